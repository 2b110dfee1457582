"""A large offload batch on a store that queues copies at once (QueuesCopies: the local
store) launches its first requests before it matches the rest (Rounds.move, _head), so
that copying starts before the last match; other stores, and small batches, keep one
launch per batch."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, one_batch, small_store

import aiokv
from aiokv.requests import Kind
from aiokv.stores.base import BoolArray, Int64Array, MatchAnswers, Queries, Store
from aiokv.testing import CheckingStore, FakeStore, StoreWrapper

TOKENS = 4 * PAGE_SIZE  # four pages per user


class Recording(StoreWrapper):
    """Logs the store calls of a round in order: put, launch:<tasks>, wait_queued."""

    def __init__(self, inner: Store) -> None:
        self.log: list[str] = []
        super().__init__(inner)

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self.log.append("put")
        return super().put_match(token_ids, namespace)

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        self.log.append(f"launch:{len(task_ids)}")
        super().launch(task_ids, slot_mappings)


class RecordingQueues(Recording):
    def wait_queued(self) -> None:
        self.log.append("wait_queued")
        inner = self.inner.wait_queued  # type: ignore[attr-defined]
        inner()


class MatchesMany(Recording):
    """Matches a batch in one call, as a store in another process does."""

    def wait_queued(self) -> None:
        self.inner.wait_queued()  # type: ignore[attr-defined]

    def put_match_many(self, queries: Queries) -> MatchAnswers:
        self.log.append(f"put_many:{len(queries)}")
        return [self.inner.put_match(tokens, namespace) for tokens, namespace in queries]


def user_pages(user: int) -> torch.Tensor:
    return torch.arange(4 * user, 4 * user + 4)


async def offload_all(engine: aiokv.OffloadEngine, pages: list[torch.Tensor]) -> list[object]:
    calls = (engine.offload(u, p, TOKENS) for u, p in enumerate(pages))
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=10)


@pytest.mark.asyncio
async def test_a_large_offload_batch_launches_its_first_requests_before_matching_the_rest(
    caches: list[torch.Tensor],
) -> None:
    store = RecordingQueues(small_store())
    original = [c.clone() for c in caches]
    async with aiokv.OffloadEngine(store, caches, one_batch(16)) as engine:
        results = await offload_all(engine, [user_pages(u) for u in range(16)])
        assert store.log == ["put"] * 2 + ["launch:2", "wait_queued"] + ["put"] * 14 + ["launch:14"]
        assert engine.stats().batches == 1
        # Both launches stored their pages: every user loads back what it offloaded.
        hits = await asyncio.gather(*(engine.lookup(u, TOKENS) for u in range(16)))
        targets = [torch.arange(128 + 4 * u, 128 + 4 * u + 4) for u in range(16)]
        loads = await asyncio.gather(*(engine.load(h, t) for h, t in zip(hits, targets, strict=True)))
    assert [r.stored_tokens for r in results] == [TOKENS] * 16  # type: ignore[attr-defined]
    assert [r.loaded_tokens for r in loads] == [TOKENS] * 16
    for u in range(16):
        for layer, cache in enumerate(caches):
            assert torch.equal(cache[targets[u]], original[layer][user_pages(u)]), (u, layer)


@pytest.mark.asyncio
async def test_bad_page_ids_before_and_after_the_split_fail_those_requests_once(
    caches: list[torch.Tensor],
) -> None:
    store = RecordingQueues(small_store())
    pages = [user_pages(u) for u in range(16)]
    pages[0] = torch.tensor([0, 1, 2, 10_000])  # in the first launch's part
    pages[5] = torch.tensor([20, 21, 300, 23])  # in the rest
    async with aiokv.OffloadEngine(store, caches, one_batch(16)) as engine:
        results = await offload_all(engine, pages)
        stats = engine.stats()
    for user in (0, 5):
        error = results[user]
        assert isinstance(error, aiokv.InvalidRequest) and error.field == "page_ids", error
    assert "10000" in str(results[0]) and "300" in str(results[5])
    good = [r for u, r in enumerate(results) if u not in (0, 5)]
    assert [r.stored_tokens for r in good] == [TOKENS] * 14  # type: ignore[attr-defined]
    # Request 0 was matched before its page ids were read (then given back); request 5,
    # read by the time the rest were matched, never was.
    assert store.log == ["put"] * 2 + ["launch:1", "wait_queued"] + ["put"] * 13 + ["launch:13"]
    assert stats.store_tasks_open == 0 and stats.pending == 0


@pytest.mark.parametrize("users", [15])
@pytest.mark.asyncio
async def test_a_batch_below_the_split_size_launches_once(
    caches: list[torch.Tensor], users: int
) -> None:
    store = RecordingQueues(small_store())
    async with aiokv.OffloadEngine(store, caches, one_batch(users)) as engine:
        results = await offload_all(engine, [user_pages(u) for u in range(users)])
    assert store.log == ["put"] * users + [f"launch:{users}"]
    assert [r.stored_tokens for r in results] == [TOKENS] * users  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_stores_that_match_many_at_once_or_queue_no_copies_launch_once(
    caches: list[torch.Tensor],
) -> None:
    many = MatchesMany(small_store())
    async with aiokv.OffloadEngine(many, caches, one_batch(16)) as engine:
        await offload_all(engine, [user_pages(u) for u in range(16)])
    assert many.log == ["put_many:16", "launch:16"]  # one round trip would become two

    fake = Recording(FakeStore(PAGE_SIZE))  # no wait_queued
    async with aiokv.OffloadEngine(fake, caches, one_batch(16)) as engine:
        results = await offload_all(engine, [user_pages(u) for u in range(16)])
    assert fake.log == ["put"] * 16 + ["launch:16"]
    assert all(isinstance(r, aiokv.OffloadResult) for r in results)


def test_the_local_store_waits_for_its_copy_thread_to_take_the_last_job() -> None:
    """LocalStore.wait_queued returns once the copy thread has the job (at once when no
    job was launched); the job's copy may still run."""
    from aiokv.stores.local.pool import HostPool
    from aiokv.stores.local.transfer import CopyJob, Transfer

    cache = torch.zeros(8, 2, PAGE_SIZE, 2, 8)
    pool = HostPool.for_caches([cache], 0.001)
    done: list[CopyJob] = []
    transfer = Transfer([cache], pool, done.append)
    try:
        assert transfer.wait_queued(timeout=0)  # nothing submitted yet
        job = CopyJob([1], True, np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64))
        transfer.submit(job)
        assert transfer.wait_queued(timeout=5)
        assert job.queued.is_set()
    finally:
        transfer.close()
        pool.close()
    assert done == [job]


def test_the_head_is_an_eighth_of_a_lone_batch_of_sixteen_or_more() -> None:
    from aiokv.rounds import Rounds
    from aiokv.stores.base import Capabilities

    launched: dict[int, object] = {}
    rounds = Rounds(
        FakeStore(PAGE_SIZE), Capabilities(wait_queued=lambda: None), None, None,  # type: ignore[arg-type]
        256, None, launched, set(), None, lambda task_id: None,  # type: ignore[arg-type]
    )
    assert [rounds._head(range(n)) for n in (1, 15, 16, 23, 24, 64)] == [0, 0, 2, 2, 3, 8]
    launched[6] = SimpleNamespace(kind=Kind.LOAD)
    assert rounds._head(range(64)) == 0  # CPU caches: one copy thread, busy with the load
    rounds._copy_stream = object()  # GPU caches: loads copy the other way, on their own
    assert rounds._head(range(64)) == 8
    launched[7] = SimpleNamespace(kind=Kind.OFFLOAD)  # copies out busy: no split
    assert rounds._head(range(64)) == 0
    rounds._copy_stream = None
    many = Capabilities(wait_queued=lambda: None, put_match_many=lambda queries: [])
    launched.clear()
    rounds._caps = many
    assert rounds._head(range(64)) == 0


class FailingWait(RecordingQueues):
    fail = True

    def wait_queued(self) -> None:
        super().wait_queued()
        if self.fail:
            raise RuntimeError("the copy thread is gone")


@pytest.mark.asyncio
async def test_a_failure_between_the_two_launches_fails_the_rest_and_holds_nothing(
    caches: list[torch.Tensor],
) -> None:
    """The first part is stored; the rest fail with the StoreError, unmatched, and a
    later batch stores them."""
    checking = CheckingStore(small_store())
    store = FailingWait(checking)
    async with aiokv.OffloadEngine(store, caches, one_batch(16)) as engine:
        results = await offload_all(engine, [user_pages(u) for u in range(16)])
        store.fail = False
        again = await offload_all(engine, [user_pages(u) for u in range(16)])
        stats = engine.stats()
    assert [isinstance(r, aiokv.OffloadResult) for r in results] == [True] * 2 + [False] * 14
    assert all(isinstance(r, aiokv.StoreError) for r in results[2:])
    assert [r.stored_tokens for r in again] == [0] * 2 + [TOKENS] * 14  # type: ignore[attr-defined]
    assert stats.store_tasks_open == 0 and stats.pending == 0
    assert checking.problems() == []  # every match launched or given back
