"""Request deadlines (``request_timeout_ms``) with one timer for the whole engine.

Every request gets the same timeout, so deadlines come due in the order requests were
accepted: a FIFO with one loop timer, armed for its oldest entry, enforces them all. A
timer per request (``call_later`` then ``cancel``) costs about 4 µs under uvloop; an
append costs about 0.1 µs. Resolved requests are not removed when they resolve (that
would need a search); they leave from the head, which in the usual first-in,
first-out traffic is resolved already, and by a compaction when one slow request at the
head holds many resolved ones behind it.

The timer fails the requests that have no answer by their deadline. An answer that comes
after the deadline but before the timer runs is failed where it is resolved
(:meth:`aiokv.loop.resolution.Resolver.resolve`, from ``Request.deadline``). The store
thread launches nothing past ``Request.deadline``, and gives it to stores that wait inside
(:mod:`aiokv.worker.rounds`), on ``time.monotonic()``'s clock: :func:`monotonic_offset_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from ..requests import Request

_MIN_COMPACT = 1024
_SAME_CLOCK_S = 1.0  # a loop clock this close to time.monotonic() is taken to be it


def monotonic_offset_s(loop: asyncio.AbstractEventLoop) -> float:
    """What to add to ``loop.time()`` to read ``time.monotonic()``: 0 where the loop's
    clock is CLOCK_MONOTONIC, as asyncio's is and uvloop's is (floored to the millisecond,
    so never ahead of it): a deadline the loop has seen pass, the store thread and a store
    process on this host see passed too. For a loop on another clock, the difference
    measured now."""
    offset = time.monotonic() - loop.time()
    return offset if abs(offset) > _SAME_CLOCK_S else 0.0


class Deadlines:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        expire: Callable[[Request], None],
    ) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._expire = expire  # resolves a request that is still pending at its deadline
        self._queue: deque[tuple[float, Request]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, request: Request, deadline: float | None = None) -> float:
        """Enforce ``request``'s deadline: ``deadline`` (loop time) when it was set at the
        call (a caller that waited for room), else the timeout from now. Returns the
        deadline enforced."""
        self.prune()
        queue = self._queue
        if deadline is None:
            deadline = self._loop.time() + self._timeout_s
        elif queue and deadline < queue[-1][0]:
            # Earlier than the FIFO's tail (it waited for room while later callers were
            # accepted): a timer of its own keeps the FIFO in deadline order.
            request.timer = self._loop.call_at(deadline, self._expire, request)
            return deadline
        queue.append((deadline, request))
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._fire)
        elif len(queue) > self._compact_at:
            self._compact()
        return deadline

    def prune(self) -> None:
        """Drop the resolved entries at the head. Called as outcomes are resolved, so a
        resolved request is not kept alive by its entry until the next submit (which
        then paid for freeing the previous round's requests, and the garbage collector
        counted them as young survivors in the meantime)."""
        queue = self._queue
        while queue and queue[0][1].future.done():
            queue.popleft()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()

    def _fire(self) -> None:
        self._timer = None
        queue = self._queue
        now = self._loop.time()
        while queue:
            deadline, request = queue[0]
            if request.future.done():
                queue.popleft()
            elif deadline <= now:
                queue.popleft()
                self._expire(request)
            else:
                break
        if queue:
            self._timer = self._loop.call_at(queue[0][0], self._fire)

    def _compact(self) -> None:
        """Drop resolved entries; O(n), run after n/2 appends at least, so O(1) each."""
        self._queue = deque(entry for entry in self._queue if not entry[1].future.done())
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._queue))
