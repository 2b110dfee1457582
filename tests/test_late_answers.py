"""An answer that comes after its request's deadline is a RequestTimeout (issue 19).

Found by benchmarks/overload.py: both loops run the callbacks that are ready before the
timers that came due meanwhile, so a store answer whose delivery ran after the deadline,
before the deadline's timer, reached its caller as a success. Here the delivery is made
to run past the deadline by holding the loop in it (``LateDeliveries``), as a loop that
lags under overload does: the timer cannot run first, on either loop.

The other way round: a request that the store thread reaches only after its deadline,
while the loop lags, is not launched, so that nothing of it is copied once its caller is
told RequestTimeout (an offload stores nothing, a load's pages get nothing).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import torch
from conftest import held
from test_edges import Rig, eventually, one_room_rig, pages

import aiokv
from aiokv.requests import Request

# Every call of a test shares it, its set-up calls too: long enough for a loaded runner
# to answer those (it can stall a thread past 200 ms); each late answer holds the loop
# this long.
TIMEOUT_MS = 1000


class LateDeliveries:
    """Replaces the engine's delivery of store answers: each answer ``late(outcome)``
    picks is delivered only once its request's deadline has passed, the loop held
    (``time.sleep``) until then. ``late`` counts those still pending when their answer
    came (their timer had not run: the case under test); ``requests`` keeps every
    request an answer came for."""

    def __init__(
        self, engine: aiokv.OffloadEngine, late: Callable[[object], bool] = lambda _: True
    ) -> None:
        worker = engine._worker
        assert worker is not None  # started
        self._worker = worker
        self._deliver = worker._deliver
        worker._deliver = self.deliver  # read by the store thread as it posts
        self._is_late = late
        self.late = 0
        self.requests: list[Request] = []

    def deliver(self, pairs: list[tuple[Request, object]]) -> None:
        loop = asyncio.get_running_loop()
        for request, outcome in pairs:
            self.requests.append(request)
            deadline = request.deadline
            if deadline is None or request.future.done() or not self._is_late(outcome):
                continue
            self.late += 1
            while loop.time() <= deadline:
                time.sleep(deadline - loop.time() + 0.001)
        self._deliver(pairs)

    def stop(self) -> None:
        """Deliver answers as they come again."""
        self._worker._deliver = self._deliver


@pytest.mark.asyncio
async def test_a_result_delivered_after_the_deadline_is_a_request_timeout(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0, request_timeout_ms=TIMEOUT_MS)
    async with rig.engine:
        rig.faulty.hold.clear()  # no answer at all: the deadline's timer fails it
        with pytest.raises(aiokv.RequestTimeout) as by_timer:
            await rig.engine.offload("slow", pages(8), 16)
        rig.faulty.hold.set()
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
        late = LateDeliveries(rig.engine)
        with pytest.raises(aiokv.RequestTimeout) as by_answer:
            await rig.engine.offload("u", pages(0), 16)
        assert late.late == 1  # its answer came before its timer ran
        assert str(by_answer.value) == str(by_timer.value)  # expire's words
        assert str(by_answer.value) == (
            f"offload not done within engine.request_timeout_ms={TIMEOUT_MS}"
        )
        stats = rig.engine.stats()
        assert stats.timed_out == 2 and stats.completed == 0 and stats.pending == 0
        assert stats.offloaded_tokens == 0  # counted as the timeout, not the result
        # The store kept what the late offload wrote, as with any timed-out transfer.
        late.stop()
        hit = await rig.engine.lookup("u", 16)
        hit.release()
    assert hit.cached_tokens == 16
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_late_lookup_gives_its_reservation_back(caches: list[torch.Tensor]) -> None:
    # A long TTL: only the late answer's handling can give the reservation back in time.
    rig = Rig(caches, window_us=0, request_timeout_ms=TIMEOUT_MS, lookup_ttl_ms=60_000)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        late = LateDeliveries(rig.engine)
        with pytest.raises(aiokv.RequestTimeout, match=r"^lookup not done within"):
            await rig.engine.lookup("u", 16)
        assert late.late == 1
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
        stats = rig.engine.stats()
        assert stats.timed_out == 1 and stats.completed == 1  # the offload
        assert stats.lookup_tokens == 0  # no lookup completed
    assert len(rig.checked.cancelled) == 1  # the reservation, cancelled in the store
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_late_load_is_a_request_timeout_and_its_lookup_is_spent(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0, request_timeout_ms=TIMEOUT_MS)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        hit = await rig.engine.lookup("u", 16)
        late = LateDeliveries(rig.engine)
        with pytest.raises(aiokv.RequestTimeout, match=r"^load not done within"):
            await rig.engine.load(hit, pages(20))
        assert late.late == 1 and not hit.held
        with pytest.raises(aiokv.InvalidRequest, match="released"):
            await rig.engine.load(hit, pages(20))
        assert rig.engine.stats().store_tasks_open == 0
        assert rig.engine.stats().loaded_tokens == 0
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_late_error_stays_that_error(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=0, request_timeout_ms=TIMEOUT_MS)
    async with rig.engine:
        rig.faulty.fail_tasks = True
        late = LateDeliveries(rig.engine)
        with pytest.raises(aiokv.StoreError, match="injected failure") as caught:
            await rig.engine.offload("u", pages(0), 16)
        assert late.late == 1
        assert not isinstance(caught.value, aiokv.RequestTimeout)
        stats = rig.engine.stats()
        assert stats.failed == 1 and stats.timed_out == 0
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_late_result_of_an_offload_that_found_room_on_a_retry_is_a_timeout(
    caches: list[torch.Tensor],
) -> None:
    """What the deadline's timer gives such an offload, whichever comes first, the timer
    or the answer: RequestTimeout, as any launched offload's; not StoreFull ("no room
    after 1 tries"), which blamed room its retry had found."""
    rig = Rig(caches, window_us=0, request_timeout_ms=TIMEOUT_MS)
    async with rig.engine:
        rig.faulty.no_space_for = 1  # the first match finds no room; the retry does
        late = LateDeliveries(
            rig.engine, late=lambda outcome: not isinstance(outcome, BaseException)
        )
        with pytest.raises(aiokv.RequestTimeout):
            await rig.engine.offload("u", pages(0), 16)
        assert late.late == 1  # the retry's result, late
        stats = rig.engine.stats()
        assert stats.space_waits == 1 and stats.timed_out == 1 and stats.completed == 0
        assert rig.engine._space is not None and rig.engine._space.waits == {}
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_result_before_the_deadline_stays_a_result(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=0, request_timeout_ms=60_000)
    loop = asyncio.get_running_loop()
    async with rig.engine:
        seen = LateDeliveries(rig.engine, late=lambda _: False)
        called = loop.time()
        result = await rig.engine.offload("u", pages(0), 16)
        answered = loop.time()
        stats = rig.engine.stats()
    assert result.stored_tokens == 16
    assert stats.completed == 1 and stats.timed_out == 0
    (request,) = seen.requests
    assert request.deadline is not None
    assert called + 60.0 <= request.deadline <= answered + 60.0
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_request_that_waited_for_room_keeps_the_deadline_of_its_call(
    caches: list[torch.Tensor],
) -> None:
    rig = one_room_rig(caches, request_timeout_ms=60_000)
    loop = asyncio.get_running_loop()
    async with rig.engine:
        seen = LateDeliveries(rig.engine, late=lambda _: False)
        first = await rig.held_offload("a", pages(0))
        called = loop.time()
        waiting = asyncio.ensure_future(rig.engine.offload("b", pages(4), 16))
        await asyncio.sleep(0)  # its first step: it waits for room
        waited_from = loop.time()
        assert not waiting.done() and rig.engine.stats().submitted == 1
        # The first ends 50 ms later: its room goes to the waiting call.
        loop.call_at(waited_from + 0.05, rig.faulty.hold.set)
        results = await asyncio.wait_for(asyncio.gather(first, waiting), 10)
    assert [r.stored_tokens for r in results] == [16, 16]
    second = next(r for r in seen.requests if r.user_id == "b")
    assert second.deadline is not None
    # From the call; one from its admission would be at least 50 ms later.
    assert called + 60.0 <= second.deadline <= waited_from + 60.0
    rig.assert_clean()


def lag_past_the_deadlines(rig: Rig, gate: threading.Event) -> None:
    """Hold the loop (called on it) past the deadlines of what was just submitted, then
    let the store thread go on (``gate``) and hold the loop until it has launched or
    cancelled two more ids: it gets to them before their deadlines' timers can run."""
    decided = len(rig.checked.launched | rig.checked.cancelled)
    time.sleep(TIMEOUT_MS / 1e3 + 0.05)
    gate.set()
    for _ in range(1000):
        if len(rig.checked.launched | rig.checked.cancelled) >= decided + 2:
            return
        time.sleep(0.01)


@pytest.mark.asyncio
async def test_nothing_is_launched_past_its_deadline_while_the_loop_lags(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = Rig(caches, window_us=0, request_timeout_ms=TIMEOUT_MS)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        hit = await rig.engine.lookup("u", 16)
        for cache in caches:
            cache[pages(20)] = float("nan")
        # The store thread is held in the offload's match, and the load queues behind it.
        gate = held(monkeypatch, aiokv.LocalStore, "put_match",
                    lambda store, tokens, namespace: "late" in str(namespace))
        offload = asyncio.ensure_future(rig.engine.offload("late", pages(8), 16))
        assert await asyncio.to_thread(gate.entered.wait, 10)
        submitted = rig.engine.stats().submitted
        load = asyncio.ensure_future(rig.engine.load(hit, pages(20)))
        await eventually(  # accepted, and on its way to the store thread
            lambda: (rig.engine.stats().submitted, rig.engine.stats().queued) == (submitted + 1, 0)
        )
        lag_past_the_deadlines(rig, gate)
        with pytest.raises(aiokv.RequestTimeout):
            await offload
        with pytest.raises(aiokv.RequestTimeout):
            await load
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
        again = await rig.engine.lookup("late", 16)
        again.release()
        assert again.cached_tokens == 0  # the offload stored nothing
        stats = rig.engine.stats()
        assert (stats.timed_out, stats.pending) == (2, 0)
    assert all(c[pages(20)].isnan().all() for c in caches)  # the load copied nothing
    rig.assert_clean()
