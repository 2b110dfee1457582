"""The SSD tier's LRU order across a clean restart: a sidecar file next to the meta file.

A slot header says when its block was written (its generation), not when it was last
read; ranking recovered blocks by generation alone made a restart evict first the block
read just before it, the most recently used one. So a clean close saves the order:
``recency.bin`` in the first directory, replaced atomically as the meta file is, lists
the (slot, generation) of every evictable slot, least recently used first, tagged with
each directory's epoch.

The open that finds the file removes it, durably, before the tier writes anything, so an
order serves only the open right after the close that saved it: after a kill -9 there is
none, and blocks rank by generation (the reads since the last open are not known then).
Even so, an order is applied only when it matches the headers exactly: as many
directories with the same epochs, and every pair names a slot whose recovered header
carries that generation (a generation is written once: a slot rewritten, voided or of a
cleared epoch since does not match). Anything else, a file torn, damaged or not aiokv's
among it, falls back to generation order and never stops the tier from opening: the
order chooses which block goes first, never what bytes a block holds. Recovered slots
the order does not list were not evictable at the close (a reader held them: in use as
the store stopped); they rank above every listed slot, the newest generation first.

Layout, little-endian: magic ``AIOKVLRU``, format (u32), directories (u32), pairs (u64);
the epochs (u64 each); the pairs (i64 slot, i64 generation, oldest first); an xxh3-64 of
everything before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..base import Int64Array
from .ssd_format import checksum, replace_durably, sync_directory

log = logging.getLogger("aiokv")

RECENCY_NAME = "recency.bin"
MAGIC = b"AIOKVLRU"
FORMAT = 1
_HEAD = struct.Struct("<8sIIQ")
_SUM = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class SavedOrder:
    epochs: tuple[int, ...]
    slots: Int64Array  # least recently used first
    generations: Int64Array  # of each slot's header


def save(directory: Path, epochs: Sequence[int], slots: Int64Array,
         generations: Int64Array) -> None:
    """Write the order (``slots`` oldest first, with their headers' generations) for
    the next open. OSError when the file cannot be written (the open then ranks by
    generation)."""
    pairs = np.empty((len(slots), 2), dtype="<i8")
    pairs[:, 0] = slots
    pairs[:, 1] = generations
    body = b"".join((
        _HEAD.pack(MAGIC, FORMAT, len(epochs), len(slots)),
        struct.pack(f"<{len(epochs)}Q", *epochs),
        pairs.tobytes(),
    ))
    replace_durably(directory, RECENCY_NAME, body + _SUM.pack(checksum(body)))


def take(directory: Path) -> SavedOrder | None:
    """The order a clean close saved, removed from disk (durably) before it is returned;
    None when there is none, or it is unreadable, or it cannot be removed (a crash after
    later writes must not find it)."""
    path = directory / RECENCY_NAME
    with contextlib.suppress(OSError):  # a save a crash cut short: never read
        os.unlink(directory / (RECENCY_NAME + ".tmp"))
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raw, reason = b"", f"unreadable: {exc!r}"
    else:
        reason = ""
    try:
        os.unlink(path)
        sync_directory(directory)
    except OSError as exc:
        log.warning("aiokv: cannot remove %s (%r); the SSD tier ranks its blocks by when "
                    "they were written", path, exc)
        return None
    saved = None
    if not reason:
        try:
            saved = _parse(raw)
        except (ValueError, struct.error) as exc:  # a file not ours: never stops an open
            reason = repr(exc)
    if saved is None:
        log.warning("aiokv: ignoring %s (%s); the SSD tier ranks its blocks by when they "
                    "were written", path, reason or "not a whole LRU order of aiokv's")
    return saved


def _parse(raw: bytes) -> SavedOrder | None:
    if len(raw) < _HEAD.size + _SUM.size:
        return None
    body, (stored,) = raw[: -_SUM.size], _SUM.unpack(raw[-_SUM.size :])
    if checksum(body) != stored:
        return None
    magic, fmt, dirs, count = _HEAD.unpack_from(body, 0)
    if magic != MAGIC or fmt != FORMAT or len(body) != _HEAD.size + 8 * dirs + 16 * count:
        return None
    epochs = struct.unpack_from(f"<{dirs}Q", body, _HEAD.size)
    pairs = np.frombuffer(body, dtype="<i8", offset=_HEAD.size + 8 * dirs).reshape(-1, 2)
    pairs = pairs.astype(np.int64)
    return SavedOrder(tuple(epochs), pairs[:, 0], pairs[:, 1])


def newest_first(saved: SavedOrder | None, epochs: Sequence[int], slots: Int64Array,
                 generations: Int64Array, total: int) -> Int64Array:
    """The recovered ``slots`` (their headers' ``generations``; ``total`` slots in the
    tier) most recently used first: by ``saved`` where it matches them exactly, by
    generation otherwise."""
    by_generation = slots[np.argsort(generations, kind="stable")[::-1]]
    if saved is None:
        return by_generation
    listed = saved.slots
    generation_of = np.full(total, -1, dtype=np.int64)  # -1: no recovered header
    generation_of[slots] = generations
    in_range = bool(((listed >= 0) & (listed < total)).all())
    if (
        saved.epochs != tuple(epochs)
        or not in_range
        or len(np.unique(listed)) != len(listed)
        or bool((saved.generations < 0).any())
        or not np.array_equal(generation_of[listed], saved.generations)
    ):
        log.info("aiokv: the SSD tier's saved LRU order does not match its blocks; they "
                 "rank by when they were written")
        return by_generation
    unlisted = by_generation[~np.isin(by_generation, listed)]
    return np.concatenate([unlisted, listed[::-1]])
