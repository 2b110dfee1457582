"""The link between the host tier and the SSD tier below it.

- write_through: a put's blocks are READY (and the put done) once on the host; their SSD
  copy follows, holding them as a reader, and they join the host LRU when it is written,
  so that host eviction only drops blocks the SSD has.
- write_back: only blocks about to be evicted are written. While less than an eighth of
  the host tier (or the largest reservation seen; at most half the SSD slots not being
  written or read) is free, that many of its LRU's oldest blocks are copied to SSD (held
  as readers, still readable on the host), and each goes back to the LRU's old end, so
  that eviction then frees it at no cost and a lookup never finds it in neither tier.
- either way, eviction (the demotion hook) keeps a block that has no SSD copy yet
  (eviction outran the copies) and copies it first, readable all along: a put that
  needed its room gets NoSpace until then. Where no copy can start (every SSD slot is
  being written or read) while SSD requests are in flight, the block is kept too, with
  no copy, for their slots (their drain stages waiting loads again; a put matches again
  after its backoff): a lookup's prefetch staged just before another lookup's reads are
  in must not cost a completed put. Where none is in flight (every slot held by lookups),
  or its SSD write failed, the block is given up, counted (``ssd_full_drops``,
  ``ssd_write_errors``): eviction drops it.
- a host block's ``clean`` (the SSD has its copy) is cleared when the SSD's own LRU
  gives that copy's slot to another key, so that a block kept hot on the host is written
  down again before its eviction.
- loads: a get's pages after its host prefix that the SSD has are held there from the
  match on, read into host blocks when there is room (waiting for it at launch) and
  copied on to the GPU chunk by chunk; :mod:`.loads` says how (:class:`~.loads.Loads`:
  the link's ``loads``, which the store calls for them), and :mod:`.staging` how they
  wait for host room (:class:`~.staging.LoadStaging`: the link's ``staging``, the loads'
  own, which puts, drains and evicts ask). A later match of the key takes over the reads
  of a load whose caller no longer wants them (:mod:`.takeover`).

Everything here runs on the store thread, from the store's calls and ``drain``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...config import StoreConfig
from ..base import Int64Array
from ..dirlock import DirLock
from .blocks import NO_BLOCKS, READY, Tier
from .index import Space
from .loads import Copy, End, Loads
from .pool import HostPool
from .ssd import SsdTier
from .ssd_voids import VoidsDone

_FLUSH, _CLEAN = "flush", "clean"


def _geometry(pool: HostPool, dtype: torch.dtype, page_size: int) -> dict[str, Any]:
    shape = list(pool.data.shape[1:])
    names = ("layers", "kv", "page_size", "heads", "head_dim")
    geometry: dict[str, Any] = (
        dict(zip(names, shape, strict=True)) if len(shape) == 5 else {"block_shape": shape}
    )
    geometry.update(dtype=str(dtype).removeprefix("torch."), page_size=page_size)
    return geometry


class TierLink:
    def __init__(
        self,
        config: StoreConfig,
        pool: HostPool,
        dtype: torch.dtype,
        page_size: int,
        wake: Callable[[], None],
        copy: Copy,
        end: End,
        held: Sequence[DirLock] | None = None,
    ) -> None:
        """``copy``, ``end``: the loads' (:class:`~.loads.Loads`); ``held``: the SSD
        directories' locks, taken and kept by the caller (SsdFiles)."""
        self.host = Tier("host", pool, demote=self._demote)
        self.ssd = SsdTier(
            config.ssd_dirs(),
            config.ssd_cache_gb * (1 << 30),
            pool,
            _geometry(pool, dtype, page_size),
            reset_on_mismatch=config.ssd_reset_on_mismatch,
            notify=wake,
            held=held,
        )
        self.ssd.on_recycled = self._copies_gone
        self.write_through = config.ssd_write_policy == "write_through"
        self._copying = 0  # host blocks held by their SSD copies (room on its way)
        # A get's SSD pages read into host blocks (loads.py): the store's to call.
        self.loads = Loads(self.host, self.ssd, copy, end, page_size)
        # Their queue for host room (staging.py): puts, drains and evicts ask it.
        self.staging = self.loads.staging
        self._closed = False

    # ---- puts and demotion ---------------------------------------------------------

    def mark_stored_below(
        self, key: tuple[str, ...], digests: list[bytes], present: list[int | None] | None
    ) -> list[int | None] | None:
        """``present`` (host blocks or None per page) with -1 for pages only the SSD has:
        a put does not write them again."""
        if present is None:
            has = self.ssd.has(key, digests)
            return [-1 if h else None for h in has] if any(has) else None
        missing = [i for i, b in enumerate(present) if b is None]
        if missing:
            for i, h in zip(missing, self.ssd.has(key, [digests[i] for i in missing]),
                            strict=True):
                if h:
                    present[i] = -1
        return present

    def write_through_puts(self, tasks: Sequence[Any], blocks: Int64Array) -> None:
        """Finished puts' blocks (READY): copy them to SSD, held as readers till then. A
        put whose key was dropped while it ran (its table buried: another engine's evict,
        on the shared tier) is published instead, so that its blocks are freed as they
        fall idle and never written down."""
        host = self.host
        if host.buried:
            live = [t.space is not None and host.index.space(t.space.key) is t.space
                    for t in tasks]
            if not all(live):
                gone = [t for t, ok in zip(tasks, live, strict=True) if not ok]
                host.publish([t.blocks for t in gone], np.concatenate([t.blocks for t in gone]),
                             0)
                tasks = [t for t, ok in zip(tasks, live, strict=True) if ok]
                if not tasks:
                    return
                blocks = np.concatenate([t.blocks for t in tasks])
        spaces: list[Space] = []
        digests: list[bytes] = []
        for task in tasks:
            spaces += [task.space] * len(task.blocks)
            digests += task.digests
        host.readers[blocks] += 1
        request = self.ssd.write(blocks, spaces, digests, _FLUSH)
        if request is None:
            host.drop_readers(blocks)
            return
        self._copying += len(request.host_blocks)
        host.passing[request.host_blocks] += 1
        if len(request.host_blocks) != len(blocks):
            host.drop_readers(blocks[~np.isin(blocks, request.host_blocks)])

    def _demote(self, blocks: Int64Array, spaces: list[Space], digests: list[bytes]) -> Int64Array:
        """The host tier's eviction hook: keeps (and copies down) what the SSD lacks. A
        copy down may take the SSD slot of another of these blocks (the SSD's LRU gives
        it away: _copies_gone), which then lacks its copy too: asked again until none
        does, or no copy can start (then kept for the slots of the requests in flight,
        where there are some: _wait_for_slots)."""
        kept: list[Int64Array] = []
        asked = np.zeros(len(blocks), dtype=np.bool_)
        while True:
            want = ~self.host.clean[blocks] & ~asked
            if not want.any():
                break
            asked |= want
            these = blocks[want]
            spaces_now = [s for s, w in zip(spaces, want, strict=True) if w]
            digests_now = [g for g, w in zip(digests, want, strict=True) if w]
            copying = self._copy_down(these, spaces_now, digests_now)
            kept.append(copying)
            if len(copying) < len(these):  # rare: the SSD's slots all in use
                if self.ssd.in_flight:
                    kept.append(self._wait_for_slots(these, copying, spaces_now,
                                                     digests_now))
                else:
                    self._count_dropped(these, copying, spaces_now, digests_now)
                break
        if not kept:
            return NO_BLOCKS
        return kept[0] if len(kept) == 1 else np.concatenate(kept)

    def _wait_for_slots(self, blocks: Int64Array, copying: Int64Array, spaces: list[Space],
                        digests: list[bytes]) -> Int64Array:
        """Blocks eviction would free that the SSD has no copy of and no slot for now,
        while SSD requests are in flight: kept, back as the LRU's oldest, and the
        eviction that asked gets NoSpace. Their slots may come back at their drain (a
        cancelled load's reads, copies that become evictable), which stages waiting
        loads again (a put matches again after its backoff), and that eviction copies
        them down: a put that completed is not lost to a lookup's prefetch staged the
        moment before another lookup's reads were in. Returns those kept."""
        ssd = self.ssd
        lacking = np.array([not ssd.has(space.key, [digest])[0]
                            for space, digest in zip(spaces, digests, strict=True)],
                           dtype=np.bool_)
        waiting = blocks[lacking & ~np.isin(blocks, copying)]
        self.host.index.make_evictable_oldest(waiting)
        return waiting

    def _count_dropped(self, blocks: Int64Array, kept: Int64Array, spaces: list[Space],
                       digests: list[bytes]) -> None:
        """Blocks eviction frees that the SSD has no copy of: every SSD slot was held,
        none by a request in flight, so no copy could start. Eviction goes on (a put is
        not held up by lookups holding the SSD); the pages are lost to both tiers, and
        counted."""
        ssd = self.ssd
        gone = ~np.isin(blocks, kept)
        lost = sum(1 for space, digest, g in zip(spaces, digests, gone, strict=True)
                   if g and not ssd.has(space.key, [digest])[0])
        ssd.stats["ssd_full_drops"] += lost

    def _copies_gone(self, spaces: list[Space], digests: list[bytes]) -> None:
        """The SSD gave these keys' slots to others: where the host holds one of them,
        that block is the only copy now, and is written down again before eviction."""
        index = self.host.index
        for space, digest in zip(spaces, digests, strict=True):
            table = index.space(space.key)
            block = table.get(digest) if table is not None else None
            if block is not None:
                self.host.clean[block] = False

    def _copy_down(
        self, blocks: Int64Array, spaces: Sequence[Space], digests: Sequence[bytes]
    ) -> Int64Array:
        """Start SSD copies of host blocks out of the LRU, each held as a reader until it
        is done; returns those being copied (the others need no copy, or cannot have one
        now: the SSD tier is full of blocks in flight)."""
        request = self.ssd.write(blocks, spaces, digests, _CLEAN)
        if request is None:
            return NO_BLOCKS
        self.host.readers[request.host_blocks] += 1
        self._copying += len(request.host_blocks)
        self.host.passing[request.host_blocks] += 1
        return request.host_blocks

    def _keep_room(self) -> None:
        """write_back: copy the LRU's oldest blocks to SSD before they are evicted."""
        host = self.host
        # An eighth of the tier, or the largest reservation seen (a burst of such puts
        # would otherwise evict blocks not yet copied): room for the next one. At most
        # half the SSD's slots not being written or read: the copies then recycle slots
        # of other keys, not those of the blocks copied before them, which would lose
        # their copies and be written again, round after round. The tier is what it can
        # ever hold: where pinning stopped short (a memlock limit), the pinned blocks.
        size = host.alloc.capacity
        target = min(size // 2, max(size // 8, host.largest), self.ssd.tier.available() // 2)
        if target < 1 or host.alloc.num_free + self._copying >= target \
                or not host.index.evictable:
            return
        oldest = host.index.oldest(target)
        self.write_down(oldest[~host.clean[oldest]])

    def write_down(self, blocks: Int64Array) -> None:
        """Start SSD copies of those of these host blocks that are in the LRU and have
        none, ahead of their eviction (held as readers, readable all along; then the
        LRU's oldest). write_back's ``_keep_room``, and a put that must evict while its
        own stored pages fill the host tier (:mod:`.claims`)."""
        host = self.host
        # Only as many as the SSD has slots for now: the rest stay where they are in the
        # LRU. Put back as its oldest, they went ahead of the blocks copied before them,
        # and eviction, finding them first, copied them in turn, recycling those copies'
        # slots: on a small SSD, over and over, and a put waited for room until it failed.
        dirty = blocks[~host.clean[blocks]][: self.ssd.tier.available()]
        dirty = host.index.make_unevictable(dirty)
        if not len(dirty):
            return
        keys = list(map(host.index.key_of, dirty.tolist()))
        spaces: list[Space] = [k[0] for k in keys]  # type: ignore[misc]  # in the index
        copying = self._copy_down(dirty, spaces, [k[1] for k in keys])  # type: ignore[misc]
        if len(copying) != len(dirty):  # on SSD already, or a namespace no header holds
            host.index.make_evictable_oldest(dirty[~np.isin(dirty, copying)])

    def _back_to_oldest(self, blocks: Int64Array) -> None:
        host = self.host
        left = host.readers[blocks] - 1
        host.readers[blocks] = left
        host.index.make_evictable_oldest(blocks[(left == 0) & (host.state[blocks] == READY)])

    # ---- completions ---------------------------------------------------------------

    def drain(self) -> None:
        """Apply the SSD tier's finished requests on the host side."""
        host = self.host
        for request in self.ssd.drain():
            blocks = request.host_blocks
            if not request.is_write:
                # At close the copy thread is gone: launched loads end unheard. One not
                # launched copies nothing: a cancelled one (its Lookup given back while
                # its reads were out) ends here, giving back what it held.
                if not self._closed or request.owner.gpu_pages is None:
                    self.loads.advance(request.owner)
                continue
            # Copied, or given up on after a write error (counted): either way eviction
            # may now drop the block without trying to copy it again.
            host.clean[blocks] = True
            self._copying -= len(blocks)
            host.passing[blocks] -= 1
            if request.owner == _FLUSH:
                host.drop_readers(blocks)
            else:
                self._back_to_oldest(blocks)
        if host.buried:  # copied down for a key dropped meanwhile: listed past the tier
            host.sweep()
        if self._closed:
            return
        if not self.write_through:
            self._keep_room()
        self.staging.stage_waiting()

    def ssd_pages(self, key: tuple[str, ...]) -> int:
        """How many pages of ``key`` the SSD tier holds (or is writing)."""
        space = self.ssd.tier.index.space(key)
        return 0 if space is None else len(space)

    # ---- invalidation, stats -------------------------------------------------------

    def drop(self, namespace: tuple[str, ...] | None) -> tuple[int, VoidsDone]:
        """Drop a namespace (None: all) in both tiers (Tier.drop_namespace: what is in use
        goes out of reach, freed once idle); returns the number of distinct pages no tier
        holds any more, and an event set once the SSD holds none of them (its voids are
        written: SsdTier.drop_namespace). A clear's caller has begun it first, with the
        SSD tier's new epoch (SsdTier.begin_clear), so that a refused one drops nothing
        in any tier, remote included."""
        before = self.keys(namespace)
        self.staging.drop_unstaged(namespace)
        self.host.drop_namespace(namespace)
        written = self.ssd.drop_namespace(namespace)
        return len(before - self.keys(namespace)), written

    def keys(self, namespace: tuple[str, ...] | None) -> set[tuple[tuple[str, ...], bytes]]:
        """The (key, digest) of every page of a namespace (None: all) either tier holds."""
        keys: set[tuple[tuple[str, ...], bytes]] = set()
        for index in (self.host.index, self.ssd.tier.index):
            spaces = index.spaces() if namespace is None else [index.space(namespace)]
            for space in spaces:
                if space is not None:
                    keys.update((space.key, d) for d in space)
        return keys

    def stats(self) -> dict[str, int | float]:
        tier = self.ssd.tier
        return {"ssd_blocks_used": tier.used, "ssd_blocks_total": tier.num_blocks,
                "stage_waits": self.staging.stage_waits, **self.ssd.stats}

    def close(self) -> None:
        """Copy the host tier's idle blocks the SSD lacks, so that a reopen finds them:
        write_back's, and write_through's whose write found no free SSD slot at their
        put (its slots all in flight). Then finish the queued SSD requests (every copy
        becomes durable) and apply them, so that the stats count them, and copy what
        found no slot while those were in flight. Runs after the copy thread ended."""
        host = self.host
        if host.index.evictable:
            self.write_down(host.index.oldest(host.index.evictable))
        self._closed = True
        self.ssd.stop()
        self.drain()  # what it applies may still void headers (written at once now)
        if host.index.evictable:  # the writes in flight are done: their slots can go
            self.write_down(host.index.oldest(host.index.evictable))  # runs here and now
            self.drain()
        self.ssd.close()
