"""Throwaway probe (twenty-sixth session): where a lone load batch's control path spends
the GIL, thread by thread, sampled by py-spy; and the floor of a load queued by the
calling thread itself.

    python benchmarks/results/spy_probe_1207z.py run --device cuda [--rounds 200]
        [--tokens 1024] [--direct]
    py-spy record -r 400 --threads --gil --nonblocking -f raw -o RAW -- \
        python benchmarks/results/spy_probe_1207z.py run --device cuda --rounds 150
    python benchmarks/results/spy_probe_1207z.py split RAW --rounds 155 --rate 400

    python benchmarks/results/spy_probe_1207z.py run --device cuda --core --direct \
        --direct-streams 4    # the twenty-seventh session's: the recsys core's loads too
    python benchmarks/results/spy_probe_1207z.py split RAW --within onboard_kvcache_launch \
        --rounds N            # only stacks inside that function (any process or thread)

``run``: recsys's geometry (3 layers, 4 heads x 128, page 32, bfloat16), 8 users x
``--tokens`` offloaded once, then per round: 8 lookups and 8 loads into scattered pages
(int32 page ids on the GPU, as recsys gives them) through ``run_in_background`` (one
thread submits, then waits), timed from the first load call to the last result; beside
it a raw copy of the same bytes (one pinned buffer per layer to the device, then an
``index_copy_`` into the same pages). ``--direct``: also a benchmark-only load with none
of the engine's hops (:func:`_direct`; ``--direct-streams``: on that many streams).
``--core``: also the recsys core's loads, queued by the calling thread (aiokv.direct).
Prints medians. ``split``: GIL-holding samples per thread and per round (ms), and each
thread's functions with the most samples (self and inclusive), from py-spy's raw output
(``h100_1207z_spy_1024.raw.gz``: gunzip first).
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def run(args: argparse.Namespace) -> None:
    import torch

    import aiokv

    if args.engine_streams:
        import aiokv.copy.copier
        aiokv.copy.copier.STREAMS = args.engine_streams
    device = torch.device(args.device)
    layers, heads, dim, page, users, tokens = 3, 4, 128, 32, 8, args.tokens
    pages = tokens // page
    num_pages = 4 * users * pages
    caches = [torch.randn(num_pages, 2, page, heads, dim, device=device, dtype=torch.bfloat16)
              for _ in range(layers)]
    history = sum(c[: users * pages].nbytes for c in caches)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=max(0.05, 3 * history / 1e9),
                                               page_size=page))
    config = aiokv.EngineConfig(window_us=0)
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    sources = [order[u * pages:(u + 1) * pages].to(device) for u in range(users)]
    targets = [order[(users + u) * pages:(users + u + 1) * pages].to(device, torch.int32)
               for u in range(users)]
    for f in [kv.submit_offload(u, sources[u], tokens) for u in range(users)]:
        f.result()
    # The raw reference: the same bytes from one pinned buffer into the same pages.
    pinned = [torch.empty(users * pages, 2, page, heads, dim, dtype=torch.bfloat16,
                          pin_memory=device.type == "cuda") for _ in range(layers)]
    flat = torch.cat(targets).long()
    lookup_ms: list[float] = []
    load_ms: list[float] = []
    raw_ms: list[float] = []
    direct_ms: list[float] = []
    direct = (_direct(store, layers, args.direct_streams)
              if args.direct and device.type == "cuda" else None)
    core_ms: list[float] = []
    core = None
    if args.core:  # the recsys core's loads: queued by this thread (aiokv.direct)
        from aiokv.integrations.recsys_core import RecsysCore
        core = RecsysCore(kv)

    def _rounds() -> None:  # the only main-thread frames the split counts
        for r in range(args.rounds + 5):
            t0 = time.perf_counter()
            hits = [f.result() for f in [kv.submit_lookup(u, tokens) for u in range(users)]]
            t1 = time.perf_counter()
            futures = [kv.submit_load(hits[u], targets[u]) for u in range(users)]
            got = [f.result() for f in futures]
            t2 = time.perf_counter()
            if any(g.loaded_tokens != tokens for g in got):
                raise RuntimeError(f"loaded {[g.loaded_tokens for g in got]}")
            if device.type == "cuda":
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                for layer, src in zip(caches, pinned, strict=True):
                    layer.index_copy_(0, flat.to(device), src.to(device, non_blocking=True))
                torch.cuda.synchronize()
                raw = time.perf_counter() - t3
            else:
                raw = 0.0
            if direct is not None:  # the floor of a load queued by the caller's thread
                hits = [f.result() for f in [kv.submit_lookup(u, tokens) for u in range(users)]]
                torch.cuda.synchronize()
                t4 = time.perf_counter()
                direct(hits, targets)
                direct_ms.append((time.perf_counter() - t4) * 1e3)
                for hit in hits:
                    hit.release()
            if core is not None:
                hits = core.lookup(list(range(users)), [tokens] * users)
                torch.cuda.synchronize() if device.type == "cuda" else None
                t5 = time.perf_counter()
                done = core.load(hits, targets).outcomes()
                core_ms.append((time.perf_counter() - t5) * 1e3)
                if any(getattr(d, "loaded_tokens", None) != tokens for d in done):
                    raise RuntimeError(f"core loaded {done}")
            if r >= 5:
                lookup_ms.append((t1 - t0) * 1e3)
                load_ms.append((t2 - t1) * 1e3)
                raw_ms.append(raw * 1e3)

    try:
        _rounds()
        for u in range(users):  # the bytes, once at the end (restore the offloaded ones)
            for f in [kv.submit_lookup(u, tokens)]:
                hit = f.result()
                kv.load(hit, targets[u])
            for layer in caches:
                if not torch.equal(layer[targets[u].long()], layer[sources[u]]):
                    raise RuntimeError("bytes differ")
    finally:
        kv.close()
    med = statistics.median
    print(f"{users} x {tokens}, {layers} layers, {device.type}, median of {args.rounds}: "
          f"lookups {med(lookup_ms):.3f} ms, loads {med(load_ms):.3f} ms, "
          f"raw copy {med(raw_ms):.3f} ms"
          + (f", direct {med(direct_ms[5:]):.3f} ms" if direct_ms else "")
          + (f", core (caller-queued) loads {med(core_ms[5:]):.3f} ms" if core_ms else ""))


def _direct(store: object, layers: int, streams: int = 1
            ) -> Callable[[list[object], list[object]], None]:
    """A benchmark-only load, in the calling thread, with none of the engine's hops: the
    held reservations' host blocks read out of the store (unsafe anywhere else), the page
    ids fetched to the host (one device-to-host copy), planned and queued on one stream
    by the copy plane's own code, waited for."""
    import numpy as np
    import torch

    from aiokv.copy.driver import CU_EVENT_BLOCKING_SYNC, CU_EVENT_DISABLE_TIMING, EventPool
    from aiokv.copy.plan import plan
    from aiokv.copy.queueing import Entries, Queuer

    copier = store._require_jobs()._in  # type: ignore[attr-defined]
    copy_streams = [torch.cuda.Stream() for _ in range(streams)]
    queuer = Queuer(Entries.of_driver(), [s.cuda_stream for s in copy_streams])
    ends = EventPool(CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC).take(streams)

    def load(hits: list[object], targets: list[object]) -> None:
        ids = torch.cat(targets).cpu().numpy().astype(np.int64)  # type: ignore[call-overload]
        tasks = store._tasks  # type: ignore[attr-defined]
        blocks = np.concatenate([tasks[h.lookup._reservation.task_id].blocks  # type: ignore[attr-defined]
                                 for h in hits])
        copies = plan(copier._geometry, ids, blocks, False, streams,
                      chunk_starts=copier._chunk_starts)
        prepared = queuer.prepare(copies, layers, 0, None,
                                  [e.handle for e in ends[: copies.streams]])
        queuer.queue(prepared, 0, layers, wait_ready=False, end=True)
        for end in ends[: copies.streams]:
            end.synchronize()

    return load


_FRAME = re.compile(r"^(.*) \((.*?):(\d+)\)$")


def split(args: argparse.Namespace) -> None:
    per_thread: collections.Counter[str] = collections.Counter()
    self_fn: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl_fn: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    names_by_tid: dict[str, str] = {}
    lines = [line.rpartition(" ") for line in Path(args.raw).read_text().splitlines()]
    for stack, _, _ in lines:
        head = stack.split(";", 1)[0]
        if ": " in head:
            tid, name = head.split(": ", 1)
            names_by_tid[tid] = name
    for stack, _, count_s in lines:
        if not stack:
            continue
        if not count_s.isdigit():
            continue  # a stack py-spy could not read whole
        count = int(count_s)
        head, *frames = stack.split(";")
        tid = head.split(": ", 1)[0]
        thread = names_by_tid.get(tid, tid)
        if args.within:  # only the stacks inside that function, whichever the thread
            if not any(args.within in f for f in frames):
                continue
        elif thread == "MainThread" and not any("_rounds" in f for f in frames):
            continue  # the probe's setup (imports, caches): not a round's
        names = [_FRAME.sub(r"\1 (\2)", f) for f in frames if f]
        per_thread[thread] += count
        if names:
            self_fn[thread][names[-1]] += count
        for n in set(names):
            incl_fn[thread][n] += count
    ms = 1e3 / args.rate / args.rounds
    print(f"GIL-holding samples per round (ms at {args.rate} Hz over {args.rounds} rounds):")
    for thread, n in per_thread.most_common(12):
        print(f"  {n * ms:8.3f}  {thread}")
    for thread, _ in per_thread.most_common(5):
        print(f"\n{thread}: self (ms/round)")
        for fn, n in self_fn[thread].most_common(args.top):
            print(f"  {n * ms:8.3f}  {fn}")
        print(f"{thread}: inclusive (ms/round)")
        for fn, n in incl_fn[thread].most_common(args.top * 2):
            print(f"  {n * ms:8.3f}  {fn}")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--device", default="cpu")
    r.add_argument("--rounds", type=int, default=400)
    r.add_argument("--tokens", type=int, default=1024)
    r.add_argument("--direct", action="store_true", help="also the caller-thread floor")
    r.add_argument("--direct-streams", type=int, default=1, help="the floor's copy streams")
    r.add_argument("--core", action="store_true",
                   help="also the recsys core's loads (queued by the calling thread)")
    r.add_argument("--engine-streams", type=int, default=0,
                   help="the engine copier's streams (0: aiokv.copy.copier.STREAMS)")
    s = sub.add_parser("split")
    s.add_argument("raw")
    s.add_argument("--rounds", type=int, default=400)
    s.add_argument("--rate", type=int, default=2000)
    s.add_argument("--top", type=int, default=12)
    s.add_argument("--within", default="",
                   help="count only stacks with a frame naming this (a function's name)")
    args = parser.parse_args()
    run(args) if args.mode == "run" else split(args)


if __name__ == "__main__":
    main()
