"""The remote tier's checksums: xxh3 of each (key, block), a batch split over threads.

xxhash hashes without the GIL, so a large batch is shared between the calling thread and
``threads - 1`` summing threads (``store.remote.checksum_threads``); below ``_SPLIT_BYTES`` a
hand-over would cost what it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

_SPLIT_BYTES = 4 << 20


class Checksums:
    """``sums(keys, blocks)``: the checksum of each (key, block); ``view(block)`` gives a
    block's bytes. ``close()`` stops the summing threads."""

    def __init__(self, view: Callable[[int], memoryview], block_bytes: int, threads: int) -> None:
        self._view = view
        self._block_bytes = block_bytes
        self._threads = threads
        self._summers = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="aiokv-remote-sum")
            if threads > 1 else None
        )

    def __call__(self, keys: Sequence[str], blocks: Sequence[int]) -> list[int]:
        summers, share = self._summers, -(-len(blocks) // self._threads)  # rounded up
        if summers is None or len(blocks) * self._block_bytes < _SPLIT_BYTES:
            return self._run(keys, blocks)
        parts = [summers.submit(self._run, keys[i : i + share], blocks[i : i + share])
                 for i in range(share, len(blocks), share)]
        sums = self._run(keys[:share], blocks[:share])
        for part in parts:
            sums += part.result()
        return sums

    def _run(self, keys: Sequence[str], blocks: Sequence[int]) -> list[int]:
        view = self._view
        sums = []
        for key, block in zip(keys, blocks, strict=True):
            digest = xxhash.xxh3_64(key.encode())
            digest.update(view(block))
            sums.append(digest.intdigest())
        return sums

    def close(self) -> None:
        if self._summers is not None:
            self._summers.shutdown(wait=True)
