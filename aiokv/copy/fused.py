"""A batch's page ids brought to the host in one copy, where they are needed there
(FlexKV: host slot mappings; a store in a child process: numpy ids to send; the copier,
while offloads hold the copy engines: :mod:`.ids`).

:func:`fuse_page_ids` concatenates the launch's device page ids on a stream that waited
for the callers' ready events (:func:`wait_ready`), expands them to slots there where
asked (``page * page_size + offset``: one tiny kernel instead of a host pass over every
slot), and has them written into pinned host memory without blocking: one
device-to-host transfer per launch. What it answers, :class:`FusedPages`, is host math
from there on: the store waits for it, checks every page id at once
(:meth:`FusedPages.page_errors`, naming the id as the caller gave it) and cuts it per
task (:meth:`FusedPages.split`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .pinned import HOST_WRITES, as_device_tensor, writes_host
from .plan import Int64Array


class PageCopier:
    """Brings launches' page ids to the host with one device-to-host copy per launch, on
    a stream of its own per device, after the callers' ready events; counts the copies
    (``d2h_copies``, a store's ``store_stats`` key). Store thread only."""

    def __init__(self) -> None:
        self.d2h_copies = 0
        self._streams: dict[torch.device, Any] = {}

    def stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def fuse(
        self, pages: Sequence[torch.Tensor], ready: Sequence[Any], page_size: int = 0
    ) -> tuple[FusedPages, Any]:
        """:func:`fuse_page_ids` after the ``ready`` events (on the stream, or where no
        device work is needed, once they fired: the store's copy reads the KV after the
        callers wrote it); with the stream it used (None: none)."""
        if len(pages) != len(ready):
            raise ValueError(f"{len(pages)} page id tensors for {len(ready)} ready events")
        device = next((p.device for p in pages if not p.is_cpu), None)
        stream = None if device is None else self.stream(device)
        events = wait_ready(ready, stream)
        fused = fuse_page_ids(pages, stream, page_size)
        if fused.copy_done is None:
            for event in events:
                event.synchronize()
        self.d2h_copies += fused.d2h_copies
        return fused, stream

    def host_pages(self, pages: Sequence[torch.Tensor], ready: Sequence[Any]) -> list[Int64Array]:
        """Every tensor of ``pages`` as int64 numpy (views of one array), once the one copy
        landed and the events fired."""
        fused, _ = self.fuse(pages, ready)
        return fused.split(fused.wait(), 1)


def wait_ready(ready: Iterable[Any], stream: Any) -> list[Any]:
    """Make ``stream`` (None: no device work follows) wait for the distinct CUDA events
    of ``ready``, without blocking this thread; returns those events."""
    events: dict[int, Any] = {}
    for event in ready:
        if event is not None:
            events.setdefault(id(event), event)
    if stream is not None:
        for event in events.values():
            stream.wait_event(event)
    return list(events.values())


@dataclass(slots=True)
class FusedPages:
    """Page ids of one batch on the host; request ``i`` owns
    ``pages[starts[i]:starts[i] + counts[i]]`` (pages between requests, if any, belong
    to none)."""

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

    def wait_slots(self, page_size: int) -> Int64Array:
        """Block until the copy landed; return every page's slots (:meth:`expand`) without
        recovering page ids first when the device already expanded them."""
        if not self.expanded_page_size:
            return self.expand(self.wait(), page_size)
        if self.copy_done is not None:
            self.copy_done.synchronize()
        return self._device_slots(page_size)

    def _device_slots(self, page_size: int) -> Int64Array:
        """The slots the device expanded (valid once the copy landed)."""
        if page_size != self.expanded_page_size:
            raise ValueError(f"slots were expanded for page size {self.expanded_page_size}")
        slots: Int64Array = self.host.numpy()
        return slots

    def bad_requests(self, slots: Int64Array, num_pages: int, page_size: int) -> Int64Array:
        """Indexes of requests holding a page id < 0 or >= num_pages (vectorized), read
        from each page's first slot (``page * page_size``): the slots are what the batch
        needs anyway, and dividing them back into page ids would cost more than this."""
        # One strided gather (a cache line per page), then one unsigned compare: a
        # negative id wraps to >= 2**63, past any limit. Comparing the strided view twice
        # costs twice the gather.
        firsts = np.ascontiguousarray(slots[::page_size]).view(np.uint64)
        bad = firsts >= num_pages * page_size
        if not bad.any():
            return np.empty(0, dtype=np.int64)
        running = np.concatenate(([0], np.cumsum(bad, dtype=np.int64)))
        per_request = running[self.starts + self.counts] - running[self.starts]
        return np.flatnonzero(per_request)

    def page_errors(
        self,
        slots: Int64Array,
        num_pages: int,
        page_size: int,
        unique: Collection[int],
        own_id: Callable[[int, int], int | None] | None = None,
    ) -> dict[int, str]:
        """{task index: its error} for tasks holding a page id outside
        ``[0, num_pages)`` (naming the first such id) or, among the indexes in ``unique``
        (loads, which write their pages), a page id twice. Vectorized over the batch;
        only tasks at fault cost a numpy call each.

        ``own_id(task, position)``: the caller's own id there (None: unknown). The
        slots hold ids clamped to ``[-1, largest_page]`` (:func:`largest_page`), so
        without it an id beyond those bounds is named as the bound."""
        errors: dict[int, str] = {}
        for index in self.bad_requests(slots, num_pages, page_size).tolist():
            pages = self.request_slots(slots, index, page_size)[::page_size] // page_size
            position = int(np.argmax((pages < 0) | (pages >= num_pages)))
            first = int(pages[position])
            if own_id is not None and first in (-1, largest_page(page_size)):
                own = own_id(index, position)  # only a bound may stand for another id
                first = first if own is None else own
            errors[index] = f"holds {first}, outside [0, {num_pages})"
        if unique:
            skip = set(errors) | set(range(len(self.starts))).difference(unique)
            for index, page in self._duplicates(slots, num_pages, page_size, skip).items():
                errors[index] = f"holds {page} twice; a load writes each page once"
        return errors

    def _duplicates(
        self, slots: Int64Array, num_pages: int, page_size: int, skip: Collection[int]
    ) -> dict[int, int]:
        """{request index: a page id it holds twice}, from one sort of (request, page)
        keys over the batch; tasks in ``skip`` are left out."""
        pages = slots[::page_size] // page_size
        if len(pages) < 2:
            return {}
        positions = np.arange(len(pages), dtype=np.int64)
        owners = np.searchsorted(self.starts, positions, side="right") - 1
        owned = (owners >= 0) & (positions < (self.starts + self.counts)[owners])
        if skip:
            owned &= ~np.isin(owners, list(skip))
        keys = np.sort(owners[owned] * num_pages + pages[owned])
        twice = keys[1:][keys[1:] == keys[:-1]]
        found: dict[int, int] = {}
        for key in twice.tolist():
            found.setdefault(key // num_pages, key % num_pages)
        return found

    def expand(self, pages: Int64Array, page_size: int) -> Int64Array:
        """Slots of every page: ``page * page_size + offset``, one op for the batch."""
        if self.expanded_page_size:
            return self._device_slots(page_size)
        offsets = np.arange(page_size, dtype=np.int64)
        pages = np.clip(pages, -1, largest_page(page_size))  # see _largest_page
        return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)

    def request_slots(self, slots: Int64Array, index: int, page_size: int) -> Int64Array:
        """Request ``index``'s slots, a view into ``slots``."""
        start = int(self.starts[index]) * page_size
        return slots[start : start + int(self.counts[index]) * page_size]

    def split(self, slots: Int64Array, page_size: int) -> list[Int64Array]:
        """Every request's slots in request order, views into ``slots`` (what
        :meth:`request_slots` gives for each index, without a numpy call per request)."""
        begins = (self.starts * page_size).tolist()
        ends = ((self.starts + self.counts) * page_size).tolist()
        return [slots[begin:end] for begin, end in zip(begins, ends, strict=True)]


def largest_page(page_size: int) -> int:
    """The largest page id whose slots fit in int64. Ids are clamped to
    ``[-1, _largest_page]`` before they become slots: ``page * page_size`` wraps around
    in int64, and a huge id could wrap into a valid slot and pass the range check
    (:meth:`FusedPages.bad_requests`), moving another page. A clamped id is still out of
    range (no cache has that many pages), so it is still caught."""
    return int((2**63 - 1) // max(page_size, 1))


_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _device_offsets(device: torch.device, page_size: int) -> torch.Tensor:
    """``arange(page_size)`` on ``device``, made once (a kernel launch saved per batch)."""
    offsets = _OFFSETS.get((device, page_size))
    if offsets is None:
        offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        # Later batches use it from other streams: let the one fill land first.
        torch.cuda.current_stream(device).synchronize()
        _OFFSETS[(device, page_size)] = offsets
    return offsets


def fuse_page_ids(
    page_ids: Sequence[torch.Tensor], stream: Any = None, page_size: int = 0
) -> FusedPages:
    """Bring every ``page_ids[i]`` (1-D) to the host with at most one device-to-host copy.
    Device tensors are concatenated on ``stream`` (a torch.cuda.Stream that waited for the
    callers' events, :func:`wait_ready`; None: the current stream) and written into pinned
    memory without blocking; CPU tensors are concatenated on the host. The result lists
    device-resident tensors first, so ``starts`` is not in argument order. Given
    ``page_size``, a batch held on the device is also expanded to slots there, and the
    slots are what the one copy brings back."""
    counts = np.array([t.numel() for t in page_ids], dtype=np.int64)
    is_cpu = [t.is_cpu for t in page_ids]
    if not any(is_cpu):  # all on the device, the usual case
        if not page_ids:
            return FusedPages(torch.empty(0, dtype=torch.int64), counts, counts.copy(), None, 0)
        pinned, copy_done = _fuse_on_device(page_ids, stream, page_size)
        starts = np.cumsum(counts) - counts
        return FusedPages(pinned, starts, counts, copy_done, 1, expanded_page_size=page_size)
    on_host = [i for i, cpu in enumerate(is_cpu) if cpu]
    host_part = torch.cat([page_ids[i] for i in on_host])  # a copy
    if host_part.dtype != torch.int64:
        host_part = host_part.to(torch.int64)
    if len(on_host) == len(page_ids):  # all on the host: in argument order
        return FusedPages(host_part, np.cumsum(counts) - counts, counts, None, 0)
    on_device = [i for i, cpu in enumerate(is_cpu) if not cpu]
    starts = np.empty(len(page_ids), dtype=np.int64)
    host_counts, device_counts = counts[on_host], counts[on_device]
    starts[on_host] = np.cumsum(host_counts) - host_counts
    # The host part holds pages: the store thread expands both.
    pinned, copy_done = _fuse_on_device([page_ids[i] for i in on_device], stream, 0)
    starts[on_device] = np.cumsum(device_counts) - device_counts
    starts[on_host] += pinned.shape[0]
    # The device part becomes valid when copy_done fires, so the store thread joins the
    # two after waiting (see FusedPages.wait).
    return FusedPages(pinned, starts, counts, copy_done, 1, host_tail=host_part)


def _fuse_on_device(
    page_ids: Sequence[torch.Tensor], stream: Any, page_size: int
) -> tuple[torch.Tensor, Any]:
    """One concat (and expansion to slots of ``page_size``, if > 0) on ``stream`` and one
    device-to-host transfer into pinned memory (the expanding kernel writes it there, or
    one copy does where kernels cannot write pinned memory); returns the pinned tensor
    and the transfer's event."""
    total = sum(t.numel() for t in page_ids)
    pinned = torch.empty(total * max(page_size, 1), dtype=torch.int64, pin_memory=True)
    if stream is None:
        return pinned, _cat_expand_copy(list(page_ids), page_size, pinned)
    # A switch to the stream and back: a stream context manager costs several times as
    # much, and the store thread pays it on every launch's critical path.
    previous = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        copy_done = _cat_expand_copy(list(page_ids), page_size, pinned)
    finally:
        torch.cuda.set_stream(previous)
    return pinned, copy_done


def _cat_expand_copy(parts: list[torch.Tensor], page_size: int, pinned: torch.Tensor) -> Any:
    """On the current stream: concatenate, expand to slots given ``page_size``, and bring
    the result to ``pinned``; return the event that marks the end.

    Where the device can write pinned memory directly (:func:`.pinned.writes_host`), the last
    kernel writes its result there, with no copy at all. A copy would go through the
    device's copy engines, which run device-to-host copies one after another: behind a
    large offload copy, a batch's slots would land only after it, and the store thread
    could not match the batch until then. A kernel's writes do not queue behind them."""
    device = parts[0].device
    direct = pinned.numel() > 0 and writes_host(device)
    target = as_device_tensor(pinned, device) if direct else None
    fused = parts[0] if len(parts) == 1 else torch.cat(parts)
    if page_size > 0:
        # offsets + page_size * pages, broadcast: one kernel for every slot (the add
        # promotes int32 ids to int64), writing the host where it can.
        offsets = _device_offsets(device, page_size)
        out = None if target is None else target.view(-1, page_size)
        if fused.dtype == torch.int64:  # int32 ids cannot wrap; see _largest_page
            fused = fused.clamp(-1, largest_page(page_size))
        fused = torch.add(offsets, fused.reshape(-1, 1), alpha=page_size, out=out).view(-1)
    elif target is not None:
        torch.add(fused, 0, out=target)  # one kernel: the write and the cast to int64
    elif fused.dtype != torch.int64:
        fused = fused.to(torch.int64)
    copy_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    if target is None:
        pinned.copy_(fused, non_blocking=True)
    copy_done.record()
    if target is not None:
        # Torch's pinned allocator tracks its own copies, not a kernel's writes: hold
        # the memory until the event fired, whatever becomes of the batch.
        HOST_WRITES.hold(copy_done, pinned)
    # `fused` was allocated on this stream and is only used here, so the caching
    # allocator will not reuse it before the copy ends. The callers' page_ids stay
    # referenced by their requests until those resolve.
    return copy_done


def warm_up(device: torch.device, page_size: int, stream: Any = None) -> None:
    """Run the fused path once for the shapes launches take (one task, a few, many; int32
    and int64 ids), so that CUDA's lazy module loading happens here, at registration, and
    not in the first launches, which it would delay. Blocks."""
    for dtype in (torch.int64, torch.int32):
        for tasks in (1, 3, 64):
            ids = [torch.zeros(4, dtype=dtype, device=device) for _ in range(tasks)]
            if stream is not None:  # as a launch does: the copy follows the writes
                stream.wait_stream(torch.cuda.current_stream(device))
            for size in (page_size, 0):  # slots (FlexKV) and pages (a store process)
                fuse_page_ids(ids, stream, size).wait()
