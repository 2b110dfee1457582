"""Staging: a get's SSD pages wait here for host blocks to be read into, launched loads
first; prefetches give theirs back to launched loads that wait.

Staging (host blocks reserved, reads started: :meth:`~LoadStaging._stage`) happens:

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

A launched load still waiting for room at its deadline (:mod:`.loads`) gives up and
gives its SSD slots back: it ends EXPIRED, with the host pages it queued at launch.
``time.monotonic()`` is read on the store thread just before each staging.

A launched load that waits for room also takes it from prefetches not launched yet
(``_give_way``): otherwise one that needs more than the half of the tier they may hold
would wait until their Lookups are loaded, released or expire, however long their callers
keep them (a caller may well wait for this very load first). A prefetch keeps its SSD
slots held after its reads (``keep``), so that once they are in it can give its host
blocks back (out of the host tier, free) and wait to be staged again like a load matched
without room: its Lookup still loads all it reported, read once more.

Room comes back as tasks end; and the host pages of a launched load that waits for room
go back as soon as their GPU copy is done (:meth:`.loads.Loads.job_done`), so loads
waiting for room never wait for each other's host pages. While a load of a key is still
to be staged, a match promises nothing of that key (:meth:`~LoadStaging.unstaged`: its
pages would reach the host under that load, not this one: a miss, not a short load).

:class:`LoadStaging` does it, owned by :class:`~.loads.Loads` (the link's ``loads``),
which queues each load at its match (``queue``), owes it room at launch (``owe``),
withdraws one that will copy nothing (``withdraw``), and lends it the finish of a load
that ends unstaged. The link hands it out as its ``staging``: puts ask it for the room
launched loads are owed (``leave_owed``), the link's ``drain`` and the store's ends have
it stage what room allows (``stage_waiting``), an evict asks which loads are parked and
drops those of its key (``parked``, ``drop_unstaged``), and the server's gets whether
room is coming. Runs on the store thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..base import Int64Array, NoSpace
from .blocks import NO_BLOCKS, Tier
from .load import Load
from .ssd import SsdTier


class LoadStaging:
    """The loads not staged yet, and the prefetches staged and not launched, between
    ``host`` and ``ssd`` (the link's tiers). ``finish``: end a load that will never be
    staged, or whose reads are settled (:meth:`.loads.Loads._finish`)."""

    def __init__(self, host: Tier, ssd: SsdTier, finish: Callable[[Load], None]) -> None:
        self._host, self._ssd = host, ssd
        self._finish = finish
        # Loads not staged yet: matched, not launched (oldest first), and launched, owed
        # room before those (oldest launch first); how many of each key are in either.
        self._waiting: list[Load] = []
        self._owed: list[Load] = []
        self._unstaged: dict[tuple[str, ...], int] = {}
        # Staged, neither launched nor cancelled (oldest first), and their host blocks.
        self._prefetches: dict[Load, None] = {}
        self._prefetched = 0
        self.stage_waits = 0  # launches that found no room to stage their SSD pages

    def unstaged(self, key: tuple[str, ...]) -> bool:
        """Whether a load of ``key`` is still to be staged: a match of the key promises
        none of its pages (they go to that load)."""
        return bool(self._unstaged.get(key))

    def queue(self, load: Load, owed: bool = False) -> None:
        """A matched load, its SSD slots held, waits to be staged: as a prefetch, staged
        now where room allows; ``owed`` (the store server's get, whose caller waits for
        it now), owed room as a launched load is, but only while room comes back by
        itself (:meth:`room_coming`: see the module docstring)."""
        if owed:
            load.while_coming = True
            self._unstaged[load.key] = self._unstaged.get(load.key, 0) + 1
            self._stage_owed(load, counted=self.room_coming)
        else:
            self._wait(load)
            self.stage_waiting()

    def owe(self, load: Load) -> None:
        """A matched load not staged yet is launched: it is owed room, before any
        prefetch (one past its deadline gives up here)."""
        self._waiting.remove(load)
        self._stage_owed(load)

    def withdraw(self, load: Load) -> bool:
        """A load not staged yet leaves its queue, never to be staged (its caller gave
        it up, or it will copy nothing), and gives its SSD slots back; its owner ends
        it. False where it is in no queue."""
        for queue in (self._owed, self._waiting):
            if load in queue:
                queue.remove(load)
                self._unstage(load)
                return True
        return False

    @property
    def prefetches(self) -> Iterable[Load]:
        """The staged loads not launched, oldest first (a match may take a cancelled
        one over: :mod:`.takeover`)."""
        return self._prefetches.keys()

    def _wait(self, load: Load) -> None:
        """A matched load, its SSD slots held, waits to be staged."""
        self._unstaged[load.key] = self._unstaged.get(load.key, 0) + 1
        self._waiting.append(load)

    def _stage_owed(self, load: Load, counted: Callable[[], bool] = lambda: True) -> None:
        """A load whose caller waits for it now (launched, or the server's get) is owed
        room: staged after those owed before it (one past its deadline gives up here);
        each that has to wait counts one ``stage_waits`` (where ``counted``, asked once
        its staging was tried: the server's get waits only while room is coming)."""
        self._owed.append(load)
        self.stage_waiting()
        if not load.staged and not load.finished and counted():
            self.stage_waits += 1

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
            self.book_prefetch(load)

    def book_prefetch(self, load: Load) -> None:
        """A staged load not launched (staged at its match, or handed over:
        :mod:`.takeover`) counts against the prefetches' half of the tier, until it is
        launched, gives way or ends cancelled (``unprefetch``)."""
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
            self.unprefetch(load)
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

    def unprefetch(self, load: Load) -> None:
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

    def _give_up(self, load: Load) -> None:
        """A launched load found no room by its deadline: it ends EXPIRED, moving nothing
        more (its host prefix was queued at launch)."""
        pages = len(load.slots)
        self._unstage(load)
        if load.expired is None:  # (launched late, it says so already)
            load.expired = f"no host room to stage its {pages} SSD pages by its deadline"
        self._finish(load)

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
