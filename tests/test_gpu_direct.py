"""On a GPU, loads queued by their caller's thread (aiokv.direct): the bytes land in
scattered pages before the blocking load returns (a caller that overwrites its pages at
once keeps its own write), from several threads at once, with recsys's int32 page ids
on the device. Skipped without CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

import aiokv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 3, 512, 32, 4, 128
USERS, USER_PAGES = 8, 16
CONFIG = {"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 0.2}}


def rig() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(3)
    caches = [torch.randn(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, generator=generator)
              .to(device, torch.bfloat16) for _ in range(LAYERS)]
    order = torch.randperm(PAGES, generator=generator)
    sources = [order[u * USER_PAGES:(u + 1) * USER_PAGES].to(device) for u in range(USERS)]
    half = USERS * USER_PAGES
    targets = [order[half + u * USER_PAGES: half + (u + 1) * USER_PAGES]
               .to(device, torch.int32) for u in range(USERS)]
    torch.cuda.synchronize()
    return caches, sources, targets


def offloaded(kv: aiokv.BackgroundEngine, caches: list[torch.Tensor],
              sources: list[torch.Tensor], tokens: int) -> list[list[torch.Tensor]]:
    """Every user's pages offloaded: what each load must bring back, layer by layer."""
    for u in range(USERS):
        kv.offload(u, sources[u], tokens)
    return [[cache[sources[u]].clone() for cache in caches] for u in range(USERS)]


def test_a_load_has_landed_when_it_returns_and_the_callers_next_write_wins() -> None:
    caches, sources, targets = rig()
    tokens = USER_PAGES * PAGE_SIZE
    with aiokv.run_in_background(aiokv.open_engine(CONFIG, kv_caches=caches)) as kv:
        expected = offloaded(kv, caches, sources, tokens)
        for u in range(USERS):
            hit = kv.lookup(u, tokens)
            before = kv.stats().batches
            assert kv.load(hit, targets[u]).loaded_tokens == tokens
            assert kv.stats().batches == before  # queued by this thread: no batch
            # At once, on this thread's stream: a copy still under way would land over it.
            for cache in caches:
                cache[targets[u][:1].long()] = -7.0
        torch.cuda.synchronize()
        for u in range(USERS):
            for cache, want in zip(caches, expected[u], strict=True):
                got = cache[targets[u].long()]
                assert bool((got[:1] == -7.0).all())
                assert torch.equal(got[1:], want[1:])


def test_threads_loading_at_once_each_get_their_own_bytes() -> None:
    caches, sources, targets = rig()
    tokens = USER_PAGES * PAGE_SIZE
    with aiokv.run_in_background(aiokv.open_engine(CONFIG, kv_caches=caches)) as kv:
        expected = offloaded(kv, caches, sources, tokens)
        for cache in caches:
            for u in range(USERS):
                cache[targets[u].long()] = 0
        torch.cuda.synchronize()
        errors: list[BaseException] = []
        go = threading.Barrier(USERS)

        def load(u: int) -> None:
            try:
                go.wait()
                for _ in range(5):
                    got = kv.load(kv.lookup(u, tokens), targets[u])
                    assert got.loaded_tokens == tokens
                    torch.cuda.current_stream().synchronize()
                    for cache, want in zip(caches, expected[u], strict=True):
                        assert torch.equal(cache[targets[u].long()], want)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=load, args=(u,)) for u in range(USERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert kv.stats().completed >= USERS * 6
