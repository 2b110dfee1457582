"""An offload whose caller stopped waiting while its copy ran keeps nothing of it.

Found by review: an offload that failed with RequestTimeout (or whose caller was
cancelled) after its launch left its copy running; the caller, whose call had resolved,
reused its pages, the copy read them, and the store kept what it read as the key's
pages: a later lookup and load was a full hit that returned bytes written after the
timeout, or a mix, with no error. Now such a put ends FAILED and stores nothing, unless
its copy had ended before the caller was told (then it read the offloaded bytes).

The copy is held (``Copier._move_cpu`` waits for a gate) until the caller was told and
overwrote its pages; no timing decides what is tested.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import PAGE_SIZE, Gate, held, small_store
from shared_host import caches as shared_caches
from shared_host import wait_for
from shared_inprocess import (
    PAGES,
    Host,
    host_fixture,  # noqa: F401  (the host fixture)
)
from shared_inprocess import TOKENS as SHARED_TOKENS
from test_edges import eventually, pages

import aiokv
import aiokv.testing
from aiokv.copy.copier import Copier
from aiokv.stores.base import TaskStatus
from aiokv.stores.process import ProcessStore
from aiokv.stores.shared import SharedStore

TOKENS = 4 * PAGE_SIZE
# Every call of a test has it, its set-up calls too: long enough for a loaded runner.
TIMEOUT_MS = 1000


def engine_of(caches: list[torch.Tensor], timeout_ms: int = TIMEOUT_MS) -> aiokv.OffloadEngine:
    config = aiokv.EngineConfig(window_us=0, request_timeout_ms=timeout_ms)
    return aiokv.OffloadEngine(small_store(), caches, config)


async def copy_ends(engine: aiokv.OffloadEngine, copying: Gate) -> None:
    """Let the held copy run, and wait (bounded) until its task ended in the store."""
    copying.set()
    await eventually(lambda: engine.stats().store_tasks_open == 0)


async def copy_ends_with_the_store_thread(engine: aiokv.OffloadEngine, copying: Gate) -> None:
    """Let the held copy run, and wait (bounded) until the engine's store thread, told
    to end by a close or a crash, has ended: what became of the copy is reported then."""
    copying.set()
    assert engine._worker is not None
    assert await asyncio.to_thread(engine._worker.join, 10)


async def loaded(engine: aiokv.OffloadEngine, caches: list[torch.Tensor], key: str,
                 into: torch.Tensor) -> int:
    """Tokens a lookup and load of ``key`` put into the pages ``into`` (zeroed first)."""
    for cache in caches:
        cache[into] = 0.0
    async with await engine.lookup(key, TOKENS) as hit:
        return (await engine.load(hit, into)).loaded_tokens


def on_server(host: Host) -> tuple[SharedStore, list[torch.Tensor]]:
    """A client of the test's store server, and caches for an engine on it."""
    return SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket))), \
        shared_caches()


def copies_held_on_server(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> tuple[Gate, SharedStore, list[torch.Tensor]]:
    """Offloads' copies to the host held until the gate returned is set, then, as
    :func:`on_server`, a client of the test's store server and caches for an engine."""
    copying = held(monkeypatch, Copier, "_move_cpu", lambda copier, job: job.to_host)
    return (copying, *on_server(host))


async def another_engine_misses_then_stores(host: Host, tokens: int) -> None:
    """Another engine on the server: the key ``u`` is a miss (before the fixes: every
    page, each 7.0, what the copy read after its caller was told), and an offload of it
    now stores what its pages hold now."""
    store, tables = on_server(host)
    async with aiokv.OffloadEngine(store, tables, aiokv.EngineConfig(window_us=0)) as other:
        for cache in tables:
            cache[:PAGES] = 3.0
        await misses_then_stores(other, tables, tokens, 3.0)


async def misses_then_stores(engine: aiokv.OffloadEngine, tables: list[torch.Tensor],
                             tokens: int, value: float) -> None:
    """The key ``u`` is a miss; an offload of pages ``0..PAGES`` (each ``value`` now)
    stores them, and they load back as they are."""
    source, target = torch.arange(PAGES), torch.arange(PAGES, 2 * PAGES)
    async with await engine.lookup("u", tokens) as hit:
        assert hit.cached_tokens == 0
    assert (await engine.offload("u", source, tokens)).stored_tokens == tokens
    async with await engine.lookup("u", tokens) as hit:
        assert (await engine.load(hit, target)).loaded_tokens == tokens
    for cache in tables:
        assert bool((cache[target] == value).all())


@pytest.mark.asyncio
@pytest.mark.parametrize("stop", ["timeout", "cancel"])
async def test_an_offload_that_stops_waiting_during_its_copy_stores_nothing_of_its_reused_pages(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    copying = held(monkeypatch, Copier, "_move_cpu", lambda copier, job: job.to_host)
    source, target = pages(0), pages(40)
    async with engine_of(caches, TIMEOUT_MS if stop == "timeout" else 0) as engine:
        call = asyncio.ensure_future(engine.offload("u", source, TOKENS))
        try:
            assert await asyncio.to_thread(copying.entered.wait, 10)  # launched, copying
            if stop == "timeout":
                with pytest.raises(aiokv.RequestTimeout):
                    await asyncio.wait_for(call, 10)
            else:
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            for cache in caches:  # the call resolved: its pages are the caller's again
                cache[source] = 7.0
        finally:
            await copy_ends(engine, copying)  # the copy reads them now
        # Before the fix: a full hit, every byte 7.0 (what was written after the call).
        assert await loaded(engine, caches, "u", target) == 0
        stats = engine.stats()
        assert (stats.timed_out if stop == "timeout" else stats.cancelled, stats.pending) == (1, 0)
        # The key is not held up: an offload now stores what the pages hold now.
        assert (await engine.offload("u", source, TOKENS)).stored_tokens == TOKENS
        assert await loaded(engine, caches, "u", target) == TOKENS
        for cache in caches:
            assert bool((cache[target] == 7.0).all())


@pytest.mark.asyncio
async def test_an_offload_whose_copy_ends_in_time_is_stored_bit_for_bit(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    copying = held(monkeypatch, Copier, "_move_cpu", lambda copier, job: job.to_host)
    source, target = pages(0), pages(40)
    original = [cache[source].clone() for cache in caches]
    async with engine_of(caches, timeout_ms=0) as engine:
        call = asyncio.ensure_future(engine.offload("u", source, TOKENS))
        assert await asyncio.to_thread(copying.entered.wait, 10)
        copying.set()
        assert (await asyncio.wait_for(call, 10)).stored_tokens == TOKENS
        for cache in caches:
            cache[source] = 7.0
        assert await loaded(engine, caches, "u", target) == TOKENS
        for cache, before in zip(caches, original, strict=True):
            assert torch.equal(cache[target], before)


def test_a_shared_server_keeps_no_put_whose_caller_detached_during_its_copy(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same for a store server's client (its copies run in the engine's process): the
    # engine's detach, as at a RequestTimeout or a cancellation, before its copy ended.
    store, tables = host.engine()
    try:
        copying = held(monkeypatch, Copier, "_move_cpu", lambda copier, job: job.to_host)
        results: dict[int, Any] = {}
        put, mask = store.put_match(SHARED_TOKENS, ["user:1"])
        assert mask.all()
        store.launch([put], [torch.arange(PAGES)], [None])
        assert copying.entered.wait(10)
        store.detach(put)
        for cache in tables:
            cache[:PAGES] = 7.0
        copying.set()
        wait_for(lambda: results.update(store.try_wait([put])) or results, "the offload")
        assert results[put].status is TaskStatus.FAILED
        assert "stopped waiting" in str(results[put].error)
        get, mask = store.get_match(SHARED_TOKENS, ["user:1"])
        assert not mask.any()  # before the fix: every page, each 7.0
        store.cancel([get])
        # A put detached after its copy ended read the pages before its caller was told.
        again, _ = store.put_match(SHARED_TOKENS, ["user:1"])
        store.launch([again], [torch.arange(PAGES)], [None])
        results.clear()
        wait_for(lambda: results.update(store.try_wait([again])) or results, "the offload")
        store.detach(again)
        assert results[again].status is TaskStatus.SUCCESS
        get, mask = store.get_match(SHARED_TOKENS, ["user:1"])
        assert mask.all()
        store.cancel([get])
    finally:
        store.close()


@pytest.mark.asyncio
async def test_an_engine_on_a_shared_server_stores_nothing_of_a_timed_out_offloads_reused_pages(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    copying, store, tables = copies_held_on_server(host, monkeypatch)
    config = aiokv.EngineConfig(window_us=0, request_timeout_ms=TIMEOUT_MS)
    tokens, source = PAGES * PAGE_SIZE, torch.arange(PAGES)
    async with aiokv.OffloadEngine(store, tables, config) as engine:
        call = asyncio.ensure_future(engine.offload("u", source, tokens))
        try:
            assert await asyncio.to_thread(copying.entered.wait, 10)
            with pytest.raises(aiokv.RequestTimeout):
                await asyncio.wait_for(call, 10)
            for cache in tables:
                cache[source] = 7.0
        finally:
            await copy_ends(engine, copying)
        # Before the fix: a hit of every page, each 7.0.
        await misses_then_stores(engine, tables, tokens, 7.0)


@pytest.mark.asyncio
async def test_a_close_that_abandons_an_offload_mid_copy_leaves_nothing_of_its_reused_pages(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A close whose timeout passes while an offload's copy runs fails it with
    # EngineClosed, and its caller may reuse its pages; the store server outlives the
    # engine, and another engine's lookup must not find what the copy read since.
    copying, store, tables = copies_held_on_server(host, monkeypatch)
    tokens, source = PAGES * PAGE_SIZE, torch.arange(PAGES)
    engine = aiokv.OffloadEngine(store, tables, aiokv.EngineConfig(window_us=0))
    await engine.start()
    call = asyncio.ensure_future(engine.offload("u", source, tokens))
    try:
        assert await asyncio.to_thread(copying.entered.wait, 10)
        # The copy is held: the close gives up on it, whatever its timeout.
        await engine.aclose(timeout=0.2)
        with pytest.raises(aiokv.EngineClosed):
            await call
        for cache in tables:
            cache[source] = 7.0
    finally:
        await copy_ends_with_the_store_thread(engine, copying)  # the copy reads them now
    await another_engine_misses_then_stores(host, tokens)


class CrashingStore(aiokv.testing.StoreWrapper):
    """``crash`` makes the next put_match raise a BaseException: a bug that escapes every
    handler and ends the store thread."""

    crash = False

    def put_match(self, token_ids: Any, namespace: Any) -> Any:
        if self.crash:
            self.crash = False
            raise KeyboardInterrupt("a bug")
        return self.inner.put_match(token_ids, namespace)


@pytest.mark.asyncio
async def test_a_crashed_store_thread_leaves_nothing_of_an_offload_it_failed_mid_copy(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The crash fails what the thread held with StoreError while the offload's copy runs;
    # its caller reuses its pages, and the store's close (which waits for the copy) must
    # not report it done to the server.
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's crash
    copying, client, tables = copies_held_on_server(host, monkeypatch)
    store = CrashingStore(client)
    store.put_match_many = None  # every match through put_match, the crashing one
    tokens, source = PAGES * PAGE_SIZE, torch.arange(PAGES)
    async with aiokv.OffloadEngine(store, tables, aiokv.EngineConfig(window_us=0)) as engine:
        call = asyncio.ensure_future(engine.offload("u", source, tokens))
        try:
            assert await asyncio.to_thread(copying.entered.wait, 10)
            store.crash = True
            with pytest.raises(aiokv.StoreError, match="crashed"):
                await engine.offload("v", torch.arange(PAGES, 2 * PAGES), tokens)
            with pytest.raises(aiokv.StoreError, match="crashed"):
                await call
            for cache in tables:
                cache[source] = 7.0
        finally:
            await copy_ends_with_the_store_thread(engine, copying)  # the copy reads them now
    await another_engine_misses_then_stores(host, tokens)


# Imported by a store's child process at its start (PYTHONPATH): its copies of offloads
# wait, once it says so in a file, for a file the test writes.
_HOLD_THE_CHILDS_COPIES = """
import os, time
where = os.environ.get("AIOKV_TEST_HOLD_COPIES")
if where:
    from aiokv.copy import copier
    real = copier.Copier._move_cpu
    def held(self, job):
        if job.to_host:
            open(os.path.join(where, "entered"), "w").close()
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
                time.sleep(0.002)
        return real(self, job)
    copier.Copier._move_cpu = held
"""


@pytest.mark.asyncio
async def test_an_offload_to_a_store_in_its_own_process_stores_nothing_of_its_reused_pages(
    caches: list[torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's copies run in its child; the detach must reach it before the caller
    # hears its RequestTimeout (a table in shared memory, not a message behind a call).
    (tmp_path / "sitecustomize.py").write_text(_HOLD_THE_CHILDS_COPIES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("AIOKV_TEST_HOLD_COPIES", str(tmp_path))
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    config = aiokv.EngineConfig(window_us=0, request_timeout_ms=TIMEOUT_MS)
    source, target = pages(0), pages(40)
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        call = asyncio.ensure_future(engine.offload("u", source, TOKENS))
        try:
            await eventually(lambda: (tmp_path / "entered").exists())  # the child copies
            with pytest.raises(aiokv.RequestTimeout):
                await asyncio.wait_for(call, 10)
            for cache in caches:  # the call resolved: its pages are the caller's again
                cache[source] = 7.0
        finally:
            (tmp_path / "go").touch()  # the child's copy reads them now
            await eventually(lambda: engine.stats().store_tasks_open == 0)
        # Before the fix: a full hit, every byte 7.0 (what was written after the call).
        assert await loaded(engine, caches, "u", target) == 0
        assert (await engine.offload("u", source, TOKENS)).stored_tokens == TOKENS
        assert await loaded(engine, caches, "u", target) == TOKENS
        for cache in caches:
            assert bool((cache[target] == 7.0).all())
