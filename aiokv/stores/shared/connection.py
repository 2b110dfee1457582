"""What ``aiokv store-server`` keeps for each engine's connection: its socket, the bytes of
a frame still coming, its tasks (a :class:`~aiokv.stores.shared.tasks.Client`), and the
reply it waits for while the server answers the others: a batch of gets waiting for SSD
reads, or an evict waiting for other engines' loads (:class:`EvictWait`)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...remote.reads import Published
from ..local.ssd_voids import VoidsDone
from . import sockets, wire
from .tasks import Client, Entry


@dataclass(slots=True, eq=False)
class Connection:
    sock: socket.socket
    client: Client
    inbox: bytearray = field(default_factory=bytearray)
    registered: bool = False
    busy: bool = False  # its frames are being answered: not read again meanwhile
    deferred: list[Entry] | None = None  # a batch of gets waiting for SSD reads
    evicting: EvictWait | None = None  # an evict or clear waiting for loads under way
    # time.monotonic() by which the replies of this turn must be out: the server answers
    # on one thread, so a peer that reads them slowly would hold every other engine.
    reply_by: float | None = None

    def reply(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send a reply (OSError, TimeoutError included, drops the peer: the caller's)."""
        sockets.send(self.sock, data, fds, by=self.reply_by)

    @property
    def waits(self) -> bool:
        """Its reply waits: its later frames are kept until it is sent."""
        return self.deferred is not None or self.evicting is not None


@dataclass(slots=True, eq=False)
class EvictWait:
    """An evict's or clear's answer, sent once the gets of the key that other engines
    had under way (``loads``: client, task id) have ended, its SSD voids are written and
    its remote marker is out (or its own time is up), or at ``deadline``."""

    loads: list[tuple[Client, int]]
    tokens: int  # dropped
    deadline: float
    written: VoidsDone | None = None  # set once its SSD voids are on disk
    published: Published | None = None  # set once Mooncake has its marker, or at its time

    def reply(self) -> bytes:
        """The answer: the tokens dropped, or why the SSD may still hold the key (its
        voids' failure: the engine's evict raises it)."""
        failure = self.written.failure if self.written is not None else None
        if failure is not None:
            return wire.encode_json({"ok": False, "error": failure})
        return wire.encode_json({"ok": True, "tokens": self.tokens})

    def loads_over(self) -> bool:
        return all(task_id not in client.tasks for client, task_id in self.loads)

    def over(self) -> bool:
        return self.loads_over() and all(done is None or done.is_set()
                                         for done in (self.written, self.published))
