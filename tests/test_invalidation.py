"""engine.evict / engine.clear: validated like offload, ordered on the store thread after
what was accepted before them, lookup reservations of the key given back first, a store
without the capability refused at the call, and nothing left open at close."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from conftest import PAGE_SIZE, make_caches

import aiokv
from aiokv.stores import ProcessStore
from aiokv.stores.shared import SharedStore
from aiokv.testing import CheckingStore, FakeStore, FaultyStore, StoreWrapper

TOKENS = 4 * PAGE_SIZE


def engine_over(store: aiokv.Store, **config: int) -> aiokv.OffloadEngine:
    return aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(**config))


@pytest.mark.asyncio
async def test_evict_drops_one_key_and_clear_drops_the_rest() -> None:
    async with engine_over(FakeStore()) as engine:
        for user in (1, "1", 2):
            await engine.offload(user, torch.arange(4), TOKENS)
        await engine.offload(3, torch.arange(4), TOKENS, namespace=["tenant", "3"])
        assert await engine.evict("1") == TOKENS  # the str id: its own key
        assert await engine.evict("1") == 0  # nothing left
        async with await engine.lookup(1, TOKENS) as kept:
            assert kept.cached_tokens == TOKENS  # the int id's key is untouched
        assert await engine.evict(99, namespace=["tenant", "3"]) == TOKENS
        assert await engine.clear() == 2 * TOKENS
        assert await engine.clear() == 0
        for user in (1, 2):
            async with await engine.lookup(user, TOKENS) as gone:
                assert gone.cached_tokens == 0


@pytest.mark.asyncio
async def test_evict_comes_after_the_offloads_accepted_before_it() -> None:
    # A long window: the offload is still queued in the batcher when evict is called (a
    # moment later; the window is waited out before both go).
    async with engine_over(FakeStore(), window_us=300_000) as engine:
        offload = asyncio.ensure_future(engine.offload(5, torch.arange(4), TOKENS))
        await asyncio.sleep(0)  # accepted, not dispatched
        assert engine.stats().batches == 0
        assert await engine.evict(5) == TOKENS  # the offload went first, then the evict
        assert (await offload).stored_tokens == TOKENS
        async with await engine.lookup(5, TOKENS) as hit:
            assert hit.cached_tokens == 0


@pytest.mark.asyncio
async def test_a_load_already_dispatched_finishes_before_the_evict() -> None:
    store = FaultyStore(FakeStore())
    async with engine_over(store) as engine:
        await engine.offload(1, torch.arange(4), TOKENS)
        hit = await engine.lookup(1, TOKENS)
        store.hold.clear()  # the load's copy "runs" until hold is set
        store.launched.clear()
        load = asyncio.ensure_future(engine.load(hit, torch.arange(8, 12)))
        await asyncio.to_thread(store.launched.wait)  # launched in the store
        evict = asyncio.ensure_future(engine.evict(1))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not evict.done() and not load.done()  # the evict waits for the load
        store.hold.set()
        assert (await load).loaded_tokens == TOKENS  # loaded the KV as it was
        assert await evict == TOKENS


@pytest.mark.asyncio
async def test_an_evict_behind_a_copy_that_does_not_end_times_out_dropping_nothing() -> None:
    # It waits for every copy launched before it; one that hangs must not hold the evict,
    # nor the calls behind it, past request_timeout_ms.
    store = FaultyStore(FakeStore())
    async with engine_over(store, window_us=0, request_timeout_ms=400) as engine:
        await engine.offload("b", torch.arange(8, 12), TOKENS)
        store.hold.clear()  # copies "run" until hold is set
        store.launched.clear()
        stuck = asyncio.ensure_future(engine.offload("a", torch.arange(0, 4), TOKENS))
        await asyncio.to_thread(store.launched.wait)
        try:
            began = asyncio.get_running_loop().time()
            with pytest.raises(aiokv.RequestTimeout, match=r"evict.*nothing was dropped"):
                await asyncio.wait_for(engine.evict("b"), 5)  # (a hang fails, too)
            assert asyncio.get_running_loop().time() - began < 2
            async with await engine.lookup("b", TOKENS) as hit:  # served, and still there
                assert hit.cached_tokens == TOKENS
        finally:
            store.hold.set()
        with pytest.raises(aiokv.RequestTimeout):
            await stuck
        assert await engine.evict("b") == TOKENS


class SlowEvict(StoreWrapper):
    """Its evict returns once ``answer`` is set (30 s at most), the key dropped: asked
    before the deadline, answered after it."""

    def __init__(self, inner: aiokv.Store) -> None:
        super().__init__(inner)
        self.answer = threading.Event()

    def evict(self, namespace: tuple[str, ...]) -> int:
        self.answer.wait(30)
        return int(self.inner.evict(namespace))


@pytest.mark.asyncio
async def test_an_evict_answered_after_its_deadline_counts_what_the_store_dropped() -> None:
    # The caller hears RequestTimeout ("it may have dropped the key"); the store drops
    # the key all the same, and dropped_tokens says so, as for a caller who left. The
    # store answers once the caller has its error, not after a fixed delay, and the
    # timeout leaves the offload before it room on a loaded host (at 100 ms, a loop
    # that lagged 150 ms failed that offload with RequestTimeout).
    store = SlowEvict(aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01)))
    async with engine_over(store, request_timeout_ms=1000) as engine:
        try:
            await engine.offload("a", torch.arange(0, 4), TOKENS)
            with pytest.raises(aiokv.RequestTimeout, match="may have dropped the key"):
                await engine.evict("a")
        finally:
            store.answer.set()
        deadline = asyncio.get_running_loop().time() + 10
        while not engine.stats().dropped_tokens:  # the store's evict answers now
            assert asyncio.get_running_loop().time() < deadline, engine.stats()
            await asyncio.sleep(0.01)
        assert engine.stats().dropped_tokens == TOKENS
        async with await engine.lookup("a", TOKENS) as hit:
            assert hit.cached_tokens == 0


@pytest.mark.asyncio
async def test_a_held_reservation_of_the_key_is_given_back_and_its_load_misses() -> None:
    store = CheckingStore(FakeStore())
    async with engine_over(store) as engine:
        for user in (1, 2):
            await engine.offload(user, torch.arange(4), TOKENS)
        evicted = await engine.lookup(1, TOKENS)
        other = await engine.lookup(2, TOKENS)
        assert await engine.evict(1) == TOKENS
        assert (await engine.load(evicted, torch.arange(8, 12))).loaded_tokens == 0
        assert (await engine.load(other, torch.arange(8, 12))).loaded_tokens == TOKENS
        evicted.release()  # consumed already: a no-op
        third = await engine.lookup(2, TOKENS)
        assert await engine.clear() == TOKENS  # gives back every reservation
        assert (await engine.load(third, torch.arange(8, 12))).loaded_tokens == 0
        assert engine.stats().store_tasks_open == 0
    assert store.problems() == []


@pytest.mark.asyncio
async def test_a_reservation_that_expires_after_an_evict_is_not_given_back_twice() -> None:
    store = CheckingStore(FakeStore())
    async with engine_over(store, lookup_ttl_ms=1) as engine:
        await engine.offload(1, torch.arange(4), TOKENS)
        hit = await engine.lookup(1, TOKENS)
        assert await engine.evict(1) == TOKENS
        hit.release()  # the store thread gave it back already: ignored there
        await engine.offload(2, torch.arange(4), TOKENS)  # a round trip after the release
    assert store.problems() == []


@contextlib.contextmanager
def store_of(kind: str, directory: Path) -> Iterator[aiokv.Store]:
    """A small store of ``kind``: embedded, in a process of its own, or a client of a
    store server (in a thread of this process)."""
    from conftest import small_store
    from shared_inprocess import Host

    if kind == "embedded":
        yield small_store()
    elif kind == "own_process":
        yield ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=True))
    else:
        host = Host(directory, ssd=False, cpu_cache_gb=0.01)
        host.start()
        try:
            yield SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
        finally:
            host.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["embedded", "own_process", "shared"])
async def test_a_lookup_given_back_by_an_evict_or_clear_no_longer_reads_held(
    kind: str, tmp_path: Path
) -> None:
    """It read held (state=held) after the evict had given its reservation back, so code
    that checks ``hit.held`` before a load was misled: it now reads evicted (cleared),
    its release gives nothing back twice, and its load still loads 0 tokens."""
    with store_of(kind, tmp_path) as inner:
        store = CheckingStore(inner)
        async with engine_over(store) as engine:
            for user in (1, 2):
                await engine.offload(user, torch.arange(4 * user, 4 * user + 4), TOKENS)
            evicted, kept = await engine.lookup(1, TOKENS), await engine.lookup(2, TOKENS)
            assert evicted.held and kept.held
            assert await engine.evict(1) == TOKENS
            assert (evicted.held, kept.held) == (False, True)
            assert repr(evicted) == f"Lookup(user_id=1, cached_tokens={TOKENS}, state=evicted)"
            evicted.release()  # given back already: nothing to give back
            assert "state=evicted" in repr(evicted)
            assert (await engine.load(evicted, torch.arange(20, 24))).loaded_tokens == 0
            assert not evicted.held
            with pytest.raises(aiokv.InvalidRequest, match="hit"):
                await engine.load(evicted, torch.arange(20, 24))  # consumed, as any Lookup
            again = await engine.lookup(2, TOKENS)
            assert await engine.clear() == TOKENS
            for hit in (kept, again):
                assert not hit.held
                assert repr(hit) == f"Lookup(user_id=2, cached_tokens={TOKENS}, state=cleared)"
            kept.release()
            assert (await engine.load(again, torch.arange(20, 24))).loaded_tokens == 0
            assert engine.stats().store_tasks_open == 0
        assert not kept.held and "state=cleared" in repr(kept)  # the close left it so
    assert store.problems() == []


def test_a_background_lookup_given_back_by_an_evict_no_longer_reads_held() -> None:
    from conftest import small_store

    with aiokv.run_in_background(engine_over(small_store())) as kv:
        kv.offload(1, torch.arange(4), TOKENS)
        hit = kv.lookup(1, TOKENS)
        assert hit.held
        assert kv.evict(1) == TOKENS
        assert not hit.held
        assert repr(hit) == f"BackgroundLookup(user_id=1, cached_tokens={TOKENS}, state=evicted)"
        hit.release()
        assert kv.load(hit, torch.arange(20, 24)).loaded_tokens == 0
        assert kv.stats().store_tasks_open == 0


class CannotInvalidate(StoreWrapper):
    def __init__(self, inner: aiokv.Store) -> None:
        super().__init__(inner)
        self.evict = None
        self.clear = None


@pytest.mark.asyncio
async def test_a_store_that_cannot_evict_is_refused_at_the_call() -> None:
    async with engine_over(CannotInvalidate(FakeStore())) as engine:
        with pytest.raises(aiokv.StoreError, match=r"CannotInvalidate\) cannot evict"):
            await engine.evict(1)
        with pytest.raises(aiokv.StoreError, match="cannot clear"):
            await engine.clear()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("user_id", "namespace", "field"),
    [(1.5, None, "user_id"), (True, None, "user_id"), (1, "uid:1", "namespace"),
     (1, [1], "namespace")],
)
async def test_evict_validates_its_key_as_offload_does(
    user_id: object, namespace: object, field: str
) -> None:
    async with engine_over(FakeStore()) as engine:
        with pytest.raises(aiokv.InvalidRequest) as raised:
            await engine.evict(user_id, namespace=namespace)  # type: ignore[arg-type]
        assert raised.value.field == field


@pytest.mark.asyncio
async def test_evict_and_clear_need_a_running_engine() -> None:
    engine = engine_over(FakeStore())
    with pytest.raises(aiokv.EngineClosed, match="not started"):
        await engine.evict(1)
    async with engine:
        pass
    with pytest.raises(aiokv.EngineClosed):
        await engine.clear()


class FailingEvict(StoreWrapper):
    def evict(self, namespace: Sequence[str]) -> int:
        raise RuntimeError("disk gone")


@pytest.mark.asyncio
async def test_a_store_error_in_evict_reaches_the_caller_and_the_engine_goes_on() -> None:
    async with engine_over(FailingEvict(FakeStore())) as engine:
        with pytest.raises(aiokv.StoreError, match="disk gone"):
            await engine.evict(1)
        assert (await engine.offload(1, torch.arange(4), TOKENS)).stored_tokens == TOKENS


@pytest.mark.asyncio
async def test_an_evict_the_store_thread_never_answers_fails_at_close() -> None:
    store = FaultyStore(FakeStore())
    engine = engine_over(store)
    await engine.start()
    await engine.offload(1, torch.arange(4), TOKENS)
    store.hold.clear()  # the next offload never ends while hold is clear
    store.launched.clear()
    offload = asyncio.ensure_future(engine.offload(2, torch.arange(4), TOKENS))
    await asyncio.to_thread(store.launched.wait)
    evict = asyncio.ensure_future(engine.evict(1))  # waits behind the stuck offload
    await engine.aclose(drain=False, timeout=0.1)
    with pytest.raises(aiokv.EngineClosed):
        await evict
    with pytest.raises(aiokv.EngineClosed):
        await offload
    store.hold.set()  # let the abandoned store thread finish
    await asyncio.to_thread(engine._worker.join)  # type: ignore[union-attr]


class CancelFails(StoreWrapper):
    """A store whose cancel raises its first ``failures`` times (then works)."""

    def __init__(self, inner: aiokv.Store, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures

    def cancel(self, task_ids: Sequence[int]) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("cancel failed")
        self.inner.cancel(task_ids)


@pytest.mark.asyncio
@pytest.mark.parametrize("failures, dropped", [(2, True), (50, False)])
async def test_an_evict_whose_give_back_fails_never_leaves_old_kv_to_be_found(
    failures: int, dropped: bool
) -> None:
    """The key's reservation is given back first; when that cancel raises, the store still
    holds the blocks and could not drop them. The evict cancels again before it drops
    (then the old KV is gone), or, when the store keeps failing, says so and drops
    nothing, rather than report the key evicted while its blocks stay findable."""
    from conftest import small_store

    store = CancelFails(small_store(), failures=0)
    async with engine_over(store) as engine:
        await engine.offload(1, torch.arange(4), TOKENS)
        held = await engine.lookup(1, TOKENS)
        assert held.cached_tokens == TOKENS
        store.failures = failures
        if dropped:
            assert await engine.evict(1) == TOKENS
        else:
            with pytest.raises(aiokv.StoreError, match="nothing was dropped"):
                await engine.evict(1)
            store.failures = 0
        async with await engine.lookup(1, TOKENS) as after:
            assert after.cached_tokens == (0 if dropped else TOKENS)
        held.release()
