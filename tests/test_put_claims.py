"""What an offload reports is stored: its key's pages another offload is still writing
count only once that write is in (if it fails, this offload writes them itself), in the
embedded store, in a store process and on the store server."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_caches
from shared_host import PAGE_SIZE, caches, observer, user_kv, wait_for
from shared_inprocess import Host

import aiokv
from aiokv.stores.base import NoSpace
from aiokv.stores.shared import SharedStore

BOUND_S = 10.0  # a call that should answer at once, bounded so that a fault fails, not hangs
PAGE = 4  # make_caches' page size


async def answer(call: Awaitable[Any]) -> Any:
    """A call's result or the error it raised, within BOUND_S."""
    try:
        return await asyncio.wait_for(call, BOUND_S)
    except (aiokv.AiokvError, TimeoutError) as exc:
        return exc


@asynccontextmanager
async def engine_for(backend: str, caches_: list[torch.Tensor], **engine: Any
                     ) -> AsyncIterator[aiokv.OffloadEngine]:
    store = aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=backend == "process")
    async with aiokv.open_engine({"engine": dict(engine), "store": {
            "cpu_cache_gb": store.cpu_cache_gb, "own_process": store.own_process}},
            kv_caches=caches_) as kv:
        yield kv


async def offload_twice(backend: str, key: str, first: list[int], second: list[int]
                        ) -> tuple[Any, Any, int, int | None]:
    """Two offloads of ``key`` (4 pages each: ``first``'s, then ``second``'s page ids) in
    one batch: their answers, the tokens a lookup of the key then loads, and whose
    bytes it loaded (0: ``first``'s, 1: ``second``'s, None: neither's)."""
    tables = make_caches()
    original = [t.clone() for t in tables]
    async with engine_for(backend, tables, window_us=100_000, max_batch_requests=2,
                          request_timeout_ms=60_000) as engine:
        answers = await asyncio.gather(
            answer(engine.offload(key, torch.tensor(first), 4 * PAGE)),
            answer(engine.offload(key, torch.tensor(second), 4 * PAGE)))
        target = torch.arange(200, 204)
        async with await engine.lookup(key, 4 * PAGE) as hit:
            found = (await engine.load(hit, target)).loaded_tokens if hit.cached_tokens else 0
    whose = [i for i, pages in enumerate((first, second)) if max(pages) < len(tables[0])
             and all(torch.equal(c[target], o[pages]) for c, o in zip(tables, original,
                                                                    strict=True))]
    return answers[0], answers[1], found, whose[0] if whose else None


# ---- one engine: two offloads of one key in one batch ----------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["local", "process"])
async def test_a_failed_offload_leaves_a_good_one_of_its_key_storing_its_own_pages(
        backend: str) -> None:
    """The first offload of "A" has a bad page id and fails alone; the second, matched
    while the first's pages were being written, used to be told they were stored
    (cached_tokens 16) while the failure rolled them back (a lookup then found 0). It
    now writes them itself: a lookup finds them and loads its bytes."""
    bad, good, found, whose = await offload_twice(backend, "A", [0, 1, 2, 999], [4, 5, 6, 7])
    assert isinstance(bad, aiokv.InvalidRequest) and "999" in str(bad), repr(bad)
    assert isinstance(good, aiokv.OffloadResult), repr(good)
    assert (good.stored_tokens, good.cached_tokens) == (4 * PAGE, 4 * PAGE)
    assert found == 4 * PAGE and whose == 1


@pytest.mark.asyncio
async def test_two_good_offloads_of_one_key_at_once_still_write_it_once() -> None:
    """The second waits for the first's write rather than writing the pages again: one
    of them stored the key, the other reports it cached, and a lookup loads the bytes
    of the one that stored it."""
    first, second, found, whose = await offload_twice("local", "B", [0, 1, 2, 3], [4, 5, 6, 7])
    assert isinstance(first, aiokv.OffloadResult) and isinstance(second, aiokv.OffloadResult)
    assert (first.stored_tokens, second.stored_tokens) == (4 * PAGE, 0)
    assert first.cached_tokens == second.cached_tokens == 4 * PAGE
    assert found == 4 * PAGE and whose == 0


# ---- the store server: engines of one host ---------------------------------------------


def test_the_server_answers_a_put_of_pages_being_written_no_room_yet(tmp_path: Path) -> None:
    """At the seam: a put of pages another engine's put still writes gets NoSpace (the
    engine waits and matches again), never a mask that reads as stored; once the first
    put failed, the pages are new to it."""
    host = Host(tmp_path, ssd=False)
    host.start()
    first, _ = observer(host.socket)
    second, _ = observer(host.socket)
    try:
        tokens = np.arange(4 * PAGE_SIZE, dtype=np.int64)
        task, mask = first.put_match(tokens, ["k"])
        assert mask.all()
        with pytest.raises(NoSpace, match="being written"):
            second.put_match(tokens, ["k"])
        first.launch([task], [torch.tensor([0, 1, 2, 10**6])], [None])
        results: dict[int, Any] = {}
        wait_for(lambda: results.update(first.try_wait([task])) or results, "the failure")
        assert results[task].status is aiokv.stores.TaskStatus.INVALID
        again, mask = second.put_match(tokens, ["k"])
        assert mask.all()  # its own to write now
        second.cancel([again])
    finally:
        first.close()
        second.close()
        host.stop()


@pytest.mark.asyncio
async def test_an_engine_on_the_server_stores_what_another_engines_failed_put_did_not(
        tmp_path: Path) -> None:
    """Engine B offloads key "k" while another engine's put of it is matched (its pages
    reserved, being written): B waits; that put fails; B writes the pages itself, and
    a lookup loads B's bytes."""
    host = Host(tmp_path, ssd=False)
    host.start()
    other, _ = observer(host.socket)
    tables = caches()
    for cache, kv in zip(tables, user_kv(7, 4), strict=True):
        cache[:4] = kv
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
    try:
        tokens = np.arange(4 * PAGE_SIZE, dtype=np.int64)
        task, _ = other.put_match(tokens, ["k"])
        config = aiokv.EngineConfig(request_timeout_ms=60_000)
        async with aiokv.OffloadEngine(store, tables, config) as engine:
            offload = asyncio.ensure_future(engine.offload(
                "k", torch.arange(4), 4 * PAGE_SIZE, namespace=["k"]))
            for _ in range(int(BOUND_S / 0.01)):  # until it waits (or, unfixed, answers)
                if offload.done() or engine.stats().space_waits:
                    break
                await asyncio.sleep(0.01)
            other.launch([task], [torch.tensor([0, 1, 2, 10**6])], [None])
            results: dict[int, Any] = {}
            while not results:  # its end reaches the server with its answer
                results.update(other.try_wait([task]))
                await asyncio.sleep(0.01)
            got = await answer(offload)
            hit = await engine.lookup("k", 4 * PAGE_SIZE, namespace=["k"])
            async with hit:
                cached = hit.cached_tokens
                loaded = (await engine.load(hit, torch.arange(60, 64))).loaded_tokens
    finally:
        other.close()
        host.stop()
    assert isinstance(got, aiokv.OffloadResult), repr(got)
    assert (got.stored_tokens, got.cached_tokens) == (4 * PAGE_SIZE, 4 * PAGE_SIZE)
    assert cached == loaded == 4 * PAGE_SIZE
    assert all(torch.equal(cache[60:64], kv)
               for cache, kv in zip(tables, user_kv(7, 4), strict=True))


# ---- a put stages all its new pages on the host tier at once ---------------------------

HOST_BLOCKS = 16  # of make_caches' 1 KiB blocks (16 KiB: whole memory pages)
BLOCK_BYTES = 1024


@asynccontextmanager
async def tiered(backend: str, directory: Path, policy: str = "write_through"
                 ) -> AsyncIterator[tuple[aiokv.OffloadEngine, list[torch.Tensor]]]:
    """An engine on a host tier of HOST_BLOCKS blocks over an SSD tier of ~2000 (embedded,
    in a store process, or on a store server), and its caches; a minute's
    request_timeout_ms, so that an offload that waits for room would show (answer() gives
    up after BOUND_S)."""
    tiers = aiokv.StoreConfig(
        cpu_cache_gb=HOST_BLOCKS * BLOCK_BYTES / 2**30, ssd_cache_gb=0.002,
        ssd_cache_dir=str(directory / "ssd"), ssd_write_policy=policy)  # type: ignore[arg-type]
    config = aiokv.EngineConfig(request_timeout_ms=60_000)
    tables = make_caches(pages=64)
    host = None
    if backend == "server":
        host = Host(directory)  # makes directory/ssd
        host.config = tiers
        host.start()
        store: Any = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
    else:
        (directory / "ssd").mkdir()
        store = aiokv.stores.make_store(
            dataclasses.replace(tiers, own_process=backend == "process"))
    try:
        async with aiokv.OffloadEngine(store, tables, config) as engine:
            yield engine, tables
    finally:
        if host is not None:
            host.stop()


BACKENDS = ["local", "process", "server"]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_offload_of_more_new_pages_than_the_host_tier_has_fails_at_once(
        backend: str, tmp_path: Path) -> None:
    """20 new pages, a host tier of 16 blocks: within both tiers (the call's bound), but
    never all on the host at once. It used to wait out request_timeout_ms for room that
    could not come, then fail with StoreFull; now it fails at its match with an
    InvalidRequest naming the counts, and the same history offloaded in two steps is
    stored."""
    async with tiered(backend, tmp_path) as (engine, _):
        got = await answer(engine.offload(1, torch.arange(20), 20 * PAGE))
        first = await answer(engine.offload(1, torch.arange(16), 16 * PAGE))
        second = await answer(engine.offload(1, torch.arange(20), 20 * PAGE))
    assert isinstance(got, aiokv.InvalidRequest), repr(got)
    assert got.field == "num_tokens" and f"{20 * PAGE} tokens" in str(got)
    assert "20 of its 20 full pages are new" in str(got) and "16 blocks" in str(got), str(got)
    assert isinstance(first, aiokv.OffloadResult) and first.stored_tokens == 16 * PAGE
    assert isinstance(second, aiokv.OffloadResult), repr(second)
    assert (second.stored_tokens, second.cached_tokens) == (4 * PAGE, 20 * PAGE)


@pytest.mark.asyncio
@pytest.mark.parametrize(("backend", "policy"), [
    *((b, "write_through") for b in BACKENDS), ("local", "write_back")])
async def test_a_history_longer_than_the_host_tier_keeps_growing(
        backend: str, policy: str, tmp_path: Path) -> None:
    """A user's history grows past the host tier (16 blocks) to 52 pages: each offload
    needs room for its new pages only, however long the prefix the SSD tier holds. It
    used to hold the key's own pages on the host while it reserved, so the offload of
    page 17 waited out request_timeout_ms; now the pages the SSD has too may be evicted
    for it, and with write_back those it lacks are copied down first (11 new pages:
    more than write_back keeps copied ahead of eviction). The prefix still loads bit for
    bit."""
    async with tiered(backend, tmp_path, policy) as (engine, tables):
        original = [t.clone() for t in tables]
        stored = 0
        for pages in (8, 16, 17, 24, 32, 40, 41, 52, 52):
            got = await answer(engine.offload(1, torch.arange(pages), pages * PAGE))
            assert isinstance(got, aiokv.OffloadResult), (pages, repr(got))
            assert (got.stored_tokens, got.cached_tokens) == (
                (pages - stored) * PAGE, pages * PAGE), pages
            stored = pages
        # A store server's lookup misses SSD pages the host tier has no room for at once:
        # let the tail's SSD copies (write_through) end first. ssd_blocks_used counts the
        # slots of writes still under way too; the bytes written count only those in.
        for _ in range(int(BOUND_S / 0.01)):
            if policy == "write_back" or engine.stats().bytes_ssd_written >= (
                    stored * BLOCK_BYTES):
                break
            await asyncio.sleep(0.01)
        async with await engine.lookup(1, 8 * PAGE) as hit:
            loaded = (await engine.load(hit, torch.arange(48, 56))).loaded_tokens
    assert loaded == 8 * PAGE
    assert all(torch.equal(t[48:56], o[:8]) for t, o in zip(tables, original, strict=True))


def _stores(blocks: int) -> tuple[aiokv.LocalStore, aiokv.LocalStore]:
    """Two embedded stores of ``blocks`` host blocks on the same caches."""
    caches = make_caches()
    block_gb = sum(c[0].nbytes for c in caches) / 1e9
    made = []
    for _ in range(2):
        store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=blocks * block_gb * 1.0001,
                                                   page_size=PAGE))
        store.register(caches)
        made.append(store)
    return made[0], made[1]


def _outcome(answer: Any) -> tuple[str, list[bool]]:
    if isinstance(answer, Exception):
        return type(answer).__name__, []
    return "ok", answer[1].tolist()


@pytest.mark.parametrize("seed", range(12))
def test_a_batch_of_puts_answers_as_the_same_puts_one_by_one(seed: int) -> None:
    """put_match_many (one reservation for the batch's keys never seen) against the same
    queries one by one on a twin store: the same answers (masks, or the same error) for
    batches that mix new keys, a key named twice, grown and repeated histories of stored
    keys, empty and too-large puts, and more new pages than fit."""
    rng = np.random.default_rng(seed)
    batched, single = _stores(blocks=48)
    try:
        stored: list[str] = []
        for round_ in range(6):
            queries = []
            for i in range(int(rng.integers(1, 9))):
                pick = rng.random()
                if stored and pick < 0.3:
                    key = stored[int(rng.integers(len(stored)))]  # stored: grown or repeated
                elif queries and pick < 0.4:
                    key = queries[int(rng.integers(len(queries)))][1][0]  # twice in the batch
                else:
                    key = f"r{round_}-{i}"
                pages = int(rng.choice([0, 1, 3, 6, 12, 60]))  # 60: more than the tier
                tokens = np.arange(pages * PAGE + int(rng.integers(0, PAGE)), dtype=np.int64)
                queries.append((tokens, [key]))
            many = batched.put_match_many(queries)
            one = []
            for query in queries:
                try:
                    one.append(single.put_match(*query))
                except Exception as exc:
                    one.append(exc)
            assert [_outcome(a) for a in many] == [_outcome(a) for a in one]
            for store, answers in ((batched, many), (single, one)):
                ids = [a[0] for a in answers if not isinstance(a, Exception)]
                store.launch(ids, [torch.arange(int(a[1].sum()) // PAGE) for a in answers
                                   if not isinstance(a, Exception)], [None] * len(ids))
                while len(store.try_wait(ids)) < len(ids):
                    pass
            stored += [q[1][0] for q, a in zip(queries, many, strict=True)
                       if not isinstance(a, Exception) and a[1].any()]
            assert batched.store_stats()["host_blocks_used"] == (
                single.store_stats()["host_blocks_used"])
            for key in {q[1][0] for q in queries} | set(stored):  # the same keys kept
                hits = [store.get_match(np.arange(60 * PAGE, dtype=np.int64), [key])
                        for store in (batched, single)]
                assert hits[0][1].tolist() == hits[1][1].tolist(), key
                batched.cancel([hits[0][0]])
                single.cancel([hits[1][0]])
    finally:
        batched.close()
        single.close()
