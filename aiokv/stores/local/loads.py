"""Loads: a get's pages after its host prefix that the SSD tier has, read into host
blocks and queued for their host -> GPU copies.

A match runs, after the host prefix, through every page either tier has ready, in any
interleaving (a key demoted to SSD, then appended to on the host: SSD pages, then host
pages, and so on), up to the first page neither has: its ``cached_tokens`` is the key's
whole prefix held across the tiers, as a put counts it. The task's blocks stay one list
in page order (page i of the caller's pages <- its i-th block): host pages after the
first SSD page are held from the match on, as the prefix is, and copied at launch with
it; SSD pages are staged into blocks of their own and copied run by run as verified.

What a match found is what the load brings (the Lookup's promise): the SSD slots are held
from the match on, whether or not the host tier has room to stage them then, so they can
be neither evicted nor overwritten. Only a block that fails its checksum or that the disk
could not give back (an I/O error, a file cut short) ends a load short (the task succeeds
with the mask of what was loaded; the SSD tier drops the block: :mod:`.ssd`). Staging
(host blocks reserved, reads started) waits for host room: at the match, as a prefetch,
where there is room at once; else at launch, owed room before any prefetch; the store
server's gets are owed room from their match on (:mod:`.staging`). A match promises at
most a host tier's worth of pages (what the tier could ever stage beside its own host
pages), and nothing of a key while another load of that key is still to be staged.

A launched load has a deadline (``LocalStore.set_deadlines``: its request's, which the
engine times its caller out at): nothing of it is staged or queued for its GPU copy after
it, so that a caller told RequestTimeout finds nothing more copied into its pages than
what was queued by then (its host pages, at launch, and the SSD chunks verified before
it). One still waiting for room then gives up and gives its SSD slots back
(:mod:`.staging`); one whose reads are still out ends once they are in, without copying
them, or as soon as a match of its key asks for its pages: its reads then go on for that
match, as a released Lookup's prefetch's do (:mod:`.takeover`). Either ends EXPIRED, with
the pages it queued. ``time.monotonic()`` is read on the store thread just before each
staging and each queued chunk.

A prefetch cancelled while its reads are out (its Lookup released, or its ttl ran out)
ends once they are in. Until then its pages are in the host table, still being written:
a match of the key, which stops at such a page, takes it over instead, all of it or the
prefix it asks for (:mod:`.takeover`). A user who gives a Lookup back and looks the key
up again finds what is stored (being read in for it), not a miss to recompute.

One request per chunk; once launched, each verified chunk is queued for its host -> GPU
copy while the next chunk is read. The task ends with the copy job of its last chunk. A
checksum failure or an unreadable block ends what it loads at that SSD page; host pages
past it may have been copied already, at launch (their bytes are right, only not
counted), and go back with the task. The host pages of a launched load still waiting for
room go back as soon as their GPU copy is done (``job_done``).

:class:`Loads` does it, owned by the link (:class:`~.tiering.TierLink`, its ``loads``),
which lends it the two tiers: the store calls it for a get's load (match, launch, cancel,
take-over), and the link's ``drain`` hands it each load whose reads are in
(:meth:`~Loads.advance`). It queues each load with its :class:`~.staging.LoadStaging`
(its ``staging``, which the link hands out for the room: puts, drains, evicts), which
ends through it the loads it never stages; it tells its :class:`~.takeover.Takeover` of
each launch and finish, and hands it the matches that stop at a page still being read in
(``adopt``). Runs on the store thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...copy.copier import CopyJob
from ..base import Int64Array
from .blocks import READY, Tier
from .load import Load, look_up, page_runs
from .ssd import SsdRequest, SsdTier
from .staging import LoadStaging
from .takeover import Takeover

# The store's copy of a load's pages (``pages``, a slice of the caller's page ids) from
# host ``blocks`` (None: only check the pages), waiting for the load's ready events,
# naming its task in errors; the job ends ``tasks`` (none: a chunk, whose task ends with
# the load's last job).
Copy = Callable[[list[Any], Any, "Int64Array | None", "Load"], CopyJob]
End = Callable[[list[Any], bool], None]


class Loads:
    """The loads of a get's SSD pages between ``host`` and ``ssd`` (the link's tiers).
    ``copy``: queue a host -> GPU copy job (:data:`Copy`); ``end``: end tasks that copy
    nothing more (:data:`End`); ``page_size``: tokens per page (a short load's mask)."""

    def __init__(self, host: Tier, ssd: SsdTier, copy: Copy, end: End, page_size: int) -> None:
        self._host, self._ssd = host, ssd
        self._copy, self._end = copy, end
        self._page_size = page_size
        # A chunk's copy job -> its load, and whether it copies host pages.
        self._chunk_jobs: dict[int, tuple[Load, bool]] = {}
        # Loads not staged yet, and prefetches not launched: it ends those it never
        # stages here (_finish).
        self.staging = LoadStaging(host, ssd, self._finish)
        # Launched loads, for matches that take their reads over.
        self._takeover = Takeover(host, ssd.tier, self._past_deadline,
                                  self.staging.book_prefetch, self._finish)

    def start_load(
        self, key: tuple[str, ...], digests: list[bytes], hits: int, task: Any,
        waits: bool = False,
    ) -> Load | None:
        """The pages after a get's host prefix (``hits`` pages, held: ``task.blocks``) that
        either tier has ready, up to the first that neither has (or that the host is
        still writing): the SSD ones held on SSD now, and prefetched into host blocks
        when there is room (see the module docstring); the host ones held and added to
        ``task.blocks``, in page order. None when the SSD has none of them (page ``hits``
        is not on the host). ``waits``: its caller waits for the staging now (the store
        server's get, answered once its SSD pages are on the host): staged as a launched
        load is, owed room (until its ``deadline``), never as a prefetch, but only while
        room comes back by itself (:meth:`.staging.LoadStaging.room_coming`): where none
        is free for it and none comes, it ends unstaged at once (finished: its host
        prefix), uncounted."""
        if self.staging.unstaged(key):
            return None  # another load of this key stages first: those pages go to it
        host, tier = self._host, self._ssd.tier
        # At most a host tier's worth: what the tier could ever stage beside the host
        # pages the task holds; while it is being pinned, what is pinned so far (the
        # pinning may stop short of the rest: a memlock limit).
        rest = digests[hits : max(hits, host.alloc.sure)]
        blocks, slots = look_up(host, key, rest), look_up(tier, key, rest)
        on_host = blocks >= 0
        ready = on_host & (host.state[blocks] == READY)
        on_ssd = ~on_host & (slots >= 0) & (tier.state[slots] == READY)
        usable = ready | on_ssd
        count = len(rest) if usable.all() else int(np.argmin(usable))
        if count <= 0:
            return None
        on_ssd, ready = on_ssd[:count], ready[:count]
        slots = slots[:count][on_ssd]
        tier.hold(slots)
        later = blocks[:count][ready]
        if len(later):  # held as the prefix is; the task is shared if one of them is
            if host.hold(later) and not task.shared:
                task.shared = True
                host.shared_gets += 1
            task.blocks = np.concatenate((task.blocks, later))
        load = Load(task, hits + count, key, list(itertools.compress(rest, on_ssd)), slots,
                    hits + np.flatnonzero(on_ssd),
                    np.concatenate((np.arange(hits), hits + np.flatnonzero(ready))),
                    chain=digests[: hits + count])
        self.staging.queue(load, owed=waits)
        return load

    def _past_deadline(self, load: Load) -> bool:
        """Whether the launched load reached its deadline: from then on nothing more of
        it is queued for its GPU copy (checked just before queueing)."""
        if load.expired is None and load.deadline is not None and (
            time.monotonic() >= load.deadline
        ):
            load.expired = "its deadline passed before it was all queued for its copy"
        return load.expired is not None

    def launch_load(self, load: Load, gpu_pages: Any, ready: Sequence[Any]) -> None:
        """Queue the load's copies (one launched past its deadline copies nothing)."""
        load.gpu_pages, load.ready = gpu_pages, ready
        # Cut to the prefix it reported (its caller's page ids are that prefix's), and,
        # unless finished, known to matches that may take its reads over.
        self._takeover.launched(load)
        self.staging.unprefetch(load)
        task = load.task
        late = self._past_deadline(load)
        if load.finished:  # task.blocks in page order: the first ``loaded`` are loaded
            pages = 0 if late else load.loaded
            self._copy([task], gpu_pages[:pages], task.blocks[:pages], load)
            return
        # Its pages are copied chunk by chunk: checked whole first (no page twice).
        self._chunk_jobs[id(self._copy([], gpu_pages, None, load))] = (load, False)
        host_at = load.host_at
        for i, j in page_runs(host_at) if len(host_at) and not late else ():
            first = int(host_at[i])
            self._chunk(load, gpu_pages[first : first + j - i], task.blocks[i:j], host=True)
            load.host_copies += 1
        if not load.staged:
            self.staging.owe(load)
        self._submit_verified(load)

    def cancel_load(self, load: Load) -> None:
        load.cancelled = True
        if load.finished:  # its reads settled, or an evict dropped it unstaged
            self.staging.unprefetch(load)
            self._end([load.task], False)
        elif not load.staged:  # nothing was read: the SSD slots go back now
            # Matched, or owed room (the server's get, given up on by its caller).
            self.staging.withdraw(load)
            self._finish(load)
        # Otherwise it ends when its reads are in (_finish), a prefetch until then: a
        # match of its pages meanwhile takes it over (takeover.py).

    def adopt(self, key: tuple[str, ...], digests: list[bytes]) -> Any | None:
        """A match of ``key`` stops at a page still being written: the task of a load
        whose reads bring it, which the match takes over, or None
        (:meth:`.takeover.Takeover.adopt`)."""
        return self._takeover.adopt(key, digests, self.staging.prefetches)

    def advance(self, load: Load) -> None:
        """Some of the load's reads are in (the link's ``drain``): settle those in, in
        order, queue the GPU copies of the pages verified (once launched), and finish it
        once all are settled."""
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
        host = self._host
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
            if load.good > len(load.at):  # read past the prefix it was cut to (takeover.py)
                load.good, load.truncated = len(load.at), True
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
        """Queue the GPU copies of the SSD pages verified since the last call (none past
        the load's deadline)."""
        assert load.gpu_pages is not None
        if load.good > load.submitted and not self._past_deadline(load):
            self._queue_ssd(load, load.good)

    def _queue_ssd(self, load: Load, hi: int, tasks: Sequence[Any] = ()) -> None:
        """Queue the GPU copies of its SSD pages ``submitted..hi`` (staged, verified),
        one job per run of adjacent pages; ``tasks`` (the load's, at its end) end with
        the last job (one that copies nothing where none is left)."""
        assert load.gpu_pages is not None
        lo = load.submitted
        at = load.at[lo:hi]
        runs = page_runs(at)
        for n, (i, j) in enumerate(runs):
            first = int(at[i]) if i < j else 0
            pages = load.gpu_pages[first : first + j - i]
            blocks = load.host_blocks[lo + i : lo + j]
            if n == len(runs) - 1 and tasks:
                self._copy(list(tasks), pages, blocks, load)
            else:
                self._chunk(load, pages, blocks)
        load.submitted = hi

    def _chunk(
        self, load: Load, gpu_pages: Any, blocks: Int64Array, host: bool = False
    ) -> None:
        job = self._copy([], gpu_pages, blocks, load)
        self._chunk_jobs[id(job)] = (load, host)

    def _finish(self, load: Load) -> None:
        """Every read is settled (or there was none): the task's last copy job, which
        ends it, takes the verified pages not copied yet (none past its deadline)."""
        load.finished = True
        self._takeover.finished(load)  # cut to a prefix a match took it over for
        task = load.task
        launched = load.gpu_pages is not None
        copied = load.submitted if launched and self._past_deadline(load) else load.good
        loaded = load.upto(copied)
        if loaded < load.match_pages:  # a checksum failure, a read error, or its deadline
            task.mask = task.mask.copy()  # a new mask: the worker counts what moved
            task.mask[loaded * self._page_size :] = False
        # The blocks the task holds till it ends, in page order: its host pages (unless
        # they went back early) and what was staged and verified.
        held = task.blocks[: 0 if load.host_released else len(load.host_at)]
        pages = np.concatenate((load.host_at[: len(held)], load.at[: load.good]))
        blocks = np.concatenate((held, load.host_blocks[: load.good]))
        task.blocks = blocks[np.argsort(pages)]
        if not launched:  # launch copies it all in one job
            if load.cancelled:
                # Its reads kept their SSD slots until now, for a match that would have
                # taken it over as the prefetch it was (staging's _give_way needs them).
                self.staging.unprefetch(load)
                self._end([task], False)
            return
        self._queue_ssd(load, copied, [task])

    def job_done(self, job: CopyJob) -> None:
        """A load's chunk was copied (or failed). Host pages all copied while their load
        still waits for room go back now: loads waiting for room must not wait for each
        other's host pages. (Otherwise a task's blocks go back together when it ends, in
        order, so that its head stays the most recent.)"""
        chunk = self._chunk_jobs.pop(id(job), None)
        if chunk is None:
            return
        load, host = chunk
        if job.error is not None:
            load.error = load.error or job.error
        if job.invalid and load.invalid is None:  # a chunk's page ids were refused
            load.invalid = next(iter(job.invalid.values()))
            if self.staging.withdraw(load):
                # It will copy nothing: it ends now rather than wait for host room (and
                # hold up the puts that leave_owed turns away meanwhile) until its
                # deadline, when the room would only stage reads for no copy.
                self._finish(load)
        if host:
            load.host_copies -= 1
            if not load.host_copies and not load.staged and not load.finished:
                load.host_released = True
                self._host.drop_readers(load.task.blocks[: len(load.host_at)])
