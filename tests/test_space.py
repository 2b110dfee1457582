"""Backpressure (aiokv/space.py): an offload that finds no room waits and matches again.

The retry decision as pure functions; SpaceWaits on a fake clock and timer; and the
engine end to end over a FaultyStore that has no room for a while (``no_space_for``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, small_store

import aiokv
from aiokv import space
from aiokv.errors import StoreFull
from aiokv.requests import Kind, Request
from aiokv.space import SpaceWaits, give_up_at, next_try_at
from aiokv.stats import StatsRecorder
from aiokv.stores.base import NoSpace
from aiokv.testing import CheckingStore, FaultyStore, StoreWrapper

MIN, MAX = space.BACKOFF_MIN_S, space.BACKOFF_MAX_S

# ---- the decision ------------------------------------------------------------------------


def test_the_backoff_starts_small_doubles_and_is_capped() -> None:
    delays = [next_try_at(100.0, 1e9, tries) for tries in range(1, 40)]
    steps = [d - 100.0 for d in delays if d is not None]
    assert steps[0] == pytest.approx(MIN)
    assert steps[1] == pytest.approx(2 * MIN) and steps[2] == pytest.approx(4 * MIN)
    assert all(b >= a for a, b in itertools.pairwise(steps))  # never shrinks
    assert max(steps) == pytest.approx(MAX) and steps[-1] == pytest.approx(MAX)
    assert MIN < MAX <= 0.1  # "a few ms, growing": a wait never hides room for long


def test_no_try_is_due_past_the_deadline_and_the_last_is_at_it() -> None:
    assert next_try_at(10.0, 10.0 + MIN / 2, 1) == pytest.approx(10.0 + MIN / 2)
    assert next_try_at(10.0, 10.0, 1) is None  # reached: give up (StoreFull)
    assert next_try_at(11.0, 10.0, 5) is None


def test_the_deadline_is_the_request_timeout_or_a_bound_without_one() -> None:
    assert give_up_at(5.0, 7.0, 1500) == pytest.approx(6.5)  # from accept, not first wait
    assert give_up_at(5.0, 7.0, 0) == pytest.approx(7.0 + space.NO_TIMEOUT_WAIT_S)


# ---- SpaceWaits on a fake clock --------------------------------------------------------


class FakeTimers:
    """The loop's call_later, run by hand; and the clock SpaceWaits reads."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[list[Any]] = []  # [when, callback, cancelled]

    def clock(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        entry = [self.now + delay, callback, False]
        self.timers.append(entry)

        class Handle:
            def cancel(self) -> None:
                entry[2] = True

        return Handle()

    def armed(self) -> list[float]:
        return [when for when, _, cancelled in self.timers if not cancelled]

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for entry in list(self.timers):
            if not entry[2] and entry[0] <= self.now:
                entry[2] = True
                entry[1]()


def offload(submitted_at: float = 0.0) -> Request:
    request = Request(
        Kind.OFFLOAD, "u", concurrent.futures.Future(), PAGE_SIZE,
        np.arange(PAGE_SIZE, dtype=np.int64), ("ns",), None, 1,
    )
    request.submitted_at = submitted_at
    return request


def full() -> StoreFull:
    error = StoreFull("store has no space: full")
    error.__cause__ = NoSpace("full")
    return error


class Rig:
    def __init__(self, timeout_ms: int = 1000) -> None:
        self.timers = FakeTimers()
        self.stats = StatsRecorder()
        self.requeued: list[list[Request]] = []
        self.waits = SpaceWaits(
            self.timers, timeout_ms, self.stats, self.requeue, self.resolve,  # type: ignore[arg-type]
            clock=self.timers.clock,
        )

    def requeue(self, requests: Sequence[Request]) -> None:
        self.requeued.append(list(requests))

    def resolve(self, request: Request, outcome: object) -> None:
        raise AssertionError("SpaceWaits hands its errors back; it resolves nothing itself")


def test_a_held_offload_is_requeued_after_its_backoff_and_not_before() -> None:
    rig = Rig()
    request = offload()
    assert rig.waits.hold(request, full()) is None
    assert rig.timers.armed() == [pytest.approx(MIN)]
    rig.timers.advance(MIN / 4)
    assert rig.requeued == []  # no spin: nothing before the backoff
    rig.timers.advance(MIN)
    assert rig.requeued == [[request]]
    assert rig.stats.space_waits == 1 and rig.stats.space_wait_s == pytest.approx(1.25 * MIN)
    assert rig.waits.hold(request, full()) is None  # no room again: twice the backoff
    assert rig.timers.armed() == [pytest.approx(rig.timers.now + 2 * MIN)]


def test_a_terminal_task_requeues_every_held_offload_at_once_in_order() -> None:
    rig = Rig()
    first, second = offload(), offload()
    rig.waits.hold(first, full())
    rig.timers.advance(MIN / 2)
    rig.waits.hold(second, full())
    rig.waits.room_may_have_freed()
    assert rig.requeued == [[first, second]]
    assert rig.timers.armed() == []  # nothing left to wake up for
    rig.waits.room_may_have_freed()  # nothing held: nothing requeued twice
    assert rig.requeued == [[first, second]]


def test_an_offload_gives_up_at_its_deadline_with_the_stores_cause() -> None:
    rig = Rig(timeout_ms=10)
    request = offload(submitted_at=0.0)
    tries = 0
    final: StoreFull | None = None
    while final is None:
        final = rig.waits.hold(request, full())
        tries += 1
        if final is None:
            rig.timers.advance(1.0)  # past every backoff: the timer fires, it matches again
    assert isinstance(final.__cause__, NoSpace)
    assert "no room after" in str(final) and "request_timeout_ms=10" in str(final)
    assert tries >= 2 and rig.timers.now >= 0.01
    assert not rig.waits.waited(request)  # forgotten once it gave up


def test_the_deadline_gives_storefull_to_an_offload_that_waited() -> None:
    rig = Rig()
    request = offload()
    rig.waits.hold(request, full())
    assert rig.waits.waited(request)
    error = rig.waits.give_up(request)
    assert isinstance(error, StoreFull) and not rig.waits.waited(request)
    rig.timers.advance(1.0)
    assert rig.requeued == []  # its timer entry is skipped


def test_a_caller_who_left_is_neither_held_nor_requeued() -> None:
    rig = Rig()
    left, stays = offload(), offload()
    left.future.cancel()
    error = full()
    assert rig.waits.hold(left, error) is error and not rig.waits.waited(left)
    rig.waits.hold(stays, full())
    other = offload()
    rig.waits.hold(other, full())
    other.future.cancel()  # left while held
    rig.waits.room_may_have_freed()
    assert rig.requeued == [[stays]] and not rig.waits.waited(other)


def test_close_returns_the_held_offloads_and_holds_no_more() -> None:
    rig = Rig()
    held, on_its_way = offload(), offload()
    rig.waits.hold(on_its_way, full())
    rig.timers.advance(MIN)  # matched again: on its way to the store at the close
    assert rig.requeued == [[on_its_way]]
    rig.waits.hold(held, full())
    assert rig.waits.close() == [held]
    assert rig.timers.armed() == []
    # Its answer comes back after the close, without room: the close ended its wait, so
    # EngineClosed, not a StoreFull that claims request_timeout_ms passed.
    error = rig.waits.hold(on_its_way, full())
    assert isinstance(error, aiokv.EngineClosed), error
    assert "engine closed while this offload waited for room" in str(error)
    assert isinstance(error.__cause__, NoSpace)
    assert not rig.waits.waited(on_its_way) and rig.timers.armed() == []


# ---- the engine, end to end -------------------------------------------------------------


class NoRoomBehindAGate(StoreWrapper):
    """Never any room; the second match answers so only once ``gate`` opens: an
    offload's retry on its way to the store while the engine closes."""

    def __init__(self, inner: aiokv.Store) -> None:
        super().__init__(inner)
        self.matches = 0
        self.retrying = threading.Event()
        self.gate = threading.Event()

    def put_match(self, token_ids: Any, namespace: Sequence[str]) -> Any:
        self.matches += 1
        if self.matches == 2:
            self.retrying.set()
            self.gate.wait()
        raise aiokv.testing.no_space()


class Holds:
    """Counts the offloads SpaceWaits put on hold, and lets a test wait for a count."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._changed = asyncio.Event()
        real = SpaceWaits.hold

        def hold(waits: SpaceWaits, request: Request, error: StoreFull) -> StoreFull | None:
            outcome = real(waits, request, error)
            if outcome is None:
                self.count += 1
                self._changed.set()
            return outcome

        monkeypatch.setattr(SpaceWaits, "hold", hold)

    async def reach(self, count: int) -> None:
        while self.count < count:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 10)


def engine_over(caches: list[torch.Tensor], **config: Any) -> tuple[
    FaultyStore, aiokv.OffloadEngine, CheckingStore
]:
    faulty = FaultyStore(small_store())
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    engine = aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(window_us=0, **config))
    return faulty, engine, checked


def hour_long_backoffs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a store event (or the deadline) can end a wait now."""
    monkeypatch.setattr(space, "BACKOFF_MIN_S", 3600.0)
    monkeypatch.setattr(space, "BACKOFF_MAX_S", 3600.0)


def pages(start: int, count: int = 4) -> torch.Tensor:
    return torch.arange(start, start + count)


@pytest.mark.asyncio
async def test_offloads_wait_out_a_store_with_no_room_for_a_while(
    caches: list[torch.Tensor],
) -> None:
    faulty, engine, checked = engine_over(caches)
    async with engine:
        faulty.no_space_for = 6
        results = await asyncio.gather(
            *(engine.offload(u, pages(4 * u), 4 * PAGE_SIZE) for u in range(3))
        )
        assert [r.stored_tokens for r in results] == [4 * PAGE_SIZE] * 3  # no StoreFull
        stats = engine.stats()
        assert faulty.injected["no_space"] == 6 and stats.space_waits == 6
        assert stats.space_wait_ms > 0 and stats.failed == 0 and stats.completed == 3
        hit = await engine.lookup(1, 4 * PAGE_SIZE)  # what waited was stored whole
        assert hit.cached_tokens == 4 * PAGE_SIZE
        hit.release()
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_a_terminal_task_wakes_an_offload_that_waits_for_room(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    hour_long_backoffs(monkeypatch)  # only the store's "a task ended" can bring the retry
    holds = Holds(monkeypatch)
    faulty, engine, checked = engine_over(caches, request_timeout_ms=0)
    async with engine:
        faulty.hold.clear()  # the first offload's answer is held back
        first = asyncio.ensure_future(engine.offload("a", pages(0), 4 * PAGE_SIZE))
        assert await asyncio.to_thread(faulty.launched.wait, 10)
        faulty.no_space_for = 1
        second = asyncio.ensure_future(engine.offload("b", pages(4), 4 * PAGE_SIZE))
        await holds.reach(1)  # b found no room and is held
        assert not second.done()
        faulty.hold.set()  # a's task ends: b matches again at once
        done = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert [r.stored_tokens for r in done] == [4 * PAGE_SIZE] * 2
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_with_no_timeout_the_wait_for_room_is_still_bounded(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(space, "NO_TIMEOUT_WAIT_S", 0.05)
    faulty, engine, checked = engine_over(caches, request_timeout_ms=0)
    async with engine:
        faulty.put_match_error = aiokv.testing.no_space()  # never any room
        with pytest.raises(aiokv.StoreFull, match="no room after") as error:
            await engine.offload("u", pages(0), 4 * PAGE_SIZE)
        assert isinstance(error.value.__cause__, NoSpace)
        # The bound that applied, not a request_timeout_ms of 0 that bounds nothing.
        assert "0.05 s, the wait for room without" in str(error.value)
        assert engine.stats().space_waits >= 1 and engine.stats().timed_out == 0
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_the_request_deadline_fails_an_offload_that_waits_with_storefull(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    hour_long_backoffs(monkeypatch)  # held when the deadline comes
    # The deadline runs from the call: it must leave the store's first answer (no room)
    # the time a loaded runner may take to give it, or the offload times out before it
    # ever waited (RequestTimeout). The hold then lasts until the deadline.
    faulty, engine, checked = engine_over(caches, request_timeout_ms=1000)
    async with engine:
        faulty.no_space_for = 1
        with pytest.raises(aiokv.StoreFull, match="no room after 1 tries"):
            await engine.offload("u", pages(0), 4 * PAGE_SIZE)
        stats = engine.stats()
        assert stats.timed_out == 0 and stats.failed == 1 and stats.space_waits == 1
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_an_offload_that_found_room_then_missed_its_deadline_times_out(
    caches: list[torch.Tensor],
) -> None:
    # It waited for room once, found it on its retry and launched; its copy's answer then
    # came after the deadline: RequestTimeout, as for any launched offload, not StoreFull
    # ("no room after 1 tries"), which blames room that was there.
    faulty, engine, checked = engine_over(caches, request_timeout_ms=1500)
    async with engine:
        faulty.no_space_for = 1
        faulty.hold.clear()  # its answer is held back past the deadline
        with pytest.raises(aiokv.RequestTimeout):
            await engine.offload("u", pages(0), 4 * PAGE_SIZE)
        assert faulty.launched.is_set()  # it found room: its retry launched
        faulty.hold.set()
        stats = engine.stats()
        assert (stats.space_waits, stats.timed_out, stats.failed) == (1, 1, 0)
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_callers_who_leave_or_a_close_end_the_wait(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    hour_long_backoffs(monkeypatch)
    holds = Holds(monkeypatch)
    faulty, engine, checked = engine_over(caches, request_timeout_ms=0)
    await engine.start()
    faulty.no_space_for = 2
    leaver = asyncio.ensure_future(engine.offload("a", pages(0), 4 * PAGE_SIZE))
    stayer = asyncio.ensure_future(engine.offload("b", pages(4), 4 * PAGE_SIZE))
    await holds.reach(2)
    held = engine.stats()  # waiting for room: pending, and queued (not at the store)
    assert (held.queued, held.pending, held.store_tasks_open) == (2, 2, 0)
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    await engine.aclose(drain=False)
    with pytest.raises(aiokv.EngineClosed):
        await stayer
    stats = engine.stats()
    assert stats.pending == 0 and stats.cancelled == 1 and stats.failed == 1
    assert stats.queued == 0 and stats.space_wait_ms > 0
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_a_close_fails_a_retry_on_its_way_to_the_store_with_engine_closed(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The offload waited for room and its retry was at the store when aclose came: its
    # no-room answer arrived after the close ended the waits. It failed with StoreFull
    # "no room after N tries within engine.request_timeout_ms=30000" a moment after the
    # call; the close ended its wait, so it is EngineClosed, as a held one's is.
    store = NoRoomBehindAGate(small_store())
    engine = aiokv.OffloadEngine(
        store, caches, aiokv.EngineConfig(window_us=0, request_timeout_ms=30000)
    )
    real_close = SpaceWaits.close

    def close(waits: SpaceWaits) -> list[Request]:
        held = real_close(waits)
        store.gate.set()  # the store answers the retry only once the waits ended
        return held

    monkeypatch.setattr(SpaceWaits, "close", close)
    await engine.start()
    try:
        waiting = asyncio.ensure_future(engine.offload("u", pages(0), 4 * PAGE_SIZE))
        assert await asyncio.to_thread(store.retrying.wait, 30)
        assert not waiting.done()
        # The close's join waits for the store thread, which posts the answer first.
        await engine.aclose(drain=False)
    finally:
        store.gate.set()
    with pytest.raises(aiokv.EngineClosed, match="while this offload waited for room") as caught:
        await waiting
    assert isinstance(caught.value.__cause__, NoSpace)
    stats = engine.stats()
    assert (stats.failed, stats.pending, stats.queued, stats.timed_out) == (1, 0, 0, 0)


@pytest.mark.asyncio
async def test_queued_never_goes_negative_while_offloads_wait_for_room(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny host tier held whole by a lookup: offloads find no room, wait, match again
    (each wait a dispatch more) and finally store once the lookup lets go. ``queued``
    (accepted, not dispatched) stays within 0..pending all along and ends at 0."""
    holds = Holds(monkeypatch)
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=8 * block_bytes / (1 << 30)))
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    seen: list[tuple[int, int]] = []  # (queued, pending), every loop iteration
    watching = True

    async def watch() -> None:
        while watching:
            stats = engine.stats()
            seen.append((stats.queued, stats.pending))
            await asyncio.sleep(0)  # the next loop iteration, not a wall-clock wait

    async with engine:
        await engine.offload("a", pages(0, 8), 8 * PAGE_SIZE)
        hit = await engine.lookup("a", 8 * PAGE_SIZE)  # holds all 8 blocks
        watcher = asyncio.ensure_future(watch())
        waiting = [
            asyncio.ensure_future(engine.offload(u, pages(8 + 2 * u, 2), 2 * PAGE_SIZE))
            for u in range(4)
        ]
        await holds.reach(12)  # each found no room, several times
        hit.release()  # room: they store
        results = await asyncio.wait_for(asyncio.gather(*waiting), 30)
        watching = False
        await watcher
        stats = engine.stats()
    assert [r.stored_tokens for r in results] == [2 * PAGE_SIZE] * 4
    assert stats.space_waits >= 12
    assert min(queued for queued, _ in seen) >= 0
    assert all(queued <= pending for queued, pending in seen)
    assert (stats.queued, stats.pending) == (0, 0)
    assert (engine.stats().queued, engine.stats().pending) == (0, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("verb", ["evict", "clear"])
async def test_an_offload_waiting_for_room_when_its_key_is_evicted_stores_nothing(
    caches: list[torch.Tensor], verb: str
) -> None:
    # Accepted before the evict, it would store the KV the evict drops once room came:
    # whether held or on its way to a match when the evict comes, it ends with nothing
    # stored, and the key stays dropped.
    for _ in range(20):  # the evict lands at different points of the offload's retries
        faulty, engine, checked = engine_over(caches)
        async with engine:
            faulty.no_space_for = 3
            offload = asyncio.ensure_future(engine.offload(7, pages(0), 4 * PAGE_SIZE))
            for _ in range(10_000):  # until its first match found no room
                if faulty.injected.get("no_space", 0):
                    break
                await asyncio.sleep(0.0002)
            await (engine.evict(7) if verb == "evict" else engine.clear())
            result = await offload
            assert (result.stored_tokens, result.cached_tokens) == (0, 0)
            hit = await engine.lookup(7, 4 * PAGE_SIZE)
            assert hit.cached_tokens == 0
            hit.release()
            other = await engine.offload(8, pages(4), 4 * PAGE_SIZE)  # later calls store
            assert other.stored_tokens == 4 * PAGE_SIZE
        assert checked.problems() == []
