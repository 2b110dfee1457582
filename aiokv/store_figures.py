"""The store's own figures (its ``store_stats()``: tier hits, SSD bytes, errors,
occupancy) as the engine reports them, in :class:`~aiokv.stats.EngineStats` and to
Prometheus scrapes.

Every store call belongs to the store thread, and ``engine.stats()`` runs on the loop,
which must not wait for that thread. So the store thread keeps :class:`StoreFigures`:
the latest answer, replaced whole (one reference assignment, read from any thread). It
asks the store again at most every :data:`REFRESH_S` while the store works, once more
when the work stops (never while idle: nothing changed), for each scrape
(:class:`StoreStatsQuery`), and at the close, before and after ``store.close()`` (which
finishes the SSD writes), so that the figures read after ``aclose()`` are final.
:class:`StoreSideStats` is the store thread's other figure: its latency histogram.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .histograms import LATENCY_BOUNDS_S, Histogram, HistogramReading

if TYPE_CHECKING:
    from .requests import Request

log = logging.getLogger("aiokv")

REFRESH_S = 0.1  # how old the figures in engine.stats() may be while the store works

StoreStatsAnswer = Mapping[str, "int | float"]
AskStore = Callable[[], StoreStatsAnswer]

# The store_stats() keys that EngineStats carries, under the same names (0 where the
# store reports none: FlexKV reports none).
FIELDS = (
    "host_hit_tokens",  # tokens lookups found on the host tier (at the match)
    "ssd_hit_tokens",  # tokens they found only on the SSD tier (read in for the load)
    "bytes_ssd_written",
    "bytes_ssd_read",
    "checksum_failures",
    "ssd_read_errors",  # SSD blocks a read could not bring (I/O error, short file): misses
    "ssd_write_errors",
    "ssd_full_drops",  # host blocks evicted with no SSD copy: every SSD slot was in use
    "host_blocks_used",
    "host_blocks_total",
    "ssd_blocks_used",
    "ssd_blocks_total",
    "stage_waits",  # loads that waited for host room to stage their SSD pages
    "d2h_copies",  # device-to-host copies of page ids the store made for its launches
    # The remote tier (aiokv.remote.link; 0 without one).
    "remote_hits",  # lookups that asked Mooncake and got at least their first block
    "remote_misses",  # lookups that asked Mooncake and got none
    "remote_hit_tokens",  # tokens those hits read into the host tier
    "remote_checksum_failures",
    "remote_dropped_writes",  # blocks not written (store_stats: remote_dropped_<reason>)
    "remote_errors",  # failed or timed-out calls to Mooncake
)
# EngineStats field -> the store_stats() key under another name.
RENAMED = {
    "bytes_remote_written": "remote_bytes_written",
    "bytes_remote_read": "remote_bytes_read",
}


# store_stats() keys that are levels, not counts (and every "server_" one but the server's
# counters): they may fall, and a new store's (a restarted child, a restarted store server)
# are its own. MAXIMA carry as the larger. Every other key counts since the store opened,
# and carries over to the store that replaces it (a store process's child whose store
# resumes its figures, stores.base.ResumesFigures, goes on from them itself instead).
GAUGES = frozenset({
    "host_blocks_used", "host_blocks_total", "host_blocks_ready", "ssd_blocks_used",
    "ssd_blocks_total", "remote_write_queue_blocks", "remote_blocks_held",
    "remote_lookups_open", "remote_invalidations_waiting",
})
SERVER_COUNTERS = frozenset({"server_gets_invalidated"})
MAXIMA = frozenset({"remote_lookup_seconds_max"})


def carried(base: StoreStatsAnswer, figures: StoreStatsAnswer) -> dict[str, int | float]:
    """``figures`` with the counts of the stores before it (``base``) added: a store
    process or server that restarts starts counting again, and the engine's counters must
    not fall. Gauges are ``figures``' own; a maximum is the larger of the two."""
    out: dict[str, int | float] = {k: v for k, v in base.items() if not _gauge(k)}
    for key, value in figures.items():
        if _gauge(key):
            out[key] = value
        elif key in MAXIMA:
            out[key] = max(value, out.get(key, value))
        else:
            out[key] = value + out.get(key, 0)
    return out


def _gauge(key: str) -> bool:
    return key in GAUGES or (key.startswith("server_") and key not in SERVER_COUNTERS)


def engine_fields(answer: StoreStatsAnswer) -> dict[str, Any]:
    """EngineStats' store fields from a store_stats() answer (ints, and floats for the
    ``_ms`` fields: Any, as EngineStats' keyword arguments of either type)."""
    fields: dict[str, Any] = {name: int(answer.get(name, 0)) for name in FIELDS}
    for name, key in RENAMED.items():
        fields[name] = int(answer.get(key, 0))
    # The waits for Mooncake, the store thread's or a store server's (one per batch of
    # lookups that asked it).
    waits = answer.get("remote_lookup_waits", 0)
    seconds = answer.get("remote_lookup_seconds_total", 0.0)
    fields["remote_lookup_mean_ms"] = 1e3 * seconds / waits if waits else 0.0
    fields["remote_lookup_max_ms"] = 1e3 * float(answer.get("remote_lookup_seconds_max", 0.0))
    return fields


class StoreFigures:
    """The latest ``store_stats()`` answer (``{}`` before the first, and for a store
    without the method). Written on the store thread only; ``latest`` may be read from
    any thread."""

    def __init__(
        self, store_stats: AskStore | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store_stats = store_stats
        self._clock = clock
        self.latest: StoreStatsAnswer = {}
        self._changed = False  # the store worked since the latest answer
        self._due = 0.0  # no periodic ask before this (clock)
        self._failed = False  # a periodic ask failed: logged once

    def changed(self) -> None:
        """The store did something: its figures may have moved."""
        self._changed = self._store_stats is not None

    def timeout(self, timeout: float | None) -> float | None:
        """The store thread's wait for work, shortened so that it wakes when an ask is
        due for work it has done (else as given: no wake-up while nothing changed)."""
        if not self._changed:
            return timeout
        left = max(self._due - self._clock(), 0.0)
        return left if timeout is None else min(timeout, left)

    def refresh(self, now: bool = False) -> None:
        """Ask the store if it worked since the last answer and REFRESH_S have passed
        (``now``: whenever it worked); an error is logged once and the last answer kept."""
        if self._changed and (now or self._clock() >= self._due):
            try:
                self.ask()
            except Exception:
                if not self._failed:  # a broken store_stats() logs once, not per refresh
                    self._failed = True
                    log.exception("aiokv: store_stats() failed; engine.stats() keeps its last")

    def ask(self) -> StoreStatsAnswer:
        """Ask the store now and keep its answer (store thread); raises what it raises."""
        self._changed = False
        self._due = self._clock() + REFRESH_S
        if self._store_stats is None:
            return self.latest
        answer = dict(self._store_stats())
        self.latest = answer
        return answer

    def after_close(self) -> None:
        """The store closed: ask once more where it still answers (the embedded store
        counts the SSD writes its close finished); one that is gone (a child process)
        keeps the answer taken before the close."""
        try:
            self.ask()
        except Exception:  # closed stores may refuse: the answer from before stands
            log.debug("aiokv: store_stats() after close not answered", exc_info=True)


class StoreStatsQuery:
    """A scrape's request for ``store_stats()``, run by the store thread (the store is
    that thread's alone) and waited for by the scraping thread. ``on_answer``, if given,
    is called on the store thread with what the store reported (``{}`` for a store
    without ``store_stats``), or not at all when it raised (logged)."""

    __slots__ = ("_answered", "_on_answer")

    def __init__(self, on_answer: Callable[[StoreStatsAnswer], None] | None = None) -> None:
        self._answered = threading.Event()
        self._on_answer = on_answer

    def run(self, store_stats: AskStore | None) -> None:
        """Store thread."""
        try:
            answer = dict(store_stats()) if store_stats is not None else {}
            if self._on_answer is not None:
                self._on_answer(answer)
        except Exception:
            log.exception("aiokv: store_stats() failed; the scrape keeps its last answer")
        finally:
            self._answered.set()

    @property
    def answered(self) -> bool:
        return self._answered.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for the store thread; True once it ran the query."""
        return self._answered.wait(timeout_s)


class StoreSideStats:
    """The store thread's histogram: dispatch to outcome posted (store time). Written on
    the store thread only."""

    def __init__(self) -> None:
        self.store = Histogram(LATENCY_BOUNDS_S)

    def posted(self, pairs: Iterable[tuple[Request, object]]) -> None:
        """Outcomes about to be posted to the loop, now."""
        self.observe(request for request, _ in pairs)

    def observe(self, requests: Iterable[Request]) -> None:
        """Tries over now: posted, or given up with no outcome (their caller left)."""
        now = time.perf_counter()
        store = self.store
        counts, bounds = store.counts, store.bounds
        total = 0.0
        for request in requests:  # inlined Histogram.observe: this runs per request
            spent = now - request.dispatched_at
            counts[bisect_left(bounds, spent)] += 1
            total += spent
        store.sums[0] += total


@dataclass(frozen=True)
class ClosedFigures:
    """What the store thread showed as the engine's close ended: its open tasks, the
    store's latest answer and the store-time histogram. Read from then on, so that a
    store thread left to end on its own (a close that timed out) changes no figure after
    the close (README: final after close)."""

    tasks_open: int
    latest: StoreStatsAnswer
    store_latency: HistogramReading
