"""A copy job's page ids, brought to the host (the copier's waits A and B).

The copies are planned on the host, so the callers' page ids, where they are device
tensors, come over first, on one high-priority stream of their own (the ids stream),
after the callers' ready events. Two ways:

- **the copy engines** (``cuMemcpyBatchAsync``, one copy per task, no kernel) while no
  offload is in flight: the quickest way then, and it takes no SM from the model (a
  kernel waits for the thread blocks of a model that queued all its work, which costs the
  copies beside that model: ``aiokv bench model``);
- **a kernel** (:func:`~.fused.fuse_page_ids`, the FlexKV launch's way: one concat and
  one cast that writes straight into pinned host memory, which the GPU sees through
  unified addressing) while offloads are in flight (:class:`OffloadsInFlight`, shared by
  a store's copiers): the copy engines run the device-to-host copies they were given in
  order, so ids copied by them would wait for every offload byte queued before them, a
  whole job or more, and so would the job, a load's too (``benchmarks/ids_wait.py``,
  ``benchmarks/behind_a_stream.py``). On a high-priority stream the kernels, a few thread
  blocks, wait only for running thread blocks to end.

The thread then waits for the ids stream (wait B; the wait releases the GIL) and reads
them. Where a job's ids are not all device tensors, the copy engines bring them (and
:mod:`.fused` copies too where kernels cannot write pinned memory).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .driver import BatchCopy
from .fused import fuse_page_ids, warm_up
from .plan import Int64Array

# Highest priority torch gives a stream (lower is higher): the kernel's thread blocks go
# before those of a model's queued kernels.
_HIGH_PRIORITY = -1


def as_numpy(pages: torch.Tensor | Int64Array) -> Int64Array:
    if isinstance(pages, torch.Tensor):
        return pages.numpy().astype(np.int64, copy=False)
    return np.asarray(pages, dtype=np.int64)


def concat(parts: Sequence[Int64Array]) -> Int64Array:
    """The parts as one new int64 array (never a view of a part)."""
    if not parts:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64, copy=False)


class OffloadsInFlight:
    """Offload jobs queued on the device and not yet ended, counted across the copiers
    that share this (a store's: one copier per direction): while any is, the
    device-to-host copy engines hold their bytes. Copy and done threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self, count: int) -> None:
        with self._lock:
            self._count += count

    def __bool__(self) -> bool:
        return self._count > 0


class PageIds:
    """The copy thread's way to the host for page ids (made and used on that thread,
    with the device's context current)."""

    def __init__(self, device: torch.device, batch: BatchCopy | None) -> None:
        self.stream = torch.cuda.Stream(device, priority=_HIGH_PRIORITY)  # type: ignore[no-untyped-call]
        self._batch = batch  # None: the driver lacks the batch call, torch copies instead
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the copy engines' (pinned)
        # The kernels' modules loaded now: CUDA loads them lazily, at first use, which
        # would be a job's, behind a stream of offloads.
        warm_up(device, 0, self.stream)
        self.fetches = 0  # jobs whose ids came from the device
        self.by_kernel = 0  # of them, by fuse_page_ids (the kernel way)

    def fetch(
        self, pages: Sequence[torch.Tensor | Int64Array], ready: Sequence[Any],
        engines_busy: bool,
    ) -> Int64Array:
        """Every task's ids, in order, as one int64 array of its own, once the ids stream
        waited for ``ready``. ``engines_busy``: offloads are in flight."""
        for event in ready:
            if event is not None:
                self.stream.wait_event(event)
        on_device = [p for p in pages if isinstance(p, torch.Tensor) and p.is_cuda]
        if not on_device:
            return concat([as_numpy(p) for p in pages])
        self.fetches += 1
        if engines_busy and len(on_device) == len(pages):
            self.by_kernel += 1
            # Fresh pinned memory each time (held until the kernel's event fired); the
            # wait releases the GIL (wait B).
            ids: Int64Array = fuse_page_ids([p.reshape(-1) for p in on_device],
                                            self.stream).wait()
            return ids
        return self._by_engines(pages, on_device)

    def _by_engines(
        self, pages: Sequence[torch.Tensor | Int64Array], on_device: list[torch.Tensor]
    ) -> Int64Array:
        """One copy per task in the caller's dtype, each task 8-byte aligned in the buffer."""
        sizes = np.array([p.numel() * p.element_size() for p in on_device], dtype=np.uint64)
        offsets = np.zeros(len(sizes), dtype=np.uint64)  # uint64 throughout (addresses)
        offsets[1:] = np.cumsum((sizes[:-1] + np.uint64(7)) // np.uint64(8) * np.uint64(8))
        total = int(offsets[-1] + sizes[-1])
        if len(self._buffer) < total:
            self._buffer = torch.empty(max(total, 2 * len(self._buffer)), dtype=torch.uint8,
                                       pin_memory=True)
        buffer = self._buffer
        if self._batch is not None and all(p.is_contiguous() for p in on_device):
            srcs = np.array([p.data_ptr() for p in on_device], dtype=np.uint64)
            some = sizes > 0  # a copy of 0 bytes is not one the driver takes
            dsts = offsets[some] + np.uint64(buffer.data_ptr())
            self._batch(dsts, srcs[some], sizes[some], self.stream.cuda_stream)
        else:  # an old driver, or strided ids: a torch copy each (the same engines)
            with torch.cuda.stream(self.stream):
                for p, at, size in zip(on_device, offsets.tolist(), sizes.tolist(), strict=True):
                    buffer[at : at + size].view(p.dtype).copy_(p, non_blocking=True)
        self.stream.synchronize()  # wait B; releases the GIL while it waits
        raw = buffer.numpy()
        parts: list[Int64Array] = []
        device_ids = iter(zip(on_device, offsets.tolist(), strict=True))
        for task in pages:
            if isinstance(task, torch.Tensor) and task.is_cuda:
                p, at = next(device_ids)
                dtype = np.int32 if p.dtype is torch.int32 else np.int64
                parts.append(np.frombuffer(raw, dtype=dtype, count=p.numel(), offset=at))
            else:
                parts.append(as_numpy(task))
        return concat(parts)  # a copy: the buffer is the next job's

