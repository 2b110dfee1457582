"""The store server's gets that wait: a get whose pages only the SSD tier has is read into
host blocks before its match is answered (a :class:`PendingGet` while the reads run, and
before them while no host block is free for them but SSD copies or remote writes hold
some that no get reads: room comes back as they end; where none do, the room is held by
tasks only their engines end, the asking one's perhaps, which is blocked in this get: it
is answered with its host pages at once, and once the copies are in without the room),
and a get of a key whose pages are being read, from SSD by a pending get or from
Mooncake by a batch's remote read, waits for that (a :class:`Retry`), so that it finds
them on the host rather than missing them. The batch's answer waits for all of them
(:meth:`DeferredGets.settle`) while the server answers other requests, but never past the
batch's deadline (``by``, its engine's ``request_timeout_ms``, sent with it: that engine's
store thread is blocked in the call, and none of its callers takes an answer after it)
nor SSD_STAGE_TIMEOUT_S: each get is answered then with what it has, its host prefix.

:class:`DeferredGets` keeps which keys are being staged and hands each waiting get back
to the service (:class:`Matcher`) to be matched again or answered once it is ready. It
runs on the server's one thread, as the service does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ...remote.link import RemoteLink
from ..local.blocks import NO_BLOCKS
from ..local.load import Load
from ..local.tiering import TierLink
from .tasks import NO_MASK, Client, Entry, PendingGet, Retry, Task
from .wire import Answer, Query

log = logging.getLogger("aiokv.server")

# A get whose SSD pages are not read into host blocks by then (SSD copies that hold the
# room for them that long, or slow reads) is answered with what was: as long as an
# embedded store's load waits for room without request_timeout_ms (space.NO_TIMEOUT_WAIT_S).
SSD_STAGE_TIMEOUT_S = 30.0


class Matcher(Protocol):
    """What the deferred gets need of the service (:class:`.service.Service`)."""

    def get_match(self, client: Client, tokens: int, digests: list[bytes],
                  namespace: tuple[str, ...], by: float = ...) -> Entry: ...  # matched now

    def answer_staged(self, client: Client, pending: PendingGet) -> Answer: ...

    def poll(self) -> None: ...  # apply finished SSD requests and remote calls


class DeferredGets:
    """The gets waiting for reads into host blocks, over one service's SSD link and
    remote tier (either None without that tier)."""

    def __init__(self, matcher: Matcher, link: TierLink | None,
                 remote: RemoteLink | None) -> None:
        self._matcher = matcher
        self._link = link
        self._remote = remote
        self._staging: dict[tuple[str, ...], int] = {}  # pending gets' keys -> how many
        # Gets answered or gone while their SSD reads ran (at their engine's deadline,
        # or their connection went): the reads go on (they cannot be recalled) and their
        # keys stay being read until they are in, or until the server's own limit on
        # their reads (``PendingGet.limit``).
        self._abandoned: list[PendingGet] = []

    @property
    def staging(self) -> int:
        """The pending gets whose SSD reads run (those of gone connections too)."""
        self._reap()
        return sum(self._staging.values())

    def reading(self, namespace: tuple[str, ...]) -> bool:
        """Pages of this key are being read into host blocks, from SSD or Mooncake."""
        self._reap()
        return namespace in self._staging or (
            self._remote is not None and self._remote.reads.reading(namespace))

    def ask_remote(self, queries: Sequence[Query]) -> set[tuple[str, ...]]:
        """One read from Mooncake, for a batch of gets, of what neither the host nor the
        SSD tier has; the gets of its keys wait for it (get_match: a Retry). The keys it
        reads."""
        assert self._remote is not None
        self._matcher.poll()
        link = self._link
        read = self._remote.reads.start([(ns, digests) for _, digests, ns in queries
                                         if ns not in self._staging],
                                        link.ssd.has if link is not None else None)
        return set() if read is None else {key for key, _ in read.wanted}

    def stage(self, task: Task, load: Load, pages: int, hit: int,
              namespace: tuple[str, ...], by: float = math.inf) -> PendingGet:
        """A get whose SSD pages wait for host room (while it comes back by itself) or
        for their reads: answered by :meth:`settle` once they are in, or with its host
        pages once no room is coming, or at its batch's deadline ``by`` or after
        SSD_STAGE_TIMEOUT_S, whichever comes first (the link gives up staging it then,
        its ``deadline``)."""
        self._staging[namespace] = self._staging.get(namespace, 0) + 1
        limit = time.monotonic() + SSD_STAGE_TIMEOUT_S
        give_up_at = min(limit, by)
        load.deadline = give_up_at
        return PendingGet(task, load, pages, hit, namespace, give_up_at, limit)

    def settle(self, client: Client, entries: Sequence[Entry]) -> list[Entry]:
        """A deferred batch's entries again, the ready ones answered: pending gets whose
        reads are in (or that waited too long, or wait for room no SSD copy brings back
        now), retries whose key nothing reads now or whose batch's deadline passed (their
        host prefix then)."""
        self._matcher.poll()
        now = time.monotonic()
        link = self._link
        out: list[Entry] = []
        for entry in entries:
            if isinstance(entry, PendingGet) and (
                    entry.load.finished or now >= entry.give_up_at
                    or not (entry.load.staged or link is None or link.staging.room_coming())):
                entry = self._finish(client, entry)
            elif isinstance(entry, Retry) and (
                    now >= entry.by or not self.reading(entry.query[2])):
                if now < entry.by and self._remote is not None and not entry.asked:
                    # It waited for another get's read, which may have brought fewer of
                    # its pages than it asks for: the rest are asked now, once.
                    entry.asked = True
                    self.ask_remote([entry.query])
                if now >= entry.by or not self.reading(entry.query[2]):
                    entry = self._matcher.get_match(client, *entry.query, by=entry.by)
            out.append(entry)
        return out

    def abandon(self, entries: Sequence[Entry]) -> None:
        """A deferred batch whose connection went: its pending gets' reads end them
        (their blocks given back once in); its answered tasks are the client's, ended
        by the service's ``drop``."""
        for entry in entries:
            # Skips a get answered before its batch failed (the batch is then abandoned
            # as the connection sent it, ended gets among the rest).
            if isinstance(entry, PendingGet) and not entry.ended:
                entry.ended = True
                entry.task.matching = False  # the link's end of it is its end
                assert self._link is not None  # a load came from it
                self._link.loads.cancel_load(entry.load)
                # Its key stays being read until the reads are in: a get of it meanwhile
                # waits for them (a Retry) rather than missing blocks still being filled.
                self._abandoned.append(entry)
        self._reap()

    def _finish(self, client: Client, pending: PendingGet) -> Answer:
        pending.ended = True
        link, load = self._link, pending.load
        assert link is not None  # a load came from it
        if load.staged and not load.finished and time.monotonic() < pending.limit:
            # Answered at its engine's deadline, its reads go on: other engines' gets of
            # the key wait for them (a Retry, up to their own deadlines) rather than miss
            # blocks still being filled, as for a get whose engine went (one engine's
            # short request_timeout_ms is not a miss for the others).
            self._abandoned.append(pending)
        else:
            self._staged_out(pending.namespace)
        if load.finished:
            pending.hit = launch_staged(link, load)
        else:  # the get answers its host prefix; the reads go on, in a task of their own
            if pending.give_up_at < pending.limit and time.monotonic() >= pending.give_up_at:
                # Its engine's request_timeout_ms: a short one is no fault of the server's.
                log.debug("aiokv store-server: a get answered its host prefix at its "
                          "engine's deadline, %d SSD pages not read in by then",
                          len(load.slots))
            elif load.staged or time.monotonic() >= pending.give_up_at:
                log.warning("aiokv store-server: SSD reads of %d pages took over %.0f s%s",
                            len(load.slots), SSD_STAGE_TIMEOUT_S,
                            "" if load.staged else " (no host room for them)")
            # Ended (their blocks freed) when they are in, apart from the get's own end.
            load.task = Task(client.number, False, NO_MASK, NO_BLOCKS, [], None,
                             matching=False)
            link.loads.cancel_load(load)
            keep_loaded(link, load, pending.task, pending.hit)
        return self._matcher.answer_staged(client, pending)

    def _reap(self) -> None:
        """Abandoned gets whose reads are in (or that waited too long, as a pending get
        gives up): their keys are no longer being read."""
        if not self._abandoned:
            return
        now = time.monotonic()
        still = []
        for pending in self._abandoned:
            if pending.load.finished or now >= pending.limit:
                self._staged_out(pending.namespace)
            else:
                still.append(pending)
        self._abandoned = still

    def _staged_out(self, namespace: tuple[str, ...]) -> None:
        self._staging[namespace] -= 1
        if not self._staging[namespace]:
            del self._staging[namespace]


def launch_staged(link: TierLink, load: Load) -> int:
    """Staged and verified: task.blocks is now its pages' blocks in page order
    (loads._finish); the launch only settles the loads' books (its copy is the engine's,
    the service's ``_no_copy``). The get is answered with the pages it loads
    (:func:`keep_loaded`); returns how many of them are host pages."""
    link.loads.launch_load(load, np.arange(load.match_pages, dtype=np.int64), ())
    return keep_loaded(link, load, load.task, load.loaded)


def keep_loaded(link: TierLink, load: Load, task: Task, pages: int) -> int:
    """A get is answered with the blocks of exactly the pages it loads, from the first:
    ``task`` (``load``'s, or the one it was taken from, whose blocks are its host pages)
    keeps the first ``pages`` of its blocks (in page order); the host pages it held past
    them (after an SSD page: :meth:`~..local.loads.Loads.start_load`) go back now.
    Returns how many of those it keeps are host pages."""
    past = task.blocks[pages:]
    if len(past):
        link.host.drop_readers(past)
        task.blocks = task.blocks[:pages]
    return int(np.searchsorted(load.host_at, pages))


__all__ = ["SSD_STAGE_TIMEOUT_S", "DeferredGets", "Matcher", "keep_loaded", "launch_staged"]
