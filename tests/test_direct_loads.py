"""A blocking load whose pages are all on the embedded store's host tier, queued by the
calling thread itself (aiokv.direct): the same bytes, results, errors and counts as a load
through the loop, with no batch of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop
from conftest import PAGE_SIZE, make_caches, outcomes_in_a_forked_child, small_store

import aiokv

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
TOKENS = 8 * PAGE_SIZE
ROOT = Path(__file__).resolve().parents[1]


def background(
    caches: list[torch.Tensor], loop: str, store: aiokv.LocalStore | None = None, **config: int
) -> aiokv.BackgroundEngine:
    engine = aiokv.OffloadEngine(store or small_store(), caches,
                                 aiokv.EngineConfig(window_us=0, **config))  # type: ignore[arg-type]
    return aiokv.run_in_background(engine, loop_factory=LOOPS[loop])


def source(user: int) -> torch.Tensor:
    return torch.arange(user * 8, user * 8 + 8)


def target(user: int) -> torch.Tensor:
    return torch.arange(128 + user * 8, 128 + user * 8 + 8)


def freed(kv: aiokv.BackgroundEngine) -> None:
    """Every host block is free again, once the store's figures caught up (they may be
    a refresh behind an evict's answer)."""
    deadline = time.monotonic() + 30  # a loaded runner
    while kv.stats().host_blocks_used:
        assert time.monotonic() < deadline, f"{kv.stats().host_blocks_used} blocks held"
        time.sleep(0.01)


def same(caches: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(torch.equal(cache[a], cache[b]) for cache in caches)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_load_of_host_pages_is_bit_exact_counted_and_makes_no_batch(loop: str) -> None:
    caches = make_caches()
    with background(caches, loop) as kv:
        for user in (1, 2):
            kv.offload(user, source(user), TOKENS)
        hits = [kv.lookup(user, TOKENS) for user in (1, 2)]
        before = kv.stats()
        results = [kv.load(hit, target(user)) for user, hit in zip((1, 2), hits, strict=True)]
        after = kv.stats()
        assert [(r.user_id, r.loaded_tokens) for r in results] == [(1, TOKENS), (2, TOKENS)]
        assert same(caches, source(1), target(1)) and same(caches, source(2), target(2))
        assert after.batches == before.batches  # neither went through the loop's batches
        assert after.completed - before.completed == 2
        assert after.loaded_tokens - before.loaded_tokens == 2 * TOKENS
        assert after.pending == 0
        assert [hit.held for hit in hits] == [False, False]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_hit_loads_once_whichever_way_the_second_load_goes(loop: str) -> None:
    with background(make_caches(), loop) as kv:
        kv.offload(3, source(3), TOKENS)
        hit = kv.lookup(3, TOKENS)
        assert kv.load(hit, target(3)).loaded_tokens == TOKENS
        with pytest.raises(aiokv.InvalidRequest, match="hit: reservation is loaded"):
            kv.load(hit, target(4))
        with pytest.raises(aiokv.InvalidRequest, match="hit: reservation is loaded"):
            kv.submit_load(hit, target(4)).result()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_released_or_expired_hit_is_refused_and_an_evicted_one_loads_nothing(
        loop: str) -> None:
    caches = make_caches()
    with background(caches, loop, lookup_ttl_ms=50) as kv:
        kv.offload(5, source(5), TOKENS)
        hit = kv.lookup(5, TOKENS)
        hit.release()
        with pytest.raises(aiokv.InvalidRequest, match="reservation is released"):
            kv.load(hit, target(5))
        hit = kv.lookup(5, TOKENS)
        time.sleep(0.3)
        with pytest.raises(aiokv.InvalidRequest, match="reservation is expired"):
            kv.load(hit, target(5))
        hit = kv.lookup(5, TOKENS)
        untouched = [cache[target(5)].clone() for cache in caches]
        assert kv.evict(5) == TOKENS
        assert kv.load(hit, target(5)).loaded_tokens == 0
        assert all(torch.equal(cache[target(5)], was)
                   for cache, was in zip(caches, untouched, strict=True))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_bad_page_id_fails_naming_page_ids_and_leaves_the_blocks_to_the_next_load(
        loop: str) -> None:
    caches = make_caches()
    with background(caches, loop) as kv:
        kv.offload(6, source(6), TOKENS)
        bad = target(6).clone()
        bad[3] = 10_000
        with pytest.raises(aiokv.InvalidRequest, match="page_ids: holds 10000, outside"):
            kv.load(kv.lookup(6, TOKENS), bad)
        twice = target(6).clone()
        twice[1] = twice[0]
        with pytest.raises(aiokv.InvalidRequest, match=r"page_ids: holds .* twice"):
            kv.load(kv.lookup(6, TOKENS), twice)
        with pytest.raises(aiokv.InvalidRequest, match="page_ids: has 2 pages"):
            kv.load(kv.lookup(6, TOKENS), target(6)[:2])
        assert kv.load(kv.lookup(6, TOKENS), target(6)).loaded_tokens == TOKENS
        assert same(caches, source(6), target(6))
        # Every read of the blocks ended: an evict drops them all, and nothing is left.
        assert kv.evict(6) == TOKENS
        assert kv.lookup(6, TOKENS).cached_tokens == 0
        freed(kv)


def race(kv: aiokv.BackgroundEngine, caches: list[torch.Tensor], user: int,
         evicts: bool) -> None:
    """One thread loads a hit while another releases it and a third evicts its key (or
    not): the load brings the bytes, refuses (released first) or loads nothing (evicted
    first); never a half, never a hang."""
    kv.offload(user, source(user), TOKENS)
    hit = kv.lookup(user, TOKENS)
    outcome: list[object] = []
    go = threading.Barrier(3)

    def load() -> None:
        go.wait()
        try:
            outcome.append(kv.load(hit, target(user)).loaded_tokens)
        except aiokv.InvalidRequest as exc:
            outcome.append(str(exc))

    def release() -> None:
        go.wait()
        hit.release()

    def evict() -> None:
        go.wait()
        if evicts:
            kv.evict(user)

    threads = [threading.Thread(target=f) for f in (load, release, evict)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    (got,) = outcome
    assert got in (TOKENS, 0) or "reservation is released" in str(got), got
    if got == TOKENS:
        assert same(caches, source(user), target(user))


@pytest.mark.parametrize("loop", LOOPS)
def test_threads_that_load_release_and_evict_the_same_hits_lose_nothing(loop: str) -> None:
    caches = make_caches()
    with background(caches, loop, lookup_ttl_ms=600_000) as kv:
        for round_ in range(12):
            user = 8 + round_ % 4
            race(kv, caches, user, evicts=bool(round_ % 2))
            kv.evict(user)
        # Every read of the blocks ended: nothing is left held.
        freed(kv)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_close_while_threads_load_answers_each_load_whole_or_refused(loop: str) -> None:
    caches = make_caches()
    kv = background(caches, loop)
    for user in range(4):
        kv.offload(user, source(user), TOKENS)
    hits = [kv.lookup(user, TOKENS) for user in range(4)]
    outcomes: list[object] = []
    go = threading.Barrier(5)

    def load(user: int) -> None:
        go.wait()
        try:
            outcomes.append(kv.load(hits[user], target(user)).loaded_tokens)
        except BaseException as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=load, args=(user,)) for user in range(4)]
    for thread in threads:
        thread.start()
    go.wait()
    kv.close()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert len(outcomes) == 4
    for got in outcomes:
        assert got == TOKENS or isinstance(got, aiokv.EngineClosed), got
    loaded = [u for u in range(4) if same(caches, source(u), target(u))]
    assert len(loaded) >= sum(1 for got in outcomes if got == TOKENS)


def held_cancel(store: aiokv.LocalStore) -> tuple[threading.Event, threading.Event]:
    """The store's next cancel of some task (an evict giving its key's reservations
    back, after it marked them) held: (``marked``, set once it is held; ``loaded``, set
    by the test to let it go on)."""
    marked, loaded = threading.Event(), threading.Event()
    armed = [True]
    cancel = store.cancel

    def slow_cancel(task_ids: list[int]) -> None:
        if armed[0] and task_ids:
            armed[0] = False
            marked.set()
            loaded.wait(10)
        cancel(task_ids)

    store.cancel = slow_cancel  # type: ignore[method-assign]
    return marked, loaded

def recsys_hit_an_evict_will_mark(loop: str) -> tuple[Any, Any, aiokv.EngineStats,
                                                       threading.Event, threading.Event]:
    """A recsys core holding user 5's hit, whose next load passes the engine's checks,
    says so (``checked``), then goes on only once an evict made meanwhile marked the hit
    given back on the store thread; that evict's cancel is held until ``loaded`` is set.
    Returns (core, hit, the stats before the load, checked, loaded)."""
    from aiokv.integrations.recsys_core import RecsysCore

    store = small_store()
    takes_load = store.takes_load
    checked = threading.Event()

    def late_takes_load(task_id: int) -> bool:
        checked.set()
        assert marked.wait(10)
        return takes_load(task_id)

    core = RecsysCore(background(make_caches(), loop, store))
    core.offload([5], [source(5)], [TOKENS]).outcomes()
    (hit,) = core.lookup([5], [TOKENS])
    assert hit is not None
    before = core.kv.stats()
    marked, loaded = held_cancel(store)
    store.takes_load = late_takes_load  # type: ignore[method-assign]
    return core, hit, before, checked, loaded

def pause_release_in(core: Any, loader: threading.Thread
                     ) -> tuple[threading.Event, threading.Event]:
    """The store's release hand-over that ``loader`` makes as it finishes its group pauses
    there (as a preempted thread would): ``finishing`` is set as it begins, and it goes on
    once ``go`` is. Returns (finishing, go)."""
    worker = core.kv.engine._worker
    assert worker is not None
    release = worker.release
    finishing, go = threading.Event(), threading.Event()

    def paused_release(task_ids: object) -> None:
        if threading.current_thread() is loader:
            finishing.set()
            go.wait(10)  # the thread is preempted here while the close runs
        release(task_ids)  # type: ignore[arg-type]

    worker.release = paused_release  # type: ignore[method-assign, assignment]
    return finishing, go




@pytest.mark.parametrize("loop", LOOPS)
def test_a_hit_that_reads_evicted_loads_nothing_while_the_store_gives_it_back(
        loop: str) -> None:
    # The store thread marks the key's reservations evicted, then gives them back to the
    # store (its cancel): a load made in between, of a Lookup that already reads
    # evicted, must load nothing (a miss, as through the loop), never the evicted KV.
    store = small_store()
    marked, loaded = held_cancel(store)
    caches = make_caches()
    with background(caches, loop, store=store) as kv:
        kv.offload(5, source(5), TOKENS)
        hit = kv.lookup(5, TOKENS)
        untouched = [cache[target(5)].clone() for cache in caches]
        evicted = kv.submit_evict(5)
        assert marked.wait(10)
        assert not hit.held
        outcome: list[int] = []
        loader = threading.Thread(
            target=lambda: outcome.append(kv.load(hit, target(5)).loaded_tokens))
        try:
            loader.start()
            loader.join(0.3)  # through the loop, it waits for the store thread
        finally:
            loaded.set()
        loader.join(10)
        assert outcome == [0]
        assert all(torch.equal(cache[target(5)], was)
                   for cache, was in zip(caches, untouched, strict=True))
        assert evicted.result(10) == TOKENS
        freed(kv)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_evict_while_a_load_copies_drops_the_key_whole_after_it(
        loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A load whose copies are under way (as on a GPU, where they take milliseconds) was
    # taken before the evict reached the store: the evict waits for it, as for a load
    # the loop dispatched before it, and drops every block of the key.
    from aiokv.copy.copier import Copier

    copying, go = threading.Event(), threading.Event()
    loaders: list[threading.Thread] = []
    move = Copier._move_cpu

    def slow_move(self: Copier, job: object) -> None:
        if threading.current_thread() in loaders:
            copying.set()
            go.wait(10)
        move(self, job)  # type: ignore[arg-type]

    monkeypatch.setattr(Copier, "_move_cpu", slow_move)
    caches = make_caches()
    with background(caches, loop) as kv:
        kv.offload(5, source(5), TOKENS)
        hit = kv.lookup(5, TOKENS)
        outcome: list[int] = []
        loader = threading.Thread(
            target=lambda: outcome.append(kv.load(hit, target(5)).loaded_tokens))
        loaders.append(loader)
        loader.start()
        try:
            assert copying.wait(10)
            evicted = kv.submit_evict(5)
            concurrent.futures.wait([evicted], timeout=1)
        finally:
            go.set()
        loader.join(10)
        assert outcome == [TOKENS]
        assert same(caches, source(5), target(5))
        assert evicted.result(10) == TOKENS
        assert kv.lookup(5, TOKENS).cached_tokens == 0
        freed(kv)


def test_a_forked_child_gets_engine_closed_from_the_recsys_load_as_from_its_offload() -> None:
    # A child forked beside a recsys core: its load must be refused at the call, as every
    # other call of the core is, saying why (the engine is its parent's), and the parent's
    # hit stays loadable.
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches(pages=64)
    core = RecsysCore.open({"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 0.01}},
                           caches)
    try:
        tokens = 4 * core.page_size
        core.offload([1], [torch.arange(0, 4)], [tokens]).outcomes()
        hits = core.lookup([1], [tokens])
        said, _ = outcomes_in_a_forked_child([
            ("load", lambda: core.load(hits, [torch.arange(20, 24)]).outcomes()),
            ("offload", lambda: core.offload([2], [torch.arange(4, 8)], [tokens]).outcomes()),
        ])
        for name in ("load", "offload"):
            assert said[name].startswith("EngineClosed: "), (name, said[name])
            assert "forked child must open an engine of its own" in said[name]
        assert [r.loaded_tokens for r in core.load(hits, [torch.arange(20, 24)]).outcomes()
                ] == [tokens]
        assert all(torch.equal(c[20:24], c[0:4]) for c in caches)
    finally:
        core.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_load_made_after_an_evict_of_its_key_loads_nothing_while_the_evict_waits(
        loop: str) -> None:
    # The thread's evict was accepted (on the store thread's inbox, behind an offload the
    # store is slow to launch), then the thread loads a hit of that key: the load comes
    # after the evict, as through the loop, and loads nothing, never the evicted KV.
    store = small_store()
    blocked, go = threading.Event(), threading.Event()
    armed = [False]
    launch = store.launch

    def slow_launch(*args: object, **kwargs: object) -> None:
        if armed[0]:
            armed[0] = False
            blocked.set()
            go.wait(10)
        launch(*args, **kwargs)  # type: ignore[arg-type]

    store.launch = slow_launch  # type: ignore[method-assign]
    caches = make_caches()
    with background(caches, loop, store=store) as kv:
        kv.offload(5, source(5), TOKENS)
        hit = kv.lookup(5, TOKENS)
        untouched = [cache[target(5)].clone() for cache in caches]
        armed[0] = True
        offloaded = kv.submit_offload(9, source(9), TOKENS)
        outcome: list[int] = []
        try:
            assert blocked.wait(10)
            evicted = kv.submit_evict(5)
            deadline = time.monotonic() + 10
            while kv.portal.in_hand():  # the evict is on the store thread's inbox
                assert time.monotonic() < deadline
                time.sleep(0.001)
            loader = threading.Thread(
                target=lambda: outcome.append(kv.load(hit, target(5)).loaded_tokens))
            loader.start()
            loader.join(0.3)
        finally:
            go.set()
        loader.join(10)
        assert outcome == [0]
        assert all(torch.equal(cache[target(5)], was)
                   for cache, was in zip(caches, untouched, strict=True))
        assert evicted.result(10) == TOKENS
        assert offloaded.result(10).stored_tokens == TOKENS


@pytest.mark.parametrize("loop", LOOPS)
def test_loads_a_thread_queued_before_a_close_are_in_the_close_s_final_figures(
    loop: str,
) -> None:
    # The recsys core's load returns before its loads are waited for; a close made
    # then answers them LoadResults, and its final figures count them as the loop's
    # drain would have.
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    core = RecsysCore(background(caches, loop))
    users = [1, 2]
    core.offload(users, [source(u) for u in users], [TOKENS] * 2).outcomes()
    hits = core.lookup(users, [TOKENS] * 2)
    before = core.kv.stats()
    pending = core.load(hits, [target(u) for u in users])
    core.close()
    outcomes = pending.outcomes()
    assert [(r.user_id, r.loaded_tokens) for r in outcomes] == [(1, TOKENS), (2, TOKENS)]
    assert same(caches, source(1), target(1)) and same(caches, source(2), target(2))
    after = core.kv.stats()
    assert after.completed - before.completed == 2
    assert after.loaded_tokens - before.loaded_tokens == 2 * TOKENS
    assert after.submitted - before.submitted == 2


# A daemon thread loading (128 MiB a load, its copies run by that thread) while the main
# thread returns, the engine never closed.
_EXIT_MID_LOAD = """
import threading, time, torch, aiokv
caches = [torch.randn(256, 2, 16, 8, 128) for _ in range(8)]
store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.2))
kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0)))
kv.offload(1, torch.arange(0, 128), 128 * 16)
loading = threading.Event()
target = torch.arange(128, 256)  # made here: a torch call of its own in the thread could abort too
def loads():
    while True:
        hit = kv.lookup(1, 128 * 16)
        loading.set()
        kv.load(hit, target)
threading.Thread(target=loads, daemon=True).start()
loading.wait(30)
time.sleep(0.1)
print("exits", flush=True)
"""


def exits_cleanly(script: str) -> None:
    """``script`` in a process of its own: it exits with 0, having printed only "exits"
    (no abort, no outcome its daemon thread should never have been told)."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["exits"], (done.stdout, done.stderr[-2000:])


def test_a_process_exiting_while_a_thread_loads_exits_cleanly() -> None:
    # The thread's load ran its torch copies in that thread (aiokv.direct), a daemon the
    # exit did not wait for: inside them when the interpreter finalized, CPython ended
    # it there, std::terminate, the process aborted (SIGABRT, 5 runs in 5).
    exits_cleanly(_EXIT_MID_LOAD)


@pytest.mark.parametrize("loop", LOOPS)
def test_bytes_a_thread_loaded_before_a_close_are_in_the_store_s_final_figures(
    loop: str,
) -> None:
    # The copies of a recsys load nobody waited for before the close were reported in
    # the store's close, after which nothing took them in: bytes_h2d (and the metric
    # aiokv_bytes_total{direction="h2d"}) read 0 for bytes that were loaded.
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    store = small_store()
    core = RecsysCore(background(caches, loop, store))
    users = [1, 2]
    core.offload(users, [source(u) for u in users], [TOKENS] * 2).outcomes()
    hits = core.lookup(users, [TOKENS] * 2)
    pending = core.load(hits, [target(u) for u in users])
    core.close()
    assert [r.loaded_tokens for r in pending.outcomes()] == [TOKENS, TOKENS]
    block_bytes = sum(c[0].numel() * c.element_size() for c in caches)
    assert store.store_stats()["bytes_h2d"] == 2 * 8 * block_bytes


def closed_while_held(core: Any, loader: threading.Thread, held: threading.Event,
                      go: threading.Event, got: list[Any]) -> Any:
    """Start ``loader``; once it is ``held``, close ``core`` from a thread of its own,
    then let the loader go on (``go``): neither hangs; the loader's outcomes."""
    loader.start()
    try:
        assert held.wait(10)
        closer = threading.Thread(target=core.close)
        closer.start()
        closer.join(1.0)  # the close ends without that thread, or waits for it
    finally:
        go.set()
    loader.join(10)
    closer.join(10)
    assert not loader.is_alive() and not closer.is_alive()
    (outcomes,) = got
    return outcomes


def counted(core: Any, before: aiokv.EngineStats, loads: int) -> None:
    """The close's final figures hold ``loads`` more completed loads of TOKENS each."""
    after = core.kv.stats()
    assert after.completed - before.completed == loads
    assert after.loaded_tokens - before.loaded_tokens == loads * TOKENS


@pytest.mark.parametrize("loop", LOOPS)
def test_loads_a_thread_queued_as_a_close_began_are_in_the_close_s_final_figures(
        loop: str) -> None:
    # A recsys load whose copies were queued (take_loads returned) just before a close
    # began, its thread not yet back in the engine: the close must still count it in its
    # final figures, as it counts the loads queued before it (nobody else can: the loop
    # is gone by the time that thread waits).
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    store = small_store()
    core = RecsysCore(background(caches, loop, store))
    users = [1, 2]
    core.offload(users, [source(u) for u in users], [TOKENS] * 2).outcomes()
    hits = core.lookup(users, [TOKENS] * 2)
    before = core.kv.stats()
    queued, go = threading.Event(), threading.Event()
    take_loads = store.take_loads

    def take_then_pause(*args: object, **kwargs: object) -> object:
        taken = take_loads(*args, **kwargs)  # type: ignore[arg-type]
        queued.set()
        go.wait(10)  # the thread is preempted here while the close runs
        return taken

    store.take_loads = take_then_pause  # type: ignore[method-assign, assignment]
    got: list[object] = []
    loader = threading.Thread(target=lambda: got.append(
        core.load(hits, [target(u) for u in users]).outcomes()))
    outcomes = closed_while_held(core, loader, queued, go, got)
    assert [r.loaded_tokens for r in outcomes] == [TOKENS, TOKENS]  # type: ignore[attr-defined]
    assert same(caches, source(1), target(1)) and same(caches, source(2), target(2))
    counted(core, before, loads=2)


@pytest.mark.parametrize("loop", LOOPS)
def test_loads_a_thread_was_finishing_as_a_close_ran_are_in_the_close_s_final_figures(
        loop: str) -> None:
    # A thread waiting for its recsys loads as the close runs: the close finds them
    # finished by that thread, whose counts must still reach the figures before they are
    # final (the loop then takes no more).
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    core = RecsysCore(background(caches, loop))
    users = [1, 2]
    core.offload(users, [source(u) for u in users], [TOKENS] * 2).outcomes()
    hits = core.lookup(users, [TOKENS] * 2)
    before = core.kv.stats()
    pending = core.load(hits, [target(u) for u in users])
    got: list[object] = []
    loader = threading.Thread(target=lambda: got.append(pending.outcomes()))
    finishing, go = pause_release_in(core, loader)
    outcomes = closed_while_held(core, loader, finishing, go, got)
    assert [r.loaded_tokens for r in outcomes] == [TOKENS, TOKENS]  # type: ignore[attr-defined]
    counted(core, before, loads=2)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_recsys_load_an_evict_made_a_miss_meanwhile_is_in_the_close_s_final_figures(
        loop: str) -> None:
    # A recsys load that found its hit given back by an evict running meanwhile (marked
    # on the store thread, not yet cancelled there) answers the miss it is; waited for
    # only after a close, it must still be counted in the close's final figures, as a
    # load the close found queued is.
    core, hit, before, checked, loaded = recsys_hit_an_evict_will_mark(loop)
    pendings: list[object] = []
    loader = threading.Thread(target=lambda: pendings.append(core.load([hit], [target(5)])))
    loader.start()
    assert checked.wait(10)
    evicted = core.kv.submit_evict(5)
    loader.join(10)
    loaded.set()
    assert evicted.result(10) == TOKENS
    core.close()
    (pending,) = pendings
    outcomes = pending.outcomes()  # type: ignore[attr-defined]
    assert [r.loaded_tokens for r in outcomes] == [0]
    assert core.kv.stats().completed - before.completed == 1


# A daemon thread's recsys load made as the exit begins: its copier (the store's last)
# stops taking jobs before the thread queues them.
_EXIT_AS_RECSYS_LOADS = """
import threading, torch, aiokv
from aiokv.integrations.recsys_core import RecsysCore
caches = [torch.randn(256, 2, 16, 8, 16) for _ in range(2)]
store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.05))
core = RecsysCore(aiokv.run_in_background(
    aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))))
core.offload([1], [torch.arange(0, 8)], [8 * 16]).outcomes()
(hit,) = core.lookup([1], [8 * 16])
target = torch.arange(128, 136)
copier = store._jobs._in
stop_at_exit, takes_load = copier.stop_at_exit, store.takes_load
checking, exiting = threading.Event(), threading.Event()
def stopped() -> None:
    stop_at_exit()
    exiting.set()
def late(task_id):
    checking.set()
    exiting.wait(30)
    return takes_load(task_id)
copier.stop_at_exit, store.takes_load = stopped, late
def loads():
    print("outcome", core.load([hit], [target]).outcomes(), flush=True)
threading.Thread(target=loads, daemon=True).start()
checking.wait(30)
print("exits", flush=True)
"""


def test_a_recsys_load_made_as_the_process_exits_gets_no_error_in_its_daemon_thread() -> None:
    # As the exit begins, a hand-over of a thread other than the main one gets a future
    # that never resolves (exiting.HandOverGate): a daemon thread told an error might go
    # on calling into torch while the interpreter finalizes. The recsys load whose thread
    # queues the copies itself answered EngineClosed ("the interpreter exits") instead.
    exits_cleanly(_EXIT_AS_RECSYS_LOADS)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_recsys_miss_its_thread_was_finishing_as_a_close_ran_is_in_its_final_figures(
        loop: str) -> None:
    # A recsys load whose hit an evict gave back meanwhile is a miss, finished and
    # counted by its thread at the call; a close running while that thread finishes it
    # must still count it in its final figures (the loop takes no counts after).
    core, hit, before, checked, loaded = recsys_hit_an_evict_will_mark(loop)
    got: list[object] = []
    loader = threading.Thread(target=lambda: got.append(
        core.load([hit], [target(5)]).outcomes()))
    finishing, go = pause_release_in(core, loader)
    loader.start()
    try:
        assert checked.wait(10)
        evicted = core.kv.submit_evict(5)
        assert finishing.wait(10)  # the miss is being finished by its thread
        loaded.set()
        assert evicted.result(10) == TOKENS
        closer = threading.Thread(target=core.close)
        closer.start()
        closer.join(1.0)  # the close ends without that thread, or waits for it
    finally:
        loaded.set()
        go.set()
    loader.join(10)
    closer.join(10)
    assert not loader.is_alive() and not closer.is_alive()
    (outcomes,) = got
    assert [r.loaded_tokens for r in outcomes] == [0]  # type: ignore[attr-defined]
    assert core.kv.stats().completed - before.completed == 1


class Interrupted(BaseException):
    """What a signal handler raises in the main thread, as KeyboardInterrupt does."""


class InterruptedOnce:
    """``call`` in place, except that its first call made on the main thread raises
    Interrupted (as a signal handler's KeyboardInterrupt would there): before ``call``
    runs, or just after it (``after``). ``armed`` is False once it did."""

    def __init__(self, call: Callable[..., Any], after: bool = False) -> None:
        self.call, self.after, self.armed = call, after, True

    def __call__(self, *args: Any) -> Any:
        if not (self.armed and threading.current_thread() is threading.main_thread()):
            return self.call(*args)
        self.armed = False
        if self.after:
            self.call(*args)
        raise Interrupted

def load_interrupted(core: Any, hits: Any, interrupted: InterruptedOnce) -> Any:
    """User 5's load into ``target(5)``, its first wait interrupted (by ``interrupted``,
    which must have raised there); the load's calls, to wait for again."""
    pending = core.load(hits, [target(5)])
    with pytest.raises(Interrupted):
        pending.outcomes()
    assert not interrupted.armed
    return pending



@pytest.mark.parametrize("loop", LOOPS)
def test_a_recsys_wait_interrupted_in_its_copies_wait_leaves_the_load_to_the_next_wait(
        loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A KeyboardInterrupt in the wait for a load's copies (on a GPU the long wait, the
    # end events): the next wait must still report the load, so that the store ends its
    # reads of the key's blocks, and an evict then drops them (it kept them for good).
    from aiokv.copy import copier
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    core = RecsysCore(background(caches, loop))
    core.offload([5], [source(5)], [TOKENS]).outcomes()
    hits = core.lookup([5], [TOKENS])
    interrupted = InterruptedOnce(copier._ran)
    monkeypatch.setattr(copier, "_ran", interrupted)
    try:
        pending = load_interrupted(core, hits, interrupted)
        assert [r.loaded_tokens for r in pending.outcomes()] == [TOKENS]
        assert same(caches, source(5), target(5))
        assert core.evict([5]) == TOKENS
        freed(core.kv)
    finally:
        core.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_releasing_a_loaded_hit_leaves_the_next_load_to_its_thread(loop: str) -> None:
    # A release of a hit a load consumed has nothing to give back; handed to the loop
    # anyway, it would sit there as a call not begun, and a thread's load must not
    # overtake one: the next load would go through the loop (busy here), a batch of its own.
    caches = make_caches()
    with background(caches, loop) as kv:
        for user in (1, 2):
            kv.offload(user, source(user), TOKENS)
        first, second = (kv.lookup(user, TOKENS) for user in (1, 2))
        kv.load(first, target(1))
        before = kv.stats()
        busy = threading.Event()
        kv.loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(0.5)))
        assert busy.wait(10)
        first.release()  # loaded: nothing to give back
        result = kv.load(second, target(2))
        assert result.loaded_tokens == TOKENS and same(caches, source(2), target(2))
        assert kv.stats().batches == before.batches


@pytest.mark.parametrize("loop", LOOPS)
def test_a_recsys_wait_interrupted_after_its_report_reports_its_load_once(
        loop: str, caplog: pytest.LogCaptureFixture) -> None:
    # A KeyboardInterrupt as the report of a load's copies wakes the store (the report
    # already handed over): the next wait reported the load again, and the store's next
    # call failed on it (a StoreError: KeyError), logged, its work retried.
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    store = small_store()
    core = RecsysCore(background(caches, loop, store))
    try:
        core.offload([5, 6], [source(5), source(6)], [TOKENS] * 2).outcomes()
        hits = core.lookup([5], [TOKENS])
        block_bytes = sum(c[0].numel() * c.element_size() for c in caches)
        before = store.store_stats()["bytes_h2d"]
        interrupted = InterruptedOnce(store._ends._wake, after=True)
        store._ends._wake = interrupted  # type: ignore[method-assign]
        pending = load_interrupted(core, hits, interrupted)
        assert [r.loaded_tokens for r in pending.outcomes()] == [TOKENS]
        assert same(caches, source(5), target(5))
        # The store goes on: a load of another key, and evicts that drop each key whole.
        (r6,) = core.load(core.lookup([6], [TOKENS]), [target(6)]).outcomes()
        assert r6.loaded_tokens == TOKENS  # type: ignore[union-attr]
        assert same(caches, source(6), target(6))
        assert core.evict([5]) == TOKENS
        assert core.evict([6]) == TOKENS
        freed(core.kv)
        assert store.store_stats()["bytes_h2d"] - before == 2 * 8 * block_bytes
        failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert failed == []
    finally:
        core.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_an_evict_after_a_recsys_wait_interrupted_in_its_report_drops_the_key_whole(
        loop: str) -> None:
    # A KeyboardInterrupt as a load's copies are reported, before the store got the
    # report: an evict of its key made before any other wait must still find the load
    # (it waits for the loads callers queued), or it finds the blocks read and drops 0.
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    store = small_store()
    core = RecsysCore(background(caches, loop, store))
    try:
        core.offload([5], [source(5)], [TOKENS]).outcomes()
        hits = core.lookup([5], [TOKENS])
        copier = store._jobs._in  # type: ignore[union-attr]
        interrupted = InterruptedOnce(copier._on_done)
        copier._on_done = interrupted
        pending = load_interrupted(core, hits, interrupted)
        assert same(caches, source(5), target(5))
        assert core.evict([5]) == TOKENS
        assert [r.loaded_tokens for r in pending.outcomes()] == [TOKENS]
        freed(core.kv)
    finally:
        core.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_recsys_wait_interrupted_as_its_load_is_given_back_counts_it_at_the_next_wait(
        loop: str) -> None:
    # A KeyboardInterrupt as a load's reservation goes back to the store thread (its
    # copies ran, its result known): the next wait answers it, and it must still be
    # counted (completed, loaded_tokens), as it is at a wait that was not interrupted.
    from aiokv.integrations.recsys_core import RecsysCore

    caches = make_caches()
    core = RecsysCore(background(caches, loop))
    try:
        core.offload([5], [source(5)], [TOKENS]).outcomes()
        hits = core.lookup([5], [TOKENS])
        before = core.kv.stats()
        worker = core.kv.engine._worker
        assert worker is not None
        interrupted = InterruptedOnce(worker.release)
        worker.release = interrupted  # type: ignore[method-assign]
        pending = load_interrupted(core, hits, interrupted)
        assert [r.loaded_tokens for r in pending.outcomes()] == [TOKENS]
        assert same(caches, source(5), target(5))
        counted(core, before, loads=1)
        assert core.evict([5]) == TOKENS
        freed(core.kv)
    finally:
        core.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_recsys_load_interrupted_as_it_takes_its_hits_gives_their_room_back(
        loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A KeyboardInterrupt as a recsys load takes its hits one by one (the first taken,
    # the second not yet): the call raises it, and the hit it took must go back to the
    # store, or its key's blocks stay read for good (a release of the hits does nothing
    # to it) and an offload that needs their room cannot have it.
    from aiokv.integrations.recsys_core import RecsysCore
    from aiokv.requests import Lookup

    caches = make_caches()
    store = small_store(cpu_cache_gb=16 * 1024 / 2**30)
    core = RecsysCore(background(caches, loop, store))
    try:
        assert core.kv.stats().host_blocks_total == 16
        core.offload([5, 6], [source(5), source(6)], [TOKENS] * 2).outcomes()
        hits = core.lookup([5, 6], [TOKENS] * 2)
        take = Lookup._take
        calls = [0]

        def interrupted_second(self: Lookup) -> object:
            if threading.current_thread() is threading.main_thread():
                calls[0] += 1
                if calls[0] == 2:
                    raise Interrupted
            return take(self)

        monkeypatch.setattr(Lookup, "_take", interrupted_second)
        with pytest.raises(Interrupted):
            core.load(hits, [target(5), target(6)])  # type: ignore[arg-type]
        monkeypatch.setattr(Lookup, "_take", take)
        core.release(hits)  # type: ignore[arg-type]
        # Both keys' 16 blocks are free to go: a key of 16 pages is stored whole.
        (stored,) = core.offload([7], [torch.arange(200, 216)], [2 * TOKENS]).outcomes()
        assert stored.stored_tokens == 2 * TOKENS  # type: ignore[union-attr]
    finally:
        core.close()
