"""An engine's lookup whose pages only the SSD tier holds, on ``aiokv store-server``: the
server reads them into host blocks before it answers that lookup, and answers the other
engines meanwhile; a lookup of the same key waits for those reads and hits. The server
runs in this process (a thread) so that its SSD reads can be held back: a slow SSD on
demand."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from shared_host import PAGE_SIZE, caches, user_kv

import aiokv
from aiokv.stores.local import ssd as ssd_module
from aiokv.stores.shared import SharedStore
from aiokv.stores.shared import service as service_module
from aiokv.stores.shared.server import StoreServer

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="the shared region needs memfd_create (Linux)")

PAGES = 6
TOKENS = np.arange(PAGES * PAGE_SIZE, dtype=np.int64)


class Host:
    """A store server in a thread over an SSD directory, restartable on it."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "run" / "store.sock"
        (directory / "ssd").mkdir()
        self.config = aiokv.StoreConfig(cpu_cache_gb=0.002, ssd_cache_gb=0.01,
                                        ssd_cache_dir=str(directory / "ssd"))
        self.server: StoreServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.server = StoreServer(self.socket, self.config)
        self.server.start()
        self.thread = threading.Thread(target=self.server.serve, name="test-store-server")
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.stop()
            self.thread.join(30)
            assert not self.thread.is_alive(), "the server did not stop"
        self.server = self.thread = None

    def engine(self) -> tuple[SharedStore, list[torch.Tensor]]:
        store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(self.socket)))
        tables = caches()
        store.register(tables)
        return store, tables


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    running = Host(tmp_path)
    running.start()
    yield running
    running.stop()


def wait_for(condition: Callable[[], object], what: str) -> None:
    give_up = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < give_up, f"not within 20 s: {what}"
        time.sleep(0.01)


def offload(store: SharedStore, tables: list[torch.Tensor], user: int) -> None:
    for cache, kv in zip(tables, user_kv(user, PAGES), strict=True):
        cache[:PAGES] = kv
    task, mask = store.put_match(TOKENS, [f"user:{user}"])
    assert mask.all()
    store.launch([task], [torch.arange(PAGES)], [None])
    wait_for(lambda: store.try_wait([task]), "the offload")


def load_exact(store: SharedStore, tables: list[torch.Tensor], user: int, task: int) -> bool:
    first = len(tables[0]) - PAGES
    for cache in tables:
        cache.zero_()
    store.launch([task], [torch.arange(first, first + PAGES)], [None])
    results: dict[int, Any] = {}
    wait_for(lambda: results.update(store.try_wait([task])) or results, "the load")
    return all(torch.equal(cache[first:], kv)
               for cache, kv in zip(tables, user_kv(user, PAGES), strict=True))


def on_ssd_only(host: Host, user: int, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """``user`` offloaded, then on SSD only (the server restarted: the host tier goes with
    it); the SSD's reads from then on wait for the event returned."""
    writer, tables = host.engine()
    offload(writer, tables, user)
    wait_for(lambda: writer.store_stats()["ssd_blocks_used"] >= PAGES, "the SSD copy")
    writer.close()
    host.stop()
    host.start()
    gate = threading.Event()
    real_run = ssd_module.SsdTier._run

    def slow_run(tier: Any, request: Any, *args: Any) -> None:
        if not request.is_write:
            gate.wait(30)
        real_run(tier, request, *args)

    monkeypatch.setattr(ssd_module.SsdTier, "_run", slow_run)
    return gate


class Call(threading.Thread):
    """A store call on a thread of its own, so that the test can see it wait."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__()
        self._call = call
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as exc:  # the test's thread raises it
            self.error = exc

    def outcome(self, timeout: float = 20) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def lookup_reading(reader: SharedStore, user: int, figures: SharedStore) -> Call:
    """``reader``'s lookup of ``user`` on a thread, once the server is reading its pages
    (as ``figures``, another engine, sees it)."""
    lookup = Call(lambda: reader.get_match(TOKENS, [f"user:{user}"]))
    wait_for(lambda: figures.store_stats()["server_gets_staging"] == 1, "the reads started")
    return lookup

def test_an_engine_waiting_on_ssd_reads_does_not_hold_up_the_others(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = on_ssd_only(host, 7, monkeypatch)
    reader, reader_tables = host.engine()
    twin, twin_tables = host.engine()
    other, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 7, other)
        same_key = Call(lambda: twin.get_match(TOKENS, ["user:7"]))

        # The other engines are answered while the reads wait.
        Call(other.ping).outcome(10)
        put, put_mask = Call(lambda: other.put_match(TOKENS, ["user:8"])).outcome(10)
        assert put_mask.all()
        other.cancel([put])
        assert lookup.is_alive() and same_key.is_alive()

        gate.set()
        task, mask = lookup.outcome()
        assert mask.sum() == PAGES * PAGE_SIZE  # every page, read from SSD
        twin_task, twin_mask = same_key.outcome()
        assert twin_mask.sum() == PAGES * PAGE_SIZE  # waited for those reads: a hit
        assert load_exact(reader, reader_tables, 7, task)
        assert load_exact(twin, twin_tables, 7, twin_task)
        stats = other.store_stats()
        assert stats["server_gets_staging"] == 0 and stats["server_tasks_open"] == 0
    finally:
        gate.set()
        for store in (reader, twin, other):
            store.close()


def test_an_engine_gone_while_its_ssd_reads_wait_leaves_nothing_held(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = on_ssd_only(host, 9, monkeypatch)
    reader, _ = host.engine()
    figures, figures_tables = host.engine()
    try:
        lookup = lookup_reading(reader, 9, figures)
        assert reader._link is not None
        reader._link.sock.shutdown(socket.SHUT_RDWR)  # the engine goes, its lookup unanswered
        with pytest.raises(aiokv.StoreError):
            lookup.outcome()
        wait_for(lambda: figures.store_stats()["server_clients"] == 1, "the drop")
        gate.set()
        wait_for(lambda: figures.store_stats()["host_blocks_used"] == PAGES,
                 "the reads' blocks back in the LRU")  # read, kept, held by no one
        stats = figures.store_stats()
        assert stats["server_gets_staging"] == 0 and stats["server_blocks_held"] == 0
        task, mask = figures.get_match(TOKENS, ["user:9"])
        assert mask.sum() == PAGES * PAGE_SIZE
        assert load_exact(figures, figures_tables, 9, task)
    finally:
        gate.set()
        reader.close()
        figures.close()


def test_a_drain_answers_a_lookup_still_reading_before_it_exits(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM's drain (``stop``) while a lookup waits for its SSD reads: new matches are
    refused, the waiting lookup is answered once its reads are in and loads bit for
    bit, and the server exits once that task has ended."""
    gate = on_ssd_only(host, 11, monkeypatch)
    reader, reader_tables = host.engine()
    other, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 11, other)
        assert host.server is not None and host.thread is not None
        host.server.stop()
        wait_for(lambda: not host.socket.exists(), "the drain's start")
        with pytest.raises(aiokv.StoreError, match="shutting down"):
            other.put_match(TOKENS, ["user:12"])
        other.close()
        gate.set()
        task, mask = lookup.outcome()
        assert mask.sum() == PAGES * PAGE_SIZE
        assert host.thread.is_alive()  # the task is open: the drain waits for its end
        assert load_exact(reader, reader_tables, 11, task)
        reader.close()
        host.thread.join(20)
        assert not host.thread.is_alive(), "the server did not exit after its last task"
    finally:
        gate.set()
        reader.close()
        other.close()


def test_reads_past_the_timeout_answer_the_host_prefix_and_free_everything_later(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup whose SSD reads take longer than the server waits (30 s; 0.3 here) is
    answered with what the host tier has (nothing here), and so is a lookup of the same
    key that waited behind it; once the reads are in and both end, nothing is held."""
    monkeypatch.setattr(service_module, "SSD_STAGE_TIMEOUT_S", 0.3)
    gate = on_ssd_only(host, 13, monkeypatch)
    reader, _ = host.engine()
    twin, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 13, twin)
        same_key = Call(lambda: twin.get_match(TOKENS, ["user:13"]))
        task, mask = lookup.outcome()
        twin_task, twin_mask = same_key.outcome()
        assert not mask.any() and not twin_mask.any()
        gate.set()
        reader.cancel([task])
        twin.cancel([twin_task])
        wait_for(lambda: twin.store_stats()["server_blocks_held"] == 0, "the holds' end")
        stats = twin.store_stats()
        assert stats["server_gets_staging"] == 0 and stats["server_tasks_open"] == 0
        wait_for(lambda: twin.clear() >= 0 and twin.store_stats()["host_blocks_used"] == 0,
                 "every block free after a clear")  # the late reads' blocks held by no one
    finally:
        gate.set()
        reader.close()
        twin.close()
