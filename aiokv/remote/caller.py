"""The remote tier's reader thread: one daemon thread that runs the calls submitted to it
in order, each answered through a :class:`~concurrent.futures.Future`, and between them
(or after ``tend``'s wait with none) ``tend``, for the work nobody waits on: markers that
could not be published yet.

A daemon, and closed with a bound, because a Mooncake call on a master that stopped
answering waits about 30 s: such a call must hold up neither the engine's close nor the
interpreter's exit (a ``ThreadPoolExecutor``'s threads are joined at exit).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("aiokv")

_running = threading.local()


def current_call() -> Future[Any] | None:
    """The future of the call this thread is running, or of ``tend``'s pass (None outside
    a :class:`CallThread`): what a failure inside the call is counted against."""
    future: Future[Any] | None = getattr(_running, "future", None)
    return future

_Call = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any]"]


class CallThread:
    """``tend()`` returns how long to wait for a call before it runs again (None: until a
    call comes)."""

    def __init__(self, name: str, tend: Callable[[], float | None]) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._tend = tend
        self._closed = False
        # Held by submit from its check of _closed until its call is queued, and by stop:
        # a call is queued before stop empties the queue (and is cancelled there), or
        # refused after; never queued behind stop's end marker, neither run nor cancelled.
        self._queueing = threading.Lock()
        # The call under way (a tend pass has a future of its own): the one that a call
        # queued behind it waits for.
        self._under_way: Future[Any] | None = None
        self._starting = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``function(*args)`` after the calls before it. Once closed, the future comes
        back cancelled (and notified), as stop leaves the calls it found queued: the
        caller's usual answer for a call never made (a lookup's miss), not an exception
        inside a store call (the interpreter's exit stops the tier under the store
        thread's lookups and evicts)."""
        future: Future[Any] = Future()
        with self._queueing:
            if not self._closed:
                self._calls.put((function, args, future))
                return future
        future.cancel()
        future.set_running_or_notify_cancel()
        return future

    @property
    def closing(self) -> bool:
        """Whether :meth:`stop` was called: ``tend``'s pass under way stops between its
        steps (the thread ends after it, and close may give up on it before)."""
        return self._closed

    def waits_for(self, future: Future[Any]) -> Future[Any]:
        """The call that ``future`` waits for now: itself once it started, else the call
        under way (whose time a caller that gives up on ``future`` spent)."""
        with self._starting:
            if future.running() or future.done() or self._under_way is None:
                return future
            return self._under_way

    def _run(self) -> None:
        wait: float | None = None
        while True:
            try:
                call = self._calls.get(timeout=wait)
            except queue.Empty:
                call = None  # time to tend
            else:
                if call is None:  # closed
                    return
                function, args, future = call
                if self._start(future):
                    try:
                        result = function(*args)
                    except BaseException as exc:  # the caller's to see, as an executor's
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
                    finally:
                        self._ended()
            if self._closed:
                continue
            tending: Future[Any] = Future()  # its calls count as one, as a submitted call's
            self._start(tending)
            try:
                wait = self._tend()
            except Exception as exc:  # a bug or the client's: keep the thread
                log.exception("aiokv: remote tier: %s", exc)
                wait = None
            finally:
                self._ended()

    def _start(self, future: Future[Any]) -> bool:
        """Whether ``future``'s call runs (not cancelled): then it is the call under way."""
        with self._starting:
            if not future.set_running_or_notify_cancel():
                return False
            self._under_way = _running.future = future
            return True

    def _ended(self) -> None:
        with self._starting:
            self._under_way = _running.future = None

    def close(self, timeout_s: float) -> bool:
        """Cancel the calls not yet started and stop after the one under way, waiting
        ``timeout_s`` at most; whether the thread ended (else it is left to end by
        itself: a daemon, holding whatever the call under way holds)."""
        self.stop()
        return self.join(timeout_s)

    def stop(self) -> None:
        """:meth:`close` without the wait: the calls not yet started are cancelled, the
        thread ends after the one under way."""
        with self._queueing:
            self._closed = True
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    # Marked notified too: ``cancel()`` wakes ``result()``, not the store
                    # thread's ``concurrent.futures.wait``, which would sit out the call's
                    # whole timeout_ms. Out of the queue, no other thread can start it now.
                    future = call[2]
                    if future.cancel():
                        future.set_running_or_notify_cancel()
            self._calls.put(None)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
