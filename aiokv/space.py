"""Backpressure: an offload that finds no room waits for it, instead of failing at once.

A store answers a put_match with NoSpace (the caller's StoreFull) when a tier is full of
blocks it may not evict yet: FlexKV keeps a put's CPU blocks locked until their SSD write
ends, the local store keeps host blocks until their SSD copy is done, a lookup's
reservation holds its blocks until the load; the embedded store and the store server also
answer NoSpace to a put of pages another put is still writing (a failed write rolls them
back: :mod:`aiokv.stores.local.claims`), and so does FlexKV's adapter. That room comes
back on its own, so such an offload is held here and matched again in a later window:

- at once when the store reports a task terminal (an offload or load resolved: its blocks
  may be free now), or
- after a backoff: :data:`BACKOFF_MIN_S`, doubling with each no-space answer in a row, up
  to :data:`BACKOFF_MAX_S`.

Nothing spins: every new match follows a store event or a timer. The offload gives up at
its deadline, ``request_timeout_ms`` after it was accepted (with ``request_timeout_ms: 0``,
:data:`NO_TIMEOUT_WAIT_S` after its first no-space answer): then, and only then, its caller
gets StoreFull, "no room even after waiting". A close that drains lets waiting offloads
go on trying (up to the drain's timeout); a close without drain fails them with
EngineClosed at once, and so is one whose retry was on its way to the store and came
back without room after the close: the close ended its wait, not its deadline.

Held on the loop and re-queued into the batcher, not kept on the store thread: a retry is
an offload like any other (fused into its batch's one host copy, matched with the batch,
planned by plans.py with its exactly-once bookkeeping), deadlines and resolution already
live on the loop, and the store thread keeps no request across rounds (holding a request
there would pin its batch's fused slots and need a second clock beside the inbox wait).
Re-queued offloads go to the head of the queue, before newer ones: what frees up goes to
those that waited longest.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import EngineClosed, StoreFull
from .requests import OffloadResult, Request
from .stats import StatsRecorder

BACKOFF_MIN_S = 0.002  # the first wait after a no-space answer
BACKOFF_MAX_S = 0.05  # the backoff doubles up to this
NO_TIMEOUT_WAIT_S = 30.0  # how long an offload waits for room with request_timeout_ms: 0
_TIMER_SLACK_S = 0.001
_FORGET_S = 60.0  # an evict's time is kept this long past the longest wait for room


def give_up_at(submitted_s: float, first_wait_s: float, request_timeout_ms: int) -> float:
    """When an offload stops waiting for room: its deadline (``request_timeout_ms`` after
    ``submitted_s``), or ``NO_TIMEOUT_WAIT_S`` after its first wait when there is none."""
    if request_timeout_ms:
        return submitted_s + request_timeout_ms / 1e3
    return first_wait_s + NO_TIMEOUT_WAIT_S


def next_try_at(now_s: float, give_up_s: float, tries: int) -> float | None:
    """When an offload whose last ``tries`` matches (1 or more) all found no room matches
    again: after ``BACKOFF_MIN_S * 2 ** (tries - 1)``, at most ``BACKOFF_MAX_S``, and no
    later than ``give_up_s``. None once ``now_s`` reached ``give_up_s``: it fails."""
    if now_s >= give_up_s:
        return None
    backoff = BACKOFF_MIN_S * 2.0 ** min(tries - 1, 32)  # capped exponent: no overflow
    return min(now_s + min(backoff, BACKOFF_MAX_S), give_up_s)


@dataclass(slots=True)
class _Wait:
    """One offload that got no room, from its first no-space answer until it resolves."""

    tries: int  # no-space answers so far
    give_up_s: float
    last: StoreFull  # the store's latest answer (the cause of the final error)
    held_since: float | None  # on hold since then; None while it is matched again


class SpaceWaits:
    """Offloads waiting for room (loop thread only). ``requeue`` puts requests back into
    the batcher (:meth:`Batcher.requeue`); ``resolve`` is the Resolver's, for those that
    give up."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_timeout_ms: int,
        stats: StatsRecorder,
        requeue: Callable[[Sequence[Request]], None],
        resolve: Callable[[Request, object], None],
        clock: Callable[[], float] = time.perf_counter,  # Request.submitted_at's clock
    ) -> None:
        self._loop = loop
        self._timeout_ms = request_timeout_ms
        self._stats = stats
        self._requeue = requeue
        self._resolve = resolve
        self._clock = clock
        self.waits: dict[Request, _Wait] = {}  # every offload that waited and is pending
        self._held: list[tuple[float, int, Request]] = []  # heap: (due, seq, request)
        self._seq = itertools.count()  # ties in the heap: first held, first out
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._closed = False
        # When each key was last evicted, and the store cleared (the clock's time).
        self._evicted_at: dict[tuple[str, ...], float] = {}
        self._cleared_at = -math.inf

    def hold(self, request: Request, error: StoreFull) -> object | None:
        """An offload's match found no room: hold it for a later try (None), or what to
        resolve it with now: StoreFull past its deadline, EngineClosed once closed, or
        nothing stored (its key was evicted since it was accepted: :meth:`superseded`)."""
        if request.future.done():
            return error  # its caller left, or it timed out: nothing to wait for
        if self._dropped_since(request):
            self.forget(request)
            return OffloadResult(request.user_id, 0, 0)
        now = self._clock()
        wait = self.waits.get(request)
        if wait is None:
            wait = _Wait(0, give_up_at(request.submitted_at, now, self._timeout_ms), error, None)
            self.waits[request] = wait
        wait.tries += 1
        wait.last = error
        if self._closed:
            # Its retry was on its way to the store as the engine closed: the close ends
            # the wait (as it does a held one's), well before its deadline.
            self.forget(request)
            closed = EngineClosed("engine closed while this offload waited for room")
            closed.__cause__ = error.__cause__ or error  # the store's own NoSpace
            return closed
        due = next_try_at(now, wait.give_up_s, wait.tries)
        if due is None:
            return self._give_up(request, wait)
        self._stats.space_waits += 1
        self._stats.record_requeue((request,))  # queued again: EngineStats.queued counts it
        wait.held_since = now
        heapq.heappush(self._held, (due, next(self._seq), request))
        self._arm(due, now)
        return None

    def room_may_have_freed(self) -> None:
        """The store reported tasks terminal: every held offload tries again now."""
        if self._held:
            self._release(len(self._held))

    def waited(self, request: Request) -> bool:
        """Whether this pending offload has found no room at least once."""
        return request in self.waits

    def give_up(self, request: Request) -> StoreFull:
        """The StoreFull for an offload that waited and reached its deadline."""
        return self._give_up(request, self.waits[request])

    def forget(self, request: Request) -> None:
        """A request resolved (any outcome): stop tracking it. Its heap entry, if any,
        is skipped when it comes due."""
        wait = self.waits.pop(request, None)
        if wait is not None and wait.held_since is not None:
            self._stats.space_wait_s += self._clock() - wait.held_since

    def superseded(self, namespace: tuple[str, ...] | None) -> list[Request]:
        """An evict of ``namespace`` (None: a clear) is about to run, after every call
        the engine accepted before it: an offload of the key accepted before it that
        waits for room would store what the evict drops. The held ones are taken off
        hold and returned, for the engine to resolve with nothing stored; one that comes
        back without room later (it was on its way to a match) is answered so by
        :meth:`hold`."""
        now = self._clock()
        if namespace is None:
            self._cleared_at = now
            self._evicted_at.clear()
        else:
            self._evicted_at.pop(namespace, None)  # to the end: the dict is in time order
            self._evicted_at[namespace] = now
            # An entry only matters to offloads accepted before it and still pending,
            # which a timeout (or the wait for room's own bound) ends well before this.
            horizon = now - (max(self._timeout_ms / 1e3, NO_TIMEOUT_WAIT_S) + _FORGET_S)
            while self._evicted_at and next(iter(self._evicted_at.values())) < horizon:
                del self._evicted_at[next(iter(self._evicted_at))]
        out = [entry[2] for entry in sorted(self._held)
               if (wait := self.waits.get(entry[2])) is not None
               and wait.held_since is not None and not entry[2].future.done()
               and namespace in (None, entry[2].namespace)]
        for request in out:
            self.forget(request)  # its heap entry is skipped when it comes due
        return out

    def _dropped_since(self, request: Request) -> bool:
        """An evict or clear of the request's key came after it was accepted."""
        at = max(self._cleared_at, self._evicted_at.get(request.namespace, -math.inf))
        return request.submitted_at <= at

    def close(self) -> list[Request]:
        """Stop: no more tries. Returns the held requests (still pending) for the engine
        to fail."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held = [entry[2] for entry in sorted(self._held) if entry[2] in self.waits]
        self._held.clear()
        return held

    # ---- internals -----------------------------------------------------------------

    def _give_up(self, request: Request, wait: _Wait) -> StoreFull:
        self.forget(request)
        bound = (f"engine.request_timeout_ms={self._timeout_ms}" if self._timeout_ms
                 else f"{NO_TIMEOUT_WAIT_S:g} s, the wait for room without "
                      "engine.request_timeout_ms")
        error = StoreFull(f"{wait.last} (no room after {wait.tries} tries within {bound})")
        error.__cause__ = wait.last.__cause__  # the store's own NoSpace
        return error

    def _arm(self, due: float, now: float) -> None:
        """Run the timer for the earliest due entry (``due``, just pushed, may be it)."""
        if self._timer is not None:
            if self._timer_at <= due:
                return
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_later(max(0.0, due - now), self._fire)

    def _fire(self) -> None:
        self._timer = None
        # Loops run a timer up to their clock's resolution early: count those as due.
        now = self._clock() + _TIMER_SLACK_S
        self._release(sum(1 for entry in self._held if entry[0] <= now))

    def _release(self, count: int) -> None:
        """Re-queue the ``count`` earliest held offloads, then re-arm for the rest."""
        now = self._clock()
        out: list[Request] = []
        for _ in range(count):
            _, _, request = heapq.heappop(self._held)
            wait = self.waits.get(request)
            if wait is None or wait.held_since is None:
                continue  # resolved meanwhile (forgotten), or already on its way
            if request.future.done():
                self.forget(request)
                continue
            self._stats.space_wait_s += now - wait.held_since
            wait.held_since = None
            out.append(request)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held:
            self._arm(self._held[0][0], now)
        if out:
            self._requeue(out)
