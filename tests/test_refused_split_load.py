"""A load refused for a bad page id copies nothing into its pages, also when its hit is
split across the tiers and its SSD pages are staged after launch: its host pages and its
SSD chunks are copy jobs of their own after the job that checks its page ids, and each
copied its own pages whatever that check found."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_lookup_tiers import HISTORY, POLICIES, caches_for, engine_on, source, then_cleared
from test_ssd import PAGE

import aiokv

OTHER = torch.arange(64, 76)  # user 9: 12 pages, three quarters of the host tier


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bad", ["outside", "twice"])
async def test_a_refused_split_load_writes_none_of_its_pages(
    tmp_path: Path, policy: str, bad: str
) -> None:
    caches = caches_for()
    engine = engine_on(tmp_path, policy, caches)
    await engine.start()
    async with then_cleared(engine):
        await engine.offload(0, source(0), HISTORY)
        for _ in range(100):  # write_through: its SSD copy lands
            if engine.stats().ssd_blocks_used >= 8 or policy == "write_back":
                break
            await asyncio.sleep(0.01)
        # User 9 pushes user 0's last 4 pages out of the host tier (to SSD), and holds
        # what it stored: no host room is left to stage them.
        await engine.offload(9, OTHER, len(OTHER) * PAGE)
        hold = await engine.lookup(9, len(OTHER) * PAGE)
        hit = await engine.lookup(0, HISTORY)
        assert hit.cached_tokens == HISTORY
        dest = torch.arange(96, 104)
        dest[6] = 10_000 if bad == "outside" else int(dest[0])
        for cache in caches:
            cache[96:104] = float("nan")
        task = asyncio.ensure_future(engine.load(hit, dest))
        for _ in range(1000):  # launched: its host pages queued, its SSD half waits
            if engine.stats().stage_waits >= 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().stage_waits == 1
        hold.release()
        with pytest.raises(aiokv.InvalidRequest, match=str(int(dest[6]))):
            await task
        written = [i for i in range(8)
                   if i != 6 and not bool(caches[0][dest[i]].isnan().all())]
        assert written == [], f"a refused load wrote positions {written}"


LAYERS, SMALL_PAGE, HEADS, DIM, USER = 2, 16, 2, 16, 8  # 8 pages a user
SMALL_BLOCK = LAYERS * 2 * SMALL_PAGE * HEADS * DIM * 4


@pytest.mark.asyncio
async def test_a_refused_load_waiting_for_host_room_answers_at_once_and_owes_none(
    tmp_path: Path,
) -> None:
    """A load whose SSD pages wait for host room, refused for a bad page id at launch,
    raises InvalidRequest then, not at its deadline; and other users' offloads do not wait
    for the room it will never use."""
    from aiokv.stores.local import ssd_format

    caches = [torch.randn(160, 2, SMALL_PAGE, HEADS, DIM) for _ in range(LAYERS)]
    store = aiokv.LocalStore(aiokv.StoreConfig(
        cpu_cache_gb=16 * SMALL_BLOCK / 2**30, ssd_cache_dir=str(tmp_path),
        ssd_cache_gb=64 * (ssd_format.HEADER_BYTES + SMALL_BLOCK) / 2**30))  # 16 host blocks
    tokens = USER * SMALL_PAGE
    async with aiokv.OffloadEngine(store, caches,
                                   aiokv.EngineConfig(request_timeout_ms=30_000)) as engine:
        for user in range(6):  # users 0..3 end up on the SSD only
            await engine.offload(user, torch.arange(USER * user, USER * (user + 1)), tokens)
        for _ in range(1000):
            if engine.stats().bytes_ssd_written >= 4 * USER * SMALL_BLOCK:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().bytes_ssd_written >= 4 * USER * SMALL_BLOCK
        held = [await engine.lookup(4, tokens), await engine.lookup(5, tokens // 2)]  # 12
        hit = await engine.lookup(0, tokens)  # 8 SSD pages, room for 4 of them
        assert hit.cached_tokens == tokens
        pages = torch.arange(100, 108)
        pages[3] = -7
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(aiokv.InvalidRequest, match="-7"):
            await engine.load(hit, pages)
        # Not at its deadline (30 s): a busy host's few seconds are no wait for room.
        assert loop.time() - start < 10.0, "the refused load waited for host room"
        start = loop.time()
        stored = await engine.offload(9, torch.arange(72, 76), 4 * SMALL_PAGE)
        assert stored.stored_tokens == 4 * SMALL_PAGE
        assert loop.time() - start < 10.0, "an offload waited for a refused load's room"
        for lookup in held:
            lookup.release()
