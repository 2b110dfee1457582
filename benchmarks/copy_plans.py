"""A batch of pages as copies: where each (page, layer) lives on the GPU and in the host
pool, and the runs that can move as one copy. Pure numpy, no device: the mechanisms of
``copy_mechanisms.py`` turn these (destination, source, size) triples into copy calls or
a kernel's table, and the tests check the arithmetic on the CPU with memmove.

Layouts. The GPU caches are one tensor per layer, ``[page, 2, page_size, heads,
head_dim]``: a page of a layer is ``page_bytes`` contiguous bytes at ``layer_base +
page * page_bytes``. The host pool is either ``block``-major, ``[block, layer, ...]``
(aiokv's pool today: all layers of a block contiguous, as the SSD tier wants), or
``layer``-major, ``[layer, block, ...]``. Pages ``p, p+1`` going to blocks ``b, b+1``
are one contiguous run on both sides only in the layer-major pool (in the block-major
one, the next block's bytes of a layer are ``layers * page_bytes`` further on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUTS = ("block", "layer")


@dataclass(frozen=True)
class Geometry:
    layers: int
    page_bytes: int  # one page of one layer
    num_blocks: int  # blocks in the host pool
    layout: str  # "block" or "layer"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def coalesces(self) -> bool:
        """Whether adjacent blocks of a layer are adjacent in the pool."""
        return self.layout == "layer" or self.layers == 1

    def host_offsets(self, blocks: np.ndarray, layer: int) -> np.ndarray:
        """Byte offsets in the pool of ``blocks``' bytes of ``layer``."""
        blocks = blocks.astype(np.int64)
        if self.layout == "block":
            return (blocks * self.layers + layer) * self.page_bytes
        return (layer * self.num_blocks + blocks) * self.page_bytes


@dataclass(frozen=True)
class Plan:
    """One copy per entry: ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (uint64)."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


def runs(pages: np.ndarray, blocks: np.ndarray, coalesce: bool) -> tuple[np.ndarray, np.ndarray]:
    """(start positions, lengths) of the runs where pages and blocks both step by one;
    every position its own run where ``coalesce`` is False."""
    n = len(pages)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if not coalesce:
        return np.arange(n, dtype=np.int64), np.ones(n, np.int64)
    pages = pages.astype(np.int64)
    blocks = blocks.astype(np.int64)
    breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(blocks) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [n]))).astype(np.int64)
    return starts, lengths


def plan(
    geometry: Geometry,
    pages: np.ndarray,
    blocks: np.ndarray,
    layer_bases: list[int],
    host_base: int,
    to_host: bool,
) -> Plan:
    """The copies that move ``pages[i]`` (GPU) to or from ``blocks[i]`` (host), layer by
    layer, each run of adjacent pages and blocks as one copy where the layout allows."""
    if len(pages) != len(blocks):
        raise ValueError(f"{len(pages)} pages but {len(blocks)} blocks")
    if len(layer_bases) != geometry.layers:
        raise ValueError(f"{len(layer_bases)} layer bases for {geometry.layers} layers")
    starts, lengths = runs(pages, blocks, geometry.coalesces)
    first_pages = pages[starts].astype(np.int64)
    first_blocks = blocks[starts].astype(np.int64)
    gpu = np.concatenate(
        [base + first_pages * geometry.page_bytes for base in layer_bases]
    )
    host = np.concatenate(
        [host_base + geometry.host_offsets(first_blocks, layer) for layer in range(geometry.layers)]
    )
    sizes = np.tile(lengths * geometry.page_bytes, geometry.layers)
    dsts, srcs = (host, gpu) if to_host else (gpu, host)
    return Plan(dsts.astype(np.uint64), srcs.astype(np.uint64), sizes.astype(np.uint64))


def check_aligned(plan_: Plan, alignment: int) -> None:
    """Raise ValueError unless every address and size is a multiple of ``alignment``
    (a kernel moving 16-byte vectors needs it)."""
    for name in ("dsts", "srcs", "sizes"):
        values = getattr(plan_, name)
        bad = np.flatnonzero(values % np.uint64(alignment))
        if len(bad):
            raise ValueError(
                f"{name}[{int(bad[0])}] = {int(values[bad[0]])} is not a multiple of {alignment}"
            )
