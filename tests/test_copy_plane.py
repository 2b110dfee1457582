"""The data plane on the CPU: copy plans checked by moving their bytes with memmove against
torch's indexing, the page id checks' errors, the CPU copier's bytes and layer marks, and
LocalStore failing a task with bad page ids alone (INVALID) and freeing its blocks."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, make_caches

import aiokv
from aiokv.copy import copier as copier_module
from aiokv.copy.copier import Copier, CopyJob
from aiokv.copy.driver import BatchCopy, DriverError, batch_entry
from aiokv.copy.marks import LayerFailed, LayerMarks
from aiokv.copy.plan import MIN_RUN, Geometry, check_pages, find_runs, plan, split
from aiokv.stores.base import NoSpace, TaskResult, TaskStatus
from aiokv.stores.local.layout import block_stride, strided_blocks

LAYERS = 3


TRAILER_MARK = 0xA5


def pool_for(caches: list[torch.Tensor], blocks: int, trailer: bool = False) -> torch.Tensor:
    """A zeroed host pool for ``caches``; with ``trailer`` its blocks are a remote tier's
    stride apart, and the bytes between them (the trailers) hold ``TRAILER_MARK``."""
    shape = (len(caches), *caches[0].shape[1:])
    if not trailer:
        return torch.zeros(blocks, *shape, dtype=caches[0].dtype)
    block_bytes = int(np.prod(shape)) * caches[0].element_size()
    stride = block_stride(block_bytes, True)
    raw = torch.full((blocks * stride,), TRAILER_MARK, dtype=torch.uint8)
    pool = strided_blocks(raw, blocks, shape, caches[0].dtype, stride)
    pool.zero_()
    return pool


def trailers_of(pool: torch.Tensor) -> torch.Tensor:
    """The bytes between a strided pool's blocks (its trailers)."""
    element = pool.element_size()
    stride, size = pool.stride(0) * element, pool[0].numel() * element
    raw = torch.as_strided(pool.view(torch.uint8), (pool.shape[0], stride), (stride, 1))
    return raw[:, size:]


def memmove_plan(caches: list[torch.Tensor], pool: torch.Tensor, pages: np.ndarray,
                 blocks: np.ndarray, to_host: bool, streams: int, **options: object) -> int:
    """Run a plan's copies with memmove, part by part (a 2-D copy row by row); the number
    of copies made."""
    copies = plan(Geometry.of(caches, pool), pages, blocks, to_host, streams, **options)  # type: ignore[arg-type]
    runs = copies.runs
    made = 0
    for layer in range(len(caches)):
        for stream in range(copies.streams):
            for dst, src, size in zip(*copies.part(layer, stream), strict=True):
                ctypes.memmove(int(dst), int(src), int(size))
                made += 1
            for r in runs.on(stream) if runs is not None else []:
                for row in range(int(runs.heights[r])):
                    ctypes.memmove(int(runs.dsts[layer, r]) + row * runs.dst_pitch,
                                   int(runs.srcs[layer, r]) + row * runs.src_pitch, runs.width)
                made += 1
    return made


@pytest.mark.parametrize("trailer", [False, True], ids=["packed", "trailer"])
@pytest.mark.parametrize("streams", [1, 4, 8])
def test_a_plan_moves_every_page_of_every_layer_to_its_block_and_back(
    streams: int, trailer: bool
) -> None:
    rng = np.random.default_rng(streams)
    # Tables whose pages are not adjacent (every other page of a larger tensor): the
    # plan must follow the table's page stride, not the page size.
    caches = [c[::2] for c in make_caches(pages=64, layers=LAYERS, seed=1)]
    pool = pool_for(caches, 40, trailer)
    pages = rng.choice(32, size=7, replace=False).astype(np.int64)
    blocks = rng.choice(40, size=7, replace=False).astype(np.int64)
    assert memmove_plan(caches, pool, pages, blocks, True, streams) == 7 * LAYERS
    for layer, cache in enumerate(caches):
        assert torch.equal(pool[torch.from_numpy(blocks), layer], cache[torch.from_numpy(pages)])
    untouched = np.setdiff1d(np.arange(40), blocks)
    assert not pool[torch.from_numpy(untouched)].any()
    if trailer:  # a remote tier's checksums between the blocks: never written
        assert bool((trailers_of(pool) == TRAILER_MARK).all())
    # Back into other pages.
    targets = np.setdiff1d(np.arange(32), pages)[:7]
    memmove_plan(caches, pool, targets, blocks, False, streams)
    for cache in caches:
        assert torch.equal(cache[torch.from_numpy(targets)], cache[torch.from_numpy(pages)])


@pytest.mark.parametrize("trailer", [False, True], ids=["packed", "trailer"])
@pytest.mark.parametrize("streams", [1, 4])
def test_runs_of_adjacent_pages_move_the_same_bytes_in_fewer_copies(
    streams: int, trailer: bool
) -> None:
    # Two runs (over a strided table's pages), singles between them, a run one page too
    # short to count: out and back, every byte where page by page puts it.
    m = MIN_RUN
    caches = [c[::2] for c in make_caches(pages=2 * 8 * m, layers=LAYERS, seed=2)]
    pool = pool_for(caches, 6 * m, trailer)
    pages = np.concatenate([np.arange(10, 10 + m), [2, 4 * m, 5], np.arange(2 * m, 3 * m - 1),
                            np.arange(3 * m + 10, 4 * m + 18)])
    blocks = np.concatenate([np.arange(0, m), [5 * m, 5 * m - 5, 5 * m - 10],
                             np.arange(m + 5, 2 * m + 4), np.arange(3 * m, 4 * m + 8)])
    made = memmove_plan(caches, pool, pages, blocks, True, streams)
    singles = 3 + m - 1
    assert made == (singles + 2) * LAYERS
    index_p, index_b = torch.from_numpy(pages), torch.from_numpy(blocks)
    for layer, cache in enumerate(caches):
        assert torch.equal(pool[index_b, layer], cache[index_p])
    assert not pool[torch.from_numpy(np.setdiff1d(np.arange(6 * m), blocks))].any()
    if trailer:
        assert bool((trailers_of(pool) == TRAILER_MARK).all())
    targets = np.setdiff1d(np.arange(8 * m), pages)[: len(pages)]  # runs of their own
    memmove_plan(caches, pool, targets, blocks, False, streams)
    for cache in caches:
        assert torch.equal(cache[torch.from_numpy(targets)], cache[index_p])


def test_runs_are_at_least_min_run_long_and_never_cross_a_pinned_chunk() -> None:
    starts, lengths = find_runs(np.arange(50), np.arange(50), 32)
    assert starts.tolist() == [0] and lengths.tolist() == [50]
    # The blocks jump once: two runs, and the short one is not a run.
    blocks = np.concatenate([np.arange(40), np.arange(100, 110)])
    starts, lengths = find_runs(np.arange(50), blocks, 8)
    assert (starts.tolist(), lengths.tolist()) == ([0, 40], [40, 10])
    assert find_runs(np.arange(50), blocks, 11)[0].tolist() == [0]
    # A pool pinned in chunks starting at blocks 0, 20 and 64: a run stops at each start.
    caches = make_caches(pages=80, layers=2)
    pool = pool_for(caches, 80)
    copies = plan(Geometry.of(caches, pool), np.arange(70), np.arange(5, 75), True, 2,
                  min_run=8, chunk_starts=(0, 20, 64))
    assert copies.runs is not None
    geometry = Geometry.of(caches, pool)
    first_blocks = ((copies.runs.dsts[0].astype(np.int64) - geometry.host_base)
                    // geometry.block_bytes)
    spans = sorted(zip(first_blocks.tolist(), copies.runs.heights.tolist(), strict=True))
    assert spans == [(5, 15), (20, 44), (64, 11)]


def test_streams_split_the_pages_without_gaps_or_empty_parts() -> None:
    for count in range(0, 20):
        for streams in (1, 3, 4, 8):
            bounds = split(count, streams)
            assert bounds[0] == 0 and bounds[-1] == count
            assert len(bounds) - 1 == max(1, min(streams, count))
            sizes = np.diff(bounds)
            assert count == 0 or (sizes > 0).all()


def test_page_checks_name_the_bad_id() -> None:
    assert check_pages(np.array([0, 3, 9]), 10, once=True) is None
    outside = check_pages(np.array([0, 10, 3]), 10, once=False)
    assert outside == "holds 10, outside [0, 10)"
    negative = check_pages(np.array([-1]), 10, once=False)
    assert negative is not None and negative.startswith("holds -1, outside [0, 10)")
    # A load writes each page once; an offload may read one page twice.
    assert check_pages(np.array([4, 2, 4]), 10, once=False) is None
    twice = check_pages(np.array([4, 2, 4]), 10, once=True)
    assert twice == "holds 4 twice; a load writes each page once"


def test_a_plan_refuses_pages_and_blocks_of_different_lengths() -> None:
    caches = make_caches(pages=8, layers=2)
    with pytest.raises(ValueError, match="3 pages but 2 blocks"):
        plan(Geometry.of(caches, pool_for(caches, 4)), np.arange(3), np.arange(2), True, 4)


# ---- the copier, on the CPU ----------------------------------------------------------


class Done:
    """on_done for a copier: the jobs, and an event per job."""

    def __init__(self) -> None:
        self.jobs: list[CopyJob] = []
        self.event = threading.Event()

    def __call__(self, job: CopyJob) -> None:
        self.jobs.append(job)
        self.event.set()

    def wait(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.jobs) < count:
            assert time.monotonic() < deadline, "copy jobs did not end"
            self.event.wait(0.01)
            self.event.clear()


class OrderedMarks(LayerMarks):
    """Marks that record, at each layer reported, which layers read as ready and whether
    that layer's bytes were in place then."""

    def __init__(self, num_layers: int, check: object) -> None:
        super().__init__(num_layers)
        self.seen: list[list[bool]] = []
        self.bytes_in_place: list[bool] = []
        self._check = check

    def layer_done(self, layer: int) -> None:
        super().layer_done(layer)
        self.seen.append([self.is_ready(i) for i in range(self.num_layers)])
        self.bytes_in_place.append(self._check(layer))  # type: ignore[operator]


@pytest.mark.parametrize("trailer", [False, True], ids=["packed", "trailer"])
def test_the_cpu_copier_moves_offloads_and_loads_and_marks_layers_in_order(
    trailer: bool,
) -> None:
    caches = make_caches(pages=32, layers=LAYERS, seed=2)
    pool = pool_for(caches, 16, trailer)
    done = Done()
    copier = Copier(caches, pool, done)
    try:
        # Two tasks' pages (one given as a tensor, one as numpy) into blocks 9.., 2..
        pages = [torch.tensor([5, 1, 7]), np.array([30, 2])]
        blocks = np.array([9, 10, 11, 2, 3], dtype=np.int64)
        copier.submit(CopyJob(True, pages, blocks, names=[1, 2]))
        done.wait(1)
        assert done.jobs[0].error is None and not done.jobs[0].invalid
        for layer, cache in enumerate(caches):
            assert torch.equal(pool[[9, 10, 11, 2, 3], layer], cache[[5, 1, 7, 30, 2]])
        targets = torch.tensor([20, 21, 22, 23, 24])

        def in_place(layer: int) -> bool:
            return torch.equal(caches[layer][targets], caches[layer][[5, 1, 7, 30, 2]])

        marks = OrderedMarks(LAYERS, in_place)
        copier.submit(CopyJob(False, [targets], blocks, names=[3], marks=[marks]))
        done.wait(2)
        assert done.jobs[1].error is None
        assert all(in_place(layer) for layer in range(LAYERS))
        # Each layer reported after its bytes, and the ready layers always a prefix.
        assert marks.bytes_in_place == [True] * LAYERS
        assert marks.seen == [[i <= k for i in range(LAYERS)] for k in range(LAYERS)]
        assert marks.error is None and all(marks.is_ready(i) for i in range(LAYERS))
        if trailer:
            assert bool((trailers_of(pool) == TRAILER_MARK).all())
    finally:
        copier.close()


def test_a_bad_id_refuses_only_its_segment_and_wakes_its_layer_waiters() -> None:
    caches = make_caches(pages=16, layers=LAYERS, seed=3)
    before = [cache.clone() for cache in caches]
    pool = pool_for(caches, 8)
    pool[:] = 1.5
    done = Done()
    copier = Copier(caches, pool, done)
    try:
        bad, good = LayerMarks(LAYERS), LayerMarks(LAYERS)
        failed: list[BaseException] = []

        def waiter() -> None:
            try:
                bad.synchronize(LAYERS - 1)
            except LayerFailed as exc:
                failed.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        # Load: task 8 gives page 3 twice, task 9 is fine.
        job = CopyJob(False, [torch.tensor([3, 4, 3]), torch.tensor([10, 11])],
                      np.arange(5, dtype=np.int64), names=[8, 9], marks=[bad, good])
        copier.submit(job)
        done.wait(1)
        thread.join(10)
        assert not thread.is_alive() and len(failed) == 1 and "holds 3 twice" in str(failed[0])
        assert list(job.invalid) == [0] and "holds 3 twice" in job.invalid[0]
        assert job.error is None and good.error is None and good.is_ready(LAYERS - 1)
        for layer, cache in enumerate(caches):
            assert (cache[[10, 11]] == 1.5).all()  # the good task's pages were loaded
            assert torch.equal(cache[[3, 4]], before[layer][[3, 4]])  # the bad one's not
    finally:
        copier.close()


def test_a_failed_copy_fails_the_job_and_every_layer_waiter() -> None:
    caches = make_caches(pages=16, layers=LAYERS)
    done = Done()
    copier = Copier(caches, pool_for(caches, 8), done)
    try:
        marks = LayerMarks(LAYERS)
        # A host block past the pool: the copy itself fails (a store never asks this).
        copier.submit(CopyJob(False, [torch.tensor([1])], np.array([99]), names=[4],
                              marks=[marks]))
        done.wait(1)
        error = done.jobs[0].error
        assert error is not None and "IndexError" in error
        for layer in range(LAYERS):
            with pytest.raises(LayerFailed, match="IndexError"):
                marks.wait(layer)
    finally:
        copier.close()


def test_a_layer_waiter_gets_that_layers_events_on_its_stream() -> None:
    """On a GPU a layer is marked by the events recorded after its copies, one per copy
    stream: a waiter's stream must wait for exactly those (here, named stand-ins)."""

    class Stream:
        def __init__(self) -> None:
            self.waited: list[str] = []

        def wait_event(self, event: str) -> None:
            self.waited.append(event)

    marks, stream = LayerMarks(3), Stream()
    waiter = threading.Thread(target=marks.wait, args=(1, stream))
    waiter.start()  # blocks until layer 1 is queued
    marks.layer_queued(0, ["0a", "0b"])
    marks.layer_queued(1, ["1a", "1b"])
    waiter.join(10)
    assert not waiter.is_alive() and stream.waited == ["1a", "1b"]
    with pytest.raises(ValueError, match="layer 1 queued after 2 layers"):
        marks.layer_queued(1, ["again"])  # layers are queued once, in order
    marks.fail("the copy failed")
    with pytest.raises(LayerFailed, match="the copy failed"):
        marks.wait(2, stream)


# ---- LocalStore, driven directly -----------------------------------------------------


def wait_all(store: aiokv.LocalStore, ids: list[int]) -> dict[int, TaskResult]:
    results: dict[int, TaskResult] = {}
    deadline = time.monotonic() + 30
    while len(results) < len(ids):
        assert time.monotonic() < deadline, "tasks did not finish"
        results.update(store.try_wait([i for i in ids if i not in results]))
        time.sleep(0.001)
    return results


@pytest.fixture
def local() -> Iterator[tuple[aiokv.LocalStore, list[torch.Tensor]]]:
    """A registered LocalStore on 32-page CPU caches, closed after the test."""
    caches = make_caches(pages=32)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(caches)
    yield store, caches
    store.close()


def test_a_bad_page_id_fails_only_its_task_as_invalid_and_frees_its_blocks(
    local: tuple[aiokv.LocalStore, list[torch.Tensor]],
) -> None:
    store, caches = local
    tokens = np.arange(3 * PAGE_SIZE, dtype=np.int64)
    free = store.free_blocks
    good, _ = store.put_match(tokens, ["good"])
    bad, _ = store.put_match(tokens, ["bad"])
    store.launch([good, bad], [torch.tensor([4, 5, 6]), torch.tensor([7, 32, 8])],
                 [None, None])
    results = wait_all(store, [good, bad])
    assert results[good].status is TaskStatus.SUCCESS
    assert results[bad].status is TaskStatus.INVALID
    assert results[bad].error == "holds 32, outside [0, 32)"
    assert store.free_blocks == free - 3  # the bad task's blocks came back
    again, mask = store.put_match(tokens, ["bad"])
    assert mask.all()  # nothing of it was stored
    store.cancel([again])
    # Loads: one giving a page twice fails alone; the other lands.
    first, mask_1 = store.get_match(tokens, ["good"])
    second, mask_2 = store.get_match(tokens, ["good"])
    assert mask_1.all() and mask_2.all()
    store.launch([first, second], [torch.tensor([20, 21, 20]), torch.tensor([24, 25, 26])],
                 [None, None])
    results = wait_all(store, [first, second])
    assert results[first].status is TaskStatus.INVALID and "twice" in results[first].error
    assert results[second].status is TaskStatus.SUCCESS
    for cache in caches:
        assert torch.equal(cache[24:27], cache[4:7])
    # Neither load holds its blocks any more: the key can be evicted whole.
    assert store.evict(["good"]) == 3 * PAGE_SIZE


def test_a_get_launched_with_no_ssd_part_has_layer_marks_that_end_ready(
    local: tuple[aiokv.LocalStore, list[torch.Tensor]],
) -> None:
    store, caches = local
    tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    put, _ = store.put_match(tokens, ["u"])
    store.launch([put], [torch.tensor([1, 2])], [None])
    wait_all(store, [put])
    assert store.layer_marks(put) is None  # an offload has none
    get, _ = store.get_match(tokens, ["u"])
    store.launch([get], [torch.tensor([10, 11])], [None])
    marks = store.layer_marks(get)
    assert marks is not None and marks.num_layers == len(caches)
    for layer in range(len(caches)):
        marks.synchronize(layer)
        assert torch.equal(caches[layer][10:12], caches[layer][1:3])
    assert wait_all(store, [get])[get].status is TaskStatus.SUCCESS


def test_launch_refuses_a_wrong_page_count_and_launches_none_of_the_tasks(
    local: tuple[aiokv.LocalStore, list[torch.Tensor]],
) -> None:
    store = local[0]
    a, _ = store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["a"])
    b, _ = store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["b"])
    with pytest.raises(ValueError, match=f"task {b} needs 2 page ids, got 3"):
        store.launch([a, b], [torch.tensor([1, 2]), torch.tensor([3, 4, 5])],
                     [None, None])
    store.launch([a, b], [torch.tensor([1, 2]), torch.tensor([3, 4])], [None, None])
    assert all(r.status is TaskStatus.SUCCESS for r in wait_all(store, [a, b]).values())


# ---- the driver ----------------------------------------------------------------------


def test_without_the_batch_call_the_driver_says_why() -> None:
    call, why = batch_entry()
    if call is not None:
        pytest.skip("this driver has cuMemcpyBatchAsync")
    assert why
    with pytest.raises(DriverError, match=re.escape(why)):
        BatchCopy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_without_the_batch_call_torch_copies_move_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def absent() -> None:
        raise DriverError("cuMemcpyBatchAsync not found (a test)")

    monkeypatch.setattr(copier_module, "BatchCopy", absent)
    monkeypatch.setattr(copier_module, "_fallback_warned", False)
    caches = [c.cuda() for c in make_caches(pages=32, layers=LAYERS, seed=4)]
    pool = pool_for(caches, 16).pin_memory()
    done = Done()
    with caplog.at_level("WARNING", logger="aiokv"):
        copier = Copier(caches, pool, done)
        try:
            copier.submit(CopyJob(True, [torch.tensor([3, 9, 4], device="cuda")],
                                  np.array([7, 0, 12]), names=[1]))
            done.wait(1)
            marks = LayerMarks(LAYERS)
            copier.submit(CopyJob(False, [torch.tensor([20, 21, 22])], np.array([7, 0, 12]),
                                  names=[2], marks=[marks]))
            done.wait(2)
        finally:
            copier.close()
    assert [job.error for job in done.jobs] == [None, None]
    for layer, cache in enumerate(caches):
        assert torch.equal(pool[[7, 0, 12], layer], cache[[3, 9, 4]].cpu())
        assert torch.equal(cache[20:23], cache[[3, 9, 4]])
    assert "a test" in caplog.text


def test_a_load_from_ssd_checks_its_whole_page_list_and_fails_alone(tmp_path: Path) -> None:
    caches = make_caches(pages=32)
    block = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(
        cpu_cache_gb=4 * block / (1 << 30), ssd_cache_gb=64 * 4096 / (1 << 30),
        ssd_cache_dir=str(tmp_path), ssd_write_policy="write_through"))
    store.register(caches)
    try:
        tokens = np.arange(4 * PAGE_SIZE, dtype=np.int64)
        # b's put evicts a's two tail blocks once they are on SSD: a load of a then
        # copies a host prefix of two pages and two pages staged from SSD, apart.
        for key, first, count in (("a", 0, 4), ("b", 4, 2)):
            deadline = time.monotonic() + 30
            while True:
                try:
                    task, _ = store.put_match(tokens[: count * PAGE_SIZE], [key])
                    break
                except NoSpace:
                    assert time.monotonic() < deadline, "no room came back"
                    store.try_wait([])
                    time.sleep(0.01)
            store.launch([task], [torch.arange(first, first + count)], [None])
            assert wait_all(store, [task])[task].status is TaskStatus.SUCCESS
        # b's SSD copy landed too (its blocks clean): the first load then stages a's tail
        # by evicting b's blocks. Were they still held, that load would wait for room, its
        # host prefix going back once copied and evicted for that room (a on the host as
        # [-, -, 2, 3]: the second match would stop at page 2, the host's, with 2 pages).
        deadline = time.monotonic() + 30
        while store.store_stats()["bytes_ssd_written"] < 6 * block:
            assert time.monotonic() < deadline, "the SSD copies did not land"
            store.try_wait([])
            time.sleep(0.001)
        results, marks = [], []
        # The first gives page 20 twice, once in each part (neither part alone repeats
        # a page); the pages it staged from SSD stay on the host for the second.
        for target in ([20, 21, 22, 20], [24, 25, 26, 27]):
            task, mask = store.get_match(tokens, ["a"])
            assert mask.all()
            store.launch([task], [torch.tensor(target)], [None])
            marks.append(store.layer_marks(task))
            results.append(wait_all(store, [task])[task])
        assert marks[0] is None  # a load with an SSD part: its layers are known at its end
        bad, good = results
        assert bad.status is TaskStatus.INVALID and "holds 20 twice" in bad.error
        assert good.status is TaskStatus.SUCCESS, good.error
        for cache in caches:
            assert torch.equal(cache[24:28], cache[0:4])
    finally:
        store.close()


class _StartsAsIfOnAGpu(Copier):
    """A copier that takes its CPU caches for a GPU's: its copy thread's start-up fails
    (``torch.cuda.set_device`` of a CPU device), as it would without a usable device."""

    @property  # type: ignore[override]
    def _cuda(self) -> bool:
        return True

    @_cuda.setter
    def _cuda(self, value: bool) -> None:
        pass


def test_jobs_fail_at_once_naming_why_when_the_copy_thread_cannot_start() -> None:
    caches = make_caches(pages=8, layers=LAYERS, seed=5)
    done = Done()
    copier = _StartsAsIfOnAGpu(caches, pool_for(caches, 4), done)
    try:
        marks = LayerMarks(LAYERS)
        copier.submit(CopyJob(True, [torch.tensor([1, 2])], np.array([0, 1]), names=[1]))
        copier.submit(CopyJob(False, [torch.tensor([3])], np.array([2]), names=[2],
                              marks=[marks]))
        done.wait(2)  # within Done's 10 s, not a caller's timeout
        for job in done.jobs:
            assert job.error is not None and "the copy thread stopped" in job.error
        with pytest.raises(LayerFailed, match="the copy thread stopped"):
            marks.synchronize(0)
    finally:
        copier.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
                                   torch.uint32, torch.uint64, torch.bool])
async def test_caches_of_any_dtype_go_out_and_come_back_bit_exact(dtype: torch.dtype) -> None:
    # torch's CPU index ops lack some of these dtypes; the bytes must move all the same.
    generator = torch.Generator().manual_seed(7)
    caches = [torch.randint(0, 256, (16, 2, PAGE_SIZE, 2, 8 * (dtype.itemsize or 1)),
                            dtype=torch.uint8, generator=generator).view(dtype)
              for _ in range(LAYERS)]
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.001))
    async with aiokv.OffloadEngine(store, caches) as engine:
        await engine.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
        async with await engine.lookup(1, 4 * PAGE_SIZE) as hit:
            got = await engine.load(hit, torch.arange(8, 12))
    assert got.loaded_tokens == 4 * PAGE_SIZE
    for cache in caches:
        raw = cache.view(torch.uint8)
        assert torch.equal(raw[8:12], raw[0:4])
