"""A host block whose SSD copy's slot the SSD's LRU gave to another key is written down again
before it leaves the host (at eviction, or write_back's close), and a host block evicted
with nowhere to go on SSD is counted. (Both were lost silently: the host block kept its
"the SSD has it" mark after that slot was given away, and the SSD's LRU sees writes and
reads, not the host's hits, so a key kept hot on the host loses its SSD copy first.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_ssd import (
    BLOCK,
    PAGE,
    TARGET,
    USER_PAGES,
    caches_for,
    figure,
    load_back,
    offload,
    same,
    source_pages,
    ssd_config,
)

import aiokv

SLOTS = 32  # four users on SSD, two on the host


async def offload_landed(engine: aiokv.OffloadEngine, store: aiokv.LocalStore | None,
                         user: int) -> None:
    """An offload, then (``store`` given: write_through) its SSD copy landed. The SSD's LRU
    orders copies by when they land, and host blocks still being copied cannot be evicted:
    on a slow disk the host evicted user 0 for want of others, and the SSD then ranked it
    below a copy that landed after its read, which is not what these tests are about."""
    before = store.store_stats()["bytes_ssd_written"] if store is not None else 0
    await offload(engine, user)
    if store is None:
        return
    deadline = asyncio.get_running_loop().time() + 10
    while store.store_stats()["bytes_ssd_written"] < before + USER_PAGES * BLOCK:
        assert asyncio.get_running_loop().time() < deadline, store.store_stats()
        await asyncio.sleep(0.005)


async def keep_user_0_hot(engine: aiokv.OffloadEngine, users: range,
                          store: aiokv.LocalStore | None = None) -> None:
    """Load user 0 back before each new user's offload: the most recently used key."""
    for user in users:
        assert await load_back(engine, 0, TARGET) == USER_PAGES * PAGE
        await offload_landed(engine, store, user)


@pytest.mark.asyncio
async def test_a_key_kept_hot_on_the_host_is_written_down_again_when_the_host_evicts_it(
    tmp_path: Path,
) -> None:
    caches = caches_for()
    original = [c.clone() for c in caches]
    store = aiokv.LocalStore(ssd_config(tmp_path, slots=SLOTS))  # write_through
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        await offload_landed(engine, store, 0)
        await keep_user_0_hot(engine, range(1, 10), store)  # its first SSD copy's slot goes
        for user in (10, 11):  # user 0 untouched: the host evicts it
            await offload(engine, user)
        assert await load_back(engine, 0, TARGET) == USER_PAGES * PAGE
        assert same(caches, original, TARGET, source_pages(0))


@pytest.mark.asyncio
async def test_write_back_close_writes_a_hot_key_whose_ssd_copy_was_given_away(
    tmp_path: Path,
) -> None:
    config = ssd_config(tmp_path, slots=SLOTS, ssd_write_policy="write_back")
    caches = caches_for()
    original = [c.clone() for c in caches]
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches, aiokv.EngineConfig()) as e:
        for user in range(3):  # user 0 goes down to SSD, and is read back below
            await offload(e, user)
        await keep_user_0_hot(e, range(3, 10))
        assert await load_back(e, 0, TARGET) == USER_PAGES * PAGE  # its last use
    reopened = [torch.zeros_like(c) for c in caches]
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), reopened,
                                   aiokv.EngineConfig()) as engine:
        assert await load_back(engine, 0, TARGET) == USER_PAGES * PAGE
        assert same(reopened, original, TARGET, source_pages(0))


@pytest.mark.asyncio
async def test_host_blocks_evicted_while_every_ssd_slot_is_held_are_counted(
    tmp_path: Path,
) -> None:
    slots = 3 * USER_PAGES
    config = ssd_config(tmp_path, slots=slots)
    caches = caches_for()
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches, aiokv.EngineConfig()) as e:
        for user in range(3):
            await offload(e, user)
    # Reopened: users 0-2 on SSD only, in every slot, each held by a lookup.
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches,
                                   aiokv.EngineConfig()) as engine:
        hits = [await engine.lookup(user, USER_PAGES * PAGE) for user in range(3)]
        assert [hit.cached_tokens for hit in hits] == [USER_PAGES * PAGE] * 3
        try:
            for user in (5, 6, 7):  # the host holds two users: 5 and 6 go, with no copy
                assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        finally:
            for hit in hits:
                hit.release()
        deadline = asyncio.get_running_loop().time() + 10
        while engine.stats().ssd_full_drops < 2 * USER_PAGES:
            assert asyncio.get_running_loop().time() < deadline, engine.stats()
            await asyncio.sleep(0.05)
        assert engine.stats().ssd_full_drops == 2 * USER_PAGES
        assert await load_back(engine, 5, TARGET) == 0  # what the count says was lost
        assert await load_back(engine, 7, TARGET) == USER_PAGES * PAGE


@pytest.mark.asyncio
async def test_a_clean_block_whose_copy_goes_in_the_same_eviction_is_copied_again(
    tmp_path: Path,
) -> None:
    # Two keys evicted together: the copy down of the one without an SSD copy took the SSD
    # slot of the other's copy, and that one, checked before, was freed with none.
    unit = 4  # pages per user here: a 16-block host holds 4, a 12-slot SSD 3

    def pages(user: int) -> torch.Tensor:
        return torch.arange(unit * user, unit * (user + 1))

    caches = caches_for()
    original = [c.clone() for c in caches]
    target = TARGET[:unit]
    store = aiokv.LocalStore(ssd_config(tmp_path, slots=12))  # write_through
    written = 0

    async def put(user: int, user_pages: torch.Tensor) -> None:
        nonlocal written
        await engine.offload(user, user_pages, len(user_pages) * PAGE)
        written += len(user_pages) * BLOCK
        await figure(store, "bytes_ssd_written", written)  # its SSD copy landed

    async def use(user: int) -> int:
        return await load_back(engine, user, target)

    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        a, b, x1, x2 = 0, 1, 2, 3
        for user in (a, b, x1):
            await put(user, pages(user))
        await use(a)
        await use(b)
        await put(x2, pages(x2))  # the SSD gives A's slots to X2: A is the host's only copy
        await use(x1)
        await use(x2)  # the host's LRU: A, B oldest
        await engine.offload(99, torch.arange(100, 108), 8 * PAGE)  # evicts A and B at once
        await asyncio.sleep(0.3)
        assert await use(b) == unit * PAGE
        assert same(caches, original, target, pages(b))
