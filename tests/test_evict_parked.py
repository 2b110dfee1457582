"""An evict or clear while a load waits for host room to stage its SSD pages, the room held
by lookups whose loads were called after the evict: the evict used to wait for that load,
which waited for those lookups, whose loads waited for the evict, until the load's
deadline (30 s with no request_timeout_ms) stalled every call. An evict now goes ahead of
a load of another key that waits for room, and ends one of its own key with what it has,
as the drop would. (A clear gives every held lookup back first: the room comes back.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch
from test_ssd import (
    PAGE,
    PAGES,
    USER_PAGES,
    caches_for,
    offload,
    same,
    source_pages,
    ssd_config,
)

import aiokv
from aiokv.stores import ProcessStore

TOKENS = USER_PAGES * PAGE


def targets(n: int) -> list[torch.Tensor]:
    """Destination pages, none of them a source of users 0-3."""
    return [torch.arange(PAGES - USER_PAGES * (k + 1), PAGES - USER_PAGES * k) for k in range(n)]


async def a_load_waiting_for_room(
    engine: aiokv.OffloadEngine,
) -> tuple[list[aiokv.Lookup], asyncio.Future[aiokv.LoadResult]]:
    """Users 0-3 offloaded (the host holds two users: 2 and 3); lookups of 2 and 3 hold
    every host block; user 0's load (SSD only) is launched and waits for room."""
    for user in range(4):
        await offload(engine, user)
    holds = [await engine.lookup(user, TOKENS) for user in (2, 3)]
    assert [hold.cached_tokens for hold in holds] == [TOKENS, TOKENS]
    hit = await engine.lookup(0, TOKENS)
    assert hit.cached_tokens == TOKENS
    load = asyncio.ensure_future(engine.load(hit, targets(1)[0]))
    deadline = asyncio.get_running_loop().time() + 10
    while engine.stats().stage_waits < 1:
        assert asyncio.get_running_loop().time() < deadline, "the load never waited for room"
        assert not load.done(), load
        await asyncio.sleep(0.02)
    return holds, load


async def evict_goes_ahead(engine: aiokv.OffloadEngine, caches: list[torch.Tensor],
                           original: list[torch.Tensor]) -> None:
    """An evict of user 1 while user 0's load waits for room: it answers, the holds'
    loads called after it free the room, and user 0's load then completes bit-exact."""
    holds, load = await a_load_waiting_for_room(engine)
    evict = asyncio.ensure_future(engine.evict(1))
    loads = [engine.load(hold, pages) for hold, pages in zip(holds, targets(3)[1:],
                                                              strict=True)]
    assert await asyncio.wait_for(evict, 10) == TOKENS
    await asyncio.wait_for(asyncio.gather(*loads), 10)
    assert (await asyncio.wait_for(load, 10)).loaded_tokens == TOKENS
    assert same(caches, original, targets(1)[0], source_pages(0))


@pytest.mark.asyncio
async def test_an_evict_goes_ahead_of_a_load_of_another_key_waiting_for_room(
    tmp_path: Path,
) -> None:
    caches = caches_for()
    original = [c.clone() for c in caches]
    store = aiokv.LocalStore(ssd_config(tmp_path))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        await evict_goes_ahead(engine, caches, original)
        hit = await engine.lookup(1, TOKENS)
        assert hit.cached_tokens == 0
        hit.release()


@pytest.mark.asyncio
async def test_an_evict_of_its_key_ends_a_load_waiting_for_room(tmp_path: Path) -> None:
    caches = caches_for()
    store = aiokv.LocalStore(ssd_config(tmp_path))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        holds, load = await a_load_waiting_for_room(engine)
        assert await asyncio.wait_for(engine.evict(0), 10) == TOKENS
        # Its pages were all on SSD, none staged: it ends having loaded nothing.
        assert (await asyncio.wait_for(load, 10)).loaded_tokens == 0
        for hold in holds:
            hold.release()
        hit = await engine.lookup(0, TOKENS)
        assert hit.cached_tokens == 0
        hit.release()


@pytest.mark.asyncio
async def test_an_evict_goes_ahead_of_such_a_load_in_a_store_process_started_again(
    tmp_path: Path,
) -> None:
    # A child started again numbers its tasks after the first one's: the answer must be
    # in the engine's ids, or the evict waits for the load's deadline again.
    caches = caches_for()
    original = [c.clone() for c in caches]
    store = ProcessStore(dataclasses.replace(ssd_config(tmp_path), own_process=True))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        os.kill(store.pid, signal.SIGKILL)
        deadline = asyncio.get_running_loop().time() + 30
        while engine.stats().store_restarts < 1:  # the next call starts a new child
            assert asyncio.get_running_loop().time() < deadline
            with contextlib.suppress(aiokv.StoreError):
                await engine.evict(9)
            await asyncio.sleep(0.05)
        await evict_goes_ahead(engine, caches, original)
