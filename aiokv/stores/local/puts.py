"""The embedded store's put matches (``LocalStore.put_match`` and ``put_match_many``):
which of a put's pages are stored already, which it must write, and the host blocks it
reserves for them, under the rules of :mod:`.claims`.

A batch's puts of keys the store has never seen (:func:`new_keys`), one after another,
take their blocks in one reservation and one index insert, as one put of all their pages
would: nothing of theirs is stored, nothing is held, and their keys differ, so their
order changes nothing but the work (one eviction and one allocation, not one per put:
the store round's matches took 2.2 ms one by one against 0.9 ms so, for 32 x 2048 on a
2-core box). A put of a stored key between them keeps its place: it makes its pages the
most recent before the puts after it evict. With an SSD or remote tier, the puts are
matched one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ...remote.link import RemoteLink
from ..base import BoolArray, Int64Array, MatchAnswers, NoSpace, Queries
from .blocks import NO_BLOCKS, Tier
from .claims import check_fits, check_written, on_host, to_hold
from .completion import Task
from .digests import ChainMemo
from .tiering import TierLink


class NewKey(NamedTuple):
    """A batch's put of a key the store has never seen: its query's index, the key, its
    pages' digests and its tokens."""

    query: int
    key: tuple[str, ...]
    digests: list[bytes]
    tokens: int


def new_keys(host: Tier, queries: Queries, memo: ChainMemo) -> list[NewKey]:
    """The puts of ``queries`` whose key neither the host tier knows nor an earlier query
    of the batch names, with at least one full page and no more than the tier has
    blocks: each is all new pages. The others (a key's second put among them, which must
    see the first's pages as being written) are matched one by one after them."""
    capacity = host.alloc.capacity  # where pinning stopped short, the pinned blocks
    fresh: list[NewKey] = []
    seen: set[tuple[str, ...]] = set()
    for index, (token_ids, namespace) in enumerate(queries):
        key = tuple(namespace)
        if key in seen:
            continue
        seen.add(key)
        if host.index.space(key) is not None:
            continue
        digests = memo.digests(key, token_ids)
        if digests and len(digests) <= capacity:
            fresh.append(NewKey(index, key, digests, len(token_ids)))
    return fresh


class Puts:
    """A registered store's put matches: over its host tier, the SSD link and the remote
    tier below it (None without them); ``memo`` hashes the keys' tokens (the store's
    lookups share it); ``new_task`` files a task and gives its id."""

    def __init__(self, host: Tier, link: TierLink | None, remote: RemoteLink | None,
                 memo: ChainMemo, page_size: int, new_task: Callable[[Task], int]) -> None:
        self._host = host
        self._link = link
        self._remote = remote
        self._memo = memo
        self._page_size = page_size
        self._new_task = new_task

    def match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """Reserve blocks for the pages not yet stored (in either tier); mask True = must
        write. Raises NoSpace when some page is new and the host tier cannot take all new
        pages now (also while blocks it would evict are still being written to SSD), and
        while a page of the key is still being written; TooLarge when the new pages are
        more than the host tier can ever hold (:mod:`.claims`)."""
        host = self._host
        link = self._link
        if link is not None:
            link.drain()
        if self._remote is not None:
            self._remote.drain()
        page_size = self._page_size
        key = tuple(namespace)
        digests = self._memo.digests(key, token_ids)
        n = len(digests)
        space = host.index.space(key)
        present: list[int | None] | None = (
            list(map(space.get, digests)) if space is not None else None
        )
        if link is not None:
            present = link.mark_stored_below(key, digests, present)
        missing_count = n if present is None else present.count(None)
        # With no SSD tier every stored page is held out of the LRU (claims.to_hold).
        check_fits(host, missing_count, n, n - missing_count if link is None else 0)
        if present is not None and missing_count < n:
            held = on_host(present)
            check_written(host, held)  # a page still being written is not stored yet
            # Stored pages become the most recent; while new blocks are reserved, they are
            # out of the LRU so that eviction cannot take them (but for SSD copies: claims).
            held = to_hold(host, link, key, digests, present, held, missing_count)
            listed = host.index.make_unevictable(held)
        else:
            listed = None
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        blocks = NO_BLOCKS
        new_digests: list[bytes] = []
        owner = space
        if missing_count:
            try:
                if link is not None:
                    link.staging.leave_owed(missing_count)  # loads launched before it wait for room
                blocks = host.reserve(missing_count)
            finally:
                if listed is not None:
                    host.index.make_evictable(listed)
            if present is None or missing_count == n:
                first, new_digests = 0, digests
            else:
                first = present.index(None)
                new_digests = [d for d, b in zip(digests, present, strict=True) if b is None]
            owner = host.index.insert(key, new_digests, blocks)
            if self._remote is not None:
                self._remote.expect(key)
            if n - first == missing_count:  # the usual: a suffix
                mask[first * page_size : n * page_size] = True
            else:
                pages = mask[: n * page_size].reshape(-1, page_size)
                assert present is not None
                pages[[i for i, b in enumerate(present) if b is None]] = True
        elif listed is not None:
            host.index.make_evictable(listed)
        return self._new_task(Task(True, mask, blocks, new_digests, owner)), mask

    def match_many(self, queries: Queries) -> MatchAnswers:
        """``match`` of each query in order (an answer or the exception it raised);
        each run of puts of keys never seen takes its blocks in one reservation
        (:func:`.claims.new_keys`). With an SSD or remote tier, one by one."""
        host = self._host
        fresh = ({new.query: new for new in new_keys(host, queries, self._memo)}
                 if self._link is None and self._remote is None else {})
        answers: MatchAnswers = []
        at = 0
        while at < len(queries):
            run: list[NewKey] = []
            while at + len(run) < len(queries) and at + len(run) in fresh:
                run.append(fresh[at + len(run)])
            if len(run) > 1:
                answers += self._new(host, run, queries)
                at += len(run)
            else:  # in order: a put of a stored key first makes its pages recent
                answers.append(self._one(*queries[at]))
                at += 1
        return answers

    def _new(self, host: Tier, run: list[NewKey], queries: Queries) -> MatchAnswers:
        """Puts of keys never seen, one after another in the batch: their blocks in one
        reservation, else (no room for all) one by one, as put_match would."""
        try:
            blocks = host.reserve(sum(len(new.digests) for new in run))
        except NoSpace:
            return [self._one(*queries[new.query]) for new in run]
        owners = host.index.insert_many([new.key for new in run],
                                        [new.digests for new in run], blocks)
        answers: MatchAnswers = []
        at = 0
        for new, owner in zip(run, owners, strict=True):
            mask = np.zeros(new.tokens, dtype=np.bool_)
            mask[: len(new.digests) * self._page_size] = True
            mine = blocks[at : at + len(new.digests)]
            at += len(new.digests)
            answers.append((self._new_task(Task(True, mask, mine, new.digests, owner)), mask))
        return answers

    def _one(self, token_ids: Int64Array, namespace: Sequence[str]
                 ) -> tuple[int, BoolArray] | Exception:
        try:
            return self.match(token_ids, namespace)
        except Exception as exc:  # that query's answer, as one by one
            return exc
