"""An engine's copies between its caches and the shared region, on a thread of its own
(``aiokv-shared-copy``): a job names cache pages and region blocks; its end (or error)
is reported through a callback, so the store thread never waits on a copy.

CPU caches: torch index ops, one gather and one scatter per job (a put gathers every
layer's pages into one ``[n, layer, ...]`` tensor and scatters it into the blocks in
one ``index_copy_``; a load the reverse, layer by layer). GPU caches: the same ops
through ``.to(device)``, correct but not the data plane the region is for; the
copy-engine copier (:mod:`aiokv.copy`) plugs in here, over the region's pool-like
object (:class:`PoolView`: the block tensor and the prefix pinned so far).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .region import Pinning, Region

log = logging.getLogger("aiokv")


@dataclass(frozen=True, slots=True)
class PoolView:
    """What a copier needs of the region: ``data`` (``[block, layer, k/v, token, head,
    dim]``), where separately pinned chunks start (no copy may cross one), and how many
    leading blocks are pinned (all of them for CPU caches, which need none)."""

    region: Region
    pinning: Pinning | None

    @property
    def data(self) -> torch.Tensor:
        return self.region.data

    @property
    def ready_blocks(self) -> int:
        return self.region.num_blocks if self.pinning is None else self.pinning.ready_blocks


@dataclass(slots=True, eq=False)
class Job:
    """Copies of one launch's tasks in one direction."""

    to_region: bool
    pool: PoolView
    pages: torch.Tensor  # cache page ids (int64, CPU), all tasks' joined
    blocks: torch.Tensor  # region blocks, one per page
    task_ids: list[int]
    ready: list[object] = field(default_factory=list)  # CUDA events to wait for first
    error: str | None = None


class RegionCopier:
    def __init__(self, kv_caches: Sequence[torch.Tensor], done: Callable[[Job], None]) -> None:
        self._caches = list(kv_caches)
        self._done = done
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="aiokv-shared-copy",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Finish the queued jobs, then stop."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                for event in job.ready:
                    event.synchronize()  # type: ignore[attr-defined]
                self._copy(job)
            except Exception as exc:  # the job's tasks fail with it; the thread goes on
                log.exception("aiokv: a copy to or from the shared region failed")
                job.error = f"copy failed: {type(exc).__name__}: {exc}"
            self._done(job)

    def _copy(self, job: Job) -> None:
        if not len(job.pages):
            return
        data, caches = job.pool.data, self._caches
        device = caches[0].device
        pages = job.pages.to(device)
        if job.to_region:
            stacked = torch.stack([cache.index_select(0, pages) for cache in caches], dim=1)
            data.index_copy_(0, job.blocks, stacked.to("cpu"))
            return
        got = data.index_select(0, job.blocks)  # layers in order: one gather for all
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, pages, got[:, layer].to(device, non_blocking=False))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
