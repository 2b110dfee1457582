"""The way onto an engine's loop from other threads (``run_in_background``'s): calls
start there in the order they were handed over.

The engine accepts a call in the call's first step on the loop: it validates it and
queues it (an offload, lookup or load), sends it after what was accepted before (an evict
or clear), or consumes a Lookup (a load). Its contract is about that order: an evict or
clear runs after every call accepted before it, a load fails once its Lookup was
released. So a thread's calls must be accepted in the order the thread made them, and
:meth:`Portal.start` gives that order to every call handed to the loop:

- one ``call_soon_threadsafe`` per hand-over, whose callback makes each call's task, in
  order (the calls of one hand-over take their first steps in one loop iteration: one
  batch for the engine);
- the loop runs callbacks in the order they were scheduled, and tasks take their first
  steps in the order they were made (both queues are FIFO, asyncio's and uvloop's).

What breaks it: a call run straight in a callback overtakes the tasks made in the same
iteration (a Lookup released that way failed the load submitted just before it), and a
call behind a coroutine that awaits before calling the engine is overtaken by the calls
handed over after it (the recsys core's batches, gathered that way, were accepted after
an ``evict_all`` made after them).

A fork copies the loop but not its thread: in a forked child nothing would ever take a
call, and the loop's self-pipe is the parent's. So nothing is handed over there
(:func:`refuse_in_fork`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import EngineClosed
from .loop import takers
from .loop.resolution import finish_thread_future

Call = Callable[[], Coroutine[Any, Any, Any]]


class Portal:
    """Starts calls on ``loop`` from any thread, in the order they were handed over."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # The calls' tasks until they end: the loop keeps only weak references to tasks.
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = threading.Lock()
        self._closed = False  # close(): nothing more is handed over
        self.pid = os.getpid()  # the process whose loop thread takes the calls
        # Calls handed over whose tasks have not taken their first step yet (in_hand).
        self._in_hand = 0

    def start(self, calls: Sequence[Call]) -> list[concurrent.futures.Future[Any]]:
        """Start ``calls`` on the loop, after every call handed over before, in one loop
        iteration; does not wait. Returns one future per call: its result, its error, or
        cancelled. A future cancelled before the loop took its call: the call never
        runs; later: its task is cancelled. Raises RuntimeError where the loop is closed,
        or in a forked child of the portal's process (nothing is started then)."""
        if forked(self.pid):  # before the lock: a thread gone with the fork may hold it
            raise RuntimeError(f"the portal belongs to process {self.pid}")
        futures: list[concurrent.futures.Future[Any]] = [
            concurrent.futures.Future() for _ in calls
        ]
        with self._lock:
            if self._closed:
                raise RuntimeError("the portal is closed")
            self.loop.call_soon_threadsafe(self._make_tasks, list(calls), futures)
            self._in_hand += len(calls)
        return futures

    def in_hand(self) -> bool:
        """Whether calls handed over (by any thread) have not all taken their first step
        on the loop yet: something a thread does itself, bypassing the loop (a load,
        aiokv.direct), would overtake them (a release another thread made before, say)."""
        return self._in_hand > 0  # an int read: atomic

    def _taken_up(self, count: int) -> None:
        with self._lock:
            self._in_hand -= count

    def close(self) -> None:
        """Hand nothing more over: later start() calls raise RuntimeError."""
        with self._lock:
            self._closed = True

    def _make_tasks(
        self, calls: list[Call], futures: list[concurrent.futures.Future[Any]]
    ) -> None:
        try:
            self._make(calls, futures)
        finally:
            # Scheduled after the tasks' first steps were, run after them (FIFO): then
            # the calls are taken up (in_hand).
            self.loop.call_soon(self._taken_up, len(calls))

    def _make(self, calls: list[Call], futures: list[concurrent.futures.Future[Any]]) -> None:
        # Each future is finished once: here, or by its task's end (_hand_back).
        loop, tasks = self.loop, self._tasks
        for call, future in zip(calls, futures, strict=True):
            if future.cancelled():  # before the loop took it: it never runs
                finish_thread_future(future, concurrent.futures.CancelledError())
                continue
            # The thread takes the task's outcome only if it has not cancelled its
            # future by then (_hand_back): the call's counts wait for that.
            taker = takers.Taker()
            try:
                task = takers.create_task(loop, call, taker)
            except Exception as exc:  # one call that cannot start fails alone
                finish_thread_future(future, exc)
                continue
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(functools.partial(_hand_back, future, taker))
            future.add_done_callback(functools.partial(_cancel_task, loop, task))


def forked(owner_pid: int) -> bool:
    """Whether this process is not ``owner_pid``: a forked child of it."""
    return os.getpid() != owner_pid


def refuse_in_fork(owner_pid: int, what: str, missing: str = "loop thread") -> None:
    """EngineClosed in a forked child of ``owner_pid``, whose handle ``what`` (made
    there) has no loop thread here (``missing``: the engine's thread the child lacks): a
    call handed over would wait forever."""
    if forked(owner_pid):
        raise EngineClosed(
            f"this {what} belongs to process {owner_pid}, and this is its forked child "
            f"{os.getpid()}, where the engine's {missing} does not exist; a forked child "
            "must open an engine of its own"
        )


def outcome(done: concurrent.futures.Future[Any] | asyncio.Future[Any]) -> object:
    """A finished future's result, its exception, or a CancelledError if it was
    cancelled, as a value."""
    if done.cancelled():
        return concurrent.futures.CancelledError()
    return done.exception() or done.result()


@runtime_checkable
class Held(Protocol):
    """A call's result that holds something until released (a Lookup's reservation)."""

    def release(self) -> None: ...


def _hand_back(
    future: concurrent.futures.Future[Any], taker: takers.Taker, task: asyncio.Task[Any]
) -> None:
    # The call's counts as the thread sees it, decided with the future, before the thread
    # can see it: a thread that cancelled the future meanwhile saw a cancellation.
    result = outcome(task)
    if not finish_thread_future(future, result, taker.decide) and isinstance(result, Held):
        result.release()  # its caller cancelled the future meanwhile: nobody else will


def _cancel_task(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], future: concurrent.futures.Future[Any]
) -> None:
    """The caller cancelled its future: cancel the task, on the loop (a no-op once the
    task is done, and once the loop is closed: then it was cancelled at the close)."""
    if future.cancelled():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(task.cancel)


__all__ = ["Call", "Portal", "forked", "outcome", "refuse_in_fork"]
