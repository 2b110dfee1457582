"""The recsys-examples core (aiokv.integrations.recsys_core) between the manager's thread
and the engine's loop: its calls reach the engine in the order the manager made them, on
CPU caches, under asyncio's loop and uvloop's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import uvloop
from conftest import hold_the_loop, make_caches

import aiokv
from aiokv.integrations.recsys_core import RecsysCore

CONFIG = {"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 0.01}}
LOOPS: dict[str, type[asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.SelectorEventLoop,
    "uvloop": uvloop.Loop,
}


class Manager:
    """The manager's thread, running one function; ``handed`` is set once that thread,
    after ``watch()``, hands something to the engine's loop (the loop told by
    :meth:`loop_factory`'s loops): a blocking call's request is on its way."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.thread = threading.Thread(target=function, name="manager")
        self.watching = threading.Event()
        self.handed = threading.Event()

    def watch(self) -> None:
        self.watching.set()

    def loop_factory(self, kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
        base: Any = LOOPS[kind]
        manager = self

        class Watched(base):  # type: ignore[misc]
            def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
                handle = super().call_soon_threadsafe(*args, **kwargs)
                if manager.watching.is_set() and threading.current_thread() is manager.thread:
                    manager.handed.set()
                return handle

        return Watched


@pytest.fixture(params=list(LOOPS))
def loop_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def cached(core: RecsysCore, users: list[int], lengths: list[int]) -> list[int]:
    hits = core.lookup(users, lengths)
    core.release(hits)
    return [0 if hit is None else hit.cached_tokens for hit in hits]


@pytest.mark.parametrize("invalidation", ["clear", "evict"])
def test_an_invalidation_after_an_offload_runs_after_it(loop_kind: str, invalidation: str) -> None:
    # The manager's offload_kvcache_launch, then its evict_all (or evict) without waiting:
    # the engine runs an evict or clear after every call it accepted before, so the host
    # must hold nothing of the users after it. The loop is held until the invalidation
    # was handed over, so that both reach it in one iteration: a clear accepted before
    # the offload's calls left the offloaded KV on the host.
    users, lengths = [5, 6], [16, 16]
    outcomes: list[Any] = []

    def manager_calls() -> None:
        pending = core.offload(users, [torch.arange(0, 4), torch.arange(4, 8)], lengths)
        manager.watch()
        outcomes.append(core.clear() if invalidation == "clear" else core.evict(users))
        outcomes.append(pending.outcomes())

    manager = Manager(manager_calls)
    core = RecsysCore.open(CONFIG, make_caches(pages=64), manager.loop_factory(loop_kind))
    try:
        release = hold_the_loop(core.kv)
        manager.thread.start()
        assert manager.handed.wait(30)
        release.set()
        manager.thread.join(30)
        dropped, offloaded = outcomes
        assert [r.stored_tokens for r in offloaded] == lengths
        assert dropped == sum(lengths)  # what the offload stored, dropped after it
        assert cached(core, users, lengths) == [0, 0]
    finally:
        core.close()


def test_blocking_calls_from_the_loop_thread_raise_instead_of_deadlocking(loop_kind: str) -> None:
    # A manager call made on the engine's loop thread (say, from a done-callback of one
    # of the core's futures) would wait for that loop forever; it raises, as the
    # handle's own blocking calls do. The calls that do not wait are allowed there.
    core = RecsysCore.open(CONFIG, make_caches(pages=64), LOOPS[loop_kind])
    try:
        offloaded = core.offload([1], [torch.arange(0, 2)], [8])
        assert offloaded.outcomes()[0].stored_tokens == 8

        async def on_the_loop() -> tuple[list[str], Any]:
            refused = []
            for call in (
                offloaded.outcomes,  # done already: it would not wait, and still raises
                lambda: offloaded.poll(0.0),
                lambda: core.lookup([1], [8]),
                lambda: core.evict([1]),
                core.clear,
            ):
                with pytest.raises(aiokv.BlockingCallOnLoop, match="own thread") as info:
                    call()
                refused.append(str(info.value).split("(")[0])
            return refused, core.offload([2], [torch.arange(2, 4)], [8])

        refused, pending = asyncio.run_coroutine_threadsafe(on_the_loop(), core.kv.loop).result(30)
        assert refused == ["offload", "offload", "lookup", "evict", "clear"]
        assert pending.outcomes()[0].stored_tokens == 8
        assert cached(core, [1, 2], [8, 8]) == [8, 8]  # nothing was evicted or cleared
    finally:
        core.close()
