"""On a GPU: a batch's fused slots reach the host while a large device-to-host copy is
still running on another stream (the kernel writes pinned memory; a copy would queue
behind the bulk copy in the copy engine), and they are right for every shape of batch
the batcher makes. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokv.copy import pinned
from aiokv.copy.fused import fuse_page_ids, warm_up

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PAGE_SIZE = 32


def expected_slots(page_ids: list[torch.Tensor], used: list[int]) -> list[list[int]]:
    return [
        [page * PAGE_SIZE + offset for page in ids[:n].tolist() for offset in range(PAGE_SIZE)]
        for ids, n in zip(page_ids, used, strict=True)
    ]


def request_slots(page_ids: list[torch.Tensor], used: list[int]) -> list[list[int]]:
    views = [ids[:n] for ids, n in zip(page_ids, used, strict=True)]
    fused = fuse_page_ids(views, torch.cuda.current_stream(), PAGE_SIZE)
    slots = fused.wait_slots(PAGE_SIZE)
    return [part.tolist() for part in fused.split(slots, PAGE_SIZE)]


def test_fused_slots_arrive_while_a_bulk_copy_to_the_host_runs() -> None:
    device = torch.device("cuda")
    if not pinned.writes_host(device):
        pytest.skip("this device cannot write pinned memory from kernels (copy fallback)")
    # Load the fused path's kernels first: lazy loading takes 20-30 ms on an H200, about
    # as long as the bulk copy, and would make this a race.
    warm_up(device, PAGE_SIZE)
    bulk = torch.ones(1 << 30, dtype=torch.uint8, device=device)  # ~20 ms at 50 GiB/s
    bulk_host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    page_ids = [torch.randint(0, 10_000, (64,), device=device) for _ in range(64)]
    used = [64] * 64
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    bulk_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        bulk_host.copy_(bulk, non_blocking=True)
        bulk_done.record()
    fused = fuse_page_ids(page_ids, torch.cuda.current_stream(), PAGE_SIZE)
    slots = fused.wait_slots(PAGE_SIZE)
    # Through the copy engine, the slots would land only after the bulk copy.
    done_first = bulk_done.query()  # type: ignore[no-untyped-call]
    assert not done_first, "the fused slots waited for the bulk copy"
    assert [part.tolist() for part in fused.split(slots, PAGE_SIZE)] == expected_slots(
        page_ids, used
    )
    bulk_done.synchronize()


@pytest.mark.parametrize("direct", [True, False], ids=["kernel-writes-host", "copy"])
def test_fused_slots_are_right_for_every_batch_shape(
    direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With its index: the flag is looked up by the tensors' device, which has one (a key
    # of plain "cuda" left the copy variant running the kernel path).
    device = torch.device("cuda", torch.cuda.current_device())
    if direct and not pinned.writes_host(device):
        pytest.skip("this device cannot write pinned memory from kernels (copy fallback)")
    monkeypatch.setitem(pinned._WRITES_HOST, device, direct)
    assert pinned.writes_host(torch.empty(1, device=device).device) is direct
    generator = torch.Generator().manual_seed(5)

    def ids(count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(0, 1 << 20, (count,), generator=generator).to(device, dtype)

    one = [ids(7)]
    assert request_slots(one, [7]) == expected_slots(one, [7])
    mixed_dtypes = [ids(3), ids(5, torch.int32), ids(1)]
    assert request_slots(mixed_dtypes, [3, 2, 1]) == expected_slots(mixed_dtypes, [3, 2, 1])
    long_tails = [ids(500), ids(400)]  # sliced to the used heads before the concat
    assert request_slots(long_tails, [2, 3]) == expected_slots(long_tails, [2, 3])
    # Some ids on the host: the device part is not expanded there, and joins the host's.
    with_host = [ids(4, torch.int32), torch.tensor([9, 8]), ids(2)]
    with_host[2] = with_host[2][:1]  # a view, as the engine hands them over
    fused = fuse_page_ids(with_host, torch.cuda.current_stream(), PAGE_SIZE)
    assert fused.d2h_copies == 1
    pages = fused.wait()
    starts = fused.starts.tolist()
    got = [pages[s : s + n].tolist() for s, n in zip(starts, [4, 2, 1], strict=True)]
    assert got == [with_host[0].tolist(), [9, 8], with_host[2][:1].tolist()]
    assert np.array_equal(fused.expand(pages, PAGE_SIZE)[:PAGE_SIZE],
                          np.arange(PAGE_SIZE) + pages[0] * PAGE_SIZE)
