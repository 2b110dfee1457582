"""The copy thread, ``aiokv-copy``: moves pages between the GPU caches and the host pool.

``launch`` only queues a :class:`CopyJob`; this thread runs it and reports completion.
On a GPU, a job is cut into chunks of consecutive host blocks; each chunk is gathered
from the scattered GPU pages into a staging buffer on one stream, and moved with one
large copy on a second stream, two buffers deep, so gathers overlap copies and the copy
engine sees few, large transfers. Loads run the same pipeline in reverse (copy in,
then scatter). On the CPU the same chunks are gathered and scattered with torch ops.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..base import Int64Array
from .pool import HostPool

log = logging.getLogger("aiokv")

STAGING_BYTES = 128 << 20  # per staging buffer; two are allocated on the GPU


@dataclass
class CopyJob:
    """Pages to move: ``gpu_pages[i]`` <-> ``host_blocks[i]``. ``to_host``: an offload."""

    task_ids: list[int]
    to_host: bool
    gpu_pages: Int64Array
    host_blocks: Int64Array
    error: str | None = field(default=None)


def contiguous_runs(host_blocks: Int64Array, max_len: int) -> list[tuple[int, int]]:
    """Split positions ``[0, n)`` into (start, end) ranges whose host blocks are
    consecutive and at most ``max_len`` long. ``host_blocks`` must be in job order."""
    n = len(host_blocks)
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(host_blocks) != 1) + 1
    bounds = np.concatenate(([0], breaks, [n]))
    runs = []
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        for chunk in range(start, end, max_len):
            runs.append((chunk, min(chunk + max_len, end)))
    return runs


class Transfer:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        pool: HostPool,
        on_done: Callable[[CopyJob], None],
    ) -> None:
        self._caches = list(kv_caches)
        self._pool = pool
        self._on_done = on_done
        self._device = self._caches[0].device
        block_bytes = pool.data[0].numel() * pool.data.element_size()
        self._chunk_blocks = max(1, STAGING_BYTES // block_bytes)
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        if self._device.type == "cuda":
            shape = (self._chunk_blocks, *pool.data.shape[1:])
            self._staging = [
                torch.empty(shape, dtype=pool.data.dtype, device=self._device) for _ in range(2)
            ]
            # Gathers/scatters on one stream, host <-> device copies on the other.
            self._gpu_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            self._copy_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, name="aiokv-copy", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._device.type == "cuda":
                    self._run_cuda(job)
                else:
                    self._run_cpu(job)
            except Exception as exc:  # reported as a FAILED task, never lost
                log.exception("aiokv copy job failed")
                job.error = repr(exc)
            self._on_done(job)

    def _run_cpu(self, job: CopyJob) -> None:
        pool = self._pool.data
        pages = torch.from_numpy(job.gpu_pages)
        for start, end in contiguous_runs(job.host_blocks, self._chunk_blocks):
            first = int(job.host_blocks[start])
            host = pool[first : first + end - start]
            run_pages = pages[start:end]
            for layer, cache in enumerate(self._caches):
                if job.to_host:
                    torch.index_select(cache, 0, run_pages, out=host[:, layer])
                else:
                    cache.index_copy_(0, run_pages, host[:, layer])

    def _run_cuda(self, job: CopyJob) -> None:
        pool = self._pool.data
        pages = torch.from_numpy(job.gpu_pages).to(self._device)
        gpu, copy = self._gpu_stream, self._copy_stream
        # Stage i is free again once this event (recorded by its last user) fires.
        free: list[torch.cuda.Event | None] = [None, None]
        gpu.wait_stream(torch.cuda.current_stream(self._device))  # `pages` H2D copy
        for i, (start, end) in enumerate(contiguous_runs(job.host_blocks, self._chunk_blocks)):
            stage = self._staging[i % 2][: end - start]
            first = int(job.host_blocks[start])
            host = pool[first : first + end - start]
            run_pages = pages[start:end]
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            if job.to_host:
                with torch.cuda.stream(gpu):
                    if (previous := free[i % 2]) is not None:
                        gpu.wait_event(previous)
                    for layer, cache in enumerate(self._caches):
                        torch.index_select(cache, 0, run_pages, out=stage[:, layer])
                    ready.record(gpu)
                with torch.cuda.stream(copy):
                    copy.wait_event(ready)
                    host.copy_(stage, non_blocking=True)
                    done.record(copy)
            else:
                with torch.cuda.stream(copy):
                    if (previous := free[i % 2]) is not None:
                        copy.wait_event(previous)
                    stage.copy_(host, non_blocking=True)
                    ready.record(copy)
                with torch.cuda.stream(gpu):
                    gpu.wait_event(ready)
                    for layer, cache in enumerate(self._caches):
                        cache.index_copy_(0, run_pages, stage[:, layer])
                    done.record(gpu)
            free[i % 2] = done
        copy.synchronize()
        gpu.synchronize()
