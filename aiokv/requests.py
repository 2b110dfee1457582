"""Request and result types.

Public: :class:`OffloadResult`, :class:`Lookup`, :class:`LoadResult`. Internal:
:class:`Request`, one per awaited call, which carries a call from submit to the
store's terminal answer; the loop thread and the store thread hand it back and forth but
never write the same field (see the comments on each).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from .errors import InvalidRequest
from .stores.base import BoolArray, Int64Array

log = logging.getLogger("aiokv")


@dataclass(frozen=True, slots=True)
class OffloadResult:
    """``stored_tokens``: tokens newly written by this call; ``cached_tokens``: the
    page-aligned prefix of this key that is now in the store."""

    user_id: Hashable
    stored_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class LoadResult:
    """``loaded_tokens``: tokens copied into the caller's pages (the Lookup's prefix)."""

    user_id: Hashable
    loaded_tokens: int


class Kind(enum.IntEnum):
    """Request kinds, in dispatch order: GET batches go before PUT batches."""

    LOOKUP = 0
    LOAD = 1
    OFFLOAD = 2


@dataclass(eq=False, slots=True)
class Request:
    """One awaited call. Written by the loop until dispatch, by the store thread after,
    except ``detached``, which only the loop sets (the caller stopped waiting)."""

    kind: Kind
    user_id: Hashable
    future: asyncio.Future[Any]
    num_tokens: int
    token_ids: Int64Array | None
    namespace: tuple[str, ...]
    page_ids: torch.Tensor | None
    pages_used: int  # leading entries of page_ids this request moves (known from shapes)
    ready_event: Any = None  # torch.cuda.Event on the caller's stream (ReadyMarks), or None
    lookup: Lookup | None = None  # the reservation a LOAD consumes
    detached: bool = False
    task_id: int | None = None
    mask: BoolArray | None = None
    moved: int = 0  # True positions of the mask: tokens this request moves
    submitted_at: float = 0.0


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

    torch builds a new Stream object per call: about 3 µs on an H200 host, half of a
    submit's cost on the loop. The stream's identity is a (stream id, device index,
    device type) triple that torch reads in about 0.1 µs; a Stream is nothing but that
    triple, so the object built for a triple is kept and handed out again. Where torch
    lacks the private getter (``torch._C._cuda_getCurrentStream``), it falls back to
    ``torch.cuda.current_stream``."""

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
    batcher closes a window (:meth:`close_window`), which comes before any of that
    window's batches is fused. Recording later than the submit only waits for more work,
    never less: on a stream shared by several callers, it may include kernels the others
    queued later in the same iteration (re-recording at every submit of a window did the
    same, up to the window's last submit). Recording at every submit cost a CUDA call, and
    torch releases the GIL around it: in a burst of submits, each one was a chance for
    the store thread to take the GIL and keep it for milliseconds (inside FlexKV's C
    code, Python cannot take it back), stalling the loop in the middle of the burst."""

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


@dataclass(frozen=True, slots=True)
class LookupGrant:
    """What the store thread answers for a lookup; the loop turns it into a Lookup."""

    task_id: int | None
    mask: BoolArray | None
    cached_tokens: int


class Lookup:
    """A lookup's answer: ``cached_tokens`` of the key are in the store and reserved
    for a ``load``. Release it (``release()`` or ``async with``) if you will not load;
    an unused reservation is released after ``lookup_ttl_ms`` anyway. A Lookup is
    consumed by one ``load``; using it twice raises InvalidRequest."""

    def __init__(
        self,
        user_id: Hashable,
        grant: LookupGrant,
        release_task: Callable[[int], None],
    ) -> None:
        self.user_id = user_id
        self.cached_tokens = grant.cached_tokens
        self._task_id = grant.task_id
        self._mask = grant.mask
        self._release_task = release_task
        self._state = "held" if grant.task_id is not None else "empty"
        self._ttl_handle: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return (
            f"Lookup(user_id={self.user_id!r}, cached_tokens={self.cached_tokens}, "
            f"state={self._state})"
        )

    @property
    def held(self) -> bool:
        """True while the reservation is held (not yet loaded, released or expired)."""
        return self._state == "held"

    def release(self) -> None:
        """Give the reservation back. Idempotent; a no-op once loaded."""
        if self._state == "held":
            self._state = "released"
            self._cancel_ttl()
            if self._task_id is not None:
                self._release_task(self._task_id)

    def _pages_needed(self, page_size: int) -> int:
        """Pages a load must be given: up to the page of the last position to load."""
        if self._mask is None:
            return 0
        positions = np.flatnonzero(self._mask)
        return 0 if len(positions) == 0 else int(positions[-1]) // page_size + 1

    def _consume(self) -> tuple[int, BoolArray]:
        """Hand the reservation to a load (loop thread only)."""
        if self._state != "held" or self._task_id is None or self._mask is None:
            raise InvalidRequest(
                "lookup", f"reservation is {self._state}; a Lookup can be loaded once, "
                "before it is released or expires"
            )
        self._state = "loading"
        self._cancel_ttl()
        return self._task_id, self._mask

    def _set_ttl(self, handle: asyncio.TimerHandle) -> None:
        self._ttl_handle = handle

    def _cancel_ttl(self) -> None:
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
            self._ttl_handle = None

    def _expire(self) -> None:
        if self._state == "held":
            self.release()
            self._state = "expired"

    async def __aenter__(self) -> Lookup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


_positions: Int64Array = np.arange(0, dtype=np.int64)
_views: dict[int, Int64Array] = {}  # num_tokens -> its view, for the first lengths asked
_MAX_VIEWS = 4096


def default_token_ids(num_tokens: int) -> Int64Array:
    """Positions 0..num_tokens-1: the recommender case, an append-only history. A
    read-only view of one shared array (grown as needed), not a new array per call;
    the views themselves are kept for the first lengths asked (a lookup costs less than
    slicing)."""
    global _positions
    view = _views.get(num_tokens)
    if view is not None:
        return view
    if num_tokens > len(_positions):
        grown = np.arange(max(num_tokens, 2 * len(_positions), 4096), dtype=np.int64)
        grown.flags.writeable = False
        _positions = grown
    view = _positions[:num_tokens]
    if len(_views) < _MAX_VIEWS:
        _views[num_tokens] = view
    return view
