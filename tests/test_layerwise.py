"""engine.load_layerwise on CPU caches: layers ready in order with the bytes in the pages,
every outcome of a load (failed, invalid, evicted, timed out, closed, cancelled) raised
from wait_layer, layer_ready and result, never a hang; stores that mark layers only at
the end; the run_in_background handle."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import uvloop
from conftest import make_caches, small_store

import aiokv
from aiokv.testing import FaultyStore, LayeredStore, StoreWrapper

LAYERS, PAGE_SIZE = 4, 4
TOKENS = 4 * PAGE_SIZE
SOURCE, TARGET = torch.arange(4), torch.arange(8, 12)


def engine_over(store: aiokv.Store, **config: int) -> tuple[aiokv.OffloadEngine, list[torch.Tensor]]:
    caches = make_caches(layers=LAYERS, page_size=PAGE_SIZE)
    for cache in caches:
        cache[TARGET] = 0  # what a layer holds before it is loaded
    return aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(**config)), caches


def loaded(caches: list[torch.Tensor], layer: int) -> bool:
    return torch.equal(caches[layer][TARGET], caches[layer][SOURCE])


def untouched(caches: list[torch.Tensor], layer: int) -> bool:
    return bool((caches[layer][TARGET] == 0).all())


async def hit_of(engine: aiokv.OffloadEngine, user: int = 1) -> aiokv.Lookup:
    await engine.offload(user, SOURCE, TOKENS)
    hit = await engine.lookup(user, TOKENS)
    assert hit.cached_tokens == TOKENS
    return hit


async def held(
    engine: aiokv.OffloadEngine, store: LayeredStore, fail_at_layer: int | None = None
) -> aiokv.LayerwiseLoad:
    """A launched load of user 1's hit whose layers each wait for a permit of
    ``store.gate`` (none given yet)."""
    hit = await hit_of(engine)
    store.gate, store.fail_at_layer = threading.Semaphore(0), fail_at_layer
    return await engine.load_layerwise(hit, TARGET)


async def in_thread(load: aiokv.LayerwiseLoad, layer: int) -> None:
    await asyncio.to_thread(load.wait_layer, layer)


async def on_loop(load: aiokv.LayerwiseLoad, layer: int) -> None:
    load.wait_layer(layer)  # CPU caches: blocks this (the loop's) thread until copied


async def ready(load: aiokv.LayerwiseLoad, layer: int) -> None:
    await load.layer_ready(layer)


WAITS = {"wait_layer in a thread": in_thread, "wait_layer on the loop": on_loop,
         "layer_ready": ready}


@pytest.mark.asyncio
@pytest.mark.parametrize("wait", list(WAITS))
async def test_layers_become_ready_in_order_with_their_bytes(wait: str) -> None:
    store = LayeredStore()
    engine, caches = engine_over(store)
    async with engine:
        load = await held(engine, store)
        for layer in range(LAYERS):
            assert untouched(caches, layer) and not load.is_ready(layer)
            store.gate.release()
            await WAITS[wait](load, layer)
            assert loaded(caches, layer) and load.is_ready(layer)
            if layer + 1 < LAYERS:  # still held back: not copied, not ready
                assert untouched(caches, layer + 1) and not load.is_ready(layer + 1)
        assert await load.result() == aiokv.LoadResult(1, TOKENS)
        stats = engine.stats()
    assert stats.loaded_tokens == TOKENS and stats.completed == 3  # offload, lookup, load
    assert stats.store_tasks_open == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["layers marked at the end", "LocalStore"])
async def test_a_store_without_marks_marks_every_layer_at_the_end(store: str) -> None:
    inner = LayeredStore(marks=False) if store != "LocalStore" else small_store()
    engine, caches = engine_over(inner)
    async with engine:
        hit = await hit_of(engine)
        if isinstance(inner, LayeredStore):
            inner.gate = threading.Semaphore(0)
        load = await engine.load_layerwise(hit, TARGET)
        if isinstance(inner, LayeredStore):
            # Only the load's end marks its layers, and the loop delivers the end.
            with pytest.raises(aiokv.BlockingCallOnLoop, match="layer_ready"):
                load.wait_layer(0)
            inner.gate.release()  # layer 0 copied; not marked on its own
            assert not load.is_ready(0)
            inner.gate.release(LAYERS - 1)
        waiters = [asyncio.to_thread(load.wait_layer, i) for i in range(LAYERS)]
        await asyncio.gather(*waiters, *(load.layer_ready(i) for i in range(LAYERS)))
        assert all(loaded(caches, i) for i in range(LAYERS))
        assert (await load.result()).loaded_tokens == TOKENS
        load.wait_layer(LAYERS - 1)  # ended: answers on the loop too


def raised(function: Callable[..., object], *args: object) -> BaseException | None:
    """What ``function(*args)`` raised (in a thread, whose errors to_thread would convert)."""
    try:
        function(*args)
    except BaseException as exc:
        return exc
    return None


async def all_raise(load: aiokv.LayerwiseLoad, error: type[BaseException], layer: int = 0) -> None:
    with pytest.raises(error):
        await asyncio.to_thread(load.wait_layer, layer)
    with pytest.raises(error):
        load.wait_layer(layer)
    with pytest.raises(error):
        await load.layer_ready(layer)
    assert not load.is_ready(layer)


@pytest.mark.asyncio
async def test_a_layer_that_fails_in_the_store_fails_its_waits_and_the_result() -> None:
    store = LayeredStore()
    engine, caches = engine_over(store)
    async with engine:
        load = await held(engine, store, fail_at_layer=2)
        blocked = asyncio.ensure_future(asyncio.to_thread(load.wait_layer, 2))
        readying = asyncio.ensure_future(load.layer_ready(3))
        store.gate.release(2)  # layers 0 and 1 copied
        await load.layer_ready(1)
        assert loaded(caches, 1)
        store.gate.release(1)  # then the failure (after it, no layer stands: below)
        with pytest.raises(aiokv.StoreError):
            await blocked  # woken by the failure, not left waiting
        with pytest.raises(aiokv.StoreError):
            await readying
        with pytest.raises(aiokv.StoreError, match="failed in the store"):
            await load.result()
        await all_raise(load, aiokv.StoreError, layer=0)  # the load failed: no layer stands


@pytest.mark.asyncio
async def test_a_failed_launch_and_a_failed_task_reach_every_wait() -> None:
    store = FaultyStore(LayeredStore())
    engine, _ = engine_over(store)
    async with engine:
        hit = await hit_of(engine, 1)
        store.launch_error = RuntimeError("launch refused")
        load = await engine.load_layerwise(hit, TARGET)  # ended, never launched: handed out
        with pytest.raises(aiokv.StoreError, match="launch refused"):
            await load.result()
        await all_raise(load, aiokv.StoreError)
        store.launch_error = None
        hit = await hit_of(engine, 2)
        store.fail_tasks = True
        load = await engine.load_layerwise(hit, TARGET)
        with pytest.raises(aiokv.StoreError):
            await load.result()
        await all_raise(load, aiokv.StoreError, layer=LAYERS - 1)


@pytest.mark.asyncio
async def test_invalid_page_ids_raise_invalid_request_from_every_wait() -> None:
    engine, _ = engine_over(LayeredStore())
    async with engine:
        hit = await hit_of(engine)
        load = await engine.load_layerwise(hit, torch.tensor([8, 9, 10, 10_000]))
        with pytest.raises(aiokv.InvalidRequest, match="10000"):
            await load.result()
        await all_raise(load, aiokv.InvalidRequest)


@pytest.mark.asyncio
async def test_an_evicted_key_loads_nothing_and_no_layer_reads_ready() -> None:
    engine, caches = engine_over(LayeredStore())
    async with engine:
        hit = await hit_of(engine)
        for cache in caches:
            cache[TARGET] = cache[SOURCE]  # the user's KV from before the evict
        assert await engine.evict(1) == TOKENS
        load = await engine.load_layerwise(hit, TARGET)
        assert await load.result() == aiokv.LoadResult(1, 0)  # as load() answers it
        await all_raise(load, aiokv.NotLoaded, layer=LAYERS - 1)
        with pytest.raises(aiokv.NotLoaded) as caught:
            load.wait_layer(0)
        assert (caught.value.loaded_tokens, caught.value.cached_tokens) == (0, TOKENS)
        assert engine.stats().store_tasks_open == 0


@pytest.mark.asyncio
async def test_an_empty_hit_is_loaded_at_once_and_its_layers_are_ready() -> None:
    engine, _ = engine_over(LayeredStore())
    async with engine:
        async with await engine.lookup(7, TOKENS) as miss:
            load = await engine.load_layerwise(miss, TARGET)
        assert await load.result() == aiokv.LoadResult(7, 0)
        load.wait_layer(0)  # nothing was asked for: nothing is missing
        await load.layer_ready(LAYERS - 1)
        assert engine.stats().empty_loads == 1


@pytest.mark.asyncio
async def test_a_timeout_and_a_close_fail_waits_blocked_on_held_layers() -> None:
    store = LayeredStore()
    # The offload and lookup before the held load run under the same deadline: 1 s, not
    # 50 ms, which a store thread held up on a loaded host outlasted (RequestTimeout).
    engine, _ = engine_over(store, request_timeout_ms=1_000)
    async with engine:
        load = await held(engine, store)  # and never given a permit
        blocked = asyncio.ensure_future(asyncio.to_thread(load.wait_layer, 0))
        readying = asyncio.ensure_future(load.layer_ready(0))
        with pytest.raises(aiokv.RequestTimeout):
            await load.result()
        for waiter in (blocked, readying):
            with pytest.raises(aiokv.RequestTimeout):
                await waiter
        await all_raise(load, aiokv.RequestTimeout)
        store.gate.release(LAYERS)
    store = LayeredStore()
    engine, _ = engine_over(store)
    await engine.start()
    load = await held(engine, store)
    blocked = asyncio.ensure_future(asyncio.to_thread(load.wait_layer, 1))
    await engine.aclose(drain=False, timeout=0.05)  # the launched copy outlives the close
    with pytest.raises(aiokv.EngineClosed):
        await blocked
    with pytest.raises(aiokv.EngineClosed):
        await load.result()
    await all_raise(load, aiokv.EngineClosed)
    store.gate.release(LAYERS)  # the store thread ends, and closes the store


@pytest.mark.asyncio
async def test_cancelling_the_load_reaches_every_wait() -> None:
    store = LayeredStore()
    engine, _ = engine_over(store)
    async with engine:
        load = await held(engine, store)
        blocked = asyncio.ensure_future(asyncio.to_thread(raised, load.wait_layer, 0))
        load.cancel()
        # A thread's wait raises concurrent.futures' CancelledError, not asyncio's.
        assert isinstance(await blocked, concurrent.futures.CancelledError)
        with pytest.raises(asyncio.CancelledError):
            await load.result()
        with pytest.raises(asyncio.CancelledError):
            await load.layer_ready(0)
        with pytest.raises(concurrent.futures.CancelledError):
            load.wait_layer(0)
        store.gate.release(LAYERS)  # a launched copy is never cancelled: it ends
    assert engine.stats().cancelled == 1


@pytest.mark.asyncio
async def test_a_caller_cancelled_before_the_launch_cancels_the_load() -> None:
    # Batches of two, or a long window: a lone load is still queued when its caller leaves.
    engine, caches = engine_over(LayeredStore(), window_us=1_000_000, max_batch_requests=2)
    async with engine:
        await asyncio.gather(*(engine.offload(u, SOURCE, TOKENS) for u in (1, 2)))
        hit, other = await asyncio.gather(*(engine.lookup(u, TOKENS) for u in (1, 2)))
        other.release()
        calling = asyncio.ensure_future(engine.load_layerwise(hit, TARGET))
        for _ in range(10):  # until the load is accepted (queued for the window)
            if engine.stats().pending:
                break
            await asyncio.sleep(0)
        assert engine.stats().pending == 1
        calling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await calling
        stats = engine.stats()
        assert (stats.cancelled, stats.pending) == (1, 0)
    assert all(untouched(caches, i) for i in range(LAYERS))  # never matched, never copied
    assert engine.stats().store_tasks_open == 0  # the reservation went back


@pytest.mark.asyncio
async def test_a_bad_layer_index_or_call_fails_alone_naming_it() -> None:
    engine, _ = engine_over(LayeredStore())
    with pytest.raises(aiokv.EngineClosed):
        await engine.load_layerwise(object(), TARGET)  # type: ignore[arg-type]
    async with engine:
        hit = await hit_of(engine)
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await engine.load_layerwise(object(), TARGET)  # type: ignore[arg-type]
        assert caught.value.field == "hit"
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await engine.load_layerwise(hit, TARGET[:2])
        assert caught.value.field == "page_ids"
        load = await engine.load_layerwise(hit, TARGET)
        for layer in (-1, LAYERS, True, 1.0):
            with pytest.raises(aiokv.InvalidRequest) as caught:
                load.wait_layer(layer)  # type: ignore[arg-type]
            assert caught.value.field == "layer"
            assert str(layer) in str(caught.value) or "must be an int" in str(caught.value)
            with pytest.raises(aiokv.InvalidRequest, match="layer"):
                await load.layer_ready(layer)  # type: ignore[arg-type]
        assert (await load.result()).loaded_tokens == TOKENS
        await load.layer_ready(np.int64(LAYERS - 1))  # type: ignore[arg-type]  # as num_tokens
        load.wait_layer(np.int64(0))  # type: ignore[arg-type]


def test_run_in_background_waits_for_layers_in_the_calling_thread() -> None:
    store = LayeredStore()
    engine, caches = engine_over(store)
    with aiokv.run_in_background(engine) as kv:
        kv.offload(1, SOURCE, TOKENS)
        store.gate = threading.Semaphore(0)
        load = kv.load_layerwise(kv.lookup(1, TOKENS), TARGET)
        for layer in range(LAYERS):
            store.gate.release()
            if layer % 2:
                load.wait_layer(layer)
            else:
                load.layer_ready(layer)
            assert loaded(caches, layer)
            if layer + 1 < LAYERS:
                assert untouched(caches, layer + 1)
        assert load.result(timeout=10) == aiokv.LoadResult(1, TOKENS)
        store.gate = None
        kv.offload(2, SOURCE, TOKENS)
        hit = kv.lookup(2, TOKENS)
        assert kv.evict(2) == TOKENS
        evicted = kv.submit_load_layerwise(hit, TARGET).result(timeout=10)
        assert evicted.result() == aiokv.LoadResult(2, 0)
        for wait in (evicted.wait_layer, evicted.layer_ready):
            with pytest.raises(aiokv.NotLoaded):
                wait(0)

        async def on_loop() -> aiokv.LoadResult:
            return evicted.result()  # ended: answered even on the loop's own thread

        ended = asyncio.run_coroutine_threadsafe(on_loop(), kv.loop).result(timeout=10)
        assert ended == aiokv.LoadResult(2, 0)
    assert evicted.result() == aiokv.LoadResult(2, 0)  # after the close too


def test_run_in_background_hands_out_errors_and_cancels_before_the_launch() -> None:
    # The handle's future is resolved as the launch notice lands; what ends the call before
    # that (an error at submit, the caller cancelling it) still reaches it. Batches of two
    # and a 10 s window: the lone load waits there until its caller cancels it (a 0.3 s
    # window let a loaded host launch it first, and the cancel came too late); the
    # other calls go in pairs, so that none waits the window out.
    engine, caches = engine_over(LayeredStore(), window_us=10_000_000, max_batch_requests=2)
    with aiokv.run_in_background(engine) as kv:
        for stored in [kv.submit_offload(user, SOURCE, TOKENS) for user in (1, 2)]:
            assert stored.result(timeout=30).stored_tokens == TOKENS
        hit, other = (f.result(timeout=30) for f in [kv.submit_lookup(u, TOKENS) for u in (1, 2)])
        with pytest.raises(aiokv.InvalidRequest) as caught:
            kv.submit_load_layerwise(hit, TARGET[:2]).result(timeout=10)
        assert caught.value.field == "page_ids"
        assert hit.held  # refused at the submit: the hit is still the caller's to load
        calling = kv.submit_load_layerwise(hit, TARGET)
        for _ in range(1000):  # until the load is accepted (queued for the window)
            if kv.stats().pending:
                break
        assert kv.stats().pending == 1
        assert calling.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            calling.result(timeout=10)
        for _ in range(1000):  # the cancel reaches the loop
            if kv.stats().cancelled:
                break
        stats = kv.stats()
        assert (stats.cancelled, stats.pending) == (1, 0)
        # The handle still serves. The cancelled load no longer counts toward the pair
        # (callers that left fill no window): an offload beside this load fills it.
        loading = kv.submit_load_layerwise(other, TARGET)
        assert kv.offload(3, SOURCE, TOKENS).stored_tokens == TOKENS
        load = loading.result(timeout=30)
        load.wait_layer(LAYERS - 1)
        assert all(loaded(caches, i) for i in range(LAYERS))
        assert load.result(timeout=10) == aiokv.LoadResult(2, TOKENS)


def test_a_load_cancelled_as_it_is_handed_out_leaves_the_others_of_its_round_theirs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Two loads launched in one round; the caller cancels the first one's future from its
    # thread at the last moment before the loop sets it (after any check the loop made).
    # It ends cancelled, once, and the second load, which nobody cancelled, is handed out
    # at its launch (its layers still held back), not at its end.
    store = LayeredStore()
    engine, caches = engine_over(store, window_us=10_000_000, max_batch_requests=2)
    first: list[concurrent.futures.Future[aiokv.BackgroundLayerwiseLoad]] = []
    cancelled = threading.Event()
    transition = concurrent.futures.Future.set_running_or_notify_cancel

    def cancelled_just_before(future: concurrent.futures.Future[Any]) -> bool:
        if first and future is first[0] and not cancelled.is_set():
            cancelled.set()
            caller = threading.Thread(target=future.cancel)  # its callbacks run there
            caller.start()
            caller.join()
        return transition(future)

    with aiokv.run_in_background(engine) as kv:
        for stored in [kv.submit_offload(user, SOURCE, TOKENS) for user in (1, 2)]:
            assert stored.result(timeout=30).stored_tokens == TOKENS
        hits = [kv.submit_lookup(user, TOKENS) for user in (1, 2)]
        first_hit, second_hit = (hit.result(timeout=30) for hit in hits)
        store.gate = threading.Semaphore(0)  # no layer is copied until let through
        monkeypatch.setattr(
            concurrent.futures.Future, "set_running_or_notify_cancel", cancelled_just_before
        )
        first.append(kv.submit_load_layerwise(first_hit, torch.arange(12, 16)))
        second = kv.submit_load_layerwise(second_hit, TARGET)  # the round's second load
        assert cancelled.wait(30)  # the loop was handing the first load out

        async def after_the_hand_out() -> None:  # queued behind the round's hand-out
            pass

        asyncio.run_coroutine_threadsafe(after_the_hand_out(), kv.loop).result(timeout=30)
        assert second.done()  # handed out at its launch, while every layer is held back
        load = second.result()
        assert isinstance(load, aiokv.BackgroundLayerwiseLoad)
        assert not load.is_ready(0) and all(untouched(caches, i) for i in range(LAYERS))
        assert concurrent.futures.wait(first, timeout=30).not_done == set()
        with pytest.raises(concurrent.futures.CancelledError):
            first[0].result()
        store.gate.release(2 * LAYERS)  # the cancelled load's copy still runs to its end
        load.wait_layer(LAYERS - 1)
        assert all(loaded(caches, i) for i in range(LAYERS))
        assert load.result(timeout=30) == aiokv.LoadResult(2, TOKENS)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.asyncio
async def test_a_hand_out_that_fails_leaves_the_others_of_its_round_theirs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Whoever is told of the first load's launch fails: that is logged, and the second
    # load of the round is still handed out at its launch (its layers held back), not at
    # its end.
    store = LayeredStore()
    engine, caches = engine_over(store, window_us=10_000_000, max_batch_requests=2)

    def broken(load: aiokv.LayerwiseLoad, decided: Callable[[bool], None]) -> None:
        raise RuntimeError(f"told of {load.user_id}'s launch")

    told: list[aiokv.LayerwiseLoad] = []
    async with engine:
        hits = await asyncio.gather(hit_of(engine, 1), hit_of(engine, 2))
        store.gate = threading.Semaphore(0)  # no layer is copied until let through
        first = asyncio.ensure_future(
            engine.load_layerwise(hits[0], torch.arange(12, 16), _on_handed_out=broken)
        )
        second = asyncio.ensure_future(
            engine.load_layerwise(hits[1], TARGET, _on_handed_out=lambda load, _: told.append(load))
        )
        await first  # woken by the round's hand-out, which has run to its end by now
        assert len(told) == 1  # the second load was handed out in the same round
        load = await second
        assert told == [load]
        assert not load.is_ready(0) and all(untouched(caches, i) for i in range(LAYERS))
        store.gate.release(2 * LAYERS)
        await load.layer_ready(LAYERS - 1)
        assert all(loaded(caches, i) for i in range(LAYERS))
        assert await load.result() == aiokv.LoadResult(2, TOKENS)
        assert await (await first).result() == aiokv.LoadResult(1, TOKENS)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [repr(r.exc_info[1]) for r in errors if r.exc_info] == [
        'RuntimeError("told of 1\'s launch")'
    ]


@pytest.mark.asyncio
async def test_waits_for_layers_leave_the_loops_threads_to_a_close_and_to_the_caller() -> None:
    # More layer_ready waits on stalled copies than the loop's default executor has
    # threads: its own work (a caller's to_thread, the close's join) still runs.
    store = LayeredStore()
    engine, _ = engine_over(store, request_timeout_ms=0)
    await engine.start()
    hits = [await hit_of(engine, user) for user in range(1, 4)]
    store.gate = threading.Semaphore(0)  # the copies stall
    loads = [await engine.load_layerwise(hit, TARGET) for hit in hits]
    executor = concurrent.futures.ThreadPoolExecutor(2)  # a small default executor
    asyncio.get_running_loop().set_default_executor(executor)
    waits = [asyncio.ensure_future(load.layer_ready(0)) for load in loads for _ in range(2)]
    try:
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 5) == "ran"
        closing = asyncio.ensure_future(engine.aclose(timeout=0.5))
        done, _ = await asyncio.wait([closing], timeout=5)
        assert done, "aclose(timeout=0.5) waited for the layers' waits"
    finally:
        store.gate.release(1000)
        await asyncio.gather(*waits, return_exceptions=True)
        await engine.aclose()
        executor.shutdown(wait=False)


@pytest.mark.asyncio
async def test_cancelled_layer_waits_leave_the_shared_wait_threads_to_other_engines() -> None:
    # The threads that wait for marked layers are every engine's: a caller polling a
    # stalled load with short timeouts (more polls than there are threads) must not
    # leave another engine's wait for a layer in place hanging.
    stalled_store, other_store = LayeredStore(), LayeredStore()
    stalled, _ = engine_over(stalled_store, request_timeout_ms=0)
    other, other_caches = engine_over(other_store, request_timeout_ms=0)
    await stalled.start()
    await other.start()
    try:
        load = await held(stalled, stalled_store)
        for _ in range(40):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(load.layer_ready(0), 0.005)
        other_load = await held(other, other_store)
        waiting = asyncio.ensure_future(other_load.layer_ready(0))  # a thread waits for it
        await asyncio.sleep(0)  # it runs up to its wait
        assert not waiting.done() and other_store.gate is not None
        other_store.gate.release(LAYERS)
        assert (await asyncio.wait_for(other_load.result(), 5)).loaded_tokens == TOKENS
        await asyncio.wait_for(waiting, 5)  # not queued behind the stalled load's waits
        assert loaded(other_caches, 0)
    finally:
        for store in (stalled_store, other_store):
            if store.gate is not None:
                store.gate.release(1000)
        await asyncio.wait_for(stalled.aclose(), 10)
        await asyncio.wait_for(other.aclose(), 10)


@pytest.mark.asyncio
async def test_a_bad_page_id_raises_invalid_request_from_a_wait_made_before_the_load_ends() -> None:
    # The embedded store's copier refuses the id before the loop delivers the load's end:
    # a wait made at once raises the end's typed error, not a store failure.
    engine = aiokv.OffloadEngine(small_store(), make_caches(layers=LAYERS, page_size=PAGE_SIZE),
                                 aiokv.EngineConfig())
    async with engine:
        hit = await hit_of(engine)
        load = await engine.load_layerwise(hit, torch.tensor([8, 9, 10, 10_000]))
        with pytest.raises(aiokv.InvalidRequest, match="10000") as raised:
            load.wait_layer(0)  # on the loop's thread: the end cannot come meanwhile
        assert raised.value.field == "page_ids"
        with pytest.raises(aiokv.InvalidRequest, match="10000"):
            await load.result()
    engine = aiokv.OffloadEngine(small_store(), make_caches(layers=LAYERS, page_size=PAGE_SIZE),
                                 aiokv.EngineConfig())
    with aiokv.run_in_background(engine) as kv:
        kv.offload(1, SOURCE, TOKENS)
        for _ in range(3):
            load = kv.load_layerwise(kv.lookup(1, TOKENS), torch.tensor([8, 9, 10, 10_000]))
            with pytest.raises(aiokv.InvalidRequest, match="10000"):
                await asyncio.to_thread(load.wait_layer, 0)
            with pytest.raises(aiokv.InvalidRequest, match="10000"):
                await asyncio.to_thread(load.result, 10)


class AnsweredTogether(StoreWrapper):
    """Holds back the answers of launched tasks until ``together`` of them ended, then
    gives those in one ``try_wait`` (in the order asked): the engine answers their callers
    in one loop step."""

    def __init__(self, inner: aiokv.Store) -> None:
        super().__init__(inner)
        self.together = 0
        self._ended: dict[int, Any] = {}

    def try_wait(self, task_ids: Any) -> dict[int, Any]:
        ended = self._ended
        ended.update(self.inner.try_wait([t for t in task_ids if t not in ended]))
        if len(ended) < self.together:
            return {}
        self.together = 0
        return {t: ended.pop(t) for t in task_ids if t in ended}


@pytest.mark.asyncio
@pytest.mark.parametrize("marks", [True, False], ids=["store marks", "end marks"])
async def test_every_wait_answers_as_result_from_the_moment_the_load_ended(marks: bool) -> None:
    # The layerwise load's end and another load's are answered in one step, the layerwise
    # first: once the other's caller has its error, result() raises the layerwise load's
    # at once, and every wait must raise it too, not report layers 0 and 1 (copied, and
    # marked by the store before it failed the load) ready.
    inner = LayeredStore(marks=marks)
    store = AnsweredTogether(inner)
    engine, _ = engine_over(store)
    async with engine:
        hit = await hit_of(engine, 1)
        other = await hit_of(engine, 2)
        inner.fail_at_layer = 2  # every load fails there, its layers 0 and 1 copied
        store.together = 2
        load = await engine.load_layerwise(hit, TARGET)
        with pytest.raises(aiokv.StoreError):
            await engine.load(other, torch.arange(12, 16))
        with pytest.raises(aiokv.StoreError):
            await load.result()
        assert not load.is_ready(0)
        with pytest.raises(aiokv.StoreError):
            load.wait_layer(0)
        with pytest.raises(aiokv.StoreError):
            await load.layer_ready(0)


@pytest.mark.asyncio
async def test_a_caller_cancelled_as_its_load_is_refused_for_overload_leaves_the_lookup_released(
) -> None:
    # max_pending=1 under overload "reject": the second load is refused (Overloaded) while
    # its caller is cancelled. That caller has its CancelledError and no load to retry
    # with: its Lookup goes back, as a cancelled load's does, not held until its TTL.
    store = LayeredStore()
    engine = aiokv.OffloadEngine(
        store, make_caches(layers=LAYERS, page_size=PAGE_SIZE),
        aiokv.EngineConfig(max_pending=1, overload="reject", window_us=0),
    )
    async with engine:
        first = await hit_of(engine, 1)
        second = await hit_of(engine, 2)
        store.gate = threading.Semaphore(0)
        try:
            holding = await engine.load_layerwise(first, TARGET)  # the one pending slot
            calling = asyncio.ensure_future(engine.load_layerwise(second, torch.arange(12, 16)))
            for _ in range(10):  # until the load was refused: its Lookup handed back
                await asyncio.sleep(0)  # the first: the call took the Lookup
                if second.held:
                    break
            assert second.held and engine.stats().pending == 1  # the holding load only
            calling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await calling
            assert not second.held and "state=released" in repr(second)
            # Its caller saw its cancellation, not the refusal: like a call cancelled
            # while it waited for room, never accepted, it is counted nowhere.
            assert engine.stats().rejected == 0
        finally:
            store.gate.release(LAYERS)
        assert await holding.result() == aiokv.LoadResult(1, TOKENS)
        assert engine.stats().store_tasks_open == 0  # its reservation went back too


def test_a_background_wait_that_times_out_lets_its_wait_thread_go() -> None:
    # A thread polling a stalled load with short timeouts, more polls than there are
    # shared wait threads: another engine's wait for a copied layer still returns.
    stalled_store, other_store = LayeredStore(), LayeredStore()
    stalled, _ = engine_over(stalled_store, request_timeout_ms=0)
    other, other_caches = engine_over(other_store, request_timeout_ms=0)
    with aiokv.run_in_background(stalled) as slow, aiokv.run_in_background(other) as kv:
        slow.offload(1, SOURCE, TOKENS)
        kv.offload(1, SOURCE, TOKENS)
        stalled_store.gate = threading.Semaphore(0)
        try:
            load = slow.load_layerwise(slow.lookup(1, TOKENS), TARGET)
            for _ in range(40):
                with pytest.raises(TimeoutError):
                    load.layer_ready(0, timeout=0.005)
            other_store.gate = threading.Semaphore(LAYERS)  # every layer may copy
            other_load = kv.load_layerwise(kv.lookup(1, TOKENS), TARGET)
            other_load.layer_ready(LAYERS - 1, timeout=5)
            assert loaded(other_caches, LAYERS - 1)
            assert other_load.result(timeout=5) == aiokv.LoadResult(1, TOKENS)
        finally:
            stalled_store.gate.release(1000)


@pytest.mark.asyncio
async def test_a_loads_end_reaches_layer_ready_while_the_wait_threads_are_all_taken() -> None:
    # 32 waits on another engine's stalled load hold every shared wait thread: this
    # engine's load times out, and its layer_ready ends with that timeout, not later.
    stalled_store, store = LayeredStore(), LayeredStore()
    stalled, _ = engine_over(stalled_store, request_timeout_ms=0)
    # The offload and lookup before the held load run under the same deadline: 1 s, not
    # 200 ms, which a store thread held up on a loaded host outlasted (RequestTimeout).
    engine, _ = engine_over(store, request_timeout_ms=1_000)
    await stalled.start()
    await engine.start()
    waits: list[asyncio.Future[None]] = []
    try:
        stalled_load = await held(stalled, stalled_store)
        waits = [asyncio.ensure_future(stalled_load.layer_ready(0)) for _ in range(40)]
        await asyncio.sleep(0.1)  # the waits take their threads
        load = await held(engine, store)
        waiting = asyncio.ensure_future(load.layer_ready(1))
        with pytest.raises(aiokv.RequestTimeout):
            await load.result()
        done, _ = await asyncio.wait([waiting], timeout=3)
        assert done, "layer_ready outlived its load's end"
        with pytest.raises(aiokv.RequestTimeout):
            waiting.result()
    finally:
        for gated in (stalled_store, store):
            if gated.gate is not None:
                gated.gate.release(1000)
        await asyncio.gather(*waits, return_exceptions=True)
        await asyncio.wait_for(stalled.aclose(), 10)
        await asyncio.wait_for(engine.aclose(), 10)


@pytest.mark.asyncio
async def test_waits_on_a_failed_load_do_not_keep_the_callers_frames() -> None:
    # Every wait raises the load's error: with the traceback it ended with, not one that
    # grows by the frames (and the locals) of every wait before.
    engine, _ = engine_over(small_store())
    async with engine:
        hit = await hit_of(engine)
        await engine.evict(1)
        load = await engine.load_layerwise(hit, TARGET)  # 0 tokens: every wait raises
        assert (await load.result()).loaded_tokens == 0

        class Hidden:  # a model step's local: a hidden-state tensor, say
            pass

        kept = []

        def model_step(layer: int) -> None:
            hidden = Hidden()
            kept.append(weakref.ref(hidden))
            with pytest.raises(aiokv.NotLoaded):
                load.wait_layer(layer)

        for i in range(50):
            model_step(i % LAYERS)
        gc.collect()
        assert [ref for ref in kept if ref() is not None] == []  # the last one's too
        for _ in range(50):
            with pytest.raises(aiokv.NotLoaded):
                await load.layer_ready(0)
        with pytest.raises(aiokv.NotLoaded) as caught:
            load.wait_layer(0)
        assert len(traceback.extract_tb(caught.value.__traceback__)) < 10


@pytest.mark.asyncio
@pytest.mark.parametrize("marks", [True, False], ids=["store marks", "end marks"])
async def test_no_wait_reports_a_layer_ready_once_the_load_is_cancelled(marks: bool) -> None:
    store = LayeredStore(marks=marks)
    engine, caches = engine_over(store)
    async with engine:
        load = await held(engine, store)
        store.gate.release(1)  # layer 0 copied
        # Seen copied (and ready, where the store marks its layers) before the cancel: a
        # cancel that came first left no layer to report, whatever a wait then said.
        for _ in range(3000):
            if load.is_ready(0) if marks else loaded(caches, 0):
                break
            await asyncio.sleep(0.01)
        assert load.is_ready(0) if marks else loaded(caches, 0), "layer 0 was not copied"
        load.cancel()
        try:
            assert not load.is_ready(0)
            with pytest.raises(asyncio.CancelledError):
                await load.layer_ready(0)
            with pytest.raises(concurrent.futures.CancelledError):
                load.wait_layer(0)
        finally:
            store.gate.release(LAYERS)  # a launched copy is never cancelled: it ends


def _launched_then_its_loop_closed(
        new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> tuple[aiokv.OffloadEngine, LayeredStore, aiokv.LayerwiseLoad]:
    """An engine with a layerwise load launched whose layers wait for the store's gate,
    its loop then closed without aclose (the engine still open)."""
    store = LayeredStore(marks=False)
    engine, _ = engine_over(store)
    loop = new_loop()

    async def launch() -> aiokv.LayerwiseLoad:
        await engine.start()
        return await held(engine, store)

    try:
        load = loop.run_until_complete(launch())
    finally:
        loop.close()
    return engine, store, load


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop],
                         ids=["asyncio", "uvloop"])
def test_a_close_after_the_loop_was_closed_wakes_a_thread_waiting_for_a_layer(
        new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """The engine's loop is closed without aclose (after which any loop may close the
    engine) while a thread waits for a layer that only the load's end marks: that close
    wakes it with EngineClosed, and every wait after raises it at once; no loop is left
    to deliver the load's end."""
    engine, store, load = _launched_then_its_loop_closed(new_loop)
    outcome: list[BaseException | None] = []
    # A daemon: without the fix it waits forever, and must not hold up the session.
    waiter = threading.Thread(target=lambda: outcome.append(raised(load.wait_layer, 0)),
                              name="test-layer-waiter", daemon=True)
    waiter.start()
    store.gate.release(LAYERS)  # the copy ends on the store thread; its answer finds no loop
    asyncio.run(engine.aclose(timeout=10))
    waiter.join(30)
    assert outcome and isinstance(outcome[0], aiokv.EngineClosed), outcome or "still waiting"
    with pytest.raises(aiokv.EngineClosed):
        load.wait_layer(LAYERS - 1)
    assert not load.is_ready(0)


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop],
                         ids=["asyncio", "uvloop"])
def test_a_close_after_the_loop_was_closed_leaves_no_aiokv_task_logged_destroyed(
        new_loop: Callable[[], asyncio.AbstractEventLoop],
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine's loop is closed without aclose with a layerwise load in flight, and
    the engine is then closed from another loop, as its docstring allows: that close
    settles what the engine's tasks on the dead loop held (their requests counted, the
    load ended with EngineClosed). asyncio then logged "Task was destroyed but it is
    pending!" for the aiokv-batcher and aiokv-load-layerwise tasks as they were
    collected, an error that read as lost work."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    batcher = _closed_after_its_loop(new_loop)
    gc.collect()
    assert batcher() is None  # collected: asyncio's log of it, if any, is in
    destroyed = [r.getMessage() for r in caplog.records if "destroyed" in r.getMessage()]
    assert not [m for m in destroyed if "aiokv" in m], destroyed


def _closed_after_its_loop(
        new_loop: Callable[[], asyncio.AbstractEventLoop]) -> weakref.ref[Any]:
    """An engine whose loop was closed with a layerwise load in flight, closed from
    another loop, its load ended with EngineClosed: its batcher task, weakly (nothing
    else of it is left)."""
    engine, store, load = _launched_then_its_loop_closed(new_loop)
    store.gate.release(LAYERS)
    asyncio.run(engine.aclose(timeout=10))
    assert isinstance(raised(load.wait_layer, LAYERS - 1), aiokv.EngineClosed)
    return weakref.ref(engine._batcher_task)


@pytest.mark.parametrize("wait", ["result", "layer_ready"])
@pytest.mark.parametrize("hand_over", ["refused", "dropped"])
def test_a_threads_wait_handed_over_as_the_close_ends_gets_the_loads_end(
        monkeypatch: pytest.MonkeyPatch, wait: str, hand_over: str) -> None:
    """A thread asks a background load for its end (``result``, ``layer_ready``) while it
    still runs, and is preempted before its wait reaches the loop; meanwhile a close ends
    the load with EngineClosed and closes the loop. The wait answers with that end: not
    the RuntimeError of a loop already closed (``refused``), nor a hang where the loop's
    close dropped the wait handed to it in its last moment (``dropped``)."""
    store = LayeredStore()
    engine, _ = engine_over(store)
    kv = aiokv.run_in_background(engine)
    closed = threading.Event()
    real = asyncio.run_coroutine_threadsafe

    def late(coro: Any, loop: asyncio.AbstractEventLoop) -> concurrent.futures.Future[Any]:
        closed.wait(30)  # the thread runs again only once the close has ended
        if hand_over == "refused":
            return real(coro, loop)  # RuntimeError: the loop is closed
        coro.close()  # handed over, and dropped with the loop's last callbacks
        return concurrent.futures.Future()

    try:
        kv.offload(1, SOURCE, TOKENS)
        hit = kv.lookup(1, TOKENS)
        store.gate = threading.Semaphore(0)  # the load's layers never copy
        load = kv.load_layerwise(hit, TARGET)
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", late)
        outcome: list[BaseException | None] = []
        asking = threading.Thread(
            target=lambda: outcome.append(raised(getattr(load, wait), *(
                (0,) if wait == "layer_ready" else ()), 2.0)),
            name="test-asking", daemon=True)
        asking.start()
        kv.close(drain=False, timeout=0.05)  # the launched copy outlives the close
        closed.set()
        asking.join(30)
        assert outcome and isinstance(outcome[0], aiokv.EngineClosed), outcome or "waiting"
    finally:
        closed.set()
        kv.close()
        if store.gate is not None:
            store.gate.release(LAYERS)  # a launched copy is never cancelled: it ends
