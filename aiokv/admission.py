"""Admission control: ``max_pending`` and the ``overload`` policy.

The live set holds every accepted, unresolved request; it is the one count of
"pending". With ``overload: wait``, callers queue FIFO for room, bounded by
``request_timeout_ms``; a woken caller that leaves passes its turn on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from .config import EngineConfig
from .errors import Overloaded, RequestTimeout
from .requests import Request
from .stats import StatsRecorder


class Admission:
    def __init__(self, config: EngineConfig, stats: StatsRecorder) -> None:
        self._config = config
        self._stats = stats
        self.live: set[Request] = set()  # accepted and not yet resolved
        self._waiters: deque[asyncio.Future[None]] = deque()

    def has_room(self) -> bool:
        return len(self.live) < self._config.max_pending

    def admit(self, request: Request) -> None:
        self.live.add(request)

    def leave(self, request: Request) -> None:
        self.live.discard(request)
        if self._waiters:
            self._wake_one()

    async def wait_for_room(self, running: Callable[[], bool]) -> None:
        """Return once there is room (or ``running()`` turned false). Raises Overloaded
        under ``overload: reject``, RequestTimeout when ``request_timeout_ms`` passes."""
        if self._config.overload == "reject":
            self._stats.rejected += 1
            raise Overloaded(f"{self._config.max_pending} requests pending (engine.max_pending)")
        loop = asyncio.get_running_loop()
        timeout_ms = self._config.request_timeout_ms
        deadline = loop.time() + timeout_ms / 1e3 if timeout_ms else None
        while not self.has_room() and running():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                self._stats.rejected += 1
                raise RequestTimeout(
                    f"no room among {self._config.max_pending} pending requests within "
                    f"engine.request_timeout_ms={timeout_ms}"
                ) from None
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # we were woken but leave: pass the room on
                raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
