"""The engine end to end on the embedded store: batching, dedup, round trips, growth."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store

import aiokv
from aiokv.testing import CheckingStore


def checked_engine(
    caches: list[torch.Tensor], **config: int | str
) -> tuple[aiokv.OffloadEngine, CheckingStore]:
    store = CheckingStore(small_store(), loop_thread=threading.get_ident())
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(**config))  # type: ignore[arg-type]
    return engine, store


@pytest.mark.asyncio
async def test_one_window_is_one_batch_with_one_launch(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches, window_us=50_000)
    async with engine:
        results = await asyncio.gather(
            *(engine.offload(u, torch.arange(4 * u, 4 * u + 4), 16) for u in range(8))
        )
        stats = engine.stats()
    assert [r.stored_tokens for r in results] == [16] * 8
    assert stats.batches == 1
    assert store.calls["put_match"] == 8
    assert store.calls["launch"] == 1
    assert stats.d2h_copies == 0  # CPU page ids need no device copy
    assert store.problems() == []


@pytest.mark.asyncio
async def test_max_batch_requests_splits_and_flushes_early(caches: list[torch.Tensor]) -> None:
    # A window of 10 s: only the request limit can flush it before the test times out.
    engine, store = checked_engine(caches, window_us=10_000_000, max_batch_requests=4)
    async with engine:
        await asyncio.wait_for(
            asyncio.gather(*(engine.offload(u, torch.arange(4 * u, 4 * u + 4), 16) for u in range(8))),
            timeout=5,
        )
        assert engine.stats().batches == 2
    assert store.calls["launch"] == 2
    assert store.problems() == []


@pytest.mark.asyncio
async def test_max_batch_tokens_bounds_each_batch(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches, window_us=10_000_000, max_batch_tokens=32)
    async with engine:
        await asyncio.wait_for(
            asyncio.gather(*(engine.offload(u, torch.arange(4 * u, 4 * u + 4), 16) for u in range(4))),
            timeout=5,
        )
        assert engine.stats().batches == 2  # 16 + 16 tokens per batch
    assert store.problems() == []


@pytest.mark.asyncio
async def test_window_zero_flushes_on_next_iteration(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches, window_us=0)
    async with engine:
        result = await asyncio.wait_for(engine.offload("u", torch.arange(4), 16), timeout=5)
    assert result.stored_tokens == 16
    assert store.problems() == []


@pytest.mark.asyncio
async def test_stored_prefix_is_deduplicated(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches)
    async with engine:
        first = await engine.offload("u", torch.arange(4), 16)
        again = await engine.offload("u", torch.arange(4), 16)
        launches = store.calls["launch"]
    assert (first.stored_tokens, first.cached_tokens) == (16, 16)
    assert (again.stored_tokens, again.cached_tokens) == (0, 16)
    assert launches == 1  # the second offload was cancelled, not launched
    assert store.problems() == []


@pytest.mark.asyncio
async def test_history_growth_writes_only_new_full_pages(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches)
    pages = torch.arange(10)
    async with engine:
        a = await engine.offload("u", pages, 2 * PAGE_SIZE + 1)  # 2 full pages + 1 token
        b = await engine.offload("u", pages, 5 * PAGE_SIZE)
        c = await engine.offload("u", pages, 5 * PAGE_SIZE + 3)
        hit = await engine.lookup("u", 10 * PAGE_SIZE)
        hit.release()
    assert (a.stored_tokens, a.cached_tokens) == (2 * PAGE_SIZE, 2 * PAGE_SIZE)
    assert (b.stored_tokens, b.cached_tokens) == (3 * PAGE_SIZE, 5 * PAGE_SIZE)
    assert (c.stored_tokens, c.cached_tokens) == (0, 5 * PAGE_SIZE)
    assert hit.cached_tokens == 5 * PAGE_SIZE
    assert store.problems() == []


@pytest.mark.asyncio
async def test_round_trip_many_ragged_users_is_bit_exact() -> None:
    caches = make_caches(pages=512)
    original = [c.clone() for c in caches]
    rng = np.random.default_rng(7)
    users = 40
    lengths = rng.integers(1, 6 * PAGE_SIZE, size=users)  # ragged, many with partial pages
    source = rng.permutation(256)[: users * 6].reshape(users, 6)  # scattered source pages
    engine, store = checked_engine(caches, window_us=1000)
    async with engine:
        offloads = await asyncio.gather(
            *(engine.offload(u, torch.from_numpy(source[u]), int(lengths[u])) for u in range(users))
        )
        hits = await asyncio.gather(*(engine.lookup(u, int(lengths[u])) for u in range(users)))
        targets = [torch.arange(256 + 6 * u, 256 + 6 * u + 6) for u in range(users)]
        loads = await asyncio.gather(*(engine.load(h, t) for h, t in zip(hits, targets, strict=False)))
        stats = engine.stats()
    for u in range(users):
        full = int(lengths[u]) // PAGE_SIZE
        assert offloads[u].stored_tokens == full * PAGE_SIZE
        assert hits[u].cached_tokens == full * PAGE_SIZE
        assert loads[u].loaded_tokens == full * PAGE_SIZE
        for layer in range(len(caches)):
            got = caches[layer][targets[u][:full]]
            want = original[layer][torch.from_numpy(source[u][:full])]
            assert torch.equal(got, want), f"user {u} layer {layer}"
    assert stats.pending == 0 and stats.store_tasks_open == 0
    # A load of an empty hit returns at once, without a store round, and is counted as such.
    with_pages = int((lengths >= PAGE_SIZE).sum())
    assert stats.completed == 3 * users and stats.empty_loads == users - with_pages
    assert store.problems() == []


@pytest.mark.asyncio
async def test_namespaces_and_token_ids_separate_keys(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches)
    tokens = np.arange(100, 116, dtype=np.int64)
    async with engine:
        await engine.offload("a", torch.arange(4), 16, token_ids=tokens, namespace=["tenant1"])
        same = await engine.lookup("b", 16, token_ids=tokens, namespace=["tenant1"])
        other_ns = await engine.lookup("b", 16, token_ids=tokens, namespace=["tenant2"])
        other_tokens = await engine.lookup("a", 16, namespace=["tenant1"])  # positions
        for hit in (same, other_ns, other_tokens):
            hit.release()
    assert same.cached_tokens == 16
    assert other_ns.cached_tokens == 0
    assert other_tokens.cached_tokens == 0
    assert store.problems() == []


@pytest.mark.asyncio
async def test_gets_dispatch_before_puts_in_a_window(caches: list[torch.Tensor]) -> None:
    engine, store = checked_engine(caches, window_us=50_000)
    order: list[str] = []
    inner_put, inner_get = store.put_match, store.get_match

    def put_match(*args: object) -> object:
        order.append("put")
        return inner_put(*args)  # type: ignore[arg-type]

    def get_match(*args: object) -> object:
        order.append("get")
        return inner_get(*args)  # type: ignore[arg-type]

    store.put_match, store.get_match = put_match, get_match  # type: ignore[method-assign,assignment]
    async with engine:
        offload = asyncio.ensure_future(engine.offload("u", torch.arange(4), 16))
        await asyncio.sleep(0)
        lookup = asyncio.ensure_future(engine.lookup("v", 16))
        await asyncio.gather(offload, lookup)
        (await lookup).release()
    assert order == ["get", "put"]


def _batcher_rig(**config: int) -> tuple[Any, list[Any], list[Any]]:
    from aiokv.loop.batcher import Batcher

    submitted: list[Any] = []
    failed: list[Any] = []
    batcher = Batcher(
        aiokv.EngineConfig(**config),  # type: ignore[arg-type]
        submitted.append,
        lambda request: None,
        lambda batch: None,
        lambda requests, exc: failed.append((list(requests), exc)),
    )
    return batcher, submitted, failed


def _dispatch_budget(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    from aiokv.loop import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "DISPATCH_BUDGET_S", seconds)


def _lookup_request(user: int) -> Any:
    from aiokv.requests import Kind, Request

    loop = asyncio.get_running_loop()
    return Request(Kind.LOOKUP, user, loop.create_future(), 16, None, (f"n{user}",), None, 0)


@pytest.mark.asyncio
async def test_a_full_queue_goes_to_the_store_from_the_enqueue_that_filled_it() -> None:
    batcher, submitted, _ = _batcher_rig(window_us=10_000_000, max_batch_requests=4)
    for user in range(4):
        batcher.enqueue(_lookup_request(user))
    # No loop iteration has run: waking the batcher task would put it behind every
    # submit already scheduled.
    assert [len(batch.requests) for batch in submitted] == [4]
    assert len(batcher) == 0


@pytest.mark.asyncio
async def test_a_burst_of_full_batches_goes_out_one_per_loop_iteration_past_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _dispatch_budget(monkeypatch, 0.0)  # every dispatch is over it
    dropped: list[Any] = []
    batcher, submitted, _ = _batcher_rig(window_us=10_000_000, max_batch_requests=4)
    batcher._on_dropped = dropped.append
    task = asyncio.ensure_future(batcher.run())
    try:
        burst = [_lookup_request(user) for user in range(12)]
        for request in burst:
            batcher.enqueue(request)
        # One loop iteration's burst: only the first full batch left during it.
        assert [len(batch.requests) for batch in submitted] == [4]
        assert len(batcher) == 8
        burst[9].future.cancel()  # its caller leaves before its batch is sent
        sent_per_iteration = []
        for _ in range(6):
            before = len(submitted)
            await asyncio.sleep(0)
            sent_per_iteration.append(len(submitted) - before)
        assert max(sent_per_iteration) == 1
        assert [len(batch.requests) for batch in submitted] == [4, 4, 3]
        assert dropped == [burst[9]]
        assert len(batcher) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_cheap_batches_of_a_burst_all_go_out_within_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _dispatch_budget(monkeypatch, 60.0)
    batcher, submitted, _ = _batcher_rig(window_us=10_000_000, max_batch_requests=4)
    for user in range(12):
        batcher.enqueue(_lookup_request(user))
    assert [len(batch.requests) for batch in submitted] == [4, 4, 4]
    assert len(batcher) == 0


def _resolve_budget(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    from aiokv.loop import resolution

    monkeypatch.setattr(resolution, "RESOLVE_BUDGET_S", seconds)


async def _admitted_offloads(
    engine: aiokv.OffloadEngine, count: int
) -> tuple[list[Any], list[asyncio.Task[Any]]]:
    """Offload requests the engine counts as live, without queueing them: the test posts
    their outcomes itself, as the store thread would. Each is awaited by a caller's task,
    which counts its outcome as it takes it."""
    from aiokv.requests import Kind

    requests = [
        engine._new_request(Kind.OFFLOAD, user, 16, None, None, torch.arange(4), 4)
        for user in range(count)
    ]
    callers = [asyncio.ensure_future(engine._run(request)) for request in requests]
    await asyncio.sleep(0)  # the callers' first steps (accepted), before the batcher's
    assert len(engine._batcher.take_queued()) == count  # type: ignore[union-attr]
    return requests, callers


@pytest.mark.asyncio
async def test_outcomes_past_the_budget_resolve_in_order_over_later_iterations(
    aiokv_engine: aiokv.OffloadEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _resolve_budget(monkeypatch, 0.0)  # every outcome is over it: one per callback
    engine = aiokv_engine  # the plugin's: closed after the test, which fails if it leaked
    requests, callers = await _admitted_offloads(engine, 6)
    outcomes = [aiokv.OffloadResult(r.user_id, 16, 16) for r in requests]
    engine._resolver.deliver(list(zip(requests[:4], outcomes[:4], strict=True)))
    engine._resolver.deliver(list(zip(requests[4:], outcomes[4:], strict=True)))  # waits its turn
    resolved_per_iteration = [sum(r.future.done() for r in requests)]
    while resolved_per_iteration[-1] < len(requests):
        await asyncio.sleep(0)
        resolved_per_iteration.append(sum(r.future.done() for r in requests))
    assert resolved_per_iteration == [1, 2, 3, 4, 5, 6]
    assert await asyncio.gather(*callers) == outcomes
    assert engine.stats().completed == 6


@pytest.mark.asyncio
async def test_a_resolution_that_raises_does_not_strand_the_outcomes_after_it(
    aiokv_engine: aiokv.OffloadEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _resolve_budget(monkeypatch, 0.0)
    loop = asyncio.get_running_loop()
    errors: list[Any] = []
    loop.set_exception_handler(lambda loop, context: errors.append(context["exception"]))
    engine = aiokv_engine  # closed after the test; a leak fails it
    requests, callers = await _admitted_offloads(engine, 4)
    outcomes = [aiokv.OffloadResult(r.user_id, 16, 16) for r in requests]
    resolver = engine._resolver
    assert resolver is not None
    resolve = resolver.resolve

    def resolve_but_fail_the_second(request: Any, outcome: object) -> None:
        if request is requests[1]:
            raise RuntimeError("a bug in resolving")
        resolve(request, outcome)

    monkeypatch.setattr(resolver, "resolve", resolve_but_fail_the_second)
    resolver.deliver(list(zip(requests[:2], outcomes[:2], strict=True)))
    for _ in range(3):
        await asyncio.sleep(0)  # the second raises in a callback of its own
    resolver.deliver(list(zip(requests[2:], outcomes[2:], strict=True)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert [r.future.done() for r in requests] == [True, False, True, True]
    assert [type(e) for e in errors] == [RuntimeError]
    callers[1].cancel()  # let the engine close without waiting for it
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)


@pytest.mark.asyncio
async def test_outcomes_still_queued_at_close_resolve_with_their_own_results(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    _resolve_budget(monkeypatch, 0.0)
    engine = aiokv.OffloadEngine(small_store(), caches)
    await engine.start()
    requests, callers = await _admitted_offloads(engine, 50)
    outcomes = [aiokv.OffloadResult(r.user_id, 16, 16) for r in requests]
    loop = asyncio.get_running_loop()
    worker = engine._worker
    assert worker is not None
    join = worker.join

    def join_then_post(timeout: float | None = None) -> bool:
        finished = join(timeout)
        # The store thread's last post, as it ends: finished before the close gave up.
        loop.call_soon_threadsafe(engine._resolver.deliver, list(zip(requests, outcomes, strict=True)))
        return finished

    monkeypatch.setattr(worker, "join", join_then_post)
    await engine.aclose(drain=False)
    assert [r.future.result() for r in requests] == outcomes
    assert await asyncio.gather(*callers) == outcomes


@pytest.mark.asyncio
async def test_take_queued_returns_planned_batches_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _dispatch_budget(monkeypatch, 0.0)
    batcher, submitted, _ = _batcher_rig(window_us=10_000_000, max_batch_requests=4)
    burst = [_lookup_request(user) for user in range(10)]
    for request in burst:
        batcher.enqueue(request)
    assert len(submitted) == 1
    # Planned (4..7) before the open window's (8, 9): arrival order, nothing lost.
    assert batcher.take_queued() == burst[4:]
    assert len(batcher) == 0


@pytest.mark.asyncio
async def test_requests_after_a_full_batch_wait_for_their_own_window() -> None:
    batcher, submitted, _ = _batcher_rig(window_us=200_000, max_batch_requests=4)
    task = asyncio.ensure_future(batcher.run())
    try:
        for user in range(5):
            batcher.enqueue(_lookup_request(user))
        await asyncio.sleep(0.02)
        # The fifth did not leave with the full batch's window: it waits for its own.
        assert [len(batch.requests) for batch in submitted] == [4]
        for _ in range(200):
            if len(submitted) == 2:
                break
            await asyncio.sleep(0.01)
        assert [len(batch.requests) for batch in submitted] == [4, 1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_a_notifying_store_whose_answer_comes_after_the_wake_up_is_still_polled(
    caches: list[torch.Tensor],
) -> None:
    from aiokv.testing import StoreWrapper

    class LateAnswers(StoreWrapper):
        """Forwards LocalStore's wake-ups but withholds each task's first answer: the
        wake-up then finds nothing, and no other wake-up comes."""

        def __init__(self, inner: aiokv.LocalStore) -> None:
            super().__init__(inner)
            self.held: dict[int, aiokv.TaskResult] = {}
            self.withheld = 0

        def try_wait(self, task_ids: Any) -> dict[int, aiokv.TaskResult]:
            answered = {t: self.held.pop(t) for t in task_ids if t in self.held}
            for task_id, result in self.inner.try_wait(task_ids).items():
                self.held[task_id] = result  # given out at the next poll
                self.withheld += 1
            return answered

    store = LateAnswers(small_store())
    assert store.set_notify is not None  # the worker relies on wake-ups, not polls
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    async with engine:
        result = await asyncio.wait_for(engine.offload("u", torch.arange(4), 16), 10)
    assert result.stored_tokens == 16 and store.withheld == 1


@pytest.mark.asyncio
async def test_d2h_copies_is_what_the_store_reports(caches: list[torch.Tensor]) -> None:
    """The stat is the store's own count of the copies its launches made (FlexKV and a
    store process count them; the embedded store needs none)."""
    from aiokv.testing import StoreWrapper

    class Copying(StoreWrapper):
        def store_stats(self) -> dict[str, int]:
            return {"d2h_copies": 7, "host_blocks_total": 64}

    engine = aiokv.OffloadEngine(Copying(small_store()), caches, aiokv.EngineConfig(window_us=0))
    async with engine:
        await asyncio.wait_for(engine.offload("u", torch.arange(4), 16), timeout=5)
    assert engine.stats().d2h_copies == 7


@pytest.mark.asyncio
async def test_a_bad_page_found_after_matching_gives_its_match_back(
    caches: list[torch.Tensor],
) -> None:
    """The store checks page ids at launch: an offload whose page ids are out of range
    fails alone, naming the id, and its match goes back to the store."""
    engine, store = checked_engine(caches, window_us=50_000)
    num_pages = caches[0].shape[0]
    async with engine:
        good, bad = await asyncio.gather(
            engine.offload(1, torch.arange(0, 4), 16),
            engine.offload(2, torch.tensor([0, 1, 2, num_pages]), 16),
            return_exceptions=True,
        )
        stats = engine.stats()
    assert isinstance(good, aiokv.OffloadResult) and good.stored_tokens == 16
    assert isinstance(bad, aiokv.InvalidRequest) and bad.field == "page_ids"
    assert f"holds {num_pages}, outside [0, {num_pages})" in str(bad)
    assert store.calls["put_match"] == 2  # both matched before the page check
    assert stats.store_tasks_open == 0
    assert store.problems() == []


