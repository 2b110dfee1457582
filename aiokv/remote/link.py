"""A store's side of the remote tier: what it holds for the writer, what a lookup that
misses the host tier fetches, and invalidation. Store thread only (the embedded store's,
or the store server's one thread).

The store calls these: :meth:`RemoteLink.expect` as a put starts (its namespace's markers
asked for meanwhile), :meth:`RemoteLink.offer` after its host copy (the blocks are
held as readers, so that eviction cannot reuse them while they are sent, and given back
in :meth:`drain`), a read at the start of a lookup (a miss in the host tier asks
Mooncake; what arrives whole becomes ordinary host blocks, and the lookup goes on as if
they had always been there: :meth:`fill` waits for it; the store server starts it and
polls it, :attr:`RemoteLink.reads`, while it answers other engines), :meth:`invalidate`
from evict and clear, and :meth:`drain` whenever it looks at finished work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import ConfigError
from ..stores.base import Int64Array
from ..stores.local.blocks import Tier
from ..stores.local.digests import chain_digests
from ..stores.local.ssd import SsdTier
from .client import RemoteIO
from .config import RemoteConfig
from .keys import Keys, geometry_tag, namespace_tag
from .lineage import SsdLineage
from .native import unavailable
from .queue import WriteJob
from .reads import Below, Published, Reader, Wanted
from .values import Layout
from .views import PageViews

# The tiers whose threads close left in a call (a master that stopped answering), with
# the memory those calls may still read into: kept for the life of the process.
_ABANDONED: list[tuple[RemoteIO, torch.Tensor]] = []


class BlockMemory(Protocol):
    """The host tier's memory as the tier reads and writes it: a private pool
    (:class:`~aiokv.stores.local.pool.HostPool`) or the store server's region."""

    num_blocks: int
    block_bytes: int
    block_stride: int  # bytes from one block to the next: room for a checksum after each
    data: torch.Tensor  # [block, *block shape]

    @property
    def raw(self) -> torch.Tensor: ...  # all blocks as one uint8 buffer

    def block_view(self, block: int) -> memoryview: ...


class RemoteLink:
    """The remote tier of one LocalStore; ConfigError (store.remote) where Mooncake's
    client cannot be loaded. ``ssd``: the SSD tier (None without one), as it opened:
    whether its pages from earlier runs may join reads from Mooncake (:mod:`.lineage`)."""

    def __init__(
        self,
        config: RemoteConfig,
        host: Tier,
        pool: BlockMemory,
        dtype: torch.dtype,
        page_size: int,
        wake: Callable[[], None],
        ssd: SsdTier | None = None,
    ) -> None:
        reason = unavailable()
        if reason is not None:
            raise ConfigError("store.remote", reason)
        self._host = host
        self._page_size = page_size
        self._timeout_s = config.timeout_ms / 1000
        block_shape = tuple(pool.data.shape[1:])
        memory = self._memory = pool.raw
        # Before the I/O: its first connect (on the reader thread) may learn the boot id.
        keys = self._keys = Keys(geometry_tag(block_shape, dtype, page_size))
        views = PageViews(keys)
        self._lineage = None if ssd is None else SsdLineage(
            ssd.files.paths[0], ssd.tier.alloc.num_free < ssd.tier.num_blocks)
        self._views = views
        self._ssd = ssd
        # Whether a put was offered before any boot id was learned (:meth:`offer`).
        self._offered_blind = False
        self.io = RemoteIO(
            config,
            keys,
            Layout(memory.data_ptr(), memory.numel(), pool.block_bytes, pool.block_stride,
                   pool.num_blocks),
            pool.block_view,
            wake,
            self._learned,
        )
        self._tags: dict[tuple[str, ...], str] = {}
        self.reads = Reader(self.io, host, self._tag, wake, views,
                            None if ssd is None else self._below)
        self._held = 0  # host blocks held by writes
        self.stats_ = {"remote_dropped_queue": 0, "remote_dropped_resting": 0}
        self._evicted = 0  # blocks not sent (or taken back) because this host evicted their key
        self._stale = 0  # blocks not sent: they extend pages of the key of another view

    def _learned(self, boot: str, lifetime: int, rested: bool) -> None:
        """The reader's or writer's thread: the master of ``lifetime`` is ``boot``
        (``rested``: the tier failed to reach a master before). The SSD's pages from
        earlier runs are of no known view: where they may be of another master (one
        that knew of evicts this one does not), none of no known view joins a read (the
        store thread sees it by its next read's answer, which follows). So are the puts
        offered before now where this host was cut off first: a master may have
        restarted meanwhile (an SSD that recorded this one before tells it did not)."""
        if lifetime != 0:
            return
        blind = self._offered_blind and rested
        lineage = self._lineage
        if not (lineage.joins(boot, blind) if lineage is not None else not blind):
            self._views.unknown = None
            if blind:
                self._keys.blind_lifetime = None

    def _tag(self, namespace: tuple[str, ...]) -> str:
        tag = self._tags.get(namespace)
        if tag is None:
            if len(self._tags) > 65536:
                self._tags.clear()
            tag = self._tags[namespace] = namespace_tag(namespace)
        return tag

    # ---- writes --------------------------------------------------------------------

    def offer(self, tasks: Sequence[Any]) -> None:
        """Puts whose host copy is done (their blocks READY, in the index): send their
        new blocks to Mooncake in the background, or drop them (counted) when the queue
        is full or the tier rests."""
        host, io = self._host, self.io
        for task in tasks:
            blocks, space = task.blocks, task.space
            # A key evicted while its put ran has its table out of reach: its blocks are
            # freed as they fall idle, and must not come back under the new generation.
            live = space is not None and host.index.space(space.key) is space
            if not len(blocks) or not live:
                continue
            tag = self._tag(space.key)
            if io.keys.boot is None:  # first: _learned reads it before the id is set
                self._offered_blind = True
            view = io.keys.offered_view(tag)
            # Its first pages were stored already, on the host or below (the SSD's are
            # not in the host tier's table).
            extends = _extends_stored(task.mask)
            if len(space) == len(blocks) and not extends and not self._below(space.key,
                                                                             task.digests):
                # Written or not, the key's pages are of what this host knows now (a
                # lookup must not join them with pages of another generation).
                self.reads.views.noted(space.key, view)
            if io.resting():
                self.stats_["remote_dropped_resting"] += len(blocks)
                continue
            if not io.keys.usable(tag):  # its evict's marker is not out yet
                self._evicted += len(blocks)
                continue
            if extends and not self._may_extend(space.key, view):
                # It extends pages of the key that are of another view (an evict,
                # clear or restart ended theirs since): under this one its pages would
                # follow other hosts' pages of this view, of the next version, and a
                # lookup would load two versions in one (reads never join them: views).
                self._stale += len(blocks)
                continue
            # Writes queued or under way hold their host blocks: at most half the tier
            # (the blocks it serves with: a tier pinned short has fewer), whatever
            # write_queue_blocks says, so that a Mooncake that stops answering leaves
            # offloads room (else they wait for it, then fail StoreFull). Not half of
            # what is pinned so far: at start-up that dropped the writes of offloads
            # made while the tier was still being pinned, never offered again. (Writes
            # held then, where pinning later stops short, can hold more than half of
            # it until they are written or fail.)
            if self._held + len(blocks) > max(1, host.alloc.capacity // 2):
                self.stats_["remote_dropped_queue"] += len(blocks)
                continue
            # Held first: once queued, the writer may read them at any moment.
            host.readers[blocks] += 1
            host.index.make_unevictable(blocks)
            if io.queue.put(WriteJob(tag, list(task.digests), blocks, view)):
                self._held += len(blocks)
                host.passing[blocks] += 1  # the write lets them go by itself
            else:
                host.drop_readers(blocks)
                self.stats_["remote_dropped_queue"] += len(blocks)

    def _below(self, key: tuple[str, ...], digests: Sequence[bytes] = ()) -> bool:
        """Whether this host holds pages of the key on its SSD only, but for ``digests``:
        of a view its puts of other pages never tell (an earlier run's, or of a
        generation that ended since they went below the host tier)."""
        ssd = self._ssd
        below = None if ssd is None else ssd.tier.index.space(key)
        if not below:
            return False
        mine = set(digests)
        return any(digest not in mine for digest in below)

    def _may_extend(self, key: tuple[str, ...], view: tuple[int, int, int]) -> bool:
        """Whether a put's new pages offered under ``view`` may extend this host's pages
        of the key: those are of that view (as a read's pages must be to join them).
        One offered of no known master is the writer's to drop."""
        seen = self._keys.seen(view)
        return seen is None or self._views.same(key, seen)

    def expect(self, namespace: Sequence[str]) -> None:
        """A put of the key reserved host blocks; its offer follows once they are
        copied. Where this host did not ask lately, the writer asks for the namespace's
        markers meanwhile: a host that never looked the key up would otherwise offer it
        under the generation another host's evict ended, dropped as stale. Learned
        before the offer, that evict came before the put's end, so its blocks may go
        under the next generation; learned after, they are dropped, as ever (nothing
        waits for the answer)."""
        io = self.io
        tag = self._tag(tuple(namespace))
        if not io.resting() and io.keys.usable(tag):
            io.expect(tag)

    def drain(self) -> None:
        """Give back the blocks of finished writes and of late reads that returned."""
        for blocks in self.io.queue.finished():
            self._give_back(blocks)
        self.reads.drain()

    def _give_back(self, blocks: Int64Array) -> None:
        self._held -= len(blocks)
        self._host.passing[blocks] -= 1
        self._host.drop_readers(blocks)

    # ---- reads ---------------------------------------------------------------------

    def fill(self, queries: Sequence[tuple[Int64Array, Sequence[str]]], below: Below = None
             ) -> None:
        """Bring the pages the host tier lacks, from each query's first missing one on,
        into host blocks where Mooncake has them, and wait for them (:mod:`.reads`): one
        read for all the queries, each of them asking for its own pages."""
        wanted: Wanted = [(tuple(namespace), chain_digests(token_ids, self._page_size))
                          for token_ids, namespace in queries]
        read = self.reads.start(wanted, below)
        if read is not None:
            self.reads.wait(read)

    # ---- invalidation ---------------------------------------------------------------

    def invalidate(self, namespace: tuple[str, ...] | None, wait: bool = True) -> Published:
        """Before the host tier drops a namespace (None: everything): queued writes of it
        are taken back, reads of it under way will bring nothing, and this host neither
        reads nor writes it on Mooncake until the marker that ends its generation (the
        epoch) is out: published on the reader thread (then a best-effort remove, on a
        thread nobody waits for), or, where the tier rests or its reader is stuck in a
        call, once it answers again.

        ``wait``: first wait for a write of it under way (so that its blocks are idle when
        the host tier drops the key), then for the marker, ``timeout_ms`` each at most.
        Else nothing blocks: the write's blocks are freed when it ends (the host tier
        buries what is in use), and the answer is set once the marker is out, or failed,
        or its ``timeout_ms`` is up."""
        io = self.io
        ns = None if namespace is None else self._tag(namespace)
        # Held while it waits for the write: the reader thread publishes markers not out
        # between its calls, and another evict's publish call those of every namespace.
        io.keys.unpublish(ns, held=wait)
        try:
            for blocks in io.queue.cancel(ns):
                self._give_back(blocks)
                self._evicted += len(blocks)  # dropped writes, as close counts those it takes
            self.reads.invalidated(namespace)
            self.reads.views.forget(namespace)
            if wait:
                # A write of the key still under way after this is no failure of the evict:
                # the host tier buries its blocks, and the marker (counted) ends what it puts.
                io.queue.wait_idle(self._timeout_s, ns)
        finally:
            if wait:
                io.keys.release(ns)
        self.drain()
        return self.reads.publish(wait)

    # ---- stats, close ----------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        io = self.io
        stats: dict[str, int | float] = {**self.stats_, **self.reads.stats_, **io.write_stats,
                                         **io.read_stats, **io.remove_stats}
        stats["remote_write_queue_blocks"] = io.queue.queued_blocks
        stats["remote_blocks_held"] = self._held  # host blocks waiting for their write
        stats["remote_lookups_open"] = self.reads.open_reads  # under way (store server)
        # Lookups' tokens read from Mooncake into the host tier (LocalStore.store_stats
        # takes them out of host_hit_tokens: each hit is counted on one tier).
        stats["remote_hit_tokens"] = stats["remote_blocks_read"] * self._page_size
        stats["remote_dropped_evicted"] += self._evicted
        stats["remote_dropped_stale"] += self._stale
        stats["remote_dropped_down"] += io.dropped_at_restart
        # Evicts and clears whose markers are not out (this host does not use those keys).
        stats["remote_invalidations_waiting"] = sum(io.keys.unpublished().values())
        stats["remote_dropped_writes"] = (
            stats["remote_dropped_queue"] + stats["remote_dropped_resting"]
            + stats["remote_dropped_full"] + stats["remote_dropped_down"]
            + stats["remote_dropped_evicted"] + stats["remote_dropped_stale"]
        )
        stats["remote_connect_errors"] = io.connection.failed_connects
        stats["remote_call_errors"] = io.connection.failed_calls
        # Each failed or timed-out call once, under its kind. Not the evicts and clears
        # whose marker did not go out (remote_invalidation_errors): the call that failed
        # for one is counted here already, and one made while the tier rests made none.
        stats["remote_errors"] = (
            stats["remote_read_errors"] + stats["remote_write_errors"]
            + stats["remote_remove_errors"] + stats["remote_timeouts"] + stats["remote_call_errors"]
            + stats["remote_connect_errors"]
        )
        return stats

    def close(self) -> None:
        """Finish the queued writes and markers (``timeout_ms`` a call; not at all where
        the reader thread is already stuck in one), then stop; the reads under way end as
        misses. Before the pool goes; where a call is still under way (a master that
        stopped answering), the memory it may read into is kept, never reused."""
        io = self.io
        if not io.close(flush=not self.reads.stuck):
            _ABANDONED.append((io, self._memory))
        self.reads.close()
        self.drain()


def _extends_stored(mask: Any) -> bool:
    """Whether a put found some of its pages stored before its last new one: its mask
    (per token, or per page on the store server) is not one run from the first on."""
    if not mask[0]:
        return True
    stored = int(np.argmin(mask))  # its first page not new (0: none is)
    return bool(stored) and bool(mask[stored:].any())
