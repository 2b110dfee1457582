"""Throwaway probe (2026-12-05, ninth session): a lone batch of U offloads of T tokens on
CPU caches, each stage stamped by wrapping the engine's functions; medians of 200.

    python benchmarks/results/cpu_1205i_lone_probe.py 8 1024
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiokv
from aiokv import engine as engine_module
from aiokv import validate
from aiokv.copy import copier
from aiokv.loop import batcher, resolution
from aiokv.stores.local import completion
from aiokv.stores.local import store as local_store
from aiokv.worker import calls
from aiokv.worker import thread as worker

at: dict[str, float] = {}


def mark(stage: str) -> None:
    at.setdefault(stage, time.perf_counter())


def wrap(owner: Any, name: str, before: str | None = None, after: str | None = None) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        result = original(*args, **kwargs)
        if after:
            mark(after)
        return result

    setattr(owner, name, wrapped)


def instrument() -> None:
    wrap(batcher.Batcher, "enqueue", "enq_first")
    wrap(validate, "page_ids", "validate_first", "validated_first")
    wrap(engine_module.OffloadEngine, "_new_request", "newreq", "newreq_done")
    wrap(engine_module.OffloadEngine, "_accept", "accept", "accepted")
    wrap(batcher.Batcher, "_dispatch", "dispatch", "dispatched")
    wrap(engine_module.OffloadEngine, "_on_batch", "on_batch", "on_batch_done")
    wrap(worker.StoreWorker, "submit", "submit", "submitted")
    wrap(worker.StoreWorker, "_handle", "store_thread")
    wrap(calls.StoreCalls, "match", "match", "matched")
    wrap(local_store.LocalStore, "put_match_many", "pmm", "pmm_done")
    wrap(local_store.LocalStore, "launch", "launch", "launched")
    wrap(copier.Copier, "_move_cpu", "copy_thread", "copy_end")
    wrap(copier.Copier, "_end", "job_end")
    wrap(completion.TaskEnds, "job_done", "job_done")
    wrap(worker.StoreWorker, "_poll", "poll")
    wrap(resolution.Resolver, "deliver", "deliver")
    post = worker.StoreWorker._post

    def posted(self: Any) -> None:
        if self._outbox:
            mark("posted")
        post(self)

    worker.StoreWorker._post = posted  # type: ignore[method-assign]


async def main(users: int, tokens: int, page: int = 32) -> None:
    pages = users * tokens // page
    caches = [torch.zeros(pages * 2, 2, page, 1, 8) for _ in range(8)]
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.05, page_size=page))
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=users,
                                max_batch_tokens=users * tokens, max_pending=1024)
    rows = []
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        for repeat in range(220):
            ids = list(torch.randperm(pages * 2)[:pages].view(users, -1))
            names = [[f"r{repeat}-{u}"] for u in range(users)]
            await asyncio.sleep(0.002)
            at.clear()
            start = time.perf_counter()
            mark("args")
            coroutines = [engine.offload(u, ids[u], tokens, namespace=names[u])
                          for u in range(users)]
            mark("coros")
            gathered = asyncio.gather(*coroutines)
            mark("gathered")
            await gathered
            mark("caller")
            if repeat >= 20:
                rows.append({k: (v - start) * 1e6 for k, v in at.items()})
    stages = set.intersection(*(set(row) for row in rows))
    previous = 0.0
    for stage in sorted(stages, key=lambda s: statistics.median(r[s] for r in rows)):
        median = statistics.median(row[stage] for row in rows)
        print(f"{stage:>16} {median:8.1f} us  (+{median - previous:6.1f})")
        previous = median


if __name__ == "__main__":
    instrument()
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
