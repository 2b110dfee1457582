"""On a GPU: a copy job's page ids brought to the host (aiokv/copy/ids.py), by its kernel
and by the copy engines, checked by the ids it returns. Skipped without CUDA.

The ids are written on a side stream behind a long busy kernel and fetched at once with
the side stream's event as ready: a fetch that did not wait for it (on either path)
reads the ids from before (all 10**6 here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokv.copy.driver import BatchCopy, DriverError
from aiokv.copy.ids import PageIds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

BUSY_CYCLES = 200_000_000


def batch_or_none() -> BatchCopy | None:
    try:
        return BatchCopy()
    except DriverError:
        return None


@pytest.mark.parametrize("engines_busy", [False, True])
def test_ids_written_on_a_side_stream_come_back_as_written(engines_busy: bool) -> None:
    device = torch.device("cuda")
    torch.cuda.synchronize()
    page_ids = PageIds(device, batch_or_none())
    sizes, dtypes = [5, 0, 300, 1, 64], [torch.int32, torch.int64, torch.int64,
                                         torch.int32, torch.int64]
    generator = torch.Generator().manual_seed(3)
    wanted = [torch.randint(0, 2**31 - 1, (n,), generator=generator).to(d)
              for n, d in zip(sizes, dtypes, strict=True)]
    tasks = [torch.full((n,), 10**6, dtype=d, device=device)
             for n, d in zip(sizes, dtypes, strict=True)]
    # A strided view as well: every other id of a longer tensor.
    strided_source = torch.full((2 * 50,), 10**6, dtype=torch.int64, device=device)
    strided_wanted = torch.arange(50, dtype=torch.int64) * 7
    # On the device beforehand: a copy from pageable host memory could wait for the side
    # stream on the host, and the ids would be written before the fetch began.
    on_device = [w.to(device) for w in wanted]
    strided_on_device = strided_wanted.to(device)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        for task, want in zip(tasks, on_device, strict=True):
            task.copy_(want)
        strided_source[::2].copy_(strided_on_device)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(side)
    pages = [*tasks, strided_source[::2]]
    for _ in range(2):  # the second time through the grown buffer (and its view)
        ids = page_ids.fetch(pages, [ready], engines_busy=engines_busy)
        expected = np.concatenate([w.numpy().astype(np.int64) for w in wanted]
                                  + [strided_wanted.numpy()])
        np.testing.assert_array_equal(ids, expected)
    assert page_ids.fetches == 2
    assert page_ids.by_kernel == (2 if engines_busy else 0)


def test_a_first_job_of_no_ids_leaves_the_kernel_way_working() -> None:
    device = torch.device("cuda")
    page_ids = PageIds(device, batch_or_none())
    empty = page_ids.fetch([torch.empty(0, dtype=torch.int64, device=device)], [None],
                           engines_busy=True)
    assert len(empty) == 0
    ids = page_ids.fetch([torch.tensor([3, 1], device=device)], [None], engines_busy=True)
    np.testing.assert_array_equal(ids, [3, 1])
    assert page_ids.by_kernel == 2


def test_ids_partly_on_the_host_come_back_in_task_order() -> None:
    device = torch.device("cuda")
    page_ids = PageIds(device, batch_or_none())
    pages = [torch.tensor([4, 5], device=device), np.array([9], dtype=np.int64),
             torch.tensor([7], dtype=torch.int32, device=device)]
    ids = page_ids.fetch(pages, [None], engines_busy=True)  # partly on the host: engines
    np.testing.assert_array_equal(ids, [4, 5, 9, 7])
    assert page_ids.by_kernel == 0
