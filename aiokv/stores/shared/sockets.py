"""Frames over a UNIX socket between ``aiokv store-server`` and its engines: sending one
(with the region's descriptor, for ``hello``'s answer), the client's request-and-reply
:class:`Channel`, reading the one JSON reply that carries descriptors, and kernel-side
send and receive timeouts. What a frame holds is :mod:`.wire`'s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from .wire import (
    HEAD,
    JSON,
    MAX_FDS,
    NotSent,
    PeerGone,
    PeerSilent,
    WireError,
    check_length,
    decode_json,
)

_BUFFER = 1 << 16  # a client's receive buffer: a batch's answers fit


def send(sock: socket.socket, data: bytes, fds: Sequence[int] = (),
         by: float | None = None) -> None:
    """``data`` (with ``fds``, as SCM_RIGHTS), whole; ``by``: the time.monotonic() by
    which it must be out (TimeoutError past it). The kernel's send timeout ends a send
    only when no byte moves for that long: a peer that reads a few bytes now and then
    would hold the sender for good without ``by``."""
    view = memoryview(data)
    if fds:
        view = view[socket.send_fds(sock, [data], list(fds)):]
    if by is None:
        sock.sendall(view)
        return
    while view:
        if time.monotonic() >= by:
            raise TimeoutError(f"the peer took {len(data) - len(view)} of {len(data)} "
                               "bytes in the time it had")
        view = view[sock.send(view):]


class Channel:
    """The client's end: one request, then its reply, read into one buffer kept for the
    connection (one ``recv_into`` for a reply that fits); or a request that has none."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray(_BUFFER)

    def send(self, request: bytes) -> None:
        """Send a request that gets no reply (``END``); NotSent when the connection
        broke."""
        try:
            self.sock.sendall(request)
        except BlockingIOError as exc:  # the kernel's send timeout: the peer takes nothing
            raise PeerSilent(f"the peer took no request: {exc}") from exc
        except (ConnectionError, OSError) as exc:
            raise NotSent(f"the connection broke: {exc}") from exc

    def call(self, request: bytes) -> tuple[int, memoryview]:
        """Send ``request``; its reply's (op, body). The body views this channel's buffer:
        valid until the next call. PeerGone when the connection closes or breaks
        (NotSent when it broke before the request left, PeerSilent when a kernel timeout
        passes first), WireError for a reply out of bounds."""
        if len(self._buffer) > _BUFFER:  # the last reply was a large one: not kept
            self._buffer = bytearray(_BUFFER)
        self.send(request)
        try:
            view = memoryview(self._buffer)
            have = self.sock.recv_into(view)
            while 0 < have < 8:
                n = self.sock.recv_into(view[have:])
                if n == 0:  # closed inside a header: else this would spin for ever
                    raise PeerGone("the peer closed the connection in a reply's header")
                have += n
            if have == 0:
                raise PeerGone("the peer closed the connection")
            length, op = HEAD.unpack_from(view, 0)
            check_length(length)
            end = 4 + length
            if end > len(self._buffer):  # a large reply: a buffer that holds it
                self._buffer = bytearray(end)
                self._buffer[:have] = view[:have]
                view = memoryview(self._buffer)
            while have < end:
                n = self.sock.recv_into(view[have:end])
                if n == 0:
                    raise PeerGone("the peer closed the connection")
                have += n
        except BlockingIOError as exc:  # a kernel timeout: the peer stopped answering
            raise PeerSilent(f"no answer: {exc}") from exc
        except (ConnectionError, OSError) as exc:
            raise PeerGone(f"the connection broke: {exc}") from exc
        if have != end:
            raise WireError(f"{have - end} bytes after a reply")
        return op, view[8:end]


def recv_json(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON message from a blocking socket that carries nothing after it, with the
    descriptors that came with it (the answer to ``hello``). PeerGone when the connection
    closes or breaks (PeerSilent when the socket's receive timeout passes first), WireError
    for a frame out of bounds or malformed."""
    fds: list[int] = []
    data = bytearray()
    try:
        while len(data) < 8 or len(data) < 4 + HEAD.unpack_from(data, 0)[0]:
            if len(data) >= 8:
                check_length(HEAD.unpack_from(data, 0)[0])
            chunk, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, MAX_FDS)
            fds += got
            if not chunk:
                raise PeerGone("the peer closed the connection")
            data += chunk
        length, op = HEAD.unpack_from(data, 0)
        check_length(length)
        if op != JSON or len(data) != 4 + length:
            raise WireError(f"expected one JSON reply, got op {op}")
        return decode_json(memoryview(data)[8:]), fds
    except BaseException as exc:
        for fd in fds:
            close_quietly(fd)
        if isinstance(exc, BlockingIOError):  # a kernel timeout
            raise PeerSilent(f"no answer: {exc}") from exc
        if isinstance(exc, OSError):
            raise PeerGone(f"the connection broke: {exc}") from exc
        raise


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def kernel_timeouts(sock: socket.socket, *, send_s: float = 0.0, recv_s: float = 0.0) -> None:
    """Bound a blocking socket's sends and receives in the kernel (SO_SNDTIMEO,
    SO_RCVTIMEO; 0: unbounded): an expired one raises BlockingIOError. Python's own
    ``settimeout`` polls before every call instead, which costs a system call a message."""
    for option, seconds in ((socket.SO_SNDTIMEO, send_s), (socket.SO_RCVTIMEO, recv_s)):
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, option,
                        struct.pack("ll", whole, int((seconds - whole) * 1e6)))
