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
from conftest import PAGE_SIZE, held, small_store

import aiokv
from aiokv.copy.copier import Copier
from aiokv.stores.base import Store, TaskResult
from aiokv.testing import CheckingStore, StoreWrapper
from aiokv.worker import recovery

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
        # The poll is asked again: the offload ends as its copy does, never with the fault.
        assert (await engine.offload("u", torch.arange(4), TOKENS)).stored_tokens == TOKENS
    assert faulty.failed.is_set()
    assert checked.problems() == []  # every launched id waited to its terminal answer


class FailsAWhile(StoreWrapper):
    """A try_wait fault of a moment, met for sure. From :meth:`hold` until :meth:`arm`,
    ``try_wait`` of launched tasks answers nothing (their copies still run; ``polled``
    is set once one is asked for); once armed, it raises from its first call for
    ``FAULT_S`` (a moment, however late that first poll comes), counting the raises in
    ``failures``, then answers as the store does. ``arm_on_cancel``: armed by the first
    ``cancel`` once held (an evict giving back a held lookup of its key, just before it
    waits for what was launched before it)."""

    FAULT_S = 0.03

    def __init__(self, inner: Store, arm_on_cancel: bool) -> None:
        super().__init__(inner)
        self.arm_on_cancel = arm_on_cancel
        self.holding = False
        self.armed = False
        self.polled = threading.Event()
        self.until: float | None = None  # time.monotonic(), from the first raise
        self.failures = 0

    def hold(self) -> None:
        self.holding = True

    def arm(self) -> None:
        self.armed = True

    def cancel(self, task_ids: Sequence[int]) -> None:
        if self.holding and self.arm_on_cancel:
            self.arm()
        self.inner.cancel(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        if not task_ids or not self.holding:
            return self.inner.try_wait(task_ids)
        if not self.armed:
            self.polled.set()
            return {}
        now = time.monotonic()
        if self.until is None:
            self.until = now + self.FAULT_S
        if now < self.until:
            self.failures += 1
            raise RuntimeError("transient: the store is reconnecting")
        return self.inner.try_wait(task_ids)


@pytest.mark.asyncio
@pytest.mark.parametrize("evict", [False, True])
async def test_a_try_wait_that_fails_for_a_moment_during_an_evict_fails_no_task(
    caches: list[torch.Tensor], evict: bool
) -> None:
    # Outside an evict the failing polls back off and ride the fault out; the evict's
    # own wait for what was launched before it must too, not fail every task in flight.
    # The offload's copy is not over before the fault begins, and with the evict the
    # fault begins as the evict gives back a held lookup of its key: its wait meets it.
    faulty = FailsAWhile(small_store(), arm_on_cancel=evict)
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    async with aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(window_us=0)) as engine:
        assert (await engine.offload("other", torch.arange(4), TOKENS)).stored_tokens == TOKENS
        lookup = await engine.lookup("other", TOKENS)
        assert lookup.cached_tokens == TOKENS
        faulty.hold()
        offload = asyncio.ensure_future(engine.offload("u", torch.arange(4, 8), TOKENS))
        assert await asyncio.to_thread(faulty.polled.wait, 10), "the offload's copy never ran"
        if evict:
            assert await engine.evict("other") == TOKENS  # the fault begins in its wait
        else:
            faulty.arm()
        assert (await offload).stored_tokens == TOKENS
        if not evict:
            lookup.release()
    assert faulty.failures > 0, "the fault was never met"
    assert checked.problems() == []


class Outage(StoreWrapper):
    """While ``failing`` is set, ``try_wait`` of launched tasks raises (a store link
    that is down); ``failures`` counts those raises, and ``enough`` is set once they are
    ``enough_after``."""

    def __init__(self, inner: Store, enough_after: int) -> None:
        super().__init__(inner)
        self.failing = threading.Event()
        self.failures = 0
        self.enough_after = enough_after
        self.enough = threading.Event()

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        if task_ids and self.failing.is_set():
            self.failures += 1
            if self.failures >= self.enough_after:
                self.enough.set()
            raise ConnectionError("the store link is down")
        return self.inner.try_wait(task_ids)


def outage_rig(
    caches: list[torch.Tensor], request_timeout_ms: int, enough_after: int = 1
) -> tuple[Outage, CheckingStore, aiokv.OffloadEngine]:
    outage = Outage(small_store(), enough_after)
    checked = CheckingStore(outage, loop_thread=threading.get_ident())
    config = aiokv.EngineConfig(window_us=0, request_timeout_ms=request_timeout_ms)
    return outage, checked, aiokv.OffloadEngine(checked, caches, config)


# More try_wait failures in a row than the engine once gave up after (8): the offload's
# copy still runs all along, so its caller must not be told anything yet.
LONG_OUTAGE = 10


@pytest.mark.asyncio
async def test_a_try_wait_outage_longer_than_a_moment_leaves_the_offload_pending_until_it_ends(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    copying = held(monkeypatch, Copier, "_move_cpu", lambda copier, job: job.to_host)
    # The failures are counted, not timed: their backoff (doubling to 0.5 s, a second for
    # these ten) capped at 16 ms.
    monkeypatch.setattr(recovery, "MAX_BACKOFF_S", 0.016)
    outage, checked, engine = outage_rig(caches, request_timeout_ms=0, enough_after=LONG_OUTAGE)
    offloaded = torch.arange(4)
    original = [cache[offloaded].clone() for cache in caches]
    async with engine:
        outage.failing.set()
        offload = asyncio.ensure_future(engine.offload("u", offloaded, TOKENS))
        try:
            assert await asyncio.to_thread(copying.entered.wait, 10)
            assert await asyncio.to_thread(outage.enough.wait, 5), "the offload was given up"
            assert not offload.done()  # its copy still runs: no answer yet
            stats = engine.stats()
            assert (stats.pending, stats.store_tasks_open, stats.failed) == (1, 1, 0)
        finally:
            outage.failing.clear()
            copying.set()
        result = await asyncio.wait_for(offload, 10)
        assert (result.stored_tokens, result.cached_tokens) == (TOKENS, TOKENS)
        for cache in caches:  # the caller reuses its pages once told
            cache[offloaded] = 7.0
        async with await engine.lookup("u", TOKENS) as hit:
            assert (await engine.load(hit, torch.arange(40, 44))).loaded_tokens == TOKENS
        for cache, before in zip(caches, original, strict=True):
            assert torch.equal(cache[40:44], before)
        assert engine.stats().store_tasks_open == 0
    assert checked.problems() == []  # the id was waited to its terminal answer


@pytest.mark.asyncio
async def test_a_try_wait_that_never_recovers_times_the_call_out_and_the_close_ends(
    caches: list[torch.Tensor],
) -> None:
    outage, checked, engine = outage_rig(caches, request_timeout_ms=300)
    await engine.start()
    try:
        outage.failing.set()
        offload = asyncio.ensure_future(engine.offload("u", torch.arange(4), TOKENS))
        assert await asyncio.to_thread(outage.enough.wait, 10)
        with pytest.raises(aiokv.RequestTimeout):  # not a StoreError: the copy may still end
            await asyncio.wait_for(offload, 10)
        assert engine.stats().store_tasks_open == 1  # still asked about
    finally:
        await asyncio.wait_for(engine.aclose(timeout=0.2), 10)  # given up at its deadline
    assert engine.stats().pending == 0
    problems = checked.problems()  # the close gave up on it: the store closed under it
    assert len(problems) == 1 and "launched but never waited" in problems[0], problems


@pytest.mark.asyncio
async def test_an_evict_during_a_try_wait_outage_fails_and_drops_nothing(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    copying = held(monkeypatch, Copier, "_move_cpu", lambda copier, job: job.to_host)
    outage, checked, engine = outage_rig(caches, request_timeout_ms=0)
    async with engine:
        outage.failing.set()
        offload = asyncio.ensure_future(engine.offload("u", torch.arange(4), TOKENS))
        try:
            assert await asyncio.to_thread(copying.entered.wait, 10)
            with pytest.raises(aiokv.StoreError, match="nothing was dropped"):
                await asyncio.wait_for(engine.evict("u"), 10)
        finally:
            outage.failing.clear()
            copying.set()
        assert (await asyncio.wait_for(offload, 10)).stored_tokens == TOKENS
        async with await engine.lookup("u", TOKENS) as hit:
            assert hit.cached_tokens == TOKENS  # the evict dropped nothing
        assert await engine.evict("u") == TOKENS  # once the store answers again
    assert checked.problems() == []
