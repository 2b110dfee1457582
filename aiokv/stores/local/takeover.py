"""Take-over: a match of a key takes over the SSD reads still out of a load of that key
whose own caller no longer wants them, rather than stop at the pages they are writing.

A prefetch cancelled while its reads are out (its Lookup released, or its ttl ran out)
ends once they are in (:mod:`.loads`). Until then its pages are in the host table, still
being written: a match of the key, which stops at such a page, takes it over instead
(:meth:`Takeover.adopt`), all of it where it asks for all of its pages, else the prefix it
asks for. It is cut to that prefix (``_cut``: the pages read past it are not brought, each
goes back to the LRU as it comes in verified) only once launched or its reads are in:
given back before, it is whole again for the next match, which may ask for all of it. A
user who gives a Lookup back and looks the key up again, up to an earlier token or to the
last, finds what is stored (being read in for it), not a miss to recompute.

A launched load past its deadline whose reads are still out becomes such a prefetch as
soon as a match of its key asks for its pages (``_hand_over``): it ends EXPIRED at once,
with the pages it queued, and its reads go on for that match, as a released Lookup's
prefetch's do. Otherwise that match would stop at the first page still being read in (a
caller's lookup right after its load timed out).

:class:`Takeover` keeps the launched loads not finished yet, among which a match looks
for those of its key; :class:`~.loads.Loads` tells it of each launch and finish, and
lends it what a hand-over needs: its deadline rule, a load's finish, and its staging's
booking of a staged load as a prefetch (:class:`~.staging.LoadStaging`, whose
prefetches ``adopt`` looks among). Runs on the store thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .blocks import READY, Tier
from .load import Load, look_up


class Takeover:
    """``host``, ``ssd``: the link's tiers. ``past_deadline``: whether a launched load
    reached its deadline (it then copies nothing more); ``prefetch``: book a staged load
    as a prefetch not launched (:meth:`.staging.LoadStaging.book_prefetch`); ``finish``:
    a load's reads are all settled, or it ends without them (:class:`~.loads.Loads`')."""

    def __init__(
        self, host: Tier, ssd: Tier, past_deadline: Callable[[Load], bool],
        prefetch: Callable[[Load], None], finish: Callable[[Load], None],
    ) -> None:
        self._host, self._ssd = host, ssd
        self._past_deadline, self._prefetch, self._finish = past_deadline, prefetch, finish
        self._launched: dict[Load, None] = {}  # launched, not finished: oldest launch first

    def launched(self, load: Load) -> None:
        """A load is launched: cut to the prefix its caller's page ids are for (a match
        of that prefix took it over); until it finishes, a match of its key may take its
        reads over once it is past its deadline."""
        self._cut(load)
        if not load.finished:
            self._launched[load] = None

    def finished(self, load: Load) -> None:
        """A load's reads are settled, or it ends without them: one taken over for a
        prefix is cut to it now; not one cancelled (it ends now, holding nothing)."""
        self._launched.pop(load, None)
        if not load.cancelled:
            self._cut(load)

    def adopt(
        self, key: tuple[str, ...], digests: list[bytes], prefetches: Iterable[Load]
    ) -> Any | None:
        """A match of ``key`` (``digests``: its pages') whose host prefix stops at a page
        still being written: where that is a cancelled prefetch's (of ``prefetches``: its
        Lookup released, or its ttl ran out, before its reads were in; or a launched
        load's past its deadline, which becomes one here: ``_hand_over``) that staged
        these pages, or a longer run of them, the match takes it over, rather than miss
        what is being read into the host for it. Returns its task (what it holds, its
        reads and its match: the pages it reported, though this match may ask for more;
        those this match asks for where it asks for fewer, ``Load.cut_to``), no longer
        cancelled; None where there is none (a key dropped since, a read that failed:
        the match stops at that page). A cancelled prefetch is never cut (``_cut``): it
        offers all of its pages."""
        space = self._host.index.space(key)
        for load in [x for x in self._launched if x.key == key and x.space is space]:
            # Past its deadline, a launched load copies nothing more: its reads still out
            # bring these pages for this match, not for a caller told RequestTimeout.
            if (load.staged and not load.host_released and load.error is None
                    and self._past_deadline(load) and self._keep_slots(load)):
                self._hand_over(load)
        for load in prefetches:
            pages = min(load.match_pages, len(digests))
            if (load.cancelled and load.key == key and load.space is space
                    and load.error is None and pages
                    and digests[pages - 1] == load.chain[pages - 1]
                    and int(load.at[0]) < pages):  # one of its SSD pages is asked for
                load.cut_to = pages if pages < load.match_pages else None
                load.cancelled = False
                load.deadline = None  # the cancelled request's (set_deadlines sets this one's)
                return load.task
        return None

    def _keep_slots(self, load: Load) -> bool:
        """A launched load's reads give their SSD slots back as they come in; the
        prefetch it is handed over to must keep its verified ones (``keep``), as one
        staged at a match does: giving way (``staging.LoadStaging._give_way``), it stages
        them again, and a slot gone back meanwhile may hold another key's page by then
        (read as a checksum failure, which drops that page). Those in already are held
        again where the SSD still has them for this key; where one is not, False: no
        hand-over."""
        tier = self._ssd
        came = [request for request in load.reads if request.arrived >= request.ops]
        if came:
            slots = np.concatenate([request.slots[request.ok] for request in came])
            digests = [d for request in came
                       for d, ok in zip(request.digests, request.ok.tolist(), strict=True) if ok]
            if not ((look_up(tier, load.key, digests) == slots).all()
                    and (tier.state[slots] == READY).all()):
                return False
            tier.hold(slots)
        for request in load.reads:
            request.keep = True
        return True

    def _hand_over(self, load: Load) -> None:
        """A launched load past its deadline, its reads still out: it ends now, with what
        it queued for its copy by then, and its reads go on for a cancelled prefetch of
        the same match, with a task of its own holding what its task held for the match
        (its host pages, and the SSD pages staged), which ``adopt`` gives the match that
        asks for them. Otherwise that match would stop at the first page still being read
        in: a miss of what the SSD holds and the host is about to, until the reads are in
        (a caller's lookup right after its load timed out)."""
        host, task, queued = self._host, load.task, load.submitted
        heir = dataclasses.replace(task, blocks=task.blocks[: len(load.host_at)], task_id=0,
                                   shared=False, load=None, deadline=None, marks=None)
        # Read by both until the load's task ends: its host pages, and the SSD pages its
        # copies were queued from. The reads' blocks past those are the heir's alone.
        both = np.concatenate((heir.blocks, load.host_blocks[:queued]))
        heir.shared = bool(len(both)) and host.hold(both)
        host.shared_gets += heir.shared
        heir.load = new = Load(
            heir, load.match_pages, load.key, load.digests, load.slots, load.at,
            load.host_at, chain=load.chain, host_blocks=load.host_blocks, space=load.space,
            reads=load.reads, resolved=load.resolved, settled=load.settled, good=load.good,
            truncated=load.truncated, staged=True, cancelled=True)
        for request in new.reads:
            request.owner = new
        self._prefetch(new)
        load.reads, load.host_blocks = [], load.host_blocks[:queued]
        load.resolved = load.settled = load.good = queued
        self._finish(load)

    def _cut(self, load: Load) -> None:
        """A prefetch taken over by a match of its first ``cut_to`` pages (``adopt``),
        now launched or its reads in, brings those only: its host pages past them go
        back now, its SSD pages past them as they come in (``loads.Loads._settle``: past
        ``at``, not loaded), those in already now. Not before: its match may be given
        back while its reads are out, and the next one take all of it over again."""
        pages = load.cut_to
        if pages is None:
            return
        load.cut_to = None
        host, task = self._host, load.task
        keep = int(np.searchsorted(load.host_at, pages))
        if keep < len(load.host_at):
            host.drop_readers(task.blocks[keep:])
            task.blocks, load.host_at = task.blocks[:keep], load.host_at[:keep]
        brings = int(np.searchsorted(load.at, pages))
        if load.good > brings:
            host.drop_readers(load.host_blocks[brings : load.good])
            load.good, load.truncated = brings, True
        load.at, load.chain, load.match_pages = load.at[:brings], load.chain[:pages], pages
