"""A store server in this process (a thread), for tests that hold its SSD reads back (a
slow SSD on demand) or watch a call wait on it: the server, raw ``SharedStore`` engines
on it, and their offloads and loads checked bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import held
from shared_host import PAGE_SIZE, observer, user_kv, wait_for

import aiokv
from aiokv.stores.local import ssd as ssd_module
from aiokv.stores.shared import SharedStore
from aiokv.stores.shared.server import StoreServer

PAGES = 6
TOKENS = np.arange(PAGES * PAGE_SIZE, dtype=np.int64)


class Host:
    """A store server in a thread over an SSD directory (``ssd``), restartable on it;
    ``remote``: its ``store.remote``."""

    def __init__(self, directory: Path, ssd: bool = True,
                 remote: dict[str, Any] | None = None, cpu_cache_gb: float = 0.002,
                 config: aiokv.StoreConfig | None = None) -> None:
        """``config``: the server's store config as given (the other arguments unused)."""
        self.socket = directory / "run" / "store.sock"
        if config is None:
            tiers: dict[str, Any] = {"remote": remote}
            if ssd:
                (directory / "ssd").mkdir()
                tiers.update(ssd_cache_gb=0.02, ssd_cache_dir=str(directory / "ssd"))
            config = aiokv.StoreConfig(cpu_cache_gb=cpu_cache_gb, **tiers)
        self.config = config
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
        return observer(self.socket)


def offload(store: SharedStore, tables: list[torch.Tensor], user: int) -> None:
    """``user``'s pages offloaded under ``user:<user>``."""
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
    return held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *args: not request.is_write)


@pytest.fixture(name="host")
def host_fixture(tmp_path: Path) -> Iterator[Host]:
    """A server in this process over a fresh SSD directory (import it to use ``host``)."""
    running = Host(tmp_path)
    running.start()
    yield running
    running.stop()


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
