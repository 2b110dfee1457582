"""Where a layerwise load's first milliseconds go, hop by hop, as a model thread calls it;
with ``--offload``, where a batch of offloads' time goes, from the first call to the last
result.

    python benchmarks/hops.py [--device cpu|cuda] [--users 4] [--tokens 64] [--repeats 30]
        [--heads 2] [--head-dim 64] [--page 16] [--dtype float32] [--scattered] [--host-ids]
        [--offload]

The calls go through ``run_in_background`` (``submit_load_layerwise`` per user, then
``wait_layer(0)`` on each), the path of ``aiokv bench layers``. Each stage is stamped
by wrapping the engine's functions (no change to the code under test; a wrapper costs
about a microsecond) and printed as the median ms from the first call over ``--repeats``
rounds: the loop takes the calls (enqueue), the store thread takes the batch, the launch
returns, the copy thread starts the job, layer 0 is marked, the launch notice leaves the
store thread and reaches the loop, the caller holds its loads, and layer 0 is waited for.

An offload batch (fresh keys each round, the host tier three batches large, so that from
the fourth round on each batch evicts one) is stamped where its matches start and end
(``put_match_many``; where puts are matched one by one, the first and the last
``put_match``), the launch returns, the copy thread takes the job, has its
page ids on the host, has planned and queued it, the copies end (the job is reported),
the store's poll sees the tasks end, and the caller has every result; ``copies`` is the
GiB/s of the bytes over the time from queued to reported, ``whole`` over the time from
the first call to the last result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv import layerwise
from aiokv.copy import copier
from aiokv.copy import marks as layer_marks
from aiokv.loop import batcher
from aiokv.stores.local import store as local_store
from aiokv.worker import thread as worker

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16

at: dict[str, float] = {}


def mark(stage: str) -> None:
    at.setdefault(stage, time.perf_counter())


def mark_last(stage: str) -> None:
    at[stage] = time.perf_counter()


def wrap(owner: Any, name: str, before: str | None, after: str | None = None,
         last: str | None = None) -> None:
    """Stamp ``before`` the first call, ``after`` the first return, ``last`` every return
    (the last one stays)."""
    original: Callable[..., Any] | None = getattr(owner, name, None)
    if original is None:  # an older tree's store, without this method
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        result = original(*args, **kwargs)
        if after:
            mark(after)
        if last:
            mark_last(last)
        return result

    setattr(owner, name, wrapped)


def instrument() -> None:
    wrap(batcher.Batcher, "enqueue", "loop_enqueue")
    wrap(worker.StoreWorker, "_handle", "store_thread")
    wrap(local_store.LocalStore, "launch", None, "launched")
    wrap(copier.Copier, "_move_cpu", "copy_thread")
    wrap(copier.Copier, "_queue_driver", "copy_thread")
    wrap(copier.Copier, "_host_ids", None, "ids_on_host")
    wrap(copier, "plan", None, "planned")
    wrap(layer_marks.LayerMarks, "layer_done", None, "layer0_marked")
    wrap(layer_marks.LayerMarks, "layer_queued", None, "layer0_marked")
    wrap(layerwise, "note_launches", "notice_sent")
    wrap(layerwise, "_deliver", "notice_on_loop")
    wrap(copier.Copier, "_end", "job_reported")


def instrument_offload() -> None:
    wrap(batcher.Batcher, "enqueue", "loop_enqueue")
    wrap(worker.StoreWorker, "_handle", "store_thread")
    wrap(local_store.LocalStore, "put_match_many", "matching", "matched")
    wrap(local_store.LocalStore, "put_match", "put_match_first", "put_match_first_done",
         last="put_match_last_done")  # one by one: a store without the batch's match
    wrap(local_store.LocalStore, "launch", None, "launched")
    wrap(copier.Copier, "_queue_driver", "copy_thread", "queued")
    wrap(copier.Copier, "_move_cpu", "copy_thread", "queued")
    wrap(copier.Copier, "_host_ids", None, "ids_on_host")
    wrap(copier, "plan", None, "planned")
    wrap(copier.Copier, "_end", "job_reported")

    original = local_store.LocalStore.try_wait

    def try_wait(self: Any, task_ids: Any) -> Any:
        answers = original(self, task_ids)
        if answers:
            mark_last("store_polled_end")
        return answers

    local_store.LocalStore.try_wait = try_wait  # type: ignore[method-assign]


def offloads(args: argparse.Namespace, device: torch.device, caches: list[torch.Tensor],
             num_pages: int, pages: int) -> None:
    batch_bytes = sum(c[: args.users * pages].nbytes for c in caches)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=3 * batch_bytes / 2**30,
                                               page_size=args.page))
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=args.users,
                                max_batch_tokens=args.users * args.tokens,
                                max_pending=max(4 * args.users, 1024))
    instrument_offload()  # first: the engine takes the store's methods as it starts
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    generator = torch.Generator().manual_seed(0)
    where = torch.device("cpu") if args.host_ids else device

    def scatter() -> list[torch.Tensor]:
        if not args.scattered:
            return [torch.arange(u * pages, (u + 1) * pages, device=where)
                    for u in range(args.users)]
        order = torch.randperm(num_pages, generator=generator)[: args.users * pages]
        return list(order.to(where).view(args.users, pages))

    wait_pinned = getattr(store, "wait_pinned", None)
    rows: list[dict[str, float]] = []
    try:
        if wait_pinned is not None:
            wait_pinned()
        for repeat in range(args.repeats + 3):  # 3 warm up (and fill the host tier)
            sources = scatter()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            at.clear()
            start = time.perf_counter()
            futures = [kv.submit_offload(u, sources[u], args.tokens, namespace=[f"o{repeat}-{u}"])
                       for u in range(args.users)]
            stored = [f.result() for f in futures]
            mark("results_back")
            if any(r.stored_tokens != pages * args.page for r in stored):
                raise RuntimeError(f"hops: offloads stored {[r.stored_tokens for r in stored]}")
            if repeat >= 3:
                rows.append({stage: (t - start) * 1e3 for stage, t in at.items()})
    finally:
        kv.close()
    stages = set.intersection(*(set(row) for row in rows))
    medians = {s: statistics.median(row[s] for row in rows) for s in stages}
    print(f"{args.users} x {args.tokens} offloads on {device.type}, {len(caches)} layers, "
          f"{batch_bytes / 2**20:.0f} MiB, median of {args.repeats}, ms from the first call:")
    for stage, ms in sorted(medians.items(), key=lambda item: item[1]):
        print(f"  {stage:>22}  {ms:7.3f}")
    # From the plan (the first copies are queued right after it; "queued" is when the
    # last layer was, which a paced offload reaches late) to the job's end.
    copy_ms = statistics.median(r["job_reported"] - r.get("planned", r["copy_thread"])
                                for r in rows)
    whole_ms = statistics.median(r["results_back"] for r in rows)
    print(f"  copies {batch_bytes / 2**30 / copy_ms * 1e3:.1f} GiB/s (planned to reported), "
          f"whole {batch_bytes / 2**30 / whole_ms * 1e3:.1f} GiB/s (first call to last "
          f"result): {copy_ms / whole_ms:.0%} of the time is the copies")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--page", type=int, default=PAGE, help="tokens per page")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--scattered", action="store_true",
                        help="pages at random, as aiokv bench layers places them")
    parser.add_argument("--host-ids", action="store_true",
                        help="the page ids as CPU tensors (no copy of them to the host)")
    parser.add_argument("--offload", action="store_true",
                        help="a batch of offloads, first call to last result")
    parser.add_argument("--switch-interval-us", type=int, default=0,
                        help="sys.setswitchinterval (0: Python's 5 ms)")
    args = parser.parse_args()
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    device = torch.device(args.device)
    pages = args.tokens // args.page
    num_pages = 2 * args.users * pages
    caches = [torch.randn(num_pages, 2, args.page, args.heads, args.head_dim, device=device,
                          dtype=getattr(torch, args.dtype)) for _ in range(args.layers)]
    if args.offload:
        offloads(args, device, caches, num_pages, pages)
        return
    # Room for every user's history twice over: a lookup that lost blocks to eviction
    # would load fewer pages than were offloaded.
    history = sum(c[: args.users * pages].nbytes for c in caches)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=max(0.05, 2 * history / 1e9),
                                               page_size=args.page))
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=args.users,
                                max_batch_tokens=args.users * args.tokens)
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    sources = [torch.arange(u * pages, (u + 1) * pages, device=device) for u in range(args.users)]
    targets = [t + num_pages // 2 for t in sources]
    if args.scattered:
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).to(device)
        sources = [order[u * pages : (u + 1) * pages] for u in range(args.users)]
        targets = [order[(args.users + u) * pages : (args.users + u + 1) * pages]
                   for u in range(args.users)]
    if args.host_ids:
        targets = [t.cpu() for t in targets]
    for future in [kv.submit_offload(u, sources[u], args.tokens) for u in range(args.users)]:
        future.result()
    instrument()
    rows: list[dict[str, float]] = []
    try:
        for repeat in range(args.repeats + 1):  # 0 warms up
            hits = [f.result() for f in [kv.submit_lookup(u, args.tokens)
                                         for u in range(args.users)]]
            if any(hit.cached_tokens != args.tokens for hit in hits):
                raise RuntimeError(f"hops: lookups found {[h.cached_tokens for h in hits]} tokens "
                                   f"of {args.tokens}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            at.clear()
            start = time.perf_counter()
            futures = [kv.submit_load_layerwise(hits[u], targets[u]) for u in range(args.users)]
            loads = [f.result() for f in futures]
            mark("caller_has_loads")
            for load in loads:
                load.wait_layer(0)
            if device.type == "cuda":  # this stream only: the later layers may still copy
                torch.cuda.current_stream(device).synchronize()
            mark("layer0_waited")
            for load in loads:
                load.result()
            mark("results_back")
            for layer in caches:
                for s, t in zip(sources, targets, strict=True):
                    if not torch.equal(layer[t], layer[s]):
                        raise RuntimeError("hops: a load's bytes differ from the offload's")
            if repeat:
                rows.append({stage: (t - start) * 1e3 for stage, t in at.items()})
    finally:
        kv.close()
    stages = set.intersection(*(set(row) for row in rows))
    medians = {s: statistics.median(row[s] for row in rows) for s in stages}
    print(f"{args.users} x {args.tokens} layerwise loads on {device.type}, {len(caches)} layers, "
          f"median of {args.repeats}, ms from the first call:")
    for stage, ms in sorted(medians.items(), key=lambda item: item[1]):
        print(f"  {stage:>18}  {ms:7.3f}")


if __name__ == "__main__":
    main()
