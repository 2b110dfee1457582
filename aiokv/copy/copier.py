"""The copy threads: :class:`CopyJob` in, each job's end reported through a callback.

On a GPU, the copy thread (``aiokv-copy-*``) runs each job as:

1. a high-priority stream of its own (the ids stream) waits for the job's ready events
   (the callers' page ids and KV are written after them); the copy streams wait for an
   event recorded there (wait A: nothing is read before the caller's writes);
2. where page ids are on the device, the job's ids come into one pinned buffer
   (:class:`~.ids.PageIds`, ``d2h_copies``): by the copy engines, or by a small kernel
   while offloads are in flight, whose bytes those engines would copy first; the thread
   waits for them (wait B: the ids are read on the host only once there; the wait
   releases the GIL);
3. each task's ids are checked (:func:`~.plan.check_pages`): a bad one fails only its
   own task, which the job reports as invalid and copies nothing of;
4. the rest is planned (:func:`~.plan.plan`) and queued on ``STREAMS`` streams by
   :class:`~.queueing.Queuer` from C without the GIL: per layer and stream one
   ``cuMemcpyBatchAsync`` and a strided ``cuMemcpy2DAsync`` per run of adjacent pages,
   layers in order; a load with marks goes one call per layer, each layer's events (one
   per stream, from an :class:`~.driver.EventPool`) handed to its marks once queued (wait
   C: ``LayerMarks.wait(i)`` waits for exactly the events after layer i's copies); a
   large offload paced, no more than ``MAX_BYTES_AHEAD`` of it queued on the copy
   engines at once (the C loop waits for its earlier layers, without the GIL), so that
   a model's own small copies to the host wait for little of it.

A second thread (``...-done``) waits for each job's end events, on every stream (wait D:
an offload's bytes are on the host, a load's in the caller's pages, before the job is
reported), in the order the jobs were queued, so the copy thread queues the next job
meanwhile and the copy engines run jobs back to back. No staging buffer; no kernel but
the ids' small one.
Where the driver lacks the batch call, each (page, layer) is one torch copy instead
(slower, the same bytes), said once in the log.

On the CPU the copy thread moves a job with torch index ops per layer, marking each layer
of a load as it is copied.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..exiting import stop_at_exit
from .driver import (
    CU_EVENT_BLOCKING_SYNC,
    CU_EVENT_DISABLE_TIMING,
    BatchCopy,
    DriverError,
    DriverEvent,
    EventPool,
)
from .ids import OffloadsInFlight, PageIds, as_numpy, concat
from .marks import LayerMarks
from .plan import Geometry, Int64Array, check_pages, plan
from .queueing import Entries, Queuer, torch_copies

log = logging.getLogger("aiokv")

# Copy streams per copier. Measured on the H200 (issue 34), a batch split over 4 streams
# reached 47 GiB/s against 42 on one; the lead measures 4 against 8.
STREAMS = 4
# Jobs queued on the device ahead of their end: enough to keep the copy engines busy
# while the copy thread waits for the GIL, and a bound on what sits in the device's
# launch queue (when that is full, every launch of the process blocks, the model's too).
MAX_JOBS_IN_FLIGHT = 8
# An offload's bytes queued on the copy engines ahead of what they are copying, at most
# (about; at least two layers, so the engines never wait for the host to queue the next):
# those engines copy to the host in the order given, across streams, so whatever the
# model's own thread copies to the host (its next tokens, every step) waits for all of
# it: unpaced, a whole job or two; paced, about a millisecond of a PCIe 5 link, or two
# layers of a job whose layers are larger (``benchmarks/behind_a_stream.py --probe copy``).
MAX_BYTES_AHEAD = 64 << 20

_fallback_warned = False


class Caller(Protocol):
    """An offload task's side of its caller: ``detached`` is set (from the engine's loop
    thread, before the caller hears a RequestTimeout or its cancellation) once the caller
    stopped waiting, and may then reuse its pages."""

    detached: bool


# Why an offload segment's copy counts for nothing (CopyJob.left).
DETACHED = "its caller stopped waiting before the copy of its pages ended"


@dataclass(slots=True, eq=False)
class CopyJob:
    """Move ``pages[s][i]`` <-> the matching entry of ``blocks`` for each segment ``s``
    (a task, or part of one); ``to_host``: an offload.

    ``pages`` are the callers' page ids as given (CPU or device tensors, or numpy);
    ``blocks`` holds every segment's host blocks, in segment order; ``names[s]`` is the
    task id that segment ``s``'s errors name; ``ready`` the CUDA events (or None) the
    copies wait for; ``marks[s]`` a load segment's per-layer marks (or None). The copier
    sets ``error`` (the job failed: nothing it moved counts), ``invalid`` (segment -> why
    its page ids were refused; nothing of it was copied) and ``copied`` (the pages it
    moved). ``check_only``: the job only checks its page ids (``blocks`` is empty): a load
    copied in parts checks its whole page list once, so that no page is given twice.
    ``callers[s]``: an offload segment's :class:`Caller` (or none given); the copier sets
    ``left``: the offload segments whose caller had detached by the time the copy of their
    pages was seen to end (their bytes may be what the caller wrote since: a store keeps
    none of them).
    """

    to_host: bool
    pages: Sequence[torch.Tensor | Int64Array]
    blocks: Int64Array
    names: Sequence[int]
    ready: Sequence[Any] = ()
    marks: Sequence[LayerMarks | None] = ()
    error: str | None = None
    invalid: dict[int, str] = field(default_factory=dict)
    check_only: bool = False
    copied: int = 0
    # A load copied in parts (its check job, then chunks): its task id, and whether this
    # job is its last. Once its check job refused its ids, its later parts copy nothing.
    load: int = 0
    ends_load: bool = False
    callers: Sequence[Caller] = ()
    left: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Queued:
    job: CopyJob
    ends: list[Any]  # CUDA events, one per stream used; empty: nothing to wait for
    keep: Any  # what the queued copies read from (the plan's arrays), until they ran
    taken: list[tuple[EventPool, list[DriverEvent]]]  # back to their pools once ended


@dataclass(slots=True)
class _Lane:
    """What one thread at a time queues jobs with: its copy streams, the driver's queuer
    (None: torch copies), its way to the host for page ids, and its event pools. The
    copy thread has one; callers that queue their own jobs (:meth:`Copier.queue_here`)
    take one from a free list, so that two never share a page id buffer."""

    streams: list[Any]
    queuer: Queuer | None
    page_ids: PageIds
    events: EventPool | None
    ends: EventPool | None


class Here:
    """A job queued by its caller's thread (:meth:`Copier.queue_here`). :meth:`wait`
    waits for its copies and reports it (``on_done``): the caller's wait or the
    copier's close, whichever comes first; once, but where a wait is interrupted after
    its report and before it forgets the job, the next wait reports it again (the store
    takes a job in once)."""

    __slots__ = ("_copier", "_lock", "_queued", "job")

    def __init__(self, copier: Copier, queued: _Queued) -> None:
        self._copier = copier
        self._queued: _Queued | None = queued
        self._lock = threading.Lock()
        self.job = queued.job

    def wait(self) -> CopyJob:
        """Wait for the job's copies (the GIL released) and report it; the job, with its
        ``error`` and ``invalid`` set."""
        with self._lock:  # a second waiter waits for the first's report
            queued = self._queued
            if queued is not None:
                # Forgotten once reported: a wait interrupted in it (a KeyboardInterrupt
                # as the end events are waited for) leaves the report to the next waiter
                # (or the close), or the store would never end the job's reads.
                self._copier._end_here(self, queued)
                self._queued = None
        return self.job


def paced_layers(pages: int, geometry: Geometry) -> int:
    """How many layers of an offload of ``pages`` pages (every layer of each) may wait on
    the copy engines at once (0: all): ``MAX_BYTES_AHEAD``'s worth, and never fewer than
    two."""
    layers = geometry.layers
    job_bytes = pages * geometry.block_bytes
    if layers <= 2 or job_bytes <= MAX_BYTES_AHEAD:
        return 0
    ahead = max(2, MAX_BYTES_AHEAD * layers // job_bytes)
    return 0 if ahead >= layers else ahead


class Copier:
    """Moves jobs between ``caches`` and the host pool ``pool`` (``[block, layer, ...]``),
    in submission order; ``on_done(job)`` from its threads once a job ended.
    ``chunk_starts``: the blocks where the pool's separately pinned chunks start, where
    it was registered with CUDA in parts (no copy may span two). ``offloads``: shared by
    a store's copiers (one per direction), so that each knows of the other's offloads."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        pool: torch.Tensor,
        on_done: Callable[[CopyJob], None],
        name: str = "aiokv-copy",
        streams: int | None = None,
        chunk_starts: Sequence[int] = (0,),
        offloads: OffloadsInFlight | None = None,
    ) -> None:
        self._caches = list(caches)
        self._pool = pool
        self._chunk_starts = tuple(chunk_starts)  # the pool's pinned chunks (by block)
        self._on_done = on_done
        self._device = self._caches[0].device
        self._gpu_pages = int(self._caches[0].shape[0])
        # Read here, not bound at import: a benchmark may set STREAMS before register.
        self._num_streams = streams or STREAMS
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._page_ids: PageIds | None = None  # the copy thread's (CUDA)
        # Shared with the store's other copier: which way a job's ids come (:mod:`.ids`).
        self._offloads = offloads if offloads is not None else OffloadsInFlight()
        self._pools: list[EventPool] = []  # destroyed by the done thread at its end
        self._refused: dict[int, str] = {}  # split loads whose check job failed: why
        self._cuda = self._device.type == "cuda"
        self._exiting = False  # the interpreter exits (aiokv.exiting): no new job
        # Jobs queued by their callers' threads (queue_here): their lanes, free or in
        # use, and the jobs not yet reported; close waits for those.
        self._here_lock = threading.Condition()
        self._queuing_here = 0  # callers between their check of closed and their job's entry
        self._free_lanes: list[_Lane] = []
        self._lanes: list[_Lane] = []
        self._here: set[Here] = set()
        self._here_closed = False
        self._threads = [threading.Thread(target=self._run, name=name, daemon=True)]
        if self._cuda:
            self._geometry = Geometry.of(self._caches, pool)
            self._queued: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
            self._slots = threading.Semaphore(MAX_JOBS_IN_FLIGHT)
            self._threads.append(
                threading.Thread(target=self._complete, name=f"{name}-done", daemon=True)
            )
        for thread in self._threads:
            thread.start()
        stop_at_exit(self)

    @property
    def d2h_copies(self) -> int:
        """Jobs whose page ids came from the device (one fetch per job at most)."""
        return self._page_ids.fetches if self._page_ids is not None else 0

    def submit(self, job: CopyJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Finish the queued jobs (those their callers queued too), then stop the
        threads."""
        self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        with self._here_lock:
            self._here_closed = True
            self._here_lock.wait_for(lambda: not self._queuing_here)
            here = list(self._here)
        for job in here:  # their callers may not wait (a recsys launch never waited)
            job.wait()
        for lane in self._lanes:
            for pool in (lane.events, lane.ends):
                if pool is not None:
                    try:
                        pool.close()
                    except Exception:  # cleanup at the end: the events are lost
                        log.exception("aiokv: destroying a lane's CUDA events failed")

    # ---- jobs queued by their callers' threads -------------------------------------

    def wait_here(self) -> None:
        """Wait for the jobs callers queued (or are queuing) now and report them: their
        reads of host blocks end once the store takes their reports in (an evict must
        find those blocks idle, as it finds a load's that the loop dispatched before it)."""
        with self._here_lock:
            self._here_lock.wait_for(lambda: not self._queuing_here)
            here = list(self._here)
        for job in here:
            job.wait()

    def queue_here(self, job: CopyJob) -> Here | None:
        """Run the job's steps 1-4 in the calling thread (CUDA; on the CPU, move it), so
        that a caller that waits for its load anyway needs no other thread before its
        copies start; None once the copier is closing (nothing queued). The caller then
        :meth:`Here.wait` s, which reports the job as the done thread would."""
        with self._here_lock:
            if self._here_closed or self._exiting:
                return None
            lane = self._free_lanes.pop() if self._free_lanes else None
            self._queuing_here += 1
        queued: _Queued | None = None
        try:
            queued = self._queue_here(job, lane)
        except Exception as exc:  # no lane (a broken context): reported FAILED, not lost
            log.exception("aiokv copy job failed")
            job.error = repr(exc)
            queued = _Queued(job, [], None, [])
        finally:
            with self._here_lock:  # known to close before it stops waiting for callers
                self._queuing_here -= 1
                here = None if queued is None else Here(self, queued)
                if here is not None:
                    self._here.add(here)
                self._here_lock.notify_all()
        return here

    def _queue_here(self, job: CopyJob, lane: _Lane | None) -> _Queued:
        if not self._cuda:
            try:
                self._move_cpu(job)
            except Exception as exc:  # reported as a FAILED task, never lost
                log.exception("aiokv copy job failed")
                job.error = repr(exc)
            queued = _Queued(job, [], None, [])
        else:
            with torch.cuda.device(self._device):  # the caller's own device may differ
                if lane is None:
                    lane = self._lane()
                    with self._here_lock:
                        self._lanes.append(lane)
                queued = self._queue_job(job, lane)
            with self._here_lock:
                self._free_lanes.append(lane)
        return queued

    def _end_here(self, here: Here, queued: _Queued) -> None:
        _ran(queued)
        self._end(queued.job)
        # Known to wait_here and close until reported: a wait interrupted before its
        # report leaves the job to them (an evict's wait_here, or its blocks stay read).
        with self._here_lock:
            self._here.discard(here)

    def stop_at_exit(self) -> None:
        """The interpreter exits (:mod:`aiokv.exiting`): the copy thread ends after the job
        it is copying; the jobs queued behind it are left undone, never reported. On a GPU
        the done thread still waits for the jobs already queued on the device. Callers
        queue no job of their own any more (:meth:`queue_here` answers None), and the exit
        waits for those queuing one now (:meth:`join_at_exit`)."""
        with self._here_lock:  # no caller queues a job of its own from now on
            self._exiting = True
        self._jobs.put(None)  # wakes an idle copy thread

    def join_at_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        # Callers' threads queuing a job of their own (queue_here) run the same torch
        # copies and CUDA calls as the copy thread, as daemons too (a user's loader): one
        # inside them when the interpreter finalizes aborts the process just the same.
        with self._here_lock:  # releases the GIL: their calls can return
            self._here_lock.wait_for(lambda: not self._queuing_here,
                                     max(0.0, deadline - time.monotonic()))
            queuing = self._queuing_here
        return not queuing and not any(thread.is_alive() for thread in self._threads)

    def _next_job(self) -> CopyJob | None:
        """The next job; None once closed, or once the interpreter exits."""
        job = self._jobs.get()
        return None if self._exiting else job

    # ---- the copy thread -----------------------------------------------------------

    def _run(self) -> None:
        if not self._cuda:
            while (job := self._next_job()) is not None:
                try:
                    self._move_cpu(job)
                except Exception as exc:  # reported as a FAILED task, never lost
                    log.exception("aiokv copy job failed")
                    job.error = repr(exc)
                self._end(job)
            return
        stopped: Exception | None = None
        try:
            self._run_cuda()
        except Exception as exc:  # its start-up failed (no device, a broken context)
            log.exception("aiokv: the copy thread stopped")
            stopped = exc
        finally:
            self._queued.put(None)  # whatever happened, the done thread ends
        if stopped is not None:
            # Every job from now on fails at once, naming why, rather than waiting out
            # its callers' timeouts.
            while (job := self._jobs.get()) is not None:
                job.error = f"the copy thread stopped: {stopped!r}"
                self._end(job)

    def _lane(self) -> _Lane:
        """A new lane, made on the thread that uses it first (the device current)."""
        streams = [torch.cuda.Stream(self._device) for _ in range(self._num_streams)]  # type: ignore[no-untyped-call]
        streams[0].synchronize()  # a runtime call: the context is current for the driver's
        batch: BatchCopy | None = None
        queuer: Queuer | None = None
        events = ends = None
        try:
            batch = BatchCopy()
            queuer = Queuer(Entries.of_driver(), [s.cuda_stream for s in streams])
            events = EventPool(CU_EVENT_DISABLE_TIMING)
            ends = EventPool(CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC)
        except DriverError as exc:
            global _fallback_warned
            queuer = None
            if not _fallback_warned:
                _fallback_warned = True
                log.warning("aiokv: copying page by page with torch copies, slower: %s", exc)
        return _Lane(streams, queuer, PageIds(self._device, batch), events, ends)

    def _run_cuda(self) -> None:
        torch.cuda.set_device(self._device)
        lane = self._lane()
        self._pools.extend(p for p in (lane.events, lane.ends) if p is not None)
        self._page_ids = lane.page_ids
        # One lane made now for the callers that queue their own jobs (queue_here): the
        # first of them would otherwise pay for its streams, events and kernels' load.
        spare = self._lane()
        with self._here_lock:
            self._lanes.append(spare)
            self._free_lanes.append(spare)
        while (job := self._next_job()) is not None:
            self._slots.acquire()  # released by the done thread
            self._queued.put(self._queue_job(job, lane))

    def _queue_job(self, job: CopyJob, lane: _Lane) -> _Queued:
        """Steps 1-4 of a job on ``lane``: what the done thread (or :class:`Here`)
        waits for."""
        taken: list[tuple[EventPool, list[DriverEvent]]] = []  # the job's events
        counted = False  # in self._offloads (once per offload; the done thread's -1)
        try:
            ids = self._host_ids(job, lane.page_ids)
            if job.to_host:  # before its first bytes are queued: a paced job takes long
                self._offloads.add(1)
                counted = True
            if lane.queuer is not None:
                queued = self._queue_driver(job, ids, lane, taken)
            else:
                queued = self._queue_torch(job, ids, lane.streams)
        except Exception as exc:
            log.exception("aiokv copy job failed")
            job.error = repr(exc)
            # What was queued may still read or write blocks that go back once the
            # job is reported: let it run first. (A broken context fails these too;
            # the next jobs then fail in turn, each reported.)
            for stream in (*lane.streams, lane.page_ids.stream):
                try:
                    stream.synchronize()
                except Exception:
                    log.exception("aiokv: synchronizing a copy stream failed")
            queued = _Queued(job, [], None, taken)
        if job.to_host and not counted:
            self._offloads.add(1)  # taken off by the done thread once it ended
        return queued

    def _host_ids(self, job: CopyJob, page_ids: PageIds) -> Int64Array:
        """The job's page ids on the host, after its ready events (waits A and B)."""
        return page_ids.fetch(job.pages, job.ready, engines_busy=bool(self._offloads))

    def _checked(self, job: CopyJob, ids: Int64Array) -> tuple[Int64Array, Int64Array]:
        """The job's (pages, blocks) less the segments whose ids are refused (job.invalid,
        their marks failed)."""
        refused = self._refused.pop(job.load, None) if job.ends_load else (
            self._refused.get(job.load) if job.load else None)
        if refused is not None:  # its check job refused the load: none of it is copied
            for segment in range(len(job.names)):
                job.invalid[segment] = refused
                marks = job.marks[segment] if job.marks else None
                if marks is not None:
                    marks.fail(refused, field="page_ids")
            return ids[:0], job.blocks[:0]
        keep: np.ndarray | None = None
        at = 0
        # A batch's ids checked whole first: where they all pass (the rule), so does each
        # segment's, and one check costs a fraction of one per segment.
        segments = len(job.names)
        if segments > 1 and check_pages(ids, self._gpu_pages, not job.to_host) is None:
            segments = 0
        for segment in range(segments):
            count = len(job.pages[segment])
            why = check_pages(ids[at : at + count], self._gpu_pages, not job.to_host)
            if why is not None:
                job.invalid[segment] = why
                if keep is None:
                    keep = np.ones(len(ids), dtype=np.bool_)
                keep[at : at + count] = False
                marks = job.marks[segment] if job.marks else None
                if marks is not None:
                    marks.fail(why, field="page_ids")
            at += count
        if job.check_only:
            if job.invalid and job.load:
                self._refused[job.load] = next(iter(job.invalid.values()))
            return ids[:0], job.blocks[:0]
        if len(ids) != len(job.blocks):
            raise ValueError(f"{len(ids)} page ids for {len(job.blocks)} host blocks")
        pages, blocks = (ids, job.blocks) if keep is None else (ids[keep], job.blocks[keep])
        job.copied = len(pages)
        return pages, blocks

    def _live_marks(self, job: CopyJob) -> list[LayerMarks]:
        return [m for s, m in enumerate(job.marks) if m is not None and s not in job.invalid]

    def _queue_driver(
        self, job: CopyJob, ids: Int64Array, lane: _Lane,
        taken: list[tuple[EventPool, list[DriverEvent]]],
    ) -> _Queued:
        """Queue the job with the driver's calls from C (:mod:`.queueing`): a load with
        marks one call per layer, each layer marked once queued; else one call. The events
        it takes go into ``taken`` as they are taken (a failure gives them back too)."""

        def take(pool: EventPool, count: int) -> list[DriverEvent]:
            events = pool.take(count)
            taken.append((pool, events))
            return events

        streams, queuer, ids_stream = lane.streams, lane.queuer, lane.page_ids.stream
        assert queuer is not None and lane.events is not None and lane.ends is not None
        pages, blocks = self._checked(job, ids)
        copies = plan(self._geometry, pages, blocks, job.to_host, len(streams),
                      chunk_starts=self._chunk_starts)
        used, layers = copies.streams, self._geometry.layers
        marks = self._live_marks(job)
        ready = 0
        if any(event is not None for event in job.ready):
            # wait A for the copy streams: one event on the ids stream, which waited for
            # the callers' ready events (_host_ids), and which the copy streams wait for.
            (mark,) = take(lane.events, 1)
            mark.record(ids_stream)
            ready = mark.handle
        ahead = paced_layers(len(pages), self._geometry) if job.to_host else 0
        # A paced offload's host waits for its layers' events (blocking ones: the copy
        # thread sleeps rather than spins while a layer runs).
        layer_events = (take(lane.events, layers * used) if marks
                        else take(lane.ends, layers * used) if ahead else [])
        ends = take(lane.ends, used)
        prepared = queuer.prepare(copies, layers, ready,
                                  [e.handle for e in layer_events] if layer_events else None,
                                  [e.handle for e in ends], barrier=bool(marks), ahead=ahead)
        if marks:
            for layer in range(layers):
                queuer.queue(prepared, layer, layer + 1, wait_ready=layer == 0,
                             end=layer == layers - 1)
                events = layer_events[layer * used : (layer + 1) * used]
                for m in marks:
                    m.layer_queued(layer, events)
        else:
            queuer.queue(prepared, 0, layers, wait_ready=True, end=True)
        return _Queued(job, ends, prepared, taken)

    def _queue_torch(self, job: CopyJob, ids: Int64Array, streams: list[Any]) -> _Queued:
        """The fallback where the driver lacks the batch call (:func:`.queueing.torch_copies`)."""
        pages, blocks = self._checked(job, ids)
        copies = plan(self._geometry, pages, blocks, job.to_host, len(streams), min_run=None)
        ends = torch_copies(self._caches, self._pool, job.to_host, pages, blocks, copies,
                            streams[: copies.streams], job.ready, self._live_marks(job))
        return _Queued(job, ends, copies, [])

    # ---- the done thread (CUDA) ----------------------------------------------------

    def _complete(self) -> None:
        """Report jobs in the order they were queued, each once it ran on every stream
        (wait D)."""
        while (item := self._queued.get()) is not None:
            _ran(item)
            del item.keep
            if item.job.to_host:
                self._offloads.add(-1)
            self._slots.release()
            self._end(item.job)
        # Every job ended and gave its events back (a caller's marks no longer use them).
        for pool in self._pools:
            try:
                pool.close()
            except Exception:  # cleanup at the end: the events are lost, nothing else
                log.exception("aiokv: destroying the copier's CUDA events failed")

    def _end(self, job: CopyJob) -> None:
        if job.to_host and job.callers and job.error is None:
            # The copies ended (the CPU copy returned, or every stream's end event). A
            # caller detached before now may have rewritten its pages while they were
            # read: none of its bytes count. One that detaches after this was told
            # nothing until its pages were read in full: its bytes are good.
            job.left = [s for s, caller in enumerate(job.callers)
                        if caller.detached and s not in job.invalid]
        for marks in self._live_marks(job):
            if job.error is None:
                marks.finish()
            else:
                marks.fail(job.error)
        self._on_done(job)

    # ---- the CPU path --------------------------------------------------------------

    def _move_cpu(self, job: CopyJob) -> None:
        pages, blocks = self._checked(job, concat([as_numpy(p) for p in job.pages]))
        marks = self._live_marks(job)
        # Writable copies where needed: the store's block arrays may be read-only.
        page_index = torch.from_numpy(np.require(pages, requirements="W"))
        block_index = torch.from_numpy(np.require(blocks, requirements="W"))
        pool = _raw(self._pool)
        for layer, cache in enumerate(map(_raw, self._caches)):
            host = pool[:, layer]
            if job.to_host:
                host.index_copy_(0, block_index, cache.index_select(0, page_index))
            else:
                cache.index_copy_(0, page_index, host.index_select(0, block_index))
                for m in marks:
                    m.layer_done(layer)


def _ran(queued: _Queued) -> None:
    """Wait D for a queued job: its end events, on every stream (a failure fails the
    job); then its events back to their pools, where every record of them ran (they
    ended, or the streams were synchronized)."""
    try:
        for event in queued.ends:
            event.synchronize()  # releases the GIL while it waits
    except Exception as exc:
        log.exception("aiokv copy job failed on the GPU")
        queued.job.error = repr(exc)
    if queued.job.error is None or not queued.ends:
        # Each list given once: a wait interrupted here is made again by the next one.
        while queued.taken:
            pool, events = queued.taken.pop(0)
            pool.give(events)


# A dtype's bytes as a signed integer of its size: torch's CPU index ops lack some dtypes
# (float8, uint16/32/64), and a copy moves bytes, whatever they mean.
_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    raw = _RAW.get(tensor.element_size())
    return tensor if raw is None or tensor.dtype == raw else tensor.view(raw)
