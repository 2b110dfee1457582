"""One batch's store round, on the store thread (:mod:`aiokv.worker.thread` runs it in inbox order).

An offload or load: one match call for the batch (an offload's ``put_match``es,
:class:`aiokv.worker.calls.StoreCalls`; a load's matches are its Lookups' reservations), the
round planned in one pure pass (:mod:`aiokv.worker.plans`: each request's task id, mask and page
view), then executed: cancels, then one ``launch(task_ids, pages, ready)`` with each
request's page view and ready event. The engine never reads page ids: the store makes
what it needs of them and checks them (a bad one fails its task INVALID). A lookup: its
matches, planned into outcomes and the reservations it keeps. The worker then polls the
launched ids until each is terminal.

Deadlines: nothing is launched past its request's deadline (checked last before the
launch; the caller hears RequestTimeout from the deadline's timer on the loop, and no
copy of its pages is queued after it), and a store that waits inside before it queues a
load's copy (:class:`~aiokv.stores.base.BoundsWaits`) is given each load's deadline, so
that it queues none after it either; a store whose lookup may wait inside
(:class:`~aiokv.stores.base.BoundsLookups`: ``aiokv store-server``) is given the lookup
batch's, so that the store thread is not held past it. Request deadlines are on the
loop's clock; the store thread reads them on ``time.monotonic()``'s
(:func:`aiokv.loop.deadlines.monotonic_offset_s`).

:class:`Rounds` shares its containers with the worker (the same objects, never replaced):
``launched`` (launched ids -> request, until terminal) and ``reserved`` (lookup matches
held for a load). Outcomes go to the outbox the worker passes in, which it posts.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import validate
from ..errors import InvalidRequest, StoreError
from ..invalidation import HeldKeys
from ..layerwise import note_launches
from ..loop.batcher import Batch
from ..requests import LAUNCHED, TERMINAL, Kind, Request
from ..space import NO_TIMEOUT_WAIT_S
from ..stores.base import Capabilities, MatchAnswers, Store
from .calls import StoreCalls
from .handoff import GilSlice
from .plans import Move, Round, plan_load, plan_lookup, plan_offload, to_match

_OFFLOAD = Kind.OFFLOAD  # a module global: read per batch

Outbox = list[tuple[Request, object]]


class Rounds:
    """Runs batches' store rounds (store thread only)."""

    def __init__(
        self,
        store: Store,
        caps: Capabilities,
        calls: StoreCalls,
        gil_slice: GilSlice,
        side_stream: Any,
        launched: dict[int, Request],
        reserved: set[int],
        held_keys: HeldKeys,
        release_one: Callable[[int], None],
        renew_capacity: Callable[[], None],
        clock_offset_s: float = 0.0,
    ) -> None:
        self._store = store
        self._caps = caps
        self._calls = calls
        self._slice = gil_slice
        # torch.cuda.Stream for a page view with holes on the device, or None (CPU caches)
        self._side_stream = side_stream
        self._launched = launched
        self._reserved = reserved
        self._held_keys = held_keys  # the reservations' keys, for an evict
        self._release_one = release_one  # a Reservation's way back (StoreWorker.release_one)
        self._offset_s = clock_offset_s  # time.monotonic() - the loop's time
        self.page_size = 0  # the store's, set by the worker once it is registered
        # The most tokens the store can hold (stores.base.capacity_tokens), set with
        # page_size; None: unknown. A lookup's key is cut to it (calls.key_ids) and a
        # longer offload refused (_within_capacity), once renew_capacity has asked again.
        self.capacity_tokens: int | None = None
        self._renew_capacity = renew_capacity

    def lookup(self, batch: Batch, outbox: Outbox) -> None:
        requests = batch.requests
        wanted = [i for i, r in enumerate(requests) if r.stage is not TERMINAL]
        many: Callable[..., MatchAnswers] | None = self._caps.get_match_many
        if many is not None and self._caps.bounds_lookups and wanted:
            many = functools.partial(many, deadline_s=self._lookup_deadline(requests, wanted))
        answers = self._calls.match(
            self._store.get_match, many, requests, wanted, self._lookup_bound(requests, wanted)
        )
        outcomes, cancel, reserved = plan_lookup(requests, answers, self._release_one)
        outbox.extend(outcomes)
        self._reserved.update(reserved)
        self._held_keys.note(outcomes, self._reserved)
        if cancel:
            self._calls.cancel(cancel)

    def _lookup_bound(self, requests: Sequence[Request], wanted: list[int]) -> int | None:
        """The most tokens of each key the store is asked about (``capacity_tokens``).
        Where a lookup is longer, the bound is asked of the store again first: the figures
        it was taken from may be those of a store server since restarted with larger
        tiers, which holds more of the key. Asked before the match, not after a match cut
        to the old bound hit to its end: a second match of the key, its first given back,
        made the store count that lookup's hit twice (its host_hit_tokens)."""
        limit = self.capacity_tokens
        if limit is None or all(requests[i].num_tokens <= limit for i in wanted):
            return limit
        self._renew_capacity()
        return self.capacity_tokens

    def move(self, batch: Batch, outbox: Outbox) -> None:
        """Offload (put) or load (get) batch: one match call, one plan, one launch."""
        requests, page_size = batch.requests, self.page_size
        if batch.kind is _OFFLOAD:
            wanted = self._within_capacity(requests, to_match(requests), outbox)
            answers = self._calls.match(
                self._store.put_match, self._caps.put_match_many, requests, wanted
            )
            if any(isinstance(answer, InvalidRequest) for answer in answers):
                # The store refused a put as more than it can ever hold (TooLarge): the
                # figures the bound is from may be a store server's since restarted with
                # a smaller host tier. Asked again before the refusal is answered, so
                # that a caller who cuts its offloads to the figures (the recsys
                # adapter) finds the new ones once it learns of it.
                self._renew_capacity()
            plan = plan_offload(requests, answers, page_size)
        else:
            # Every load consumes its reservation here: launched or cancelled below,
            # unless an evict or clear gave it back already.
            reserved = self._reserved
            gone = [i for i, r in enumerate(requests) if r.task_id not in reserved]
            reserved.difference_update([r.task_id for r in requests])
            plan = plan_load(requests, page_size, gone)
        self._execute(plan, outbox, batch.kind is not _OFFLOAD)

    def _within_capacity(self, requests: Sequence[Request], wanted: list[int], outbox: Outbox
                         ) -> list[int]:
        """``wanted`` less the offloads of more full pages than the store's tiers can ever
        hold (``capacity_tokens``), each answered InvalidRequest naming ``num_tokens``.
        Before any is refused, the bound is asked of the store again (``renew_capacity``):
        the figures it was taken from may be those of a store server since restarted with
        larger tiers, which an engine making only such offloads would otherwise never ask
        again."""
        page_size = self.page_size
        if self.capacity_tokens is None or all(
                requests[i].pages_used * page_size <= self.capacity_tokens for i in wanted):
            return wanted
        self._renew_capacity()
        kept = []
        for index in wanted:
            request = requests[index]
            try:
                validate.store_holds(request.num_tokens, request.pages_used, page_size,
                                     self.capacity_tokens)
            except InvalidRequest as error:
                outbox.append((request, error))
            else:
                kept.append(index)
        return kept

    def _execute(self, plan: Round, outbox: Outbox, loads: bool) -> None:
        """Act on a planned round: its outcomes, its cancels, then its one launch (with
        the loads' deadlines first, for a store that takes them)."""
        outbox.extend(plan.outcomes)
        if plan.cancel:
            self._calls.cancel(plan.cancel)
        if not plan.launch:
            return
        try:
            views = [self._view(move) for move in plan.launch]
        except Exception:
            self._calls.cancel(plan.launch_ids)  # matched, never launched: given back
            raise  # the batch fails (see StoreWorker._handle)
        self._slice.yield_if_used()
        moves, views = self._launchable(plan.launch, views, offloads=not loads)
        if not moves:
            return
        launch_ids = [move.task_id for move in moves]
        set_deadlines = self._caps.set_deadlines if loads else None
        try:
            if set_deadlines is not None:
                self._calls.call(set_deadlines, launch_ids, self._store_deadlines(moves))
            self._calls.call(
                self._store.launch, launch_ids, [v[0] for v in views], [v[1] for v in views]
            )
        except StoreError as error:
            # A launch that raised took none of them (the Store contract): they are
            # still matched, and would hold their blocks forever unless given back.
            self._calls.cancel(launch_ids)
            outbox.extend((move.request, error) for move in moves)
            return
        launched = self._launched
        for move in moves:
            request = move.request
            request.task_id, request.mask, request.moved = move.task_id, move.mask, move.moved
            request.stage = LAUNCHED
            launched[move.task_id] = request
        # load_layerwise's callers hear of the launch, with the store's layer marks.
        note_launches((move.request for move in moves), self._caps.layer_marks)

    def _launchable(
        self, moves: list[Move], views: list[tuple[torch.Tensor, Any]], offloads: bool
    ) -> tuple[list[Move], list[tuple[torch.Tensor, Any]]]:
        """The moves (and views) to launch, read just before the launch (the GIL may have
        been with the loop until now); the others are given back, unlaunched:

        - those whose request's deadline has passed, unanswered: their deadline's timer on
          the loop answers them (RequestTimeout, as it would a late answer: this one found
          room);
        - offloads whose caller left since the plan. Each request's task id is written
          first, then its stage read; the loop detaches a caller
          (resolution.Resolver.detach) in the other order, stage then id: so it finds the
          id of every offload launched after it left, and the store drops what that copy
          read (stores.base.Detaches)."""
        if offloads:
            for move in moves:
                move.request.task_id = move.task_id
        now = time.monotonic() - self._offset_s  # on the loop's clock, as Request.deadline
        back = [i for i, m in enumerate(moves)
                if ((d := m.request.deadline) is not None and d <= now)
                or (offloads and m.request.stage is TERMINAL)]
        if not back:
            return moves, views
        self._calls.cancel([moves[i].task_id for i in back])
        kept = sorted(set(range(len(moves))).difference(back))
        return [moves[i] for i in kept], [views[i] for i in kept]

    def _lookup_deadline(self, requests: Sequence[Request], wanted: list[int]) -> float | None:
        """A lookup batch's deadline for the store (stores.base.BoundsLookups), on
        time.monotonic()'s clock: the latest of its waiting requests' (an answer after it
        serves none of them, and every call behind it waits for it), None where one has
        none (the store's own limit then)."""
        latest = 0.0
        for index in wanted:
            deadline = requests[index].deadline
            if deadline is None:
                return None
            latest = max(latest, deadline)
        return latest + self._offset_s

    def _store_deadlines(self, moves: Sequence[Move]) -> list[float]:
        """Each load's deadline for the store, on time.monotonic()'s clock: its request's,
        or NO_TIMEOUT_WAIT_S from now without request_timeout_ms (then the caller is told
        a StoreError, not RequestTimeout, should the store give up)."""
        offset = self._offset_s
        unbounded = time.monotonic() + NO_TIMEOUT_WAIT_S
        return [unbounded if (d := m.request.deadline) is None else d + offset for m in moves]

    def _view(self, move: Move) -> tuple[torch.Tensor, Any]:
        """A task's page ids and the event they are ready after: a slice of the caller's
        tensor (a view, no GPU work), or where its mask has holes an index of it, made on
        the side stream after the caller's event (never on this thread's stream, which
        would also wait for what the model queued since), with an event of its own."""
        page_ids, ready = move.request.page_ids, move.request.ready_event
        if page_ids is None:
            raise ValueError("a request to move holds no page ids")
        if move.positions is None:
            return page_ids[move.first : move.end], ready
        index = torch.from_numpy(move.positions)
        stream = self._side_stream
        if page_ids.is_cpu or stream is None:
            return page_ids[index], ready
        if ready is not None:
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            view = page_ids[index.to(page_ids.device, non_blocking=True)]
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        return view, done
