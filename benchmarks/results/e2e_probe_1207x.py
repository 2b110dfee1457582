"""Where a remote hit's lookup + load time goes: lookup (with the remote read) vs load."""

import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
sys.path.insert(0, os.getcwd())
import remote_tier as rt
import torch

import aiokv
from aiokv.remote.servers import MooncakeServers

rt.DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"


async def main():
    with MooncakeServers(segment_mb=2048, lease_ms=2000) as servers:
        pages = 16
        ca = rt.make_caches(pages, False)
        cb = rt.make_caches(pages, False)
        sa = aiokv.LocalStore(rt.store_config(servers.master, 1.0))
        sb = aiokv.LocalStore(rt.store_config(servers.master, 1.0))
        async with (
            aiokv.OffloadEngine(sa, ca, aiokv.EngineConfig()) as ea,
            aiokv.OffloadEngine(sb, cb, aiokv.EngineConfig()) as eb,
        ):
            ps = ea.page_size
            users = range(40)
            await asyncio.gather(*(ea.offload(u, torch.arange(pages), pages * ps) for u in users))
            await rt.until(lambda: sa.store_stats()["remote_blocks_written"] >= 40 * pages)
            await rt.until(lambda: rt.remote_of(sb).io.client() is not None)
            lk, ld, rd = [], [], []
            target = torch.arange(pages)
            for u in users:
                r0 = sb.store_stats()["remote_lookup_seconds_total"]
                t0 = time.perf_counter()
                hit = await eb.lookup(u, pages * ps)
                t1 = time.perf_counter()
                async with hit:
                    got = await eb.load(hit, target)
                t2 = time.perf_counter()
                assert got.loaded_tokens == pages * ps, got
                rd.append(sb.store_stats()["remote_lookup_seconds_total"] - r0)
                lk.append(t1 - t0)
                ld.append(t2 - t1)
            def m(x: list[float]) -> float:
                return statistics.median(x[5:]) * 1e3

            print(f"{rt.DEVICE}: lookup {m(lk):.2f} ms (its remote read {m(rd):.2f} ms), "
                  f"load {m(ld):.2f} ms")


asyncio.run(main())
