"""A drain close with nothing left to answer ends at once, whatever path the last call
took out of the engine: the idle event it waits for is set only once no call is live
and no refused offload keeps its room for a second try (Admission.idle), so every such
path must give that room back or take it."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE
from test_offload_again import LONG, SHORT, engine_over, outcome, pages, shorter

import aiokv
from aiokv.errors import InvalidRequest

Scenario = Callable[[aiokv.OffloadEngine], Awaitable[Any]]


async def stored(engine: aiokv.OffloadEngine) -> Any:
    return await engine.offload("a", pages(0, 4), 4 * PAGE_SIZE)


async def loaded(engine: aiokv.OffloadEngine) -> Any:
    await stored(engine)
    return await engine.load(await engine.lookup("a", 4 * PAGE_SIZE), pages(8, 4))


async def empty_load(engine: aiokv.OffloadEngine) -> Any:
    return await engine.load(await engine.lookup("z", 4 * PAGE_SIZE), pages(8, 4))


async def lookup_held(engine: aiokv.OffloadEngine) -> Any:
    await stored(engine)
    return (await engine.lookup("a", 4 * PAGE_SIZE)).cached_tokens


async def invalidated(engine: aiokv.OffloadEngine) -> Any:
    await stored(engine)
    return await engine.evict("a"), await engine.clear()


async def cancelled(engine: aiokv.OffloadEngine) -> Any:
    call = asyncio.ensure_future(stored(engine))
    await asyncio.sleep(0)  # accepted
    call.cancel()
    return (await asyncio.gather(call, return_exceptions=True))[0]


async def refused(engine: aiokv.OffloadEngine) -> Any:
    return await outcome(engine.offload("a", pages(0, 16), LONG))


async def again(engine: aiokv.OffloadEngine) -> Any:
    return (await engine.offload("a", pages(0, 16), LONG, _again=shorter)).stored_tokens


async def again_declined(engine: aiokv.OffloadEngine) -> Any:
    return await outcome(engine.offload("a", pages(0, 16), LONG, _again=lambda _: None))


async def again_bad_count(engine: aiokv.OffloadEngine) -> Any:
    return await outcome(engine.offload("a", pages(0, 16), LONG, _again=lambda _: -1))


async def again_callback_failed(engine: aiokv.OffloadEngine) -> Any:
    def fails(refusal: InvalidRequest) -> int:
        raise LookupError("the caller's own failure")

    with pytest.raises(LookupError):
        await engine.offload("a", pages(0, 16), LONG, _again=fails)
    return "LookupError"


async def again_cancelled_after_refusal(engine: aiokv.OffloadEngine) -> Any:
    # The refusal's answer came, and its caller was cancelled before its task ran again.
    call = asyncio.ensure_future(engine.offload("a", pages(0, 16), LONG, _again=shorter))
    for _ in range(10_000):
        await asyncio.sleep(0)
        if engine._admission._kept:
            break
    else:
        pytest.fail("the refusal never came")
    call.cancel()
    return (await asyncio.gather(call, return_exceptions=True))[0]


async def overloaded(engine: aiokv.OffloadEngine) -> Any:
    calls = [outcome(engine.offload(f"u{i}", pages(4 * i, 4), 4 * PAGE_SIZE)) for i in range(3)]
    return [type(result).__name__ for result in await asyncio.gather(*calls)]


async def room_waits_cancelled(engine: aiokv.OffloadEngine) -> Any:
    calls = [asyncio.ensure_future(engine.offload(f"u{i}", pages(4 * i, 4), 4 * PAGE_SIZE))
             for i in range(3)]
    await asyncio.sleep(0)
    calls[1].cancel()
    calls[2].cancel()
    return [type(r).__name__ for r in await asyncio.gather(*calls, return_exceptions=True)]


async def waited_for_space(engine: aiokv.OffloadEngine) -> Any:
    # The host tier is full of a held lookup's blocks: the offload waits for room
    # (aiokv.space) until that lookup is released.
    await engine.offload("a", pages(0, 8), 8 * PAGE_SIZE)
    hit = await engine.lookup("a", 8 * PAGE_SIZE)
    call = asyncio.ensure_future(engine.offload("b", pages(8, 8), 8 * PAGE_SIZE))
    await asyncio.sleep(0.05)
    hit.release()
    return (await call).stored_tokens


SCENARIOS: dict[str, tuple[Scenario, dict[str, Any], Any]] = {
    "stored": (stored, {}, aiokv.OffloadResult("a", 4 * PAGE_SIZE, 4 * PAGE_SIZE)),
    "loaded": (loaded, {}, aiokv.LoadResult("a", 4 * PAGE_SIZE)),
    "empty_load": (empty_load, {}, aiokv.LoadResult("z", 0)),
    "lookup_held": (lookup_held, {}, 4 * PAGE_SIZE),
    "invalidated": (invalidated, {}, (4 * PAGE_SIZE, 0)),
    "cancelled": (cancelled, {"window_us": 100_000}, asyncio.CancelledError),
    "refused": (refused, {}, InvalidRequest),
    "again": (again, {}, SHORT),
    "again_declined": (again_declined, {}, InvalidRequest),
    "again_bad_count": (again_bad_count, {}, InvalidRequest),
    "again_callback_failed": (again_callback_failed, {}, "LookupError"),
    "again_cancelled_after_refusal": (again_cancelled_after_refusal, {"window_us": 1000},
                                      asyncio.CancelledError),
    "overloaded": (overloaded, {"max_pending": 1, "window_us": 10_000},
                   ["OffloadResult", "Overloaded", "Overloaded"]),
    "room_waits_cancelled": (room_waits_cancelled,
                             {"max_pending": 1, "overload": "wait", "window_us": 10_000},
                             ["OffloadResult", "CancelledError", "CancelledError"]),
    "waited_for_space": (waited_for_space, {"window_us": 1000}, 8 * PAGE_SIZE),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_a_drain_close_after_the_last_call_ended_does_not_wait_for_its_timeout(
    caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture, name: str,
) -> None:
    scenario, config, expected = SCENARIOS[name]
    _, engine = engine_over(caches, **config)
    await engine.start()
    result = await scenario(engine)
    if isinstance(expected, type):
        assert isinstance(result, expected), result
    else:
        assert result == expected
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        await engine.aclose(drain=True, timeout=2)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (engine.stats().pending, engine.stats().queued) == (0, 0)


async def _wait_for_312(awaitable: Any, timeout: float | None) -> Any:
    """asyncio.wait_for as Python 3.12 on makes it: a coroutine that need not wait (an
    Event already set) returns without yielding to the loop."""
    async with asyncio.timeout(timeout):
        return await awaitable


@pytest.mark.asyncio
async def test_a_drain_close_answers_a_layerwise_load_called_as_the_close_began(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # load_layerwise called after aclose() was, before the close's task ran: the call
    # passed the running check, and its load is accepted in a task of its own, which
    # ran after the close's. The close found nothing live and (on Python 3.12 on, whose
    # wait_for of an Event already set does not yield) stopped draining before that
    # accept: the load failed with EngineClosed, 'abandoned at the close's timeout',
    # where nothing had timed out.
    if sys.version_info < (3, 12):
        monkeypatch.setattr(asyncio, "wait_for", _wait_for_312)
    _, engine = engine_over(caches, window_us=1000)
    await engine.start()
    await stored(engine)
    hit = await engine.lookup("a", 4 * PAGE_SIZE)
    close = asyncio.ensure_future(engine.aclose(drain=True, timeout=5))
    await asyncio.sleep(0)  # aclose() ran; the close's own task has not yet

    async def load() -> Any:
        return await (await engine.load_layerwise(hit, pages(8, 4))).result()

    with caplog.at_level(logging.WARNING, logger="aiokv"):
        result = await outcome(load())
        await close
    assert result == aiokv.LoadResult("a", 4 * PAGE_SIZE)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
