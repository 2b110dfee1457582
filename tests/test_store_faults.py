"""A store verb that raises once (a transient fault) must cost the engine nothing but the
requests it concerned: found by the soak (benchmarks/soak.py, ``--error-verbs cancel`` or
``try_wait``), reduced here to one fault each (strict-xfail reproducers until the store thread retried
them: aiokv/worker/recovery.py). Every verb's failure is in the soak's CI run
(tests/test_soak_quick.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
import torch
from conftest import PAGE_SIZE, small_store

import aiokv
from aiokv.stores.base import Store, TaskResult
from aiokv.testing import CheckingStore, StoreWrapper

TOKENS = 4 * PAGE_SIZE


class FailsOnce(StoreWrapper):
    """Raises from the first call of ``verb`` without reaching the inner store, then
    forwards as usual."""

    def __init__(self, inner: Store, verb: str) -> None:
        super().__init__(inner)
        self.verb = verb
        self.failed = threading.Event()

    def _maybe_fail(self, verb: str) -> None:
        if verb == self.verb and not self.failed.is_set():
            self.failed.set()
            raise RuntimeError(f"transient: {verb} failed once")

    def cancel(self, task_ids: Sequence[int]) -> None:
        self._maybe_fail("cancel")
        self.inner.cancel(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        self._maybe_fail("try_wait")
        return self.inner.try_wait(task_ids)


def rig(caches: list[torch.Tensor], verb: str) -> tuple[FailsOnce, CheckingStore, aiokv.OffloadEngine]:
    faulty = FailsOnce(small_store(), verb)
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    return faulty, checked, aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(window_us=0))


@pytest.mark.asyncio
async def test_a_cancel_that_raises_once_is_retried(caches: list[torch.Tensor]) -> None:
    faulty, checked, engine = rig(caches, "cancel")
    async with engine:
        await engine.offload("u", torch.arange(4), TOKENS)
        (await engine.lookup("u", TOKENS)).release()  # its cancel raises
        await asyncio.to_thread(faulty.failed.wait, 10)
        assert (await engine.offload("v", torch.arange(4, 8), TOKENS)).stored_tokens == TOKENS
    assert faulty.failed.is_set()
    assert checked.problems() == []  # the released reservation was cancelled in the end


@pytest.mark.asyncio
async def test_a_try_wait_that_raises_once_loses_no_task(caches: list[torch.Tensor]) -> None:
    faulty, checked, engine = rig(caches, "try_wait")
    async with engine:
        outcome = await asyncio.gather(
            engine.offload("u", torch.arange(4), TOKENS), return_exceptions=True
        )
        assert isinstance(outcome[0], (aiokv.OffloadResult, aiokv.StoreError)), outcome
    assert faulty.failed.is_set()
    assert checked.problems() == []  # every launched id waited to its terminal answer


class FailsAWhile(StoreWrapper):
    """``try_wait`` of launched tasks raises until ``until`` (time.monotonic())."""

    until = 0.0

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        if task_ids and time.monotonic() < self.until:
            raise RuntimeError("transient: the store is reconnecting")
        return self.inner.try_wait(task_ids)


@pytest.mark.asyncio
@pytest.mark.parametrize("evict", [False, True])
async def test_a_try_wait_that_fails_for_a_moment_during_an_evict_fails_no_task(
    caches: list[torch.Tensor], evict: bool
) -> None:
    # Outside an evict the failing polls back off and ride the fault out; the evict's
    # own wait for what was launched before it must too, not fail every task in flight.
    faulty = FailsAWhile(small_store())
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    async with aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(window_us=0)) as engine:
        await engine.offload("warm", torch.arange(4), TOKENS)
        faulty.until = time.monotonic() + 0.03
        offload = asyncio.ensure_future(engine.offload("u", torch.arange(4, 8), TOKENS))
        if evict:
            await asyncio.sleep(0)  # the offload first, then another user's evict
            assert await engine.evict("other") == 0
        assert (await offload).stored_tokens == TOKENS
    assert checked.problems() == []
