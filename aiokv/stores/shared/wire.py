"""What crosses the UNIX socket between ``aiokv store-server`` and its engines.

A frame is ``u32 length | u32 op | body`` (``length`` counts the op and the body, so a
body starts 8-byte aligned). A batch's messages are binary, so that neither side builds
a Python object per field: ``PUT``/``GET`` (a batch's matches, :func:`encode_match`),
``ANSWERS`` (their replies, :func:`encode_answers`), ``END`` (tasks over,
:func:`encode_end`), ``LAUNCH`` (gets about to be copied, :func:`encode_launch`),
``PING`` and ``OK`` (empty). The rare messages (``hello``, ``evict``, ``clear``,
``stats``, ``invalidated``) and every refusal are a ``JSON`` frame holding a mapping (a
decoder that cannot run code, whatever a peer sends). Frames are bounded
(:data:`MAX_FRAME`); a peer that announces a larger one, or sends one that does not
decode to what the receiver expects, is a :class:`WireError`, and the server then drops
that peer alone.

Every request but ``END`` and ``LAUNCH`` gets exactly one reply, in order, on the one
connection; the first reply of the server (to ``hello``) carries the region's file
descriptor and the connection's notice word's (SCM_RIGHTS; :mod:`.notice`). ``END`` and
``LAUNCH`` get none: a batch's end costs its engine one send, not a round trip. What the
server owes an engine that reports a put done on that send (a lookup from any engine
after it sees the put) it keeps by reading every connection's waiting frames before it
answers a lookup (:meth:`~aiokv.stores.shared.server.StoreServer.absorb`). The
``hello`` names the wire's :data:`VERSION` both ways: an engine and a server of
different versions refuse each other, naming both.

A match request carries its batch's deadline (``by``: the engine's ``time.monotonic()``,
one clock for the host's processes; infinite without one), by which a get batch that
waits at the server (:mod:`.deferred`) is answered with what it has. Per query, it
carries its token count and either its page digests,
computed by the client (:func:`~aiokv.stores.local.digests.chain_digests`: a client is
trusted with the digests as it is with the bytes it writes under them), or none when its
token ids are the default positions, whose digests the server keeps; and its namespace
as UTF-8 strings. An answer carries, per query, the task id, the blocks and one bool per
page (True: the client copies that page), or a refusal and its message: no room now,
failed, or more new pages than the host tier has (the client raises NoSpace, StoreError,
TooLarge).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import StoreError
from ..base import NoSpace, TooLarge
from ..local.digests import DIGEST_BYTES, are_positions, chain_digests, position_digests

# 2: END is not answered; 3: LAUNCH and the notice word; 4: TOO_LARGE; 5: a match's "by";
# 6: hello's answer carries the region's "stride" (an engine of 5 maps blocks back to back,
# off the blocks of a server whose remote tier keeps a trailer after each)
VERSION = 6
MAX_FRAME = 256 << 20  # a batch of 64 x 64k tokens is 1 MiB of digests: far below
MAX_FDS = 2  # the region and the notice word
MAX_QUERIES = 4096  # matches in one request
MAX_TOKENS = 1 << 26  # tokens of one query
MAX_NAMESPACE = 64  # strings in one namespace
MAX_IDS = 1 << 20  # task ids in one request
MAX_ENDED = 64  # lost connections a hello names (their copies over: .quarantine)
# An answer holds a byte of mask and at most 8 bytes of block id per page asked about.
MAX_ANSWER_PAGES = MAX_FRAME // 9

JSON, PING, PUT, GET, END, OK, ANSWERS, LAUNCH = range(8)
HEAD = struct.Struct("<II")  # a frame's: length (op + body), op
# queries, released, digests, strings, name bytes, and the batch's deadline (by)
_MATCH_HEAD = struct.Struct("<5qd")
_ANSWER_HEAD = struct.Struct("<4q")  # queries, blocks, mask pages, error bytes
_END_HEAD = struct.Struct("<2q")  # done, failed
# An answer's id when the query got no task: no room now (the engine waits and asks
# again), failed, or more new pages than the host tier could ever take at once.
NO_SPACE, FAILED, TOO_LARGE = -1, -2, -3
_REFUSALS = (NO_SPACE, FAILED, TOO_LARGE)

Query = tuple[int, list[bytes], tuple[str, ...]]  # tokens asked, page digests, namespace
Refusal = tuple[str, int]  # why, and NO_SPACE, FAILED or TOO_LARGE
# Server side, per query: (task id, one bool per page, blocks), or a refusal.
Answer = tuple[int, npt.NDArray[np.bool_], npt.NDArray[np.int64]] | Refusal


class WireError(Exception):
    """A frame that is malformed, oversized or not the message expected."""


class PeerGone(Exception):
    """The connection closed (or broke) before a whole frame came."""


class PeerSilent(PeerGone):
    """The peer did not take or answer a frame within the socket's timeout: it is
    stopped or wedged (the connection is of no more use)."""


class NotSent(PeerGone):
    """The connection was broken before the whole request left (the peer had gone): the
    peer acted on none of it (it acts on whole frames only)."""

def frame(op: int, body: bytes = b"") -> bytes:
    return HEAD.pack(len(body) + 4, op) + body


def _pack_ints(values: Sequence[int]) -> bytes:
    return _ints(len(values)).pack(*values)


@functools.lru_cache(maxsize=256)
def _ints(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def check_length(length: int) -> None:
    if length < 4 or length > MAX_FRAME:
        raise WireError(f"frame of {length} bytes (at most {MAX_FRAME})")


# ---- the rare messages: JSON ------------------------------------------------------------


def encode_json(message: Mapping[str, Any]) -> bytes:
    return frame(JSON, json.dumps(message, separators=(",", ":")).encode())


def decode_json(body: memoryview | bytes) -> dict[str, Any]:
    """A JSON frame's body back into a mapping; WireError if it is not one."""
    try:
        message = json.loads(bytes(body))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise WireError(f"a message is a mapping, got {type(message).__name__}")
    return message


def namespace(raw: Any) -> tuple[str, ...]:
    """A namespace from a JSON request (WireError unless it is a list of strings)."""
    if not isinstance(raw, list) or len(raw) > MAX_NAMESPACE or not all(
            isinstance(s, str) for s in raw):
        raise WireError(f"a namespace is a list of at most {MAX_NAMESPACE} strings")
    return tuple(raw)


# ---- a batch's matches ------------------------------------------------------------------


def encode_match(op: int, queries: Sequence[tuple[Any, Sequence[str]]], page_size: int,
                 released: Sequence[int], by: float | None = None) -> bytes:
    """A ``PUT`` or ``GET`` frame: the queries' (token ids, namespace), the ids of tasks
    to end as failed first (cancels riding along with the next batch), and the batch's
    deadline ``by`` (time.monotonic(); None: none)."""
    tokens, digest_counts, string_counts, string_lengths = [], [], [], []
    digests: list[bytes] = []
    names: list[bytes] = []
    for token_ids, space in queries:
        n = len(token_ids)
        pages = n // page_size
        tokens.append(n)
        if pages and not are_positions(token_ids[: pages * page_size]):
            digests += chain_digests(np.asarray(token_ids), page_size)
            digest_counts.append(pages)
        else:
            digest_counts.append(0)
        string_counts.append(len(space))
        for name in space:
            raw = name.encode()
            string_lengths.append(len(raw))
            names.append(raw)
    name_bytes = b"".join(names)
    head = _MATCH_HEAD.pack(len(tokens), len(released), len(digests), len(string_lengths),
                            len(name_bytes), math.inf if by is None else by)
    ints = _pack_ints([*released, *tokens, *digest_counts, *string_counts, *string_lengths])
    return frame(op, b"".join((head, ints, *digests, name_bytes)))


@dataclass(slots=True)
class MatchRequest:
    queries: list[Query]
    released: list[int]
    by: float  # the batch's deadline (time.monotonic(); math.inf: none)


def decode_match(body: memoryview, page_size: int, max_tokens: int = MAX_TOKENS) -> MatchRequest:
    """:func:`encode_match`'s body undone, every field checked (WireError). A query of more
    than ``max_tokens`` tokens is refused: the server passes what its tiers hold, which a
    client never asks past (its hello's answer says it, as ``capacity``), and which bounds
    the default token ids' digests the server computes and keeps."""
    if len(body) < _MATCH_HEAD.size:
        raise WireError("a match request shorter than its header")
    count, released, digest_pages, strings, name_bytes, by = _MATCH_HEAD.unpack_from(body, 0)
    if math.isnan(by):
        raise WireError("a match request's deadline is not a number")
    if not (0 <= count <= MAX_QUERIES and 0 <= released <= MAX_IDS
            and 0 <= strings <= count * MAX_NAMESPACE and 0 <= digest_pages <= MAX_FRAME
            and 0 <= name_bytes <= MAX_FRAME):
        raise WireError("a match request's counts are out of range")
    ints = released + 3 * count + strings
    if len(body) != _MATCH_HEAD.size + 8 * ints + DIGEST_BYTES * digest_pages + name_bytes:
        raise WireError("a match request's length does not match its counts")
    # Python ints, checked in Python: for a batch's few dozen, cheaper than numpy's calls.
    values = _ints(ints).unpack_from(body, _MATCH_HEAD.size)
    tokens = values[released : released + count]
    digest_counts = values[released + count : released + 2 * count]
    string_counts = values[released + 2 * count : released + 3 * count]
    string_lengths = values[released + 3 * count :]
    if count and (min(tokens) < 0 or max(tokens) > MAX_TOKENS or min(digest_counts) < 0
                  or min(string_counts) < 0 or max(string_counts) > MAX_NAMESPACE):
        raise WireError("a query's token, digest or namespace count is out of range")
    if count and max(tokens) > max_tokens:
        raise WireError(f"a query of {max(tokens)} tokens; this store holds at most "
                        f"{max_tokens}")
    pages = sum(n // page_size for n in tokens) if count else 0
    if pages > MAX_ANSWER_PAGES:  # and what the server builds for them would be gigabytes
        raise WireError(f"a match request of {pages} pages: its answer would not fit a frame")
    if sum(digest_counts) != digest_pages or (digest_pages and any(
            d and d != n // page_size for d, n in zip(digest_counts, tokens, strict=True))):
        raise WireError("a query's digests do not match its full pages")
    if sum(string_counts) != strings or (strings and (
            min(string_lengths) < 0 or sum(string_lengths) != name_bytes)):
        raise WireError("the namespaces' lengths do not match their bytes")
    at = _MATCH_HEAD.size + 8 * ints
    digest_blob = bytes(body[at : at + DIGEST_BYTES * digest_pages])
    raw_names = bytes(body[at + DIGEST_BYTES * digest_pages :])
    # ASCII (the usual case): one decode, then cut the text at the byte offsets.
    text = raw_names.decode("ascii") if raw_names.isascii() else None
    names: str | bytes = raw_names if text is None else text
    bounds = [0, *itertools.accumulate(string_lengths)]
    positions = position_digests(page_size, max(
        (n for n, d in zip(tokens, digest_counts, strict=True) if not d), default=0)
        // page_size)  # the default token ids' digests, kept by the server
    queries: list[Query] = []
    digest_at = string_at = 0
    for n, pages, k in zip(tokens, digest_counts, string_counts, strict=True):
        if pages:
            end = digest_at + pages * DIGEST_BYTES
            digests = [digest_blob[i : i + DIGEST_BYTES]
                       for i in range(digest_at, end, DIGEST_BYTES)]
            digest_at = end
        else:
            digests = positions[: n // page_size]
        if text is not None and k == 1:
            space: tuple[str, ...] = (text[bounds[string_at] : bounds[string_at + 1]],)
        else:
            space = tuple(_text(names[bounds[j] : bounds[j + 1]])
                          for j in range(string_at, string_at + k))
        string_at += k
        queries.append((n, digests, space))
    return MatchRequest(queries, list(values[:released]), by)


def _text(part: str | bytes) -> str:
    if isinstance(part, str):
        return part
    try:
        return part.decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"a namespace is not UTF-8: {exc}") from exc


# ---- their answers ----------------------------------------------------------------------


def encode_answers(answers: Sequence[Answer]) -> bytes:
    """An ``ANSWERS`` frame: per query its task id (or NO_SPACE / FAILED / TOO_LARGE), its
    blocks and its page mask; the errors' messages as JSON after them."""
    ids, block_counts, mask_counts = [], [], []
    blocks: list[bytes] = []
    masks: list[bytes] = []
    errors: list[str] = []
    for answer in answers:
        if isinstance(answer[0], str):
            if answer[1] not in _REFUSALS:
                raise ValueError(f"a refusal is one of {_REFUSALS}, got {answer[1]!r}")
            ids.append(answer[1])
            block_counts.append(0)
            mask_counts.append(0)
            errors.append(answer[0])
            continue
        task_id, mask, held = answer
        ids.append(task_id)
        block_counts.append(len(held))
        mask_counts.append(len(mask))
        blocks.append(held.tobytes())
        masks.append(mask.tobytes())
    error_bytes = json.dumps(errors).encode() if errors else b""
    head = _ANSWER_HEAD.pack(len(ids), sum(block_counts), sum(mask_counts), len(error_bytes))
    return frame(ANSWERS, b"".join((head, _pack_ints([*ids, *block_counts, *mask_counts]),
                                    *blocks, *masks, error_bytes)))


# Client side, per query: (server task id, token mask, blocks), or what a refusal raises
# (NoSpace, StoreError, TooLarge: the Store contract's answers).
ClientAnswer = tuple[int, npt.NDArray[np.bool_], npt.NDArray[np.int64]] | Exception
_RAISES: dict[int, Callable[[str], Exception]] = {
    NO_SPACE: NoSpace, FAILED: StoreError, TOO_LARGE: TooLarge}


def decode_answers(body: memoryview, tokens: Sequence[int], page_size: int
                   ) -> list[ClientAnswer]:
    """:func:`encode_answers`'s body, for queries of ``tokens`` tokens each, into token
    masks (their trailing partial page False) and blocks; copies what it keeps."""
    if len(body) < _ANSWER_HEAD.size:
        raise WireError("answers shorter than their header")
    count, block_total, mask_total, error_bytes = _ANSWER_HEAD.unpack_from(body, 0)
    if count != len(tokens) or min(block_total, mask_total, error_bytes) < 0:
        raise WireError(f"{count} answers for {len(tokens)} queries")
    ints = 3 * count + block_total
    at = _ANSWER_HEAD.size + 8 * ints
    if len(body) != at + mask_total + error_bytes:
        raise WireError("answers' length does not match their counts")
    values = np.frombuffer(body, dtype=np.int64, count=ints, offset=_ANSWER_HEAD.size).copy()
    ids, block_counts = values[:count].tolist(), values[count : 2 * count].tolist()
    mask_counts = values[2 * count : 3 * count].tolist()
    blocks = values[3 * count :]
    page_masks = np.frombuffer(body, dtype=np.bool_, count=mask_total, offset=at)
    token_masks = page_masks.repeat(page_size)  # a new array: views of it are kept
    errors = iter(json.loads(bytes(body[at + mask_total :])) if error_bytes else [])
    out: list[ClientAnswer] = []
    block_at = mask_at = 0
    for task_id, b, m, n in zip(ids, block_counts, mask_counts, tokens, strict=True):
        if task_id < 0:
            if task_id not in _RAISES:
                raise WireError(f"an answer's id {task_id}")
            out.append(_RAISES[task_id](str(next(errors, ""))))
            continue
        if m != n // page_size:
            raise WireError(f"a mask of {m} pages for {n} tokens")
        full = m * page_size
        if full == n:
            mask = token_masks[mask_at : mask_at + full]
        else:
            mask = np.zeros(n, dtype=np.bool_)
            mask[:full] = token_masks[mask_at : mask_at + full]
        out.append((task_id, mask, blocks[block_at : block_at + b]))
        block_at, mask_at = block_at + b, mask_at + full
    return out


# ---- a batch's end ----------------------------------------------------------------------


def encode_end(done: Sequence[int], failed: Sequence[int]) -> bytes:
    return frame(END, _END_HEAD.pack(len(done), len(failed)) + _pack_ints([*done, *failed]))


def decode_end(body: memoryview) -> tuple[list[int], list[int]]:
    if len(body) < _END_HEAD.size:
        raise WireError("an end shorter than its header")
    done, failed = _END_HEAD.unpack_from(body, 0)
    if not (0 <= done <= MAX_IDS and 0 <= failed <= MAX_IDS) or len(body) != (
            _END_HEAD.size + 8 * (done + failed)):
        raise WireError("an end's length does not match its counts")
    ids = np.frombuffer(body, dtype=np.int64, offset=_END_HEAD.size).tolist()
    return ids[:done], ids[done:]


# ---- gets about to be copied ------------------------------------------------------------


def encode_launch(ids: Sequence[int]) -> bytes:
    """A ``LAUNCH`` frame: the server ids of gets whose copies start now (:mod:`.notice`)."""
    return frame(LAUNCH, _pack_ints(ids))


def decode_launch(body: memoryview) -> list[int]:
    if len(body) % 8 or len(body) > 8 * MAX_IDS:
        raise WireError(f"a launch of {len(body)} bytes is not a list of task ids")
    ids: list[int] = np.frombuffer(body, dtype=np.int64).tolist()
    return ids
