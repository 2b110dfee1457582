"""Request sizes are bounded at the call (issue 29, item 1): the sizes a new user sent
(300M tokens for a user never stored, 200M for a stored one, 10**12, 1e12) fail at once
with InvalidRequest naming the field and the bound, through the engine and through the
FastAPI example, without memory growth or a stalled event loop; up to the bound a lookup
costs what is stored, not what was asked."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_caches
from pinning import pin_in_chunks
from test_ssd import engine_on, offload, same

import aiokv
from aiokv.config import parse_config
from aiokv.config_file import load_config
from aiokv.stores.local import hostmem
from aiokv.stores.local import pool as pool_module

ROOT = Path(__file__).resolve().parents[1]
BOUND = 1 << 24  # engine.max_lookup_tokens's default (the README's table says so)
PAGE = 16
STORED = 6 * PAGE  # user 1's history
# (user, num_tokens) as the issue sent them: never stored, stored, and two absurd sizes.
ISSUE_CALLS = [(999, 300_000_000), (1, 200_000_000), (1, 10**12), (1, 1e12)]
RSS_GROWTH_MIB = 64  # the issue's 300M lookup kept 3 GiB; 8 MiB positions is what is fair
LAG_S = 1.0  # the issue's 200M lookup stalled the loop for 7 s
BLOCK = 2 * 2 * PAGE * 2 * 8 * 4  # make_caches' layers, k/v, page, heads, dim, float32
HOST_GB = 16 * BLOCK / (1 << 30)  # a host tier of 16 blocks


def rss_mib() -> float:
    """This process's resident memory, from /proc (no psutil)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="no /proc")


class LoopWatch:
    """Another coroutine on the loop, ticking every millisecond: the longest gap between
    its turns (loop.time()) beyond its own period is how long the loop was held."""

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.001)
            now = loop.time()
            self.worst_s = max(self.worst_s, now - last - 0.001)
            last = now

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[LoopWatch]:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0)  # it has started
        try:
            yield self
        finally:
            self._task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self._task


def engine_for(
    caches: list[torch.Tensor] | None = None, cpu_cache_gb: float = 0.01, **engine: Any
) -> aiokv.OffloadEngine:
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=cpu_cache_gb))
    caches = caches if caches is not None else make_caches(pages=64, page_size=PAGE)
    return aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0, **engine))


async def answer(call: Any) -> Any:
    """A call's result, or the error it raised (any: the issue saw MemoryError)."""
    try:
        return await call
    except Exception as exc:
        return exc


def assert_names_the_bound(error: Any, value: Any, bound: int = BOUND) -> None:
    assert isinstance(error, aiokv.InvalidRequest), repr(error)
    assert error.field == "num_tokens"
    if isinstance(value, int):
        assert str(value) in str(error) and str(bound) in str(error), str(error)
        assert "engine.max_lookup_tokens" in str(error)
    else:
        assert "int" in str(error)


@needs_proc
@pytest.mark.asyncio
@pytest.mark.parametrize(("user", "num_tokens"), ISSUE_CALLS)
async def test_the_issues_lookups_fail_at_once_without_memory_or_a_stalled_loop(
    user: int, num_tokens: Any
) -> None:
    async with engine_for() as engine:
        await engine.offload(1, torch.arange(6), STORED)
        (await engine.lookup(1, STORED)).release()  # warm: the first calls allocate
        before = rss_mib()
        async with LoopWatch().watching() as watch:
            got = await answer(engine.lookup(user, num_tokens))
            # The engine still serves the stored user.
            async with await engine.lookup(1, STORED) as hit:
                assert hit.cached_tokens == STORED
        grown = rss_mib() - before
    assert_names_the_bound(got, num_tokens)
    assert grown < RSS_GROWTH_MIB, f"RSS grew {grown:.0f} MiB"
    assert watch.worst_s < LAG_S, f"the loop was held {watch.worst_s:.2f} s"


@needs_proc
@pytest.mark.asyncio
async def test_up_to_the_bound_a_lookup_costs_what_is_stored_not_what_was_asked() -> None:
    caches = make_caches(pages=64, page_size=PAGE)
    source = [c[:6].clone() for c in caches]
    async with engine_for(caches) as engine:
        await engine.offload(1, torch.arange(6), STORED)
        (await engine.lookup(1, STORED)).release()
        before = rss_mib()
        async with LoopWatch().watching() as watch:
            never = await engine.lookup(999, BOUND)
            async with await engine.lookup(1, BOUND) as hit:
                loaded = await engine.load(hit, torch.arange(32, 40))
        grown = rss_mib() - before
    assert never.cached_tokens == 0
    assert hit.cached_tokens == STORED and loaded.loaded_tokens == STORED
    assert all(torch.equal(c[32:38], s) for c, s in zip(caches, source, strict=True))
    assert grown < RSS_GROWTH_MIB, f"RSS grew {grown:.0f} MiB"
    assert watch.worst_s < LAG_S, f"the loop was held {watch.worst_s:.2f} s"


@pytest.mark.asyncio
async def test_the_configured_bound_is_the_bound() -> None:
    async with engine_for(max_lookup_tokens=10 * PAGE) as engine:
        await engine.offload(1, torch.arange(6), STORED)
        assert (await engine.lookup(1, 10 * PAGE)).cached_tokens == STORED
        got = await answer(engine.lookup(1, 10 * PAGE + 1))
    assert_names_the_bound(got, 10 * PAGE + 1, 10 * PAGE)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "16", None, 10**13])
def test_a_bad_max_lookup_tokens_is_a_config_error(value: Any) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.EngineConfig(max_lookup_tokens=value)
    assert caught.value.key == "engine.max_lookup_tokens"
    with pytest.raises(aiokv.ConfigError, match=r"engine\.max_lookup_tokens"):
        parse_config({"engine": {"max_lookup_tokens": value}})


def test_the_shipped_configs_name_the_bound() -> None:
    assert aiokv.EngineConfig().max_lookup_tokens == BOUND
    for path in (ROOT / "configs" / "default.yml", ROOT / "aiokv" / "default.yml"):
        engine, _ = load_config(path)
        assert engine.max_lookup_tokens == BOUND, path


@pytest.mark.asyncio
async def test_an_offload_larger_than_every_tier_is_refused_at_once() -> None:
    # 0.0005 GiB of 4 KiB blocks (16 tokens x 256 bytes): 131 blocks, fewer than the
    # caches' 256 pages. Such an offload could never be stored: it used to wait for
    # room until request_timeout_ms and fail with StoreFull.
    caches = make_caches(pages=256, page_size=PAGE)
    async with engine_for(caches, cpu_cache_gb=0.0005, request_timeout_ms=2_000) as engine:
        got = await answer(engine.offload(1, torch.arange(256), 256 * PAGE))
        fits = await engine.offload(2, torch.arange(100), 100 * PAGE)
    assert isinstance(got, aiokv.InvalidRequest), repr(got)
    assert got.field == "num_tokens" and str(256 * PAGE) in str(got)
    assert "can ever hold" in str(got) and str(131 * PAGE) in str(got), str(got)
    assert fits.stored_tokens == 100 * PAGE


@pytest.mark.asyncio
@pytest.mark.parametrize("pinning", ["stopped", "stopping"])
async def test_an_offload_larger_than_a_host_tier_pinned_short_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch, pinning: str
) -> None:
    # Pinning stops after 2 of the host tier's 4 chunks of 4 blocks (a memlock limit;
    # registering fails on the third): the store serves with 8 blocks. An offload of 12
    # new pages is refused as one larger than a fully pinned tier is, also where it came
    # while the third chunk was still being registered. (It waited for room that could
    # never come: StoreFull at request_timeout_ms; with no deadline, for good.)
    third, fails, waits = threading.Event(), threading.Event(), threading.Event()
    memories = pin_in_chunks(monkeypatch, 4, 2, third, fails)
    wait_for_free = pool_module.HostPool.wait_for_free

    def waiting(pool: pool_module.HostPool, count: int) -> None:
        waits.set()  # a reserve waits for the blocks still being pinned
        wait_for_free(pool, count)

    monkeypatch.setattr(pool_module.HostPool, "wait_for_free", waiting)
    engine = engine_for(cpu_cache_gb=HOST_GB, request_timeout_ms=0)
    async with engine:
        try:
            assert await asyncio.to_thread(third.wait, 10)
            if pinning == "stopped":
                fails.set()
                assert await asyncio.to_thread(memories[0].wait_all, 10)
            got = asyncio.ensure_future(answer(engine.offload(1, torch.arange(12), 12 * PAGE)))
            if pinning == "stopping":
                assert await asyncio.to_thread(waits.wait, 10)
                fails.set()
            too_large = await asyncio.wait_for(got, 60)
        finally:
            fails.set()
        assert memories[0].ready_blocks == 8 and memories[0].num_blocks == 16
        fits = await asyncio.wait_for(engine.offload(2, torch.arange(8), 8 * PAGE), 60)
    assert isinstance(too_large, aiokv.InvalidRequest), repr(too_large)
    assert too_large.field == "num_tokens" and str(12 * PAGE) in str(too_large)
    assert "more than the 8 blocks of the host tier that are pinned" in str(too_large)
    assert fits.stored_tokens == 8 * PAGE


def pinned_short(monkeypatch: pytest.MonkeyPatch, third: threading.Event | None = None,
                 fails: threading.Event | None = None) -> list[hostmem.HostMemory]:
    """The host tier of 16 blocks (``engine_for(cpu_cache_gb=HOST_GB)``) in 4 chunks of 4,
    whose pinning stops after 2 (a memlock limit: registering the third, which sets
    ``third``, fails once ``fails`` is set, where given), so that the store serves with
    8; its mapping, once made, is the list's first."""
    return pin_in_chunks(monkeypatch, 4, 2, third, fails)


@pytest.mark.asyncio
async def test_an_offload_that_cannot_fit_beside_its_stored_pages_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host tier pinned short at 8 blocks, no SSD tier: user 1 has 4 pages stored. Its
    # offload of 12 pages has 8 new, as many as the pinned blocks, but its 4 stored pages
    # stay while those are reserved (nothing below takes them): it is refused at once, as
    # on a fully pinned tier. (It waited for room that could never come: StoreFull at
    # request_timeout_ms; with no deadline, for good.) The store refuses it: the 4 pages
    # are stored while pinning goes on, and the store is idle from the figures that show
    # them until the 12 are asked, so the engine's bound is still that of all 16 blocks.
    third, fails = threading.Event(), threading.Event()
    memories = pinned_short(monkeypatch, third, fails)
    async with engine_for(cpu_cache_gb=HOST_GB, request_timeout_ms=0) as engine:
        try:
            assert await asyncio.to_thread(third.wait, 10)  # 8 blocks pinned
            stored = await asyncio.wait_for(engine.offload(1, torch.arange(4), 4 * PAGE), 60)
            for _ in range(6000):  # the figures the store gives once it is idle again
                if engine.stats().host_blocks_used == 4:  # the figures after the 4 pages
                    break
                await asyncio.sleep(0.01)
        finally:
            fails.set()
        assert await asyncio.to_thread(memories[0].wait_all, 10)
        assert memories[0].ready_blocks == 8
        too_large = await asyncio.wait_for(
            answer(engine.offload(1, torch.arange(12), 12 * PAGE)), 60)
        fits = await asyncio.wait_for(engine.offload(1, torch.arange(8), 8 * PAGE), 60)
    assert stored.stored_tokens == 4 * PAGE
    assert isinstance(too_large, aiokv.InvalidRequest), repr(too_large)
    assert too_large.field == "num_tokens" and str(12 * PAGE) in str(too_large)
    assert "8 of its 12 full pages are new and 4 stored" in str(too_large)
    assert "the 8 blocks of the host tier that are pinned" in str(too_large)
    assert fits.cached_tokens == 8 * PAGE and fits.stored_tokens == 4 * PAGE  # 4 new


@pytest.mark.asyncio
async def test_store_full_on_a_host_tier_pinned_short_names_the_pinned_blocks(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # A held Lookup holds all 8 blocks of a host tier pinned short: an offload gets
    # StoreFull at its deadline, and the store's reason names the 8 it serves with. (It
    # said "0 free, 0 evictable of 16", which reads as 16 taken.)
    memories = pinned_short(monkeypatch)
    async with engine_for(cpu_cache_gb=HOST_GB, request_timeout_ms=1_000) as engine:
        assert await asyncio.to_thread(memories[0].wait_all, 10)
        await asyncio.wait_for(engine.offload(0, torch.arange(8), 8 * PAGE), 60)
        hit = await engine.lookup(0, 8 * PAGE)
        full = await asyncio.wait_for(
            answer(engine.offload(1, torch.arange(8, 12), 4 * PAGE)), 60)
        hit.release()
        fits = await asyncio.wait_for(engine.offload(1, torch.arange(8, 12), 4 * PAGE), 60)
    assert hit.cached_tokens == 8 * PAGE
    assert isinstance(full, aiokv.StoreFull), repr(full)
    assert "need 4 blocks; 0 free, 0 evictable of the 8 pinned (of 16" in str(full)
    assert fits.stored_tokens == 4 * PAGE


@pytest.mark.asyncio
async def test_the_engine_s_bound_on_a_host_tier_pinned_short_is_its_pinned_blocks(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host tier pinned short at 8 of its 16 blocks, no SSD tier: once the store's
    # figures show the 8, offloads of 20 pages and of 16 are refused at once naming the
    # bound of those 8 (128 tokens). (It named all 16, 256 tokens, computed before
    # pinning stopped: a user who shortened the offload to 16 pages was refused again.)
    memories = pinned_short(monkeypatch)
    async with engine_for(cpu_cache_gb=HOST_GB, request_timeout_ms=0) as engine:
        assert await asyncio.to_thread(memories[0].wait_all, 10)
        await asyncio.wait_for(engine.offload(0, torch.arange(4), 4 * PAGE), 60)
        for _ in range(6000):  # the figures are asked again once the store has worked
            stats = engine.stats()
            if (stats.host_blocks_total, stats.host_blocks_used) == (8, 4):
                break
            await asyncio.sleep(0.01)
        # A round on the store thread after that answer: the bound is taken from it.
        await asyncio.wait_for(engine.offload(0, torch.arange(4), 4 * PAGE), 60)
        refused = [await asyncio.wait_for(answer(engine.offload(n, torch.arange(n),
                                                                n * PAGE)), 60)
                   for n in (20, 16)]
    for pages, error in zip((20, 16), refused, strict=True):
        assert isinstance(error, aiokv.InvalidRequest), repr(error)
        assert error.field == "num_tokens" and str(pages * PAGE) in str(error)
        assert f"more than the store can ever hold ({8 * PAGE}: " in str(error)
    assert (stats.host_blocks_total, stats.host_blocks_used) == (8, 4)


@pytest.mark.asyncio
async def test_an_offload_of_more_pages_than_the_caches_have_is_refused() -> None:
    async with engine_for() as engine:  # 64 pages of 16
        got = await answer(engine.offload(1, torch.arange(65) % 64, 65 * PAGE))
        fits = await engine.offload(1, torch.arange(64), 64 * PAGE)
    assert isinstance(got, aiokv.InvalidRequest), repr(got)
    assert got.field == "num_tokens" and str(65 * PAGE) in str(got) and "caches' 64" in str(got)
    assert fits.stored_tokens == 64 * PAGE


@pytest.mark.asyncio
async def test_a_long_lookup_still_finds_pages_only_the_ssd_holds(tmp_path: Path) -> None:
    # The store is asked about no more than the key's pages: those on SSD count.
    caches, original, _, engine = engine_on(tmp_path)
    async with engine:
        for user in range(4):  # twice the host tier: users 0 and 1 live on SSD only
            await offload(engine, user)
        target = torch.arange(120, 128)
        async with await engine.lookup(0, BOUND) as hit:
            loaded = await engine.load(hit, target)
    assert hit.cached_tokens == loaded.loaded_tokens == 8 * 16
    assert same(caches, original, target, torch.arange(0, 8))


def query(num_tokens: Any) -> str:
    """As a client writes it in a URL: 1e12, not 1000000000000.0."""
    return str(num_tokens) if isinstance(num_tokens, int) else f"{num_tokens:.0e}".replace("+", "")


@needs_proc
@pytest.mark.asyncio
async def test_the_fastapi_example_answers_422_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import fastapi_app  # the shipped example, served in this loop through ASGI

    app = fastapi_app.create_app()
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),  # starts and drains the engine
        httpx.AsyncClient(transport=transport, base_url="http://example") as client,
    ):
        assert (await client.post("/users/1/step", params={"new_tokens": 100})).status_code == 200
        assert (await client.get("/users/1/cached", params={"num_tokens": 100})).status_code == 200
        before = rss_mib()
        async with LoopWatch().watching() as watch:
            answers = [
                (n, await client.get(f"/users/{user}/cached", params={"num_tokens": query(n)}))
                for user, n in ISSUE_CALLS
            ]
            at_bound = await client.get("/users/1/cached", params={"num_tokens": BOUND})
        grown = rss_mib() - before
    for num_tokens, response in answers:
        assert response.status_code == 422, (num_tokens, response.text)
        assert "num_tokens" in response.text
        if isinstance(num_tokens, int):
            assert response.json()["error"] == "InvalidRequest"
            assert str(BOUND) in response.json()["detail"], response.text
    assert at_bound.status_code == 200 and at_bound.json() == {"cached_tokens": 96}
    assert grown < RSS_GROWTH_MIB, f"RSS grew {grown:.0f} MiB"
    assert watch.worst_s < LAG_S, f"the loop was held {watch.worst_s:.2f} s"


@pytest.mark.asyncio
async def test_a_close_that_stops_the_pinning_keeps_the_tier_s_size_in_the_figures(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # No memlock limit: the engine is closed while the third of 4 chunks registers. The
    # figures after close still say 16 blocks (they said 8, the pinned ones, as if
    # pinning had stopped short), of which the 2 stored are used (not the 8 unpinned).
    third, go_on = threading.Event(), threading.Event()
    memories = pin_in_chunks(monkeypatch, 4, 2, third, go_on, fails=False)
    engine = engine_for(cpu_cache_gb=HOST_GB)
    await engine.start()
    try:
        assert await asyncio.to_thread(third.wait, 10)
        stored = await asyncio.wait_for(engine.offload(1, torch.arange(2), 2 * PAGE), 60)
        closing = asyncio.create_task(engine.aclose())
        for _ in range(6000):  # until the close asked the pinning to stop
            if memories[0]._stop:
                break
            await asyncio.sleep(0.01)
    finally:
        go_on.set()
    await asyncio.wait_for(closing, 60)
    assert stored.stored_tokens == 2 * PAGE
    assert memories[0].ready_blocks < 16 and memories[0].error is None
    assert engine.stats().host_blocks_total == 16
    assert engine.stats().host_blocks_used == 2  # not the blocks never pinned
