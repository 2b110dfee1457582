"""Prometheus metrics of one engine: :func:`register` adds an :class:`EngineCollector` to
a ``prometheus_client`` registry (pip install 'aiokv[metrics]').

Nothing is counted at scrape time: the engine's loop and store thread record into
fixed-bucket arrays as they work (aiokv.stats), and a scrape copies them. The store's own
``store_stats()`` (occupancy, tier hits, byte counters) is asked of the store thread, to
which every store call belongs: the scrape queues a query on its inbox and waits up to
``store_timeout_s`` for the answer; a scrape made on a thread running an event loop (a
``/metrics`` route served by the engine's own loop, say) does not wait, and reports the
store thread's latest answer (:mod:`aiokv.store_figures`, at most REFRESH_S old while
the store works; final after the close). Until the first answer the store families are
empty.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
        SummaryMetricFamily,
    )
    from prometheus_client.registry import REGISTRY, CollectorRegistry
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # the extra is optional: say which one to install
    raise ImportError(
        "aiokv.metrics needs prometheus-client: pip install 'aiokv[metrics]'"
    ) from exc

from . import validate
from .engine import OffloadEngine
from .errors import EngineClosed, InvalidRequest
from .requests import Kind
from .stats import (
    KINDS,
    OUTCOMES,
    HistogramReading,
    Reading,
    StatsRecorder,
    StoreSideStats,
)
from .store_figures import StoreStatsQuery

__all__ = ["EngineCollector", "register"]

# aiokv_bytes_total{direction, tier}: the store_stats() key of each series, what the store
# copied (a failed call's copies too: the link carried them). Where the store reports no
# bytes_d2h / bytes_h2d (FlexKV), the host series are the tokens completed offloads stored
# / loads loaded times the caches' bytes per token; the SSD series appear only where the
# store reports them.
_BYTES_KEYS = (
    ("d2h", "host", "bytes_d2h"),
    ("h2d", "host", "bytes_h2d"),
    ("d2h", "ssd", "bytes_ssd_written"),
    ("h2d", "ssd", "bytes_ssd_read"),
    ("d2h", "remote", "remote_bytes_written"),
    ("h2d", "remote", "remote_bytes_read"),
)
_BLOCK_KEYS = (
    ("host", "used", "host_blocks_used"),
    ("host", "total", "host_blocks_total"),
    ("ssd", "used", "ssd_blocks_used"),
    ("ssd", "total", "ssd_blocks_total"),
    ("remote", "queued", "remote_write_queue_blocks"),  # waiting for the writer
    ("remote", "held", "remote_blocks_held"),  # host blocks held for their write
)
_ERROR_KEYS = (
    ("checksum", "checksum_failures"),
    ("ssd_read", "ssd_read_errors"),
    ("ssd_write", "ssd_write_errors"),
    # Header voids and new epochs the disk refused (what keeps evicted or cleared blocks
    # from a restart): not data writes.
    ("ssd_invalidation", "ssd_invalidation_errors"),
    ("remote_checksum", "remote_checksum_failures"),
    ("remote_read", "remote_read_errors"),
    ("remote_write", "remote_write_errors"),
    ("remote_remove", "remote_remove_errors"),  # removals of what a marker ended, refused
    ("remote_timeout", "remote_timeouts"),
    # Evicts and clears whose marker did not go out: not calls (those are the others').
    ("remote_invalidation", "remote_invalidation_errors"),
    ("remote_call", "remote_call_errors"),
    ("remote_connect", "remote_connect_errors"),  # the master refused or did not answer
)
_HIT_KEYS = (
    ("host", "host_hit_tokens"),
    ("ssd", "ssd_hit_tokens"),
    ("remote", "remote_hit_tokens"),
)
# The remote tier (aiokv.remote.link): lookups that asked Mooncake, by outcome; blocks
# whose write was dropped, by reason; the waits for it, as (count key, seconds key).
_REMOTE_LOOKUP_KEYS = (("hit", "remote_hits"), ("miss", "remote_misses"))
_REMOTE_DROP_KEYS = (
    ("queue_full", "remote_dropped_queue"),
    ("resting", "remote_dropped_resting"),
    ("store_full", "remote_dropped_full"),
    ("down", "remote_dropped_down"),
    ("evicted", "remote_dropped_evicted"),
    ("stale", "remote_dropped_stale"),
)
_REMOTE_WAITS = (
    ("aiokv_remote_lookup_seconds", "The waits for Mooncake at lookups, the store "
     "thread's or a store server's (one per batch of lookups that asked it).",
     "remote_lookup_waits", "remote_lookup_seconds_total"),
    ("aiokv_remote_write_seconds", "The remote writer's busy time (a batch of background "
     "writes in hand: its checks and checksums, Mooncake's put), over its batches.",
     "remote_write_batches", "remote_write_seconds"),
)
# Batches are of a request Kind; lookups move no KV.
_BATCHED_KINDS = tuple(kind.name.lower() for kind in Kind)
_BATCH_BYTE_KINDS = tuple(kind for kind in _BATCHED_KINDS if kind != "lookup")
_Submit = Callable[[StoreStatsQuery], None]  # StoreWorker.submit
Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


def register(
    engine: OffloadEngine,
    registry: CollectorRegistry | None = None,
    *,
    store_timeout_s: float = 0.25,
) -> EngineCollector:
    """Add a collector of ``engine``'s metrics to ``registry`` (prometheus_client's
    default REGISTRY when None) and return it (``registry.unregister(it)`` removes it).
    Any time in the engine's life: before ``start()`` the counts are zero, after
    ``aclose()`` they stay at their last values. One engine per registry: a second
    registration of the same names raises ValueError (prometheus_client's).
    ``store_timeout_s``: how long a scrape waits for the store thread's answer, a number
    of seconds >= 0 (at most threading.TIMEOUT_MAX). Raises InvalidRequest naming
    ``engine`` or ``store_timeout_s`` here, rather than fail every scrape of the
    registry later."""
    collector = EngineCollector(engine, store_timeout_s)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


class EngineCollector:
    """prometheus_client's Collector protocol: ``collect()`` yields the engine's metric
    families, at each scrape, from any thread."""

    def __init__(self, engine: OffloadEngine, store_timeout_s: float = 0.25) -> None:
        if not isinstance(engine, OffloadEngine):  # a scrape reads its parts
            raise InvalidRequest("engine", f"must be an aiokv.OffloadEngine (a "
                                           f"BackgroundEngine's is its .engine), got "
                                           f"{type(engine).__name__}")
        self._engine = engine
        self._store_timeout_s = validate.seconds("store_timeout_s", store_timeout_s)
        self._asked: StoreStatsQuery | None = None  # the latest query sent

    def describe(self) -> Iterator[Metric]:
        """The families without samples: the registry checks names with them, without
        a scrape."""
        empty = StatsRecorder().read()
        return _families(empty, StoreSideStats().store.read(), {}, 0, 0)

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        # The engine's parts, read here so that the engine needs no metrics code: the
        # recorder (loop), the worker (store thread; None before start), the geometry.
        reading = engine._stats.read()
        closed = engine._closed_figures
        if closed is not None:  # final: a store thread still running changes none of it
            return _families(reading, closed.store_latency, closed.latest,
                             engine._bytes_per_token, closed.tasks_open)
        worker = engine._worker
        store_latency = (worker.stats if worker is not None else StoreSideStats()).store.read()
        tasks_open = worker.tasks_open if worker is not None else 0
        if worker is not None:
            self._ask_store(worker.submit)
        store = worker.figures.latest if worker is not None else {}  # the answer, or the latest
        return _families(reading, store_latency, store, engine._bytes_per_token, tasks_open)

    def _ask_store(self, submit: _Submit) -> None:
        """Queue a store_stats() query for the store thread (unless the last one is still
        waiting there) and wait for it, except on a thread running an event loop."""
        query = self._asked
        if query is None or query.answered:
            query = StoreStatsQuery()  # the answer is kept by the worker's StoreFigures
            try:
                submit(query)
            except EngineClosed:  # stopped: the last answer stands
                return
            self._asked = query
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here: this thread may block
            query.wait(self._store_timeout_s)


def _histogram(
    family: HistogramMetricFamily, labels: list[str], reading: HistogramReading, row: int
) -> None:
    # "le" spelled as prometheus_client's own histograms spell it ("+Inf" last).
    bounds = [floatToGoString(b) for b in (*reading.bounds, math.inf)]  # type: ignore[no-untyped-call]
    cumulative = reading.cumulative(row)
    buckets = [(b, float(c)) for b, c in zip(bounds, cumulative, strict=True)]
    family.add_metric(labels, buckets, reading.sums[row])


def _families(
    reading: Reading,
    store_latency: HistogramReading,
    store: Mapping[str, int | float],
    bytes_per_token: int,
    tasks_open: int,
) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "aiokv_requests",
        "Calls by kind and outcome (rejected: turned away by admission, never accepted: "
        "Overloaded, or RequestTimeout while waiting for room).",
        labels=["kind", "outcome"],
    )
    for kind in KINDS:
        for outcome in OUTCOMES:
            requests.add_metric([kind, outcome], reading.requests(kind, outcome))
    yield requests
    yield CounterMetricFamily("aiokv_batches", "Batches dispatched.", reading.batches)
    yield GaugeMetricFamily(
        "aiokv_pending", "Accepted calls whose callers have not taken their outcome yet.",
        reading.pending,
    )
    yield GaugeMetricFamily(
        "aiokv_queued", "Accepted calls not yet dispatched to the store thread.", reading.queued
    )
    yield GaugeMetricFamily(
        "aiokv_store_tasks_open", "Store task ids matched or launched, not terminal.", tasks_open
    )

    batch_requests = HistogramMetricFamily(
        "aiokv_batch_requests", "Requests per dispatched batch.", labels=["kind"]
    )
    batch_bytes = HistogramMetricFamily(
        "aiokv_batch_bytes",
        "KV bytes in the pages of each dispatched offload or load batch.",
        labels=["kind"],
    )
    latency = HistogramMetricFamily(
        "aiokv_latency_seconds",
        "Submit to resolved, per call (cancelled calls not observed).",
        labels=["kind"],
    )
    for row, kind in enumerate(KINDS):
        if kind in _BATCHED_KINDS:
            _histogram(batch_requests, [kind], reading.batch_requests, row)
        if kind in _BATCH_BYTE_KINDS:
            _histogram(batch_bytes, [kind], reading.batch_bytes, row)
        _histogram(latency, [kind], reading.latency, row)
    window = HistogramMetricFamily(
        "aiokv_latency_window_seconds", "Submit to dispatched (the batching window), per call."
    )
    _histogram(window, [], reading.window, 0)
    store_time = HistogramMetricFamily(
        "aiokv_latency_store_seconds",
        "Dispatched to outcome posted by the store thread, per dispatch (an offload held "
        "for room is dispatched again at each try).",
    )
    _histogram(store_time, [], store_latency, 0)
    yield from (batch_requests, batch_bytes, window, store_time, latency)

    moved = CounterMetricFamily(
        "aiokv_bytes", "KV bytes the store copied, by direction and tier (failed calls' copies "
        "too; where a store counts none, completed calls' tokens x bytes per token).",
        labels=["direction", "tier"]
    )
    computed = {
        "bytes_d2h": reading.offloaded_tokens * bytes_per_token,
        "bytes_h2d": reading.loaded_tokens * bytes_per_token,
    }
    for direction, tier, key in _BYTES_KEYS:
        value = store.get(key, computed.get(key))
        if value is not None:
            moved.add_metric([direction, tier], value)
    yield moved

    yield CounterMetricFamily(
        "aiokv_lookup_tokens", "Tokens asked by completed lookups.", reading.lookup_tokens
    )
    yield CounterMetricFamily(
        "aiokv_lookup_hit_tokens", "Tokens found for completed lookups.", reading.lookup_hit_tokens
    )
    asked = reading.lookup_tokens
    hits = CounterMetricFamily(
        "aiokv_tier_hit_tokens",
        "Tokens lookups found, by the tier the store found them on (the store's count).",
        labels=["tier"],
    )
    yield _from_store(hits, _HIT_KEYS, store)
    yield CounterMetricFamily(
        "aiokv_empty_loads",
        "Loads of a Lookup that found nothing, answered at once (in aiokv_requests_total too).",
        reading.empty_loads,
    )
    yield CounterMetricFamily(
        "aiokv_dropped_tokens", "Tokens dropped by evicts and clears.", reading.dropped_tokens
    )
    yield GaugeMetricFamily(
        "aiokv_hit_ratio",
        "aiokv_lookup_hit_tokens / aiokv_lookup_tokens since start (0 before any lookup).",
        reading.lookup_hit_tokens / asked if asked else 0.0,
    )

    blocks = GaugeMetricFamily(
        "aiokv_store_blocks", "Store blocks by tier, used and total.", labels=["tier", "state"]
    )
    yield _from_store(blocks, _BLOCK_KEYS, store)
    errors = CounterMetricFamily(
        "aiokv_store_errors", "Errors the store counted, by kind.", labels=["error"]
    )
    yield _from_store(errors, _ERROR_KEYS, store)
    yield from _remote_families(store)


def _from_store(
    family: Family, rows: Iterable[tuple[str, ...]], store: Mapping[str, int | float]
) -> Family:
    """Per row (its label values, then a store_stats() key): a sample where the store
    reports the key."""
    for *labels, key in rows:
        if key in store:
            family.add_metric(labels, store[key])
    return family


def _remote_families(store: Mapping[str, int | float]) -> Iterator[Metric]:
    """The remote tier's own families (empty without one)."""
    lookups = CounterMetricFamily(
        "aiokv_remote_lookups",
        "Lookups that missed the host and SSD tiers and asked Mooncake, by outcome (hit: "
        "at least the first missing block came).",
        labels=["outcome"],
    )
    yield _from_store(lookups, _REMOTE_LOOKUP_KEYS, store)
    dropped = CounterMetricFamily(
        "aiokv_remote_dropped_writes",
        "Blocks whose background write to Mooncake was dropped, by reason.",
        labels=["reason"],
    )
    yield _from_store(dropped, _REMOTE_DROP_KEYS, store)
    removals = CounterMetricFamily(
        "aiokv_remote_dropped_removals",
        "Removals of what an evict's or clear's marker ended that were never made (queued "
        "past the bound, the tier down or resting, refused, or dropped at close): those "
        "blocks stay in Mooncake, hidden by the markers, until its LRU takes them.",
    )
    yield _from_store(removals, [("remote_removals_dropped",)], store)
    waiting = GaugeMetricFamily(
        "aiokv_remote_invalidations_waiting",
        "Evicts and clears whose marker is not out on Mooncake yet: until it is, this host "
        "neither reads nor writes their keys there, while other hosts still serve them.",
    )
    yield _from_store(waiting, [("remote_invalidations_waiting",)], store)
    for name, help_text, count_key, seconds_key in _REMOTE_WAITS:
        waits = SummaryMetricFamily(name, help_text, labels=[])
        if count_key in store:
            waits.add_metric([], int(store[count_key]), store.get(seconds_key, 0.0))
        yield waits
