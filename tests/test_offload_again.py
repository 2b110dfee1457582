"""An offload the store refused as more than it can ever hold, made again shorter by the
engine (offload's internal ``_again``, the recsys adapter's): one call with its first
try, accepted once, so its second try neither waits for room nor is turned away, and it
keeps the call's deadline."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE

import aiokv
from aiokv.errors import InvalidRequest
from aiokv.loop import resolution
from aiokv.stores.base import BoolArray, Int64Array
from aiokv.testing import FaultyStore

HOST_BLOCKS = 8  # the store's tiers: an offload of 16 pages is refused, one of 8 fits
LONG, SHORT = 16 * PAGE_SIZE, HOST_BLOCKS * PAGE_SIZE


def pages(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)


class GatedMatch(FaultyStore):
    """put_match waits while ``gate`` is clear (``entered`` set once one waits)."""

    def __init__(self, inner: aiokv.LocalStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def put_match(self, token_ids: Int64Array, namespace: Any) -> tuple[int, BoolArray]:
        if not self.gate.is_set():
            self.entered.set()
            self.gate.wait(10)
        return super().put_match(token_ids, namespace)


def engine_over(caches: list[torch.Tensor], **config: Any) -> tuple[GatedMatch, aiokv.OffloadEngine]:
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = GatedMatch(aiokv.LocalStore(
        aiokv.StoreConfig(cpu_cache_gb=HOST_BLOCKS * block_bytes / (1 << 30))))
    return store, aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(**config))


def shorter(refusal: InvalidRequest) -> int:
    assert refusal.field == "num_tokens"
    return SHORT


async def outcome(call: Any) -> Any:
    try:
        return await call
    except aiokv.AiokvError as error:
        return error


def figures(engine: aiokv.OffloadEngine) -> dict[str, int]:
    stats = engine.stats()
    return {name: getattr(stats, name) for name in (
        "submitted", "completed", "failed", "cancelled", "rejected", "timed_out", "pending",
        "queued", "offloaded_tokens")}


@pytest.mark.asyncio
async def test_a_second_try_is_not_turned_away_by_a_caller_that_took_the_room_meanwhile(
    caches: list[torch.Tensor],
) -> None:
    # overload: reject, max_pending 1. Another caller, trying again and again, took the
    # room the refused first try left before the offload's task ran again: the second
    # try was refused with Overloaded, an accepted offload read rejected and failed both.
    _, engine = engine_over(caches, window_us=0, max_pending=1, overload="reject")
    async with engine:
        call = asyncio.ensure_future(outcome(engine.offload("a", pages(0, 16), LONG,
                                                            _again=shorter)))
        await asyncio.sleep(0)  # accepted
        turned_away = 0
        other = None
        while not call.done():
            if other is None:
                try:
                    other = await engine.offload("b", pages(100, 2), 2 * PAGE_SIZE)
                    continue
                except aiokv.Overloaded:
                    turned_away += 1
            await asyncio.sleep(0)
        result = call.result()
        assert isinstance(result, aiokv.OffloadResult), result
        assert result.stored_tokens == SHORT
        seen = figures(engine)
    assert turned_away > 0  # the other caller found the offload holding the room
    assert seen == {
        "submitted": 1 + (other is not None), "completed": 1 + (other is not None),
        "failed": 0, "cancelled": 0, "rejected": turned_away, "timed_out": 0, "pending": 0,
        "queued": 0, "offloaded_tokens": SHORT + (2 * PAGE_SIZE if other else 0)}


@pytest.mark.asyncio
async def test_a_second_try_behind_a_waiter_for_room_is_stored_by_a_drain_close(
    caches: list[torch.Tensor],
) -> None:
    # overload: wait, max_pending 1: the refused first try's room went to a caller
    # waiting for it, the second try waited behind, and the drain close sent it away with
    # 'engine is draining' (failed) where the offload was accepted before the close.
    store, engine = engine_over(caches, window_us=0, max_pending=1, overload="wait")
    async with engine:
        store.hold.clear()  # launched copies answer only once the close has begun
        call = asyncio.ensure_future(outcome(engine.offload("a", pages(0, 16), LONG,
                                                            _again=shorter)))
        await asyncio.sleep(0)  # accepted
        waiter = asyncio.ensure_future(outcome(engine.offload("w", pages(100, 2), 2 * PAGE_SIZE)))
        assert await asyncio.to_thread(store.launched.wait, 10)
        close = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.05)
        store.hold.set()
        await close
    result = call.result()
    assert isinstance(result, aiokv.OffloadResult), result
    assert result.stored_tokens == SHORT
    if isinstance(waiter.result(), aiokv.OffloadResult):
        others = 1  # accepted before the close
    else:
        assert isinstance(waiter.result(), aiokv.EngineClosed)  # still waiting for room
        others = 0
    seen = figures(engine)
    assert (seen["failed"], seen["pending"], seen["queued"]) == (0, 0, 0)
    assert (seen["submitted"], seen["completed"]) == (1 + others, 1 + others)


@pytest.mark.asyncio
async def test_a_second_try_keeps_the_calls_deadline(caches: list[torch.Tensor]) -> None:
    # Each try waits out a batching window of 0.5 s; request_timeout_ms is 0.75 s. The
    # second try had a deadline of its own, 0.75 s after it: the call returned stored
    # after 1 s instead of its RequestTimeout at 0.75 s.
    _, engine = engine_over(caches, window_us=500_000, max_batch_requests=64,
                            request_timeout_ms=750)
    async with engine:
        result = await outcome(engine.offload("a", pages(0, 16), LONG, _again=shorter))
        seen = figures(engine)
    assert isinstance(result, aiokv.RequestTimeout), result
    assert seen == {
        "submitted": 1, "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0,
        "timed_out": 1, "pending": 0, "queued": 0, "offloaded_tokens": 0}


@pytest.mark.asyncio
async def test_a_refusal_whose_caller_left_before_a_second_try_frees_its_room(
    caches: list[torch.Tensor],
) -> None:
    # Two refused offloads in one batch, the first answered first: its caller cancels the
    # other's before that one runs again. No second try comes of it, and its room is
    # free again: two later offloads fit max_pending 2.
    _, engine = engine_over(caches, window_us=10_000_000, max_batch_requests=2,
                            max_pending=2, overload="reject")
    async with engine:
        calls: list[asyncio.Task[Any]] = []

        async def first() -> None:
            with pytest.raises(InvalidRequest):
                await engine.offload("b", pages(0, 16), LONG)
            calls[1].cancel()

        calls.append(asyncio.ensure_future(first()))
        await asyncio.sleep(0)
        calls.append(asyncio.ensure_future(
            engine.offload("a", pages(20, 16), LONG, _again=shorter)))
        await calls[0]
        with pytest.raises(asyncio.CancelledError):
            await calls[1]
        later = await asyncio.gather(*(engine.offload(u, pages(40 + 4 * u, 4), 4 * PAGE_SIZE)
                                       for u in range(2)))
        seen = figures(engine)
    assert [r.stored_tokens for r in later] == [4 * PAGE_SIZE] * 2
    assert (seen["failed"], seen["cancelled"], seen["rejected"]) == (1, 1, 0)
    assert (seen["pending"], seen["queued"]) == (0, 0)


@pytest.mark.asyncio
async def test_a_close_without_drain_takes_no_second_try(
    caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    # The refusal came while aclose(drain=False) waited for the store thread: the second
    # try was accepted by the closing engine, which dispatched nothing more, and the close
    # counted it abandoned: 'closed with 1 requests unfinished' logged, and its caller told
    # '1 requests abandoned at the close's timeout', where nothing had timed out.
    store, engine = engine_over(caches, window_us=10_000_000, max_batch_requests=2)
    await engine.start()
    store.gate.clear()  # the batch's match waits, after the long offload's refusal
    call = asyncio.ensure_future(outcome(engine.offload("a", pages(0, 16), LONG,
                                                        _again=shorter)))
    other = asyncio.ensure_future(outcome(engine.offload("b", pages(20, 2), 2 * PAGE_SIZE)))
    assert await asyncio.to_thread(store.entered.wait, 10)
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        close = asyncio.ensure_future(engine.aclose(drain=False, timeout=10))
        await asyncio.sleep(0.05)  # the close waits for the store thread
        store.gate.set()
        await close
    result = call.result()
    assert isinstance(result, aiokv.EngineClosed), result
    assert "abandoned" not in str(result)
    assert isinstance(other.result(), aiokv.OffloadResult)
    assert [r.getMessage() for r in caplog.records if "unfinished" in r.getMessage()] == []
    seen = figures(engine)
    assert (seen["submitted"], seen["completed"], seen["failed"]) == (2, 1, 1)
    assert (seen["pending"], seen["queued"]) == (0, 0)


async def _wait_for_312(awaitable: Any, timeout: float | None) -> Any:
    """asyncio.wait_for as Python 3.12 on makes it: a coroutine that need not wait (an
    Event already set) returns without yielding to the loop (3.10 and 3.11 run it in a
    task of its own, and yield)."""
    async with asyncio.timeout(timeout):
        return await awaitable


@pytest.mark.asyncio
async def test_a_drain_close_begun_as_the_refusal_came_stores_the_second_try(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two refused offloads in one batch, their answers resolved one loop iteration apart
    # (a busy loop: RESOLVE_BUDGET_S); the first's caller closes the engine as it hears
    # its refusal. The close ran after the second's refusal, before that offload's task
    # ran again: no request was unresolved, and the drain (on Python 3.12 on, whose
    # wait_for of an Event already set does not yield) ended at once. The second try was
    # not taken, and the call, accepted before the close, failed with 'engine is
    # draining'.
    if sys.version_info < (3, 12):
        monkeypatch.setattr(asyncio, "wait_for", _wait_for_312)
    monkeypatch.setattr(resolution, "RESOLVE_BUDGET_S", 0.0)  # one answer per iteration
    _, engine = engine_over(caches, window_us=10_000_000, max_batch_requests=2)
    await engine.start()

    async def first() -> None:
        with pytest.raises(InvalidRequest):
            await engine.offload("b", pages(0, 16), LONG)
        await engine.aclose()

    closer = asyncio.ensure_future(first())
    await asyncio.sleep(0)
    call = asyncio.ensure_future(outcome(engine.offload("a", pages(20, 16), LONG,
                                                        _again=shorter)))
    await closer
    result = await call
    assert isinstance(result, aiokv.OffloadResult), result
    assert result.stored_tokens == SHORT
    seen = figures(engine)
    assert (seen["submitted"], seen["completed"], seen["failed"]) == (2, 1, 1)
    assert (seen["pending"], seen["queued"]) == (0, 0)


@pytest.mark.parametrize("tokens", [-PAGE_SIZE, 20 * PAGE_SIZE])
@pytest.mark.asyncio
async def test_a_second_try_of_a_count_its_pages_cannot_hold_is_refused_as_an_offload_is(
    caches: list[torch.Tensor], tokens: int,
) -> None:
    # The store refused a page id; the second try's count went to the store unchecked: a
    # negative one failed with StoreError ("the store's mask ... names page 1022 of a
    # request of -1 pages"), one past the call's 16 pages with "store.launch failed",
    # where an offload of that many tokens is InvalidRequest naming num_tokens.
    engine = aiokv.OffloadEngine(
        aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01)), caches,  # holds them all
        aiokv.EngineConfig(window_us=0, max_pending=1, overload="reject"))
    bad = pages(0, 16)
    bad[3] = 10_000  # outside the caches: the store refuses it at launch
    refusals: list[InvalidRequest] = []

    def again(refusal: InvalidRequest) -> int:
        refusals.append(refusal)
        return tokens

    async with engine:
        result = await outcome(engine.offload("a", bad, 4 * PAGE_SIZE, _again=again))
        later = await engine.offload("b", pages(100, 2), 2 * PAGE_SIZE)
        seen = figures(engine)
    assert [r.field for r in refusals] == ["page_ids"]
    assert isinstance(result, InvalidRequest), result
    assert (result.field, str(tokens) in str(result)) == ("num_tokens", True), result
    assert later.stored_tokens == 2 * PAGE_SIZE  # its room was given back
    assert (seen["submitted"], seen["completed"], seen["failed"]) == (2, 1, 1)
    assert (seen["pending"], seen["queued"]) == (0, 0)
