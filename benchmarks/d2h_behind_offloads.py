"""How long a model's own small device-to-host copy takes while aiokv offloads stream out:
a decode step's sampled tokens (or logits) brought to the host, behind the offloads'
bytes on the same copy engines. ``--loads``: the other direction, a model's small
host-to-device copy (its next inputs) while aiokv loads stream in.

    python benchmarks/d2h_behind_offloads.py [--device cuda] [--users 32] [--tokens 2048]
        [--offloads 6] [--bytes 4096] [--samples 50] [--loads]

The copy engines run the device-to-host copies they were given in order, across streams
(``benchmarks/ids_wait.py`` saw a copy job's page ids wait for the whole job queued before
them). A copier may hold up to ``MAX_JOBS_IN_FLIGHT`` jobs on the device, so a stream of
offloads can put seconds' worth of bytes ahead of anything else that goes to the host.
Per repeat: ``--offloads`` batches of ``--users`` x ``--tokens`` offloads are submitted at
once; once the first has ended, the main thread times ``--samples`` copies of ``--bytes``
bytes from a device tensor into pinned memory on a stream of its own (a model's
``.cpu()`` of its next tokens), each waited for before the next. Printed: their median
and worst, next to the same copies with nothing else running, and the offload stream's
time. On ``--device cpu`` a smoke run (host memcpys; nothing queues).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 128, 32


def small_copies(source: torch.Tensor, target: torch.Tensor, stream: object,
                 samples: int) -> list[float]:
    """``samples`` copies of ``source`` into ``target``, each waited for; seconds each."""
    took = []
    for _ in range(samples):
        start = time.perf_counter()
        if source.is_cuda:
            with torch.cuda.stream(stream):  # type: ignore[arg-type]
                target.copy_(source, non_blocking=True)
            stream.synchronize()  # type: ignore[attr-defined]
        else:
            target.copy_(source)
        took.append(time.perf_counter() - start)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--offloads", type=int, default=6)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loads", action="store_true",
                        help="time host-to-device copies behind a stream of loads instead")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    per_user = args.tokens // PAGE
    pages = args.users * per_user
    caches = [torch.randn(pages, 2, PAGE, HEADS, HEAD_DIM, device=device)
              .to(torch.bfloat16) for _ in range(LAYERS)]
    page_bytes = sum(c[0].nbytes for c in caches)
    held = args.repeats * args.offloads * pages * page_bytes
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=1.2 * held / 1e9, page_size=PAGE))
    config = aiokv.EngineConfig(max_pending=4 * args.offloads * args.users + 1024,
                                max_batch_requests=args.users)  # a job per batch
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    wait_pinned = getattr(store, "wait_pinned", None)
    if wait_pinned is not None:
        wait_pinned()
    ids = [torch.arange(u * per_user, (u + 1) * per_user, device=device)
           for u in range(args.users)]
    source = torch.randint(0, 255, (args.bytes,), dtype=torch.uint8, device=device)
    target = torch.empty(args.bytes, dtype=torch.uint8, pin_memory=cuda)
    if args.loads:  # the model's copy goes the other way
        source, target = target.random_(0, 255), source
        for future in [kv.submit_offload(f"l{u}", ids[u], args.tokens)
                       for u in range(args.users)]:
            future.result()  # what the loads bring back
    held: list[Any] = []  # the loads' lookups, released at the end
    stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
    alone: list[float] = []
    behind: list[float] = []
    streams: list[float] = []
    key = 0
    try:
        for _ in range(args.repeats):
            alone += small_copies(source, target, stream, args.samples)
            start = time.perf_counter()
            futures: list[Any] = []
            for _ in range(args.offloads):
                if args.loads:  # a Lookup loads once: fresh ones per batch
                    hits = [kv.lookup(f"l{u}", args.tokens) for u in range(args.users)]
                    held += hits
                    futures += [kv.submit_load(hits[u], ids[u]) for u in range(args.users)]
                else:
                    futures += [kv.submit_offload(f"u{key + u}", ids[u], args.tokens)
                                for u in range(args.users)]
                key += args.users
            futures[0].result()
            behind += small_copies(source, target, stream, args.samples)
            for future in futures:
                future.result()
            streams.append(time.perf_counter() - start)
    finally:
        for hit in held:
            hit.release()
        kv.close()
    if not torch.equal(target.cpu(), source.cpu()):
        raise RuntimeError("d2h_behind_offloads: the small copy's bytes differ")
    ms = 1e3
    way, what = ("host-to-device", "loads") if args.loads else ("device-to-host", "offloads")
    print(f"{args.bytes}-byte {way} copies on {device.type}, alone and behind "
          f"{args.offloads} batches of {args.users} x {args.tokens} {what} ({LAYERS} layers "
          f"of {HEADS} x {HEAD_DIM}, bf16, page {PAGE}), {args.repeats} x {args.samples}:")
    print(f"  alone            median {statistics.median(alone) * ms:8.3f} ms, "
          f"max {max(alone) * ms:8.3f}")
    print(f"  behind {what:8} median {statistics.median(behind) * ms:8.3f} ms, "
          f"max {max(behind) * ms:8.3f}")
    print(f"  the {what} stream {statistics.median(streams) * ms:8.2f} ms")


if __name__ == "__main__":
    main()
