"""Per-layer loads: ``engine.load_layerwise`` and the :class:`LayerwiseLoad` it returns
(:class:`BackgroundLayerwiseLoad` for ``run_in_background``'s threads).

A layerwise load is an ordinary load request (validated, admitted, timed out, counted
and resolved as ``load``'s) that also hears of its launch. On the store thread, right
after the launch that took it, :func:`note_launches` asks the store for the task's
:class:`~aiokv.copy.marks.LayerMarks` (``stores.base.MarksLayers``) and posts them to the
loop, one ``call_soon_threadsafe`` per round; ``load_layerwise`` returns then, or when
the load ended if it never launched. Waiters wait on the store's marks, or, where the
store marks nothing (no ``layer_marks``, or None for this task), on marks of the load's
own that its end sets all at once.

The load's end reaches every waiter, whichever thread it waits on: an error fails the
marks (waking waiters blocked in them) and every wait after raises it; a load that moved
fewer tokens than its Lookup held (0 after an evict of the key) raises
:class:`~aiokv.errors.NotLoaded` from the waits, so pages a load did not fill are never
reported ready; a success finishes the marks. A wait that returned before the end stands:
its layer was in place. Whoever first sees the end (its task done: ``result()`` can
answer) takes it in, on any thread, so that no wait then answers from the marks as if the
load were still running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Hashable, Iterable
from types import TracebackType
from typing import Any

import numpy as np

from .copy.marks import LayerFailed, LayerMarks, Waiter
from .errors import BlockingCallOnLoop, EngineClosed, InvalidRequest, NotLoaded, StoreError
from .loop import takers
from .loop.binding import check_loop
from .loop.resolution import finish_thread_future, settle
from .portal import forked, refuse_in_fork
from .requests import LoadResult, Lookup, Request

log = logging.getLogger("aiokv")

LayerMarksOf = Callable[[int], LayerMarks | None]
# Told of a load as it is handed out, and told back whether its caller got it (start()).
HandOut = Callable[["LayerwiseLoad", Callable[[bool], None]], None]


class LayerwiseLoad:
    """A launched load whose layers can be waited for one by one: ``wait_layer(i)`` from
    any thread, ``await layer_ready(i)`` on the engine's loop, ``await result()``.

    ``user_id``, ``cached_tokens`` (the Lookup's, what a full load moves) and
    ``num_layers`` (the caches' tables) are the load's. Made by
    ``engine.load_layerwise``, never directly.

    In a forked child of the process that made it, the waits for a load that had not
    ended at the fork raise EngineClosed (nothing there would ever end it: the store's
    thread and copies are the parent's, as is the loop's thread); one that had ended
    answers as it ended; ``cancel()`` does nothing (the load is the parent's)."""

    def __init__(self, num_layers: int, hit: Lookup, loop: asyncio.AbstractEventLoop) -> None:
        self.user_id: Hashable = hit.user_id
        self.cached_tokens = hit.cached_tokens
        self.num_layers = num_layers
        self._loop = loop
        self._loop_thread = threading.get_ident()  # made on the loop, by load_layerwise
        self._pid = os.getpid()  # the process whose loop and store end the load
        # The marks waiters wait on: the load's own until the store's arrive with the
        # launch notice (before the load is handed out), and for good where none do.
        self._marks = LayerMarks(num_layers)
        self._own_marks = True
        self._launched: asyncio.Future[None] = loop.create_future()
        # Told of the load as it is handed out, on the loop, in the same callback as the
        # launch notice: run_in_background's callers get their load without waiting for
        # load_layerwise's task to wake and its result to be chained to their future.
        self._on_handed_out: Callable[[LayerwiseLoad], None] | None = None
        self._end: asyncio.Future[LoadResult] = loop.create_future()  # replaced by _follow
        # Once ended (``_ended``): what every wait raises from then on, None after a full
        # load. Written on the loop before the marks are finished or failed, whose lock
        # orders it before what the woken waiters read.
        self._error: BaseException | None = None
        self._error_tb: TracebackType | None = None  # its traceback as the load ended
        self._ended = False
        # Taking the end in (_finish) is done once, by whichever thread sees it first.
        # Never taken in a forked child (_take_end): a lock held at the fork is not freed.
        self._end_lock = threading.Lock()
        # Finished once the end is taken in: what a thread's wait for the end waits on
        # (BackgroundLayerwiseLoad), without a hop through the loop, which a close may
        # have closed before the hop reached it.
        self._ended_signal: concurrent.futures.Future[None] = concurrent.futures.Future()

    def __repr__(self) -> str:
        ended = self._take_end()
        state = "running" if not ended else "failed" if self._error else "loaded"
        return (
            f"LayerwiseLoad(user_id={self.user_id!r}, cached_tokens={self.cached_tokens}, "
            f"num_layers={self.num_layers}, {state})"
        )

    # ---- waiters ---------------------------------------------------------------------

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Order ``stream`` (a ``torch.cuda.Stream``; None: this thread's current one)
        after layer ``layer``'s copies: the CPU waits only until they are queued (until
        the load ends, on a store that marks layers at the end). On CPU caches, block
        until the layer is copied.

        Raises InvalidRequest (``layer`` outside ``[0, num_layers)``), the load's error
        (StoreError, RequestTimeout, EngineClosed, InvalidRequest for a bad page id...),
        :class:`concurrent.futures.CancelledError` (the load was cancelled), NotLoaded
        (it ended with fewer tokens than its Lookup's), and BlockingCallOnLoop on the
        engine's loop thread where only the loop could end the wait (a store that marks
        layers at the end): ``await layer_ready(layer)`` there."""
        self._check(layer)
        self._take_end()
        self._refuse_in_fork()
        self._raise_if_failed(threads=True)
        marks = self._marks
        if self._own_marks and not self._ended and threading.get_ident() == self._loop_thread:
            raise BlockingCallOnLoop(
                f"wait_layer({layer}) would wait on the engine's loop thread for the load's "
                "end, which that loop delivers; await layer_ready() there instead"
            )
        try:
            marks.wait(layer, stream)
        except LayerFailed as failed:
            self._take_end()
            self._raise_if_failed(threads=True)
            if failed.field is not None:  # the end will carry this error: raise it now
                raise InvalidRequest(failed.field, str(failed)) from None
            raise StoreError(f"layer {layer} of the load failed in the store: {failed}") from failed
        self._take_end()
        self._raise_if_failed(threads=True)

    async def layer_ready(self, layer: int) -> None:
        """Return once layer ``layer`` is in the pages (on a GPU: its copies done, for
        any stream and the host); the loop never blocks. Raises what :meth:`wait_layer`
        raises (asyncio's CancelledError for a cancelled load), except
        BlockingCallOnLoop; WrongLoop off the engine's loop."""
        if forked(self._pid):  # no loop here is the engine's; what ended answers
            self._check(layer)
            self._refuse_in_fork()
            self._raise_if_failed(threads=False)
            return
        check_loop(self._loop)
        self._check(layer)
        if not self._take_end():
            await self._until_ready(layer)
        self._take_end()
        self._raise_if_failed(threads=False)

    async def _until_ready(self, layer: int) -> None:
        """:meth:`layer_ready`'s wait, for a load that has not ended: until its layer is
        in place or the load ended."""
        marks = self._marks
        if self._own_marks:
            await asyncio.wait((self._end,))  # only the end marks these
        elif not marks.is_ready(layer):
            # The store's copier marks it; a thread waits for it: one of aiokv's own, so
            # that waits never fill the loop's default executor (which close and callers'
            # own to_thread work use). Those threads are every engine's: a cancelled wait
            # lets its thread go at once, or a caller polling a stalled load with short
            # timeouts would hold them all and stall other engines' waits.
            # The load's end answers too: the wait's job may still queue behind other
            # engines' waits for a thread when the end comes.
            waiter = Waiter()
            job = self._loop.run_in_executor(_layer_waits(), _synchronize, marks, layer, waiter)
            try:
                await asyncio.wait((job, self._end), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                marks.abandon(waiter)
                raise
            if not job.done():
                marks.abandon(waiter)  # its thread returns at once, or never waits
            elif job.result() is not None and not self._take_end():
                await asyncio.wait((self._end,))  # its typed error comes with the end

    def is_ready(self, layer: int) -> bool:
        """Whether layer ``layer`` is in the pages now (never blocks; False once the load
        failed or moved fewer tokens than its Lookup's)."""
        self._check(layer)
        if self._take_end():
            return self._error is None
        return self._marks.is_ready(layer)

    async def result(self) -> LoadResult:
        """The load's LoadResult once it ended (as ``load`` returns it: ``loaded_tokens``
        may be 0 after an evict), or its error. Cancelling this await does not cancel the
        load (:meth:`cancel` does). WrongLoop off the engine's loop."""
        if forked(self._pid):  # no loop here is the engine's; what ended answers
            end = self._end
            if not end.done():
                refuse_in_fork(self._pid, "layerwise load", "store thread")
            if end.cancelled():
                raise asyncio.CancelledError()
            return end.result()
        check_loop(self._loop)
        # An end not yet taken in is taken in now: the waits after this answer as it
        # does, and its error is kept with its traceback before this raise adds to it.
        self._take_end()
        return await asyncio.shield(self._end)

    def cancel(self) -> None:
        """Stop waiting for the load (engine's loop only): as for a cancelled ``load``, a
        launched copy still runs to its end into the pages; every wait then raises a
        CancelledError. A no-op once the load ended; WrongLoop off the engine's loop
        before that (a no-op in a forked child: the load is the parent's)."""
        if self._end.done() or forked(self._pid):
            return
        check_loop(self._loop)
        self._end.cancel()
        # Ended now, not at the end's callback a loop iteration later: a wait in between
        # must not report a copied layer of a cancelled load ready.
        self._finish(asyncio.CancelledError())
        self._hand_out()

    # ---- the engine's side (loop thread) ---------------------------------------------

    def _follow(self, end: asyncio.Future[LoadResult]) -> None:
        self._end = end
        if end.done():
            self._on_end(end)  # an empty hit's: ended before it is handed out
        else:  # runs before the callbacks of result()'s awaits, added later
            end.add_done_callback(self._on_end)

    def _on_launch(self, marks: LayerMarks | None) -> None:
        """The launch notice (:func:`note_launches`), before the load is handed out."""
        if marks is not None and not self._take_end():
            if marks.num_layers == self.num_layers:
                self._marks, self._own_marks = marks, False
            else:  # a store bug: the load's own marks still end every wait
                log.warning(
                    "aiokv: the store marked %d layers of a load into %d; marking them at "
                    "its end", marks.num_layers, self.num_layers,
                )
        self._hand_out()

    def _on_end(self, end: asyncio.Future[LoadResult]) -> None:
        self._take_end()  # unless cancel() or a wait took it in first
        self._hand_out()  # a load that never launched is handed out now

    def _end_orphaned(self) -> None:
        """The engine was closed after its loop was closed without closing it (any
        thread): unless its end was taken in, the load ends with EngineClosed. Only the
        loop delivers a load's end, and that loop is gone, so nothing else would wake the
        threads blocked in ``wait_layer`` (on marks that only the end sets) or answer the
        waits after. A load whose task ended before the loop closed ends as it did."""
        if not self._take_end():
            self._finish(EngineClosed(
                f"the engine was closed after its loop was closed without aclose(); the "
                f"load of user {self.user_id!r} never delivered its end to that loop"
            ))

    def _take_end(self) -> bool:
        """Whether the load ended, its end taken in here (any thread) once ``_end`` is
        done: ``result()`` answers from then on, and the waits must not answer from the
        marks meanwhile, as they would until ``_on_end`` ran a loop iteration later. Not
        in a forked child, where an end the loop had not taken in stays unknown."""
        if self._ended:
            return True
        end = self._end
        if not end.done() or forked(self._pid):
            return False
        error: BaseException | None
        if end.cancelled():
            error = asyncio.CancelledError()
        else:
            error = end.exception()  # read: a load nobody awaits logs no "never retrieved"
            if error is None and (loaded := end.result().loaded_tokens) < self.cached_tokens:
                error = NotLoaded(
                    f"the load of user {self.user_id!r} moved {loaded} of its Lookup's "
                    f"{self.cached_tokens} tokens (the key was evicted or cleared after the "
                    "lookup, or a block failed its checksum): its layers are not in the pages",
                    loaded, self.cached_tokens,
                )
        self._finish(error)
        return True

    def _finish(self, error: BaseException | None) -> None:
        """End the load with ``error`` (None: loaded), unless it ended already."""
        with self._end_lock:
            if self._ended:
                return
            self._error = error
            # Each wait raises the error with this traceback, not with those of the waits
            # before it: a re-raised exception keeps every frame it passed (and locals).
            self._error_tb = None if error is None else error.__traceback__
            self._ended = True
        if error is None:
            self._marks.finish()
        else:
            self._marks.fail(f"the load ended with {error!r}")
        finish_thread_future(self._ended_signal, None)

    # ---- helpers ---------------------------------------------------------------------

    def _hand_out(self) -> None:
        settle(self._launched, None)
        hook, self._on_handed_out = self._on_handed_out, None
        if hook is not None:
            hook(self)

    def _refuse_in_fork(self) -> None:
        """EngineClosed in a forked child for a load that had not ended at the fork
        (or whose end the loop had not yet taken in: its layers' outcome is not known)."""
        if not self._ended:
            refuse_in_fork(self._pid, "layerwise load", "store thread")

    def _check(self, layer: object) -> None:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise InvalidRequest("layer", f"must be an int, got {type(layer).__name__} "
                                          f"{layer!r}")
        if not 0 <= layer < self.num_layers:
            raise InvalidRequest("layer", f"{layer} is outside [0, {self.num_layers})")

    def _raise_if_failed(self, threads: bool) -> None:
        error = self._error if self._ended else None
        if error is None:
            return
        if isinstance(error, asyncio.CancelledError):
            # A thread's waits raise the CancelledError of concurrent futures (an
            # Exception): asyncio's would read as the cancellation of a task.
            raise concurrent.futures.CancelledError() if threads else asyncio.CancelledError()
        raise _fresh(error).with_traceback(self._error_tb)


def _fresh(error: BaseException) -> BaseException:
    """A copy of ``error`` for one wait to raise: a raise adds its frames to the
    exception's traceback, and every wait raising the load's own would keep the last
    waiter's frames (and their locals) alive with the load, and mix threads' tracebacks."""
    try:
        fresh = copy.copy(error)
    except Exception:  # an exception that does not copy: raised as it is
        return error
    fresh.__cause__, fresh.__suppress_context__ = error.__cause__, error.__suppress_context__
    return fresh


def _synchronize(marks: LayerMarks, layer: int, waiter: Waiter) -> LayerFailed | None:
    """In a thread: wait until ``layer`` is in place (or ``waiter`` is abandoned, and
    nobody reads the answer); its failure, if it failed."""
    try:
        marks.synchronize(layer, waiter)
    except LayerFailed as failed:
        return failed
    return None


async def start(
    num_layers: int,
    hit: Lookup,
    request: Request | None,
    run: Callable[[Lookup, Request], Coroutine[Any, Any, LoadResult]],
    loads: weakref.WeakSet[LayerwiseLoad],
    on_handed_out: HandOut | None = None,
) -> LayerwiseLoad:
    """``load_layerwise``'s body, once ``request`` (None: an empty hit, loaded at once)
    is made and checked: run it (``run``: the engine's load) and return once it is
    launched or ended. Cancelled before that, the load is cancelled as ``load`` is.
    ``loads``: the engine's, for a close after its loop was closed to end those that loop
    never ended (:meth:`LayerwiseLoad._end_orphaned`). ``on_handed_out(load, decided)``:
    called on the loop as the load is launched or ended, before this returns; it tells
    ``decided`` whether the load reached its caller, before that caller can see it."""
    loop = asyncio.get_running_loop()
    load = LayerwiseLoad(num_layers, hit, loop)
    # The load's outcome reaches this caller only through the load returned here: one
    # that ended before (refused, failed) counts as cancelled where this caller is
    # cancelled first (aiokv.loop.takers). The parent: a run_in_background thread's call,
    # whose own taking decides in turn.
    outer = takers.current()
    taker = takers.Taker(outer) if request is not None else None
    if on_handed_out is not None:
        def decided(taken: bool) -> None:
            # The hook's caller (a thread) has the load as it is handed out, before this
            # returns and its task hands the load on: the counts of its call (an empty
            # load's, the load's refusal) are settled then, before it can see them.
            if outer is not None:
                outer.decide(taken)
            if taker is not None:
                taker.decide(taken)

        hand_out = on_handed_out
        load._on_handed_out = lambda handed: hand_out(handed, decided)
    if request is None:
        done: asyncio.Future[LoadResult] = loop.create_future()
        settle(done, LoadResult(hit.user_id, 0))
        load._follow(done)
        return load
    # Weak: a load its caller dropped has no waiter to wake. Not by its request (the
    # engine's live set): one answered in the loop's last iteration has left that set
    # while its task, which would take the answer in, never runs again.
    loads.add(load)
    request.layers = load
    assert taker is not None
    load._follow(takers.create_task(
        loop, lambda: run(hit, request), taker, name="aiokv-load-layerwise"))
    taken = False
    try:
        await load._launched
        taken = True
    except asyncio.CancelledError:
        load.cancel()
        # Refused meanwhile (Overloaded), the load handed its Lookup back to be loaded
        # later; but this caller leaves with neither the load nor its error, so the
        # Lookup goes back as a cancelled load's does (a no-op unless it is held).
        hit.release()
        raise
    finally:
        taker.decide(taken)
    return load


def note_launches(requests: Iterable[Request], layer_marks: LayerMarksOf | None) -> None:
    """Store thread, right after a launch succeeded: tell the launched layerwise loads
    among ``requests`` (each with its ``task_id``), with the store's marks for each
    (``layer_marks``, the store's MarksLayers; None: marked at the end)."""
    notices: list[tuple[LayerwiseLoad, LayerMarks | None]] = []
    for request in requests:
        load = request.layers
        if load is None:
            continue
        marks = None
        if layer_marks is not None and request.task_id is not None:
            try:
                marks = layer_marks(request.task_id)
            except Exception:  # the load still ends, and its end marks every layer
                log.warning("aiokv: store.layer_marks(%s) failed", request.task_id, exc_info=True)
        notices.append((load, marks))
    if notices:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            notices[0][0]._loop.call_soon_threadsafe(_deliver, notices)


def _deliver(notices: list[tuple[LayerwiseLoad, LayerMarks | None]]) -> None:
    for load, marks in notices:
        try:
            load._on_launch(marks)
        except Exception:  # a bug in one hand-out: the round's other loads still get theirs
            log.exception(
                "aiokv: handing out the launched layerwise load of user %r failed", load.user_id
            )


__all__ = ["LayerwiseLoad", "note_launches", "start"]


_WAITS: concurrent.futures.ThreadPoolExecutor | None = None
_WAITS_LOCK = threading.Lock()
LAYER_WAIT_THREADS = 32  # layer_ready waits at once; more queue for a thread


def _layer_waits() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that wait for layers marked by a store's copier (every engine's)."""
    global _WAITS
    with _WAITS_LOCK:
        if _WAITS is None:
            _WAITS = concurrent.futures.ThreadPoolExecutor(
                LAYER_WAIT_THREADS, thread_name_prefix="aiokv-layer-wait")
        return _WAITS
