"""Per-layer completion of one launched load (:class:`LayerMarks`), the link between the
copier that moves a load layer by layer and ``engine.load_layerwise``'s waiters.

The copier is the producer: on a GPU it records one CUDA event per layer and stream as soon
as it has queued that layer's copies (:meth:`LayerMarks.layer_queued`, in layer order, so
a waiter for layer 0 need not wait for the later layers to be queued), on the CPU it
reports each layer once copied (:meth:`LayerMarks.layer_done`); either way it ends with
:meth:`LayerMarks.finish` or :meth:`LayerMarks.fail`. Waiters never hang: a failure, or a
copier that ends without queuing a layer, wakes every waiter with the error. A thread that
waits for someone who stopped waiting (a cancelled ``layer_ready``) is let go at once
(:meth:`LayerMarks.abandon`): such threads come from a pool that every engine shares.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class LayerFailed(Exception):
    """The load failed before this layer was in place; the message says why. ``field``:
    the request argument at fault (``page_ids``), None for a failure in the store."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# What _settled answers a waiter abandoned first (compared by identity).
_ABANDONED: tuple[Any, ...] = ("abandoned",)


class Waiter:
    """One thread's wait in :meth:`LayerMarks.synchronize`, which another thread may
    abandon (:meth:`LayerMarks.abandon`). ``abandoned`` is read and written under the
    marks' lock."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class LayerMarks:
    """``num_layers`` marks of one load. Producer methods from the copier's threads,
    waiter methods from any thread."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # GPU: per layer queued so far, the events (one per copy stream) after its copies.
        self._events: list[tuple[Any, ...]] = []
        self._done = 0  # layers in place (CPU), or all once finished
        self._error: str | None = None
        self._field: str | None = None
        self._ended = False

    # ---- producer ------------------------------------------------------------------

    def layer_queued(self, layer: int, events: Sequence[Any]) -> None:
        """Layer ``layer``'s copies are queued (after every earlier layer's): ``events``
        fire once it is in place."""
        with self._changed:
            if layer != len(self._events):
                raise ValueError(f"layer {layer} queued after {len(self._events)} layers")
            self._events.append(tuple(events))
            self._changed.notify_all()

    def layer_done(self, layer: int) -> None:
        """Layer ``layer`` (and every one before it) is in place (CPU copies)."""
        with self._changed:
            self._done = max(self._done, layer + 1)
            self._changed.notify_all()

    def finish(self) -> None:
        """The load ended well: every layer is in place."""
        with self._changed:
            self._done = self.num_layers
            self._ended = True
            self._changed.notify_all()

    def fail(self, error: str, field: str | None = None) -> None:
        """The load failed; layers not yet in place never will be. Their waiters raise
        :class:`LayerFailed` (with ``field``: the request argument at fault, so that a wait
        that comes before the load's end raises the same typed error as the end).
        Idempotent; after :meth:`finish`, a no-op."""
        with self._changed:
            if not self._ended:
                self._error = error
                self._field = field
                self._ended = True
            self._changed.notify_all()

    # ---- waiters -------------------------------------------------------------------

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is outside [0, {self.num_layers})")

    def _settled(self, layer: int, waiter: Waiter | None = None) -> tuple[Any, ...] | None:
        """Block until layer ``layer`` is in place (None) or has events to wait on; raise
        LayerFailed if the load failed first. ``waiter`` abandoned first: _ABANDONED."""
        with self._changed:
            while True:
                if self._done > layer:
                    return None
                if layer < len(self._events) and self._error is None:
                    return self._events[layer]
                if self._error is not None:
                    raise LayerFailed(self._error, self._field)
                if self._ended:
                    return None
                if waiter is not None and waiter.abandoned:
                    return _ABANDONED
                self._changed.wait()

    def wait(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (a torch.cuda.Stream; None: the current one) wait for layer
        ``layer`` on the device without blocking this thread beyond the moment its
        copies are queued; on CPU copies, block until the layer is copied."""
        self._check(layer)
        events = self._settled(layer)
        if events is None:
            return
        if stream is None:
            import torch

            stream = torch.cuda.current_stream()
        for event in events:
            stream.wait_event(event)

    def synchronize(self, layer: int, waiter: Waiter | None = None) -> bool:
        """Block this thread until layer ``layer`` is in place (True), or until ``waiter``
        is abandoned while its copies are not yet queued (False); LayerFailed if the load
        failed first. Once queued, the copies are waited for (their events), abandoned
        or not: that wait is bounded by the copy."""
        self._check(layer)
        events = self._settled(layer, waiter)
        if events is _ABANDONED:
            return False
        for event in events or ():
            event.synchronize()
        with self._changed:
            if self._error is not None and self._done <= layer and events is None:
                raise LayerFailed(self._error, self._field)
        return True

    def abandon(self, waiter: Waiter) -> None:
        """Let ``waiter``'s thread go: its :meth:`synchronize` returns False at once
        where the layer's copies are not yet queued (any thread; never blocks)."""
        with self._changed:
            waiter.abandoned = True
            self._changed.notify_all()

    def is_ready(self, layer: int) -> bool:
        """Whether layer ``layer`` is in place now (never blocks; False after a failure
        that came first)."""
        self._check(layer)
        with self._lock:
            if self._done > layer:
                return True
            queued = layer < len(self._events) and self._error is None
            events = self._events[layer] if queued else None
        return events is not None and all(event.query() for event in events)

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error
