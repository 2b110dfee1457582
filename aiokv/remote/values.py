"""Moving the remote tier's values between host blocks and Mooncake.

A value is the block's bytes followed by their 8-byte xxh3-64 checksum (of the key and
the bytes, so a value under the wrong key fails too): one Mooncake object, the same bytes
whichever way it travels. Mooncake pays for every slice it moves about what copying a
quarter of a MiB costs here, so below ``STAGE_BELOW`` bytes a block is copied into a
registered slot with its checksum after it and moves as one slice; larger blocks go
zero-copy as two slices, the block from (into) the host pool and the checksum from (into)
a table of one per host block. Measured (benchmarks/RESULTS.md): at 16 KiB staging took a
third off puts and gets, at 256 KiB it was even, at 512 KiB it lost 15%.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checksums import Checksums

STAGE_BELOW = 256 << 10  # block bytes below which values are staged
CHECKSUM_BYTES = 8
_SLOT_ALIGN = 64
_STAGING_BYTES = 16 << 20  # slots per thread; a larger batch goes in turns


class Values:
    """One thread's puts and gets (the writer's, or the reader's) for a host pool whose
    block ``b`` is at ``base + b * block_bytes`` (``sums``: checksums of its blocks).
    Times go to ``stats`` under ``keys``: Mooncake's calls, the copies and checksums."""

    def __init__(self, base: int, block_bytes: int, num_blocks: int, sums: Checksums,
                 stats: dict[str, float], keys: tuple[str, str]) -> None:
        self._base, self.block_bytes = base, block_bytes
        self.whole = block_bytes + CHECKSUM_BYTES
        self._sums, self._stats = sums, stats
        self._calls_key, self._sums_key = keys  # the stats' names of the two times
        self._table = np.zeros(num_blocks, dtype=np.uint64)  # two slices: per host block
        self._scratch = np.zeros(1, dtype=np.uint64)  # where markers land, never read
        self._staged = block_bytes < STAGE_BELOW
        self._stride = -(-self.whole // _SLOT_ALIGN) * _SLOT_ALIGN
        self._count = max(1, _STAGING_BYTES // self._stride) if self._staged else 0
        self._slots = np.zeros(self._count * self._stride, dtype=np.uint8)
        self._slot_bytes = self._slots.data.cast("B")

    def buffers(self) -> list[tuple[int, int]]:
        """Memory to register with Mooncake (address, bytes), besides the pool."""
        own = [(self._table.ctypes.data, self._table.nbytes), (self._scratch.ctypes.data, 8)]
        return own + ([(self._slots.ctypes.data, self._slots.nbytes)] if self._staged else [])

    def put(self, client: Any, keys: Sequence[str], blocks: Sequence[int]) -> list[int]:
        """Put each key's value from its host block: per key 0 or Mooncake's code."""
        if not self._staged:
            began = time.monotonic()
            self._table[list(blocks)] = np.array(self._sums(keys, blocks), dtype=np.uint64)
            began = self._spent(self._sums_key, began)
            codes = client.batch_put_from_multi_buffers(list(keys), *self._two(blocks))
            self._spent(self._calls_key, began)
            return list(codes)
        codes = []
        for at in range(0, len(keys), self._count):
            began = time.monotonic()
            part, slots = keys[at : at + self._count], range(len(keys[at : at + self._count]))
            for slot, block in zip(slots, blocks[at : at + self._count], strict=True):
                ctypes.memmove(self._slot(slot), self._base + block * self.block_bytes,
                               self.block_bytes)
            sums = self._sums.of(part, [self._body(slot) for slot in slots])  # hot in cache
            for slot, value in zip(slots, sums, strict=True):
                self._trailer(slot)[:] = value.to_bytes(CHECKSUM_BYTES, "little")
            began = self._spent(self._sums_key, began)
            codes += client.batch_put_from(list(part), [self._slot(s) for s in slots],
                                           [self.whole] * len(part))
            self._spent(self._calls_key, began)
        return codes

    def get(self, client: Any, keys: Sequence[str], blocks: Sequence[int],
            markers: Sequence[str] = ()) -> tuple[list[int], list[int], list[bool]]:
        """Get each key's value into its host block, and ``markers`` (one-byte values)
        in the same call: the markers' answers, then per key the get's answer (bytes, or
        a code) and whether the block is in place and passed its checksum."""
        if not self._staged:
            began = time.monotonic()
            buffers, sizes = self._two(blocks)
            got = list(client.batch_get_into_multi_buffers(
                [*markers, *keys], [[self._scratch.ctypes.data]] * len(markers) + buffers,
                [[1]] * len(markers) + sizes))
            began = self._spent(self._calls_key, began)
            answers, got = got[: len(markers)], got[len(markers) :]
            arrived = [i for i, n in enumerate(got) if n == self.whole]
            sums = dict(zip(arrived, self._sums([keys[i] for i in arrived],
                                                [blocks[i] for i in arrived]), strict=True))
            good = [i in sums and sums[i] == int(self._table[b]) for i, b in enumerate(blocks)]
            self._spent(self._sums_key, began)
            return answers, got, good
        answers, got, good, asked = [], [], [], list(markers)
        for at in range(0, max(1, len(keys)), self._count):
            began = time.monotonic()
            part, slots = keys[at : at + self._count], range(len(keys[at : at + self._count]))
            some = list(client.batch_get_into(
                asked + list(part), [self._scratch.ctypes.data] * len(asked)
                + [self._slot(s) for s in slots], [8] * len(asked) + [self.whole] * len(part)))
            began = self._spent(self._calls_key, began)
            answers, some, asked = answers + some[: len(asked)], some[len(asked) :], []
            arrived = [s for s in slots if some[s] == self.whole]
            sums = dict(zip(arrived, self._sums.of([part[s] for s in arrived],
                                                   [self._body(s) for s in arrived]),
                            strict=True))
            for slot, block in zip(slots, blocks[at : at + self._count], strict=True):
                ok = slot in sums and sums[slot] == int.from_bytes(self._trailer(slot), "little")
                if ok:
                    ctypes.memmove(self._base + block * self.block_bytes, self._slot(slot),
                                   self.block_bytes)
                good.append(ok)
            got += some
            self._spent(self._sums_key, began)
        return answers, got, good

    def _two(self, blocks: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per host block, its value's two slices (addresses, sizes)."""
        size, table = self.block_bytes, self._table.ctypes.data
        return ([[self._base + b * size, table + b * CHECKSUM_BYTES] for b in blocks],
                [[size, CHECKSUM_BYTES]] * len(blocks))

    def _slot(self, slot: int) -> int:
        return int(self._slots.ctypes.data) + slot * self._stride

    def _body(self, slot: int) -> memoryview:
        return self._slot_bytes[slot * self._stride : slot * self._stride + self.block_bytes]

    def _trailer(self, slot: int) -> memoryview:
        at = slot * self._stride + self.block_bytes
        return self._slot_bytes[at : at + CHECKSUM_BYTES]

    def _spent(self, key: str, began: float) -> float:
        now = time.monotonic()
        self._stats[key] += now - began
        return now
