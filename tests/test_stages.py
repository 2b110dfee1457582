"""Each request's stage, written once per transition: QUEUED (made), DISPATCHED (the
batcher), LAUNCHED (the store thread's launch), TERMINAL (resolution)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from conftest import failing_first_call, small_store

import aiokv
import aiokv.requests
from aiokv.requests import Request, Stage
from aiokv.testing import CheckingStore, FaultyStore
from aiokv.worker.thread import StoreWorker

Q, D, L, T = Stage.QUEUED, Stage.DISPATCHED, Stage.LAUNCHED, Stage.TERMINAL


class Stages:
    """Every stage written to every request the engine makes, in the order written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        writes: list[tuple[Request, Stage]] = []
        self._writes = writes

        class Recorded(Request):
            __slots__ = ()

            def __setattr__(self, name: str, value: Any) -> None:
                if name == "stage":
                    writes.append((self, value))  # list.append: safe from both threads
                super().__setattr__(name, value)

        monkeypatch.setattr(aiokv.requests, "Request", Recorded)

    def of(self, user_id: object, kind: aiokv.requests.Kind) -> list[Stage]:
        requests = {id(r): r for r, _ in self._writes if r.user_id == user_id and r.kind is kind}
        assert len(requests) == 1, f"{len(requests)} {kind.name} requests of {user_id!r}"
        (request,) = requests.values()
        return [stage for r, stage in self._writes if r is request]


def _engine(caches: list[torch.Tensor], **config: Any) -> tuple[aiokv.OffloadEngine, FaultyStore,
                                                                 CheckingStore]:
    faulty = FaultyStore(small_store())
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    return aiokv.OffloadEngine(checked, caches, aiokv.EngineConfig(**config)), faulty, checked


@pytest.mark.asyncio
async def test_an_offload_a_lookup_and_a_load_go_through_their_stages(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    stages = Stages(monkeypatch)
    engine, _, checked = _engine(caches, window_us=0)
    async with engine:
        stored = await engine.offload("u", torch.arange(4), 16)
        hit = await engine.lookup("u", 16)
        # The lookup is done, its reservation held by the Lookup: it never launched.
        assert stages.of("u", aiokv.requests.Kind.LOOKUP) == [Q, D, T]
        loaded = await engine.load(hit, torch.arange(8, 12))
    assert stored.stored_tokens == 16 and loaded.loaded_tokens == 16
    assert stages.of("u", aiokv.requests.Kind.OFFLOAD) == [Q, D, L, T]
    assert stages.of("u", aiokv.requests.Kind.LOAD) == [Q, D, L, T]
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_a_caller_cancelled_after_launch_ends_terminal(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    stages = Stages(monkeypatch)
    engine, faulty, checked = _engine(caches, window_us=0)
    faulty.hold.clear()  # the transfer does not finish until released
    async with engine:
        call = asyncio.ensure_future(engine.offload("u", torch.arange(4), 16))
        assert await asyncio.to_thread(faulty.launched.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert stages.of("u", aiokv.requests.Kind.OFFLOAD) == [Q, D, L, T]
        faulty.hold.set()
    # Closed: the launched transfer was waited for and its outcome came back, found the
    # future done, and left the request terminal.
    seen = stages.of("u", aiokv.requests.Kind.OFFLOAD)
    assert seen[:4] == [Q, D, L, T] and set(seen[4:]) <= {T}, seen
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_a_caller_cancelled_before_dispatch_is_never_dispatched(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    stages = Stages(monkeypatch)
    engine, _, checked = _engine(caches, window_us=10_000_000, max_batch_requests=2)
    async with engine:
        doomed = asyncio.ensure_future(engine.offload("gone", torch.arange(4), 16))
        await asyncio.sleep(0)  # queued in the open window
        doomed.cancel()
        # Two live calls fill the window (the cancelled one no longer counts).
        kept, also = await asyncio.wait_for(asyncio.gather(
            engine.offload("kept", torch.arange(4, 8), 16),
            engine.offload("also", torch.arange(8, 12), 16)), 5)
        with pytest.raises(asyncio.CancelledError):
            await doomed
    assert kept.stored_tokens == also.stored_tokens == 16
    assert stages.of("gone", aiokv.requests.Kind.OFFLOAD) == [Q, T]
    assert stages.of("kept", aiokv.requests.Kind.OFFLOAD) == [Q, D, L, T]
    assert checked.calls["put_match"] == 2  # kept and also: never the cancelled one
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_a_failed_dispatch_goes_from_dispatched_to_terminal(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    stages = Stages(monkeypatch)
    monkeypatch.setattr(
        StoreWorker, "submit", failing_first_call(StoreWorker.submit, "inbox broke")
    )
    engine, _, checked = _engine(caches, window_us=0)
    async with engine:
        with pytest.raises(aiokv.StoreError, match="before reaching the store"):
            await engine.offload("u", torch.arange(4), 16)
        again = await engine.offload("v", torch.arange(4, 8), 16)  # the batcher goes on
    assert again.stored_tokens == 16
    assert stages.of("u", aiokv.requests.Kind.OFFLOAD) == [Q, D, T]
    assert stages.of("v", aiokv.requests.Kind.OFFLOAD) == [Q, D, L, T]
    assert checked.calls["put_match"] == 1
    assert checked.problems() == []
