"""How long a new user's load takes while other users' offloads stream out: the load that
decides a serving step's time to first token, behind the offloads of users who left.

    python benchmarks/load_behind_offloads.py [--device cuda] [--offload-users 32]
        [--offload-tokens 2048] [--offloads 6] [--users 8] [--tokens 1024] [--repeats 5]

Per repeat: ``--offloads`` batches of offloads are submitted at once (each
``--offload-users`` x ``--offload-tokens``, fresh keys), then, once the first of them
has ended (so the rest are queued on the device), one batch of loads of ``--users``
users (offloaded and looked up beforehand). Printed: the loads' median time from submit
to the last result, next to the same loads alone, and the offload stream's own time,
from one run. The loads' bytes take the host-to-device engines, which the offloads
leave idle; what they may wait for is their page ids, which come from the device. On
``--device cpu`` a smoke run (the bytes are checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 128, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--offload-users", type=int, default=32)
    parser.add_argument("--offload-tokens", type=int, default=2048)
    parser.add_argument("--offloads", type=int, default=6)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    out_pages = args.offload_users * args.offload_tokens // PAGE
    in_pages = args.users * args.tokens // PAGE
    total_pages = out_pages + 2 * in_pages
    caches = [torch.randn(total_pages, 2, PAGE, HEADS, HEAD_DIM, device=device)
              .to(torch.bfloat16) for _ in range(LAYERS)]
    page_bytes = sum(c[0].nbytes for c in caches)
    held = (args.repeats * args.offloads * out_pages + in_pages) * page_bytes
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=1.2 * held / 1e9, page_size=PAGE))
    # One batch per --offload-users offloads: a job each, queued one behind the other.
    config = aiokv.EngineConfig(max_pending=4 * args.offloads * args.offload_users + 1024,
                                max_batch_requests=max(args.offload_users, args.users))
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    wait_pinned = getattr(store, "wait_pinned", None)
    if wait_pinned is not None:
        wait_pinned()
    per_out = args.offload_tokens // PAGE
    per_in = args.tokens // PAGE
    out_ids = [torch.arange(u * per_out, (u + 1) * per_out, device=device)
               for u in range(args.offload_users)]
    sources = [torch.arange(out_pages + u * per_in, out_pages + (u + 1) * per_in,
                            device=device) for u in range(args.users)]
    targets = [s + in_pages for s in sources]
    users = [f"reader-{u}" for u in range(args.users)]
    for future in [kv.submit_offload(users[u], sources[u], args.tokens)
                   for u in range(args.users)]:
        future.result()
    torch.cuda.synchronize() if device.type == "cuda" else None

    def load_once() -> float:
        hits = [kv.lookup(u, args.tokens) for u in users]
        try:
            start = time.perf_counter()
            for future in [kv.submit_load(h, t) for h, t in zip(hits, targets, strict=True)]:
                future.result()
            return time.perf_counter() - start
        finally:
            for hit in hits:
                hit.release()

    alone, behind, stream = [], [], []
    key = 0
    try:
        for _ in range(args.repeats):
            alone.append(load_once())
            start = time.perf_counter()
            offloads = []
            for _ in range(args.offloads):
                offloads += [kv.submit_offload(f"writer-{key + u}", out_ids[u],
                                               args.offload_tokens)
                             for u in range(args.offload_users)]
                key += args.offload_users
            offloads[0].result()
            behind.append(load_once())
            for future in offloads:
                future.result()
            stream.append(time.perf_counter() - start)
    finally:
        kv.close()
    for layer in caches:
        for s, t in zip(sources, targets, strict=True):
            if not torch.equal(layer[t], layer[s]):
                raise RuntimeError("load_behind_offloads: a load's bytes differ")
    ms = 1e3
    print(f"{args.users} x {args.tokens} loads on {device.type}, alone and behind "
          f"{args.offloads} batches of {args.offload_users} x {args.offload_tokens} "
          f"offloads ({LAYERS} layers of {HEADS} x {HEAD_DIM}, bf16, page {PAGE}), "
          f"median of {args.repeats}:")
    print(f"  loads alone            {statistics.median(alone) * ms:8.2f} ms")
    print(f"  loads behind offloads  {statistics.median(behind) * ms:8.2f} ms "
          f"(max {max(behind) * ms:.2f})")
    print(f"  the offload stream     {statistics.median(stream) * ms:8.2f} ms")


if __name__ == "__main__":
    main()
