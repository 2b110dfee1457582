"""``aiokv store-server`` with ``store.remote``: the server owns a remote tier on Mooncake
below its host tier, which its engines use as an embedded store's engines use theirs and
which it shares with embedded hosts of the same geometry (tests/remote_host.py and
tests/shared_host.py make the same KV under the same keys). On a real Mooncake Store
(conftest's ``mooncake``); the servers run as a process, or in this process where the
test watches a call wait."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import held, needs_mooncake, offers_once_learned
from remote_host import ChildHost
from remote_host import Host as EmbeddedHost
from shared_host import (
    PAGE_SIZE,
    Server,
    caches,
    hello,
    observer,
    start_processes,
    user_kv,
    wait_for,
)
from shared_host import Host as Engine
from shared_inprocess import PAGES, TOKENS, Call, Host, load_exact, offload
from test_shared_ssd_reads import host_tier_in_flight, store_of, user_0_loads_whole, user_0_on_ssd
from test_ssd import PAGE, ssd_config
from test_ssd import USER_PAGES as SSD_USER_PAGES

import aiokv
from aiokv.remote import client as remote_client
from aiokv.remote import writer as remote_writer
from aiokv.remote.keys import namespace_tag
from aiokv.remote.native import import_store
from aiokv.remote.removals import Remover
from aiokv.remote.servers import MooncakeServers
from aiokv.remote.values import Values
from aiokv.remote.writer import Writer
from aiokv.stores.shared import SharedStore, wire
from aiokv.stores.shared.server import StoreServer
from aiokv.stores.shared.service import Service
from aiokv.stores.shared.tasks import Retry

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


def _on_mooncake_only(host: Host, user: int) -> None:
    """``user`` offloaded through the server and written to Mooncake, then the server
    restarted: its host tier starts empty."""
    writer, tables = host.engine()
    offload(writer, tables, user)
    wait_for(lambda: _written(writer, PAGES), "the remote write")
    writer.close()
    host.stop()
    host.start()


def _held(monkeypatch: pytest.MonkeyPatch, name: str, owner: Any = remote_client.RemoteIO,
          timeout_ms: int | None = None) -> tuple[threading.Event, threading.Event]:
    """``owner.<name>`` held until the second event is set; the first is set once a
    call is held. ``timeout_ms``: only a RemoteIO's of that store.remote.timeout_ms (a
    value of the test's own: the tier of an earlier test, closed, may still be in a
    call, and call it next)."""
    entered, gate = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(self: Any, *args: Any) -> Any:
        if timeout_ms is not None and self.config.timeout_ms != timeout_ms:
            return real(self, *args)
        if not gate.is_set():
            entered.set()
            gate.wait(20)
        return real(self, *args)

    monkeypatch.setattr(owner, name, held)
    return entered, gate


def _waits_for_a_read(monkeypatch: pytest.MonkeyPatch, pages: int) -> threading.Event:
    """Set once the server has put a GET of ``pages`` pages off until another read of
    its key is in (a Retry): the GET reached the server while that read ran."""
    waiting = threading.Event()
    real = Service.get_match

    def get_match(self: Service, client: Any, tokens: int, digests: list[bytes],
                  namespace: tuple[str, ...], **keys: Any) -> Any:
        entry = real(self, client, tokens, digests, namespace, **keys)
        if isinstance(entry, Retry) and len(digests) == pages:
            waiting.set()
        return entry

    monkeypatch.setattr(Service, "get_match", get_match)
    return waiting


def test_a_mooncake_that_stops_answering_costs_one_lookup_its_timeout_and_no_one_else(
        mooncake: MooncakeServers, tmp_path: Path) -> None:
    # Long enough for the other engine's offload, lookup and load to be served while the
    # reader's lookup waits: a fresh-clone run with the suite in two workers took over 2 s.
    timeout_s = 5.0
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master,
                                             "timeout_ms": int(timeout_s * 1000)})
    host.start()
    try:
        _on_mooncake_only(host, 601)
        reader, reader_tables = host.engine()
        other, other_tables = host.engine()
        warm, _ = other.get_match(TOKENS, ["user:602"])  # nobody's: the client connects
        other.cancel([warm])
        # Returns once every thread of the store process is stopped: a read that reached
        # it in between (the signal sent, not yet taken) was answered in full, a hit.
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
            # queue behind it: it is a miss at once, with no wait for Mooncake counted.
            # By the figures, not a time (a loaded runner can take over a second for any
            # call); a read queued behind is a wait, answered at its timeout.
            before = other.store_stats()
            task, mask = reader.get_match(TOKENS, ["user:601"])
            after = other.store_stats()
            assert not mask.any()
            assert (after["remote_lookups"], after["remote_misses"]) == (
                before["remote_lookups"] + 1, before["remote_misses"] + 1)
            assert after["remote_lookup_waits"] == before["remote_lookup_waits"]
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


def test_a_write_under_way_when_its_key_is_evicted_stays_hidden_from_every_host(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer has taken the put (the evict cannot take it back) and is asking
    # Mooncake for markers when another engine evicts the key: the write must not land
    # under the generation that follows the evict, where every host would read it.
    entered, gate = _held(monkeypatch, "_refresh", Writer)
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master})
    host.start()
    try:
        engine, tables = host.engine()
        offload(engine, tables, 901)
        assert entered.wait(10), "the writer did not take the put"
        other, _ = host.engine()
        assert other.evict(["user:901"]) == TOKENS.size
        gate.set()
        wait_for(lambda: engine.store_stats()["remote_blocks_held"] == 0, "the write's end")
        assert engine.store_stats()["remote_blocks_written"] == 0
        assert engine.store_stats()["remote_dropped_writes"] == PAGES
        engine.close()
        other.close()
        host.stop()
        host.start()  # an empty host tier: whatever it finds comes from Mooncake
        reader, _ = host.engine()
        task, mask = reader.get_match(TOKENS, ["user:901"])
        reader.cancel([task])
        assert not mask.any()
        assert reader.store_stats()["remote_hits"] == 0
        reader.close()
    finally:
        gate.set()
        host.stop()


def test_a_write_waiting_behind_another_users_put_is_dropped_by_its_keys_evict(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's writer took 952's write off the queue (checked, summed) while 951's
    # was in Mooncake's put. An evict of 952 through the server does not wait for its
    # write: it published its marker and removed the keys of 952's generation, and the
    # put then landed after the remove, in Mooncake for good (until its LRU). Not put
    # yet, the evict drops it.
    put = held(monkeypatch, Values, "put")
    removed = threading.Event()
    remove = Remover._remove

    def remove_then_tell(remover: Remover, *args: Any) -> Any:
        try:
            return remove(remover, *args)
        finally:
            removed.set()

    monkeypatch.setattr(Remover, "_remove", remove_then_tell)
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master})
    host.start()
    try:
        engine, tables = host.engine()
        offload(engine, tables, 951)
        assert put.entered.wait(30), "951's write never reached its put"
        summed = engine.store_stats()["remote_write_checksum_seconds"]
        offload(engine, tables, 952)
        wait_for(lambda: engine.store_stats()["remote_write_checksum_seconds"] > summed,
                 "952's write summed")
        other, _ = host.engine()
        assert other.evict(["user:952"]) == TOKENS.size
        assert removed.wait(30), "the evict removed nothing"
        put.set()
        wait_for(lambda: engine.store_stats()["remote_blocks_held"] == 0, "the writes' end")
        stats = engine.store_stats()
        assert stats["remote_blocks_written"] == PAGES  # 951's alone
        assert stats["remote_dropped_writes"] == PAGES
        engine.close()
        other.close()
    finally:
        put.set()
        host.stop()


def test_a_users_write_dropped_at_its_checks_by_an_evict_gives_back_its_batchs_blocks(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 962's and 963's writes are one batch; an evict of 963 through the server (which
    # does not wait for writes) comes while the writer checks it: 963's write is
    # dropped there, 962's goes on. 963's host blocks were never given back
    # (remote_blocks_held stayed at its pages, which later writes find taken) and 963
    # stayed a namespace being written.
    def of(user: int) -> Any:
        tag = namespace_tag([f"user:{user}"])
        return lambda writer, jobs: any(job.ns == tag for job in jobs)

    first = held(monkeypatch, Writer, "_write", of(961))
    checks = held(monkeypatch, Writer, "_write", of(963))
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master})
    host.start()
    try:
        engine, tables = host.engine()
        offload(engine, tables, 961)
        assert first.entered.wait(30), "961's write never reached its checks"
        offload(engine, tables, 962)
        offload(engine, tables, 963)
        wait_for(lambda: engine.store_stats()["remote_write_queue_blocks"] == 2 * PAGES,
                 "962's and 963's writes queued")
        first.set()
        assert checks.entered.wait(30), "962's and 963's batch never reached its checks"
        other, _ = host.engine()
        assert other.evict(["user:963"]) == TOKENS.size
        checks.set()
        wait_for(lambda: engine.store_stats()["remote_blocks_held"] == 0, "the writes' end")
        stats = engine.store_stats()
        assert stats["remote_blocks_written"] == 2 * PAGES  # 961's and 962's
        assert stats["remote_dropped_writes"] == PAGES
        engine.close()
        other.close()
    finally:
        first.set()
        checks.set()
        host.stop()


def test_a_server_that_never_looked_a_key_up_writes_it_where_hosts_find_it_after_an_evict(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An embedded host evicts the key; the server, which never looked it up, then takes
    # an offload of it, offered once the server has moved past the evict's marker (a
    # copy slower than a marker call): its blocks go under the generation that evict
    # began, where a host tier that starts empty finds them.
    namespace = ["user:931"]
    evicting = EmbeddedHost(mooncake.master)
    try:
        assert evicting.kv.evict(931, namespace=namespace) == 0  # its marker goes out
    finally:
        evicting.kv.close()
    offers_once_learned(monkeypatch, namespace_tag(namespace))
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master})
    host.start()
    try:
        engine, tables = host.engine()
        offload(engine, tables, 931)
        wait_for(lambda: engine.store_stats()["remote_blocks_held"] == 0, "the write's end")
        assert engine.store_stats()["remote_blocks_written"] == PAGES
        engine.close()
        host.stop()
        host.start()  # an empty host tier: whatever it finds comes from Mooncake
        reader, _ = host.engine()
        task, mask = reader.get_match(TOKENS, namespace)
        reader.cancel([task])
        assert mask.all()
        assert reader.store_stats()["remote_hits"] == 1
        reader.close()
    finally:
        host.stop()


def test_a_get_that_waited_for_another_gets_read_asks_mooncake_for_its_own_pages(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master})
    host.start()
    try:
        _on_mooncake_only(host, 951)
        entered, gate = _held(monkeypatch, "read")
        waiting = _waits_for_a_read(monkeypatch, PAGES)
        short, _ = host.engine()
        full, full_tables = host.engine()
        head = Call(lambda: short.get_match(TOKENS[: 2 * PAGE_SIZE], ["user:951"]))
        assert entered.wait(10), "the first read did not start"
        whole = Call(lambda: full.get_match(TOKENS, ["user:951"]))
        assert waiting.wait(10), "the whole GET did not wait for the first read"
        assert whole.is_alive()
        gate.set()
        task, mask = head.outcome()
        assert mask.sum() == 2 * PAGE_SIZE
        short.cancel([task])
        task, mask = whole.outcome()
        assert mask.all(), f"{int(mask.sum())} of {TOKENS.size} tokens"
        assert load_exact(full, full_tables, 951, task)
        short.close()
        full.close()
    finally:
        host.stop()


def test_a_server_stopped_while_mooncake_answers_a_read_stops_cleanly(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The host tier has too few free blocks for the read: it first asks which blocks
    # exist, and that answer comes while the server is closing.
    socket_path = tmp_path / "run" / "store.sock"
    config = aiokv.StoreConfig(cpu_cache_gb=0.002, remote={"master": mooncake.master})
    errors: list[BaseException] = []

    def serve(server: StoreServer) -> threading.Thread:
        def run() -> None:
            try:
                server.serve()
            except BaseException as exc:  # what the test looks for
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    first = StoreServer(socket_path, config)
    first.start()
    thread = serve(first)
    writer, tables = observer(socket_path)
    offload(writer, tables, 911)
    wait_for(lambda: _written(writer, PAGES), "the remote write")
    writer.close()
    first.stop()
    thread.join(30)
    entered, gate = _held(monkeypatch, "leading")
    second = StoreServer(socket_path, config, drain_timeout_s=0.5)
    second.start()
    thread = serve(second)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(str(socket_path))
    hello(raw)
    host_tier = second.service._host
    assert host_tier is not None
    hog = host_tier.reserve(host_tier.alloc.num_free - 2)  # room for 2 of the 6 pages
    assert len(hog)
    raw.sendall(wire.encode_match(wire.GET, [(TOKENS, ["user:911"])], PAGE_SIZE, []))
    assert entered.wait(10), "the read did not ask which blocks exist"
    raw.close()  # that engine dies
    second.stop()
    threading.Timer(0.2, gate.set).start()  # Mooncake answers while the server closes
    thread.join(30)
    assert not thread.is_alive() and errors == []
    again = StoreServer(socket_path, config)  # its locks were let go
    again.start()
    again.stop()
    again.serve()


@pytest.mark.parametrize("fate", ["times out", "raises"])
def test_evicts_that_share_one_marker_call_count_its_failure_once(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fate: str) -> None:
    # Two engines evict while the server's reader thread is in another call (its first
    # check of the markers, held): both evicts' markers wait for the one publish call
    # queued behind it. Where they gave up on it, each counted a timeout; where that call
    # raised, each counted a failed call: remote_errors said 2 for one call.
    entered, gate = _held(monkeypatch, "_check", timeout_ms=2001)
    if fate == "raises":
        publish = remote_client.RemoteIO._publish
        raised = threading.Event()

        def raises_once(io: remote_client.RemoteIO) -> bool:
            if raised.is_set() or io.config.timeout_ms != 2001:
                return publish(io)
            raised.set()
            raise RuntimeError("the client raised")

        monkeypatch.setattr(remote_client.RemoteIO, "_publish", raises_once)
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master, "timeout_ms": 2001})
    host.start()
    engines = [host.engine()[0] for _ in range(3)]
    try:
        figures = engines[2]
        assert entered.wait(10), "the remote tier's first check did not start"
        evicts = [Call(lambda e=e, u=u: e.evict([f"user:{u}"]))
                  for e, u in ((engines[0], 1201), (engines[1], 1202))]
        wait_for(lambda: figures.store_stats()["remote_invalidations_waiting"] == 2,
                 "both evicts at the server")
        if fate == "times out":
            assert [evict.outcome() for evict in evicts] == [0, 0]  # after timeout_ms
            gate.set()
        else:
            gate.set()
            assert [evict.outcome() for evict in evicts] == [0, 0]
        # The markers go out all the same (the reader thread, once the tier answers).
        wait_for(lambda: figures.store_stats()["remote_invalidations_waiting"] == 0,
                 "the markers out")
        stats = figures.store_stats()
    finally:
        gate.set()
        for engine in engines:
            engine.close()
        host.stop()
    seen = {key: stats[key] for key in ("remote_timeouts", "remote_call_errors",
                                        "remote_invalidation_errors", "remote_errors")}
    one = "remote_timeouts" if fate == "times out" else "remote_call_errors"
    assert seen == {"remote_timeouts": 0, "remote_call_errors": 0, one: 1,
                    "remote_invalidation_errors": 2, "remote_errors": 1}


def test_a_marker_call_that_close_cancels_before_it_started_is_no_failure(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # An engine evicts and exits while the evict's marker call waits behind a call that
    # does not end (a check, held); the server stops within the evict's timeout_ms and
    # its close cancels that call, never made. It was counted a failed call, and the
    # tier put to rest: "remote tier: a call failed (); resting".
    entered, gate = threading.Event(), threading.Event()

    check = remote_client.RemoteIO._check

    def held_check(io: remote_client.RemoteIO) -> bool:
        if io.config.timeout_ms != 3001:
            return check(io)
        entered.set()
        gate.wait(30)
        return False  # no answer, as a master that never gives one

    monkeypatch.setattr(remote_client.RemoteIO, "_check", held_check)
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master, "timeout_ms": 3001})
    host.start()
    figures, _ = host.engine()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert entered.wait(10), "the remote tier's first check did not start"
        raw.connect(str(host.socket))
        hello(raw)
        raw.sendall(wire.encode_json({"op": "evict", "ns": ["user:1301"]}))
        wait_for(lambda: figures.store_stats()["remote_invalidations_waiting"] == 1,
                 "the evict at the server")
        raw.close()  # that engine exits, its evict unanswered
        wait_for(lambda: figures.store_stats()["server_clients"] == 1, "the engine gone")
        figures.close()
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            host.stop()  # within the evict's timeout_ms
    finally:
        gate.set()
        raw.close()
        figures.close()
        host.stop()
    said = [record.getMessage() for record in caplog.records]
    assert any("1 evicts or clears closed with their markers unpublished" in line
               for line in said), said
    assert not any("failed" in line for line in said), said


@pytest.mark.asyncio
async def test_a_lookup_waits_for_ssd_copies_whose_blocks_only_mooncakes_writer_also_reads(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with SSD (write_through) and Mooncake: user 0 only on SSD; users 1 and 2
    fill the host tier, their SSD copies held. User 1's blocks are read by their copies
    and by Mooncake's writer (user 2's did not fit its queue, half the tier), user 2's by
    their copies and this engine's Lookup. Both the copies and the write end by
    themselves, so the lookup of user 0 waits for the room user 1's blocks bring and hits
    whole; it was answered short at once (0 tokens): the writer read like a Lookup."""
    _, caches, original = await user_0_on_ssd(tmp_path)
    config = ssd_config(tmp_path / "ssd", remote={"master": mooncake.master})
    remote_writes = held(monkeypatch, Writer, "_write")
    with store_of("shared", config, tmp_path, caches) as (store, figures):
        async with aiokv.OffloadEngine(store, caches) as engine:
            writes = await host_tier_in_flight(engine, monkeypatch)
            hold = None
            try:
                assert await asyncio.to_thread(remote_writes.entered.wait, 10)
                hold = await engine.lookup(2, SSD_USER_PAGES * PAGE)
                assert hold.cached_tokens == SSD_USER_PAGES * PAGE
                lookup = asyncio.ensure_future(engine.lookup(0, SSD_USER_PAGES * PAGE))
                await asyncio.to_thread(wait_for, lambda: lookup.done()
                                        or figures()["stage_waits"], "the lookup's answer")
                # Mooncake's write ends first: user 1's blocks are then read by their SSD
                # copies only.
                remote_writes.set()
                await asyncio.to_thread(wait_for, lambda: figures()["remote_blocks_held"] == 0,
                                        "the remote writes in")
            finally:
                writes.set()
                remote_writes.set()
                if hold is not None:
                    hold.release()
            assert await user_0_loads_whole(engine, caches, original, await lookup)


def _put(store: SharedStore, tables: list[torch.Tensor], user: int, kv: list[torch.Tensor],
         pages: int) -> None:
    """The first ``pages`` pages of ``kv`` offloaded under ``user:<user>``."""
    for cache, pages_kv in zip(tables, kv, strict=True):
        cache[:pages] = pages_kv[:pages]
    task, mask = store.put_match(TOKENS[: pages * PAGE_SIZE], [f"user:{user}"])
    assert mask.all()
    store.launch([task], [torch.arange(pages)], [None])
    wait_for(lambda: store.try_wait([task]), "the offload")


def _version(tables: list[torch.Tensor], at: int, user: int, page: int) -> str:
    """Which version page ``at`` of the tables holds of the user's page ``page`` (v1: the
    user's KV, v2: the next user's, ?: neither)."""
    for name, kv in (("v1", user_kv(user, PAGES)), ("v2", user_kv(user + 1, PAGES))):
        if all(torch.equal(t[at], k[page]) for t, k in zip(tables, kv, strict=True)):
            return name
    return "?"


@contextmanager
def _a_and_b_with_v1_on_mooncake(
    tmp_path: Path, master: str, user: int, a_timeout_ms: int | None = None
) -> Iterator[tuple[Host, SharedStore, list[torch.Tensor]]]:
    """Store servers A and B on one Mooncake, each over its own directory and without
    SSD (A's store.remote with ``a_timeout_ms`` where given). B has offloaded all of the
    user's pages (v1) and written them to Mooncake. Yields A, and B's engine with its
    tables; both servers stop on the way out (a read the block held must be let go by
    then)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a_remote: dict[str, Any] = {"master": master}
    if a_timeout_ms is not None:
        a_remote["timeout_ms"] = a_timeout_ms
    a = Host(tmp_path / "a", ssd=False, remote=a_remote)
    b = Host(tmp_path / "b", ssd=False, remote={"master": master})
    a.start()
    b.start()
    try:
        b_engine, b_tables = b.engine()
        _put(b_engine, b_tables, user, user_kv(user, PAGES), PAGES)  # v1
        wait_for(lambda: _written(b_engine, PAGES), "B's first write")
        yield a, b_engine, b_tables
    finally:
        a.stop()
        b.stop()


def _loaded_versions(gate: threading.Event, lookup: Any, reader: Any, tables: Any,
                     user: int) -> list[str]:
    """Let the reader's held lookup of the user go (``gate`` holds it), and load what it
    found into the last pages of its tables; each page's version (v1, v2), as
    :func:`_version` tells it."""
    gate.set()
    task, mask = lookup.outcome()
    pages = int(mask.sum()) // PAGE_SIZE
    first = len(tables[0]) - pages
    reader.launch([task], [torch.arange(first, first + pages)], [None])
    results: dict[int, Any] = {}
    wait_for(lambda: results.update(reader.try_wait([task])) or results, "the load")
    return [_version(tables, first + p, user, p) for p in range(pages)]


def test_a_read_never_joins_a_put_of_its_key_that_landed_meanwhile_with_another_version(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A had no page of the user when its read from Mooncake began (held before it asks).
    # Meanwhile another engine of A puts the user's first half (v1, under the generation
    # A knows), B evicts the user and offloads all of it again with other bytes (v2),
    # and the read, let go, reads v2 under the next generation. Its second half joined
    # A's own v1 half: a load of pages of two versions.
    user, half = 981, PAGES // 2
    with _a_and_b_with_v1_on_mooncake(tmp_path, mooncake.master, user) as (a, b_engine, b_tables):
        entered, gate = _held(monkeypatch, "read")
        try:
            reader, tables = a.engine()
            putter, put_tables = a.engine()
            lookup = Call(lambda: reader.get_match(TOKENS, [f"user:{user}"]))
            assert entered.wait(10), "A's read did not start"
            _put(putter, put_tables, user, user_kv(user, PAGES), half)  # A's own v1 half
            wait_for(lambda: putter.store_stats()["remote_blocks_held"] == 0, "A's write")
            assert b_engine.evict([f"user:{user}"]) == PAGES * PAGE_SIZE
            assert b_engine.store_stats()["remote_invalidation_errors"] == 0  # its marker is out
            _put(b_engine, b_tables, user, user_kv(user + 1, PAGES), PAGES)  # v2
            wait_for(lambda: _written(b_engine, 2 * PAGES), "B's second write")
            versions = _loaded_versions(gate, lookup, reader, tables, user)
            for engine in (reader, putter, b_engine):
                engine.close()
        finally:
            gate.set()
    assert versions in (["v1"] * half, ["v2"] * PAGES)


def test_a_read_never_joins_a_put_that_trusted_its_markers_from_before_an_evict(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A's read has its answer (v1, under the generation its markers told) but the server
    # has not placed it yet. B evicts the user (its marker out), then another engine of A
    # puts the user's first page with the bytes after that evict (v2). Its put trusts the
    # markers A's read was answered with (asked within the writer's freshness: made
    # certain here), so it is labelled with the read's generation. The read's pages must
    # not join it: that lookup would load pages of two versions.
    user, timeout_ms = 991, 4321  # A's tier alone has that timeout_ms
    monkeypatch.setattr(remote_writer, "_MARKERS_FRESH_S", 600.0)
    answered, gate = threading.Event(), threading.Event()
    real = remote_client.RemoteIO.viewed

    def viewed(io: Any, *args: Any) -> Any:
        answer = real(io, *args)
        if io.config.timeout_ms == timeout_ms and not gate.is_set():
            answered.set()
            gate.wait(20)
        return answer

    monkeypatch.setattr(remote_client.RemoteIO, "viewed", viewed)
    with _a_and_b_with_v1_on_mooncake(tmp_path, mooncake.master, user,
                                      a_timeout_ms=timeout_ms) as (a, b_engine, _):
        try:
            reader, tables = a.engine()
            putter, put_tables = a.engine()
            lookup = Call(lambda: reader.get_match(TOKENS, [f"user:{user}"]))
            assert answered.wait(10), "A's read was not answered"
            assert b_engine.evict([f"user:{user}"]) == PAGES * PAGE_SIZE
            assert b_engine.store_stats()["remote_invalidation_errors"] == 0  # its marker is out
            _put(putter, put_tables, user, user_kv(user + 1, PAGES), 1)  # A's own v2 page
            versions = _loaded_versions(gate, lookup, reader, tables, user)
            for engine in (reader, putter, b_engine):
                engine.close()
        finally:
            gate.set()
    assert versions == ["v2"]


def _puts_held_and_a_bare_client(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Any, Any]:
    """The keys the writer puts (filled as each put starts), the gate that holds each
    put in Mooncake's call until set, and a bare Mooncake client to look for them."""
    put: list[str] = []

    def keys_of(writer: Any, ready: Any, count: int) -> bool:
        put.extend(key for _, keys in ready.parts for key in keys)
        return True

    gate = held(monkeypatch, Writer, "_put", when=keys_of)
    bare = import_store().MooncakeDistributedStore()
    assert bare.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                      mooncake.master) == 0
    return put, gate, bare


def _gone_from_mooncake(bare: Any, put: list[str]) -> None:
    """The one user's put keys leave Mooncake within 3 s."""
    assert len(put) == PAGES
    deadline = time.monotonic() + 3
    while any(code == 1 for code in bare.batch_is_exist(put)):
        assert time.monotonic() < deadline, "the evicted user's blocks stayed in Mooncake"
        time.sleep(0.05)


def test_an_evict_through_the_server_while_its_users_put_is_under_way_leaves_no_blocks(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Mooncake has the user's put in hand when another engine evicts the user: the
    # evict's marker ends the generation, and its removal must come after the put
    # lands, or the put's blocks stay in Mooncake, read by nobody, until its LRU (as an
    # embedded store's evict, which waits for the put, already does).
    put, gate, bare = _puts_held_and_a_bare_client(mooncake, monkeypatch)
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master,
                                              "timeout_ms": 5_000})
    host.start()
    try:
        engine, tables = host.engine()
        offload(engine, tables, 1901)
        assert gate.entered.wait(10), "the writer never reached its put"
        other, _ = host.engine()
        evicted: list[int] = []
        evict = threading.Thread(target=lambda: evicted.append(other.evict(["user:1901"])))
        evict.start()
        evict.join(1.0)  # answered at once where it does not wait for the put
        time.sleep(0.5)  # and the removal that followed its marker ran
        gate.set()
        evict.join(30)
        assert evicted == [TOKENS.size]
        wait_for(lambda: engine.store_stats()["remote_blocks_held"] == 0, "the put's end")
        _gone_from_mooncake(bare, put)
        engine.close()
        other.close()
    finally:
        gate.set()
        host.stop()
        bare.close()


def test_an_evict_by_another_host_while_a_servers_put_is_under_way_leaves_no_blocks(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Mooncake has the server's put of a user in hand when an embedded host evicts that
    # user: its marker ends the generation and its removal runs before the put lands.
    # The server, which never looked the key up since, must remove what landed: nobody
    # reads it, and it holds Mooncake's room until its LRU.
    put, gate, bare = _puts_held_and_a_bare_client(mooncake, monkeypatch)
    host = Host(tmp_path, ssd=False, remote={"master": mooncake.master,
                                              "timeout_ms": 5_000})
    host.start()
    evicting = EmbeddedHost(mooncake.master)
    try:
        engine, tables = host.engine()
        offload(engine, tables, 1911)
        assert gate.entered.wait(10), "the writer never reached its put"
        assert evicting.kv.evict(1911, namespace=["user:1911"]) == 0  # its marker is out
        time.sleep(0.5)  # and the removal that followed it ran
        gate.set()
        wait_for(lambda: engine.store_stats()["remote_blocks_held"] == 0, "the put's end")
        _gone_from_mooncake(bare, put)
        engine.close()
    finally:
        gate.set()
        evicting.kv.close()
        host.stop()
        bare.close()
