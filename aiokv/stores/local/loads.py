"""Loads: a get's pages after its host prefix that the SSD tier has, read into host
blocks and queued for their host -> GPU copies.

The pages are read from the match on (a lookup's reservation prefetches), or as soon as
the host tier has room when copies in flight are making it; one request per chunk; once
launched, each verified chunk is queued for its host -> GPU copy while the next chunk is
read. The task ends with the copy job of its last chunk. A block that fails its checksum
ends the load there: the task succeeds with the mask of what was loaded. A read error
fails the task.

:class:`LoadStaging` is the link's (:class:`~.tiering.TierLink`) part that does it: a
base class, so that these run as the link's own methods, with no call in between; the
link's ``drain`` advances the loads whose reads are in and stages the waiting ones. Runs
on the store thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base import Int64Array, NoSpace
from .blocks import NO_BLOCKS, READY, Tier
from .index import Space
from .ssd import SsdRequest, SsdTier
from .transfer import CopyJob

Copy = Callable[[list[Any], bool, Int64Array, Int64Array], CopyJob]
End = Callable[[list[Any], bool], None]


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


class LoadStaging:
    """The link's loads; the state is the link's (its ``__init__``)."""

    host: Tier
    ssd: SsdTier
    _copy: Copy
    _end: End
    _page_size: int
    _chunk_jobs: dict[int, Load]
    _copying: int  # host blocks held by their SSD copies (room on its way)
    _waiting: list[Load]  # loads waiting for host room, oldest first

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

    def job_done(self, job: CopyJob) -> None:
        load = self._chunk_jobs.pop(id(job), None)
        if load is not None and job.error is not None:
            load.error = load.error or job.error
