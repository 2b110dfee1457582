"""An evict or clear on ``aiokv store-server`` as one embedded store would run it for
every engine: a get another engine holds and has not started to copy loads nothing, the
evict's answer waits for the loads of the key other engines have under way (up to a
bound, past which that engine is disconnected), no lookup after it finds the key, and
every block of it is freed once unused, on the host and on SSD, across a restart. Raw
``SharedStore`` engines on a server in this process (engines on ``open_engine``:
``test_shared_store.py``)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import failing_header_voids, held, slow_header_voids
from shared_host import PAGE_SIZE, user_kv
from shared_inprocess import (
    PAGES,
    TOKENS,
    Call,
    Host,
    host_fixture,  # noqa: F401  (the host fixture)
    lookup_reading,
    offload,
    on_ssd_only,
    wait_for,
)

import aiokv
from aiokv.copy.copier import Copier
from aiokv.errors import StoreError
from aiokv.stores.base import TaskResult, TaskStatus
from aiokv.stores.local import ssd_voids
from aiokv.stores.shared import SharedStore, sockets, wire
from aiokv.stores.shared import answers as answers_module
from aiokv.stores.shared.service import Service

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="the shared region needs memfd_create (Linux)")


def launch_load(store: SharedStore, tables: list[torch.Tensor], task: int) -> None:
    """The task's load into the last PAGES pages, zeroed first."""
    for cache in tables:
        cache.zero_()
    first = len(tables[0]) - PAGES
    store.launch([task], [torch.arange(first, first + PAGES)], [None])


def result(store: SharedStore, task: int) -> TaskResult:
    results: dict[int, TaskResult] = {}
    wait_for(lambda: results.update(store.try_wait([task])) or results, "the task's end")
    return results[task]


def loaded(tables: list[torch.Tensor], user: int) -> tuple[bool, bool]:
    """(the last PAGES pages hold the user's KV, they are still zero)."""
    first = len(tables[0]) - PAGES
    exact = all(torch.equal(cache[first:], kv)
                for cache, kv in zip(tables, user_kv(user, PAGES), strict=True))
    return exact, all(not cache[first:].any() for cache in tables)


def test_a_get_held_elsewhere_loads_nothing_and_no_lookup_finds_the_key(host: Host) -> None:
    writer, writer_tables = host.engine()
    holder, holder_tables = host.engine()
    try:
        offload(writer, writer_tables, 1)
        task, mask = holder.get_match(TOKENS, ["user:1"])
        assert mask.sum() == PAGES * PAGE_SIZE
        assert writer.evict(["user:1"]) == PAGES * PAGE_SIZE  # not waiting for the holder
        assert writer.get_match(TOKENS, ["user:1"])[1].sum() == 0
        again, again_mask = writer.put_match(TOKENS, ["user:1"])
        assert again_mask.all()  # written afresh, not found among the held blocks
        writer.cancel([again])
        stats = writer.store_stats()
        assert stats["host_blocks_used"] == PAGES  # the holder's, out of reach
        assert stats["server_gets_invalidated"] == 1

        launch_load(holder, holder_tables, task)
        got = result(holder, task)
        assert got.status is TaskStatus.SUCCESS and got.mask is not None
        assert not got.mask.any()  # loaded nothing ...
        assert loaded(holder_tables, 1) == (False, True)  # ... and copied nothing
        wait_for(lambda: writer.store_stats()["host_blocks_used"] == 0,
                 "the held blocks freed once given back")
    finally:
        writer.close()
        holder.close()


def test_an_evict_waits_for_a_load_of_the_key_under_way_elsewhere(host: Host) -> None:
    """As one engine runs it: a load already under way finishes first, with the KV as it
    was, then the evict answers."""
    writer, writer_tables = host.engine()
    reader, reader_tables = host.engine()
    try:
        offload(writer, writer_tables, 2)
        task, _ = reader.get_match(TOKENS, ["user:2"])
        launch_load(reader, reader_tables, task)  # copying; its end not reported yet
        evict = Call(lambda: writer.clear())
        # The clear at the server, its answer waiting (a clear that came only after the
        # load's end, as a fixed sleep allowed on a loaded host, waits for nothing).
        assert host.server is not None
        server = host.server
        wait_for(lambda: any(conn.evicting is not None for conn in server.peers()),
                 "the clear waiting at the server")
        evict.join(0.5)  # an answer sent all the same would reach it meanwhile
        assert evict.is_alive(), "the clear answered before a load under way ended"
        got = result(reader, task)
        assert got.status is TaskStatus.SUCCESS and got.mask is not None
        assert got.mask.sum() == PAGES * PAGE_SIZE
        assert loaded(reader_tables, 2) == (True, False)
        assert evict.outcome() == PAGES * PAGE_SIZE
        assert reader.get_match(TOKENS, ["user:2"])[1].sum() == 0
        assert writer.store_stats()["host_blocks_used"] == 0
    finally:
        writer.close()
        reader.close()


def test_an_engine_evicting_a_key_it_is_loading_gets_nothing_from_that_load(
        host: Host) -> None:
    store, tables = host.engine()
    try:
        offload(store, tables, 3)
        task, _ = store.get_match(TOKENS, ["user:3"])
        launch_load(store, tables, task)
        assert store.evict(["user:3"]) == PAGES * PAGE_SIZE  # no wait for its own load
        got = result(store, task)
        assert got.status is TaskStatus.SUCCESS and got.mask is not None
        assert not got.mask.any()
        wait_for(lambda: store.store_stats()["host_blocks_used"] == 0, "the blocks freed")
    finally:
        store.close()


def test_an_evict_stops_waiting_for_an_engine_that_never_ends_its_load(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(answers_module, "EVICT_WAIT_S", 0.5)
    writer, writer_tables = host.engine()
    stuck, stuck_tables = host.engine()
    try:
        offload(writer, writer_tables, 4)
        task, _ = stuck.get_match(TOKENS, ["user:4"])
        launch_load(stuck, stuck_tables, task)  # and never asks how it went
        assert writer.store_stats()["server_clients"] == 2
        assert Call(lambda: writer.evict(["user:4"])).outcome(10) == PAGES * PAGE_SIZE
        stats = writer.store_stats()
        assert stats["server_clients"] == 1  # the stuck engine was disconnected ...
        # ... what it read kept while its process lives (its copies may still run) ...
        assert stats["server_blocks_quarantined"] == stats["host_blocks_used"] == PAGES
        assert result(stuck, task).status is TaskStatus.FAILED
        stuck.ping()  # ... until a new link's hello says they ended
        wait_for(lambda: writer.store_stats()["host_blocks_used"] == 0, "the release")
    finally:
        writer.close()
        stuck.close()


def test_a_lookup_reading_from_ssd_when_its_key_is_evicted_loads_nothing(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its SSD slots, in use at the evict, are voided before the evict answers: the
    lookup, answered after, finds nothing, nothing counts as damage, and the key stays
    gone across a restart of the server."""
    gate = on_ssd_only(host, 5, monkeypatch)
    reader, _ = host.engine()
    other, _ = host.engine()
    try:
        lookup = lookup_reading(reader, 5, other)
        assert other.evict(["user:5"]) == PAGES * PAGE_SIZE
        gate.set()
        _, mask = lookup.outcome()
        assert mask.sum() == 0
        # (A get of the key before the gate opens would wait for the read in flight, up
        # to the server's bound on a staged read, 30 s: asked after it.)
        assert other.get_match(TOKENS, ["user:5"])[1].sum() == 0
        wait_for(lambda: other.store_stats()["ssd_blocks_used"] == 0, "the SSD slots freed")
        assert other.store_stats()["checksum_failures"] == 0
    finally:
        gate.set()
        reader.close()
        other.close()
    host.stop()
    host.start()
    fresh, _ = host.engine()
    try:
        assert fresh.get_match(TOKENS, ["user:5"])[1].sum() == 0
    finally:
        fresh.close()


def test_an_evict_answers_once_its_ssd_voids_are_written(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """So that a server killed right after (kill -9) does not find the key again at its
    restart: the slots' voided headers are on disk before the evict returns."""
    writer, tables = host.engine()
    try:
        offload(writer, tables, 6)
        wait_for(lambda: writer.store_stats()["bytes_ssd_written"] > 0, "the SSD copy")
        gate = held(monkeypatch, ssd_voids.HeaderVoids, "_void_one")
        evict = Call(lambda: writer.evict(["user:6"]))
        # Its voids under way (an evict not yet at the server after a fixed sleep, on a
        # loaded host, proved nothing), then time for an early answer to come.
        assert gate.entered.wait(30), "the evict wrote no SSD void"
        evict.join(0.5)
        assert evict.is_alive(), "the evict answered before its SSD voids were written"
        gate.set()
        assert evict.outcome() == PAGES * PAGE_SIZE
    finally:
        writer.close()
    host.stop()
    host.start()
    fresh, _ = host.engine()
    try:
        assert fresh.get_match(TOKENS, ["user:6"])[1].sum() == 0
    finally:
        fresh.close()


def restarted_finds(host: Host, user: int) -> int:
    """Tokens of ``user`` the server finds after a restart (a kill -9 there would be no
    kinder: the evict had answered)."""
    host.stop()
    host.start()
    fresh, _ = host.engine()
    try:
        return int(fresh.get_match(TOKENS, [f"user:{user}"])[1].sum())
    finally:
        fresh.close()


def test_an_evict_whose_ssd_voids_fail_keeps_the_key_out_of_a_restart(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses the writes that void the key's slot headers: the evict answers
    the tokens dropped all the same, and the server does not find the key at its
    restart (that file's headers are retired instead)."""
    writer, tables = host.engine()
    try:
        offload(writer, tables, 7)
        wait_for(lambda: writer.store_stats()["bytes_ssd_written"] > 0, "the SSD copy")
        failing_header_voids(monkeypatch)
        assert writer.evict(["user:7"]) == PAGES * PAGE_SIZE
    finally:
        writer.close()
    monkeypatch.undo()
    assert restarted_finds(host, 7) == 0


def test_an_evict_that_cannot_void_its_key_on_ssd_answers_a_store_error(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the header voids nor the meta file's new epoch can be written: the evict
    raises StoreError, saying so; evicting the key again once the disk is well voids
    what names it, and the restarted server does not find it."""
    writer, tables = host.engine()
    try:
        offload(writer, tables, 8)
        wait_for(lambda: writer.store_stats()["bytes_ssd_written"] > 0, "the SSD copy")
        failing_header_voids(monkeypatch, meta_too=True)
        with pytest.raises(StoreError, match="could not void"):
            writer.evict(["user:8"])
        assert writer.get_match(TOKENS, ["user:8"])[1].sum() == 0
        monkeypatch.undo()
        assert writer.evict(["user:8"]) == 0
    finally:
        writer.close()
    assert restarted_finds(host, 8) == 0


def test_an_evict_whose_ssd_voids_are_too_slow_answers_a_store_error(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk too slow to void the key's headers within the evict's wait: the evict
    raises StoreError, saying so, rather than answer as if a restart could not find
    the key; once the voids land, the restarted server does not."""
    monkeypatch.setattr(answers_module, "EVICT_WAIT_S", 0.3)
    writer, tables = host.engine()
    gate = threading.Event()
    try:
        offload(writer, tables, 8)
        wait_for(lambda: writer.store_stats()["bytes_ssd_written"] > 0, "the SSD copy")
        gate = slow_header_voids(monkeypatch)
        with pytest.raises(StoreError, match="not written in"):
            writer.evict(["user:8"])
        assert writer.get_match(TOKENS, ["user:8"])[1].sum() == 0
    finally:
        gate.set()
        writer.close()
    assert restarted_finds(host, 8) == 0


def test_a_put_under_way_when_its_key_is_evicted_is_never_written_to_ssd(host: Host) -> None:
    """Another engine's put of the key, matched before the evict and ended after it: its
    blocks are freed, never copied down under the dropped key (write_through), so no
    lookup after the evict finds the key, on the host or on SSD."""
    writer, tables = host.engine()
    other, _ = host.engine()
    try:
        for cache, kv in zip(tables, user_kv(9, PAGES), strict=True):
            cache[:PAGES] = kv
        task, mask = writer.put_match(TOKENS, ["user:9"])
        assert mask.all()
        other.evict(["user:9"])
        writer.launch([task], [torch.arange(PAGES)], [None])
        wait_for(lambda: writer.try_wait([task]), "the offload")
        # The put's blocks stay reserved until its end reaches the server.
        wait_for(lambda: other.store_stats()["host_blocks_used"] == 0, "the put's end")
        assert other.store_stats()["ssd_blocks_used"] == 0
        assert other.get_match(TOKENS, ["user:9"])[1].sum() == 0
    finally:
        writer.close()
        other.close()


@contextlib.contextmanager
def three_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[SharedStore, SharedStore, list[torch.Tensor], SharedStore, list[Any]]]:
    """A server whose evicts wait 0.5 s for other engines' loads, and engines W (user 1
    offloaded), X (its tables too) and Z on it; the gates put in the list are opened at
    the end, before the engines close."""
    monkeypatch.setattr(answers_module, "EVICT_WAIT_S", 0.5)
    host = Host(tmp_path, ssd=False)
    host.start()
    w, w_tables = host.engine()
    x, x_tables = host.engine()
    z, _ = host.engine()
    gates: list[Any] = []
    try:
        offload(w, w_tables, 1)
        yield w, x, x_tables, z, gates
    finally:
        for gate in gates:
            gate.set()
        for store in (x, z, w):
            store.close()
        host.stop()


def offload_the_region_over_twice(z: SharedStore, total: int, avoid: set[int]) -> None:
    """Z's puts of new keys, twice the region's blocks: none is given one of ``avoid``."""
    for user in range(3, 3 + 2 * total // PAGES):
        task, _ = z.put_match(TOKENS, [f"user:{user}"])
        assert not avoid & set(z._tasks[task].blocks.tolist())
        z.launch([task], [torch.arange(PAGES)], [None])
        wait_for(lambda task=task: z.try_wait([task]), "Z's offload")


def test_a_live_engine_dropped_mid_load_keeps_its_reads_until_its_copies_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # X's load of user 1 is still copying out of the region when W's evict of user 1 stops
    # waiting for it and the server drops X. Its get's blocks were freed at once (the
    # evict had buried them): another engine's put took them, and X's late copy read that
    # put's KV into X's pages, layer marks and all.
    with three_engines(tmp_path, monkeypatch) as (w, x, x_tables, z, gates):
        get, _ = x.get_match(TOKENS, ["user:1"])
        reading = set(x._tasks[get].blocks.tolist())
        copiers = list(x._link.plane._copiers)  # type: ignore[union-attr]
        gate = held(monkeypatch, Copier, "_move_cpu",
                    lambda copier, job: not job.to_host and copier in copiers)
        gates.append(gate)
        launch_load(x, x_tables, get)
        assert gate.entered.wait(10)  # X's copy out of the region is under way
        assert Call(lambda: w.evict(["user:1"])).outcome(10) == TOKENS.size
        assert w.store_stats()["server_clients"] == 2  # X dropped
        offload_the_region_over_twice(z, w.store_stats()["host_blocks_total"], reading)
        assert w.store_stats()["server_blocks_quarantined"] == PAGES
        gate.set()
        x.ping()  # X's copy over: a new link, whose hello says so
        wait_for(lambda: w.store_stats()["server_blocks_quarantined"] == 0, "the release")


def test_a_live_engine_dropped_mid_offload_keeps_its_blocks_until_its_copies_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # X is slow to end a load of user 1, which W evicts: past the evict's wait the server
    # drops X, whose offload of user 2 is still copying into its blocks. Given to another
    # engine's put, they would take X's late bytes under that engine's key.
    with three_engines(tmp_path, monkeypatch) as (w, x, _, z, gates):
        get, _ = x.get_match(TOKENS, ["user:1"])
        x.launch([get], [torch.arange(PAGES, 2 * PAGES)], [None])
        wait_for(lambda: x._done_jobs, "X's load copied (its end not sent)")
        copiers = list(x._link.plane._copiers)  # type: ignore[union-attr]
        gate = held(monkeypatch, Copier, "_move_cpu",
                    lambda copier, job: job.to_host and copier in copiers)
        gates.append(gate)
        put, _ = x.put_match(TOKENS, ["user:2"])
        kept = set(x._tasks[put].blocks.tolist())
        x.launch([put], [torch.arange(PAGES)], [None])
        assert gate.entered.wait(10)  # X's copy into the region is under way
        assert Call(lambda: w.evict(["user:1"])).outcome(10) == TOKENS.size
        stats = w.store_stats()
        assert stats["server_clients"] == 2  # X dropped
        offload_the_region_over_twice(z, stats["host_blocks_total"], kept)
        # Held while X's process (this one) lives: Z's connections, of the same
        # process, did not free them (its put's blocks, and its get's: its end unsent).
        assert w.store_stats()["server_blocks_quarantined"] == 2 * PAGES
        # X's copy over, its next call finds the link lost before its request left (it
        # joins its copy threads) and goes on a new link, whose hello says so: the
        # blocks are free again.
        gate.set()
        x.ping()
        stats = w.store_stats()
        assert stats["server_blocks_quarantined"] == 0
        assert stats["server_clients"] == 3


def test_gets_held_elsewhere_give_their_blocks_back_once_their_engine_is_told(
        host: Host) -> None:
    # As one store's held Lookups do at an evict: here once the engine has heard of it
    # (its next load asks), not at the gets' own end, which may be a TTL away.
    writer, writer_tables = host.engine()
    holder, holder_tables = host.engine()
    try:
        offload(writer, writer_tables, 1)
        offload(writer, writer_tables, 2)
        first, _ = holder.get_match(TOKENS, ["user:1"])
        second, _ = holder.get_match(TOKENS, ["user:2"])
        assert writer.clear() == 2 * PAGES * PAGE_SIZE
        assert writer.store_stats()["host_blocks_used"] == 2 * PAGES  # held, out of reach
        launch_load(holder, holder_tables, first)  # announces it, then hears of the clear
        assert not result(holder, first).mask.any()  # it loads nothing
        assert loaded(holder_tables, 1) == (False, True)
        # The second get, never launched, holds nothing from here on.
        wait_for(lambda: writer.store_stats()["host_blocks_used"] == 0, "the blocks back")
        holder.cancel([second])
        wait_for(lambda: writer.store_stats()["server_tasks_open"] == 0, "the gets' ends")
        assert writer.store_stats()["host_blocks_used"] == 0
    finally:
        holder.close()
        writer.close()


def test_an_idle_engines_held_lookups_give_their_blocks_back_after_an_evict(
        host: Host) -> None:
    # The engine holds its Lookups and does nothing else: it still hears of the clear,
    # and their blocks go back (they waited for its next call, or their TTL).
    writer, writer_tables = host.engine()
    holder = aiokv.run_in_background(aiokv.OffloadEngine(
        SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket))),
        [torch.zeros_like(t) for t in writer_tables],
        aiokv.EngineConfig(lookup_ttl_ms=600_000)))
    try:
        offload(writer, writer_tables, 1)
        held = holder.lookup(1, PAGES * PAGE_SIZE, token_ids=TOKENS, namespace=["user:1"])
        assert held.cached_tokens == PAGES * PAGE_SIZE
        assert writer.clear() == PAGES * PAGE_SIZE
        wait_for(lambda: writer.store_stats()["host_blocks_used"] == 0, "the blocks back")
        first = len(writer_tables[0]) - PAGES
        assert holder.load(held, torch.arange(first, first + PAGES)).loaded_tokens == 0
    finally:
        holder.close()
        writer.close()


def sent(monkeypatch: pytest.MonkeyPatch, picks: Callable[[bytes], bool]) -> threading.Event:
    """Set once an engine's request that ``picks`` is on its socket, where the server's
    next read of that connection finds it: a step of a race seen to have happened (a
    sleep only hoped it had, and a race not run passes its checks all the same)."""
    done = threading.Event()
    send = sockets.Channel.send

    def sending(channel: sockets.Channel, request: bytes) -> None:
        send(channel, request)
        if picks(bytes(request)):
            done.set()

    monkeypatch.setattr(sockets.Channel, "send", sending)
    return done


def op_of(request: bytes) -> int:
    return int(wire.HEAD.unpack_from(request)[1])


ASKS_WHICH_WERE_TAKEN = wire.encode_json({"op": "invalidated"})


def launch_before_the_taking_back(holder: SharedStore, tables: list[torch.Tensor], task: int,
                                  taking: Any, evicts: list[threading.Thread],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch the holder's get while the evict waits at ``taking`` (after its bump, before
    it takes the get back), then let it go: the get loads and copies nothing."""
    launched = sent(monkeypatch, lambda request: op_of(request) == wire.LAUNCH)
    launching = threading.Thread(target=launch_load, args=(holder, tables, task))
    launching.start()
    # The launch is out and reads its notice word, the evict still under way.
    assert launched.wait(10), "the holder's launch did not go out"
    taking.set()
    launching.join(10)
    for evict in evicts:
        evict.join(10)
    assert not result(holder, task).mask.any()
    assert loaded(tables, 1) == (False, True)  # and copied nothing


def test_a_check_answered_inside_an_evict_does_not_hide_it_from_the_next_load(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    # The holder asks which gets were taken back while the evict is between its notice
    # bump and its taking back: that answer covered the bump, so a load launched right
    # after read its word unchanged and copied a get the evict then took back.
    writer, writer_tables = host.engine()
    holder, holder_tables = host.engine()
    try:
        offload(writer, writer_tables, 1)
        task, _ = holder.get_match(TOKENS, ["user:1"])
        dropping = held(monkeypatch, Service, "evict")  # after the bump, before the drop
        taking = held(monkeypatch, Service, "invalidate")  # after the second read
        evict = threading.Thread(target=writer.evict, args=(["user:1"],))
        evict.start()
        assert dropping.entered.wait(10)
        question = sent(monkeypatch, lambda request: request == ASKS_WHICH_WERE_TAKEN)
        asking = threading.Thread(target=holder.check_held)
        asking.start()
        # Its question waits on the socket for the evict's second read.
        assert question.wait(10), "the holder did not ask"
        dropping.set()
        assert taking.entered.wait(10)
        asking.join(10)
        assert not asking.is_alive()  # answered by that read
        launch_before_the_taking_back(holder, holder_tables, task, taking, [evict],
                                      monkeypatch)
    finally:
        holder.close()
        writer.close()


def test_an_evict_nested_in_another_keeps_the_outer_bump_from_the_next_load(
        host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    # Evict E1 (user:1) bumped the holder's word and reads the engines' frames before
    # taking its gets back; one of them is another engine's evict E2 (user:2), run
    # inside. E2's end forgot E1's word from before the bump, so the holder's question,
    # answered after E2 still inside E1, covered E1's bump: a load launched then copied
    # the get E1 took back (the dropped KV in its pages, reported as nothing loaded).
    first, first_tables = host.engine()
    second, second_tables = host.engine()
    holder, holder_tables = host.engine()
    try:
        offload(first, first_tables, 1)
        offload(second, second_tables, 2)
        offload(first, first_tables, 3)
        task, _ = holder.get_match(TOKENS, ["user:1"])
        other, _ = holder.get_match(TOKENS, ["user:3"])
        outer = held(monkeypatch, Service, "evict", lambda self, ns: ns == ("user:1",))
        inner_taking = held(monkeypatch, Service, "invalidate",
                            lambda self, req, clients, ns: ns == ("user:2",))
        outer_taking = held(monkeypatch, Service, "invalidate",
                            lambda self, req, clients, ns: ns == ("user:1",))
        evict_1 = threading.Thread(target=first.evict, args=(["user:1"],))
        evict_1.start()
        assert outer.entered.wait(10)  # E1 bumped the holder's word
        inner = sent(monkeypatch, lambda request: op_of(request) == wire.JSON
                     and b'"evict"' in request and b"user:2" in request)
        evict_2 = threading.Thread(target=second.evict, args=(["user:2"],))
        evict_2.start()
        assert inner.wait(10), "E2 was not sent"  # E2's frame waits first
        # Then one of the holder's (it is among E1's peers): on its socket once cancel
        # returns (a frame with no reply).
        holder.cancel([other])
        outer.set()  # E1's second read runs E2 inside it
        assert inner_taking.entered.wait(10)
        question = sent(monkeypatch, lambda request: request == ASKS_WHICH_WERE_TAKEN)
        asking = threading.Thread(target=holder.check_held)
        asking.start()
        assert question.wait(10), "the holder did not ask"
        inner_taking.set()  # E2 ends; E1's read answers the holder's question
        asking.join(10)
        assert not asking.is_alive()
        assert outer_taking.entered.wait(10)  # E1 has not taken the get back yet
        launch_before_the_taking_back(holder, holder_tables, task, outer_taking,
                                      [evict_1, evict_2], monkeypatch)
    finally:
        holder.close()
        second.close()
        first.close()
