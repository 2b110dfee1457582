"""The interpreter's exit with an engine still running: its copy and store threads stop
after their current step, before the interpreter finalizes.

Those threads are daemons (an engine never closed does not hold the interpreter at exit),
and they run native code without the GIL: torch's index copies, CUDA calls. At
finalization CPython ends a daemon thread where it takes the GIL back, by unwinding its
stack; an unwind through torch's C++ frames (which may not be unwound) calls
``std::terminate``, and the process aborts ("terminate called without an active
exception"). So an ``atexit`` hook, which runs after the non-daemon threads were joined
(a user's thread still offloading then works on as usual) and before finalization, has
every live copier and store thread of this process (and the remote tier's writer and
reader, which wait in Mooncake's C++ calls, and the shared region's page-table walk, in
madvise) take no new work and joins it, with a bound; and it waits, with the same bound,
for a user's thread running a load's copies itself (:mod:`aiokv.direct`).
The engine is not drained (that is its close): jobs and batches not yet begun stay undone,
and their callers' futures unresolved. ``threading._register_atexit`` would run too early:
before the non-daemon threads are joined, which may still be using the engine.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from .errors import EngineClosed

T = TypeVar("T")

# How long the exit waits for the threads together. Each finishes the step it is in: a
# copy job (its copies, on a GPU those queued ahead of it), a store call; well under a
# second even for a job of GiBs. The bound is for a thread that waits on something that
# may never come (a device or a disk that hangs): the exit goes on without it then.
EXIT_JOIN_S = 5.0


class StopsAtExit(Protocol):
    def stop_at_exit(self) -> None:
        """Take no new work and wake the threads (returns at once)."""

    def join_at_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the threads to end; whether they did."""


# Weak: an engine dropped (or closed) is no business of the exit.
_live: weakref.WeakSet[StopsAtExit] = weakref.WeakSet()

# The exit hook began: every HandOverGate refuses from then on, not only once its own
# handle was told (the owners are told one after another, in no set order: a copier told
# before the handle refuses a thread's own load with EngineClosed, which the thread, a
# daemon, must not hear).
_began = False


def stop_at_exit(owner: StopsAtExit) -> None:
    """Have ``owner``'s threads stopped at the interpreter's exit, if still running."""
    _live.add(owner)


def _forget_in_child() -> None:
    # A forked child has none of these threads, only copies of their owners, whose locks
    # a thread gone with the fork may hold: stopping them at the child's exit could wait
    # for ever. The child's own engines (it must open its own) register anew.
    _live.clear()
    global _began
    _began = False  # the child's own exit, if this fork came from an exiting thread


os.register_at_fork(after_in_child=_forget_in_child)


def _at_exit() -> None:
    global _began
    _began = True  # before any owner is told: see _began
    owners = list(_live)
    for owner in owners:  # all told first: they stop together, not one after another
        owner.stop_at_exit()
    deadline = time.monotonic() + EXIT_JOIN_S
    for owner in owners:
        owner.join_at_exit(max(0.0, deadline - time.monotonic()))


class HandOverGate:
    """A background handle's hand-overs once the interpreter exits (:func:`stop_at_exit`
    on the handle): none is made any more, and the exit waits for those under way.

    A call from a thread other than the main one then does no work and gets a future that
    never resolves: such a thread is a daemon the exit abandons, and one that got an error
    instead might go on calling, into torch, while the interpreter finalizes (which aborts
    the process). Its calls are kept, so that the page ids they hold are not freed in its
    thread either. The main thread (a later exit hook) gets EngineClosed. ``lock`` is the
    handle's, which orders its submits against its close and now against the exit."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._exiting = False
        self.parked = threading.Event()  # the loop thread runs nothing more
        self._handing = 0  # calls taking their ready event and page ids (torch work)
        self._hands_free = threading.Condition(lock)
        self._never_run: list[object] = []

    @property
    def exiting(self) -> bool:
        """Whether the interpreter's exit began (this gate closed, or the exit hook began
        telling the owners: see ``_began``)."""
        return self._exiting or _began

    def close(self) -> None:
        with self._lock:
            self._exiting = True

    def refused(self, calls: Sequence[object]) -> list[concurrent.futures.Future[Any]] | None:
        """Under the handle's lock: None while the interpreter runs on; else the futures
        ``calls`` get instead of running (EngineClosed on the main thread)."""
        if not self.exiting:
            return None
        if threading.current_thread() is threading.main_thread():
            raise EngineClosed("the interpreter is exiting: the engine has stopped")
        self._never_run.extend(calls)
        return [concurrent.futures.Future() for _ in calls]

    def handed(self, take: Callable[[], tuple[Any, Any]], page_ids: Any) -> tuple[Any, Any]:
        """``take()`` (a call's ready event and page ids, in the calling thread), counted
        for the exit to wait for; (None, ``page_ids``) untouched once it exits: the call
        will not run."""
        with self._lock:
            if self.exiting:
                return None, page_ids
            self._handing += 1
        try:
            return take()
        finally:
            with self._lock:
                self._handing -= 1
                if self.exiting and not self._handing:
                    self._hands_free.notify_all()

    def counted(self, work: Callable[[], T]) -> tuple[bool, T | None]:
        """``work()`` in the calling thread, counted for the exit to wait for as
        :meth:`handed` counts its ``take``: a load this thread queues and copies itself
        (:mod:`aiokv.direct`) runs torch's copies there. (False, None), not run, once the
        interpreter exits."""
        with self._lock:
            if self.exiting:
                return False, None
            self._handing += 1
        try:
            return True, work()
        finally:
            with self._lock:
                self._handing -= 1
                if self.exiting and not self._handing:
                    self._hands_free.notify_all()

    def park(self) -> None:
        """On the loop's thread: run nothing more, in a wait the exit leaves it in."""
        self.parked.set()
        threading.Event().wait()  # never set: the process ends with this thread here

    def wait_hands_free(self, timeout: float) -> None:
        with self._lock:  # releases the GIL: their torch calls can return
            self._hands_free.wait_for(lambda: not self._handing, timeout)


# Registered at import (aiokv's, after torch's): atexit runs the latest first, so a user's
# own exit hook registered after importing aiokv (a close of its engine, say) runs before
# this one, and torch's after it.
atexit.register(_at_exit)
