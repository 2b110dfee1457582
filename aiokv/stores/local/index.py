"""The prefix index: chained block digests (:mod:`.digests`), one table per namespace, and
the LRU order of the blocks that may be evicted.

Namespaces are kept apart by structure, not by hashing: each namespace has its own table
(digest -> block), so two users can never read each other's blocks, whatever their tokens.

Everything here works on arrays of blocks at a time: per block, only C-level dict
operations (``update(zip(...))``, ``map(d.get, ...)``) and numpy indexing.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np

from ..base import Int64Array
from .pool import as_index


class Space(dict[bytes, int]):
    """One namespace's table: digest -> host block. Hashed and compared by identity (a
    table is one object), so that a set of tables costs no Python call per element."""

    __slots__ = ("key",)
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def __init__(self, key: tuple[str, ...]) -> None:
        super().__init__()
        self.key = key


class _Segment:
    """Blocks made evictable together. A block in it is still in the LRU while
    ``owner[block]`` is this segment's key; ``live`` counts those.

    ``blocks`` is cut in runs of ``width`` blocks, each run a sequence's blocks in order
    (first = most recent): the oldest-first order is each run reversed, runs in order.
    It is put in that order (``width`` 1) only when eviction or compaction needs it, so
    that making blocks evictable copies nothing. ``head`` then skips the positions that
    eviction already consumed."""

    __slots__ = ("blocks", "head", "live", "width")

    def __init__(self, blocks: Int64Array, width: int) -> None:
        self.blocks = blocks
        self.width = width
        self.head = 0
        self.live = len(blocks)

    def oldest_first(self) -> Int64Array:
        """The blocks not consumed yet, oldest first."""
        if self.width != 1:
            self.blocks = self.blocks.reshape(-1, self.width)[:, ::-1].reshape(-1)
            self.width = 1
        return self.blocks[self.head :]


class BlockIndex:
    """Per-namespace tables (digest -> host block), and the LRU order of the blocks that
    may be evicted.

    Only READY blocks with no reader are in the LRU; the tier moves blocks in and out.
    ``on_evict(blocks, spaces, digests)``, when given, sees the blocks eviction takes out
    of the LRU, with their keys, and answers those the index must keep (the tier's
    demotion hook: they are being copied to the tier below); it forgets the rest.
    The LRU is a queue of segments (one per ``make_evictable`` call, i.e. per task or per
    batch of tasks) plus a per-block array that says which segment, if any (0: none),
    holds a block now: moving a whole task in or out costs a few numpy operations, not a
    dict operation per block. Eviction walks the segments oldest first and is exact LRU.
    """

    def __init__(
        self,
        num_blocks: int = 0,
        on_evict: Callable[[Int64Array, list[Space], list[bytes]], Int64Array] | None = None,
    ) -> None:
        self._on_evict = on_evict
        self._spaces: dict[tuple[str, ...], Space] = {}
        self._count = 0
        # Reverse map, block -> (digest, table); stale for blocks not in the index.
        self._digest: list[bytes | None] = [None] * num_blocks
        self._space: list[Space | None] = [None] * num_blocks
        self._owner = np.zeros(num_blocks, dtype=np.int64)  # segment key; 0: not listed
        self._segments: OrderedDict[int, _Segment] = OrderedDict()  # oldest first
        self._next_segment = 1
        self._evictable = 0

    def __len__(self) -> int:
        return self._count

    # ---- tables --------------------------------------------------------------------

    def space(self, namespace: tuple[str, ...]) -> Space | None:
        return self._spaces.get(namespace)

    def spaces(self) -> list[Space]:
        return list(self._spaces.values())

    def key_of(self, block: int) -> tuple[Space | None, bytes | None]:
        """The (table, digest) of a block in the index (stale for others)."""
        return self._space[block], self._digest[block]

    def drop_idle(self, blocks: Int64Array) -> Int64Array:
        """Forget those of ``blocks`` (unique, in the index) that are in the LRU, as if
        evicted but without the hook; returns them. Blocks in use stay."""
        idle = self.make_unevictable(blocks)
        block_list = idle.tolist()
        spaces = list(map(self._space.__getitem__, block_list))
        digests = map(self._digest.__getitem__, block_list)
        deque(map(dict.pop, spaces, digests), maxlen=0)  # type: ignore[arg-type]
        self._count -= len(block_list)
        for space in set(spaces):
            if space is not None and not space and self._spaces.get(space.key) is space:
                del self._spaces[space.key]
        return idle

    def lookup(self, namespace: tuple[str, ...], digests: Sequence[bytes]) -> list[int | None]:
        space = self._spaces.get(namespace)
        if space is None:
            return [None] * len(digests)
        return list(map(space.get, digests))

    def insert(
        self, namespace: tuple[str, ...], digests: Sequence[bytes], blocks: Int64Array
    ) -> Space:
        """Add new digests (not in the table) for these blocks; returns the table.
        ``blocks`` as the pool hands them out: unique and ascending, or ascending with one
        wrap, so that ``last - first == n - 1`` means one run (see ``pool.as_index``)."""
        return self.insert_many([namespace], [digests], blocks)[0]

    def insert_many(
        self,
        namespaces: Sequence[tuple[str, ...]],
        digests: Sequence[Sequence[bytes]],
        blocks: Int64Array,
    ) -> list[Space]:
        """``insert`` of each namespace's digests in turn, their blocks one after another
        in ``blocks`` (one reservation, as ``insert`` takes it); returns the tables."""
        if sum(map(len, digests)) != len(blocks):
            raise ValueError(f"{sum(map(len, digests))} digests for {len(blocks)} blocks")
        block_list = blocks.tolist()
        tables: list[Space] = []
        at = 0
        for namespace, keys in zip(namespaces, digests, strict=True):
            space = self._spaces.get(namespace)
            if space is None:
                space = self._spaces[namespace] = Space(namespace)
            space.update(zip(keys, block_list[at : at + len(keys)], strict=True))
            at += len(keys)
            tables.append(space)
        self._count += at
        every = digests[0] if len(digests) == 1 else list(itertools.chain.from_iterable(digests))
        owners = itertools.chain.from_iterable(
            itertools.repeat(space, len(keys)) for space, keys in zip(tables, digests, strict=True)
        )
        run = as_index(blocks)
        if isinstance(run, slice):  # one ascending run
            self._digest[run] = every
            self._space[run] = owners
        else:
            deque(map(self._digest.__setitem__, block_list, every), maxlen=0)
            deque(map(self._space.__setitem__, block_list, owners), maxlen=0)
        return tables

    def remove(self, space: Space, digests: Sequence[bytes]) -> None:
        """Drop digests that are not in the LRU (a rolled back reservation)."""
        before = len(space)
        deque(map(space.pop, digests, itertools.repeat(None)), maxlen=0)
        self._count -= before - len(space)
        if not space and self._spaces.get(space.key) is space:
            del self._spaces[space.key]

    def detach(self, space: Space) -> None:
        """Take a table out of reach: lookups and inserts of its key find a new one from
        now on; its blocks stay indexed under it (the tier frees them with drop_idle)."""
        if self._spaces.get(space.key) is space:
            del self._spaces[space.key]

    # ---- LRU -----------------------------------------------------------------------

    @property
    def evictable(self) -> int:
        return self._evictable

    def make_evictable(self, blocks: Int64Array) -> None:
        """Add blocks (not in the LRU, unique) as most recently used. Pass a sequence's
        blocks in order: the first becomes the most recent, so tails are evicted before
        heads and prefixes survive longest."""
        self._append(blocks, len(blocks))

    def make_evictable_many(self, sequences: Sequence[Int64Array]) -> None:
        """``make_evictable`` of each sequence in turn (later ones more recent), in one
        segment. The blocks must be unique across all sequences."""
        if len(sequences) == 1:
            self._append(sequences[0], len(sequences[0]))
        elif sequences:
            self._append(np.concatenate([s[::-1] for s in sequences]), 1)

    def make_evictable_runs(self, blocks: Int64Array, size: int) -> None:
        """``make_evictable_many`` of ``blocks`` cut in sequences of ``size`` blocks."""
        if len(blocks) == 0:
            return
        if size <= 0 or len(blocks) % size:
            raise ValueError(f"{len(blocks)} blocks are not runs of {size}")
        self._append(blocks, size)

    def make_unevictable(self, blocks: Int64Array) -> Int64Array:
        """Take blocks (unique) out of the LRU; returns those that were in it, in order."""
        if len(blocks) == 0:
            return blocks
        owners = self._owner[blocks]
        if not owners.all():
            listed = owners != 0
            blocks, owners = blocks[listed], owners[listed]
            if len(blocks) == 0:
                return blocks
        self._owner[blocks] = 0
        self._evictable -= len(blocks)
        first = int(owners[0])
        if first == int(owners[-1]) and (owners == first).all():  # usual: one segment
            self._drop_live(first, len(blocks))
        else:
            cuts = (np.flatnonzero(owners[1:] != owners[:-1]) + 1).tolist()
            for start, end in zip([0, *cuts], [*cuts, len(blocks)], strict=True):
                self._drop_live(int(owners[start]), end - start)
        return blocks

    def evict(self, count: int) -> Int64Array:
        """Drop the ``count`` least recently used evictable blocks from the index; returns
        them, oldest first."""
        need = min(count, self._evictable)
        taken: list[Int64Array] = []
        segments, owner = self._segments, self._owner
        while need > 0:
            key, segment = next(iter(segments.items()))
            part = segment.oldest_first()
            # None: all still listed, the common case.
            positions = None if segment.live == len(part) else np.flatnonzero(owner[part] == key)
            if segment.live <= need:
                taken.append(part if positions is None else part[positions])
                need -= segment.live
                del segments[key]
                continue
            if positions is None:
                taken.append(part[:need])
                segment.head += need
            else:
                taken.append(part[positions[:need]])
                segment.head += int(positions[need - 1]) + 1
            segment.live -= need
            need = 0
        if not taken:
            return np.empty(0, dtype=np.int64)
        evicted = taken[0] if len(taken) == 1 else np.concatenate(taken)
        owner[evicted] = 0
        self._evictable -= len(evicted)
        block_list = evicted.tolist()
        spaces = list(map(self._space.__getitem__, block_list))
        digest_list = list(map(self._digest.__getitem__, block_list))
        if self._on_evict is not None:
            kept = self._on_evict(evicted, spaces, digest_list)  # type: ignore[arg-type]
            if len(kept):  # out of the LRU, still in the index
                gone = ~np.isin(evicted, kept)
                evicted = evicted[gone]
                spaces = [s for s, g in zip(spaces, gone, strict=True) if g]
                digest_list = [d for d, g in zip(digest_list, gone, strict=True) if g]
        self._count -= len(evicted)
        deque(map(dict.pop, spaces, digest_list), maxlen=0)  # type: ignore[arg-type]
        if not all(spaces):  # some namespace lost its last block
            for space in set(spaces):
                if space is not None and not space and self._spaces.get(space.key) is space:
                    del self._spaces[space.key]
        return evicted

    def make_evictable_oldest(self, blocks: Int64Array) -> None:
        """Add blocks (not in the LRU, unique) as the least recently used: next to go."""
        if len(blocks):
            self._append(blocks, len(blocks))
            self._segments.move_to_end(self._next_segment - 1, last=False)

    def oldest(self, count: int) -> Int64Array:
        """The ``count`` least recently used evictable blocks, oldest first, left listed."""
        taken: list[Int64Array] = []
        need = count
        for key, segment in self._segments.items():
            if need <= 0:
                break
            part = segment.oldest_first()
            listed = part if segment.live == len(part) else part[self._owner[part] == key]
            taken.append(listed[:need])
            need -= len(taken[-1])
        return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)

    def _append(self, blocks: Int64Array, width: int) -> None:
        if len(blocks) == 0:
            return
        key = self._next_segment
        self._next_segment += 1
        self._owner[blocks] = key
        self._segments[key] = _Segment(blocks, width)
        self._evictable += len(blocks)

    def _drop_live(self, key: int, count: int) -> None:
        segment = self._segments[key]
        segment.live -= count
        if segment.live == 0:
            del self._segments[key]
            return
        left = len(segment.blocks) - segment.head
        if left > 16 and segment.live * 4 < left:
            # Bound a segment's garbage (its blocks no longer listed in it).
            part = segment.oldest_first()
            segment.blocks, segment.head = part[self._owner[part] == key], 0
