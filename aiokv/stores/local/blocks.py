"""One tier's block states, readers and LRU eviction, whatever holds the bytes.

A tier is a set of numbered blocks (host blocks, SSD slots): an allocator, a prefix index
(digest -> block per namespace, and the LRU) and two arrays, ``state`` and ``readers``.

Block life: FREE -> WRITING (reserved: in the index but not readable; its bytes are on
their way from the GPU or from the tier below) -> READY (readable; in the LRU while it
has no reader) -> FREE (evicted, dropped, or rolled back). Invariant: a READY block that
is not in the LRU has at least one reader; a get task and a copy to the tier below (the
SSD write of write_through) are readers alike.

Eviction runs through the demotion hook ``demote(blocks, spaces, digests)``, called with
the LRU blocks eviction takes and their keys; it answers the blocks it keeps: it has
started copying them to the tier below, holding each as a reader, so they stay in the
index and readable, and come back to the LRU when the copy is done. The rest are
forgotten and freed. A tier with nothing below keeps none. ``clean`` marks blocks the tier
below has a copy of, which the link keeps ahead of eviction so that the hook rarely has
anything to write. Everything runs on the store thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..base import Int64Array, NoSpace
from .index import BlockIndex, Space
from .pool import BlockAllocator, as_index

# Plain ints: compared against numpy elements on the hot path, where an IntEnum costs a
# few microseconds a comparison.
FREE, WRITING, READY = 0, 1, 2

Demote = Callable[[Int64Array, list[Space], list[bytes]], Int64Array]

NO_BLOCKS: Int64Array = np.empty(0, dtype=np.int64)
NO_BLOCKS.flags.writeable = False


def _keep_none(blocks: Int64Array, spaces: list[Space], digests: list[bytes]) -> Int64Array:
    return NO_BLOCKS


class Tier:
    def __init__(self, name: str, alloc: BlockAllocator, demote: Demote | None = None,
                 forget: Callable[[Int64Array], None] | None = None) -> None:
        self.name = name
        self.alloc = alloc
        num_blocks = alloc.num_blocks
        self.state = np.zeros(num_blocks, dtype=np.int8)
        self.readers = np.zeros(num_blocks, dtype=np.int32)
        # Of those readers, the ones that let go by themselves: copies to the tier below
        # (SSD) and writes to the remote tier under way, whose end needs no caller
        # (room on its way: staging.LoadStaging.room_coming).
        self.passing = np.zeros(num_blocks, dtype=np.int32)
        # The tier below holds a copy (as far as this tier knows: it may have dropped it).
        self.clean = np.zeros(num_blocks, dtype=np.bool_)
        self._demote = demote or _keep_none
        self.index = BlockIndex(num_blocks, on_evict=self._demote)
        # Open get tasks that found a block already read by another; while none is open,
        # every read block of a get has exactly one reader.
        self.shared_gets = 0
        self.largest = 0  # the largest reservation asked for
        # Tables a drop took out of reach while some of their blocks were in use, and
        # what to tell of the blocks freed from them later (the SSD tier voids them).
        self.buried: list[Space] = []
        self._forget = forget

    @property
    def num_blocks(self) -> int:
        return self.alloc.num_blocks

    @property
    def used(self) -> int:
        """Blocks holding data or reserved (never one not pinned yet)."""
        return self.alloc.used

    def available(self) -> int:
        """Blocks a reserve could have now: free, or evictable."""
        return self.alloc.num_free + self.index.evictable

    def reserve(self, count: int) -> Int64Array:
        """``count`` blocks in state WRITING (not yet in the index). Raises NoSpace when
        they cannot all be had now; it may have started copies down that make room."""
        alloc = self.alloc
        self.largest = max(self.largest, count)
        if self.buried:  # never evict (nor copy down) a dropped key's block
            self.sweep()
        if count > alloc.num_free:
            # A pool still being pinned grows within moments: wait for it rather than
            # evicting what was just stored or answering "no space" at start-up.
            alloc.wait_for_free(count)
        if count > self.available():
            capacity = alloc.capacity
            size = (f"the {capacity} pinned (of {alloc.num_blocks}: pinning stopped short, "
                    "a memlock limit)" if capacity < alloc.num_blocks else str(capacity))
            raise NoSpace(
                f"{self.name}: need {count} blocks; {alloc.num_free} free, "
                f"{self.index.evictable} evictable of {size}"
            )
        if count > alloc.num_free:
            self.evict(count - alloc.num_free)
            if count > alloc.num_free:
                raise NoSpace(
                    f"{self.name}: need {count} blocks; {alloc.num_free} free, "
                    "the rest is being copied to the tier below or waits for room there "
                    "(retry when done)"
                )
        blocks = alloc.allocate(count)
        self.state[as_index(blocks)] = WRITING
        return blocks

    def evict(self, count: int) -> None:
        """Evict up to ``count`` LRU blocks: freed, or kept by the demotion hook."""
        if self.buried:
            self.sweep()
        evicted = self.index.evict(count)
        self.free(np.sort(evicted))  # LRU order is not block order (as_index)

    def free(self, blocks: Int64Array) -> None:
        """Blocks (sorted, unique, out of the index) go back to the allocator."""
        if len(blocks):
            index = as_index(blocks)
            self.state[index] = FREE
            self.readers[index] = 0
            self.clean[index] = False
            self.alloc.release(blocks)

    def roll_back(self, space: Space | None, digests: list[bytes], blocks: Int64Array) -> None:
        """A reservation that will never be READY: out of the index, free again."""
        self.roll_back_many([(space, digests)], blocks)

    def roll_back_many(
        self, keys: Sequence[tuple[Space | None, list[bytes]]], blocks: Int64Array
    ) -> None:
        """``roll_back`` of several reservations at once: ``keys`` their (table, digests),
        ``blocks`` all of their blocks (freed with one sort)."""
        for space, digests in keys:
            if space is not None:
                self.index.remove(space, digests)
        self.free(blocks if len(blocks) < 2 else np.sort(blocks))

    def hold(self, blocks: Int64Array) -> bool:
        """READY blocks (unique) gain a reader; True when some already had one."""
        self.readers[blocks] += 1
        return len(self.index.make_unevictable(blocks)) != len(blocks)

    def publish(self, per_task: list[Int64Array], blocks: Int64Array, size: int) -> None:
        """Finished puts' blocks (``blocks``: all of them, task after task; ``size``: the
        tasks' common block count, 0 when they differ) are READY and evictable, as
        make_evictable for each task in turn: tails first, later tasks more recent."""
        self.state[blocks] = READY
        self._list(per_task, blocks, size)
        if self.buried:
            self.sweep()

    def end_reads(
        self, per_task: list[Int64Array], shared: list[bool], blocks: Int64Array, size: int
    ) -> None:
        """Finished gets (arguments as ``publish``; ``shared`` per task, as ``hold``
        answered) drop their readers, exactly as one task after another."""
        if self.shared_gets:
            for task_blocks, was_shared in zip(per_task, shared, strict=True):
                self.drop_readers(task_blocks)
                self.shared_gets -= was_shared
            return
        # No open get shares a block with another: every block has this one reader.
        self.readers[blocks] = 0
        self._list(per_task, blocks, size)
        if self.buried:
            self.sweep()

    def _list(self, per_task: list[Int64Array], blocks: Int64Array, size: int) -> None:
        if size:
            self.index.make_evictable_runs(blocks, size)
        else:
            self.index.make_evictable_many(per_task)

    def drop_readers(self, blocks: Int64Array) -> None:
        """Blocks (unique) lose a reader; the unread READY ones go back to the LRU."""
        left = self.readers[blocks] - 1
        self.readers[blocks] = left
        back = blocks[(left == 0) & (self.state[blocks] == READY)]
        if len(back):
            self.index.make_evictable(back)
        if self.buried:
            self.sweep()

    def drop_idle(self, blocks: Int64Array) -> Int64Array:
        """Forget and free those of ``blocks`` (in the index) that nothing uses."""
        idle = self.index.drop_idle(blocks)
        self.free(np.sort(idle))
        return idle

    def drop_namespace(self, namespace: tuple[str, ...] | None) -> Int64Array:
        """Drop one namespace (None: every namespace) at once: ``drop_idle`` of its blocks,
        and its tables that still hold blocks in use (read, being written, or copied
        down) out of reach, so that no lookup finds them and a put of the key starts
        afresh; those blocks are forgotten and freed as they fall idle (:meth:`sweep`).
        Returns the blocks dropped now."""
        spaces = self.index.spaces() if namespace is None else [self.index.space(namespace)]
        dropped = [
            self.drop_idle(np.fromiter(space.values(), dtype=np.int64, count=len(space)))
            for space in spaces
            if space is not None
        ]
        for space in spaces:
            if space is not None and len(space):
                self.index.detach(space)
                self.buried.append(space)
        return np.concatenate(dropped) if dropped else NO_BLOCKS

    def sweep(self) -> None:
        """Forget and free the blocks of dropped tables that nothing uses now (their
        own calls do it; a caller that lists blocks past them calls it after)."""
        left = []
        for space in self.buried:
            freed = self.drop_idle(np.fromiter(space.values(), dtype=np.int64,
                                               count=len(space)))
            if len(freed) and self._forget is not None:
                self._forget(freed)
            if len(space):
                left.append(space)
        self.buried = left
