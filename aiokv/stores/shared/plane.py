"""An engine's copies between its caches and the shared region, on the embedded store's
data plane (:class:`~aiokv.copy.copier.Copier`): on a GPU the copy engines
(``cuMemcpyBatchAsync``, one copier per direction so that offloads and loads in flight
together do not queue behind each other), on the CPU torch index ops; the same page-id
checks (a bad task fails alone, with the embedded store's message) and per-layer marks
for loads.

One plane per mapping of the region (a reconnect maps a new one, at another address, so
it gets a new plane). On a GPU the copy engines must only touch pinned memory: the
region is pinned in chunks in the background (:class:`~.region.Pinning`), and a job
waits (on the store thread, as the embedded store's pool waits for its next chunk) until
its blocks are in the pinned prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...copy.copier import Caller, Copier, CopyJob
from ...copy.ids import OffloadsInFlight
from ...copy.marks import LayerMarks
from ..base import Int64Array
from .region import Pinning, Populating, Region


class RegionPlane:
    def __init__(self, caches: Sequence[torch.Tensor], region: Region,
                 done: Callable[[CopyJob], None]) -> None:
        self.region = region
        gpu = caches[0].device.type == "cuda"
        self.pinning = Pinning(region) if gpu else None
        # Pinning maps the pages itself.
        self.populating = Populating(region) if not gpu else None
        names = ("aiokv-shared-out", "aiokv-shared-in") if gpu else ("aiokv-shared-copy",)
        starts = self.pinning.chunk_starts.tolist() if self.pinning is not None else [0]
        offloads = OffloadsInFlight()  # each copier knows of the other's (copy.ids)
        self._copiers = [Copier(caches, region.data, done, name=n, chunk_starts=starts,
                                offloads=offloads) for n in names]
        self._closed = False

    def unpinned(self, blocks: Int64Array) -> str | None:
        """Why these blocks cannot be copied (None: they are pinned, or need not be).
        Waits while the region is still being pinned up to them."""
        if self.pinning is None or not len(blocks):
            return None
        need = int(blocks.max()) + 1
        if self.pinning.wait_for(need):
            return None
        return (f"region block {need - 1} is not pinned (pinning stopped at block "
                f"{self.pinning.ready_blocks}: {self.pinning.error!r})")

    def submit(self, to_region: bool, task_ids: list[int], pages: list[Any],
               blocks: Int64Array, ready: Sequence[Any],
               marks: Sequence[LayerMarks | None], callers: Sequence[Caller] = ()) -> None:
        """One job of these tasks' copies (one segment per task); ``callers``: an
        offload's tasks, whose detached callers' copies count for nothing (CopyJob)."""
        events = {id(e): e for e in ready if e is not None}  # a batch's callers share some
        job = CopyJob(to_host=to_region, pages=pages, blocks=blocks, names=task_ids,
                      ready=list(events.values()), marks=marks, callers=callers)
        (self._copiers[0] if to_region else self._copiers[-1]).submit(job)

    @property
    def d2h_copies(self) -> int:
        return sum(c.d2h_copies for c in self._copiers)

    def close(self) -> None:
        """Stop filling the page tables, finish the queued copies (each reported), then
        unpin; once. No thread of the plane runs on after it."""
        if self._closed:
            return
        self._closed = True
        if self.populating is not None:
            self.populating.close()
        for copier in self._copiers:
            copier.close()
        if self.pinning is not None:
            self.pinning.close()
