"""What the store server holds in each engine's name: a connection's matched tasks
(:class:`Client`, :class:`Task`), and a batch's entries while some of its gets wait
(:class:`PendingGet` for SSD reads, :class:`Retry` behind another get's reads)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..base import BoolArray, Int64Array
from ..local.index import Space
from ..local.load import Load
from .notice import Notice
from .wire import Answer, Query

NO_MASK: BoolArray = np.zeros(0, dtype=np.bool_)  # the mask of a task not answered yet


class Foreign(Exception):
    """A request that names a task its connection does not hold."""


@dataclass(slots=True, eq=False)
class Task:
    """One matched task, as the SSD link and the host tier see LocalStore's."""

    client: int
    is_put: bool
    mask: BoolArray
    blocks: Int64Array
    digests: list[bytes]
    space: Space | None
    shared: bool = False
    load: Load | None = None
    matching: bool = True  # still inside its match: an SSD part given up is not its end
    namespace: tuple[str, ...] | None = None  # a get's key (an evict's or clear's test)
    launched: bool = False  # a get its engine announced it copies (LAUNCH)
    invalidated: bool = False  # a get an evict or clear took back: it loads nothing


@dataclass(slots=True, eq=False)
class PendingGet:
    """A get whose SSD pages (held since its match) wait for host room, then are read
    into host blocks: answered once they are in, or once ``give_up_at`` passes (then with
    its host prefix): its batch's deadline, or the server's own ``limit``
    (``deferred.SSD_STAGE_TIMEOUT_S`` after its match) where that comes first."""

    task: Task
    load: Load
    pages: int  # the query's full pages
    hit: int  # its host prefix, in pages
    namespace: tuple[str, ...]
    give_up_at: float
    limit: float  # the server's own limit on its reads
    # Its key was evicted ("evicted") or cleared ("cleared") meanwhile: answered, then
    # taken back so.
    invalidated: str | None = None
    ended: bool = False  # answered or abandoned: its reads are no longer its key's


@dataclass(slots=True, eq=False)
class Retry:
    """A get of a key whose pages a pending get is reading from SSD, or a read from
    Mooncake is bringing: matched once that is over, or once its batch's deadline ``by``
    passes (then with its host prefix). ``asked``: it had its own pages asked of Mooncake
    (else they are asked then, from the host tier's first gap on)."""

    query: Query
    by: float = math.inf  # its batch's deadline (time.monotonic(); inf: none)
    asked: bool = False


# A batch's entry: its answer, or what it waits for.
Entry = Answer | PendingGet | Retry


@dataclass(slots=True)
class Client:
    """One connection's tasks (id -> task), its notice word (:mod:`.notice`, from its
    hello) and the ids of its gets invalidated since it last asked, each with what took
    it back ("evicted" or "cleared": its engine's Lookup says which)."""

    number: int
    pid: int
    tasks: dict[int, Task] = field(default_factory=dict)
    notice: Notice | None = None
    invalidated: dict[int, str] = field(default_factory=dict)
    # Its notice word's value before an evict under way bumped it, until that evict has
    # taken its gets back: the seq an answer meanwhile gives (not one that covers the bump).
    before_bump: int | None = None

    def launched(self, ids: Sequence[int]) -> None:
        """It copies these gets now (LAUNCH); Foreign unless each is a get it holds."""
        for task_id in ids:
            task = self.tasks.get(task_id)
            if task is None or task.is_put:
                raise Foreign(f"task {task_id} is not a get held by this connection")
            task.launched = True

    def gets_of(self, namespace: tuple[str, ...] | None) -> list[tuple[int, Task]]:
        """Its gets of ``namespace`` (None: of every key) not taken back yet."""
        return [(task_id, task) for task_id, task in self.tasks.items()
                if not task.is_put and not task.invalidated
                and (namespace is None or task.namespace == namespace)]

    def take_back(self, ids: Sequence[int], why: str) -> int:
        """These gets load nothing (``why``: "evicted" or "cleared"): listed for its next
        ``invalidated`` question, and its notice word bumped so that it asks
        (:mod:`.notice`). How many."""
        if not ids:
            return 0
        for task_id in ids:
            self.tasks[task_id].invalidated = True
        # Kept to those still held: an engine that looks up and lets go, but never loads,
        # never asks, and the list would grow with every evict of what it looked up.
        tasks = self.tasks
        self.invalidated = {t: w for t, w in self.invalidated.items() if t in tasks}
        self.invalidated.update(dict.fromkeys(ids, why))
        if self.notice is not None:
            self.notice.bump()
        return len(ids)

    def take_invalidated(self) -> dict[int, str]:
        """Its gets taken back since it last asked (and still held), and by what."""
        ids, self.invalidated = self.invalidated, {}
        return {t: why for t, why in ids.items() if t in self.tasks}


def answers_only(entries: Sequence[Entry]) -> list[Answer] | None:
    """A batch's answers, or None while an entry waits (a PendingGet or a Retry)."""
    answers = [e for e in entries if not isinstance(e, (PendingGet, Retry))]
    return answers if len(answers) == len(entries) else None


__all__ = ["NO_MASK", "Answer", "Client", "Entry", "Foreign", "PendingGet", "Retry", "Task",
           "answers_only"]
