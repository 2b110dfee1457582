"""A copy job's order: its (GPU page, host block) pairs in host-block order, and the runs of
consecutive host blocks that each become one copy (:mod:`.transfer` moves them). Pure
numpy, no device: the copy threads call these before a job's first copy.
"""

from __future__ import annotations

import numpy as np

from ..base import Int64Array


def in_host_order(gpu_pages: Int64Array, host_blocks: Int64Array) -> tuple[Int64Array, Int64Array]:
    """The (gpu page, host block) pairs in host-block order, repeated blocks (loads of
    one shared prefix into several requests' pages) as one ascending pass per repeat.

    Pairs are independent (a job never writes one GPU page or one host block twice), so
    any order moves the same bytes. In host order, the blocks a batch took in pieces
    become one run again: when the LRU frees an old, longer sequence for shorter
    requests, it gives each request the next piece of that sequence from its tail (tails
    are evicted first), so in request order a batch's blocks descend piece by piece, one
    run per request; sorted, they ascend as one. Fewer runs mean fewer, larger copies,
    and full chunks for the graph path."""
    if len(host_blocks) < 2 or (host_blocks[1:] > host_blocks[:-1]).all():  # ascending
        return gpu_pages, host_blocks
    order = np.argsort(host_blocks, kind="stable")
    ordered = host_blocks[order]
    first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    if len(first) < len(ordered):
        # Repeats: sorting by block alone would interleave them ([5, 5, 6, 6]) and cut
        # every run to one block. Sort by (occurrence, block) instead: [5, 6, 5, 6].
        sizes = np.diff(np.concatenate((first, [len(ordered)])))
        occurrence = np.empty(len(ordered), dtype=np.int64)
        occurrence[order] = np.arange(len(ordered)) - np.repeat(first, sizes)
        order = np.lexsort((host_blocks, occurrence))
    return gpu_pages[order], host_blocks[order]


def contiguous_runs(
    host_blocks: Int64Array, max_len: int, chunk_starts: Int64Array | None = None
) -> list[tuple[int, int]]:
    """Split positions ``[0, n)`` into (start, end) ranges whose host blocks are
    consecutive and at most ``max_len`` long, in the order given (the copy order).

    ``chunk_starts``: host blocks that begin a separately pinned chunk of the pool, in
    ascending order. A run never crosses one: CUDA refuses a copy whose host range spans
    two registrations. (Each block's chunk comes from one binary search against the few
    starts, several times cheaper than ``np.isin``: this runs before a job's first copy.)"""
    n = len(host_blocks)
    if n == 0:
        return []
    step = np.diff(host_blocks) != 1
    if chunk_starts is not None and len(chunk_starts):
        pinned_chunk = np.searchsorted(chunk_starts, host_blocks, side="right")
        step |= pinned_chunk[1:] != pinned_chunk[:-1]
    breaks = np.flatnonzero(step) + 1
    bounds = np.concatenate(([0], breaks, [n]))
    runs = []
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        for chunk in range(start, end, max_len):
            runs.append((chunk, min(chunk + max_len, end)))
    return runs
