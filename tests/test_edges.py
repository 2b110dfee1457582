"""Behaviour at the edges: cancellation, bad input, overload, timeouts, TTL, shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, make_caches, small_store
from test_space import Holds

import aiokv
from aiokv.copy.copier import Copier
from aiokv.testing import CheckingStore, FakeStore, FaultyStore, no_space


class Rig:
    """An engine over CheckingStore(FaultyStore(LocalStore)), and the loop's errors."""

    def __init__(self, caches: list[torch.Tensor], **config: Any) -> None:
        self.faulty = FaultyStore(small_store())
        self.checked = CheckingStore(self.faulty, loop_thread=threading.get_ident())
        self.engine = aiokv.OffloadEngine(self.checked, caches, aiokv.EngineConfig(**config))
        self.loop_errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: self.loop_errors.append(context)
        )

    async def launched(self) -> None:
        """Wait (bounded) until the store launched something."""
        assert await asyncio.to_thread(self.faulty.launched.wait, 10)
        self.faulty.launched.clear()

    async def held_offload(self, user_id: str, page_ids: torch.Tensor) -> asyncio.Future[Any]:
        """Hold transfers, offload 16 tokens, and return once the store launched them."""
        self.faulty.hold.clear()
        call = asyncio.ensure_future(self.engine.offload(user_id, page_ids, 16))
        await self.launched()
        return call

    def finish_the_accepted_one(self) -> None:
        """Resolve the one accepted request now, as its store outcome would (in this
        callback: the room it frees goes to the first caller waiting for one)."""
        (accepted,) = self.engine._admission.live
        self.engine._resolver.deliver(  # type: ignore[union-attr]
            [(accepted, aiokv.OffloadResult(accepted.user_id, 16, 16))])

    def assert_clean(self) -> None:
        assert self.checked.problems() == []
        assert self.loop_errors == []


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll a condition that another thread or a timer makes true; bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def pages(start: int, count: int = 4) -> torch.Tensor:
    return torch.arange(start, start + count)


def one_room_rig(caches: list[torch.Tensor], **config: Any) -> Rig:
    """A rig whose engine has room for one request; later callers wait for room."""
    return Rig(caches, window_us=0, max_pending=1, overload="wait", **config)


@pytest.mark.asyncio
async def test_caller_cancelled_before_dispatch_is_never_matched(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=10_000_000, max_batch_requests=2)
    async with rig.engine:
        doomed = asyncio.ensure_future(rig.engine.offload("gone", pages(0), 16))
        await asyncio.sleep(0)  # queued in the open window
        doomed.cancel()
        # Two live calls fill the window (the cancelled one no longer counts).
        kept, also = await asyncio.wait_for(asyncio.gather(
            rig.engine.offload("kept", pages(4), 16), rig.engine.offload("also", pages(8), 16)), 5)
        with pytest.raises(asyncio.CancelledError):
            await doomed
        stats = rig.engine.stats()
    assert kept.stored_tokens == also.stored_tokens == 16
    assert rig.checked.calls["put_match"] == 2  # kept and also: never the cancelled one
    assert stats.cancelled == 1 and stats.completed == 2
    rig.assert_clean()


@pytest.mark.asyncio
async def test_caller_cancelled_after_launch_only_detaches(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    copied = threading.Event()
    end = Copier._end

    def ended(copier: Copier, job: Any) -> None:
        end(copier, job)
        copied.set()

    monkeypatch.setattr(Copier, "_end", ended)
    rig = Rig(caches, window_us=0)
    rig.faulty.hold.clear()  # transfers do not finish until released
    async with rig.engine:
        task = asyncio.ensure_future(rig.engine.offload("u", pages(0), 16))
        await rig.launched()
        # Its copy ended before the caller left (test_detach.py: one that had not, keeps
        # nothing): what it read is what was offloaded.
        assert await asyncio.to_thread(copied.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rig.engine.stats().store_tasks_open == 1  # the transfer still runs
        rig.faulty.hold.set()
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
        # The data landed even though nobody waited: the key is stored.
        hit = await rig.engine.lookup("u", 16)
        hit.release()
    assert hit.cached_tokens == 16
    assert rig.checked.cancelled.isdisjoint(rig.checked.launched)
    rig.assert_clean()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("field", "call"),
    [
        ("page_ids", lambda e: e.offload("u", torch.zeros(4), 16)),  # float dtype
        ("page_ids", lambda e: e.offload("u", torch.zeros(2, 2, dtype=torch.long), 4)),
        ("page_ids", lambda e: e.offload("u", torch.tensor([0, 1, 9999]), 12)),
        ("page_ids", lambda e: e.offload("u", torch.tensor([0, -1]), 8)),
        # page * PAGE_SIZE wraps around to 4 in int64: must not pass as page 1.
        ("page_ids", lambda e: e.offload("u", torch.tensor([2**64 // PAGE_SIZE + 1]), 4)),
        ("page_ids", lambda e: e.offload("u", np.array([0, 1], dtype=object), 8)),
        ("page_ids", lambda e: e.offload("u", np.array([0.0, 1.0]), 8)),
        ("num_tokens", lambda e: e.offload("u", pages(0, 2), 9)),
        ("num_tokens", lambda e: e.offload("u", pages(0, 2), -1)),
        ("num_tokens", lambda e: e.lookup("u", 2.5)),
        ("token_ids", lambda e: e.offload("u", pages(0), 16, token_ids=np.arange(3))),
        ("token_ids", lambda e: e.offload("u", pages(0), 4, token_ids=np.zeros(4, np.int32))),
        (
            "token_ids",
            lambda e: e.offload("u", pages(0), 4, token_ids=torch.zeros(4, dtype=torch.bfloat16)),
        ),
        ("namespace", lambda e: e.lookup("u", 4, namespace="not-a-list")),
        ("user_id", lambda e: e.lookup(["unhashable"], 4)),
        ("hit", lambda e: e.load("not a lookup", pages(0))),
    ],
)
async def test_bad_request_fails_alone_naming_the_field(
    caches: list[torch.Tensor], field: str, call: Callable[[aiokv.OffloadEngine], Any]
) -> None:
    rig = Rig(caches, window_us=20_000)
    async with rig.engine:
        good = asyncio.ensure_future(rig.engine.offload("good", pages(8), 16))
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await call(rig.engine)
        assert (await good).stored_tokens == 16  # same window, unaffected
    assert caught.value.field == field and field in str(caught.value)
    assert isinstance(caught.value, ValueError)
    rig.assert_clean()


@pytest.mark.asyncio
@pytest.mark.parametrize("bad_id", [-1, -5, 9999, 2**64 // PAGE_SIZE + 1])
async def test_an_id_out_of_range_is_named_as_the_caller_gave_it(
    caches: list[torch.Tensor], bad_id: int
) -> None:
    """The message names the id as the caller gave it (FlexKV's slots hold ids clamped
    to [-1, largest_page]; the embedded store reads them as given)."""
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        with pytest.raises(aiokv.InvalidRequest, match=rf"holds {bad_id}, outside"):
            await rig.engine.offload("u", torch.tensor([0, 1, bad_id]), 12)
        hit = await rig.engine.lookup("v", 12)
        hit.release()
    rig.assert_clean()


@pytest.mark.asyncio
async def test_load_needs_enough_pages_and_a_fresh_lookup(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        hit = await rig.engine.lookup("u", 16)
        with pytest.raises(aiokv.InvalidRequest, match="page_ids"):
            await rig.engine.load(hit, pages(20, 3))
        assert (await rig.engine.load(hit, pages(20))).loaded_tokens == 16
        with pytest.raises(aiokv.InvalidRequest, match=r"^hit: reservation is loaded"):
            await rig.engine.load(hit, pages(20))  # consumed
    rig.assert_clean()


@pytest.mark.asyncio
async def test_overload_reject_answers_at_once(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=0, max_pending=2, overload="reject")
    rig.faulty.hold.clear()
    async with rig.engine:
        held = [asyncio.ensure_future(rig.engine.offload(u, pages(4 * u), 16)) for u in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(aiokv.Overloaded):
            await rig.engine.offload("third", pages(40), 16)
        assert rig.engine.stats().rejected == 1
        rig.faulty.hold.set()
        assert [r.stored_tokens for r in await asyncio.gather(*held)] == [16, 16]
        # Room again once they resolved.
        assert (await rig.engine.offload("third", pages(40), 16)).stored_tokens == 16
    rig.assert_clean()


@pytest.mark.asyncio
async def test_overload_wait_admits_when_room_frees(caches: list[torch.Tensor]) -> None:
    rig = one_room_rig(caches)
    rig.faulty.hold.clear()
    async with rig.engine:
        first = asyncio.ensure_future(rig.engine.offload("a", pages(0), 16))
        second = asyncio.ensure_future(rig.engine.offload("b", pages(4), 16))
        await rig.launched()
        assert not second.done() and rig.engine.stats().submitted == 1
        rig.faulty.hold.set()
        results = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert [r.stored_tokens for r in results] == [16, 16]
    rig.assert_clean()


@pytest.mark.asyncio
async def test_request_timeout_fires_from_a_timer(caches: list[torch.Tensor]) -> None:
    # The transfer must be launched before the deadline (the store thread launches
    # nothing past it): 1 s, not 30 ms, which a store thread held up on a loaded host
    # missed (the offload then was never launched: no store task left open).
    rig = Rig(caches, window_us=0, request_timeout_ms=1_000)
    rig.faulty.hold.clear()  # nothing would ever flush or complete
    async with rig.engine:
        with pytest.raises(aiokv.RequestTimeout) as caught:
            await asyncio.wait_for(rig.engine.offload("u", pages(0), 16), 10)
        assert isinstance(caught.value, TimeoutError)
        assert rig.engine.stats().timed_out == 1
        assert rig.engine.stats().store_tasks_open == 1  # launched: still waited for
        rig.faulty.hold.set()
    assert rig.engine.stats().store_tasks_open == 0
    rig.assert_clean()


@pytest.mark.asyncio
async def test_unused_lookup_is_released_after_ttl(caches: list[torch.Tensor]) -> None:
    # The hit must still be held when its caller looks: 1 s, not 20 ms, which a loop that
    # lagged after the answer used up (uvloop runs due timers before the caller resumes).
    rig = Rig(caches, window_us=0, lookup_ttl_ms=1_000)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        hit = await rig.engine.lookup("u", 16)
        assert hit.held and rig.engine.stats().store_tasks_open == 1
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
        assert not hit.held
        with pytest.raises(aiokv.InvalidRequest, match="expired"):
            await rig.engine.load(hit, pages(20))
    assert len(rig.checked.cancelled) >= 1
    rig.assert_clean()


@pytest.mark.asyncio
async def test_lookup_context_manager_releases(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        async with await rig.engine.lookup("u", 16) as hit:
            assert hit.cached_tokens == 16
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
    rig.assert_clean()


@pytest.mark.asyncio
async def test_drain_close_resolves_everything_accepted(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches, window_us=10_000_000)
    await rig.engine.start()
    tasks = [asyncio.ensure_future(rig.engine.offload(u, pages(4 * u), 16)) for u in range(20)]
    await asyncio.sleep(0)
    await rig.engine.aclose(drain=True)
    assert [t.result().stored_tokens for t in tasks] == [16] * 20
    stats = rig.engine.stats()
    assert stats.pending == 0 and stats.completed == 20
    rig.assert_clean()


@pytest.mark.asyncio
async def test_close_without_drain_fails_queued_and_waits_for_launched(
    caches: list[torch.Tensor],
) -> None:
    # 16 tokens fill a batch at once; 4 tokens wait for a 10 s window.
    rig = Rig(caches, window_us=10_000_000, max_batch_tokens=16)
    await rig.engine.start()
    launched = await rig.held_offload("a", pages(0))
    queued = asyncio.ensure_future(rig.engine.offload("b", pages(4, 1), 4))
    await asyncio.sleep(0)  # accepted, not dispatched
    closing = asyncio.ensure_future(rig.engine.aclose(drain=False))
    with pytest.raises(aiokv.EngineClosed):
        await queued
    assert not closing.done()  # still waiting for the launched transfer
    rig.faulty.hold.set()
    await asyncio.wait_for(closing, 10)
    assert (await launched).stored_tokens == 16
    rig.assert_clean()


def cancel_every_task_but(*spared: asyncio.Future[Any]) -> None:
    """What many shutdown handlers do (and asyncio.run with the tasks left at its end):
    cancel every task but the caller's own, the engine's close task among them."""
    me = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not me and task not in spared:
            task.cancel()


def aiokv_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t not in before and t.is_alive() and t.name.startswith("aiokv"))


@pytest.mark.asyncio
@pytest.mark.parametrize("cancelled", ["before its first step", "mid-drain", "in its join"])
async def test_a_close_cancelled_by_a_shutdown_is_finished_by_the_next_aclose(
    caches: list[torch.Tensor], cancelled: str,
) -> None:
    # The engine stayed running (or draining), every later aclose() raised CancelledError
    # at once to a caller nobody cancelled, and the store and copy threads ran on.
    before = set(threading.enumerate())
    rig = Rig(caches)
    await rig.engine.start()
    await rig.held_offload("a", pages(0))  # launched: the drain waits for it
    closer = asyncio.ensure_future(rig.engine.aclose(drain=cancelled != "in its join"))
    if cancelled == "mid-drain":
        await eventually(lambda: rig.engine.state is aiokv.EngineState.DRAINING)
    elif cancelled == "in its join":  # of the store thread, which waits for the transfer
        await eventually(lambda: "aiokv-close" in aiokv_threads(before))
    else:
        await asyncio.sleep(0)  # the closer started the close task, which has not run yet
    cancel_every_task_but()
    with pytest.raises(asyncio.CancelledError):
        await closer  # a caller cancelled itself still gets its CancelledError
    rig.faulty.hold.set()
    await asyncio.wait_for(rig.engine.aclose(), 10)
    assert rig.engine.state is aiokv.EngineState.CLOSED
    assert aiokv_threads(before) == []
    with pytest.raises(aiokv.EngineClosed):
        await rig.engine.lookup("a", 16)
    rig.assert_clean()


@pytest.mark.asyncio
async def test_an_aclose_not_cancelled_itself_closes_when_a_shutdown_cancels_the_close(
    caches: list[torch.Tensor],
) -> None:
    before = set(threading.enumerate())
    rig = Rig(caches)
    await rig.engine.start()
    await rig.held_offload("a", pages(0))
    waiter = asyncio.ensure_future(rig.engine.aclose())
    await eventually(lambda: rig.engine.state is aiokv.EngineState.DRAINING)
    cancel_every_task_but(waiter)  # the close task goes; its waiter was not cancelled
    rig.faulty.hold.set()
    await asyncio.wait_for(waiter, 10)  # it raised CancelledError
    assert rig.engine.state is aiokv.EngineState.CLOSED
    assert aiokv_threads(before) == []
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_drain_after_a_shutdown_cancelled_the_batcher_still_dispatches_what_is_queued(
    caches: list[torch.Tensor],
) -> None:
    # The drain waited its whole timeout (nothing dispatched), failed the call with
    # EngineClosed and left the store thread behind, its time spent.
    before = set(threading.enumerate())
    rig = Rig(caches, window_us=10_000_000)
    await rig.engine.start()
    queued = asyncio.ensure_future(rig.engine.offload("a", pages(0), 16))
    await asyncio.sleep(0)  # accepted, waiting for its window
    cancel_every_task_but(queued)
    await asyncio.sleep(0)
    await asyncio.wait_for(rig.engine.aclose(timeout=30), 10)
    assert (await queued).stored_tokens == 16
    assert aiokv_threads(before) == []
    rig.assert_clean()


@pytest.mark.asyncio
async def test_every_call_after_close_raises_engine_closed(caches: list[torch.Tensor]) -> None:
    rig = Rig(caches)
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        hit = await rig.engine.lookup("u", 16)
    await rig.engine.aclose()  # idempotent
    with pytest.raises(aiokv.EngineClosed):
        await rig.engine.offload("u", pages(0), 16)
    with pytest.raises(aiokv.EngineClosed):
        await rig.engine.lookup("u", 16)
    with pytest.raises(aiokv.EngineClosed):
        await rig.engine.load(hit, pages(0))
    with pytest.raises(aiokv.EngineClosed):
        await rig.engine.start()
    assert rig.engine.stats().store_tasks_open == 0  # the reservation was cancelled
    rig.assert_clean()


@pytest.mark.asyncio
async def test_store_errors_fail_their_requests_typed(caches: list[torch.Tensor]) -> None:
    # A store with no room at all fails the offload once its deadline passed. The calls
    # after it run under the same deadline and must not meet it: 1 s, not 100 ms, which
    # a store thread held up on a loaded host outlasted (a RequestTimeout, not the
    # store's error, then the last offload timed out).
    rig = Rig(caches, window_us=0, request_timeout_ms=1_000)
    async with rig.engine:
        rig.faulty.put_match_error = no_space()
        with pytest.raises(aiokv.StoreFull) as full:
            await rig.engine.offload("u", pages(0), 16)
        assert isinstance(full.value.__cause__, aiokv.stores.NoSpace)
        assert rig.engine.stats().space_waits >= 1  # it waited for room first
        rig.faulty.put_match_error = RuntimeError("disk on fire")
        with pytest.raises(aiokv.StoreError, match="disk on fire"):
            await rig.engine.offload("u", pages(0), 16)
        rig.faulty.put_match_error = None
        rig.faulty.fail_tasks = True
        with pytest.raises(aiokv.StoreError, match="injected failure"):
            await rig.engine.offload("u", pages(0), 16)
        rig.faulty.fail_tasks = False
        assert rig.engine.stats().failed == 3
        # The engine goes on serving after store errors.
        assert (await rig.engine.offload("v", pages(8), 16)).stored_tokens == 16
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_refused_launch_fails_its_requests_and_gives_their_matches_back(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        rig.faulty.launch_error = ValueError("launch refused")
        with pytest.raises(aiokv.StoreError, match="launch refused"):
            await rig.engine.offload("u", pages(0), 16)
        rig.faulty.launch_error = None
        # Still matched after the refusal, the pages would read as stored (or held) now.
        assert (await rig.engine.offload("u", pages(0), 16)).stored_tokens == 16
    assert len(rig.checked.cancelled) == 1
    rig.assert_clean()


@pytest.mark.asyncio
async def test_full_store_reports_no_space(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    holds = Holds(monkeypatch)
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=8 * block_bytes / (1 << 30)))
    checked = CheckingStore(store, loop_thread=threading.get_ident())
    # b waits for room up to its deadline, then again until the hit is released, its
    # put made within the same deadline from its call: 1 s, not 500 ms, which a store
    # thread held up on a loaded host outlasted (the released room came too late).
    config = aiokv.EngineConfig(window_us=0, request_timeout_ms=1_000)
    engine = aiokv.OffloadEngine(checked, caches, config)
    async with engine:
        await engine.offload("a", pages(0, 8), 8 * PAGE_SIZE)
        hit = await engine.lookup("a", 8 * PAGE_SIZE)  # holds all 8 blocks: none evictable
        with pytest.raises(aiokv.StoreFull, match="no room after"):
            await engine.offload("b", pages(8), 16)  # it waited, up to its deadline
        assert engine.stats().space_waits >= 2
        waiting = asyncio.ensure_future(engine.offload("b", pages(8), 16))
        await holds.reach(holds.count + 1)  # no room: it waits
        hit.release()
        # Released blocks are evictable again: the put that waited succeeds by evicting.
        assert (await waiting).stored_tokens == 16
    assert checked.problems() == []


@pytest.mark.asyncio
async def test_overload_wait_skips_callers_who_left(caches: list[torch.Tensor]) -> None:
    rig = one_room_rig(caches)
    async with rig.engine:
        first = await rig.held_offload("a", pages(0))
        leaver = asyncio.ensure_future(rig.engine.offload("b", pages(4), 16))
        stayer = asyncio.ensure_future(rig.engine.offload("c", pages(8), 16))
        await asyncio.sleep(0)
        leaver.cancel()  # waiting for room, never accepted
        rig.faulty.hold.set()
        results = await asyncio.wait_for(asyncio.gather(first, stayer), 10)
        with pytest.raises(asyncio.CancelledError):
            await leaver
        stats = rig.engine.stats()
    assert [r.stored_tokens for r in results] == [16, 16]
    assert stats.submitted == 2 and stats.cancelled == 0  # the leaver was never accepted
    rig.assert_clean()


@pytest.mark.asyncio
async def test_overload_wait_times_out_with_request_timeout(caches: list[torch.Tensor]) -> None:
    # a must be launched before its deadline: 1 s, not 50 ms, which a store thread held
    # up on a loaded host missed (a was never launched, and held_offload waited for it).
    rig = one_room_rig(caches, request_timeout_ms=1_000)
    async with rig.engine:
        first = await rig.held_offload("a", pages(0))
        # b waits for room; a's deadline frees it first, then b's own deadline passes
        # while the store still holds everything: either way b gets RequestTimeout, and
        # waiting for room does not extend a request's time budget forever.
        with pytest.raises(aiokv.RequestTimeout):
            await asyncio.wait_for(rig.engine.offload("b", pages(4), 16), 10)
        with pytest.raises(aiokv.RequestTimeout):
            await first
        stats = rig.engine.stats()
        rig.faulty.hold.set()
    assert stats.timed_out + stats.rejected == 2
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_caller_cancelled_just_after_it_was_given_room_stays_cancelled(
    caches: list[torch.Tensor],
) -> None:
    rig = one_room_rig(caches, request_timeout_ms=60_000)
    async with rig.engine:
        first = await rig.held_offload("a", pages(0))
        second = asyncio.ensure_future(rig.engine.offload("b", pages(4), 16))
        third = asyncio.ensure_future(rig.engine.offload("c", pages(8), 16))
        await asyncio.sleep(0.01)
        # In one callback: a's outcome arrives (its room goes to the second caller's
        # waiter), then the second caller is cancelled (an outer timeout, say).
        rig.finish_the_accepted_one()
        second.cancel()
        rig.faulty.hold.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(second, 10)
        # The room it was given went on to the next caller.
        assert (await asyncio.wait_for(third, 10)).stored_tokens == 16
        stats = rig.engine.stats()
    assert stats.submitted == 2  # a and c; b never ran
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_newcomer_does_not_take_the_room_given_to_a_waiter(
    caches: list[torch.Tensor],
) -> None:
    rig = one_room_rig(caches, request_timeout_ms=0)
    async with rig.engine:
        first = await rig.held_offload("a", pages(0))
        waiter = asyncio.ensure_future(rig.engine.offload("b", pages(4), 16))
        await asyncio.sleep(0.01)
        rig.faulty.hold.clear()
        # The newcomer's first step is scheduled before the waiter is woken, so it runs
        # first: the room has just been given to the waiter, and FIFO puts it behind.
        newcomer = asyncio.ensure_future(rig.engine.offload("c", pages(8), 16))
        rig.finish_the_accepted_one()
        await rig.launched()
        assert not newcomer.done() and rig.engine.stats().submitted == 2
        (running,) = rig.engine._admission.live
        assert running.user_id == "b"
        rig.faulty.hold.set()
        await first
        results = await asyncio.wait_for(asyncio.gather(waiter, newcomer), 10)
    assert [r.user_id for r in results] == ["b", "c"]
    rig.assert_clean()


@pytest.mark.asyncio
@pytest.mark.parametrize("drain", [True, False])
async def test_close_sends_every_caller_waiting_for_room_away(
    caches: list[torch.Tensor], drain: bool
) -> None:
    # Two waiters for one room: each request that finishes wakes one waiter only, so the
    # close itself must wake them all.
    rig = one_room_rig(caches, request_timeout_ms=0)
    await rig.engine.start()
    first = await rig.held_offload("a", pages(0))
    waiters = [asyncio.ensure_future(rig.engine.offload(u, pages(4 * i + 4), 16))
               for i, u in enumerate("bc")]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiters)
    # The close begins (DRAINING, waiters woken) before the held offload may end: were it
    # to end first, its room would let a waiter in before the close, and that waiter
    # would rightly succeed.
    closing = asyncio.ensure_future(rig.engine.aclose(drain=drain))
    for _ in range(100):
        if rig.engine.state is not aiokv.EngineState.RUNNING:
            break
        await asyncio.sleep(0)
    assert rig.engine.state is aiokv.EngineState.DRAINING
    rig.faulty.hold.set()
    await asyncio.wait_for(closing, 10)
    _, pending = await asyncio.wait([first, *waiters], timeout=2)
    for call in pending:
        call.cancel()
    assert not pending, f"{len(pending)} caller(s) still waiting after aclose returned"
    for waiter in waiters:
        with pytest.raises(aiokv.EngineClosed):
            waiter.result()
    rig.assert_clean()


class FailingRegister(aiokv.testing.StoreWrapper):
    """Registers only when ``go`` is set, then fails (or, with ``fail=False``, not)."""

    def __init__(self, inner: Any, fail: bool) -> None:
        super().__init__(inner)
        self.go = threading.Event()
        self.fail = fail
        self.closed = 0

    def close(self) -> None:
        self.closed += 1
        self.inner.close()

    def register(self, kv_caches: Any) -> None:
        assert self.go.wait(10)
        if self.fail:
            raise RuntimeError("registration failed")
        self.inner.register(kv_caches)


class Starting:
    """An engine whose start() is under way (registration held until ``store.go``) and
    one offload accepted meanwhile."""

    def __init__(self, store: FailingRegister, engine: aiokv.OffloadEngine) -> None:
        self.store, self.engine = store, engine
        self.starting: asyncio.Future[None] = asyncio.ensure_future(engine.start())
        self.call: asyncio.Future[Any] | None = None

    @classmethod
    async def begin(cls, caches: list[torch.Tensor], fail: bool) -> Starting:
        store = FailingRegister(small_store(), fail=fail)
        rig = cls(store, aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(request_timeout_ms=0)))
        await asyncio.sleep(0.01)
        rig.call = asyncio.ensure_future(rig.engine.offload("u", pages(0), 16))
        await asyncio.sleep(0)
        assert rig.engine.stats().submitted == 1  # accepted, queued until started
        return rig


@pytest.mark.asyncio
async def test_calls_accepted_while_a_start_fails_are_failed_with_it(
    caches: list[torch.Tensor],
) -> None:
    rig = await Starting.begin(caches, fail=True)
    rig.store.go.set()
    with pytest.raises(RuntimeError, match="registration failed"):
        await rig.starting
    with pytest.raises(aiokv.EngineClosed, match="failed to start"):
        await asyncio.wait_for(rig.call, 2)
    assert rig.engine.state is aiokv.EngineState.CLOSED


class FailsAfterRegistering(aiokv.testing.StoreWrapper):
    """Registers, then fails the engine's next setup call (set_notify), as a store
    process that is down does (found with a ProcessStore out of restarts that a
    testing.SharedStore handed to a second engine)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = 0

    def set_notify(self, callback: Any) -> None:
        raise aiokv.StoreError("the store is down")

    def close(self) -> None:
        self.closed += 1
        self.inner.close()


@pytest.mark.asyncio
async def test_a_store_that_fails_right_after_registering_fails_the_start_not_hangs_it(
    caches: list[torch.Tensor],
) -> None:
    store = FailsAfterRegistering(small_store())
    engine = aiokv.OffloadEngine(store, caches)
    with pytest.raises(aiokv.StoreError, match="the store is down"):
        await asyncio.wait_for(engine.start(), 10)  # the store thread had died: no answer
    assert store.closed == 1 and engine.state is aiokv.EngineState.CLOSED


@pytest.mark.asyncio
async def test_a_close_during_start_ends_both_without_a_batcher_left_running(
    caches: list[torch.Tensor],
) -> None:
    rig = await Starting.begin(caches, fail=False)
    closing = asyncio.ensure_future(rig.engine.aclose(drain=True, timeout=30))
    await asyncio.sleep(0.01)
    rig.store.go.set()
    with pytest.raises(aiokv.EngineClosed, match="closed while it started"):
        await asyncio.wait_for(rig.starting, 5)
    await asyncio.wait_for(closing, 5)  # no drain wait: nothing could dispatch the call
    with pytest.raises(aiokv.EngineClosed):
        await asyncio.wait_for(rig.call, 2)
    assert rig.engine._batcher_task is None and rig.engine.state is aiokv.EngineState.CLOSED


@pytest.mark.asyncio
async def test_a_cancelled_start_fails_its_calls_at_once_and_still_closes_the_store(
    caches: list[torch.Tensor],
) -> None:
    rig = await Starting.begin(caches, fail=False)
    rig.starting.cancel()  # e.g. asyncio.wait_for(engine.start(), ...) timing out
    # The call fails while the registration still runs: it need not wait for it.
    with pytest.raises(aiokv.EngineClosed, match="failed to start"):
        await asyncio.wait_for(rig.call, 2)
    rig.store.go.set()  # the registration ends after start() gave up on it
    with pytest.raises(asyncio.CancelledError):
        await rig.starting
    assert rig.store.closed == 1  # the store thread was not killed by the cancelled future
    assert rig.engine.state is aiokv.EngineState.CLOSED


class CrashingStore(aiokv.testing.StoreWrapper):
    """``crash_put`` makes the next put_match raise a BaseException (a bug escaping every
    handler); ``garble`` makes the next try_wait answer something that is not a dict."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.crash_put = False
        self.garble = False

    def put_match(self, token_ids: Any, namespace: Any) -> Any:
        if self.crash_put:
            self.crash_put = False
            raise KeyboardInterrupt("a bug")
        return self.inner.put_match(token_ids, namespace)

    def try_wait(self, task_ids: Any) -> Any:
        if self.garble:
            self.garble = False
            return [(task_id, None) for task_id in task_ids]
        return self.inner.try_wait(task_ids)


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["crash_put", "garble"])
async def test_a_crashed_store_thread_fails_what_it_held_and_every_later_call(
    caches: list[torch.Tensor], fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CrashingStore(small_store())
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(request_timeout_ms=0))
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's own crash
    await engine.start()
    setattr(store, fault, True)
    crashed = asyncio.ensure_future(engine.offload("a", pages(0), 16))
    with pytest.raises(aiokv.StoreError, match="crashed"):
        await asyncio.wait_for(crashed, 5)
    with pytest.raises(aiokv.EngineClosed):
        await asyncio.wait_for(engine.offload("b", pages(4), 16), 5)
    await asyncio.wait_for(engine.aclose(drain=False, timeout=1), 5)


class GatedCrashingStore(CrashingStore):
    """``crash_put`` waits for ``go`` before it crashes (so batches pile up in the
    inbox); ``bad_result`` answers results whose ``status`` raises."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.in_put = threading.Event()
        self.go = threading.Event()
        self.bad_result = False

    def put_match(self, token_ids: Any, namespace: Any) -> Any:
        if self.crash_put:
            self.in_put.set()
            assert self.go.wait(10)
        return super().put_match(token_ids, namespace)

    def try_wait(self, task_ids: Any) -> Any:
        results = self.inner.try_wait(task_ids)
        if self.bad_result:

            class Garbled:
                @property
                def status(self) -> Any:
                    raise RuntimeError("garbled result")

            return {task_id: Garbled() for task_id in results}
        return results


@pytest.mark.asyncio
async def test_batches_waiting_in_the_inbox_fail_with_a_crash(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GatedCrashingStore(small_store())
    engine = aiokv.OffloadEngine(
        store, caches, aiokv.EngineConfig(window_us=0, request_timeout_ms=0)
    )
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    await engine.start()
    store.crash_put = True
    crashing = asyncio.ensure_future(engine.offload("a", pages(0), 16))
    assert await asyncio.to_thread(store.in_put.wait, 5)
    waiting = asyncio.ensure_future(engine.offload("b", pages(4), 16))
    # Seen on the inbox before the crash, not assumed after 0.02 s: a batch dispatched
    # once the thread had crashed fails with EngineClosed (tests above), not with it.
    await eventually(lambda: (engine.stats().submitted, engine.stats().queued) == (2, 0))
    store.go.set()
    for call in (crashing, waiting):
        with pytest.raises(aiokv.StoreError, match="crashed"):
            await asyncio.wait_for(call, 5)
    await asyncio.wait_for(engine.aclose(drain=False, timeout=1), 5)


@pytest.mark.asyncio
async def test_a_launched_request_whose_outcome_raises_is_failed_not_lost(
    caches: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GatedCrashingStore(small_store())
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(request_timeout_ms=0))
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    await engine.start()
    store.bad_result = True
    with pytest.raises(aiokv.StoreError, match="crashed"):
        await asyncio.wait_for(engine.offload("a", pages(0), 16), 5)
    await asyncio.wait_for(engine.aclose(drain=False, timeout=1), 5)



@pytest.mark.asyncio
async def test_numpy_page_ids_of_any_layout_are_taken_as_their_values(
    caches: list[torch.Tensor],
) -> None:
    rig = Rig(caches, window_us=0)
    async with rig.engine:
        reversed_view = np.arange(8, dtype=np.int64)[::-1][:4]  # a negative stride: 7..4
        swapped = np.arange(8, 12, dtype=np.dtype(">i4"))  # big-endian int32: 8..11
        assert (await rig.engine.offload("r", reversed_view, 16)).stored_tokens == 16
        assert (await rig.engine.offload("s", swapped, 16)).stored_tokens == 16
        hit = await rig.engine.lookup("r", 16)
        await rig.engine.load(hit, pages(40))
    for cache in caches:  # page 7 was first in "r": it is what page 40 holds now
        assert torch.equal(cache[40], cache[7])
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_lookup_answered_as_its_caller_leaves_holds_nothing(
        caches: list[torch.Tensor]) -> None:
    # asyncio.timeout() whose timer falls due in the loop iteration that brings the answer:
    # the caller gets TimeoutError, so nobody has the Lookup to release. Its reservation
    # (host blocks, a store task) must go back then, not at lookup_ttl_ms.
    rig = Rig(caches, window_us=0, lookup_ttl_ms=600_000)
    async with rig.engine:
        for user in range(4):
            await rig.engine.offload(user, pages(4 * user), 16)
        loop = asyncio.get_running_loop()
        began = loop.time()
        for _ in range(20):
            (await rig.engine.lookup(0, 16)).release()
        latency = (loop.time() - began) / 20
        left = 0
        for attempt in range(400):
            try:
                async with asyncio.timeout(latency * (0.3 + 1.2 * (attempt % 17) / 16)):
                    hit = await rig.engine.lookup(attempt % 4, 16)
                hit.release()
            except TimeoutError:
                left += 1
        await eventually(lambda: rig.engine.stats().store_tasks_open == 0)
    assert left > 0  # the race was run at all
    rig.assert_clean()


@pytest.mark.asyncio
async def test_a_load_refused_for_overload_leaves_its_lookup_to_load_later(
        caches: list[torch.Tensor]) -> None:
    # Overloaded means "not accepted: try later"; the later try must find its hit held.
    rig = Rig(caches, window_us=0, max_pending=1, overload="reject")
    async with rig.engine:
        await rig.engine.offload("u", pages(0), 16)
        hit = await rig.engine.lookup("u", 16)
        busy = await rig.held_offload("other", pages(8))  # the one pending request
        try:
            with pytest.raises(aiokv.Overloaded):
                await rig.engine.load(hit, pages(20))
            assert hit.held
        finally:
            rig.faulty.hold.set()
        await busy
        assert (await rig.engine.load(hit, pages(20))).loaded_tokens == 16
        assert all(torch.equal(c[20:24], c[0:4]) for c in caches)
        assert rig.engine.stats().store_tasks_open == 0
    rig.assert_clean()


class HeldRegister(FakeStore):
    """Registers, or fails to (``fail``), once ``go`` is set; ``entered`` once it began."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.entered, self.go, self.registered = (
            threading.Event(), threading.Event(), threading.Event())

    def register(self, kv_caches: Any) -> None:
        self.entered.set()
        self.go.wait(30)
        if self.fail:
            raise RuntimeError("register failed")
        super().register(kv_caches)
        self.registered.set()


@pytest.mark.asyncio
@pytest.mark.parametrize("fail", [False, True])
async def test_a_second_start_returns_once_the_first_registered_and_fails_with_it(
    fail: bool,
) -> None:
    store = HeldRegister(fail)
    engine = aiokv.OffloadEngine(store, make_caches())
    first = asyncio.create_task(engine.start())
    # The first start is registering the store, and stays there until the second start
    # is seen waiting (a fixed sleep and a slow register let a loaded host start the
    # second after the first had ended: it then had nothing to wait for).
    assert await asyncio.to_thread(store.entered.wait, 30)
    second = asyncio.create_task(engine.start())
    await asyncio.sleep(0)  # the second start runs up to its wait
    assert not second.done()
    store.go.set()
    if fail:
        with pytest.raises(aiokv.EngineClosed, match="failed to start"):
            await second
    else:
        await second
        assert store.registered.is_set()
    await asyncio.gather(first, return_exceptions=True)
    await engine.aclose()
