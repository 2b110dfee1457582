"""A copy ahead: a batch's first chunk moved on the GPU before its launch (base.Prestages,
base.PrestagesPuts).

A load's first chunk is copied into a staging buffer before its batch's page ids reach
the host, and its launch scatters from there. An offload's first chunk is gathered from
the callers' own device page ids (clamped into the caches, so a bad id cannot read out of
bounds) and copied into its reserved host blocks before the slots reach the host, and its
launch skips it. Either is used only by the job that carries its tag; any other job
leaves it unused. :class:`CopiesAhead` is :class:`~.transfer.Transfer`'s part that does
it (a base class, as :class:`~.completion.TaskEnds` is LocalStore's), run on the copy
thread in queue order with the jobs.

Why an offload's copy ahead is safe: its blocks are reserved by their put tasks, which
no reader, evict or SSD read touches until the task ends. A job queued after it on the
same streams ends after it, so a task launched in any job ends after the copy ahead
wrote its blocks; a task cancelled instead has its blocks freed only after
:meth:`CopiesAhead.settle_ahead` (LocalStore.cancel), since the SSD tier refills freed
blocks off the streams. The callers' page-id tensors are read on the gather stream
without ``record_stream``: each stays referenced by its request until the request's
answer, which comes after its job ended (launched) or after that wait (cancelled), so
the caching allocator cannot hand its memory out while the copy ahead may read it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..base import Int64Array
from . import streams
from .graphs import LayerGraphs
from .order import contiguous_runs, in_host_order
from .pool import HostPool

log = logging.getLogger("aiokv")

# How often settle_ahead looks whether the copy thread still lives while it waits.
_SETTLE_POLL_S = 0.1


@dataclass(slots=True)
class Prestage:
    """The copy thread's order to move the first chunk of a job of these host blocks
    ahead: a load's copy in, or (``gpu_pages`` given) an offload's gather and copy out."""

    host_blocks: Int64Array
    tag: int  # LocalStore's, carried by the job it is for (CopyJob.prestaged)
    # An offload's device page ids, per task (their concatenation is host_blocks' pages,
    # in order), read once the ``ready`` events fired.
    gpu_pages: Sequence[torch.Tensor] | None = None
    ready: Sequence[Any] = ()
    handled: threading.Event = field(default_factory=threading.Event)  # by the copy thread
    # An offload's copy out, once queued (the copy thread sets it before ``handled``).
    copied: Any = None


@dataclass(slots=True, frozen=True)
class CopiedAhead:
    """A prestage's first chunk: in staging buffer ``stage`` once ``copied`` fired (an
    offload's: in its host blocks too); host blocks ``first`` to ``first + count``; for
    the job that carries ``tag``."""

    stage: int
    copied: Any  # torch.cuda.Event
    first: int
    count: int
    tag: int


class CopiesAhead:
    """Transfer's copy ahead; the state is Transfer's (its ``__init__``)."""

    _caches: list[torch.Tensor]
    _pool: HostPool
    _device: torch.device
    _chunk_blocks: int
    _chunk_starts: Int64Array | None
    _jobs: queue.SimpleQueue[Any]
    _staging: list[torch.Tensor]
    _free_after: list[torch.cuda.Event | None]
    _next_stage: int
    _gpu_stream: Any
    _copy_stream: Any
    _graphs: LayerGraphs | None
    _prestaged: CopiedAhead | None  # the last copy ahead, until a job takes or drops it
    _last_prestage: Prestage | None  # the last order queued (settle_ahead)
    _last_queued: threading.Event | None  # Transfer.wait_queued's
    _threads: list[threading.Thread]  # the copy thread first

    if TYPE_CHECKING:

        def _per_layer(
            self, to_host: bool, graphs: LayerGraphs | None, which: int,
            pages: torch.Tensor, stage: torch.Tensor,
        ) -> None: ...

    def prestage(
        self,
        host_blocks: Int64Array,
        tag: int,
        gpu_pages: Sequence[torch.Tensor] | None = None,
        ready: Sequence[Any] = (),
    ) -> None:
        """Move ahead of its job the first chunk of a load of ``host_blocks``, or (with
        ``gpu_pages``) of an offload into them (LocalStore.prestage, .prestage_puts); the
        next job uses it if it carries ``tag`` (> 0)."""
        if self._device.type == "cuda":
            order = Prestage(host_blocks, tag, gpu_pages, ready)
            self._last_prestage = order
            self._last_queued = order.handled
            self._jobs.put(order)

    def settle_ahead(self) -> None:
        """Block until every offload copy ahead queued so far has written its blocks (or
        was given up): before blocks it may write are freed. Any thread but the copy
        thread; waits on it, then on the device."""
        order = self._last_prestage
        if order is None:
            return
        copier = self._threads[0]
        while not order.handled.wait(_SETTLE_POLL_S):
            if not copier.is_alive():  # it died with the order unhandled: whatever it
                self._copy_stream.synchronize()  # queued before is on these streams
                self._gpu_stream.synchronize()
                return
        # The last copy ahead ran after every older one (the same streams); a failed one
        # synchronized the streams instead (an offload's order always has blocks).
        if order.copied is not None:
            order.copied.synchronize()

    def _copy_ahead(self, order: Prestage) -> None:
        """Queue a prestage's first chunk (copy thread). A newer copy ahead drops an
        older one, used or not; a failed one only costs its head start."""
        self._prestaged = None
        try:
            self._prestaged = self._queue_ahead(order)
        except Exception:  # a hint: the job copies its first chunk itself
            log.warning("aiokv: copying a first chunk ahead failed", exc_info=True)
            self._prestaged = None
            try:  # a copy queued before the failure may still use a staging buffer
                self._copy_stream.synchronize()
                self._gpu_stream.synchronize()
            except Exception:
                log.exception("aiokv: synchronizing the copy streams failed")
        finally:
            order.handled.set()

    def _queue_ahead(self, order: Prestage) -> CopiedAhead | None:
        """The copies of ``order``'s first chunk, into the next staging buffer, on the
        streams a job's first chunk would use. Until a job uses it, the buffer is busy
        until they end: a job that does not use it (its ``free_after``) waits for them."""
        blocks = order.host_blocks
        positions, ordered = in_host_order(np.arange(len(blocks), dtype=np.int64), blocks)
        runs = contiguous_runs(ordered, self._chunk_blocks, self._chunk_starts)
        if not runs:
            return None
        end = runs[0][1]
        which = self._next_stage
        self._next_stage ^= 1
        previous = self._free_after[which]
        stage = self._staging[which][:end]
        first = int(ordered[0])
        host = self._pool.data[first : first + end]
        gpu, copy = self._gpu_stream, self._copy_stream
        if order.gpu_pages is None:  # a load: copy in
            if previous is not None:
                copy.wait_event(previous)
            streams.on_stream(copy, gpu, stage.copy_, host)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(copy)
        else:  # an offload: gather (this thread's current stream), copy out
            for event in order.ready:  # the callers wrote their KV and page ids
                gpu.wait_event(event)
            if previous is not None:
                gpu.wait_event(previous)
            pages = self._pages_ahead(order.gpu_pages, positions[:end])
            graphs = self._graphs if end == self._chunk_blocks else None
            self._per_layer(True, graphs, which, pages, stage)
            gathered = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gathered.record(gpu)
            copy.wait_event(gathered)
            streams.on_stream(copy, gpu, host.copy_, stage)
            copied = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            copied.record(copy)
            order.copied = copied
        self._free_after[which] = copied
        return CopiedAhead(which, copied, first, end, order.tag)

    def _pages_ahead(
        self, gpu_pages: Sequence[torch.Tensor], positions: Int64Array
    ) -> torch.Tensor:
        """The device page ids at ``positions`` of the tasks' pages, as int64, clamped
        into the caches: ids not checked yet (a bad one fails its request, whose blocks
        the copy ahead then wrote for nothing, but never reads out of bounds). On the
        current stream (the gather stream), where they are used and then freed."""
        pages = torch.cat(list(gpu_pages)) if len(gpu_pages) > 1 else gpu_pages[0]
        count = len(positions)
        if np.array_equal(positions, np.arange(count)):  # host order is task order
            pages = pages[:count]
        else:
            pages = pages[streams.to_device(positions, self._device)]
        return pages.to(torch.int64).clamp(0, self._caches[0].shape[0] - 1)
