"""Requests/s of the aiokv engine against a naive per-request integration, on the CPU.

For each count of concurrent users, back to back on a fresh LocalStore of the same
geometry each, every user offloads a fresh history (a new namespace per request, so
every page is written) as fast as its awaits return:

  baseline  each request is one job on a single-thread ThreadPoolExecutor, awaited with
            loop.run_in_executor: its own put_match, launch, then try_wait polled every
            poll interval (the engine's) until terminal. One thread, because a store is
            driven from one thread.
  engine    await engine.offload(...): windows, one launch per batch, one poller.

Then the engine's own cost: 64 users on aiokv.testing.FakeStore (no data moves) with
max_batch_requests 64; process CPU time (every thread) over N requests, divided by N,
and split in three, each measured in the same run:

  store    CPU time inside the store's methods (thread_time around each call);
  callers  the same closed-loop users, building the same arguments (a page-id view, a
           namespace) and awaiting a call that does nothing but resolve a future with a
           result on the next loop iteration (what any awaited API costs its caller:
           the arguments, the task switch, the coroutines, the future);
  engine   the rest: validation, admission, deadlines, batching, the fused copy, the
           store thread's own work, resolution.

Everything runs under uvloop. The project's targets on these figures are judged by
benchmarks/targets.py.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Any

import numpy as np
import torch

from ..config import EngineConfig, StoreConfig
from ..engine import OffloadEngine
from ..stores.base import Store
from ..stores.local import LocalStore
from ..testing import FakeStore
from . import common
from .drive import (
    PerRequestClient,
    Sample,
    Settings,
    TimedStore,
    _callers_only,
    drive,
    timing_overhead_s,
)

NAME = "engine"
HELP = "engine vs per-request baseline requests/s; engine CPU per request"


QUICK: dict[str, object] = {"seconds": 0.5, "warmup_s": 0.1, "cpu_requests": 5_000}
HELPS = {
    "users": "concurrent users per row",
    "seconds": "measured seconds per side per row",
    "warmup_s": "unmeasured seconds before each measurement",
    "pages": "pages per request (each a fresh history)",
    "cpu_cache_gb": "LocalStore size, GiB",
    "window_us": "engine batch window",
    "poll_interval_us": "store polling interval, both sides",
    "cpu_users": "users of the FakeStore CPU-cost run (also its max_batch_requests)",
    "cpu_requests": "requests measured in the FakeStore CPU-cost run",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)














def _caches(settings: Settings, users: int) -> list[torch.Tensor]:
    # Zeros, not random: the bytes moved are what is measured, not their values.
    return [
        t.zero_()
        for t in common.make_caches(
            settings.layers,
            users * settings.pages,
            settings.page_size,
            settings.heads,
            settings.head_dim,
            common.DTYPES[settings.dtype],
            torch.device("cpu"),
        )
    ]


def _local_store(settings: Settings) -> LocalStore:
    return LocalStore(StoreConfig(cpu_cache_gb=settings.cpu_cache_gb))


async def _baseline(settings: Settings, users: int) -> Sample:
    caches = _caches(settings, users)
    pages = np.arange(users * settings.pages, dtype=np.int64).reshape(users, settings.pages)
    tokens = settings.pages * settings.page_size
    client = PerRequestClient(_local_store(settings), settings.poll_interval_us / 1e6)
    names = itertools.count()
    await client.start(caches)

    async def one(user: int) -> None:
        stored = await client.offload(pages[user], tokens, [f"r{next(names)}"])
        if stored != tokens:
            raise RuntimeError(f"baseline stored {stored} of {tokens} fresh tokens")

    try:
        return await drive(users, one, settings.warmup_s, seconds=settings.seconds)
    finally:
        await client.close()


async def _engine(
    settings: Settings, users: int, store: Store, max_batch: int, requests: int | None = None
) -> tuple[Sample, Any]:
    caches = _caches(settings, users)
    pages = torch.arange(users * settings.pages).view(users, settings.pages)
    tokens = settings.pages * settings.page_size
    config = EngineConfig(
        window_us=settings.window_us,
        max_batch_requests=max_batch,
        poll_interval_us=settings.poll_interval_us,
    )
    names = itertools.count()
    spans: list[tuple[float, float]] = []  # each request's submit and result
    async with OffloadEngine(store, caches, config) as engine:

        async def one(user: int) -> None:
            began = time.perf_counter()
            result = await engine.offload(user, pages[user], tokens, namespace=[f"r{next(names)}"])
            spans.append((began, time.perf_counter()))
            if result.stored_tokens != tokens:
                raise RuntimeError(f"engine stored {result.stored_tokens} of {tokens} fresh tokens")

        if requests is None:
            sample = await drive(users, one, settings.warmup_s, seconds=settings.seconds)
        else:
            sample = await drive(users, one, settings.warmup_s, requests=requests)
        after = engine.stats()
    # Of the measured window only: requests that began and ended in it, and its batches.
    end = sample.started + sample.wall_s
    inside = np.array([b - a for a, b in spans if a >= sample.started and b <= end])
    window = {
        "p50_ms": float(np.percentile(inside, 50)) * 1e3 if len(inside) else math.nan,
        "p99_ms": float(np.percentile(inside, 99)) * 1e3 if len(inside) else math.nan,
        # Over the whole run, warm-up included: from the start to the drain nothing is in
        # flight at either end, so every request counted had its batch counted too (the
        # window's deltas counted requests of a batch dispatched before it opened).
        "mean_batch": after.completed / after.batches if after.batches else 0.0,
        "run_completed": after.completed,  # the whole run's, warm-up included
    }
    return sample, window


async def _main(settings: Settings) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    bar = common.progress(2 * len(settings.users) + 1, "engine bench", "run")
    with bar:
        for users in settings.users:
            base = await _baseline(settings, users)
            bar.update()
            mine, stats = await _engine(
                settings, users, _local_store(settings), EngineConfig.max_batch_requests
            )
            bar.update()
            rows.append(
                {
                    "users": users,
                    "baseline_rps": base.per_second,
                    "engine_rps": mine.per_second,
                    "ratio": mine.per_second / base.per_second if base.per_second else 0.0,
                    "engine_mean_batch": stats["mean_batch"],
                    "baseline_cpu_us": base.cpu_us,
                    "engine_cpu_us": mine.cpu_us,
                    "engine_p50_ms": stats["p50_ms"],
                    "engine_p99_ms": stats["p99_ms"],
                }
            )
        cpu = await _cpu_split(settings)
        bar.update()
    return {"rows": rows, "cpu": cpu}


async def _cpu_split(settings: Settings) -> dict[str, Any]:
    """Process CPU per request on FakeStore, split into engine, store calls and callers."""
    fake = TimedStore(FakeStore(settings.page_size))
    cpu, cpu_stats = await _engine(
        settings, settings.cpu_users, fake, settings.cpu_users, settings.cpu_requests
    )
    # Store CPU per completed request (warm-up included on both sides of the ratio).
    completed = max(cpu_stats["run_completed"], 1)
    store_us = fake.cpu_s / completed * 1e6
    # TimedStore's own cost outside what it measures, per request; taken out of the
    # engine's share (its store thread makes these calls).
    wrapper_us = fake.calls / completed * timing_overhead_s() * 1e6
    callers = await _callers_only(settings)
    return {
        "users": settings.cpu_users,
        "requests": cpu.requests,
        "cpu_us_per_request": cpu.cpu_us,
        "store_us_per_request": store_us,
        "callers_us_per_request": callers.cpu_us,
        "timing_wrapper_us_per_request": wrapper_us,
        "engine_us_per_request": cpu.cpu_us - store_us - callers.cpu_us - wrapper_us,
        # The same split by thread: the loop's share, the rest (store thread, copy).
        "engine_loop_us_per_request": cpu.loop_cpu_us - callers.loop_cpu_us,
        "engine_other_threads_us_per_request": (
            cpu.cpu_us
            - cpu.loop_cpu_us
            - store_us
            - wrapper_us
            - (callers.cpu_us - callers.loop_cpu_us)
        ),
        "requests_per_s": cpu.per_second,
        "mean_batch": cpu_stats["mean_batch"],
    }


def run(args: argparse.Namespace) -> int:
    settings = common.settings_from_args(Settings, args, QUICK)
    # Every user keeps one call in flight, on engines of the default max_pending.
    for users in ("users", "cpu_users"):
        common.check_in_flight(settings, users, max_pending=EngineConfig.max_pending)
    # Its store is --cpu-cache-gb (checked as a config): a round's caches are the rest,
    # --cpu-users' as much as the largest --users'.
    common.check_round_fits(settings, torch.device("cpu"), store=False, users_too=("cpu_users",))
    results = common.run_uvloop(_main(settings))
    geometry = (
        f"{settings.layers} layers, page {settings.page_size}, {settings.heads} heads x "
        f"{settings.head_dim}, {settings.dtype}, {settings.pages} pages/request, CPU"
    )
    common.print_table(
        f"offload requests/s: per-request baseline vs engine ({geometry})",
        ["users", "baseline/s", "engine/s", "engine/base", "batch", "base us/req",
         "eng us/req", "eng p50 ms", "eng p99 ms"],
        [
            [r["users"], r["baseline_rps"], r["engine_rps"], f"{r['ratio']:.2f}x",
             r["engine_mean_batch"], r["baseline_cpu_us"], r["engine_cpu_us"],
             r["engine_p50_ms"], r["engine_p99_ms"]]
            for r in results["rows"]
        ],
    )
    # uvloop's loop.time() is libuv's millisecond clock, which EngineStats' latencies use.
    print("  (engine p50/p99: the measured window's requests, call to result; batch: requests "
          "per batch over the whole run)")
    cpu = results["cpu"]
    print(
        f"process CPU per request on FakeStore: {cpu['cpu_us_per_request']:.1f} us = "
        f"engine {cpu['engine_us_per_request']:.1f} + store calls "
        f"{cpu['store_us_per_request']:.1f} + callers {cpu['callers_us_per_request']:.1f} "
        f"+ store timing wrapper {cpu['timing_wrapper_us_per_request']:.1f} "
        f"(engine on the loop thread {cpu['engine_loop_us_per_request']:.1f}, on others "
        f"{cpu['engine_other_threads_us_per_request']:.1f}; {cpu['users']} users, "
        f"mean batch {cpu['mean_batch']:.1f}, "
        f"{cpu['requests']} requests, {cpu['requests_per_s']:,.0f} req/s)"
    )
    if args.json:
        common.write_json(args.json, NAME, settings, torch.device("cpu"), args.bench_argv, results)
    if args.plot:
        _plot(args.plot, results["rows"])
    return 0


def _plot(path: str, rows: list[dict[str, Any]]) -> None:
    def draw(axes: Any) -> None:
        users = [r["users"] for r in rows]
        axes.plot(users, [r["baseline_rps"] for r in rows], "o-", label="per-request baseline")
        axes.plot(users, [r["engine_rps"] for r in rows], "s-", label="aiokv engine")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("concurrent users")
        axes.set_ylabel("offload requests/s")
        axes.legend()

    common.save_plot(path, "aiokv engine vs per-request baseline (CPU, LocalStore)", draw)


__all__ = ["HELP", "NAME", "Settings", "add_arguments", "drive", "run"]
