"""What a thread holds of what the engine's loop owns: :class:`BackgroundLookup` (a
:class:`~aiokv.Lookup`) and :class:`BackgroundLayerwiseLoad` (a
:class:`~aiokv.LayerwiseLoad`), handed out by ``run_in_background``'s handle
(:mod:`aiokv.sync`). Each forwards what must run on the loop through it, and answers on
the calling thread what can be answered there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Hashable
from types import TracebackType
from typing import Any

from . import validate
from .errors import BlockingCallOnLoop
from .layerwise import LayerwiseLoad
from .portal import Portal, forked, refuse_in_fork
from .requests import LoadResult, Lookup


class BackgroundLookup:
    """A :class:`~aiokv.Lookup` handed to a thread. ``release()`` may be called from any
    thread: the release runs on the engine's loop, which owns the reservation, and in
    order with the calls submitted before it (through the handle's ``portal``). Usable
    as ``with``."""

    def __init__(self, lookup: Lookup, portal: Portal) -> None:
        self.lookup = lookup
        self._portal = portal

    @property
    def user_id(self) -> Hashable:
        return self.lookup.user_id

    @property
    def cached_tokens(self) -> int:
        return self.lookup.cached_tokens

    @property
    def held(self) -> bool:
        """True while the reservation is held (not yet loaded, released, expired, or given
        back by an evict or clear of the key)."""
        return self.lookup.held

    def __repr__(self) -> str:
        return f"Background{self.lookup!r}"

    def release(self) -> None:
        """Give the reservation back; does not wait. Idempotent; a no-op once loaded
        (a load submitted before the release, from any thread, consumes the hit first),
        once the engine's loop has stopped (closing the engine released it), and in a
        forked child (the reservation is the parent's)."""
        if not self.lookup.held:
            # Loaded, released, expired or given back: the loop's release would do
            # nothing, and handed over it would hold back this engine's thread-queued
            # loads until it began (aiokv.direct: they never overtake a call in hand).
            return
        # The loop is closed, and so is the engine; or this is a forked child.
        with contextlib.suppress(RuntimeError):
            self._portal.start([self._release])

    async def _release(self) -> None:
        # A task's first step, as the engine's calls are (aiokv.portal): not a plain
        # callback, which would overtake the loads whose tasks were made before it.
        self.lookup.release()

    def __enter__(self) -> BackgroundLookup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class BackgroundLayerwiseLoad:
    """A :class:`LayerwiseLoad` handed to a thread by ``run_in_background``'s handle:
    ``wait_layer`` runs in the calling thread (its current CUDA stream waits), the
    rest on the engine's loop. The blocking ones raise BlockingCallOnLoop on that loop's
    own thread; threads see a cancelled load as ``concurrent.futures.CancelledError``.
    In a forked child, a wait for a load that had not ended raises EngineClosed: nothing
    there ends it."""

    def __init__(self, load: LayerwiseLoad, loop: asyncio.AbstractEventLoop) -> None:
        self.load = load
        self._loop = loop
        self._pid = os.getpid()  # the process whose loop and store end the load

    @property
    def user_id(self) -> Hashable:
        return self.load.user_id

    @property
    def cached_tokens(self) -> int:
        return self.load.cached_tokens

    @property
    def num_layers(self) -> int:
        return self.load.num_layers

    def __repr__(self) -> str:
        return f"Background{self.load!r}"

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """:meth:`LayerwiseLoad.wait_layer`, in this thread."""
        if not self.load._take_end():
            refuse_in_fork(self._pid, "layerwise load")
        self.load.wait_layer(layer, stream)

    def is_ready(self, layer: int) -> bool:
        """:meth:`LayerwiseLoad.is_ready` (never blocks)."""
        return self.load.is_ready(layer)

    def layer_ready(self, layer: int, timeout: float | None = None) -> None:
        """Block until layer ``layer`` is in the pages (:meth:`LayerwiseLoad.layer_ready`)
        or ``timeout`` seconds pass (TimeoutError). The load's end answers too, also
        where a close ended it before this wait reached the loop, and closed the loop."""
        timeout = validate.wait_timeout(timeout)
        load = self.load
        load._check(layer)
        if load._take_end():  # also once the handle closed and its loop is gone
            load._raise_if_failed(threads=True)
            return
        refuse_in_fork(self._pid, "layerwise load")
        self._refuse_on_loop("layer_ready")
        waits: list[concurrent.futures.Future[None]] = [load._ended_signal]
        ready = load.layer_ready(layer)
        try:
            waits.append(asyncio.run_coroutine_threadsafe(ready, self._loop))
        except RuntimeError:  # the loop is closed: so is the engine, whose close ended it
            ready.close()
        done, _ = concurrent.futures.wait(
            waits, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        waited = waits[-1] if len(waits) > 1 else None
        if waited is not None and waited in done:
            waited.result()
            return
        if waited is not None:
            waited.cancel()  # given up, or answered by the end: its wait thread goes
        if not done:
            raise TimeoutError(f"layer {layer} was not ready within {timeout} s")
        load._take_end()
        load._raise_if_failed(threads=True)  # else it ended loaded: every layer is in

    def result(self, timeout: float | None = None) -> LoadResult:
        """Block for the load's LoadResult or error (TimeoutError after ``timeout``).
        Waits in this thread for the load's end (which its engine's close brings too),
        not on the loop: a close may end the loop before a wait handed to it ran."""
        timeout = validate.wait_timeout(timeout)
        load = self.load
        if not load._take_end():
            refuse_in_fork(self._pid, "layerwise load")
            self._refuse_on_loop("result")
            try:
                load._ended_signal.result(timeout)
            except concurrent.futures.TimeoutError:  # builtin TimeoutError from 3.11
                raise TimeoutError(f"the load did not end within {timeout} s") from None
            load._take_end()
        end = load._end
        if end.cancelled():
            raise concurrent.futures.CancelledError()
        if not end.done():  # ended before its task: cancelled, or by a close (EngineClosed)
            load._raise_if_failed(threads=True)
        return end.result()

    def cancel(self) -> None:
        """:meth:`LayerwiseLoad.cancel`, on the engine's loop; does not wait (a no-op in
        a forked child: the load is the parent's)."""
        if forked(self._pid):
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the load ended
            self._loop.call_soon_threadsafe(self.load.cancel)

    def _refuse_on_loop(self, name: str) -> None:
        if threading.get_ident() == self.load._loop_thread:
            raise BlockingCallOnLoop(
                f"{name}() blocks until the engine's loop answers, and was called on that "
                f"loop's own thread; await the LayerwiseLoad's {name}() there instead"
            )


__all__ = ["BackgroundLayerwiseLoad", "BackgroundLookup"]
