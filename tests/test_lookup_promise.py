"""A Lookup holds what it reported (issue 29, items 3 and 4), on the embedded store with a
host tier of two users over an SSD tier that holds everyone:

- every load brings the tokens its Lookup reported, bit for bit, under both SSD write
  policies, while every user's Lookup is held at once and offloads compete for the room;
- pages only the SSD has are a hit even when the host tier has no room to stage them at
  that moment: the load waits for the room (``EngineStats.stage_waits`` counts it);
- a launched load never waits for the room a held Lookup's prefetch took (it gives way);
- nor past its deadline (the README review, stage 4): a load whose caller was told
  RequestTimeout has nothing more copied into its pages, however soon the room or its SSD
  reads come after.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Gate, held
from pinning import pin_in_chunks
from test_ssd import BLOCK, DIM, HEADS, HOST_BLOCKS, LAYERS, PAGE, SLOT, USER_PAGES

import aiokv
from aiokv.stores.local import ssd as ssd_module

HISTORY = USER_PAGES * PAGE  # 128 tokens
USERS = 12  # six times the host tier
PAGES = 2 * (USERS + 4) * USER_PAGES  # each user's source pages, then its load destination


def source(user: int) -> torch.Tensor:
    return torch.arange(USER_PAGES * user, USER_PAGES * (user + 1))


def destination(user: int) -> torch.Tensor:
    return source(user) + PAGES // 2


def engine_on(
    directory: Path, policy: str, own_process: bool = False, ssd_users: int = 4 * USERS,
    **engine_keys: int,
) -> tuple[list[torch.Tensor], aiokv.OffloadEngine]:
    generator = torch.Generator().manual_seed(29)
    caches = [torch.randn(PAGES, 2, PAGE, HEADS, DIM, generator=generator) for _ in range(LAYERS)]
    config = aiokv.StoreConfig(
        cpu_cache_gb=HOST_BLOCKS * BLOCK / (1 << 30),
        ssd_cache_gb=ssd_users * USER_PAGES * SLOT / (1 << 30),
        ssd_cache_dir=str(directory),
        ssd_write_policy=policy,
    )
    store: aiokv.Store = aiokv.ProcessStore(config) if own_process else aiokv.LocalStore(config)
    return caches, aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(**engine_keys))


def loaded_intact(caches: list[torch.Tensor], user: int, tokens: int) -> bool:
    """The first ``tokens`` of the user's pages came back into its destination."""
    pages = tokens // PAGE
    return all(torch.equal(c[destination(user)[:pages]], c[source(user)[:pages]]) for c in caches)


def forget_loads(caches: list[torch.Tensor]) -> None:
    for cache in caches:
        cache[PAGES // 2 :] = float("nan")


async def until(engine: aiokv.OffloadEngine, reached: Callable[[aiokv.EngineStats], bool]) -> None:
    """Wait until the engine's stats show what ``reached`` asks (60 s at most: a slow
    disk's writes; then the test fails here, saying so, not at a later step)."""
    for _ in range(6000):
        if reached(engine.stats()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine's stats never got there: {engine.stats()}")


def held_reads(monkeypatch: pytest.MonkeyPatch, reading: bool = True) -> Gate:
    """The SSD tier's reads held until the gate returned is set (none where not
    ``reading``); writes go on."""
    return held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *args: reading and not request.is_write)


def held_writes(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """The SSD tier's writes held until the gate returned is set; reads go on."""
    return held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *args: request.is_write)


@asynccontextmanager
async def a_load_of_user_0_timed_out_mid_read(
    engine: aiokv.OffloadEngine, caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[None]:
    """Users 0 to 3 offload, each whole on SSD; users 2 and 3 hold the host tier, users 0
    and 1 are only on SSD. Then user 0 is looked up, its SSD reads start and are held, and
    its load gives up at its deadline (its destination forgotten first). The reads stay
    held until the block is left, however it is left."""
    for user in range(4):
        if user == 2:  # its room: users 0's and 1's host blocks, once on SSD
            await until(engine, lambda s: s.bytes_ssd_written >= 2 * USER_PAGES * BLOCK)
        await engine.offload(user, source(user), HISTORY)
    await until(engine, lambda stats: stats.bytes_ssd_written >= 4 * USER_PAGES * BLOCK)
    gate = held_reads(monkeypatch)
    try:
        hit = await engine.lookup(0, HISTORY)
        assert hit.cached_tokens == HISTORY
        forget_loads(caches)
        with pytest.raises(aiokv.RequestTimeout):
            await engine.load(hit, destination(0))
        yield
    finally:
        gate.set()


async def no_room_for_user_0(
    engine: aiokv.OffloadEngine, caches: list[torch.Tensor], offloaded: int = 0
) -> tuple[list[aiokv.Lookup], aiokv.Lookup]:
    """Users 0 to 3 offload (those below ``offloaded`` have already); users 2 and 3 are
    the host tier's two users, and their Lookups hold all of it; user 0 is only on SSD, a
    hit with no room to stage it now. Returns (the holders' Lookups, user 0's), the
    loads' destinations forgotten. Users 2 and 3 offload once users 0 and 1 are on SSD:
    on a busy disk their room could come later than a short request_timeout_ms."""
    for user in range(offloaded, 4):
        if user == 2:  # its room: users 0's and 1's host blocks, evictable once on SSD
            await until(engine, lambda stats: stats.bytes_ssd_written >= 2 * USER_PAGES * BLOCK)
        await engine.offload(user, source(user), HISTORY)
    holders = [await engine.lookup(user, HISTORY) for user in (2, 3)]
    assert [hit.cached_tokens for hit in holders] == [HISTORY, HISTORY]
    hit = await engine.lookup(0, HISTORY)
    assert hit.cached_tokens == HISTORY
    forget_loads(caches)
    return holders, hit


async def load(engine: aiokv.OffloadEngine, user: int, hit: aiokv.Lookup) -> tuple[int, int]:
    """(reported, loaded) tokens of a Lookup loaded into the user's destination."""
    if hit.cached_tokens == 0:
        hit.release()
        return 0, 0
    got = await engine.load(hit, destination(user)[: hit.cached_tokens // PAGE])
    return hit.cached_tokens, got.loaded_tokens


async def serve_everyone(directory: Path, policy: str) -> list[tuple[str, int, int, bool]]:
    """Twelve users offload; then, three times, every user's Lookup at once (most of them
    only on SSD), then every load while one more user offloads and competes for the host
    tier. Per load: (who, tokens reported, tokens loaded, bit for bit)."""
    caches, engine = engine_on(directory, policy)
    loads: list[tuple[str, int, int, bool]] = []
    async with engine:
        for user in range(USERS):
            await engine.offload(user, source(user), HISTORY)
        for step in range(3):
            forget_loads(caches)
            hits = await asyncio.gather(*(engine.lookup(u, HISTORY) for u in range(USERS)))
            newcomer = USERS + step
            results: list[Any] = await asyncio.gather(
                *(load(engine, u, hit) for u, hit in enumerate(hits)),
                engine.offload(newcomer, source(newcomer), HISTORY),
            )
            for user, (reported, loaded) in enumerate(results[:USERS]):
                intact = loaded_intact(caches, user, loaded)
                loads.append((f"step {step} user {user}", reported, loaded, intact))
        stats = engine.stats()
    assert stats.pending == 0 and stats.store_tasks_open == 0
    return loads


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_every_load_brings_what_its_lookup_reported(tmp_path: Path, policy: str) -> None:
    loads = await serve_everyone(tmp_path, policy)
    short = [f"{who}: lookup said {said}, load gave {gave}" for who, said, gave, _ in loads
             if gave != said]
    assert short == []
    assert [who for who, _, _, intact in loads if not intact] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_everyone_on_ssd_is_a_hit_while_the_host_tier_is_busy(
    tmp_path: Path, policy: str
) -> None:
    loads = await serve_everyone(tmp_path, policy)
    assert [f"{who}: {said}" for who, said, _, _ in loads if said != HISTORY] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("own_process", [False, True], ids=["in process", "own process"])
async def test_ssd_pages_are_a_hit_when_the_host_tier_has_no_room_now(
    tmp_path: Path, own_process: bool
) -> None:
    caches, engine = engine_on(tmp_path, "write_through", own_process, request_timeout_ms=10_000)
    async with engine:
        holders, hit = await no_room_for_user_0(engine, caches)
        # Launched first, user 0's load waits for the room the holders' loads give back,
        # long before its deadline (which the store is given, in a child too).
        got = await asyncio.gather(
            engine.load(hit, destination(0)), *(
                engine.load(h, destination(u)) for u, h in zip((2, 3), holders, strict=True)
            )
        )
        assert [r.loaded_tokens for r in got] == [HISTORY] * 3
        assert all(loaded_intact(caches, user, HISTORY) for user in (0, 2, 3))
    stats = engine.stats()  # the store's figures, final once it is closed
    assert stats.stage_waits >= 1
    assert stats.lookup_hit_tokens == stats.lookup_tokens == 3 * HISTORY
    assert (stats.timed_out, stats.failed, stats.store_tasks_open) == (0, 0, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("own_process", [False, True], ids=["in process", "own process"])
async def test_a_load_waits_for_room_no_longer_than_request_timeout_ms(
    tmp_path: Path, own_process: bool
) -> None:
    # The loads after the one that gives up run under the same deadline: 1 s, not less,
    # so that a busy two-core host (a child store's process beside pytest's) meets it.
    caches, engine = engine_on(
        tmp_path, "write_through", own_process, request_timeout_ms=1_000, lookup_ttl_ms=60_000
    )
    async with engine:
        holders, hit = await no_room_for_user_0(engine, caches)
        with pytest.raises(aiokv.RequestTimeout):
            await engine.load(hit, destination(0))
        # The holders' pages are room once on SSD too: else the next load waits for it
        # as well (a second stage wait), and past 1 s on a busy disk.
        await until(engine, lambda stats: stats.bytes_ssd_written >= 4 * USER_PAGES * BLOCK)
        for holder in holders:  # the room it waited for, right after: its caller may
            holder.release()  # reuse its pages from now on
        # The key is whole and loads bit for bit (elsewhere): the load that gave up at its
        # deadline holds none of it.
        again = await engine.lookup(0, HISTORY)
        assert again.cached_tokens == HISTORY
        assert (await engine.load(again, destination(5))).loaded_tokens == HISTORY
        assert all(torch.equal(c[destination(5)], c[source(0)]) for c in caches)
    # The close waited for every task: nothing came into the timed-out load's pages.
    assert all(c[destination(0)].isnan().all() for c in caches)
    stats = engine.stats()
    assert (stats.timed_out, stats.pending, stats.store_tasks_open) == (1, 0, 0)
    assert stats.stage_waits == 1  # also from a store in a child (its store_stats())


@pytest.mark.asyncio
async def test_ssd_pages_read_after_a_load_timed_out_are_not_copied_into_its_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=1_000)
    async with engine:
        # User 0 is only on SSD; the host has room (users 2's and 3's pages, on SSD too),
        # so its lookup starts reading it at once, from a disk that answers only once the
        # load has timed out.
        async with a_load_of_user_0_timed_out_mid_read(engine, caches, monkeypatch):
            pass  # leaving lets the reads go on
        await until(engine, lambda stats: stats.store_tasks_open == 0)  # once its reads are in
        # Read in after the deadline, the pages are on the host now, whole.
        again = await engine.lookup(0, HISTORY)
        assert (await engine.load(again, destination(5))).loaded_tokens == HISTORY
        assert all(torch.equal(c[destination(5)], c[source(0)]) for c in caches)
    assert all(c[destination(0)].isnan().all() for c in caches)
    stats = engine.stats()
    assert (stats.timed_out, stats.pending, stats.store_tasks_open) == (1, 0, 0)


@pytest.mark.asyncio
async def test_a_lookup_right_after_a_load_timed_out_finds_the_pages_it_was_reading_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=1_000)
    async with engine:
        # User 0 is only on SSD; its lookup starts reading it into the host at once, from
        # a disk that answers only once the load has timed out.
        async with a_load_of_user_0_timed_out_mid_read(engine, caches, monkeypatch):
            # Its caller looks the key up again at once, its reads still out: the SSD
            # holds every page (and the host is about to), not a miss to recompute.
            again = await engine.lookup(0, HISTORY)
            assert again.cached_tokens == HISTORY
        assert (await engine.load(again, destination(5))).loaded_tokens == HISTORY
        assert all(torch.equal(c[destination(5)], c[source(0)]) for c in caches)
    assert all(c[destination(0)].isnan().all() for c in caches)
    stats = engine.stats()
    assert (stats.timed_out, stats.pending, stats.store_tasks_open) == (1, 0, 0)


@pytest.mark.asyncio
async def test_the_lookup_that_took_over_a_timed_out_load_gives_way_and_still_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An SSD tier of six users: the offloads after the hand-over recycle every slot that
    # nothing holds.
    caches, engine = engine_on(tmp_path, "write_through", ssd_users=6, request_timeout_ms=1_000)
    async with engine:
        async with a_load_of_user_0_timed_out_mid_read(engine, caches, monkeypatch):
            again = await engine.lookup(0, HISTORY)  # takes the timed-out load's reads over
            assert again.cached_tokens == HISTORY
        await until(engine, lambda stats: stats.bytes_ssd_read >= USER_PAGES * BLOCK)
        for user in range(4, 10):  # while its caller holds it, the SSD turns over
            await engine.offload(user, source(user), HISTORY)
            written = (user + 1) * USER_PAGES * BLOCK
            await until(engine, lambda s, written=written: s.bytes_ssd_written >= written)
        # User 9 holds the rest of the host tier: user 8's load takes the room of the
        # Lookup that took the reads over, which stages its pages again later.
        holder = await engine.lookup(9, HISTORY)
        assert holder.cached_tokens == HISTORY
        other = await engine.lookup(8, HISTORY)
        assert (await engine.load(other, destination(8))).loaded_tokens == HISTORY
        holder.release()
        assert (await engine.load(again, destination(5))).loaded_tokens == HISTORY
        assert all(torch.equal(c[destination(5)], c[source(0)]) for c in caches)
        last = await engine.lookup(9, HISTORY)  # stored, and no other key's read lost it
        assert last.cached_tokens == HISTORY
        last.release()
    stats = engine.stats()
    assert (stats.checksum_failures, stats.timed_out, stats.pending) == (0, 1, 0)
    assert stats.store_tasks_open == 0


@pytest.mark.asyncio
async def test_a_lookup_in_the_window_of_a_load_that_timed_out_there_finds_its_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window closes only once two live calls fill it, so a load alone in one times out
    # before it is dispatched, as on a loop that runs its timers late; lookups go first.
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=1_000,
                               window_us=60_000_000, max_batch_tokens=2 * HISTORY)
    async with engine:
        for users in (2, 4):  # users 2 and 3 take the room of 0 and 1, once on SSD
            await asyncio.gather(*(engine.offload(u, source(u), HISTORY)
                                   for u in (users - 2, users - 1)))
            written = users * USER_PAGES * BLOCK
            await until(engine, lambda s, written=written: s.bytes_ssd_written >= written)
        gate = held_reads(monkeypatch)  # user 0's prefetch reads it in, and is held there
        try:
            hit, other = await asyncio.gather(engine.lookup(0, HISTORY), engine.lookup(2, HISTORY))
            other.release()
            assert hit.cached_tokens == HISTORY
            forget_loads(caches)
            with pytest.raises(aiokv.RequestTimeout):
                await engine.load(hit, destination(0))
            # Two live calls fill the window the load is still in (it no longer counts).
            again, other = await asyncio.gather(engine.lookup(0, HISTORY),
                                                engine.lookup(2, HISTORY))
            other.release()
            assert again.cached_tokens == HISTORY
        finally:
            gate.set()
        got, other = await asyncio.gather(engine.load(again, destination(5)),
                                          engine.lookup(2, HISTORY))
        other.release()
        assert got.loaded_tokens == HISTORY
        assert all(torch.equal(c[destination(5)], c[source(0)]) for c in caches)
    assert all(c[destination(0)].isnan().all() for c in caches)
    stats = engine.stats()
    assert (stats.timed_out, stats.pending, stats.store_tasks_open) == (1, 0, 0)


@pytest.mark.asyncio
async def test_a_clear_gives_back_the_room_a_waiting_load_needs(tmp_path: Path) -> None:
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=5_000)
    async with engine:
        holders, hit = await no_room_for_user_0(engine, caches)
        # The load goes first and waits for room; the clear gives the holders' back, so
        # the load finishes (with the KV as it was) and then everything is dropped.
        loaded, dropped = await asyncio.gather(engine.load(hit, destination(0)), engine.clear())
        assert loaded.loaded_tokens == HISTORY and loaded_intact(caches, 0, HISTORY)
        assert dropped >= 4 * HISTORY
        assert [(await engine.load(h, destination(2))).loaded_tokens for h in holders] == [0, 0]
        assert (await engine.lookup(0, HISTORY)).cached_tokens == 0


@pytest.mark.asyncio
async def test_a_clear_waits_for_a_load_whose_room_comes_with_ssd_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the holders' pages are still being written to SSD when the clear
    # comes: given back, they are room only once written. That room comes by itself, so
    # the clear waits for the load rather than drop the pages it reported (it did so
    # when a busy disk was slow to write them: CI, 2026-12-06).
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=10_000)
    async with engine:
        for user in (0, 1):
            await engine.offload(user, source(user), HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= 2 * USER_PAGES * BLOCK)
        writes = held_writes(monkeypatch)
        try:
            holders, hit = await no_room_for_user_0(engine, caches, offloaded=2)
            loading = asyncio.ensure_future(engine.load(hit, destination(0)))
            await until(engine, lambda stats: stats.stage_waits > 0)
            clearing = asyncio.ensure_future(engine.clear())
            await asyncio.sleep(0.2)  # the clear has given the holders' pages back by now
            writes.set()
            loaded, dropped = await asyncio.gather(loading, clearing)
        finally:
            writes.set()
        assert loaded.loaded_tokens == HISTORY and loaded_intact(caches, 0, HISTORY)
        assert dropped >= 4 * HISTORY
        assert [(await engine.load(h, destination(2))).loaded_tokens for h in holders] == [0, 0]
        assert (await engine.lookup(0, HISTORY)).cached_tokens == 0


USER_1 = torch.arange(4 * USER_PAGES, 4 * USER_PAGES + 12)  # more than half the host tier
USER_1_TOKENS = len(USER_1) * PAGE


async def user_1_loads_into_user_0_s_prefetch(
    engine: aiokv.OffloadEngine, caches: list[torch.Tensor]
) -> tuple[aiokv.Lookup, asyncio.Future[aiokv.LoadResult]]:
    """Users 0 and 1 are on SSD only (users 2 and 3 came after them into the host tier of
    16 blocks); user 1's history is 12 pages. User 0's Lookup is held, not loaded: its 8
    pages are prefetched into the host tier. User 1's load, launched, needs more room
    than the prefetch leaves. Returns (user 0's Lookup, user 1's load)."""
    await engine.offload(0, source(0), HISTORY)
    await engine.offload(1, USER_1, USER_1_TOKENS)
    for user in (2, 3):
        await engine.offload(user, source(user), HISTORY)
    await until(engine, lambda s: s.bytes_ssd_written >= (3 * USER_PAGES + 12) * BLOCK)
    held_hit = await engine.lookup(0, HISTORY)
    hit = await engine.lookup(1, USER_1_TOKENS)
    assert (held_hit.cached_tokens, hit.cached_tokens) == (HISTORY, USER_1_TOKENS)
    forget_loads(caches)
    return held_hit, asyncio.ensure_future(engine.load(hit, USER_1 + PAGES // 2))


def user_1_intact(caches: list[torch.Tensor]) -> bool:
    return all(torch.equal(c[USER_1 + PAGES // 2], c[USER_1]) for c in caches)


@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch", ["read", "reading"])
async def test_a_held_lookup_s_prefetch_gives_its_room_to_a_launched_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefetch: str
) -> None:
    # User 0's prefetch reads are still running when user 1's load comes, or not. There
    # is no request timeout: user 1's load must not wait for that room until user 0's
    # Lookup expires (a minute here).
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0,
                               lookup_ttl_ms=60_000)
    async with engine:
        reads = held_reads(monkeypatch, reading=prefetch == "reading")
        try:
            held_hit, loading = await user_1_loads_into_user_0_s_prefetch(engine, caches)
            if prefetch == "reading":  # the load waits for room; then the reads come in
                await until(engine, lambda stats: stats.stage_waits > 0)
                assert engine.stats().stage_waits == 1
                reads.set()
            got = await asyncio.wait_for(loading, 5.0)
        finally:
            reads.set()
        assert got.loaded_tokens == USER_1_TOKENS and user_1_intact(caches)
        # The held Lookup still loads all it reported, bit for bit (read again).
        assert (await engine.load(held_hit, destination(0))).loaded_tokens == HISTORY
        assert loaded_intact(caches, 0, HISTORY)
        stats = engine.stats()
        assert stats.pending == 0 and stats.store_tasks_open == 0
        await engine.clear()  # drops every block nothing holds: all of them
    stats = engine.stats()  # final once the engine is closed
    assert (stats.host_blocks_used, stats.ssd_blocks_used) == (0, 0)


@pytest.mark.asyncio
async def test_an_evict_goes_ahead_of_a_load_the_room_on_its_way_cannot_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lookups of users 2 and 3 hold 12 of the 16 host blocks; user 4's 4 pages are being
    # written to SSD (held). User 0's load (8 SSD pages) waits for room: the 4 blocks the
    # write gives back can never stage it, only the holders' loads, called after an evict
    # of another user, can. The evict goes ahead at once, not once the write is in (with
    # a Mooncake that stops answering, its call timeout of 30 s), and every load loads.
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0)
    async with engine:
        for user in range(4):
            await engine.offload(user, source(user), HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= 4 * USER_PAGES * BLOCK)
        holders = [await engine.lookup(2, HISTORY), await engine.lookup(3, HISTORY // 2)]
        assert [hit.cached_tokens for hit in holders] == [HISTORY, HISTORY // 2]
        writes = held_writes(monkeypatch)
        try:
            assert (await engine.offload(4, source(4)[:4], HISTORY // 2)).stored_tokens
            assert await asyncio.to_thread(writes.entered.wait, 10)
            hit = await engine.lookup(0, HISTORY)
            assert hit.cached_tokens == HISTORY
            forget_loads(caches)
            loading = asyncio.ensure_future(engine.load(hit, destination(0)))
            await until(engine, lambda stats: stats.stage_waits > 0)
            evicting = asyncio.ensure_future(engine.evict(7))
            later = [engine.load(h, destination(2 + i)[: h.cached_tokens // PAGE])
                     for i, h in enumerate(holders)]
            # Within 10 s, the write still held (the gate lets it go at 30 s).
            assert await asyncio.wait_for(evicting, 10) == 0
            assert not writes.is_set()
            results = await asyncio.wait_for(asyncio.gather(loading, *later), 10)
        finally:
            writes.set()
        assert [r.loaded_tokens for r in results] == [HISTORY, HISTORY, HISTORY // 2]
        assert loaded_intact(caches, 0, HISTORY)


@pytest.mark.asyncio
@pytest.mark.parametrize("verb", ["clear", "evict"])
async def test_an_invalidation_waits_for_a_load_whose_room_a_prefetch_s_reads_bring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verb: str
) -> None:
    # User 1's load waits for the room user 0's held Lookup prefetched into, its reads
    # still out. That room comes back by itself once they are in (the prefetch gives
    # way; given back by the clear, it ends), so a clear, or an evict of user 1, waits
    # for the load rather than end it with nothing.
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0,
                               lookup_ttl_ms=60_000)
    async with engine:
        reads = held_reads(monkeypatch)
        try:
            held_hit, loading = await user_1_loads_into_user_0_s_prefetch(engine, caches)
            await until(engine, lambda stats: stats.stage_waits > 0)
            invalidating = asyncio.ensure_future(
                engine.clear() if verb == "clear" else engine.evict(1))
            await asyncio.sleep(0.3)  # the invalidation has asked which loads are parked
            reads.set()
            got, dropped = await asyncio.wait_for(asyncio.gather(loading, invalidating), 10)
        finally:
            reads.set()
        assert got.loaded_tokens == USER_1_TOKENS and user_1_intact(caches)
        assert dropped >= USER_1_TOKENS
        if verb == "evict":  # the held Lookup of another user still loads all it reported
            assert (await engine.load(held_hit, destination(0))).loaded_tokens == HISTORY
            assert loaded_intact(caches, 0, HISTORY)


@pytest.mark.asyncio
async def test_an_evict_waits_for_a_load_whose_room_another_load_s_host_pages_bring(
    tmp_path: Path,
) -> None:
    # Lookups of users 2 and 3 hold 12 of the 16 host blocks. User 1's (4 host pages, 4
    # on SSD only) prefetches its SSD pages into the other 4; user 0's (4 pages, on SSD
    # only) finds no room. Both loads launched, user 1's host pages go back once copied,
    # which stages user 0's load with no call of the engine. An evict of user 0 right
    # after them waits for its load.
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0)
    async with engine:
        await engine.offload(0, source(0)[:4], HISTORY // 2)
        await engine.offload(1, source(1), HISTORY)
        await engine.offload(2, source(2), HISTORY)  # user 0's 4 pages leave the host
        await until(engine, lambda stats: stats.bytes_ssd_written >= 20 * BLOCK)
        await engine.offload(3, source(3)[:4], HISTORY // 2)  # so do user 1's last 4
        await until(engine, lambda stats: stats.bytes_ssd_written >= 24 * BLOCK)
        holders = [await engine.lookup(2, HISTORY), await engine.lookup(3, HISTORY // 2)]
        assert [hit.cached_tokens for hit in holders] == [HISTORY, HISTORY // 2]
        hits = list(reversed([await engine.lookup(1, HISTORY),
                              await engine.lookup(0, HISTORY // 2)]))
        assert [hit.cached_tokens for hit in hits] == [HISTORY // 2, HISTORY]
        forget_loads(caches)
        loads = [engine.load(hit, destination(user)[: hit.cached_tokens // PAGE])
                 for user, hit in enumerate(hits)]
        results = await asyncio.wait_for(asyncio.gather(*loads, engine.evict(0)), 30)
        assert [r.loaded_tokens for r in results[:2]] == [HISTORY // 2, HISTORY]
        assert loaded_intact(caches, 0, HISTORY // 2) and loaded_intact(caches, 1, HISTORY)
        assert results[2] == HISTORY // 2
        for holder in holders:
            holder.release()


@pytest.mark.asyncio
async def test_an_evict_goes_ahead_of_a_load_whose_room_a_shared_prefetch_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # User 0's held Lookup prefetches its 8 pages in two reads of 4 (large KV blocks);
    # the first is in, the second held. A second Lookup of user 0 holds the 4 pages in:
    # that prefetch never gives way now, its reads in or not. User 1's load (12 pages)
    # waits for room only the loads of those Lookups, called after an evict of another
    # user, give back: the evict goes ahead at once, not once the held read is in.
    monkeypatch.setattr(ssd_module, "READ_CHUNK_BYTES", 4 * SLOT)
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0,
                               lookup_ttl_ms=60_000)
    reads: list[int] = []

    def second_read(tier: Any, request: Any, *args: Any) -> bool:
        if request.is_write:
            return False
        if id(request) not in reads:
            reads.append(id(request))
        return reads.index(id(request)) == 1

    async with engine:
        await engine.offload(0, source(0), HISTORY)
        await engine.offload(1, USER_1, USER_1_TOKENS)
        for user in (2, 3):
            await engine.offload(user, source(user), HISTORY)
        await until(engine, lambda s: s.bytes_ssd_written >= (3 * USER_PAGES + 12) * BLOCK)
        gate = held(monkeypatch, ssd_module.SsdTier, "_run", second_read)
        try:
            prefetched = await engine.lookup(0, HISTORY)
            await until(engine, lambda stats: stats.bytes_ssd_read >= 4 * BLOCK)
            sharing = await engine.lookup(0, HISTORY)
            assert (prefetched.cached_tokens, sharing.cached_tokens) == (HISTORY, HISTORY // 2)
            hit = await engine.lookup(1, USER_1_TOKENS)
            forget_loads(caches)
            loading = asyncio.ensure_future(engine.load(hit, USER_1 + PAGES // 2))
            await until(engine, lambda stats: stats.stage_waits > 0)
            evicting = asyncio.ensure_future(engine.evict(7))
            later = [engine.load(sharing, destination(0)[: USER_PAGES // 2]),
                     engine.load(prefetched, destination(0))]
            assert await asyncio.wait_for(evicting, 10) == 0  # the read still held
            assert not gate.is_set()
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(loading, *later), 30)
        finally:
            gate.set()
        assert [r.loaded_tokens for r in results] == [USER_1_TOKENS, HISTORY // 2, HISTORY]
        assert user_1_intact(caches) and loaded_intact(caches, 0, HISTORY)


@pytest.mark.asyncio
async def test_an_evict_waits_for_a_load_whose_room_a_released_lookup_s_reads_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # User 0's held Lookup A prefetched its first 4 pages; Lookup B of all 8 holds those
    # as its host prefix and prefetches the other 4, whose reads are held, and B is
    # released. Until those reads are in, A cannot give way; then B ends, A gives way,
    # and user 1's load (16 pages, waiting for room) is staged, with no call of the
    # engine: an evict of user 1 waits for it.
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0,
                               lookup_ttl_ms=60_000)
    user_1 = torch.arange(2 * USER_PAGES, 4 * USER_PAGES)
    async with engine:
        await engine.offload(1, user_1, 2 * HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= 16 * BLOCK)
        await engine.offload(0, source(0), HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= 24 * BLOCK)
        for user in (4, 5):  # users 0 and 1 leave the host tier
            await engine.offload(user, source(user), HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= 40 * BLOCK)
        a = await engine.lookup(0, HISTORY // 2)
        assert a.cached_tokens == HISTORY // 2
        await until(engine, lambda stats: stats.bytes_ssd_read >= 4 * BLOCK)
        reads = held_reads(monkeypatch)
        try:
            for _ in range(1000):  # once A's pages are in the host tier (10 s at most)
                b = await engine.lookup(0, HISTORY)
                if b.cached_tokens == HISTORY:
                    break
                b.release()
                await asyncio.sleep(0.01)
            assert b.cached_tokens == HISTORY
            b.release()  # its reads still out
            hit = await engine.lookup(1, 2 * HISTORY)
            assert hit.cached_tokens == 2 * HISTORY
            forget_loads(caches)
            loading = asyncio.ensure_future(engine.load(hit, user_1 + PAGES // 2))
            await until(engine, lambda stats: stats.stage_waits > 0)
            evicting = asyncio.ensure_future(engine.evict(1))
            await asyncio.sleep(0.3)  # the evict has asked which loads are parked
            reads.set()
            got, dropped = await asyncio.wait_for(asyncio.gather(loading, evicting), 30)
        finally:
            reads.set()
        assert got.loaded_tokens == 2 * HISTORY and dropped == 2 * HISTORY
        assert all(torch.equal(c[user_1 + PAGES // 2], c[user_1]) for c in caches)
        assert (await engine.load(a, destination(0)[: USER_PAGES // 2])).loaded_tokens == (
            HISTORY // 2)


@pytest.mark.asyncio
@pytest.mark.parametrize("pinning", ["stopped", "stopping"])
async def test_a_lookup_promises_what_a_host_tier_pinned_short_can_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinning: str
) -> None:
    # Pinning stops after 2 of the host tier's 4 chunks (a memlock limit; registering
    # fails here on the third) and the store serves with 8 blocks. User 0's 16 pages are
    # on SSD only: its Lookup promises the 8 those blocks can stage, also where it comes
    # while the third chunk is still being registered, and its load brings them. (It
    # promised 16: the load waited for room until its deadline.)
    third, fails = threading.Event(), threading.Event()
    pages = torch.arange(2 * USER_PAGES)
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=10_000)
    async with engine:  # the whole host tier: user 0's 16 pages, on SSD too
        await engine.offload(0, pages, 2 * HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= 16 * BLOCK)
    memories = pin_in_chunks(monkeypatch, 4, 2, third, fails)
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=10_000)
    async with engine:  # the same SSD tier, its host tier pinned short
        try:
            assert await asyncio.to_thread(third.wait, 10)
            if pinning == "stopped":
                fails.set()
                assert await asyncio.to_thread(memories[0].wait_all, 10)
            assert memories[0].ready_blocks == HOST_BLOCKS // 2
            hit = await engine.lookup(0, 2 * HISTORY)
        finally:
            fails.set()
        assert hit.cached_tokens == HISTORY
        forget_loads(caches)
        loaded = await engine.load(hit, pages[:USER_PAGES] + PAGES // 2)
        assert loaded.loaded_tokens == HISTORY
        assert all(torch.equal(c[PAGES // 2 : PAGES // 2 + USER_PAGES], c[:USER_PAGES])
                   for c in caches)


@pytest.mark.asyncio
@pytest.mark.parametrize("pinning", ["stopped", "stopping"])
async def test_a_held_lookup_s_prefetch_leaves_half_a_host_tier_pinned_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinning: str
) -> None:
    # Pinning stops after 2 of the host tier's 4 chunks (a memlock limit; registering
    # fails on the third): the store serves with 8 blocks. User 0's 8 pages are on SSD
    # only; its Lookup, held, may prefetch into half of those at most, as into half of a
    # fully pinned tier, so user 1's offload of 8 pages still finds room; also where the
    # Lookup came while the third chunk was still being registered. (Half of all 16
    # blocks: the prefetch took the 8 pinned ones, the offload waited for room until the
    # Lookup expired, and its load was refused.)
    third, fails = threading.Event(), threading.Event()
    caches, engine = engine_on(tmp_path, "write_through")
    async with engine:
        await engine.offload(0, source(0), HISTORY)
        await until(engine, lambda stats: stats.bytes_ssd_written >= USER_PAGES * BLOCK)
    memories = pin_in_chunks(monkeypatch, 4, 2, third, fails)
    caches, engine = engine_on(tmp_path, "write_through", request_timeout_ms=0)
    async with engine:  # the same SSD tier, its host tier pinned short
        try:
            assert await asyncio.to_thread(third.wait, 10)
            if pinning == "stopped":
                fails.set()
                assert await asyncio.to_thread(memories[0].wait_all, 10)
            hit = await engine.lookup(0, HISTORY)
        finally:
            fails.set()
        assert await asyncio.to_thread(memories[0].wait_all, 10)
        assert memories[0].ready_blocks == HOST_BLOCKS // 2
        assert hit.cached_tokens == HISTORY
        stored = await asyncio.wait_for(engine.offload(1, source(1), HISTORY), 60)
        forget_loads(caches)
        loaded = await asyncio.wait_for(engine.load(hit, destination(0)), 60)
    assert stored.stored_tokens == HISTORY
    assert loaded.loaded_tokens == HISTORY and loaded_intact(caches, 0, HISTORY)
