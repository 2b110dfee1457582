"""engine.stats() and the Prometheus families count what the callers saw: a caller
cancelled after the engine answered its call, before it took the answer (its task had not
run again; a thread's future not yet finished), got CancelledError, and its call counts
as cancelled, with no tokens, bytes or latency; asyncio callers, run_in_background's
threads and layerwise loads alike."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store
from prometheus_client import CollectorRegistry
from test_engine_stats import scrape
from test_sync import LOOPS

import aiokv
from aiokv import metrics
from aiokv.loop import resolution

TOKENS = 4 * PAGE_SIZE
OUTCOME_OF = {"ok": "completed", "failed": "failed", "cancelled": "cancelled",
              "rejected": "rejected", "timed_out": "timed_out"}
COUNTED = ("completed", "cancelled", "offloaded_tokens", "loaded_tokens", "lookup_tokens",
           "lookup_hit_tokens", "bytes_offloaded", "bytes_loaded", "pending")


def engine_with_metrics() -> tuple[aiokv.OffloadEngine, CollectorRegistry]:
    engine = aiokv.OffloadEngine(small_store(), make_caches(), aiokv.EngineConfig(window_us=0))
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    return engine, registry


def answered(engine: aiokv.OffloadEngine) -> bool:
    """Every call the engine accepted has its answer (its future is resolved)."""
    return not engine._admission.live


async def until_answered(engine: aiokv.OffloadEngine) -> None:
    """Return in the loop iteration the engine answers every call it accepted, before
    their callers' tasks run again: a caller's wake-up is queued behind its answer, and
    this poller's (sleep(0), never a timer) before that answer or right after it."""
    for _ in range(1_000_000):
        if answered(engine):
            return
        await asyncio.sleep(0)
    raise AssertionError("the engine never answered")


async def hold_once_answered(
    engine: aiokv.OffloadEngine,
    handed: threading.Event,
    held: threading.Event,
    release: threading.Event,
) -> None:
    """Block the loop's thread in the iteration the engine answers the one call a thread
    hands over after this coroutine (``handed`` once it did), before the call's task hands
    the answer to that thread's future, until ``release``.

    Handed over before the call, it takes its first step before the call's first step,
    which accepts the call (both loops run hand-overs, and tasks' first steps, in order),
    and blocks the loop there until the thread has handed the call over: it counts the
    calls accepted before, then polls every iteration, however late the thread gets to
    the call. Handed over after the call, it came too late where the thread was
    descheduled in between: the call was answered and handed back by then, and an engine
    with nothing unanswered looks the same before the call as after it."""
    accepted_before = engine.stats().submitted
    handed.wait(30)
    for _ in range(1_000_000):
        if engine.stats().submitted > accepted_before:
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("the engine never accepted the call")
    await until_answered(engine)
    held.set()
    release.wait(30)


def changes(before: aiokv.EngineStats, after: aiokv.EngineStats) -> dict[str, int]:
    return {name: getattr(after, name) - getattr(before, name) for name in COUNTED}


def assert_the_metrics_agree(families: dict[str, Any], stats: aiokv.EngineStats) -> None:
    requests = families["aiokv_requests_total"]
    kinds = ("offload", "lookup", "load")
    for outcome, field in OUTCOME_OF.items():
        assert sum(requests[(k, outcome)] for k in kinds) == getattr(stats, field), outcome
    # A latency per outcome the callers took, but a cancellation or an empty load.
    latency = families["aiokv_latency_seconds_count"]
    observed = stats.completed + stats.failed + stats.timed_out - stats.empty_loads
    assert sum(latency[(k,)] for k in kinds) == observed
    assert families["aiokv_lookup_tokens_total"][()] == stats.lookup_tokens
    moved = families["aiokv_bytes_total"]
    assert moved[("d2h", "host")] >= stats.bytes_offloaded  # the store's count of copies
    assert families["aiokv_pending"][()] == stats.pending


@pytest.mark.asyncio
async def test_an_awaited_call_cancelled_after_its_answer_came_counts_cancelled() -> None:
    engine, registry = engine_with_metrics()
    async with engine:
        await engine.offload(1, torch.arange(0, 4), TOKENS)
        hit = await engine.lookup(1, TOKENS)
        before = engine.stats()
        calls: dict[str, Callable[[], Any]] = {
            "offload": lambda: engine.offload(2, torch.arange(4, 8), TOKENS),
            "lookup": lambda: engine.lookup(1, TOKENS),
            "load": lambda: engine.load(hit, torch.arange(8, 12)),
        }
        for name, call in calls.items():
            caller = asyncio.ensure_future(call())
            await asyncio.sleep(0)  # its first step: accepted
            assert not answered(engine), name
            await until_answered(engine)
            caller.cancel()  # answered, and the caller has not run since
            with pytest.raises(asyncio.CancelledError):
                await caller
        after = engine.stats()
        families = await asyncio.to_thread(scrape, registry)
        assert after.store_tasks_open == before.store_tasks_open - 1  # the load took its hit
    # Three callers saw CancelledError: three cancelled calls, nothing moved for them.
    assert changes(before, after) == {**dict.fromkeys(COUNTED, 0), "cancelled": 3}
    assert after.submitted == after.completed + after.cancelled
    assert_the_metrics_agree(families, after)


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_a_threads_call_cancelled_after_its_answer_came_counts_cancelled(loop_kind: str) -> None:
    engine, registry = engine_with_metrics()
    with aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind]) as kv:
        kv.offload(1, torch.arange(0, 4), TOKENS)
        hit = kv.lookup(1, TOKENS)
        before = kv.stats()
        calls: dict[str, Callable[[], concurrent.futures.Future[Any]]] = {
            "offload": lambda: kv.submit_offload(2, torch.arange(4, 8), TOKENS),
            "lookup": lambda: kv.submit_lookup(1, TOKENS),
            "load": lambda: kv.submit_load(hit, torch.arange(8, 12)),
        }
        for name, submit in calls.items():
            handed, held, release = threading.Event(), threading.Event(), threading.Event()
            holding = asyncio.run_coroutine_threadsafe(
                hold_once_answered(engine, handed, held, release), kv.loop)
            try:
                call = submit()
                handed.set()
                assert held.wait(30), name
                assert call.cancel(), name  # answered; the loop has not handed it over
            finally:  # a failure above leaves the loop free for the close
                handed.set()
                release.set()
            holding.result(30)
            with pytest.raises(concurrent.futures.CancelledError):
                call.result(30)
        after = kv.stats()
        families = scrape(registry)
    assert changes(before, after) == {**dict.fromkeys(COUNTED, 0), "cancelled": 3}
    assert after.submitted == after.completed + after.cancelled
    assert_the_metrics_agree(families, after)
    assert after.store_tasks_open == 0  # the Lookup nobody took went back


@pytest.mark.asyncio
async def test_a_layerwise_load_cancelled_after_its_answer_came_counts_cancelled() -> None:
    engine, registry = engine_with_metrics()
    async with engine:
        await engine.offload(1, torch.arange(0, 4), TOKENS)
        hit = await engine.lookup(1, TOKENS)
        before = engine.stats()
        load = await engine.load_layerwise(hit, torch.arange(8, 12))
        await until_answered(engine)
        load.cancel()  # answered, and its task has not run since
        with pytest.raises(asyncio.CancelledError):
            await load.result()
        with pytest.raises(concurrent.futures.CancelledError):
            load.wait_layer(0)
        after = engine.stats()
        families = await asyncio.to_thread(scrape, registry)
    assert changes(before, after) == {**dict.fromkeys(COUNTED, 0), "cancelled": 1}
    assert_the_metrics_agree(families, after)


def hold_the_loop_as_it_finishes(future: concurrent.futures.Future[Any],
                                 loop: asyncio.AbstractEventLoop,
                                 release: threading.Event) -> None:
    """A user's done callback on ``future`` that blocks the loop's thread (which runs it,
    as it finishes the future) until ``release``: the thread that waits on the future has
    its outcome, and the loop runs nothing more meanwhile."""
    def hold(_: concurrent.futures.Future[Any]) -> None:
        if loop.is_running() and threading.current_thread() is not threading.main_thread():
            release.wait(30)

    future.add_done_callback(hold)


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_a_threads_layerwise_load_is_counted_by_the_time_the_thread_sees_it_end(
        loop_kind: str) -> None:
    """run_in_background, overload: reject, one call at a time: a thread's layerwise
    load refused for want of room, and one of a Lookup that found nothing. Once the thread
    has its load and sees how it ended (Overloaded; loaded, nothing to move), stats read
    right then count it, as a scrape thread would see it, not once the loop's task that
    returned the load ended (a few loop iterations later)."""
    config = aiokv.EngineConfig(window_us=0, max_pending=1, overload="reject")
    engine = aiokv.OffloadEngine(small_store(), make_caches(), config)
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    with aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind]) as kv:
        kv.offload(1, torch.arange(0, 4), TOKENS)
        refused = False
        for _ in range(100):  # refused unless the offload ended before the load came
            hit = kv.lookup(1, TOKENS)
            before = engine.stats()
            release, stalled = threading.Event(), threading.Event()
            kv.loop.call_soon_threadsafe(stalled.wait, 30)  # both calls reach the loop together
            holder = kv.submit_offload(2, torch.arange(8, 12), TOKENS)  # the one room
            handed = kv.submit_load_layerwise(hit, torch.arange(16, 20))
            hold_the_loop_as_it_finishes(handed, kv.loop, release)
            stalled.set()
            try:
                load = handed.result(30)
                try:
                    load.result(timeout=30)
                except aiokv.Overloaded:
                    refused = True
                    now = engine.stats()  # the loop is held: nothing else runs
                    families = scrape(registry)
                    assert now.rejected == before.rejected + 1
                    assert families["aiokv_requests_total"][("load", "rejected")] == now.rejected
                    hit.release()
            finally:
                release.set()
            holder.result(30)
            if refused:
                break
        assert refused, "every load came after the offload had ended"

        empty = kv.lookup(99, TOKENS)  # nothing cached: loaded at once, nothing moved
        assert empty.cached_tokens == 0
        before = engine.stats()
        release, stalled = threading.Event(), threading.Event()
        kv.loop.call_soon_threadsafe(stalled.wait, 30)
        handed = kv.submit_load_layerwise(empty, torch.arange(16, 20))
        hold_the_loop_as_it_finishes(handed, kv.loop, release)
        stalled.set()
        try:
            assert handed.result(30).result(timeout=30).loaded_tokens == 0
            now = engine.stats()
            assert (now.empty_loads, now.completed) == (before.empty_loads + 1,
                                                        before.completed + 1)
            assert now.pending == 0
        finally:
            release.set()


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_calls_answered_as_the_loop_went_are_counted_by_the_close_after_it(
        loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's loop stops in the iteration that answered the calls, before their
    callers' tasks ran again, and is closed without aclose; a close from another loop
    counts every call it accepted: the callers never took their answers (cancelled,
    nothing moved for them), and pending is 0."""
    # All ten answers in one loop iteration: a slow box would otherwise spread them over
    # two (the resolver's per-iteration budget), and the first ones' callers take theirs.
    monkeypatch.setattr(resolution, "RESOLVE_BUDGET_S", 10.0)
    engine, registry = engine_with_metrics()
    loop = LOOPS[loop_kind]()

    async def setup() -> None:
        await engine.start()
        await engine.offload(1, torch.arange(0, 4), TOKENS)

    try:
        loop.run_until_complete(setup())
        before = engine.stats()
        callers = [loop.create_task(engine.lookup(1, TOKENS)) for _ in range(10)]
        for _ in range(1_000_000):  # one loop iteration at a time, until it answered them
            loop.stop()
            loop.run_forever()
            if answered(engine):
                break  # their callers' tasks run in the next iteration, which never comes
        assert not any(caller.done() for caller in callers)
        assert engine.stats().pending == 10
    finally:
        loop.close()
        asyncio.run(engine.aclose(timeout=10))  # its store thread ends, pass or fail
    after = engine.stats()
    families = scrape(registry)
    assert changes(before, after) == {**dict.fromkeys(COUNTED, 0), "cancelled": 10}
    assert after.submitted == (after.completed + after.failed + after.timed_out
                               + after.cancelled + after.pending)
    assert_the_metrics_agree(families, after)
