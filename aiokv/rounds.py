"""One batch's store round, on the store thread (:mod:`aiokv.worker` runs it in inbox order).

An offload or load: (on a store that prestages: name a load's reservations, or match an
offload's first requests and name them with their device page ids, so the store starts
the first copy early) fuse the batch's page ids into one host copy
(:func:`aiokv.cuda.fuse_page_ids`, on the copy stream, after the callers' CUDA events),
wait for it, check page ids, ask the store for its matches (:class:`aiokv.calls.StoreCalls`),
plan the round (:mod:`aiokv.plans`) and execute it: cancels, then one launch (a large
offload batch on a store that queues copies at once: its first requests' round, then
the rest's, so copying starts before the last match). A lookup:
its matches, planned into outcomes and the reservations it keeps. The worker then polls
the launched ids until each is terminal.

:class:`Rounds` shares its containers with the worker (the same objects, never replaced):
``launched`` (launched ids -> request, until terminal) and ``reserved`` (lookup matches
held for a load). Outcomes go to the outbox the worker passes in, which it posts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .batcher import Batch
from .calls import StoreCalls
from .cuda import fuse_page_ids, ready_events
from .errors import StoreError
from .handoff import GilSlice
from .invalidation import HeldKeys
from .layerwise import note_launches
from .plans import Round, plan_load, plan_lookup, plan_offload, to_match
from .requests import LAUNCHED, TERMINAL, Kind, Request
from .slots import FusedPages
from .stores.base import Capabilities, Store

_OFFLOAD = Kind.OFFLOAD  # module globals: read per batch
_LOAD = Kind.LOAD
# Offload batches of at least this many requests launch their first ones early (_head).
_SPLIT_FROM = 16

log = logging.getLogger("aiokv")

Outbox = list[tuple[Request, object]]


class Rounds:
    """Runs batches' store rounds (store thread only)."""

    def __init__(
        self,
        store: Store,
        caps: Capabilities,
        calls: StoreCalls,
        gil_slice: GilSlice,
        num_pages: int,
        copy_stream: Any,
        launched: dict[int, Request],
        reserved: set[int],
        held_keys: HeldKeys,
        release_one: Callable[[int], None],
    ) -> None:
        self._store = store
        self._caps = caps
        self._calls = calls
        self._slice = gil_slice
        self._num_pages = num_pages
        self._copy_stream = copy_stream  # torch.cuda.Stream for the fused copy, or None
        self._launched = launched
        self._reserved = reserved
        self._held_keys = held_keys  # the reservations' keys, for an evict
        self._release_one = release_one  # a Reservation's way back (StoreWorker.release_one)
        self.page_size = 0  # the store's, set by the worker once it is registered
        # The most tokens the store can hold (stores.base.capacity_tokens), set with
        # page_size; None: unknown. A lookup's key is cut to it (calls.key_ids).
        self.capacity_tokens: int | None = None
        # Device-to-host copies the fused page ids took (FusedPages.d2h_copies); written
        # here, read racily by the loop's stats.
        self.d2h_copies = 0
        self._prestage_failures = 0  # the first is logged with its traceback, the rest not

    def _fuse(self, batch: Batch) -> FusedPages:
        """Start the batch's page ids on their way to the host: one concat (and slot
        expansion) on the copy stream and one transfer, without waiting for them. Here,
        not on the loop: each torch call gives the GIL away, and on the loop winning it
        back from this thread (inside FlexKV's matching, say) took up to Python's switch
        interval."""
        requests = batch.requests
        stream = self._copy_stream
        if stream is not None:
            # The page ids were written on the callers' streams: order the fused copy
            # after them on the GPU, without blocking this thread.
            for event in ready_events(requests):
                stream.wait_event(event)
        return fuse_page_ids(
            [r.page_ids for r in requests if r.page_ids is not None],
            [r.pages_used for r in requests],
            stream,
            self.page_size,
        )

    def lookup(self, batch: Batch, outbox: Outbox) -> None:
        requests = batch.requests
        wanted = [i for i, r in enumerate(requests) if r.stage is not TERMINAL]
        answers = self._calls.match(
            self._store.get_match, self._caps.get_match_many, requests, wanted,
            self.capacity_tokens,
        )
        outcomes, cancel, reserved = plan_lookup(requests, answers, self._release_one)
        outbox.extend(outcomes)
        self._reserved.update(reserved)
        self._held_keys.note(outcomes, self._reserved)
        if cancel:
            self._calls.cancel(cancel)

    def move(self, batch: Batch, outbox: Outbox) -> None:
        """Offload (put) or load (get) batch: one launch for everything with work (two
        for a large offload batch on a store that queues copies at once, see _head)."""
        caps, requests, page_size = self._caps, batch.requests, self.page_size
        offload = batch.kind is _OFFLOAD
        if not offload and caps.prestage is not None:
            self._prestage(caps.prestage, requests)
        # Offloads are matched before or while their slots travel to the host: the
        # matches need only token ids. A request whose page ids turn out bad gives its
        # match back (plan_offload).
        answers: list[Any] = []
        wanted: list[int] = []
        head = 0
        early = offload and self._prestages_puts(requests)
        try:
            if early:
                # Before: the store starts copying from the callers' device page ids at
                # once, while they are fused and checked (base.PrestagesPuts).
                wanted, head, answers = self._match_head(requests)
                self._prestage_puts(requests, answers)
            fused = self._fuse(batch)
            self.d2h_copies += fused.d2h_copies
            if fused.copy_done is None:
                # The KV itself must be written before it is copied. With a device copy
                # there is no need: _fuse made that copy wait for these events, so its own
                # event (waited on by fused.wait) fires after them.
                for event in ready_events(requests):
                    event.synchronize()
            if offload and not early:  # while the slots are on their way
                wanted, head, answers = self._match_head(requests)
            slots = fused.wait_slots(page_size)
        except BaseException:
            if offload:  # the batch fails (see StoreWorker._handle): its matches go back
                self._calls.cancel([a[0] for a in answers if isinstance(a, tuple)])
            raise
        # Ids out of range, or (a load) a page twice: those requests fail alone.
        own_id = _own_id(requests, self._copy_stream)
        bad = fused.page_errors(slots, self._num_pages, page_size, not offload, own_id)

        def select(masks: Sequence[Any]) -> list[Any]:
            return fused.select(slots, masks, page_size)

        if offload and head:
            # The first requests' copies start now; the rest are matched while they run.
            split = wanted[head]  # batch indexes below it are the head's
            ahead = {i: e for i, e in bad.items() if i < split}
            self._execute(
                plan_offload(requests, ahead, answers, self._num_pages, page_size, select),
                outbox,
            )
            assert self._caps.wait_queued is not None
            self._calls.call(self._caps.wait_queued)
            bad = {i: e for i, e in bad.items() if i >= split}
            answers = self._match_puts(requests, [i for i in wanted[head:] if i not in bad])
        if offload:
            plan = plan_offload(requests, bad, answers, self._num_pages, page_size, select)
        else:
            # Every load consumes its reservation here: launched or cancelled below,
            # unless an evict or clear gave it back already.
            reserved = self._reserved
            gone = [i for i, r in enumerate(requests) if r.task_id not in reserved]
            reserved.difference_update([r.task_id for r in requests])
            plan = plan_load(requests, bad, self._num_pages, page_size, select, gone)
        self._execute(plan, outbox)

    def _prestage(
        self, prestage: Callable[[Sequence[int]], None], requests: Sequence[Request]
    ) -> None:
        """Tell the store which reservations a load batch launches, in launch order
        (base.Prestages), before its page ids are fused: the store can start the first
        copy while they land and are checked. A hint: if it fails, the launch copies
        everything itself, so its error is logged, not raised."""
        reserved = self._reserved
        ids = [r.task_id for r in requests if r.task_id in reserved and r.stage is not TERMINAL]
        if ids:
            self._hint(prestage, ids)

    def _prestages_puts(self, requests: Sequence[Request]) -> bool:
        """Whether an offload batch is matched and named before its fuse: on a store that
        prestages puts, with GPU caches, page ids all on the device (else nothing could
        be named, and the matches had better overlap the slot copy, as without), and a
        copier that is idle (behind offloads in flight the device is busy anyway, and
        the wait for the copy ahead would keep this thread from the inbox for as long
        as those take to queue)."""
        return (
            self._caps.prestage_puts is not None
            and self._copy_stream is not None
            and all(r.page_ids is not None and not r.page_ids.is_cpu for r in requests)
            and not self._copier_busy()
        )

    def _prestage_puts(self, requests: Sequence[Request], answers: Sequence[Any]) -> None:
        """Name the matched offloads that launch next, with their new pages' device page
        ids (views of the callers' tensors) and the events those and the KV are ready
        after (base.PrestagesPuts). Only a batch held on the device whose new pages are
        one run per request: else the launch could not be the one named, and nothing
        is named. A hint: if it fails, the launch copies everything itself."""
        prestage = self._caps.prestage_puts
        assert prestage is not None
        page_size = self.page_size
        ids: list[int] = []
        pages: list[torch.Tensor] = []
        named: list[Request] = []
        for request, answer in zip(requests, answers, strict=True):
            if not isinstance(answer, tuple):
                continue  # not matched: not launched
            page_ids = request.page_ids
            if page_ids is None or page_ids.is_cpu:
                return  # its slots come from the host copy only
            new = np.flatnonzero(answer[1][::page_size])
            if request.stage is TERMINAL or not len(new):
                continue  # cancelled by the plan, not launched
            first, end = int(new[0]), int(new[-1]) + 1
            if end - first != len(new):
                return
            ids.append(answer[0])
            pages.append(page_ids[first:end])
            named.append(request)
        if ids:
            self._hint(prestage, ids, pages, ready_events(named))
            if self._caps.wait_queued is not None:
                # Until the store's copy thread has queued that first chunk: the fuse's
                # torch calls, next on this thread, would take turns with its calls for
                # the GIL and delay both.
                self._hint(self._caps.wait_queued)

    def _hint(self, prestage: Callable[..., None], *args: Any) -> None:
        """Call a prestage; a failure is logged (the first with its traceback, once as a
        warning), never raised: the launch then copies everything itself."""
        try:
            prestage(*args)
        except Exception:
            self._prestage_failures += 1
            first = self._prestage_failures == 1
            (log.warning if first else log.debug)(
                "aiokv: store.prestage failed (%d times); the launch copies all",
                self._prestage_failures, exc_info=first,
            )

    def _head(self, wanted: Sequence[int]) -> int:
        """How many of an offload batch's ``wanted`` requests to match and launch before
        the rest are matched: 0 (all at once) unless the store queues copies at once
        (``wait_queued``) and matches one request per call, no offload this engine
        launched is still in flight (a lone batch, or, on GPU caches, one behind loads:
        they copy the other way), and the batch is large enough that matching the rest
        takes longer than starting the first copies; then an eighth of them, at least
        two (their copies must outlast the rest's matching and launch, or the device
        would wait between the two launches). Prestaged heads too: a quarter, tried for
        them, starved the batch's later copies beside loads in flight (benchmarks/
        RESULTS.md). Not below _SPLIT_FROM: a short head is a partial copy chunk, whose
        per-layer ops cost more than the few matches the split saves."""
        if self._caps.wait_queued is None or self._caps.put_match_many is not None:
            return 0
        # With copies in flight that the head would queue behind (_copier_busy), the
        # device is busy anyway, and waiting for the copy thread to reach the head could
        # keep this thread from the inbox for as long as those copies take.
        if len(wanted) < _SPLIT_FROM or self._copier_busy():
            return 0
        return max(2, len(wanted) // 8)

    def _copier_busy(self) -> bool:
        """Whether copies this engine launched are in flight that a new offload's would
        queue behind: on GPU caches offloads (the local store copies each direction on a
        thread of its own, so loads in flight leave the copy thread out idle), on CPU
        caches any (one thread runs both)."""
        if self._copy_stream is None:
            return bool(self._launched)
        return any(request.kind is _OFFLOAD for request in self._launched.values())

    def _match_head(self, requests: Sequence[Request]) -> tuple[list[int], int, list[Any]]:
        """An offload batch's requests to match (``wanted``), how many of them form its
        head (_head: 0 for none), and the answers of the head's matches (all of them
        without a head)."""
        wanted = to_match(requests, ())
        head = self._head(wanted)
        return wanted, head, self._match_puts(requests, wanted[:head] if head else wanted)

    def _match_puts(self, requests: Sequence[Request], wanted: list[int]) -> list[Any]:
        return self._calls.match(
            self._store.put_match, self._caps.put_match_many, requests, wanted
        )

    def _execute(self, plan: Round, outbox: Outbox) -> None:
        """Act on a planned round: its outcomes, its cancels, then its one launch."""
        outbox.extend(plan.outcomes)
        if plan.cancel:
            self._calls.cancel(plan.cancel)
        if plan.failed is not None:
            raise plan.failed  # the batch fails (see StoreWorker._handle)
        if not plan.launch:
            return
        launch_ids = plan.launch_ids
        self._slice.yield_if_used()
        try:
            self._calls.call(self._store.launch, launch_ids, plan.slots)
        except StoreError as error:
            # A launch that raised took none of them (the Store contract): they are
            # still matched, and would hold their blocks forever unless given back.
            self._calls.cancel(launch_ids)
            outbox.extend((entry[0], error) for entry in plan.launch)
            return
        launched = self._launched
        for request, task_id, mask, moved in plan.launch:
            request.task_id, request.mask, request.moved = task_id, mask, moved
            request.stage = LAUNCHED
            launched[task_id] = request
        # load_layerwise's callers hear of the launch, with the store's layer marks.
        note_launches((entry[0] for entry in plan.launch), self._caps.layer_marks)


def _own_id(requests: Sequence[Request], stream: Any) -> Callable[[int, int], int | None]:
    """A request's own page id at a position, for an error message only; None where the
    read fails (a broken device context): the message then names the clamped id, and the
    request still fails alone. A device tensor is read on ``stream`` (the fused copy's,
    which already waited for the callers' events), not the store thread's default
    stream: there the read would also wait for whatever the model queued since."""

    def own_id(index: int, position: int) -> int | None:
        page_ids = requests[index].page_ids
        if page_ids is None:
            return None
        try:
            with torch.cuda.stream(None if page_ids.is_cpu else stream):  # None: no switch
                return int(page_ids.reshape(-1)[position])
        except Exception:
            return None

    return own_id
