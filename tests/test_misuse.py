"""Misuse that must fail clearly (issue 19, items 3 and 4), through the public API only.

Each test is the behaviour a user expects; each was a strict-xfail reproducer of the bug
until the engine-side fix (phase 2) made it pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import uvloop
from conftest import PAGE_SIZE, make_caches, outcomes_in_a_forked_child, small_store

import aiokv
from aiokv import lifecycle
from aiokv.testing import CheckingStore, FaultyStore, LayeredStore, StoreWrapper

TOKENS = 4 * PAGE_SIZE
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def pages(start: int, count: int = 4) -> torch.Tensor:
    return torch.arange(start, start + count)


class Rig:
    """An engine over CheckingStore(FaultyStore(LocalStore))."""

    def __init__(self, caches: list[torch.Tensor], **config: Any) -> None:
        self.faulty = FaultyStore(small_store())
        self.checked = CheckingStore(self.faulty, loop_thread=threading.get_ident())
        self.engine = aiokv.OffloadEngine(self.checked, caches, aiokv.EngineConfig(**config))


# ---- loop binding (item 3) ---------------------------------------------------------------


@pytest.mark.parametrize("loop_kind", list(LOOPS))
def test_a_call_after_the_starting_loop_closed_fails_typed_and_leaves_nothing_pending(
    caches: list[torch.Tensor], loop_kind: str
) -> None:
    engine = aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig(window_us=0))
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        runner.run(engine.start())
    try:
        with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner, pytest.raises(
            aiokv.AiokvError, match="loop"
        ):
            runner.run(engine.offload(1, pages(0), TOKENS))
        stats = engine.stats()
        assert stats.pending == 0 and stats.submitted == 0
    finally:
        # Best effort, bounded: the loop the engine belongs to is gone.
        with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner, contextlib.suppress(
            Exception
        ):
            runner.run(asyncio.wait_for(engine.aclose(drain=False), 0.5))


@pytest.mark.parametrize("loop_kind", list(LOOPS))
def test_a_call_from_a_second_loop_fails_typed_and_never_runs(
    caches: list[torch.Tensor], loop_kind: str
) -> None:
    engine = aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig(window_us=0))
    home = LOOPS[loop_kind]()
    try:
        home.run_until_complete(engine.start())
        with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner, pytest.raises(
            aiokv.AiokvError, match="loop"
        ):
            runner.run(engine.offload(1, pages(0), TOKENS))
        assert engine.stats().pending == 0

        async def after() -> int:
            await engine.offload(2, pages(4), TOKENS)  # a round on the engine's own loop
            async with await engine.lookup(1, TOKENS) as hit:
                return hit.cached_tokens

        assert home.run_until_complete(after()) == 0  # the foreign offload never ran
    finally:
        home.run_until_complete(asyncio.wait_for(engine.aclose(), 10))
        home.close()


@pytest.mark.parametrize("own_process", [False, True], ids=["embedded", "own_process"])
def test_a_forked_child_gets_engine_closed_from_a_bare_engine_and_the_parent_serves_on(
    caches: list[torch.Tensor], own_process: bool
) -> None:
    # A program forks its workers after opening an engine on its own loop. The child's
    # calls on the parent's loop object were queued for a store thread the fork did not
    # copy and waited forever; from a loop of its own, WrongLoop said to use that loop.
    store: dict[str, Any] = {"cpu_cache_gb": 0.01, "own_process": own_process}
    engine = aiokv.open_engine({"engine": {"window_us": 0}, "store": store}, kv_caches=caches)
    home = asyncio.new_event_loop()
    try:
        home.run_until_complete(engine.start())
        home.run_until_complete(engine.offload(7, pages(0), TOKENS))
        held = home.run_until_complete(engine.lookup(7, TOKENS))

        def on(loop_of: Callable[[], asyncio.AbstractEventLoop], name: str) -> Callable[[], Any]:
            def call() -> Any:
                work = {
                    "offload": lambda: engine.offload(8, pages(4), TOKENS),
                    "lookup": lambda: engine.lookup(7, TOKENS),
                    "load": lambda: engine.load(held, pages(40)),
                    "evict": lambda: engine.evict(7),
                    "aclose": lambda: engine.aclose(timeout=3),
                }[name]
                # The bound makes a hang an untyped TimeoutError, not a stuck child.
                return loop_of().run_until_complete(asyncio.wait_for(work(), 10))
            return call

        names = ["offload", "lookup", "load", "evict", "aclose"]
        calls = [(f"fresh {name}", on(asyncio.new_event_loop, name)) for name in names]
        calls += [(f"home {name}", on(lambda: home, name)) for name in names]
        said, child = outcomes_in_a_forked_child(calls)
        assert list(said) == [name for name, _ in calls], said
        for name, outcome in said.items():
            if name.endswith("aclose"):
                assert outcome == "returned None", (name, outcome)
                continue
            assert outcome.startswith("EngineClosed: "), (name, outcome)
            assert f"belongs to process {os.getpid()}" in outcome
            assert f"forked child {child}" in outcome
            assert "forked child must open an engine of its own" in outcome

        async def after() -> None:
            # The parent's engine is untouched: the held lookup loads, new calls
            # round-trip, all bit-exact.
            assert (await engine.load(held, pages(20))).loaded_tokens == TOKENS
            assert (await engine.offload(8, pages(4), TOKENS)).stored_tokens == TOKENS
            async with await engine.lookup(8, TOKENS) as hit:
                assert (await engine.load(hit, pages(50))).loaded_tokens == TOKENS
            assert engine.stats().failed == 0

        home.run_until_complete(after())
        for c in caches:
            assert torch.equal(c[20:24], c[0:4]) and torch.equal(c[50:54], c[4:8])
    finally:
        home.run_until_complete(asyncio.wait_for(engine.aclose(), 30))
        home.close()


def _forked_child_refusal(outcome: str, child: int, what: str) -> bool:
    return (outcome.startswith(f"EngineClosed: this {what} belongs to process {os.getpid()}")
            and f"forked child {child}" in outcome)


def test_a_forked_child_releasing_a_bare_lookup_does_nothing_and_gets_no_copied_stats(
    caches: list[torch.Tensor],
) -> None:
    # A hit held across the fork: its release in the child raised WrongLoop (the
    # run_in_background handle's release does nothing there), and the child's stats()
    # answered with the parent's figures as the fork copied them.
    engine = aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig(window_us=0))
    home = asyncio.new_event_loop()
    try:
        home.run_until_complete(engine.start())
        home.run_until_complete(engine.offload(7, pages(0), TOKENS))
        held = home.run_until_complete(engine.lookup(7, TOKENS))

        async def release() -> None:
            held.release()

        async def leave() -> None:
            async with held:
                pass

        calls: list[tuple[str, Callable[[], Any]]] = [
            ("release off any loop", held.release),
            ("release on a fresh loop", lambda: asyncio.new_event_loop().run_until_complete(
                release())),
            ("async with on a fresh loop", lambda: asyncio.new_event_loop().run_until_complete(
                leave())),
            ("release on the home loop", lambda: home.run_until_complete(release())),
            ("stats", engine.stats),
        ]
        said, child = outcomes_in_a_forked_child(calls)
        assert list(said) == [name for name, _ in calls], said
        for name, _ in calls[:-1]:
            assert said[name] == "returned None", (name, said[name])
        assert _forked_child_refusal(said["stats"], child, "engine"), said["stats"]

        async def after() -> int:
            return (await engine.load(held, pages(20))).loaded_tokens

        assert held.held  # the parent's hit, still its own: it loads bit-exact
        assert home.run_until_complete(after()) == TOKENS
        assert all(torch.equal(c[20:24], c[0:4]) for c in caches)
        assert engine.stats().completed == 3
    finally:
        home.run_until_complete(asyncio.wait_for(engine.aclose(), 30))
        home.close()


def test_a_forked_child_waiting_on_a_bare_layerwise_load_gets_engine_closed_not_a_hang(
    caches: list[torch.Tensor],
) -> None:
    # A load started in the parent, its layers still on their way at the fork: the
    # child's waits (on the parent's loop object above all) waited for a store thread
    # and copies the fork did not bring.
    store = LayeredStore()
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    home = asyncio.new_event_loop()
    try:
        home.run_until_complete(engine.start())
        home.run_until_complete(engine.offload(7, pages(0), TOKENS))

        async def ended_load() -> Any:
            load = await engine.load_layerwise(await engine.lookup(7, TOKENS), pages(40))
            await load.result()
            return load

        ended = home.run_until_complete(ended_load())
        hit = home.run_until_complete(engine.lookup(7, TOKENS))
        store.gate = threading.Semaphore(0)  # its layers wait
        load = home.run_until_complete(engine.load_layerwise(hit, pages(20)))

        def on(loop_of: Callable[[], asyncio.AbstractEventLoop],
               wait: Callable[[], Any]) -> Callable[[], Any]:
            # The bound makes a hang an untyped TimeoutError, not a stuck child.
            return lambda: loop_of().run_until_complete(asyncio.wait_for(wait(), 10))

        calls: list[tuple[str, Callable[[], Any]]] = [
            ("home result", on(lambda: home, load.result)),
            ("home layer_ready", on(lambda: home, lambda: load.layer_ready(0))),
            ("fresh result", on(asyncio.new_event_loop, load.result)),
            ("fresh layer_ready", on(asyncio.new_event_loop, lambda: load.layer_ready(1))),
            ("cancel", load.cancel),
            ("ended result", on(asyncio.new_event_loop, ended.result)),
            ("ended layer_ready", on(lambda: home, lambda: ended.layer_ready(1))),
            ("wait_layer", lambda: load.wait_layer(0)),  # last: it blocks a thread
        ]
        said, child = outcomes_in_a_forked_child(calls)
        assert list(said) == [name for name, _ in calls], said
        for name in ("home result", "home layer_ready", "fresh result", "fresh layer_ready",
                     "wait_layer"):
            assert _forked_child_refusal(said[name], child, "layerwise load"), (name, said)
        assert said["cancel"] == "returned None"
        assert said["ended result"] == f"returned LoadResult(user_id=7, loaded_tokens={TOKENS})"
        assert said["ended layer_ready"] == "returned None"

        store.gate.release(1000)  # the parent's load goes on, untouched, bit-exact
        result = home.run_until_complete(asyncio.wait_for(load.result(), 30))
        assert result.loaded_tokens == TOKENS
        assert all(torch.equal(c[20:24], c[0:4]) for c in caches)
    finally:
        if store.gate is not None:
            store.gate.release(1000)
        home.run_until_complete(asyncio.wait_for(engine.aclose(), 30))
        home.close()


def in_a_thread_with_its_own_loop(work: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``work()`` (which runs a loop of its own) on a new thread: (what it raised,
    seconds it took)."""
    begun = time.monotonic()
    try:
        work()
    except Exception as error:
        return error, time.monotonic() - begun
    return None, time.monotonic() - begun


@pytest.mark.asyncio
async def test_a_call_from_another_running_loop_fails_at_once_and_never_runs(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        error, _ = await asyncio.wait_for(asyncio.to_thread(
            in_a_thread_with_its_own_loop,
            lambda: asyncio.run(rig.engine.offload(7, pages(0), TOKENS)),
        ), 10)
        assert isinstance(error, aiokv.AiokvError) and "loop" in str(error), error
        assert rig.engine.stats().pending == 0
        await rig.engine.offload(8, pages(4), TOKENS)
        async with await rig.engine.lookup(7, TOKENS) as hit:
            assert hit.cached_tokens == 0  # never ran
    assert rig.checked.problems() == []


@pytest.mark.asyncio
async def test_aclose_from_another_loop_fails_at_once_and_the_engine_serves_on(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0)
    await rig.engine.start()
    try:
        error, took_s = await asyncio.to_thread(
            in_a_thread_with_its_own_loop,
            lambda: asyncio.run(asyncio.wait_for(rig.engine.aclose(), 2.0)),
        )
        assert isinstance(error, aiokv.AiokvError) and "loop" in str(error), error
        assert took_s < 1.0  # at once, not after a drain
        assert rig.engine.state is aiokv.EngineState.RUNNING
        assert (await rig.engine.offload("u", pages(0), TOKENS)).stored_tokens == TOKENS
    finally:
        await asyncio.wait_for(rig.engine.aclose(), 10)


@pytest.mark.asyncio
async def test_start_and_async_with_from_another_loop_fail_at_once_on_a_running_engine(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0)
    entered: list[str] = []

    async def enter() -> None:
        async with rig.engine:
            entered.append("the body ran on the wrong loop")

    async with rig.engine:
        for work in (rig.engine.start, enter):
            error, _ = await asyncio.wait_for(asyncio.to_thread(
                in_a_thread_with_its_own_loop, lambda work=work: asyncio.run(work()),
            ), 10)
            assert isinstance(error, aiokv.WrongLoop), error
        assert entered == []
        assert rig.engine.state is aiokv.EngineState.RUNNING
        assert (await rig.engine.offload("u", pages(0), TOKENS)).stored_tokens == TOKENS
    assert rig.checked.problems() == []


@pytest.mark.asyncio
async def test_a_layerwise_load_awaited_or_cancelled_from_another_loop_fails_at_once(
    caches: list[torch.Tensor],
) -> None:
    store = LayeredStore()
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    async with engine:
        await engine.offload(1, pages(0), TOKENS)
        hit = await engine.lookup(1, TOKENS)
        store.gate = threading.Semaphore(0)  # its layers wait
        load = await engine.load_layerwise(hit, pages(8))
        try:
            for call in (load.result, lambda: load.layer_ready(0)):
                error, _ = await asyncio.wait_for(asyncio.to_thread(
                    in_a_thread_with_its_own_loop,
                    lambda call=call: asyncio.run(asyncio.wait_for(call(), 2)),
                ), 10)
                assert isinstance(error, aiokv.WrongLoop), error
            with pytest.raises(aiokv.WrongLoop):
                await asyncio.wait_for(asyncio.to_thread(load.cancel), 10)
        finally:
            store.gate.release(1000)
        assert (await asyncio.wait_for(load.result(), 10)).loaded_tokens == TOKENS
        assert torch.equal(caches[0][8:12], caches[0][0:4])


# ---- edges (item 4) ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_duplicate_page_ids_in_a_load_fail_that_load_alone(
    caches: list[torch.Tensor],
) -> None:
    original = [c.clone() for c in caches]
    rig = Rig(caches, window_us=20_000)
    async with rig.engine:
        await rig.engine.offload("a", pages(0), TOKENS)
        await rig.engine.offload("b", pages(4), TOKENS)
        hit_a = await rig.engine.lookup("a", TOKENS)
        hit_b = await rig.engine.lookup("b", TOKENS)
        bad = asyncio.ensure_future(rig.engine.load(hit_a, torch.tensor([37, 37, 38, 39])))
        good = asyncio.ensure_future(rig.engine.load(hit_b, pages(40)))  # the same window
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await bad
        assert caught.value.field == "page_ids" and "37" in str(caught.value)
        assert (await good).loaded_tokens == TOKENS
        for cache, before in zip(caches, original, strict=True):
            assert torch.equal(cache[40:44], before[4:8])
    assert rig.checked.problems() == []


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["launch", "page_range"])
async def test_a_failed_load_releases_its_lookup(
    caches: list[torch.Tensor], failure: str
) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), TOKENS)
        hit = await rig.engine.lookup("u", TOKENS)
        target = pages(8)
        if failure == "launch":
            rig.faulty.launch_error = RuntimeError("injected: launch refused")
        else:
            target = torch.tensor([8, 9, 10, 10_000])
        with pytest.raises((aiokv.StoreError, aiokv.InvalidRequest)):
            await rig.engine.load(hit, target)
        assert not hit.held and "released" in repr(hit), repr(hit)
    assert rig.engine.stats().store_tasks_open == 0
    assert rig.checked.problems() == []


@pytest.mark.asyncio
async def test_aclose_returns_within_its_timeout_whatever_the_store_does(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0)
    await rig.engine.start()
    rig.faulty.hold.clear()  # launched transfers never answer
    call = asyncio.ensure_future(rig.engine.offload("u", pages(0), TOKENS))
    assert await asyncio.to_thread(rig.faulty.launched.wait, 10)
    loop = asyncio.get_running_loop()
    try:
        begun = loop.time()
        await rig.engine.aclose(drain=True, timeout=0.5)
        took_s = loop.time() - begun
    finally:
        rig.faulty.hold.set()  # let the abandoned store thread end
    with pytest.raises(aiokv.EngineClosed):
        await call
    # The spec itself (timeout + 0.2 s): the one timed assertion of these tests.
    assert took_s < 0.7, took_s


BAD_CLOSES = [({"timeout": None}, "timeout"), ({"timeout": "5"}, "timeout"),
              ({"timeout": float("nan")}, "timeout"), ({"timeout": float("inf")}, "timeout"),
              ({"timeout": -1.0}, "timeout"), ({"drain": "no"}, "drain"),
              # Finite, but past threading.TIMEOUT_MAX: the close thread's join overflowed.
              ({"timeout": 1e10}, "timeout")]


@pytest.mark.asyncio
async def test_aclose_with_bad_arguments_fails_typed_and_leaves_the_engine_serving(
    caches: list[torch.Tensor],
) -> None:
    engine = aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig())
    await engine.start()
    try:
        for user, (arguments, field) in enumerate(BAD_CLOSES):
            with pytest.raises(aiokv.InvalidRequest, match=field) as raised:
                await asyncio.wait_for(engine.aclose(**arguments), 10)
            assert raised.value.field == field
            assert (await engine.offload(user, pages(0), TOKENS)).stored_tokens == TOKENS
    finally:
        await asyncio.wait_for(engine.aclose(), 10)
    assert engine.state is aiokv.EngineState.CLOSED


def test_a_background_close_with_bad_arguments_fails_typed_and_a_good_one_closes(
    caches: list[torch.Tensor],
) -> None:
    engine = aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig())
    kv = aiokv.run_in_background(engine)
    for arguments, field in BAD_CLOSES:
        with pytest.raises(aiokv.InvalidRequest, match=field):
            kv.close(**arguments)
    assert kv.offload("u", pages(0), TOKENS).stored_tokens == TOKENS
    kv.close(timeout=10)
    assert engine.state is aiokv.EngineState.CLOSED


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [9_999, -1])
async def test_the_page_id_range_error_names_the_bad_value(
    caches: list[torch.Tensor], bad: int
) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await rig.engine.offload("u", torch.tensor([0, 1, bad]), 3 * PAGE_SIZE)
    assert caught.value.field == "page_ids" and str(bad) in str(caught.value)
    assert rig.checked.problems() == []


@pytest.mark.asyncio
async def test_sparse_page_ids_fail_their_call_alone_at_submit(
        caches: list[torch.Tensor]) -> None:
    # Accepted, they failed the whole batch on the store thread with an untyped error.
    rig = Rig(caches, window_us=100_000)
    sparse = torch.tensor([1, 2]).to_sparse()
    async with rig.engine:
        good = asyncio.ensure_future(rig.engine.offload("good", pages(4, 2), 2 * PAGE_SIZE))
        with pytest.raises(aiokv.InvalidRequest, match=r"^page_ids: must be a dense"):
            await rig.engine.offload("bad", sparse, 2 * PAGE_SIZE)
        assert (await good).stored_tokens == 2 * PAGE_SIZE
    assert rig.checked.problems() == []


@pytest.mark.asyncio
async def test_one_store_handed_to_two_engines_is_refused(caches: list[torch.Tensor]) -> None:
    store = small_store()
    first = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    await first.start()
    try:
        with pytest.raises(aiokv.AiokvError):
            second = aiokv.OffloadEngine(store, make_caches(seed=1))
            await second.start()
        # The first engine keeps its store.
        assert (await first.offload("u", pages(0), TOKENS)).stored_tokens == TOKENS
    finally:
        await asyncio.wait_for(first.aclose(), 10)


@pytest.mark.asyncio
async def test_an_embedded_store_closed_with_its_engine_is_refused_by_the_next(
    caches: list[torch.Tensor],
) -> None:
    # The close released its tiers: a second engine on it stored, and every lookup then
    # missed. It is refused at start instead, naming the store.
    store = small_store()
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0)) as first:
        assert (await first.offload("u", pages(0), TOKENS)).stored_tokens == TOKENS
    second = aiokv.OffloadEngine(store, make_caches(seed=1), aiokv.EngineConfig(window_us=0))
    with pytest.raises(aiokv.ConfigError, match=r"store: LocalStore at .* was closed"):
        await second.start()
    await second.aclose()


@pytest.mark.asyncio
async def test_a_store_whose_closed_engine_left_its_thread_running_is_refused_until_it_ends(
    caches: list[torch.Tensor],
) -> None:
    # A close that timed out leaves the store thread to end on its own: another engine
    # on the store meanwhile would drive it from a second thread (and see it closed).
    faulty = FaultyStore(small_store())
    checked = CheckingStore(faulty)
    first = aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(window_us=0))
    await first.start()
    faulty.hold.clear()  # a transfer that does not end
    offload = asyncio.ensure_future(first.offload("u", pages(0), TOKENS))
    await asyncio.to_thread(faulty.launched.wait, 10)
    await first.aclose(timeout=0.2)
    with pytest.raises(aiokv.EngineClosed):
        await offload
    second = aiokv.OffloadEngine(checked, make_caches(seed=1), aiokv.EngineConfig(window_us=0))
    with pytest.raises(aiokv.ConfigError) as caught:
        await second.start()
    assert "still runs" in str(caught.value)
    faulty.hold.set()  # the transfer ends: the first engine's thread closes the store
    for _ in range(500):
        if not lifecycle.store_in_use(checked):
            break
        await asyncio.sleep(0.01)
    assert not lifecycle.store_in_use(checked)
    assert not any("second thread" in problem for problem in checked.problems())


@pytest.mark.asyncio
async def test_a_call_before_start_says_to_call_start(caches: list[torch.Tensor]) -> None:
    engine = aiokv.OffloadEngine(small_store(), caches)
    try:
        with pytest.raises(aiokv.EngineClosed) as caught:
            await engine.offload("u", pages(0), TOKENS)
        assert "start()" in str(caught.value)
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_a_lookup_left_at_close_reads_released(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), TOKENS)
        hit = await rig.engine.lookup("u", TOKENS)
        assert hit.held
    assert rig.engine.stats().store_tasks_open == 0  # the close cancelled it in the store
    assert rig.checked.problems() == []
    assert not hit.held and "released" in repr(hit), repr(hit)


class RecordsClose(StoreWrapper):
    def __init__(self, inner: aiokv.Store) -> None:
        super().__init__(inner)
        self.closed = threading.Event()

    def close(self) -> None:
        self.inner.close()
        self.closed.set()


@pytest.mark.parametrize("loop_kind", list(LOOPS))
def test_an_engine_whose_loop_closed_can_be_closed_from_another_loop(
    caches: list[torch.Tensor], loop_kind: str
) -> None:
    store = RecordsClose(small_store())
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        runner.run(engine.start())
        runner.run(engine.offload(1, pages(0), TOKENS))
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
        runner.run(asyncio.wait_for(engine.aclose(), 10))
        runner.run(engine.aclose())  # idempotent
    assert engine.state is aiokv.EngineState.CLOSED
    assert store.closed.is_set()  # the store thread stopped and closed its store
    with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner, pytest.raises(
        aiokv.EngineClosed
    ):
        runner.run(engine.offload(2, pages(4), TOKENS))


@pytest.mark.parametrize(("field", "store", "config"), [
    ("config", None, {"window_us": 100}),
    ("config", None, aiokv.StoreConfig()),
    ("store", aiokv.StoreConfig(), None),
    ("store", "local", None),
])
def test_an_engine_of_a_store_or_config_of_the_wrong_kind_is_refused_naming_it(
        caches: list[torch.Tensor], field: str, store: Any, config: Any) -> None:
    # Not an AttributeError at start(), after the store was half set up.
    with pytest.raises(aiokv.ConfigError, match=rf"^{field}: must be"):
        aiokv.OffloadEngine(small_store() if store is None else store, caches, config)


@pytest.mark.parametrize("made", ["not a loop", "running", "closed"])
def test_a_loop_factory_whose_loop_cannot_serve_is_refused_before_anything_starts(
        caches: list[torch.Tensor], made: str) -> None:
    app_loop = asyncio.new_event_loop()
    victim: list[asyncio.Task[None]] = []
    ready = threading.Event()

    async def app() -> None:
        victim.append(asyncio.current_task())  # type: ignore[arg-type]
        ready.set()
        await asyncio.sleep(30)

    def serve() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # how the test ends it
            app_loop.run_until_complete(app())

    serving = threading.Thread(target=serve)
    if made == "running":  # the application's own loop, already running elsewhere
        serving.start()
        assert ready.wait(10)
    elif made == "closed":
        app_loop.close()
    engine = aiokv.OffloadEngine(small_store(), caches)
    try:
        with pytest.raises(aiokv.InvalidRequest, match=r"^loop_factory: "):
            aiokv.run_in_background(engine, loop_factory=lambda: (
                "not a loop" if made == "not a loop" else app_loop))  # type: ignore[arg-type,return-value]
        if made == "running":
            assert not victim[0].cancelled() and not victim[0].done()  # left alone
    finally:
        if made == "running":
            app_loop.call_soon_threadsafe(victim[0].cancel)
            serving.join(10)
        if not app_loop.is_closed():
            app_loop.close()
    with aiokv.run_in_background(engine) as kv:  # the engine was never started
        assert kv.offload(1, torch.arange(0, 2), 2 * PAGE_SIZE).stored_tokens == 2 * PAGE_SIZE


@pytest.mark.asyncio
async def test_a_lookup_released_from_another_thread_is_wrong_loop_and_stays_held() -> None:
    """Lookup.release() off the engine's loop would cancel the loop's TTL timer from that
    thread (uvloop crashed on it); it raises WrongLoop, as every engine call does, and
    leaves the hit held (threads release through run_in_background's BackgroundLookup)."""
    async with aiokv.OffloadEngine(small_store(), make_caches()) as engine:
        await engine.offload(1, torch.arange(4), 4 * PAGE_SIZE)
        hit = await engine.lookup(1, 4 * PAGE_SIZE)
        raised: list[BaseException] = []

        def off_loop() -> None:
            try:
                hit.release()
            except BaseException as exc:
                raised.append(exc)

        await asyncio.to_thread(off_loop)
        assert [type(e) for e in raised] == [aiokv.WrongLoop]
        assert hit.held
        hit.release()  # on the loop
        assert not hit.held


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_background_release_as_the_loop_thread_ends_starts_no_orphan_task(
    new_loop: Callable[[], asyncio.AbstractEventLoop], caplog: pytest.LogCaptureFixture
) -> None:
    """A BackgroundLookup.release() that comes while the loop's thread winds down (after
    the close was handed over) is a no-op: no task that never runs, no "never awaited"."""
    hit: Any = None

    def factory() -> asyncio.AbstractEventLoop:
        loop = new_loop()
        shutdown = loop.shutdown_asyncgens

        async def release_then_shutdown() -> None:  # on the loop's thread, at its end
            thread = threading.Thread(target=hit.release)
            thread.start()
            thread.join()
            await shutdown()

        loop.shutdown_asyncgens = release_then_shutdown  # type: ignore[method-assign]
        return loop

    kv = aiokv.run_in_background(aiokv.OffloadEngine(small_store(), make_caches()),
                                 loop_factory=factory)
    kv.offload(1, torch.arange(4), 4 * PAGE_SIZE)
    hit = kv.lookup(1, 4 * PAGE_SIZE)
    with warnings.catch_warnings(record=True) as caught, \
            caplog.at_level(logging.ERROR, "asyncio"):
        warnings.simplefilter("always")
        kv.close()
        gc.collect()
    assert not hit.held
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
