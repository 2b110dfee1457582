"""aiokv.run_in_background: the engine on a loop thread of its own, called from threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import re
import threading
from collections import UserList
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import uvloop
from conftest import (
    PAGE_SIZE,
    held,
    hold_the_loop,
    make_caches,
    outcomes_in_a_forked_child,
    small_store,
)

import aiokv
from aiokv.testing import CheckingStore, FakeStore, FaultyStore, StoreWrapper

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def background(
    caches: list[torch.Tensor], store: aiokv.Store | None = None, **config: int
) -> aiokv.BackgroundEngine:
    engine = aiokv.OffloadEngine(
        store or small_store(), caches, aiokv.EngineConfig(**config)  # type: ignore[arg-type]
    )
    return aiokv.run_in_background(engine)


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiokv-loop"]


def test_blocking_round_trip_is_bit_exact_and_close_joins_the_thread(
    aiokv_kv_caches: list[torch.Tensor],
) -> None:
    caches = aiokv_kv_caches
    with background(caches) as kv:
        assert [t.name for t in loop_threads()] == ["aiokv-loop"]
        stored = kv.offload(7, torch.arange(0, 4), 4 * PAGE_SIZE)
        assert (stored.stored_tokens, stored.cached_tokens) == (16, 16)
        with kv.lookup(7, 4 * PAGE_SIZE) as hit:
            assert isinstance(hit, aiokv.BackgroundLookup)
            assert (hit.user_id, hit.cached_tokens, hit.held) == (7, 16, True)
            loaded = kv.load(hit, torch.arange(40, 44))
        assert loaded.loaded_tokens == 16
        assert all(torch.equal(c[40:44], c[0:4]) for c in caches)
        assert kv.stats().completed == 3
    assert loop_threads() == []
    assert kv.loop.is_closed()
    with pytest.raises(aiokv.EngineClosed):
        kv.offload(7, torch.arange(0, 4), 16)
    kv.close()  # idempotent


def test_the_loop_is_uvloop_unless_a_factory_says_otherwise() -> None:
    with background(make_caches()) as kv:
        assert isinstance(kv.loop, uvloop.Loop)
    engine = aiokv.OffloadEngine(small_store(), make_caches())
    with aiokv.run_in_background(engine, loop_factory=asyncio.new_event_loop) as kv:
        assert not isinstance(kv.loop, uvloop.Loop)
        assert kv.offload(1, torch.arange(0, 1), PAGE_SIZE).stored_tokens == PAGE_SIZE


def test_submitted_calls_from_one_thread_share_one_batch() -> None:
    # A 10 s window: only max_batch_requests can flush it, so one batch means the
    # futures really were in flight together.
    with background(make_caches(), window_us=10_000_000, max_batch_requests=16) as kv:
        futures = [kv.submit_offload(u, torch.arange(4 * u, 4 * u + 4), 16) for u in range(16)]
        assert all(isinstance(f, concurrent.futures.Future) for f in futures)
        done, _ = concurrent.futures.wait(futures, timeout=30)
        assert len(done) == 16
        assert [f.result().stored_tokens for f in futures] == [16] * 16
        assert kv.stats().batches == 1


def test_many_threads_through_one_handle(
    aiokv_kv_caches: list[torch.Tensor], aiokv_store_config: aiokv.StoreConfig
) -> None:
    caches = aiokv_kv_caches
    store = CheckingStore(aiokv.LocalStore(aiokv_store_config))
    with background(caches, store) as kv:
        store.loop_thread = loop_threads()[0].ident  # type: ignore[assignment]

        def user(u: int) -> bool:
            pages = torch.arange(4 * u, 4 * u + 2)
            kv.offload(u, pages, 8)
            hit = kv.submit_lookup(u, 8).result()
            target = torch.arange(4 * u + 2, 4 * u + 4)
            kv.submit_load(hit, target).result()
            return all(torch.equal(c[target], c[pages]) for c in caches)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(user, range(16))) == [True] * 16
        stats = kv.stats()
    assert (stats.completed, stats.failed) == (48, 0)
    assert store.problems() == []


def test_errors_cross_the_thread_boundary_with_their_type() -> None:
    with background(make_caches()) as kv:
        with pytest.raises(aiokv.InvalidRequest, match="num_tokens"):
            kv.offload(1, torch.arange(0, 1), 10 * PAGE_SIZE)
        future = kv.submit_offload(1, torch.arange(0, 1), -1)
        with pytest.raises(aiokv.InvalidRequest, match="num_tokens"):
            future.result()


def test_a_released_lookup_cannot_be_loaded_and_frees_its_task() -> None:
    with background(make_caches()) as kv:
        kv.offload(3, torch.arange(0, 2), 8)
        hit = kv.lookup(3, 8)
        releaser = threading.Thread(target=hit.release)
        releaser.start()
        releaser.join()
        # The release was scheduled on the loop before this load: it sees it released.
        with pytest.raises(aiokv.InvalidRequest, match="released"):
            kv.load(hit, torch.arange(10, 12))
        assert not hit.held
    assert kv.engine.stats().store_tasks_open == 0


def test_blocking_calls_from_the_loop_thread_raise_instead_of_deadlocking() -> None:
    with background(make_caches()) as kv:

        async def misuse() -> list[str]:
            names = []
            for call in (
                lambda: kv.offload(1, torch.arange(0, 1), 4),
                lambda: kv.lookup(1, 4),
                kv.stats,
                kv.close,
            ):
                with pytest.raises(aiokv.BlockingCallOnLoop, match="own thread") as info:
                    call()
                names.append(str(info.value).split("(")[0])
            # Submitting does not block, so it is allowed there.
            result = await asyncio.wrap_future(kv.submit_offload(2, torch.arange(1, 2), 4))
            assert result.stored_tokens == 4
            return names

        names = asyncio.run_coroutine_threadsafe(misuse(), kv.loop).result(timeout=30)
        assert names == ["offload", "lookup", "stats", "close"]
        assert kv.stats().completed == 1


def test_the_hint_of_a_blocking_call_on_the_loop_names_a_call_that_works_there() -> None:
    """What BlockingCallOnLoop tells a caller on the loop to do instead, done as it says:
    the engine's own call (awaited where the message says await) runs there, for stats()
    (the figures) and for close() (the engine closes; the handle's close() from this
    thread then ends the loop's thread)."""
    kv = background(make_caches())
    kv.offload(1, torch.arange(0, 1), 4)

    async def follow_the_hints() -> dict[str, Any]:
        done = {}
        for name in ("stats", "close"):
            with pytest.raises(aiokv.BlockingCallOnLoop) as info:
                getattr(kv, name)()
            hint = str(info.value).rsplit("on the loop, ", 1)[1]
            named = re.match(r"(?:call )?(await )?engine\.(\w+)\(", hint)
            assert named is not None, hint
            result = getattr(kv.engine, named[2])()
            done[name] = await result if named[1] else result
        return done

    try:
        done = asyncio.run_coroutine_threadsafe(follow_the_hints(), kv.loop).result(timeout=30)
        assert isinstance(done["stats"], aiokv.EngineStats)
        assert done["stats"].completed == 1
        assert kv.engine.state is aiokv.EngineState.CLOSED
    finally:
        kv.close()
    assert loop_threads() == []


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_the_hint_of_a_blocking_load_on_the_loop_names_a_load_that_works_there(
    loop_kind: str,
) -> None:
    """load() and load_layerwise() on the loop's thread, with the BackgroundLookup that
    the handle's lookup() returned: the hint's call, with the arguments it names, loads
    the offloaded pages there (it said "await engine.load(...)", and the engine refused
    the BackgroundLookup with InvalidRequest)."""
    caches = make_caches()
    kv = aiokv.run_in_background(
        aiokv.OffloadEngine(small_store(), caches), loop_factory=LOOPS[loop_kind])
    kv.offload(1, torch.arange(0, 2), 2 * PAGE_SIZE)
    targets = {"load": torch.arange(10, 12), "load_layerwise": torch.arange(20, 22)}
    hits = {name: kv.lookup(1, 2 * PAGE_SIZE) for name in targets}

    async def follow_the_hints() -> dict[str, int]:
        loaded = {}
        for name, page_ids in targets.items():
            given = {"hit": hits[name], "page_ids": page_ids}
            with pytest.raises(aiokv.BlockingCallOnLoop) as info:
                getattr(kv, name)(*given.values())
            hint = str(info.value).rsplit("on the loop, ", 1)[1]
            named = re.match(r"await engine\.(\w+)\(([^)]*)\)", hint)
            assert named is not None and named[1] == name, hint
            # "..." is the same arguments; else each named one, as the hint writes it.
            paths = [arg.strip().split(".") for arg in named[2].split(",")]
            args = list(given.values()) if named[2] == "..." else [
                functools.reduce(getattr, path[1:], given[path[0]]) for path in paths
            ]
            result = await getattr(kv.engine, name)(*args)
            if name == "load_layerwise":
                result = await result.result()
            loaded[name] = result.loaded_tokens
        return loaded

    try:
        loaded = asyncio.run_coroutine_threadsafe(follow_the_hints(), kv.loop).result(30)
    finally:
        kv.close()
    assert loaded == {"load": 2 * PAGE_SIZE, "load_layerwise": 2 * PAGE_SIZE}
    assert all(torch.equal(c[10:12], c[0:2]) and torch.equal(c[20:22], c[0:2]) for c in caches)
    assert loop_threads() == []


class FailingRegister(StoreWrapper):
    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        raise RuntimeError("register failed on purpose")


def test_a_failed_start_raises_and_stops_the_thread() -> None:
    engine = aiokv.OffloadEngine(FailingRegister(small_store()), make_caches())
    with pytest.raises(RuntimeError, match="on purpose"):
        aiokv.run_in_background(engine)
    assert loop_threads() == []
    assert engine.state is aiokv.EngineState.CLOSED


def test_an_engine_already_started_is_refused() -> None:
    engine = aiokv.OffloadEngine(small_store(), make_caches())

    async def started() -> None:
        await engine.start()
        with pytest.raises(aiokv.InvalidRequest, match="never started"):
            aiokv.run_in_background(engine)
        await engine.aclose()

    asyncio.run(started())
    assert loop_threads() == []


def test_concurrent_closes_share_one_close() -> None:
    kv = background(make_caches())
    kv.offload(1, torch.arange(0, 2), 8)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: kv.close(), range(4)))
    assert kv.engine.state is aiokv.EngineState.CLOSED
    assert loop_threads() == []


def test_evict_and_clear_through_the_facade() -> None:
    # FakeStore: the facade is under test here (the stores' own evict has tests of its own).
    with background(make_caches(), FakeStore()) as kv:
        for u in range(3):
            kv.offload(u, torch.arange(4 * u, 4 * u + 4), 16)
        assert kv.evict(0) == 16
        with kv.lookup(0, 16) as hit:
            assert hit.cached_tokens == 0
        assert kv.clear() == 32
        for u in (1, 2):
            with kv.lookup(u, 16) as hit:
                assert hit.cached_tokens == 0


@pytest.mark.parametrize("loop_kind", list(LOOPS))
def test_submitted_evicts_and_clears_run_after_the_calls_submitted_before_them(
        loop_kind: str) -> None:
    # Offloads, then an evict and a clear, all handed over while the loop is held: they
    # reach it in one iteration, and each invalidation still sees the offloads before it.
    engine = aiokv.OffloadEngine(small_store(), make_caches(), aiokv.EngineConfig(window_us=0))
    with aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind]) as kv:
        release = hold_the_loop(kv)
        offloads = [kv.submit_offload(u, torch.arange(4 * u, 4 * u + 4), 16) for u in range(3)]
        evicted = kv.submit_evict(0)
        more = kv.submit_offload(3, torch.arange(12, 16), 16)
        cleared = kv.submit_clear()
        release.set()
        assert [f.result(timeout=30).stored_tokens for f in [*offloads, more]] == [16] * 4
        assert evicted.result(timeout=30) == 16
        assert cleared.result(timeout=30) == 48
        with kv.lookup(3, 16) as hit:
            assert hit.cached_tokens == 0


@pytest.mark.parametrize("loop_kind", list(LOOPS))
def test_a_release_runs_after_the_load_submitted_before_it(loop_kind: str) -> None:
    # `with kv.lookup(...) as hit: future = kv.submit_load(hit, ...)`: the block's exit
    # releases the hit before the load ran. The loop is held so that both reach it in one
    # iteration, where a release that overtook the load failed it ("released").
    caches = make_caches()
    engine = aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig(window_us=0))
    with aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind]) as kv:
        kv.offload(1, torch.arange(0, 2), 8)
        with kv.lookup(1, 8) as hit:
            release = hold_the_loop(kv)
            loading = kv.submit_load(hit, torch.arange(4, 6))
        release.set()
        assert loading.result(timeout=30).loaded_tokens == 8
        assert all(torch.equal(c[4:6], c[0:2]) for c in caches)
        assert not hit.held
    assert engine.stats().store_tasks_open == 0


def test_a_call_cancelled_before_the_loop_took_it_never_runs() -> None:
    with background(make_caches()) as kv:
        release = hold_the_loop(kv)
        cancelled = kv.submit_offload(1, torch.arange(0, 2), 8)
        kept = kv.submit_offload(2, torch.arange(2, 4), 8)
        assert cancelled.cancel()
        release.set()
        assert kept.result(timeout=30).stored_tokens == 8
        assert cancelled.cancelled()
        assert concurrent.futures.wait([cancelled], timeout=30).not_done == set()
        with kv.lookup(1, 8) as hit:
            assert hit.cached_tokens == 0  # nothing of it reached the store
        assert kv.stats().completed == 2  # the kept offload and the lookup


@pytest.mark.parametrize("kind", ["torch", "numpy int32"])
def test_page_ids_on_the_cpu_are_the_callers_again_once_a_submit_returns(kind: str) -> None:
    # The loop takes the calls only after the caller has reused its id buffers: what is
    # stored, and where a load lands, are still the pages named at the submit.
    caches = make_caches()
    before = [c.clone() for c in caches]

    def ids(first: int) -> Any:
        if kind == "torch":
            return torch.arange(first, first + 4)
        return np.arange(first, first + 4, dtype=np.int32)

    def reused_at_once(kv: aiokv.BackgroundEngine, submit: Callable[[Any], Any], first: int,
                       reuse: int) -> Any:
        release = hold_the_loop(kv)
        page_ids = ids(first)
        future = submit(page_ids)
        page_ids[:] = reuse  # reused at once: the submit has returned
        release.set()
        return future.result(timeout=30)

    with background(caches) as kv:
        stored = reused_at_once(kv, lambda p: kv.submit_offload(1, p, 4 * PAGE_SIZE), 0, 60)
        assert stored.stored_tokens == 4 * PAGE_SIZE
        hit = kv.lookup(1, 4 * PAGE_SIZE)
        loaded = reused_at_once(kv, lambda p: kv.submit_load(hit, p), 20, 61)
        assert loaded.loaded_tokens == 4 * PAGE_SIZE
        hit = kv.lookup(1, 4 * PAGE_SIZE)
        layerwise = reused_at_once(kv, lambda p: kv.submit_load_layerwise(hit, p), 30, 62)
        assert layerwise.result(timeout=30).loaded_tokens == 4 * PAGE_SIZE
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[20:24], b[0:4])
        assert torch.equal(c[30:34], b[0:4])
        assert torch.equal(c[60:63], b[60:63])  # the reused ids named nothing that moved


class Names(list[str]):
    """A caller's own list type for its key's names."""


@pytest.mark.parametrize(("kind", "names_of"), [("torch", list), ("numpy", list),
                                                ("torch", Names), ("numpy", UserList)],
                         ids=["torch-list", "numpy-list", "torch-subclass",
                              "numpy-UserList"])
def test_token_ids_and_namespace_are_the_callers_again_once_a_submit_returns(
        kind: str, names_of: Callable[[list[str]], Any]) -> None:
    # As page ids: the loop takes the calls only after the caller has filled its token
    # id buffer and its namespace list with the next user's; the keys stored and looked
    # up are still those named at the submit.
    tokens = 4 * PAGE_SIZE

    def content(user: int) -> Any:
        ids = np.arange(user * 1000, user * 1000 + tokens, dtype=np.int64)
        return torch.from_numpy(ids) if kind == "torch" else ids

    with background(make_caches()) as kv:
        for user in (1, 2):
            release = hold_the_loop(kv)
            ids, names = content(user), names_of(["shared", f"user:{user}"])
            offload = kv.submit_offload(user, torch.arange(4 * user, 4 * user + 4), tokens,
                                        token_ids=ids, namespace=names)
            ids[:] = -1  # reused at once for the next call: the submit has returned
            names[1] = "user:reused-by-offload"
            release.set()
            assert offload.result(timeout=30).stored_tokens == tokens
        for user in (1, 2):
            release = hold_the_loop(kv)
            ids, names = content(user), names_of(["shared", f"user:{user}"])
            lookup = kv.submit_lookup(user, tokens, token_ids=ids, namespace=names)
            ids[:] = -1
            names[1] = "user:reused-by-lookup"  # not the offloads': a key neither stored
            release.set()
            with lookup.result(timeout=30) as hit:
                assert hit.cached_tokens == tokens  # stored under the key named, found so


def test_a_layerwise_load_cancelled_before_the_loop_took_it_counts_as_done() -> None:
    # concurrent.futures.wait and as_completed count a cancelled future done only once it
    # is marked notified; the layerwise load's future was left cancelled, never notified.
    with background(make_caches()) as kv:
        kv.offload(1, torch.arange(0, 2), 8)
        hit = kv.lookup(1, 8)
        release = hold_the_loop(kv)
        cancelled = kv.submit_load_layerwise(hit, torch.arange(8, 10))
        assert cancelled.cancel()
        release.set()
        assert concurrent.futures.wait([cancelled], timeout=30).not_done == set()
        assert list(concurrent.futures.as_completed([cancelled], timeout=30)) == [cancelled]


def test_a_lookup_cancelled_as_its_answer_comes_holds_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller cancels its future after the store answered, before the loop handed the
    # Lookup over: nobody will release it, so its reservation must go back now, not at
    # lookup_ttl_ms.
    store = small_store()
    with background(make_caches(), store, window_us=0, lookup_ttl_ms=600_000) as kv:
        kv.offload(1, torch.arange(0, 2), 8)
        gate = held(monkeypatch, type(store), "get_match")
        asked = kv.submit_lookup(1, 8)
        assert gate.entered.wait(30)  # the store thread is in the lookup's match
        release = hold_the_loop(kv)
        gate.set()  # answered: the answer waits for the loop
        threading.Event().wait(0.2)
        assert asked.cancel()
        release.set()
        with pytest.raises(concurrent.futures.CancelledError):
            asked.result(timeout=30)
        deadline = threading.Event()
        for _ in range(1000):
            if kv.stats().store_tasks_open == 0:
                break
            deadline.wait(0.01)
        assert kv.stats().store_tasks_open == 0
        with kv.lookup(1, 8) as hit:
            assert hit.cached_tokens == 8


def test_a_waiting_call_cancelled_by_its_caller_is_cancelled_in_the_engine() -> None:
    # A 10 s window that 4 requests would flush: the one offload waits in the batcher.
    with background(make_caches(), window_us=10_000_000, max_batch_requests=4) as kv:
        waiting = kv.submit_offload(1, torch.arange(0, 2), 8)
        while kv.stats().queued == 0:  # the loop took it
            threading.Event().wait(0.001)
        assert waiting.cancel()
        while kv.stats().cancelled == 0:
            threading.Event().wait(0.001)
        with pytest.raises(concurrent.futures.CancelledError):
            waiting.result()
        assert concurrent.futures.wait([waiting], timeout=30).not_done == set()
        assert kv.stats().queued == 0


def test_submits_racing_a_close_each_end_with_a_result_or_engine_closed() -> None:
    kv = background(make_caches(pages=256), window_us=200)
    futures: list[concurrent.futures.Future[aiokv.OffloadResult]] = []
    start = threading.Barrier(5)

    def submitter(first: int) -> None:
        start.wait()
        for u in range(first, first + 200):
            try:
                futures.append(kv.submit_offload(u, torch.arange(u % 256, u % 256 + 1), 4))
            except aiokv.EngineClosed:
                return

    threads = [threading.Thread(target=submitter, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    start.wait()
    while len(futures) < 40 and any(t.is_alive() for t in threads):
        threading.Event().wait(0.0001)
    kv.close()  # with submits still coming from the four threads
    for t in threads:
        t.join()
    assert len(futures) >= 40
    done, pending = concurrent.futures.wait(futures, timeout=30)
    assert not pending  # every accepted call ended: none lost on the way to the loop
    for f in done:
        error = f.exception()
        assert error is None or isinstance(error, aiokv.EngineClosed), error
        if error is None:
            assert f.result().stored_tokens == 4


@pytest.mark.parametrize(("args", "field"), [
    ((None,), "engine"), ((aiokv.EngineConfig(),), "engine"), (("engine",), "engine"),
])
def test_something_other_than_an_engine_is_refused_naming_it(args: Any, field: str) -> None:
    with pytest.raises(aiokv.InvalidRequest) as caught:
        aiokv.run_in_background(*args)
    assert caught.value.field == field and type(args[0]).__name__ in str(caught.value)
    assert loop_threads() == []


def test_a_loop_factory_that_makes_no_loop_is_refused() -> None:
    engine = aiokv.OffloadEngine(small_store(), make_caches())
    with pytest.raises(aiokv.InvalidRequest) as caught:
        aiokv.run_in_background(engine, loop_factory=5)  # type: ignore[arg-type]
    assert caught.value.field == "loop_factory" and "int" in str(caught.value)
    assert loop_threads() == []


def test_a_forked_child_gets_engine_closed_at_once_and_the_parent_goes_on() -> None:
    # A server that forks its workers after a preload (gunicorn --preload): the child
    # inherits the handle but not its loop thread. Its calls used to wait forever on
    # futures nothing would resolve, close(timeout=3) included.
    caches = make_caches()
    faulty = FaultyStore(small_store())
    with background(caches, faulty, window_us=0) as kv:
        kv.offload(7, torch.arange(0, 4), 4 * PAGE_SIZE)
        held = kv.lookup(7, 4 * PAGE_SIZE)  # held across the fork
        faulty.hold.clear()  # the layerwise load's end is held back: in flight at the fork
        layerwise = kv.load_layerwise(kv.lookup(7, 4 * PAGE_SIZE), torch.arange(20, 24))
        calls: list[tuple[str, Callable[[], object]]] = [
            ("offload", lambda: kv.offload(8, torch.arange(4, 8), 4 * PAGE_SIZE)),
            ("submit_lookup", lambda: kv.submit_lookup(7, 4 * PAGE_SIZE).result()),
            ("load", lambda: kv.load(held, torch.arange(40, 44))),
            ("layerwise_result", lambda: layerwise.result()),
            ("stats", lambda: kv.stats()),
            ("release", lambda: held.release()),
            ("close", lambda: kv.close(timeout=3)),
        ]
        try:
            said, _ = outcomes_in_a_forked_child(calls)
        finally:
            faulty.hold.set()
        assert list(said) == [name for name, _ in calls], said
        for name in ("offload", "submit_lookup", "load", "layerwise_result", "stats"):
            assert said[name].startswith("EngineClosed: "), (name, said[name])
            assert f"belongs to process {os.getpid()}" in said[name]
            assert "forked child must open an engine of its own" in said[name]
        assert said["release"] == "returned None" and said["close"] == "returned None"
        # The parent's engine is untouched: the held lookup still loads, the layerwise
        # load ends, new calls round-trip, all bit-exact.
        assert layerwise.result(timeout=30).loaded_tokens == 4 * PAGE_SIZE
        assert kv.load(held, torch.arange(40, 44)).loaded_tokens == 4 * PAGE_SIZE
        assert kv.offload(8, torch.arange(4, 8), 4 * PAGE_SIZE).stored_tokens == 4 * PAGE_SIZE
        with kv.lookup(8, 4 * PAGE_SIZE) as hit:
            assert kv.load(hit, torch.arange(50, 54)).loaded_tokens == 4 * PAGE_SIZE
        for c in caches:
            assert torch.equal(c[20:24], c[0:4]) and torch.equal(c[40:44], c[0:4])
            assert torch.equal(c[50:54], c[4:8])
        assert kv.stats().failed == 0
    assert loop_threads() == []
