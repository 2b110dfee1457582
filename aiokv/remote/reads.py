"""The remote tier's calls on the reader thread, as the store thread sees them: lookups'
reads into host blocks (one call or two, in ``timeout_ms`` together), and invalidations' markers.

A read is :meth:`Reader.start`, then :meth:`Reader.poll` until it is over: the embedded
store blocks in :meth:`Reader.wait` (its lookups are answered after it anyway); the
store server answers other engines meanwhile and polls when ``wake`` says a call
returned, or at :meth:`Reader.due`. Where the host tier has free blocks for every page a
batch of lookups misses, they are reserved first and one call asks Mooncake for the
values themselves (an absent one answers for itself); where it would have to evict for
them, a first call asks which blocks Mooncake has, and only those are reserved and read.
A call not answered when the store thread looks at its read at or past the deadline is
given up (a miss), and its answer dropped when it comes; while the reader thread is still
busy with it the next lookups miss at once rather than queue behind it; host blocks that a
late read still writes into stay reserved until it returns. (An answer that came after the
deadline but before that look is used: the store thread looks at the deadline's timer,
or sooner when ``wake`` says the call returned.) A key is read by one read at a
time (:meth:`Reader.reading`); an evict or clear while it reads discards what it brings.

Lookups of one key in a batch (prompts of one namespace sharing a prefix, a user asked
twice) each ask for their own pages, but a page is read once: a lookup's range leaves out
the pages an earlier one of the batch asks for (its digests are chained, so those are a
prefix of its range), since two host copies of one page of a key cannot both be indexed.
Each lookup is counted, a hit where the pages it asked for arrived.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stores.base import Int64Array, NoSpace
from ..stores.local.blocks import NO_BLOCKS, Tier
from .client import RemoteIO
from .views import PageViews, View

Below = Callable[[tuple[str, ...], list[bytes]], list[bool]] | None
Wanted = list[tuple[tuple[str, ...], list[bytes]]]  # (key, digests of the pages to read)


@dataclass(slots=True, eq=False)
class RemoteRead:
    """One read of a batch of lookups' host misses into reserved host blocks: the values
    at once (``counts`` known), or first which leading blocks exist (``counts`` None
    until that answer) and then those."""

    wanted: Wanted  # the ranges read: no page in two of them
    # Per lookup, the pages it asked for (a range of ``wanted`` may hold only part of
    # them, the rest in an earlier range): what its hit is counted on.
    queries: Wanted
    future: Future[Any]  # the reader thread's current call
    began: float  # time.monotonic()
    deadline: float  # not answered by then: a miss (timeout_ms from began, both calls)
    # Reserved, ``counts[i]`` of them per wanted range.
    blocks: Int64Array = field(default_factory=lambda: NO_BLOCKS)
    counts: list[int] | None = None
    # Per wanted range, the digests of the key's pages before it (on the host at the
    # start): the room made for the range must not evict them.
    before: list[list[bytes]] = field(default_factory=list)
    # Per wanted range, the page before it in another range of this read (None where the
    # range starts the lookup's own): placed only after that one, else none of it is.
    after: list[bytes | None] = field(default_factory=list)
    gone: set[tuple[str, ...]] = field(default_factory=set)  # evicted meanwhile: dropped
    # Per wanted range, whether this host held pages of the key (host or SSD) at the
    # start: the range joins them in a lookup, so it must be of their generation (where
    # it held none, it joins no put that lands meanwhile: :meth:`Reader._place`).
    own: list[bool] = field(default_factory=list)
    # Per wanted range, the (lifetime, epoch, generation) it was read under (None: not
    # known); filled by the reader thread's call.
    views: list[View | None] = field(default_factory=list)
    over: bool = False


@dataclass(slots=True, eq=False)
class Published:
    """An evict's or clear's marker on its way to Mooncake: set once the reader thread
    has sent it (or failed to), or at ``deadline`` (time.monotonic())."""

    future: Future[Any]
    deadline: float

    def is_set(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline


class Reader:
    """The reader thread's calls of one store. ``tag``: a namespace's tag in keys;
    ``wake``: called (from the reader thread) when a call returns; ``views``: which
    generation each key's pages here are of."""

    def __init__(self, io: RemoteIO, host: Tier, tag: Callable[[tuple[str, ...]], str],
                 wake: Callable[[], None], views: PageViews,
                 held_below: Callable[[tuple[str, ...]], bool] | None = None) -> None:
        self._io = io
        # Whether this host holds pages of a key on its SSD only (None: it has no SSD).
        self._held_below = held_below
        self._host = host
        self._tag = tag
        self._wake = wake
        self._timeout_s = io.config.timeout_ms / 1000
        self._reads: list[RemoteRead] = []  # started, not over
        self._reading: Counter[tuple[str, ...]] = Counter()  # their keys
        self._publishing: list[Published] = []  # markers not yet accounted for
        self._late: list[tuple[Future[Any], Int64Array]] = []  # reads past their time
        self._busy: Future[Any] | None = None  # a call that outlived its time
        self.views = views  # which generation each key's pages here are of
        self.stats_ = {
            "remote_lookups": 0, "remote_lookup_waits": 0, "remote_hits": 0, "remote_misses": 0,
            "remote_blocks_read": 0, "remote_bytes_read": 0, "remote_timeouts": 0,
            "remote_invalidation_errors": 0,
            "remote_lookup_seconds_total": 0.0, "remote_lookup_seconds_max": 0.0,
        }

    @property
    def open_reads(self) -> int:
        return len(self._reads)

    @property
    def stuck(self) -> bool:
        """The reader thread is still in a call that outlived its time."""
        return self._busy is not None and not self._busy.done()

    # ---- reads ---------------------------------------------------------------------

    def start(self, queries: Wanted, below: Below = None) -> RemoteRead | None:
        """Start one read, for all the queries (a key and its pages' digests; none of a
        key being read), of the pages from each one's first miss on: the first run of
        pages that neither the host tier nor ``below`` (the SSD tier's ``has``; the SSD
        path reads its own) holds. None where nothing is read (nothing missing, or the
        tier rests: then counted as misses)."""
        io, host = self._io, self._host
        lookups: Wanted = []  # each query's pages to ask for
        unusable: Wanted = []  # a miss: evicted here, the marker not out yet; or of an
        # ended generation here (views)
        wanted: Wanted = []  # the ranges to read, no page twice
        before: list[list[bytes]] = []  # wanted's
        after: list[bytes | None] = []  # wanted's
        asked: dict[tuple[str, ...], set[bytes]] = {}  # the pages wanted, per key
        own: list[bool] = []  # wanted's
        for key, digests in queries:
            if key in self._reading:
                continue
            head, gap = self._missing(key, digests)
            space = host.index.space(key)
            # Its pages here of other prompts too: the view is the key's, of them all.
            mine = space is not None and len(space) > 0
            if not mine and self._held_below is not None:
                mine = self._held_below(key)
            if gap and below is not None:
                on_ssd = below(key, gap)
                mine = mine or True in on_ssd
                if on_ssd[0]:  # the SSD's run is the SSD path's; Mooncake's comes after
                    start = on_ssd.index(False) if False in on_ssd else len(gap)
                    gap = gap[start:]
                    on_ssd = on_ssd[start:]
                if True in on_ssd:
                    gap = gap[: on_ssd.index(True)]
            if not gap:
                continue
            tag = self._tag(key)
            if not io.keys.usable(tag):
                unusable.append((key, gap))
                continue
            if mine and not self.views.same(key, io.keys.view(tag)):
                unusable.append((key, gap))  # its pages here are of an ended generation
                continue
            lookups.append((key, gap))
            seen = asked.setdefault(key, set())
            # Pages of the key already in a range start the gap, if any are (chained
            # digests: two lookups of a key share a prefix, nothing after it).
            skip = next((i for i, d in enumerate(gap) if d not in seen), len(gap))
            rest = gap[skip:]
            rest = rest[: next((i for i, d in enumerate(rest) if d in seen), len(rest))]
            if rest:
                seen.update(rest)
                wanted.append((key, rest))
                before.append(head)
                after.append(gap[skip - 1] if skip else None)
                own.append(mine)
        if unusable:
            self._count(unusable, [0] * len(unusable), 0, None)
        if not wanted:
            return None
        now = time.monotonic()
        if io.resting() or self.stuck:
            self._count(lookups, [0] * len(lookups), 0, None)
            return None
        tagged = [(self._tag(key), digests) for key, digests in wanted]
        total = sum(len(digests) for _, digests in wanted)
        if total <= host.alloc.num_free:  # room without evicting: one call
            blocks = host.reserve(total)
            views: list[View | None] = []
            read = RemoteRead(wanted, lookups,
                              io.submit_read(io.viewed, views, io.read, tagged, blocks.tolist()),
                              now, now + self._timeout_s, blocks, [len(d) for _, d in wanted],
                              after=after, own=own, views=views)
        else:
            views = []
            read = RemoteRead(wanted, lookups,
                              io.submit_read(io.viewed, views, io.leading, tagged),
                              now, now + self._timeout_s, before=before, after=after, own=own,
                              views=views)
        self._reads.append(read)
        self._reading.update(key for key, _ in wanted)
        read.future.add_done_callback(self._returned)
        return read

    def wait(self, read: RemoteRead) -> None:
        """Block until the read is over (its calls' time at most)."""
        while not read.over:
            wait_for([read.future], max(0.0, read.deadline - time.monotonic()))
            self._advance(read, time.monotonic())

    def reading(self, key: tuple[str, ...]) -> bool:
        """A read of this key is under way."""
        return key in self._reading

    def poll(self) -> None:
        """Move the reads on (their calls that returned, or that are past their time)
        and account for the markers."""
        now = time.monotonic()
        for read in list(self._reads):
            self._advance(read, now)
        if self._publishing:
            self._published(now)

    def due(self) -> float | None:
        """The earliest deadline (time.monotonic()) of a read's call or a marker: when
        :meth:`poll` has something to end even if nothing returns."""
        deadlines = [r.deadline for r in self._reads] + [p.deadline for p in self._publishing]
        return min(deadlines, default=None)

    def drain(self) -> None:
        """Free the blocks of late reads that returned."""
        if self._late:
            done = [(f, b) for f, b in self._late if f.done()]
            if done:
                self._late = [(f, b) for f, b in self._late if not f.done()]
                for _, blocks in done:
                    self._host.free(np.sort(blocks))

    def close(self) -> None:
        """Once the reader thread has stopped (or was left in a call: the pool's memory
        then stays, never used again): the reads under way end as misses, their blocks
        freed, rather than move on (nothing can be asked now); the markers are
        accounted for."""
        now = time.monotonic()
        for read in list(self._reads):
            if len(read.blocks):
                self._host.free(np.sort(read.blocks))
            self._end(read, now)
        if self._publishing:
            self._published(now)
        self.drain()

    def _returned(self, future: Future[Any]) -> None:  # the reader thread
        self._wake()

    def _missing(self, key: tuple[str, ...], digests: list[bytes]
                 ) -> tuple[list[bytes], list[bytes]]:
        """The digests of this query's pages before the host tier's first gap in them,
        and those of that gap."""
        space = self._host.index.space(key)
        if space is None:
            return [], digests
        found = list(map(space.get, digests))
        if None not in found:
            return digests, []
        start = found.index(None)
        end = next((i for i in range(start, len(found)) if found[i] is not None), len(found))
        return digests[:start], digests[start:end]

    def _prefixes(self, read: RemoteRead) -> Int64Array:
        """The host blocks of the pages before each wanted range that are still there."""
        index = self._host.index
        found: list[int] = []
        for (key, _), head in zip(read.wanted, read.before, strict=False):
            space = index.space(key)
            if space is not None and head:
                found.extend(b for b in map(space.get, head) if b is not None)
        return np.array(found, dtype=np.int64)

    def _advance(self, read: RemoteRead, now: float) -> None:
        if read.over:
            return
        future = read.future
        if not future.done():
            if now >= read.deadline:  # a miss; its blocks wait for the call to return
                if self._io.timed_out(future):
                    self.stats_["remote_timeouts"] += 1
                self._busy = future
                if len(read.blocks):
                    self._late.append((future, read.blocks))
                self._end(read, now)
            return
        answer = self._answer(future)
        if read.counts is None:
            self._fetch(read, answer)
        elif answer is None:
            self._host.free(np.sort(read.blocks))
            self._end(read, now)
        else:
            self._end(read, now, self._place(read, answer))

    def _answer(self, future: Future[Any]) -> Any:
        """A returned call's answer; None if it raised (counted, and the tier rests, once
        for the call: evicts may share it), or if close cancelled it before it started
        (no call was made: nothing failed)."""
        if future.cancelled():
            return None
        try:
            return future.result(0)
        except Exception as exc:  # the client raised: counted, a miss
            self._io.failed("a call", exc, future)
            return None

    def _fetch(self, read: RemoteRead, present: list[list[str]] | None) -> None:
        """Mooncake said which leading blocks it has: reserve room for them (earlier
        queries first, as far as the host tier has room) and read them."""
        host, io = self._host, self._io
        present = present or [[] for _ in read.wanted]
        # The lookups' own host pages before their ranges stay out of the LRU meanwhile:
        # evicted for the room, the lookup would find its key's first page gone.
        listed = host.index.make_unevictable(self._prefixes(read))
        try:
            room = host.available()
            counts = []
            for (key, _), keys in zip(read.wanted, present, strict=True):
                counts.append(0 if key in read.gone else min(len(keys), room))
                room -= counts[-1]
            total = sum(counts)
            now = time.monotonic()
            if total and now >= read.deadline:  # the lookup's time is up: no second call
                self.stats_["remote_timeouts"] += 1
                total = 0
            try:
                blocks = host.reserve(total) if total else None
            except NoSpace:
                blocks = None
        finally:
            host.index.make_evictable(listed)
        if blocks is None:
            self._end(read, now)
            return
        keys = [key for group, count in zip(present, counts, strict=True) for key in group[:count]]
        # Within the deadline the read began with: one timeout_ms for the lookup.
        read.blocks, read.counts = blocks, counts
        read.future = io.submit_read(io.fetch, keys, blocks.tolist(), counts)
        read.future.add_done_callback(self._returned)

    def _place(self, read: RemoteRead, good: list[int]) -> list[list[bytes]]:
        """Index and publish each range's leading good blocks (``good``: per range, how
        many arrived whole), but none of a key evicted meanwhile, nor a page that a put
        of the key reserved meanwhile, nor any of a key that had no page here when the
        read began and has some now (a put landed meanwhile, or is under way), nor a
        range whose page before it (in an earlier range) is not on the host; free the
        rest. The pages placed, per range."""
        host = self._host
        assert read.counts is not None  # a values call answered
        placed: list[list[bytes]] = []
        landed: dict[tuple[str, ...], bool] = {}  # per key: a put of it landed meanwhile
        unused, at = [], 0
        views = read.views or [None] * len(read.wanted)
        for (key, digests), count, n, prev, own, view in zip(
                read.wanted, read.counts, good, read.after, read.own, views, strict=True):
            mine = read.blocks[at : at + count]
            at += count
            space = host.index.space(key)
            if landed.setdefault(key, not own and bool(space)):
                # A put of the key landed meanwhile (as its first range here found; the
                # later ones find that range's pages): none of the read's pages join it.
                # Its view tells nothing: none is noted while it is under way, and one
                # offered within the writer's freshness took the generation from the
                # markers this read was answered with, though an evict may have ended it
                # before the put began (its bytes then of the next version).
                n = 0
            if key in read.gone or (prev is not None and (space is None or prev not in space)):
                n = 0  # (pages past a hole would be out of every lookup's reach)
            elif n and not self.views.joins(key, own, view):
                n = 0  # this host's pages of the key are of another generation
            unused.append(mine[n:])
            if space is not None and n:
                taken = np.fromiter(map(space.__contains__, digests[:n]), dtype=np.bool_,
                                    count=n)
                if taken.any():  # rare: a put of the key got there first
                    unused.append(mine[:n][taken])
                    digests = [d for d, t in zip(digests[:n], taken.tolist(), strict=True)
                               if not t]
                    mine = mine[:n][~taken]
                    n = len(mine)
            if n:
                host.index.insert(key, digests[:n], mine[:n])
                host.publish([mine[:n]], mine[:n], n)
            placed.append(digests[:n])
        host.free(np.sort(np.concatenate(unused)))
        return placed

    def _end(self, read: RemoteRead, now: float, placed: list[list[bytes]] | None = None
             ) -> None:
        """``placed``: the pages that arrived, per range (None: none did)."""
        read.over = True
        self._reads.remove(read)
        self._reading.subtract(key for key, _ in read.wanted)
        self._reading = +self._reading  # no key left at 0
        if placed is None:
            arrived, blocks = [0] * len(read.queries), 0
        else:
            keys: dict[tuple[str, ...], set[bytes]] = {}
            for (key, _), pages in zip(read.wanted, placed, strict=True):
                keys.setdefault(key, set()).update(pages)
            # Each lookup's own pages that arrived, from its first on.
            arrived = [next((i for i, d in enumerate(gap) if d not in keys.get(key, ())),
                            len(gap)) for key, gap in read.queries]
            blocks = sum(map(len, placed))
        self._count(read.queries, arrived, blocks, now - read.began)

    def _count(self, lookups: Wanted, arrived: list[int], blocks: int,
               spent: float | None) -> None:
        """``arrived``: per lookup, how many of its pages arrived; ``blocks``: the blocks
        read (a page two lookups asked for is read once). ``spent``: the wait for
        Mooncake, None where it was not asked (a miss at once), which is no wait: it
        would pull the mean wait down."""
        stats = self.stats_
        stats["remote_lookups"] += len(lookups)
        if spent is not None:
            stats["remote_lookup_waits"] += 1
            stats["remote_lookup_seconds_total"] += spent
            stats["remote_lookup_seconds_max"] = max(stats["remote_lookup_seconds_max"], spent)
        hits = sum(map(bool, arrived))
        stats["remote_hits"] += hits
        stats["remote_misses"] += len(lookups) - hits
        stats["remote_blocks_read"] += blocks
        stats["remote_bytes_read"] += blocks * self._io.block_bytes

    # ---- markers -------------------------------------------------------------------

    def invalidated(self, key: tuple[str, ...] | None) -> None:
        """Reads under way of this key (None: of any) bring nothing."""
        for read in self._reads:
            read.gone.update(k for k, _ in read.wanted if key in (None, k))

    def publish(self, wait: bool) -> Published:
        """Send the markers of the evicts and clears not out yet (:meth:`RemoteIO.publish`);
        ``wait``: block until they are out, or its time is up. Where the tier rests, or
        the reader thread is still in a call past its time (a master that does not
        answer), nothing is asked now: the answer is a failure at once, and the reader
        thread publishes them once the tier answers again (:meth:`RemoteIO._tend`)."""
        io = self._io
        if io.resting() or self.stuck:
            future: Future[Any] = Future()
            future.set_result(False)
        else:
            future = io.publish()
        published = Published(future, time.monotonic() + self._timeout_s)
        published.future.add_done_callback(self._returned)
        self._publishing.append(published)
        if wait:
            wait_for([published.future], self._timeout_s)
            self._published(time.monotonic())
        return published

    def _published(self, now: float) -> None:
        """Count the evicts and clears whose markers failed to go out, or were not out in
        time (the reader thread is then busy: lookups miss at once until it is not). The
        call's own failure is counted where it failed, its timeout here: a call that
        times out and then fails is one error, and so is one that several evicts shared
        (:meth:`RemoteIO.publish`)."""
        left = []
        for published in self._publishing:
            if published.future.done():
                if not self._answer(published.future):
                    self.stats_["remote_invalidation_errors"] += 1
            elif now >= published.deadline:
                if self._io.timed_out(published.future):
                    self.stats_["remote_timeouts"] += 1
                self.stats_["remote_invalidation_errors"] += 1
                self._busy = published.future
            else:
                left.append(published)
        self._publishing = left
