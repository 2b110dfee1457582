"""Fused slot mapping: one concat, one device-to-host transfer, one vectorized expansion.

The store thread calls :func:`fuse_page_ids` as it takes a batch (never the event loop:
each torch call gives the GIL away). It concatenates the page ids of every request in the
batch on their device and has them written into pinned host memory without blocking (by
the expanding kernel itself where the device can write pinned memory, else by one copy);
offsets come from shapes, so nothing waits for the GPU there. It then waits for the copy
and has every page's slots (:meth:`FusedPages.wait_slots`,
expanding pages to slots once where the device did not), and checks every page id at
once (:meth:`FusedPages.bad_requests`); :func:`select_slots` picks one request's
positions.
:meth:`FusedPages.split` and :meth:`FusedPages.select` give every request's slots, or
its masked positions' slots, as views for a whole batch with a fixed number of numpy
calls; :meth:`FusedPages.wait_request_slots` makes those views while the copy is still
in flight, for callers that need no page-id check.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from .stores.base import BoolArray, Int64Array

log = logging.getLogger("aiokv")


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

    def expand(self, pages: Int64Array, page_size: int) -> Int64Array:
        """Slots of every page: ``page * page_size + offset``, one op for the batch."""
        if self.expanded_page_size:
            return self._device_slots(page_size)
        offsets = np.arange(page_size, dtype=np.int64)
        pages = np.clip(pages, -1, _largest_page(page_size))  # see _largest_page
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

    def select(
        self, slots: Int64Array, masks: Sequence[BoolArray], page_size: int
    ) -> list[Int64Array]:
        """``select_slots(request_slots(slots, i, page_size), masks[i])`` for every
        request, with a fixed number of numpy calls for the batch.

        The masks are joined once, with a False between requests, and every run of True
        is found from the places where the value changes. A request whose True positions
        form one run (store masks do: a suffix for puts, a prefix for gets) gets a view;
        one with holes falls back to :func:`select_slots`; one with none, an empty view.
        """
        out, holes = self._select_views(slots, masks, page_size)
        for index in holes:
            out[index] = select_slots(self.request_slots(slots, index, page_size), masks[index])
        return out

    def wait_request_slots(
        self, page_size: int, masks: Sequence[BoolArray] | None = None
    ) -> list[Int64Array]:
        """Block until the copy landed; return :meth:`split` (every request's slots) or,
        given ``masks``, :meth:`select` (their masked positions'). When the device
        expanded the slots, the views are made while the copy is still in flight: only
        their bounds are computed before the wait, no slot is read."""
        if self.expanded_page_size != page_size or self.copy_done is None:
            slots = self.wait_slots(page_size)
            return self.split(slots, page_size) if masks is None else self.select(
                slots, masks, page_size
            )
        slots = self.host.numpy()
        if masks is None:
            out = self.split(slots, page_size)
            self.copy_done.synchronize()
            return out
        out, holes = self._select_views(slots, masks, page_size)
        self.copy_done.synchronize()
        for index in holes:  # fancy indexing reads slots: after the wait
            out[index] = select_slots(self.request_slots(slots, index, page_size), masks[index])
        return out

    def _select_views(
        self, slots: Int64Array, masks: Sequence[BoolArray], page_size: int
    ) -> tuple[list[Int64Array], list[int]]:
        """:meth:`select`'s views, reading no slot; the indexes of requests whose masks
        have holes come back unfilled, for :func:`select_slots`."""
        n = len(masks)
        if n != len(self.starts):
            raise ValueError(f"{n} masks for {len(self.starts)} requests")
        if n == 0:
            return [], []
        parts: list[BoolArray] = [_FALSE] * (2 * n + 1)
        parts[1::2] = masks
        joined = np.concatenate(parts).astype(np.bool_, copy=False)
        edges = np.flatnonzero(joined[1:] != joined[:-1]) + 1
        rises, falls = edges[0::2], edges[1::2]  # each run of True is [rise, fall)
        lengths = np.array([len(m) for m in masks], dtype=np.int64)
        mask_ends = np.cumsum(lengths + 1)  # where the False after each mask is
        mask_begins = mask_ends - lengths
        if len(rises) == n and (rises >= mask_begins).all() and (falls <= mask_ends).all():
            owners: Int64Array | None = None  # run i is request i's only run: the usual
            begins, have = mask_begins, self.counts * page_size
            shift = self.starts * page_size - mask_begins
        else:
            owners = np.searchsorted(mask_begins, rises, side="right") - 1
            runs_per_request = np.bincount(owners, minlength=n)
            single = runs_per_request[owners] == 1
            owners, rises, falls = owners[single], rises[single], falls[single]
            begins = mask_begins[owners]
            have = self.counts[owners] * page_size
            shift = self.starts[owners] * page_size - begins
        past = falls - begins > have
        if past.any():
            first = int(np.argmax(past))
            raise IndexError(
                f"mask position {int(falls[first] - begins[first]) - 1} "
                f"is past the {int(have[first])} slots"
            )
        firsts, lasts = (rises + shift).tolist(), (falls + shift).tolist()
        views = [slots[a:b] for a, b in zip(firsts, lasts, strict=True)]
        if owners is None:
            return views, []
        out = [slots[:0]] * n
        for owner, view in zip(owners.tolist(), views, strict=True):
            out[owner] = view
        return out, np.flatnonzero(runs_per_request > 1).tolist()


_FALSE: BoolArray = np.zeros(1, dtype=np.bool_)


def select_slots(request_slots: Int64Array, mask: BoolArray) -> Int64Array:
    """The slots of exactly the True positions of ``mask`` (a view when they are one
    contiguous run, as store masks are: a suffix for puts, a prefix for gets)."""
    if not mask.size:
        return request_slots[:0]
    first = int(mask.argmax())  # argmax + counts: cheaper than flatnonzero per request
    if not mask[first]:
        return request_slots[:0]
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


def _largest_page(page_size: int) -> int:
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


def d2h_copies(page_ids: Iterable[torch.Tensor | None]) -> int:
    """The device-to-host copies :func:`fuse_page_ids` makes for these page ids: one when
    any of them is on a device, none when all are on the host. For the stats, which are
    counted on the loop while the store thread fuses."""
    return int(any(t is not None and not t.is_cpu for t in page_ids))


def fuse_page_ids(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    stream: Any = None,
    page_size: int = 0,
) -> FusedPages:
    """Bring the leading ``pages_used[i]`` of each ``page_ids[i]`` to the host with at
    most one device-to-host copy.

    Device tensors are concatenated on ``stream`` (a torch.cuda.Stream the caller made
    wait for the requests' events; None: the current stream) and copied into pinned
    memory without blocking; CPU tensors are concatenated on the host. The result lists
    device-resident requests first, so ``starts`` is not in request order. Given
    ``page_size``, a batch held on the device is also expanded to slots there (one tiny
    kernel instead of a host pass over every slot), and the slots are what the one copy
    brings back. When the device tensors hold few pages past the used ones, they are
    concatenated whole (a slice op per request costs more than copying a short unused
    tail), so the host copy may hold pages no request owns between requests.
    """
    counts = np.array(pages_used, dtype=np.int64)
    is_cpu = [t.is_cpu for t in page_ids]
    if not any(is_cpu):  # all on the device, the usual case
        if not page_ids:
            return FusedPages(torch.empty(0, dtype=torch.int64), counts, counts.copy(), None, 0)
        pinned, copy_done, starts = _fuse_on_device(
            page_ids, pages_used, counts, stream, page_size, expand=page_size > 0
        )
        return FusedPages(pinned, starts, counts, copy_done, 1, expanded_page_size=page_size)
    on_host = [i for i, cpu in enumerate(is_cpu) if cpu]
    host_part = torch.cat([_head(page_ids[i], pages_used[i]) for i in on_host])  # a copy
    if host_part.dtype != torch.int64:
        host_part = host_part.to(torch.int64)
    if len(on_host) == len(page_ids):  # all on the host: in request order
        return FusedPages(host_part, np.cumsum(counts) - counts, counts, None, 0)
    on_device = [i for i, cpu in enumerate(is_cpu) if not cpu]
    starts = np.empty(len(page_ids), dtype=np.int64)
    host_counts = counts[on_host]
    starts[on_host] = np.cumsum(host_counts) - host_counts
    pinned, copy_done, device_starts = _fuse_on_device(
        [page_ids[i] for i in on_device],
        [pages_used[i] for i in on_device],
        counts[on_device],
        stream,
        page_size,
        expand=False,  # the host part holds pages: the store thread expands both
    )
    starts[on_device] = device_starts
    starts[on_host] += pinned.shape[0]
    # The device part becomes valid when copy_done fires, so the store thread joins the
    # two after waiting (see FusedPages.wait).
    return FusedPages(pinned, starts, counts, copy_done, 1, host_tail=host_part)


# Concatenate device tensors whole while their unused tails add at most this many slots
# per request to the copy: a slice op costs about as much as copying 2048 slots.
_TAIL_SLOTS_PER_REQUEST = 2048


def _fuse_on_device(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    counts: Int64Array,
    stream: Any,
    page_size: int,
    expand: bool,
) -> tuple[torch.Tensor, Any, Int64Array]:
    """One concat (and expansion to slots of ``page_size``, if ``expand``) on ``stream``
    and one device-to-host transfer into pinned memory (the expanding kernel writes it
    there, or one copy does where kernels cannot write pinned memory); returns the pinned
    tensor, the transfer's event and each request's start (in pages) in it."""
    # Unused tails are weighed in slots either way: unexpanded, the host expands them.
    parts, starts, total = _device_parts(page_ids, pages_used, counts, page_size)
    expand_to = page_size if expand else 0
    pinned = torch.empty(
        total * expand_to if expand_to else total, dtype=torch.int64, pin_memory=True
    )
    if stream is None:
        copy_done = _cat_expand_copy(parts, expand_to, pinned)
    else:
        with torch.cuda.stream(stream):
            copy_done = _cat_expand_copy(parts, expand_to, pinned)
    return pinned, copy_done, starts


def _device_parts(
    page_ids: Sequence[torch.Tensor],
    pages_used: Sequence[int],
    counts: Int64Array,
    page_size: int,
) -> tuple[list[torch.Tensor], Int64Array, int]:
    """The (1-D) tensors to concatenate, where each request starts in the result and its
    length in pages: whole tensors while their unused tails are short, else only the
    used pages (a slice op each)."""
    lengths = [t.numel() for t in page_ids]  # cheaper than shape[0]
    ends = list(accumulate(lengths))
    used = int(counts.sum())
    if (ends[-1] - used) * max(page_size, 1) <= _TAIL_SLOTS_PER_REQUEST * len(lengths):
        ends[-1:] = []
        return list(page_ids), np.array([0, *ends], dtype=np.int64), sum(lengths)
    parts = [_head(t, n) for t, n in zip(page_ids, pages_used, strict=True)]
    return parts, np.cumsum(counts) - counts, used


def _cat_expand_copy(parts: list[torch.Tensor], page_size: int, pinned: torch.Tensor) -> Any:
    """On the current stream: concatenate, expand to slots given ``page_size``, and bring
    the result to ``pinned``; return the event that marks the end.

    Where the device can write pinned memory directly (:func:`_writes_host`), the last
    kernel writes its result there, with no copy at all. A copy would go through the
    device's copy engines, which run device-to-host copies one after another: on an H200,
    1 MiB copied during a 1 GiB offload copy landed after 17.5 ms, and in a stream of
    offloads the store thread waited up to 230 ms for a batch's slots before it could
    match the batch. A kernel's writes into pinned memory do not queue there: 0.2-0.4 ms
    for the same 1 MiB during the same copy.
    """
    device = parts[0].device
    direct = pinned.numel() > 0 and _writes_host(device)
    target = as_device_tensor(pinned, device) if direct else None
    fused = parts[0] if len(parts) == 1 else torch.cat(parts)
    if page_size > 0:
        # offsets + page_size * pages, broadcast: one kernel for every slot (the add
        # promotes int32 ids to int64), writing the host where it can.
        offsets = _device_offsets(device, page_size)
        out = None if target is None else target.view(-1, page_size)
        if fused.dtype == torch.int64:  # int32 ids cannot wrap; see _largest_page
            fused = fused.clamp(-1, _largest_page(page_size))
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
        _HOST_WRITES.hold(copy_done, pinned)
    # `fused` was allocated on this stream and is only used here, so the caching
    # allocator will not reuse it before the copy ends. The callers' page_ids stay
    # referenced by their requests until those resolve.
    return copy_done


class _DeviceArray:
    """A pinned host tensor presented to torch as a CUDA array. With unified addressing
    (every 64-bit CUDA platform), pinned memory is mapped into each device's address
    space at its host address, so a device tensor over that address is the host memory:
    what kernels write there, the host reads after the kernels' event."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # keeps the memory alive as long as the device view is
        typestr = {torch.int64: "<i8", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def as_device_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the memory of the pinned, contiguous ``host``."""
    view = torch.as_tensor(_DeviceArray(host), device=device)
    if view.data_ptr() != host.data_ptr():  # torch copied instead of aliasing
        raise RuntimeError("the device view of pinned memory is not the same memory")
    return view


_WRITES_HOST: dict[torch.device, bool] = {}


def _writes_host(device: torch.device) -> bool:
    """Whether kernels on ``device`` can write pinned memory through
    :func:`as_device_tensor`, tried once per device: a kernel writes a pattern there and
    the host reads it back. Where not (or on any error), copies are used instead.

    Torch's default pinned allocator uses ``cudaHostAlloc``, whose memory every device
    with unified addressing reaches at its host address (CUDA programming guide,
    "Unified Virtual Address Space")."""
    known = _WRITES_HOST.get(device)
    if known is not None:
        return known
    if "pinned_use_cuda_host_register" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # Pinned memory is then malloc'd and registered, which maps it into the device's
        # address space only when asked to: a kernel's write could fault the context.
        _WRITES_HOST[device] = False
        return False
    try:
        host = torch.zeros(1024, dtype=torch.int64, pin_memory=True)
        pattern = torch.arange(7, 7 + 1024, dtype=torch.int64, device=device)
        torch.add(pattern, 0, out=as_device_tensor(host, device))
        torch.cuda.current_stream(device).synchronize()
        works = bool(torch.equal(host, pattern.cpu()))
    except Exception:
        works = False
    if not works:
        log.warning("aiokv: kernels cannot write pinned memory on %s; fused slots are "
                    "copied instead, behind any copy already queued", device)
    _WRITES_HOST[device] = works
    return works


class _HeldUntilDone:
    """Pinned buffers that kernels write, each held until its event fired. Pruned on
    every :meth:`hold` (one event query per held buffer that is done, oldest first)."""

    def __init__(self) -> None:
        self._held: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._lock = threading.Lock()  # the store thread and a warm-up thread may both hold

    def hold(self, event: Any, memory: torch.Tensor) -> None:
        with self._lock:
            held = self._held
            while held and held[0][0].query():
                held.popleft()
            held.append((event, memory))


_HOST_WRITES = _HeldUntilDone()


def warm_up(device: torch.device, page_size: int, stream: Any = None) -> None:
    """Run the fused path once for the shapes batches take (one request, a few, many;
    int32 and int64 ids), so that CUDA's lazy module loading happens here, at start-up,
    and not in the first batches: on an H200 it cost them 20-30 ms. Blocks until done:
    call it before serving."""
    for dtype in (torch.int64, torch.int32):
        for requests in (1, 3, 64):
            ids = [torch.zeros(4, dtype=dtype, device=device) for _ in range(requests)]
            if stream is not None:  # as the store thread does: the copy follows the writes
                stream.wait_stream(torch.cuda.current_stream(device))
            for used in (4, 2):  # whole tensors, and the used heads only
                fused = fuse_page_ids(ids, [used] * requests, stream, page_size)
                fused.wait_slots(page_size)


def _head(pages: torch.Tensor, used: int) -> torch.Tensor:
    """The first ``used`` page ids; no slice op (a few µs each) when all are used."""
    return pages if used == pages.numel() else pages[:used]  # 1-D: numel() is shape[0]
