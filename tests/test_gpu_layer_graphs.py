"""On a GPU: the copy thread's chunks move every page whole, whether a chunk is one CUDA
graph replay (a full chunk) or one op per layer (a run's tail, or graphs turned off), in
both directions, and a load writes only its own pages. Skipped without CUDA."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from aiokv.stores.local import transfer
from aiokv.stores.local.pool import HostPool
from aiokv.stores.local.transfer import CopyJob, Transfer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 3, 128, 16, 2, 64
BLOCK_SHAPE = (LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM)
CHUNK_BLOCKS = 4


def run(transfer_: Transfer, done: queue.SimpleQueue[CopyJob], job: CopyJob) -> None:
    transfer_.submit(job)
    finished = done.get(timeout=60)
    assert finished is job and job.error is None, job.error


def runs_and_tails() -> np.ndarray:
    # Blocks 3..13 are one run: chunks of 4, 4, then a tail of 3; blocks 20..22 and 25
    # are a second and third run, tails only.
    return np.concatenate([np.arange(3, 14), np.arange(20, 23), [25]])


def descending_pieces() -> np.ndarray:
    # As the LRU hands out an old sequence's pieces, tail first: 40 blocks that copy in
    # host order as ten full chunks, more than MAX_CHUNKS_IN_FLIGHT, so each stage's
    # index buffer is rewritten while earlier replays may still be queued.
    return np.concatenate([np.arange(start, start + 4) for start in range(36, -1, -4)])


@pytest.mark.parametrize("blocks", [runs_and_tails(), descending_pieces()], ids=["runs", "pieces"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_chunks_move_every_page_whole(
    monkeypatch: pytest.MonkeyPatch, graphs: bool, blocks: np.ndarray
) -> None:
    device = torch.device("cuda")
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 2
    monkeypatch.setattr(transfer, "STAGING_BYTES", CHUNK_BLOCKS * block_bytes)
    generator = torch.Generator(device).manual_seed(7)
    caches = [
        torch.randn(PAGES, *BLOCK_SHAPE[1:], generator=generator, device=device).to(
            torch.bfloat16
        )
        for _ in range(LAYERS)
    ]
    pristine = [cache.clone() for cache in caches]
    pool = HostPool(48, BLOCK_SHAPE, torch.bfloat16, pin=True)
    # The test copies into blocks it picks, not ones the allocator handed out: they
    # must all be pinned first (a copy racing their registration fails it).
    assert pool.memory.wait_all(60) and pool.memory.ready_blocks == 48, pool.memory.error
    done: queue.SimpleQueue[CopyJob] = queue.SimpleQueue()
    if not graphs:  # as where capture fails: every chunk runs the eager ops
        monkeypatch.setattr(transfer.LayerGraphs, "capture", lambda *args: None)
    copier = Transfer(caches, pool, done.put)
    try:
        assert (copier._graphs is not None) is graphs, "graph capture failed (see the log)"
        torch.cuda.synchronize()
        assert all(torch.equal(c, p) for c, p in zip(caches, pristine, strict=True)), (
            "building the copier (its warm-up and capture) wrote into the caches"
        )
        order = np.random.default_rng(3).permutation(PAGES)
        n = len(blocks)
        sources, targets = order[:n], order[n : 2 * n]
        blocks = blocks.astype(np.int64)
        run(copier, done, CopyJob([1], True, sources.astype(np.int64), blocks))
        for page, block in zip(sources.tolist(), blocks.tolist(), strict=True):
            for layer, cache in enumerate(caches):
                assert torch.equal(pool.data[block, layer], cache[page].cpu()), (page, layer)

        before = [cache.clone() for cache in caches]
        run(copier, done, CopyJob([2], False, targets.astype(np.int64), blocks))
        on_device = {name: torch.from_numpy(ids).to(device) for name, ids in
                     (("sources", sources), ("targets", targets))}
        untouched = torch.ones(PAGES, dtype=torch.bool, device=device)
        untouched[on_device["targets"]] = False
        for layer, cache in enumerate(caches):
            assert torch.equal(cache[on_device["targets"]], before[layer][on_device["sources"]])
            assert torch.equal(cache[untouched], before[layer][untouched])
    finally:
        copier.close()
        pool.close()
