"""On a GPU: an offload copies what the caller's stream wrote before the call, even while
that stream is still busy writing it (the engine waits for the caller's CUDA event), and
a load's data is in place when it resolves. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import aiokv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 64, 16, 2, 64
# About 0.1-0.5 s of GPU time on current GPUs: far longer than a batch window, so a copy
# that did not wait for the caller's stream would read the pages before they are written.
BUSY_CYCLES = 500_000_000


@pytest.mark.asyncio
async def test_offload_waits_for_the_callers_stream_and_load_lands_before_resolving() -> None:
    device = torch.device("cuda")
    caches = [
        torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device)
        for _ in range(LAYERS)
    ]
    written = [torch.randn(4, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device) for _ in caches]
    source = torch.arange(0, 4, device=device)
    target = torch.arange(8, 12, device=device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    engine = aiokv.OffloadEngine(
        aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01)),
        caches,
        aiokv.EngineConfig(window_us=0),
    )
    side.wait_stream(torch.cuda.current_stream(device))  # the tensors above are made there
    async with engine:
        with torch.cuda.stream(side):
            torch.cuda._sleep(BUSY_CYCLES)  # the stream is busy when its writes are queued
            for cache, data in zip(caches, written, strict=True):
                cache[source] = data
            stored = await engine.offload("u", source, 4 * PAGE_SIZE)
        assert stored.stored_tokens == 4 * PAGE_SIZE
        hit = await engine.lookup("u", 4 * PAGE_SIZE)
        loaded = await engine.load(hit, target)
        assert loaded.loaded_tokens == 4 * PAGE_SIZE
        # No synchronize before reading: the load resolved, so its copy has landed.
        for cache, data in zip(caches, written, strict=True):
            assert torch.equal(cache[target].cpu(), data.cpu())
