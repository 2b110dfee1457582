"""Copy plans: a job's page ids and host blocks as one copy per (page, layer), with the
checks a caller's page ids must pass first. Pure numpy, no device, so that the tests can
move the planned bytes with memmove and compare them with torch's indexing.

Layouts. The caches are one table per layer, ``[page, 2, page_size, heads, head_dim]``:
a page of a layer is ``page_bytes`` contiguous bytes at ``layer_base + page *
page_stride``. The host pool is ``[block, layer, ...]``: all layers of a block are
contiguous (the SSD tier moves a block as one range), layer ``l`` of block ``b`` at
``host_base + b * block_stride + l * page_bytes`` (a stride past the block's bytes leaves
a remote tier's trailer after each block). Pages go one copy per (page, layer) in one
batch call per layer and stream (the copy engines take thousands of them at full
speed), except runs: ``MIN_RUN`` or more adjacent pages into adjacent blocks (what a
fresh allocator hands out, on both sides) are, in one layer, rows ``page_stride`` apart
on the GPU and ``block_stride`` apart on the host, so one strided 2-D copy per layer moves
a run, for a fraction of the queueing time (the driver's time per copy is most of a
job's CPU time).

A plan is layer-major (a load's layer 0 is queued, and can be marked, first) and split
over the copy streams: stream ``s`` moves pages ``bounds[s]:bounds[s+1]`` of the pages
outside runs, and the runs that :meth:`Runs.on` gives it, of every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

Int64Array = npt.NDArray[np.int64]
UInt64Array = npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where the bytes are: the caches' tables and the host pool."""

    layer_bases: tuple[int, ...]  # the address of each layer's table
    page_stride: int  # bytes from one page of a table to the next
    page_bytes: int  # one page of one layer
    gpu_pages: int  # pages per table
    host_base: int  # the pool's address
    num_blocks: int  # blocks in the pool
    block_stride: int  # bytes from one block of the pool to the next

    @property
    def layers(self) -> int:
        return len(self.layer_bases)

    @property
    def block_bytes(self) -> int:
        return self.layers * self.page_bytes

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], pool: torch.Tensor) -> Geometry:
        """The geometry of these caches and this pool (``[block, layer, *page shape]``).
        ValueError where a page of a table is not one contiguous range, or the tables
        differ in shape, dtype or strides."""
        first = caches[0]
        for layer, cache in enumerate(caches):
            if (cache.shape, cache.dtype, cache.stride()) != (
                first.shape, first.dtype, first.stride()
            ):
                raise ValueError(f"kv_caches[{layer}] differs from kv_caches[0] in shape, "
                                 "dtype or strides")
        if not first[0].is_contiguous():
            raise ValueError("a page of kv_caches[0] is not contiguous: the copy engines "
                             "move a page of a layer as one range")
        if tuple(pool.shape[1:]) != (len(caches), *first.shape[1:]):
            raise ValueError(f"the host pool's shape {tuple(pool.shape)} is not "
                             f"[block, {len(caches)}, *{tuple(first.shape[1:])}]")
        if not pool[0].is_contiguous() or pool.stride(0) < pool[0].numel():
            raise ValueError("a block of the host pool is not one contiguous range of its "
                             "own")
        element = first.element_size()
        return cls(
            layer_bases=tuple(cache.data_ptr() for cache in caches),
            page_stride=first.stride(0) * element,
            page_bytes=first[0].numel() * element,
            gpu_pages=int(first.shape[0]),
            host_base=pool.data_ptr(),
            num_blocks=int(pool.shape[0]),
            block_stride=pool.stride(0) * element,
        )


def check_pages(pages: Int64Array, gpu_pages: int, once: bool) -> str | None:
    """Why a task's page ids (as the caller gave them) cannot be copied, or None: an id
    outside ``[0, gpu_pages)`` (it would fault the device), or, where ``once`` (a load
    writes its pages), an id given twice. The messages are the FlexKV store's
    (:meth:`aiokv.copy.fused.FusedPages.page_errors`)."""
    if not len(pages):
        return None
    outside = (pages < 0) | (pages >= gpu_pages)
    if outside.any():
        at = int(np.argmax(outside))
        return f"holds {int(pages[at])}, outside [0, {gpu_pages})"
    if once and len(pages) > 1:
        order = np.argsort(pages, kind="stable")
        ordered = pages[order]
        twice = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(twice):
            return f"holds {int(ordered[twice[0]])} twice; a load writes each page once"
    return None


# Runs of at least this many pages go as 2-D copies. Measured on the H200
# (benchmarks/copy_runs.py, 64 and 128 KiB pages, jobs back to back): runs of 64 moved at
# 96-98% of a raw copy against the batch call's 98-99%, for a tenth of its queueing time;
# runs of 32 at 93-96%, of 8 at 78-87% (a 2-D copy costs the engines microseconds of its
# own), so shorter runs stay in the batch call.
MIN_RUN = 64


@dataclass(frozen=True, slots=True)
class Runs:
    """Strided copies: run ``r`` of layer ``l`` moves ``heights[r]`` rows of ``width``
    bytes from ``srcs[l, r]`` (rows ``src_pitch`` apart) to ``dsts[l, r]`` (rows
    ``dst_pitch`` apart), on stream ``stream_of[r]``."""

    dsts: UInt64Array  # [layers, runs]
    srcs: UInt64Array  # [layers, runs]
    heights: Int64Array  # [runs]
    stream_of: Int64Array  # [runs]
    width: int
    src_pitch: int
    dst_pitch: int

    def on(self, stream: int) -> list[int]:
        """The runs stream ``stream`` moves."""
        return np.flatnonzero(self.stream_of == stream).tolist()


@dataclass(frozen=True, slots=True)
class Plan:
    """``sizes[i]`` bytes from ``srcs[l, i]`` to ``dsts[l, i]`` for each layer ``l`` and
    position ``i`` of the pages outside runs; stream ``s`` takes positions
    ``bounds[s]:bounds[s + 1]`` (maybe none) and its share of ``runs``."""

    dsts: UInt64Array  # [layers, pages outside runs]
    srcs: UInt64Array  # [layers, pages outside runs]
    sizes: UInt64Array  # [pages outside runs]
    bounds: tuple[int, ...]
    runs: Runs | None = None

    def __len__(self) -> int:
        """Copies to queue: one per (page, layer) outside runs, one per (run, layer)."""
        runs = 0 if self.runs is None else int(self.runs.dsts.size)
        return int(self.dsts.size) + runs

    @property
    def streams(self) -> int:
        return len(self.bounds) - 1

    def part(self, layer: int, stream: int) -> tuple[UInt64Array, UInt64Array, UInt64Array]:
        """One batch call's arrays (contiguous views): layer ``layer``, stream ``stream``."""
        lo, hi = self.bounds[stream], self.bounds[stream + 1]
        return self.dsts[layer, lo:hi], self.srcs[layer, lo:hi], self.sizes[lo:hi]


def split(count: int, streams: int) -> tuple[int, ...]:
    """Bounds of ``count`` positions over at most ``streams`` parts, none empty (fewer
    parts than streams for a job of fewer pages)."""
    parts = max(1, min(streams, count))
    return tuple(count * s // parts for s in range(parts + 1))


def find_runs(
    pages: Int64Array, blocks: Int64Array, min_run: int, chunk_starts: Sequence[int] = (0,)
) -> tuple[Int64Array, Int64Array]:
    """(starts, lengths) of the runs of at least ``min_run`` positions where both the page
    and the block go up by one from each position to the next, and no block crosses into
    another pinned chunk (``chunk_starts``: CUDA refuses a copy that spans two host
    registrations)."""
    count = len(pages)
    if count < min_run:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    breaks = (np.diff(pages) != 1) | (np.diff(blocks) != 1)
    if len(chunk_starts) > 1:
        chunk = np.searchsorted(np.asarray(chunk_starts, dtype=np.int64), blocks, "right")
        breaks |= np.diff(chunk) != 0
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, count))
    long = lengths >= min_run
    return starts[long].astype(np.int64), lengths[long].astype(np.int64)


def plan(
    geometry: Geometry, pages: Int64Array, blocks: Int64Array, to_host: bool, streams: int,
    min_run: int | None = MIN_RUN, chunk_starts: Sequence[int] = (0,),
) -> Plan:
    """The copies that move GPU page ``pages[i]`` to (``to_host``) or from host block
    ``blocks[i]``, every layer, split over ``streams``; runs of ``min_run`` or more as
    2-D copies (None: none, one copy per page and layer). Checked pages only
    (:func:`check_pages`); blocks are the store's own. ``chunk_starts``: the blocks where
    the pool's separately pinned chunks start (a run never crosses into another)."""
    if len(pages) != len(blocks):
        raise ValueError(f"{len(pages)} pages but {len(blocks)} blocks")
    g = geometry
    pages = np.asarray(pages, dtype=np.int64)
    blocks = np.asarray(blocks, dtype=np.int64)
    # Each (page, layer) copy lies inside one block (its layer's range of it); the pool's
    # separately pinned chunks begin on block boundaries (hostmem.chunk_bounds), so no
    # copy crosses one (CUDA refuses a copy that spans two host registrations).
    assert g.layers * g.page_bytes == g.block_bytes
    assert not len(blocks) or (int(blocks.min()) >= 0 and int(blocks.max()) < g.num_blocks)
    if min_run is not None:
        starts, lengths = find_runs(pages, blocks, min_run, chunk_starts)
        if len(starts):
            used = max(1, min(streams, len(pages)))
            inside = np.zeros(len(pages), dtype=np.bool_)
            for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
                inside[start : start + length] = True
            runs = _strided(g, pages[starts], blocks[starts], lengths, to_host, used)
            pages, blocks = pages[~inside], blocks[~inside]
            # The pages outside runs over every stream (some maybe none): each has its
            # share of the runs too.
            bounds = tuple(len(pages) * s // used for s in range(used + 1))
            return Plan(*_addresses(g, pages, blocks, to_host), bounds, runs)
    return Plan(*_addresses(g, pages, blocks, to_host), split(len(pages), streams))


def _addresses(
    g: Geometry, pages: Int64Array, blocks: Int64Array, to_host: bool
) -> tuple[UInt64Array, UInt64Array, UInt64Array]:
    """(dsts, srcs, sizes) of one copy per (page, layer)."""
    gpu = np.asarray(g.layer_bases, dtype=np.int64)[:, None] + pages[None, :] * g.page_stride
    host = (g.host_base + blocks * g.block_stride)[None, :] + (
        np.arange(g.layers, dtype=np.int64) * g.page_bytes
    )[:, None]
    dsts, srcs = (host, gpu) if to_host else (gpu, host)
    return (np.ascontiguousarray(dsts).view(np.uint64),
            np.ascontiguousarray(srcs).view(np.uint64),
            np.full(len(pages), g.page_bytes, dtype=np.uint64))


def _strided(
    g: Geometry, pages: Int64Array, blocks: Int64Array, heights: Int64Array,
    to_host: bool, streams: int,
) -> Runs:
    """The 2-D copies of runs starting at ``pages[r]`` / ``blocks[r]``, each given to the
    stream with the fewest rows so far (the single pages are split evenly anyway)."""
    host, gpu, _ = _addresses(g, pages, blocks, to_host=True)
    dsts, srcs = (host, gpu) if to_host else (gpu, host)
    load = np.zeros(streams, dtype=np.int64)
    stream_of = np.empty(len(heights), dtype=np.int64)
    for r, height in enumerate(heights.tolist()):
        stream = int(np.argmin(load))
        stream_of[r] = stream
        load[stream] += height
    src_pitch, dst_pitch = ((g.page_stride, g.block_stride) if to_host
                            else (g.block_stride, g.page_stride))
    return Runs(dsts, srcs, heights, stream_of, g.page_bytes, src_pitch, dst_pitch)
