"""The event-loop coroutine that turns awaited calls into batched store rounds.

A window opens at the first queued request and closes ``window_us`` later
(``window_us == 0``: on the next loop iteration). A queue whose live requests (not those
whose callers left) reach ``max_batch_requests`` or ``max_batch_tokens`` closes its window
at once. When a window closes, the queue is planned into batches by
:func:`plan_batches`, a pure function, and each batch is dispatched: handed to the store
thread, which matches it and launches it with its page ids in one call. A batch whose
dispatch fails is failed alone (``on_failed``); the batcher carries on.

Dispatching makes no CUDA call: each torch call gives the GIL away, and winning it back
from a store thread inside a store's Python can take up to Python's switch interval. On
the store thread the same calls cost the loop nothing.

At most about half a millisecond of dispatching runs in one loop iteration (always at
least one batch). A burst of submits (many callers made ready at once) runs in one
iteration. Full batches go out from the ``enqueue`` that filled them while the
iteration's budget lasts (the store thread starts on them while the burst goes on,
instead of after every submit already scheduled), and the batcher task sends the rest in
later iterations, letting other callbacks run in between.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..config import EngineConfig
from ..requests import DISPATCHED, QUEUED, TERMINAL, Kind, Request

# Dispatching in one loop iteration beyond this waits for the next (see the docstring).
DISPATCH_BUDGET_S = 0.0005


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests of one kind dispatched together."""

    kind: Kind
    requests: tuple[Request, ...]


def plan_batches(
    requests: Iterable[Request], max_requests: int, max_tokens: int
) -> list[tuple[Kind, list[Request]]]:
    """Partition queued requests into batches: by kind (GET kinds before PUT), in arrival
    order, each within ``max_requests`` and ``max_tokens``. A request larger than
    ``max_tokens`` forms a batch of its own. Pure: no loop, no GPU, no store."""
    requests = list(requests)
    if requests:  # the usual window: one kind, within both limits, so one batch
        kind, tokens = requests[0].kind, 0
        for request in requests:
            if request.kind is not kind:
                break
            tokens += request.num_tokens
        else:
            if len(requests) <= max_requests and tokens <= max_tokens:
                return [(kind, requests)]
    by_kind: dict[Kind, list[Request]] = {kind: [] for kind in Kind}
    for request in requests:
        by_kind[request.kind].append(request)
    plan: list[tuple[Kind, list[Request]]] = []
    for kind in sorted(Kind):
        current: list[Request] = []
        tokens = 0
        for request in by_kind[kind]:
            if current and (
                len(current) >= max_requests or tokens + request.num_tokens > max_tokens
            ):
                plan.append((kind, current))
                current, tokens = [], 0
            current.append(request)
            tokens += request.num_tokens
        if current:
            plan.append((kind, current))
    return plan


class Batcher:
    """Owns the queue of accepted requests and the ``aiokv-batcher`` task."""

    def __init__(
        self,
        config: EngineConfig,
        submit: Callable[[Batch], None],
        on_dropped: Callable[[Request], None],
        on_batch: Callable[[Batch], None],
        on_failed: Callable[[Sequence[Request], Exception], None],
        on_window_closed: Callable[[], None] | None = None,
    ) -> None:
        self._config = config
        self._submit = submit  # hands a batch to the store thread
        self._on_dropped = on_dropped  # a request whose caller left before dispatch
        self._on_batch = on_batch  # stats
        self._on_failed = on_failed  # a batch that could not be dispatched
        self._queue: deque[Request] = deque()  # accepted, in the current window
        self._queued_tokens = 0
        self._planned: deque[tuple[Kind, list[Request]]] = deque()  # window closed, not sent
        self._head_since = 0.0  # loop time at which the queue's first request came
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work = asyncio.Event()  # set while anything is queued or planned
        self._window: asyncio.Future[None] | None = None
        self._draining = False
        self._spent_this_iteration: float | None = None  # dispatching, s; None: none yet
        # Called as each window closes, before its batches go to the store thread (the
        # callers' CUDA events are recorded there: cuda.ReadyMarks).
        self._on_window_closed = on_window_closed

    def __len__(self) -> int:
        """Requests accepted and not yet dispatched."""
        return len(self._queue) + sum(len(requests) for _, requests in self._planned)

    def enqueue(self, request: Request) -> None:
        if not self._queue:
            loop = self._loop or asyncio.get_running_loop()
            self._head_since = loop.time()  # the window runs from the first request
        self._queue.append(request)
        self._queued_tokens += request.num_tokens
        self._work.set()
        if self._full():
            self._send_full()

    def requeue(self, requests: Sequence[Request]) -> None:
        """Put dispatched requests back, at the head of the queue, in order: offloads that
        found no room go before newer ones (:mod:`aiokv.space`)."""
        if not requests:
            return
        if not self._queue:
            self._head_since = (self._loop or asyncio.get_running_loop()).time()
        for request in requests:
            if request.stage is not TERMINAL:  # a caller that left stays gone
                request.stage = QUEUED  # dispatched again from here
        self._queue.extendleft(reversed(requests))
        self._queued_tokens += sum(request.num_tokens for request in requests)
        self._work.set()
        if self._full():
            self._send_full()

    def _send_full(self) -> None:
        self.flush()  # the batcher's window was for requests that leave now
        self._plan_queue()
        while self._planned and self._may_dispatch():
            self._dispatch_next()  # at once: see the module docstring

    def _full(self) -> bool:
        """Whether the window's live requests reach a limit. Callers that left (cancelled,
        timed out) are in no batch of it: were they counted, a window would close for
        fewer requests than it waits for, and the calls after it wait a window more. They
        are dropped only once the queue with them reaches a limit, so that no submit pays
        for a look at the queue otherwise."""
        if not self._at_limit():
            return False
        self._drop_left()
        return self._at_limit()

    def _at_limit(self) -> bool:
        return (
            len(self._queue) >= self._config.max_batch_requests
            or self._queued_tokens >= self._config.max_batch_tokens
        )

    def _drop_left(self) -> None:
        """Drop the queued requests whose callers left (cancelled, timed out)."""
        live: deque[Request] = deque()
        tokens = 0
        for request in self._queue:
            if request.future.done():
                self._on_dropped(request)
            else:
                live.append(request)
                tokens += request.num_tokens
        self._queue = live
        self._queued_tokens = tokens

    def flush(self) -> None:
        """Close the current window now (a limit was reached)."""
        if self._window is not None and not self._window.done():
            self._window.set_result(None)

    def drain(self) -> None:
        """From now on, dispatch without waiting for windows (the engine is closing)."""
        self._draining = True
        self.flush()

    def dispatch_all(self) -> None:
        """Hand everything accepted to the store thread now, in order, whatever the window
        and the iteration's budget (an evict or clear must follow the requests accepted
        before it: aiokv.invalidation)."""
        if self._queue:
            self._plan_queue()
        while self._planned:
            self._dispatch_next()

    def take_queued(self) -> list[Request]:
        """Everything not yet dispatched, planned first, without dispatching it (the
        engine closing without drain)."""
        taken = [request for _, requests in self._planned for request in requests]
        taken.extend(self._queue)
        self._planned.clear()
        self._queue.clear()
        self._queued_tokens = 0
        self._work.clear()
        return taken

    async def run(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        window_s = self._config.window_us / 1e6
        while True:
            if self._planned:
                if self._may_dispatch():
                    self._dispatch_next()
                else:
                    await asyncio.sleep(0)  # the next iteration: other callbacks go first
                continue
            await self._work.wait()
            if self._planned or not self._queue:
                # Full batches planned (from enqueue) beyond the dispatch budget go out
                # before any window opens for a partial batch queued behind them.
                if not self._planned and not self._queue:
                    self._work.clear()
                continue
            if not self._draining and window_s > 0:
                head = self._queue[0]
                self._window = loop.create_future()
                timer = loop.call_at(self._head_since + window_s, self.flush)
                try:
                    await self._window
                finally:
                    timer.cancel()
                    self._window = None
                if not self._draining and self._queue and self._queue[0] is not head:
                    continue  # this window's requests left full; the newer ones get theirs
            elif not self._draining:
                await asyncio.sleep(0)  # one loop iteration: let ready callers enqueue
            if self._queue:  # enqueue may have planned it all meanwhile
                self._plan_queue()

    def _plan_queue(self) -> None:
        """Close the window: its requests become planned batches. Those whose callers
        left (cancelled, timed out) are dropped first, not as their batch goes out: a
        load's Lookup reservation must be back at the store before a lookup of this
        window is matched (lookups go first), or a caller that looks the key up again
        right after its load timed out here finds the pages that reservation holds (SSD
        pages being read in for it) taken: a miss."""
        if self._on_window_closed is not None:
            self._on_window_closed()
        self._drop_left()
        requests = list(self._queue)
        self._queue.clear()
        self._queued_tokens = 0
        self._planned.extend(
            plan_batches(requests, self._config.max_batch_requests, self._config.max_batch_tokens)
        )

    def _dispatch_next(self) -> None:
        kind, planned = self._planned.popleft()
        if not self._planned and not self._queue:
            self._work.clear()
        live: list[Request] = []
        for request in planned:
            # A caller cancelled (or timed out) before dispatch is dropped here: its
            # match is never made.
            if request.future.done():
                self._on_dropped(request)
            else:
                # Before the batch goes on the store thread's inbox (requests.py: threads).
                request.stage = DISPATCHED
                live.append(request)
        if not live:
            return
        if self._spent_this_iteration is None:
            self._spent_this_iteration = 0.0
            (self._loop or asyncio.get_running_loop()).call_soon(self._next_iteration)
        start = time.perf_counter()
        try:
            self._dispatch(kind, live)
        except Exception as exc:  # e.g. a closed worker
            self._on_failed(live, exc)
        finally:
            self._spent_this_iteration += time.perf_counter() - start

    def _may_dispatch(self) -> bool:
        """Whether this loop iteration may dispatch another batch (the module docstring)."""
        spent = self._spent_this_iteration
        return spent is None or spent < DISPATCH_BUDGET_S

    def _next_iteration(self) -> None:
        self._spent_this_iteration = None

    def _dispatch(self, kind: Kind, requests: list[Request]) -> None:
        batch = Batch(kind, tuple(requests))
        self._on_batch(batch)
        self._submit(batch)  # last: once the store thread has the batch, nothing may fail it here
