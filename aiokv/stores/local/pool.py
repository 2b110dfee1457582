"""The host block pool: one block per GPU page, all layers of a page contiguous.

Layout ``[block, layer, k/v, token, head, dim]``: a run of consecutive blocks is one
contiguous range of host memory, so a batch that lands in a run moves with one large
copy. The allocator hands out blocks from a rotating cursor, which keeps a batch's
blocks consecutive when eviction follows allocation order (LRU does, mostly).
"""

from __future__ import annotations

import numpy as np
import torch

from ..base import Int64Array


def as_index(blocks: Int64Array) -> slice | Int64Array:
    """A slice when ``blocks`` is one ascending run (as the allocator usually hands out),
    else the array: numpy slice assignment is several times cheaper than fancy indexing.

    Precondition: ``blocks`` is unique and ascending, or ascending with one wrap (the
    allocator's order), so that ``last - first == n - 1`` means one run. Sort anything
    else first: for [4, 10, 6] the test would pass and name the wrong blocks."""
    n = len(blocks)
    if n and int(blocks[-1]) - int(blocks[0]) == n - 1:
        return slice(int(blocks[0]), int(blocks[0]) + n)
    return blocks


class HostPool:
    def __init__(
        self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> None:
        self.data = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._cursor = 0

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, count: int) -> Int64Array:
        """``count`` free blocks, consecutive where possible. Caller checks num_free."""
        if count > self._num_free:
            raise ValueError(f"asked for {count} blocks, {self._num_free} free")
        # Look just past the cursor first: usually enough, and O(count).
        cursor = self._cursor
        window = self._free[cursor : cursor + count]
        if len(window) == count and window.all():
            window[:] = False  # a view: marks the run taken
            self._num_free -= count
            self._cursor = (cursor + count) % self.num_blocks if count else cursor
            return np.arange(cursor, cursor + count, dtype=np.int64)
        free = np.flatnonzero(self._free)
        after = free[free >= cursor]
        blocks = np.concatenate((after, free[free < cursor]))[:count].astype(np.int64)
        self._free[as_index(blocks)] = False
        self._num_free -= count
        self._cursor = (int(blocks[-1]) + 1) % self.num_blocks if count else self._cursor
        return blocks

    def release(self, blocks: Int64Array) -> None:
        if len(blocks) == 0:
            return
        index = as_index(blocks)
        if self._free[index].any():
            raise RuntimeError("double free of host blocks")
        self._free[index] = True
        self._num_free += len(blocks)
