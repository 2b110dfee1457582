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
                    if not hit.held:
                        # Expired: the loop resumed this caller more than lookup_ttl_ms
                        # after the answer (a busy runner; uvloop runs the due TTL timer
                        # before the resumption), and a load of it would be refused.
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


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("drain", [True, False])
@pytest.mark.parametrize("timeout_ms", [0, 5])
async def test_a_close_under_load_resolves_every_call_once(
    seed: int, drain: bool, timeout_ms: int
) -> None:
    """Users offload, look up and load with few rooms (``overload: wait``), short
    timeouts, cancellations (queued, waiting for room, launched) and failing tasks, and
    the engine is closed in the middle of it. Every call must end (no caller left
    waiting), the books must balance, and no room may stay promised."""
    rng = random.Random(seed)
    caches = make_caches(pages=USERS * HISTORY_PAGES)
    faulty = FaultyStore(aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01)))
    checked = CheckingStore(faulty, loop_thread=threading.get_ident())
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
    config = aiokv.EngineConfig(
        window_us=rng.choice([0, 200, 1000]), max_batch_requests=rng.choice([2, 4, 8]),
        max_pending=rng.choice([1, 3, 6]), overload="wait",
        request_timeout_ms=timeout_ms, lookup_ttl_ms=20,
    )
    engine = aiokv.OffloadEngine(checked, caches, config)
    expected = (aiokv.EngineClosed, aiokv.StoreError, aiokv.RequestTimeout, aiokv.InvalidRequest)
    ends: list[str] = []

    async def one_call(index: int, call_rng: random.Random) -> None:
        own = torch.arange(index * HISTORY_PAGES, (index + 1) * HISTORY_PAGES)
        tokens = call_rng.randint(1, HISTORY_PAGES * PAGE_SIZE)
        if call_rng.random() < 0.6:
            await engine.offload(index, own, tokens)
        else:
            hit = await engine.lookup(index, tokens)
            if hit.cached_tokens:
                await engine.load(hit, own)

    async def user(index: int) -> None:
        user_rng = random.Random(seed * 1000 + index)
        for _ in range(ROUNDS):
            call = asyncio.ensure_future(one_call(index, user_rng))
            if user_rng.random() < 0.2:
                for _ in range(user_rng.randint(0, 3)):
                    await asyncio.sleep(0)
                call.cancel()
            faulty.fail_tasks = user_rng.random() < 0.1
            try:
                await call
                ends.append("done")
            except asyncio.CancelledError:
                ends.append("cancelled")
            except expected as error:
                ends.append(type(error).__name__)
                if isinstance(error, aiokv.EngineClosed):
                    return

    await engine.start()
    users = [asyncio.ensure_future(user(u)) for u in range(USERS)]
    await asyncio.sleep(rng.uniform(0.005, 0.05))
    await asyncio.wait_for(engine.aclose(drain=drain, timeout=5), 20)
    # Every caller ends at the close: none may be left to a request timeout (or none).
    _, stuck = await asyncio.wait(users, timeout=1)
    for task in stuck:
        task.cancel()
    assert not stuck, f"{len(stuck)} users still waiting after the close"
    for task in users:
        task.result()  # nothing unexpected escaped
    stats = engine.stats()
    resolved = stats.completed + stats.failed + stats.cancelled + stats.timed_out
    assert stats.submitted == resolved and stats.pending == 0
    assert engine._admission._promised == 0 and not engine._admission._waiters
    assert "EngineClosed" in ends  # the close came while users were still calling
    assert checked.problems() == []
    assert loop_errors == []
