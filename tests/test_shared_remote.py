"""``aiokv store-server`` with ``store.remote``: the server owns a remote tier on Mooncake
below its host tier, which its engines use as an embedded store's engines use theirs and
which it shares with embedded hosts of the same geometry (tests/remote_host.py and
tests/shared_host.py make the same KV under the same keys). On a real Mooncake Store
(conftest's ``mooncake``); the servers run as a process, or in this process where the
test watches a call wait."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import needs_mooncake
from remote_host import ChildHost
from remote_host import Host as EmbeddedHost
from shared_host import PAGE_SIZE, Server, caches, observer, start_processes, user_kv, wait_for
from shared_host import Host as Engine
from shared_inprocess import PAGES, TOKENS, Call, Host, load_exact, offload

import aiokv
from aiokv.remote.servers import MooncakeServers
from aiokv.stores.shared import SharedStore

pytestmark = [needs_mooncake(),
              pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                 reason="the shared region needs memfd_create (Linux)")]

USER_PAGES = 8
USER_TOKENS = USER_PAGES * PAGE_SIZE
EXACT = {"cached": USER_TOKENS, "loaded": USER_TOKENS, "exact": True}


def test_engines_of_a_store_server_load_what_an_embedded_host_put_on_mooncake(
        mooncake: MooncakeServers, tmp_path: Path) -> None:
    embedded = ChildHost(mooncake.master)
    try:
        for user in (501, 502):
            assert embedded("offload", user=user, pages=USER_PAGES) == {"stored": USER_TOKENS}
    finally:
        written = embedded.close()["remote_blocks_written"]  # its close ends the writes
    assert written == 2 * USER_PAGES
    server = Server(tmp_path, {"remote": {"master": mooncake.master}}).start()
    first, second = start_processes(server.socket, 2)
    figures, _ = observer(server.socket)
    try:
        assert first("load", user=501, pages=USER_PAGES) == EXACT  # Mooncake -> region
        assert second("load", user=502, pages=USER_PAGES) == EXACT
        assert second("load", user=501, pages=USER_PAGES) == EXACT  # now the host tier's
        stats = figures.store_stats()
    finally:
        figures.close()
        for engine in (first, second):
            engine.close()
        server.kill()
    assert (stats["remote_hits"], stats["remote_misses"]) == (2, 0)
    assert stats["remote_hit_tokens"] == 2 * USER_TOKENS
    assert stats["host_hit_tokens"] == USER_TOKENS  # each hit counted on one tier
    assert stats["remote_bytes_read"] > 0
    assert (stats["remote_checksum_failures"], stats["remote_errors"]) == (0, 0)


def _written(figures: SharedStore, blocks: int) -> bool:
    stats = figures.store_stats()
    return bool(stats["remote_blocks_written"] >= blocks and stats["remote_blocks_held"] == 0)


def test_a_mooncake_that_stops_answering_costs_one_lookup_its_timeout_and_no_one_else(
        mooncake: MooncakeServers, tmp_path: Path) -> None:
    timeout_s = 2.0
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master,
                                             "timeout_ms": int(timeout_s * 1000)})
    host.start()
    try:
        writer, tables = host.engine()
        offload(writer, tables, 601)
        wait_for(lambda: _written(writer, PAGES), "the remote write")
        writer.close()
        host.stop()
        host.start()  # its host tier starts empty: user 601 is on Mooncake only
        reader, reader_tables = host.engine()
        other, other_tables = host.engine()
        warm, _ = other.get_match(TOKENS, ["user:602"])  # nobody's: the client connects
        other.cancel([warm])
        mooncake.pause_store()
        try:
            began = time.monotonic()
            lookup = Call(lambda: reader.get_match(TOKENS, ["user:601"]))
            wait_for(lambda: other.store_stats()["remote_lookups_open"] == 1, "the read")
            # Meanwhile the server answers the other engine: an offload, and its lookup.
            offload(other, other_tables, 603)
            task, mask = other.get_match(TOKENS, ["user:603"])
            assert mask.all() and load_exact(other, other_tables, 603, task)
            assert lookup.is_alive()
            task, mask = lookup.outcome()
            assert time.monotonic() - began < timeout_s + 2.0  # bounded: a miss
            assert not mask.any()
            reader.cancel([task])
            # The reader thread is still stuck in that call: the next lookup does not
            # queue behind it.
            began = time.monotonic()
            task, mask = reader.get_match(TOKENS, ["user:601"])
            assert time.monotonic() - began < 1.0 and not mask.any()
            reader.cancel([task])
        finally:
            mooncake.pause_store(False)

        def hit() -> bool:
            task, mask = reader.get_match(TOKENS, ["user:601"])
            if not mask.all():
                reader.cancel([task])
                return False
            assert load_exact(reader, reader_tables, 601, task)  # bit for bit
            return True

        wait_for(hit, "a hit once Mooncake answers again")
        assert other.store_stats()["remote_timeouts"] >= 1
    finally:
        host.stop()


def test_an_evict_through_the_server_reaches_other_hosts_and_frees_its_blocks(
        mooncake: MooncakeServers, tmp_path: Path) -> None:
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master})
    host.start()
    engine = Engine(str(host.socket))
    figures, _ = observer(host.socket)
    embedded = EmbeddedHost(mooncake.master)
    try:
        assert engine.offload(701, pages=USER_PAGES)["stored"] == USER_TOKENS
        wait_for(lambda: _written(figures, USER_PAGES), "the remote write")
        assert embedded.load(701, USER_PAGES) == EXACT  # the server's write, read there
        assert figures.store_stats()["host_blocks_used"] == USER_PAGES
        assert engine.evict(701) == {"dropped": USER_TOKENS}
        assert figures.store_stats()["host_blocks_used"] == 0  # every block back
        embedded.restart()  # its own host tier's copy stays its own: a fresh one
        assert embedded.load(701, USER_PAGES)["cached"] == 0
        assert engine.load(701, USER_PAGES)["cached"] == 0
        assert figures.store_stats()["remote_invalidation_errors"] == 0
    finally:
        embedded.kv.close()
        engine.kv.close()
        figures.close()
        host.stop()


@pytest.mark.asyncio
async def test_offloads_through_the_server_never_fail_while_the_master_is_down(
        tmp_path: Path) -> None:
    users = range(801, 809)  # 64 pages: the caches' all
    (tmp_path / "mooncake").mkdir()
    with MooncakeServers(segment_mb=16, log_dir=tmp_path / "mooncake") as servers:
        servers.stop_master()
        host = Host(tmp_path, ssd=False, remote={"master": servers.master, "timeout_ms": 100})
        host.start()
        tables = caches()
        store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
        try:
            async with aiokv.OffloadEngine(store, tables, aiokv.EngineConfig()) as engine:
                for user in users:
                    first = (user - users[0]) * USER_PAGES
                    for cache, kv in zip(tables, user_kv(user, USER_PAGES), strict=True):
                        cache[first : first + USER_PAGES] = kv
                results = await asyncio.gather(*(
                    engine.offload(user, torch.arange(i * USER_PAGES, (i + 1) * USER_PAGES),
                                   USER_TOKENS) for i, user in enumerate(users)))
                assert [r.stored_tokens for r in results] == [USER_TOKENS] * len(users)
                lookup = await engine.lookup(users[0], USER_TOKENS)
                async with lookup:  # the server's own host tier still serves them
                    assert lookup.cached_tokens == USER_TOKENS
            figures, _ = observer(host.socket)
            offered = len(users) * USER_PAGES
            wait_for(lambda: figures.store_stats()["remote_dropped_writes"] == offered,
                     "every write dropped, counted")
            stats = figures.store_stats()
            figures.close()
        finally:
            host.stop()
    assert stats["remote_blocks_written"] == 0
    assert stats["remote_blocks_held"] == 0
