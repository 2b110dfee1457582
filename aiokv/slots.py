"""Fused slot mapping math, on the host: a batch's page ids as one array, their slots
(``page * page_size + offset``), the page-id check, and every request's (masked) slots.

:func:`aiokv.cuda.fuse_page_ids` brings a batch's page ids to the host in one copy and
answers a :class:`FusedPages`; the store thread waits for it and has every page's slots
(:meth:`FusedPages.wait_slots`, expanding pages to slots once where the device did not),
checks every page id at once (:meth:`FusedPages.bad_requests`), and selects each
request's masked positions' slots as views, with a fixed number of numpy calls for the
whole batch (:meth:`FusedPages.select`; :func:`select_slots` for one request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import InvalidRequest
from .stores.base import BoolArray, Int64Array


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
        unique: bool,
        own_id: Callable[[int, int], int | None] | None = None,
    ) -> dict[int, InvalidRequest]:
        """{request index: its InvalidRequest} for requests holding a page id outside
        ``[0, num_pages)`` (naming the first such id) or, with ``unique`` (a load, which
        writes its pages), a page id twice. Vectorized over the batch; only requests at
        fault cost a numpy call each.

        ``own_id(request, position)``: the caller's own id there (None: unknown). The
        slots hold ids clamped to ``[-1, largest_page]`` (:func:`largest_page`), so
        without it an id beyond those bounds is named as the bound."""
        errors: dict[int, InvalidRequest] = {}
        for index in self.bad_requests(slots, num_pages, page_size).tolist():
            pages = self.request_slots(slots, index, page_size)[::page_size] // page_size
            position = int(np.argmax((pages < 0) | (pages >= num_pages)))
            first = int(pages[position])
            if own_id is not None and first in (-1, largest_page(page_size)):
                own = own_id(index, position)  # only a bound may stand for another id
                first = first if own is None else own
            errors[index] = InvalidRequest(
                "page_ids", f"holds {first}, outside [0, {num_pages})"
            )
        if unique:
            for index, page in self._duplicates(slots, num_pages, page_size, errors).items():
                errors[index] = InvalidRequest(
                    "page_ids", f"holds {page} twice; a load writes each page once"
                )
        return errors

    def _duplicates(
        self, slots: Int64Array, num_pages: int, page_size: int, skip: dict[int, Any]
    ) -> dict[int, int]:
        """{request index: a page id it holds twice}, from one sort of (request, page)
        keys over the batch; requests in ``skip`` (ids out of range) are left out."""
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


def largest_page(page_size: int) -> int:
    """The largest page id whose slots fit in int64. Ids are clamped to
    ``[-1, _largest_page]`` before they become slots: ``page * page_size`` wraps around
    in int64, and a huge id could wrap into a valid slot and pass the range check
    (:meth:`FusedPages.bad_requests`), moving another page. A clamped id is still out of
    range (no cache has that many pages), so it is still caught."""
    return int((2**63 - 1) // max(page_size, 1))
