"""What the store server holds in each engine's name: a connection's matched tasks
(:class:`Client`, :class:`Task`), and a batch's entries while some of its gets wait
(:class:`PendingGet` for SSD reads, :class:`Retry` behind another get's reads)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..base import BoolArray, Int64Array
from ..local.index import Space
from ..local.loads import Load
from .wire import Answer, Query


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


@dataclass(slots=True, eq=False)
class PendingGet:
    """A get whose SSD pages are being read into host blocks (held since its match):
    answered once they are in, or once ``give_up_at`` passes (then with its host prefix)."""

    task: Task
    load: Load
    pages: int  # the query's full pages
    hit: int  # its host prefix, in pages
    namespace: tuple[str, ...]
    give_up_at: float


@dataclass(slots=True, eq=False)
class Retry:
    """A get of a key whose pages a pending get is reading from SSD: matched once that
    get is answered."""

    query: Query


# A batch's entry: its answer, or what it waits for.
Entry = Answer | PendingGet | Retry


@dataclass(slots=True)
class Client:
    """One connection's tasks (id -> task)."""

    number: int
    pid: int
    tasks: dict[int, Task] = field(default_factory=dict)


def answers_only(entries: Sequence[Entry]) -> list[Answer] | None:
    """A batch's answers, or None while an entry waits (a PendingGet or a Retry)."""
    answers = [e for e in entries if not isinstance(e, (PendingGet, Retry))]
    return answers if len(answers) == len(entries) else None


__all__ = ["Answer", "Client", "Entry", "Foreign", "PendingGet", "Retry", "Task", "answers_only"]
