"""The shared store on CUDA caches: each engine process copies between its own GPU and
the shared region on the embedded store's data plane (the copy engines, from the
region's pinned chunks); what one process offloads loads bit-exact in another."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from shared_host import Process, Server, running_host

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not hasattr(os, "memfd_create"),
                       reason="the shared region needs memfd_create (Linux)"),
]


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[Process]]]:
    with running_host(tmp_path_factory.mktemp("shared-gpu"), 2, device="cuda") as running:
        yield running


def test_offloaded_by_one_gpu_process_loads_bit_exact_in_another(
    gpu_host: tuple[Server, list[Process]],
) -> None:
    _, (first, second) = gpu_host
    assert first("offload", user=7, pages=16) == {"stored": 64, "cached": 64}
    assert second("load", user=7, pages=16) == {"cached": 64, "loaded": 64, "exact": True}
    # And back the other way, on blocks the server hands out next.
    assert second("offload", user=8, pages=12, first_page=30) == {"stored": 48, "cached": 48}
    assert first("load", user=8, pages=12) == {"cached": 48, "loaded": 48, "exact": True}


def test_a_gpu_process_reloads_its_own_offload(gpu_host: tuple[Server, list[Process]]) -> None:
    _, (first, _second) = gpu_host
    assert first("offload", user=9, pages=4, first_page=40)["cached"] == 16
    assert first("load", user=9, pages=4) == {"cached": 16, "loaded": 16, "exact": True}
