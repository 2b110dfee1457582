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

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 3, 64, 16, 2, 64
BLOCK_SHAPE = (LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM)
CHUNK_BLOCKS = 4


def run(transfer_: Transfer, done: queue.SimpleQueue[CopyJob], job: CopyJob) -> None:
    transfer_.submit(job)
    finished = done.get(timeout=60)
    assert finished is job and job.error is None, job.error


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_full_chunks_and_tails_move_every_page_whole(
    monkeypatch: pytest.MonkeyPatch, graphs: bool
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
    pool = HostPool(32, BLOCK_SHAPE, torch.bfloat16, pin=True)
    done: queue.SimpleQueue[CopyJob] = queue.SimpleQueue()
    copier = Transfer(caches, pool, done.put, layer_graphs=graphs)
    try:
        assert (copier._graphs is not None) is graphs, "graph capture failed (see the log)"
        order = np.random.default_rng(3).permutation(PAGES)
        sources, targets = order[:11], order[11:22]
        # Blocks 3..13 are one run: chunks of 4, 4, then a tail of 3; blocks 20..22 and
        # 25 are a second and third run, tails only.
        blocks = np.concatenate([np.arange(3, 14), np.arange(20, 23), [25]])
        sources = np.concatenate([sources, order[22:26]])
        targets = np.concatenate([targets, order[26:30]])
        run(copier, done, CopyJob([1], True, sources.astype(np.int64), blocks.astype(np.int64)))
        for page, block in zip(sources.tolist(), blocks.tolist(), strict=True):
            for layer, cache in enumerate(caches):
                assert torch.equal(pool.data[block, layer], cache[page].cpu()), (page, layer)

        before = [cache.clone() for cache in caches]
        run(copier, done, CopyJob([2], False, targets.astype(np.int64), blocks.astype(np.int64)))
        untouched = torch.ones(PAGES, dtype=torch.bool, device=device)
        untouched[torch.from_numpy(targets).to(device)] = False
        for layer, cache in enumerate(caches):
            assert torch.equal(cache[torch.from_numpy(targets).to(device)],
                               before[layer][torch.from_numpy(sources).to(device)])
            assert torch.equal(cache[untouched], before[layer][untouched])
    finally:
        copier.close()
