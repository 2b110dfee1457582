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
        await asyncio.sleep(0.2)  # launched: its host pages queued, its SSD half waits
        hold.release()
        with pytest.raises(aiokv.InvalidRequest, match=str(int(dest[6]))):
            await task
        written = [i for i in range(8)
                   if i != 6 and not bool(caches[0][dest[i]].isnan().all())]
        assert written == [], f"a refused load wrote positions {written}"
