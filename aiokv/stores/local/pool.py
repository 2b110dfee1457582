"""Block allocation: a free bitmap with a rotating cursor (any tier), and the host pool
(one block per GPU page, all layers of a page contiguous).

Host layout ``[block, layer, k/v, token, head, dim]``, block ``b`` at ``b *
block_stride``: a block's bytes are one contiguous range. With a remote tier each block
is followed by a trailer (:func:`block_stride`) where its checksum goes, so that block and
checksum travel to Mooncake as one range; without one blocks are back to back. The
allocator hands out blocks from a rotating cursor, which keeps a batch's blocks
consecutive when eviction follows allocation order (LRU does, mostly), so that a run of
them moves with one strided copy per layer. The pool starts on a 4 KiB boundary, so that
the SSD tier can move a block with O_DIRECT without a bounce buffer whenever a block and
its stride are whole numbers of 4 KiB pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...errors import ConfigError
from ..base import Int64Array
from .hostmem import HostMemory
from .layout import block_stride, block_text


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


class BlockAllocator:
    """Which of ``num_blocks`` block numbers are free; hands them out from a cursor."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._cursor = 0

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        """The most blocks it may ever hand out (a fixed allocator: all of them)."""
        return self.num_blocks

    @property
    def sure(self) -> int:
        """The blocks it will surely be able to hand out (a fixed allocator: all)."""
        return self.num_blocks

    @property
    def used(self) -> int:
        """The blocks handed out and not given back."""
        return self.num_blocks - self._num_free

    def wait_for_free(self, count: int) -> None:
        """Block until ``count`` blocks are free or no more will come without a release
        (a fixed allocator: at once)."""

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

    def take(self, blocks: Int64Array) -> None:
        """Mark these (free, unique) blocks used: recovered ones, at open."""
        if self._free[blocks].sum() != len(blocks):
            raise RuntimeError("taking blocks that are not free")
        self._free[blocks] = False
        self._num_free -= len(blocks)

    def release(self, blocks: Int64Array) -> None:
        if len(blocks) == 0:
            return
        index = as_index(blocks)
        if self._free[index].any():
            raise RuntimeError("double free of blocks")
        self._free[index] = True
        self._num_free += len(blocks)


class HostPool(BlockAllocator):
    """The host tier's blocks, in a :class:`~.hostmem.HostMemory` mapping. When pinned,
    blocks join the allocator chunk by chunk as the mapping's background threads pin
    them (:meth:`grow`, on the store thread), so a store serves from the first chunk."""

    def __init__(
        self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
        trailer: bool = False,
    ) -> None:
        super().__init__(num_blocks)
        # A mapping starts on a page boundary, which O_DIRECT's alignment divides.
        self.memory = HostMemory(num_blocks, block_shape, dtype, pin, trailer=trailer)
        self.data = self.memory.data
        self.block_bytes = self.memory.block_bytes
        self.block_stride = self.memory.block_stride
        # The same memory as bytes, for the SSD tier's I/O threads (no copy).
        self.bytes = memoryview(self.memory.raw.numpy())  # type: ignore[arg-type]
        self._usable = self.memory.ready_blocks
        self._free[self._usable :] = False  # not pinned yet
        self._num_free = self._usable
        self.memory.start()

    def grow(self) -> None:
        """Take in the blocks pinned since the last call (store thread only)."""
        ready = self.memory.ready_blocks
        if ready > self._usable:
            self._free[self._usable : ready] = True
            self._num_free += ready - self._usable
            self._usable = ready

    @property
    def num_free(self) -> int:
        self.grow()
        return self._num_free

    @property
    def capacity(self) -> int:
        """All its blocks while they are being pinned; those pinned where pinning stopped
        short (a memlock limit: the store serves with those). A close that stops the
        pinning is no limit: the tier keeps its size, in the figures after close too."""
        memory = self.memory
        short = memory.wait_all(0) and memory.error is not None
        return memory.ready_blocks if short else self.num_blocks

    @property
    def sure(self) -> int:
        """The blocks pinned so far: pinning may yet stop short of the rest."""
        return self.memory.ready_blocks

    @property
    def used(self) -> int:
        """Of the blocks taken in (pinned), those handed out: never one not pinned yet,
        nor one a close left unpinned."""
        self.grow()
        return self._usable - self._num_free

    def wait_for_free(self, count: int) -> None:
        """Block (store thread) while the pool is still being pinned and fewer than
        ``count`` blocks are free; pinning a chunk takes milliseconds."""
        while self.num_free < count and self.memory.wait_grown(self._usable):
            pass

    def allocate(self, count: int) -> Int64Array:
        self.grow()
        return super().allocate(count)

    def close(self) -> None:
        """Unregister the pinned chunks (after the last copy that uses them)."""
        self.memory.close()

    @classmethod
    def for_caches(cls, kv_caches: Sequence[torch.Tensor], cpu_cache_gb: float,
                   trailer: bool = False) -> HostPool:
        """The pool of ``cpu_cache_gb`` GiB for these caches (pinned when they are on a
        GPU), with a trailer after each block where ``trailer`` (a remote tier's);
        ConfigError when that holds no block."""
        first = kv_caches[0]
        block_shape = (len(kv_caches), *first.shape[1:])
        block_bytes = int(np.prod(block_shape)) * first.element_size()
        stride = block_stride(block_bytes, trailer)
        num_blocks = int(cpu_cache_gb * (1 << 30) // stride)
        if num_blocks < 1:
            raise ConfigError(
                "store.cpu_cache_gb",
                f"{cpu_cache_gb} GiB holds no block of {block_text(block_bytes, stride)}",
            )
        pin = first.device.type == "cuda"
        try:
            return cls(num_blocks, block_shape, first.dtype, pin, trailer)
        except (RuntimeError, MemoryError, OSError) as exc:  # the mapping (or pinning) failed
            raise ConfigError(
                "store.cpu_cache_gb",
                f"{cpu_cache_gb} GiB ({num_blocks} blocks of {block_text(block_bytes, stride)}"
                f"{', pinned' if pin else ''}) could not be allocated: {exc}",
            ) from exc

    @property
    def raw(self) -> torch.Tensor:
        """All blocks (and trailers) as one uint8 buffer (the remote tier registers it
        with Mooncake)."""
        return self.memory.raw

    def block_view(self, block: int) -> memoryview:
        """Block ``block``'s bytes, writable."""
        at = block * self.block_stride
        return self.bytes[at : at + self.block_bytes]
