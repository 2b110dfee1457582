"""The embedded store's data plane alone (aiokv/copy/copier.py), by its count of copy
streams, next to a raw pinned copy of 256 MiB measured in the same run.

    python benchmarks/copy_plane.py [--streams 1,2,4,8] [--pages 512] [--layers 8]
                                    [--jobs 16] [--ids-on cuda|cpu] [--device cuda]

Each row: ``--jobs`` offload jobs of ``--pages`` random GPU pages (into random host
blocks) submitted back to back, waited for together, then as many load jobs; GiB/s of
each direction. The default geometry is the lead's probe of issue 34: 8 users x 2048
tokens = 512 pages of 128 KiB per layer, 8 layers (64 MiB a job). ``--ids-on cuda``
hands the page ids over as device tensors (one device-to-host copy of them per job),
as the engine's page-based launch does. ``--device cpu`` is a smoke run.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv.bench.bandwidth import raw_copy_gib_s
from aiokv.copy.copier import Copier, CopyJob
from aiokv.running import pick_device

PAGE_SHAPE = (2, 32, 8, 128)  # bf16: 128 KiB a page and layer


def run(copier_streams: int, caches: list[torch.Tensor], pool: torch.Tensor, pages: int,
        jobs: int, ids_on: str) -> tuple[float, float]:
    """(offload, load) GiB/s of ``jobs`` jobs each way through one copier."""
    lock = threading.Condition()
    ended: list[CopyJob] = []

    def on_done(job: CopyJob) -> None:
        with lock:
            ended.append(job)
            lock.notify_all()

    copier = Copier(caches, pool, on_done, "bench-copy", streams=copier_streams)
    rng = np.random.default_rng(0)
    job_bytes = pages * len(caches) * caches[0][0].numel() * caches[0].element_size()
    rates = []
    try:
        for to_host in (True, False, True, False):  # the first pair warms up
            batch = []
            for _ in range(jobs):
                ids = torch.from_numpy(rng.choice(len(caches[0]), pages, replace=False))
                blocks = rng.choice(len(pool), pages, replace=False).astype(np.int64)
                batch.append(CopyJob(to_host, [ids.to(ids_on)], blocks, names=[0]))
            if caches[0].is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            target = len(ended) + jobs
            for job in batch:
                copier.submit(job)
            with lock:
                while len(ended) < target:
                    lock.wait()
            rates.append(jobs * job_bytes / (1 << 30) / (time.perf_counter() - start))
            if any(job.error or job.invalid for job in batch):
                raise RuntimeError(f"a job failed: {[job.error for job in batch]}")
    finally:
        copier.close()
    return rates[2], rates[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--ids-on", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = pick_device(args.device)
    ids_on = args.ids_on if device.type == "cuda" else "cpu"
    caches = [torch.randn(4 * args.pages, *PAGE_SHAPE, device=device).to(torch.bfloat16)
              for _ in range(args.layers)]
    pool = torch.empty(2 * args.pages, args.layers, *PAGE_SHAPE, dtype=torch.bfloat16,
                       pin_memory=device.type == "cuda")
    d2h, h2d = raw_copy_gib_s(0.25, device, 5)
    print(f"raw 256 MiB copy: d2h {d2h:.1f} GiB/s, h2d {h2d:.1f} GiB/s")
    for streams in (int(s) for s in args.streams.split(",")):
        offload, load = run(streams, caches, pool, args.pages, args.jobs, ids_on)
        print(f"{streams} streams, {args.pages} pages x {args.layers} layers, ids on {ids_on}:"
              f" offload {offload:.1f} GiB/s ({offload / d2h:.0%} of raw), "
              f"load {load:.1f} GiB/s ({load / h2d:.0%} of raw)")


if __name__ == "__main__":
    main()
