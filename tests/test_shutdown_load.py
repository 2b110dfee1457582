"""Shutdown under load (issue 19, item 7): ``aclose`` with thousands of requests in flight
(launched, answers held back), dispatched but waiting behind a busy store thread, and
still queued in a window, some cancelled on the way. Every future resolves, no store task
is left open and the store contract holds."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import PAGE_SIZE
from test_ssd import PAGE, TARGET, USER_PAGES, caches_for, same, source_pages, ssd_config
from test_ssd import offload as offload_user
from test_sync import LOOPS

import aiokv
from aiokv.stores import ProcessStore
from aiokv.stores.base import BoolArray, Int64Array, Store
from aiokv.testing import CheckingStore, FakeStore, FaultyStore, StoreWrapper

# Requests of each phase. IN_FLIGHT fills whole batches: a partial one left in the queue
# would hold the full ones planned behind it for its whole window (the batcher bug of
# tests/test_batcher_windows.py, xfail).
BATCH = 64
IN_FLIGHT, BEHIND = 24 * BATCH, 1_500
TOKENS = 2 * PAGE_SIZE
SSD_TOKENS = USER_PAGES * PAGE  # a user's tokens in test_ssd's layout


class Gate(StoreWrapper):
    """While ``open`` is clear, ``put_match`` blocks the store thread (a store that is
    slow to answer): batches dispatched meanwhile wait in its inbox."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.open = threading.Event()
        self.open.set()
        self.blocked = threading.Event()  # set once a put_match waits at the gate

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        if not self.open.is_set():
            self.blocked.set()
            self.open.wait(30)
        return self.inner.put_match(token_ids, namespace)


async def eventually(condition: object, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


@pytest.mark.asyncio
@pytest.mark.parametrize("drain", [True, False])
async def test_a_close_with_thousands_queued_and_in_flight_resolves_every_future(
    drain: bool,
) -> None:
    rng = random.Random(int(drain))
    caches = [torch.zeros(8, 2, PAGE_SIZE, 2, 8)]  # FakeStore moves no data: pages repeat
    faulty = FaultyStore(FakeStore(PAGE_SIZE), seed=7, fail_rate=0.05, delay_s=0.01)
    gate = Gate(faulty)
    checked = CheckingStore(gate, loop_thread=threading.get_ident())
    loop_errors: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
    engine = aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(
        window_us=10_000_000, max_batch_requests=BATCH, max_pending=10 * (IN_FLIGHT + BEHIND),
        request_timeout_ms=0, lookup_ttl_ms=60_000,
    ))
    await engine.start()
    page_ids = torch.arange(2)

    def offload(user: int) -> asyncio.Future[object]:
        return asyncio.ensure_future(engine.offload(user, page_ids, TOKENS))

    # Reservations held by callers that never load nor release (the close cancels them).
    stored = await asyncio.gather(*(offload(-u) for u in range(1, BATCH + 1)), return_exceptions=True)
    lookups = await asyncio.gather(*(engine.lookup(-u, TOKENS) for u in range(1, BATCH + 1)))
    # (An offload answered FAILED by fail_rate may still be stored: the copy did end.)
    assert sum(hit.held for hit in lookups) >= sum(
        isinstance(r, aiokv.OffloadResult) for r in stored
    ) > 0
    # In flight: launched, their answers held back (but a window's worth: see below).
    faulty.hold.clear()
    calls = [offload(u) for u in range(IN_FLIGHT)]
    await eventually(lambda: engine.stats().store_tasks_open >= IN_FLIGHT * 0.9)
    # Behind a store thread blocked in put_match: dispatched batches wait in its inbox,
    # the last ones in a window; one in ten callers gives up on the way.
    gate.open.clear()
    behind = [offload(IN_FLIGHT + u) for u in range(BEHIND)]
    calls += behind
    await asyncio.to_thread(gate.blocked.wait, 10)
    for call in rng.sample(behind, BEHIND // 10):
        call.cancel()
    # Each phase's last partial batch stays queued in its window (window_us: 10 s).
    stats = engine.stats()
    assert stats.pending >= BEHIND * 0.8 and stats.store_tasks_open >= IN_FLIGHT * 0.9

    closing = asyncio.ensure_future(engine.aclose(drain=drain, timeout=20))
    await asyncio.sleep(0)  # the close has begun: queued requests are failed or drained
    gate.open.set()
    faulty.hold.set()
    await asyncio.wait_for(closing, 60)

    assert all(call.done() for call in calls)
    ends = Counter(
        "cancelled" if call.cancelled() else type(call.exception() or call.result()).__name__
        for call in calls
    )
    expected = {"OffloadResult", "StoreError", "cancelled"}
    if not drain:
        expected.add("EngineClosed")
    assert set(ends) <= expected, ends
    assert ends["OffloadResult"] >= IN_FLIGHT * 0.8  # launched work is never abandoned
    assert ends["StoreError"] > 0  # fail_rate: the injected failures came back too
    if not drain:
        assert ends["EngineClosed"] > 0  # a close without drain fails what is queued
    # (The Lookups themselves still read held: tests/test_misuse.py, xfail.)
    stats = engine.stats()
    resolved = stats.completed + stats.failed + stats.cancelled + stats.timed_out
    assert stats.pending == 0 and stats.submitted == resolved
    assert stats.store_tasks_open == 0
    assert checked.problems() == []
    assert loop_errors == []


def a_store(kind: str, directory: Path) -> aiokv.Store:
    """An SSD-backed store, embedded or in a process of its own (a store server's lookup of
    pages only its SSD holds reads them before it answers, or misses: no load of it waits
    for room once launched)."""
    config = ssd_config(directory)
    if kind == "own_process":
        return ProcessStore(dataclasses.replace(config, own_process=True))
    return aiokv.LocalStore(config)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["embedded", "own_process"])
@pytest.mark.parametrize("drain", [True, False])
async def test_a_close_gives_held_lookups_back_to_a_load_waiting_for_their_room(
    kind: str, drain: bool, tmp_path: Path
) -> None:
    """A layerwise load launched while held Lookups take every host block waits for room
    to stage its SSD pages. The close used to give those Lookups back only after the store
    thread had waited for that load: it took its whole timeout, failed the load with
    EngineClosed, and left the store thread (and the SSD directory) busy until the load's
    own 30 s deadline. The Lookups go back first now: the load completes, bit for bit,
    and the close returns with nothing left open."""
    caches = caches_for()
    original = [cache.clone() for cache in caches]
    # The Lookups' TTL (10 s by default) would give them back in the end: not before the
    # close's timeout here. The load's deadline: the default 30 s.
    engine = aiokv.OffloadEngine(a_store(kind, tmp_path), caches,
                                 aiokv.EngineConfig(lookup_ttl_ms=60_000))
    await engine.start()
    for user in range(4):
        await offload_user(engine, user)
    holds = [await engine.lookup(user, SSD_TOKENS) for user in (2, 3)]  # the host's blocks
    hit = await engine.lookup(0, SSD_TOKENS)  # user 0: on SSD only
    assert [hold.cached_tokens for hold in [*holds, hit]] == [SSD_TOKENS] * 3
    loading = await engine.load_layerwise(hit, TARGET)
    await eventually(lambda: engine.stats().stage_waits >= 1)
    layers = [asyncio.ensure_future(loading.layer_ready(i)) for i in range(len(caches))]

    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(engine.aclose(drain=drain, timeout=20), 60)
    assert loop.time() - began < 10  # it was the whole 20 s

    result = await asyncio.wait_for(loading.result(), 10)
    assert result.loaded_tokens == SSD_TOKENS
    await asyncio.wait_for(asyncio.gather(*layers), 10)
    assert same(caches, original, TARGET, source_pages(0))
    assert [hold.held for hold in holds] == [False, False]
    stats = engine.stats()
    assert stats.store_tasks_open == 0 and stats.pending == 0
    # The store is closed: its SSD directory opens again at once (in this process, for
    # either kind: what a store left open is the directory's lock, not a process's).
    async with aiokv.OffloadEngine(a_store("embedded", tmp_path), caches_for()) as again:
        (await again.lookup(0, SSD_TOKENS)).release()


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_a_close_after_the_loop_closed_cancels_reservations_before_a_load_waiting_for_room(
    loop_kind: str, tmp_path: Path
) -> None:
    """The loop that started the engine closed with it running, held Lookups taking every
    host block and a load launched waiting for room: nothing on that loop gives the
    Lookups back, and the store thread cancelled their reservations only after the
    launched tasks ended, that load among them (at its own 30 s deadline). The close
    (from another loop) took its whole timeout and left the thread and the SSD directory
    busy. The store thread cancels them as it stops now: the load ends, bit for bit."""
    caches = caches_for()
    original = [cache.clone() for cache in caches]
    engine = aiokv.OffloadEngine(aiokv.LocalStore(ssd_config(tmp_path)), caches,
                                 aiokv.EngineConfig(lookup_ttl_ms=60_000))
    home = LOOPS[loop_kind]()

    async def parked() -> list[aiokv.Lookup]:
        await engine.start()
        for user in range(4):
            await offload_user(engine, user)
        holds = [await engine.lookup(user, SSD_TOKENS) for user in (2, 3)]
        hit = await engine.lookup(0, SSD_TOKENS)  # user 0: on SSD only
        loading = await engine.load_layerwise(hit, TARGET)
        await eventually(lambda: engine.stats().stage_waits >= 1)
        assert not loading.is_ready(0)
        return holds

    holds = home.run_until_complete(parked())  # referenced: held until the close
    home.close()  # with the engine running

    async def close() -> float:
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(engine.aclose(timeout=20), 60)
        return loop.time() - began

    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        assert runner.run(close()) < 10  # it was the whole 20 s
        assert engine.state is aiokv.EngineState.CLOSED
        assert same(caches, original, TARGET, source_pages(0))  # launched: it completed
        assert engine.stats().store_tasks_open == 0
        # The store is closed: its SSD directory opens again at once.
        runner.run(aiokv.OffloadEngine(aiokv.LocalStore(ssd_config(tmp_path)),
                                       caches_for()).aclose())
    del holds


class LookupGate(StoreWrapper):
    """While ``open`` is clear, ``get_match`` blocks the store thread."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.open = threading.Event()
        self.open.set()
        self.blocked = threading.Event()  # set once a get_match waits at the gate

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        if not self.open.is_set():
            self.blocked.set()
            self.open.wait(30)
        return self.inner.get_match(token_ids, namespace)


@pytest.mark.asyncio
async def test_lookups_drained_by_a_close_go_back_to_a_load_waiting_for_their_room(
    tmp_path: Path,
) -> None:
    """Lookups the close drains (dispatched before it, answered after it began) take the
    host room that a launched load waits for: nothing could load them (the engine drains),
    yet they were given back only at the close's end, so the drain waited for that load
    until its timeout. They are given back as they are answered now: the load completes
    and the close returns at once; the drained lookups still resolve (read released)."""
    caches = caches_for()
    original = [cache.clone() for cache in caches]
    gate = LookupGate(aiokv.LocalStore(ssd_config(tmp_path)))
    engine = aiokv.OffloadEngine(gate, caches, aiokv.EngineConfig(lookup_ttl_ms=60_000))
    await engine.start()
    for user in range(4):
        await offload_user(engine, user)
    holds = [await engine.lookup(user, SSD_TOKENS) for user in (2, 3)]  # the host's blocks
    hit = await engine.lookup(0, SSD_TOKENS)  # user 0: on SSD only
    loading = asyncio.ensure_future(engine.load(hit, TARGET))
    await eventually(lambda: engine.stats().stage_waits >= 1)
    # Lookups of the same users, in one batch, held up in the store: answered once the
    # close has given the first two back, they hold the whole host tier again.
    gate.open.clear()
    drained = asyncio.gather(*(engine.lookup(user, SSD_TOKENS) for user in (2, 3)))
    await asyncio.to_thread(gate.blocked.wait, 10)

    loop = asyncio.get_running_loop()
    began = loop.time()
    closing = asyncio.ensure_future(engine.aclose(drain=True, timeout=20))
    await asyncio.sleep(0)  # the close has begun: the first two are given back
    gate.open.set()
    await asyncio.wait_for(closing, 60)
    assert loop.time() - began < 10  # it was the whole 20 s

    assert (await asyncio.wait_for(loading, 10)).loaded_tokens == SSD_TOKENS
    assert same(caches, original, TARGET, source_pages(0))
    lookups = await asyncio.wait_for(drained, 10)
    assert [lookup.cached_tokens for lookup in lookups] == [SSD_TOKENS] * 2
    assert not any(lookup.held for lookup in [*holds, *lookups])
    assert engine.stats().store_tasks_open == 0
