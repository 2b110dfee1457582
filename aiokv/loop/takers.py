"""Whether a call's outcome reached its caller, where the task that awaited the engine
is not the caller: a thread's call (``run_in_background``: the portal's task hands the
outcome to a future the thread may cancel until then) and a layerwise load (its own task
ends the load, whose caller has it once ``load_layerwise`` returned).

Counts follow what callers saw: an outcome is counted as its caller takes it (the
engine's ``_run``, :mod:`aiokv.invalidation`, :mod:`aiokv.loop.admission`), not as its
future is resolved: a caller cancelled in between sees CancelledError, and counted then
its call read completed, its tokens moved. Counting where the outcome is decided, once,
leaves no count to take back (Prometheus counters only grow). In a task that hands its
outcome on, that point is later: its :class:`Taker` holds the counts made in the task
until the hand-over says whether the caller took them; one it never took counts as the
caller's cancellation. A task's own counts only: a task it starts runs under a Taker of
its own, or none.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Coroutine
from typing import Any

# A count, told whether the caller took the outcome it counts (False: as cancelled).
Count = Callable[[bool], None]

_current: contextvars.ContextVar[Taker | None] = contextvars.ContextVar(
    "aiokv_taker", default=None
)


class Taker:
    """Decides once whether the outcome of its task's calls reached their caller, and
    holds their counts until then (loop thread only). ``parent``: the Taker of the task
    that hands this task's outcome on in turn (a thread's load_layerwise): taken only if
    both took it."""

    __slots__ = ("_counts", "_parent", "_taken", "task")

    def __init__(self, parent: Taker | None = None) -> None:
        self.task: asyncio.Task[Any] | None = None
        self._parent = parent
        self._taken: bool | None = None  # None until decided
        self._counts: list[Count] = []

    def then(self, count: Count) -> None:
        taken = self._taken
        if taken is None:
            self._counts.append(count)
        elif taken and self._parent is not None:
            self._parent.then(count)
        else:
            count(taken)

    def decide(self, taken: bool) -> None:
        """The caller took the task's outcome (or not); the first decision stands."""
        if self._taken is not None:
            return
        self._taken = taken
        counts, self._counts = self._counts, []
        for count in counts:
            self.then(count)


def current() -> Taker | None:
    """The running task's Taker, if it has one of its own (a task started in its context
    inherits the variable, not the Taker)."""
    taker = _current.get()
    if taker is None or taker.task is not asyncio.current_task():
        return None
    return taker


def count(record: Callable[..., None], *args: object) -> None:
    """``record(*args)`` as the running task's caller takes the outcome it counts: at
    once in a task without a Taker, else ``record(*args, taken)`` once it decides."""
    taker = current()
    if taker is None:
        record(*args)
    else:
        taker.then(functools.partial(record, *args))


def create_task(
    loop: asyncio.AbstractEventLoop,
    make: Callable[[], Coroutine[Any, Any, Any]],
    taker: Taker,
    name: str | None = None,
) -> asyncio.Task[Any]:
    """A task of ``make()`` whose counts wait for ``taker`` (its context's own copy: the
    caller's context is left as it was)."""
    task: asyncio.Task[Any] = contextvars.copy_context().run(_create, loop, make, taker, name)
    taker.task = task
    return task


def _create(
    loop: asyncio.AbstractEventLoop,
    make: Callable[[], Coroutine[Any, Any, Any]],
    taker: Taker,
    name: str | None,
) -> asyncio.Task[Any]:
    _current.set(taker)  # in the copy create_task runs in: the task copies it
    return loop.create_task(make(), name=name)
