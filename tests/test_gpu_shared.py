"""On a GPU: two engine processes with CUDA caches on one ``aiokv store-server`` (the
region pinned in chunks in each engine). What one offloads, the other loads bit for bit,
and a load right after the other's offload returned finds it. Skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from shared_host import Process, Server, running_host

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
