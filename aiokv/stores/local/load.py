"""One get's pages across the tiers (:class:`Load`): which of its match's pages are on the
host and which the SSD tier holds, what is staged and verified so far, and where what it
brings ends. :mod:`.staging` stages them (host room reserved, reads started),
:mod:`.loads` copies them on; :mod:`.takeover` hands a load's reads to a later match of
its key.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base import Int64Array
from .blocks import NO_BLOCKS, Tier
from .index import Space
from .ssd import SsdRequest


@dataclass(slots=True, eq=False)
class Load:
    """A get task's SSD part: pages ``at`` of its match; the task's host pages (its
    ``blocks`` until the load finishes) are pages ``host_at``."""

    task: Any
    match_pages: int
    key: tuple[str, ...]
    digests: list[bytes]
    slots: Int64Array  # held on SSD until read
    # The match's page of each SSD page it brings (ascending); past ``slots`` (an SSD
    # part cut short), the page where what the load brings ends. Shorter than ``slots``
    # once cut to a prefix a match of it took it over for (takeover.py): the
    # pages read past it are not brought.
    at: Int64Array
    host_at: Int64Array  # the match's page of each of the task's host blocks (ascending)
    # Its match's pages' digests (chained: page i's names pages 0..i), by which a match
    # of these pages, or of a prefix of them, finds it once it is cancelled
    # (takeover.py).
    chain: list[bytes] = field(default_factory=list)
    host_blocks: Int64Array = field(default_factory=lambda: NO_BLOCKS)  # staged on host
    space: Space | None = None  # the host table the staging blocks are in
    reads: list[SsdRequest] = field(default_factory=list)
    resolved: int = 0  # reads settled, in order
    settled: int = 0  # SSD-part pages settled
    good: int = 0  # SSD-part pages verified in order (the loadable ones)
    truncated: bool = False
    submitted: int = 0  # SSD-part pages queued for their GPU copy
    gpu_pages: Any = None  # the caller's page ids (a tensor), set at launch
    ready: Sequence[Any] = ()  # the caller's ready events, set at launch
    invalid: str | None = None  # why the copier refused some of its page ids
    staged: bool = False  # host blocks reserved and reads started
    prefetched: int = 0  # host blocks staged before launch, counted in _prefetched
    deadline: float | None = None  # time.monotonic(): nothing staged or queued after it
    expired: str | None = None  # why it stopped at its deadline (the task ends EXPIRED)
    host_copies: int = 0  # the GPU copies of its host pages queued at launch, not done
    host_released: bool = False  # its host pages went back once copied (job_done)
    # The store server's get (``start_load(waits=True)``): owed room only while room
    # comes back by itself (``room_coming``); once none does, it leaves the owed queue
    # unstaged where the room there is cannot stage it (``stage_waiting``).
    while_coming: bool = False
    cancelled: bool = False
    finished: bool = False
    error: str | None = None
    # A match of its first ``cut_to`` pages took it over (takeover.py): cut to them
    # only at launch or once its reads are in, so that, given back before, it is still
    # whole for a match of all of its pages.
    cut_to: int | None = None

    @property
    def pages(self) -> int:
        """The pages its match reported (its task's mask, its launch's page ids)."""
        return self.match_pages if self.cut_to is None else self.cut_to

    def upto(self, ssd_pages: int) -> int:
        """The pages from the first up to its SSD page ``ssd_pages`` (all, past its last)."""
        return int(self.at[ssd_pages]) if ssd_pages < len(self.at) else self.match_pages

    @property
    def loaded(self) -> int:
        """The pages it brings, from the first: up to its first SSD page not verified."""
        return self.upto(self.good)


def page_runs(at: Int64Array) -> list[tuple[int, int]]:
    """``at``'s runs of consecutive pages, as index ranges (one empty one if none)."""
    cuts = [0, *(np.flatnonzero(np.diff(at) != 1) + 1).tolist(), len(at)]
    return list(itertools.pairwise(cuts))


def look_up(tier: Tier, key: tuple[str, ...], digests: list[bytes]) -> Int64Array:
    """Each digest's block in ``tier``'s table of ``key``, -1 where it has none."""
    space = tier.index.space(key)
    if space is None:
        return np.full(len(digests), -1, dtype=np.int64)
    return np.fromiter(map(space.get, digests, itertools.repeat(-1)), dtype=np.int64,
                       count=len(digests))
