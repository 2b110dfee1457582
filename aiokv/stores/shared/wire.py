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
A batch's matches and their answers travel as a few joined arrays
(:func:`pack_queries`, :func:`pack_answers`), not a mapping per query.
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
import numpy.typing as npt

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


class Channel:
    """The client's end: one request, then its reply, read with as few calls as the
    reply's size allows (one ``recvmsg`` for a small one)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """One message, with the descriptors that came with it. PeerGone when the
        connection closes, WireError for a frame out of bounds or malformed."""
        fds: list[int] = []
        data = bytearray(self._buffer)
        try:
            while len(data) < 4:
                chunk, got, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, MAX_FDS)
                fds += got
                if not chunk:
                    raise PeerGone("the peer closed the connection")
                data += chunk
            end = 4 + _length(data)
            have = len(data)
            if have < end:  # a large reply: the rest straight into its place
                data += bytes(end - have)
                view = memoryview(data)
                while have < end:
                    n = self.sock.recv_into(view[have:end])
                    if n == 0:
                        raise PeerGone("the peer closed the connection")
                    have += n
                view.release()
        except (ConnectionError, OSError) as exc:
            for fd in fds:
                close_quietly(fd)
            raise PeerGone(f"the connection broke: {exc}") from exc
        self._buffer = bytes(data[end:])
        return decode(bytes(data[4:end])), fds


def _length(data: bytes | bytearray) -> int:
    (length,) = struct.unpack_from("<I", data, 0)
    check_length(length)
    return int(length)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message from a blocking socket that carries nothing after it."""
    return Channel(sock).recv()


def check_length(length: int) -> None:
    if length < 4 or length > MAX_FRAME:
        raise WireError(f"frame of {length} bytes (at most {MAX_FRAME})")


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


# ---- a batch's matches: a few arrays, not a mapping per query --------------------------

MAX_QUERIES = 4096  # matches in one request
MAX_TOKENS = 1 << 26  # token ids in one request
MAX_NAMESPACE = 64  # strings in one namespace
Query = tuple[npt.NDArray[np.int64], tuple[str, ...]]
# Per query: (task id, mask, blocks), or (error, whether it is "no room now").
Answer = tuple[int, npt.NDArray[np.bool_], npt.NDArray[np.int64]] | tuple[str, bool]
_NO_IDS = np.zeros(0, dtype=np.int64)
_positions_bytes = b""
_positions = np.arange(0, dtype=np.int64)


def pack_queries(queries: Sequence[tuple[Any, Sequence[str]]]) -> dict[str, Any]:
    """``n``: per query, its count of default token ids (``0..n-1``, recognised by
    content and sent as the count) or -1; ``t``: the other queries' ids, joined, ``l``
    their lengths; ``ns``: the namespaces."""
    global _positions_bytes
    counts, lengths, explicit = [], [], []
    for token_ids, _ in queries:
        tokens = np.ascontiguousarray(token_ids, dtype=np.int64)
        n = len(tokens)
        if n and int(tokens[0]) == 0 and int(tokens[-1]) == n - 1:
            if len(_positions_bytes) < n * 8:
                _positions_bytes = np.arange(max(n, 1 << 16), dtype=np.int64).tobytes()
            if _positions_bytes.startswith(tokens.tobytes()):
                counts.append(n)
                continue
        counts.append(-1)
        lengths.append(n)
        explicit.append(tokens)
    return {"n": np.array(counts, dtype=np.int64), "l": np.array(lengths, dtype=np.int64),
            "t": np.concatenate(explicit) if explicit else _NO_IDS,
            "ns": [list(space) for _, space in queries]}


def unpack_queries(message: Mapping[str, Any]) -> list[Query]:
    """:func:`pack_queries` undone, every field checked (WireError)."""
    global _positions
    counts: Any = message.get("n")
    lengths: Any = message.get("l")
    tokens: Any = message.get("t")
    spaces: Any = message.get("ns")
    if not (_is_ids(counts) and _is_ids(lengths) and _is_ids(tokens)):
        raise WireError("n, l and t must be int64 arrays")
    if not isinstance(spaces, list) or len(spaces) != len(counts) or len(counts) > MAX_QUERIES:
        raise WireError(f"ns must list one namespace per query (at most {MAX_QUERIES})")
    if (counts < -1).any() or (counts > MAX_TOKENS).any() or (lengths < 0).any():
        raise WireError("a query's token count is out of range")
    if int((counts == -1).sum()) != len(lengths) or int(lengths.sum()) != len(tokens):
        raise WireError("l and t do not match the queries without a count")
    largest = int(counts.max(initial=0))
    if len(_positions) < largest:
        _positions = np.arange(max(largest, 2 * len(_positions)), dtype=np.int64)
    queries: list[Query] = []
    start, explicit = 0, iter(lengths.tolist())
    for count, space in zip(counts.tolist(), spaces, strict=True):
        if count >= 0:
            ids = _positions[:count]
        else:
            length = next(explicit)
            ids, start = tokens[start : start + length], start + length
        queries.append((ids, namespace(space)))
    return queries


def _is_ids(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.int64 and len(value) <= (
        MAX_TOKENS)


def namespace(raw: Any) -> tuple[str, ...]:
    """A namespace from a request (WireError unless it is a list of strings)."""
    if not isinstance(raw, list) or len(raw) > MAX_NAMESPACE or not all(
            isinstance(s, str) for s in raw):
        raise WireError(f"a namespace is a list of at most {MAX_NAMESPACE} strings")
    return tuple(raw)


def pack_answers(answers: Sequence[Answer]) -> dict[str, Any]:
    ids, mask_lengths, masks, block_counts, blocks = [], [], [], [], []
    errors: dict[str, Any] = {}
    for index, answer in enumerate(answers):
        if isinstance(answer[0], str):
            errors[str(index)] = list(answer)
            ids.append(0)
            mask_lengths.append(0)
            block_counts.append(0)
            continue
        task_id, mask, held = answer
        ids.append(task_id)
        mask_lengths.append(len(mask))
        masks.append(mask)
        block_counts.append(len(held))
        blocks.append(held)
    return {"ids": np.array(ids, dtype=np.int64),
            "ml": np.array(mask_lengths, dtype=np.int64),
            "m": np.concatenate(masks) if masks else np.zeros(0, dtype=np.bool_),
            "bl": np.array(block_counts, dtype=np.int64),
            "b": np.concatenate(blocks) if blocks else _NO_IDS, "e": errors}


def unpack_answers(message: Mapping[str, Any]) -> list[Answer]:
    ids, mask_lengths, masks, block_counts, blocks, errors = (
        message[k] for k in ("ids", "ml", "m", "bl", "b", "e"))
    out: list[Answer] = []
    mask_at = block_at = 0
    for index, (task_id, m, b) in enumerate(zip(ids.tolist(), mask_lengths.tolist(),
                                                block_counts.tolist(), strict=True)):
        error = errors.get(str(index))
        if error is not None:
            out.append((str(error[0]), bool(error[1])))
            continue
        out.append((task_id, masks[mask_at : mask_at + m].copy(),
                    blocks[block_at : block_at + b].copy()))
        mask_at, block_at = mask_at + m, block_at + b
    return out


def kernel_timeouts(sock: socket.socket, *, send_s: float = 0.0, recv_s: float = 0.0) -> None:
    """Bound a blocking socket's sends and receives in the kernel (SO_SNDTIMEO,
    SO_RCVTIMEO; 0: unbounded): an expired one raises BlockingIOError. Python's own
    ``settimeout`` polls before every call instead, which costs a system call a message."""
    for option, seconds in ((socket.SO_SNDTIMEO, send_s), (socket.SO_RCVTIMEO, recv_s)):
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, option,
                        struct.pack("ll", whole, int((seconds - whole) * 1e6)))

