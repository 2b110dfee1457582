"""Blocks of a live engine the server dropped: kept out of use until its copies are over.

An engine copies its puts' pages into the region itself, and the server cannot stop a copy
it has queued (on a GPU, DMA). When the server drops an engine whose process is still alive
(an evict waited too long for its loads, a request it refused, a reply it did not read),
that engine's puts under way could still land in their blocks: freed at once, those would
go to another engine's put, which the late copy would then overwrite, silently. So a live
engine's put blocks stay reserved, out of the index, until its process exits (a pidfd the
server's loop watches; ``server_blocks_quarantined`` counts them meanwhile), or until the
engine says, in the hello of a later connection of that process, that the dropped
connection's copies have ended (it closes a lost link only once its copier threads have
finished). Not at any later connection of the process by itself: a process may hold
several, and the copies of the one dropped may still run. An engine that died (kill -9)
has its blocks freed at once, as before. Its gets under way are kept the same way, as
reads: their copies out of the region may still run, and their blocks, freed (an evict
buries them: the reads were all that kept them), would be another key's by then.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..base import Int64Array
from ..local.blocks import NO_BLOCKS
from .tasks import Task


@dataclass(slots=True)
class Kept:
    """What a dropped connection leaves held: its puts' blocks (out of the index, freed
    later) and its gets (their reads ended later)."""

    blocks: Int64Array = field(default_factory=lambda: NO_BLOCKS)
    gets: list[Task] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks) + sum(len(task.blocks) for task in self.gets)


def merged(kept: Iterable[Kept]) -> Kept:
    """Several connections' held blocks (sorted) and gets as one."""
    kept = list(kept)
    blocks = [k.blocks for k in kept if len(k.blocks)]
    return Kept(np.sort(np.concatenate(blocks)) if blocks else NO_BLOCKS,
                [task for k in kept for task in k.gets])


@dataclass(slots=True)
class _Held:
    pidfd: int
    kept: dict[int, list[Kept]] = field(default_factory=dict)  # per connection


class Quarantine:
    """Per engine pid: the blocks held, per dropped connection, and the pidfd that says
    when the process exited."""

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

    def hold(self, pid: int, connection: int, pidfd: int, kept: Kept) -> bool:
        """Keep what ``pid``'s dropped ``connection`` left until that process exits or says
        the connection's copies have ended; True when ``pidfd`` is new (the caller
        watches it), False when it was watched already (closed here)."""
        held = self._held.get(pid)
        if held is not None:
            os.close(pidfd)
            held.kept.setdefault(connection, []).append(kept)
            return False
        self._held[pid] = _Held(pidfd, {connection: [kept]})
        return True

    def release(self, pid: int) -> tuple[int | None, Kept]:
        """``pid`` exited (or the server closes): its pidfd (to stop watching and close)
        and what it left (to free and end); (None, nothing) when nothing was held."""
        held = self._held.pop(pid, None)
        if held is None:
            return None, Kept()
        return held.pidfd, merged(k for kept in held.kept.values() for k in kept)

    def ended(self, pid: int, connection: int) -> tuple[int | None, Kept]:
        """``pid`` says its dropped ``connection``'s copies have ended: what that
        connection left (to free and end), and the pidfd when nothing of ``pid`` is held
        any more (to stop watching and close); (None, nothing) when nothing was held."""
        held = self._held.get(pid)
        kept = None if held is None else held.kept.pop(connection, None)
        if held is None or kept is None:
            return None, Kept()
        pidfd = None
        if not held.kept:
            del self._held[pid]
            pidfd = held.pidfd
        return pidfd, merged(kept)

    @property
    def blocks(self) -> int:
        return sum(len(k) for held in self._held.values() for kept in held.kept.values()
                   for k in kept)

    def pids(self) -> list[int]:
        return list(self._held)

    def close(self) -> None:
        for held in self._held.values():
            with contextlib.suppress(OSError):
                os.close(held.pidfd)
        self._held.clear()
