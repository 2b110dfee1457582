"""Admission control: ``max_pending`` and the ``overload`` policy.

The live set holds every accepted, unresolved request; it is the one count of
"pending". With ``overload: wait``, callers queue FIFO for room, bounded by
``request_timeout_ms``. A request that leaves wakes the first waiter and promises it the
room: until that waiter runs, the room is not free to anyone else (a caller arriving in
between queues behind it). A woken caller cancelled before it runs passes the room on;
a waiter whose timeout fires before it is woken is skipped, and one woken before its
timeout fires keeps the room.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from .config import EngineConfig
from .errors import Overloaded, RequestTimeout
from .requests import Kind, Request
from .stats import StatsRecorder


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

    def has_room(self) -> bool:
        return len(self.live) + self._promised < self._config.max_pending

    def admit(self, request: Request) -> None:
        self.live.add(request)

    def leave(self, request: Request) -> None:
        self.live.discard(request)
        if self._waiters:
            self._wake_one()

    def wake_all(self) -> None:
        """Wake every waiter without a promise: they look at ``running()`` again and
        leave (the engine is closing)."""
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(False)

    async def wait_for_room(self, running: Callable[[], bool], kind: Kind) -> None:
        """Return once there is room (or ``running()`` turned false). Raises Overloaded
        under ``overload: reject``, RequestTimeout when ``request_timeout_ms`` passes
        (both counted as rejected calls of ``kind``).

        Not ``asyncio.wait_for``: on Python 3.11 it returns the waiter's result when the
        caller is cancelled just after the waiter was woken (the cancellation is lost),
        and on 3.12 a waiter woken as its timeout fires raises TimeoutError, and the room
        it was promised would be lost with it."""
        if self._config.overload == "reject":
            self._stats.record_rejected(kind)
            raise Overloaded(f"{self._config.max_pending} requests pending (engine.max_pending)")
        loop = asyncio.get_running_loop()
        timeout_ms = self._config.request_timeout_ms
        deadline = loop.time() + timeout_ms / 1e3 if timeout_ms else None
        while not self.has_room() and running():
            waiter: asyncio.Future[bool] = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_at(deadline, _time_out, waiter) if deadline is not None else None
            try:
                promised = await waiter
            except _NoRoomInTime:
                self._stats.record_rejected(kind)
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
