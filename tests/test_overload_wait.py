"""``overload: wait`` keeps memory and deadlines bounded (found by benchmarks/overload.py:
waiting callers grew without bound, and a caller that waited for room got a fresh
request_timeout_ms once accepted). Timer order on the loop clock decides these tests,
not the speed of the machine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE, small_store

import aiokv
from aiokv.loop.admission import max_waiting
from aiokv.stores.base import Store, TaskResult
from aiokv.testing import StoreWrapper

TOKENS = 4 * PAGE_SIZE
# The first offload, called before the waiter, must end by its own deadline, once room
# comes at half the waiter's: the waiter's call may come up to half of it after the
# first's. 1 s, not 400 ms, whose 200 ms a loaded host spent before the waiter's call.
TIMEOUT_MS = 1_000


class FirstLaunchGate(StoreWrapper):
    """Answers the tasks of the first launch once ``opened`` is set, and no other task
    until ``release_all`` is (transfers that never end, for as long as a test needs)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.first: set[int] | None = None
        self.launched = threading.Event()
        self.opened = threading.Event()
        self.release_all = threading.Event()
        self._answers: dict[int, TaskResult] = {}

    def launch(self, task_ids: Sequence[int], pages: Sequence[Any], ready: Sequence[Any]) -> None:
        self.inner.launch(task_ids, pages, ready)
        if self.first is None:
            self.first = set(task_ids)
        self.launched.set()

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        asked = [t for t in task_ids if t not in self._answers]
        self._answers.update(self.inner.try_wait(asked))
        ready = [
            t for t in task_ids if t in self._answers and (
                self.release_all.is_set() or (self.opened.is_set() and t in (self.first or ()))
            )
        ]
        return {t: self._answers.pop(t) for t in ready}


def engine_over(store: Store, caches: list[torch.Tensor], **config: object) -> aiokv.OffloadEngine:
    return aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(
        window_us=0, overload="wait", **config  # type: ignore[arg-type]
    ))


def offload(engine: aiokv.OffloadEngine, user: int) -> asyncio.Future[aiokv.OffloadResult]:
    # Every user's own key; reading the same pages is fine for offloads.
    return asyncio.ensure_future(engine.offload(user, torch.arange(4), TOKENS))


@pytest.mark.asyncio
async def test_waiters_beyond_their_bound_are_refused_at_once(caches: list[torch.Tensor]) -> None:
    max_pending = 2
    bound = max_waiting(max_pending)
    gate = FirstLaunchGate(small_store())
    engine = engine_over(gate, caches, max_pending=max_pending)
    await engine.start()
    try:
        accepted = [offload(engine, u) for u in range(max_pending)]
        await asyncio.sleep(0)
        waiting = [offload(engine, u) for u in range(max_pending, max_pending + bound)]
        await asyncio.sleep(0)
        assert not any(call.done() for call in accepted + waiting)
        with pytest.raises(aiokv.Overloaded, match="max_pending"):
            await engine.offload(-1, torch.arange(4), TOKENS)  # raised at submit
        assert engine.stats().pending == max_pending
        gate.release_all.set()
        results = await asyncio.gather(*accepted, *waiting)
        assert [r.stored_tokens for r in results] == [TOKENS] * len(results)  # all got in
    finally:
        gate.release_all.set()
        await asyncio.wait_for(engine.aclose(), 10)


@pytest.mark.asyncio
async def test_the_deadline_of_a_caller_that_waited_runs_from_the_call(
    caches: list[torch.Tensor],
) -> None:
    gate = FirstLaunchGate(small_store())
    engine = engine_over(gate, caches, max_pending=1, request_timeout_ms=TIMEOUT_MS)
    timeout_s = TIMEOUT_MS / 1e3
    loop = asyncio.get_running_loop()
    await engine.start()
    try:
        first = asyncio.ensure_future(engine.offload("a", torch.arange(4), TOKENS))
        assert await asyncio.to_thread(gate.launched.wait, 10)
        # Calls timed out or refused by the marker (the waiter is the only one that can).
        ended_by_marker: asyncio.Future[int] = loop.create_future()

        async def call_and_wait() -> aiokv.OffloadResult:
            # The call's deadline is taken in the same loop step as ``called`` (its
            # synchronous part, up to its wait for room): a loop that lags between the
            # two would push that deadline, not the marker, later.
            called = loop.time()
            # Room comes at half the timeout; the waiter's own transfer never ends.
            loop.call_at(called + timeout_s / 2, gate.opened.set)
            # What the engine had ended by the marker: the timers due by then ran in
            # time order, the deadline's first, even where a lagging loop ran them in
            # one step (then the waiter's task had not yet seen its error).
            loop.call_at(called + 1.25 * timeout_s, lambda: ended_by_marker.set_result(
                engine.stats().timed_out + engine.stats().rejected))
            return await engine.offload("b", torch.arange(4, 8), TOKENS)

        with pytest.raises(aiokv.RequestTimeout):
            await call_and_wait()
        assert (await first).stored_tokens == TOKENS
        # Timed out at the call's deadline (called + timeout), before the marker; a fresh
        # timeout from admission would end it at about called + 1.5 x timeout.
        assert await ended_by_marker == 1
    finally:
        gate.release_all.set()
        await asyncio.wait_for(engine.aclose(), 10)
