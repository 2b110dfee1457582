"""FlexKV with an SSD tier under aiokv, on a GPU: offload four times what the CPU tier
holds, all at once, then look every user up and load it back bit for bit.

Through the public path (``make_store`` of a ``backend: flexkv`` StoreConfig: FlexKV in its
default child process). With an SSD tier FlexKV keeps a put's CPU blocks locked until its
SSD write ends; aiokv resolves the put only then (store.py polls ``completely=True``), and
an offload that finds the CPU tier full of locked blocks waits for room (space.py) instead
of failing: no StoreFull reaches a caller, and every lookup finds its whole user (an SSD
hit stages through CPU blocks, which are free again). Skipped without CUDA and FlexKV.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import aiokv
from aiokv.stores.flexkv import flexkv_available

REASON = flexkv_available()
pytestmark = [pytest.mark.flexkv,
              pytest.mark.skipif(REASON is not None, reason=f"FlexKV not usable: {REASON}")]

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 256, 32  # 1 MiB per page (bf16, K and V)
USERS, USER_PAGES = 32, 32  # 1 GiB in all
CPU_GB, SSD_GB = 0.25, 2.0  # the CPU tier holds 256 pages: a quarter of what is offloaded
GROUP = 4  # users looked up and loaded together (their staging fits the CPU tier)


def caches_and_copy() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    pages = USERS * USER_PAGES + GROUP * USER_PAGES  # sources, then load targets
    generator = torch.Generator(device="cuda").manual_seed(7)
    caches = [
        torch.randn(pages, 2, PAGE, HEADS, HEAD_DIM, generator=generator, device="cuda")
        .to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    return caches, [c.clone() for c in caches]


def source(user: int) -> torch.Tensor:
    return torch.arange(user * USER_PAGES, (user + 1) * USER_PAGES, device="cuda")


def target(slot: int) -> torch.Tensor:
    start = USERS * USER_PAGES + slot * USER_PAGES
    return torch.arange(start, start + USER_PAGES, device="cuda")


@pytest.mark.asyncio
async def test_offloads_past_the_cpu_tier_load_back_bit_exact(tmp_path: Path) -> None:
    caches, original = caches_and_copy()
    config = aiokv.StoreConfig(
        backend="flexkv", page_size=PAGE, cpu_cache_gb=CPU_GB, ssd_cache_gb=SSD_GB,
        ssd_cache_dir=str(tmp_path),
    )
    engine = aiokv.OffloadEngine(
        aiokv.stores.make_store(config), caches,
        aiokv.EngineConfig(max_batch_requests=USERS, request_timeout_ms=120_000),
    )
    tokens = USER_PAGES * PAGE
    async with engine:
        outcomes = await asyncio.gather(
            *(engine.offload(user, source(user), tokens) for user in range(USERS)),
            return_exceptions=True,
        )
        full = [o for o in outcomes if isinstance(o, aiokv.StoreFull)]
        assert full == [], f"{len(full)} callers got StoreFull: {full[:1]}"
        assert [getattr(o, "stored_tokens", o) for o in outcomes] == [tokens] * USERS
        offloaded = engine.stats()
        for first in range(0, USERS, GROUP):
            users = range(first, first + GROUP)
            hits = await asyncio.gather(*(engine.lookup(user, tokens) for user in users))
            assert [h.cached_tokens for h in hits] == [tokens] * GROUP, list(users)
            for cache in caches:
                cache[USERS * USER_PAGES :].zero_()  # a load that writes nothing fails
            loads = await asyncio.gather(
                *(engine.load(hit, target(slot)) for slot, hit in enumerate(hits))
            )
            assert [r.loaded_tokens for r in loads] == [tokens] * GROUP
            torch.cuda.synchronize()
            for slot, user in enumerate(users):
                for layer, (cache, want) in enumerate(zip(caches, original, strict=True)):
                    got = cache[target(slot)].view(torch.int16)
                    assert torch.equal(got, want[source(user)].view(torch.int16)), (user, layer)
        stats = engine.stats()
    print(
        f"\nflexkv ssd: {USERS} users x {tokens} tokens, cpu {CPU_GB} GiB, ssd {SSD_GB} GiB: "
        f"space_waits={offloaded.space_waits} space_wait_ms={offloaded.space_wait_ms:.0f}, "
        f"failed={stats.failed}, loaded={stats.loaded_tokens}"
    )
    assert stats.failed == 0 and stats.timed_out == 0
    assert stats.loaded_tokens == USERS * tokens
