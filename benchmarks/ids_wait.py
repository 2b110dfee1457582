"""Whether a copy job's page ids wait behind the job before it: offloads against loads.

    python benchmarks/ids_wait.py [--device cuda] [--users 8] [--tokens 1024] [--batches 8]
        [--heads 4] [--head-dim 128] [--page 32]

A hypothesis for why offloads are the weaker direction in a steady stream (issue 34): a
job's device page ids come to the host through the device-to-host copy engines, which an
offload stream keeps busy with the job before it, so the next job's plan starts only
once those copies are done and the engines idle meanwhile; a load's ids take engines
that its copies do not use. This probe submits ``--batches`` batches of offloads at once
through ``run_in_background`` (then the same of loads), stamps each copy job's page-id
fetch (start, on the host) and its report (after its end events), and prints per
direction the median wait for the ids and how many jobs, among those whose predecessor
was still running when they asked, got their ids only once that predecessor had ended.
Stamps come from wrapping two copier functions (no change to the code under test). On
``--device cpu`` the copier fetches no ids: a smoke run of the rest (the bytes are checked).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv.copy import copier

LAYERS = 8
stamps: dict[int, dict[str, float]] = {}  # id(job) -> stage -> time
order: list[int] = []  # jobs in the order the copy thread took them


def instrument() -> None:
    host_ids: Callable[..., Any] = copier.Copier._host_ids
    end: Callable[..., Any] = copier.Copier._end

    def timed_host_ids(self: Any, job: Any, *args: Any) -> Any:
        key = id(job)
        order.append(key)
        stamps[key] = {"ids_start": time.perf_counter()}
        result = host_ids(self, job, *args)
        stamps[key]["ids_done"] = time.perf_counter()
        return result

    def timed_end(self: Any, job: Any) -> None:
        stamps.setdefault(id(job), {})["reported"] = time.perf_counter()
        end(self, job)

    copier.Copier._host_ids = timed_host_ids  # type: ignore[method-assign]
    copier.Copier._end = timed_end  # type: ignore[method-assign]


def summary(kind: str, jobs: list[int]) -> None:
    if not jobs:  # CPU caches: the copier moves them without fetching ids
        print(f"  {kind:8} no page ids fetched (CPU caches): nothing to measure")
        return
    waits = [(stamps[j]["ids_done"] - stamps[j]["ids_start"]) * 1e3 for j in jobs]
    busy = behind = 0
    for before, job in itertools.pairwise(jobs):
        ended = stamps[before].get("reported", float("inf"))
        if ended > stamps[job]["ids_start"]:  # its predecessor was still running
            busy += 1
            behind += stamps[job]["ids_done"] >= ended
    print(f"  {kind:8} jobs {len(jobs):3}  ids wait median {statistics.median(waits):6.3f} ms, "
          f"max {max(waits):6.3f} ms;  ids only after the job before ended: {behind} of "
          f"{busy} whose job before was running")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=32, help="tokens per page")
    args = parser.parse_args()
    device = torch.device(args.device)
    pages = args.tokens // args.page
    users = args.users * args.batches
    caches = [torch.randn(2 * users * pages, 2, args.page, args.heads, args.head_dim,
                          device=device) for _ in range(LAYERS)]
    history = sum(c[: users * pages].nbytes for c in caches)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=max(0.05, 1.5 * history / 1e9),
                                               page_size=args.page))
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=args.users,
                                max_batch_tokens=args.users * args.tokens,
                                max_pending=max(4 * users, 1024))
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, config))
    wait_pinned = getattr(store, "wait_pinned", None)
    if wait_pinned is not None:
        wait_pinned()
    sources = [torch.arange(u * pages, (u + 1) * pages, device=device) for u in range(users)]
    targets = [s + users * pages for s in sources]
    instrument()
    try:
        print(f"{args.batches} batches of {args.users} x {args.tokens} tokens each way on "
              f"{device.type}, {LAYERS} layers of {args.heads} x {args.head_dim}, page "
              f"{args.page}:")
        first = len(order)
        for future in [kv.submit_offload(u, sources[u], args.tokens) for u in range(users)]:
            future.result()
        offloads = order[first:]
        hits = [f.result() for f in [kv.submit_lookup(u, args.tokens) for u in range(users)]]
        first = len(order)
        for future in [kv.submit_load(hits[u], targets[u]) for u in range(users)]:
            future.result()
        loads = order[first:]
    finally:
        kv.close()
    for layer in caches:
        for s, t in zip(sources, targets, strict=True):
            if not torch.equal(layer[t], layer[s]):
                raise RuntimeError("ids_wait: a load's bytes differ from the offload's")
    summary("offload", offloads)
    summary("load", loads)


if __name__ == "__main__":
    main()
