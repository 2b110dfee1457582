"""What ``EngineConfig.store_slice_us`` does for the event loop behind a Python-heavy store.

The local store wrapped so that each ``put_match`` runs ``--match-us`` of pure Python and
each answered task ``--answer-us`` (the shape of FlexKV's matching and answers, without a
GPU). Rounds of ``--users`` offloads go through the engine while a 100 µs ticker on the
loop records how late it wakes. Passes alternate slice off (0) and on, on one machine in
one run, and the table prints each pass's lateness and throughput side by side, with the
ratio of the medians. CPU only:
``python benchmarks/store_slice.py [--slice-us 200] [--passes 3] [--json PATH]``.

This measures the mechanism, not FlexKV: a FlexKV call that holds the GIL longer than a
slice is not split by it (see the README's FlexKV results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv.stores.base import BoolArray, Int64Array, Store, TaskResult
from aiokv.testing import StoreWrapper

PAGE, PAGES_PER_USER = 16, 4


def run_python_for(seconds: float) -> None:
    """Hold the GIL the way Python code does: bytecode, no blocking call."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class PythonHeavy(StoreWrapper):
    def __init__(self, inner: Store, match_s: float, answer_s: float) -> None:
        super().__init__(inner)
        self.match_s, self.answer_s = match_s, answer_s

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        run_python_for(self.match_s)
        return super().put_match(token_ids, namespace)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        answers = super().try_wait(task_ids)
        run_python_for(self.answer_s * len(answers))
        return answers


async def one_pass(args: argparse.Namespace, slice_us: int, tag: str) -> dict[str, float]:
    caches = [torch.zeros(args.users * PAGES_PER_USER * 2, 2, PAGE, 2, 64) for _ in range(2)]
    store = PythonHeavy(
        aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.25)),
        args.match_us / 1e6,
        args.answer_us / 1e6,
    )
    config = aiokv.EngineConfig(
        window_us=300, max_batch_requests=args.users, store_slice_us=slice_us
    )
    lateness: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            due = time.perf_counter() + 100e-6
            await asyncio.sleep(100e-6)
            lateness.append(max(0.0, time.perf_counter() - due))

    async with aiokv.OffloadEngine(store, caches, config) as engine:
        tick = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        for r in range(args.rounds):
            await asyncio.gather(
                *(
                    engine.offload(
                        u,
                        torch.arange(u * PAGES_PER_USER, (u + 1) * PAGES_PER_USER),
                        PAGES_PER_USER * PAGE,
                        namespace=[f"{tag}-{r}"],
                    )
                    for u in range(args.users)
                )
            )
        elapsed = time.perf_counter() - start
        done.set()
        await tick
    late_ms = np.asarray(lateness) * 1e3
    return {
        "slice_us": slice_us,
        "lag_max_ms": float(late_ms.max()),
        "lag_p99_ms": float(np.percentile(late_ms, 99)),
        "requests_per_s": args.rounds * args.users / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slice-us", type=int, default=200)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--match-us", type=int, default=300)
    parser.add_argument("--answer-us", type=int, default=15)
    parser.add_argument("--passes", type=int, default=3, help="passes per setting, alternated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("slice_us", "passes", "users", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("match_us", "answer_us"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    rows = []
    for number in range(args.passes):
        for slice_us in (0, args.slice_us):
            rows.append(asyncio.run(one_pass(args, slice_us, f"p{number}-s{slice_us}")))
    print(f"{'slice_us':>8} | {'lag max ms':>10} {'lag p99 ms':>10} | {'req/s':>8}")
    for row in rows:
        print(f"{row['slice_us']:>8} | {row['lag_max_ms']:>10.2f} {row['lag_p99_ms']:>10.2f} | "
              f"{row['requests_per_s']:>8.0f}")

    def median(key: str, slice_us: int) -> float:
        return statistics.median(r[key] for r in rows if r["slice_us"] == slice_us)

    summary = {
        key: median(key, args.slice_us) / median(key, 0)
        for key in ("lag_max_ms", "lag_p99_ms", "requests_per_s")
    }
    print(f"on/off, medians of {args.passes} passes each: lag max {summary['lag_max_ms']:.2f}x, "
          f"lag p99 {summary['lag_p99_ms']:.2f}x, throughput {summary['requests_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "settings": vars(args), "rows": rows,
                       "on_over_off": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
