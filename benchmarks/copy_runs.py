"""Runs of adjacent pages: one strided 2-D copy per run against one copy per (page, layer),
next to a raw pinned copy measured in the same run. A probe for the data plane (issue 34).

    python benchmarks/copy_runs.py [--runs 1,8,16,32,64] [--page-kib 64,128] [--layers 8]
                                   [--pages 512] [--jobs 16]

The host pool is aiokv's, ``[block, layer, page]``: layer ``l`` of consecutive blocks is
``block_bytes`` apart, so a run of consecutive GPU pages going to consecutive blocks is
contiguous on the GPU and strided on the host: one ``cuMemcpy2DAsync`` (width a page,
height the run, the host's pitch a block) moves it, where the batch call takes one copy
per page. ``--runs 1`` places pages at random (no run longer than one page). Each row:
``--jobs`` jobs of ``--pages`` pages x ``--layers`` layers queued back to back over 4
streams, then synchronised; GiB/s each way, and the CPU time the queueing took.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv.bench.bandwidth import raw_copy_gib_s
from aiokv.copy.driver import BatchCopy, StridedCopy

STREAMS = 4
GIB = 1 << 30
def placement(gpu_pages: int, blocks: int, count: int, run: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` (page, block) pairs in runs of ``run`` adjacent pages and blocks."""
    starts_p = rng.choice(gpu_pages // run, count // run, replace=False) * run
    starts_b = rng.choice(blocks // run, count // run, replace=False) * run
    step = np.arange(run)
    return ((starts_p[:, None] + step).ravel().astype(np.int64),
            (starts_b[:, None] + step).ravel().astype(np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="1,8,16,32,64")
    parser.add_argument("--page-kib", default="64,128")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=16)
    args = parser.parse_args()
    d2h_raw, h2d_raw = raw_copy_gib_s(0.25, torch.device("cuda"), 5)
    print(f"raw 256 MiB copy: d2h {d2h_raw:.1f} GiB/s, h2d {h2d_raw:.1f} GiB/s")
    streams = [torch.cuda.Stream() for _ in range(STREAMS)]
    torch.cuda.synchronize()
    batch, strided = BatchCopy(), StridedCopy()
    rng = np.random.default_rng(0)
    for kib in (int(k) for k in args.page_kib.split(",")):
        page = kib * 1024
        gpu_pages, blocks = 4 * args.pages, 2 * args.pages
        caches = [torch.empty(gpu_pages * page, dtype=torch.uint8, device="cuda")
                  for _ in range(args.layers)]
        pool = torch.empty(blocks * args.layers * page, dtype=torch.uint8, pin_memory=True)
        bases = np.array([c.data_ptr() for c in caches], dtype=np.int64)
        block_bytes = args.layers * page
        for run in (int(r) for r in args.runs.split(",")):
            for to_host in (True, False):
                jobs = [placement(gpu_pages, blocks, args.pages, run, rng)
                        for _ in range(args.jobs)]
                for how in ("batch", "2d"):
                    cpu = 0.0
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for pages, blks in jobs:
                        t0 = time.perf_counter()
                        gpu = bases[:, None] + pages[None, :] * page
                        host = (pool.data_ptr() + blks * block_bytes)[None, :] + (
                            np.arange(args.layers) * page)[:, None]
                        dst, src = (host, gpu) if to_host else (gpu, host)
                        bounds = [len(pages) * s // STREAMS for s in range(STREAMS + 1)]
                        if how == "batch":
                            sizes = np.full(len(pages), page, dtype=np.uint64)
                            for layer in range(args.layers):
                                for s, stream in enumerate(streams):
                                    lo, hi = bounds[s], bounds[s + 1]
                                    batch(np.ascontiguousarray(dst[layer, lo:hi]).view(np.uint64),
                                          np.ascontiguousarray(src[layer, lo:hi]).view(np.uint64),
                                          sizes[lo:hi], stream.cuda_stream)
                        else:
                            src_pitch = page if to_host else block_bytes
                            dst_pitch = block_bytes if to_host else page
                            for layer in range(args.layers):
                                for r, at in enumerate(range(0, len(pages), run)):
                                    strided(int(dst[layer, at]), dst_pitch, int(src[layer, at]),
                                            src_pitch, page, run,
                                            streams[r % STREAMS].cuda_stream)
                        cpu += time.perf_counter() - t0
                    torch.cuda.synchronize()
                    took = time.perf_counter() - start
                    moved = args.jobs * args.pages * args.layers * page
                    rate = moved / GIB / took
                    raw = d2h_raw if to_host else h2d_raw
                    print(f"{kib:4d} KiB pages, runs of {run:3d}, "
                          f"{'offload' if to_host else 'load   '} {how:5s}: {rate:5.1f} GiB/s "
                          f"({rate / raw:4.0%} of raw), queueing {cpu * 1e3 / args.jobs:6.3f} "
                          f"ms a job")


if __name__ == "__main__":
    main()
