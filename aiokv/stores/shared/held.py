"""The store server's replies that wait for something while it answers the other engines:
a batch of gets whose pages are being read from SSD or Mooncake (``conn.deferred``, the
gets :mod:`.deferred` keeps), and an evict or clear waiting for the loads of the key that
other engines have under way, its SSD voids and its remote marker (``conn.evicting``, an
:class:`~.connection.EvictWait`).

:mod:`.answers` leaves such a reply on its connection; after each turn of its selector the
socket loop (:mod:`.server`) asks :class:`HeldReplies` to send those that are due. Kept
apart from the loop because when a reply is due is the service's business (its reads, its
tasks' ends), not the sockets': the loop only sends it, and then the frames its engine
sent meanwhile.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

from ..local.ssd_voids import VoidsDone
from . import wire
from .answers import EVICT_WAIT_S
from .connection import Connection
from .service import Service
from .tasks import PendingGet, Retry, answers_only

log = logging.getLogger("aiokv.server")


class Loop(Protocol):
    """What the held replies need of the socket loop (:class:`.server.StoreServer`)."""

    def peers(self) -> list[Connection]: ...  # every connection

    def drop(self, conn: Connection, why: str) -> None: ...  # disconnected, tasks rolled back

    def deliver(self, conn: Connection, reply: bytes) -> None: ...  # sent, then its frames


class HeldReplies:
    """The held replies of one server: :meth:`send` after each turn of the loop;
    :meth:`holding` while any waits (a drain waits for them too)."""

    def __init__(self, service: Service, loop: Loop) -> None:
        self.service = service
        self._loop = loop

    def holding(self) -> bool:
        return bool(self._waiting()) or bool(self._evicting())

    def wait_s(self, longest_s: float) -> float:
        """How long the loop may wait for a request or a wake: ``longest_s``, or until
        the first deadline of a waiting get (its batch is answered then, :meth:`send`)."""
        due = min((entry.give_up_at if isinstance(entry, PendingGet) else entry.by
                   for conn in self._waiting() for entry in conn.deferred or ()
                   if isinstance(entry, (PendingGet, Retry))), default=math.inf)
        return min(longest_s, max(0.0, due - time.monotonic()))

    def send(self) -> None:
        """Send the replies that are due."""
        if self._waiting():
            self._settle()
        if self._evicting():
            self._answer_evicts()

    def abandon(self, conn: Connection) -> None:
        """``conn`` is being dropped: its waiting gets' reads end them (their tasks are
        the client's, rolled back with it)."""
        if conn.deferred is not None:
            self.service.abandon(conn.deferred)
            conn.deferred = None

    def _waiting(self) -> list[Connection]:
        """The connections whose batch of gets waits (:meth:`_settle`)."""
        return [c for c in self._loop.peers() if c.deferred is not None]

    def _settle(self) -> None:
        """Answer the deferred batches whose gets are all ready, oldest first, and then
        the frames each one's engine sent meanwhile; again while one was answered (a get
        that waited for another's reads may be ready now)."""
        answered = True
        while answered:
            answered = False
            for conn in self._waiting():
                if conn.deferred is None:  # dropped meanwhile
                    continue
                try:
                    entries = self.service.settle(conn.client, conn.deferred)
                except Exception as exc:  # a bug: that peer goes (its tasks rolled back)
                    log.exception("aiokv store-server: gets of engine pid %d failed",
                                  conn.client.pid)
                    # The batch stays on the connection: the drop abandons its gets not
                    # yet answered, or their keys would stay marked as being read.
                    self._loop.drop(conn, f"{type(exc).__name__}: {exc}")
                    continue
                conn.deferred = entries
                answers = answers_only(entries)
                if answers is None:
                    continue
                conn.deferred = None
                answered = True
                self._loop.deliver(conn, wire.encode_answers(answers))

    def _evicting(self) -> list[Connection]:
        return [c for c in self._loop.peers() if c.evicting is not None]

    def _answer_evicts(self) -> None:
        """Send the evicts' answers whose loads are over and whose SSD voids are written;
        at their deadline, disconnect the engines whose loads are not (their tasks are
        rolled back) and send them; voids not written by then fail the evict (logged)."""
        now = time.monotonic()
        for conn in self._evicting():
            wait = conn.evicting
            if wait is None or conn.sock.fileno() < 0:  # answered, or dropped, meanwhile
                continue
            if not wait.over() and now >= wait.deadline:
                late = {client.number for client, task_id in wait.loads
                        if task_id in client.tasks}
                for other in self._loop.peers():
                    if other.client.number in late:
                        self._loop.drop(other, f"its loads of an evicted key did not end "
                                               f"in {EVICT_WAIT_S:.0f} s")
                if wait.written is not None and not wait.written.is_set():
                    why = (f"the evict's SSD voids were not written in {EVICT_WAIT_S:.0f} "
                           "s: the key is dropped, but a restart before they are may find "
                           "it")
                    log.warning("aiokv store-server: %s", why)
                    wait.written = VoidsDone.failed(why)  # answered: the engine raises it
            if not wait.over():
                continue
            conn.evicting = None
            self._loop.deliver(conn, wait.reply())
