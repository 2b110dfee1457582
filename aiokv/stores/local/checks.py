"""The old seam's launch (slot mappings, not page ids), kept until the engine's page-based
launch merges: its slot mappings checked for the whole launch at once, and turned into
page ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import Int64Array


def _concat(arrays: list[Int64Array]) -> Int64Array:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def check_pages(
    task_ids: Sequence[int],
    firsts: list[Int64Array],
    lasts: list[Int64Array],
    page_size: int,
    gpu_pages: int,
) -> None:
    """Slots must be whole pages in order (``page * page_size + 0..page_size-1``) of
    pages that exist (``[0, gpu_pages)``): the copy moves whole pages, and an index past
    the caches would fault the device. Checked on each page's first and last slot, for
    the whole launch at once (a pass over every slot, or a check per task, costs about 1%
    of a batch's copy time); a page whose middle slots are permuted is copied in order.
    Raises ValueError naming the first bad task."""
    if firsts and _pages_ok(_concat(firsts), _concat(lasts), page_size, gpu_pages):
        return
    for task_id, first, last in zip(task_ids, firsts, lasts, strict=True):
        if not _pages_ok(first, last, page_size, gpu_pages):
            raise ValueError(
                f"launch: task {task_id}'s slots are not whole pages in order "
                f"(page * {page_size} + 0..{page_size - 1}) of pages in "
                f"[0, {gpu_pages})"
            )


def _pages_ok(first: Int64Array, last: Int64Array, page_size: int, gpu_pages: int) -> bool:
    return len(first) == 0 or not (
        (first % page_size).any()
        or int(first.min()) < 0
        or int(first.max()) >= gpu_pages * page_size
        or (last - first != page_size - 1).any()
    )


def pages_of_slots(
    task_ids: Sequence[int], slot_mappings: Sequence[Any], page_size: int, gpu_pages: int
) -> list[Int64Array]:
    """Each task's page ids from its slot mapping; ValueError (the whole launch fails, as
    with the old seam) for one that is not whole pages in order of pages that exist."""
    if len(task_ids) != len(slot_mappings):
        raise ValueError("launch: one slot mapping per task id")
    slots = [np.asarray(s, dtype=np.int64) for s in slot_mappings]
    firsts = [s[::page_size] for s in slots]
    lasts = [s[page_size - 1 :: page_size] for s in slots]
    check_pages(task_ids, firsts, lasts, page_size, gpu_pages)
    return [first // page_size for first in firsts]
