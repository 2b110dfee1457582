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
    block's bytes (``sums.of(keys, views)``: of any bytes).
    ``close()`` stops the summing threads."""

    def __init__(self, view: Callable[[int], memoryview], block_bytes: int, threads: int) -> None:
        self._view = view
        self._block_bytes = block_bytes
        self._threads = threads
        self._summers = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="aiokv-remote-sum")
            if threads > 1 else None
        )

    def __call__(self, keys: Sequence[str], blocks: Sequence[int]) -> list[int]:
        return self.of(keys, [self._view(block) for block in blocks])

    def of(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[int]:
        summers, share = self._summers, -(-len(views) // self._threads)  # rounded up
        if summers is None or len(views) * self._block_bytes < _SPLIT_BYTES:
            return self._run(keys, views)
        try:
            parts = [summers.submit(self._run, keys[i : i + share], views[i : i + share])
                     for i in range(share, len(views), share)]
        except RuntimeError:
            # The pool takes no work once the interpreter exits (its threads end first,
            # while a daemon writer may still be in a batch) or once closed: the batch is
            # hashed here, whole; parts already taken are left to end unread.
            return self._run(keys, views)
        sums = self._run(keys[:share], views[:share])
        for part in parts:
            sums += part.result()
        return sums

    @staticmethod
    def _run(keys: Sequence[str], views: Sequence[memoryview]) -> list[int]:
        sums = []
        for key, view in zip(keys, views, strict=True):
            digest = xxhash.xxh3_64(key.encode())
            digest.update(view)
            sums.append(digest.intdigest())
        return sums

    def close(self) -> None:
        if self._summers is not None:
            self._summers.shutdown(wait=True)
