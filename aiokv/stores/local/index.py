"""The prefix index: chained block digests per namespace, and LRU order for eviction.

A block's key is a 128-bit BLAKE2b digest of the namespace and of every token id from
the start of the sequence to the end of that block, so equal keys mean equal prefixes
(two users' blocks never share a key unless their namespace and whole prefix match).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..base import Int64Array

DIGEST_BYTES = 16
# Keyed once; each key starts from a copy (cheaper than constructing with parameters).
_SEED = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"aiokv-prefix")


def chain_digests(
    token_ids: Int64Array, namespace: Sequence[str], page_size: int
) -> list[bytes]:
    """One digest per full page: digest ``i`` covers the namespace and tokens
    ``[0, (i + 1) * page_size)``. A running hash is copied per block, so the cost is
    linear in the tokens, not quadratic."""
    full_pages = len(token_ids) // page_size
    running = _SEED.copy()
    encoded = [part.encode() for part in namespace]
    # Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    running.update(b"".join(len(e).to_bytes(8, "little") + e for e in encoded) + b"\x00tokens")
    head = token_ids[: full_pages * page_size]
    if head.dtype != np.int64 or not head.flags.c_contiguous:
        head = np.ascontiguousarray(head, dtype=np.int64)
    data = memoryview(head.data).cast("B")  # no copy: update() reads the array buffer
    block_bytes = page_size * 8
    update, copy = running.update, running.copy  # bound once: this loop is the store's hot spot
    digests = []
    for start in range(0, full_pages * block_bytes, block_bytes):
        update(data[start : start + block_bytes])
        digests.append(copy().digest())
    return digests


class BlockIndex:
    """digest -> host block, and the LRU order of blocks that may be evicted.

    Only READY blocks with no reader are in the LRU; the store moves blocks in and out.
    """

    def __init__(self) -> None:
        self._blocks: dict[bytes, int] = {}
        self._digests: dict[int, bytes] = {}  # the reverse map
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, digest: bytes) -> int | None:
        return self._blocks.get(digest)

    def digest_of(self, block: int) -> bytes:
        return self._digests[block]

    def insert(self, digests: Sequence[bytes], blocks: Sequence[int]) -> None:
        self._blocks.update(zip(digests, blocks, strict=True))
        self._digests.update(zip(blocks, digests, strict=True))

    def lookup(self, digests: Sequence[bytes]) -> list[int | None]:
        return list(map(self._blocks.get, digests))

    def remove(self, digest: bytes) -> None:
        block = self._blocks.pop(digest, None)
        if block is not None:
            self._digests.pop(block, None)

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def make_evictable(self, blocks: Sequence[int], digests: Sequence[bytes]) -> None:
        """Add (or refresh) blocks as most recently used. Pass a sequence's blocks in
        order: the first becomes the most recent, so tails are evicted before heads and
        prefixes survive longest."""
        # The blocks are not in the LRU (new, or just unpinned): appending in reverse
        # order makes the first block the most recent.
        self._lru.update(zip(reversed(blocks), reversed(digests), strict=True))

    def make_unevictable(self, block: int) -> None:
        self._lru.pop(block, None)

    def touch(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            if block in self._lru:
                self._lru.move_to_end(block)

    def evict(self, count: int) -> list[int]:
        """Drop the ``count`` least recently used evictable blocks from the index."""
        lru, blocks, digests = self._lru, self._blocks, self._digests
        evicted = []
        for _ in range(min(count, len(lru))):
            block, digest = lru.popitem(last=False)
            del blocks[digest]
            del digests[block]
            evicted.append(block)
        return evicted
