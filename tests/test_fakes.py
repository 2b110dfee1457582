"""The stores aiokv ships for its users' tests (:mod:`aiokv.testing`) answer as a real
store does where the Store contract says how: a test that passes on them must not fail on
LocalStore for these. Each case runs on the fakes and on LocalStore, side by side."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch
from conftest import PAGE_SIZE, PAGES, make_caches, small_store

import aiokv
from aiokv.testing import FakeStore, LayeredStore

STORES: dict[str, Callable[[], aiokv.Store]] = {
    "local": small_store,
    "fake": FakeStore,
    "layered": LayeredStore,
}
TOKENS = 2 * PAGE_SIZE


@pytest.mark.asyncio
@pytest.mark.parametrize("store", list(STORES))
async def test_a_page_id_outside_the_caches_fails_its_call_alone(store: str) -> None:
    async with aiokv.OffloadEngine(STORES[store](), make_caches()) as engine:
        with pytest.raises(aiokv.InvalidRequest, match="page_ids"):
            await engine.offload("u", torch.tensor([0, PAGES + 5]), TOKENS)
        await engine.offload("v", torch.tensor([0, 1]), TOKENS)
        async with await engine.lookup("v", TOKENS) as hit:
            with pytest.raises(aiokv.InvalidRequest, match="page_ids"):
                await engine.load(hit, torch.tensor([4, PAGES + 5]))


@pytest.mark.asyncio
@pytest.mark.parametrize("store", list(STORES))
async def test_a_load_into_a_page_twice_fails(store: str) -> None:
    async with aiokv.OffloadEngine(STORES[store](), make_caches()) as engine:
        await engine.offload("v", torch.tensor([0, 1]), TOKENS)
        async with await engine.lookup("v", TOKENS) as hit:
            with pytest.raises(aiokv.InvalidRequest, match="page_ids"):
                await engine.load(hit, torch.tensor([5, 5]))


@pytest.mark.asyncio
@pytest.mark.parametrize("store", list(STORES))
async def test_two_offloads_of_one_key_in_one_batch_store_it_once(store: str) -> None:
    caches = make_caches()
    async with aiokv.OffloadEngine(
        STORES[store](), caches, aiokv.EngineConfig(window_us=50_000)
    ) as engine:
        first, second = await asyncio.gather(
            engine.offload("k", torch.tensor([2, 3]), TOKENS),
            engine.offload("k", torch.tensor([6, 7]), TOKENS),
        )
        assert first.stored_tokens + second.stored_tokens == TOKENS
        async with await engine.lookup("k", 2 * TOKENS) as hit:
            assert hit.cached_tokens == TOKENS  # what the key has, not twice that
            loaded = await engine.load(hit, torch.tensor([10, 11, 12, 13]))
        assert loaded.loaded_tokens == TOKENS
        if store != "fake":  # which moves no bytes
            source = [2, 3] if first.stored_tokens else [6, 7]
            assert all(torch.equal(c[10:12], c[source]) for c in caches)
