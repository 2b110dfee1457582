"""The engine's one-timer deadline queue (aiokv/loop/deadlines.py)."""

from __future__ import annotations

import asyncio
import gc
import heapq
from collections.abc import Callable
from typing import cast

import pytest
import torch
from conftest import make_caches

import aiokv
from aiokv.loop.deadlines import _MIN_COMPACT, Deadlines
from aiokv.requests import Kind, Request
from aiokv.testing import FakeStore


def request(loop: asyncio.AbstractEventLoop, name: str) -> Request:
    return Request(Kind.OFFLOAD, name, loop.create_future(), 16, None, (name,), None, 1)


class ManualClock:
    """The two things Deadlines asks of its loop, ``time`` and ``call_at``, on a clock that
    moves only when told: a deadline is checked against the time the timer fires at, not
    against how long a loaded host took to run the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, asyncio.TimerHandle, Callable[[], object]]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., object],
                *args: object) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, args, asyncio.get_running_loop())
        heapq.heappush(self._timers, (when, id(handle), handle, lambda: callback(*args)))
        return handle

    def advance_to(self, now: float) -> None:
        """Move to ``now``, running each timer due by then at its own time, in order."""
        while self._timers and self._timers[0][0] <= now:
            when, _, handle, run = heapq.heappop(self._timers)
            if not handle.cancelled():
                self.now = max(self.now, when)
                run()
        self.now = now


@pytest.mark.asyncio
async def test_each_pending_request_expires_at_its_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    clock = ManualClock()
    expired: list[tuple[str, float]] = []

    def expire(r: Request) -> None:
        expired.append((str(r.user_id), clock.time()))
        r.future.set_exception(TimeoutError())

    deadlines = Deadlines(cast(asyncio.AbstractEventLoop, clock), 0.08, expire)
    first, done, late = request(loop, "first"), request(loop, "done"), request(loop, "late")
    deadlines.add(first)
    deadlines.add(done)
    clock.advance_to(0.05)
    deadlines.add(late)
    done.future.set_result(None)  # resolved in time: must never be expired
    clock.advance_to(0.0799)
    assert expired == []  # not before its deadline
    clock.advance_to(0.129)
    assert expired == [("first", 0.08)]  # at its deadline, "late" not with it
    clock.advance_to(1.0)
    # The timer was armed again for the next pending head, and fired at its deadline.
    assert expired == [("first", 0.08), ("late", 0.05 + 0.08)]
    await asyncio.gather(first.future, late.future, return_exceptions=True)
    assert not done.future.exception()
    assert len(deadlines) == 0
    deadlines.close()


@pytest.mark.asyncio
async def test_resolved_requests_behind_a_stuck_head_are_compacted_away() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, 60.0, lambda r: r.future.cancel())
    stuck = request(loop, "stuck")
    deadlines.add(stuck)
    for i in range(5 * _MIN_COMPACT):
        r = request(loop, f"r{i}")
        deadlines.add(r)
        r.future.set_result(None)
    # Only the stuck head and what arrived since the last compaction remain.
    assert len(deadlines) <= _MIN_COMPACT + 1
    assert not stuck.future.done()
    deadlines.close()
    assert len(deadlines) == 0


@pytest.mark.asyncio
async def test_resolved_heads_leave_as_new_requests_arrive() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, 60.0, lambda r: r.future.cancel())
    for i in range(100):
        r = request(loop, f"r{i}")
        deadlines.add(r)
        r.future.set_result(None)
    assert len(deadlines) == 1  # first-in, first-out traffic keeps the queue short
    deadlines.close()


@pytest.mark.asyncio
async def test_prune_drops_resolved_heads_only() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, 60.0, lambda r: r.future.cancel())
    first, second, third = (request(loop, name) for name in ("first", "second", "third"))
    for r in (first, second, third):
        deadlines.add(r)
    first.future.set_result(None)
    third.future.set_result(None)
    deadlines.prune()
    assert len(deadlines) == 2  # "second" is pending and holds "third" behind it
    second.future.set_result(None)
    deadlines.prune()
    assert len(deadlines) == 0
    deadlines.close()


@pytest.mark.asyncio
async def test_the_engine_keeps_no_resolved_request_alive() -> None:
    """A round's requests are freed with their callers, not at the next submit: their
    deadline entries leave as their outcomes are resolved. (Held until the next submit,
    that submit paid for freeing the whole previous round, in the middle of a burst.)"""
    caches = [torch.zeros(64, 2, 4, 2, 8)]
    engine = aiokv.OffloadEngine(FakeStore(4), caches, aiokv.EngineConfig(window_us=0))
    marker = object()
    base = id(marker) << 8  # int user ids (a tuple has no default key) no other test uses
    async with engine:
        results = await asyncio.gather(
            *(engine.offload(base + u, torch.arange(u * 2, u * 2 + 2), 8) for u in range(8))
        )
        assert [r.stored_tokens for r in results] == [8] * 8
        alive = [
            o for o in gc.get_objects()
            if type(o) is Request and type(o.user_id) is int and base <= o.user_id < base + 8
        ]
        assert alive == []


@pytest.mark.asyncio
async def test_callers_that_waited_for_room_are_not_kept_alive_by_their_deadlines() -> None:
    """With overload "wait", a caller accepted after waiting for room has a deadline
    earlier than the queue's tail and a timer of its own; resolved, it must not stay
    alive (its page tensors with it) until that timer falls due."""
    def live_requests() -> int:
        gc.collect()
        return sum(type(o) is Request for o in gc.get_objects())

    before = live_requests()
    config = aiokv.EngineConfig(request_timeout_ms=600_000, overload="wait", max_pending=32)
    async with aiokv.OffloadEngine(FakeStore(), make_caches(), config) as engine:

        async def caller(user: int) -> None:
            for i in range(100):
                await engine.offload(user * 1000 + i, torch.arange(4 * user, 4 * user + 4), 16)

        await asyncio.gather(*(caller(u) for u in range(40)))
    assert live_requests() - before <= 1
