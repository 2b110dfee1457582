"""Content keys of pages: a block's key is a 128-bit BLAKE2b digest of every token id from
the start of the sequence to the end of that block, so equal keys mean equal prefixes
(whatever host or process computed them). The chain of the default token ids (positions
``0..n-1``, the recommender case) is computed once per page size and reused.

Used by the prefix index (:mod:`.index`), the shared store's client and wire (a client
hashes, the server keeps the positions' chain) and the remote tier's keys. The embedded
store keeps each key's last chain (:class:`ChainMemo`): an offload and the lookups of the
same history, or of one grown since, hash only the pages that no earlier match of the key
covered.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict

import numpy as np

from ..base import Int64Array

DIGEST_BYTES = 16
# Keyed once; each key starts from a copy (cheaper than constructing with parameters).
_SEED = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"aiokv-tokens")


def _hash_chain(
    running: hashlib.blake2b, data: memoryview, block_bytes: int, digests: list[bytes]
) -> None:
    update, copy = running.update, running.copy  # bound once: the hot loop of hashing
    append = digests.append
    for start in range(0, len(data), block_bytes):
        update(data[start : start + block_bytes])
        append(copy().digest())


def _as_int64(tokens: Int64Array) -> Int64Array:
    if tokens.dtype != np.int64 or not tokens.flags.c_contiguous:
        return np.ascontiguousarray(tokens, dtype=np.int64)
    return tokens


class _PositionChain:
    """The digests of positions ``0..n-1`` for one page size, grown on demand. Replaced,
    never mutated, so readers on other threads always see a consistent pair."""

    __slots__ = ("digests", "running")

    def __init__(self, digests: list[bytes], running: hashlib.blake2b) -> None:
        self.digests = digests
        self.running = running  # the state after the last digest; copied, never updated


_position_chains: dict[int, _PositionChain] = {}
_position_bytes = b""  # positions 0..m-1 as native int64 bytes, grown on demand


def position_digests(page_size: int, pages: int) -> list[bytes]:
    """``chain_digests`` of the default token ids (positions) for ``pages`` pages, from a
    cache grown on demand (the list is shared: do not mutate it)."""
    chain = _position_chains.get(page_size)
    if chain is None or len(chain.digests) < pages:
        have = chain.digests if chain is not None else []
        want = max(pages, 2 * len(have), 4096 // page_size + 1)
        running = chain.running.copy() if chain is not None else _SEED.copy()
        tail = np.arange(len(have) * page_size, want * page_size, dtype=np.int64)
        grown = list(have)
        _hash_chain(running, memoryview(tail.data).cast("B"), page_size * 8, grown)
        chain = _PositionChain(grown, running)
        _position_chains[page_size] = chain
    return chain.digests[:pages]


def are_positions(head: Int64Array) -> bool:
    """True when ``head`` is ``0..len(head)-1``, by content: one comparison of the raw
    bytes (memcmp stops at the first difference), after two element checks only where
    the cached positions must grow first."""
    global _position_bytes
    n = len(head)
    if n * 8 > len(_position_bytes):
        if int(head[0]) != 0 or int(head[-1]) != n - 1:
            return False
        _position_bytes = (
            np.arange(max(n, len(_position_bytes) // 4, 1 << 16)).astype(np.int64).tobytes()
        )
    head = _as_int64(head)
    return _position_bytes.startswith(head)  # type: ignore[arg-type]  # buffer protocol


def _to_hash(token_ids: Int64Array, page_size: int) -> Int64Array | list[bytes]:
    """The full pages' token ids (int64) to hash, or their digests where they are known
    without hashing: none, or the default positions'."""
    full_pages = len(token_ids) // page_size
    if full_pages == 0:
        return []
    head = token_ids[: full_pages * page_size]
    if are_positions(head):
        return position_digests(page_size, full_pages)
    return _as_int64(head)


def chain_digests(token_ids: Int64Array, page_size: int) -> list[bytes]:
    """One digest per full page: digest ``i`` covers tokens ``[0, (i + 1) * page_size)``
    (not the namespace: see the module docstring). A running hash is copied per block,
    so the cost is linear in the tokens, not quadratic; the default token ids (positions)
    are recognised by content and answered from a cache."""
    head = _to_hash(token_ids, page_size)
    if isinstance(head, list):
        return head
    digests: list[bytes] = []
    _hash_chain(_SEED.copy(), memoryview(head.data).cast("B"), page_size * 8, digests)
    return digests


# The memory a ChainMemo holds at most (its keys, token bytes, digests and hash states):
# beyond it, the keys matched least recently are forgotten (hashed again when next
# matched).
MEMO_BYTES = 64 << 20


class _Chain:
    """One key's last chain: its full pages' token bytes, their digests, and the running
    hash after the last page (copied, never updated)."""

    __slots__ = ("data", "digests", "running")

    def __init__(self, data: bytes, digests: list[bytes], running: hashlib.blake2b) -> None:
        self.data = data
        self.digests = digests
        self.running = running


class ChainMemo:
    """``chain_digests`` per key (a namespace), remembering each key's last chain: tokens
    that repeat or cut it take its digests, tokens that extend it hash only the pages
    after it, anything else is hashed afresh and replaces it. Equal digests still mean
    equal prefixes: a chain is reused only where the token bytes are equal (compared, not
    hashed). One thread (the store's); about ``max_bytes`` of memory at most (keys, token
    bytes, digests, hash states), the least recently matched keys forgotten first."""

    def __init__(self, page_size: int, max_bytes: int = MEMO_BYTES) -> None:
        self._page_size = page_size
        self._max_bytes = max_bytes
        self._chains: OrderedDict[tuple[str, ...], _Chain] = OrderedDict()
        self._bytes = 0

    def digests(self, key: tuple[str, ...], token_ids: Int64Array) -> list[bytes]:
        """``chain_digests(token_ids, page_size)``; the list is the caller's."""
        page_size = self._page_size
        head = _to_hash(token_ids, page_size)
        if isinstance(head, list):
            return head
        full_pages = len(head) // page_size
        data = head.tobytes()
        chain = self._chains.get(key)
        if chain is not None:
            if len(data) <= len(chain.data):
                if chain.data.startswith(data):  # the same pages, or fewer
                    self._chains.move_to_end(key)
                    return chain.digests[:full_pages]
            elif data.startswith(chain.data):  # grown: hash the new pages alone
                running = chain.running.copy()
                digests = list(chain.digests)
                _hash_chain(running, memoryview(data)[len(chain.data) :], page_size * 8,
                            digests)
                self._keep(key, _Chain(data, digests, running))
                return digests[:]
        running = _SEED.copy()
        digests = []
        _hash_chain(running, memoryview(data), page_size * 8, digests)
        self._keep(key, _Chain(data, digests, running))
        return digests[:]

    def _keep(self, key: tuple[str, ...], chain: _Chain) -> None:
        old = self._chains.pop(key, None)
        if old is not None:
            self._bytes -= _size(key, old)
        size = _size(key, chain)
        if size > self._max_bytes:
            return
        self._chains[key] = chain
        self._bytes += size
        while self._bytes > self._max_bytes:
            dropped_key, dropped = self._chains.popitem(last=False)
            self._bytes -= _size(dropped_key, dropped)


# What a kept key costs beside its token bytes, digests and key strings (measured on
# CPython 3.11): the copied hash state (~460 bytes), the chain object, its digest list,
# the key's tuple and the ordered dict's entry. Each digest: a 32-byte bytes object and
# its list slot.
_PER_CHAIN = 1024
_PER_DIGEST = 81


def _size(key: tuple[str, ...], chain: _Chain) -> int:
    """What keeping ``chain`` under ``key`` holds in memory, about (never less)."""
    return (_PER_CHAIN + sys.getsizeof(chain.data) + _PER_DIGEST * len(chain.digests)
            + sum(map(sys.getsizeof, key)))
