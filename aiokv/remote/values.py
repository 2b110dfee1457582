"""Moving the remote tier's values between host blocks and Mooncake.

A value is the block's bytes followed by their 8-byte xxh3-64 checksum (of the key and
the bytes, so a value under the wrong key fails too): one Mooncake object. The host tier
keeps room for the checksum right after each block (its trailer,
:mod:`aiokv.stores.local.layout`), so a value goes out of and comes back into its host
block as one slice, zero-copy: Mooncake pays for every slice it moves, which at 512 KiB
cost about a tenth of a value's time, and more at smaller blocks; copying blocks through
staging slots cost more still above 256 KiB (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..stores.local.layout import TRAILER_BYTES
from .checksums import Checksums

CHECKSUM_BYTES = TRAILER_BYTES


@dataclass(frozen=True, slots=True)
class Layout:
    """The host tier's memory as the remote tier moves it: ``size`` bytes at ``base``
    (registered with Mooncake whole), block ``b`` at ``base + b * stride``, its
    checksum's room right after its ``block_bytes``."""

    base: int
    size: int
    block_bytes: int
    stride: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.stride < self.block_bytes + CHECKSUM_BYTES or (
                self.num_blocks * self.stride > self.size):
            raise ValueError(f"{self.num_blocks} blocks of {self.block_bytes} bytes, "
                             f"{self.stride} apart, in {self.size} bytes leave no room for "
                             "their checksums")


class Values:
    """One thread's puts and gets (the writer's, or the reader's) between the host
    memory of ``layout`` and Mooncake (``sums``: checksums of its blocks). Times go to
    ``stats`` under ``keys``: Mooncake's calls, and the checksums."""

    def __init__(self, layout: Layout, sums: Checksums, stats: dict[str, float],
                 keys: tuple[str, str]) -> None:
        self._base, self._stride = layout.base, layout.stride
        self.block_bytes = block_bytes = layout.block_bytes
        self.whole = block_bytes + CHECKSUM_BYTES
        self._sums, self._stats = sums, stats
        self._calls_key, self._sums_key = keys  # the stats' names of the two times
        # Each block's trailer, as one array over the host memory (unaligned where the
        # block's bytes are not whole 8-byte words: numpy reads and writes them so).
        memory = memoryview((ctypes.c_char * layout.size).from_address(layout.base)).cast("B")
        self._trailers: np.ndarray[Any, np.dtype[np.uint64]] = np.ndarray(
            (layout.num_blocks,), dtype="<u8", buffer=memory, offset=block_bytes,
            strides=(layout.stride,))
        self._scratch = np.zeros(1, dtype=np.uint64)  # where markers land, never read

    def buffers(self) -> list[tuple[int, int]]:
        """Memory to register with Mooncake (address, bytes), besides the host memory."""
        return [(self._scratch.ctypes.data, self._scratch.nbytes)]

    def seal(self, keys: Sequence[str], blocks: Sequence[int]) -> None:
        """Write each block's checksum under its key into its trailer, before its put."""
        began = time.monotonic()
        self._trailers[list(blocks)] = np.array(self._sums(keys, blocks), dtype=np.uint64)
        self._spent(self._sums_key, began)

    def put(self, client: Any, keys: Sequence[str], blocks: Sequence[int]) -> list[int]:
        """Put each key's value (sealed) from its host block: per key 0 or Mooncake's code."""
        began = time.monotonic()
        codes = client.batch_put_from(list(keys), self._at(blocks), [self.whole] * len(keys))
        self._spent(self._calls_key, began)
        return list(codes)

    def get(self, client: Any, keys: Sequence[str], blocks: Sequence[int],
            markers: Sequence[str] = ()) -> tuple[list[int], list[int], list[bool]]:
        """Get each key's value into its host block, and ``markers`` (one-byte values)
        in the same call: the markers' answers, then per key the get's answer (bytes, or
        a code) and whether the block is in place and passed its checksum."""
        began = time.monotonic()
        scratch = self._scratch.ctypes.data
        got = list(client.batch_get_into(
            [*markers, *keys], [scratch] * len(markers) + self._at(blocks),
            [self._scratch.nbytes] * len(markers) + [self.whole] * len(keys)))
        began = self._spent(self._calls_key, began)
        answers, got = got[: len(markers)], got[len(markers) :]
        arrived = [i for i, n in enumerate(got) if n == self.whole]
        sums = dict(zip(arrived, self._sums([keys[i] for i in arrived],
                                            [blocks[i] for i in arrived]), strict=True))
        trailers = self._trailers
        good = [i in sums and sums[i] == int(trailers[b]) for i, b in enumerate(blocks)]
        self._spent(self._sums_key, began)
        return answers, got, good

    def _at(self, blocks: Sequence[int]) -> list[int]:
        base, stride = self._base, self._stride
        return [base + b * stride for b in blocks]

    def _spent(self, key: str, began: float) -> float:
        now = time.monotonic()
        self._stats[key] += now - began
        return now
