"""What crosses the UNIX socket between ``aiokv store-server`` and its engines.

A frame is ``u32 length | u32 header length | header | arrays``: the header is JSON (a
decoder that cannot run code, whatever a peer sends), and each array it carries is
written as ``{"a": [kind, offset, count]}`` into the bytes after it (``kind``: ``i`` int64,
``b`` bool). Frames are bounded (:data:`MAX_FRAME`): a peer that announces a larger one,
or sends one that does not decode to what the receiver expects, is a :class:`WireError`,
and the server then drops that peer alone.

Messages are mappings with an ``op``; every request gets exactly one reply, in order, on
the one connection (``{"ok": true, ...}`` or ``{"ok": false, "error": str}``). The first
reply of the server (to ``hello``) carries the region's file descriptor (SCM_RIGHTS).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MAX_FRAME = 256 << 20  # a batch of 64 x 64k tokens is 32 MiB of token ids: far below
MAX_FDS = 1
_HEAD = struct.Struct("<II")
_KINDS = {"i": np.dtype(np.int64), "b": np.dtype(np.bool_)}
_KIND_OF = {np.dtype(np.int64): "i", np.dtype(np.bool_): "b"}


class WireError(Exception):
    """A frame that is malformed, oversized or not the message expected."""


class PeerGone(Exception):
    """The connection closed (or broke) before a whole frame came."""


def encode(message: Mapping[str, Any]) -> bytes:
    """One frame. Numpy int64/bool arrays anywhere in ``message`` travel as raw bytes."""
    blobs: list[bytes] = []
    offset = 0

    def plain(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, np.ndarray):
            kind = _KIND_OF.get(value.dtype)
            if kind is None:
                value = value.astype(np.int64)
                kind = "i"
            raw = np.ascontiguousarray(value).tobytes()
            blobs.append(raw)
            ref = {"a": [kind, offset, len(value)]}
            offset += len(raw)
            return ref
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, np.integer):
            return int(value)
        return value

    header = json.dumps(plain(message), separators=(",", ":")).encode()
    body = b"".join(blobs)
    return _HEAD.pack(len(header) + len(body) + 4, len(header)) + header + body


def decode(frame: memoryview | bytes | bytearray) -> dict[str, Any]:
    """A frame's body (after its length word) back into a message; WireError if it is
    not one."""
    frame = memoryview(frame)
    if len(frame) < 4:
        raise WireError("frame shorter than its header")
    (header_len,) = struct.unpack_from("<I", frame, 0)
    if header_len > len(frame) - 4:
        raise WireError(f"header of {header_len} bytes in a frame of {len(frame)}")
    try:
        header = json.loads(bytes(frame[4 : 4 + header_len]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError(f"a message is a mapping, got {type(header).__name__}")
    data = frame[4 + header_len :]

    def arrays(value: Any) -> Any:
        if isinstance(value, dict):
            ref = value.get("a")
            if len(value) == 1 and isinstance(ref, list):
                return _array(ref, data)
            return {k: arrays(v) for k, v in value.items()}
        if isinstance(value, list):
            return [arrays(v) for v in value]
        return value

    try:
        result: dict[str, Any] = arrays(header)
    except RecursionError as exc:
        raise WireError("message nested too deep") from exc
    return result


def _array(ref: list[Any], data: memoryview) -> np.ndarray[Any, Any]:
    if len(ref) != 3 or ref[0] not in _KINDS or not all(type(x) is int for x in ref[1:]):
        raise WireError(f"bad array reference {ref!r}")
    dtype = _KINDS[ref[0]]
    start, count = ref[1], ref[2]
    end = start + count * dtype.itemsize
    if start < 0 or count < 0 or end > len(data):
        raise WireError(f"array [{start}, {end}) outside the {len(data)} bytes sent")
    return np.frombuffer(data[start:end], dtype=dtype)


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    frame = encode(message)
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _recv_exactly(sock: socket.socket, size: int, into: bytearray) -> None:
    view = memoryview(into)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise PeerGone("the peer closed the connection")
        got += n


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message from a blocking socket, with the descriptors that came with it.
    PeerGone when it closes, WireError for a frame out of bounds or malformed."""
    try:
        head, fds, _flags, _addr = socket.recv_fds(sock, 4, MAX_FDS)
    except (ConnectionError, OSError) as exc:
        raise PeerGone(f"the connection broke: {exc}") from exc
    if not head:
        raise PeerGone("the peer closed the connection")
    try:
        rest = bytearray(4 - len(head))
        if rest:
            _recv_exactly(sock, len(rest), rest)
        (length,) = struct.unpack("<I", bytes(head) + bytes(rest))
        check_length(length)
        body = bytearray(length)
        _recv_exactly(sock, length, body)
    except (ConnectionError, OSError) as exc:
        for fd in fds:
            close_quietly(fd)
        raise PeerGone(f"the connection broke: {exc}") from exc
    return decode(body), fds


def check_length(length: int) -> None:
    if length < 4 or length > MAX_FRAME:
        raise WireError(f"frame of {length} bytes (at most {MAX_FRAME})")


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
