"""Store rounds planned without a store or a thread: the exactly-once rules on plans."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np
import pytest

import aiokv
from aiokv.requests import Kind, LookupGrant, Request, Stage
from aiokv.stores.base import BoolArray, TaskResult, TaskStatus
from aiokv.worker.plans import Round, outcome, plan_load, plan_lookup, plan_offload, to_match

PAGE = 4


def _request(kind: Kind, pages: int, *, left: bool = False, task_id: int | None = None,
             mask: BoolArray | None = None) -> Request:
    request = Request(
        kind, f"u{id(object())}", concurrent.futures.Future(), pages * PAGE,
        np.arange(pages * PAGE, dtype=np.int64), ("ns",), None, pages,
    )
    request.task_id, request.mask = task_id, mask
    request.stage = Stage.TERMINAL if left else Stage.DISPATCHED
    return request


def _suffix(pages: int, new: int) -> BoolArray:
    mask = np.zeros(pages * PAGE, dtype=np.bool_)
    if new:
        mask[-new * PAGE:] = True
    return mask


def _ids_once(plan: Round, matched: set[int]) -> None:
    """Every matched id is cancelled or launched, exactly once."""
    given_back = plan.cancel + plan.launch_ids
    assert sorted(given_back) == sorted(matched)
    assert len(set(given_back)) == len(given_back)


def test_an_offload_round_launches_new_pages_and_cancels_the_rest() -> None:
    requests = [_request(Kind.OFFLOAD, 2) for _ in range(4)]
    requests[2].stage = Stage.TERMINAL  # left after its match
    answers: list[Any] = [(10, _suffix(2, 1)), (11, _suffix(2, 0)), (12, _suffix(2, 2)),
                          aiokv.StoreError("no")]
    assert to_match(requests) == [0, 1, 3]  # a caller that left is not asked
    plan = plan_offload(requests, answers, PAGE)
    _ids_once(plan, {10, 11, 12})
    assert plan.launch_ids == [10] and sorted(plan.cancel) == [11, 12]
    [move] = plan.launch
    # Its page view: the second of its two pages, a slice of the caller's tensor.
    assert (move.first, move.end, move.positions) == (1, 2, None)
    assert move.moved == PAGE and move.request is requests[0]
    outcomes = dict((id(r), o) for r, o in plan.outcomes)
    assert outcomes[id(requests[1])] == aiokv.OffloadResult(requests[1].user_id, 0, 2 * PAGE)
    assert isinstance(outcomes[id(requests[3])], aiokv.StoreError)
    assert id(requests[0]) not in outcomes and id(requests[2]) not in outcomes


def test_a_mask_with_holes_gets_an_index_and_one_past_the_pages_is_given_back() -> None:
    requests = [_request(Kind.OFFLOAD, 4) for _ in range(2)]
    holes = np.repeat(np.array([True, False, True, True]), PAGE)
    past = np.ones(5 * PAGE, dtype=np.bool_)  # a broken store: 5 pages for a request of 4
    plan = plan_offload(requests, [(1, holes), (2, past)], PAGE)
    _ids_once(plan, {1, 2})
    [move] = plan.launch
    assert move.positions is not None and move.positions.tolist() == [0, 2, 3]
    assert move.moved == 3 * PAGE
    [(failed, error)] = plan.outcomes
    assert failed is requests[1] and isinstance(error, aiokv.StoreError)
    assert plan.cancel == [2]


def test_a_load_round_consumes_every_reservation_once() -> None:
    requests = [
        _request(Kind.LOAD, 2, task_id=20, mask=~_suffix(2, 0)),
        _request(Kind.LOAD, 2, task_id=21, mask=~_suffix(2, 2)),  # nothing to load
        _request(Kind.LOAD, 2, task_id=22, mask=~_suffix(2, 0), left=True),
    ]
    plan = plan_load(requests, PAGE)
    _ids_once(plan, {20, 21, 22})
    assert plan.launch_ids == [20] and sorted(plan.cancel) == [21, 22]
    assert (plan.launch[0].first, plan.launch[0].end) == (0, 2)
    assert plan.outcomes == [(requests[1], aiokv.LoadResult(requests[1].user_id, 0))]


def test_a_load_whose_reservation_an_evict_took_loads_nothing() -> None:
    requests = [
        _request(Kind.LOAD, 2, task_id=30, mask=~_suffix(2, 0)),
        _request(Kind.LOAD, 2, task_id=31, mask=~_suffix(2, 0)),  # its key was evicted
    ]
    plan = plan_load(requests, PAGE, gone={1})
    _ids_once(plan, {30})  # 31 is the store's no longer: neither launched nor cancelled
    assert plan.outcomes == [(requests[1], aiokv.LoadResult(requests[1].user_id, 0))]


def test_a_load_without_a_reservation_is_a_bug_not_a_launch() -> None:
    with pytest.raises(ValueError, match="reservation"):
        plan_load([_request(Kind.LOAD, 1)], PAGE)


def test_an_invalid_task_fails_its_request_with_the_stores_words() -> None:
    request = _request(Kind.LOAD, 2, task_id=5, mask=~_suffix(2, 0))
    error = outcome(request, TaskResult(TaskStatus.INVALID, None, "holds 99, outside [0, 8)"), PAGE)
    assert isinstance(error, aiokv.InvalidRequest) and error.field == "page_ids"
    assert str(error) == "page_ids: holds 99, outside [0, 8)"


def test_a_lookup_round_reserves_hits_and_cancels_misses() -> None:
    requests = [_request(Kind.LOOKUP, 2) for _ in range(5)]
    requests[2].stage = Stage.TERMINAL  # a hit whose caller left since
    hit = ~_suffix(2, 1)
    answers: list[Any] = [(1, hit), (2, _suffix(2, 0)), (3, hit), None, aiokv.StoreError("x")]
    given_back: list[int] = []
    outcomes, cancel, reserved = plan_lookup(requests, answers, given_back.append)
    assert reserved == [1] and sorted(cancel) == [2, 3]
    grants = [o for _, o in outcomes]
    assert isinstance(grants[0], LookupGrant) and grants[0].cached_tokens == PAGE
    reservation = grants[0].reservation
    assert reservation is not None and reservation.task_id == 1 and reservation.mask is hit
    assert grants[1] == grants[2] == LookupGrant(None, 0)
    assert isinstance(grants[3], aiokv.StoreError) and len(outcomes) == 4
    reservation.release()
    reservation.release()  # idempotent: the store hears of it once
    assert given_back == [1]
