"""``aiokv store-server`` with engine processes on ``store.backend: shared`` (issue 31):
a real server process and spawned engine processes on CPU caches. What one process
offloads is a hit, bit for bit, in every other; two offloading one key at once write it
once; evict and clear act host-wide; a client killed while it holds blocks leaves the
server's figures as they were; an engine with other caches, and a second server on the
same socket, are refused naming why."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from shared_host import (
    PAGE_SIZE,
    Process,
    Server,
    caches,
    connect,
    hello,
    observer,
    running_host,
    start_processes,
    user_kv,
    wait_for,
)
from shared_inprocess import TOKENS, load_exact, offload

import aiokv
from aiokv.stores.base import TaskStatus
from aiokv.stores.shared import SharedStore, sockets, wire

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="the shared region needs memfd_create (Linux)")


Host = tuple[Server, list[Process]]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    with running_host(tmp_path_factory.mktemp("shared"), 3) as running:
        yield running


def test_a_key_offloaded_by_one_process_loads_bit_exact_in_every_other(host: Host) -> None:
    _, (first, second, third) = host
    assert first("offload", user=1, pages=8) == {"stored": 32, "cached": 32}
    for engine in (second, third):
        assert engine("load", user=1, pages=8) == {"cached": 32, "loaded": 32, "exact": True}


def test_two_processes_offloading_one_key_at_once_write_it_once(host: Host) -> None:
    _, (first, second, third) = host
    second.send("offload", user=2, pages=6, first_page=10)
    third.send("offload", user=2, pages=6, first_page=20)
    answers = [second.answer(), third.answer()]
    assert [a["cached"] for a in answers] == [24, 24]
    assert sum(a["stored"] for a in answers) == 24  # one wrote it, the other found it
    assert first("load", user=2, pages=6) == {"cached": 24, "loaded": 24, "exact": True}


def test_evict_and_clear_apply_to_every_process(host: Host) -> None:
    _, (first, second, third) = host
    first("offload", user=3, pages=3)
    assert second("evict", user=3) == {"dropped": 12}
    assert third("load", user=3, pages=3)["cached"] == 0
    first("offload", user=4, pages=2)
    third("offload", user=5, pages=2, first_page=30)
    assert second("clear")["dropped"] >= 16
    for user in (4, 5):
        assert first("load", user=user, pages=2)["cached"] == 0
    assert second("load", user=1, pages=8)["cached"] == 0  # earlier keys went too


def test_a_lookup_holds_its_blocks_at_the_server_against_other_processes(host: Host) -> None:
    _, (first, second, third) = host
    first("offload", user=9, pages=4)
    first("offload", user=19, pages=4, first_page=8)
    assert second("lookup", user=9, pages=4) == {"cached": 16}
    third("evict", user=19)  # another key's evict leaves it alone
    assert second("load_held", user=9, pages=4) == {"cached": 16, "loaded": 16, "exact": True}


def test_a_lookup_held_in_one_process_loads_nothing_after_an_evict_in_another(
        host: Host) -> None:
    """As in one engine: the key's KV is gone for every Lookup once the evict returns,
    those held elsewhere included (0 tokens, never the dropped KV)."""
    _, (first, second, third) = host
    for verb in ("evict", "clear"):
        first("offload", user=8, pages=4)
        assert second("lookup", user=8, pages=4) == {"cached": 16}
        assert third(verb, user=8) if verb == "evict" else third(verb)
        assert second("load_held", user=8, pages=4) == {"cached": 16, "loaded": 0,
                                                        "exact": True}
        assert first("load", user=8, pages=4)["cached"] == 0


def test_a_lookup_held_in_one_process_reads_evicted_once_another_evicts_its_key(
        host: Host) -> None:
    """As in one engine, the Lookup itself says so: once the evict (or clear) has
    returned in another process, it turns not held, evicted (cleared), with no call of
    its own engine; its load then loads 0 tokens and writes none of its pages."""
    _, (first, second, third) = host
    for verb, user in (("evict", 21), ("clear", 22)):
        first("offload", user=user, pages=4)
        assert second("lookup", user=user, pages=4) == {"cached": 16}
        assert second("held_state", user=user)["held"] is True
        assert third(verb, user=user) if verb == "evict" else third(verb)
        wait_for(lambda user=user: second("held_state", user=user)["held"] is False,
                 f"the Lookup held elsewhere to read not held after the {verb}")
        state = "evicted" if verb == "evict" else "cleared"
        assert f"state={state}" in second("held_state", user=user)["repr"]
        assert second("load_held", user=user, pages=4, fill=7.0) == {
            "cached": 16, "loaded": 0, "exact": True, "untouched": True}


def test_a_client_killed_while_holding_blocks_releases_them(host: Host) -> None:
    server, (first, _, _) = host
    first("offload", user=6, pages=5)
    figures, _ = observer(server.socket)
    try:
        idle = figures.store_stats()
        assert idle["server_tasks_open"] == 0
        (holder,) = start_processes(server.socket, 1, kind="holder")
        assert holder("hold", user=6, pages=5) == {"reserved": 20, "held": 20}
        busy = figures.store_stats()
        assert busy["server_blocks_held"] == 10
        assert busy["host_blocks_used"] == idle["host_blocks_used"] + 5
        holder.process.kill()  # SIGKILL: no goodbye
        holder.process.join()

        def back_to_idle() -> bool:
            stats = figures.store_stats()
            return all(stats[k] == idle[k] for k in
                       ("server_tasks_open", "server_blocks_held", "host_blocks_used"))

        wait_for(back_to_idle, "the server's figures back to their idle values")
        assert first("load", user=6, pages=5) == {"cached": 20, "loaded": 20, "exact": True}
    finally:
        figures.close()


def test_a_store_closed_by_a_process_that_lives_on_gives_back_what_it_matched(
        host: Host) -> None:
    # Matched and never launched: no copy can touch those blocks, so a clean close gives
    # them back rather than leave them held until this process exits.
    server, (first, _, _) = host
    assert first("offload", user=11, pages=4) == {"stored": 16, "cached": 16}
    figures, _ = observer(server.socket)
    try:
        idle = figures.store_stats()
        store, _ = observer(server.socket)
        _, put_mask = store.put_match(np.arange(16 * PAGE_SIZE, dtype=np.int64), ["closed"])
        _, get_mask = store.get_match(np.arange(4 * PAGE_SIZE, dtype=np.int64), ["uid:11"])
        assert (int(put_mask.sum()), int(get_mask.sum())) == (64, 16)
        busy = figures.store_stats()
        assert busy["host_blocks_used"] == idle["host_blocks_used"] + 16
        assert busy["server_blocks_held"] == 20
        store.close()
        wait_for(lambda: figures.store_stats()["server_clients"] == idle["server_clients"],
                 "the server has seen the close")
        after = figures.store_stats()
        names = ("host_blocks_used", "server_tasks_open", "server_blocks_held",
                 "server_blocks_quarantined")
        assert {k: after[k] for k in names} == {k: idle[k] for k in names}
        assert after["server_blocks_quarantined"] == 0
        assert first("load", user=11, pages=4) == {"cached": 16, "loaded": 16, "exact": True}
    finally:
        figures.close()


def test_caches_of_another_geometry_are_refused_naming_what_differs(host: Host) -> None:
    server, _ = host
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(server.socket)))
    with pytest.raises(aiokv.ConfigError, match="head_dim 16 != the server's 8"):
        store.register(caches(head_dim=16))


def test_a_second_server_on_the_same_socket_refuses(host: Host, tmp_path: Path) -> None:
    server, _ = host
    second = Server(tmp_path, socket_path=server.socket)
    code, log = second.run_here()
    assert code == 2
    assert f"in use by another aiokv store-server (pid {server.process.pid}" in log  # type: ignore[union-attr]


def test_raw_client_copies_bit_exact_through_the_region(host: Host) -> None:
    """The seam itself (launch with page ids): what one client puts, another gets."""
    server, _ = host
    (writer, written), (reader, read) = observer(server.socket), observer(server.socket)
    try:
        tokens = np.arange(100, 100 + 6 * PAGE_SIZE, dtype=np.int64)
        kv = user_kv(40, 6)
        put, mask = writer.put_match(tokens, ["raw"])
        assert mask.all()
        for cache, data in zip(written, kv, strict=True):
            cache[:6] = data
        writer.launch([put], [torch.arange(6)], [None])
        wait_for(lambda: writer.try_wait([put]), "the put's end")
        get, mask = reader.get_match(tokens, ["raw"])
        assert mask.sum() == 6 * PAGE_SIZE
        reader.launch([get], [torch.tensor([9, 3, 7, 1, 5, 0])], [None])
        wait_for(lambda: reader.try_wait([get]), "the get's end")
        order = [9, 3, 7, 1, 5, 0]
        for cache, data in zip(read, kv, strict=True):
            assert torch.equal(cache[order], data)
    finally:
        writer.close()
        reader.close()


def test_a_bad_page_id_fails_only_its_task_and_loads_mark_their_layers(host: Host) -> None:
    """The embedded store's data plane under the client: a page id outside the caches
    ends its own task INVALID with the embedded store's message, its batch-mate is
    copied; a get offers per-layer marks (base.MarksLayers), each layer ready once in
    place."""
    server, _ = host
    store, tables = observer(server.socket)
    local = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    local.register(caches())
    try:
        good_tokens = np.arange(500, 500 + 2 * PAGE_SIZE, dtype=np.int64)
        bad_tokens = np.arange(700, 700 + 2 * PAGE_SIZE, dtype=np.int64)
        good, _ = store.put_match(good_tokens, ["bad-ids"])
        bad, _ = store.put_match(bad_tokens, ["bad-ids"])
        local_bad, _ = local.put_match(bad_tokens, ["bad-ids"])
        kv = user_kv(41, 2)
        for cache, data in zip(tables, kv, strict=True):
            cache[:2] = data
        store.launch([good, bad], [torch.arange(2), torch.tensor([3, 9999])], [None, None])
        local.launch([local_bad], [torch.tensor([3, 9999])], [None])
        ends: dict[int, Any] = {}
        wait_for(lambda: ends.update(store.try_wait([good, bad])) or len(ends) == 2,
                 "both puts' ends")
        local_end: dict[int, Any] = {}
        wait_for(lambda: local_end.update(local.try_wait([local_bad])) or local_end,
                 "the local put's end")
        assert ends[good].status is TaskStatus.SUCCESS
        assert ends[bad].status is TaskStatus.INVALID
        assert "9999" in str(ends[bad].error)
        assert ends[bad].error == local_end[local_bad].error
        for cache in tables:
            cache.zero_()
        get, mask = store.get_match(good_tokens, ["bad-ids"])
        assert mask.sum() == 2 * PAGE_SIZE
        store.launch([get], [torch.tensor([5, 6])], [None])
        marks = store.layer_marks(get)
        assert marks is not None
        for layer, (cache, data) in enumerate(zip(tables, kv, strict=True)):
            marks.synchronize(layer)
            assert torch.equal(cache[5:7], data)
        wait_for(lambda: store.try_wait([get]), "the get's end")
    finally:
        store.close()
        local.close()


def test_namespaces_of_any_text_and_partial_pages_keep_their_keys(host: Host) -> None:
    """Non-ASCII namespaces, several strings, explicit token ids and a trailing partial
    page cross the wire as given: the same key hits in another client, a namespace that
    differs in one string does not, and the partial page is never stored."""
    server, _ = host
    (writer, _), (reader, _) = observer(server.socket), observer(server.socket)
    try:
        tokens = np.arange(900, 900 + 3 * PAGE_SIZE + 1, dtype=np.int64)
        key = ["ключ:7", "ü", ""]
        put, mask = writer.put_match(tokens, key)
        assert mask.tolist() == [True] * (3 * PAGE_SIZE) + [False]
        writer.launch([put], [torch.arange(3)], [None])
        wait_for(lambda: writer.try_wait([put]), "the put's end")
        for namespace, hit in ((key, 3 * PAGE_SIZE), (["ключ:7", "ü"], 0),
                               (["ключ:7", "u", ""], 0)):
            get, mask = reader.get_match(tokens, namespace)
            assert int(mask.sum()) == hit and len(mask) == len(tokens)
            reader.cancel([get])
    finally:
        writer.close()
        reader.close()


def aiokv_threads(besides: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("aiokv") and t not in besides)


@pytest.mark.asyncio
async def test_no_aiokv_thread_outlives_aclose_and_the_offloaded_bytes_load_elsewhere(
        tmp_path: Path) -> None:
    """On CPU caches an engine fills its page tables for the region on a thread
    (aiokv-map-region); over a region of 1 GiB that walk outlasts an offload and a close.
    The close stops it and waits for it, as for every aiokv thread (one left running
    took the process down at exit: SIGABRT), and what the engine offloaded before it
    closed loads bit for bit in an engine opened after."""
    server = Server(tmp_path, {"cpu_cache_gb": 1.0}).start()
    before = set(threading.enumerate())
    config = {"store": {"backend": "shared", "socket": str(server.socket)}}
    pages, tokens = 4, 4 * PAGE_SIZE
    try:
        writer = caches()
        for cache, kv in zip(writer, user_kv(1, pages), strict=True):
            cache[:pages] = kv
        async with aiokv.open_engine(config, kv_caches=writer) as engine:
            assert (await engine.offload(1, torch.arange(pages), tokens)).stored_tokens == tokens
        assert aiokv_threads(before) == []

        reader = caches()
        async with (aiokv.open_engine(config, kv_caches=reader) as engine,
                    await engine.lookup(1, tokens) as hit):
            loaded = await engine.load(hit, torch.arange(pages, 2 * pages))
        assert aiokv_threads(before) == []
        assert loaded.loaded_tokens == tokens
        assert all(torch.equal(cache[pages:2 * pages], kv)
                   for cache, kv in zip(reader, user_kv(1, pages), strict=True))
    finally:
        server.kill()


def test_a_batch_answers_each_match_as_if_alone(tmp_path: Path) -> None:
    """One message of several matches: a key twice in it is written once (the second
    finds the first's pages being written: no room yet, it matches again once they are
    in), and a batch that cannot have all its blocks at once gives them to its matches
    in order until one cannot have its own (NoSpace for that one)."""
    server = Server(tmp_path).start()
    store, _ = observer(server.socket)
    try:
        tokens = np.arange(3 * PAGE_SIZE, dtype=np.int64)
        first, twice, once = store.put_match_many([(tokens, ["twice"]), (tokens, ["twice"]),
                                                   (tokens, ["once"])])
        assert isinstance(twice, aiokv.stores.base.NoSpace)
        assert not isinstance(first, Exception) and first[1].all()
        assert not isinstance(once, Exception) and once[1].all()
        store.cancel([first[0], once[0]])
        pages = int(store.store_stats()["host_blocks_total"]) * 6 // 10
        big = np.arange(pages * PAGE_SIZE, dtype=np.int64)
        first, second = store.put_match_many([(big, ["big:1"]), (big, ["big:2"])])
        assert isinstance(second, aiokv.stores.base.NoSpace)
        assert not isinstance(first, Exception) and first[1].all()
        store.cancel([first[0]])
        assert store.store_stats()["host_blocks_used"] == 0
    finally:
        store.close()
        server.kill()


def test_sigterm_drains_and_exits_0(tmp_path: Path) -> None:
    server = Server(tmp_path).start()
    assert server.signal(signal.SIGTERM) == 0
    assert "stopped" in server.text()
    assert not server.socket.exists()


def test_a_sigterm_as_soon_as_the_server_listens_drains_it(tmp_path: Path) -> None:
    """The command's server (``start(handle_signals=True)``, main thread) has its
    handlers in before it says it listens: a SIGTERM right then drains it, exit as
    usual, rather than ending the process (the default action)."""
    import faulthandler

    from aiokv.stores.shared.server import StoreServer

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    server = StoreServer(tmp_path / "run" / "store.sock",
                         aiokv.StoreConfig(cpu_cache_gb=0.001), drain_timeout_s=5)
    try:
        server.start(handle_signals=True)
        os.kill(os.getpid(), signal.SIGTERM)  # this process's own handler runs here
        assert server.stopping
        server.serve()  # drains and returns
        assert not (tmp_path / "run" / "store.sock").exists()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        faulthandler.unregister(signal.SIGUSR1)


def test_sigusr1_logs_every_threads_stack_and_the_server_goes_on(tmp_path: Path) -> None:
    server = Server(tmp_path).start()
    assert server.process is not None
    try:
        server.process.send_signal(signal.SIGUSR1)
        wait_for(lambda: "in serve" in server.text(), "the serving thread's stack logged")
        assert "Current thread" in server.text() or "Thread 0x" in server.text()
        store, tables = observer(server.socket)
        try:
            offload(store, tables, 1)
            task, mask = store.get_match(TOKENS, ["user:1"])
            assert mask.all() and load_exact(store, tables, 1, task)
        finally:
            store.close()
    finally:
        server.kill()


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP delivered: it runs nothing more)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def reply(sock: socket.socket) -> tuple[int, bytes]:
    """One reply frame from ``sock``, and nothing after it: (op, body)."""
    length, op = wire.HEAD.unpack(sock.recv(wire.HEAD.size, socket.MSG_WAITALL))
    body = sock.recv(length - 4, socket.MSG_WAITALL) if length > 4 else b""
    return op, body


def test_a_put_reported_done_is_a_hit_for_a_lookup_made_after_it(tmp_path: Path) -> None:
    """A put's end gets no answer: an engine reports the put done once the end is sent.
    A lookup from another engine made after that finds it even when the server reads
    that engine's connection first. Here the server is stopped while B's ping, then
    A's end, then B's lookup arrive: on waking it lists B first (B was ready first) and
    reads the ping and the lookup together. It then goes on serving the others: A's
    connection, read before its turn came, does not hold it up when that turn comes."""
    server = Server(tmp_path).start()
    assert server.process is not None
    tokens = np.arange(3 * PAGE_SIZE, dtype=np.int64)
    try:
        with connect(server) as a, connect(server) as b, connect(server) as c:
            for sock in (a, b, c):
                hello(sock)
                # A server held up never answers; a loaded runner stalled one for 10 s.
                sock.settimeout(60)
            a_channel = sockets.Channel(a)
            op, body = a_channel.call(wire.encode_match(wire.PUT, [(tokens, ["after"])],
                                                        PAGE_SIZE, []))
            ((task, mask, _blocks),) = wire.decode_answers(body, [len(tokens)], PAGE_SIZE)
            assert op == wire.ANSWERS and mask.all()
            server.process.send_signal(signal.SIGSTOP)
            try:
                # Stopped before B's ping: a server still running could answer the ping
                # before A's end came, and the order under test would never arise.
                wait_for(lambda: stopped(server.process.pid),  # type: ignore[union-attr]
                         "the server stops")
                b.sendall(wire.frame(wire.PING))
                time.sleep(0.05)  # B's ping is in before A's end (not ordering our work)
                a_channel.send(wire.encode_end([task], []))  # A's put is done once sent
                time.sleep(0.05)
                b.sendall(wire.encode_match(wire.GET, [(tokens, ["after"])], PAGE_SIZE, []))
            finally:
                server.process.send_signal(signal.SIGCONT)
            assert reply(b)[0] == wire.OK  # the two replies may come in one read
            op, body = reply(b)
            ((_task, mask, blocks),) = wire.decode_answers(memoryview(body), [len(tokens)],
                                                           PAGE_SIZE)
            assert op == wire.ANSWERS
            assert mask.tolist() == [True] * len(tokens) and len(blocks) == 3
            assert sockets.Channel(c).call(wire.frame(wire.PING))[0] == wire.OK
    finally:
        server.kill()
