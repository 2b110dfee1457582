"""A bounded randomized soak: many users, random cancellations and timeouts, injected
store failures. Afterwards the engine's books must balance, the store contract must hold,
nothing may reach the loop's exception handler, and every load that succeeded must be
bit-exact."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import pytest
import torch
from conftest import PAGE_SIZE, make_caches

import aiokv
from aiokv.testing import CheckingStore, FaultyStore

USERS, ROUNDS, HISTORY_PAGES = 24, 30, 4


@pytest.mark.asyncio
async def test_soak_books_balance_and_loads_stay_bit_exact() -> None:
    caches = make_caches(pages=USERS * HISTORY_PAGES * 2)
    original = [c.clone() for c in caches]
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    # Room for about half the users' histories: eviction and StoreFull both happen.
    store_gb = USERS * HISTORY_PAGES * block_bytes / 2 / (1 << 30)
    faulty = FaultyStore(aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=store_gb)))
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
    config = aiokv.EngineConfig(window_us=300, max_batch_requests=8, max_pending=16,
                                overload="wait", request_timeout_ms=2_000, lookup_ttl_ms=50)
    engine = aiokv.OffloadEngine(checked, caches, config)
    verified = 0

    async def user(index: int) -> None:
        nonlocal verified
        rng = random.Random(index)
        own = torch.arange(index * HISTORY_PAGES, (index + 1) * HISTORY_PAGES)
        scratch = own + USERS * HISTORY_PAGES
        for _ in range(ROUNDS):
            tokens = rng.randint(1, HISTORY_PAGES * PAGE_SIZE)
            action = rng.random()
            try:
                if action < 0.45:
                    call = asyncio.ensure_future(engine.offload(index, own, tokens))
                    if rng.random() < 0.15:
                        await asyncio.sleep(0)
                        call.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
                elif action < 0.9:
                    hit = await engine.lookup(index, tokens)
                    if hit.cached_tokens == 0 or rng.random() < 0.2:
                        if rng.random() < 0.5:
                            hit.release()  # else: left for lookup_ttl_ms
                        continue
                    pages = hit.cached_tokens // PAGE_SIZE
                    for cache in caches:
                        cache[scratch[:pages]] = float("nan")
                    got = await engine.load(hit, scratch)
                    assert got.loaded_tokens == hit.cached_tokens
                    for cache, before in zip(caches, original, strict=True):
                        assert torch.equal(cache[scratch[:pages]], before[own[:pages]])
                    verified += 1
                else:
                    faulty.fail_tasks = rng.random() < 0.5  # some launched tasks fail
                    await asyncio.sleep(0)
                    faulty.fail_tasks = False
            except (aiokv.StoreError, aiokv.RequestTimeout):
                pass  # injected failures and a full store are expected outcomes

    async with engine:
        await asyncio.wait_for(asyncio.gather(*(user(u) for u in range(USERS))), 120)
    stats = engine.stats()
    resolved = stats.completed + stats.failed + stats.cancelled + stats.timed_out
    assert stats.submitted == resolved and stats.pending == 0
    assert stats.store_tasks_open == 0
    assert verified > 0 and stats.completed > 0
    assert checked.problems() == []
    assert loop_errors == []
