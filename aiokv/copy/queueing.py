"""Queueing a copy plan's layers on the copy streams: every batch call, 2-D copy and event
of a range of layers in ONE call that does not hold the GIL.

Made one driver call at a time from Python, a job of 8 layers on 4 streams is dozens of
ctypes calls, each giving the GIL back and taking it again; beside a model whose thread
launches kernels in Python, each retake waits for that thread, and the model's thread
waits for the copier's in turn. :class:`Queuer` hands the whole range to the extension
``aiokv.copy._queue`` (``_queue.c``), which makes the same driver calls in C with the
GIL released: a load's layer marked as soon as its copies are queued costs one call per
layer, an offload one call in all. A marked load's streams also wait for each other's
previous layer (``_queue.c`` says why), so that its layers land in order; a large
offload's call waits (``cuEventSynchronize``, in C) for its layer L - ``ahead`` before it
queues layer L, so that little of it sits ahead of a model's own copies to the host. Where the
extension was not built (a source tree used without ``pip install``), the same loop runs
here in Python, said once in the log; where the driver lacks the batch call,
:func:`torch_copies` queues a torch copy per page and layer.

The driver's entry points come in :class:`Entries` (addresses), so that the CPU tests can
hand both loops functions of their own (memmove) and check the bytes.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .driver import (
    BATCH_SIGNATURE,
    CU_MEMORYTYPE_UNIFIED,
    DriverError,
    Memcpy2D,
    batch_entry,
    copy_attributes,
    error_name,
    libcuda,
)
from .marks import LayerMarks
from .plan import Int64Array, Plan

log = logging.getLogger("aiokv")

_P = ctypes.c_void_p
COPY2D_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Memcpy2D), _P)
RECORD_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P)
WAIT_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_uint)
SYNC_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, _P)
_NO_FAILURE = 2**64 - 1  # failIdx's value while no copy failed
_U64 = ctypes.POINTER(ctypes.c_uint64)
_I64 = ctypes.POINTER(ctypes.c_int64)

# What failed, as _queue.c writes it into QueueArgs.fail_kind.
_KINDS = {1: "cuStreamWaitEvent", 2: "cuMemcpyBatchAsync", 3: "cuMemcpy2DAsync",
          4: "cuEventRecord", 5: "cuEventSynchronize"}


class QueueArgs(ctypes.Structure):
    """One call's arguments and, on failure, which driver call failed: ``_queue.c``'s
    struct of the same name, field for field."""

    _fields_ = [
        ("batch", _P), ("copy2d", _P), ("record", _P), ("wait", _P), ("attrs", _P),
        ("streams", _U64), ("n_streams", ctypes.c_int64), ("ready", ctypes.c_uint64),
        ("first_layer", ctypes.c_int64), ("last_layer", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("dsts", _U64), ("srcs", _U64), ("sizes", _U64), ("positions", ctypes.c_int64),
        ("bounds", _I64),
        ("run_dsts", _U64), ("run_srcs", _U64), ("heights", _I64), ("stream_of", _I64),
        ("n_runs", ctypes.c_int64),
        ("width", ctypes.c_uint64), ("src_pitch", ctypes.c_uint64),
        ("dst_pitch", ctypes.c_uint64),
        ("layer_events", _U64), ("end_events", _U64),
        ("barrier", ctypes.c_int64), ("sync", _P), ("ahead", ctypes.c_int64),
        ("err", ctypes.c_int64), ("fail_kind", ctypes.c_int64), ("fail_layer", ctypes.c_int64),
        ("fail_stream", ctypes.c_int64), ("fail_index", ctypes.c_int64),
        ("fail_copy", ctypes.c_uint64),
    ]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A plan's :class:`QueueArgs`, its ready event and end events, and the arrays the
    arguments point into."""

    args: QueueArgs
    ready: int
    ends: Any  # a pointer to the end events (NULL: none)
    keep: list[Any]


@dataclass(frozen=True, slots=True)
class Entries:
    """The driver calls a :class:`Queuer` makes, as function addresses (the driver's own,
    or a test's), and how to name a driver error."""

    batch: int  # cuMemcpyBatchAsync (the 12.8 ABI)
    copy2d: int  # cuMemcpy2DAsync_v2
    record: int  # cuEventRecord
    wait: int  # cuStreamWaitEvent
    name_error: Callable[[int], str] = str
    sync: int = 0  # cuEventSynchronize (0: none, and no pacing)

    @classmethod
    def of_driver(cls) -> Entries:
        """The CUDA driver's; DriverError where it lacks the batch call."""
        call, why = batch_entry()
        if call is None:
            raise DriverError(why or "cuMemcpyBatchAsync is absent")
        lib = libcuda()

        def address(name: str) -> int:
            try:
                return int(ctypes.cast(getattr(lib, name), _P).value or 0)
            except AttributeError as exc:
                raise DriverError(f"{name} is absent from the driver ({exc})") from exc

        return cls(int(ctypes.cast(call, _P).value or 0), address("cuMemcpy2DAsync_v2"),
                   address("cuEventRecord"), address("cuStreamWaitEvent"),
                   lambda err: error_name(lib, err), address("cuEventSynchronize"))


def native_run() -> Callable[[int], int] | None:
    """The extension's entry point, or None where it was not built."""
    try:
        extension = importlib.import_module("aiokv.copy._queue")
    except ImportError:
        return None
    run: Callable[[int], int] = extension.run
    return run


_python_warned = False


def _as(array: np.ndarray, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=dtype)


class Queuer:
    """Queues plans on ``streams`` (CUstream handles), made once per copy thread.
    ``native``: use the extension where it was built (False: the Python loop)."""

    def __init__(self, entries: Entries, streams: Sequence[int], native: bool = True) -> None:
        self._entries = entries
        self._streams = np.array(streams, dtype=np.uint64)
        self._attrs = copy_attributes()
        self._run = native_run() if native else None
        if self._run is None and native:
            global _python_warned
            if not _python_warned:
                _python_warned = True
                log.warning("aiokv: the extension aiokv.copy._queue is not built; the copy "
                            "thread queues copies from Python, holding the GIL more "
                            "(`pip install -e .` builds it)")

    @property
    def native(self) -> bool:
        return self._run is not None

    def prepare(
        self, copies: Plan, layers: int, ready: int = 0,
        layer_events: Sequence[int] | None = None, end_events: Sequence[int] | None = None,
        barrier: bool = False, ahead: int = 0,
    ) -> Prepared:
        """The arguments that queue ``copies`` on the first ``copies.streams`` streams
        (layers set per call by :meth:`queue`), with the arrays they point into (keep
        them until the queued copies ran). Every stream first waits for event ``ready``
        (0: none); ``layer_events`` ([layer, stream] flattened) are recorded after each
        layer, ``end_events`` (one per stream) after the last. ``barrier``: each stream
        starts a layer once every stream did the one before (layer events needed).
        ``ahead`` > 0: the host queues layer L only once layer L - ``ahead`` ran on every
        stream (layer events and the entries' ``sync`` needed), so that no more than
        ``ahead`` layers wait on the copy engines."""
        if (barrier or ahead) and layer_events is None:
            raise ValueError("barrier and ahead need layer events")
        if ahead and not self._entries.sync:
            raise ValueError("ahead needs the driver's cuEventSynchronize")
        used = copies.streams
        keep: list[Any] = []

        def ptr(array: np.ndarray, kind: Any) -> Any:
            keep.append(array)
            return array.ctypes.data_as(kind)

        runs = copies.runs
        args = QueueArgs(
            batch=self._entries.batch, copy2d=self._entries.copy2d,
            record=self._entries.record, wait=self._entries.wait,
            attrs=ctypes.addressof(self._attrs),
            streams=ptr(self._streams[:used], _U64), n_streams=used,
            layers=layers,
            dsts=ptr(_as(copies.dsts, np.uint64), _U64),
            srcs=ptr(_as(copies.srcs, np.uint64), _U64),
            sizes=ptr(_as(copies.sizes, np.uint64), _U64),
            positions=copies.dsts.shape[1] if copies.dsts.ndim == 2 else 0,
            bounds=ptr(np.array(copies.bounds, dtype=np.int64), _I64),
        )
        if runs is not None:
            args.run_dsts = ptr(_as(runs.dsts, np.uint64), _U64)
            args.run_srcs = ptr(_as(runs.srcs, np.uint64), _U64)
            args.heights = ptr(_as(runs.heights, np.int64), _I64)
            args.stream_of = ptr(_as(runs.stream_of, np.int64), _I64)
            args.n_runs = len(runs.heights)
            args.width, args.src_pitch, args.dst_pitch = (runs.width, runs.src_pitch,
                                                          runs.dst_pitch)
        if layer_events is not None:
            args.layer_events = ptr(np.array(layer_events, dtype=np.uint64), _U64)
        args.barrier, args.sync, args.ahead = int(barrier), self._entries.sync, ahead
        ends = _U64() if end_events is None else ptr(np.array(end_events, dtype=np.uint64), _U64)
        return Prepared(args, ready, ends, keep)

    def queue(self, prepared: Prepared, first: int, last: int, wait_ready: bool,
              end: bool) -> None:
        """Queue layers ``first:last``; the streams wait for the ready event first where
        ``wait_ready``, the end events are recorded where ``end``. DriverError names the
        call that failed."""
        args = prepared.args
        args.first_layer, args.last_layer = first, last
        args.ready = prepared.ready if wait_ready else 0
        args.end_events = prepared.ends if end else _U64()
        err = self._run(ctypes.addressof(args)) if self._run else _queue_python(args)
        if err:
            raise DriverError(self._describe(args))

    def _describe(self, a: QueueArgs) -> str:
        what = _KINDS.get(a.fail_kind, "a driver call")
        where = f"layer {a.fail_layer}, stream {a.fail_stream}"
        # The failed copy's details only where the driver's index names one of the call's
        # copies: an index out of range must not turn a job's error into a crash.
        calls = a.bounds[a.fail_stream + 1] - a.bounds[a.fail_stream] if a.fail_kind == 2 else 0
        if a.fail_kind == 2 and a.fail_copy < calls:
            i = a.fail_index + a.fail_copy
            layer_at = a.fail_layer * a.positions + i
            where += (f", copy {a.fail_copy}: {a.sizes[i]} bytes from "
                      f"{a.srcs[layer_at]:#x} to {a.dsts[layer_at]:#x}")
        elif a.fail_kind == 3:
            r = a.fail_layer * a.n_runs + a.fail_index
            where += (f", run {a.fail_index}: {a.heights[a.fail_index]} rows x {a.width} "
                      f"bytes from {a.run_srcs[r]:#x} (pitch {a.src_pitch}) to "
                      f"{a.run_dsts[r]:#x} (pitch {a.dst_pitch})")
        return f"{what} failed ({where}): {self._entries.name_error(int(a.err))}"


def _queue_python(a: QueueArgs) -> int:
    """``_queue.c``'s loop, call for call, where the extension is absent."""
    batch = BATCH_SIGNATURE(a.batch)
    copy2d, record, wait = (COPY2D_SIGNATURE(a.copy2d), RECORD_SIGNATURE(a.record),
                            WAIT_SIGNATURE(a.wait))
    sync = SYNC_SIGNATURE(a.sync) if a.ahead > 0 else None
    attr_index, failed = ctypes.c_size_t(0), ctypes.c_size_t(0)
    op = Memcpy2D(srcMemoryType=CU_MEMORYTYPE_UNIFIED, dstMemoryType=CU_MEMORYTYPE_UNIFIED,
                  WidthInBytes=a.width, srcPitch=a.src_pitch, dstPitch=a.dst_pitch)
    a.err, a.fail_kind = 0, 0

    def fail(err: int, kind: int, layer: int, stream: int, index: int) -> int:
        a.err, a.fail_kind, a.fail_layer, a.fail_stream, a.fail_index = (err, kind, layer,
                                                                          stream, index)
        return err

    streams = [a.streams[s] for s in range(a.n_streams)]
    if a.ready:
        for s, stream in enumerate(streams):
            if err := wait(stream, a.ready, 0):
                return fail(err, 1, a.first_layer, s, 0)
    u64 = ctypes.sizeof(ctypes.c_uint64)
    dsts, srcs, sizes = (ctypes.cast(a.dsts, _P).value or 0, ctypes.cast(a.srcs, _P).value or 0,
                         ctypes.cast(a.sizes, _P).value or 0)
    for layer in range(a.first_layer, a.last_layer):
        row = layer * a.positions
        if sync is not None and layer >= a.ahead:
            for s in range(a.n_streams):
                if err := sync(a.layer_events[(layer - a.ahead) * a.n_streams + s]):
                    return fail(err, 5, layer - a.ahead, s, 0)
        for s, stream in enumerate(streams):
            for t in range(a.n_streams) if a.barrier and layer > 0 else ():
                before = a.layer_events[(layer - 1) * a.n_streams + t]
                if t != s and (err := wait(stream, before, 0)):
                    return fail(err, 1, layer, s, t)
            lo, count = a.bounds[s], a.bounds[s + 1] - a.bounds[s]
            if count > 0:
                failed.value = _NO_FAILURE
                err = batch(dsts + (row + lo) * u64, srcs + (row + lo) * u64,
                            sizes + lo * u64, count, a.attrs, ctypes.byref(attr_index), 1,
                            ctypes.byref(failed), stream)
                if err:
                    a.fail_copy = failed.value
                    return fail(err, 2, layer, s, lo)
            for r in range(a.n_runs):
                if a.stream_of[r] != s:
                    continue
                op.dstDevice = a.run_dsts[layer * a.n_runs + r]
                op.srcDevice = a.run_srcs[layer * a.n_runs + r]
                op.Height = a.heights[r]
                if err := copy2d(ctypes.byref(op), stream):
                    return fail(err, 3, layer, s, r)
            if a.layer_events and (err := record(a.layer_events[layer * a.n_streams + s],
                                                 stream)):
                return fail(err, 4, layer, s, 0)
    if a.end_events:
        for s, stream in enumerate(streams):
            if err := record(a.end_events[s], stream):
                return fail(err, 4, a.last_layer, s, 0)
    return 0


def torch_copies(
    caches: Sequence[torch.Tensor], pool: torch.Tensor, to_host: bool, pages: Int64Array,
    blocks: Int64Array, copies: Plan, streams: Sequence[Any], ready: Sequence[Any],
    marks: Sequence[LayerMarks],
) -> list[Any]:
    """Where the driver lacks the batch call: a torch copy per (page, layer) of ``copies``
    (a plan without runs) on ``streams``, after the ``ready`` events, each layer's torch
    events handed to ``marks``; the end events, one per stream."""
    for stream in streams:  # wait A, for the copy streams
        for event in ready:
            if event is not None:
                stream.wait_event(event)
    for layer, cache in enumerate(caches):
        for part, stream in enumerate(streams):
            lo, hi = copies.bounds[part], copies.bounds[part + 1]
            with torch.cuda.stream(stream):
                for page, block in zip(pages[lo:hi].tolist(), blocks[lo:hi].tolist(),
                                       strict=True):
                    if to_host:
                        pool[block, layer].copy_(cache[page], non_blocking=True)
                    else:
                        cache[page].copy_(pool[block, layer], non_blocking=True)
        if marks:  # wait C's events: this layer, every stream
            events = [torch.cuda.Event() for _ in streams]  # type: ignore[no-untyped-call]
            for event, stream in zip(events, streams, strict=True):
                event.record(stream)
            for m in marks:
                m.layer_queued(layer, events)
    ends = [torch.cuda.Event(blocking=True) for _ in streams]  # type: ignore[no-untyped-call]
    for event, stream in zip(ends, streams, strict=True):
        event.record(stream)
    return ends
