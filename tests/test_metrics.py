"""Metrics: the recorder's fixed-bucket histograms, the Prometheus collector's families,
and a real /metrics endpoint scraped over HTTP while an engine serves."""

from __future__ import annotations

import asyncio
import importlib
import logging
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store
from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import aiokv
from aiokv import metrics
from aiokv.loop.batcher import Batch
from aiokv.requests import Kind, LoadResult, LookupGrant, OffloadResult, Request, new_request
from aiokv.stats import (
    KINDS,
    LATENCY_BOUNDS_S,
    OUTCOMES,
    Histogram,
    StatsRecorder,
    StoreSideStats,
    StoreStatsQuery,
)
from aiokv.testing import FaultyStore

BYTES_PER_PAGE = 1000


class ReportingStore(FaultyStore):
    """A FaultyStore with ``store_stats``: it reports ``report``, once ``gate`` is set;
    it notes the threads that asked."""

    def __init__(self, inner: aiokv.Store, report: Mapping[str, int | float]) -> None:
        super().__init__(inner)
        self.report = dict(report)
        self.asked_from: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def store_stats(self) -> Mapping[str, int | float]:
        self.asked_from.append(threading.current_thread().name)
        self.gate.wait()
        return self.report


def request(kind: Kind, num_tokens: int = 8, pages_used: int = 2) -> Request:
    future: asyncio.Future[Any] = asyncio.Future(loop=asyncio.new_event_loop())
    made = new_request(kind, 1, future, num_tokens, None, None, None, pages_used)
    future.get_loop().close()
    return made


def ended(recorder: StatsRecorder, made: Request, outcome: object, taken: bool = True) -> None:
    """``made`` resolved with ``outcome``, and its caller took it (or not)."""
    recorder.record_resolved(made)
    recorder.record_outcome(made, outcome, taken)


def by_name(families: Iterator[Any]) -> dict[str, Any]:
    return {family.name: family for family in families}


def samples(family: Any, suffix: str = "", **labels: str) -> list[float]:
    """Values of the family's samples named name+suffix whose labels include ``labels``."""
    return [
        s.value
        for s in family.samples
        if s.name == family.name + suffix and labels.items() <= s.labels.items()
    ]


def value(family: Any, suffix: str = "", **labels: str) -> float:
    (found,) = samples(family, suffix, **labels)
    return found


# ---- the recorder ------------------------------------------------------------------


def test_a_histogram_counts_each_value_in_the_first_bucket_whose_bound_holds_it() -> None:
    histogram = Histogram((1.0, 2.0, 4.0), rows=2)
    for v in (0.5, 1.0, 1.5, 4.0, 9.0):
        histogram.observe(v, row=1)
    histogram.observe(3.0, row=0)
    reading = histogram.read()
    # le semantics: a value equal to a bound is in that bound's bucket; above all: +Inf.
    assert reading.cumulative(1) == [2, 3, 4, 5]
    assert reading.cumulative(0) == [0, 0, 1, 1]
    assert reading.sums == [3.0, 16.0]
    assert (reading.count(0), reading.count(1)) == (1, 5)
    histogram.observe(0.1, row=0)
    assert reading.cumulative(0) == [0, 0, 1, 1]  # a reading is a copy


def test_record_batch_observes_each_requests_window_and_the_batch_size_and_bytes() -> None:
    recorder = StatsRecorder(BYTES_PER_PAGE)
    offloads = [request(Kind.OFFLOAD, pages_used=p) for p in (1, 2, 3)]
    for r in offloads:
        r.submitted_at = time.perf_counter() - 100  # windows over the last bound: +Inf
    recorder.record_batch(Batch(Kind.OFFLOAD, tuple(offloads)))
    lookups = [request(Kind.LOOKUP, pages_used=0) for _ in range(2)]
    for r in lookups:
        r.submitted_at = time.perf_counter()
    recorder.record_batch(Batch(Kind.LOOKUP, tuple(lookups)))
    assert all(r.dispatched_at > 0.0 for r in offloads + lookups)
    reading = recorder.read()
    assert reading.batches == 2
    assert reading.window.count() == 5
    assert reading.window.cumulative()[-2] == 2  # the lookups' windows, under 10 s
    offload, lookup = KINDS.index("offload"), KINDS.index("lookup")
    assert (reading.batch_requests.count(offload), reading.batch_requests.sums[offload]) == (1, 3)
    assert (reading.batch_requests.count(lookup), reading.batch_requests.sums[lookup]) == (1, 2)
    assert reading.batch_bytes.sums[offload] == 6 * BYTES_PER_PAGE
    assert reading.batch_bytes.count(lookup) == 0  # lookups move no KV: not observed


def test_record_outcome_counts_by_kind_and_outcome_and_derives_pending_and_queued() -> None:
    recorder = StatsRecorder()
    offload, lookup, load, late = (
        request(Kind.OFFLOAD), request(Kind.LOOKUP, num_tokens=12), request(Kind.LOAD),
        request(Kind.OFFLOAD),
    )
    queued_then_cancelled = request(Kind.OFFLOAD)
    for _ in range(5):
        recorder.record_submit()
    recorder.record_rejected(Kind.LOAD)
    recorder.record_batch(Batch(Kind.OFFLOAD, (offload, late)))
    recorder.record_batch(Batch(Kind.LOOKUP, (lookup,)))
    assert (recorder.read().pending, recorder.read().queued) == (5, 2)  # load, cancelled
    ended(recorder, offload, OffloadResult(1, 8, 8))
    ended(recorder, lookup, LookupGrant(None, 4))
    ended(recorder, late, aiokv.RequestTimeout("late"))
    ended(recorder, queued_then_cancelled, None)
    reading = recorder.read()
    assert (reading.pending, reading.queued) == (1, 1)  # the load, never dispatched
    ended(recorder, load, aiokv.StoreError("failed"))
    reading = recorder.read()
    assert (reading.pending, reading.queued) == (0, 0)
    table = {(k, o): reading.requests(k, o) for k in KINDS for o in OUTCOMES}
    assert {key: n for key, n in table.items() if n} == {
        ("offload", "ok"): 1,
        ("offload", "timed_out"): 1,
        ("offload", "cancelled"): 1,
        ("lookup", "ok"): 1,
        ("load", "failed"): 1,
        ("load", "rejected"): 1,
    }
    assert (reading.lookup_tokens, reading.lookup_hit_tokens, reading.offloaded_tokens) == (12, 4, 8)
    # End to end: every outcome but the caller's cancellation is observed.
    assert [reading.latency.count(KINDS.index(k)) for k in ("offload", "lookup", "load")] == [2, 1, 1]
    stats = recorder.snapshot(0, bytes_per_token=10)
    assert (stats.completed, stats.failed, stats.cancelled, stats.rejected, stats.timed_out) == (
        2, 1, 1, 1, 1,
    )
    assert (stats.bytes_offloaded, stats.hit_ratio, stats.queued) == (80, 4 / 12, 0)
    ended(recorder, request(Kind.LOAD), LoadResult(1, 16))
    assert recorder.read().loaded_tokens == 16


def test_an_offload_requeued_to_wait_for_room_is_queued_once_more_each_time() -> None:
    recorder = StatsRecorder()
    waits, stays = request(Kind.OFFLOAD), request(Kind.OFFLOAD)
    recorder.record_submit()
    recorder.record_submit()
    for _ in range(3):  # no room, three times: dispatched, held, requeued
        recorder.record_batch(Batch(Kind.OFFLOAD, (waits, stays)))
        assert (recorder.read().queued, recorder.read().pending) == (0, 2)
        recorder.record_requeue([waits, stays])
        assert recorder.read().queued == 2
    ended(recorder, stays, aiokv.RequestTimeout("no room by its deadline"))
    assert (recorder.read().queued, recorder.read().pending) == (1, 1)  # resolved in the queue
    recorder.record_batch(Batch(Kind.OFFLOAD, (waits,)))
    ended(recorder, waits, OffloadResult(1, 8, 8))
    stats = recorder.snapshot(0, bytes_per_token=10)
    assert (stats.queued, stats.pending, stats.batches, stats.completed) == (0, 0, 4, 1)


def test_an_answer_its_caller_never_took_counts_as_cancelled_with_nothing_moved() -> None:
    recorder = StatsRecorder()
    offload, lookup = request(Kind.OFFLOAD), request(Kind.LOOKUP)
    for made in (offload, lookup):
        recorder.record_submit()
        recorder.record_resolved(made)  # answered while queued, the caller not back yet
    assert (recorder.read().pending, recorder.read().queued) == (2, 0)
    recorder.record_outcome(offload, OffloadResult(1, 8, 8), taken=False)
    recorder.record_outcome(lookup, LookupGrant(None, 8), taken=False)
    recorder.record_empty_load(taken=False)
    recorder.record_rejected(Kind.LOAD, taken=False)  # never accepted: counted nowhere
    recorder.record_call("evict", 64, 0.002, taken=False)
    reading = recorder.read()
    table = {(k, o): reading.requests(k, o) for k in KINDS for o in OUTCOMES}
    assert {key: n for key, n in table.items() if n} == {
        ("offload", "cancelled"): 1, ("lookup", "cancelled"): 1, ("load", "cancelled"): 1,
        ("evict", "cancelled"): 1,
    }
    assert (reading.pending, reading.queued, reading.empty_loads) == (0, 0, 0)
    assert (reading.offloaded_tokens, reading.lookup_tokens, reading.lookup_hit_tokens) == (0, 0, 0)
    assert [reading.latency.count(row) for row in range(len(KINDS))] == [0] * len(KINDS)


def test_calls_outside_requests_count_by_their_kind() -> None:
    recorder = StatsRecorder()
    recorder.record_call("evict", 64, 0.002)
    recorder.record_call("evict", None, 5.0)
    recorder.record_call("clear", aiokv.StoreError("cannot clear"), 0.5)
    reading = recorder.read()
    assert [reading.requests("evict", o) for o in ("ok", "cancelled")] == [1, 1]
    assert reading.requests("clear", "failed") == 1
    evict, clear = KINDS.index("evict"), KINDS.index("clear")
    assert (reading.latency.count(evict), reading.latency.sums[evict]) == (1, 0.002)
    assert reading.latency.count(clear) == 1
    assert reading.pending == 0  # never submitted as requests
    with pytest.raises(ValueError):
        recorder.record_call("compact", 0, 0.0)


def test_the_store_side_observes_each_posted_outcome_from_its_dispatch() -> None:
    side = StoreSideStats()
    posted = [request(Kind.OFFLOAD) for _ in range(3)]
    for r in posted:
        r.dispatched_at = time.perf_counter() - 100
    side.posted([(r, None) for r in posted])
    reading = side.store.read()
    assert reading.count() == 3
    assert reading.cumulative()[len(LATENCY_BOUNDS_S) - 1] == 0  # all above 10 s: +Inf


def test_a_store_stats_query_reports_empty_for_a_store_without_it_and_survives_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: list[Mapping[str, int | float]] = []
    query = StoreStatsQuery(answers.append)
    assert not query.answered and not query.wait(0)
    query.run(None)
    assert query.answered and answers == [{}]

    def broken() -> Mapping[str, int | float]:
        raise RuntimeError("store gone")

    query = StoreStatsQuery(answers.append)
    with caplog.at_level(logging.ERROR, logger="aiokv"):
        query.run(broken)
    assert query.wait(0) and answers == [{}]  # no answer kept; the waiter is released
    assert "store_stats() failed" in caplog.text


# ---- the collector -------------------------------------------------------------------


def test_metrics_needs_the_extra_and_import_aiokv_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "aiokv.metrics")
    with pytest.raises(ImportError, match=r"pip install 'aiokv\[metrics\]'"):
        importlib.import_module("aiokv.metrics")
    monkeypatch.undo()
    code = "import sys, aiokv; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_register_describes_every_family_and_refuses_a_second_engine() -> None:
    registry = CollectorRegistry()
    engine = aiokv.OffloadEngine(small_store(), make_caches())
    collector = metrics.register(engine, registry)
    names = {family.name for family in collector.describe()}
    assert names == {
        "aiokv_requests", "aiokv_batches", "aiokv_pending", "aiokv_queued",
        "aiokv_store_tasks_open", "aiokv_batch_requests", "aiokv_batch_bytes",
        "aiokv_latency_window_seconds", "aiokv_latency_store_seconds", "aiokv_latency_seconds",
        "aiokv_bytes", "aiokv_lookup_tokens", "aiokv_lookup_hit_tokens", "aiokv_hit_ratio",
        "aiokv_store_blocks", "aiokv_store_errors", "aiokv_tier_hit_tokens",
        "aiokv_empty_loads", "aiokv_dropped_tokens", "aiokv_remote_lookups",
        "aiokv_remote_dropped_writes", "aiokv_remote_dropped_removals",
        "aiokv_remote_lookup_seconds",
        "aiokv_remote_write_seconds", "aiokv_remote_invalidations_waiting",
    }  # fmt: skip
    # Before start: zeros, and no store answer yet (the store thread does not exist).
    families = by_name(registry.collect())
    assert sum(samples(families["aiokv_requests"], "_total")) == 0
    assert families["aiokv_store_blocks"].samples == []
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.register(aiokv.OffloadEngine(small_store(), make_caches()), registry)
    registry.unregister(collector)


@pytest.mark.parametrize(("engine_of", "store_timeout_s", "says"), [
    (lambda engine: None, 0.25, "engine: must be an aiokv.OffloadEngine"),
    (lambda engine: aiokv.run_in_background(engine), 0.25, "got BackgroundEngine"),
    (lambda engine: engine, float("inf"), "store_timeout_s: must be a finite"),
    (lambda engine: engine, "0.5", "store_timeout_s: must be a number of seconds, got str"),
    (lambda engine: engine, float("nan"), "store_timeout_s: must be a finite"),
    (lambda engine: engine, -1, "got -1"),
    (lambda engine: engine, 1e10, "TIMEOUT_MAX"),  # a wait's longest
])
def test_register_refuses_what_no_scrape_could_use(
    engine_of: Any, store_timeout_s: Any, says: str
) -> None:
    # Each was accepted, then every scrape of the registry failed (the application's own
    # metrics with it); nan and -1 were taken silently.
    registry = CollectorRegistry()
    Counter("app_requests", "the application's own metric", registry=registry)
    engine = engine_of(aiokv.OffloadEngine(small_store(), make_caches()))
    try:
        with pytest.raises(aiokv.InvalidRequest, match=says):
            metrics.register(engine, registry, store_timeout_s=store_timeout_s)
    finally:
        if isinstance(engine, aiokv.BackgroundEngine):
            engine.close()
    assert "app_requests_total 0.0" in generate_latest(registry).decode()


def test_the_readme_names_every_family() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("\n## Metrics\n") :]
    section = section[: section.index("\n## ", 1)]
    engine = aiokv.OffloadEngine(small_store(), make_caches())
    for family in metrics.EngineCollector(engine).describe():
        suffix = "_total" if family.type == "counter" else ""
        assert f"`{family.name}{suffix}" in section, family.name


@pytest.mark.asyncio
async def test_store_families_come_from_store_stats_asked_on_the_store_thread() -> None:
    report = {
        "host_blocks_used": 3, "host_blocks_total": 10, "ssd_blocks_used": 5,
        "ssd_blocks_total": 40, "bytes_d2h": 111, "bytes_h2d": 222,
        "bytes_ssd_written": 333, "bytes_ssd_read": 444, "checksum_failures": 1,
        "ssd_write_errors": 2,
    }  # fmt: skip
    store = ReportingStore(small_store(), report)
    registry = CollectorRegistry()
    async with aiokv.OffloadEngine(store, make_caches()) as engine:
        metrics.register(engine, registry)
        await engine.offload(1, torch.arange(0, 2), 2 * PAGE_SIZE)
        families = by_name(await asyncio.to_thread(lambda: list(registry.collect())))
    assert store.asked_from and set(store.asked_from) == {"aiokv-store"}
    moved = families["aiokv_bytes"]
    # The store's counters, not the engine's own count of offloaded tokens.
    assert {(s.labels["direction"], s.labels["tier"]): s.value for s in moved.samples} == {
        ("d2h", "host"): 111, ("h2d", "host"): 222, ("d2h", "ssd"): 333, ("h2d", "ssd"): 444,
    }  # fmt: skip
    blocks = families["aiokv_store_blocks"]
    assert {(s.labels["tier"], s.labels["state"]): s.value for s in blocks.samples} == {
        ("host", "used"): 3, ("host", "total"): 10, ("ssd", "used"): 5, ("ssd", "total"): 40,
    }  # fmt: skip
    errors = families["aiokv_store_errors"]
    assert {s.labels["error"]: s.value for s in errors.samples} == {"checksum": 1, "ssd_write": 2}
    # After the close the store thread is gone: its final answer stands, nothing is asked.
    asked = len(store.asked_from)
    families = by_name(await asyncio.to_thread(lambda: list(registry.collect())))
    assert value(families["aiokv_store_blocks"], tier="host", state="used") == 3
    assert len(store.asked_from) == asked and set(store.asked_from) == {"aiokv-store"}


@pytest.mark.asyncio
async def test_a_scrape_on_the_loop_thread_does_not_wait_and_sees_what_is_queued() -> None:
    store = ReportingStore(small_store(), {"host_blocks_used": 4})
    registry = CollectorRegistry()
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=3)
    async with aiokv.OffloadEngine(store, make_caches(), config) as engine:
        # A scrape that waited for the store (an hour) would hang the loop, and this test.
        collector = metrics.register(engine, registry, store_timeout_s=3600)
        calls = [
            asyncio.ensure_future(engine.offload(u, torch.arange(u, u + 1), PAGE_SIZE))
            for u in range(2)
        ]
        await asyncio.sleep(0)  # both accepted, queued in the 10 s window
        store.report["host_blocks_used"] = 5  # the store's figure moved since the start
        store.gate.clear()  # store_stats() blocks until the scrape is over
        families = by_name(registry.collect())  # on the loop
        store.gate.set()
        assert value(families["aiokv_queued"]) == 2
        assert value(families["aiokv_pending"]) == 2
        # The figures asked at the start: the new ones asked, not waited for.
        assert value(families["aiokv_store_blocks"], tier="host", state="used") == 4
        query = collector._asked
        assert query is not None
        assert await asyncio.to_thread(query.wait, 10)
        families = by_name(registry.collect())
        assert value(families["aiokv_store_blocks"], tier="host", state="used") == 5
        calls.append(asyncio.ensure_future(engine.offload(2, torch.arange(2, 3), PAGE_SIZE)))
        await asyncio.gather(*calls)  # the third fills the batch
        families = by_name(registry.collect())
        assert (value(families["aiokv_queued"]), value(families["aiokv_pending"])) == (0, 0)
        assert value(families["aiokv_batch_requests"], "_sum", kind="offload") == 3


# ---- a real endpoint -------------------------------------------------------------------


async def wait_for(condition: Any, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


@pytest.mark.asyncio
async def test_a_scraped_metrics_endpoint_matches_engine_stats() -> None:
    store = ReportingStore(small_store(), {"host_blocks_used": 9, "host_blocks_total": 64})
    # One offload is held until it times out; every other call runs under the same
    # deadline and must not meet it: 1 s, not 100 ms, which a store thread held up on a
    # loaded host outlasted (a healthy offload's RequestTimeout).
    config = aiokv.EngineConfig(max_pending=4, overload="reject", request_timeout_ms=1_000)
    registry = CollectorRegistry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def scrape() -> dict[str, Any]:
        with urllib.request.urlopen(url, timeout=10) as response:
            return by_name(text_string_to_metric_families(response.read().decode()))

    def offload(user: int) -> Any:
        return engine.offload(user, torch.arange(4 * user, 4 * user + 4), 4 * PAGE_SIZE)

    try:
        async with aiokv.OffloadEngine(store, make_caches(), config) as engine:
            metrics.register(engine, registry)
            await asyncio.gather(*(offload(u) for u in range(3)))
            hit = await engine.lookup(0, 4 * PAGE_SIZE)
            miss = await engine.lookup(9, 4 * PAGE_SIZE)
            assert (hit.cached_tokens, miss.cached_tokens) == (16, 0)
            await engine.load(hit, torch.arange(100, 104))
            store.fail_tasks = True
            with pytest.raises(aiokv.StoreError):
                await offload(5)
            store.fail_tasks = False
            burst = await asyncio.gather(*(offload(u) for u in range(10, 15)), return_exceptions=True)
            assert sum(isinstance(r, aiokv.Overloaded) for r in burst) == 1
            store.hold.clear()  # answers held back: one call times out, one is cancelled
            with pytest.raises(aiokv.RequestTimeout):
                await offload(20)
            store.launched.clear()
            cancelled = asyncio.ensure_future(offload(21))
            await asyncio.to_thread(store.launched.wait, 10)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            store.hold.set()
            await wait_for(lambda: engine.stats().store_tasks_open == 0, "the held tasks end")
            families = await asyncio.to_thread(scrape)
            stats = engine.stats()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)

    requests = families["aiokv_requests"]
    by_outcome = {o: sum(samples(requests, "_total", outcome=o)) for o in OUTCOMES}
    assert by_outcome == {
        "ok": stats.completed, "failed": stats.failed, "cancelled": stats.cancelled,
        "rejected": stats.rejected, "timed_out": stats.timed_out,
    }  # fmt: skip
    assert by_outcome == {"ok": 10, "failed": 1, "cancelled": 1, "rejected": 1, "timed_out": 1}
    assert value(requests, "_total", kind="lookup", outcome="ok") == 2
    assert value(requests, "_total", kind="load", outcome="ok") == 1
    assert value(families["aiokv_pending"]) == stats.pending == 0
    assert value(families["aiokv_queued"]) == stats.queued == 0
    assert value(families["aiokv_batches"], "_total") == stats.batches
    batch_requests = families["aiokv_batch_requests"]
    assert sum(samples(batch_requests, "_count")) == stats.batches
    dispatched = sum(samples(batch_requests, "_sum"))
    assert dispatched == stats.submitted  # every accepted call here was dispatched
    assert value(families["aiokv_latency_window_seconds"], "_count") == dispatched
    assert value(families["aiokv_latency_store_seconds"], "_count") == dispatched
    latency = families["aiokv_latency_seconds"]
    for kind in ("offload", "lookup", "load"):
        observed = sum(value(requests, "_total", kind=kind, outcome=o) for o in ("ok", "failed", "timed_out"))
        assert value(latency, "_count", kind=kind) == observed
        buckets = samples(latency, "_bucket", kind=kind)
        assert buckets == sorted(buckets) and buckets[-1] == observed  # cumulative, +Inf last
    # The load's 4 pages hold the 16 tokens it loaded.
    assert value(families["aiokv_batch_bytes"], "_sum", kind="load") == stats.bytes_loaded
    moved = families["aiokv_bytes"]
    assert value(moved, "_total", direction="d2h", tier="host") == stats.bytes_offloaded
    assert value(moved, "_total", direction="h2d", tier="host") == stats.bytes_loaded > 0
    assert samples(moved, "_total", tier="ssd") == []  # the store reports no SSD bytes
    assert value(families["aiokv_lookup_tokens"], "_total") == stats.lookup_tokens == 32
    assert value(families["aiokv_lookup_hit_tokens"], "_total") == stats.lookup_hit_tokens == 16
    assert value(families["aiokv_hit_ratio"]) == stats.hit_ratio == 0.5
    assert value(families["aiokv_store_blocks"], tier="host", state="used") == 9
    assert value(families["aiokv_store_blocks"], tier="host", state="total") == 64
    assert set(store.asked_from) == {"aiokv-store"}


def test_the_remote_tiers_dropped_removals_are_exported_as_the_store_counts_them() -> None:
    # store_stats()'s remote_removals_dropped, as a scrape shows it (README's metric list).
    families = {family.name: family for family in metrics._remote_families(
        {"remote_removals_dropped": 7, "remote_dropped_queue": 2})}
    dropped = families["aiokv_remote_dropped_removals"]
    assert [(s.name, s.value) for s in dropped.samples] == [
        ("aiokv_remote_dropped_removals_total", 7)]
