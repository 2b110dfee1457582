"""A host block whose SSD copy's slot the SSD's LRU gave to another key is written down again
before it leaves the host (at eviction, or write_back's close), and a host block evicted
with nowhere to go on SSD is counted. (Both were lost silently: the host block kept its
"the SSD has it" mark after that slot was given away, and the SSD's LRU sees writes and
reads, not the host's hits, so a key kept hot on the host loses its SSD copy first.)

A clean restart keeps the SSD's LRU order: a restart ranked blocks by when they were
written, so the key read from SSD just before it was the first to go after it. After a
crash, or with the saved order damaged or out of date, blocks rank by when they were
written, and every block is still served whole."""

from __future__ import annotations

import asyncio
import shutil
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
from aiokv.stores import dirlock
from aiokv.stores.local import ssd_io, ssd_recency

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
    unit = 4  # pages per user here: the 16-block host and the 16-slot SSD hold 4

    def pages(user: int) -> torch.Tensor:
        return torch.arange(unit * user, unit * (user + 1))

    caches = caches_for()
    original = [c.clone() for c in caches]
    target = TARGET[:unit]
    store = aiokv.LocalStore(ssd_config(tmp_path, slots=16))  # write_through
    written = 0

    async def put(user: int, user_pages: torch.Tensor) -> None:
        nonlocal written
        await engine.offload(user, user_pages, len(user_pages) * PAGE)
        written += len(user_pages) * BLOCK
        await figure(store, "bytes_ssd_written", written)  # its SSD copy landed

    async def use(user: int) -> int:
        return await load_back(engine, user, target)

    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        a, b, x1, y, x2 = 0, 1, 2, 3, 4
        for user in (a, b, x1, y):
            await put(user, pages(user))
        await use(a)
        await use(b)
        # The host evicts X1; the SSD gives A's slots to X2: A is the host's only copy.
        await put(x2, pages(x2))
        await use(y)
        await use(x2)  # the host's LRU: A, B oldest
        await engine.offload(99, torch.arange(100, 108), 8 * PAGE)  # evicts A and B at once
        await asyncio.sleep(0.3)
        assert await use(b) == unit * PAGE
        assert same(caches, original, target, pages(b))


async def users_0_to_3_then_user_0_read_from_ssd(engine: aiokv.OffloadEngine,
                                                  store: aiokv.LocalStore) -> None:
    """Users 0-3 on SSD in that order; then user 0, which the host evicted, read back
    from SSD: the SSD's LRU is 1, 2, 3, 0 (least recently used first)."""
    for user in range(4):
        await offload_landed(engine, store, user)
    assert await load_back(engine, 0, TARGET) == USER_PAGES * PAGE
    assert store.store_stats()["ssd_hit_tokens"] == USER_PAGES * PAGE


async def closed_after_reads(root: Path) -> tuple[aiokv.StoreConfig, list[torch.Tensor],
                                                   list[torch.Tensor]]:
    """An SSD tier under ``root`` after :func:`users_0_to_3_then_user_0_read_from_ssd`,
    closed cleanly: its config, the caches and their first contents."""
    config = ssd_config(root, slots=SLOTS)
    caches = caches_for()
    original = [c.clone() for c in caches]
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        await users_0_to_3_then_user_0_read_from_ssd(engine, store)
    return config, caches, original


async def restarted(config: aiokv.StoreConfig, caches: list[torch.Tensor],
                    users: tuple[int, ...]) -> None:
    """A store on ``config`` offloads ``users``, each landing on SSD, and closes."""
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        for user in users:
            await offload_landed(engine, store, user)


async def kept(config: aiokv.StoreConfig, original: list[torch.Tensor]) -> list[int]:
    """What a fresh store finds of users 0-5: pages per user, each found user's pages
    loaded and checked against what was offloaded."""
    caches = [torch.zeros_like(c) for c in original]
    found = []
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches,
                                   aiokv.EngineConfig()) as engine:
        for user in range(6):
            pages = await load_back(engine, user, TARGET) // PAGE
            assert same(caches, original, TARGET[:pages], source_pages(user)[:pages])
            found.append(pages)
    return found


def saved_order(root: Path) -> Path:
    return root / ssd_io.SUBDIR / ssd_recency.RECENCY_NAME


@pytest.mark.asyncio
@pytest.mark.parametrize("restart", [False, True], ids=["running", "clean-restart"])
async def test_a_clean_restart_does_not_change_which_key_the_ssd_evicts(
    tmp_path: Path, restart: bool,
) -> None:
    config = ssd_config(tmp_path, slots=SLOTS)  # write_through
    caches = caches_for()
    original = [c.clone() for c in caches]
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        await users_0_to_3_then_user_0_read_from_ssd(engine, store)
        if not restart:
            await offload_landed(engine, store, 4)  # the SSD evicts its LRU user: 1
    if restart:
        await restarted(config, caches, (4,))
    assert await kept(config, original) == [8, 0, 8, 8, 8, 0]


@pytest.mark.asyncio
async def test_after_a_crash_ssd_blocks_rank_by_when_they_were_written(tmp_path: Path) -> None:
    # The order the last clean close saved is used by the next open alone: after a crash
    # it would rank user 1, read since that open, as the least recently used.
    (tmp_path / "live").mkdir()
    config, caches, original = await closed_after_reads(tmp_path / "live")
    assert saved_order(tmp_path / "live").exists()
    killed = tmp_path / "killed"
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches,
                                   aiokv.EngineConfig()) as engine:
        assert await load_back(engine, 1, TARGET) == USER_PAGES * PAGE  # from SSD
        # The files as a kill -9 now would leave them (no lock).
        shutil.copytree(tmp_path / "live", killed,
                        ignore=shutil.ignore_patterns(dirlock.LOCK_NAME))
    crashed = ssd_config(killed, slots=SLOTS)
    await restarted(crashed, caches, (4,))  # generation order: user 0, written first, goes
    assert await kept(crashed, original) == [0, 8, 8, 8, 8, 0]


@pytest.mark.asyncio
async def test_an_order_saved_before_later_writes_is_not_applied(tmp_path: Path) -> None:
    config, caches, original = await closed_after_reads(tmp_path)
    stale = saved_order(tmp_path).read_bytes()
    await restarted(config, caches, (4,))  # user 1 goes; user 4 takes its slots
    saved_order(tmp_path).write_bytes(stale)  # names user 1's slots as the oldest
    await restarted(config, caches, (5,))  # generation order: user 0 goes
    assert await kept(config, original) == [0, 0, 8, 8, 8, 8]


def damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "flipped":
        path.write_bytes(raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])  # in the first pair
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "foreign":
        path.write_text('{"lru": [[0, 1]]}\n')
    else:  # a directory in its place: it can be neither read nor replaced
        path.unlink()
        (path / "x").mkdir(parents=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["flipped", "truncated", "foreign", "directory"])
async def test_a_damaged_saved_order_is_ignored(tmp_path: Path, how: str) -> None:
    config, caches, original = await closed_after_reads(tmp_path)
    damage(saved_order(tmp_path), how)
    await restarted(config, caches, (4,))  # generation order: user 0 goes
    assert await kept(config, original) == [0, 8, 8, 8, 8, 0]
