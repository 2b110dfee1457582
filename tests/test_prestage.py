"""A load batch names its reservations to a store that prestages (base.Prestages) before
its page ids are fused, in launch order; the local store marks the launch of exactly
those tasks as prestaged (its copier then scatters the first chunk it copied ahead:
tests/test_copy_pipeline.py), and any other launch as not; a failing prestage costs
nothing but the head start."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, small_store

import aiokv
from aiokv.stores.base import Capabilities, Int64Array, Store
from aiokv.stores.local.transfer import CopyJob
from aiokv.testing import CheckingStore, FakeStore, StoreWrapper

TOKENS = 4 * PAGE_SIZE


class Recording(StoreWrapper):
    """Logs prestage:<ids> and launch:<ids>, in order."""

    raise_in_prestage = False

    def __init__(self, inner: Store) -> None:
        self.log: list[tuple[str, list[int]]] = []
        super().__init__(inner)

    def prestage(self, task_ids: Sequence[int]) -> None:
        self.log.append(("prestage", list(task_ids)))
        if self.raise_in_prestage:
            raise RuntimeError("prestage broke")
        self.inner.prestage(task_ids)  # type: ignore[attr-defined]

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        self.log.append(("launch", list(task_ids)))
        super().launch(task_ids, slot_mappings)


def one_batch(users: int) -> aiokv.EngineConfig:
    return aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=users)


async def offload_then_lookup(engine: aiokv.OffloadEngine, users: int) -> list[aiokv.Lookup]:
    await asyncio.gather(*(engine.offload(u, torch.arange(4 * u, 4 * u + 4), TOKENS)
                           for u in range(users)))
    return list(await asyncio.gather(*(engine.lookup(u, TOKENS) for u in range(users))))


@pytest.mark.asyncio
async def test_a_load_batch_names_its_reservations_in_launch_order_before_launching(
    caches: list[torch.Tensor],
) -> None:
    store = Recording(CheckingStore(small_store()))
    original = [c.clone() for c in caches]
    async with aiokv.OffloadEngine(store, caches, one_batch(4)) as engine:
        hits = await offload_then_lookup(engine, 4)
        store.log.clear()
        targets = [torch.arange(100 + 4 * u, 104 + 4 * u) for u in range(4)]
        loads = await asyncio.gather(*(engine.load(h, t) for h, t in zip(hits, targets, strict=True)))
    assert [r.loaded_tokens for r in loads] == [TOKENS] * 4
    (verb, named), (launch, launched) = store.log
    assert (verb, launch) == ("prestage", "launch")
    assert named == launched and len(named) == 4
    for u, target in enumerate(targets):
        for layer, cache in enumerate(caches):
            assert torch.equal(cache[target], original[layer][4 * u : 4 * u + 4])
    assert store.inner.problems() == []  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_a_bad_load_is_named_to_prestage_but_not_launched(
    caches: list[torch.Tensor],
) -> None:
    store = Recording(small_store())
    async with aiokv.OffloadEngine(store, caches, one_batch(3)) as engine:
        hits = await offload_then_lookup(engine, 3)
        store.log.clear()
        targets = [torch.arange(100, 104), torch.tensor([110, 111, 112, 9999]),
                   torch.arange(120, 124)]
        results = await asyncio.gather(*(engine.load(h, t) for h, t in zip(hits, targets, strict=True)),
                                       return_exceptions=True)
        stats = engine.stats()
    assert isinstance(results[1], aiokv.InvalidRequest)
    assert [r.loaded_tokens for i, r in enumerate(results) if i != 1] == [TOKENS] * 2  # type: ignore[union-attr]
    (_, named), (_, launched) = store.log
    assert len(named) == 3 and launched == [named[0], named[2]]
    assert stats.store_tasks_open == 0


@pytest.mark.asyncio
async def test_a_failing_prestage_is_only_logged_and_warned_of_once(
    caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture,
) -> None:
    store = Recording(small_store())
    store.raise_in_prestage = True
    async with aiokv.OffloadEngine(store, caches, one_batch(2)) as engine:
        for _ in range(2):
            hits = await offload_then_lookup(engine, 2)
            loads = await asyncio.gather(engine.load(hits[0], torch.arange(100, 104)),
                                         engine.load(hits[1], torch.arange(110, 114)))
            assert [r.loaded_tokens for r in loads] == [TOKENS] * 2
    warnings = [r for r in caplog.records if "store.prestage failed" in r.getMessage()
                and r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].exc_info is not None
    assert [verb for verb, _ in store.log].count("prestage") == 2


@pytest.mark.asyncio
async def test_stores_without_prestage_are_not_asked(caches: list[torch.Tensor]) -> None:
    store = Recording(FakeStore(PAGE_SIZE))
    assert Capabilities.of(FakeStore(PAGE_SIZE)).prestage is None
    async with aiokv.OffloadEngine(store.inner, caches, one_batch(2)) as engine:
        hits = await offload_then_lookup(engine, 2)
        loads = await asyncio.gather(engine.load(hits[0], torch.arange(100, 104)),
                                     engine.load(hits[1], torch.arange(110, 114)))
    assert [r.loaded_tokens for r in loads] == [TOKENS] * 2


class FakeCopier:
    """Stands in for the local store's load copier: records what it is handed."""

    def __init__(self, fail: bool = False) -> None:
        self.prestaged: list[list[int]] = []
        self.jobs: list[CopyJob] = []
        self.fail = fail

    def prestage(self, host_blocks: Int64Array, tag: int) -> None:
        if self.fail:
            raise RuntimeError("the copier is gone")
        self.prestaged.append([tag, *host_blocks.tolist()])

    def submit(self, job: CopyJob) -> None:
        self.jobs.append(job)

    def close(self) -> None:
        pass


def stored_gets(store: aiokv.LocalStore, users: int) -> list[tuple[int, Any]]:
    """Put ``users`` keys of 4 pages (copied at once on the CPU), then match each."""
    for u in range(users):
        task_id, _ = store.put_match(np.arange(TOKENS, dtype=np.int64), [f"k{u}"])
        store.launch([task_id], [np.arange(TOKENS, dtype=np.int64) + TOKENS * u])
    ended: dict[int, Any] = {}
    deadline = time.monotonic() + 10
    while len(ended) < users and time.monotonic() < deadline:
        ended.update(store.try_wait([t for t in range(1, users + 1) if t not in ended]))
        time.sleep(0.001)
    assert len(ended) == users
    return [store.get_match(np.arange(TOKENS, dtype=np.int64), [f"k{u}"]) for u in range(users)]


@pytest.mark.parametrize("launched", ["same", "fewer", "reordered", "copier failed"])
def test_the_local_store_marks_only_the_prestaged_launch(
    caches: list[torch.Tensor], launched: str,
) -> None:
    store = small_store()
    store.register(caches)
    try:
        gets = stored_gets(store, 3)
        ids = [task_id for task_id, _ in gets]
        copier = FakeCopier(fail=launched == "copier failed")
        store._load_transfer = copier  # type: ignore[assignment]
        blocks = [store._tasks[t].blocks.tolist() for t in ids]
        if launched == "copier failed":
            with pytest.raises(RuntimeError):
                store.prestage(ids)
        else:
            store.prestage([*ids, 10_000])  # an id it does not know is ignored
            (tag, *prestaged), = copier.prestaged
            assert tag > 0 and prestaged == blocks[0] + blocks[1] + blocks[2]
        chosen = {"fewer": ids[:2], "reordered": ids[::-1]}.get(launched, ids)
        slots = [np.arange(TOKENS, dtype=np.int64) + (40 + 4 * i) * PAGE_SIZE
                 for i in range(len(chosen))]
        store.launch(chosen, slots)
        (job,) = copier.jobs
        assert job.prestaged == (tag if launched == "same" else 0)
        assert store._prestaged == (0, [])  # a launch consumes it, whatever it launched
        store.cancel([t for t in ids if t not in chosen])
    finally:
        store._load_transfer = None
        store.close()
