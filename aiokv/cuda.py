"""The callers' ready events: what aiokv asks of CUDA on the loop.

:class:`ReadyMarks` notes each caller's stream at submit and records one event per stream
per window (:class:`CurrentStreams` hands out the stream objects); each request carries
its event to the store's ``launch``, which orders its copies after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .requests import Request

log = logging.getLogger("aiokv")


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


def caller_event(device: torch.device) -> Any:
    """A CUDA event recorded now on the calling thread's current stream on ``device``. For
    a call another thread submits (``run_in_background``, the recsys adapter): CUDA's
    current stream is per thread, so on the loop's thread :class:`ReadyMarks` would note
    the loop thread's stream, not the one the caller wrote its pages on (a side stream, a
    CUDA graph's), and the copy could read them before they are written."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event
