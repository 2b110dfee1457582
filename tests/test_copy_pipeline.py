"""The local store's CUDA copy pipeline (Transfer._enqueue_chunks, and a load's first chunk
moved ahead, CopiesAhead._copy_ahead) run on the CPU: its
streams and events replaced by ones that log what is queued where, its copies and
per-layer ops real. CPU ops run at once, so the bytes check the chunking (runs, pinned
chunk boundaries, host order, the two staging buffers) and the log checks the order the
GPU would see: what each stream waits for before each copy, gather and scatter."""

from __future__ import annotations

import collections
import queue
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from aiokv.stores.local import streams as streams_module
from aiokv.stores.local import transfer as transfer_module
from aiokv.stores.local.ahead import Prestage
from aiokv.stores.local.transfer import CopyJob, Transfer

LAYERS, PAGE_SHAPE = 3, (2, 4, 2, 8)  # per layer: [page, k/v, token, head, dim]
PAGES, BLOCKS, CHUNK = 40, 48, 4


class Log(list[tuple[str, ...]]):
    current = "default"  # the copy thread's current stream (torch.cuda.set_stream)


class FakeStream:
    def __init__(self, name: str, log: Log) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, "wait", event.name))


class FakeEvent:
    made = 0
    log: Log

    def __init__(self, blocking: bool = False) -> None:
        FakeEvent.made += 1
        self.name = f"e{FakeEvent.made}"

    def record(self, stream: FakeStream | None = None) -> None:
        self.log.append((stream.name if stream else self.log.current, "record", self.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture
def pipeline(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Transfer, Log]]:
    log = Log()
    FakeEvent.log = log
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def set_stream(stream: FakeStream) -> None:
        log.current = stream.name

    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    original_on_stream = streams_module.on_stream

    def on_stream(stream: FakeStream, back: FakeStream, copy: Any, source: torch.Tensor) -> None:
        original_on_stream(stream, back, copy, source)
        log.append((stream.name, "copy"))
        assert log.current == back.name  # switched back for what follows

    monkeypatch.setattr(streams_module, "on_stream", on_stream)

    def to_device(pages: np.ndarray, device: torch.device) -> torch.Tensor:
        log.append((log.current, "upload"))
        return torch.from_numpy(pages)

    monkeypatch.setattr(streams_module, "to_device", to_device)
    for name in ("gather_layers", "scatter_layers"):
        original = getattr(transfer_module, name)

        def logged(*args: Any, _original: Any = original, _name: str = name) -> None:
            log.append((log.current, _name.split("_")[0]))
            _original(*args)

        monkeypatch.setattr(transfer_module, name, logged)

    torch.manual_seed(0)
    transfer = Transfer.__new__(Transfer)  # the CUDA path's state, on the CPU
    transfer._caches = [torch.randn(PAGES, *PAGE_SHAPE) for _ in range(LAYERS)]
    transfer._pool = types.SimpleNamespace(data=torch.zeros(BLOCKS, LAYERS, *PAGE_SHAPE))
    transfer._chunk_blocks = CHUNK
    transfer._chunk_starts = np.array([0, 30], dtype=np.int64)  # a second pinned chunk
    transfer._staging = [torch.empty(CHUNK, LAYERS, *PAGE_SHAPE) for _ in range(2)]
    transfer._free_after = [None, None]
    transfer._chunks_in_flight = collections.deque()
    transfer._next_stage = 0
    transfer._prestaged = None
    transfer._last_prestage = None
    transfer._last_queued = None
    transfer._threads = [threading.current_thread()]  # a live "copy thread"
    transfer._gpu_stream = FakeStream("gather", log)
    transfer._copy_stream = FakeStream("copy", log)
    transfer._graphs = None
    transfer._device = torch.device("cpu")
    log.current = "gather"  # as _run sets it
    yield transfer, log


def block_of(transfer: Transfer, block: int) -> torch.Tensor:
    data: torch.Tensor = transfer._pool.data
    return data[block]


def page_of(transfer: Transfer, page: int) -> torch.Tensor:
    return torch.stack([cache[page] for cache in transfer._caches])


# Blocks 27..34 cross the pinned chunk at 30; 10..12 and 40 are runs of their own. In
# host order, chunks of at most 4: 10-12 | 27-29 | 30-33 | 34 | 40 (without the pinned
# chunk it would be 10-12 | 27-30 | 31-34 | 40).
HOST_BLOCKS = np.array([27, 28, 29, 30, 31, 32, 33, 34, 12, 11, 10, 40], dtype=np.int64)
GPU_PAGES = np.array([5, 9, 1, 0, 33, 2, 7, 8, 20, 21, 22, 39], dtype=np.int64)


def test_an_offload_moves_every_page_to_its_block_across_chunks(
    pipeline: tuple[Transfer, Log],
) -> None:
    transfer, log = pipeline
    in_flight = transfer._enqueue_chunks(CopyJob([1], True, GPU_PAGES, HOST_BLOCKS))
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        assert torch.equal(block_of(transfer, block), page_of(transfer, page)), (page, block)
    assert log[0] == ("gather", "upload")  # the gathers read the page ids on the device
    gathers = [i for i, entry in enumerate(log) if entry[1:] == ("gather",)]
    copies = [i for i, entry in enumerate(log) if entry == ("copy", "copy")]
    assert len(gathers) == len(copies) == 5  # each chunk gathered, then copied

    for gather, copy in zip(gathers, copies, strict=True):
        ready = log[gather + 1]
        assert ready[:2] == ("gather", "record")
        assert log[gather + 2] == ("copy", "wait", ready[2])  # the copy after its gather
        assert gather < copy
    # The third chunk reuses the first's staging buffer: its gather waits for that copy.
    first_done = log[copies[0] + 1]
    assert first_done[:2] == ("copy", "record")
    assert log[gathers[2] - 1] == ("gather", "wait", first_done[2])
    assert in_flight.done is not None and log[-1] == ("copy", "record", in_flight.done.name)


def test_a_load_queues_its_first_copy_in_before_its_page_ids_go_up(
    pipeline: tuple[Transfer, Log],
) -> None:
    transfer, log = pipeline
    expected = refill_pool(transfer)
    in_flight = transfer._enqueue_chunks(CopyJob([2], False, GPU_PAGES, HOST_BLOCKS))
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        assert torch.equal(page_of(transfer, page), expected[block]), (page, block)
    assert log[0] == ("copy", "copy")  # the copy engine starts before the upload
    assert log.index(("gather", "upload")) < log.index(("gather", "scatter"))
    assert log.count(("gather", "upload")) == 1
    scatters = [i for i, entry in enumerate(log) if entry == ("gather", "scatter")]
    assert len(scatters) == 5
    for scatter in scatters:
        ready = [e for e in log[:scatter] if e[:2] == ("copy", "record")][-1]
        assert ("gather", "wait", ready[2]) in log[:scatter]  # after its own copy in
    # The third chunk's copy in reuses the first's staging buffer: it waits for that
    # chunk's scatter (its done event, on the gather stream) before it overwrites it.
    copies = [i for i, entry in enumerate(log) if entry == ("copy", "copy")]
    first_done = log[scatters[0] + 1]
    assert first_done[:2] == ("gather", "record")
    assert log[copies[2] - 1] == ("copy", "wait", first_done[2])
    assert in_flight.done is not None and log[-1] == ("gather", "record", in_flight.done.name)


def refill_pool(transfer: Transfer) -> dict[int, torch.Tensor]:
    """New random contents for the pool; what HOST_BLOCKS now hold."""
    data: torch.Tensor = transfer._pool.data
    data.copy_(torch.randn_like(data))
    return {int(b): data[int(b)].clone() for b in HOST_BLOCKS}


FIRST_CHUNK = [10, 11, 12]  # HOST_BLOCKS' first chunk in host order


def test_a_prestaged_load_scatters_its_first_chunk_from_the_copy_made_ahead(
    pipeline: tuple[Transfer, Log],
) -> None:
    transfer, log = pipeline
    before = refill_pool(transfer)
    transfer._copy_ahead(Prestage(HOST_BLOCKS, 7))
    assert log[:2] == [("copy", "copy"), ("copy", "record", log[1][2])]
    ahead_event = log[1][2]
    # The blocks change after the copy ahead (they never do while a match holds them):
    # what lands for the first chunk shows whether the job used that copy or made its own.
    after = refill_pool(transfer)
    del log[:]
    in_flight = transfer._enqueue_chunks(
        CopyJob([2], False, GPU_PAGES, HOST_BLOCKS, prestaged=7)
    )
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        expected = before[block] if block in FIRST_CHUNK else after[block]
        assert torch.equal(page_of(transfer, page), expected), (page, block)
    assert log.count(("copy", "copy")) == 4  # five chunks, the first copied ahead
    assert log[0] == ("gather", "upload")  # nothing to copy in before the page ids
    first_scatter = log.index(("gather", "scatter"))
    assert ("gather", "wait", ahead_event) in log[:first_scatter]  # after the copy ahead
    # The third chunk's copy in reuses the copy ahead's buffer: it waits for the first
    # chunk's scatter from it (not merely for the copy ahead) before it overwrites it.
    first_done = log[first_scatter + 1]
    assert first_done[:2] == ("gather", "record")
    copies = [i for i, entry in enumerate(log) if entry == ("copy", "copy")]
    assert log[copies[1] - 1] == ("copy", "wait", first_done[2])
    assert transfer._prestaged is None  # used once
    assert in_flight.done is not None


@pytest.mark.parametrize("case", ["not marked", "another prestage's", "other blocks"])
def test_a_load_that_the_copy_ahead_was_not_for_copies_everything_itself(
    pipeline: tuple[Transfer, Log], case: str,
) -> None:
    transfer, log = pipeline
    transfer._copy_ahead(Prestage(HOST_BLOCKS if case != "other blocks" else np.array([27, 28]), 7))
    ahead_event = log[1][2]
    after = refill_pool(transfer)
    del log[:]
    tag = {"not marked": 0, "another prestage's": 6, "other blocks": 7}[case]
    transfer._enqueue_chunks(CopyJob([2], False, GPU_PAGES, HOST_BLOCKS, prestaged=tag))
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        assert torch.equal(page_of(transfer, page), after[block]), (page, block)
    copies = [i for i, entry in enumerate(log) if entry == ("copy", "copy")]
    assert len(copies) == 5
    # The copy ahead took staging buffer 0; the job's second chunk is the next to use it
    # and must not overwrite it before that copy ended.
    assert log[copies[1] - 1] == ("copy", "wait", ahead_event)
    assert transfer._prestaged is None


def test_a_copy_ahead_waits_for_the_last_user_of_its_staging_buffer(
    pipeline: tuple[Transfer, Log],
) -> None:
    transfer, log = pipeline
    transfer._enqueue_chunks(CopyJob([1], True, GPU_PAGES[:2], HOST_BLOCKS[:2]))
    last_done = transfer._free_after[0].name  # type: ignore[union-attr]
    del log[:]
    # The offload used buffer 0; buffer 1 is next, unused: no wait. Then buffer 0 again.
    transfer._copy_ahead(Prestage(HOST_BLOCKS, 7))
    assert log[0] == ("copy", "copy")
    transfer._copy_ahead(Prestage(HOST_BLOCKS, 7))
    assert log[2] == ("copy", "wait", last_done)


def test_close_waits_for_a_copy_ahead_that_no_job_used(
    pipeline: tuple[Transfer, Log], monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer, log = pipeline
    waited: list[str] = []
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: waited.append(self.name))
    transfer._copy_ahead(Prestage(HOST_BLOCKS, 7))
    ahead_event = log[1][2]
    transfer._jobs = queue.SimpleQueue()
    transfer._threads = []
    transfer.close()  # the pool is unpinned next: the copy must have ended
    assert waited == [ahead_event]


# An offload's copy ahead: the first chunk in host order (blocks 10-12, at positions
# 10, 9, 8 of the job) gathered from the callers' device page ids, per task.
def offload_prestage(tag: int = 7) -> Prestage:
    pages = torch.from_numpy(GPU_PAGES).to(torch.int32)  # callers may hold int32 ids
    return Prestage(HOST_BLOCKS, tag, [pages[:8], pages[8:]], [FakeEvent(), FakeEvent()])


def new_caches(transfer: Transfer) -> None:
    """New KV in every page (never while its callers wait; here it tells which copy of a
    page landed in a block: the copy ahead's or the job's own)."""
    for cache in transfer._caches:
        cache.copy_(torch.randn_like(cache))


def test_a_prestaged_offload_gathers_its_first_chunk_ahead_and_its_job_skips_it(
    pipeline: tuple[Transfer, Log],
) -> None:
    transfer, log = pipeline
    order = offload_prestage()
    transfer._copy_ahead(order)
    assert order.handled.is_set()
    ready = [event.name for event in order.ready]
    gather = log.index(("gather", "gather"))
    assert [e for e in log[:gather] if e[1] == "wait"] == [("gather", "wait", r) for r in ready]
    assert ("gather", "upload") in log[:gather]  # host order is not task order here
    copied = log[-1]
    assert copied[:2] == ("copy", "record") and log[-2] == ("copy", "copy")
    before = {page: page_of(transfer, page).clone() for page in GPU_PAGES.tolist()}
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        if block in FIRST_CHUNK:  # copied ahead; the rest not yet
            assert torch.equal(block_of(transfer, block), before[page]), (page, block)
        else:
            assert not block_of(transfer, block).any(), block
    new_caches(transfer)
    del log[:]
    in_flight = transfer._enqueue_chunks(
        CopyJob([1, 2], True, GPU_PAGES, HOST_BLOCKS, prestaged=7)
    )
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        expected = before[page] if block in FIRST_CHUNK else page_of(transfer, page)
        assert torch.equal(block_of(transfer, block), expected), (page, block)
    gathers = [i for i, entry in enumerate(log) if entry == ("gather", "gather")]
    assert len(gathers) == log.count(("copy", "copy")) == 4  # five chunks, one ahead
    # The job's second chunk takes the other buffer; its third the copy ahead's, after
    # that buffer's copy out ended.
    assert ("gather", "wait", copied[2]) not in log[: gathers[0]]
    assert log[gathers[1] - 1] == ("gather", "wait", copied[2])
    assert transfer._prestaged is None
    assert in_flight.done is not None and log[-1] == ("copy", "record", in_flight.done.name)


def test_an_offload_copy_ahead_clamps_unchecked_page_ids_into_the_caches(
    pipeline: tuple[Transfer, Log],
) -> None:
    transfer, log = pipeline
    blocks = np.array([27, 28, 29], dtype=np.int64)  # ascending: pages in task order
    pages = torch.tensor([PAGES + 500, -3, 6])
    transfer._copy_ahead(Prestage(blocks, 7, [pages[:1], pages[1:]]))
    assert ("gather", "upload") not in log
    for block, page in zip(blocks.tolist(), [PAGES - 1, 0, 6], strict=True):
        assert torch.equal(block_of(transfer, block), page_of(transfer, page)), block


@pytest.mark.parametrize("case", ["not marked", "another prestage's"])
def test_an_offload_that_the_copy_ahead_was_not_for_copies_everything_itself(
    pipeline: tuple[Transfer, Log], case: str,
) -> None:
    transfer, log = pipeline
    transfer._copy_ahead(offload_prestage())
    new_caches(transfer)
    del log[:]
    tag = {"not marked": 0, "another prestage's": 6}[case]
    transfer._enqueue_chunks(CopyJob([1, 2], True, GPU_PAGES, HOST_BLOCKS, prestaged=tag))
    for page, block in zip(GPU_PAGES.tolist(), HOST_BLOCKS.tolist(), strict=True):
        assert torch.equal(block_of(transfer, block), page_of(transfer, page)), (page, block)
    assert log.count(("gather", "gather")) == log.count(("copy", "copy")) == 5
    assert transfer._prestaged is None


def test_settle_ahead_and_wait_queued_return_once_the_copy_ahead_was_queued(
    pipeline: tuple[Transfer, Log], monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer, log = pipeline
    waited: list[str] = []
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: waited.append(self.name))
    transfer.settle_ahead()  # none queued: nothing to wait for
    monkeypatch.setattr(transfer, "_device", torch.device("cuda"))  # prestage queues it
    transfer._jobs = queue.SimpleQueue()
    pages = offload_prestage().gpu_pages
    assert pages is not None
    transfer.prestage(HOST_BLOCKS, 7, pages)
    order = transfer._jobs.get_nowait()
    assert not transfer.wait_queued(timeout=0)  # an engine waits for it before its fuse
    copier = threading.Timer(0.05, transfer._copy_ahead, [order])
    copier.start()
    transfer.settle_ahead()  # waits for the copy thread, then for the device
    assert order.handled.is_set() and transfer.wait_queued(timeout=0)
    assert waited == [log[-1][2]]  # the copy out's event
    copier.join()


def log_stream_waits(transfer: Transfer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the streams ``synchronize``d from now on, in order."""
    synchronized: list[str] = []
    for stream in (transfer._gpu_stream, transfer._copy_stream):
        monkeypatch.setattr(stream, "synchronize", lambda s=stream: synchronized.append(s.name),
                            raising=False)
    return synchronized


def test_a_failing_copy_ahead_is_dropped_and_still_handled(
    pipeline: tuple[Transfer, Log], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    transfer, _ = pipeline
    synchronized = log_stream_waits(transfer, monkeypatch)

    def broken(*args: Any) -> None:
        raise RuntimeError("gather failed")

    monkeypatch.setattr(transfer, "_per_layer", broken)
    order = offload_prestage()
    transfer._copy_ahead(order)
    assert order.handled.is_set() and transfer._prestaged is None
    assert sorted(synchronized) == ["copy", "gather"]
    assert "copying a first chunk ahead failed" in caplog.text


def test_settle_ahead_does_not_wait_forever_for_a_dead_copy_thread(
    pipeline: tuple[Transfer, Log], monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer, _ = pipeline
    synchronized = log_stream_waits(transfer, monkeypatch)
    monkeypatch.setattr(transfer, "_device", torch.device("cuda"))
    transfer._jobs = queue.SimpleQueue()
    transfer.prestage(HOST_BLOCKS, 7, [torch.from_numpy(GPU_PAGES)])  # never handled
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    transfer._threads = [dead]
    transfer.settle_ahead()  # returns: what the thread queued before it died is waited for
    assert sorted(synchronized) == ["copy", "gather"]
