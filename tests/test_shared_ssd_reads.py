"""An engine's lookup whose pages only the SSD tier holds, on ``aiokv store-server``: the
server reads them into host blocks before it answers that lookup, and answers the other
engines meanwhile; a lookup of the same key waits for those reads and hits. The server
runs in this process (a thread) so that its SSD reads can be held back: a slow SSD on
demand."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Gate, held
from shared_host import PAGE_SIZE, user_kv
from shared_inprocess import (
    PAGES,
    TOKENS,
    Call,
    Host,
    host_fixture,  # noqa: F401  (the host fixture)
    load_exact,
    lookup_reading,
    on_ssd_only,
    wait_for,
)
from test_ssd import (
    BLOCK,
    HOST_BLOCKS,
    PAGE,
    TARGET,
    USER_PAGES,
    offload,
    only_on_ssd,
    same,
    source_pages,
    ssd_config,
)

import aiokv
from aiokv.stores.local import ssd as ssd_module
from aiokv.stores.shared import SharedStore
from aiokv.stores.shared import deferred as deferred_module
from aiokv.stores.shared.service import Service
from aiokv.stores.shared.tasks import Retry

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="the shared region needs memfd_create (Linux)")


def hits_whole(store: SharedStore, tables: list[torch.Tensor], user: int) -> bool:
    """A lookup of ``user`` (answered within 10 s) hits every page, and they load bit for
    bit."""
    task, mask = Call(lambda: store.get_match(TOKENS, [f"user:{user}"])).outcome(10)
    return bool(mask.sum() == PAGES * PAGE_SIZE) and load_exact(store, tables, user, task)


def gone_mid_lookup(reader: SharedStore, user: int, figures: SharedStore,
                    clients_left: int) -> None:
    """``reader`` looks ``user`` up (its pages on SSD only, their reads held) and goes,
    its lookup unanswered (a StoreError); the server sees ``clients_left`` engines then."""
    lookup = lookup_reading(reader, user, figures)
    assert reader._link is not None
    reader._link.sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(aiokv.StoreError):
        lookup.outcome()
    wait_for(lambda: figures.store_stats()["server_clients"] == clients_left, "the drop")


def waits_for_a_read(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once the server has put a lookup off until another read of its key is in (a
    Retry): the lookup reached the server while that read ran."""
    waiting = threading.Event()
    real = Service.get_match

    def get_match(self: Service, *args: Any, **kwargs: Any) -> Any:
        entry = real(self, *args, **kwargs)
        if isinstance(entry, Retry):
            waiting.set()
        return entry

    monkeypatch.setattr(Service, "get_match", get_match)
    return waiting


def waits_for_the_reads_and_hits(store: SharedStore, tables: list[torch.Tensor], user: int,
                                 gate: threading.Event,
                                 monkeypatch: pytest.MonkeyPatch) -> bool:
    """``store``'s lookup of ``user``, whose SSD reads another get started and ``gate``
    holds, is put off until they are in (seen taken by the server while they go on:
    after a fixed sleep, on a loaded host, it could come once they were in and hit
    without waiting), is not answered meanwhile, then hits every page, bit for bit."""
    waits = waits_for_a_read(monkeypatch)
    same_key = Call(lambda: store.get_match(TOKENS, [f"user:{user}"]))
    assert waits.wait(30), "the lookup did not wait for the reads under way"
    assert same_key.is_alive()  # and not answered meanwhile
    gate.set()
    task, mask = same_key.outcome()
    return bool(mask.sum() == PAGES * PAGE_SIZE) and load_exact(store, tables, user, task)


def test_an_engine_waiting_on_ssd_reads_does_not_hold_up_the_others(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = on_ssd_only(host, 7, monkeypatch)
    reader, reader_tables = host.engine()
    twin, twin_tables = host.engine()
    other, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 7, other)
        same_key = Call(lambda: twin.get_match(TOKENS, ["user:7"]))

        # The other engines are answered while the reads wait.
        Call(other.ping).outcome(10)
        put, put_mask = Call(lambda: other.put_match(TOKENS, ["user:8"])).outcome(10)
        assert put_mask.all()
        other.cancel([put])
        assert lookup.is_alive() and same_key.is_alive()

        gate.set()
        task, mask = lookup.outcome()
        assert mask.sum() == PAGES * PAGE_SIZE  # every page, read from SSD
        twin_task, twin_mask = same_key.outcome()
        assert twin_mask.sum() == PAGES * PAGE_SIZE  # waited for those reads: a hit
        assert load_exact(reader, reader_tables, 7, task)
        assert load_exact(twin, twin_tables, 7, twin_task)
        stats = other.store_stats()
        assert stats["server_gets_staging"] == 0 and stats["server_tasks_open"] == 0
    finally:
        gate.set()
        for store in (reader, twin, other):
            store.close()


def test_a_lookup_of_a_key_whose_reader_was_answered_at_its_deadline_waits_for_the_reads(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine's short request_timeout_ms is not a miss for another: its lookup is
    answered at its deadline (its host prefix, none here) while the SSD reads it started
    go on, and another engine's lookup of the key waits for those reads and hits."""
    gate = on_ssd_only(host, 7, monkeypatch)
    reader, _ = host.engine()
    twin, twin_tables = host.engine()
    figures, _ = host.engine()
    try:
        short = Call(lambda: reader.get_match_many([(TOKENS, ["user:7"])],
                                                   deadline_s=time.monotonic() + 0.3))
        wait_for(lambda: figures.store_stats()["server_gets_staging"] == 1, "the reads")
        (answer,) = short.outcome(30)
        assert not isinstance(answer, BaseException)
        gave_up, gave_up_mask = answer
        assert not gave_up_mask.any()  # answered at its deadline, the reads not in
        reader.cancel([gave_up])
        assert waits_for_the_reads_and_hits(twin, twin_tables, 7, gate, monkeypatch)
        stats = figures.store_stats()
        assert stats["server_gets_staging"] == 0 and stats["server_tasks_open"] == 0
    finally:
        gate.set()
        for store in (reader, twin, figures):
            store.close()


def test_an_engine_gone_while_its_ssd_reads_wait_leaves_nothing_held(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = on_ssd_only(host, 9, monkeypatch)
    reader, _ = host.engine()
    figures, figures_tables = host.engine()
    try:
        gone_mid_lookup(reader, 9, figures, clients_left=1)
        gate.set()
        # The reads' blocks were taken when they started: their count says nothing about
        # the reads' end, which is the staging count falling to 0.
        wait_for(lambda: figures.store_stats()["server_gets_staging"] == 0,
                 "the abandoned reads' end")
        stats = figures.store_stats()
        # Read, kept in the LRU, held by no one.
        assert stats["host_blocks_used"] == PAGES and stats["server_blocks_held"] == 0
        assert hits_whole(figures, figures_tables, 9)
    finally:
        gate.set()
        reader.close()
        figures.close()


def test_a_lookup_of_a_key_still_read_for_a_gone_engine_waits_for_those_reads(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gone engine's SSD reads go on (they cannot be recalled): a lookup of the same
    key meanwhile waits for them and hits, as it would behind a live engine's reads,
    instead of missing blocks still being filled (it answered 0 pages)."""
    gate = on_ssd_only(host, 15, monkeypatch)
    reader, _ = host.engine()
    twin, twin_tables = host.engine()
    figures, _ = host.engine()
    try:
        gone_mid_lookup(reader, 15, figures, clients_left=2)
        assert waits_for_the_reads_and_hits(twin, twin_tables, 15, gate, monkeypatch)
    finally:
        gate.set()
        for store in (reader, twin, figures):
            store.close()


def test_a_failure_while_answering_a_reading_lookup_leaves_its_key_readable(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server fails (a bug) as it checks a waiting lookup's reads: that engine is
    disconnected, and its reads are ended as if it had gone, so that the key is not left
    marked as being read, which would make every later lookup of it wait."""
    gate = on_ssd_only(host, 13, monkeypatch)
    reader, _ = host.engine()
    figures, figures_tables = host.engine()
    original = deferred_module.DeferredGets.settle
    armed, failed = [], []

    def settle_fails_once(self: deferred_module.DeferredGets, *args: object) -> object:
        if armed and not failed:
            failed.append(True)
            raise RuntimeError("a bug in the server's answer")
        return original(self, *args)  # type: ignore[arg-type]

    try:
        monkeypatch.setattr(deferred_module.DeferredGets, "settle", settle_fails_once)
        lookup = lookup_reading(reader, 13, figures)
        armed.append(True)  # the next check of its reads fails
        with pytest.raises(aiokv.StoreError):
            lookup.outcome()
        gate.set()
        wait_for(lambda: figures.store_stats()["server_gets_staging"] == 0,
                 "the failed lookup's reads ended")
        assert hits_whole(figures, figures_tables, 13)  # not left waiting for those reads
    finally:
        gate.set()
        reader.close()
        figures.close()


def test_a_drain_answers_a_lookup_still_reading_before_it_exits(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM's drain (``stop``) while a lookup waits for its SSD reads: new matches are
    refused, the waiting lookup is answered once its reads are in and loads bit for
    bit, and the server exits once that task has ended."""
    gate = on_ssd_only(host, 11, monkeypatch)
    reader, reader_tables = host.engine()
    other, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 11, other)
        assert host.server is not None and host.thread is not None
        host.server.stop()
        wait_for(lambda: not host.socket.exists(), "the drain's start")
        with pytest.raises(aiokv.StoreError, match="shutting down"):
            other.put_match(TOKENS, ["user:12"])
        other.close()
        gate.set()
        task, mask = lookup.outcome()
        assert mask.sum() == PAGES * PAGE_SIZE
        assert host.thread.is_alive()  # the task is open: the drain waits for its end
        assert load_exact(reader, reader_tables, 11, task)
        reader.close()
        host.thread.join(20)
        assert not host.thread.is_alive(), "the server did not exit after its last task"
    finally:
        gate.set()
        reader.close()
        other.close()


def test_reads_past_the_timeout_answer_the_host_prefix_and_free_everything_later(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup whose SSD reads take longer than the server waits (30 s; 0.3 here) is
    answered with what the host tier has (nothing here), and so is a lookup of the same
    key that waited behind it; once the reads are in and both end, nothing is held."""
    monkeypatch.setattr(deferred_module, "SSD_STAGE_TIMEOUT_S", 0.3)
    gate = on_ssd_only(host, 13, monkeypatch)
    reader, _ = host.engine()
    twin, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 13, twin)
        same_key = Call(lambda: twin.get_match(TOKENS, ["user:13"]))
        task, mask = lookup.outcome()
        twin_task, twin_mask = same_key.outcome()
        assert not mask.any() and not twin_mask.any()
        gate.set()
        reader.cancel([task])
        twin.cancel([twin_task])
        wait_for(lambda: twin.store_stats()["server_blocks_held"] == 0, "the holds' end")
        stats = twin.store_stats()
        assert stats["server_gets_staging"] == 0 and stats["server_tasks_open"] == 0
        wait_for(lambda: twin.clear() >= 0 and twin.store_stats()["host_blocks_used"] == 0,
                 "every block free after a clear")  # the late reads' blocks held by no one
    finally:
        gate.set()
        reader.close()
        twin.close()


def ssd_then_host(host: Host, user: int) -> None:
    """``user``'s first half offloaded, then on SSD only (the server restarted), then its
    whole history offloaded: the second half only the host tier has."""
    half = PAGES // 2
    namespace = [f"user:{user}"]
    for pages in (half, PAGES):
        writer, tables = host.engine()
        for cache, kv in zip(tables, user_kv(user, PAGES), strict=True):
            cache[:PAGES] = kv
        task, mask = writer.put_match(TOKENS[: pages * PAGE_SIZE], namespace)
        assert mask.sum() == half * PAGE_SIZE and mask[(pages - half) * PAGE_SIZE :].all()
        writer.launch([task], [torch.arange(pages - half, pages)], [None])
        wait_for(lambda: writer.try_wait([task]), "the offload")  # noqa: B023
        if pages == half:
            wait_for(lambda: writer.store_stats()["ssd_blocks_used"] >= half,  # noqa: B023
                     "the SSD copy")
            host.stop()
            host.start()
        writer.close()


def test_a_lookup_of_ssd_pages_then_host_pages_finds_and_loads_them_all(host: Host) -> None:
    """The pages after the SSD ones are a hit too (the put counted them), loaded bit for
    bit; once loaded and cleared, nothing is held."""
    ssd_then_host(host, 15)
    reader, reader_tables = host.engine()
    try:
        task, mask = reader.get_match(TOKENS, ["user:15"])
        assert mask.sum() == PAGES * PAGE_SIZE
        assert load_exact(reader, reader_tables, 15, task)
        stats = reader.store_stats()
        assert stats["server_tasks_open"] == 0 and stats["server_blocks_held"] == 0
        reader.clear()
        wait_for(lambda: reader.store_stats()["host_blocks_used"] == 0, "every block free")
    finally:
        reader.close()


def test_reads_past_the_timeout_give_back_the_host_pages_held_after_them(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup answered with its host prefix (nothing here) once its SSD reads take too
    long also gives back the host pages it held after them."""
    monkeypatch.setattr(deferred_module, "SSD_STAGE_TIMEOUT_S", 0.3)
    ssd_then_host(host, 17)
    gate = held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *args: not request.is_write)
    reader, _ = host.engine()
    try:
        task, mask = reader.get_match(TOKENS, ["user:17"])
        assert not mask.any()
        gate.set()
        reader.cancel([task])
        wait_for(lambda: reader.store_stats()["server_blocks_held"] == 0, "the holds' end")
        wait_for(lambda: reader.clear() >= 0 and reader.store_stats()["host_blocks_used"] == 0,
                 "every block free after a clear")
    finally:
        gate.set()
        reader.close()


@contextlib.contextmanager
def store_of(kind: str, config: aiokv.StoreConfig, directory: Path,
             caches: list[torch.Tensor]
             ) -> Iterator[tuple[aiokv.Store, Callable[[], Mapping[str, int | float]]]]:
    """The embedded store on ``config``, or a server on it (in a thread) and an engine's
    store on that server; with a way to read the store's figures from the loop (the
    shared one's through another engine's store, on caches like ``caches``: the first
    one is busy in its calls)."""
    if kind == "embedded":
        store = aiokv.LocalStore(config)
        yield store, store.store_stats
        return
    host = Host(directory, config=config)
    host.start()
    shared = aiokv.StoreConfig(backend="shared", socket=str(host.socket))
    figures = SharedStore(shared)
    try:
        figures.register([torch.zeros_like(cache) for cache in caches])
        yield SharedStore(shared), figures.store_stats
    finally:
        figures.close()
        host.stop()


async def host_tier_in_flight(engine: aiokv.OffloadEngine, monkeypatch: pytest.MonkeyPatch
                              ) -> Gate:
    """Users 1 and 2 offloaded: the whole host tier, its SSD writes held (until the gate
    returned is set)."""
    writes = held(monkeypatch, ssd_module.SsdTier, "_run",
                  lambda tier, request, *args: request.is_write)
    for user in (1, 2):
        assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
    assert await asyncio.to_thread(writes.entered.wait, 10)
    return writes


async def user_0_on_ssd(tmp_path: Path, **keys: Any
                        ) -> tuple[aiokv.StoreConfig, list[torch.Tensor], list[torch.Tensor]]:
    """An SSD tier under ``tmp_path`` (``ssd_config`` with ``keys``) holding user 0 only
    on SSD (``only_on_ssd``): the config, the caches and user 0's pages as offloaded."""
    (tmp_path / "ssd").mkdir()
    config = ssd_config(tmp_path / "ssd", **keys)
    caches, original = await only_on_ssd(config, (0,))
    return config, caches, original


async def user_0_loads_whole(engine: aiokv.OffloadEngine, caches: list[torch.Tensor],
                             original: list[torch.Tensor], hit: aiokv.Lookup | None = None
                             ) -> bool:
    """A lookup of user 0 (``only_on_ssd``'s; or ``hit``, one made) finds it all, and its
    load brings it bit for bit."""
    if hit is None:
        hit = await engine.lookup(0, USER_PAGES * PAGE)
    assert hit.cached_tokens == USER_PAGES * PAGE
    assert (await engine.load(hit, TARGET)).loaded_tokens == USER_PAGES * PAGE
    return same(caches, original, TARGET, source_pages(0))


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind", ["embedded", "shared"])
async def test_a_lookup_while_ssd_writes_hold_the_free_host_blocks_waits_and_hits_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, policy: str) -> None:
    """User 0 on SSD only; users 1 and 2 fill the host tier, their SSD writes held: no
    host block is free for user 0's SSD pages until those writes are in. The embedded
    store's Lookup reports them all and its load waits for the room; the server answered
    at once with the host prefix (nothing), a miss the same config did not have."""
    config, caches, original = await user_0_on_ssd(tmp_path, ssd_write_policy=policy)
    with store_of(kind, config, tmp_path, caches) as (store, figures):
        async with aiokv.OffloadEngine(store, caches) as engine:
            writes = await host_tier_in_flight(engine, monkeypatch)
            try:
                lookup = asyncio.ensure_future(engine.lookup(0, USER_PAGES * PAGE))
                # Embedded: answered at once. Shared: answered once the room is there,
                # so the writes go on once the server says the lookup waits for it (in
                # its answer to another engine's call, meanwhile).
                await asyncio.to_thread(wait_for, lambda: lookup.done()
                                        or figures()["stage_waits"], "the lookup's answer")
            finally:
                writes.set()
            hit = await lookup
            assert hit.cached_tokens == USER_PAGES * PAGE
            assert (await engine.load(hit, TARGET)).loaded_tokens == USER_PAGES * PAGE
            assert same(caches, original, TARGET, source_pages(0))


@pytest.mark.asyncio
async def test_a_lookup_that_finds_no_host_room_in_time_answers_its_host_prefix_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the writes stay held past the server's wait (30 s; 0.3 here): the
    lookup is answered with what the host has (nothing), and what it held goes back: once
    the writes are in, a lookup of the key finds and loads it all."""
    wait_s = deferred_module.SSD_STAGE_TIMEOUT_S
    monkeypatch.setattr(deferred_module, "SSD_STAGE_TIMEOUT_S", 0.3)
    config, caches, original = await user_0_on_ssd(tmp_path)
    with store_of("shared", config, tmp_path, caches) as (store, figures):
        async with aiokv.OffloadEngine(store, caches) as engine:
            writes = await host_tier_in_flight(engine, monkeypatch)
            try:
                async with await engine.lookup(0, USER_PAGES * PAGE) as late:
                    assert late.cached_tokens == 0
                assert figures()["stage_waits"] == 1
            finally:
                writes.set()
            # The server's own wait again: the 0.3 s was the late lookup's, and this one
            # waits for the copies just let go and then its reads, which a loaded host
            # may well take longer than that over.
            monkeypatch.setattr(deferred_module, "SSD_STAGE_TIMEOUT_S", wait_s)
            assert await user_0_loads_whole(engine, caches, original)
            stats = figures()
            assert stats["server_gets_staging"] == 0 and stats["server_blocks_held"] == 0


async def users_1_and_2_held(engine: aiokv.OffloadEngine) -> list[aiokv.Lookup]:
    """Lookups of users 1 and 2 (offloaded, the whole host tier), each finding it all."""
    holds = [await engine.lookup(user, USER_PAGES * PAGE) for user in (1, 2)]
    assert [h.cached_tokens for h in holds] == [USER_PAGES * PAGE] * 2
    return holds


async def user_0_answered_nothing_at_once(engine: aiokv.OffloadEngine) -> None:
    """A lookup of user 0 (on SSD only) answered with its host prefix, nothing, within
    15 s: at once, against the server's 30 s wait for room."""
    short = await asyncio.wait_for(engine.lookup(0, USER_PAGES * PAGE), 15)
    assert short.cached_tokens == 0
    short.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_lookup_whose_host_room_only_its_own_lookups_hold_answers_its_host_prefix_at_once(
        tmp_path: Path, policy: str) -> None:
    """User 0 on SSD only; the engine holds Lookups of users 1 and 2, the whole host tier,
    and no SSD copy is under way: only this engine can give the room back, and it is
    blocked in its lookup of user 0. That lookup is answered at once with what the host
    has (nothing), not after the server's 30 s wait; once the Lookups are given back, a
    lookup of user 0 loads it all, bit for bit."""
    config, caches, original = await user_0_on_ssd(tmp_path, ssd_write_policy=policy)
    with store_of("shared", config, tmp_path, caches) as (store, figures):
        async with aiokv.OffloadEngine(store, caches) as engine:
            for user in (1, 2):
                assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
            holds = await users_1_and_2_held(engine)
            try:
                if policy == "write_through":  # their copies are in: none under way
                    await asyncio.to_thread(wait_for, lambda: figures()["bytes_ssd_written"]
                                            >= 2 * USER_PAGES * BLOCK, "the SSD copies")
                # (write_back: copies down of the LRU may be under way; they end soon.)
                await user_0_answered_nothing_at_once(engine)
                if policy == "write_through":
                    assert figures()["stage_waits"] == 0  # it did not wait: as before
            finally:
                for hold in holds:
                    hold.release()
            assert await user_0_loads_whole(engine, caches, original)


@pytest.mark.asyncio
async def test_a_lookup_whose_room_ssd_copies_hold_for_its_own_lookups_answers_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the SSD copies of users 1 and 2 are still held when the lookup of
    user 0 comes: they hold host blocks, but blocks this engine's own Lookups read, so
    their end frees nothing. The lookup is answered at once with its host prefix
    (nothing), not when the copies are in (it waited for them: as long as the disk took,
    up to the server's 30 s, past request_timeout_ms on a slow one)."""
    config, caches, original = await user_0_on_ssd(tmp_path)
    with store_of("shared", config, tmp_path, caches) as (store, figures):
        async with aiokv.OffloadEngine(store, caches) as engine:
            writes = await host_tier_in_flight(engine, monkeypatch)
            holds: list[aiokv.Lookup] = []
            try:
                holds = await users_1_and_2_held(engine)
                # The writes stay held until the lookup is answered.
                await user_0_answered_nothing_at_once(engine)
                assert figures()["stage_waits"] == 0  # it did not wait
            finally:
                writes.set()
                for hold in holds:
                    hold.release()
            assert await user_0_loads_whole(engine, caches, original)


@pytest.mark.asyncio
async def test_a_lookup_waiting_for_room_another_engine_then_holds_answers_once_copies_are_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """User 0 only on SSD; users 1 and 2 fill the host tier, their SSD copies held: the
    lookup of user 0 waits for the room their end brings. Meanwhile another engine looks
    users 1 and 2 up and holds them: once the copies are in, no room comes, and the
    lookup is answered then with its host prefix (nothing), not at the server's 30 s; once
    the other engine lets go, user 0 loads whole."""
    config, caches, original = await user_0_on_ssd(tmp_path)
    with store_of("shared", config, tmp_path, caches) as (store, figures):
        other: SharedStore = figures.__self__  # type: ignore[attr-defined]
        async with aiokv.OffloadEngine(store, caches) as engine:
            writes = await host_tier_in_flight(engine, monkeypatch)
            held_there: list[int] = []
            try:
                lookup = asyncio.ensure_future(engine.lookup(0, USER_PAGES * PAGE))
                await asyncio.to_thread(wait_for, lambda: figures()["stage_waits"],
                                        "the lookup waiting")
                tokens = torch.arange(USER_PAGES * PAGE).numpy()
                answers = await asyncio.to_thread(
                    other.get_match_many, [(tokens, [f"uid:{user}"]) for user in (1, 2)])
                for answer in answers:
                    assert isinstance(answer, tuple) and answer[1].all()
                    held_there.append(answer[0])
                writes.set()
                short = await asyncio.wait_for(lookup, 15)
                assert short.cached_tokens == 0
                short.release()
            finally:
                writes.set()
                await asyncio.to_thread(other.cancel, held_there)
            assert await user_0_loads_whole(engine, caches, original)


@pytest.mark.asyncio
@pytest.mark.parametrize("order", ["small_first", "large_first"])
async def test_a_small_lookup_that_fits_the_room_left_is_not_held_short_by_a_large_one_queued_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """Users 0 and 3 only on SSD; users 1 and 2 fill the host tier, their SSD copies held.
    Another engine holds 10 of the 16 host blocks; a lookup of user 0 (8 SSD pages) waits
    for room, then one of 2 pages of user 3 behind it. Once the copies are in, 6 blocks
    are free: never enough for user 0 (answered with its host prefix, nothing), enough for
    user 3's 2 pages, which the small lookup hits and loads bit for bit, whichever of the
    two engines connected to the server first (the server visits them in that order)."""
    (tmp_path / "ssd").mkdir()
    config = ssd_config(tmp_path / "ssd")
    caches, original = await only_on_ssd(config, (0, 3))
    small_pages = 2
    tokens = torch.arange(USER_PAGES * PAGE).numpy()
    host = Host(tmp_path, config=config)
    host.start()
    shared = aiokv.StoreConfig(backend="shared", socket=str(host.socket))
    other, small = SharedStore(shared), SharedStore(shared)
    figures = other.store_stats
    try:
        other.register([torch.zeros_like(cache) for cache in caches])
        small_caches = [torch.zeros_like(cache) for cache in caches]
        if order == "small_first":
            small.register(small_caches)
        engine = aiokv.OffloadEngine(SharedStore(shared), caches)
        await engine.start()
        writes = None
        held_there: list[int] = []
        try:
            if order == "large_first":
                small.register(small_caches)
            writes = await host_tier_in_flight(engine, monkeypatch)
            answers = await asyncio.to_thread(other.get_match_many, [
                (tokens, ["uid:1"]), (tokens[: 2 * PAGE], ["uid:2"])])
            for answer in answers:
                assert isinstance(answer, tuple) and answer[1].all()
                held_there.append(answer[0])
            large = asyncio.ensure_future(engine.lookup(0, USER_PAGES * PAGE))
            await asyncio.to_thread(wait_for, lambda: figures()["stage_waits"] >= 1,
                                    "the large lookup waiting")
            lookup = Call(lambda: small.get_match(tokens[: small_pages * PAGE], ["uid:3"]))
            await asyncio.to_thread(wait_for, lambda: figures()["stage_waits"] >= 2,
                                    "the small lookup waiting")
            writes.set()
            task, mask = await asyncio.to_thread(lookup.outcome, 20)
            short = await asyncio.wait_for(large, 20)
            assert int(mask.sum()) == small_pages * PAGE
            assert short.cached_tokens == 0
            short.release()
            target = TARGET[:small_pages]
            small.launch([task], [target], [None])
            results: dict[int, Any] = {}
            await asyncio.to_thread(wait_for, lambda: results.update(small.try_wait([task]))
                                    or results, "the small load")
            assert same(small_caches, original, target, source_pages(3)[:small_pages])
        finally:
            if writes is not None:
                writes.set()
            await asyncio.to_thread(other.cancel, held_there)
            await engine.aclose()
            small.close()
        stats = figures()
        assert stats["server_blocks_held"] == 0 and stats["server_gets_staging"] == 0
    finally:
        other.close()
        host.stop()


def test_a_lookup_behind_another_engines_reads_is_answered_at_its_own_deadline(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine looks up a key another engine's lookup is reading from SSD (the reads
    held): past its batch's deadline it is answered with what the host has (nothing),
    not when those reads are in (up to the server's 30 s, its store thread blocked that
    long), while the other lookup still waits; once the reads are in, both engines find
    and load the key whole."""
    gate = on_ssd_only(host, 19, monkeypatch)
    reader, reader_tables = host.engine()
    twin, twin_tables = host.engine()
    try:
        lookup = lookup_reading(reader, 19, twin)
        short = Call(lambda: twin.get_match_many([(TOKENS, ["user:19"])],
                                                 deadline_s=time.monotonic() + 0.3))
        ((twin_task, twin_mask),) = short.outcome(10)
        assert not twin_mask.any()
        twin.cancel([twin_task])
        assert lookup.is_alive()  # its reads are still held
        gate.set()
        task, mask = lookup.outcome()
        assert mask.sum() == PAGES * PAGE_SIZE
        assert load_exact(reader, reader_tables, 19, task)
        assert hits_whole(twin, twin_tables, 19)
        stats = twin.store_stats()
        assert stats["server_tasks_open"] == 0 and stats["server_blocks_held"] == 0
    finally:
        gate.set()
        reader.close()
        twin.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["embedded", "shared"])
async def test_a_lookup_whose_ssd_reads_outlast_request_timeout_ms_holds_up_no_later_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """User 0 on SSD only, its reads held; an engine with request_timeout_ms: 2000. Its
    lookup and load of user 0 fail with RequestTimeout, and its calls after that are
    answered: a lookup of user 1 (on the host tier) hits, an offload of user 2 is stored.
    The server used to hold the lookup up to its own 30 s, and the engine's store thread
    with it: every call of that engine timed out meanwhile. Once the reads are let go,
    user 0 loads whole, bit for bit, and after a clear no host block is used."""
    config, caches, original = await user_0_on_ssd(tmp_path)
    # Room for every user's pages: no call here waits for host room.
    config = dataclasses.replace(config, cpu_cache_gb=4 * HOST_BLOCKS * BLOCK / (1 << 30))
    with store_of(kind, config, tmp_path, caches) as (store, figures):
        # 2 s: the calls after the timed-out ones share it, and a loaded host can take
        # more than 500 ms to answer one; the fault took the server's 30 s.
        async with aiokv.OffloadEngine(store, caches,
                                       aiokv.EngineConfig(request_timeout_ms=2_000)) as engine:
            assert (await offload(engine, 1)).stored_tokens == USER_PAGES * PAGE
            reads = held(monkeypatch, ssd_module.SsdTier, "_run",
                         lambda tier, request, *args: not request.is_write)
            try:
                with pytest.raises(aiokv.RequestTimeout):  # embedded: its load's
                    hit = await engine.lookup(0, USER_PAGES * PAGE)
                    await engine.load(hit, TARGET)
                assert reads.entered.is_set()  # it waited for the reads held
                async with await engine.lookup(1, USER_PAGES * PAGE) as other:
                    assert other.cached_tokens == USER_PAGES * PAGE
                assert (await offload(engine, 2)).stored_tokens == USER_PAGES * PAGE
            finally:
                reads.set()
            # The reads given up on end by themselves: then user 0 is read whole again.
            await asyncio.to_thread(wait_for, lambda: figures()["bytes_ssd_read"]
                                    >= USER_PAGES * BLOCK, "the held reads' end")
            assert await user_0_loads_whole(engine, caches, original)
            await engine.clear()
            await asyncio.to_thread(wait_for, lambda: figures()["host_blocks_used"] == 0,
                                    "every host block given back")
            stats = figures()
            assert stats.get("server_tasks_open", 0) == 0
            assert stats.get("server_gets_staging", 0) == 0
