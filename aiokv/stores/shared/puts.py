"""The store server's put matches: LocalStore.put_match for each query of a batch, with
one reservation for the batch where its keys are distinct.

The pages that neither the host nor the SSD tier stores get host blocks (WRITING, in the
index: a second put of them, from any engine, is answered no room until that write is
in or rolled back, :mod:`..local.claims`, and then writes nothing, or what that write
failed to store); the pages stored become the most recent. A put whose blocks cannot be
had now is answered (why, NO_SPACE), for the engine to wait and match again; one with more
new pages than the host tier has blocks (why, TOO_LARGE), for the engine to fail it."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from ..base import BoolArray, Int64Array, NoSpace, TooLarge
from ..local.blocks import NO_BLOCKS, Tier
from ..local.claims import check_fits, check_written, on_host, to_hold
from ..local.index import Space
from ..local.tiering import TierLink
from .tasks import Task
from .wire import NO_SPACE, TOO_LARGE, Query, Refusal


def match_puts(host: Tier, link: TierLink | None, client: int, queries: Sequence[Query]
               ) -> list[Task | Refusal]:
    """Each query's task (for connection ``client``), or (why, NO_SPACE) where its blocks
    cannot be had now, (why, TOO_LARGE) where they never can, in order, each as if
    alone."""
    namespaces = {space for _, _, space in queries}
    if len(queries) > 1 and len(namespaces) == len(queries):
        # Distinct namespaces never share a block: every lookup first, then one
        # reservation for the batch; when it cannot be had whole, one by one.
        with contextlib.suppress(NoSpace, TooLarge):
            return list(reserve(host, link, client, queries))
    answers: list[Task | Refusal] = []
    for query in queries:  # a key twice in a batch: its second put sees the first's
        try:
            answers += reserve(host, link, client, [query])
        except NoSpace as exc:
            answers.append((str(exc), NO_SPACE))
        except TooLarge as exc:
            answers.append((str(exc), TOO_LARGE))
    return answers


def reserve(host: Tier, link: TierLink | None, client: int, queries: Sequence[Query]
            ) -> list[Task]:
    """The queries' tasks (distinct namespaces), their new pages' blocks reserved and in
    the index; NoSpace, with nothing reserved, when they cannot all be had now (TooLarge:
    one never can)."""
    index = host.index
    tables: list[Space | None] = []
    presents: list[list[int | None] | None] = []
    held: list[Int64Array] = []  # per query with pages stored: those on the host
    missing = 0
    for _, digests, namespace in queries:
        table = index.space(namespace)
        present = None if table is None else list(map(table.get, digests))
        if link is not None:
            present = link.mark_stored_below(namespace, digests, present)
        tables.append(table)
        presents.append(present)
        lacking = len(digests) if present is None else present.count(None)
        # With no SSD tier every stored page is held out of the LRU (claims.to_hold).
        check_fits(host, lacking, len(digests), len(digests) - lacking if link is None else 0)
        missing += lacking
        if present is not None and lacking < len(present):
            stored = on_host(present)
            check_written(host, stored)  # before anything changed: NoSpace for it alone
            held.append(to_hold(host, link, namespace, digests, present, stored, lacking))
    # Stored pages become the most recent, and are not evicted by this reservation (but
    # for those the SSD has: claims).
    listed = index.make_unevictable(np.concatenate(held)) if held else NO_BLOCKS
    try:
        if missing and link is not None:
            link.staging.leave_owed(missing)  # gets waiting for host room go first
        blocks = host.reserve(missing) if missing else NO_BLOCKS
    finally:
        if len(listed):
            if len(listed) != sum(map(len, held)):
                held = [h[np.isin(h, listed)] for h in held]
            index.make_evictable_many(held)
    tasks: list[Task] = []
    writing: list[Task] = []  # only these enter the index: an empty table would stay
    keys: list[tuple[str, ...]] = []
    at = 0
    for (_, digests, namespace), table, present in zip(queries, tables, presents,
                                                       strict=True):
        if present is None:
            mask, new = _all_true(len(digests)), digests
        else:
            new_pages = [i for i, b in enumerate(present) if b is None]
            mask = np.zeros(len(digests), dtype=np.bool_)
            mask[new_pages] = True
            new = [digests[i] for i in new_pages]
        task = Task(client, True, mask, blocks[at : at + len(new)], new, table)
        at += len(new)
        tasks.append(task)
        if new:
            writing.append(task)
            keys.append(namespace)
    if writing:
        spaces = index.insert_many(keys, [t.digests for t in writing], blocks)
        for task, space in zip(writing, spaces, strict=True):
            task.space = space
    return tasks


_ALL_TRUE = np.ones(0, dtype=np.bool_)


def _all_true(pages: int) -> BoolArray:
    """A read-only mask of ``pages`` Trues (a view: a put's mask is never written)."""
    global _ALL_TRUE
    if len(_ALL_TRUE) < pages:
        _ALL_TRUE = np.ones(max(pages, 2 * len(_ALL_TRUE), 4096), dtype=np.bool_)
        _ALL_TRUE.flags.writeable = False
    return _ALL_TRUE[:pages]
