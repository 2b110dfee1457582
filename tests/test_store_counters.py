"""The store's counters as the engine reports them never fall: not when the store's child
process is restarted (it counts from 0), not while the store server is away (its figures
stay those it gave last, with server_up 0), not when a new server takes its place."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import make_caches, wait_for_exit
from shared_host import PAGE_SIZE, caches
from shared_inprocess import Host

import aiokv
from aiokv.metrics import EngineCollector
from aiokv.store_figures import carried
from aiokv.stores import ProcessStore
from aiokv.stores.shared import SharedStore


def test_carried_adds_the_counts_before_and_keeps_gauges_current() -> None:
    before = {"bytes_d2h": 100, "host_hit_tokens": 8, "host_blocks_used": 5, "server_clients": 2,
              "server_gets_invalidated": 7, "remote_lookup_seconds_max": 2.5}
    now = {"bytes_d2h": 10, "host_blocks_used": 1, "server_clients": 1, "stage_waits": 3,
           "server_gets_invalidated": 1, "remote_lookup_seconds_max": 0.01}
    assert carried(before, now) == {
        "bytes_d2h": 110, "host_hit_tokens": 8, "stage_waits": 3,  # counts: summed
        "server_gets_invalidated": 8,  # the server's one count
        "host_blocks_used": 1, "server_clients": 1,  # levels: the store's own
        "remote_lookup_seconds_max": 2.5,  # the larger
    }


async def asked(engine: aiokv.OffloadEngine) -> aiokv.EngineStats:
    """engine.stats() once the store thread has asked the store for its figures, after
    this call: a scrape made off the loop waits for that answer, which the engine keeps.
    (A fixed sleep for the periodic refresh let a slow host show the figures from before
    what the test just did, and a figure that must not move passed without a look.)"""
    collector = EngineCollector(engine, store_timeout_s=60)
    await asyncio.to_thread(lambda: list(collector.collect()))
    query = collector._asked
    assert query is not None and query.answered, "the store thread did not answer the scrape"
    return engine.stats()


async def offload_and_load(engine: aiokv.OffloadEngine, users: range, page: int) -> None:
    for user in users:
        await engine.offload(user, torch.arange(user * 4, user * 4 + 4), 4 * page)
    for user in users:
        async with await engine.lookup(user, 4 * page) as hit:
            await engine.load(hit, torch.arange(40, 44))


@pytest.mark.asyncio
async def test_a_restarted_store_process_does_not_set_the_counters_back() -> None:
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=True))
    async with aiokv.OffloadEngine(store, make_caches()) as engine:
        page = engine.page_size
        await offload_and_load(engine, range(4), page)
        before = await asked(engine)
        assert before.host_hit_tokens == 16 * page
        pid = store.pid
        os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(wait_for_exit, pid)
        for _ in range(100):  # a call in flight as the child died fails; a new child serves
            try:
                await offload_and_load(engine, range(10, 11), page)
                break
            except aiokv.StoreError:
                await asyncio.sleep(0.05)
        after = await asked(engine)
    assert after.store_restarts == 1
    assert after.host_hit_tokens == before.host_hit_tokens + 4 * page


@pytest.mark.asyncio
async def test_the_server_figures_stay_while_it_is_away_and_go_on_from_a_new_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = Host(tmp_path, ssd=False)
    host.start()
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
    answers: list[dict[str, int | float]] = []  # what store_stats() gave the engine
    ask = store.store_stats

    def recorded() -> dict[str, int | float]:
        answers.append(dict(ask()))
        return answers[-1]

    monkeypatch.setattr(store, "store_stats", recorded)
    try:
        async with aiokv.OffloadEngine(store, caches()) as engine:
            await offload_and_load(engine, range(3), PAGE_SIZE)
            up = await asked(engine)
            assert up.host_hit_tokens == 12 * PAGE_SIZE and up.host_blocks_total > 0
            host.server.drain_timeout_s = 0.0
            await asyncio.to_thread(host.stop)
            with pytest.raises(aiokv.StoreError):
                await engine.lookup(0, 4 * PAGE_SIZE)
            away = await asked(engine)
            assert answers[-1]["server_up"] == 0  # asked with the server away
            assert (away.host_hit_tokens, away.host_blocks_total) == (
                up.host_hit_tokens, up.host_blocks_total)
            host.start()  # a new server: it counts from 0
            for _ in range(200):
                try:
                    await offload_and_load(engine, range(5, 7), PAGE_SIZE)
                    break
                except aiokv.StoreError:  # until the engine reconnects
                    await asyncio.sleep(0.05)
            again = await asked(engine)
            assert again.host_hit_tokens == up.host_hit_tokens + 8 * PAGE_SIZE
    finally:
        host.stop()


async def offload_and_load_again(engine: aiokv.OffloadEngine, users: range) -> None:
    """offload_and_load, tried again while the store's calls fail (a child or server that
    went away: the call in flight fails; a new one serves)."""
    for _ in range(200):
        try:
            await offload_and_load(engine, users, PAGE_SIZE)
            return
        except aiokv.StoreError:
            await asyncio.sleep(0.05)
    raise AssertionError("the store did not come back")


async def host_bytes_copied(engine: aiokv.OffloadEngine, direction: str) -> float:
    """aiokv_bytes_total{direction, tier="host"} as a scrape reads it."""
    collector = EngineCollector(engine, store_timeout_s=60)
    families = await asyncio.to_thread(lambda: list(collector.collect()))
    return next(sample.value for family in families if family.name == "aiokv_bytes"
                for sample in family.samples
                if sample.labels == {"direction": direction, "tier": "host"})


async def kill_child(store: ProcessStore) -> None:
    pid = store.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(wait_for_exit, pid)


def _shared_in_a_child(tmp_path: Path) -> tuple[Host, ProcessStore]:
    """A store server, started, and a shared store on it in a child process."""
    host = Host(tmp_path, ssd=False)
    host.start()
    return host, ProcessStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket),
                                                own_process=True))


@pytest.mark.asyncio
async def test_a_restarted_store_process_on_a_shared_server_counts_the_server_hits_once(
    tmp_path: Path,
) -> None:
    """The server's figures are its running totals: a new child finds the hits the dead
    one reported already counted there, and must not have them added again."""
    host, store = _shared_in_a_child(tmp_path)
    try:
        async with aiokv.OffloadEngine(store, caches()) as engine:
            await offload_and_load(engine, range(3), PAGE_SIZE)
            before = await asked(engine)
            assert before.host_hit_tokens == before.lookup_hit_tokens == 12 * PAGE_SIZE
            await kill_child(store)
            await offload_and_load_again(engine, range(10, 11))
            after = await asked(engine)
            # The engine's own copies, counted by each child: the dead one's go on.
            written = await host_bytes_copied(engine, "d2h")
            read = await host_bytes_copied(engine, "h2d")
    finally:
        host.stop()
    assert after.store_restarts == 1
    assert after.lookup_hit_tokens == 16 * PAGE_SIZE
    assert after.host_hit_tokens == 16 * PAGE_SIZE
    assert after.offloaded_tokens == after.loaded_tokens == 16 * PAGE_SIZE
    assert (written, read) == (after.bytes_offloaded, after.bytes_loaded)


@pytest.mark.asyncio
async def test_a_store_process_on_a_restarted_server_counts_each_server_once_across_its_restart(
    tmp_path: Path,
) -> None:
    """A new server counts from 0 (the old one's hits are carried); a new child after it
    goes on from both servers' hits, counting neither twice nor dropping the first's."""
    host, store = _shared_in_a_child(tmp_path)
    try:
        async with aiokv.OffloadEngine(store, caches()) as engine:
            await offload_and_load(engine, range(3), PAGE_SIZE)
            assert (await asked(engine)).host_hit_tokens == 12 * PAGE_SIZE
            assert host.server is not None
            host.server.drain_timeout_s = 0.0
            await asyncio.to_thread(host.stop)
            host.start()  # a new server: it counts from 0
            await offload_and_load_again(engine, range(5, 7))
            served = await asked(engine)
            assert served.store_restarts == 0  # the same child, on a new server
            assert served.host_hit_tokens == 20 * PAGE_SIZE
            await kill_child(store)
            await offload_and_load_again(engine, range(10, 11))
            after = await asked(engine)
    finally:
        host.stop()
    assert after.store_restarts == 1
    assert after.lookup_hit_tokens == 24 * PAGE_SIZE
    assert after.host_hit_tokens == 24 * PAGE_SIZE
