"""ProcessStore restarts a child that died (store.store_restarts): what was in flight fails
with a StoreError naming the exit, later calls are served by a new child (empty, caches
registered again), restarts are counted and bounded, and no future or store task is lost."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, make_caches, wait_for_exit
from shared_inprocess import Host

import aiokv
from aiokv.stores import ProcessStore
from aiokv.stores.base import TaskResult, TaskStatus
from aiokv.stores.restarts import STRIDE, Generations, how_it_ended, restart_delay_s
from aiokv.testing import CheckingStore, FaultyStore, SharedStore

TOKENS = 4 * PAGE_SIZE
KILLED = r"killed by signal 9 \(SIGKILL\)"


def child_store(restarts: int = 3) -> ProcessStore:
    return ProcessStore(
        aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=True, store_restarts=restarts)
    )


async def kill(store: ProcessStore) -> int:
    """SIGKILL the child and wait until it has exited; its pid."""
    pid = store.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(wait_for_exit, pid)
    return pid


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process, stopped or a zombie not yet reaped included."""
    return os.path.exists(f"/proc/{pid}")


def pages(user: int) -> torch.Tensor:
    return torch.arange(4 * user, 4 * user + 4)


@pytest.mark.asyncio
async def test_a_killed_child_fails_what_was_in_flight_and_a_new_child_serves() -> None:
    caches = make_caches()
    child = child_store()
    faulty = FaultyStore(child)  # hold: the answers of launched tasks wait in this process
    checking = CheckingStore(faulty)
    engine = aiokv.OffloadEngine(checking, caches, aiokv.EngineConfig(window_us=0))
    async with engine:
        assert (await engine.offload(0, pages(0), TOKENS)).stored_tokens == TOKENS
        faulty.hold.clear()
        faulty.launched.clear()
        in_flight = [asyncio.ensure_future(engine.offload(u, pages(u), TOKENS)) for u in (1, 2)]
        await asyncio.to_thread(faulty.launched.wait)
        first = await kill(child)
        faulty.hold.set()
        outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
        for outcome in outcomes:  # each in flight failed, naming the child and its end
            assert isinstance(outcome, aiokv.StoreError)
            assert f"pid {first}" in str(outcome)
            assert re.search(KILLED, str(outcome)), outcome
        # Later calls: a new child, empty, with the caches registered again.
        assert (await engine.offload(3, pages(3), TOKENS)).stored_tokens == TOKENS
        assert child.pid not in (None, first)
        async with await engine.lookup(0, TOKENS) as before:
            assert before.cached_tokens == 0  # stored in the dead child only
        hit = await engine.lookup(3, TOKENS)
        assert (await engine.load(hit, torch.arange(100, 104))).loaded_tokens == TOKENS
        assert all(torch.equal(c[100:104], c[12:16]) for c in caches)
        stats = engine.stats()
        assert (stats.store_restarts, stats.pending, stats.store_tasks_open) == (1, 0, 0)
    assert checking.problems() == []


@pytest.mark.asyncio
async def test_a_lookup_held_across_a_restart_fails_its_load_alone() -> None:
    # Its task was the dead child's; the load batched with it, matched by the new child,
    # failed with the same StoreError (the launch refused all of them), its bytes unloaded.
    caches = make_caches()
    child = child_store()
    checking = CheckingStore(child)
    config = aiokv.EngineConfig(window_us=200_000, max_batch_requests=2)
    async with aiokv.OffloadEngine(checking, caches, config) as engine:
        await asyncio.gather(engine.offload(0, pages(0), TOKENS),
                             engine.offload(9, pages(9), TOKENS))
        stale = (await asyncio.gather(engine.lookup(0, TOKENS), asyncio.sleep(0)))[0]
        first = await kill(child)
        await asyncio.gather(engine.offload(1, pages(1), TOKENS),
                             engine.offload(2, pages(2), TOKENS))
        fresh, other = await asyncio.gather(engine.lookup(1, TOKENS), engine.lookup(2, TOKENS))
        other.release()
        assert (stale.cached_tokens, fresh.cached_tokens) == (TOKENS, TOKENS)
        outcomes = await asyncio.gather(engine.load(stale, torch.arange(100, 104)),
                                        engine.load(fresh, torch.arange(104, 108)),
                                        return_exceptions=True)
        assert isinstance(outcomes[0], aiokv.StoreError)
        assert f"pid {first}" in str(outcomes[0]) and re.search(KILLED, str(outcomes[0]))
        assert not isinstance(outcomes[1], BaseException), outcomes[1]
        assert outcomes[1].loaded_tokens == TOKENS
        assert all(torch.equal(c[104:108], c[4:8]) for c in caches)
        stats = engine.stats()
        assert (stats.pending, stats.store_tasks_open) == (0, 0)
    assert checking.problems() == []


@pytest.mark.asyncio
async def test_restarts_are_bounded_then_every_call_fails_for_good() -> None:
    child = child_store(restarts=1)
    async with aiokv.OffloadEngine(child, make_caches()) as engine:
        await kill(child)
        # Killed while idle: the notice channel closed with it, so the next call starts a
        # new child first and does not fail (restart 1 of 1).
        assert (await engine.offload(0, pages(0), TOKENS)).stored_tokens == TOKENS
        assert engine.stats().failed == 0
        await kill(child)
        for user in (1, 2):
            with pytest.raises(aiokv.StoreError, match=r"no restart left \(store.store_restarts=1\)"):
                await engine.offload(user, pages(user), TOKENS)
        assert engine.stats().store_restarts == 1


@pytest.mark.asyncio
async def test_once_no_restart_is_left_the_dead_childs_ids_are_let_go() -> None:
    """Its reservations are given back (nothing stays open, nothing is owed) and an
    evict or clear says that the store is down, not that ids are still held."""
    child = child_store(restarts=0)
    engine = aiokv.OffloadEngine(child, make_caches(), aiokv.EngineConfig(window_us=0))
    async with engine:
        await engine.offload(0, pages(0), TOKENS)
        released, held = await engine.lookup(0, TOKENS), await engine.lookup(0, TOKENS)
        assert engine.stats().store_tasks_open == 2
        await kill(child)
        released.release()
        down = r"the store is down: .*killed by signal 9 \(SIGKILL\).*no restart left"
        with pytest.raises(aiokv.StoreError, match=down):
            await engine.evict(0)  # after the release (inbox order); gives back `held`
        assert engine.stats().store_tasks_open == 0
        with pytest.raises(aiokv.StoreError, match=down):
            await engine.clear()
        with pytest.raises(aiokv.StoreError, match=down):
            await engine.offload(1, pages(1), TOKENS)
        assert (await engine.load(held, pages(2))).loaded_tokens == 0  # given back: a miss
        stats = engine.stats()
        assert (stats.store_tasks_open, stats.pending, stats.store_restarts) == (0, 0, 0)


@pytest.mark.asyncio
async def test_a_child_that_dies_once_the_close_began_is_not_restarted() -> None:
    """The close's own calls (polls of what was launched, the reservations it gives
    back, the last figures) start no new child: a whole start, only to close it."""
    child = child_store()
    faulty = FaultyStore(child)  # hold: the answers of launched tasks wait in this process
    checking = CheckingStore(faulty)
    engine = aiokv.OffloadEngine(checking, make_caches(), aiokv.EngineConfig(window_us=0))
    await engine.start()
    await engine.offload(0, pages(0), TOKENS)
    held = await engine.lookup(0, TOKENS)  # left to the close to give back
    assert held.cached_tokens == TOKENS
    faulty.hold.clear()
    faulty.launched.clear()
    in_flight = [asyncio.ensure_future(engine.offload(u, pages(u), TOKENS)) for u in (1, 2)]
    await asyncio.to_thread(faulty.launched.wait)
    closing = asyncio.ensure_future(engine.aclose(timeout=60))
    await asyncio.sleep(0)  # the close began: it drains what was launched
    first = await kill(child)
    faulty.hold.set()
    await closing
    for outcome in await asyncio.gather(*in_flight, return_exceptions=True):
        assert isinstance(outcome, aiokv.StoreError), outcome
        assert f"pid {first}" in str(outcome) and re.search(KILLED, str(outcome)), outcome
    stats = engine.stats()
    assert (stats.store_restarts, stats.pending, stats.store_tasks_open) == (0, 0, 0)
    assert child.pid == first  # no other child was started
    assert checking.problems() == []


@pytest.mark.asyncio
async def test_a_close_right_after_a_death_starts_no_child_to_close_it() -> None:
    """Killed while idle, the child is replaced at once (its notice channel closed); a
    close that begins meanwhile cuts that start short, or keeps it from starting."""
    child = child_store()
    engine = aiokv.OffloadEngine(child, make_caches(), aiokv.EngineConfig(window_us=0))
    await engine.start()
    await engine.offload(0, pages(0), TOKENS)
    held = await engine.lookup(0, TOKENS)
    assert held.cached_tokens == TOKENS
    await kill(child)  # a new child's start (python, torch: seconds) may be under way
    await engine.aclose()
    stats = engine.stats()
    assert (stats.store_restarts, stats.pending, stats.store_tasks_open) == (0, 0, 0)
    assert stats.host_blocks_total > 0  # the dead child's last figures


@pytest.mark.asyncio
async def test_one_engines_close_does_not_end_restarts_of_a_store_that_serves_the_next() -> None:
    child = child_store()
    shared = SharedStore(child)  # the store outlives each engine on it
    caches = make_caches()
    try:
        async with aiokv.OffloadEngine(shared, caches) as first:
            await first.offload(0, pages(0), TOKENS)
        await kill(child)
        async with aiokv.OffloadEngine(shared, caches) as second:
            assert (await second.offload(1, pages(1), TOKENS)).stored_tokens == TOKENS
            assert second.stats().store_restarts == 1
    finally:
        shared.close_inner()


def test_a_child_that_does_not_answer_a_call_in_time_is_killed_and_replaced() -> None:
    """SIGSTOP stands for a store deadlocked in a call: the call fails within the
    store's bound instead of holding its caller for good, and a new child serves."""
    config = aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=True)
    store = ProcessStore(config, call_timeout_s=1.0)
    store.register(make_caches())
    tokens = np.arange(TOKENS, dtype=np.int64)
    first = store.pid
    assert first is not None
    try:
        store.cancel([store.put_match(tokens, ["before"])[0]])
        os.kill(first, signal.SIGSTOP)
        hung = rf"pid {first}\) was killed \(SIGKILL\): it did not answer put_match within 1 s"
        with pytest.raises(aiokv.StoreError, match=hung):
            store.put_match(tokens, ["hung"])
        assert not _exists(first)  # killed and reaped
        store.cancel([store.put_match(tokens, ["after"])[0]])  # a new child's answer
        assert store.restarts == 1 and store.pid != first
    finally:
        if _exists(first):
            os.kill(first, signal.SIGKILL)  # the test failed: leave no stopped process
        store.close()


def test_a_request_larger_than_the_socket_holds_is_bounded_too() -> None:
    """A child that stops reading leaves a large request (here 8 MiB of token ids) half
    sent: the send is bounded by the call's time as the wait for its answer is."""
    config = aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=True)
    store = ProcessStore(config, call_timeout_s=1.0)
    store.register(make_caches())
    first = store.pid
    assert first is not None
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            store.put_match(np.arange(1 << 20, dtype=np.int64), ["large"])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        os.kill(first, signal.SIGSTOP)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(20)
        assert outcome, "the send to a child that reads nothing never returned"
        assert isinstance(outcome[0], aiokv.StoreError)
        assert re.search(rf"pid {first}\) was killed \(SIGKILL\): it did not take "
                         r"put_match within 1 s", str(outcome[0]))
        tokens = np.arange(TOKENS, dtype=np.int64)
        store.cancel([store.put_match(tokens, ["after"])[0]])  # a new child's answer
        assert store.restarts == 1 and store.pid != first
    finally:
        if _exists(first):
            os.kill(first, signal.SIGKILL)  # the test failed: let the sender go
        store.close()


@pytest.mark.asyncio
async def test_a_child_dead_while_idle_is_restarted_before_the_next_call_even_unnoticed() -> None:
    """The notice channel's reader thread may not have seen the child's end when the next
    call comes: the child's exit status alone must start a new one first."""
    child = child_store()
    async with aiokv.OffloadEngine(child, make_caches()) as engine:
        await kill(child)
        child._notices.closed = False  # as if its reader thread had not run yet
        assert (await engine.offload(0, pages(0), TOKENS)).stored_tokens == TOKENS
        assert engine.stats().failed == 0 and engine.stats().store_restarts == 1


@pytest.mark.asyncio
async def test_a_child_killed_under_load_loses_no_future_and_leaks_no_task() -> None:
    caches = make_caches()
    child = child_store()
    checking = CheckingStore(child)
    engine = aiokv.OffloadEngine(checking, caches, aiokv.EngineConfig(window_us=0))
    users = range(1, 40)
    rng = random.Random(7)
    outcomes: list[object] = []
    busy = asyncio.Event()  # set once the load has been running for a while

    async def user_loop(user: int, rounds: int) -> None:
        for _ in range(rounds):
            for call in ("offload", "lookup"):
                try:
                    if call == "offload":
                        outcomes.append(await engine.offload(user, pages(user), TOKENS))
                    else:
                        hit = await engine.lookup(user, TOKENS)
                        target = torch.arange(200 + 4 * (user % 8), 204 + 4 * (user % 8))
                        outcomes.append(await engine.load(hit, target))
                except aiokv.StoreError as error:
                    outcomes.append(error)
                if len(outcomes) >= 200:
                    busy.set()
            await asyncio.sleep(rng.random() * 1e-3)

    async with engine:
        load = [asyncio.ensure_future(user_loop(u, 30)) for u in users]
        await busy.wait()
        await kill(child)
        await asyncio.gather(*load)
        # Served again afterwards, by one new child.
        await asyncio.gather(*(user_loop(u, 1) for u in users))
        assert engine.stats().store_restarts == 1
        assert engine.stats().pending == 0
        assert engine.stats().store_tasks_open == 0
    assert len(outcomes) == len(users) * 31 * 2  # every call came back
    errors = [o for o in outcomes if isinstance(o, aiokv.StoreError)]
    for error in errors:
        assert "killed by signal 9 (SIGKILL)" in str(error), error
    assert all(not isinstance(o, aiokv.StoreError) for o in outcomes[-len(users) * 2 :])
    assert checking.problems() == []


def test_ids_of_a_dead_child_answer_failed_saying_how_it_ended() -> None:
    ids = Generations()
    assert ids.split([1, 2]) == ([1, 2], [])
    ids.retire("the store process (pid 9) was killed by signal 9 (SIGKILL)")
    assert ids.match((1, None)) == (STRIDE + 1, None)  # type: ignore[arg-type]
    assert ids.split([2, STRIDE + 1]) == ([1], [2])
    answers = ids.results({1: TaskResult(TaskStatus.SUCCESS)}, [2])
    assert answers[STRIDE + 1].status is TaskStatus.SUCCESS
    assert answers[2].status is TaskStatus.FAILED and "pid 9" in answers[2].error


def test_exits_are_named_and_restarts_back_off() -> None:
    assert how_it_ended(5, -9) == "the store process (pid 5) was killed by signal 9 (SIGKILL)"
    assert how_it_ended(5, 3) == "the store process (pid 5) exited with code 3"
    assert [restart_delay_s(n) for n in (1, 2, 3, 10)] == [0.1, 0.2, 0.4, 5.0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_store_restarts_must_be_a_count(bad: object) -> None:
    with pytest.raises(aiokv.ConfigError, match=r"store\.store_restarts"):
        aiokv.StoreConfig(store_restarts=bad)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_child_killed_while_the_shared_server_is_away_serves_once_it_is_back(
        tmp_path: Path) -> None:
    """README (store server faults): while the server is away calls fail with StoreError,
    then work again once it is back, without a restart of the client. A child that dies
    meanwhile is no exception: its replacement must not spend the restart budget on a
    server that is not there yet."""
    host = Host(tmp_path, ssd=False)
    host.start()
    caches = make_caches()
    child = ProcessStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket),
                                           own_process=True))
    engine = aiokv.OffloadEngine(child, caches, aiokv.EngineConfig(window_us=0))
    try:
        async with engine:
            assert (await engine.offload(0, pages(0), TOKENS)).stored_tokens == TOKENS
            assert host.server is not None
            host.server.drain_timeout_s = 0.0
            await asyncio.to_thread(host.stop)
            await kill(child)
            with pytest.raises(aiokv.StoreError):  # the server is away: the call fails
                await engine.offload(1, pages(1), TOKENS)
            await asyncio.to_thread(host.start)
            assert (await engine.offload(5, pages(5), TOKENS)).stored_tokens == TOKENS
            async with await engine.lookup(5, TOKENS) as hit:
                assert hit.cached_tokens == TOKENS
                loaded = await engine.load(hit, torch.arange(200, 204))
            assert loaded.loaded_tokens == TOKENS
            assert all(torch.equal(c[200:204], c[20:24]) for c in caches)
    finally:
        await asyncio.to_thread(host.stop)
