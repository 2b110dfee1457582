"""Throwaway probe (2026-12-05, ninth session): a lone batch of U offloads of T tokens on
CPU caches, each stage stamped by wrapping the engine's functions; medians of 200.
    python benchmarks/results/cpu_1205i_lone_probe.py 8 1024
"""
import asyncio, statistics, sys, time
import torch
sys.path.insert(0, "/work/main")
import aiokv
from aiokv.loop import batcher, resolution
from aiokv.worker import thread as worker, calls
from aiokv.stores.local import store as local_store, completion
from aiokv.copy import copier
at = {}
def mark(s): at.setdefault(s, time.perf_counter())
def wrap(owner, name, before=None, after=None):
    orig = getattr(owner, name)
    def w(*a, **k):
        if before: mark(before)
        r = orig(*a, **k)
        if after: mark(after)
        return r
    setattr(owner, name, w)
wrap(batcher.Batcher, "enqueue", "enq_first")
from aiokv import validate, engine as E
wrap(validate, "page_ids", "validate_first", "validated_first")
wrap(E.OffloadEngine, "_new_request", "newreq", "newreq_done")
wrap(E.OffloadEngine, "_accept", "accept", "accepted")

wrap(batcher.Batcher, "_dispatch", "dispatch", "dispatched")
from aiokv import stats as S
wrap(S.EngineStatsRecorder if hasattr(S, "EngineStatsRecorder") else E.OffloadEngine, "_on_batch", "on_batch", "on_batch_done")
wrap(worker.StoreWorker, "submit", "submit", "submitted")
wrap(worker.StoreWorker, "_handle", "store_thread")
wrap(calls.StoreCalls, "match", "match", "matched")
import cProfile, pstats
PR = cProfile.Profile()
_pmm = local_store.LocalStore.put_match_many
def pmm(self, q):
    mark("pmm")
    try:
        return _pmm(self, q)
    finally:
        mark("pmm_done")
local_store.LocalStore.put_match_many = pmm
wrap(local_store.LocalStore, "launch", "launch", "launched")
wrap(copier.Copier, "_move_cpu", "copy_thread", "copy_end")
wrap(copier.Copier, "_end", "job_end")
wrap(completion.TaskEnds, "job_done", "job_done")
wrap(worker.StoreWorker, "_poll", "poll")
op = worker.StoreWorker._post
def post(self):
    if self._outbox: mark("posted")
    op(self)
worker.StoreWorker._post = post
wrap(resolution.Resolver, "deliver", "deliver")
U, T, P = int(sys.argv[1]), int(sys.argv[2]), 32
async def main():
    pages = U * T // P
    caches = [torch.zeros(pages * 2, 2, P, 1, 8) for _ in range(8)]
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.05, page_size=P))
    cfg = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=U, max_batch_tokens=U*T, max_pending=1024)
    rows = []
    async with aiokv.OffloadEngine(store, caches, cfg) as eng:
        for r in range(220):
            ids = torch.randperm(pages * 2)[: pages].view(U, -1)
            await asyncio.sleep(0.002)
            at.clear()
            t0 = time.perf_counter()
            rows_ids = list(ids); nss = [[f"r{r}-{u}"] for u in range(U)]
            mark("args")
            coros = [eng.offload(u, rows_ids[u], T, namespace=nss[u]) for u in range(U)]
            mark("coros")
            fut = asyncio.gather(*coros)
            mark("gathered")
            res = await fut
            mark("caller")
            if r >= 20: rows.append({k: (v - t0) * 1e6 for k, v in at.items()})
    keys = sorted(set.intersection(*(set(x) for x in rows)), key=lambda k: statistics.median(x[k] for x in rows))
    prev = 0
    for k in keys:
        m = statistics.median(x[k] for x in rows); print(f"{k:>14} {m:8.1f} us  (+{m-prev:6.1f})"); prev = m
asyncio.run(main())

