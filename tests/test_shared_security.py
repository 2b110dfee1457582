"""Who may talk to ``aiokv store-server`` and what a bad peer costs (issue 31.5): random,
truncated, oversized and malformed messages, and requests naming tasks the peer does
not hold, each get that peer disconnected and logged; afterwards a well-behaved client
is still served bit for bit. A peer of another uid is refused at connect."""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from shared_host import PAGE_SIZE, Server, caches, connect, hello, user_kv

import aiokv
from aiokv.stores.shared import SharedStore, sockets, wire
from aiokv.stores.shared import server as server_module
from aiokv.stores.shared.region import Geometry


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("fuzz")).start()
    yield running
    running.kill()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server hung up on ``sock`` (within 60 s: a loaded runner stalled a
    server for over 10 s; a peer kept is never hung up on), after draining its replies."""
    sock.settimeout(60)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def put(counts: tuple[int, ...], ints: tuple[int, ...], tail: bytes = b"",
        by: float = math.inf) -> bytes:
    """A PUT frame written by hand: its five counts (queries, released, digests, strings,
    name bytes), its deadline (none), its int64s, then digests and names."""
    return wire.frame(wire.PUT, struct.pack(f"<5qd{len(ints)}q", *counts, by, *ints) + tail)


def one_put(tokens: int, name: bytes = b"x") -> bytes:
    """A PUT of one query of ``tokens`` default token ids in namespace ``[name]``."""
    return put((1, 0, 0, 1, len(name)), (tokens, 0, 1, len(name)), name)


BAD_FRAMES = {
    "oversized": struct.pack("<II", wire.MAX_FRAME + 1, wire.JSON) + b"{}",
    "too short": struct.pack("<I", 2) + b"ab",
    "not json": wire.frame(wire.JSON, b"\xff\xfe{not json"),
    "not a mapping": wire.frame(wire.JSON, b"[1,2,3]"),
    "unknown op": wire.frame(99),
    "unknown json op": wire.encode_json({"op": "format_disk"}),
    "counts past the frame": put((5, 0, 0, 5, 5), (8,)),
    "negative count": one_put(-5),
    "too many tokens": one_put(wire.MAX_TOKENS + 1),
    "namespace not utf-8": one_put(8, b"\xff\xfe"),
    "digests not its pages": put((1, 0, 1, 1, 1), (64, 1, 1, 1), bytes(16) + b"x"),
    "names past their bytes": put((1, 0, 0, 1, 1), (8, 0, 1, 9), b"x"),
    "deadline not a number": put((1, 0, 0, 1, 1), (8, 0, 1, 1), b"x", by=math.nan),
    "foreign task": wire.encode_end([987654], []),
    "end past its ids": wire.frame(wire.END, struct.pack("<2q", 3, 0) + bytes(8)),
    "foreign launch": wire.encode_launch([987654]),
    "launch not ids": wire.frame(wire.LAUNCH, b"abc"),
    "deep nesting": wire.frame(wire.JSON, b'{"op":"evict","ns":' + b"[" * 5000 + b"]" * 5000
                               + b"}"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_a_bad_message_after_hello_disconnects_that_peer(server: Server, name: str) -> None:
    with connect(server) as sock:
        hello(sock)
        sock.sendall(BAD_FRAMES[name])
        assert closed_by_server(sock)


def test_a_hand_written_put_after_hello_is_answered(server: Server) -> None:
    """The frames above are refused for what is wrong in them: the same builder's
    well-formed request gets its answer (one task of 2 new pages)."""
    with connect(server) as sock:
        hello(sock)
        sock.sendall(one_put(2 * PAGE_SIZE + 1, b"hand-written"))
        op, body = sockets.Channel(sock).call(b"")
        assert op == wire.ANSWERS
        ((_task, mask, blocks),) = wire.decode_answers(body, [2 * PAGE_SIZE + 1], PAGE_SIZE)
        assert mask.tolist() == [True] * (2 * PAGE_SIZE) + [False]
        assert len(blocks) == 2


def test_a_query_longer_than_the_store_holds_disconnects_and_one_that_fits_is_answered(
    server: Server,
) -> None:
    """A client's engine never asks past what its store holds; a peer that does would make
    the server compute and keep that many default token ids' digests."""
    with connect(server) as sock:
        hello(sock)
        sockets.send(sock, wire.encode_json({"op": "stats"}))
        reply, _ = sockets.recv_json(sock)
        capacity = int(reply["stats"]["host_blocks_total"]) * PAGE_SIZE
        assert capacity > 0
        sock.sendall(one_put(capacity, b"fits"))
        op, _body = sockets.Channel(sock).call(b"")
        assert op == wire.ANSWERS
    with connect(server) as sock:
        hello(sock)
        sock.sendall(one_put(capacity + 1, b"too long"))
        assert closed_by_server(sock)


def test_requests_before_hello_and_bad_hellos_disconnect(server: Server) -> None:
    geometry = Geometry.of(caches()).as_dict()
    for request in (one_put(8), wire.encode_json({"op": "hello", "wire": wire.VERSION,
                                                  "geometry": {"layers": -1}}),
                    *(wire.encode_json({"op": "hello", "wire": wire.VERSION,
                                        "geometry": geometry, "ended": ended})
                      for ended in ("x", [["s", "1"]], [["s", 1, 2]], [[1, 1]],
                                    [["s", True]], [["s", 1]] * (wire.MAX_ENDED + 1)))):
        with connect(server) as sock:
            sockets.send(sock, request)
            assert closed_by_server(sock)


def test_an_engine_of_another_wire_version_is_told_both_and_disconnected(
        server: Server) -> None:
    geometry = Geometry.of(caches()).as_dict()
    for version in ({}, {"wire": wire.VERSION - 1}, {"wire": "2"}):
        with connect(server) as sock:
            sockets.send(sock, wire.encode_json({"op": "hello", "geometry": geometry,
                                                 **version}))
            reply, fds = sockets.recv_json(sock)
            assert fds == []
            assert reply["ok"] is False and reply["config"] is True
            assert f"wire version {version.get('wire', 1)!r}" in reply["error"]
            assert f"this server {wire.VERSION}" in reply["error"]
            assert closed_by_server(sock)


def test_an_engine_that_maps_the_region_without_its_stride_is_refused(server: Server) -> None:
    # An engine of wire 5 ignores hello's "stride": where the server's remote tier keeps a
    # trailer after each block, it would copy pages to and from the wrong bytes (an engine
    # of the release before did: the next one loaded what it offloaded, not bit-exact).
    geometry = Geometry.of(caches()).as_dict()
    with connect(server) as sock:
        sockets.send(sock, wire.encode_json({"op": "hello", "wire": 5, "geometry": geometry}))
        reply, fds = sockets.recv_json(sock)
        for fd in fds:
            os.close(fd)
        assert (reply["ok"], reply.get("config"), fds) == (False, True, [])
        assert "wire version 5" in reply["error"]
        assert closed_by_server(sock)


def test_a_server_of_another_wire_version_is_refused_by_the_engine(tmp_path: Path) -> None:
    """A server that answers hello without this engine's wire version (an older aiokv):
    register fails with ConfigError naming both, rather than misreading its replies."""
    path = tmp_path / "old.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def old_server() -> None:
        conn, _ = listener.accept()
        with conn:
            sockets.recv_json(conn)
            region = os.memfd_create("old-region")
            try:
                sockets.send(conn, wire.encode_json({"ok": True, "blocks": 4}), [region])
            finally:
                os.close(region)
            conn.recv(1)  # until the engine hangs up

    thread = threading.Thread(target=old_server)
    thread.start()
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(path)))
    try:
        with pytest.raises(aiokv.ConfigError, match=r"store\.socket.*wire version 1, this "
                                                     rf"engine {wire.VERSION}"):
            store.register(caches())
    finally:
        thread.join(10)
        listener.close()
        store.close()


BLOCK_BYTES = Geometry.of(caches()).block_bytes  # float32


@pytest.mark.parametrize("stride", [4160.0, "1088", True, BLOCK_BYTES + 2, -64, 1 << 62],
                         ids=["float", "string", "bool", "not whole floats", "negative",
                              "past the region"])
def test_a_hello_answer_with_a_bad_stride_fails_register_naming_it(
        tmp_path: Path, stride: object) -> None:
    """A foreign server's stride that this engine cannot map as the server's blocks
    fails register with StoreError naming it, rather than mapping blocks elsewhere (a
    float was taken for back to back, a stride of part of an element rounded down)."""
    path = tmp_path / "stride.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    blocks = 16

    def foreign_server() -> None:
        conn, _ = listener.accept()
        with conn:
            sockets.recv_json(conn)
            region, notice = os.memfd_create("region"), os.memfd_create("notice")
            try:
                os.ftruncate(region, blocks * (BLOCK_BYTES + 64))
                os.ftruncate(notice, 8)
                sockets.send(conn, wire.encode_json({"ok": True, "wire": wire.VERSION,
                                                     "blocks": blocks, "stride": stride,
                                                     "connection": ["foreign", 1]}),
                             [region, notice])
            finally:
                os.close(region)
                os.close(notice)
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                conn.recv(100)  # until the engine hangs up

    thread = threading.Thread(target=foreign_server, daemon=True)
    thread.start()
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(path)))
    try:
        with pytest.raises(aiokv.StoreError, match=rf"at '{path}'.* stride of {stride!r}"):
            store.register(caches())
    finally:
        store.close()
        thread.join(10)
        listener.close()


def test_a_server_gone_inside_a_replys_header_fails_the_call_at_once(tmp_path: Path) -> None:
    """A peer that dies after writing part of a reply's 8-byte header (killed inside its
    send): the call fails with StoreError, it does not spin holding the store's lock."""
    path = tmp_path / "half.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    blocks, geometry = 16, Geometry.of(caches())

    def dying_server() -> None:
        conn, _ = listener.accept()
        with conn:
            sockets.recv_json(conn)
            region, notice = os.memfd_create("region"), os.memfd_create("notice")
            try:
                os.ftruncate(region, blocks * geometry.block_bytes)
                os.ftruncate(notice, 8)
                sockets.send(conn, wire.encode_json({"ok": True, "wire": wire.VERSION,
                                                     "blocks": blocks,
                                                     "connection": ["half", 1]}),
                             [region, notice])
            finally:
                os.close(region)
                os.close(notice)
            conn.recv(100)  # the ping
            conn.sendall(wire.frame(wire.OK)[:4])  # half a header, then gone

    thread = threading.Thread(target=dying_server, daemon=True)
    thread.start()
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(path)))
    try:
        store.register(caches())
        outcome: list[BaseException | None] = []

        def ping() -> None:
            try:
                store.ping()
                outcome.append(None)
            except BaseException as exc:  # reported below
                outcome.append(exc)

        caller = threading.Thread(target=ping, daemon=True)
        caller.start()
        caller.join(10)
        assert outcome, "the call still ran 10 s after its server died"
        assert isinstance(outcome[0], aiokv.StoreError), outcome
        store.close()  # not while a call holds its lock: the assert above failed then
    finally:
        thread.join(10)
        listener.close()


def test_random_and_truncated_messages_then_a_client_is_served_bit_exact(server: Server) -> None:
    rng = random.Random(31)
    valid = wire.encode_match(wire.PUT, [(np.arange(7, 7 + 4 * PAGE_SIZE, dtype=np.int64),
                                          ["fuzz"])], PAGE_SIZE, [])
    for round_ in range(60):
        with connect(server) as sock:
            if round_ % 2:
                hello(sock)
            kind = round_ % 3
            if kind == 0:  # random bytes
                sock.sendall(rng.randbytes(rng.randrange(1, 4096)))
            elif kind == 1:  # a valid frame cut short, then the peer goes
                sock.sendall(valid[: rng.randrange(1, len(valid))])
                continue
            else:  # a valid frame with bytes flipped
                data = bytearray(valid)
                for _ in range(rng.randrange(1, 8)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
                sock.sendall(bytes(data))
            sock.shutdown(socket.SHUT_WR)
            closed_by_server(sock)
    assert "disconnected engine pid" in server.text()

    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(server.socket)))
    tables = caches()
    store.register(tables)
    try:
        tokens = np.arange(7, 7 + 5 * PAGE_SIZE, dtype=np.int64)
        kv = user_kv(77, 5)
        for cache, data in zip(tables, kv, strict=True):
            cache[:5] = data
        put, mask = store.put_match(tokens, ["well-behaved"])
        store.launch([put], [torch.arange(5)], [None])
        while not store.try_wait([put]):
            pass
        for cache in tables:
            cache.zero_()
        get, mask = store.get_match(tokens, ["well-behaved"])
        assert mask.sum() == 5 * PAGE_SIZE
        store.launch([get], [torch.arange(10, 15)], [None])
        results: dict[int, object] = {}
        while not results:
            results = store.try_wait([get])
        for cache, data in zip(tables, kv, strict=True):
            assert torch.equal(cache[10:15], data)
    finally:
        store.close()


def test_a_peer_of_another_uid_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """The server sees every peer as another uid than its own (SO_PEERCRED): it closes
    the connection at once and logs the peer."""
    running = server_module.StoreServer(tmp_path / "run" / "s.sock",
                                        aiokv.StoreConfig(cpu_cache_gb=0.001))
    running.start()
    thread = threading.Thread(target=running.serve, name="test-server")
    thread.start()
    try:
        real_uid = os.getuid()
        monkeypatch.setattr(server_module.os, "getuid", lambda: real_uid + 4242)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(running.path))
        with sock:
            assert closed_by_server(sock)
        assert f"of uid {real_uid} (serving uid {real_uid + 4242} only)" in caplog.text
    finally:
        monkeypatch.undo()
        running.stop()
        thread.join()
