"""Invalidation across hosts on the remote tier (a real Mooncake Store, conftest's
``mooncake``): what an evict or clear on one host ends for every other, whatever that
host knew of the key's generation, and what it leaves alone. Hosts are engines in this
process (tests/remote_local.py) that share nothing but Mooncake; where a test needs a
write to land at a given moment, the writer is held at its batch (conftest's ``held``).
Users from 1700 on: the session's Mooncake remembers what other modules' users went
through, and an evict here would change what their hosts may write."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Gate, failing_first_call, held, needs_mooncake, offers_once_learned
from prometheus_client import CollectorRegistry
from remote_host import HEAD_DIM, HEADS, LAYERS, PAGE_SIZE
from remote_local import TOKENS, USER_PAGES, LocalHost, close_woken, until

import aiokv.metrics
from aiokv.remote import connection as remote_connection
from aiokv.remote.keys import Keys, geometry_tag, namespace_tag
from aiokv.remote.markers import Markers
from aiokv.remote.native import import_store
from aiokv.remote.removals import Remover
from aiokv.remote.servers import MooncakeServers
from aiokv.remote.values import Values
from aiokv.remote.writer import Writer
from aiokv.stores.local.digests import chain_digests

pytestmark = needs_mooncake()

# For a fresh host whose first lookup must answer, or whose evict's marker must go out (both
# wait behind the connect), also on a loaded machine: a lookup that times out is a miss,
# and learns no marker in time.
SLOW_MS = 5000


def short_rests(monkeypatch: pytest.MonkeyPatch, rest_s: float = 0.5) -> None:
    """A tier that failed a call rests ``rest_s`` at most (timeout_ms, doubling, else):
    a test that restarts the master waits for its hosts to see the new one, and how long
    they rest is not what it checks."""
    rest = remote_connection.Connection.rest

    def shortened(self: remote_connection.Connection, what: str, detail: object) -> None:
        rest(self, what, detail)
        self._retry_at = min(self._retry_at, time.monotonic() + rest_s)

    monkeypatch.setattr(remote_connection.Connection, "rest", shortened)


def test_an_evict_from_a_host_that_missed_earlier_evicts_ends_what_is_served_now(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # A evicts the user once and offloads it again: those blocks belong to the generation
    # after that evict, and land once B has evicted the user. B never looked the user
    # up, so it knew only the first generation: its evict must end the one A writes to.
    a = LocalHost(mooncake.master)
    try:
        a.offload_to_mooncake(1701)
        assert a.kv.evict(1701) == TOKENS
        gate = held(monkeypatch, Writer, "_write")
        assert a.offload(1701) == TOKENS
        assert gate.entered.wait(60), "the writer did not take the put"
        # Fresh: its evict's marker goes out behind its connect, within timeout_ms or
        # counted as an invalidation error.
        b = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
        try:
            assert b.kv.evict(1701) == 0  # nothing in its own tiers
        finally:
            assert b.close()["remote_invalidation_errors"] == 0
        gate.set()
    finally:
        a.close()
    c = LocalHost(mooncake.master, timeout_ms=SLOW_MS)  # learns all from Mooncake
    try:
        assert c.load(1701)[0] == 0
    finally:
        c.close()


@pytest.mark.parametrize("clear", [False, True])
def test_a_late_remove_leaves_what_was_written_after_the_invalidation(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        clear: bool) -> None:
    # The marker is out (the evict or clear has answered) but its best-effort remove is
    # slow, as a busy master's scan would be: B learns the new generation (epoch) and
    # writes the user under it meanwhile. The remove must take what ended only.
    with contextlib.ExitStack() as stack:
        # A clear ends every key: on a Mooncake of its own, not the session's.
        servers = stack.enter_context(MooncakeServers(16, log_dir=tmp_path)) if clear else mooncake
        _written_over_a_late_remove(servers.master, monkeypatch, clear)


def _written_over_a_late_remove(master: str, monkeypatch: pytest.MonkeyPatch,
                                clear: bool) -> None:
    a = LocalHost(master)
    try:
        a.offload_to_mooncake(1711)
        gate = held(monkeypatch, import_store().MooncakeDistributedStore, "remove_by_regex")
        if clear:
            a.kv.clear()
        else:
            assert a.kv.evict(1711) == TOKENS
        # The remove follows the marker's call: under way, the marker is out (an evict
        # answers at timeout_ms without it, and B would then read what A ended).
        assert gate.entered.wait(60), "the invalidation did not remove"
        b = LocalHost(master, timeout_ms=SLOW_MS)
        try:
            assert b.load(1711)[0] == 0  # gone; B learns the generation from the marker
            b.offload_to_mooncake(1711)
        finally:
            b.close()
        gate.set()
    finally:
        a.close()  # after its remove
    c = LocalHost(master, timeout_ms=SLOW_MS)
    try:
        assert c.load(1711) == (TOKENS, True)  # what B wrote after the invalidation
    finally:
        c.close()


def test_a_slow_remove_holds_up_no_evict_lookup_or_read(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # A's evict has its marker out and its best-effort remove under way, held for as long
    # as the test likes: a master with many keys takes that long to scan them all. A's
    # next evicts get their markers out, and its lookups (a host-tier hit, a read from
    # Mooncake) answer, all before that remove ends; what the evicts ended misses on B.
    # The removes queued meanwhile then take what those evicts ended, and nothing that B
    # wrote since under the next generation.
    c = LocalHost(mooncake.master)
    try:
        c.offload_to_mooncake(1761)
    finally:
        c.close()
    a = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    b = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    # Mooncake's own call held (every client of this process: only A removes), and what
    # each one removed.
    store = import_store().MooncakeDistributedStore
    real, gate, removed = store.remove_by_regex, Gate(), []

    def slow(client: Any, pattern: str, force: bool) -> int:
        gate.entered.set()
        gate.wait(30)
        count = real(client, pattern, force)
        removed.append(count)
        return count

    monkeypatch.setattr(store, "remove_by_regex", slow)
    try:
        for user in (1762, 1763, 1764, 1765):
            assert a.offload(user) == TOKENS
        until(lambda: a.stats()["remote_blocks_written"] == 4 * USER_PAGES)
        assert a.kv.evict(1762) == TOKENS
        assert gate.entered.wait(60), "the evict did not remove"
        assert a.kv.evict(1763) == TOKENS
        assert a.kv.evict(1765) == TOKENS
        assert a.load(1764) == (TOKENS, True)
        assert a.load(1761) == (TOKENS, True)  # from Mooncake
        stats = a.stats()
        # Each of them answered, none at its timeout_ms: the remove is still held.
        assert not gate.is_set()
        assert (stats["remote_invalidation_errors"], stats["remote_timeouts"],
                stats["remote_hits"]) == (0, 0, 1), stats
        assert [b.load(user)[0] for user in (1762, 1763, 1765)] == [0, 0, 0]
        assert b.load(1764) == (TOKENS, True)  # not A's to end
        assert b.offload(1763) == TOKENS  # under the generation after A's evict
        until(lambda: b.stats()["remote_blocks_written"] == USER_PAGES)
        gate.set()
        # 1762's remove, then 1763's and 1765's together.
        until(lambda: len(removed) == 2)
        assert removed == [USER_PAGES, 2 * USER_PAGES]
        assert (a.stats()["remote_removals_dropped"], a.stats()["remote_errors"]) == (0, 0)
    finally:
        gate.set()
        b.close()
        a.close()
    d = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        assert d.load(1763) == (TOKENS, True)  # B's
    finally:
        d.close()


def test_a_host_does_not_read_what_its_evict_ends_until_the_marker_is_out(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # X serves the user under the generation after an evict. B knew only the first one,
    # and its evict's marker fails to go out (the master went away for a moment): B
    # must not read the user from Mooncake meanwhile, and the marker must follow once
    # Mooncake answers again, so that no host is served what B's evict ended.
    x = LocalHost(mooncake.master)
    try:
        x.offload_to_mooncake(1741)
        assert x.kv.evict(1741) == TOKENS
        assert x.offload(1741) == TOKENS
        # Seen written before the close, which gives a batch under way 500 ms only.
        until(lambda: x.stats()["remote_blocks_written"] >= 2 * USER_PAGES)
    finally:
        assert x.close()["remote_blocks_written"] == 2 * USER_PAGES
    monkeypatch.setattr(Markers, "end", failing_first_call(Markers.end, "the master went away"))
    b = LocalHost(mooncake.master, timeout_ms=200)
    try:
        assert b.kv.evict(1741) == 0
        # Through the tier's rest after the failure and past it, the marker out or not:
        # never what the evict ended.
        rested = time.monotonic() + 1.0
        while time.monotonic() < rested:
            assert b.load(1741)[0] == 0
        until(lambda: b.stats().get("remote_invalidations_waiting") == 0)
    finally:
        stats = b.close()
    assert stats["remote_invalidation_errors"] == 1
    c = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        assert c.load(1741)[0] == 0
    finally:
        c.close()


def test_a_master_that_stops_answering_holds_up_neither_evicts_nor_close(
        tmp_path: Path) -> None:
    # SIGSTOP: the master accepts connections and never answers; each Mooncake call
    # then waits about 30 s. A write and a lookup are in calls when evicts come: they
    # must not queue more calls, and the engine's close must not wait for Mooncake
    # (it gives a write in a call, then its threads, timeout_ms each).
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master, timeout_ms=200)
        registry = CollectorRegistry()
        aiokv.metrics.register(a.engine, registry, store_timeout_s=30)
        try:
            a.offload_to_mooncake(1)
            servers.pause_master()
            assert a.offload(2) == TOKENS  # its write waits on the master
            assert a.load(3)[0] == 0  # a miss after timeout_ms
            began = time.monotonic()
            assert a.kv.evict(1) == TOKENS
            for user in (2, 4):  # 2's blocks are the write's: freed when it ends
                a.kv.evict(user)
            evicts_s = time.monotonic() - began
            # The markers not out, as the metrics show them.
            until(lambda: [sample.value for family in registry.collect()
                           if family.name == "aiokv_remote_invalidations_waiting"
                           for sample in family.samples] == [3])
            began = time.monotonic()
            stats = a.close()
            close_s = time.monotonic() - began
        finally:
            servers.pause_master(False)
    assert evicts_s < 5 and close_s < 10  # Mooncake's 30 s per call, not waited for
    assert stats["remote_invalidations_waiting"] == 3


def test_close_after_an_evict_waits_timeout_ms_for_a_master_that_went_away(
        tmp_path: Path) -> None:
    # A killed master fails each call at once and the tier rests: close tried the evict's
    # marker again after each rest, for 10 s whatever timeout_ms said. It now gives the
    # marker one call of timeout_ms, counts what it gave up on, and closes the SSD tier
    # with every block the host tier held.
    timeout_ms = 200
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master, ssd_dir=ssd, timeout_ms=timeout_ms)
        try:
            for user in (1791, 1792):
                assert a.offload(user) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == 2 * USER_PAGES)
            servers.stop_master()
            assert a.kv.evict(1791) == TOKENS  # its marker cannot go out
        finally:
            began = time.monotonic()
            stats = a.close()
            close_s = time.monotonic() - began
        b = LocalHost(servers.master, ssd_dir=ssd, timeout_ms=timeout_ms)
        try:
            assert b.load(1792) == (TOKENS, True)  # from the SSD tier a wrote at close
        finally:
            b.close()
    assert close_s < 25 * timeout_ms / 1000  # a generous multiple; it took 10 s
    assert stats["remote_invalidations_waiting"] == 1  # given up on, and counted


def test_close_gives_timeout_ms_to_a_markers_call_a_new_namespaces_put_began(
        tmp_path: Path) -> None:
    # A put of a namespace no call asked for lately has the writer ask for its markers,
    # on a master that stopped answering (SIGSTOP: the call waits about 30 s), while the
    # put's write waits queued behind it. Close saw no call under way (only a batch's
    # write counted) and waited the whole 10 s flush for the queued write.
    timeout_ms = 200
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master, timeout_ms=timeout_ms)
        try:
            a.offload_to_mooncake(1)
            servers.pause_master()
            assert a.offload(2) == TOKENS  # user 2's namespace: never asked for
            began = time.monotonic()
            stats = a.close()
            close_s = time.monotonic() - began
        finally:
            servers.pause_master(False)
    assert close_s < 25 * timeout_ms / 1000  # a generous multiple; it took 10 s
    assert stats["remote_blocks_written"] == USER_PAGES  # user 2's never went out


def test_writes_an_evict_takes_back_are_counted_as_dropped(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # One user's write is under way (held) and another's waits in the queue when the
    # second is evicted: every block offered is written or counted as dropped.
    a = LocalHost(mooncake.master)
    try:
        gate = held(monkeypatch, Writer, "_write")
        assert a.offload(1751) == TOKENS
        assert gate.entered.wait(60), "the writer did not take the put"
        assert a.offload(1752) == TOKENS  # queued behind it
        assert a.stats()["remote_write_queue_blocks"] == USER_PAGES
        assert a.kv.evict(1752) == TOKENS  # waits timeout_ms for the write under way
        gate.set()
    finally:
        stats = a.close()
    assert (stats["remote_blocks_written"], stats["remote_dropped_writes"]) == (
        USER_PAGES, USER_PAGES)
    assert stats["remote_dropped_evicted"] == USER_PAGES



def test_after_a_master_restart_a_host_that_cleared_and_a_new_host_share_again(
        tmp_path: Path) -> None:
    # A clear moves A to the next epoch; the master then restarts and loses every key,
    # the clear's marker too. A must start again from epoch 0 with the hosts that start
    # now, rather than write where they never look.
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master)
        try:
            a.offload_to_mooncake(1781)
            a.kv.clear()
            servers.stop_master()
            servers.start_master()
            servers.wait_store_mounted()
            users = iter(range(1790, 1900))
            written = [0]

            def one_written() -> bool:  # A's writes resume once its client reconnects
                before = a.stats()["remote_blocks_written"]
                written[0] = next(users)
                assert a.offload(written[0]) == TOKENS
                until(lambda: a.stats()["remote_blocks_held"] == 0)
                return bool(a.stats()["remote_blocks_written"] > before)

            until(one_written)
            b = LocalHost(servers.master, timeout_ms=SLOW_MS)
            try:
                assert b.load(written[0]) == (TOKENS, True)
                b.offload_to_mooncake(1782)
            finally:
                b.close()
            assert a.load(1782) == (TOKENS, True)
        finally:
            a.close()


def test_a_write_offered_before_its_host_learned_of_an_evict_is_dropped_as_stale(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # B starts after A's evict and offloads the user; no lookup told it of the evict,
    # and the markers its put asks for as it starts answer only once the put is offered
    # (a copy faster than Mooncake: held here). B cannot tell whether its put came
    # before that evict (then the evict must end it) or after, so the write is dropped,
    # counted as stale, never written.
    a = LocalHost(mooncake.master)
    try:
        a.offload_to_mooncake(1801)
        assert a.kv.evict(1801) == TOKENS
    finally:
        a.close()
    gate = held(monkeypatch, Markers, "past", when=lambda markers, client, items: bool(items))
    b = LocalHost(mooncake.master)
    registry = CollectorRegistry()
    aiokv.metrics.register(b.engine, registry, store_timeout_s=30)
    try:
        assert b.offload(1801) == TOKENS
        until(lambda: b.stats()["remote_blocks_held"] == USER_PAGES)  # offered
        gate.set()
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        dropped = {sample.labels["reason"]: sample.value for family in registry.collect()
                   if family.name == "aiokv_remote_dropped_writes"
                   for sample in family.samples if sample.name.endswith("_total")}
    finally:
        stats = b.close()
    assert (stats["remote_blocks_written"], stats["remote_dropped_stale"]) == (0, USER_PAGES)
    assert stats["remote_dropped_writes"] == USER_PAGES
    assert dropped["stale"] == USER_PAGES and dropped["evicted"] == 0


def test_a_host_that_never_looked_a_key_up_writes_it_where_hosts_find_it_after_an_evict(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # B evicts the user; A, which never looked the user up, then offloads it: A must
    # learn of that evict before its put is offered, so that the blocks go under the
    # generation the evict began, where B finds them. The put is offered once A has
    # moved past the evict's marker (a copy that takes longer than a marker call; else,
    # learned too late, the write is dropped as stale).
    user = 1831
    b = LocalHost(mooncake.master)
    try:
        b.offload_to_mooncake(user)
        assert b.kv.evict(user) == TOKENS
        offers_once_learned(monkeypatch, namespace_tag([f"uid:{user}"]))
        a = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
        try:
            assert a.offload(user) == TOKENS
            until(lambda: a.stats()["remote_blocks_held"] == 0)
        finally:
            stats = a.close()
        assert (stats["remote_blocks_written"], stats["remote_dropped_writes"]) == (USER_PAGES, 0)
        assert b.load(user) == (TOKENS, True)  # its host tier dropped the user: Mooncake's
        assert b.stats()["remote_blocks_read"] == USER_PAGES
    finally:
        b.close()


def test_a_full_mooncake_keeps_the_boot_id_and_the_markers_an_evict_hides_old_bytes_with(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Mooncake evicts by LRU once its segment nears full, oldest lease first: the boot id
    # and an evict's marker (read once, then never asked for again) would go first. Then
    # a full Mooncake would look like a master restart (queued writes dropped, views back
    # to generation 0), and a host that never saw the evict would read the bytes it
    # ended, written late under the old generation. Pinned, they outlive any filling.
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        bare = import_store().MooncakeDistributedStore()
        assert bare.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                          servers.master) == 0
        a = LocalHost(servers.master)
        try:
            with caplog.at_level(logging.WARNING, logger="aiokv"):
                a.offload_to_mooncake(1801)
                keys = Keys(geometry_tag((LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM),
                                         torch.float32, PAGE_SIZE))
                boot = bytes(bare.get(keys.boot_key())).decode()
                old_keys = keys.blocks(boot, namespace_tag(["uid:1801"]), 0, 0, chain_digests(
                    torch.arange(TOKENS).numpy(), PAGE_SIZE))
                old = [bytes(bare.get(key)) for key in old_keys]
                assert all(old)  # the user's values, as a late write would put them
                assert a.kv.evict(1801) == TOKENS
                until(lambda: not any(code == 1 for code in bare.batch_is_exist(old_keys)))
                # Four times the segment, values nobody reads: past the high watermark.
                blob = bytes(512 << 10)
                for i in range(128):
                    bare.put(f"filler/{i}", blob)
                # A write of the user offered before the evict lands only now (late).
                for key, value in zip(old_keys, old, strict=True):
                    until(lambda key=key, value=value: bare.put(key, value) == 0)
                assert a.offload(1802) == TOKENS  # A's tier goes on as before
                until(lambda: a.stats()["remote_blocks_held"] == 0)
                assert a.stats()["remote_dropped_down"] == 0
            assert not [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
            c = LocalHost(servers.master, timeout_ms=SLOW_MS)  # never saw the evict
            try:
                assert c.load(1801) == (0, True)  # not the bytes the evict ended
            finally:
                c.close()
        finally:
            a.close()
            close_woken(bare)


def _versions(host: LocalHost, user: int, loaded: int) -> list[str]:
    """Per page loaded into the host's last USER_PAGES pages: which version it is (v1:
    the user's KV, v2: other bytes, ?: neither)."""
    target = host.caches[0].shape[0] - USER_PAGES
    v1, v2 = host.kv_of(user), host.kv_of(user + 1)
    return ["v1" if all(torch.equal(c[target + p], k[p]) for c, k in zip(host.caches, v1,
                                                                          strict=True))
            else "v2" if all(torch.equal(c[target + p], k[p]) for c, k in zip(host.caches, v2,
                                                                             strict=True))
            else "?" for p in range(loaded // PAGE_SIZE)]


@pytest.mark.parametrize("restart", [False, True], ids=["host", "ssd_after_restart"])
def test_a_host_never_joins_its_pages_of_a_key_with_what_another_host_wrote_after_an_evict(
        mooncake: MooncakeServers, tmp_path: Path, restart: bool) -> None:
    # B holds the first half of the user (v1: on its host tier; or on its SSD, read after
    # a restart). A evicts the user and offloads all of it again with other bytes (v2)
    # under the same tokens. B's lookup read v2's second half from Mooncake after its own
    # v1 half: a load of pages of two versions.
    user = 1811
    b = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=tmp_path if restart else None)
    a = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        half = USER_PAGES // 2
        _offload_half(b, user, half)
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        _evict(a, user)
        _put_v2(a, user)
        if restart:
            b.close()
            b = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=tmp_path)
        target = torch.arange(b.caches[0].shape[0] - USER_PAGES, b.caches[0].shape[0])
        with b.kv.lookup(user, TOKENS) as hit:
            loaded = b.kv.load(hit, target).loaded_tokens
        versions = _versions(b, user, loaded)
    finally:
        a.close()
        b.close()
    # Its own copies stay its own (README), but are never joined with the other version.
    assert versions in (["v1"] * (USER_PAGES // 2), ["v2"] * USER_PAGES)


def test_a_host_never_labels_its_ssd_pages_of_a_key_with_a_later_generation_by_extending_them(
        mooncake: MooncakeServers, tmp_path: Path) -> None:
    # B's SSD holds the first half of the user (v1) from an earlier run; A evicts the user
    # and offloads all of it again with other bytes (v2). B, restarted, learns the new
    # generation at a lookup (its SSD half only), then offloads two pages more of its own
    # after that half. Those two are of the new generation, its SSD half is not: the
    # whole run was labelled with it, and the next lookup joined v2 pages after it.
    user = 1821
    half = USER_PAGES // 2
    b = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=tmp_path)
    a = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        _offload_half(b, user, half)
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        _evict(a, user)
        _put_v2(a, user)
        b.close()
        b = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=tmp_path)
        target = torch.arange(b.caches[0].shape[0] - USER_PAGES, b.caches[0].shape[0])
        with b.kv.lookup(user, TOKENS) as hit:
            first = _versions(b, user, b.kv.load(hit, target).loaded_tokens)
        for cache, kv in zip(b.caches, b.kv_of(user), strict=True):
            cache[:USER_PAGES] = kv
        assert b.kv.offload(user, torch.arange(half + 2), (half + 2) * PAGE_SIZE).stored_tokens
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        with b.kv.lookup(user, TOKENS) as hit:
            second = _versions(b, user, b.kv.load(hit, target).loaded_tokens)
    finally:
        a.close()
        b.close()
    assert first == ["v1"] * half
    assert second == ["v1"] * (half + 2)  # its own copies, none of v2 after them


@pytest.mark.parametrize("below", [False, True], ids=["host", "ssd"])
def test_a_host_never_writes_pages_that_extend_its_own_of_an_ended_generation_under_the_next(
        mooncake: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        below: bool) -> None:
    # A holds the first half of the user (v1: on its host tier; or on its SSD only, after
    # a restart). B evicts the user; A learns the new generation (a lookup of its own
    # half; restarted, at its offload's start) and offloads two pages more, its v1 bytes:
    # new to A, they went to Mooncake under the new generation after pages that are not
    # of it. D then offloads all of the user with other bytes (v2): a put keeps the
    # first value, so C loaded v2 joined with A's v1 pages, two versions in one load.
    user, half = 1881 + below, USER_PAGES // 2
    ssd = tmp_path if below else None
    a = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=ssd)
    try:
        _offload_half(a, user, half)
        until(lambda: a.stats()["remote_blocks_held"] == 0)
        if below:
            a.close()
        _evict_on_another_host(mooncake.master, user)
        if below:
            a = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=ssd)
            offers_once_learned(monkeypatch, namespace_tag([f"uid:{user}"]))
        else:
            assert a.load(user) == (half * PAGE_SIZE, True)
        versions = _extend_then_v2_elsewhere(mooncake, a, user, half)
        own = _loaded_versions(a, user)
    finally:
        stats = a.close()
    assert versions == ["v2"] * USER_PAGES
    assert own == ["v1"] * (half + 2)  # its own copies, none of v2 after them
    assert stats["remote_dropped_stale"] == 2  # not written: counted


@pytest.mark.parametrize("how", ["put", "read"])
def test_another_prompt_of_a_key_never_labels_its_ssd_pages_with_a_later_generation(
        mooncake: MooncakeServers, tmp_path: Path, how: str) -> None:
    # A's SSD holds the first half of the user (v1) from an earlier run; B evicts the
    # user. A, restarted, offloads another prompt of the user (all new: its host tier
    # holds no other page of the key, its SSD does), or loads it from Mooncake (E's),
    # then offloads two pages more after its SSD half (v1 bytes). The first labelled the
    # whole key with the new generation, so the second wrote its pages under it; once D
    # offloaded the user with other bytes (v2), C loaded v2 joined with A's v1 pages,
    # two versions in one load.
    user, half = 1885 + (how == "read"), USER_PAGES // 2
    a = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=tmp_path)
    try:
        _offload_half(a, user, half)
        until(lambda: a.stats()["remote_blocks_held"] == 0)
        a.close()
        _evict_on_another_host(mooncake.master, user)
        a = LocalHost(mooncake.master, timeout_ms=SLOW_MS, ssd_dir=tmp_path)
        other = torch.arange(10_000, 10_000 + TOKENS)
        if how == "read":
            e = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
            try:
                with e.kv.lookup(user, TOKENS, token_ids=other) as hit:  # learns it
                    assert hit.cached_tokens == 0
                assert e.kv.offload(user, torch.arange(USER_PAGES), TOKENS,
                                    token_ids=other).stored_tokens == TOKENS
                until(lambda: e.stats()["remote_blocks_written"] == USER_PAGES)
            finally:
                e.close()
            with a.kv.lookup(user, TOKENS, token_ids=other) as hit:
                # A miss: its SSD pages of the key are of no known view, so none of
                # the new generation joins them (views).
                assert a.kv.load(hit, torch.arange(USER_PAGES)).loaded_tokens in (0, TOKENS)
        else:
            with a.kv.lookup(user, TOKENS, token_ids=other) as hit:  # learns the generation
                assert hit.cached_tokens == 0
            assert a.kv.offload(user, torch.arange(USER_PAGES), TOKENS,
                                token_ids=other).stored_tokens == TOKENS
            until(lambda: a.stats()["remote_blocks_held"] == 0)
        versions = _extend_then_v2_elsewhere(mooncake, a, user, half)
    finally:
        a.close()
    assert versions == ["v2"] * USER_PAGES


def _extend_then_v2_elsewhere(mooncake: MooncakeServers, a: LocalHost, user: int,
                              half: int) -> list[str]:
    """A offloads two pages more after its first ``half`` (its v1 bytes); D, which learns
    the user's current generation, offloads all of it with other bytes (v2); what a fresh
    host C then loads of the user, per page (:func:`_versions`)."""
    for cache, kv in zip(a.caches, a.kv_of(user), strict=True):
        cache[:USER_PAGES] = kv
    assert a.kv.offload(user, torch.arange(half + 2), (half + 2) * PAGE_SIZE).stored_tokens
    until(lambda: a.stats()["remote_blocks_held"] == 0)
    d = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        assert d.load(user) == (0, True)  # learns the new generation
        for cache, kv in zip(d.caches, d.kv_of(user + 1), strict=True):
            cache[:USER_PAGES] = kv
        assert d.kv.offload(user, torch.arange(USER_PAGES), TOKENS).stored_tokens == TOKENS
        until(lambda: d.stats()["remote_blocks_held"] == 0)
    finally:
        d.close()
    c = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        return _loaded_versions(c, user)
    finally:
        c.close()


def _loaded_versions(host: LocalHost, user: int) -> list[str]:
    """What the host's lookup of all of the user loads, per page (:func:`_versions`)."""
    target = torch.arange(host.caches[0].shape[0] - USER_PAGES, host.caches[0].shape[0])
    with host.kv.lookup(user, TOKENS) as hit:
        return _versions(host, user, host.kv.load(hit, target).loaded_tokens)


def test_an_evict_by_a_host_of_the_key_layout_before_the_boot_id_ends_the_key_here_too(
        mooncake: MooncakeServers) -> None:
    # The layout before blocks' keys named the boot id has the same markers under the
    # same root: during a rolling upgrade, an evict on a host still running it must end
    # the key for hosts of this layout too (keys.VERSION says why it stays).
    user = 1891
    a = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        a.offload_to_mooncake(user)
    finally:
        a.close()
    geometry = geometry_tag((LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM), torch.float32, PAGE_SIZE)
    bare = import_store().MooncakeDistributedStore()
    assert bare.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                      mooncake.master) == 0
    try:  # the old layout's evict of the user, as one of its hosts publishes it
        marker = f"aiokv1/{geometry}/{namespace_tag([f'uid:{user}'])}/evicted/0"
        assert bare.put(marker, b"1") == 0
    finally:
        close_woken(bare)
    c = LocalHost(mooncake.master, timeout_ms=SLOW_MS)
    try:
        assert c.load(user)[0] == 0
    finally:
        c.close()


def _offload_half(host: LocalHost, user: int, half: int) -> None:
    """``host`` offloads the first ``half`` pages of the user (v1), all of whose pages
    its caches then hold."""
    for cache, kv in zip(host.caches, host.kv_of(user), strict=True):
        cache[:USER_PAGES] = kv
    assert host.kv.offload(user, torch.arange(half), half * PAGE_SIZE).stored_tokens == (
        half * PAGE_SIZE)


def _evict_then_restart_then_put_v2(servers: MooncakeServers, user: int) -> None:
    """A host evicts the user (its marker out), the master restarts (forgetting that
    evict with every key), and another host offloads all of the user with other bytes
    (v2), written to Mooncake under the new master's first generation."""
    _evict_on_another_host(servers.master, user)
    servers.stop_master()
    servers.start_master()
    servers.wait_store_mounted()
    c = LocalHost(servers.master, timeout_ms=SLOW_MS)
    try:
        _put_v2(c, user)
    finally:
        c.close()


def _evict(host: LocalHost, user: int) -> None:
    """``host`` evicts the user, its marker out on Mooncake."""
    host.kv.evict(user)
    assert host.stats()["remote_invalidation_errors"] == 0


def _evict_on_another_host(master: str, user: int) -> None:
    """A host of its own evicts the user, its marker out on Mooncake, and closes."""
    host = LocalHost(master, timeout_ms=SLOW_MS)
    try:
        _evict(host, user)
    finally:
        host.close()


def _put_v2(host: LocalHost, user: int) -> None:
    """``host`` offloads all of the user with other bytes (v2: those of ``user + 1``),
    written to Mooncake."""
    for cache, kv in zip(host.caches, host.kv_of(user + 1), strict=True):
        cache[:USER_PAGES] = kv
    assert host.kv.offload(user, torch.arange(USER_PAGES), TOKENS).stored_tokens == TOKENS
    until(lambda: host.stats()["remote_blocks_written"] == USER_PAGES)


def test_a_host_never_joins_its_ssd_pages_from_before_a_master_restart_with_what_follows_it(
        tmp_path: Path) -> None:
    # B's SSD holds the first half of the user (v1) from an earlier run; A evicts the user,
    # then the master restarts, losing the evict's marker with every key. C offloads all of
    # the user with other bytes (v2): the new master's first generation, as for a key
    # never evicted. B, restarted, read v2's second half from Mooncake after its own v1
    # half: pages of no known view joined the first generation of a master that could no
    # longer tell of the evict that ended them.
    user, half = 1841, USER_PAGES // 2
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        b = LocalHost(servers.master, timeout_ms=SLOW_MS, ssd_dir=ssd)
        try:
            _offload_half(b, user, half)
            until(lambda: b.stats()["remote_blocks_held"] == 0)
        finally:
            b.close()
        _evict_then_restart_then_put_v2(servers, user)
        b = LocalHost(servers.master, timeout_ms=SLOW_MS, ssd_dir=ssd)
        try:
            target = torch.arange(b.caches[0].shape[0] - USER_PAGES, b.caches[0].shape[0])
            with b.kv.lookup(user, TOKENS) as hit:
                versions = _versions(b, user, b.kv.load(hit, target).loaded_tokens)
            read = b.stats()
        finally:
            b.close()
    assert versions == ["v1"] * half  # its own copies, none of v2 after them
    # Mooncake answered B's lookup, v2's half there: not a miss for want of an answer.
    assert (read["remote_lookups"], read["remote_timeouts"], read["remote_errors"]) == (1, 0, 0)


def test_a_write_offered_before_a_master_restart_never_serves_what_an_evict_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A's write of the user (v1) passed its checks and is in its put (held) when B evicts
    # the user; then the master restarts, losing the evict's marker with every key, and
    # both hosts see it. Put now, v1 landed under the key of the new master's first
    # generation: every host read bytes from before B's evict, and B's offload of the key
    # after it (v2) could not replace them (a put keeps the first value).
    user = 1861
    short_rests(monkeypatch)
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master)
        b = LocalHost(servers.master, timeout_ms=SLOW_MS)
        try:
            gate = held(monkeypatch, Values, "put")
            assert a.offload(user) == TOKENS
            assert gate.entered.wait(60), "the writer did not take the put"
            assert b.kv.evict(user) == 0  # B never had it: the marker ends it everywhere
            assert b.stats()["remote_invalidation_errors"] == 0  # its marker is out
            with caplog.at_level(logging.WARNING, logger="aiokv"):
                servers.stop_master()
                servers.start_master()
                servers.wait_store_mounted()
                until(lambda: sum("restarted" in r.getMessage() for r in caplog.records) == 2)
            gate.set()  # A's client is back: its put reaches the new master
            until(lambda: a.stats()["remote_blocks_held"] == 0)
            for cache, kv in zip(b.caches, b.kv_of(user + 1), strict=True):
                cache[:USER_PAGES] = kv
            assert b.kv.offload(user, torch.arange(USER_PAGES), TOKENS).stored_tokens == TOKENS
            until(lambda: b.stats()["remote_blocks_held"] == 0)
            c = LocalHost(servers.master, timeout_ms=SLOW_MS)
            try:
                target = torch.arange(c.caches[0].shape[0] - USER_PAGES, c.caches[0].shape[0])
                with c.kv.lookup(user, TOKENS) as hit:
                    versions = _versions(c, user, c.kv.load(hit, target).loaded_tokens)
            finally:
                c.close()
        finally:
            gate.set()
            b.close()
            stats = a.close()
    assert versions == ["v2"] * USER_PAGES
    # Not written where anyone reads it: dropped at the restart, as the queued ones are.
    assert (stats["remote_blocks_written"], stats["remote_dropped_down"]) == (0, USER_PAGES)


@pytest.mark.parametrize("next_run", [False, True], ids=["same_run", "next_run"])
def test_a_host_cut_off_before_it_reached_any_master_never_joins_what_it_put_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, next_run: bool) -> None:
    # B starts cut off from the master and puts the first half of the user (v1). A
    # evicts the user; the master restarts, forgetting that evict, and C offloads all of
    # it with other bytes (v2) under the new master's first generation. B then reaches
    # the master for the first time: its pages were taken as of that master's first
    # lifetime, and its lookup read v2's second half after its own v1 half, in this run
    # and (its SSD recording that master) in the next.
    user, half = 1871, USER_PAGES // 2
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cut_off_ms = SLOW_MS - 1  # B's, as the probe below tells hosts apart
    cut_off = threading.Event()
    cut_off.set()
    answers = remote_connection.master_answers

    def master_answers(config: Any) -> None:
        if cut_off.is_set() and config.timeout_ms == cut_off_ms:
            raise OSError("cut off from the master")
        answers(config)

    monkeypatch.setattr(remote_connection, "master_answers", master_answers)
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        b = LocalHost(servers.master, timeout_ms=cut_off_ms, ssd_dir=ssd)
        try:
            _offload_half(b, user, half)
            _evict_then_restart_then_put_v2(servers, user)
            cut_off.clear()
            # B reaches the master once its rest is over (a lookup of another user asks).
            until(lambda: b.load(user + 100) == (0, True)
                  and b.stats()["remote_lookup_waits"] > 0, timeout_s=60)
            if next_run:
                b.close()
                b = LocalHost(servers.master, timeout_ms=cut_off_ms, ssd_dir=ssd)
            target = torch.arange(b.caches[0].shape[0] - USER_PAGES, b.caches[0].shape[0])
            with b.kv.lookup(user, TOKENS) as hit:
                versions = _versions(b, user, b.kv.load(hit, target).loaded_tokens)
        finally:
            b.close()
    assert versions == ["v1"] * half  # its own copies, none of v2 after them



@pytest.mark.parametrize("seen", ["in_its_put", "after_its_put"])
def test_a_write_that_crossed_a_master_restart_is_removed_from_the_new_master(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        seen: str) -> None:
    # A's write of the user, offered under the master's boot id, lands in the master that
    # replaced it (restarted, every key lost) under the old boot id: no host reads it
    # there, and it took Mooncake's memory until the LRU came to it. A sees the restart
    # while the put is under way (in_its_put), or only once it landed (after_its_put):
    # either way A removes what is under the old boot id, and nothing under the new one.
    user, other = 1901, 1902
    keys = Keys(geometry_tag((LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM), torch.float32, PAGE_SIZE))
    digests = chain_digests(torch.arange(TOKENS).numpy(), PAGE_SIZE)
    short_rests(monkeypatch)
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        bare = _bare(servers.master)
        a = LocalHost(servers.master, timeout_ms=SLOW_MS)
        put = held(monkeypatch, Values, "put")
        # Seen after the put: A takes the old boot id for the master's until it landed.
        restart = held(monkeypatch, Keys, "restart", when=lambda *_: seen == "after_its_put")
        # The removal waits until A wrote under the new boot id: it must leave that alone.
        removal = held(monkeypatch, Remover, "_remove")
        try:
            assert a.offload(user) == TOKENS
            assert put.entered.wait(60), "the writer did not take the put"
            old_boot = bytes(bare.get(keys.boot_key())).decode()
            late = keys.blocks(old_boot, namespace_tag([f"uid:{user}"]), 0, 0, digests)
            close_woken(bare)  # a client of the old master does not answer for the new one
            with caplog.at_level(logging.WARNING, logger="aiokv"):
                servers.stop_master()
                servers.start_master()
                servers.wait_store_mounted()
                if seen == "after_its_put":
                    assert restart.entered.wait(60), "A did not see the boot id's key go"
                    put.set()
                    until(lambda: a.stats()["remote_blocks_held"] == 0)
                    restart.set()
                until(lambda: any("restarted" in r.getMessage() for r in caplog.records))
            put.set()
            until(lambda: a.stats()["remote_blocks_held"] == 0)
            bare = _bare(servers.master)
            assert all(code == 1 for code in bare.batch_is_exist(late)), "it did not land"
            until(lambda: bool(bytes(bare.get(keys.boot_key()))))  # the new master's id
            new_boot = bytes(bare.get(keys.boot_key())).decode()
            assert new_boot != old_boot
            written = a.stats()["remote_blocks_written"]
            assert a.offload(other) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == written + USER_PAGES)
            current = keys.blocks(new_boot, namespace_tag([f"uid:{other}"]), 0, 0, digests)
            assert all(code == 1 for code in bare.batch_is_exist(current))
            removal.set()
            until(lambda: not any(code == 1 for code in bare.batch_is_exist(late)))
            c = LocalHost(servers.master, timeout_ms=SLOW_MS)
            try:
                assert c.load(other) == (TOKENS, True)  # A's blocks of now, bit for bit
            finally:
                c.close()
        finally:
            put.set()
            restart.set()
            removal.set()
            stats = a.close()
            close_woken(bare)
    assert (stats["remote_removals_dropped"], stats["remote_remove_errors"]) == (0, 0)


def _bare(master: str) -> Any:
    """A Mooncake client of the test's own, to look at keys as they are."""
    bare = import_store().MooncakeDistributedStore()
    assert bare.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", master) == 0
    return bare
