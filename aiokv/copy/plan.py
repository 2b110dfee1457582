"""Copy plans: a job's page ids and host blocks as one copy per (page, layer), with the
checks a caller's page ids must pass first. Pure numpy, no device, so that the tests can
move the planned bytes with memmove and compare them with torch's indexing.

Layouts. The caches are one table per layer, ``[page, 2, page_size, heads, head_dim]``:
a page of a layer is ``page_bytes`` contiguous bytes at ``layer_base + page *
page_stride``. The host pool is ``[block, layer, ...]``: all layers of a block are
contiguous (the SSD tier moves a block as one range), layer ``l`` of block ``b`` at
``host_base + b * block_bytes + l * page_bytes``. Copies go page by page (the copy engines
take thousands of them in one batch call at full speed; no run is coalesced, because a
block's layers are not adjacent to the next block's).

A plan is layer-major (a load's layer 0 is queued, and can be marked, first) and split
over the copy streams: stream ``s`` moves pages ``bounds[s]:bounds[s+1]`` of every layer.
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
        if not pool.is_contiguous() or tuple(pool.shape[1:]) != (len(caches), *first.shape[1:]):
            raise ValueError(f"the host pool's shape {tuple(pool.shape)} is not "
                             f"[block, {len(caches)}, *{tuple(first.shape[1:])}]")
        element = first.element_size()
        return cls(
            layer_bases=tuple(cache.data_ptr() for cache in caches),
            page_stride=first.stride(0) * element,
            page_bytes=first[0].numel() * element,
            gpu_pages=int(first.shape[0]),
            host_base=pool.data_ptr(),
            num_blocks=int(pool.shape[0]),
        )


def check_pages(pages: Int64Array, gpu_pages: int, once: bool) -> str | None:
    """Why a task's page ids (as the caller gave them) cannot be copied, or None: an id
    outside ``[0, gpu_pages)`` (it would fault the device), or, where ``once`` (a load
    writes its pages), an id given twice. The messages are the FlexKV store's
    (:meth:`aiokv.stores.fused.FusedPages.page_errors`)."""
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


@dataclass(frozen=True, slots=True)
class Plan:
    """``sizes[i]`` bytes from ``srcs[l, i]`` to ``dsts[l, i]`` for each layer ``l`` and
    page position ``i``; stream ``s`` takes positions ``bounds[s]:bounds[s + 1]``."""

    dsts: UInt64Array  # [layers, pages]
    srcs: UInt64Array  # [layers, pages]
    sizes: UInt64Array  # [pages]
    bounds: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.dsts.size)

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


def plan(
    geometry: Geometry, pages: Int64Array, blocks: Int64Array, to_host: bool, streams: int
) -> Plan:
    """The copies that move GPU page ``pages[i]`` to (``to_host``) or from host block
    ``blocks[i]``, every layer, split over ``streams``. Checked pages only
    (:func:`check_pages`); blocks are the store's own."""
    if len(pages) != len(blocks):
        raise ValueError(f"{len(pages)} pages but {len(blocks)} blocks")
    g = geometry
    blocks = np.asarray(blocks, dtype=np.int64)
    # Each (page, layer) copy lies inside one block (its layer's range of it); the pool's
    # separately pinned chunks begin on block boundaries (hostmem.chunk_bounds), so no
    # copy crosses one (CUDA refuses a copy that spans two host registrations).
    assert g.layers * g.page_bytes == g.block_bytes
    assert not len(blocks) or (int(blocks.min()) >= 0 and int(blocks.max()) < g.num_blocks)
    gpu = (np.asarray(g.layer_bases, dtype=np.int64)[:, None]
           + np.asarray(pages, dtype=np.int64)[None, :] * g.page_stride)
    host = (g.host_base + blocks * g.block_bytes)[None, :] + (
        np.arange(g.layers, dtype=np.int64) * g.page_bytes
    )[:, None]
    dsts, srcs = (host, gpu) if to_host else (gpu, host)
    sizes = np.full(len(pages), g.page_bytes, dtype=np.uint64)
    return Plan(
        np.ascontiguousarray(dsts).view(np.uint64),
        np.ascontiguousarray(srcs).view(np.uint64),
        sizes,
        split(len(pages), streams),
    )
