"""Store rounds planned without a store or a thread: the exactly-once rules on plans."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import aiokv
from aiokv.plans import Round, plan_load, plan_lookup, plan_offload, to_match
from aiokv.requests import Kind, LookupGrant, Request, Stage
from aiokv.stores.base import BoolArray, Int64Array

PAGE = 4
NUM_PAGES = 100


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


def _select(requests: Sequence[Request]) -> Any:
    """FusedPages.select over made-up slots: request i owns slots 1000*i..."""

    def select(masks: Sequence[BoolArray]) -> list[Int64Array]:
        out = []
        for index, (request, mask) in enumerate(zip(requests, masks, strict=True)):
            slots = np.arange(request.pages_used * PAGE, dtype=np.int64) + 1000 * index
            out.append(slots[np.flatnonzero(mask)] if mask.size else slots[:0])
        return out

    return select


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
    plan = plan_offload(requests, set(), answers, NUM_PAGES, PAGE, _select(requests))
    _ids_once(plan, {10, 11, 12})
    assert plan.launch_ids == [10] and plan.cancel == [12, 11]
    assert [len(s) for s in plan.slots] == [PAGE] and plan.slots[0][0] == PAGE
    assert plan.launch[0][3] == PAGE  # tokens it moves
    outcomes = dict((id(r), o) for r, o in plan.outcomes)
    assert outcomes[id(requests[1])] == aiokv.OffloadResult(requests[1].user_id, 0, 2 * PAGE)
    assert isinstance(outcomes[id(requests[3])], aiokv.StoreError)
    assert id(requests[0]) not in outcomes and id(requests[2]) not in outcomes
    assert plan.failed is None


def test_an_offload_with_a_bad_page_is_never_matched_and_fails_alone() -> None:
    requests = [_request(Kind.OFFLOAD, 1) for _ in range(3)]
    requests[2].stage = Stage.TERMINAL  # left before its match
    wanted = to_match(requests, {1})
    assert wanted == [0]
    answers: list[Any] = [(7, _suffix(1, 1)), None, None]
    plan = plan_offload(requests, {1}, answers, NUM_PAGES, PAGE, _select(requests))
    _ids_once(plan, {7})
    [(failed, error)] = plan.outcomes
    assert failed is requests[1] and isinstance(error, aiokv.InvalidRequest)
    assert "page_ids" in str(error)


def test_an_offload_matched_before_its_bad_pages_were_read_gives_its_match_back() -> None:
    requests = [_request(Kind.OFFLOAD, 1) for _ in range(2)]
    # The worker matches while the slots copy in flight, before it knows request 1's
    # page ids are out of range.
    answers: list[Any] = [(7, _suffix(1, 1)), (8, _suffix(1, 1))]
    plan = plan_offload(requests, {1}, answers, NUM_PAGES, PAGE, _select(requests))
    _ids_once(plan, {7, 8})
    assert plan.launch_ids == [7] and plan.cancel == [8]
    [(failed, error)] = plan.outcomes
    assert failed is requests[1] and isinstance(error, aiokv.InvalidRequest)


def test_a_load_round_consumes_every_reservation_once() -> None:
    requests = [
        _request(Kind.LOAD, 2, task_id=20, mask=~_suffix(2, 0)),
        _request(Kind.LOAD, 2, task_id=21, mask=~_suffix(2, 0)),  # bad pages
        _request(Kind.LOAD, 2, task_id=22, mask=~_suffix(2, 0), left=True),
    ]
    plan = plan_load(requests, {1}, NUM_PAGES, PAGE, _select(requests))
    _ids_once(plan, {20, 21, 22})
    assert plan.launch_ids == [20] and sorted(plan.cancel) == [21, 22]
    assert plan.slots[0].tolist() == list(range(2 * PAGE))
    [(failed, error)] = plan.outcomes
    assert failed is requests[1] and isinstance(error, aiokv.InvalidRequest)


def test_a_load_whose_reservation_an_evict_took_loads_nothing() -> None:
    requests = [
        _request(Kind.LOAD, 2, task_id=30, mask=~_suffix(2, 0)),
        _request(Kind.LOAD, 2, task_id=31, mask=~_suffix(2, 0)),  # its key was evicted
    ]
    plan = plan_load(requests, set(), NUM_PAGES, PAGE, _select(requests), gone={1})
    _ids_once(plan, {30})  # 31 is the store's no longer: neither launched nor cancelled
    assert plan.outcomes == [(requests[1], aiokv.LoadResult(requests[1].user_id, 0))]


def test_a_load_without_a_reservation_is_a_bug_not_a_launch() -> None:
    with pytest.raises(ValueError, match="reservation"):
        plan_load([_request(Kind.LOAD, 1)], set(), NUM_PAGES, PAGE, lambda masks: [])


def test_a_round_whose_slots_cannot_be_selected_cancels_all_it_matched() -> None:
    requests = [_request(Kind.OFFLOAD, 1) for _ in range(3)]
    requests[1].stage = Stage.TERMINAL

    def broken(masks: Sequence[BoolArray]) -> list[Int64Array]:
        raise IndexError("mask position past the slots")

    answers: list[Any] = [(1, _suffix(1, 1)), (2, _suffix(1, 1)), (3, _suffix(1, 0))]
    plan = plan_offload(requests, set(), answers, NUM_PAGES, PAGE, broken)
    assert isinstance(plan.failed, IndexError)
    assert plan.launch == [] and sorted(plan.cancel) == [1, 2, 3]
    assert plan.outcomes == []  # the worker fails what has no outcome with the batch


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
