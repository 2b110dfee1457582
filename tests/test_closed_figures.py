"""Figures users read at the edges: after a close that left a busy store thread to end on
its own, engine.stats() and a scrape read what the close ended with (final after close;
they moved as that thread went on); and the store-time histogram counts every try, those
whose callers left before the store answered included (they were left out: the slow
ones)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store
from prometheus_client import CollectorRegistry

import aiokv
from aiokv import metrics
from aiokv.testing import StoreWrapper


class HeldLaunch(StoreWrapper):
    """Launches wait for ``gate`` once it is cleared."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def launch(self, *args: Any) -> None:
        if not self.gate.is_set():
            self.entered.set()
            self.gate.wait(30)
        self.inner.launch(*args)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[Any, ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("aiokv-store")}


async def store_thread_ended_and_its_posts_run(others: set[threading.Thread]) -> None:
    """Wait for the store thread to end (any not in ``others``, those running before the
    test's engine started), then for everything it posted to the loop (its outcomes,
    call_soon_threadsafe) and what those scheduled in turn to have run: a callback queued
    once the thread is gone runs after its posts, and one that callback queues runs after
    what they queued."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while store_threads() - others:
        assert loop.time() < deadline, "the store thread never ended"
        await asyncio.sleep(0.05)
    ran = loop.create_future()
    loop.call_soon(lambda: loop.call_soon(ran.set_result, None))
    await ran


@pytest.mark.asyncio
async def test_figures_after_a_close_that_left_the_store_thread_busy_do_not_move() -> None:
    store = HeldLaunch(small_store())
    engine = aiokv.OffloadEngine(store, make_caches())
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    others = store_threads()
    await engine.start()
    await engine.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
    store.gate.clear()
    late = asyncio.ensure_future(engine.offload(2, torch.arange(4, 12), 8 * PAGE_SIZE))
    assert await asyncio.to_thread(store.entered.wait, 10)
    await engine.aclose(timeout=0.2)
    with pytest.raises(aiokv.EngineClosed):
        await late
    stats, scraped = engine.stats(), await asyncio.to_thread(scrape, registry)
    store.gate.set()  # the store thread goes on: launches, copies, posts, closes the store
    await store_thread_ended_and_its_posts_run(others)
    after = engine.stats()
    moved = {f.name: (getattr(stats, f.name), getattr(after, f.name))
             for f in dataclasses.fields(stats) if getattr(stats, f.name) != getattr(after, f.name)}
    assert moved == {}
    assert await asyncio.to_thread(scrape, registry) == scraped


class HeldEvict(StoreWrapper):
    """Evicts wait for ``gate`` once it is cleared."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def evict(self, namespace: Any) -> int:
        self.entered.set()
        self.gate.wait(30)
        return int(self.inner.evict(namespace))


@pytest.mark.asyncio
async def test_an_evict_that_failed_at_close_drops_no_tokens_in_the_figures_later() -> None:
    # The close failed the evict's caller (EngineClosed, counted failed); the store's evict
    # ended later and its token count reached the figures: dropped_tokens moved after
    # close, for an evict its caller was told had failed.
    store = HeldEvict(small_store())
    engine = aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(window_us=0))
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    others = store_threads()
    await engine.start()
    await engine.offload(1, torch.arange(0, 4), 4 * PAGE_SIZE)
    evicting = asyncio.ensure_future(engine.evict(1))
    assert await asyncio.to_thread(store.entered.wait, 10)
    await engine.aclose(timeout=0.2)
    with pytest.raises(aiokv.EngineClosed):
        await evicting
    stats, scraped = engine.stats(), await asyncio.to_thread(scrape, registry)
    store.gate.set()
    await store_thread_ended_and_its_posts_run(others)
    assert engine.stats().dropped_tokens == stats.dropped_tokens == 0
    assert await asyncio.to_thread(scrape, registry) == scraped


class HeldMatch(StoreWrapper):
    """One-by-one matches that wait for ``gate``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def get_match(self, token_ids: Any, namespace: Any) -> Any:
        self.gate.wait(30)
        return self.inner.get_match(token_ids, namespace)


@pytest.mark.asyncio
async def test_the_store_time_histogram_counts_the_tries_whose_callers_left() -> None:
    # Four lookups dispatched together; their callers time out while the store thread is
    # still on the first match: the others are never asked, and were never observed.
    store = HeldMatch(small_store())
    engine = aiokv.OffloadEngine(store, make_caches(),
                                 aiokv.EngineConfig(request_timeout_ms=100))
    registry = CollectorRegistry()
    metrics.register(engine, registry)
    async with engine:
        outcomes = await asyncio.gather(*(engine.lookup(u, 4 * PAGE_SIZE) for u in range(4)),
                                        return_exceptions=True)
        assert [type(o) for o in outcomes] == [aiokv.RequestTimeout] * 4
        store.gate.set()
        key = ("aiokv_latency_store_seconds_count", ())
        deadline = asyncio.get_running_loop().time() + 10
        while (await asyncio.to_thread(scrape, registry)).get(key) != 4:
            assert asyncio.get_running_loop().time() < deadline, await asyncio.to_thread(
                scrape, registry)
            await asyncio.sleep(0.05)
