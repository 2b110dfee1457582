"""Counters, fixed-bucket histograms (:mod:`aiokv.histograms`) and recent samples;
:class:`EngineStats` is their snapshot and :class:`Reading` the raw copy a Prometheus
scrape (aiokv.metrics) reads.

One writer per piece of state, so nothing here takes a lock: the event loop writes
:class:`StatsRecorder` (``record_submit`` at accept, ``record_rejected`` when admission
turns a call away, ``record_batch`` at dispatch, ``record_resolved`` as an accepted
request's future is done and ``record_outcome`` once its caller took the outcome or left
(:mod:`aiokv.loop.takers`), ``record_call`` per evict or clear, ``record_empty_load``);
the store thread writes its latency histogram and keeps the store's own figures (both in
:mod:`aiokv.store_figures`).

Counters and buckets are preallocated Python lists, never resized: a list item is
incremented without the conversions to and from a C integer of an ``array`` or numpy
item, several times per request. Readers on other threads copy each list with one
``list.copy()``, a single C call made under the GIL, so no list is read half-written.
Every counter lives in one list: the counts of one reading agree with each other (a
histogram copied a moment later may be a few observations ahead). ``pending`` and
``queued`` are derived from them, never counted separately; the ``space_*`` counters are
changed by :class:`aiokv.space.SpaceWaits` alone. ``d2h_copies`` is the store's own
(its ``store_stats()``: the copies its launches made of page ids).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import RequestTimeout
from .histograms import LATENCY_BOUNDS_S as LATENCY_BOUNDS_S
from .histograms import Histogram as Histogram  # public here too, as before
from .histograms import HistogramReading as HistogramReading
from .requests import Kind, LoadResult, Lookup, LookupGrant, OffloadResult, Request
from .store_figures import StoreSideStats as StoreSideStats  # public here too, as before
from .store_figures import StoreStatsAnswer as StoreStatsAnswer  # public here too, as before
from .store_figures import StoreStatsQuery as StoreStatsQuery
from .store_figures import engine_fields

if TYPE_CHECKING:
    from .loop.batcher import Batch

_SAMPLES = 65_536  # recent latencies and batch sizes kept for EngineStats' percentiles

# Label values of aiokv_requests_total, in the order of the counts table.
KINDS = ("offload", "lookup", "load", "evict", "clear")
OUTCOMES = ("ok", "failed", "cancelled", "rejected", "timed_out")
_OK, _FAILED, _CANCELLED, _REJECTED, _TIMED_OUT = range(len(OUTCOMES))
_WIDTH = len(OUTCOMES)
# A request's row by its Kind's value (a list indexed by the IntEnum: no hashing on the
# hot path). A Kind whose name is not in KINDS fails here, at import, not at a scrape.
_ROW = [0] * (max(Kind) + 1)
for _kind in Kind:
    _ROW[_kind] = KINDS.index(_kind.name.lower())
_LOOKUP_ROW = KINDS.index("lookup")
# The rows of calls made as Requests: what ``submitted`` and EngineStats' outcome counts
# cover. The other kinds (evict, clear) come through record_call.
_REQUEST_ROWS = tuple(sorted(set(_ROW)))

# The counters after the kinds x outcomes table.
_TABLE = len(KINDS) * _WIDTH
(
    _SUBMITTED,
    _DISPATCHED,  # requests handed to the store thread in batches (a retry each time)
    _REQUEUED,  # offloads held to match again after no room (space.py)
    _RESOLVED_QUEUED,  # resolved while queued (cancelled, timed out, closed)
    _BATCHES,
    _OFFLOADED_TOKENS,
    _LOADED_TOKENS,
    _LOOKUP_TOKENS,  # asked by completed lookups
    _LOOKUP_HIT_TOKENS,  # found for them
    _DROPPED_TOKENS,  # dropped by evicts and clears (record_dropped)
    _EMPTY_LOADS,  # loads of a Lookup that found nothing (record_empty_load)
) = range(_TABLE, _TABLE + 11)
_COUNTERS = _TABLE + 11

BATCH_REQUEST_BOUNDS = tuple(float(2**i) for i in range(13))  # 1 .. 4096
BATCH_BYTE_BOUNDS = tuple(float(4**i) for i in range(6, 19))  # 4 KiB .. 64 GiB


@dataclass(frozen=True)
class Reading:
    """One copy of the loop's counters and histograms (any thread may take it)."""

    counts: list[int]
    latency: HistogramReading  # submit -> resolved, one row per KINDS
    window: HistogramReading  # submit -> dispatched
    batch_requests: HistogramReading  # per dispatched batch, one row per KINDS
    batch_bytes: HistogramReading  # per offload / load batch, one row per KINDS

    def requests(self, kind: str, outcome: str) -> int:
        return self.counts[KINDS.index(kind) * _WIDTH + OUTCOMES.index(outcome)]

    def outcome_total(self, outcome: str) -> int:
        """Calls made as Requests (offload, lookup, load) that ended with ``outcome``."""
        column = OUTCOMES.index(outcome)
        return sum(self.counts[row * _WIDTH + column] for row in _REQUEST_ROWS)

    @property
    def submitted(self) -> int:
        return self.counts[_SUBMITTED]

    @property
    def resolved(self) -> int:
        """Accepted requests whose outcome is counted: their callers took it or left
        (rejected ones were never accepted)."""
        return sum(self.outcome_total(o) for o in ("ok", "failed", "cancelled", "timed_out"))

    @property
    def pending(self) -> int:
        return self.counts[_SUBMITTED] - self.resolved

    @property
    def queued(self) -> int:
        """Accepted, not resolved and not at the store thread: in the batcher's queue, or
        held to match again after no room. Every request enters once at submit, an offload
        once more per no-room answer (record_requeue) and per second try after a refusal
        (record_again); each entry ends in one dispatch or one resolution while queued."""
        counts = self.counts
        return (
            counts[_SUBMITTED] + counts[_REQUEUED]
            - counts[_DISPATCHED] - counts[_RESOLVED_QUEUED]
        )

    @property
    def batches(self) -> int:
        return self.counts[_BATCHES]

    @property
    def offloaded_tokens(self) -> int:
        return self.counts[_OFFLOADED_TOKENS]

    @property
    def loaded_tokens(self) -> int:
        return self.counts[_LOADED_TOKENS]

    @property
    def lookup_tokens(self) -> int:
        return self.counts[_LOOKUP_TOKENS]

    @property
    def lookup_hit_tokens(self) -> int:
        return self.counts[_LOOKUP_HIT_TOKENS]

    @property
    def dropped_tokens(self) -> int:
        return self.counts[_DROPPED_TOKENS]

    @property
    def empty_loads(self) -> int:
        return self.counts[_EMPTY_LOADS]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. ``pending``: accepted, their outcome not yet taken by their callers
    (an answer is until the caller's task runs again, a thread's until its future is
    finished); ``queued``: of those, neither resolved nor dispatched to the store thread.
    ``store_tasks_open``: store ids matched or launched and not yet terminal. Latencies
    are submit-to-resolve, in ms, over the most recent completed requests; bytes count KV
    moved by completed requests (a caller that left before it took its result: a
    cancelled one). ``lookup_tokens``: tokens asked by completed lookups,
    ``lookup_hit_tokens``: found for them. The outcome counts are of offloads, lookups and
    loads; evicts and clears have fields of their own. Every field, its unit and meaning:
    the README's field reference."""

    submitted: int
    completed: int
    failed: int
    cancelled: int
    rejected: int
    timed_out: int
    batches: int
    d2h_copies: int
    pending: int
    store_tasks_open: int
    offloaded_tokens: int
    loaded_tokens: int
    bytes_offloaded: int
    bytes_loaded: int
    mean_batch_requests: float
    latency_p50_ms: float
    latency_p99_ms: float
    queued: int
    lookup_tokens: int
    lookup_hit_tokens: int
    # Backpressure (space.py): no-space answers after which an offload waited to match
    # again, and the time offloads spent waiting so, in ms, summed over them.
    space_waits: int = 0
    space_wait_ms: float = 0.0
    store_restarts: int = 0  # the store's backend started again after it died (own_process)
    # ---- evicts, clears, empty loads; the store's tiers (store_figures.py) ----
    # Calls answered (failures: aiokv_requests_total), and the tokens they dropped.
    evicts: int = 0
    clears: int = 0
    dropped_tokens: int = 0
    # Loads of a Lookup with cached_tokens == 0: answered at once, without the store
    # (counted in submitted and completed too, but not in the latencies).
    empty_loads: int = 0
    # The store's own figures (0 where it reports none, as FlexKV): at most
    # store_figures.REFRESH_S old while it works, final after close. Tokens lookups found
    # on the host tier / only on SSD; bytes SSD <-> host; SSD blocks that failed their
    # checksum and those a read could not bring (misses both) and SSD writes that failed;
    # blocks used and total per tier.
    host_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    bytes_ssd_written: int = 0
    bytes_ssd_read: int = 0
    checksum_failures: int = 0
    ssd_read_errors: int = 0
    ssd_write_errors: int = 0
    # Host blocks evicted without an SSD copy: every SSD slot held, none by I/O in flight.
    ssd_full_drops: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    ssd_blocks_used: int = 0
    ssd_blocks_total: int = 0
    # Loads whose SSD pages found no host room at launch and waited for it.
    stage_waits: int = 0
    # The remote tier (store.remote; 0 without one): the README's field reference.
    remote_hits: int = 0
    remote_misses: int = 0
    remote_hit_tokens: int = 0
    bytes_remote_written: int = 0
    bytes_remote_read: int = 0
    remote_checksum_failures: int = 0
    remote_dropped_writes: int = 0
    remote_errors: int = 0
    remote_lookup_mean_ms: float = 0.0
    remote_lookup_max_ms: float = 0.0

    @property
    def hit_ratio(self) -> float:
        """lookup_hit_tokens / lookup_tokens (0.0 before any lookup completed)."""
        return self.lookup_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class StatsRecorder:
    """The engine's counters and histograms. Written on the loop thread only."""

    def __init__(self, bytes_per_page: int = 0) -> None:
        self._bytes_per_page = bytes_per_page  # a batch's bytes: its pages times this
        self._counts = [0] * _COUNTERS
        self.latency = Histogram(LATENCY_BOUNDS_S, len(KINDS))
        self.window = Histogram(LATENCY_BOUNDS_S)
        self.batch_requests = Histogram(BATCH_REQUEST_BOUNDS, len(KINDS))
        self.batch_bytes = Histogram(BATCH_BYTE_BOUNDS, len(KINDS))
        self.space_waits = 0  # changed by SpaceWaits alone, as space_wait_s
        self.space_wait_s = 0.0
        self._latencies_s: deque[float] = deque(maxlen=_SAMPLES)
        self._batch_sizes: deque[int] = deque(maxlen=_SAMPLES)
        # Answered requests whose callers have not taken the outcome yet, by row: what
        # settle_orphaned counts where those callers never will (their loop is gone).
        self._untaken = [0] * len(KINDS)
        self._settled = False  # by settle_orphaned: no outcome is counted after it

    def record_submit(self) -> None:
        self._counts[_SUBMITTED] += 1

    def record_rejected(self, kind: Kind, taken: bool = True) -> None:
        """A call admission turned away (never accepted: no latency, not submitted).
        Not counted where its caller never took the refusal (``taken`` False: a thread
        that cancelled its future meanwhile), as a caller cancelled while it waited for
        room is not: neither was accepted."""
        if taken:
            self._counts[_ROW[kind] * _WIDTH + _REJECTED] += 1

    def record_batch(self, batch: Batch) -> None:
        """A batch dispatched now: its requests' window wait (once per call: not again for
        an offload dispatched anew after a wait for room), its size in requests and,
        for offloads and loads, the bytes its pages hold (what it asks to move; pages
        already stored are skipped later, so it may move fewer)."""
        now = time.perf_counter()
        requests = batch.requests
        window = self.window
        counts, bounds = window.counts, window.bounds
        waited = 0.0
        pages = 0
        for request in requests:  # inlined Histogram.observe: this runs per request
            request.dispatched_at = now
            pages += request.pages_used
            if request.held:  # dispatched again after a wait for room: its window is counted
                continue
            wait = now - request.submitted_at
            counts[bisect_left(bounds, wait)] += 1
            waited += wait
        window.sums[0] += waited
        row = _ROW[batch.kind]
        size = len(requests)
        self.batch_requests.observe(size, row)
        if row != _LOOKUP_ROW:
            self.batch_bytes.observe(pages * self._bytes_per_page, row)
        self._counts[_BATCHES] += 1
        self._counts[_DISPATCHED] += size
        self._batch_sizes.append(size)

    def record_again(self, request: Request, first: Request) -> None:
        """An offload's second try accepted, after the store refused its first
        (``first``, answered, its outcome never counted): one call with it, submitted
        once, whose outcome is the second's. Queued once more, as a requeue is, and its
        window is not observed again; its latency runs from the first's submit."""
        request.held = True
        self._untaken[_ROW[first.kind]] -= 1  # counted with the second's outcome
        self._counts[_REQUEUED] += 1

    def record_requeue(self, requests: Sequence[Request]) -> None:
        """Offloads that found no room are held on the loop to match again: queued once
        more, until record_batch dispatches them again (or they resolve first)."""
        for request in requests:
            request.dispatched_at = 0.0
            request.held = True
        self._counts[_REQUEUED] += len(requests)

    def record_resolved(self, request: Request) -> None:
        """An accepted request's future is done (resolved, or cancelled by its caller):
        no longer queued, and its latency ends here. Its outcome is counted once its
        caller takes it (:meth:`record_outcome`)."""
        request.resolved_at = time.perf_counter()
        if request.dispatched_at == 0.0:  # in the queue (record_batch, record_requeue)
            self._counts[_RESOLVED_QUEUED] += 1
        self._untaken[_ROW[request.kind]] += 1

    def record_outcome(self, request: Request, outcome: object, taken: bool = True) -> None:
        """Count the outcome of one resolved request (:meth:`record_resolved`) as its
        caller took it: ``outcome`` is its result, its exception, or None when its caller
        cancelled it, before the answer or after it, before it took it (also ``taken``
        False). The latency, submit to resolved, is observed for every outcome but a
        cancellation (the caller's time, not ours)."""
        if self._settled:  # a caller's coroutine closed after settle_orphaned counted it
            return
        counts = self._counts
        kind_row = _ROW[request.kind]
        self._untaken[kind_row] -= 1
        row = kind_row * _WIDTH  # the request's row in the counts table
        if outcome is None or not taken:
            counts[row + _CANCELLED] += 1
            return
        latency_s = request.resolved_at - request.submitted_at
        if isinstance(outcome, BaseException):
            counts[row + (_TIMED_OUT if isinstance(outcome, RequestTimeout) else _FAILED)] += 1
        else:
            counts[row] += 1  # _OK
            self._latencies_s.append(latency_s)
            if isinstance(outcome, OffloadResult):
                counts[_OFFLOADED_TOKENS] += outcome.stored_tokens
            elif isinstance(outcome, LoadResult):
                counts[_LOADED_TOKENS] += outcome.loaded_tokens
            elif isinstance(outcome, (Lookup, LookupGrant)):  # the caller's, the store's
                counts[_LOOKUP_TOKENS] += request.num_tokens
                counts[_LOOKUP_HIT_TOKENS] += outcome.cached_tokens
        latency = self.latency  # inlined Histogram.observe: this runs per request
        latency.counts[kind_row * latency.width + bisect_left(latency.bounds, latency_s)] += 1
        latency.sums[kind_row] += latency_s

    def record_call(
        self, kind: str, outcome: object, latency_s: float, taken: bool = True
    ) -> None:
        """Count one call of a kind that is not batched as a Request (``evict``,
        ``clear``): ``outcome`` is its result, its exception, or None when its caller
        cancelled it (also ``taken`` False); ``latency_s`` is observed as for
        record_outcome."""
        row = KINDS.index(kind)
        if outcome is None or not taken:
            column = _CANCELLED
        elif isinstance(outcome, BaseException):
            column = _TIMED_OUT if isinstance(outcome, RequestTimeout) else _FAILED
        else:
            column = _OK
        self._counts[row * _WIDTH + column] += 1
        if column != _CANCELLED:
            self.latency.observe(latency_s, row)

    def record_dropped(self, tokens: int) -> None:
        """Tokens an evict or clear dropped, as the store answered it (its caller may have
        left: the store drops them all the same)."""
        self._counts[_DROPPED_TOKENS] += tokens

    def settle_orphaned(self, unanswered: Sequence[Request], error: BaseException) -> None:
        """The engine is closed after its loop was closed without closing it: no caller
        still waiting will take an outcome (their tasks went with that loop), so every
        accepted request is counted now, and ``pending`` is 0 from here on. Those never
        answered (``unanswered``) fail with ``error``, as a close fails those it abandons
        (the EngineClosed a thread waiting on such a layerwise load sees). Those answered
        and never taken count as cancelled, as any outcome its caller never took
        (:mod:`aiokv.loop.takers`): no caller received the answer, so neither its tokens
        nor its latency are counted. Outcome counts are final from here: a caller's
        coroutine closed later (garbage collected) counts nothing more."""
        for request in unanswered:
            self.record_resolved(request)
            self.record_outcome(request, error)
        counts = self._counts
        for kind_row, untaken in enumerate(self._untaken):
            counts[kind_row * _WIDTH + _CANCELLED] += untaken
            self._untaken[kind_row] = 0
        self._settled = True

    def record_empty_load(self, taken: bool = True) -> None:
        """A load of a Lookup that found nothing, answered at once: submitted and
        completed, never queued (resolved before any dispatch); no latency observed (it
        never waits for anything, and would only pull the loads' percentiles down).
        ``taken`` False: its caller (a thread) cancelled it before it took the answer:
        a cancelled load, not an empty one."""
        counts = self._counts
        counts[_SUBMITTED] += 1
        counts[_RESOLVED_QUEUED] += 1
        if not taken:
            counts[_ROW[Kind.LOAD] * _WIDTH + _CANCELLED] += 1
            return
        counts[_ROW[Kind.LOAD] * _WIDTH + _OK] += 1
        counts[_EMPTY_LOADS] += 1

    def record_direct_load(self, outcome: LoadResult | BaseException, latency_s: float) -> None:
        """A load its caller's thread queued itself (:mod:`aiokv.direct`), counted once
        it ended: submitted, never queued (resolved before any dispatch), and its outcome
        with its latency, as :meth:`record_outcome` counts a load's."""
        if self._settled:
            return
        counts = self._counts
        counts[_SUBMITTED] += 1
        counts[_RESOLVED_QUEUED] += 1
        row = _ROW[Kind.LOAD]
        if isinstance(outcome, BaseException):
            counts[row * _WIDTH + _FAILED] += 1
        else:
            counts[row * _WIDTH] += 1  # _OK
            counts[_LOADED_TOKENS] += outcome.loaded_tokens
            self._latencies_s.append(latency_s)
        self.latency.observe(latency_s, row)

    def read(self) -> Reading:
        """A copy of the counters and histograms (safe from any thread)."""
        return Reading(
            self._counts.copy(),
            self.latency.read(),
            self.window.read(),
            self.batch_requests.read(),
            self.batch_bytes.read(),
        )

    def snapshot(
        self,
        store_tasks_open: int,
        bytes_per_token: int,
        store_restarts: int = 0,
        store: StoreStatsAnswer | None = None,
    ) -> EngineStats:
        """The counters now, with the store thread's: its open task ids and the store's latest
        ``store_stats()`` answer (loop thread: the samples are read here)."""
        if self._latencies_s:
            p50, p99 = np.percentile(np.fromiter(self._latencies_s, float), [50, 99]) * 1e3
        else:
            p50 = p99 = 0.0
        mean_batch = float(np.mean(self._batch_sizes)) if self._batch_sizes else 0.0
        now = self.read()
        return EngineStats(
            submitted=now.submitted,
            completed=now.outcome_total("ok"),
            failed=now.outcome_total("failed"),
            cancelled=now.outcome_total("cancelled"),
            rejected=now.outcome_total("rejected"),
            timed_out=now.outcome_total("timed_out"),
            batches=now.batches,
            pending=now.pending,
            store_tasks_open=store_tasks_open,
            offloaded_tokens=now.offloaded_tokens,
            loaded_tokens=now.loaded_tokens,
            bytes_offloaded=now.offloaded_tokens * bytes_per_token,
            bytes_loaded=now.loaded_tokens * bytes_per_token,
            mean_batch_requests=mean_batch,
            latency_p50_ms=float(p50),
            latency_p99_ms=float(p99),
            queued=now.queued,
            lookup_tokens=now.lookup_tokens,
            lookup_hit_tokens=now.lookup_hit_tokens,
            space_waits=self.space_waits,
            space_wait_ms=self.space_wait_s * 1e3,
            store_restarts=store_restarts,
            evicts=now.requests("evict", "ok"),
            clears=now.requests("clear", "ok"),
            dropped_tokens=now.dropped_tokens,
            empty_loads=now.empty_loads,
            **engine_fields(store or {}),
        )
