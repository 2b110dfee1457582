"""Everything aiokv asks of CUDA: the callers' ready events, the fused page-id copy into
pinned memory, pinned-memory helpers, and the warm-up.

On the loop: :class:`ReadyMarks` notes each caller's stream at submit and records one
event per stream per window (:class:`CurrentStreams` hands out the stream objects).
On the store thread: :func:`fuse_page_ids` orders a batch's copy after those events
(:func:`ready_events`), concatenates the batch's page ids on their device (expanding them
to slots there) and has them written into pinned host memory without blocking: one
device-to-host transfer per batch. What it answers, :class:`~aiokv.slots.FusedPages`, is
host math from there on.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .slots import FusedPages, largest_page
from .stores.base import Int64Array

if TYPE_CHECKING:
    from .requests import Request

log = logging.getLogger("aiokv")


def ready_events(requests: Iterable[Request]) -> list[Any]:
    """The distinct ready events of ``requests``, for a batch to wait for before its copy
    (usually one per caller stream; see :class:`ReadyMarks`)."""
    events: dict[int, Any] = {}
    for request in requests:
        if request.ready_event is not None:
            events.setdefault(id(request.ready_event), request.ready_event)
    return list(events.values())


class CurrentStreams:
    """``torch.cuda.current_stream(device)``, for a call on every submit.

    torch builds a new Stream object per call, a large part of a submit's cost on the
    loop. The stream's identity is a (stream id, device index, device type) triple that
    torch reads cheaply; a Stream is nothing but that triple, so the object built for a
    triple is kept and handed out again. Where torch lacks the private getter
    (``torch._C._cuda_getCurrentStream``), it falls back to ``torch.cuda.current_stream``."""

    _MAX_STREAMS = 1024  # past this many distinct streams, build objects per call again

    def __init__(
        self,
        get_current: Callable[[int], tuple[int, int, int]] | None = None,
        new_stream: Callable[..., Any] = torch.cuda.Stream,
    ) -> None:
        self._get_current = get_current or getattr(torch._C, "_cuda_getCurrentStream", None)
        self._new_stream = new_stream
        self._streams: dict[tuple[int, int, int], Any] = {}

    def __call__(self, device: torch.device) -> Any:
        get_current = self._get_current
        index = device.index
        if get_current is None or index is None:
            return torch.cuda.current_stream(device)
        key = get_current(index)
        stream = self._streams.get(key)
        if stream is None:
            stream_id, device_index, device_type = key
            stream = self._new_stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
            if len(self._streams) < self._MAX_STREAMS:
                self._streams[key] = stream
        return stream


class ReadyMarks:
    """Marks how far each caller's stream got at submit: the KV (and GPU page ids) are
    written there, and the copy must start after them.

    One CUDA event per caller stream per batch window: a stream runs in order, so one
    record of the event after a window's last submit on that stream covers every submit
    of the window, and a batch waits for it alone. That saves creating (and destroying)
    an event per request. A new window gets new events, so a batch never waits for a
    later window's submits (the callers' next kernels, say).

    A submit records nothing: it notes its stream, and the events are recorded once per
    loop iteration (a callback scheduled by the iteration's first submit) and when the
    batcher closes a window (:meth:`close_window`), before any of its batches is fused.
    Recording later than the submit only waits for more work, never less. Recording at
    every submit would be a CUDA call each, around which torch releases the GIL: in a
    burst of submits, each a chance for the store thread to take it and keep it."""

    def __init__(
        self,
        device: torch.device,
        call_soon: Callable[[Callable[[], None]], object],
        new_event: Callable[[], Any] = torch.cuda.Event,
        current_stream: Callable[[torch.device], Any] | None = None,
        synchronize: Callable[[torch.device], None] = torch.cuda.synchronize,
    ) -> None:
        self._device = device
        self._call_soon = call_soon  # the loop's call_soon
        self._new_event = new_event
        self._current_stream = current_stream or CurrentStreams()
        self._synchronize = synchronize
        self._events: dict[int, Any] = {}  # stream handle -> this window's event
        self._unrecorded: dict[int, tuple[Any, Any]] = {}  # handle -> (stream, event)

    def mark(self, request: Request) -> None:
        stream = self._current_stream(self._device)
        handle = stream.cuda_stream
        event = self._events.get(handle)
        if event is None:
            event = self._events[handle] = self._new_event()
        if not self._unrecorded:
            self._call_soon(self.record)
        self._unrecorded[handle] = (stream, event)
        request.ready_event = event

    def close_window(self) -> None:
        """The batcher closed a window: record its events before any of its batches is
        fused; later submits get new events."""
        self.record()
        self._events = {}

    def record(self) -> None:
        """Record each noted stream's event after what the stream has queued so far."""
        unrecorded, self._unrecorded = self._unrecorded, {}
        for stream, event in unrecorded.values():
            try:
                event.record(stream)
            except Exception:
                # The stream is gone (an external stream destroyed right after its
                # submit, say): wait for the whole device, so that no batch copies
                # before the caller's writes. If even that fails, the batch's own CUDA
                # calls fail next, and the batch with them.
                log.exception("aiokv: recording a caller's CUDA event failed")
                try:
                    self._synchronize(self._device)
                except Exception:
                    log.exception("aiokv: synchronizing %s failed", self._device)


_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _device_offsets(device: torch.device, page_size: int) -> torch.Tensor:
    """``arange(page_size)`` on ``device``, made once (a kernel launch saved per batch)."""
    offsets = _OFFSETS.get((device, page_size))
    if offsets is None:
        offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        # Later batches use it from other streams: let the one fill land first.
        torch.cuda.current_stream(device).synchronize()
        _OFFSETS[(device, page_size)] = offsets
    return offsets


def fuse_page_ids(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    stream: Any = None,
    page_size: int = 0,
) -> FusedPages:
    """Bring the leading ``pages_used[i]`` of each ``page_ids[i]`` to the host with at most one
    device-to-host copy. Device tensors are concatenated on ``stream`` (a torch.cuda.Stream
    the caller made wait for the requests' events; None: the current stream) and copied into
    pinned memory without blocking; CPU tensors are concatenated on the host. The result
    lists device-resident requests first, so ``starts`` is not in request order. Given
    ``page_size``, a batch held on the device is also expanded to slots there (one tiny
    kernel instead of a host pass over every slot), and the slots are what the one copy
    brings back. When the device tensors hold few pages past the used ones, they are
    concatenated whole (a slice op per request costs more than copying a short unused tail),
    so the host copy may hold pages no request owns between requests."""
    counts = np.array(pages_used, dtype=np.int64)
    is_cpu = [t.is_cpu for t in page_ids]
    if not any(is_cpu):  # all on the device, the usual case
        if not page_ids:
            return FusedPages(torch.empty(0, dtype=torch.int64), counts, counts.copy(), None, 0)
        pinned, copy_done, starts = _fuse_on_device(
            page_ids, pages_used, counts, stream, page_size, expand=page_size > 0
        )
        return FusedPages(pinned, starts, counts, copy_done, 1, expanded_page_size=page_size)
    on_host = [i for i, cpu in enumerate(is_cpu) if cpu]
    host_part = torch.cat([_head(page_ids[i], pages_used[i]) for i in on_host])  # a copy
    if host_part.dtype != torch.int64:
        host_part = host_part.to(torch.int64)
    if len(on_host) == len(page_ids):  # all on the host: in request order
        return FusedPages(host_part, np.cumsum(counts) - counts, counts, None, 0)
    on_device = [i for i, cpu in enumerate(is_cpu) if not cpu]
    starts = np.empty(len(page_ids), dtype=np.int64)
    host_counts = counts[on_host]
    starts[on_host] = np.cumsum(host_counts) - host_counts
    pinned, copy_done, device_starts = _fuse_on_device(
        [page_ids[i] for i in on_device], [pages_used[i] for i in on_device],
        counts[on_device], stream, page_size,
        expand=False,  # the host part holds pages: the store thread expands both
    )
    starts[on_device] = device_starts
    starts[on_host] += pinned.shape[0]
    # The device part becomes valid when copy_done fires, so the store thread joins the
    # two after waiting (see FusedPages.wait).
    return FusedPages(pinned, starts, counts, copy_done, 1, host_tail=host_part)


# Concatenate device tensors whole while their unused tails add at most this many slots
# per request to the copy: a slice op costs about as much as copying 2048 slots.
_TAIL_SLOTS_PER_REQUEST = 2048


def _fuse_on_device(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    counts: Int64Array,
    stream: Any,
    page_size: int,
    expand: bool,
) -> tuple[torch.Tensor, Any, Int64Array]:
    """One concat (and expansion to slots of ``page_size``, if ``expand``) on ``stream``
    and one device-to-host transfer into pinned memory (the expanding kernel writes it
    there, or one copy does where kernels cannot write pinned memory); returns the pinned
    tensor, the transfer's event and each request's start (in pages) in it."""
    # Unused tails are weighed in slots either way: unexpanded, the host expands them.
    parts, starts, total = _device_parts(page_ids, pages_used, counts, page_size)
    expand_to = page_size if expand else 0
    pinned = torch.empty(
        total * expand_to if expand_to else total, dtype=torch.int64, pin_memory=True
    )
    if stream is None:
        return pinned, _cat_expand_copy(parts, expand_to, pinned), starts
    # A switch to the stream and back: a stream context manager costs several times as
    # much, and the store thread pays it on every batch's critical path.
    previous = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        copy_done = _cat_expand_copy(parts, expand_to, pinned)
    finally:
        torch.cuda.set_stream(previous)
    return pinned, copy_done, starts


def _device_parts(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    counts: Int64Array,
    page_size: int,
) -> tuple[list[torch.Tensor], Int64Array, int]:
    """The (1-D) tensors to concatenate, where each request starts in the result and its
    length in pages: whole tensors while their unused tails are short, else only the
    used pages (a slice op each)."""
    lengths = [t.numel() for t in page_ids]  # cheaper than shape[0]
    ends = list(accumulate(lengths))
    used = int(counts.sum())
    if (ends[-1] - used) * max(page_size, 1) <= _TAIL_SLOTS_PER_REQUEST * len(lengths):
        ends[-1:] = []
        return list(page_ids), np.array([0, *ends], dtype=np.int64), sum(lengths)
    parts = [_head(t, n) for t, n in zip(page_ids, pages_used, strict=True)]
    return parts, np.cumsum(counts) - counts, used


def _cat_expand_copy(parts: list[torch.Tensor], page_size: int, pinned: torch.Tensor) -> Any:
    """On the current stream: concatenate, expand to slots given ``page_size``, and bring
    the result to ``pinned``; return the event that marks the end.

    Where the device can write pinned memory directly (:func:`_writes_host`), the last
    kernel writes its result there, with no copy at all. A copy would go through the
    device's copy engines, which run device-to-host copies one after another: behind a
    large offload copy, a batch's slots would land only after it, and the store thread
    could not match the batch until then. A kernel's writes do not queue behind them."""
    device = parts[0].device
    direct = pinned.numel() > 0 and _writes_host(device)
    target = as_device_tensor(pinned, device) if direct else None
    fused = parts[0] if len(parts) == 1 else torch.cat(parts)
    if page_size > 0:
        # offsets + page_size * pages, broadcast: one kernel for every slot (the add
        # promotes int32 ids to int64), writing the host where it can.
        offsets = _device_offsets(device, page_size)
        out = None if target is None else target.view(-1, page_size)
        if fused.dtype == torch.int64:  # int32 ids cannot wrap; see _largest_page
            fused = fused.clamp(-1, largest_page(page_size))
        fused = torch.add(offsets, fused.reshape(-1, 1), alpha=page_size, out=out).view(-1)
    elif target is not None:
        torch.add(fused, 0, out=target)  # one kernel: the write and the cast to int64
    elif fused.dtype != torch.int64:
        fused = fused.to(torch.int64)
    copy_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    if target is None:
        pinned.copy_(fused, non_blocking=True)
    copy_done.record()
    if target is not None:
        # Torch's pinned allocator tracks its own copies, not a kernel's writes: hold
        # the memory until the event fired, whatever becomes of the batch.
        _HOST_WRITES.hold(copy_done, pinned)
    # `fused` was allocated on this stream and is only used here, so the caching
    # allocator will not reuse it before the copy ends. The callers' page_ids stay
    # referenced by their requests until those resolve.
    return copy_done


class _DeviceArray:
    """A pinned host tensor presented to torch as a CUDA array. With unified addressing
    (every 64-bit CUDA platform), pinned memory is mapped into each device's address
    space at its host address, so a device tensor over that address is the host memory:
    what kernels write there, the host reads after the kernels' event."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # keeps the memory alive as long as the device view is
        typestr = {torch.int64: "<i8", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def as_device_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the memory of the pinned, contiguous ``host``."""
    view = torch.as_tensor(_DeviceArray(host), device=device)
    if view.data_ptr() != host.data_ptr():  # torch copied instead of aliasing
        raise RuntimeError("the device view of pinned memory is not the same memory")
    return view


_WRITES_HOST: dict[torch.device, bool] = {}


def _writes_host(device: torch.device) -> bool:
    """Whether kernels on ``device`` can write pinned memory through
    :func:`as_device_tensor`, tried once per device: a kernel writes a pattern there and
    the host reads it back. Where not (or on any error), copies are used instead.

    Torch's default pinned allocator uses ``cudaHostAlloc``, whose memory every device
    with unified addressing reaches at its host address (CUDA programming guide,
    "Unified Virtual Address Space")."""
    known = _WRITES_HOST.get(device)
    if known is not None:
        return known
    if "pinned_use_cuda_host_register" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # Pinned memory is then malloc'd and registered, which maps it into the device's
        # address space only when asked to: a kernel's write could fault the context.
        _WRITES_HOST[device] = False
        return False
    try:
        host = torch.zeros(1024, dtype=torch.int64, pin_memory=True)
        pattern = torch.arange(7, 7 + 1024, dtype=torch.int64, device=device)
        torch.add(pattern, 0, out=as_device_tensor(host, device))
        torch.cuda.current_stream(device).synchronize()
        works = bool(torch.equal(host, pattern.cpu()))
    except Exception:
        works = False
    if not works:
        log.warning("aiokv: kernels cannot write pinned memory on %s; fused slots are "
                    "copied instead, behind any copy already queued", device)
    _WRITES_HOST[device] = works
    return works


class _HeldUntilDone:
    """Pinned buffers that kernels write, each held until its event fired. Pruned on
    every :meth:`hold` (one event query per held buffer that is done, oldest first)."""

    def __init__(self) -> None:
        self._held: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._lock = threading.Lock()  # the store thread and a warm-up thread may both hold

    def hold(self, event: Any, memory: torch.Tensor) -> None:
        with self._lock:
            held = self._held
            while held and held[0][0].query():
                held.popleft()
            held.append((event, memory))


_HOST_WRITES = _HeldUntilDone()


def warm_up(device: torch.device, page_size: int, stream: Any = None) -> None:
    """Run the fused path once for the shapes batches take (one request, a few, many;
    int32 and int64 ids), so that CUDA's lazy module loading happens here, at start-up,
    and not in the first batches, which it would delay. Blocks: call it before serving."""
    for dtype in (torch.int64, torch.int32):
        for requests in (1, 3, 64):
            ids = [torch.zeros(4, dtype=dtype, device=device) for _ in range(requests)]
            if stream is not None:  # as the store thread does: the copy follows the writes
                stream.wait_stream(torch.cuda.current_stream(device))
            for used in (4, 2):  # whole tensors, and the used heads only
                fused = fuse_page_ids(ids, [used] * requests, stream, page_size)
                fused.wait_slots(page_size)


def _head(pages: torch.Tensor, used: int) -> torch.Tensor:
    """The first ``used`` page ids; no slice op (a costly torch call) when all are used."""
    return pages if used == pages.numel() else pages[:used]  # 1-D: numel() is shape[0]
