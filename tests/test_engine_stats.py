"""What engine.stats() and the metrics count beyond batched requests: evicts, clears and
loads of empty lookups; the store's tier hits, SSD bytes, errors and occupancy; and the
final figures after close (also through run_in_background)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store
from prometheus_client import CollectorRegistry
from test_metrics import wait_for
from test_ssd import (
    BLOCK,
    HOST_BLOCKS,
    PAGE,
    TARGET,
    USER_PAGES,
    caches_for,
    flip_byte,
    load_back,
    offload,
    slot_of,
    ssd_config,
    write_users,
)

import aiokv
from aiokv import metrics
from aiokv.store_figures import REFRESH_S, StoreFigures
from aiokv.stores.local import ssd_format
from aiokv.testing import StoreWrapper


class EvictFails(StoreWrapper):
    """Its evict raises; everything else is the inner store's."""

    def evict(self, namespace: Sequence[str]) -> int:
        raise RuntimeError("disk on fire")


def scrape(registry: CollectorRegistry) -> dict[str, dict[tuple[str, ...], float]]:
    """Every sample of a scrape: family -> label values -> value (run off the loop, so the
    scrape waits for the store thread's answer)."""
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sample.labels.values())] = sample.value
    return found


# ---- evicts, clears, empty loads -------------------------------------------------------


@pytest.mark.asyncio
async def test_evicts_clears_and_empty_loads_are_counted() -> None:
    registry = CollectorRegistry()
    engine = aiokv.OffloadEngine(EvictFails(small_store()), make_caches())
    metrics.register(engine, registry)
    async with engine:
        for user in (1, 2):
            await engine.offload(user, torch.arange(4 * user, 4 * user + 4), 4 * PAGE_SIZE)
        with pytest.raises(aiokv.StoreError, match="disk on fire"):
            await engine.evict(1)
        assert await engine.clear() == 8 * PAGE_SIZE  # both users
        miss = await engine.lookup(1, 4 * PAGE_SIZE)
        assert miss.cached_tokens == 0
        assert (await engine.load(miss, torch.arange(0, 4))).loaded_tokens == 0  # empty load
        families = await asyncio.to_thread(scrape, registry)
        stats = engine.stats()
    assert (stats.evicts, stats.clears, stats.dropped_tokens, stats.empty_loads) == (
        0, 1, 8 * PAGE_SIZE, 1,
    )  # fmt: skip
    # The empty load is a completed call: submitted and completed agree, nothing pending.
    assert (stats.submitted, stats.completed, stats.pending, stats.queued) == (4, 4, 0, 0)
    requests = families["aiokv_requests_total"]
    assert requests[("evict", "failed")] == 1 and requests[("evict", "ok")] == 0
    assert requests[("clear", "ok")] == 1
    assert requests[("load", "ok")] == 1
    assert families["aiokv_empty_loads_total"][()] == 1
    assert families["aiokv_dropped_tokens_total"][()] == 8 * PAGE_SIZE
    assert engine.stats() == stats  # closed: nothing moves any more


@pytest.mark.asyncio
async def test_evict_outcomes_reach_stats_ok_and_cancelled() -> None:
    engine = aiokv.OffloadEngine(small_store(), make_caches())
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    async with engine:
        await engine.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
        assert await engine.evict(1) == 4 * PAGE_SIZE
        assert await engine.evict(1) == 0  # answered: nothing left
        cancelled = asyncio.ensure_future(engine.evict(2))
        await asyncio.sleep(0)  # sent to the store thread
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        families = await asyncio.to_thread(scrape, registry)
        stats = engine.stats()
    assert (stats.evicts, stats.dropped_tokens) == (2, 4 * PAGE_SIZE)
    requests = families["aiokv_requests_total"]
    assert (requests[("evict", "ok")], requests[("evict", "cancelled")]) == (2, 1)
    latency = families["aiokv_latency_seconds_count"]
    assert latency[("evict",)] == 2  # a cancellation is the caller's time, not observed


# ---- the store's tiers -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_tier_hits_and_ssd_bytes_are_in_engine_stats_and_final_after_close(
    tmp_path: Path,
) -> None:
    caches = caches_for()
    registry = CollectorRegistry()
    engine = aiokv.OffloadEngine(aiokv.LocalStore(ssd_config(tmp_path)), caches)
    metrics.register(engine, registry)
    users = 6  # three times the host tier: the first ones live on SSD only
    async with engine:
        for user in range(users):
            await offload(engine, user)
        for user in reversed(range(users)):  # the last two from the host, then SSD
            assert await load_back(engine, user, TARGET) == USER_PAGES * PAGE, user
        # A scrape asks the store thread; engine.stats() then shows the same answer.
        families = await asyncio.to_thread(scrape, registry)
        during = engine.stats()
    final = engine.stats()
    hits = families["aiokv_tier_hit_tokens_total"]
    assert (during.host_hit_tokens, during.ssd_hit_tokens) == (hits[("host",)], hits[("ssd",)])
    assert final.host_hit_tokens == 2 * USER_PAGES * PAGE
    assert final.ssd_hit_tokens == (users - 2) * USER_PAGES * PAGE  # evicted, read back
    # Every token a lookup found was found on one tier or the other.
    assert final.host_hit_tokens + final.ssd_hit_tokens == final.lookup_hit_tokens
    assert final.bytes_ssd_read == final.ssd_hit_tokens // PAGE * BLOCK
    assert final.bytes_ssd_written >= (users - 2) * USER_PAGES * BLOCK
    assert (final.checksum_failures, final.ssd_write_errors) == (0, 0)
    assert (final.host_blocks_total, final.ssd_blocks_total) == (HOST_BLOCKS, 128)
    assert final.ssd_blocks_used == users * USER_PAGES  # write_through: everyone on SSD


@pytest.mark.asyncio
async def test_a_fresh_engine_shows_its_tiers_before_any_call() -> None:
    """A health check right after start sees the host tier's size, not an empty tier."""
    async with aiokv.OffloadEngine(small_store(), make_caches()) as engine:
        fresh = engine.stats()
        assert fresh.host_blocks_total > 0 and fresh.host_blocks_used == 0
        await engine.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
        await wait_for(lambda: engine.stats().host_blocks_used == 4, "the offload's blocks")
        assert engine.stats().host_blocks_total == fresh.host_blocks_total


@pytest.mark.asyncio
async def test_store_figures_reach_engine_stats_without_a_scrape() -> None:
    """The store thread refreshes them after it worked, while the engine sits idle."""
    async with aiokv.OffloadEngine(small_store(), make_caches()) as engine:
        await engine.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
        async with await engine.lookup(1, 4 * PAGE_SIZE):
            pass
        await wait_for(lambda: engine.stats().host_hit_tokens == 4 * PAGE_SIZE, "a hit")
        assert engine.stats().host_blocks_used == 4
        assert engine.stats().ssd_hit_tokens == 0  # no SSD tier


@pytest.mark.asyncio
async def test_the_checksum_warning_names_a_figure_users_can_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    original = caches_for()
    await write_users(tmp_path, 1)
    path, at = slot_of(tmp_path, 0, page=5)
    flip_byte(path, at + ssd_format.HEADER_BYTES + BLOCK // 2)
    caches = [torch.zeros_like(c) for c in original]
    engine = aiokv.OffloadEngine(aiokv.LocalStore(ssd_config(tmp_path)), caches)
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        async with engine:
            assert await load_back(engine, 0, TARGET) == 5 * PAGE  # the damaged page missed
    (warning,) = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
    assert "engine.stats().checksum_failures" in warning
    assert "store_stats()" not in warning  # no method users can call
    assert engine.stats().checksum_failures == 1


# ---- after close -----------------------------------------------------------------------


def test_background_stats_after_close_are_the_final_figures() -> None:
    caches = make_caches()
    engine = aiokv.OffloadEngine(small_store(), caches)
    kv = aiokv.run_in_background(engine)
    with kv:
        kv.offload(7, torch.arange(0, 4), 4 * PAGE_SIZE)
        with kv.lookup(7, 4 * PAGE_SIZE) as hit:
            kv.load(hit, torch.arange(40, 44))
        assert kv.evict(7) == 4 * PAGE_SIZE
        running = kv.stats()
    final = kv.stats()  # closed: no EngineClosed, the figures as the close left them
    assert (final.completed, final.evicts, final.pending) == (3, 1, 0)
    assert final.completed >= running.completed
    assert final.host_hit_tokens == 4 * PAGE_SIZE  # the store's, asked at the close
    assert kv.stats() == final == engine.stats()
    with pytest.raises(aiokv.EngineClosed):
        kv.offload(7, torch.arange(0, 4), 4 * PAGE_SIZE)


def test_background_stats_during_a_close_wait_for_it() -> None:
    engine = aiokv.OffloadEngine(small_store(), make_caches())
    kv = aiokv.run_in_background(engine)
    kv.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
    read: list[Any] = []
    closer = threading.Thread(target=kv.close)
    closer.start()
    read.append(kv.stats())  # before, during or after the close: never raises
    closer.join()
    assert read[0].completed == 1
    assert kv.stats().completed == 1


def test_store_figures_are_asked_after_work_at_most_every_refresh_and_never_while_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    answers: list[float] = []

    def store_stats() -> dict[str, int]:
        answers.append(now[0])
        if now[0] < 0:
            raise RuntimeError("broken store_stats")
        return {"host_hit_tokens": len(answers)}

    figures = StoreFigures(store_stats, clock=lambda: now[0])
    assert figures.timeout(None) is None  # nothing done: wait for work, however long
    figures.changed()
    figures.refresh()
    assert figures.latest == {"host_hit_tokens": 1}
    figures.changed()
    assert figures.timeout(None) == pytest.approx(REFRESH_S)  # wakes to read the work
    assert figures.timeout(0.01) == pytest.approx(0.01)
    figures.refresh()
    assert figures.latest == {"host_hit_tokens": 1}  # not due yet
    now[0] = REFRESH_S
    figures.refresh()
    assert figures.latest == {"host_hit_tokens": 2}
    assert figures.timeout(None) is None  # read: idle again
    figures.refresh()
    assert answers == [0.0, REFRESH_S]  # nothing asked without work
    now[0] = -1.0  # a store_stats() that raises: logged once, the last answer kept
    for _ in range(3):
        figures.changed()
        figures.refresh(now=True)
    assert figures.latest == {"host_hit_tokens": 2}
    assert sum("store_stats() failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.asyncio
async def test_an_evict_whose_caller_left_still_counts_the_tokens_it_dropped() -> None:
    async with aiokv.OffloadEngine(small_store(), make_caches()) as engine:
        await engine.offload(1, torch.arange(0, 8), 8 * PAGE_SIZE)
        evict = asyncio.ensure_future(engine.evict(1))
        await asyncio.sleep(0)  # with the store thread now
        evict.cancel()
        with pytest.raises(asyncio.CancelledError):
            await evict
        async with await engine.lookup(1, 8 * PAGE_SIZE) as hit:
            assert hit.cached_tokens == 0  # the store dropped the key all the same
        await wait_for(lambda: engine.stats().dropped_tokens == 8 * PAGE_SIZE, "the drop counted")
        await engine.offload(2, torch.arange(8, 12), 4 * PAGE_SIZE)
        assert await engine.evict(2) == 4 * PAGE_SIZE
        assert engine.stats().dropped_tokens == 12 * PAGE_SIZE


@pytest.mark.asyncio
async def test_the_window_histogram_observes_each_call_once_however_often_it_waits_for_room() -> None:
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.00005))  # ~52 blocks
    config = aiokv.EngineConfig(window_us=200, request_timeout_ms=5000)
    engine = aiokv.OffloadEngine(store, make_caches(), config)
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    async with engine:
        await engine.offload(0, torch.arange(0, 40), 40 * PAGE_SIZE)
        hit = await engine.lookup(0, 40 * PAGE_SIZE)  # holds 40 blocks
        waiting = asyncio.ensure_future(engine.offload(1, torch.arange(40, 60), 20 * PAGE_SIZE))
        await wait_for(lambda: engine.stats().space_waits >= 2, "two waits for room")
        hit.release()
        assert (await waiting).stored_tokens == 20 * PAGE_SIZE
        calls = engine.stats().submitted

    def window_count() -> float:
        value = registry.get_sample_value("aiokv_latency_window_seconds_count")
        assert value is not None
        return value

    assert engine.stats().space_waits >= 2
    assert await asyncio.to_thread(window_count) == calls == 3
