"""An engine's connection to ``aiokv store-server``: the hello that registers the cache
geometry and receives the shared region and the connection's notice word (memfds over the
socket), the region's mapping and its copy plane, and one call at a time (a request and
its reply).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

import torch

from ...copy.copier import CopyJob
from ...errors import ConfigError, StoreError
from . import sockets, wire
from .notice import Notice
from .plane import RegionPlane
from .region import Geometry, Region

CALL_TIMEOUT_S = 60.0
# A connect and its hello: a stopped server's listen backlog takes the connect, and only
# the hello's answer shows it does not serve (the client backs off after this).
HELLO_TIMEOUT_S = 5.0


class Link:
    """One connection to the server and the region it handed over."""

    def __init__(self, path: str, caches: Sequence[torch.Tensor], geometry: Geometry,
                 done: Callable[[CopyJob], None],
                 ended: Sequence[tuple[str, int]] = ()) -> None:
        """``ended``: this process's lost connections whose copies are over (the server
        frees the put blocks it held for them)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sockets.kernel_timeouts(sock, send_s=HELLO_TIMEOUT_S, recv_s=HELLO_TIMEOUT_S)
        try:
            sock.connect(path)
            sockets.send(sock, wire.encode_json({
                "op": "hello", "wire": wire.VERSION, "geometry": geometry.as_dict(),
                "ended": [list(e) for e in ended]}))
            reply, fds = sockets.recv_json(sock)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, (wire.PeerSilent, BlockingIOError)):  # connect or hello
                raise wire.PeerSilent(f"no answer to the hello within {HELLO_TIMEOUT_S:g} s "
                                      "(the server is stopped or wedged)") from exc
            raise
        if not reply.get("ok"):
            sock.close()
            error = str(reply.get("error"))
            if reply.get("config"):
                raise ConfigError("store.socket", f"the server at {path!r} refused: {error}")
            raise StoreError(f"the store server at {path!r} refused: {error}")
        if reply.get("wire") != wire.VERSION:  # a server of another aiokv version
            sock.close()
            for fd in fds:
                os.close(fd)
            raise ConfigError("store.socket", f"the server at {path!r} speaks wire version "
                              f"{reply.get('wire', 1)!r}, this engine {wire.VERSION}: run "
                              "one aiokv version for the server and its engines")
        if len(fds) != 2:
            sock.close()
            for fd in fds:
                os.close(fd)
            raise StoreError(f"the store server at {path!r} sent no region")
        # A server that stops answering (stopped, wedged) fails the call in flight after
        # this long, and the store thread goes on (the server's own waits are shorter).
        self.call_timeout_s = CALL_TIMEOUT_S
        sockets.kernel_timeouts(sock, send_s=CALL_TIMEOUT_S, recv_s=CALL_TIMEOUT_S)
        self.sock = sock
        self.channel = sockets.Channel(sock)
        named = reply.get("connection")  # [server, number]: how a later hello names it
        self.connection = (named[0], named[1]) if (
            isinstance(named, list) and len(named) == 2 and isinstance(named[0], str)
            and isinstance(named[1], int)) else None
        # The most tokens a query may ask of this server (what its tiers hold): it drops
        # a peer that asks more. Another server than the last one, restarted with smaller
        # tiers, may hold fewer than the engine's figures still say (None: not told).
        capacity = reply.get("capacity")
        self.max_tokens = capacity if type(capacity) is int and capacity > 0 else None
        try:
            stride = reply.get("stride")
            if stride is not None and type(stride) is not int:
                # Taken for back to back, it would map blocks off the server's.
                raise StoreError(f"the store server at {path!r} answered hello with a "
                                 f"stride of {stride!r}, not a number of bytes")
            try:
                self.region = Region(fds[0], int(reply["blocks"]), geometry, stride)
            except ValueError as exc:
                raise StoreError(f"the store server at {path!r} sent a region this engine "
                                 f"cannot map: {exc}") from exc
            self.notice = Notice(fds[1])
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:  # the mappings stay; a reconnect must not leak descriptors
                os.close(fd)
        self.region.fd = self.notice.fd = -1
        self.plane = RegionPlane(caches, self.region, done)

    def call(self, request: bytes, what: str, expect: int) -> memoryview:
        """One request and its reply's body (valid until the next call), which must be
        of op ``expect``; StoreError when the server refuses it, PeerSilent when it does
        not answer within CALL_TIMEOUT_S."""
        try:
            op, body = self.channel.call(request)
        except wire.PeerSilent as exc:
            raise wire.PeerSilent(f"no answer to {what!r} within {self.call_timeout_s:g} s "
                                  "(the server is stopped or wedged)") from exc
        if op == wire.JSON:
            reply = wire.decode_json(body)
            if not reply.get("ok"):
                raise StoreError(f"the store server refused {what!r}: {reply.get('error')}")
        if op != expect:
            raise wire.WireError(f"a reply of op {op} to {what!r} (expected {expect})")
        return body

    def send(self, request: bytes) -> None:
        """A request that gets no reply (a batch's end)."""
        self.channel.send(request)

    def close(self) -> None:
        """Finish the queued copies (their tasks end FAILED: the server rolls them back),
        unpin, then disconnect: a server that still has this connection does not give
        their blocks to another engine meanwhile."""
        self.plane.close()
        self.sock.close()
        # The region stays mapped while tensors view it; unmapped when they are gone.
