"""The copy threads: move pages between the GPU caches and the host pool.

``launch`` only queues a :class:`CopyJob`; the copy thread, ``aiokv-copy``, runs it and
reports completion. On a GPU, a job is cut into chunks of consecutive host blocks; each
chunk is gathered from the scattered GPU pages into a staging buffer on one stream, and
moved with one large copy on a second stream, two buffers deep, so gathers overlap copies
and the copy engine sees few, large transfers. Loads run the same pipeline in reverse
(copy in, then scatter). The copy thread only enqueues: a second thread,
``aiokv-copy-done``, waits for each job's last event in order and reports it, so the next
job's chunks are already queued on the GPU when one job ends (no drain between jobs),
at most ``MAX_CHUNKS_IN_FLIGHT`` chunks ahead of the copy engine. A full chunk's per-layer
gathers (or scatters) are one CUDA graph replay (:class:`.graphs.LayerGraphs`) where capture
succeeded, and a job's pages go in host-block order (:func:`.order.in_host_order`). A job's
first chunk may have been moved ahead of its launch (:mod:`.ahead`). On the CPU the same
chunks are gathered and scattered with torch ops, on the copy thread.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base import Int64Array
from . import streams
from .ahead import CopiedAhead, CopiesAhead, Prestage
from .graphs import LayerGraphs, gather_layers, scatter_layers
from .order import contiguous_runs, in_host_order
from .pool import HostPool

log = logging.getLogger("aiokv")

STAGING_BYTES = 128 << 20  # per staging buffer; two are allocated on the GPU
# Chunks queued on the GPU ahead of the copy engine (about 10 ms of copies at 50 GiB/s):
# enough to keep it busy while this thread waits for the GIL, and a bound on queued work.
# Unbounded, a burst of jobs would all sit in the device's launch queue, which is finite
# (when it is full, every kernel launch in the process blocks, the event loop's included).
MAX_CHUNKS_IN_FLIGHT = 4
# How long Transfer.wait_queued waits at most: a bound, not an expected wait (queueing a
# job takes well under a millisecond), so that a stuck copy thread cannot hold a caller.
_QUEUED_WAIT_S = 0.05


@dataclass(slots=True)
class CopyJob:
    """Pages to move: ``gpu_pages[i]`` <-> ``host_blocks[i]``. ``to_host``: an offload."""

    task_ids: list[int]
    to_host: bool
    gpu_pages: Int64Array
    host_blocks: Int64Array
    error: str | None = field(default=None)
    # The tag of the prestage that moved its first chunk ahead (:mod:`.ahead`); 0: none.
    prestaged: int = 0
    # Set once the copy thread has queued every copy of the job on the device (or
    # queued all it can before waiting for the device: it needs the GIL no more until
    # then), has run it (on the CPU), or has given up on it (Transfer.wait_queued).
    queued: threading.Event = field(default_factory=threading.Event)


class Transfer(CopiesAhead):
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        pool: HostPool,
        on_done: Callable[[CopyJob], None],
        name: str = "aiokv-copy",
        chunk_starts: Int64Array | None = None,
    ) -> None:
        self._caches = list(kv_caches)
        self._chunk_starts = chunk_starts  # see contiguous_runs
        self._pool = pool
        self._on_done = on_done
        self._device = self._caches[0].device
        block_bytes = pool.data[0].numel() * pool.data.element_size()
        self._chunk_blocks = max(1, STAGING_BYTES // block_bytes)
        self._jobs: queue.SimpleQueue[CopyJob | Prestage | None] = queue.SimpleQueue()
        # Set once the last job submitted, or copy ahead, is queued (wait_queued).
        self._last_queued: threading.Event | None = None
        self._prestaged: CopiedAhead | None = None  # a prestage's first chunk (CUDA only)
        self._last_prestage: Prestage | None = None
        self._threads = [threading.Thread(target=self._run, name=name, daemon=True)]
        if self._device.type == "cuda":
            shape = (self._chunk_blocks, *pool.data.shape[1:])
            self._staging = [
                torch.empty(shape, dtype=pool.data.dtype, device=self._device) for _ in range(2)
            ]
            # Stage i is free again once free_after[i] (recorded by its last user) fires;
            # kept across jobs, so one job's first chunk can follow the previous job's last.
            self._free_after: list[torch.cuda.Event | None] = [None, None]
            self._chunks_in_flight: collections.deque[torch.cuda.Event] = collections.deque()
            self._next_stage = 0
            # Gathers/scatters on one stream, host <-> device copies on the other.
            self._gpu_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            self._copy_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            # The staging buffers were allocated on the current stream, maybe in memory
            # that kernels still queued there were using: both streams start after them.
            current = torch.cuda.current_stream(self._device)
            self._gpu_stream.wait_stream(current)
            self._copy_stream.wait_stream(current)
            self._in_flight: queue.SimpleQueue[_InFlight | None] = queue.SimpleQueue()
            self._graphs = LayerGraphs.capture(self._caches, self._staging, self._gpu_stream)
            self._threads.append(
                threading.Thread(target=self._complete, name=f"{name}-done", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def submit(self, job: CopyJob) -> None:
        self._last_queued = job.queued
        self._jobs.put(job)

    def wait_queued(self, timeout: float = _QUEUED_WAIT_S) -> bool:
        """Block until the last job submitted (CopyJob.queued), or the last first chunk
        moved ahead (Prestage.handled), is queued on the device; whether it is. The
        caller's thread sleeps meanwhile, so the copy thread has the GIL to itself while
        it queues the copies (any other Python thread would take the GIL back at each
        torch call this thread makes, for up to a switch interval)."""
        last = self._last_queued
        return last is None or last.wait(timeout)

    def close(self) -> None:
        """Finish the queued jobs, then stop the threads."""
        self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        if self._prestaged is not None:
            # A copy ahead that no job used: no thread waits for it, and the pool it reads
            # is unpinned next (LocalStore.close), which must happen whatever this raises.
            try:
                self._prestaged.copied.synchronize()
            except Exception:
                log.exception("aiokv: waiting for a copy ahead at close failed")

    def _run(self) -> None:
        if self._device.type == "cuda":
            # This thread's ops run on the gather stream unless they switch (a stream
            # context manager per chunk costs several times as much as a switch).
            torch.cuda.set_stream(self._gpu_stream)
        try:
            while (job := self._jobs.get()) is not None:
                if isinstance(job, Prestage):
                    self._copy_ahead(job)
                    continue
                if self._device.type == "cuda":
                    self._in_flight.put(self._enqueue_cuda(job))
                    job.queued.set()
                    continue
                job.queued.set()  # no device queue: the copy runs now, on this thread
                try:
                    self._run_cpu(job)
                except Exception as exc:  # reported as a FAILED task, never lost
                    log.exception("aiokv copy job failed")
                    job.error = repr(exc)
                self._on_done(job)
        finally:
            if self._device.type == "cuda":
                self._in_flight.put(None)  # whatever happened, the done thread ends

    def _complete(self) -> None:
        """Report CUDA jobs in the order they were queued, each once its last op ran."""
        while (item := self._in_flight.get()) is not None:
            try:
                if item.done is not None:
                    item.done.synchronize()  # releases the GIL while it waits
            except Exception as exc:
                log.exception("aiokv copy job failed on the GPU")
                item.job.error = repr(exc)
            del item.keep_alive
            self._on_done(item.job)

    def _run_cpu(self, job: CopyJob) -> None:
        pool = self._pool.data
        gpu_pages, host_blocks = in_host_order(job.gpu_pages, job.host_blocks)
        pages = torch.from_numpy(gpu_pages)
        for start, end in contiguous_runs(host_blocks, self._chunk_blocks, self._chunk_starts):
            first = int(host_blocks[start])
            host = pool[first : first + end - start]
            run_pages = pages[start:end]
            if job.to_host:
                gather_layers(self._caches, run_pages, host)
            else:
                scatter_layers(self._caches, run_pages, host)

    def _enqueue_cuda(self, job: CopyJob) -> _InFlight:
        """Queue every chunk of ``job`` on the two streams without waiting for the GPU;
        the returned event fires when the job's last op has run."""
        try:
            return self._enqueue_chunks(job)
        except Exception as exc:
            log.exception("aiokv copy job failed")
            job.error = repr(exc)
            # Whatever was queued may still use the staging buffers: let it finish. A
            # broken context fails these too; then the next jobs fail in turn, each
            # reported, and this thread lives on to answer them.
            try:
                self._copy_stream.synchronize()
                self._gpu_stream.synchronize()
            except Exception:
                log.exception("aiokv: synchronizing the copy streams failed")
            self._free_after = [None, None]
            self._chunks_in_flight.clear()
            return _InFlight(job, None, None)

    def _enqueue_chunks(self, job: CopyJob) -> _InFlight:
        """Queue the job's chunks. This thread's current stream is the gather stream
        (_run); the host <-> device copies switch to the copy stream and back."""
        pool = self._pool.data
        gpu, copy = self._gpu_stream, self._copy_stream
        gpu_pages, host_blocks = in_host_order(job.gpu_pages, job.host_blocks)
        # The device's page ids (streams.to_device). A load needs them only for its first
        # scatter: its first copy in is queued before them, so the copy engine starts
        # while this thread uploads them.
        pages: torch.Tensor | None = None
        if job.to_host:
            pages = streams.to_device(gpu_pages, self._device)
        # A prestage's chunk serves this job's first chunk only if it was meant for it (the
        # same tasks, hence the same blocks and pages); else it is dropped unused (a job
        # queued after it on these streams runs after it, so an offload's blocks it wrote
        # are written again where this job owns them).
        ahead, self._prestaged = self._prestaged, None
        for start, end in contiguous_runs(host_blocks, self._chunk_blocks, self._chunk_starts):
            if (
                ahead is not None
                and job.prestaged == ahead.tag
                and start == 0
                and (ahead.first, ahead.count) == (int(host_blocks[0]), end)
            ):
                which, copied_in = ahead.stage, ahead.copied  # already out of the rotation
            else:
                which, copied_in = self._next_stage, None
                self._next_stage ^= 1
            stage = self._staging[which][: end - start]
            first = int(host_blocks[start])
            host = pool[first : first + end - start]
            while len(self._chunks_in_flight) >= MAX_CHUNKS_IN_FLIGHT:
                oldest = self._chunks_in_flight.popleft()
                if not oldest.query():  # type: ignore[no-untyped-call]
                    # Enough is queued to keep the device busy while this thread sleeps
                    # (without the GIL). Only then: a caller woken while this thread still
                    # queues would take the GIL back at its every torch call.
                    job.queued.set()
                    oldest.synchronize()
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            previous = self._free_after[which]
            graphs = self._graphs if end - start == self._chunk_blocks else None
            if job.to_host and copied_in is not None:
                done = copied_in  # gathered and copied out ahead, into these blocks
            elif job.to_host:
                assert pages is not None
                run_pages = pages[start:end]
                if previous is not None:
                    gpu.wait_event(previous)
                self._per_layer(True, graphs, which, run_pages, stage)
                ready.record(gpu)
                copy.wait_event(ready)
                streams.on_stream(copy, gpu, host.copy_, stage)
                done.record(copy)
            else:
                if copied_in is not None:
                    ready = copied_in
                else:
                    if previous is not None:
                        copy.wait_event(previous)
                    streams.on_stream(copy, gpu, stage.copy_, host)
                    ready.record(copy)
                if pages is None:
                    pages = streams.to_device(gpu_pages, self._device)
                run_pages = pages[start:end]
                gpu.wait_event(ready)
                self._per_layer(False, graphs, which, run_pages, stage)
                done.record(gpu)
            self._free_after[which] = done
            self._chunks_in_flight.append(done)
        # Offloads end on the copy stream, loads on the gather stream; each stream runs
        # in order, so one event on it covers the whole job.
        last = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        last.record(copy if job.to_host else gpu)
        return _InFlight(job, last, pages)

    def _per_layer(
        self,
        to_host: bool,
        graphs: LayerGraphs | None,
        which: int,
        pages: torch.Tensor,
        stage: torch.Tensor,
    ) -> None:
        """A chunk's per-layer gathers (offload) or scatters (load) on the current
        stream: one graph replay for a full chunk, else one op per layer."""
        if graphs is not None:
            (graphs.gather if to_host else graphs.scatter)(which, pages)
        else:
            (gather_layers if to_host else scatter_layers)(self._caches, pages, stage)


@dataclass(slots=True)
class _InFlight:
    """A CUDA job queued on the streams: ``done`` fires after its last op."""

    job: CopyJob
    done: Any  # torch.cuda.Event, or None when nothing was queued (the job failed)
    keep_alive: Any  # the job's device page ids, held until its kernels ran
