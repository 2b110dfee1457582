"""A recsys manager call's calls in flight (:class:`PendingCalls`): those handed to the
engine's loop, and the loads the manager's thread queued itself (:mod:`aiokv.direct`),
answered in call order, each once, and never recanted once given out."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .. import direct
from ..portal import outcome

Outcome = Any  # a call's result, or the exception it raised


class PendingCalls:
    """A manager call's calls in flight on the engine's loop. Their outcomes come in call
    order, each a result or the exception that call raised (one user's failure is its
    own); a cancelled call reads as a CancelledError. ``refuse`` raises
    BlockingCallOnLoop on the loop's own thread (``BackgroundEngine._refuse_on_loop``)."""

    def __init__(
        self, futures: list[concurrent.futures.Future[Outcome]], refuse: Callable[[], None]
    ) -> None:
        self._futures = futures
        self._refuse = refuse
        # The answer is decided once, under the lock: cancelled, or the calls' outcomes
        # (given out). A cancel from another thread than the waiter's (a request abort)
        # that saw a call running must not land after the waiter was given the outcomes.
        self._lock = threading.Lock()
        self._cancelled = False
        self._answered = False
        self._taken: list[tuple[concurrent.futures.Future[Outcome], direct.Taken]] = []

    def with_taken(self, taken: Mapping[int, direct.Taken | BaseException]) -> PendingCalls:
        """These calls, with loads this thread queued itself (:mod:`aiokv.direct`; or the
        error its start raised) at positions ``taken`` among them: each waited for (its
        copies take milliseconds) in the thread that asks for the outcomes."""
        if not taken:
            return self
        futures = iter(self._futures)
        merged: list[concurrent.futures.Future[Outcome]] = []
        for at in range(len(self._futures) + len(taken)):
            entry = taken.get(at)
            if entry is None:
                merged.append(next(futures))
                continue
            future: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
            if isinstance(entry, BaseException):
                future.set_exception(entry)
            else:
                self._taken.append((future, entry))
            merged.append(future)
        self._futures = merged
        return self

    def _wait_taken(self) -> None:
        """The loads this thread queued: waited for, their futures set (once: a second
        waiter finds them done, Taken.wait answers the same)."""
        for future, taken in self._taken:
            if future.done():
                continue
            try:
                result: Outcome = taken.wait()
            except Exception as exc:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(exc)
            else:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_result(result)

    def poll(self, wait_s: float) -> list[Outcome] | None:
        """The outcomes if every call is done within ``wait_s`` seconds, else None. The
        wait blocks on the futures with the GIL released: a caller that polls in a loop
        must leave the GIL to the engine's threads, which finish the calls. Raises
        BlockingCallOnLoop on the engine's loop thread (a poll there could never see
        them done)."""
        self._refuse()
        self._wait_taken()
        _, waiting = concurrent.futures.wait(self._futures, timeout=wait_s)
        return None if waiting else self.outcomes()

    def outcomes(self) -> list[Outcome]:
        """The outcomes, waiting for them. Raises BlockingCallOnLoop on the engine's loop
        thread, which would wait for itself forever (also when they are in: the refusal
        does not depend on timing)."""
        self._refuse()
        self._wait_taken()
        if not all(future.done() for future in self._futures):
            concurrent.futures.wait(self._futures)
        with self._lock:
            cancelled = self._cancelled
            self._answered = not cancelled
        if cancelled:
            return [concurrent.futures.CancelledError() for _ in self._futures]
        return [outcome(future) for future in self._futures]

    def cancel(self) -> bool:
        """Answer every call cancelled, once each has ended. aiokv never aborts a copy it
        launched, and a cancelled call stops only its caller's wait: answered at once,
        the manager would reuse pages that copies still read or write. So the calls run
        to their end, and their outcomes then read as cancelled (an offload's KV may be
        stored all the same). False once they are all done (nothing is cancelled), and
        once their outcomes were given out (from any thread): an answer is never recanted."""
        # Loads this thread queued end in milliseconds, and only a wait gives their
        # reservations back: waited for here, as nothing may wait for them later.
        self._wait_taken()
        if all(future.done() for future in self._futures):
            return False
        with self._lock:  # a wait on another thread may have answered since the check
            if self._answered:
                return False
            self._cancelled = True
        return True
