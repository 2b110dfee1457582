"""Admission control: ``max_pending`` and the ``overload`` policy.

The live set holds every accepted, unresolved request; it is the one count that
``max_pending`` bounds (EngineStats' ``pending`` also holds answers their callers have
not taken yet: :mod:`.takers`). With ``overload: wait``, callers queue FIFO for room,
at most :func:`max_waiting` of them (one more is refused with Overloaded at once, so at
most ``max_pending + max_waiting(max_pending)`` requests exist whatever the arrival
rate), each until its ``request_timeout_ms``, which runs from the call: the request keeps that
deadline once accepted. A request that leaves wakes the first waiter and promises it the
room: until that waiter runs, the room is not free to anyone else (a caller arriving in
between queues behind it). A woken caller cancelled before it runs passes the room on;
a waiter whose timeout fires before it is woken is skipped, and one woken before its
timeout fires keeps the room.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from ..config import EngineConfig
from ..errors import Overloaded, RequestTimeout
from ..requests import Kind, Request
from ..stats import StatsRecorder
from . import takers

# Callers that may wait for room: WAITERS_PER_ROOM per room (max_pending), and at least
# MIN_WAITERS. A caller behind W others waits for W + 1 requests to finish; past a few
# rounds of max_pending it would more likely time out than be served, and an unbounded
# queue of waiters is unbounded memory (a waiter holds a Request, its future and the
# caller's suspended coroutine: a few KiB). The floor keeps a small max_pending from
# refusing a modest burst.
WAITERS_PER_ROOM = 4
MIN_WAITERS = 64


def max_waiting(max_pending: int) -> int:
    """How many callers may wait for room under ``overload: wait``."""
    return max(WAITERS_PER_ROOM * max_pending, MIN_WAITERS)


class _NoRoomInTime(Exception):
    """Set on a waiter whose request_timeout_ms passed (never leaves this module)."""


def _time_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_exception(_NoRoomInTime())


class Admission:
    def __init__(self, config: EngineConfig, stats: StatsRecorder) -> None:
        self._config = config
        self._stats = stats
        self.live: set[Request] = set()  # accepted and not yet resolved
        # Each waiter resolves True when it is promised a room, False when woken only to
        # look again (the engine is closing).
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._promised = 0  # rooms promised to woken waiters that have not run yet
        # Rooms kept by offloads the store refused, for their second try (leave's keep):
        # the same call, accepted once, which neither waits for room nor is turned away.
        self._kept = 0
        self._waiting = 0  # callers inside wait_for_room, at most _max_waiting
        self._max_waiting = max_waiting(config.max_pending)

    def has_room(self) -> bool:
        return len(self.live) + self._promised + self._kept < self._config.max_pending

    def idle(self) -> bool:
        """No call accepted and unfinished: none live, and no refusal's room kept for its
        second try (a call that goes on, which a drain close must wait for)."""
        return not self.live and not self._kept

    def admit(self, request: Request) -> None:
        self.live.add(request)

    def leave(self, request: Request, keep: bool = False) -> None:
        """``request`` is resolved. ``keep``: its room stays taken, for a second try of
        the same call (an offload the store refused, engine.offload's ``_again``), until
        :meth:`take_kept` or :meth:`give_back_kept`, which its caller calls as its task
        runs again, before anything else it does."""
        self.live.discard(request)
        if keep:
            self._kept += 1
        elif self._waiters:
            self._wake_one()

    def take_kept(self) -> None:
        """The second try takes the room its first kept (:meth:`admit` follows at
        once), whatever waits for room."""
        self._kept -= 1

    def give_back_kept(self) -> None:
        """No second try came of a refusal that kept its room: free for anyone now."""
        self._kept -= 1
        if self._waiters:
            self._wake_one()

    def wake_all(self) -> None:
        """Wake every waiter without a promise: they look at ``running()`` again and
        leave (the engine is closing)."""
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(False)

    async def wait_for_room(self, running: Callable[[], bool], kind: Kind) -> float | None:
        """Return once there is room (or ``running()`` turned false): the request's
        deadline (loop time, from this call; None without request_timeout_ms). Raises
        Overloaded under ``overload: reject`` or when ``max_pending`` callers wait
        already, RequestTimeout when ``request_timeout_ms`` passes (each counted as a
        rejected call of ``kind``).

        Not ``asyncio.wait_for``: on Python 3.11 it returns the waiter's result when the
        caller is cancelled just after the waiter was woken (the cancellation is lost),
        and on 3.12 a waiter woken as its timeout fires raises TimeoutError, and the room
        it was promised would be lost with it."""
        if self._config.overload == "reject":
            takers.count(self._stats.record_rejected, kind)
            raise Overloaded(f"{self._config.max_pending} requests pending (engine.max_pending)")
        if self._waiting >= self._max_waiting:
            takers.count(self._stats.record_rejected, kind)
            raise Overloaded(
                f"{self._config.max_pending} requests pending (engine.max_pending) and "
                f"{self._waiting} callers waiting for room, the most that may wait"
            )
        loop = asyncio.get_running_loop()
        timeout_ms = self._config.request_timeout_ms
        deadline = loop.time() + timeout_ms / 1e3 if timeout_ms else None
        self._waiting += 1
        try:
            await self._wait(loop, deadline, running, kind)
        finally:
            self._waiting -= 1
        return deadline

    async def _wait(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float | None,
        running: Callable[[], bool],
        kind: Kind,
    ) -> None:
        timeout_ms = self._config.request_timeout_ms
        while not self.has_room() and running():
            waiter: asyncio.Future[bool] = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_at(deadline, _time_out, waiter) if deadline is not None else None
            try:
                promised = await waiter
            except _NoRoomInTime:
                takers.count(self._stats.record_rejected, kind)
                raise RequestTimeout(
                    f"no room among {self._config.max_pending} pending requests within "
                    f"engine.request_timeout_ms={timeout_ms}"
                ) from None
            except BaseException:  # cancelled: re-raised, never swallowed
                if not waiter.done():
                    waiter.cancel()
                # exception() also marks a timeout that lost the race as retrieved.
                elif not waiter.cancelled() and waiter.exception() is None and waiter.result():
                    self._promised -= 1  # woken with a room, then cancelled: pass it on
                    self._wake_one()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if promised:
                self._promised -= 1  # the room is this caller's: has_room() now sees it

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._promised += 1
                waiter.set_result(True)
                return
