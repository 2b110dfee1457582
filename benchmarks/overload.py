"""Overload: 10x the sustainable rate for 10 s, under ``overload: reject`` and ``wait``.

The store is ``FaultyStore(FakeStore)`` whose answers come back after a random delay
(uniform in [0, --delay-ms]), so the engine's capacity is about max_pending / the mean
answer time. In one run:

1. the sustainable rate: ``max_pending`` callers, each offloading as soon as its last
   call returned (a closed loop), for --measure-s;
2. per policy, arrivals at --factor x that rate for --seconds (an open loop: a new
   caller every 1/rate s, whatever became of the earlier ones), then the closed loop
   again (the rate that comes back afterwards).

Memory bound: the engine holds at most ``max_pending`` accepted requests; under ``wait``
at most ``max_waiting(max_pending) = max(4 x max_pending, 64)`` more callers wait for
room (aiokv/loop/admission.py; the next one is refused with Overloaded at submit), so at most
``max_pending + max_waiting(max_pending)`` requests exist whatever the arrival rate (320
for the default --max-pending 64). Every request's ``request_timeout_ms`` runs from its
call, the wait for room included.
Printed (and written with --json): the rates, per policy the outcomes, the latency of a
rejection and whether any rejection came after the call had suspended (it must be raised
at submit), the largest ``pending``, caller tasks alive and callers inside their call seen,
calls never resolved, the peak RSS, and two counts of successes after their deadline:

- ``late``: as the caller measures it, from its call to its resumption. It includes the
  loop's lag in resuming the caller after its future resolved (at 10x the rate the loop
  runs behind its arrivals), which no engine can avoid: a future resolved in time may
  still be resumed late.
- ``resolved_late``: as the engine resolved them, which must be 0 (issue 19: an answer
  that comes after the deadline is a RequestTimeout). :class:`ResolvedLate` wraps the
  engine's one place futures resolve (``Resolver.resolve``) and reads the loop's clock
  just before it: a success counts when that reading is at or past the request's deadline
  (``Request.deadline``: from the call, a wait for room included). As the engine reads the
  clock after it, a result resolved in time is never counted; the caller's resumption
  is not in it.

    python benchmarks/overload.py            # 10 s per policy
    python benchmarks/overload.py --quick    # about 1 s per policy, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Generator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv.loop.admission import max_waiting
from aiokv.requests import Request
from aiokv.testing import FakeStore, FaultyStore

PAGE_SIZE = 16


class Suspensions:
    """Awaits ``awaitable`` and counts how often it suspended (0: it ended in its first
    step, without waiting for anything)."""

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self.awaitable = awaitable
        self.count = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.awaitable.__await__()
        try:
            value = inner.send(None)
            while True:
                self.count += 1
                try:
                    sent = yield value
                except BaseException as error:  # a cancellation: handed on, not swallowed
                    value = inner.throw(error)
                else:
                    value = inner.send(sent)
        except StopIteration as stop:
            return stop.value


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def percentile(values: list[float], q: float, scale: float) -> float:
    return round(float(np.percentile(values, q)) * scale, 3) if values else 0.0


class ResolvedLate:
    """Counts the requests whose future the engine resolved with a result (not an
    error) at or after their deadline, measured as it resolves them (the docstring
    above). Reaches into the engine: its Resolver is built at start, and it resolves
    every future through ``resolve``, looked up on the instance per call."""

    def __init__(self, engine: aiokv.OffloadEngine) -> None:
        resolver = engine._resolver
        assert resolver is not None  # started
        self._resolver = resolver
        self._resolve = resolver.resolve
        resolver.resolve = self.resolve  # type: ignore[method-assign]
        self._now = asyncio.get_running_loop().time
        self.count = 0

    def resolve(self, request: Request, outcome: object) -> None:
        future = request.future
        pending = not future.done()
        resolved_at = self._now()  # before the engine reads the clock: never later
        self._resolve(request, outcome)
        deadline = request.deadline
        if pending and deadline is not None and resolved_at >= deadline:
            self.count += not future.cancelled() and future.exception() is None

    def close(self) -> None:
        self._resolver.resolve = self._resolve  # type: ignore[method-assign]


class Run:
    def __init__(self, args: argparse.Namespace, overload: str) -> None:
        self.args = args
        caches = [torch.zeros(4, 2, PAGE_SIZE, 2, 8)]  # FakeStore moves no data
        store = FaultyStore(FakeStore(PAGE_SIZE), seed=args.seed, delay_s=args.delay_ms / 1e3)
        self.engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(
            window_us=200, max_pending=args.max_pending, overload=overload,  # type: ignore[arg-type]
            request_timeout_ms=args.timeout_ms,
        ))
        self.ids = itertools.count()  # a new key per call: every offload writes
        self.pages = torch.arange(1)

    def offload(self) -> Awaitable[aiokv.OffloadResult]:
        return self.engine.offload(next(self.ids), self.pages, PAGE_SIZE)

    async def closed_loop(self, seconds: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        outcomes: Counter[str] = Counter()

        async def caller() -> None:
            while loop.time() < end:
                try:
                    await self.offload()
                    outcomes["ok"] += 1
                except aiokv.AiokvError as error:
                    outcomes[type(error).__name__] += 1

        await asyncio.gather(*(caller() for _ in range(self.args.max_pending)))
        return {"rps": round(outcomes["ok"] / seconds), "outcomes": dict(outcomes)}

    async def open_loop(self, rate: float, seconds: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        outcomes: Counter[str] = Counter()
        rejection_s: list[float] = []
        ok_s: list[float] = []
        late = rejected_after_suspending = 0
        deadline_s = self.args.timeout_ms / 1e3
        calls: set[asyncio.Future[None]] = set()
        max_pending_seen = max_in_flight_seen = max_started_seen = 0
        started = 0  # callers inside their call: accepted, waiting, or resolved not resumed
        resolved_late = ResolvedLate(self.engine)

        async def caller() -> None:
            nonlocal late, rejected_after_suspending, started
            begun = time.perf_counter()
            call = Suspensions(self.offload())
            started += 1
            try:
                await call
            except aiokv.Overloaded:
                rejection_s.append(time.perf_counter() - begun)
                rejected_after_suspending += call.count > 0
                outcomes["Overloaded"] += 1
                return
            except aiokv.AiokvError as error:
                outcomes[type(error).__name__] += 1
                return
            finally:
                started -= 1
            took = time.perf_counter() - begun
            ok_s.append(took)
            late += took > deadline_s
            outcomes["ok"] += 1

        begun = loop.time()
        sent = 0
        next_sample = begun
        while (now := loop.time()) < begun + seconds:
            due = int((now - begun) * rate) - sent
            for _ in range(due):
                task = asyncio.ensure_future(caller())
                calls.add(task)
                task.add_done_callback(calls.discard)
            sent += due
            if now >= next_sample:  # stats() costs a percentile: sample, not per arrival
                max_pending_seen = max(max_pending_seen, self.engine.stats().pending)
                max_in_flight_seen = max(max_in_flight_seen, len(calls))
                max_started_seen = max(max_started_seen, started)
                next_sample = now + 0.02
            await asyncio.sleep(0.001)
        offered_s = loop.time() - begun
        left = list(calls)
        if left:
            await asyncio.wait(left, timeout=3 * deadline_s + 5)
        unresolved = sum(not task.done() for task in left)
        for task in left:
            task.cancel()
        resolved_late.close()
        return {
            "offered_rps": round(sent / offered_s),
            "arrivals": sent,
            "outcomes": dict(outcomes),
            "unresolved": unresolved,
            "rejection_p50_us": percentile(rejection_s, 50, 1e6),
            "rejection_p99_us": percentile(rejection_s, 99, 1e6),
            "rejected_after_suspending": rejected_after_suspending,
            "ok_p50_ms": percentile(ok_s, 50, 1e3),
            "ok_p99_ms": percentile(ok_s, 99, 1e3),
            "ok_max_ms": round(max(ok_s, default=0.0) * 1e3, 3),
            "late": late,  # succeeded after request_timeout_ms (counted from the call)
            "resolved_late": resolved_late.count,  # resolved with a result after it
            "max_pending_seen": max_pending_seen,
            # Caller tasks alive (most not yet run: the loop lags behind the arrivals).
            "max_in_flight_seen": max_in_flight_seen,
            # Inside their call: accepted, waiting for room, or answered and not resumed.
            "max_started_seen": max_started_seen,
        }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "peak_rss_mb_at_start": peak_rss_mb(),
        "max_pending": args.max_pending,
        "timeout_ms": args.timeout_ms,
        "memory_bound": f"the engine holds at most max_pending={args.max_pending} accepted "
        f"requests; under wait at most max_waiting={max_waiting(args.max_pending)} more "
        "callers wait for room (the next is refused with Overloaded at submit): at most "
        f"{args.max_pending + max_waiting(args.max_pending)} requests in all",
        "requests_bound": args.max_pending + max_waiting(args.max_pending),
    }
    for overload in ("reject", "wait"):
        run = Run(args, overload)
        async with run.engine:
            before = await run.closed_loop(args.measure_s)
            rate = args.factor * before["rps"]
            under = await run.open_loop(rate, args.seconds)
            after = await run.closed_loop(args.measure_s)
        stats = run.engine.stats()
        report[overload] = {
            "sustainable_rps": before["rps"],
            "before": before,
            "target_rps": round(rate),
            "overload": under,
            "after": after,
            "rate_after_over_before": round(after["rps"] / max(before["rps"], 1), 3),
            "peak_rss_mb_so_far": peak_rss_mb(),
            "engine_pending_at_close": stats.pending,
            "store_tasks_open_at_close": stats.store_tasks_open,
        }
    report["peak_rss_mb"] = peak_rss_mb()
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases, for CI")
    parser.add_argument("--seconds", type=float, default=None, help="overload phase (10; quick 1)")
    parser.add_argument("--measure-s", type=float, default=None, help="rate phases (3; quick 0.5)")
    parser.add_argument("--factor", type=float, default=10.0, help="x the sustainable rate")
    parser.add_argument("--max-pending", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=40.0, help="max store answer delay")
    parser.add_argument("--timeout-ms", type=int, default=300, help="request_timeout_ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (1.0 if args.quick else 10.0)
    args.measure_s = args.measure_s or (0.5 if args.quick else 3.0)
    torch.set_num_threads(1)
    if args.loop == "uvloop":
        import uvloop

        report = uvloop.run(main_async(args))
    else:
        report = asyncio.run(main_async(args))
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
