"""The Store contract, run against every store available here.

LocalStore runs everywhere (CPU caches, and CUDA caches where a GPU is present);
FlexKVStore runs where flexkv imports and CUDA is present, and is skipped with the reason
otherwise. The engine end to end runs on top of each.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import launch_slots, wait_for_exit

import aiokv
from aiokv.stores.flexkv import flexkv_available

PAGE = 16
LAYERS, PAGES, HEADS, DIM = 2, 128, 2, 64


def _params() -> list[object]:
    """(backend, device, own_process): each store in this process and in a child of its
    own (ProcessStore)."""
    cuda = torch.cuda.is_available()
    flexkv_reason = flexkv_available()
    no_cuda = pytest.mark.skipif(not cuda, reason="no CUDA device")
    no_flexkv = pytest.mark.skipif(
        flexkv_reason is not None, reason=f"FlexKV not usable: {flexkv_reason}"
    )
    return [
        pytest.param(("local", "cpu", False), id="local-cpu"),
        pytest.param(("local", "cpu", True), id="local-cpu-process"),
        pytest.param(("local", "cuda", False), id="local-cuda", marks=no_cuda),
        pytest.param(("local", "cuda", True), id="local-cuda-process", marks=no_cuda),
        pytest.param(("flexkv", "cuda", False), id="flexkv",
                     marks=[no_flexkv, pytest.mark.flexkv]),
        pytest.param(("flexkv", "cuda", True), id="flexkv-process",
                     marks=[no_flexkv, pytest.mark.flexkv]),
    ]


class Bench:
    def __init__(self, backend: str, device: str, own_process: bool) -> None:
        generator = torch.Generator(device=device).manual_seed(1)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.caches = [
            torch.randn(PAGES, 2, PAGE, HEADS, DIM, generator=generator, device=device).to(dtype)
            for _ in range(LAYERS)
        ]
        self.original = [c.clone() for c in self.caches]
        config = aiokv.StoreConfig(
            backend=backend,  # type: ignore[arg-type]
            page_size=PAGE,
            cpu_cache_gb=0.25,
            own_process=own_process,
        )
        self.store = aiokv.stores.make_store(config)
        # Every store brings GPU page ids to the host: FlexKV's slots, a store process's ids,
        # the embedded store's copier (one copy per job whose ids are on the GPU: README).
        self.copies_ids = device == "cuda"

    def slots(self, pages: list[int], mask: np.ndarray) -> np.ndarray:
        all_slots = (np.asarray(pages)[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
        return all_slots[: len(mask)][mask[: len(all_slots)]].astype(np.int64)

    def wait(self, ids: list[int], timeout_s: float = 60) -> dict[int, aiokv.TaskResult]:
        results: dict[int, aiokv.TaskResult] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < len(ids):
            assert time.monotonic() < deadline, f"tasks {ids} not terminal in {timeout_s}s"
            results.update(self.store.try_wait([i for i in ids if i not in results]))
            time.sleep(0.0005)
        return results

    def put(self, namespace: str, pages: list[int], tokens: int) -> np.ndarray:
        task, mask = self.store.put_match(np.arange(tokens, dtype=np.int64), [namespace])
        if mask.any():
            launch_slots(self.store, [task], [self.slots(pages, mask)])
            assert self.wait([task])[task].status is aiokv.TaskStatus.SUCCESS
        else:
            self.store.cancel([task])
        return mask


# The store of its own process: started once for the module's store-level tests (a start
# is an interpreter and torch, seconds on a 2-core box, for tests of milliseconds). Each
# such test still begins on an empty store and on the caches as made (:func:`bench`).
SHARED = ("local", "cpu", True)


@pytest.fixture(scope="module")
def process_bench() -> Iterator[Bench]:
    b = Bench(*SHARED)
    b.store.register(b.caches)
    yield b
    b.store.close()


@pytest.fixture(params=_params())
def bench(request: pytest.FixtureRequest) -> Iterator[Bench]:
    if request.param != SHARED:
        b = Bench(*request.param)
        b.store.register(b.caches)
        yield b
        b.store.close()
        return
    b = request.getfixturevalue("process_bench")
    for cache, original in zip(b.caches, b.original, strict=True):
        cache.copy_(original)
    yield b
    b.store.clear()
    # Nothing the test matched or launched holds a block past the clear: the next test
    # begins on an empty store.
    assert b.store.store_stats()["host_blocks_used"] == 0, "the test left store tasks open"


def test_put_mask_covers_full_pages_only_then_dedups(bench: Bench) -> None:
    tokens = 3 * PAGE + 5
    mask = bench.put("a", [0, 1, 2, 3], tokens)
    assert mask.shape == (tokens,) and mask[: 3 * PAGE].all() and not mask[3 * PAGE :].any()
    task, again = bench.store.put_match(np.arange(tokens, dtype=np.int64), ["a"])
    assert not again.any()
    bench.store.cancel([task])


def repeat_writes_nothing(bench: Bench, tokens: np.ndarray, namespace: str) -> None:
    """A put of pages another put is writing never writes them again: an all-False mask
    (FlexKV), or NoSpace until that write is in (the embedded store, which counts no
    page a failed write would roll back: the engine matches it again)."""
    try:
        repeat, again = bench.store.put_match(tokens, [namespace])
    except aiokv.stores.NoSpace as exc:
        assert "being written" in str(exc)
        return
    assert not again.any()
    bench.store.cancel([repeat])


def test_a_repeat_put_while_the_first_is_written_writes_nothing(bench: Bench) -> None:
    # The same key offloaded twice before the first copy ends: the second has nothing
    # to write, and the store is not full.
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    first, mask = bench.store.put_match(tokens, ["twice"])
    assert mask.all()
    repeat_writes_nothing(bench, tokens, "twice")
    launch_slots(bench.store, [first], [bench.slots([3, 4], mask)])
    repeat_writes_nothing(bench, tokens, "twice")
    assert bench.wait([first])[first].status is aiokv.TaskStatus.SUCCESS
    after, done = bench.store.put_match(tokens, ["twice"])
    assert not done.any()
    bench.store.cancel([after])


def test_growth_marks_only_the_new_suffix(bench: Bench) -> None:
    bench.put("g", [0, 1], 2 * PAGE)
    mask = bench.put("g", [0, 1, 2, 3], 4 * PAGE)
    assert not mask[: 2 * PAGE].any() and mask[2 * PAGE :].all()


def test_round_trip_is_bit_exact(bench: Bench) -> None:
    bench.put("r", [5, 9, 2], 3 * PAGE)
    task, mask = bench.store.get_match(np.arange(3 * PAGE, dtype=np.int64), ["r"])
    assert mask.all()
    launch_slots(bench.store, [task], [bench.slots([100, 101, 102], mask)])
    assert bench.wait([task])[task].status is aiokv.TaskStatus.SUCCESS
    for cache, original in zip(bench.caches, bench.original, strict=False):
        assert torch.equal(cache[100:103], original[[5, 9, 2]])


def test_get_of_unknown_key_matches_nothing(bench: Bench) -> None:
    task, mask = bench.store.get_match(np.arange(2 * PAGE, dtype=np.int64), ["nobody"])
    assert not mask.any()
    bench.store.cancel([task])


def test_cancel_rolls_a_put_back(bench: Bench) -> None:
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    task, _mask = bench.store.put_match(tokens, ["c"])
    bench.store.cancel([task])
    get_task, hit = bench.store.get_match(tokens, ["c"])
    assert not hit.any()
    bench.store.cancel([get_task])
    task, again = bench.store.put_match(tokens, ["c"])
    assert again.all()  # still to be written
    bench.store.cancel([task])


def test_one_launch_of_several_tasks_answers_each_id_once(bench: Bench) -> None:
    ids, slots = [], []
    for user in range(3):
        task, mask = bench.store.put_match(np.arange(2 * PAGE, dtype=np.int64), [f"b{user}"])
        ids.append(task)
        slots.append(bench.slots([2 * user, 2 * user + 1], mask))
    launch_slots(bench.store, ids, slots)
    results = bench.wait(ids)
    assert set(results) == set(ids)
    for task in ids:
        assert results[task].status is aiokv.TaskStatus.SUCCESS
        assert results[task].mask is None or results[task].mask.sum() == 2 * PAGE
    # Each id is answered once: asked again, a store answers nothing or a non-success
    # (FlexKVStore reports the id as unknown, as FlexKV itself does).
    again = bench.store.try_wait(ids)
    assert all(r.status is not aiokv.TaskStatus.SUCCESS for r in again.values())
    for user in range(3):
        task, hit = bench.store.get_match(np.arange(2 * PAGE, dtype=np.int64), [f"b{user}"])
        assert hit.all()
        bench.store.cancel([task])


@pytest.fixture(params=_params())
def unregistered(request: pytest.FixtureRequest) -> Bench:
    return Bench(*request.param)


@pytest.mark.asyncio
async def test_engine_end_to_end_on_this_store(unregistered: Bench) -> None:
    bench = unregistered
    engine = aiokv.OffloadEngine(bench.store, bench.caches, aiokv.EngineConfig(window_us=500))
    users = 8
    async with engine:  # registers the store on the store thread, closes it on exit
        device = bench.caches[0].device
        sources = [torch.arange(4 * u, 4 * u + 4, device=device) for u in range(users)]
        stored = await asyncio.gather(
            *(engine.offload(u, sources[u], 4 * PAGE - 3) for u in range(users))
        )
        hits = await asyncio.gather(*(engine.lookup(u, 4 * PAGE) for u in range(users)))
        targets = [torch.arange(64 + 4 * u, 68 + 4 * u, device=device) for u in range(users)]
        loaded = await asyncio.gather(*(engine.load(h, t) for h, t in zip(hits, targets, strict=False)))
    # After close: the store's figures (d2h_copies among them) are final then; while it
    # runs they are refreshed at most every 0.1 s.
    stats = engine.stats()
    assert [r.stored_tokens for r in stored] == [3 * PAGE] * users
    assert [r.loaded_tokens for r in loaded] == [3 * PAGE] * users
    for u in range(users):
        for cache, original in zip(bench.caches, bench.original, strict=False):
            assert torch.equal(cache[targets[u][:3]], original[sources[u][:3]])
    assert stats.pending == 0 and stats.store_tasks_open == 0 and stats.failed == 0
    if bench.copies_ids:
        # One copy per offload or load batch; lookup batches copy nothing.
        assert 2 <= stats.d2h_copies < stats.batches
    else:  # page ids on the host: nothing to copy
        assert stats.d2h_copies == 0


@pytest.mark.asyncio
async def test_evict_drops_one_key_and_clear_drops_every_key_on_this_store(
    unregistered: Bench,
) -> None:
    bench = unregistered
    engine = aiokv.OffloadEngine(bench.store, bench.caches, aiokv.EngineConfig(window_us=500))
    tokens = 3 * PAGE
    async with engine:
        device = bench.caches[0].device

        def pages(first: int) -> torch.Tensor:
            return torch.arange(first, first + 3, device=device)

        for user in range(4):
            assert (await engine.offload(user, pages(3 * user), tokens)).stored_tokens == tokens
        assert await engine.evict(0) == tokens
        assert await engine.evict(0) == 0  # nothing left of it
        async with await engine.lookup(0, tokens) as gone:
            assert gone.cached_tokens == 0
        async with await engine.lookup(1, tokens) as kept:
            assert kept.cached_tokens == tokens
        # User 0's history was rewritten: its new KV is stored, not skipped as stored.
        assert (await engine.offload(0, pages(30), tokens)).stored_tokens == tokens
        hit = await engine.lookup(0, tokens)
        assert (await engine.load(hit, pages(60))).loaded_tokens == tokens
        for cache, original in zip(bench.caches, bench.original, strict=False):
            assert torch.equal(cache[60:63], original[30:33])
        assert await engine.clear() >= 0
        for user in range(4):
            async with await engine.lookup(user, tokens) as after:
                assert after.cached_tokens == 0, user
        stats = engine.stats()
    assert stats.pending == 0 and stats.store_tasks_open == 0 and stats.failed == 0


@pytest.mark.asyncio
async def test_a_killed_store_process_is_restarted_and_serves_on(unregistered: Bench) -> None:
    bench = unregistered
    if not isinstance(bench.store, aiokv.stores.ProcessStore):
        pytest.skip("the store runs in this process")
    engine = aiokv.OffloadEngine(bench.store, bench.caches, aiokv.EngineConfig(window_us=500))
    tokens = 3 * PAGE
    async with engine:
        device = bench.caches[0].device
        assert (await engine.offload(0, torch.arange(0, 3, device=device), tokens)).stored_tokens
        first = bench.store.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await asyncio.to_thread(wait_for_exit, first)
        # Killed while idle: the next call starts a new child (empty, caches registered).
        stored = await engine.offload(1, torch.arange(3, 6, device=device), tokens)
        assert stored.stored_tokens == tokens
        assert bench.store.pid not in (None, first)
        async with await engine.lookup(0, tokens) as lost:
            assert lost.cached_tokens == 0  # it lived in the dead child
        hit = await engine.lookup(1, tokens)
        assert (await engine.load(hit, torch.arange(60, 63, device=device))).loaded_tokens == tokens
        for cache, original in zip(bench.caches, bench.original, strict=False):
            assert torch.equal(cache[60:63], original[3:6])
        stats = engine.stats()
    assert stats.store_restarts == 1 and stats.pending == 0 and stats.store_tasks_open == 0
