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
with the mask of what was loaded; the SSD tier drops the block: :mod:`.ssd`).
Staging (host blocks reserved, reads started) happens:

- at the match, as a prefetch, when the host tier has room at once, no launched load is
  waiting for room, and prefetched loads not yet launched hold at most half the tier (a
  Lookup its caller keeps while it waits for something else must not hold the room the
  loads and offloads of others need; while the tier is being pinned, or where pinning
  stopped short, half the blocks pinned);
- otherwise at launch, waiting for room: launched loads are staged first come, first
  served, before any prefetch, and puts get NoSpace rather than the room they wait for
  (``leave_owed``). Each launch that has to wait counts one ``stage_waits``.
- at the match, owed room as a launched load is, for the store server's gets
  (``start_load(waits=True)``): an engine there copies from host blocks only, so a get
  is answered once its SSD pages are read into them, and waits for the room first (its
  ``deadline``: the server's), rather than answer the SSD part a miss. Never a prefetch.
  It waits only while room comes back by itself (:meth:`~LoadStaging.room_coming`: SSD
  copies or remote writes hold host blocks no get reads): the asking engine is blocked
  in that get, so room held by its own tasks (held Lookups, puts not ended) could never
  come back; counted in ``stage_waits`` only then. Once none comes, such a get that the
  room there is cannot stage leaves the queue unstaged (it ends with its host prefix)
  rather than hold up those behind it that it can: a lookup of 2 pages is not a miss
  because one of 8 that will never fit asked first. While room comes, first come, first
  served: a small get must not starve a large one that will fit.

A launched load has a deadline (``LocalStore.set_deadlines``: its request's, which the
engine times its caller out at): nothing of it is staged or queued for its GPU copy after
it, so that a caller told RequestTimeout finds nothing more copied into its pages than
what was queued by then (its host pages, at launch, and the SSD chunks verified before
it). One still waiting for room then gives up and gives its SSD slots back; one whose
reads are still out ends once they are in, without copying them, or as soon as a match of
its key asks for its pages: its reads then go on for that match, as a released Lookup's
prefetch's do (:mod:`.takeover`). Either ends EXPIRED, with the pages it queued.
``time.monotonic()`` is read on the store thread just before each staging and each queued
chunk.

A launched load that waits for room also takes it from prefetches not launched yet
(``_give_way``): otherwise one that needs more than the half of the tier they may hold
would wait until their Lookups are loaded, released or expire, however long their callers
keep them (a caller may well wait for this very load first). A prefetch keeps its SSD
slots held after its reads (``keep``), so that once they are in it can give its host
blocks back (out of the host tier, free) and wait to be staged again like a load matched
without room: its Lookup still loads all it reported, read once more.

A prefetch cancelled while its reads are out (its Lookup released, or its ttl ran out)
ends once they are in. Until then its pages are in the host table, still being written:
a match of the key, which stops at such a page, takes it over instead, all of it or the
prefix it asks for (:mod:`.takeover`). A user who gives a Lookup back and looks the key
up again finds what is stored (being read in for it), not a miss to recompute.

Room comes back as tasks end; and the host pages of a launched load that waits for room
go back as soon as their GPU copy is done, so loads waiting for room never wait for each
other's host pages. A match promises at most a host tier's worth of pages (what the tier
could ever stage beside its own host pages), and nothing of a key while another load of
that key is still to be staged (its pages would reach the host under that load, not this
one: a miss, not a short load). One request per chunk; once launched, each verified chunk
is queued for its host -> GPU copy while the next chunk is read. The task ends with the
copy job of its last chunk. A checksum failure or an unreadable block ends what it loads at
that SSD page; host pages past it may have been copied already, at launch (their bytes are
right, only not counted), and go back with the task.

:class:`LoadStaging` does it, owned by the link (:class:`~.tiering.TierLink`, its
``loads``), which lends it the two tiers: the store calls it for a get's load (match,
launch, cancel, take-over), and the link's ``drain`` hands it each load whose reads are
in (:meth:`~LoadStaging.advance`) and has it stage the waiting ones. It tells its
:class:`~.takeover.Takeover` of each launch and finish, and hands it the matches that
stop at a page still being read in (``adopt``). Runs on the store thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...copy.copier import CopyJob
from ..base import Int64Array, NoSpace
from .blocks import NO_BLOCKS, READY, Tier
from .load import Load, look_up, page_runs
from .ssd import SsdRequest, SsdTier
from .takeover import Takeover

# The store's copy of a load's pages (``pages``, a slice of the caller's page ids) from
# host ``blocks`` (None: only check the pages), waiting for the load's ready events,
# naming its task in errors; the job ends ``tasks`` (none: a chunk, whose task ends with
# the load's last job).
Copy = Callable[[list[Any], Any, "Int64Array | None", "Load"], CopyJob]
End = Callable[[list[Any], bool], None]


class LoadStaging:
    """The loads of a get's SSD pages between ``host`` and ``ssd`` (the link's tiers).
    ``copy``: queue a host -> GPU copy job (:data:`Copy`); ``end``: end tasks that copy
    nothing more (:data:`End`); ``page_size``: tokens per page (a short load's mask)."""

    def __init__(self, host: Tier, ssd: SsdTier, copy: Copy, end: End, page_size: int) -> None:
        self._host, self._ssd = host, ssd
        self._copy, self._end = copy, end
        self._page_size = page_size
        # A chunk's copy job -> its load, and whether it copies host pages.
        self._chunk_jobs: dict[int, tuple[Load, bool]] = {}
        # Loads not staged yet: matched, not launched (oldest first), and launched, owed
        # room before those (oldest launch first); how many of each key are in either.
        self._waiting: list[Load] = []
        self._owed: list[Load] = []
        self._unstaged: dict[tuple[str, ...], int] = {}
        # Staged, neither launched nor cancelled (oldest first), and their host blocks.
        self._prefetches: dict[Load, None] = {}
        self._prefetched = 0
        self.stage_waits = 0  # launches that found no room to stage their SSD pages
        # Launched loads, for matches that take their reads over.
        self._takeover = Takeover(host, ssd.tier, self._past_deadline, self._book_prefetch,
                                  self._finish)

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
        room comes back by itself (:meth:`room_coming`): where none is free for it and
        none comes, it ends unstaged at once (finished: its host prefix), uncounted."""
        if self._unstaged.get(key):
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
        if waits:
            load.while_coming = True
            self._unstaged[key] = self._unstaged.get(key, 0) + 1
            self._stage_owed(load, counted=self.room_coming)
        else:
            self._wait(load)
            self.stage_waiting()
        return load

    def _wait(self, load: Load) -> None:
        """A matched load, its SSD slots held, waits to be staged."""
        self._unstaged[load.key] = self._unstaged.get(load.key, 0) + 1
        self._waiting.append(load)

    def leave_owed(self, count: int) -> None:
        """Raises NoSpace when a put of ``count`` new blocks would take host room that
        launched loads wait for (they go first)."""
        if self._owed:
            owed = sum(len(load.slots) for load in self._owed)
            if count + owed > self._host.available():
                raise NoSpace(
                    f"host: need {count} blocks; loads waiting for room are owed {owed} "
                    f"of the {self._host.available()} free or evictable"
                )

    def stage_waiting(self) -> None:
        """Stage what room allows: launched loads first, in launch order, then prefetches
        in match order (none while a launched load waits). Called whenever room may have
        come back, and polled: launched loads past their deadline give up first, so that
        none is staged after it. A server's get that cannot be staged while no room comes
        back by itself leaves the queue (``while_coming``), and those after it are tried."""
        owed, waiting = self._owed, self._waiting
        if owed:
            now = time.monotonic()
            for load in [x for x in owed if x.deadline is not None and x.deadline <= now]:
                owed.remove(load)
                self._give_up(load)
        while owed:
            load = owed[0]
            if not self._stage(load, prefetch=False) and not (
                self._give_way(len(load.slots)) and self._stage(load, prefetch=False)
            ):
                # Asked after the try: a reserve that failed may have started copies
                # down (write_back), room that comes for this very get.
                if not load.while_coming or self.room_coming():
                    return
                # Its caller is answered with its host prefix now anyway: waiting at
                # the head, it would only keep the gets behind it from room that fits
                # them, and they would be answered short with it.
                owed.pop(0)
                self._unstage(load)
                self._finish(load)
                continue
            owed.pop(0)
        # Half of the blocks surely pinned: pinning may yet stop short of the rest (a
        # memlock limit), and half of them all let prefetches take every pinned one.
        limit = self._host.alloc.sure // 2
        while waiting and self._prefetched + len(waiting[0].slots) <= limit:
            load = waiting[0]
            if not self._stage(load, prefetch=True):
                break
            waiting.pop(0)
            self._book_prefetch(load)

    def _book_prefetch(self, load: Load) -> None:
        """A staged load not launched (staged at its match, or handed over:
        :mod:`.takeover`) counts against the prefetches' half of the tier, until it is
        launched, gives way or ends cancelled (``_unprefetch``)."""
        load.prefetched = len(load.host_blocks)
        self._prefetched += load.prefetched
        self._prefetches[load] = None

    def _stage(self, load: Load, prefetch: bool) -> bool:
        """Reserve the load's host blocks and start its reads; False: no room yet."""
        host = self._host
        try:
            blocks = host.reserve(len(load.slots))
        except NoSpace:
            return False  # room comes back as copies and tasks end
        load.staged = True
        self._count_out(load.key)
        load.space = host.index.insert(load.key, load.digests, blocks)  # WRITING
        host.readers[blocks] = 1  # this task's
        load.host_blocks = blocks
        # A prefetch keeps its slots, to give its host blocks back (_give_way).
        load.reads = self._ssd.read(load.slots, blocks, load.key, load.digests, load,
                                    keep=prefetch)
        return True

    def _give_way(self, need: int) -> bool:
        """A launched load waits for ``need`` host blocks: prefetches not launched give
        theirs back, oldest first, until the tier could have them (``host.available``):
        each whose reads are in (one still being read gives way once they are: ``drain``
        calls again) and whose blocks no other get reads. Its task gets a new
        :class:`Load` that waits to be staged again, holding the SSD slots the reads
        verified (kept: ``_stage``); or, where its key was dropped since or a read
        failed, one that ends with its host prefix (and that error), as
        ``drop_unstaged`` ends one. Returns whether one gave way."""
        host = self._host
        short = need - host.available()
        gave = False
        for load in list(self._prefetches):
            if short <= 0:
                break
            good = load.good
            blocks = load.host_blocks[:good]
            if not load.finished or not good or (host.readers[blocks] != 1).any():
                continue
            task = load.task
            # Ends where this one did (after its verified pages), or with no SSD page.
            new = Load(task, load.match_pages, load.key, [], NO_BLOCKS, load.at[: good + 1],
                       load.host_at, error=load.error, deadline=load.deadline,  # (set_deadlines)
                       chain=load.chain)
            again = load.error is None and host.index.space(load.key) is load.space
            if again:
                new.digests, new.slots = load.digests[:good], load.slots[:good]
                self._ssd.tier.hold(new.slots)  # before the reads' holds go back
            else:
                new.at = load.at[:1]  # its first SSD page: what it loads ends there
            self._unprefetch(load)
            host.roll_back(load.space, load.digests[:good], blocks)
            # It keeps its host blocks (task.blocks is in page order: _finish).
            pages = np.sort(np.concatenate((load.host_at, load.at[:good])))
            task.blocks = task.blocks[np.isin(pages, load.host_at, assume_unique=True)]
            task.load = new
            if again:
                self._wait(new)
            else:
                self._finish(new)
            short -= good
            gave = True
        return gave

    def _unprefetch(self, load: Load) -> None:
        """A prefetch is launched, gives way, or ends cancelled: it no longer counts
        against the prefetches' half of the tier, and its reads keep no SSD slot (those
        in now give theirs back, the others as they come in)."""
        if not load.prefetched:
            return
        self._prefetched -= load.prefetched
        load.prefetched = 0
        del self._prefetches[load]
        kept = []
        for request in load.reads:
            if request.arrived < request.ops:
                request.keep = False
            elif request.keep:
                kept.append(request.slots[request.ok])
        if kept:
            self._ssd.tier.drop_readers(np.concatenate(kept))

    def _count_out(self, key: tuple[str, ...]) -> None:
        """A load of ``key`` is staged, or will never be."""
        self._unstaged[key] -= 1
        if not self._unstaged[key]:
            del self._unstaged[key]

    def _unstage(self, load: Load) -> None:
        """A load that will never be staged gives its SSD slots back."""
        self._count_out(load.key)
        self._ssd.tier.drop_readers(load.slots)
        load.slots, load.digests = NO_BLOCKS, []

    def _give_up(self, load: Load) -> None:
        """A launched load found no room by its deadline: it ends EXPIRED, moving nothing
        more (its host prefix was queued at launch)."""
        pages = len(load.slots)
        self._unstage(load)
        if load.expired is None:  # (launched late, it says so already)
            load.expired = f"no host room to stage its {pages} SSD pages by its deadline"
        self._finish(load)

    def _past_deadline(self, load: Load) -> bool:
        """Whether the launched load reached its deadline: from then on nothing more of
        it is queued for its GPU copy (checked just before queueing)."""
        if load.expired is None and load.deadline is not None and (
            time.monotonic() >= load.deadline
        ):
            load.expired = "its deadline passed before it was all queued for its copy"
        return load.expired is not None

    def parked(self, task_ids: Sequence[int], held: Sequence[Any]) -> list[int]:
        """Of these launched tasks, the loads owed host room that only later calls of
        the engine can give back: they copy nothing more until then (an evict's drop
        ends those of its key: :meth:`drop_unstaged`). ``held``: the store's matched,
        unlaunched tasks (held Lookups), whose host blocks are theirs until the engine
        loads, releases or cancels them; but a held prefetch's own blocks come back
        (:meth:`_give_way`) unless another of them reads one. Every other block comes
        back by itself: SSD copies and remote writes end, reads come in, launched loads
        and puts end, a released prefetch ends. The owed loads are staged in launch
        order, each once the tier (:attr:`~.pool.BlockAllocator.capacity`) less what is
        held could stage it (those before it end and give their room back): the first
        that it never could is parked, and so is every load launched after it. The
        others are not, and an evict waits for them as for any launched task."""
        if not self._owed:  # (an evict asks at each of its polls)
            return []
        pinned: list[Int64Array] = []
        giving: list[Load] = []
        for task in held:
            load = task.load
            if load is not None and load in self._prefetches:
                pinned.append(np.setdiff1d(task.blocks, load.host_blocks))
                giving.append(load)
            else:
                pinned.append(task.blocks)
        others = np.concatenate(pinned) if pinned else NO_BLOCKS
        for load in giving:  # (prefetches never share their own blocks: any order)
            if np.isin(load.host_blocks, others).any():
                pinned.append(load.host_blocks)
        taken = len(np.unique(np.concatenate(pinned))) if pinned else 0
        room = self._host.alloc.capacity - taken
        asked = set(task_ids)
        parked: list[int] = []
        short = False
        for load in self._owed:
            short = short or len(load.slots) > room
            if short and load.task.task_id in asked:
                parked.append(load.task.task_id)
        return parked

    def drop_unstaged(self, namespace: tuple[str, ...] | None) -> None:
        """An evict or clear of ``namespace`` (None: all): its loads not staged yet never
        will be (staging would put the dropped key's SSD pages back into a live host
        table). Each ends with its host prefix only, as one whose reads failed; its SSD
        slots go back."""
        for queue in (self._waiting, self._owed):
            for load in [x for x in queue if namespace is None or x.key == namespace]:
                queue.remove(load)
                self._unstage(load)
                self._finish(load)

    def launch_load(self, load: Load, gpu_pages: Any, ready: Sequence[Any]) -> None:
        """Queue the load's copies (one launched past its deadline copies nothing)."""
        load.gpu_pages, load.ready = gpu_pages, ready
        # Cut to the prefix it reported (its caller's page ids are that prefix's), and,
        # unless finished, known to matches that may take its reads over.
        self._takeover.launched(load)
        self._unprefetch(load)
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
            self._waiting.remove(load)
            self._stage_owed(load)
        self._submit_verified(load)

    def _stage_owed(self, load: Load, counted: Callable[[], bool] = lambda: True) -> None:
        """A load whose caller waits for it now (launched, or the server's get) is owed
        room: staged after those owed before it (one past its deadline gives up here);
        each that has to wait counts one ``stage_waits`` (where ``counted``, asked once
        its staging was tried: the server's get waits only while room is coming)."""
        self._owed.append(load)
        self.stage_waiting()
        if not load.staged and not load.finished and counted():
            self.stage_waits += 1

    def room_coming(self) -> bool:
        """Whether host room comes back by itself: host blocks read only by readers that
        let go on their own (``Tier.passing``: SSD copies, remote writes under way),
        which their ends give back or make evictable. A block that a get also reads (a
        held Lookup) comes back only as that task ends, as does every block no such
        reader holds (a Lookup loaded or released, a put's copy ended: its engine's
        doing)."""
        host = self._host
        passing = np.flatnonzero(host.passing)
        return bool((host.readers[passing] <= host.passing[passing]).any())

    def cancel_load(self, load: Load) -> None:
        load.cancelled = True
        if load.finished:  # its reads settled, or an evict dropped it unstaged
            self._unprefetch(load)
            self._end([load.task], False)
        elif not load.staged:  # nothing was read: the SSD slots go back now
            # Matched, or owed room (the server's get, given up on by its caller).
            (self._owed if load in self._owed else self._waiting).remove(load)
            self._unstage(load)
            self._finish(load)
        # Otherwise it ends when its reads are in (_finish), a prefetch until then: a
        # match of its pages meanwhile takes it over (takeover.py).

    def adopt(self, key: tuple[str, ...], digests: list[bytes]) -> Any | None:
        """A match of ``key`` stops at a page still being written: the task of a load
        whose reads bring it, which the match takes over, or None
        (:meth:`.takeover.Takeover.adopt`)."""
        return self._takeover.adopt(key, digests, self._prefetches)

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
                # taken it over as the prefetch it was (_give_way needs them).
                self._unprefetch(load)
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
            if load in self._owed:
                # It will copy nothing: it ends now rather than wait for host room (and
                # hold up the puts that leave_owed turns away meanwhile) until its
                # deadline, when the room would only stage reads for no copy.
                self._owed.remove(load)
                self._unstage(load)
                self._finish(load)
        if host:
            load.host_copies -= 1
            if not load.host_copies and not load.staged and not load.finished:
                load.host_released = True
                self._host.drop_readers(load.task.blocks[: len(load.host_at)])
