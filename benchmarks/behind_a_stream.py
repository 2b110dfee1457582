"""What waits behind a stream of other users' transfers on the copy engines: a new user's
load (the one that decides a serving step's time to first token), or a model's own small
copy (its next tokens to the host, its next inputs to the device).

    python benchmarks/behind_a_stream.py [--probe load|copy] [--stream offloads|loads]
        [--device cuda] [--stream-users 32] [--stream-tokens 2048] [--batches 6]
        [--users 8] [--tokens 1024] [--bytes 4096] [--samples 20] [--repeats 5]

The copy engines run the copies of one direction in the order they were given, across
streams (``benchmarks/ids_wait.py`` saw a copy job's page ids wait for the whole job
queued before them), and a copier may hold ``MAX_JOBS_IN_FLIGHT`` jobs on the device.
Per repeat: the probe alone; then ``--batches`` batches of ``--stream-users`` x
``--stream-tokens`` transfers (fresh keys for offloads, the same users' histories for
loads) are submitted at once, and once the first batch has ended (the rest queued on the
device) the probe again; then the rest of the stream. The probes:

- ``load``: ``--users`` x ``--tokens`` loads of users offloaded beforehand (their bytes
  take the host-to-device engines; behind offloads, what they may wait for is their page
  ids, which come from the device), submit to the last result;
- ``copy``: ``--samples`` copies of ``--bytes`` bytes on a stream of the main thread's
  own, in the stream's direction (device to pinned host behind offloads, back behind
  loads), each waited for before the next.

Printed: the probe's median and worst alone and behind the stream, and the stream's own
time, from one run; the bytes are checked. On ``--device cpu`` a smoke run.
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

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 128, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", choices=("load", "copy"), default="load")
    parser.add_argument("--stream", choices=("offloads", "loads"), default="offloads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stream-users", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--users", type=int, default=8, help="the load probe's")
    parser.add_argument("--tokens", type=int, default=1024, help="the load probe's")
    parser.add_argument("--bytes", type=int, default=4096, help="the copy probe's")
    parser.add_argument("--samples", type=int, default=20, help="the copy probe's")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    per_stream, per_probe = args.stream_tokens // PAGE, args.tokens // PAGE
    stream_pages, probe_pages = args.stream_users * per_stream, args.users * per_probe
    caches = [torch.randn(stream_pages + 2 * probe_pages, 2, PAGE, HEADS, HEAD_DIM,
                          device=device).to(torch.bfloat16) for _ in range(LAYERS)]
    page_bytes = sum(c[0].nbytes for c in caches)
    held = (args.repeats * args.batches * stream_pages + probe_pages) * page_bytes
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=1.2 * held / 1e9, page_size=PAGE))
    # A batch per --stream-users transfers: a job each, queued one behind the other.
    config = aiokv.EngineConfig(max_pending=4 * args.batches * args.stream_users + 1024,
                                max_batch_requests=max(args.stream_users, args.users))
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    wait_pinned = getattr(store, "wait_pinned", None)
    if wait_pinned is not None:
        wait_pinned()

    def pages(first: int, count: int, per: int) -> list[torch.Tensor]:
        return [torch.arange(first + u * per, first + (u + 1) * per, device=device)
                for u in range(count)]

    def wait_all(futures: list[Any]) -> None:
        for future in futures:
            future.result()

    stream_ids = pages(0, args.stream_users, per_stream)
    sources = pages(stream_pages, args.users, per_probe)
    targets = [s + probe_pages for s in sources]
    readers = [f"reader-{u}" for u in range(args.users)]
    wait_all([kv.submit_offload(r, s, args.tokens) for r, s in zip(readers, sources,
                                                                     strict=True)])
    if args.stream == "loads":  # what the stream loads back, again and again
        wait_all([kv.submit_offload(f"stream-{u}", ids, args.stream_tokens)
                  for u, ids in enumerate(stream_ids)])
    lookups: list[Any] = []  # released once their loads ended

    def release() -> None:
        while lookups:
            lookups.pop().release()

    def load_probe() -> list[float]:
        hits = [kv.lookup(r, args.tokens) for r in readers]
        lookups.extend(hits)
        start = time.perf_counter()
        wait_all([kv.submit_load(h, t) for h, t in zip(hits, targets, strict=True)])
        took = time.perf_counter() - start
        for hit in hits:
            hit.release()
        return [took]

    device_bytes = torch.randint(0, 255, (args.bytes,), dtype=torch.uint8, device=device)
    host_bytes = torch.randint(0, 255, (args.bytes,), dtype=torch.uint8)
    if cuda:
        host_bytes = host_bytes.pin_memory()
    if args.stream == "offloads":
        source, target = device_bytes, torch.empty_like(host_bytes)
    else:
        source, target = host_bytes, torch.empty_like(device_bytes)
    copy_stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]

    def copy_probe() -> list[float]:
        took = []
        for _ in range(args.samples):
            start = time.perf_counter()
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    target.copy_(source, non_blocking=True)
                copy_stream.synchronize()
            else:
                target.copy_(source)
            took.append(time.perf_counter() - start)
        return took

    probe: Callable[[], list[float]] = load_probe if args.probe == "load" else copy_probe

    def stream_batch(batch: int) -> list[Any]:
        if args.stream == "loads":  # a Lookup loads once: fresh ones per batch
            hits = [kv.lookup(f"stream-{u}", args.stream_tokens)
                    for u in range(args.stream_users)]
            lookups.extend(hits)
            return [kv.submit_load(h, ids) for h, ids in zip(hits, stream_ids, strict=True)]
        return [kv.submit_offload(f"writer-{batch}-{u}", ids, args.stream_tokens)
                for u, ids in enumerate(stream_ids)]

    alone: list[float] = []
    behind: list[float] = []
    streams: list[float] = []
    batch = 0
    try:
        for _ in range(args.repeats):
            alone += probe()
            start = time.perf_counter()
            futures: list[Any] = []
            for _ in range(args.batches):
                futures += stream_batch(batch)
                batch += 1
            futures[0].result()
            behind += probe()
            wait_all(futures)
            streams.append(time.perf_counter() - start)
            release()
    finally:
        release()
        kv.close()
    if args.probe == "load":
        for layer in caches:
            for s, t in zip(sources, targets, strict=True):
                if not torch.equal(layer[t], layer[s]):
                    raise RuntimeError("behind_a_stream: a load's bytes differ")
    elif not torch.equal(target.cpu(), source.cpu()):
        raise RuntimeError("behind_a_stream: the small copy's bytes differ")
    way = "to the host" if args.stream == "offloads" else "to the device"
    what = (f"{args.users} x {args.tokens} loads" if args.probe == "load"
            else f"{args.bytes}-byte copies {way}")
    print(f"{what} on {device.type}, alone and behind {args.batches} batches of "
          f"{args.stream_users} x {args.stream_tokens} {args.stream} ({LAYERS} layers of "
          f"{HEADS} x {HEAD_DIM}, bf16, page {PAGE}), {args.repeats} repeats:")
    ms = 1e3
    for name, times in (("alone", alone), (f"behind {args.stream}", behind)):
        print(f"  {name:16} median {statistics.median(times) * ms:8.3f} ms, "
              f"max {max(times) * ms:8.3f}")
    print(f"  the {args.stream} stream {statistics.median(streams) * ms:8.2f} ms (median)")


if __name__ == "__main__":
    main()
