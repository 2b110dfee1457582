"""A load batch names its reservations to a store that prestages (base.Prestages) before
its page ids are fused, in launch order; the local store marks the launch of exactly
those tasks as prestaged (its copier then scatters the first chunk it copied ahead:
tests/test_copy_pipeline.py), and any other launch as not; a failing prestage costs
nothing but the head start."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, one_batch, small_store

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
    """Stands in for one of the local store's copiers: records what it is handed."""

    def __init__(self, fail: bool = False) -> None:
        self.prestaged: list[list[int]] = []
        self.pages: list[Sequence[torch.Tensor] | None] = []
        self.jobs: list[CopyJob] = []
        self.fail = fail
        self.settled: list[int] = []  # the store's free blocks at each settle_ahead
        self.store: aiokv.LocalStore | None = None

    def prestage(
        self, host_blocks: Int64Array, tag: int,
        gpu_pages: Sequence[torch.Tensor] | None = None, ready: Sequence[Any] = (),
    ) -> None:
        if self.fail:
            raise RuntimeError("the copier is gone")
        self.prestaged.append([tag, *host_blocks.tolist()])
        self.pages.append(gpu_pages)

    def settle_ahead(self) -> None:
        assert self.store is not None
        self.settled.append(self.store.free_blocks)

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


@contextlib.contextmanager
def store_with_fake_copiers(
    caches: list[torch.Tensor], gpu: bool = True,
) -> Iterator[tuple[aiokv.LocalStore, FakeCopier]]:
    """A registered local store whose offload copier is a FakeCopier (and, as on a GPU,
    a load copier of its own, unless not ``gpu``)."""
    store = small_store()
    store.register(caches)
    real = store._transfer
    copier = FakeCopier()
    copier.store = store
    try:
        store._transfer = copier  # type: ignore[assignment]
        store._load_transfer = FakeCopier() if gpu else None  # type: ignore[assignment]
        yield store, copier
    finally:
        store._transfer, store._load_transfer = real, None
        store.close()


@pytest.mark.parametrize("launched", ["same", "fewer", "pages mismatch", "no GPU"])
def test_the_local_store_marks_only_the_prestaged_put_launch_and_settles_its_cancels(
    caches: list[torch.Tensor], launched: str,
) -> None:
    with store_with_fake_copiers(caches, gpu=launched != "no GPU") as (store, copier):
        puts = [store.put_match(np.arange(TOKENS, dtype=np.int64) + u, [f"p{u}"])
                for u in range(3)]
        ids = [task_id for task_id, _ in puts]
        pages = [torch.arange(4 * u, 4 * u + 4) for u in range(3)]
        if launched == "pages mismatch":
            pages[1] = pages[1][:3]
        store.prestage_puts(ids, pages, [])
        if launched in ("pages mismatch", "no GPU"):
            assert copier.prestaged == [] and store._prestaged_puts == (0, [])
        else:
            (tag, *prestaged), = copier.prestaged
            assert prestaged == np.concatenate([store._tasks[t].blocks for t in ids]).tolist()
            assert copier.pages == [pages]
        chosen = ids[:2] if launched == "fewer" else ids
        store.launch(chosen, [np.arange(TOKENS, dtype=np.int64) + 4 * PAGE_SIZE * i
                              for i in range(len(chosen))])
        (job,) = copier.jobs
        assert job.prestaged == (tag if launched == "same" else 0)
        free = store.free_blocks
        store.cancel(ids[2:] if launched != "same" else [])
        if launched == "fewer":
            # The copy ahead may still write the cancelled task's blocks: settled first.
            assert copier.settled == [free] and store.free_blocks == free + 4
        else:
            assert copier.settled == []


def rounds_with(prestage_puts: Any, wait_queued: Any = None) -> Any:
    from aiokv.rounds import Rounds

    caps = Capabilities(prestage_puts=prestage_puts, wait_queued=wait_queued)
    rounds = Rounds(
        FakeStore(PAGE_SIZE), caps, None, None,  # type: ignore[arg-type]
        256, None, {}, set(), None, lambda task_id: None,  # type: ignore[arg-type]
    )
    rounds.page_size = PAGE_SIZE
    return rounds


def offload_request(pages: torch.Tensor, event: object = None) -> Any:
    from aiokv.requests import Kind, Request

    future: Any = None
    return Request(Kind.OFFLOAD, 0, future, TOKENS, None, (), pages, 4, event)


def page_mask(*new: int) -> Any:
    mask = np.zeros(TOKENS, dtype=np.bool_)
    for page in new:
        mask[page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = True
    return mask


def test_an_offload_round_names_each_launch_with_its_new_pages_device_ids() -> None:
    from aiokv.requests import TERMINAL

    named: list[tuple[Any, ...]] = []
    rounds = rounds_with(lambda *args: named.append(args), lambda: named.append(("queued",)))
    device = [torch.arange(10 * u, 10 * u + 6, device="meta") for u in range(5)]
    events = [object(), object()]
    requests = [offload_request(device[u], events[u % 2]) for u in range(5)]
    requests[3].stage = TERMINAL  # left since its match: the plan cancels it
    answers = [(11, page_mask(2, 3)), None, (13, page_mask(0, 1, 2, 3)), (14, page_mask(1)),
               (15, page_mask())]  # 1: not matched; 15: nothing new, cancelled
    rounds._prestage_puts(requests, answers)
    (ids, pages, ready), queued = named  # then waits for the store to queue the copy
    assert queued == ("queued",)
    assert ids == [11, 13]
    # Views of the callers' own tensors, at their new pages: no copy, no kernel.
    assert [(p.storage_offset(), len(p)) for p in pages] == [(2, 2), (0, 4)]
    assert ready == [events[0]]  # both named requests' (one caller stream)


@pytest.mark.parametrize("case", ["a hole", "pages on the host", "nothing new"])
def test_an_offload_round_the_launch_could_not_match_is_not_named(case: str) -> None:
    named: list[tuple[Any, ...]] = []
    rounds = rounds_with(lambda *args: named.append(args), lambda: named.append(("queued",)))
    requests = [offload_request(torch.arange(6, device="meta")) for _ in range(2)]
    answers: list[Any] = [(11, page_mask(0, 1)), (12, page_mask(0, 2) if case == "a hole"
                                                  else page_mask(1))]
    if case == "pages on the host":
        requests[1].page_ids = torch.arange(6)
    if case == "nothing new":
        answers = [(11, page_mask()), None]
    rounds._prestage_puts(requests, answers)
    assert named == []


def test_a_failing_offload_prestage_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("prestage broke")

    rounds = rounds_with(broken)
    requests = [offload_request(torch.arange(6, device="meta"))]
    for _ in range(2):
        rounds._prestage_puts(requests, [(11, page_mask(0))])
    assert [r.levelname for r in caplog.records if "prestage failed" in r.getMessage()] == [
        "WARNING"]


def test_an_offload_round_is_named_early_only_on_gpu_caches_with_the_copier_idle() -> None:
    from types import SimpleNamespace

    from aiokv.requests import Kind

    rounds = rounds_with(lambda *args: None)
    requests = [offload_request(torch.arange(6, device="meta")) for _ in range(2)]
    assert not rounds._prestages_puts(requests)  # CPU caches: nothing to gather ahead
    rounds._copy_stream = object()  # GPU caches
    assert rounds._prestages_puts(requests)
    assert not rounds._prestages_puts([*requests, offload_request(torch.arange(6))])
    rounds._launched[5] = SimpleNamespace(kind=Kind.LOAD)  # loads copy the other way
    assert rounds._prestages_puts(requests)
    rounds._launched[6] = SimpleNamespace(kind=Kind.OFFLOAD)  # it would queue behind
    assert not rounds._prestages_puts(requests)
    rounds._caps = Capabilities()
    rounds._launched.clear()
    assert not rounds._prestages_puts(requests)  # a store without it


def test_a_fuse_that_fails_after_an_early_match_gives_every_match_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokv.batcher import Batch
    from aiokv.calls import StoreCalls
    from aiokv.requests import Kind

    store = Recording(CheckingStore(FakeStore(PAGE_SIZE)))
    cancelled: list[int] = []
    monkeypatch.setattr(store, "cancel", lambda ids: cancelled.extend(ids), raising=False)
    named: list[Any] = []
    rounds = rounds_with(lambda *args: named.append(args))
    rounds._store, rounds._calls = store, StoreCalls(store, lambda: None)
    rounds._copy_stream = object()

    def broken(batch: Any) -> None:
        raise RuntimeError("the slot copy failed")

    monkeypatch.setattr(rounds, "_fuse", broken)
    requests = [offload_request(torch.arange(6, device="meta")) for _ in range(3)]
    for u, request in enumerate(requests):
        request.token_ids = np.arange(TOKENS, dtype=np.int64) + 1000 * u
    with pytest.raises(RuntimeError, match="slot copy"):
        rounds.move(Batch(Kind.OFFLOAD, tuple(requests)), [])
    ((ids, _, _),) = named  # matched and named before the fuse
    assert len(ids) == 3 and sorted(cancelled) == sorted(ids)


def test_a_put_named_by_an_older_prestage_still_waits_for_it_when_cancelled(
    caches: list[torch.Tensor],
) -> None:
    with store_with_fake_copiers(caches) as (store, copier):
        ids = [store.put_match(np.arange(TOKENS, dtype=np.int64) + u, [f"p{u}"])[0]
               for u in range(3)]
        pages = [torch.arange(4 * u, 4 * u + 4) for u in range(3)]
        store.prestage_puts(ids[:1], pages[:1], [])
        store.prestage_puts(ids[1:], pages[1:], [])  # the newer one replaces the tag only
        store.launch(ids[1:], [np.arange(TOKENS, dtype=np.int64) + 4 * PAGE_SIZE * i
                               for i in range(2)])
        assert copier.jobs[0].prestaged == copier.prestaged[1][0]
        fail = [True]

        def settle() -> None:
            copier.settled.append(store.free_blocks)
            if fail.pop(0) if fail else False:
                raise RuntimeError("the device is gone")

        copier.settle_ahead = settle  # type: ignore[method-assign]
        free = store.free_blocks
        with pytest.raises(RuntimeError):
            store.cancel(ids[:1])  # a failed wait frees nothing...
        assert store.free_blocks == free
        store.cancel(ids[:1])  # ...and its retry waits again
        assert copier.settled == [free, free] and store.free_blocks == free + 4
        store.cancel(ids[:1])  # gone: nothing to wait for
        assert len(copier.settled) == 2
