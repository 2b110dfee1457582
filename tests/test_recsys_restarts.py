"""The recsys-examples storage (aiokv.integrations.recsys, on the stand-in recsys types)
on a host tier that changes under it: a store server (``store.backend: shared``) that
restarts with another, an embedded store whose pinning stops short. Each offload stores,
and reports to the manager, the longest prefix the tier holds then, never a refusal of
the whole sequence."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pinning import pin_in_chunks
from shared_inprocess import Host
from test_recsys_adapter import fake_recsys, i32, until

import aiokv
from aiokv.integrations import recsys

PAGE_SIZE = 4  # the test caches' geometry is shared_host's: 20 blocks in 0.00002 GB
SMALL_GB, LARGE_GB = 0.00002, 0.00004  # 20 and 40 blocks: 80 and 160 tokens
LONG = 30 * PAGE_SIZE  # more than the small tier holds, less than the large one


class Served:
    """An AiokvHostStorage on a store server in this process, restartable."""

    def __init__(self, directory: Path, cpu_cache_gb: float, ssd: bool) -> None:
        self.directory = directory
        self.ssd = ssd
        self.host = Host(directory, ssd=ssd, cpu_cache_gb=cpu_cache_gb)
        self.host.start()
        generator = torch.Generator().manual_seed(1)
        self.tables = [torch.randn(128, 2, PAGE_SIZE, 2, 8, generator=generator)
                       for _ in range(2)]
        self.storage: Any = recsys._HostStorage({
            "engine": {"window_us": 0},
            "store": {"backend": "shared", "socket": str(self.host.socket)}})
        self.storage.register_gpu_cache_tables(self.tables)

    def restart(self, cpu_cache_gb: float) -> None:
        """The server stopped and started again with a host tier of ``cpu_cache_gb``."""
        self.host.stop()
        tiers: dict[str, Any] = {}
        if self.ssd:
            tiers.update(ssd_cache_gb=0.02, ssd_cache_dir=str(self.directory / "ssd"))
        self.host.config = aiokv.StoreConfig(cpu_cache_gb=cpu_cache_gb, **tiers)
        self.host.start()

    def offload(self, user: int, tokens: int) -> tuple[str, list[int], list[int]]:
        """User ``user``'s sequence of ``tokens`` (in the first pages) offloaded as the
        manager does: the wait's status, finish_task's answer, the handle's lengths."""
        meta = self.storage.build_index_meta(torch.tensor([user]), torch.tensor([tokens]))
        pages = types.SimpleNamespace(kv_indices=i32(*range(-(-tokens // PAGE_SIZE))))
        handle = self.storage.offload_kvcache_launch(meta.user_ids, i32(0), [], meta, pages)
        until(lambda: self.storage.offload_kvcache_wait(handle).status.value != "launched")
        status = self.storage.offload_kvcache_wait(handle).status.value
        return (status, self.storage.finish_task(handle),
                self.storage.get_offload_handle_metadata(handle)[2].tolist())

    def onboarded_exact(self, user: int, tokens: int, host: int) -> bool:
        """The host holds ``host`` tokens of the user's ``tokens``, and onboards them
        into pages from 64 on, bit for bit the first pages'."""
        meta = self.storage.build_index_meta(torch.tensor([user]), torch.tensor([tokens]))
        found = self.storage.lookup_kvcache(meta)
        if found.host_cached_lengths.tolist() != [host]:
            self.storage.core.release(found.extra[recsys.HITS])
            return False
        targets = types.SimpleNamespace(kv_indices=i32(*range(64, 64 + -(-tokens // PAGE_SIZE))))
        launched = self.storage.onboard_kvcache_launch(meta, found, targets)
        pages = host // PAGE_SIZE
        return bool(self.storage.onboard_kvcache_wait(launched).ready) and all(
            torch.equal(table[64:64 + pages], table[:pages]) for table in self.tables)

    def close(self) -> None:
        try:
            self.storage.close()
        finally:
            self.host.stop()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(recsys, "_recsys", fake_recsys)
    made: list[Served] = []

    def serve(cpu_cache_gb: float, ssd: bool = False) -> Served:
        made.append(Served(tmp_path, cpu_cache_gb, ssd))
        return made[-1]

    yield serve
    for each in made:
        each.close()


@pytest.mark.parametrize("ssd", [False, True])
def test_an_offload_after_a_restart_with_a_smaller_host_tier_stores_what_it_holds(
        served: Any, ssd: bool) -> None:
    # The storage cut each sequence to the host tier it saw at its start: after the
    # server came back smaller, every longer offload was refused whole (FAILED, the
    # manager's fail_close raising), the engine's figures long since the new server's.
    store = served(LARGE_GB, ssd)
    assert store.offload(1, LONG) == ("ready", [1], [LONG])
    store.restart(SMALL_GB)
    assert store.offload(2, LONG) == ("ready", [1], [80])
    assert store.onboarded_exact(2, LONG, 80)
    assert store.offload(3, LONG) == ("ready", [1], [80])  # with the figures asked since


def test_an_offload_after_a_restart_with_a_larger_host_tier_stores_what_it_holds(
        served: Any) -> None:
    # The storage still cut each sequence to the smaller host tier it saw at its start.
    store = served(SMALL_GB)
    assert store.offload(1, LONG) == ("ready", [1], [80])
    store.restart(LARGE_GB)
    assert store.offload(2, 8) == ("ready", [1], [8])  # the engine meets the new server
    until(lambda: store.storage.core.kv.stats().host_blocks_total * PAGE_SIZE >= LONG)
    assert store.offload(3, LONG) == ("ready", [1], [LONG])
    assert store.onboarded_exact(3, LONG, LONG)


def _launched_after_a_smaller_restart(served: Any, store: Any = None) -> tuple[Any, Any, Any]:
    """A storage on a server restarted smaller than its figures say (``store``, else a
    new one), and the handle of an offload of user 2's LONG tokens launched there (with
    its index meta)."""
    store = store or served(LARGE_GB)
    store.restart(SMALL_GB)
    meta = store.storage.build_index_meta(torch.tensor([2]), torch.tensor([LONG]))
    handle = store.storage.offload_kvcache_launch(
        meta.user_ids, i32(0), [], meta, types.SimpleNamespace(kv_indices=i32(*range(30))))
    return store, meta, handle


def test_an_evict_all_made_after_an_offload_launch_drops_it_after_a_smaller_restart_too(
        served: Any) -> None:
    # The offload refused by the smaller server is not made again after the evict_all the
    # manager made after launching it: the host would hold that user's KV after it.
    store, meta, handle = _launched_after_a_smaller_restart(served)
    store.storage.evict_all()
    handle.handle.pending.outcomes()
    found = store.storage.lookup_kvcache(meta)
    store.storage.core.release(found.extra[recsys.HITS])
    assert found.host_cached_lengths.tolist() == [0]


def test_an_offload_after_the_embedded_host_tier_stopped_pinning_short_stores_what_it_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The storage took its bound from the figures at its start, while the host tier was
    # still being pinned (wait_pinned=True waits only after): where pinning then stopped
    # short (a memlock limit), every offload longer than the pinned blocks was refused
    # whole. wait_pinned=False here: the start is then surely before the stop.
    monkeypatch.setattr(recsys, "_recsys", fake_recsys)
    go_on = threading.Event()
    memories = pin_in_chunks(monkeypatch, 4, 2, go_on=go_on)  # 8 of 16 blocks pinned
    tables = [torch.randn(64, 2, PAGE_SIZE, 2, 8) for _ in range(2)]
    storage: Any = recsys._HostStorage(
        {"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 16 * 1024 / (1 << 30)}},
        wait_pinned=False)
    try:
        storage.register_gpu_cache_tables(tables)
        go_on.set()
        assert memories[0].wait_all(10) and memories[0].ready_blocks == 8
        meta = storage.build_index_meta(torch.tensor([1]), torch.tensor([12 * PAGE_SIZE]))
        handle = storage.offload_kvcache_launch(
            meta.user_ids, i32(0), [], meta, types.SimpleNamespace(kv_indices=i32(*range(12))))
        until(lambda: storage.offload_kvcache_wait(handle).status.value != "launched")
        assert storage.offload_kvcache_wait(handle).status.value == "ready"
        assert storage.get_offload_handle_metadata(handle)[2].tolist() == [8 * PAGE_SIZE]
        found = storage.lookup_kvcache(meta)
        assert found.host_cached_lengths.tolist() == [8 * PAGE_SIZE]
        launched = storage.onboard_kvcache_launch(
            meta, found, types.SimpleNamespace(kv_indices=i32(*range(32, 44))))
        assert storage.onboard_kvcache_wait(launched).ready
        assert all(torch.equal(table[32:40], table[:8]) for table in tables)
    finally:
        go_on.set()
        storage.close()


def test_an_offload_launched_before_a_drain_close_after_a_smaller_restart_is_stored(
        served: Any) -> None:
    # The offload the smaller server refused was made again once the close had begun: the
    # engine, draining, refused that second try ("engine is draining"), and the wait
    # answered FAILED for an offload launched before the close, which a drain answers.
    store, _, handle = _launched_after_a_smaller_restart(served)
    store.storage.close()
    assert store.storage.offload_kvcache_wait(handle).status.value == "ready"
    assert store.storage.finish_task(handle) == [1]
    assert store.storage.get_offload_handle_metadata(handle)[2].tolist() == [80]
    # The server holds it: a storage opened on it after the close onboards those tokens.
    store.storage = recsys._HostStorage({
        "engine": {"window_us": 0},
        "store": {"backend": "shared", "socket": str(store.host.socket)}})
    store.storage.register_gpu_cache_tables(store.tables)
    assert store.onboarded_exact(2, LONG, 80)


def test_an_offload_made_again_after_a_smaller_restart_counts_as_one_call_that_ended_well(
        served: Any) -> None:
    # The store refused the first try as more than the new host tier holds, and the
    # storage made it again shorter, stored: EngineStats read submitted 2, failed 1 for
    # an offload the manager saw ready, as if one of the users' offloads had failed.
    store = served(LARGE_GB)
    store.restart(SMALL_GB)
    before = store.storage.core.kv.stats()
    assert store.offload(2, LONG) == ("ready", [1], [80])
    after = store.storage.core.kv.stats()
    assert (after.failed - before.failed, after.rejected - before.rejected) == (0, 0)
    assert (after.submitted - before.submitted, after.completed - before.completed) == (1, 1)
    assert after.offloaded_tokens - before.offloaded_tokens == 80
    assert after.pending == 0 and after.queued == 0


def test_an_offload_refused_and_not_made_again_counts_as_one_failed_call(
        served: Any) -> None:
    # An evict_all made after the launch: the refused offload is not made again, and the
    # call counts as it ended, failed, none left pending.
    store = served(LARGE_GB)
    before = store.storage.core.kv.stats()
    store, _, handle = _launched_after_a_smaller_restart(served, store)
    store.storage.evict_all()
    assert store.storage.offload_kvcache_wait(handle).status.value == "failed"
    after = store.storage.core.kv.stats()
    assert (after.submitted - before.submitted, after.failed - before.failed) == (1, 1)
    assert after.pending == 0 and after.queued == 0
