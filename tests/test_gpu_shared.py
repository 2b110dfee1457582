"""On a GPU: two engine processes with CUDA caches on one ``aiokv store-server`` (the
region pinned in chunks in each engine). What one offloads, the other loads bit for bit,
and a load right after the other's offload returned finds it. Skipped without CUDA."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from shared_host import PAGE_SIZE, Process, Server, caches, running_host, user_kv

import aiokv
from aiokv.stores.base import TaskStatus
from aiokv.stores.shared import SharedStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture
def gpu_host(tmp_path: Path) -> Iterator[tuple[Server, list[Process]]]:
    with running_host(tmp_path, 2, device="cuda") as host:
        yield host


def test_gpu_engines_share_the_region_bit_exact(gpu_host: tuple[Server, list[Process]]) -> None:
    _, (first, second) = gpu_host
    for user in range(4):
        assert first("offload", user=user, pages=6) == {"stored": 24, "cached": 24}
        assert second("load", user=user, pages=6) == {"cached": 24, "loaded": 24,
                                                      "exact": True}
    assert second("offload", user=9, pages=3, first_page=20)["stored"] == 12
    assert first("load", user=9, pages=3)["exact"]


def _until(condition: Callable[[], object]) -> None:
    give_up = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < give_up, "a task did not end within 20 s"
        time.sleep(0.01)  # polling the store for its answer, not ordering work


def test_cuda_page_ids_copy_through_the_data_plane_layer_by_layer(
    gpu_host: tuple[Server, list[Process]],
) -> None:
    """Page ids on the device (fused to one device-to-host copy per job, d2h_copies),
    a bad one failing its own task, and a load's layers marked one by one."""
    server, _ = gpu_host
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(server.socket)))
    tables = caches(device="cuda")
    store.register(tables)
    try:
        tokens = np.arange(900, 900 + 4 * PAGE_SIZE, dtype=np.int64)
        kv = user_kv(50, 4)
        for cache, data in zip(tables, kv, strict=True):
            cache[:4] = data.cuda()
        put, _ = store.put_match(tokens, ["gpu-ids"])
        bad, _ = store.put_match(tokens + 10_000, ["gpu-ids"])
        store.launch([put, bad], [torch.arange(4, device="cuda"),
                                  torch.tensor([0, 1, 2, 999], device="cuda")], [None, None])
        ends: dict[int, object] = {}
        _until(lambda: ends.update(store.try_wait([put, bad])) or len(ends) == 2)
        assert ends[put].status is TaskStatus.SUCCESS  # type: ignore[attr-defined]
        assert ends[bad].status is TaskStatus.INVALID  # type: ignore[attr-defined]
        assert store.store_stats()["d2h_copies"] >= 1
        for cache in tables:
            cache.zero_()
        get, mask = store.get_match(tokens, ["gpu-ids"])
        assert mask.all()
        store.launch([get], [torch.tensor([10, 3, 7, 1], device="cuda")], [None])
        marks = store.layer_marks(get)
        assert marks is not None
        for layer, (cache, data) in enumerate(zip(tables, kv, strict=True)):
            marks.synchronize(layer)
            assert torch.equal(cache[[10, 3, 7, 1]].cpu(), data)
        _until(lambda: store.try_wait([get]))
    finally:
        store.close()
