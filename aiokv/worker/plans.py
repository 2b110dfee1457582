"""Store rounds, decided before they are acted on: pure functions, no store call, no thread.

The store thread (:mod:`aiokv.worker.rounds`) asks the store for its match answers, hands them
here with the batch, and executes the :class:`Round` that comes back: post ``outcomes``,
cancel what ``cancel`` lists, launch ``launch`` in one call, each entry with its page view
(:class:`Move`). The exactly-once rule of the Store contract lives here, where a unit test
can read it off a plan: every id a match gave is either in ``cancel`` or in ``launch``,
never both, never twice.

- An offload's id comes from its ``put_match`` answer; a load's from its Lookup's
  reservation, which the load consumes whether it launches or not.
- A caller that left (its request TERMINAL) after its match is cancelled, not launched.
- A match with nothing to move is cancelled and succeeds at once with 0 tokens.
- Page ids are not read here: the store checks them (a bad one ends its task INVALID).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidRequest, RequestTimeout, StoreError
from ..requests import (
    TERMINAL,
    Kind,
    LoadResult,
    LookupGrant,
    OffloadResult,
    Request,
    Reservation,
)
from ..stores.base import BoolArray, Int64Array, TaskResult, TaskStatus

# A request's match as the store answered it: (task id, mask), its translated error (an
# InvalidRequest for a put the store could never take), or None where it was not asked (a
# caller that left before the match).
Answer = tuple[int, BoolArray] | StoreError | InvalidRequest | None

NO_MASK: BoolArray = np.zeros(0, dtype=np.bool_)  # the mask of a request not launched
_MISS = LookupGrant(None, 0)
_OFFLOAD, _SUCCESS, _CANCELLED = Kind.OFFLOAD, TaskStatus.SUCCESS, TaskStatus.CANCELLED
_INVALID, _EXPIRED = TaskStatus.INVALID, TaskStatus.EXPIRED


@dataclass(slots=True)
class Move:
    """One launched task: its request, id and mask, the tokens it moves, and its page
    view: ``request.page_ids[first:end]`` where the mask's True pages are one run (store
    masks are: a suffix for puts, a prefix for gets), else those at ``positions``."""

    request: Request
    task_id: int
    mask: BoolArray
    moved: int
    first: int
    end: int
    positions: Int64Array | None = None


@dataclass(slots=True)
class Round:
    """What one store round does, in this order: post ``outcomes`` (they are final),
    cancel ``cancel``, launch ``launch`` in one call."""

    outcomes: list[tuple[Request, object]] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    launch: list[Move] = field(default_factory=list)

    @property
    def launch_ids(self) -> list[int]:
        return [move.task_id for move in self.launch]


def to_match(requests: Sequence[Request]) -> list[int]:
    """Indexes of the offloads to ask ``put_match`` for: their callers still wait."""
    return [i for i, r in enumerate(requests) if r.stage is not TERMINAL]


def plan_offload(requests: Sequence[Request], answers: Sequence[Answer], page_size: int) -> Round:
    """The round of an offload batch, from each request's ``put_match`` answer (by batch
    index)."""
    plan = Round()
    for request, answer in zip(requests, answers, strict=True):
        if answer is None:
            continue  # never matched: nothing to give back
        if isinstance(answer, (StoreError, InvalidRequest)):
            plan.outcomes.append((request, answer))
        elif request.stage is TERMINAL:  # left since its match: given back, not launched
            plan.cancel.append(answer[0])
        else:
            _plan_move(plan, request, answer[0], answer[1], page_size)
    return plan


def plan_load(
    requests: Sequence[Request], page_size: int, gone: Collection[int] = ()
) -> Round:
    """The round of a load batch: each request launches its Lookup's reservation
    (``request.task_id``, ``request.mask``) into its pages, or gives it back. ``gone``:
    indexes whose reservation an evict or clear already gave back (aiokv.invalidation):
    they load nothing, at once."""
    plan = Round()
    for index, request in enumerate(requests):
        task_id, mask = request.task_id, request.mask
        if task_id is None or mask is None:
            raise ValueError(f"load request {index} holds no reservation")
        if index in gone:  # nothing of it is in the store any more: a miss
            plan.outcomes.append((request, success(request, 0, page_size)))
        elif request.stage is TERMINAL:  # the caller left: the reservation goes back
            plan.cancel.append(task_id)
        else:
            _plan_move(plan, request, task_id, mask, page_size)
    return plan


def _plan_move(
    plan: Round, request: Request, task_id: int, mask: BoolArray, page_size: int
) -> None:
    """Launch the task with its page view, or cancel it: at once with 0 tokens when its
    mask has nothing to move, with a StoreError when the mask reaches past the request's
    pages (a store that broke its contract)."""
    pages = mask[::page_size]  # masks are page aligned: one entry per page
    count = int(np.count_nonzero(pages))
    if count == 0:
        plan.cancel.append(task_id)
        plan.outcomes.append((request, success(request, 0, page_size)))
        return
    first = int(pages.argmax())  # argmax + a count: cheaper than flatnonzero per request
    end = first + count
    positions = None
    if end > len(pages) or np.count_nonzero(pages[first:end]) != count:
        positions = np.flatnonzero(pages)  # holes: an index, not a slice
        end = int(positions[-1]) + 1
    if end > request.pages_used:
        plan.cancel.append(task_id)
        plan.outcomes.append((request, StoreError(
            f"the store's mask of task {task_id} names page {end - 1} of a request "
            f"of {request.pages_used} pages"
        )))
        return
    plan.launch.append(Move(request, task_id, mask, count * page_size, first, end, positions))


def plan_lookup(
    requests: Sequence[Request],
    answers: Sequence[Answer],
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
        if isinstance(answer, (StoreError, InvalidRequest)):
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
    if result.status is _INVALID:  # the caller's page ids: its own fault, named
        return InvalidRequest("page_ids", result.error)
    if result.status is _CANCELLED:
        return StoreError(f"the store cancelled task {request.task_id}: {result.error}")
    if result.status is _EXPIRED:  # the deadline the engine gave it (BoundsWaits)
        if request.deadline is not None:  # the caller's own, as its timer would say
            return RequestTimeout(
                f"{request.kind.name.lower()} not done within engine.request_timeout_ms "
                f"(the store: {result.error})"
            )
        return StoreError(f"task {request.task_id} gave up in the store: {result.error}")
    return StoreError(f"task {request.task_id} failed in the store: {result.error}")
