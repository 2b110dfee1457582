"""CUDA graphs of a copy chunk's per-layer gathers and scatters, and the eager ops they
replace (:mod:`.transfer` runs them on its gather stream)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger("aiokv")


class LayerGraphs:
    """CUDA graphs of one full chunk's per-layer gathers (offload) and scatters (load),
    one of each per staging buffer, so that a chunk costs the copy thread two torch calls
    (its page ids into a fixed index buffer, one replay) instead of one per layer.

    Why: every torch call gives the GIL away and takes it back, and while the loop or the
    store thread runs Python, each take can wait up to a switch interval (5 ms by
    default). With one ``index_select`` per layer, a chunk of an 8-layer cache was 13
    such calls, and the copy engine went idle while the copy thread queued for the GIL.

    Captured once, at construction (before any job), from fixed buffers: ``index[s]``,
    which a replay reads the chunk's page ids from, and staging buffer ``s``. Replays run
    on the gather stream like the eager ops they replace, in the same order; partial
    chunks (a run's tail) still run the eager ops.
    """

    def __init__(
        self,
        index: list[torch.Tensor],
        gathers: list[Any],
        scatters: list[Any],
    ) -> None:
        self._index = index
        self._gathers = gathers
        self._scatters = scatters

    @classmethod
    def capture(
        cls,
        caches: Sequence[torch.Tensor],
        staging: Sequence[torch.Tensor],
        stream: Any,
    ) -> LayerGraphs | None:
        """The graphs, or None (with a warning) where capture fails: the eager ops then
        run every chunk, correct and slower."""
        device = caches[0].device
        chunk_blocks = staging[0].shape[0]
        stages = range(len(staging))
        try:
            with torch.cuda.stream(stream):
                index = [
                    torch.zeros(chunk_blocks, dtype=torch.int64, device=device) for _ in staging
                ]
                # Capture records kernels without running them, and cannot load them: run
                # each op once first. Gathers read page 0 into staging; scatters go to a
                # scratch page, never into the caches (their pages may be live).
                scratch = torch.empty(
                    (1, *caches[0].shape[1:]), dtype=caches[0].dtype, device=device
                )
                gather_layers(caches, index[0], staging[0])
                scatter_layers([scratch] * len(caches), index[0][:1], staging[0][:1])
                stream.synchronize()
                gathers = [
                    _capture(functools.partial(gather_layers, caches, index[s], staging[s]))
                    for s in stages
                ]
                scatters = [
                    _capture(functools.partial(scatter_layers, caches, index[s], staging[s]))
                    for s in stages
                ]
        except Exception:
            log.warning(
                "aiokv: capturing the per-layer copy graphs failed; each chunk runs one "
                "op per layer instead (slower under GIL contention)",
                exc_info=True,
            )
            return None
        return cls(index, gathers, scatters)

    def gather(self, stage: int, pages: torch.Tensor) -> None:
        """Enqueue, on the current stream, staging[stage][i, layer] = cache[layer][pages[i]]."""
        self._replay(self._gathers, stage, pages)

    def scatter(self, stage: int, pages: torch.Tensor) -> None:
        """Enqueue, on the current stream, cache[layer][pages[i]] = staging[stage][i, layer]."""
        self._replay(self._scatters, stage, pages)

    def _replay(self, graphs: list[Any], stage: int, pages: torch.Tensor) -> None:
        self._index[stage].copy_(pages, non_blocking=True)
        graphs[stage].replay()


def gather_layers(
    caches: Sequence[torch.Tensor], pages: torch.Tensor, blocks: torch.Tensor
) -> None:
    """``blocks[i, layer] = caches[layer][pages[i]]``: one op per layer."""
    for layer, cache in enumerate(caches):
        torch.index_select(cache, 0, pages, out=blocks[:, layer])


def scatter_layers(
    caches: Sequence[torch.Tensor], pages: torch.Tensor, blocks: torch.Tensor
) -> None:
    """``caches[layer][pages[i]] = blocks[i, layer]``: one op per layer."""
    for layer, cache in enumerate(caches):
        cache.index_copy_(0, pages, blocks[:, layer])


def _capture(ops: Callable[[], None]) -> Any:
    """A CUDA graph of ``ops`` captured on the current stream. Thread-local mode: other
    threads (the event loop's kernels, the store thread) may use CUDA meanwhile."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    try:
        ops()
    finally:
        graph.capture_end()
    return graph
