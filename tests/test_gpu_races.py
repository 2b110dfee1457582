"""On a GPU: races between the callers' streams and the data plane, caught by the bytes.
LocalStore is driven directly (register, put_match / get_match, launch with page ids and
ready events, try_wait). Skipped without CUDA.

Each test runs with its pages in runs (adjacent pages into adjacent blocks: one 2-D copy
per run and layer) and scattered (one copy per page and layer). Which wait in the copier
(aiokv/copy/copier.py's docstring names them A-D) each test catches, when removed:

- ``test_an_offload_copies_what_the_caller_wrote_on_a_side_stream_before_it``: the
  caller writes its pages (and, with ids on the device, its page ids) on a side stream
  behind a long busy kernel and launches at once (also right behind another offload,
  whose bytes on the copy engines make the ids come by a kernel). Wait A (every copy stream waits for
  the ready events): without it the copies read the old bytes. Wait B (the page ids
  read on the host only after their device-to-host copy, which follows the ready events):
  without it the ids read are the unwritten ones (out of range: the task ends INVALID).
- ``test_pages_overwritten_right_after_the_offload_is_reported_do_not_reach_the_store``:
  wait D (the done thread waits for every stream's end event before the job is
  reported): without it (or with it on one stream only) the caller's overwrite races
  the copies still running, and the later load gives some overwritten bytes.
- ``test_a_layer_read_on_another_stream_right_after_wait_equals_what_was_stored``:
  wait C (each layer's events are recorded after that layer's copies, on every copy
  stream): the load's copies are held behind a busy kernel (its ready event), so a
  reader whose ``LayerMarks.wait(i)`` did not wait for layer i's copies on every stream
  reads the zeros the pages held before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import aiokv
from aiokv.stores.base import TaskResult, TaskStatus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

# 8 layers of 64 KiB pages: a task of 512 pages moves 256 MiB, several ms of copies, so
# an unordered read or write lands inside them. An offload of that size is paced
# (copier.MAX_BYTES_AHEAD: two layers queued ahead), so these tests cover that path too.
LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 8, 1536, 16, 8, 128
TASK_PAGES = 512
TOKENS = np.arange(TASK_PAGES * PAGE_SIZE, dtype=np.int64)
# About 0.1-0.5 s of GPU time on current GPUs: far longer than a launch takes.
BUSY_CYCLES = 500_000_000


@pytest.fixture
def rig() -> Iterator[tuple[aiokv.LocalStore, list[torch.Tensor]]]:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    caches = [
        torch.randn(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device, generator=generator)
        .to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=1.0))
    store.register(caches)
    assert store.wait_pinned(60)
    torch.cuda.synchronize()
    yield store, caches
    store.close()


def finish(store: aiokv.LocalStore, task: int) -> TaskResult:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = store.try_wait([task])
        if answer:
            return answer[task]
        time.sleep(0.0002)
    raise AssertionError(f"task {task} did not end")


def load(store: aiokv.LocalStore, key: str, pages: Any, ready: Any = None) -> int:
    task, mask = store.get_match(TOKENS, [key])
    assert mask.all()
    store.launch([task], [pages], [ready])
    return task


# Pages in runs (what an allocator hands out fresh: 2-D copies, one per run and layer)
# or scattered (one copy per page and layer): each test runs both ways.
PLACEMENTS = ["runs", "scattered"]
SCATTER = torch.randperm(TASK_PAGES, generator=torch.Generator().manual_seed(1))


def targets(first: int, placement: str) -> torch.Tensor:
    if placement == "runs":
        return torch.arange(first, first + TASK_PAGES)
    return first + SCATTER


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("ids_on", ["cuda", "cpu", "cuda-behind-an-offload"])
def test_an_offload_copies_what_the_caller_wrote_on_a_side_stream_before_it(
    rig: tuple[aiokv.LocalStore, list[torch.Tensor]], ids_on: str, placement: str
) -> None:
    store, caches = rig
    before = store.store_stats()["d2h_copies"]
    fetches = 0 if ids_on == "cpu" else 1
    if ids_on == "cuda-behind-an-offload":
        # Another offload's bytes on the copy engines: the ids come by a kernel then.
        ids_on, fetches = "cuda", 2
        task, _ = store.put_match(TOKENS, ["in flight"])
        store.launch([task], [targets(2 * TASK_PAGES, placement).cuda()], [None])
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    # Ids out of range until the side stream writes them (after the busy kernel).
    ids = torch.full((TASK_PAGES,), 10**6, dtype=torch.int64, device=ids_on)
    written = targets(0, placement).cuda()  # what the side stream writes into ids
    if ids_on == "cpu":
        ids = targets(0, placement)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        if ids_on == "cuda":  # from the device: a pageable source would sync the stream
            ids.copy_(written)
        for layer, cache in enumerate(caches):
            cache[:TASK_PAGES].fill_(float(layer + 1))
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(side)
    task, _ = store.put_match(TOKENS, ["new"])
    store.launch([task], [ids], [ready])  # at once: the side stream is still busy
    result = finish(store, task)
    assert result.status is TaskStatus.SUCCESS, result.error
    assert store.store_stats()["d2h_copies"] - before == fetches
    back = targets(TASK_PAGES, placement)
    assert finish(store, load(store, "new", back)).status is TaskStatus.SUCCESS
    for layer, cache in enumerate(caches):
        assert (cache[back.cuda()] == float(layer + 1)).all(), layer


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_pages_overwritten_right_after_the_offload_is_reported_do_not_reach_the_store(
    rig: tuple[aiokv.LocalStore, list[torch.Tensor]], placement: str
) -> None:
    store, caches = rig
    source, back = targets(0, placement).cuda(), targets(TASK_PAGES, placement).cuda()
    expected = [cache[source].clone() for cache in caches]
    torch.cuda.synchronize()
    task, _ = store.put_match(TOKENS, ["kept"])
    store.launch([task], [source], [None])
    assert finish(store, task).status is TaskStatus.SUCCESS
    for cache in caches:  # at once, on the caller's stream, with no other wait
        cache[:TASK_PAGES].fill_(-1.0)
    assert finish(store, load(store, "kept", back)).status is TaskStatus.SUCCESS
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[back], expected[layer]), layer


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_layer_read_on_another_stream_right_after_wait_equals_what_was_stored(
    rig: tuple[aiokv.LocalStore, list[torch.Tensor]], placement: str
) -> None:
    store, caches = rig
    source, back = targets(0, placement), targets(TASK_PAGES, placement)
    stored = [cache[source.cuda()].clone() for cache in caches]
    task, _ = store.put_match(TOKENS, ["layers"])
    store.launch([task], [source], [None])
    assert finish(store, task).status is TaskStatus.SUCCESS
    for cache in caches:
        cache[TASK_PAGES : 2 * TASK_PAGES].zero_()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)  # the load's copies queue behind this
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(side)
    # Ids on the host: the copies are queued (and the layers marked) at once.
    task = load(store, "layers", back, ready)
    marks = store.layer_marks(task)
    assert marks is not None
    reader = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    seen = []
    for layer in range(LAYERS):
        marks.wait(layer, stream=reader)
        with torch.cuda.stream(reader):
            seen.append(caches[layer][back.cuda()].clone())
    reader.synchronize()
    assert finish(store, task).status is TaskStatus.SUCCESS
    for layer in range(LAYERS):
        assert torch.equal(seen[layer], stored[layer]), layer


def test_one_launch_with_int32_and_int64_device_ids_moves_each_tasks_own_pages(
    rig: tuple[aiokv.LocalStore, list[torch.Tensor]],
) -> None:
    # The copier brings every task's device ids over in one batch call, each in its own
    # dtype (recsys hands int32): a mixed launch must read each at its own offset.
    store, caches = rig
    half = TASK_PAGES // 2
    tokens = np.arange(half * PAGE_SIZE, dtype=np.int64)
    first = (SCATTER[:half]).to(torch.int32).cuda()
    second = (SCATTER[half:]).cuda()  # int64
    expected = [[cache[first.long()].clone(), cache[second].clone()] for cache in caches]
    torch.cuda.synchronize()
    tasks = [store.put_match(tokens, [name])[0] for name in ("i32", "i64")]
    store.launch(tasks, [first, second], [None, None])
    assert all(finish(store, t).status is TaskStatus.SUCCESS for t in tasks)
    backs = [TASK_PAGES + SCATTER[:half], TASK_PAGES + SCATTER[half:]]
    loads = []
    for name in ("i32", "i64"):
        task, mask = store.get_match(tokens, [name])
        assert mask.all()
        loads.append(task)
    store.launch(loads, [backs[0].to(torch.int32).cuda(), backs[1].cuda()], [None, None])
    assert all(finish(store, t).status is TaskStatus.SUCCESS for t in loads)
    for layer, cache in enumerate(caches):
        for i, back in enumerate(backs):
            assert torch.equal(cache[back.cuda()], expected[layer][i]), (layer, i)
