"""On a GPU: ``aiokv bench model``'s shaped copier moves the pages it says it moves (so
that its rate beside the model is a rate of real copies). Skipped without CUDA or a
CUDA 12.8+ driver."""

from __future__ import annotations

import threading

import pytest
import torch

from aiokv.bench.beside import ShapedCopier, Unit
from aiokv.copy.driver import batch_entry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LAYERS, PAGES, PAGE_BYTES = 3, 16, 4096


def test_a_unit_copies_each_page_out_and_back() -> None:
    if batch_entry()[0] is None:
        pytest.skip(f"no cuMemcpyBatchAsync: {batch_entry()[1]}")
    device = torch.device("cuda")
    copier = ShapedCopier(device, LAYERS, PAGES, PAGE_BYTES)
    for cache in copier._caches:
        cache.random_(0, 256)
    torch.cuda.synchronize()
    before = [c.clone() for c in copier._caches]
    failure: list[BaseException] = []

    def on_a_thread_of_its_own() -> None:  # as aiokv bench model runs it
        try:
            copier.setup()
            units.extend(copier.unit())
        except BaseException as exc:
            failure.append(exc)

    units: list[Unit] = []
    thread = threading.Thread(target=on_a_thread_of_its_own)
    thread.start()
    thread.join(60)
    assert not failure, failure
    try:
        offload, load = units
        assert (offload.kind, load.kind) == ("offload", "load")
        assert offload.nbytes == LAYERS * PAGES * PAGE_BYTES
        host = copier._host.view(LAYERS, PAGES, PAGE_BYTES)
        for layer, cache in enumerate(before):
            pages = cache.view(2 * PAGES, PAGE_BYTES)
            base = copier._caches[layer].data_ptr()  # where the copies read (``cache``: a copy)
            starts = copier._device_addrs[layer * PAGES : (layer + 1) * PAGES]
            ids = [(int(a) - base) // PAGE_BYTES for a in starts]
            assert all(0 <= i < 2 * PAGES for i in ids)
            assert torch.equal(host[layer].cuda(), pages[ids])
        # The load wrote the host's bytes back where they came from: nothing changed.
        assert all(torch.equal(c, b) for c, b in zip(copier._caches, before, strict=True))
    finally:
        copier.close()
