"""The engine's one-timer deadline queue (aiokv/deadlines.py)."""

from __future__ import annotations

import asyncio

import pytest

from aiokv.deadlines import _MIN_COMPACT, Deadlines
from aiokv.requests import Kind, Request


def request(loop: asyncio.AbstractEventLoop, name: str) -> Request:
    return Request(Kind.OFFLOAD, name, loop.create_future(), 16, None, (name,), None, 1)


@pytest.mark.asyncio
async def test_each_pending_request_expires_at_its_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    expired: list[tuple[str, float]] = []
    start = loop.time()

    def expire(r: Request) -> None:
        expired.append((str(r.user_id), loop.time() - start))
        r.future.set_exception(TimeoutError())

    deadlines = Deadlines(loop, 0.08, expire)
    first, done, late = request(loop, "first"), request(loop, "done"), request(loop, "late")
    deadlines.add(first)
    deadlines.add(done)
    await asyncio.sleep(0.05)
    deadlines.add(late)
    done.future.set_result(None)  # resolved in time: must never be expired
    await asyncio.wait_for(asyncio.gather(first.future, late.future, return_exceptions=True), 5)
    assert [name for name, _ in expired] == ["first", "late"]
    first_at, late_at = expired[0][1], expired[1][1]
    assert first_at >= 0.079  # not before its deadline (the loop clock has ms steps)
    assert late_at >= 0.05 + 0.079  # armed again for the next head, not fired early
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
