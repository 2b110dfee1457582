"""On a GPU: a load batch's first chunk, copied in ahead (LocalStore.prestage), and an
offload batch's, gathered ahead (LocalStore.prestage_puts), land bit for bit where the
launch puts them, across several chunks; a batch whose launch differs from its prestage
(a request with a bad page id) copies everything itself. Skipped without CUDA."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import aiokv
from aiokv.stores.local import transfer as transfer_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 256, 16, 2, 64
PAGES_EACH, USERS = 6, 4  # 24 pages a batch: six chunks of four
TOKENS = PAGES_EACH * PAGE_SIZE


@pytest.mark.asyncio
async def test_prestaged_loads_land_bit_exact_and_a_changed_launch_copies_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = torch.device("cuda")
    block_bytes = LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * 4
    monkeypatch.setattr(transfer_module, "STAGING_BYTES", 4 * block_bytes)
    jobs: list[tuple[bool, bool]] = []  # (prestaged, a copy ahead was waiting)
    enqueue = transfer_module.Transfer._enqueue_chunks

    def recording(self: Any, job: Any) -> Any:
        if not job.to_host:
            jobs.append((job.prestaged > 0, self._prestaged is not None))
        return enqueue(self, job)

    monkeypatch.setattr(transfer_module.Transfer, "_enqueue_chunks", recording)
    caches = [torch.randn(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device)
              for _ in range(LAYERS)]
    original = [c.clone() for c in caches]
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=USERS)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.05))
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        # Descending source pages: the pool's blocks are then in another order than the
        # pages, as in serving.
        sources = [torch.arange(PAGES_EACH * (u + 1) - 1, PAGES_EACH * u - 1, -1, device=device)
                   for u in range(USERS)]
        await asyncio.gather(*(engine.offload(u, sources[u], TOKENS) for u in range(USERS)))
        for round_, bad_user in enumerate((None, 2)):
            hits = await asyncio.gather(*(engine.lookup(u, TOKENS) for u in range(USERS)))
            first = 100 + 40 * round_
            targets = [torch.arange(first + PAGES_EACH * u, first + PAGES_EACH * (u + 1),
                                    device=device) for u in range(USERS)]
            if bad_user is not None:
                targets[bad_user] = targets[bad_user].clone()
                targets[bad_user][-1] = PAGES + 7
            results = await asyncio.gather(
                *(engine.load(h, t) for h, t in zip(hits, targets, strict=True)),
                return_exceptions=True,
            )
            for u in range(USERS):
                if u == bad_user:
                    assert isinstance(results[u], aiokv.InvalidRequest)
                    continue
                for layer, cache in enumerate(caches):
                    assert torch.equal(cache[targets[u]], original[layer][sources[u]]), (u, layer)
        assert engine.stats().store_tasks_open == 0
    # The first load job used its copy ahead; the second, launched without the bad
    # request, found one waiting and was not the one it was meant for.
    assert jobs == [(True, True), (False, True)]


@pytest.mark.asyncio
async def test_prestaged_offloads_land_bit_exact_and_a_bad_page_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Offload rounds whose first chunk is gathered ahead from the callers' device page
    ids (LocalStore.prestage_puts), loaded back and compared: all good (int32 ids); one
    request with a page id out of range (it fails alone, its blocks given back after the
    copy ahead that wrote them, clamped); and a batch of 16, whose head is named."""
    device = torch.device("cuda")
    block_bytes = LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * 4
    monkeypatch.setattr(transfer_module, "STAGING_BYTES", 4 * block_bytes)
    jobs: list[tuple[int, bool]] = []  # (tasks, prestaged)
    enqueue = transfer_module.Transfer._enqueue_chunks

    def recording(self: Any, job: Any) -> Any:
        if job.to_host:
            jobs.append((len(job.task_ids), job.prestaged > 0))
        return enqueue(self, job)

    monkeypatch.setattr(transfer_module.Transfer, "_enqueue_chunks", recording)
    caches = [torch.randn(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device)
              for _ in range(LAYERS)]
    # Each round's calls come in one loop iteration, well inside the window; a batch of
    # 16 is dispatched full at once.
    config = aiokv.EngineConfig(window_us=2000, max_batch_requests=16)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.05))
    rounds = [(USERS, PAGES_EACH, None, torch.int32), (USERS, PAGES_EACH, 1, torch.int64),
              (16, 2, None, torch.int64)]
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        for number, (users, pages_each, bad_user, dtype) in enumerate(rounds):
            tokens = pages_each * PAGE_SIZE
            keys = [f"r{number}u{u}" for u in range(users)]
            sources = [torch.arange(pages_each * (u + 1) - 1, pages_each * u - 1, -1,
                                    device=device, dtype=dtype) for u in range(users)]
            if bad_user is not None:
                sources[bad_user][1] = PAGES + 7
            results = await asyncio.gather(
                *(engine.offload(key, pages, tokens) for key, pages in zip(keys, sources,
                                                                          strict=True)),
                return_exceptions=True,
            )
            targets = [torch.arange(160 + pages_each * u, 160 + pages_each * (u + 1),
                                    device=device) for u in range(users)]
            for u in range(users):
                if u == bad_user:
                    assert isinstance(results[u], aiokv.InvalidRequest)
                    assert (await engine.lookup(keys[u], tokens)).cached_tokens == 0
                    continue
                hit = await engine.lookup(keys[u], tokens)
                loaded = await engine.load(hit, targets[u])
                assert loaded.loaded_tokens == tokens
                for layer, cache in enumerate(caches):
                    assert torch.equal(cache[targets[u]], cache[sources[u].long()]), (u, layer)
            stats = engine.stats()
            assert stats.store_tasks_open == 0
        used = store.num_blocks - store.free_blocks  # every request answered: at rest
    assert used == (USERS + USERS - 1) * PAGES_EACH + 16 * 2  # the bad request's given back
    # Round 1: one job, prestaged. Round 2: the launch lacks the bad request, so its job
    # copies everything itself. Round 3: the head (two requests) prestaged, then the rest.
    assert jobs == [(USERS, True), (USERS - 1, False), (2, True), (14, False)]
