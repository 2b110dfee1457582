"""The SSD tier under faults and pressure: a full or failing disk, bursts larger than
the host tier, invalidation, and a filesystem that refuses O_DIRECT."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import failing_header_voids, held, launch_slots, slow_header_voids
from shared_inprocess import Host
from test_ssd import (
    BLOCK,
    HOST_BLOCKS,
    PAGE,
    SLOT,
    TARGET,
    USER_PAGES,
    caches_for,
    check_loads,
    engine_on,
    figure,
    load_back,
    named_on_disk,
    offload,
    only_on_ssd,
    same,
    slot_of,
    source_pages,
    ssd_config,
    write_users,
)

import aiokv
from aiokv.stores.local import ssd as ssd_module
from aiokv.stores.local import ssd_format, ssd_io
from aiokv.stores.local import store as store_module
from aiokv.stores.shared import SharedStore


def _failing(code: int) -> Any:
    def call(*args: Any) -> int:
        raise OSError(code, os.strerror(code))

    return call


@pytest.mark.asyncio
async def test_a_full_disk_fails_no_offload_and_the_host_tier_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, original, store, engine = engine_on(tmp_path)
    async with engine:
        monkeypatch.setattr(os, "pwritev", _failing(errno.ENOSPC))
        for user in range(4):  # twice the host tier: the SSD copies all fail
            result = await offload(engine, user)
            assert result.stored_tokens == USER_PAGES * PAGE
        await check_loads(engine, (2, 3), caches, original)  # the latest, on the host
        assert await load_back(engine, 0, TARGET) == 0  # evicted, never on SSD: a miss
        for _ in range(1000):  # the copies run behind the offloads: each tried first
            if store.store_stats()["ssd_write_errors"] >= 4:
                break
            await asyncio.sleep(0.01)
        monkeypatch.undo()
        await offload(engine, 5)  # the disk has room again
    stats = store.store_stats()
    assert stats["ssd_write_errors"] >= 4
    assert stats["bytes_ssd_written"] == USER_PAGES * BLOCK  # user 5 only


@pytest.mark.asyncio
async def test_a_failing_read_is_a_miss_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read the disk refuses (EIO) fails no load: it loads nothing of those pages, and
    they are dropped from the tier, counted (a StoreError before, on every load of the
    key until an evict, the pages still indexed)."""
    caches, original, store, engine = engine_on(tmp_path)
    async with engine:
        for user in range(3):
            await offload(engine, user)
        await figure(store, "ssd_blocks_used", 3 * USER_PAGES)  # write_through: all there
        monkeypatch.setattr(os, "preadv", _failing(errno.EIO))
        for cache in caches:
            cache[TARGET] = 0
        hit = await engine.lookup(0, USER_PAGES * PAGE)  # on SSD only
        assert hit.cached_tokens == USER_PAGES * PAGE
        assert (await engine.load(hit, TARGET)).loaded_tokens == 0
        assert all(not c[TARGET].any() for c in caches)  # nothing written
        assert await load_back(engine, 2, TARGET) == USER_PAGES * PAGE  # on the host
        assert same(caches, original, TARGET, source_pages(2))
        monkeypatch.undo()
        assert await load_back(engine, 0, TARGET) == 0  # dropped: a miss, the disk back or not
        stats = store.store_stats()
        assert (stats["ssd_read_errors"], stats["checksum_failures"]) == (USER_PAGES, 0)
        assert stats["ssd_blocks_used"] == 2 * USER_PAGES


@contextlib.contextmanager
def store_of(kind: str, config: aiokv.StoreConfig, directory: Path) -> Iterator[aiokv.Store]:
    """A store on ``config``: embedded, in a process of its own, or a client of a store
    server on it (in a thread of this process)."""
    if kind == "embedded":
        yield aiokv.LocalStore(config)
    elif kind == "own_process":
        yield aiokv.ProcessStore(dataclasses.replace(config, own_process=True))
    else:
        host = Host(directory, config=config)
        host.start()
        try:
            yield SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
        finally:
            host.stop()


async def stats_when(engine: aiokv.OffloadEngine, done: Callable[[aiokv.EngineStats], bool]
                     ) -> aiokv.EngineStats:
    """``engine.stats()`` once ``done`` holds of it (5 s at most): the store's figures in
    it are a moment old."""
    for _ in range(250):
        stats = engine.stats()
        if done(stats):
            return stats
        await asyncio.sleep(0.02)
    return engine.stats()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["embedded", "own_process", pytest.param(
    "shared", marks=pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                       reason="the shared region needs memfd_create (Linux)"))])
async def test_a_data_file_cut_short_under_a_running_store_loads_what_is_left(
    tmp_path: Path, kind: str
) -> None:
    """blocks.dat truncated mid-way under an open store (a disk that returns EIO past a
    sector reads the same): a load of a key on SSD brings the pages before the cut, bit
    for bit, and no error; the pages past it are dropped from the tier (a second lookup
    misses them), counted as read errors. Before, every load of the key failed with
    StoreError until an evict or a restart, the pages still indexed and counted used."""
    (tmp_path / "ssd").mkdir()
    config = ssd_config(tmp_path / "ssd")
    caches, original = await only_on_ssd(config, (0,))
    offsets = [slot_of(tmp_path / "ssd", 0, page)[1] for page in range(USER_PAGES)]
    path = slot_of(tmp_path / "ssd", 0, 0)[0]
    cut = offsets[5] + ssd_format.HEADER_BYTES + BLOCK // 2  # mid page 5's slot
    lost = [offset + SLOT > cut for offset in offsets]
    kept = lost.index(True)  # the pages before the first one cut
    assert kept > 0
    for cache in caches:
        cache[TARGET] = 0
    with store_of(kind, config, tmp_path) as store:
        async with aiokv.OffloadEngine(store, caches) as engine:
            await stats_when(engine, lambda s: s.ssd_blocks_used == USER_PAGES)
            os.truncate(path, cut)
            async with await engine.lookup(0, USER_PAGES * PAGE) as hit:
                # (the store server reads SSD pages in before it answers a lookup)
                assert hit.cached_tokens >= kept * PAGE
                assert (await engine.load(hit, TARGET)).loaded_tokens == kept * PAGE
            assert same(caches, original, TARGET[:kept], source_pages(0)[:kept])
            assert all(not c[TARGET[kept:]].any() for c in caches)  # nothing past the cut
            async with await engine.lookup(0, USER_PAGES * PAGE) as again:
                assert again.cached_tokens == kept * PAGE
            assert await load_back(engine, 0, TARGET) == kept * PAGE
            assert same(caches, original, TARGET[:kept], source_pages(0)[:kept])
            stats = await stats_when(engine, lambda s: s.ssd_read_errors == sum(lost))
            assert (stats.ssd_read_errors, stats.checksum_failures) == (sum(lost), 0)
            assert stats.ssd_blocks_used == USER_PAGES - sum(lost)



def _bad_sector_at(path: Path, offset: int) -> Any:
    """``os.preadv`` as under O_DIRECT with a bad sector in the slot at ``offset`` of
    ``path``: a request whose range covers that slot fails whole (EIO, nothing read)."""
    real, inode = os.preadv, path.stat().st_ino

    def preadv(fd: int, buffers: Sequence[Any], at: int, *rest: Any) -> int:
        size = sum(memoryview(b).nbytes for b in buffers)
        if at < offset + SLOT and offset < at + size and os.fstat(fd).st_ino == inode:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return int(real(fd, buffers, at, *rest))

    return preadv


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["embedded", pytest.param(  # own_process: not patchable
    "shared", marks=pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                       reason="the shared region needs memfd_create (Linux)"))])
async def test_one_bad_sector_in_a_run_of_slots_costs_only_its_block(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of the 8 consecutive slots a load reads in one request is on a bad sector, and
    the request fails whole, as under O_DIRECT: the load brings the pages before it, bit
    for bit; only that block is dropped and counted, the 7 readable ones stay on SSD.
    Before, all 8 were dropped and counted, and the load brought nothing."""
    (tmp_path / "ssd").mkdir()
    config = ssd_config(tmp_path / "ssd")
    caches, original = await only_on_ssd(config, (0,))
    bad = 5
    path, offset = slot_of(tmp_path / "ssd", 0, bad)
    for cache in caches:
        cache[TARGET] = 0
    with store_of(kind, config, tmp_path) as store:
        async with aiokv.OffloadEngine(store, caches) as engine:
            await stats_when(engine, lambda s: s.ssd_blocks_used == USER_PAGES)
            monkeypatch.setattr(os, "preadv", _bad_sector_at(path, offset))
            async with await engine.lookup(0, USER_PAGES * PAGE) as hit:
                # (the store server reads SSD pages in before it answers a lookup)
                assert hit.cached_tokens >= bad * PAGE
                assert (await engine.load(hit, TARGET)).loaded_tokens == bad * PAGE
            assert same(caches, original, TARGET[:bad], source_pages(0)[:bad])
            assert all(not c[TARGET[bad:]].any() for c in caches)  # nothing past it
            stats = await stats_when(engine, lambda s: s.ssd_read_errors > 0)
            assert (stats.ssd_read_errors, stats.checksum_failures) == (1, 0)
            assert stats.ssd_blocks_used == USER_PAGES - 1
            monkeypatch.undo()  # the disk is back: its block stays lost, the prefix is there
            async with await engine.lookup(0, USER_PAGES * PAGE) as again:
                assert again.cached_tokens == bad * PAGE  # a prefix: it ends at the hole
            for cache in caches:
                cache[TARGET] = 0
            assert await load_back(engine, 0, TARGET) == bad * PAGE
            assert same(caches, original, TARGET[:bad], source_pages(0)[:bad])

def _wait(store: aiokv.LocalStore, ids: list[int]) -> dict[int, aiokv.TaskResult]:
    results: dict[int, aiokv.TaskResult] = {}
    for _ in range(100_000):
        results.update(store.try_wait([i for i in ids if i not in results]))
        if len(results) == len(ids):
            return results
        os.sched_yield()
    raise AssertionError(f"tasks {ids} never ended")


def test_a_host_tier_full_of_blocks_in_flight_frees_itself(tmp_path: Path) -> None:
    """What the store side of backpressure gives: NoSpace while the host tier is full of
    blocks whose SSD copies run, and room once they are written, with no other call
    than the ones that poll (the engine's retry in a later window rests on this)."""
    caches = caches_for()
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches)
    tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
    slots = (np.arange(USER_PAGES * PAGE)).astype(np.int64)
    for user in range(6):  # three times the host tier, as fast as the store answers
        while True:
            try:
                task, mask = store.put_match(tokens, [f"u{user}"])
                break
            except aiokv.stores.NoSpace as exc:
                assert "being copied" in str(exc) or "evictable" in str(exc)
                store.try_wait([])  # what a later window's match also does first
                os.sched_yield()
        launch_slots(store, [task], [slots[mask] + USER_PAGES * PAGE * user])
        assert _wait(store, [task])[task].status is aiokv.TaskStatus.SUCCESS
    stats = store.store_stats()
    assert stats["host_blocks_used"] <= HOST_BLOCKS
    store.close()
    assert store.store_stats()["bytes_ssd_written"] == 6 * USER_PAGES * BLOCK


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_burst_several_times_the_host_tier_round_trips(tmp_path: Path, policy: str) -> None:
    caches, original, _, engine = engine_on(tmp_path, ssd_write_policy=policy)
    users = 8  # four times the host tier, all at once
    async with engine:
        results = await asyncio.gather(*(offload(engine, user) for user in range(users)))
        assert [r.stored_tokens for r in results] == [USER_PAGES * PAGE] * users
        await check_loads(engine, range(users), caches, original)


def test_evict_and_clear_drop_both_tiers_and_stay_dropped(tmp_path: Path) -> None:
    asyncio.run(write_users(tmp_path, 4))  # users 0, 1 on SSD only; 2, 3 on both
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
    assert store.evict(["uid:0"]) == USER_PAGES * PAGE
    assert store.evict(["uid:0"]) == 0
    assert store.evict(["nobody"]) == 0
    task, mask = store.get_match(tokens, ["uid:0"])
    assert not mask.any()
    store.cancel([task])
    task, mask = store.get_match(tokens, ["uid:1"])
    assert mask.all()  # others stay
    store.cancel([task])
    store.close()
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    assert store.store_stats()["ssd_blocks_used"] == 3 * USER_PAGES  # the eviction held
    assert store.clear() == 3 * USER_PAGES * PAGE
    assert store.store_stats()["ssd_blocks_used"] == 0
    store.close()
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    assert store.store_stats()["ssd_blocks_used"] == 0  # and so did the clear
    store.close()


@pytest.mark.asyncio
async def test_an_evict_whose_header_voids_fail_keeps_the_key_out_of_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses the writes that void the evicted key's slot headers, which still
    name it on disk: the evict drops the key for good all the same. It answers the
    tokens dropped, and a restart on the directory does not find the key (every header
    of that file is retired instead: the file's other blocks are misses there too)."""
    caches, original, store, engine = engine_on(tmp_path)
    async with engine:
        for user in (0, 1):
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", 2 * USER_PAGES * BLOCK)
        failing_header_voids(monkeypatch)
        assert await engine.evict(0) == USER_PAGES * PAGE
        assert await load_back(engine, 0, TARGET) == 0
        await check_loads(engine, (1,), caches, original)  # kept until the restart
    monkeypatch.undo()
    assert named_on_disk(tmp_path, 0) == USER_PAGES  # the voids did fail
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


@pytest.mark.asyncio
async def test_an_evict_that_cannot_void_its_key_on_ssd_raises_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses the header voids and the meta file's new epoch too: nothing on
    disk can forget the key, and the evict says so with a StoreError (the key is gone
    from this store all the same). Evicting it again once the disk is well voids the
    headers that still name it, so that a restart does not find it."""
    _, _, store, engine = engine_on(tmp_path)
    async with engine:
        assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", USER_PAGES * BLOCK)
        failing_header_voids(monkeypatch, meta_too=True)
        with pytest.raises(aiokv.StoreError, match="could not void"):
            await engine.evict(0)
        assert await load_back(engine, 0, TARGET) == 0
        monkeypatch.undo()
        assert named_on_disk(tmp_path, 0) == USER_PAGES
        assert await engine.evict(0) == 0  # nothing left to drop; its headers voided
        assert named_on_disk(tmp_path, 0) == 0
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


@pytest.mark.asyncio
async def test_an_evict_whose_ssd_voids_are_too_slow_raises_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk too slow to void the key's headers within the evict's wait: the evict
    says so (a StoreError; the key is gone from this store all the same) rather than
    answer as if a restart could not find it. Once the voids land, none can."""
    monkeypatch.setattr(store_module, "SSD_VOID_WAIT_S", 0.3)
    _, _, store, engine = engine_on(tmp_path)
    async with engine:
        assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", USER_PAGES * BLOCK)
        gate = slow_header_voids(monkeypatch)
        with pytest.raises(aiokv.StoreError, match="not written within"):
            await engine.evict(0)
        assert await load_back(engine, 0, TARGET) == 0
        gate.set()
        for _ in range(200):
            if named_on_disk(tmp_path, 0) == 0:
                break
            await asyncio.sleep(0.05)
        assert named_on_disk(tmp_path, 0) == 0
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


def _histories(caches: list[torch.Tensor], original: list[torch.Tensor], loaded: int,
               histories: dict[str, torch.Tensor]) -> str:
    """Which history each page loaded into TARGET is (a letter of ``histories``)."""
    return "".join(next((name for name, pages in histories.items()
                         if same(caches, original, TARGET[i : i + 1], pages[i : i + 1])), "?")
                   for i in range(loaded))


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_a_clear_that_cannot_write_its_epoch_drops_nothing_and_mixes_nothing_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """The SSD's filesystem is full (or its directory read only): a clear cannot write
    the meta file's new epoch, the only thing that keeps a restart from finding what a
    clear drops. It fails (StoreError) saying nothing was cleared, and drops nothing. A
    user stored again under the same id after it (positional keys, another history,
    shorter) never loads, after a restart, its new pages followed by cleared ones: before,
    the clear dropped every tier's index all the same, and the restart served B's 4
    pages then 4 of the cleared A's. A clear once the disk is well holds past a restart."""
    caches, original, _, engine = engine_on(tmp_path, ssd_write_policy=policy)
    histories = {"A": source_pages(0), "B": source_pages(5)[:4]}
    async with engine:
        for user in range(4):  # user 0 (history A) on SSD, under write_back too
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        monkeypatch.setattr(ssd_io, "write_meta", _failing(errno.ENOSPC))
        with pytest.raises(aiokv.StoreError) as failed:
            await engine.clear()
        await engine.offload(0, histories["B"], 4 * PAGE)
        for user in (6, 7):  # B to SSD too, under write_back
            await offload(engine, user)
        monkeypatch.undo()  # the disk is well again
    caches, original, _, engine = engine_on(tmp_path, ssd_write_policy=policy)
    async with engine:
        got = _histories(caches, original, await load_back(engine, 0, TARGET) // PAGE,
                         histories)
        assert got == "A" * USER_PAGES  # not cleared, as the clear said: whole
        assert "nothing was cleared" in str(failed.value)
        await check_loads(engine, (1, 2, 3), caches, original)
        assert await engine.clear() > 0
    _, _, store, engine = engine_on(tmp_path, ssd_write_policy=policy)
    async with engine:
        assert store.store_stats()["ssd_blocks_used"] == 0
        for user in (0, 1, 2, 3, 6, 7):
            assert await load_back(engine, user, TARGET) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["embedded", pytest.param(  # own_process: not patchable
    "shared", marks=pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                       reason="the shared region needs memfd_create (Linux)"))])
async def test_a_clear_refused_its_epoch_says_so_and_the_store_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The SSD directory turned read only: the clear fails with a StoreError that says
    nothing was cleared, the store (a store server too: before, it dropped the engine's
    connection) serves every key as before, and a clear once the disk is well works."""
    (tmp_path / "ssd").mkdir()
    config = ssd_config(tmp_path / "ssd")
    caches = caches_for()
    original = [c.clone() for c in caches]
    with store_of(kind, config, tmp_path) as store:
        async with aiokv.OffloadEngine(store, caches) as engine:
            for user in range(3):
                assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
            monkeypatch.setattr(ssd_io, "write_meta", _failing(errno.EACCES))
            with pytest.raises(aiokv.StoreError, match="nothing was cleared"):
                await engine.clear()
            monkeypatch.undo()
            await check_loads(engine, range(3), caches, original)
            assert await engine.clear() == 3 * USER_PAGES * PAGE
            assert await load_back(engine, 0, TARGET) == 0


@pytest.mark.asyncio
async def test_a_write_that_lands_under_a_clears_new_epoch_before_its_drop_stays_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clear writes its new epoch before any tier drops anything (so that a clear that
    cannot write it drops nothing). A write queued before the clear that makes its
    headers with that new epoch, and is done before the clear drops the tiers (applied
    as done), is voided all the same: a restart does not find the cleared key."""
    writes = held(monkeypatch, ssd_module.SsdTier, "_run",
                  lambda tier, request, *args: request.is_write)
    gated, ran = ssd_module.SsdTier._run, threading.Event()

    def run(tier: ssd_module.SsdTier, request: Any, *args: Any) -> None:
        gated(tier, request, *args)
        if request.is_write:
            ran.set()

    real_epoch = ssd_io.SsdFiles.new_epoch

    def new_epoch(files: ssd_io.SsdFiles, k: int | None = None) -> None:
        real_epoch(files, k)
        if k is None:  # the clear's: the queued write runs now, and ends, under it
            writes.set()
            ran.wait(30)

    monkeypatch.setattr(ssd_module.SsdTier, "_run", run)
    monkeypatch.setattr(ssd_io.SsdFiles, "new_epoch", new_epoch)
    _, _, _, engine = engine_on(tmp_path)
    try:
        async with engine:
            assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
            assert await asyncio.to_thread(writes.entered.wait, 10)
            assert await engine.clear() == USER_PAGES * PAGE
            assert ran.is_set()
            assert named_on_disk(tmp_path, 0) == 0  # as a kill -9 now would leave it
    finally:
        writes.set()
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


def _full_sparse_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Once the returned event is set, the SSD tier's filesystem is full under a sparse
    blocks.dat (one without fallocate), as on a real disk: a write into a range never
    written fails with nothing moved (ENOSPC), and so does a meta file's new epoch; a
    write over what was written before (a header void in place) goes through."""
    full = threading.Event()
    real_write, real_meta = ssd_io.SsdFiles.write, ssd_io.write_meta
    written: set[tuple[int, int]] = set()  # (file, offset) of each slot written

    def write(files: ssd_io.SsdFiles, k: int, offset: int, buffers: Any) -> None:
        size = sum(memoryview(b).nbytes for b in buffers)
        slots = {(k, o) for o in range(offset - offset % files.slot_bytes, offset + size,
                                       files.slot_bytes)}
        if full.is_set() and not slots <= written:
            raise ssd_io.ShortIO(errno.ENOSPC, os.strerror(errno.ENOSPC), 0)
        real_write(files, k, offset, buffers)
        written.update(slots)

    def write_meta(*args: Any) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_meta(*args)

    monkeypatch.setattr(ssd_io.SsdFiles, "write", write)
    monkeypatch.setattr(ssd_io, "write_meta", write_meta)
    return full


@pytest.mark.asyncio
async def test_evicts_after_a_write_that_moved_nothing_on_a_full_disk_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up under a sparse blocks.dat: the SSD writes of later offloads
    fail having moved nothing. Evicts of keys written before (their headers void in
    place) answer the tokens dropped and hold past a restart. Before, each raised a
    StoreError about voiding a slot of a failed write, which never reached it: its void
    there (into the hole) failed as the write had, the meta file too, and every evict
    voids the failed writes' slots."""
    full = _full_sparse_disk(monkeypatch)
    caches, original, store, engine = engine_on(tmp_path)
    async with engine:
        for user in range(4):
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", 4 * USER_PAGES * BLOCK)
        full.set()
        for user in range(4, 8):  # on the host tier only: their SSD writes fail
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "ssd_write_errors", 4)
        assert await engine.evict(1) == USER_PAGES * PAGE
        assert await engine.evict(2) == USER_PAGES * PAGE
        full.clear()
    caches, original, _, engine = engine_on(tmp_path)
    async with engine:
        assert [await load_back(engine, user, TARGET) for user in (1, 2)] == [0, 0]
        await check_loads(engine, (0, 3), caches, original)


@pytest.mark.asyncio
async def test_refused_header_voids_and_a_refused_clear_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each write the disk refuses that was to keep dropped blocks from a restart is
    counted: an evict's header voids (its file's headers retired instead) and a clear's
    new epoch (the clear dropping nothing), in store_stats()'s ssd_invalidation_errors
    and aiokv_store_errors_total{error="ssd_invalidation"}. Before, neither was counted
    anywhere."""
    from prometheus_client import CollectorRegistry

    from aiokv import metrics

    registry = CollectorRegistry()
    _, _, store, engine = engine_on(tmp_path)
    metrics.register(engine, registry)
    async with engine:
        for user in (0, 1):
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", 2 * USER_PAGES * BLOCK)
        failing_header_voids(monkeypatch)
        assert await engine.evict(0) == USER_PAGES * PAGE  # one refused void per slot
        monkeypatch.undo()
        monkeypatch.setattr(ssd_io, "write_meta", _failing(errno.ENOSPC))
        with pytest.raises(aiokv.StoreError, match="nothing was cleared"):
            await engine.clear()
        monkeypatch.undo()
        assert store.store_stats().get("ssd_invalidation_errors") == USER_PAGES + 1
        families = await asyncio.to_thread(lambda: list(registry.collect()))
    (errors,) = (f for f in families if f.name == "aiokv_store_errors")
    assert {s.labels["error"]: s.value for s in errors.samples
            }.get("ssd_invalidation") == USER_PAGES + 1


def test_evict_and_clear_without_an_ssd_tier() -> None:
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=HOST_BLOCKS * BLOCK / (1 << 30)))
    store.register(caches_for())
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    for user in ("a", "b"):
        task, _ = store.put_match(tokens, [user])
        launch_slots(store, [task], [np.arange(2 * PAGE, dtype=np.int64)])
        _wait(store, [task])
    assert store.evict(["a"]) == 2 * PAGE
    assert store.store_stats()["host_blocks_used"] == 2
    assert store.clear() == 2 * PAGE
    assert store.store_stats()["host_blocks_used"] == 0
    store.close()


@pytest.mark.asyncio
async def test_without_o_direct_the_tier_uses_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT refused (as tmpfs does)")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    caches, original, store, engine = engine_on(tmp_path)
    async with engine:
        assert store._link is not None and not store._link.ssd.files.direct
        for user in range(4):
            await offload(engine, user)
        await check_loads(engine, range(4), caches, original)
    assert ssd_io.open_data_file(tmp_path / "probe", direct=True)[1] is False


def test_close_with_loads_in_flight_or_waiting(tmp_path: Path) -> None:
    asyncio.run(write_users(tmp_path, 4))
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
    masks = [store.get_match(tokens, [f"uid:{user}"])[1] for user in range(4)]
    # Each is promised whole (its SSD slots are held); the first is read into the host
    # tier at once, the others wait for room (a prefetch takes at most half the tier).
    assert all(mask.all() for mask in masks)
    store.close()  # neither launched nor cancelled: close still ends cleanly
    assert store.store_stats()["checksum_failures"] == 0
