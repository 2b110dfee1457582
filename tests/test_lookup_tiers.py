"""A Lookup finds the key's whole page-aligned prefix held across the tiers, as the offload
that stored it counts it, however its host and SSD pages interleave: a key demoted to SSD
by others' offloads (or left there by a restart) and then appended to on the host is SSD
pages, then host pages; pages the SSD lost (voided here on disk) but the host stores
again make any interleaving. Its load brings all of it bit for bit (up to the first SSD
page that fails its checksum), and every way it ends (a load, a release, its ttl, an
evict of the key, a give-way of its prefetch to a launched load) gives back exactly what
it held: once cleared and closed, no host block and no SSD slot is used, also where its
prefetch's reads come in only as the store closes. A Lookup of the key right after one is
given back finds it all (or the prefix it asks for), its SSD pages perhaps still being read
into the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Gate, held
from test_ssd import (
    BLOCK,
    DIM,
    HEADS,
    HOST_BLOCKS,
    LAYERS,
    PAGE,
    SLOT,
    USER_PAGES,
    flip_byte,
    slot_of,
)

import aiokv
from aiokv.stores.local import ssd as ssd_module
from aiokv.stores.local import ssd_format

HISTORY = USER_PAGES * PAGE  # 128 tokens
HALF = HISTORY // 2
PAGES = 128
DEST = torch.arange(96, 96 + USER_PAGES)  # a load's destination, never a source
BIG = torch.arange(64, 76)  # a 12-page history, more than half of the host tier
BIG_DEST = BIG + 40
WHOLE = torch.arange(64, 64 + HOST_BLOCKS)  # a history that takes the whole host tier
POLICIES = ["write_through", "write_back"]


def source(user: int) -> torch.Tensor:
    return torch.arange(USER_PAGES * user, USER_PAGES * (user + 1))


def caches_for() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(43)
    return [torch.randn(PAGES, 2, PAGE, HEADS, DIM, generator=generator) for _ in range(LAYERS)]


def engine_on(directory: Path, policy: str, caches: list[torch.Tensor],
              own_process: bool = False, **engine_keys: Any) -> aiokv.OffloadEngine:
    config = aiokv.StoreConfig(
        cpu_cache_gb=HOST_BLOCKS * BLOCK / (1 << 30),
        ssd_cache_gb=8 * USER_PAGES * SLOT / (1 << 30),
        ssd_cache_dir=str(directory),
        ssd_write_policy=policy,
    )
    store: aiokv.Store = aiokv.ProcessStore(config) if own_process else aiokv.LocalStore(config)
    return aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(**engine_keys))


def intact(caches: list[torch.Tensor], got: torch.Tensor, want: torch.Tensor) -> bool:
    return all(torch.equal(c[got], c[want]) for c in caches)


def void(directory: Path, user: int, page: int) -> None:
    """The SSD loses a page of the user's (its header zeroed, as an evict leaves it)."""
    path, offset = slot_of(directory, user, page)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(ssd_format.EMPTY_HEADER)


async def reopened_split(directory: Path, policy: str, caches: list[torch.Tensor],
                         stored: int, lost: tuple[int, ...], lookup_ttl_ms: int = 60_000,
                         damaged: int | None = None, own_process: bool = False,
                         **engine_keys: Any) -> aiokv.OffloadEngine:
    """User 0's first ``stored`` pages written, the store closed, pages ``lost`` of them
    voided on disk (and a byte of page ``damaged`` flipped); then reopened (only the SSD
    has the key) and user 0's whole history offloaded again: the host tier stores the
    pages the SSD lacks. Returns the engine, started (its store in a process of its own
    with ``own_process``)."""
    async with engine_on(directory, policy, caches) as engine:
        await engine.offload(0, source(0)[:stored], stored * PAGE)
    if damaged is not None:
        path, offset = slot_of(directory, 0, damaged)
        flip_byte(path, offset + ssd_format.HEADER_BYTES + BLOCK // 2)
    for page in lost:
        void(directory, 0, page)
    engine = engine_on(directory, policy, caches, own_process, lookup_ttl_ms=lookup_ttl_ms,
                       **engine_keys)
    await engine.start()
    got = await engine.offload(0, source(0), HISTORY)
    new = USER_PAGES - stored + len(lost)
    assert (got.stored_tokens, got.cached_tokens) == (new * PAGE, HISTORY)
    return engine


@contextlib.asynccontextmanager
async def then_cleared(engine: aiokv.OffloadEngine) -> AsyncIterator[list[aiokv.EngineStats]]:
    """The body runs on the (started) engine; then the engine is cleared and closed, and
    the store's figures (final once it is closed; in the list yielded) show no host
    block, no SSD slot and no store task used: nothing was leaked."""
    final: list[aiokv.EngineStats] = []
    try:
        yield final
    finally:
        await engine.clear()
        await engine.aclose()
    final.append(engine.stats())
    stats = final[0]
    assert (stats.host_blocks_used, stats.ssd_blocks_used, stats.store_tasks_open) == (0, 0, 0)


async def given_back(hit: aiokv.Lookup) -> None:
    """Wait until the Lookup's ttl gives its reservation back (it says so: not held)."""
    for _ in range(6000):
        if not hit.held:
            break
        await asyncio.sleep(0.01)
    assert not hit.held


async def loads_whole(engine: aiokv.OffloadEngine, caches: list[torch.Tensor]) -> bool:
    """User 0's Lookup reports its whole history, and its load brings all of it into
    DEST, bit for bit."""
    hit = await engine.lookup(0, HISTORY)
    assert hit.cached_tokens == HISTORY
    assert (await engine.load(hit, DEST)).loaded_tokens == HISTORY
    return intact(caches, DEST, source(0))


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
async def test_the_first_lookup_after_an_append_finds_what_the_offload_counted(
    tmp_path: Path, policy: str
) -> None:
    # User 0's first half goes to SSD as user 9 takes the whole host tier; then user 0
    # appends the second half, which only the host has.
    caches = caches_for()
    engine = engine_on(tmp_path, policy, caches)
    await engine.start()
    async with then_cleared(engine):
        await engine.offload(0, source(0)[:4], HALF)
        await engine.offload(9, WHOLE, len(WHOLE) * PAGE)
        got = await engine.offload(0, source(0), HISTORY)
        assert (got.stored_tokens, got.cached_tokens) == (HALF, HISTORY)
        # The very next Lookup finds all of it, not only the SSD half.
        assert await loads_whole(engine, caches)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("stored", "lost"),
    [(4, ()), (USER_PAGES, (1, 2, 5)), (USER_PAGES, (0, 3))],
    ids=["appended after a restart", "ssd host ssd host ssd", "host ssd host ssd"],
)
async def test_pages_of_both_tiers_in_any_interleaving_load_bit_for_bit(
    tmp_path: Path, policy: str, stored: int, lost: tuple[int, ...]
) -> None:
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, stored, lost)
    async with then_cleared(engine):
        for _ in range(2):  # the second time, the first load's SSD pages are on the host
            assert await loads_whole(engine, caches)
            for cache in caches:
                cache[DEST] = float("nan")


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["evict", "release", "ttl"])
async def test_a_lookup_over_both_tiers_ends_without_loading_and_leaks_nothing(
    tmp_path: Path, policy: str, how: str
) -> None:
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5),
                                  lookup_ttl_ms=100 if how == "ttl" else 60_000)
    async with then_cleared(engine):
        hit = await engine.lookup(0, HISTORY)
        assert hit.cached_tokens == HISTORY
        if how == "evict":
            assert await engine.evict(0) == HISTORY
            assert (await engine.load(hit, DEST)).loaded_tokens == 0
            assert all(c[DEST].ne(c[source(0)]).all() for c in caches)  # none of it
            assert (await engine.lookup(0, HISTORY)).cached_tokens == 0
        else:
            if how == "release":
                hit.release()
            else:
                await given_back(hit)
            # What it held is where it was, whole (its SSD pages perhaps still being read
            # in): a new Lookup loads all of it.
            assert await loads_whole(engine, caches)


def reads_held(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """The SSD tier's reads wait for the gate returned (its writes do not)."""
    return held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *rest: not request.is_write)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["release", "ttl"])
async def test_a_lookup_after_one_given_back_finds_the_pages_still_being_read_in(
    tmp_path: Path, policy: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first Lookup's prefetch reads its SSD pages into the host; it is given back
    # while they are still being read: the next Lookup of the key finds them all.
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5),
                                  lookup_ttl_ms=100 if how == "ttl" else 60_000)
    async with then_cleared(engine):
        gate = reads_held(monkeypatch)
        try:
            hit = await engine.lookup(0, HISTORY)
            assert hit.cached_tokens == HISTORY
            assert await asyncio.to_thread(gate.entered.wait, 60)  # its reads are out
            if how == "release":
                hit.release()
            else:
                await given_back(hit)
            again = await engine.lookup(0, HISTORY)
            assert again.cached_tokens == HISTORY
        finally:
            gate.set()
        assert (await engine.load(again, DEST)).loaded_tokens == HISTORY
        assert intact(caches, DEST, source(0))


# Loaded at start-up by an interpreter that has it on PYTHONPATH: in a store process, its
# SSD reads wait until the file HELD_READS names with ".open" exists (30 s at most), and
# the first to wait writes the one with ".entered". A slow SSD on demand, in a child.
CHILD_READS_HELD = textwrap.dedent(
    """
    import os
    gate = os.environ.get("HELD_READS")
    if gate:
        import time
        from aiokv.stores.local import ssd

        run = ssd.SsdTier._run

        def _run(tier, request, *rest):
            if not request.is_write:
                open(gate + ".entered", "w").close()
                until = time.monotonic() + 30
                while not os.path.exists(gate + ".open") and time.monotonic() < until:
                    time.sleep(0.01)
            return run(tier, request, *rest)

        ssd.SsdTier._run = _run
    """
)


class ChildReadsHeld:
    """:func:`reads_held` for a store process started after it (own_process)."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        directory.mkdir()
        (directory / "sitecustomize.py").write_text(CHILD_READS_HELD)
        self._gate = directory / "gate"
        monkeypatch.setenv("HELD_READS", str(self._gate))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            filter(None, [str(directory), os.environ.get("PYTHONPATH")])))

    def entered(self) -> bool:
        for _ in range(6000):
            if self._gate.with_suffix(".entered").exists():
                return True
            time.sleep(0.01)
        return False

    def set(self) -> None:
        self._gate.with_suffix(".open").touch()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("own_process", [False, True], ids=["in process", "own process"])
async def test_a_lookup_evicted_while_its_reads_are_out_gives_its_blocks_back_once_they_are_in(
    tmp_path: Path, policy: str, own_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The evict takes the Lookup back while its prefetch's reads are out; once they are
    # in, the engine idle (no call of it after the evict), the figures show the key gone
    # from both tiers, as store_tasks_open did at once: no block is held for it.
    caches = caches_for()
    gate: Gate | ChildReadsHeld
    if own_process:
        gate = ChildReadsHeld(tmp_path / "child", monkeypatch)
    (tmp_path / "ssd").mkdir()
    engine = await reopened_split(tmp_path / "ssd", policy, caches, USER_PAGES, (1, 2, 5),
                                  own_process=own_process)
    if not own_process:
        gate = reads_held(monkeypatch)
    async with then_cleared(engine):
        try:
            hit = await engine.lookup(0, HISTORY)
            assert hit.cached_tokens == HISTORY
            if isinstance(gate, Gate):
                assert await asyncio.to_thread(gate.entered.wait, 60)  # its reads are out
            else:
                assert await asyncio.to_thread(gate.entered)
            assert await engine.evict(0) == HISTORY
            assert engine.stats().store_tasks_open == 0
        finally:
            gate.set()
        for _ in range(6000):
            stats = engine.stats()
            if (stats.host_blocks_used, stats.ssd_blocks_used) == (0, 0):
                break
            await asyncio.sleep(0.01)
        assert (stats.host_blocks_used, stats.ssd_blocks_used) == (0, 0)


async def given_back_while_read(engine: aiokv.OffloadEngine, gate: Gate) -> None:
    """A Lookup of the whole history, given back once its prefetch's reads are out (held
    by ``gate``)."""
    hit = await engine.lookup(0, HISTORY)
    assert hit.cached_tokens == HISTORY
    assert await asyncio.to_thread(gate.entered.wait, 60)
    hit.release()



async def prefix_taken_over(engine: aiokv.OffloadEngine, gate: Gate, pages: int
                            ) -> aiokv.Lookup:
    """:func:`given_back_while_read`, then a Lookup of the first ``pages`` pages, which
    finds them all (it takes the cancelled prefetch over)."""
    await given_back_while_read(engine, gate)
    short = await engine.lookup(0, pages * PAGE)
    assert short.cached_tokens == pages * PAGE
    return short

@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pages", [4, 1, 7])
async def test_a_shorter_lookup_after_one_given_back_finds_its_pages_still_being_read_in(
    tmp_path: Path, policy: str, pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the next Lookup asks for a prefix of the history (pages 0, 3, 4, 6
    # are among the SSD pages being read): it finds all of that prefix, and loads it
    # bit for bit; what was read past it is given back (then_cleared checks).
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5))
    async with then_cleared(engine):
        gate = reads_held(monkeypatch)
        try:
            again = await prefix_taken_over(engine, gate, pages)
        finally:
            gate.set()
        assert (await engine.load(again, DEST[:pages])).loaded_tokens == pages * PAGE
        assert intact(caches, DEST[:pages], source(0)[:pages])
        # The whole history is still stored, and loads whole.
        for cache in caches:
            cache[DEST] = float("nan")
        assert await loads_whole(engine, caches)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pages", [4, 1, 7])
async def test_a_longer_lookup_after_a_shorter_one_given_back_finds_all_still_being_read_in(
    tmp_path: Path, policy: str, pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the shorter Lookup is given back too, the reads still out: the next
    # Lookup of the whole history finds all of it, not only that prefix, and loads it
    # bit for bit.
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5))
    async with then_cleared(engine):
        gate = reads_held(monkeypatch)
        try:
            (await prefix_taken_over(engine, gate, pages)).release()
            again = await engine.lookup(0, HISTORY)
            assert again.cached_tokens == HISTORY
        finally:
            gate.set()
        assert (await engine.load(again, DEST)).loaded_tokens == HISTORY
        assert intact(caches, DEST, source(0))


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["evict", "release"])
async def test_a_lookup_given_back_whose_reads_come_in_only_at_close_leaks_nothing(
    tmp_path: Path, policy: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An evict of the key (or a release) gives the Lookup back while its prefetch's reads
    # are out; they come in only as the store closes, after every other call of it:
    # what the prefetch held goes back all the same (then_cleared checks).
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5))
    gate = reads_held(monkeypatch)
    stop = ssd_module.SsdTier.stop

    def opened_at_close(tier: ssd_module.SsdTier) -> None:
        gate.set()
        stop(tier)

    monkeypatch.setattr(ssd_module.SsdTier, "stop", opened_at_close)
    try:
        async with then_cleared(engine):
            hit = await engine.lookup(0, HISTORY)
            assert hit.cached_tokens == HISTORY
            assert await asyncio.to_thread(gate.entered.wait, 60)  # its reads are out
            if how == "evict":
                assert await engine.evict(0) == HISTORY
                assert (await engine.load(hit, DEST)).loaded_tokens == 0
            else:
                hit.release()
    finally:
        gate.set()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("damaged", [3, 0, 7])
async def test_a_damaged_ssd_page_after_host_pages_ends_the_load_there(
    tmp_path: Path, policy: str, damaged: int
) -> None:
    # Pages 1, 2 and 5 are host pages; the damaged one is an SSD page: the load brings
    # the pages before it.
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5),
                                  damaged=damaged)
    async with then_cleared(engine):
        hit = await engine.lookup(0, HISTORY)
        assert hit.cached_tokens == HISTORY
        assert (await engine.load(hit, DEST)).loaded_tokens == damaged * PAGE
        assert intact(caches, DEST[:damaged], source(0)[:damaged])
        assert engine.stats().store_tasks_open == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_load_over_both_tiers_waits_for_room_to_stage_its_ssd_pages(
    tmp_path: Path, policy: str
) -> None:
    # User 0 holds its 3 host pages; users 1 and 2's Lookups hold the 13 other blocks:
    # no room for its 5 SSD pages until their loads end (they go at once).
    caches = caches_for()
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5))
    async with then_cleared(engine) as final:
        await engine.offload(1, source(1), HISTORY)
        await engine.offload(2, source(2)[:5], 5 * PAGE)
        holders = [await engine.lookup(1, HISTORY), await engine.lookup(2, 5 * PAGE)]
        assert [h.cached_tokens for h in holders] == [HISTORY, 5 * PAGE]
        hit = await engine.lookup(0, HISTORY)
        assert hit.cached_tokens == HISTORY
        got = await asyncio.gather(
            engine.load(hit, DEST),
            engine.load(holders[0], source(4)),
            engine.load(holders[1], source(5)[:5]),
        )
        assert [r.loaded_tokens for r in got] == [HISTORY, HISTORY, 5 * PAGE]
        assert intact(caches, DEST, source(0))
        assert intact(caches, source(4), source(1))
    assert final[0].stage_waits >= 1  # user 0's load waited for the room


@pytest.mark.asyncio
async def test_a_load_over_both_tiers_that_finds_no_room_in_time_leaks_nothing(
    tmp_path: Path
) -> None:
    # As above, but the holders keep their room past the load's deadline: it fails
    # (its host pages were copied at launch, its SSD pages never), gives back what it
    # held, and a new Lookup then loads it all.
    caches = caches_for()
    engine = await reopened_split(tmp_path, "write_through", caches, USER_PAGES, (1, 2, 5),
                                  request_timeout_ms=1_000)
    async with then_cleared(engine):
        await engine.offload(1, source(1), HISTORY)
        await engine.offload(2, source(2)[:5], 5 * PAGE)
        holders = [await engine.lookup(1, HISTORY), await engine.lookup(2, 5 * PAGE)]
        hit = await engine.lookup(0, HISTORY)
        assert hit.cached_tokens == HISTORY
        with pytest.raises(aiokv.RequestTimeout):
            await engine.load(hit, DEST)
        # The holders' pages are room once their write-through copies are in (user 0's
        # 3 host pages, users 1's 8 and 2's 5): else the new load waits for those too,
        # past 1 s on a busy disk.
        for _ in range(6000):  # 60 s at most
            if engine.stats().bytes_ssd_written >= HOST_BLOCKS * BLOCK:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the holders' SSD copies never landed: {engine.stats()}")
        for holder in holders:
            holder.release()
        assert await loads_whole(engine, caches)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_held_prefetch_over_both_tiers_gives_way_and_still_loads_it_all(
    tmp_path: Path, policy: str
) -> None:
    # User 0's Lookup (3 host pages held, 5 SSD pages prefetched) is held, not loaded;
    # user 7's 12 pages, on SSD only, need the room its prefetch took.
    caches = caches_for()
    async with engine_on(tmp_path, policy, caches) as engine:
        await engine.offload(7, BIG, len(BIG) * PAGE)
    engine = await reopened_split(tmp_path, policy, caches, USER_PAGES, (1, 2, 5))
    async with then_cleared(engine) as final:
        held_hit = await engine.lookup(0, HISTORY)
        assert held_hit.cached_tokens == HISTORY
        hit = await engine.lookup(7, len(BIG) * PAGE)
        assert hit.cached_tokens == len(BIG) * PAGE
        got = await asyncio.wait_for(engine.load(hit, BIG_DEST), 60.0)
        assert got.loaded_tokens == len(BIG) * PAGE
        assert intact(caches, BIG_DEST, BIG)
        assert (await engine.load(held_hit, DEST)).loaded_tokens == HISTORY
        assert intact(caches, DEST, source(0))
    assert final[0].bytes_ssd_read >= (5 + len(BIG) + 5) * BLOCK  # user 0's read twice
