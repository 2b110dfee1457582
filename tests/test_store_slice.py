"""EngineConfig.store_slice_us: the store thread hands the GIL to the loop between store
calls once it has run a slice. Deterministic: the worker's clock and sleep are faked
(``aiokv.worker.thread.time``), so no assertion depends on how fast this machine is."""

from __future__ import annotations

import asyncio
import queue
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, small_store

import aiokv
import aiokv.worker.handoff
import aiokv.worker.thread
from aiokv.config import parse_config
from aiokv.loop.batcher import Batch
from aiokv.loop.resolution import Resolver
from aiokv.stores.base import BoolArray, Int64Array, Store
from aiokv.stores.flexkv import FlexKVStore
from aiokv.testing import FakeStore, SharedStore, StoreWrapper
from aiokv.worker.handoff import store_slice_us as _store_slice_us

ROOT = Path(__file__).resolve().parent.parent
SLICE_US = 100
MATCH_US = 60  # on the fake clock: two matches use up a slice, one does not


class FakeTime:
    """Stands in for the worker's ``time`` module. The clock moves when a store call says
    so (``advance``) and, with ``tick_us``, at every read; ``sleep`` only records."""

    def __init__(self, tick_us: int = 0) -> None:
        self.now_us = 0
        self.tick_us = tick_us
        self.log: list[str] = []  # store calls and sleeps, in order
        self.slept: list[float] = []
        self.on_sleep = lambda: None

    def perf_counter(self) -> float:
        self.now_us += self.tick_us
        return self.now_us / 1e6

    def advance(self, us: int) -> None:
        self.now_us += us

    def sleep(self, seconds: float) -> None:
        self.log.append("sleep")
        self.slept.append(seconds)
        self.on_sleep()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    """The worker's clock and sleep, faked for one test."""
    fake = FakeTime()
    monkeypatch.setattr(aiokv.worker.thread, "time", fake)
    monkeypatch.setattr(aiokv.worker.handoff, "time", fake)
    return fake


def inbox_that_moves(clock: FakeTime) -> types.SimpleNamespace:
    """A stand-in for the worker's ``queue`` module whose inbox moves the fake clock on
    every blocking get, as if the store thread always waited there. (Whether it really
    blocks depends on when the loop's next item arrives; the counts below must not.)
    The non-blocking ``get_nowait`` between queued items leaves the clock alone."""

    class Inbox(queue.SimpleQueue):  # type: ignore[type-arg]
        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            clock.advance(1000)
            return super().get(block, timeout)

    return types.SimpleNamespace(SimpleQueue=Inbox, Empty=queue.Empty)


class SlowMatches(StoreWrapper):
    """Each match takes MATCH_US on the fake clock; advises a slice of SLICE_US."""

    store_slice_us = SLICE_US  # type: ignore[assignment]

    def __init__(self, inner: Store, clock: FakeTime) -> None:
        super().__init__(inner)
        self.clock = clock

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self.clock.log.append("put")
        self.clock.advance(MATCH_US)
        return super().put_match(token_ids, namespace)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self.clock.log.append("get")
        self.clock.advance(MATCH_US)
        return super().get_match(token_ids, namespace)

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        self.clock.log.append("launch")
        super().launch(task_ids, pages, ready)


# ---- config and its resolution -----------------------------------------------------


@pytest.mark.parametrize("value", [-1, True, "200", 1.5, 10**400])
def test_a_bad_store_slice_names_its_key(value: object) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        parse_config({"engine": {"store_slice_us": value}})
    assert caught.value.key == "engine.store_slice_us"


def test_store_slice_defaults_to_the_stores_advice_and_accepts_zero() -> None:
    assert aiokv.EngineConfig().store_slice_us is None
    assert parse_config({"engine": {"store_slice_us": 0}})[0].store_slice_us == 0
    assert parse_config({"engine": {"store_slice_us": None}})[0] == aiokv.EngineConfig()
    engine, _ = aiokv.load_config(ROOT / "configs" / "default.yml")
    assert engine == aiokv.EngineConfig()


def advising(slice_us: object) -> FakeStore:
    store = FakeStore(PAGE_SIZE)
    store.store_slice_us = slice_us  # type: ignore[attr-defined]
    return store


def test_the_slice_is_the_configs_else_the_stores_advice_else_zero() -> None:
    default = aiokv.EngineConfig()
    assert _store_slice_us(default, advising(250)) == 250
    assert _store_slice_us(aiokv.EngineConfig(store_slice_us=7), advising(250)) == 7
    assert _store_slice_us(aiokv.EngineConfig(store_slice_us=0), advising(250)) == 0  # 0 is set
    assert _store_slice_us(default, FakeStore(PAGE_SIZE)) == 0  # no advice
    assert _store_slice_us(default, advising(None)) == 0  # None: no advice either
    assert _store_slice_us(default, small_store()) == 0  # the local store's calls are short
    assert FlexKVStore.store_slice_us == 200
    # Wrappers pass the inner store's advice on, or its absence.
    assert _store_slice_us(default, SharedStore(advising(250))) == 250
    assert _store_slice_us(default, StoreWrapper(FakeStore(PAGE_SIZE))) == 0


@pytest.mark.parametrize("advice", [-1, True, "200", 1.5, 10**400])
def test_a_bad_advice_from_the_store_fails_engine_construction(
    advice: object, caches: list[torch.Tensor]
) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.OffloadEngine(advising(advice), caches)
    # The key a user sets to override the advice, and the store that gave it.
    assert caught.value.key == "engine.store_slice_us"
    assert "FakeStore" in str(caught.value)


# ---- the store thread --------------------------------------------------------------

USERS = 4
# Matches of 60 µs against a slice of 100 µs: a sleep once two matches ran since the
# thread woke or last slept (so before the launch too), never after each single match.
OFFLOADS_WITH_SLICE = ["put", "put", "sleep", "put", "put", "sleep", "launch"]
LOOKUPS_WITH_SLICE = ["get", "get", "sleep", "get", "get"]
WITH_SLICE = [*OFFLOADS_WITH_SLICE, *LOOKUPS_WITH_SLICE]
NEVER = ["put"] * USERS + ["launch"] + ["get"] * USERS


async def offload_users(engine: aiokv.OffloadEngine) -> list[aiokv.OffloadResult]:
    """USERS offloads of two pages each, submitted together (one batch, with
    max_batch_requests=USERS)."""
    calls = (engine.offload(u, torch.arange(2 * u, 2 * u + 2), 2 * PAGE_SIZE) for u in range(USERS))
    return await asyncio.wait_for(asyncio.gather(*calls), timeout=10)


def record_deliveries(
    monkeypatch: pytest.MonkeyPatch, clock: FakeTime
) -> tuple[list[Any], list[int]]:
    """Make each sleep of the store thread a real hand-over: it waits until the loop has
    run what was posted before it. Returns the requests in the order the loop received
    their outcomes, and how many had been received at each sleep."""
    delivered: list[Any] = []
    delivered_at_sleep: list[int] = []
    deliver = Resolver.deliver
    loop = asyncio.get_running_loop()

    def recording_deliver(self: Resolver, pairs: list[tuple[Any, object]]) -> None:
        delivered.extend(request for request, _ in pairs)
        deliver(self, pairs)

    def let_the_loop_run() -> None:
        caught_up = threading.Event()
        loop.call_soon_threadsafe(caught_up.set)  # runs after any deliver posted before it
        assert caught_up.wait(10)
        delivered_at_sleep.append(len(delivered))

    monkeypatch.setattr(Resolver, "deliver", recording_deliver)
    clock.on_sleep = let_the_loop_run
    return delivered, delivered_at_sleep


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("config_slice_us", "expected"),
    [(SLICE_US, WITH_SLICE), (None, WITH_SLICE), (0, NEVER)],
    ids=["on", "advised", "off"],  # None: the store's advice (SLICE_US); 0 overrides it
)
async def test_the_store_thread_sleeps_between_store_calls_once_its_slice_is_used(
    monkeypatch: pytest.MonkeyPatch,
    caches: list[torch.Tensor],
    clock: FakeTime,
    config_slice_us: int | None,
    expected: list[str],
) -> None:
    monkeypatch.setattr(aiokv.worker.thread, "queue", inbox_that_moves(clock))
    store = SlowMatches(small_store(), clock)
    # One batch of USERS offloads, then one of USERS lookups.
    config = aiokv.EngineConfig(
        window_us=10_000_000, max_batch_requests=USERS, store_slice_us=config_slice_us
    )
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        offloads = await offload_users(engine)
        hits = await asyncio.wait_for(
            asyncio.gather(*(engine.lookup(u, 2 * PAGE_SIZE) for u in range(USERS))), timeout=10
        )
        for hit in hits:
            hit.release()
    assert clock.log == expected
    assert clock.slept == [aiokv.worker.handoff._HANDOFF_S] * expected.count("sleep")
    # The pauses change nothing in the outcomes.
    assert [r.stored_tokens for r in offloads] == [2 * PAGE_SIZE] * USERS
    assert [h.cached_tokens for h in hits] == [2 * PAGE_SIZE] * USERS


@pytest.mark.asyncio
async def test_answers_gathered_before_a_hand_over_reach_their_callers_first(
    monkeypatch: pytest.MonkeyPatch, caches: list[torch.Tensor], clock: FakeTime
) -> None:
    # Every clock read is past the slice: the thread hands over at every point, among
    # them between each two of the answers that one try_wait gives (FakeStore answers a
    # whole launch at once).
    clock.tick_us = 2 * SLICE_US
    delivered, delivered_at_sleep = record_deliveries(monkeypatch, clock)
    config = aiokv.EngineConfig(
        window_us=10_000_000, max_batch_requests=USERS, store_slice_us=SLICE_US
    )
    async with aiokv.OffloadEngine(FakeStore(), caches, config) as engine:
        results = await offload_users(engine)
    # Before the thread took the last answer, the loop had the other USERS - 1.
    assert max(delivered_at_sleep) == USERS - 1
    # Early delivery loses and repeats nothing: each request arrived once.
    assert len(delivered) == USERS and len({id(r) for r in delivered}) == USERS
    assert [r.stored_tokens for r in results] == [2 * PAGE_SIZE] * USERS


class HeldFirstMatch(StoreWrapper):
    """The first get_match takes 2 slices and returns only once a second batch has been
    handed to the store thread, so that batch waits in the inbox behind the first."""

    def __init__(self, inner: Store, clock: FakeTime, second_batch_in: threading.Event) -> None:
        super().__init__(inner)
        self.clock = clock
        self.second_batch_in = second_batch_in
        self.matches = 0

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self.matches += 1
        if self.matches == 1:
            assert self.second_batch_in.wait(10)
            self.clock.advance(2 * SLICE_US)
        return super().get_match(token_ids, namespace)


@pytest.mark.asyncio
async def test_a_batch_finished_before_a_hand_over_between_batches_is_answered_first(
    monkeypatch: pytest.MonkeyPatch, caches: list[torch.Tensor], clock: FakeTime
) -> None:
    delivered, delivered_at_sleep = record_deliveries(monkeypatch, clock)
    second_batch_in = threading.Event()
    submit = aiokv.worker.thread.StoreWorker.submit

    def submit_and_note_the_second(self: aiokv.worker.thread.StoreWorker, item: Any) -> None:
        submit(self, item)
        if isinstance(item, Batch) and item.requests[0].user_id == "second":
            second_batch_in.set()

    monkeypatch.setattr(aiokv.worker.thread.StoreWorker, "submit", submit_and_note_the_second)
    store = HeldFirstMatch(FakeStore(), clock, second_batch_in)
    config = aiokv.EngineConfig(max_batch_requests=1, store_slice_us=SLICE_US)  # a batch each
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        first, second = await asyncio.wait_for(
            asyncio.gather(engine.lookup("first", PAGE_SIZE), engine.lookup("second", PAGE_SIZE)),
            timeout=10,
        )
    # One hand-over, between the two batches, with the first one's answer already out.
    assert delivered_at_sleep == [1]
    assert [r.user_id for r in delivered] == ["first", "second"]
    assert first.cached_tokens == second.cached_tokens == 0


class YieldsInsideTryWait(StoreWrapper):
    """A store with a yield point of its own (set_yield) inside try_wait, after two
    slices of someone else's Python, as FlexKVStore has after FlexKV's answers."""

    def __init__(self, inner: Store, clock: FakeTime) -> None:
        super().__init__(inner)
        self.clock = clock
        self.yield_point: Any = None

    def set_yield(self, callback: Any) -> None:  # type: ignore[override]
        self.yield_point = callback

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, Any]:
        answers = super().try_wait(task_ids)
        if answers:
            self.clock.advance(2 * SLICE_US)
            self.clock.log.append("answers")
            self.yield_point()
        return answers


@pytest.mark.asyncio
async def test_a_store_yield_point_hands_over_only_while_a_slice_is_set(
    monkeypatch: pytest.MonkeyPatch, caches: list[torch.Tensor], clock: FakeTime
) -> None:
    monkeypatch.setattr(aiokv.worker.thread, "queue", inbox_that_moves(clock))
    store = SharedStore(YieldsInsideTryWait(FakeStore(), clock))
    for slice_us in (0, SLICE_US):  # two engines, one after the other, on one store
        clock.log.clear()
        config = aiokv.EngineConfig(
            window_us=10_000_000, max_batch_requests=USERS, store_slice_us=slice_us
        )
        async with aiokv.OffloadEngine(store, caches, config) as engine:
            fresh = (  # new keys, so that each engine's offloads move something
                engine.offload(u, torch.arange(2 * u, 2 * u + 2), 2 * PAGE_SIZE,
                               namespace=[f"slice{slice_us}-u{u}"])
                for u in range(USERS)
            )
            await asyncio.wait_for(asyncio.gather(*fresh), timeout=10)
        answers = clock.log.index("answers")
        if slice_us:  # the second engine's yield point replaced the first's, and handed over
            assert clock.log[answers + 1] == "sleep"
        else:
            assert "sleep" not in clock.log
    # Closed, the engine took its callback back: the store's later calls (its own close,
    # on any thread) do not sleep on a dead engine's behalf.
    clock.log.clear()
    clock.advance(2 * SLICE_US)
    store.inner.yield_point()
    assert clock.log == []


@pytest.mark.asyncio
async def test_a_get_that_did_not_block_does_not_restart_the_slice(
    caches: list[torch.Tensor], clock: FakeTime
) -> None:
    # The fake clock stands still while the store thread waits on its (real) inbox, so
    # to the worker no get ever blocked: the slice runs on across batches, and the third
    # lookup's 60 µs match is the one that goes past it.
    store = SlowMatches(small_store(), clock)
    config = aiokv.EngineConfig(max_batch_requests=1, store_slice_us=SLICE_US)  # a batch each
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        for user in range(3):
            hit = await asyncio.wait_for(engine.lookup(user, PAGE_SIZE), timeout=10)
            assert hit.cached_tokens == 0
    assert clock.log == ["get", "get", "sleep", "get"]


class YieldsInsidePutMatch(StoreWrapper):
    """The first put_match fails; the second runs past the slice, calls the yield point,
    and answers a mask the batch cannot use, so the whole batch fails after it."""

    def __init__(self, inner: Store, clock: FakeTime) -> None:
        super().__init__(inner)
        self.clock = clock
        self.yield_point: Any = None
        self.matches = 0

    def set_yield(self, callback: Any) -> None:  # type: ignore[override]
        self.yield_point = callback

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self.matches += 1
        if self.matches == 1:
            raise RuntimeError("this one fails alone")
        task_id, _ = super().put_match(token_ids, namespace)
        self.clock.advance(2 * SLICE_US)
        self.yield_point()
        return task_id, np.array(True)  # 0-d: the batch's slot selection raises


@pytest.mark.asyncio
async def test_a_yield_point_inside_a_batch_posts_nothing(
    monkeypatch: pytest.MonkeyPatch, caches: list[torch.Tensor], clock: FakeTime
) -> None:
    # Posting the first request's error at the yield point would take it out of the
    # batch's outbox, and the batch's failure would then answer it a second time.
    delivered, delivered_at_sleep = record_deliveries(monkeypatch, clock)
    store = YieldsInsidePutMatch(small_store(), clock)
    config = aiokv.EngineConfig(
        window_us=10_000_000, max_batch_requests=2, store_slice_us=SLICE_US
    )
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(engine.offload(u, torch.arange(2 * u, 2 * u + 2), 2 * PAGE_SIZE)
                  for u in range(2)),
                return_exceptions=True,
            ),
            timeout=10,
        )
    assert delivered_at_sleep == [0]  # the hand-over happened, with nothing sent
    assert all(isinstance(r, aiokv.StoreError) for r in results)
    assert len(delivered) == 2 and len({id(r) for r in delivered}) == 2


@pytest.mark.asyncio
async def test_a_hand_over_that_fails_fails_its_batch_not_strands_it(
    caches: list[torch.Tensor], clock: FakeTime
) -> None:
    clock.tick_us = 2 * SLICE_US  # every point is past the slice

    def broken_sleep() -> None:
        raise RuntimeError("sleep broke")

    clock.on_sleep = broken_sleep
    config = aiokv.EngineConfig(max_batch_requests=1, store_slice_us=SLICE_US)
    async with aiokv.OffloadEngine(FakeStore(), caches, config) as engine:
        with pytest.raises(aiokv.StoreError, match="sleep broke"):
            await asyncio.wait_for(engine.lookup("u", PAGE_SIZE), timeout=10)
