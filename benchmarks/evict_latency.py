"""How long the embedded store's ``evict`` takes while write-through SSD writes stream.

An evict returns once no SSD slot holds its key (so that a kill -9 right after cannot
bring it back). This times that under load: ``--writers`` callers offload fresh keys back
to back on an SSD-tiered embedded store (``ssd_write_policy: write_through``, the
default: every offload is also written to SSD), and meanwhile, every 0.2 s, one more key
is offloaded and evicted, its ``evict`` timed. CPU caches; the SSD directory under
``--dir`` (default /var/tmp). The store thread is busy for the evict's whole wait, so a
long one stalls every other call.

    python benchmarks/evict_latency.py [--writers 8] [--evicts 10] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import aiokv

PAGES_PER_WRITER, PAGE = 64, 16


async def run(args: argparse.Namespace) -> list[float]:
    caches = [torch.randn(2048, 2, PAGE, 4, 64) for _ in range(4)]  # 128 KiB blocks
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        config = {"store": {"backend": "local", "cpu_cache_gb": 0.25, "ssd_cache_gb": 2.0,
                            "ssd_cache_dir": directory}}
        engine = aiokv.open_engine(config, kv_caches=caches)
        await engine.start()
        stop = asyncio.Event()

        async def writer(i: int) -> None:
            pages = torch.arange(i * PAGES_PER_WRITER, (i + 1) * PAGES_PER_WRITER)
            n = 0
            while not stop.is_set():
                await engine.offload(f"w{i}:{n}", pages, PAGES_PER_WRITER * PAGE)
                n += 1

        writers = [asyncio.ensure_future(writer(i)) for i in range(args.writers)]
        await asyncio.sleep(2.0)  # the SSD's write lanes fill
        times = []
        for k in range(args.evicts):
            await engine.offload(f"e{k}", torch.arange(1024, 1032), 8 * PAGE)
            begun = time.perf_counter()
            await engine.evict(f"e{k}")
            times.append((time.perf_counter() - begun) * 1e3)
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*writers)
        await engine.aclose()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--evicts", type=int, default=10)
    parser.add_argument("--dir", default="/var/tmp", help="where the SSD directory goes")
    args = parser.parse_args()
    times = asyncio.run(run(args))
    print(f"evict under {args.writers} write-through offloaders, ms: median "
          f"{statistics.median(times):.1f}, max {max(times):.1f}; "
          + " ".join(f"{t:.1f}" for t in times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
