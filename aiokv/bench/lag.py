"""Event-loop stall while the engine runs at full load, under uvloop.

A ticker task sleeps ``tick_us`` in a loop and records its lateness (wake time minus the
time it asked for, on time.perf_counter: uvloop's loop clock has millisecond steps) and
each sleep's span, so that percentiles are over time, not over ticks (:func:`by_time_ms`),
while ``users`` users offload fresh histories and load them back, continuously, for
``seconds`` (a bandwidth-like workload). The same ticker first runs alone, so the
table shows the loop's own floor next to the loaded numbers. Under uvloop a sleep
under half a millisecond is a call_soon, so lateness is close to how long the loop
was kept from coming back to the ticker (the ticker then wakes every loop iteration,
which costs the workload some CPU). ``--gc-freeze`` calls gc.freeze() before the loaded
phase: the rare long stalls are mostly full (generation 2) garbage collections walking
every object torch and numpy created at import, which a frozen heap skips.
The project's targets on these figures are judged by benchmarks/targets.py.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import EngineConfig, StoreConfig
from ..engine import OffloadEngine
from ..stores.local import LocalStore
from . import common

NAME = "lag"
HELP = "event-loop lateness while the engine offloads/loads at full load"


@dataclass(frozen=True)
class Settings:
    seconds: float = 5.0
    idle_seconds: float = common.or_zero(1.0)
    users: int = 32
    tokens: int = 2048
    layers: int = 8
    heads: int = 4
    head_dim: int = 256
    page_size: int = 32
    dtype: str = "bf16"
    tick_us: int = common.or_zero(100)
    window_us: int = common.or_zero(EngineConfig.window_us)
    cpu_cache_gb: float = common.or_zero(0.0)
    gc_freeze: bool = False
    switch_interval_us: int = common.or_zero(0)
    device: str = "auto"


QUICK: dict[str, object] = {
    "seconds": 1.0,
    "idle_seconds": 0.25,
    "users": 16,
    "tokens": 256,
    "layers": 2,
    "heads": 2,
    "head_dim": 64,
    "page_size": 16,
}
HELPS = {
    "seconds": "loaded measurement",
    "idle_seconds": "ticker alone first",
    "users": "concurrent users, each offloading then loading in a loop",
    "tokens": "tokens per history",
    "tick_us": "the ticker's sleep",
    "window_us": "engine batch window",
    "cpu_cache_gb": "LocalStore size in GiB (0: four times the users' data)",
    "gc_freeze": "gc.freeze() before the loaded phase",
    "switch_interval_us": "sys.setswitchinterval for the loaded phase (0: Python's 5 ms); "
    "how long another thread may hold the GIL while the loop waits for it",
    "device": "where the caches live",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)


async def tick(period_s: float, until: float) -> tuple[list[float], list[float]]:
    """Lateness and span samples, seconds, of a ``period_s`` sleep repeated until perf
    ``until`` (a span: from one sleep's start to its wake)."""
    late, spans = [], []
    while (now := time.perf_counter()) < until:
        await asyncio.sleep(period_s)
        span = time.perf_counter() - now
        # A call_soon'd wake can come before the period ends: that is no lateness.
        late.append(max(span - period_s, 0.0))
        spans.append(span)
    return late, spans


def by_time_ms(late_s: list[float], spans_s: list[float], points: list[float]) -> list[float]:
    """Lateness percentiles over time, ms: at point p, the lateness the loop's wall time
    stayed within for p% of the measured time. Under uvloop the ticker wakes every loop
    iteration, so percentiles over ticks count mostly fast iterations: a loop stalled
    for most of the time could still show a p99 of zero."""
    if not late_s:
        return [0.0 for _ in points]
    late, spans = np.asarray(late_s, dtype=float), np.asarray(spans_s, dtype=float)
    order = np.argsort(late, kind="stable")
    share = np.cumsum(spans[order]) / spans.sum()
    at = np.searchsorted(share, np.asarray(points, dtype=float) / 100.0)
    return [float(v) * 1e3 for v in late[order][np.minimum(at, len(late) - 1)]]


async def _show_progress(bar: Any, start: float, seconds: float) -> None:
    while True:
        await asyncio.sleep(0.5)
        bar.n = min(time.perf_counter() - start, seconds)
        bar.refresh()


def _summary(
    name: str, late_s: list[float], spans_s: list[float], extra: dict[str, Any]
) -> dict[str, Any]:
    p50, p99 = by_time_ms(late_s, spans_s, [50, 99])
    total = sum(spans_s)
    return {
        "phase": name,
        "ticks": len(late_s),
        "p50_ms": p50,  # of the time, not of the ticks (by_time_ms)
        "p99_ms": p99,
        "max_ms": max(late_s) * 1e3 if late_s else 0.0,
        "over_1ms": sum(1 for s in late_s if s > 1e-3),
        # The share of the measured time spent in ticks more than 1 ms late.
        "time_over_1ms": (
            sum(span for s, span in zip(late_s, spans_s, strict=True) if s > 1e-3) / total
            if total > 0 else 0.0
        ),
        **extra,
    }


async def _main(settings: Settings, device: torch.device) -> list[dict[str, Any]]:
    period_s = settings.tick_us / 1e6
    idle, idle_spans = await tick(period_s, time.perf_counter() + settings.idle_seconds)
    rows = [_summary("idle", idle, idle_spans, {"requests_per_s": 0.0, "gib_per_s": 0.0})]

    dtype = common.DTYPES[settings.dtype]
    page_size = settings.page_size
    pages_each = -(-settings.tokens // page_size)
    caches = common.make_caches(
        settings.layers, settings.users * pages_each, page_size, settings.heads,
        settings.head_dim, dtype, device,
    )
    for cache in caches:
        cache.normal_()
    per_token = common.bytes_per_token(settings.layers, settings.heads, settings.head_dim, dtype)
    store_gib = settings.cpu_cache_gb or (
        4 * settings.users * pages_each * page_size * per_token / float(1 << 30)
    )
    engine = OffloadEngine(
        LocalStore(StoreConfig(cpu_cache_gb=store_gib)),
        caches,
        EngineConfig(window_us=settings.window_us),
    )
    pages = torch.randperm(settings.users * pages_each, device=device).view(
        settings.users, pages_each
    )
    names = itertools.count()
    moved_tokens = 0
    requests = 0
    stop = False

    async def user(index: int) -> None:
        # Each call counted as it ends, not once its user's cycle does: where a cycle
        # outlasts --seconds (large users on a few cores), the window still shows the
        # calls that ended in it.
        nonlocal moved_tokens, requests
        while not stop:
            space = [f"lag{next(names)}"]
            stored = await engine.offload(index, pages[index], settings.tokens, namespace=space)
            moved_tokens += stored.stored_tokens
            requests += 1
            async with await engine.lookup(index, settings.tokens, namespace=space) as hit:
                requests += 1
                loaded = await engine.load(hit, pages[index])
            moved_tokens += loaded.loaded_tokens
            requests += 1

    # Restored also where the engine fails to start.
    with common.switch_interval(settings.switch_interval_us):
        async with engine:
            if settings.gc_freeze:
                gc.collect()
                gc.freeze()  # what a server would do once warmed up; undone below
            users = [asyncio.create_task(user(i)) for i in range(settings.users)]
            try:
                await asyncio.sleep(0.1)  # let the first windows fill before measuring
                start, start_tokens, start_requests = time.perf_counter(), moved_tokens, requests
                with common.progress(settings.seconds, "lag bench", "s") as bar:
                    # Redrawn twice a second: a cost far below the lateness being measured.
                    shown = asyncio.create_task(_show_progress(bar, start, settings.seconds))
                    late, spans = await tick(period_s, start + settings.seconds)
                    shown.cancel()
                    await asyncio.gather(shown, return_exceptions=True)
                elapsed = time.perf_counter() - start
                tokens, done = moved_tokens - start_tokens, requests - start_requests
            finally:
                stop = True
                outcomes = await asyncio.gather(*users, return_exceptions=True)
                if settings.gc_freeze:
                    gc.unfreeze()
            stats = engine.stats()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    rows.append(
        _summary(
            "loaded",
            late,
            spans,
            {
                "requests_per_s": done / elapsed,
                "gib_per_s": tokens * per_token / float(1 << 30) / elapsed,
                "mean_batch": stats.mean_batch_requests,
            },
        )
    )
    return rows


def run(args: argparse.Namespace) -> int:
    settings = common.settings_from_args(Settings, args, QUICK)
    device = common.pick_device(settings.device)
    # Every user keeps one call in flight, on an engine of the default max_pending.
    common.check_in_flight(settings, "users", max_pending=EngineConfig.max_pending)
    common.check_round_fits(settings, device, store=not settings.cpu_cache_gb)
    rows = common.run_uvloop(_main(settings, device))
    common.print_table(
        f"event-loop lateness of a {settings.tick_us} us ticker on {device}, uvloop "
        f"({settings.users} users x {settings.tokens} tokens offload+load, "
        f"{'gc frozen, ' if settings.gc_freeze else ''}"
        f"{settings.layers} layers, {settings.heads} heads x {settings.head_dim})",
        ["phase", "ticks", "p50 ms", "p99 ms", "max ms", "ticks >1 ms", "time >1 ms", "req/s",
         "GiB/s"],
        [[r["phase"], r["ticks"], f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
          f"{r['max_ms']:.3f}", r["over_1ms"], f"{r['time_over_1ms']:.2%}", r["requests_per_s"],
          r["gib_per_s"]]
         for r in rows],
    )
    print("  (p50, p99: of the measured time, each tick weighted by its span; time >1 ms: "
          "the share of it spent in ticks more than 1 ms late)")
    results = {"rows": rows}
    if args.json:
        common.write_json(args.json, NAME, settings, device, args.bench_argv, results)
    if args.plot:
        _plot(args.plot, rows)
    return 0


def _plot(path: str, rows: list[dict[str, Any]]) -> None:
    # The summaries carry no samples; draw the percentiles per phase.
    def draw(axes: Any) -> None:
        x = np.arange(3)
        width = 0.8 / len(rows)
        for i, row in enumerate(rows):
            values = [row["p50_ms"], row["p99_ms"], row["max_ms"]]
            axes.bar(x + i * width, values, width, label=row["phase"])
        axes.set_xticks(x + width * (len(rows) - 1) / 2, ["p50", "p99", "max"])
        axes.set_ylabel("lateness, ms")
        axes.legend()

    common.save_plot(path, "event-loop lateness (uvloop)", draw)


__all__ = ["HELP", "NAME", "Settings", "add_arguments", "by_time_ms", "run", "tick"]
