"""Fused slot mapping: one concat, one device-to-host copy, one vectorized expansion.

The batcher calls :func:`fuse_page_ids` on the event loop: it concatenates the page ids of
every request in a batch on their device and starts one non-blocking copy into pinned
host memory; offsets come from shapes, so nothing waits for the GPU. The store thread
then waits for the copy (:meth:`FusedPages.wait`), checks every page id at once
(:meth:`FusedPages.bad_requests`) and expands pages to slots once
(:meth:`FusedPages.expand`); :func:`select_slots` picks one request's positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .stores.base import BoolArray, Int64Array


@dataclass
class FusedPages:
    """Page ids of one batch on the host; request ``i`` owns
    ``pages[starts[i]:starts[i] + counts[i]]``."""

    host: torch.Tensor  # int64, CPU (pinned when it came from a GPU)
    starts: Int64Array
    counts: Int64Array
    copy_done: Any  # torch.cuda.Event, or None when no device copy was needed
    d2h_copies: int
    expanded_page_size: int = 0  # > 0: `host` holds slots expanded on the device
    host_tail: torch.Tensor | None = None  # CPU-held page ids that follow the copied ones

    def wait(self) -> Int64Array:
        """Block (store thread only) until the copy landed; return the pages as numpy."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
        host: Int64Array = self.host.numpy()
        if self.expanded_page_size:
            return host[:: self.expanded_page_size] // self.expanded_page_size
        if self.host_tail is not None:
            return np.concatenate((host, self.host_tail.numpy()))
        return host

    def bad_requests(self, pages: Int64Array, num_pages: int) -> Int64Array:
        """Indexes of requests holding a page id < 0 or >= num_pages (vectorized)."""
        bad = (pages < 0) | (pages >= num_pages)
        if not bad.any():
            return np.empty(0, dtype=np.int64)
        running = np.concatenate(([0], np.cumsum(bad, dtype=np.int64)))
        per_request = running[self.starts + self.counts] - running[self.starts]
        return np.flatnonzero(per_request)

    def expand(self, pages: Int64Array, page_size: int) -> Int64Array:
        """Slots of every page: ``page * page_size + offset``, one op for the batch."""
        if self.expanded_page_size:
            if page_size != self.expanded_page_size:
                raise ValueError(f"slots were expanded for page size {self.expanded_page_size}")
            slots: Int64Array = self.host.numpy()
            return slots
        offsets = np.arange(page_size, dtype=np.int64)
        return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)

    def request_slots(self, slots: Int64Array, index: int, page_size: int) -> Int64Array:
        """Request ``index``'s slots, a view into ``slots``."""
        start = int(self.starts[index]) * page_size
        return slots[start : start + int(self.counts[index]) * page_size]


def select_slots(
    request_slots: Int64Array, mask: BoolArray, count: int | None = None
) -> Int64Array:
    """The slots of exactly the True positions of ``mask`` (a view when they are one
    contiguous run, as store masks are: a suffix for puts, a prefix for gets)."""
    first = int(mask.argmax())  # argmax + counts: cheaper than flatnonzero per request
    if not mask[first]:
        return request_slots[:0]
    if count is None:
        count = int(np.count_nonzero(mask))
    end = first + count
    if end <= len(mask) and np.count_nonzero(mask[first:end]) == count:
        if end > len(request_slots):
            raise IndexError(f"mask position {end - 1} is past the {len(request_slots)} slots")
        return request_slots[first:end]
    positions = np.flatnonzero(mask)
    if positions[-1] >= len(request_slots):
        raise IndexError(f"mask position {positions[-1]} is past the {len(request_slots)} slots")
    return request_slots[positions]


def fuse_page_ids(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    stream: Any = None,
    page_size: int = 0,
) -> FusedPages:
    """Concatenate the leading ``pages_used[i]`` of each ``page_ids[i]`` and bring them to
    the host with at most one device-to-host copy.

    Device tensors are concatenated on ``stream`` (a torch.cuda.Stream the caller made
    wait for the requests' events) and copied into pinned memory without blocking; CPU
    tensors are concatenated on the host. The result lists device-resident requests
    first, so ``starts`` is not in request order. Given ``page_size``, a batch held on
    the device is also expanded to slots there (one tiny kernel instead of a host pass
    over every slot), and the slots are what the one copy brings back.
    """
    counts = np.asarray(pages_used, dtype=np.int64)
    on_device = [i for i, t in enumerate(page_ids) if t.device.type != "cpu"]
    on_host = [i for i, t in enumerate(page_ids) if t.device.type == "cpu"]
    order = on_device + on_host
    starts = np.zeros(len(page_ids), dtype=np.int64)
    ordered_counts = counts[order]
    starts[order] = np.concatenate(([0], np.cumsum(ordered_counts)[:-1])) if order else []

    parts: list[torch.Tensor] = []
    copy_done = None
    d2h_copies = 0
    if on_device:
        device_parts = [_head(page_ids[i], pages_used[i]) for i in on_device]
        total = int(counts[on_device].sum())
        expand_here = page_size > 0 and not on_host
        pinned = torch.empty(
            total * page_size if expand_here else total, dtype=torch.int64, pin_memory=True
        )
        with torch.cuda.stream(stream):
            fused = torch.cat(device_parts).to(torch.int64)
            if expand_here:
                offsets = torch.arange(page_size, dtype=torch.int64, device=fused.device)
                fused = (fused[:, None] * page_size + offsets).reshape(-1)
            pinned.copy_(fused, non_blocking=True)
            copy_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copy_done.record()
            # `fused` was allocated on `stream` and is only used there, so the caching
            # allocator will not reuse it before the copy ends. The callers' page_ids
            # stay referenced by their requests until those resolve.
        if expand_here:
            return FusedPages(pinned, starts, counts, copy_done, 1, expanded_page_size=page_size)
        parts.append(pinned)
        d2h_copies = 1
    if on_host:
        host_parts = [_head(page_ids[i], pages_used[i]) for i in on_host]
        parts.append(torch.cat(host_parts).to(torch.int64))
    if not parts:
        host = torch.empty(0, dtype=torch.int64)
    elif len(parts) == 1:
        host = parts[0]
    else:
        # The device part becomes valid when copy_done fires, so the store thread joins
        # the two after waiting (see FusedPages.wait).
        return FusedPages(parts[0], starts, counts, copy_done, d2h_copies, host_tail=parts[1])
    return FusedPages(host, starts, counts, copy_done, d2h_copies)


def _head(pages: torch.Tensor, used: int) -> torch.Tensor:
    """The first ``used`` page ids; no slice op (a few µs each) when all are used."""
    return pages if used == pages.shape[0] else pages[:used]
