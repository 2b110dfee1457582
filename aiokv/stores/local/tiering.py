"""The link between the host tier and the SSD tier below it.

- write_through: a put's blocks are READY (and the put done) once on the host; their SSD
  copy follows, holding them as a reader, and they join the host LRU when it is written,
  so that host eviction only drops blocks the SSD has.
- write_back: only blocks about to be evicted are written. While less than an eighth of
  the host tier (or the largest reservation seen) is free, that many of its LRU's oldest
  blocks are copied to SSD (held as readers, still readable on the host), and each goes
  back to the LRU's old end, so that eviction then frees it at no cost and a lookup
  never finds it in neither tier.
- either way, eviction (the demotion hook) keeps a block that has no SSD copy yet
  (eviction outran the copies, or the SSD tier had no free slot then) and copies it
  first, readable all along: a put that needed its room gets NoSpace until then. A block
  whose SSD write failed (counted) is given up: eviction drops it.
- loads: a get's pages after its host prefix that the SSD has are read into host blocks
  from the match on (a lookup's reservation prefetches), or as soon as the host tier has
  room when copies in flight are making it; one request per chunk; once
  launched, each verified chunk is queued for its host -> GPU copy while the next chunk
  is read. The task ends with the copy job of its last chunk. A block that fails its
  checksum ends the load there: the task succeeds with the mask of what was loaded. A
  read error fails the task.

Everything here runs on the store thread, from the store's calls and ``drain``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...config import StoreConfig
from ..base import Int64Array, NoSpace
from .blocks import NO_BLOCKS, READY, Tier
from .index import Space
from .pool import HostPool
from .ssd import SsdRequest, SsdTier
from .transfer import CopyJob

Copy = Callable[[list[Any], bool, Int64Array, Int64Array], CopyJob]
End = Callable[[list[Any], bool], None]
_FLUSH, _CLEAN = "flush", "clean"


@dataclass(slots=True, eq=False)
class Load:
    """A get task's SSD part: pages ``hits..hits+len(slots)`` of its match."""

    task: Any
    match_pages: int
    hits: int
    key: tuple[str, ...]
    digests: list[bytes]
    slots: Int64Array  # held on SSD until read
    host_blocks: Int64Array = field(default_factory=lambda: NO_BLOCKS)  # staged on host
    space: Space | None = None  # the host table the staging blocks are in
    reads: list[SsdRequest] = field(default_factory=list)
    resolved: int = 0  # reads settled, in order
    settled: int = 0  # SSD-part pages settled
    good: int = 0  # SSD-part pages verified in order (the loadable ones)
    truncated: bool = False
    submitted: int = 0  # SSD-part pages queued for their GPU copy
    gpu_pages: Int64Array | None = None  # set at launch
    cancelled: bool = False
    finished: bool = False
    error: str | None = None


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
    ) -> None:
        self.host = Tier("host", pool, demote=self._demote)
        self.ssd = SsdTier(
            config.ssd_dirs(),
            config.ssd_cache_gb * (1 << 30),
            pool,
            _geometry(pool, dtype, page_size),
            reset_on_mismatch=config.ssd_reset_on_mismatch,
            notify=wake,
        )
        self.write_through = config.ssd_write_policy == "write_through"
        self._copy, self._end = copy, end
        self._page_size = page_size
        self._chunk_jobs: dict[int, Load] = {}
        self._copying = 0  # host blocks held by their SSD copies (room on its way)
        self._waiting: list[Load] = []  # loads waiting for host room, oldest first
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
        """Finished puts' blocks (READY): copy them to SSD, held as readers till then."""
        host = self.host
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
        if len(request.host_blocks) != len(blocks):
            host.drop_readers(blocks[~np.isin(blocks, request.host_blocks)])

    def _demote(self, blocks: Int64Array, spaces: list[Space], digests: list[bytes]) -> Int64Array:
        """The host tier's eviction hook: keeps (and copies down) what the SSD lacks."""
        dirty = ~self.host.clean[blocks]
        if not dirty.any():
            return NO_BLOCKS
        if not dirty.all():
            blocks = blocks[dirty]
            spaces = [s for s, d in zip(spaces, dirty, strict=True) if d]
            digests = [g for g, d in zip(digests, dirty, strict=True) if d]
        return self._copy_down(blocks, spaces, digests)

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
        return request.host_blocks

    def _keep_room(self) -> None:
        """write_back: copy the LRU's oldest blocks to SSD before they are evicted."""
        host = self.host
        # An eighth of the tier, or the largest reservation seen (a burst of such puts
        # would otherwise evict blocks not yet copied): room for the next one.
        target = max(1, min(host.num_blocks // 2, max(host.num_blocks // 8, host.largest)))
        if host.alloc.num_free + self._copying >= target or not host.index.evictable:
            return
        oldest = host.index.oldest(target)
        dirty = oldest[~host.clean[oldest]]
        if not len(dirty):
            return
        host.index.make_unevictable(dirty)
        keys = list(map(host.index.key_of, dirty.tolist()))
        spaces: list[Space] = [k[0] for k in keys]  # type: ignore[misc]  # in the index
        copying = self._copy_down(dirty, spaces, [k[1] for k in keys])  # type: ignore[misc]
        if len(copying) != len(dirty):
            host.index.make_evictable_oldest(dirty[~np.isin(dirty, copying)])

    def _back_to_oldest(self, blocks: Int64Array) -> None:
        host = self.host
        left = host.readers[blocks] - 1
        host.readers[blocks] = left
        host.index.make_evictable_oldest(blocks[(left == 0) & (host.state[blocks] == READY)])

    # ---- loads ---------------------------------------------------------------------

    def start_load(
        self, key: tuple[str, ...], digests: list[bytes], hits: int, task: Any
    ) -> Load | None:
        """The SSD pages after a get's host prefix (``hits`` pages, already held): held on
        SSD now, read into host blocks as soon as the host tier has room for them (at
        once, or when blocks it is copying to SSD are done); None when there are none."""
        host = self.host
        rest = digests[hits:]
        slots = self.ssd.ready_prefix(key, rest)
        # More than the host tier could ever stage at once is not promised.
        count = min(len(slots), host.available() + self._copying)
        space = host.index.space(key)
        if space is not None:  # stop where the host has (or is writing) the page
            count = next((i for i, d in enumerate(rest[:count]) if d in space), count)
        if count == 0:
            return None
        slots = slots[:count]
        self.ssd.tier.hold(slots)
        load = Load(task, hits + count, hits, key, rest[:count], slots)
        if not self._stage(load):
            self._waiting.append(load)
        return load

    def _stage(self, load: Load) -> bool:
        """Reserve the load's host blocks and start its reads; False: wait for room.
        Where the host will have no room, the load ends with what it has."""
        host = self.host
        count = len(load.slots)
        space = host.index.space(load.key)
        if space is not None:  # another get began staging some page meanwhile
            count = next((i for i, d in enumerate(load.digests) if d in space), count)
        blocks = None
        for want in (count, min(count, host.available())):
            if want == 0:
                break
            try:
                blocks = host.reserve(want)
                break
            except NoSpace:
                if self._copying:
                    return False  # room is on its way
        staged = 0 if blocks is None else len(blocks)
        if staged < len(load.slots):
            self.ssd.tier.drop_readers(load.slots[staged:])
            load.slots, load.digests = load.slots[:staged], load.digests[:staged]
        if blocks is None:
            self._finish(load)
            return True
        load.space = host.index.insert(load.key, load.digests, blocks)  # WRITING
        host.readers[blocks] = 1  # this task's
        load.host_blocks = blocks
        load.reads = self.ssd.read(load.slots, blocks, load.key, load.digests, load)
        return True

    def launch_load(self, load: Load, gpu_pages: Int64Array) -> None:
        load.gpu_pages = gpu_pages
        if load.finished:
            task = load.task
            self._copy([task], False, gpu_pages[: len(task.blocks)], task.blocks)
            return
        if load.hits:
            self._chunk(load, gpu_pages[: load.hits], load.task.blocks[: load.hits])
        self._submit_verified(load)

    def cancel_load(self, load: Load) -> None:
        load.cancelled = True
        if load in self._waiting:  # not staged yet: nothing was read
            self._waiting.remove(load)
            self.ssd.tier.drop_readers(load.slots)
            load.slots, load.digests = NO_BLOCKS, []
            self._finish(load)
        elif load.finished:
            self._end([load.task], False)

    def _advance(self, load: Load) -> None:
        reads = load.reads
        while load.resolved < len(reads) and reads[load.resolved].arrived >= reads[
            load.resolved
        ].ops:
            self._settle(load, reads[load.resolved])
            load.resolved += 1
        if load.resolved < len(reads):
            if load.gpu_pages is not None:
                self._submit_verified(load)
        elif not load.finished:
            self._finish(load)

    def _settle(self, load: Load, request: SsdRequest) -> None:
        """One chunk's reads are in: verified blocks READY, the others out and free."""
        host = self.host
        start, n = load.settled, len(request.slots)
        load.settled += n
        blocks = load.host_blocks[start : start + n]
        ok = request.ok
        if request.error is not None:
            load.error = load.error or request.error
        if not load.truncated:
            first_bad = n if ok.all() else int(np.argmin(ok))
            load.good += first_bad
            load.truncated = first_bad < n
        host.state[blocks[ok]] = READY
        host.clean[blocks[ok]] = True
        bad = ~ok
        if bad.any():
            digests = load.digests[start : start + n]
            host.roll_back(load.space, [d for d, b in zip(digests, bad, strict=True) if b],
                           blocks[bad])
        # Verified blocks past a failure are not loaded: they go back to the LRU now.
        past = np.arange(start, start + n) >= load.good
        if (past & ok).any():
            host.drop_readers(blocks[past & ok])

    def _submit_verified(self, load: Load) -> None:
        assert load.gpu_pages is not None
        if load.good > load.submitted:
            lo, hi = load.submitted, load.good
            self._chunk(load, load.gpu_pages[load.hits + lo : load.hits + hi],
                        load.host_blocks[lo:hi])
            load.submitted = hi

    def _chunk(self, load: Load, gpu_pages: Int64Array, blocks: Int64Array) -> None:
        job = self._copy([], False, gpu_pages, blocks)
        self._chunk_jobs[id(job)] = load

    def _finish(self, load: Load) -> None:
        load.finished = True
        task = load.task
        task.blocks = np.concatenate((task.blocks[: load.hits], load.host_blocks[: load.good]))
        if len(task.blocks) < load.match_pages:
            task.mask = task.mask.copy()  # a new mask: the worker counts what moved
            task.mask[len(task.blocks) * self._page_size :] = False
        if load.cancelled:
            self._end([task], False)
        elif load.gpu_pages is not None:
            lo, hi = load.submitted, load.good
            self._copy([task], False, load.gpu_pages[load.hits + lo : load.hits + hi],
                       load.host_blocks[lo:hi])
            load.submitted = hi

    # ---- completions ---------------------------------------------------------------

    def drain(self) -> None:
        """Apply the SSD tier's finished requests on the host side."""
        host = self.host
        for request in self.ssd.drain():
            blocks = request.host_blocks
            if not request.is_write:
                if not self._closed:  # at close, the copy thread is gone: loads end unheard
                    self._advance(request.owner)
                continue
            # Copied, or given up on after a write error (counted): either way eviction
            # may now drop the block without trying to copy it again.
            host.clean[blocks] = True
            self._copying -= len(blocks)
            if request.owner == _FLUSH:
                host.drop_readers(blocks)
            else:
                self._back_to_oldest(blocks)
        if self._closed:
            return
        if not self.write_through:
            self._keep_room()
        while self._waiting and self._stage(self._waiting[0]):
            self._waiting.pop(0)

    def job_done(self, job: CopyJob) -> None:
        load = self._chunk_jobs.pop(id(job), None)
        if load is not None and job.error is not None:
            load.error = load.error or job.error

    # ---- invalidation, stats -------------------------------------------------------

    def drop(self, namespace: tuple[str, ...] | None) -> int:
        """Drop idle blocks of a namespace (None: all) in both tiers; returns the number
        of distinct pages no tier holds any more."""
        before = self._keys(namespace)
        self.host.drop_namespace(namespace)
        self.ssd.drop_namespace(namespace)
        return len(before - self._keys(namespace))

    def _keys(self, namespace: tuple[str, ...] | None) -> set[tuple[tuple[str, ...], bytes]]:
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
                **self.ssd.stats}

    def close(self) -> None:
        """write_back: copy the host tier's idle blocks the SSD lacks, so that a reopen
        finds them. Then finish the queued SSD requests (every copy becomes durable) and
        apply them, so that the stats count them. Runs after the copy thread ended."""
        host = self.host
        if not self.write_through and host.index.evictable:
            idle = host.index.oldest(host.index.evictable)
            dirty = idle[~host.clean[idle]]
            if len(dirty):
                host.index.make_unevictable(dirty)
                keys = list(map(host.index.key_of, dirty.tolist()))
                self._copy_down(dirty, [k[0] for k in keys], [k[1] for k in keys])  # type: ignore[misc]
        self._closed = True
        self.ssd.close()
        self.drain()
