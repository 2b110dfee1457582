"""The page-based seam end to end: the engine hands the store each request's page ids as
the caller gave them (CPU, or views of device tensors); a bad page id fails its own
request alone, with InvalidRequest naming the id, and the rest of its batch moves its
bytes."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store

import aiokv
from aiokv.testing import CheckingStore

USERS = 3
TOKENS = 3 * PAGE_SIZE


def _engine(caches: list[torch.Tensor]) -> tuple[aiokv.OffloadEngine, CheckingStore]:
    store = CheckingStore(small_store(), loop_thread=threading.get_ident())
    # A window long enough that each gather below is one batch, one launch.
    return aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=50_000)), store


async def _round_trip(device: str, bad_offload: list[int], bad_load: list[int]) -> None:
    caches = [c.to(device) for c in make_caches()]
    original = [c.clone() for c in caches]
    num_pages = caches[0].shape[0]
    engine, store = _engine(caches)

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=device)

    sources = [ids([3 * u, 3 * u + 1, 3 * u + 2]) for u in range(USERS)]
    targets = [ids([100 + 3 * u, 101 + 3 * u, 102 + 3 * u]) for u in range(USERS)]
    async with engine:
        stored = await asyncio.gather(
            *(engine.offload(u, sources[u], TOKENS) for u in range(USERS)),
            engine.offload("bad", ids(bad_offload), TOKENS),
            return_exceptions=True,
        )
        hits = await asyncio.gather(*(engine.lookup(u, TOKENS) for u in range(USERS + 1)))
        loaded = await asyncio.gather(
            *(engine.load(hits[u], targets[u]) for u in (0, 2)),
            engine.load(hits[1], ids(bad_load)),
            return_exceptions=True,
        )
        stats = engine.stats()
    # The bad offload failed alone, naming its id; the others stored their pages.
    *good, bad = stored
    assert [r.stored_tokens for r in good] == [TOKENS] * USERS  # type: ignore[union-attr]
    assert isinstance(bad, aiokv.InvalidRequest) and bad.field == "page_ids"
    wrong = next(i for i in bad_offload if not 0 <= i < num_pages)
    assert str(bad) == f"page_ids: holds {wrong}, outside [0, {num_pages})"
    assert hits[USERS].cached_tokens == 0  # nothing of it was stored
    # The bad load failed alone; the others landed bit for bit.
    first, third, failed = loaded
    assert [r.loaded_tokens for r in (first, third)] == [TOKENS] * 2  # type: ignore[union-attr]
    assert isinstance(failed, aiokv.InvalidRequest) and failed.field == "page_ids"
    wrong = next(i for i in bad_load if not 0 <= i < num_pages)
    assert str(failed) == f"page_ids: holds {wrong}, outside [0, {num_pages})"
    for cache, before in zip(caches, original, strict=True):
        for u in (0, 2):
            assert torch.equal(cache[targets[u]], before[sources[u]])
        assert torch.equal(cache[targets[1]], before[targets[1]])  # untouched
    assert stats.store_tasks_open == 0 and stats.pending == 0
    assert store.problems() == []  # every match launched or given back, once


@pytest.mark.asyncio
async def test_a_bad_page_id_fails_only_its_own_request_of_a_batch() -> None:
    await _round_trip("cpu", bad_offload=[10, 11, 256], bad_load=[120, -3, 121])


@pytest.mark.asyncio
async def test_a_load_holding_a_page_twice_fails_alone(caches: list[torch.Tensor]) -> None:
    engine, store = _engine(caches)
    original = [c.clone() for c in caches]
    async with engine:
        await asyncio.gather(*(
            engine.offload(u, torch.arange(2 * u, 2 * u + 2), 2 * PAGE_SIZE) for u in range(2)
        ))
        hits = await asyncio.gather(*(engine.lookup(u, 2 * PAGE_SIZE) for u in range(2)))
        twice, fine = await asyncio.gather(
            engine.load(hits[0], torch.tensor([50, 50])),
            engine.load(hits[1], torch.tensor([60, 61])),
            return_exceptions=True,
        )
    assert isinstance(twice, aiokv.InvalidRequest)
    assert str(twice) == "page_ids: holds 50 twice; a load writes each page once"
    assert isinstance(fine, aiokv.LoadResult) and fine.loaded_tokens == 2 * PAGE_SIZE
    for cache, before in zip(caches, original, strict=True):
        assert torch.equal(cache[60:62], before[2:4]) and torch.equal(cache[50], before[50])
    assert store.problems() == []


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
async def test_a_bad_device_page_id_fails_only_its_own_request_of_a_batch() -> None:
    await _round_trip("cuda", bad_offload=[10, 2**40, 11], bad_load=[120, 121, 4096])
