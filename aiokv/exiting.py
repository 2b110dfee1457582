"""The interpreter's exit with an engine still running: its copy and store threads stop
after their current step, before the interpreter finalizes.

Those threads are daemons (an engine never closed does not hold the interpreter at exit),
and they run native code without the GIL: torch's index copies, CUDA calls. At
finalization CPython ends a daemon thread where it takes the GIL back, by unwinding its
stack; an unwind through torch's C++ frames (which may not be unwound) calls
``std::terminate``, and the process aborts ("terminate called without an active
exception"). So an ``atexit`` hook, which runs after the non-daemon threads were joined
(a user's thread still offloading then works on as usual) and before finalization, has
every live copier and store thread of this process take no new work and joins it, with a
bound. The engine is not drained (that is its close): jobs and batches not yet begun stay
undone, and their callers' futures unresolved. ``threading._register_atexit`` would run
too early: before the non-daemon threads are joined, which may still be using the engine.
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Protocol

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


def stop_at_exit(owner: StopsAtExit) -> None:
    """Have ``owner``'s threads stopped at the interpreter's exit, if still running."""
    _live.add(owner)


def _at_exit() -> None:
    owners = list(_live)
    for owner in owners:  # all told first: they stop together, not one after another
        owner.stop_at_exit()
    deadline = time.monotonic() + EXIT_JOIN_S
    for owner in owners:
        owner.join_at_exit(max(0.0, deadline - time.monotonic()))


# Registered at import (aiokv's, after torch's): atexit runs the latest first, so a user's
# own exit hook registered after importing aiokv (a close of its engine, say) runs before
# this one, and torch's after it.
atexit.register(_at_exit)
