"""Blocks of a live engine the server dropped: kept out of use until its copies are over.

An engine copies its puts' pages into the region itself, and the server cannot stop a copy
it has queued (on a GPU, DMA). When the server drops an engine whose process is still alive
(an evict waited too long for its loads, a request it refused, a reply it did not read),
that engine's puts under way could still land in their blocks: freed at once, those would
go to another engine's put, which the late copy would then overwrite, silently. So a live
engine's put blocks stay reserved, out of the index, until its process exits (a pidfd the
server's loop watches; ``server_blocks_quarantined`` counts them meanwhile). Not at its
next connection: a process may hold several, and the copies of the one dropped may still
run. An engine that died (kill -9) has its blocks freed at once, as before.
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import dataclass, field

import numpy as np

from ..base import Int64Array
from ..local.blocks import NO_BLOCKS


@dataclass(slots=True)
class _Held:
    pidfd: int
    blocks: list[Int64Array] = field(default_factory=list)


class Quarantine:
    """Per engine pid: the blocks held and the pidfd that says when it exited."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}

    @staticmethod
    def alive(pid: int) -> int | None:
        """A pidfd of ``pid`` while that process still runs; None once it exited (or
        where pidfds are not available: then nothing is held, as before)."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # exited and reaped, or no pidfd_open
            return None
        readable, _, _ = select.select([pidfd], [], [], 0)
        if readable:  # exited (a zombie): its copies are over
            os.close(pidfd)
            return None
        return pidfd

    def hold(self, pid: int, pidfd: int, blocks: Int64Array) -> bool:
        """Keep ``blocks`` until ``pid`` exits; True when ``pidfd`` is new
        (the caller watches it), False when it was watched already (closed here)."""
        held = self._held.get(pid)
        if held is not None:
            os.close(pidfd)
            held.blocks.append(blocks)
            return False
        self._held[pid] = _Held(pidfd, [blocks])
        return True

    def release(self, pid: int) -> tuple[int | None, Int64Array]:
        """``pid`` exited (or the server closes): its pidfd (to stop watching and close) and its
        blocks (sorted, to free); (None, no blocks) when none were held."""
        held = self._held.pop(pid, None)
        if held is None:
            return None, NO_BLOCKS
        return held.pidfd, np.sort(np.concatenate(held.blocks))

    @property
    def blocks(self) -> int:
        return sum(len(b) for held in self._held.values() for b in held.blocks)

    def pids(self) -> list[int]:
        return list(self._held)

    def close(self) -> None:
        for held in self._held.values():
            with contextlib.suppress(OSError):
                os.close(held.pidfd)
        self._held.clear()
