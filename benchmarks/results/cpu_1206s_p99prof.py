"""Throwaway probe (eighteenth session): yappi's CPU time per thread while host-tier loads
run beside offloads whose blocks also go to Mooncake, against an engine without a remote
tier. Needs ``pip install yappi``; run from /tmp with PYTHONPATH=<clone>; it imports
benchmarks/remote_tier.py from /work/main/benchmarks."""

import asyncio
import sys
import threading

sys.path.insert(0, "/work/main/benchmarks")
import remote_tier as rt
import torch
import yappi

import aiokv
from aiokv.remote.servers import MooncakeServers


async def run(remote: str | None, seconds: float) -> None:
    pages = 16
    caches = rt.make_caches(3 * pages, False)
    store = aiokv.LocalStore(rt.store_config(remote, 1.0))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        store.wait_pinned()
        resident = range(10_000, 10_004)
        for user in resident:
            await engine.offload(user, torch.arange(pages), pages * engine.page_size)
        writers = range(500_000, 504_096)
        yappi.set_clock_type("cpu")
        yappi.clear_stats()
        yappi.start()
        lat = await rt.host_latency(engine, resident, pages, writers, seconds)
        yappi.stop()
        lat.sort()
        print(remote is not None, len(lat), "p50", lat[len(lat) // 2],
              "p99", lat[int(0.99 * (len(lat) - 1))])
        names = {t.ident: t.name for t in threading.enumerate()}
        for t in yappi.get_thread_stats():
            print(f"  thread {names.get(t.tid, '?')}: cpu {t.ttot:.3f} s")
        for t in yappi.get_thread_stats():
            name = names.get(t.tid, "?")
            if name.startswith(("aiokv-store", "aiokv-remote-write", "MainThread")):
                stats = yappi.get_func_stats(ctx_id=t.id)
                stats.sort("tsub")
                print(f"  -- {name} top tsub")
                for f in list(stats)[:12]:
                    print(f"     {f.tsub * 1e3:8.1f} ms  {f.ncall:7d}  "
                          f"{f.module.split('/')[-1]}:{f.name}")
        if remote:
            await engine.clear()


async def main() -> None:
    with MooncakeServers(segment_mb=2048, lease_ms=2000) as servers:
        await run(None, 4)
        await run(servers.master, 4)


asyncio.run(main())
