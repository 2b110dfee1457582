"""Store rounds, decided before they are acted on: pure functions, no store call, no thread.

The store thread (:mod:`aiokv.worker`) asks the store for its match answers, hands them
here with the batch, and executes the :class:`Round` that comes back: cancel what
``cancel`` lists, launch ``launch`` in one call, post ``outcomes``. The exactly-once rule
of the Store contract lives here, where a unit test can read it off a plan: every id a
match gave is either in ``cancel`` or in ``launch``, never both, never twice.

- An offload's id comes from its ``put_match`` answer; a load's from its Lookup's
  reservation, which the load consumes whether it launches or not.
- A request with a bad page id fails with InvalidRequest; a load's reservation is then
  cancelled (an offload with a bad page id was never matched).
- A caller that left (its request TERMINAL) after its match is cancelled, not launched.
- A match with nothing to move is cancelled and succeeds at once with 0 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest, StoreError
from .requests import (
    TERMINAL,
    Kind,
    LoadResult,
    LookupGrant,
    OffloadResult,
    Request,
    Reservation,
)
from .stores.base import BoolArray, Int64Array, TaskResult, TaskStatus

# A request's match as the store answered it: (task id, mask), its translated error, or
# None where it was not asked (a bad page id, a caller that left before the match).
Answer = tuple[int, BoolArray] | StoreError | None
# Every request's slots of exactly its mask's True positions (FusedPages.select, bound).
Select = Callable[[Sequence[BoolArray]], list[Int64Array]]

NO_MASK: BoolArray = np.zeros(0, dtype=np.bool_)  # the mask of a request not launched
_MISS = LookupGrant(None, 0)
_OFFLOAD, _SUCCESS, _CANCELLED = Kind.OFFLOAD, TaskStatus.SUCCESS, TaskStatus.CANCELLED


@dataclass(slots=True)
class Round:
    """What one store round does, in this order: post ``outcomes`` (they are final),
    cancel ``cancel``, launch ``launch`` (request, task id, mask, True positions) with
    ``slots`` in one call. ``failed``: the batch cannot go on (its slots could not be
    selected): cancel, then fail the requests without an outcome with it."""

    outcomes: list[tuple[Request, object]] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    launch: list[tuple[Request, int, BoolArray, int]] = field(default_factory=list)
    slots: list[Int64Array] = field(default_factory=list)
    failed: Exception | None = None

    @property
    def launch_ids(self) -> list[int]:
        return [entry[1] for entry in self.launch]


def to_match(requests: Sequence[Request], bad: Collection[int]) -> list[int]:
    """Indexes of the offloads to ask ``put_match`` for: page ids valid, caller waiting."""
    return [i for i, r in enumerate(requests) if i not in bad and r.stage is not TERMINAL]


def plan_offload(
    requests: Sequence[Request],
    bad: Collection[int],
    answers: Sequence[Answer],
    num_pages: int,
    page_size: int,
    select: Select,
) -> Round:
    """The round of an offload batch, from each request's ``put_match`` answer (by batch
    index) and the indexes whose page ids are out of range."""
    plan = Round()
    matched: list[tuple[Request, int, BoolArray] | None] = [None] * len(requests)
    for index, request in enumerate(requests):
        answer = answers[index]
        if index in bad:
            plan.outcomes.append((request, _bad_pages(bad, index, num_pages)))
            if answer is not None and not isinstance(answer, StoreError):
                plan.cancel.append(answer[0])  # matched before its page ids were read
            continue
        if answer is None:
            continue  # never matched: nothing to give back
        if isinstance(answer, StoreError):
            plan.outcomes.append((request, answer))
            continue
        if request.stage is TERMINAL:  # left since its match: given back, not launched
            plan.cancel.append(answer[0])
        else:
            matched[index] = (request, answer[0], answer[1])
    return _launch_plan(plan, matched, page_size, select)


def plan_load(
    requests: Sequence[Request],
    bad: Collection[int],
    num_pages: int,
    page_size: int,
    select: Select,
    gone: Collection[int] = (),
) -> Round:
    """The round of a load batch: each request launches its Lookup's reservation
    (``request.task_id``, ``request.mask``) into its pages, or gives it back. ``gone``:
    indexes whose reservation an evict or clear already gave back (aiokv.invalidation):
    they load nothing, at once."""
    plan = Round()
    matched: list[tuple[Request, int, BoolArray] | None] = [None] * len(requests)
    for index, request in enumerate(requests):
        task_id, mask = request.task_id, request.mask
        if task_id is None or mask is None:
            raise ValueError(f"load request {index} holds no reservation")
        if index in gone:  # nothing of it is in the store any more: a miss
            plan.outcomes.append((request, success(request, 0, page_size)))
            continue
        if index in bad:
            plan.outcomes.append((request, _bad_pages(bad, index, num_pages)))
            plan.cancel.append(task_id)
            continue
        if request.stage is TERMINAL:  # the caller left: the reservation goes back
            plan.cancel.append(task_id)
        else:
            matched[index] = (request, task_id, mask)
    return _launch_plan(plan, matched, page_size, select)


def plan_lookup(
    requests: Sequence[Request],
    answers: Sequence[tuple[int, BoolArray] | StoreError | None],
    give_back: Callable[[int], None],
) -> tuple[list[tuple[Request, object]], list[int], list[int]]:
    """(outcomes, ids to cancel, ids now reserved) of a lookup batch, from each request's
    ``get_match`` answer (None: the caller left before it was asked). A hit is reserved
    for a load (a :class:`Reservation` that ``give_back`` returns to the store when
    released); a miss, or a hit whose caller left meanwhile, is cancelled."""
    outcomes: list[tuple[Request, object]] = []
    cancel: list[int] = []
    reserved: list[int] = []
    for request, answer in zip(requests, answers, strict=True):
        if answer is None:
            continue
        if isinstance(answer, StoreError):
            outcomes.append((request, answer))
            continue
        task_id, mask = answer
        hit = int(np.count_nonzero(mask))
        if hit == 0 or request.stage is TERMINAL:
            cancel.append(task_id)
            outcomes.append((request, _MISS))
        else:
            reserved.append(task_id)
            end = len(mask) - int(np.argmax(mask[::-1]))  # past the last True: a load's pages
            outcomes.append(
                (request, LookupGrant(Reservation(task_id, mask, give_back, end), hit))
            )
    return outcomes, cancel, reserved


def success(request: Request, moved: int, page_size: int) -> OffloadResult | LoadResult:
    """A request's result when its task moved ``moved`` tokens."""
    if request.kind is _OFFLOAD:
        cached = request.num_tokens // page_size * page_size
        return OffloadResult(request.user_id, moved, cached)
    return LoadResult(request.user_id, moved)


def outcome(request: Request, result: TaskResult, page_size: int) -> object:
    """A launched request's outcome from its task's terminal answer."""
    if result.status is _SUCCESS:
        # A store may report the moved positions itself (FlexKV's per-sub-task masks).
        mask = result.mask
        moved = (
            request.moved if mask is None or mask is request.mask else int(np.count_nonzero(mask))
        )
        return success(request, moved, page_size)
    if result.status is _CANCELLED:
        return StoreError(f"the store cancelled task {request.task_id}: {result.error}")
    return StoreError(f"task {request.task_id} failed in the store: {result.error}")


def _bad_pages(bad: Collection[int], index: int, num_pages: int) -> Exception:
    """Request ``index``'s error: its own when ``bad`` maps indexes to errors (they name
    the bad value: FusedPages.page_errors)."""
    if isinstance(bad, Mapping):
        error: Exception = bad[index]
        return error
    return InvalidRequest("page_ids", f"holds a page id outside [0, {num_pages})")


def _launch_plan(
    plan: Round,
    matched: list[tuple[Request, int, BoolArray] | None],
    page_size: int,
    select: Select,
) -> Round:
    """Select every candidate's slots for the whole batch at once, then launch those with
    something to move and cancel (and answer at once) those with nothing."""
    masks = [NO_MASK if entry is None else entry[2] for entry in matched]
    try:
        selected = select(masks)
    except Exception as exc:
        # What it matched must not stay matched: everything is cancelled, nothing launched.
        plan.cancel.extend(entry[1] for entry in matched if entry is not None)
        plan.failed = exc
        return plan
    for entry, request_slots in zip(matched, selected, strict=True):
        if entry is None:
            continue
        request, task_id, mask = entry
        moved = len(request_slots)  # the mask's True positions
        if moved == 0:
            plan.cancel.append(task_id)
            plan.outcomes.append((request, success(request, 0, page_size)))
            continue
        plan.launch.append((request, task_id, mask, moved))
        plan.slots.append(request_slots)
    return plan
