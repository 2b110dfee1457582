"""Resolution: the one place an accepted request's future is resolved, on the loop.

The store thread posts each drained set of (request, outcome) pairs with one
``call_soon_threadsafe`` (:meth:`Resolver.deliver`); the engine resolves its own failures
(closed, timed out, dispatch failed) through :meth:`Resolver.resolve` too. A future that
is already done (its caller cancelled, or it timed out) is left alone, and a lookup's
reservation that nobody will hold any more is given back. Outcomes are counted where
their callers take them (the engine's ``_run``, :mod:`.takers`), not here: a caller
cancelled after its answer came, before it took it, saw a cancellation. An offload whose
match found no room (StoreFull) is not resolved but held for a later try
(:mod:`aiokv.space`), until its deadline. An answer that comes after its request's
deadline fails as the deadline's timer would have failed it (:meth:`Resolver._late`): a
caller gets its result by the deadline, or an error.

An offload whose caller stops waiting before its answer (its deadline's timer, its
cancellation, a close that abandons it) is detached first (:meth:`Resolver.detach`), so
that the store keeps nothing its copy may have read after the caller was told and took
its pages back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import EngineClosed, InvalidRequest, RequestTimeout, StoreError, StoreFull
from ..requests import TERMINAL, Kind, Lookup, LookupGrant, Request
from ..space import SpaceWaits
from ..stats import StatsRecorder
from .admission import Admission
from .deadlines import Deadlines

log = logging.getLogger("aiokv")

# Resolving outcomes runs at most about this long per loop callback (always at least one
# outcome); the rest waits for the next iteration. Each outcome costs a resolution and its
# caller's resumption (in the iteration after), so a store thread posting hundreds at once
# (large batches, or several drained together) would otherwise hold the loop for
# milliseconds in one or two iterations.
RESOLVE_BUDGET_S = 0.0001
_OFFLOAD = Kind.OFFLOAD  # a module global: read per outcome


class Resolver:
    """Resolves requests' futures for one running engine (loop thread only)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stats: StatsRecorder,
        admission: Admission,
        idle: asyncio.Event,
        lookup_ttl_s: float,
        request_timeout_ms: int,
    ) -> None:
        self._loop = loop
        self._now = loop.time  # bound once: read per resolve of a request with a deadline
        self._stats = stats
        self._admission = admission
        self._idle = idle  # set while no accepted request is unresolved
        self._lookup_ttl_s = lookup_ttl_s
        self._request_timeout_ms = request_timeout_ms
        self.deadlines: Deadlines | None = None  # pruned as outcomes resolve, when set
        self.space: SpaceWaits | None = None  # offloads waiting for room, once started
        # Outcomes posted by the store thread, not resolved yet (RESOLVE_BUDGET_S). While
        # it holds any, a resolve_outcomes callback is scheduled for them.
        self._outcomes: deque[tuple[Request, object]] = deque()
        # Every Lookup answered, while its caller keeps it: release_lookups at the close.
        self._lookups: weakref.WeakSet[Lookup] = weakref.WeakSet()
        self._closing = False  # set by release_lookups: Lookups answered later go back
        # The store's detach (stores.base.Detaches), when it has one.
        self.detach_task: Callable[[int], None] | None = None

    def deliver(self, pairs: list[tuple[Request, object]]) -> None:
        """Called on the loop by the store thread, once per drained set."""
        queued = bool(self._outcomes)  # then a callback is due for them: wait your turn
        self._outcomes.extend(pairs)
        # The list is ours now. The store thread may still be inside
        # call_soon_threadsafe with it as a local: emptied, it keeps no request alive
        # after its caller has been answered.
        pairs.clear()
        if not queued:
            self.resolve_outcomes()

    def resolve_outcomes(self, budget_s: float | None = None) -> None:
        """Resolve queued outcomes in order for about ``budget_s`` (default
        RESOLVE_BUDGET_S; at least one), and leave the rest to a callback in the next loop
        iteration."""
        outcomes = self._outcomes
        resolve = self.resolve
        space = self.space
        ended = False  # a store task ended: room may have freed for offloads that wait
        deadline = time.perf_counter() + (RESOLVE_BUDGET_S if budget_s is None else budget_s)
        try:
            while outcomes:
                request, outcome = outcomes.popleft()
                if space is not None:
                    if isinstance(outcome, StoreFull) and request.kind is _OFFLOAD:
                        outcome = space.hold(request, outcome)
                        if outcome is None:
                            continue  # held: it matches again in a later window
                    elif request.task_id is not None:  # launched (or a load's reservation)
                        ended = True
                resolve(request, outcome)
                if time.perf_counter() >= deadline:
                    break
        finally:
            if ended and space is not None:
                space.room_may_have_freed()
            if self.deadlines is not None:
                self.deadlines.prune()
            # Even if one resolution raised (the loop's exception handler logs it), the
            # rest must not wait for a callback that was never scheduled.
            if outcomes:
                self._loop.call_soon(self.resolve_outcomes)

    def resolve(self, request: Request, outcome: object) -> None:
        """The one place futures are resolved. A future already done (caller cancelled,
        timed out) is left alone; an orphaned reservation is given back. An answer after
        the request's deadline fails it (:meth:`_late`); an error is resolved as it is."""
        future = request.future
        if future.done():
            # Terminal already; the store thread may have written LAUNCHED since (a caller
            # that left as its batch launched): this outcome is its last word.
            request.stage = TERMINAL
            if isinstance(outcome, LookupGrant) and outcome.reservation is not None:
                outcome.reservation.release()  # nobody holds it
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)  # an error stays that error, however late
        elif (deadline := request.deadline) is not None and self._now() >= deadline:
            outcome = self._late(request, outcome)  # its caller gets, and counts, this
            future.set_exception(outcome)
        elif isinstance(outcome, LookupGrant):
            lookup = Lookup(
                request.user_id, outcome, self, self._loop.call_later, self._lookup_ttl_s
            )
            if lookup.held:
                if self._closing:
                    lookup.release()  # a lookup the close drains: nothing can load it
                else:
                    self._lookups.add(lookup)
            future.set_result(lookup)
        else:
            future.set_result(outcome)
        # A refusal whose offload may be made again keeps its room for that second try.
        self.finished(request, request.keeps_room and isinstance(outcome, InvalidRequest))

    def release_lookups(self) -> None:
        """The engine closes (it takes no more loads): each Lookup still held is given
        back now, and each answered from now on (a lookup the close drains) as it comes:
        the room it holds may be what a launched load waits for."""
        self._closing = True
        for lookup in list(self._lookups):
            lookup.release()
        self._lookups.clear()

    def expire(self, request: Request) -> None:
        """A request with no answer by its deadline (engine.request_timeout_ms) fails with
        :meth:`_past_deadline`'s error; an offload is detached first."""
        if not request.future.done():
            self.detach(request)
        self.resolve(request, self._past_deadline(request))

    def detach(self, request: Request) -> None:
        """An offload's caller stops waiting without its answer, and may reuse its pages
        once told: tell the store first (stores.base.Detaches), on this thread, before the
        caller can hear it. The stage goes TERMINAL before the task id is read: a store
        thread that launches the offload after that read writes the id before it reads the
        stage (worker.rounds), so that it either finds TERMINAL and launches nothing, or
        wrote the id this read finds."""
        detach = self.detach_task
        if detach is None or request.kind is not _OFFLOAD:
            return
        request.stage = TERMINAL
        task_id = request.task_id
        if task_id is None:
            return
        try:
            detach(task_id)
        except Exception:  # the caller's answer goes on; the store may keep what it read
            log.exception("aiokv: store.detach(%s) failed", task_id)

    def _late(self, request: Request, outcome: object) -> StoreError | RequestTimeout:
        """The error for an answer (not an error) that came after its request's deadline,
        before the deadline's timer ran: both loops run the callbacks that are ready
        before the timers that came due meanwhile, and a loop that lags (under overload)
        finds the two ready at once. The answer is late whoever is to blame (the store,
        the loop), and the caller was promised its result by the deadline or an error:
        it gets what :meth:`expire` would have given it had its timer run first, and a
        lookup's reservation goes back to the store (nobody will hold it). An offload's
        answer came, so its copy ended before its caller was told anything: the store
        keeps what it wrote, bytes the caller's pages held before it could reuse them
        (one whose timer ran first was detached instead: :meth:`detach`)."""
        if isinstance(outcome, LookupGrant) and outcome.reservation is not None:
            outcome.reservation.release()
        return self._past_deadline(request)

    def _past_deadline(self, request: Request) -> StoreError | RequestTimeout:
        """What a request past its deadline fails with, whichever comes first, its timer
        or a late answer: RequestTimeout, or StoreFull for an offload that waited for
        room and never found it (:mod:`aiokv.space`). One that found room on a retry was
        launched (its task id): it is late like any other."""
        space = self.space
        if space is not None and request.task_id is None and space.waited(request):
            return space.give_up(request)
        return RequestTimeout(
            f"{request.kind.name.lower()} not done within "
            f"engine.request_timeout_ms={self._request_timeout_ms}"
        )

    def dropped(self, request: Request) -> None:
        """A request that never reached the store thread: a load gives back the
        reservation it consumed."""
        if request.reservation is not None:
            request.reservation.release()

    def dispatch_failed(self, requests: Sequence[Request], exc: Exception) -> None:
        """A batch the batcher could not hand to the store thread: it fails alone."""
        if isinstance(exc, EngineClosed):
            error: Exception = exc
        else:
            log.error("aiokv: dispatching a batch of %d failed", len(requests), exc_info=exc)
            error = StoreError(f"batch failed before reaching the store: {exc!r}")
            error.__cause__ = exc
        for request in requests:
            self.dropped(request)
            self.resolve(request, error)

    def finished(self, request: Request, keep_room: bool = False) -> None:
        """A request's future is done (resolved, or cancelled by its caller): it leaves
        the engine. Called once per accepted request, by resolve or by the engine on
        cancellation; not a done-callback, which would cost a loop callback. Its outcome
        is counted where its caller takes it (the engine's ``_run``). ``keep_room``: its
        room stays taken for a second try (admission.Admission.leave)."""
        if request.stage is not TERMINAL:  # (detach may have written it)
            request.stage = TERMINAL  # the store thread stops caring about it from now on
        if request.timer is not None:  # its own deadline timer: it must not keep it alive
            request.timer.cancel()
            request.timer = None
        space = self.space
        if space is not None and space.waits:
            space.forget(request)
        self._admission.leave(request, keep_room)
        self._stats.record_resolved(request)
        if self._admission.idle():
            self._idle.set()

    def give_back_kept(self) -> None:
        """No second try comes of a refusal that kept its room (Admission.give_back_kept):
        that call is over, and a drain close may be waiting for it."""
        self._admission.give_back_kept()
        if self._admission.idle():
            self._idle.set()


def settle(future: asyncio.Future[Any], outcome: object) -> None:
    """Resolve a future that is not a request's (an evict or clear: nothing is counted),
    on the loop, unless it is already done (its caller cancelled it, or it failed at
    close). The other half of :meth:`Resolver.resolve`, the one place futures resolve."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


# The thread futures aiokv took out of PENDING or CANCELLED (set running, or marked
# notified): set_running_or_notify_cancel() can run once per future (again, it logs
# CRITICAL and raises), and two parties may finish one (a layerwise load's hand-out on
# the loop, and its call's end, which a caller's cancel runs in the caller's thread).
# done() cannot tell who is first: a cancel from another thread lands between any check
# and the transition. The first to claim a future finishes it; the others leave it alone.
_claiming = threading.Lock()
_claimed: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()


def finish_thread_future(
    future: concurrent.futures.Future[Any],
    outcome: object,
    decided: Callable[[bool], None] | None = None,
) -> bool:
    """Resolve a thread's future (``run_in_background``'s) with ``outcome``, from any
    thread, unless another call (from this or any thread) finished it first; a
    cancellation as ``outcome`` cancels it. One its caller cancelled is marked notified
    here, so that ``concurrent.futures.wait`` counts it done (``cancel()`` wakes
    ``result()``, not ``wait``'s waiters), as ``run_coroutine_threadsafe``'s are; the
    caller's cancel may come at any moment, and ``set_running_or_notify_cancel`` decides
    that race under the future's lock. Whether ``outcome`` reached the future (False: it
    was cancelled first, or finished by another call), also told to ``decided`` once
    known, before the future's waiters can see ``outcome``."""
    with _claiming:  # only the claim: finishing runs the future's callbacks, any code
        first = future not in _claimed
        _claimed.add(future)
    reached = False
    try:
        if first:
            if isinstance(outcome, (asyncio.CancelledError, concurrent.futures.CancelledError)):
                future.cancel()
            # False: cancelled, and its waiters are told now.
            reached = future.set_running_or_notify_cancel()
        if decided is not None:
            decided(reached)
    finally:  # whatever ``decided`` raised, a running future is finished
        if reached:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
    return reached
