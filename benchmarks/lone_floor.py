"""The least a lone batch costs in aiokv's design, measured beside the engine's lone batch.

    python benchmarks/lone_batch.py --floor     (needs a CUDA GPU)

A lone batch's time beyond its raw copy has parts that no engine of this shape avoids:
the callers' submits on the loop, one hand-off to a thread that may call CUDA, that
thread's first CUDA calls after a pause, the gathers (offload) or scatters (load) that
scattered pages need, the wait for the last copy and the hand-back to the loop. The
floor pipeline here does exactly those and nothing else: each caller's call is a future
appended to a list; the last one hands the batch to a thread, which concatenates the
device page ids (one call), queues each chunk of 128 MiB as one CUDA graph replay of its
per-layer gathers and one pinned copy, two staging buffers deep on two streams (as the
embedded store does), waits for the last event and posts one callback that resolves
every future. No validation, no match, no plan, no slot mapping on the host, no copy
thread of its own, no checks: a bound from below for the engine, not a design.

The host side is one pinned buffer with the batch's blocks in order, so every run of
host blocks is one copy; the engine's blocks come from its pool and may be cut at its
pinned chunks, which the floor never is.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from aiokv.stores.local.graphs import LayerGraphs, gather_layers, scatter_layers
from aiokv.stores.local.transfer import STAGING_BYTES

_Item = tuple[asyncio.AbstractEventLoop, list["asyncio.Future[None]"], list[torch.Tensor], bool]


class FloorPipeline:
    """A lone batch's least work, on a thread of its own (see the module docstring)."""

    def __init__(self, caches: Sequence[torch.Tensor], max_blocks: int) -> None:
        self._caches = list(caches)
        device = self._caches[0].device
        block_shape = (len(caches), *caches[0].shape[1:])
        block_bytes = caches[0][0].numel() * caches[0].element_size() * len(caches)
        self._chunk = max(1, STAGING_BYTES // block_bytes)
        self.host = torch.empty((max_blocks, *block_shape), dtype=caches[0].dtype,
                                pin_memory=True)
        self._staging = [torch.empty((self._chunk, *block_shape), dtype=caches[0].dtype,
                                     device=device) for _ in range(2)]
        self._gpu = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._copy = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(device)
        self._graphs = LayerGraphs.capture(self._caches, self._staging, self._gpu)
        self._items: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="floor", daemon=True)
        self._thread.start()

    async def call(self, batch: list[Any], users: int, page_ids: torch.Tensor,
                   to_host: bool) -> None:
        """One caller's call: its future joins the batch; the last caller hands it over."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        batch.append((future, page_ids))
        if len(batch) == users:
            self._items.put((loop, [f for f, _ in batch], [p for _, p in batch], to_host))
        await future

    def close(self) -> None:
        self._items.put(None)
        self._thread.join()

    def _run(self) -> None:
        torch.cuda.set_stream(self._gpu)
        while (item := self._items.get()) is not None:
            loop, futures, page_ids, to_host = item
            self._move(torch.cat(page_ids), to_host).synchronize()
            loop.call_soon_threadsafe(_resolve, futures)

    def _move(self, pages: torch.Tensor, to_host: bool) -> Any:
        gpu, copy = self._gpu, self._copy
        free_after: list[Any] = [None, None]
        for n, start in enumerate(range(0, pages.numel(), self._chunk)):
            end = min(start + self._chunk, pages.numel())
            which = n % 2
            stage, host = self._staging[which][: end - start], self.host[start:end]
            graphs = self._graphs if end - start == self._chunk else None
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            if to_host:
                if free_after[which] is not None:
                    gpu.wait_event(free_after[which])
                if graphs is not None:
                    graphs.gather(which, pages[start:end])
                else:
                    gather_layers(self._caches, pages[start:end], stage)
                ready.record(gpu)
                copy.wait_event(ready)
                torch.cuda.set_stream(copy)
                host.copy_(stage, non_blocking=True)
                torch.cuda.set_stream(gpu)
                done.record(copy)
            else:
                if free_after[which] is not None:
                    copy.wait_event(free_after[which])
                torch.cuda.set_stream(copy)
                stage.copy_(host, non_blocking=True)
                torch.cuda.set_stream(gpu)
                ready.record(copy)
                gpu.wait_event(ready)
                if graphs is not None:
                    graphs.scatter(which, pages[start:end])
                else:
                    scatter_layers(self._caches, pages[start:end], stage)
                done.record(gpu)
            free_after[which] = done
        last = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        last.record(copy if to_host else gpu)
        return last


def _resolve(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
