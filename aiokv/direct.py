"""Loads queued by their caller's thread: the blocking ``load`` of ``run_in_background``
and the recsys adapter's onboard, where the Lookup's pages are all on the host tier of a
store in this process (:class:`~aiokv.stores.base.TakesLoads`: the embedded store).

Such a caller blocks until its load ended anyway. Through the loop, its load would go
caller -> loop -> store thread -> copy thread before its first copy is queued, and back
the same way after the last one ran: serial Python under one GIL, more time than the
copies of a small batch take. Here the calling thread does it all itself, for all the
loads of one call at once (:func:`start_many`):

1. the checks ``engine.load`` makes (InvalidRequest, EngineClosed), before anything is
   consumed;
2. each Lookup consumed (:meth:`aiokv.requests.Lookup._take`, under its lock: a second
   load of it, or a release or TTL on the loop, finds it consumed);
3. the store's matched gets taken and their copies queued from this thread, one job,
   after its current CUDA stream (``take_loads``: page ids fetched, checked, planned and
   queued by the copy plane's own code on a lane of the copier's,
   :meth:`~aiokv.copy.copier.Copier.queue_here`);
4. :meth:`Taken.wait`: the copies ran (into the pages); the reservations go back to the
   store thread in one hand-over (which ends the gets' reads), and the engine's counts
   take the loads in one notice to the loop.

Anything else (a miss, pages on SSD, a mask with holes, another store) goes through the
loop as before: :func:`start_many` answers None for it, and so do the callers while calls
handed to the loop have not begun (``Portal.in_hand``: a release made before must not be
overtaken). A load taken here has no deadline (it is queued whole at its call, and waits
for nothing but its copies) and takes no room in the engine's queue. A close waits for
it: the store's close waits for what was taken, and the engine's close then finishes the
loads nobody waited for yet (:class:`TakenGroups`), so that its final figures count them.
The interpreter's exit waits for a thread queuing one (the handle's HandOverGate), which
runs torch's copies there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import validate
from .cuda import caller_event
from .errors import EngineClosed, InvalidRequest, StoreError
from .lifecycle import EngineState
from .requests import LoadResult, Lookup
from .stores.base import TakenLoad, TakesLoads, TaskStatus

if TYPE_CHECKING:
    from .engine import OffloadEngine
    from .requests import Reservation
    from .stats import StatsRecorder


class TakenGroups:
    """An engine's groups of loads that threads took and have not waited for yet (a
    recsys launch returns before its wait). Its close finishes them (:meth:`finish_all`),
    once the store's close ran their copies: their counts are in the final figures, as a
    drain's would be, whenever (or whether) their callers wait."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._open: set[_Group] = set()
        # Threads in start_many now (past its running check or about to be, a group's
        # copies perhaps queued and not yet added, or its misses being counted): the
        # close waits for them, or it would miss a group the store's close ran the copies
        # of (its thread preempted before it added it), or misses counted after it.
        self._opening = 0

    def opening(self) -> None:
        """A thread enters start_many (before its running check)."""
        with self._lock:
            self._opening += 1

    def opened(self, group: _Group | None) -> None:
        """Its copies queued (``group``), or none were (None); once after :meth:`opening`."""
        with self._lock:
            self._opening -= 1
            if group is not None:
                self._open.add(group)
            self._lock.notify_all()

    def discard(self, group: _Group) -> None:
        with self._lock:
            self._open.discard(group)

    def finish_all(self) -> None:
        """Any thread but the loop's (each waits for its copies), once the store's close
        began (no more are taken): each group finished, its counts handed to the loop."""
        with self._lock:
            self._lock.wait_for(lambda: not self._opening)
            groups = list(self._open)
        for group in groups:
            group.finish()


class _Group:
    """The loads one call took together (:func:`start_many`): one copy job, finished
    once, by whichever of them is waited for first (or the engine's close): the
    reservations go back, and the engine's counts take them in one notice to the loop."""

    def __init__(self, engine: OffloadEngine, started: float) -> None:
        self._engine, self._started = engine, started
        self._members: list[Taken] = []
        self._lock = threading.Lock()
        self._finished = False
        # Its steps done so far, each done once: a finish interrupted midway (a
        # KeyboardInterrupt) leaves the rest to the next finisher, which must neither
        # skip them (the counts never made) nor do them again.
        self._outcomes: list[LoadResult | BaseException] | None = None
        self._back: list[int] | None = None  # reservations detached, not yet handed back
        self._counted = False

    def finish(self) -> None:
        # All of it under the lock: a second finisher (the close's) returns only once the
        # counts were handed to the loop, which the close's final figures take in next.
        with self._lock:
            if self._finished:
                return
            # Finished once every member is: one interrupted (a KeyboardInterrupt in its
            # wait) leaves the group to the next finisher, not finished with no results.
            if self._outcomes is None:
                self._outcomes = [member._finish() for member in self._members]
            outcomes = self._outcomes
            # The store thread forgets the reservations, and takes the copies' end in:
            # one hand-over for them all (one store call), not one each.
            worker = self._engine._worker
            if self._back is None:
                self._back = [m._reservation.task_id for m in self._members
                              if m._reservation.detach()]
            if self._back and worker is not None:
                worker.release(self._back)
            self._back = []
            if not self._counted:
                latency_s = time.perf_counter() - self._started
                loop, stats = self._engine._loop, self._engine._stats
                if loop is not None:
                    with contextlib.suppress(RuntimeError):  # a closed loop: counts are final
                        loop.call_soon_threadsafe(_count, stats, outcomes, latency_s)
                self._counted = True
            self._finished = True
            # Last: the close's finish_all, which found it open, waits for all of the above.
            self._engine._taken_loads.discard(self)


def _count(stats: StatsRecorder, outcomes: list[LoadResult | BaseException],
           latency_s: float) -> None:
    for outcome in outcomes:
        stats.record_direct_load(outcome, latency_s)


class Taken:
    """A load whose copies its caller's thread queued (:func:`start_many`)."""

    __slots__ = ("_group", "_hit", "_reservation", "_result", "_taken", "_tokens")

    def __init__(
        self, group: _Group, hit: Lookup, reservation: Reservation, tokens: int,
    ) -> None:
        self._group, self._hit, self._reservation = group, hit, reservation
        self._taken: TakenLoad | None = None
        self._tokens = tokens
        self._result: LoadResult | BaseException | None = None

    def wait(self) -> LoadResult:
        """Block until the copies ran (the data is in the pages), then the load's result,
        or its error (InvalidRequest for a page id the copier refused; StoreError where
        the copies failed; EngineClosed where the close gave it back first). Any thread;
        a second call answers the same."""
        self._group.finish()
        result = self._result
        assert result is not None
        if isinstance(result, BaseException):
            raise result
        return result

    def _finish(self) -> LoadResult | BaseException:
        hit, taken = self._hit, self._taken
        outcome: LoadResult | BaseException
        if taken is None:  # given back first: by an evict or clear (a miss, as on the
            # loop, which marks it so before it gives it back), else by the close
            outcome = (LoadResult(hit.user_id, 0) if self._reservation.taken_back
                       else EngineClosed("the engine closed before the load started"))
        else:
            result = taken.wait()
            if result.status is TaskStatus.SUCCESS:
                outcome = LoadResult(hit.user_id, self._tokens)
            elif result.status is TaskStatus.INVALID:
                outcome = InvalidRequest("page_ids", result.error)
            else:
                outcome = StoreError(f"task {self._reservation.task_id} failed in the "
                                     f"store: {result.error}")
        hit._settle(loaded=not isinstance(outcome, BaseException))
        self._result = outcome
        return outcome


def start_many(
    engine: OffloadEngine, hits: Sequence[Lookup], pages: Sequence[Any], ready: Any = None
) -> list[Taken | BaseException | None]:
    """The loads of ``hits`` into ``pages``, their copies queued by this thread in one
    job after ``ready`` (a CUDA event; None: one recorded now on this thread's current
    stream); for each, its Taken, the error ``engine.load`` would raise at its call, or
    None where it goes through the loop instead (see the module docstring)."""
    store = engine._store
    if not isinstance(store, TakesLoads):
        return [None] * len(hits)
    groups = engine._taken_loads
    # Known to the close before the running check: its finish_all waits for this thread,
    # whatever it queues or finishes here (misses an evict gave back are counted at the
    # call), or the close's final figures would miss loads it answers afterwards.
    groups.opening()
    opened: list[_Group] = []  # the group whose copies were queued, for the close
    try:
        return _start_many(engine, store, hits, pages, ready, opened)
    finally:
        groups.opened(opened[0] if opened else None)


def _start_many(
    engine: OffloadEngine, store: TakesLoads, hits: Sequence[Lookup], pages: Sequence[Any],
    ready: Any, opened: list[_Group],
) -> list[Taken | BaseException | None]:
    if engine._state is not EngineState.RUNNING or engine._loop is None:
        closed = EngineClosed(f"engine is {engine._state.value}")
        return [closed] * len(hits)
    invalidations = engine._invalidations
    if invalidations is not None and invalidations.unsettled.count:
        # An evict or clear accepted before has not given its keys' reservations back
        # yet: these loads come after it, through the loop, and miss its keys.
        return [None] * len(hits)
    answers: list[Taken | BaseException | None] = []
    chosen: list[tuple[int, Lookup, torch.Tensor, int]] = []  # index, hit, view, tokens
    for at, (hit, page_ids) in enumerate(zip(hits, pages, strict=True)):
        try:
            view = _view(engine, store, hit, page_ids)
        except InvalidRequest as exc:
            answers.append(exc)
            continue
        answers.append(None)
        if view is not None:
            chosen.append((at, hit, *view))
    if not chosen:
        return answers
    group = _Group(engine, time.perf_counter())
    taking: list[tuple[int, Taken, torch.Tensor]] = []
    try:
        for at, hit, ids, tokens in chosen:
            try:
                reservation = hit._take()  # InvalidRequest where loaded, released, expired
            except InvalidRequest as exc:
                # A close released it meanwhile: the close's error, as on the loop.
                answers[at] = (exc if engine._state is EngineState.RUNNING
                               else EngineClosed(f"engine is {engine._state.value}"))
                continue
            taken = Taken(group, hit, reservation, tokens)
            group._members.append(taken)
            if reservation.taken_back is not None:
                # An evict or clear gave it back on the store thread, which may not have
                # cancelled its task yet: a miss, as on the loop, never the evicted KV.
                answers[at] = taken
                continue
            taking.append((at, taken, ids))
    except BaseException:
        # Interrupted midway (a KeyboardInterrupt): the call raises, so nobody will load
        # the hits it took; they go back, or their keys' blocks stay read for good (a
        # release finds them consumed and does nothing).
        for taken in group._members:
            taken._hit._settle(loaded=False)
            taken._reservation.release()
        raise
    if not taking:
        # Misses only (given back by an evict or clear): nothing to wait for, so they are
        # finished and counted now, while the loop takes counts; a close would not find
        # a group that queued no copies, and a wait after it could count them nowhere.
        if group._members:
            group.finish()
        return answers
    if ready is None and engine._on_gpu:
        ready = caller_event(engine._device)
    try:
        queued = store.take_loads([t._reservation.task_id for _, t, _ in taking],
                                  [ids for _, _, ids in taking], ready)
    except BaseException as exc:
        for at, taken, _ in taking:
            taken._hit._settle(loaded=False)
            taken._reservation.release()
            answers[at] = exc
        # The misses among them (given back by an evict or clear) are answered and
        # counted as such, now (as above).
        failed = {id(taken) for _, taken, _ in taking}
        group._members = [m for m in group._members if id(m) not in failed]
        if group._members:
            group.finish()
        if not isinstance(exc, Exception):
            raise
        return answers
    opened.append(group)  # the close finishes it where nobody waited first
    for (at, taken, _), one in zip(taking, queued, strict=True):
        taken._taken = one
        answers[at] = taken
    return answers


def _view(
    engine: OffloadEngine, store: TakesLoads, hit: Lookup, page_ids: Any
) -> tuple[torch.Tensor, int] | None:
    """The checks ``engine.load`` makes at its call (InvalidRequest), and the page ids
    the hit's blocks go to with the tokens they hold; None where the load goes through
    the loop (a miss, holes in its mask, pages on SSD)."""
    if not isinstance(hit, Lookup) or hit._owner is not engine._resolver:
        raise InvalidRequest("hit", "must be a Lookup returned by this engine's lookup()")
    pages = validate.page_ids(page_ids, engine._device)
    reservation = hit._reservation
    if hit.cached_tokens == 0 or reservation is None:
        return None  # the loop counts an empty load (and says why a second one is fine)
    needed = hit._pages_needed(engine._page_size)
    if pages.shape[0] < needed:
        raise InvalidRequest(
            "page_ids", f"has {pages.shape[0]} pages; this hit needs at least {needed}"
        )
    by_page = reservation.mask[:: engine._page_size]  # masks are page aligned
    count = int(np.count_nonzero(by_page))
    first = int(by_page.argmax())
    if count == 0 or np.count_nonzero(by_page[first : first + count]) != count:
        return None  # holes in the mask: the loop's plan indexes them
    if not store.takes_load(reservation.task_id):
        return None
    return pages[first : first + count], count * engine._page_size


def load(engine: OffloadEngine, hit: Lookup, page_ids: torch.Tensor) -> LoadResult | None:
    """One load queued by this thread and waited for; None where it goes through the
    loop. Raises what ``engine.load`` raises."""
    (started,) = start_many(engine, [hit], [page_ids])
    if isinstance(started, BaseException):
        raise started
    return None if started is None else started.wait()
