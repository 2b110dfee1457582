"""What the store server answers each request of an engine, over :class:`.service.Service`:
hello (the geometry, the region's and the notice's descriptors), a batch's put and get
matches, its end and its gets' launch (neither answered), an evict or clear, figures.

The socket loop (:mod:`.server`) reads the frames and hands each one here in order; a
reply is sent at once, or left on its connection where it waits for something (a batch of
gets for its SSD or Mooncake reads: ``conn.deferred``; an evict for other engines' loads:
``conn.evicting``), for :mod:`.held` to send once it is due. Before a lookup, an evict or
figures, what other engines have waiting applies first (:meth:`Loop.absorb`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol

from ...errors import ConfigError
from . import wire
from .connection import Connection, EvictWait
from .notice import Notice
from .region import Geometry
from .service import Service
from .tasks import PendingGet, answers_only

log = logging.getLogger("aiokv.server")

_OK = wire.frame(wire.OK)
EVICT_WAIT_S = 30.0  # an evict waits this long for other engines' loads of the key under way


class ProtocolError(Exception):
    """A request the server does not take from anyone: the peer is dropped."""


class Loop(Protocol):
    """What the answers need of the socket loop."""

    @property
    def stopping(self) -> bool: ...  # draining: no new work

    def peers(self) -> list[Connection]: ...  # every connection, this one included

    def absorb(self) -> None: ...  # answer what other engines have waiting first

    def ended(self, pid: int, connection: int) -> None: ...  # its copies are over (hello)


class Answers:
    """The requests' handlers of one server: ``answer(conn, op, body)`` per frame."""

    def __init__(self, service: Service, loop: Loop) -> None:
        self.service = service
        self._loop = loop
        # Names this server's connections in a hello's "ended" (a number alone could be
        # another server's, before a restart).
        self.instance = secrets.token_hex(8)
        self._handlers: dict[int, Callable[[Connection, memoryview], bytes]] = {
            wire.PUT: self._put, wire.GET: self._get, wire.END: self._end,
            wire.PING: self._ping, wire.JSON: self._json, wire.LAUNCH: self._launch}
        self._json_handlers: dict[str, Callable[[Connection, dict[str, Any]], dict[str, Any]]] = {
            "stats": self._stats, "invalidated": self._invalidated}

    def answer(self, conn: Connection, op: int, body: memoryview) -> None:
        """Answer one request of ``conn`` (an error drops that peer: the loop's)."""
        if not conn.registered:
            message = wire.decode_json(body) if op == wire.JSON else {}
            if message.get("op") != "hello":
                raise ProtocolError(f"op {op} {message.get('op')!r} before hello")
            self._hello(conn, message)
            return
        handler = self._handlers.get(op)
        if handler is None:
            raise ProtocolError(f"unknown request op {op}")
        reply = handler(conn, body)
        if reply:
            conn.reply(reply)

    def _json(self, conn: Connection, body: memoryview) -> bytes:
        message = wire.decode_json(body)
        if message.get("op") in ("evict", "clear"):
            namespace = wire.namespace(message.get("ns")) if message["op"] == "evict" else None
            late = _late(message.get("by"))
            if late is not None:  # its engine gave up on it: it drops nothing now
                return wire.encode_json({"ok": False, "error": f"{message['op']} {late}"})
            return self._invalidate(conn, namespace)
        handler = self._json_handlers.get(message.get("op"))  # type: ignore[arg-type]
        if handler is None:
            raise ProtocolError(f"unknown request {message.get('op')!r}")
        return wire.encode_json({"ok": True, **handler(conn, message)})

    def _ping(self, conn: Connection, body: memoryview) -> bytes:
        return _OK

    def _hello(self, conn: Connection, message: dict[str, Any]) -> None:
        if message.get("wire") != wire.VERSION:  # told why, then dropped (and logged)
            why = (f"it speaks wire version {message.get('wire', 1)!r}, this server "
                   f"{wire.VERSION}: run one aiokv version for the server and its engines")
            conn.reply(wire.encode_json({"ok": False, "error": why, "config": True}))
            raise ProtocolError(why)
        try:
            geometry = Geometry.from_mapping(message.get("geometry"))
        except ValueError as exc:  # told why, then dropped: its engine's caches, perhaps
            why = f"kv_caches: {exc}"
            conn.reply(wire.encode_json({"ok": False, "error": why, "config": True}))
            raise ProtocolError(why) from exc
        try:
            region = self.service.register(geometry)
        except ConfigError as exc:
            log.warning("aiokv store-server: refused engine pid %d: %s", conn.client.pid, exc)
            conn.reply(wire.encode_json({"ok": False, "error": str(exc), "config": True}))
            return
        ended = _ended(message.get("ended", []))
        conn.registered = True
        notice = conn.client.notice = Notice.create()
        try:
            conn.reply(wire.encode_json({
                "ok": True, "blocks": region.num_blocks, "stride": region.block_stride,
                "capacity": self.service.capacity_tokens, "wire": wire.VERSION,
                "connection": [self.instance, conn.client.number]}), [region.fd, notice.fd])
        finally:  # sent or not (a peer gone after its hello): not kept open here
            notice.close_fd()
        for instance, number in ended:  # the peer's credentials gave the pid: its own
            if instance == self.instance:
                self._loop.ended(conn.client.pid, number)

    def _matches(self, conn: Connection, body: memoryview, is_put: bool) -> bytes:
        assert self.service.geometry is not None  # registered: the first hello set it
        request = wire.decode_match(body, self.service.geometry.page_size,
                                    self.service.capacity_tokens)
        if request.released:  # cancels ride along with the next match (one message)
            self.service.finish(conn.client, [], request.released)
        if self._loop.stopping:
            return wire.encode_answers([("the store server is shutting down", wire.FAILED)]
                                       * len(request.queries))
        entries = self.service.match_many(conn.client, is_put, request.queries, request.by)
        answers = answers_only(entries)
        if answers is None:  # sent by HeldReplies once its SSD reads are in
            conn.deferred = list(entries)
            return b""
        return wire.encode_answers(answers)

    def _put(self, conn: Connection, body: memoryview) -> bytes:
        return self._matches(conn, body, True)

    def _get(self, conn: Connection, body: memoryview) -> bytes:
        self._loop.absorb()
        return self._matches(conn, body, False)

    def _end(self, conn: Connection, body: memoryview) -> bytes:
        done, failed = wire.decode_end(body)
        self.service.finish(conn.client, done, failed)
        return b""  # not answered: see wire

    def _launch(self, conn: Connection, body: memoryview) -> bytes:
        conn.client.launched(wire.decode_launch(body))
        return b""  # not answered: see notice

    def _invalidated(self, conn: Connection, message: dict[str, Any]) -> dict[str, Any]:
        client = conn.client
        notice = client.notice
        taken = client.take_invalidated()
        ids = list(taken)
        # Told now, the engine launches none of them: those it has not announced give
        # their blocks back at once (not at its END), as one store's held Lookups do.
        self.service.release_taken(client, ids)
        # Asked while an evict is between its bump and its taking back (its second
        # absorb): the answer must not cover that bump, or the engine would copy a get
        # the evict is about to take back, seeing its word unchanged.
        seq = client.before_bump if client.before_bump is not None else (
            notice.value if notice is not None else 0)
        # "cleared": those a clear took back (the others an evict), for the engine's
        # Lookups to say which.
        return {"ids": ids, "cleared": [t for t, why in taken.items() if why == "cleared"],
                "seq": seq}

    def _invalidate(self, conn: Connection, namespace: tuple[str, ...] | None) -> bytes:
        """An evict (or, ``namespace`` None, a clear), as one embedded store would run it
        for every engine: the key's gets that engines hold and have not started to copy
        load nothing, and the answer waits for those they are copying (:mod:`.notice`
        says why this order is enough), and for the remote tier's marker (at most its
        ``timeout_ms``), after which no other host finds the key."""
        self._loop.absorb()  # what engines sent before applies first: a put reported done goes
        refused = self.service.begin_clear() if namespace is None else None
        if refused is not None:  # a clear that must drop nothing takes no get back either
            return wire.encode_json({"ok": False, "error": refused})
        # An evict run inside another's second read (another engine's EVICT among the
        # frames) keeps the outer one's word from before its bump, the earlier one, and
        # forgets only what it set itself: the outer one has not taken its gets back.
        bumped = []
        for client in (c.client for c in self._loop.peers()):
            if client.notice is not None and client.gets_of(namespace):
                if client.before_bump is None:
                    client.before_bump = client.notice.value
                    bumped.append(client)
                client.notice.bump()  # before the key goes and before the second read
        try:
            for other in self._loop.peers():
                for entry in other.deferred or ():
                    if isinstance(entry, PendingGet) and namespace in (None, entry.namespace):
                        entry.invalidated = "cleared" if namespace is None else "evicted"
            tokens, written, published = (self.service.clear() if namespace is None
                                          else self.service.evict(namespace))
            self._loop.absorb()  # LAUNCHes sent before the bump; gets matched now miss it
            loads = self.service.invalidate(conn.client, [c.client for c in
                                                          self._loop.peers()], namespace)
        finally:
            for client in bumped:  # taken back, and bumped again: answers cover it now
                client.before_bump = None
        wait = EvictWait(loads, tokens, time.monotonic() + EVICT_WAIT_S, written, published)
        if wait.over():
            return wait.reply()
        conn.evicting = wait  # sent by HeldReplies (the SSD wakes the loop)
        return b""

    def _stats(self, conn: Connection, message: dict[str, Any]) -> dict[str, Any]:
        self._loop.absorb()  # figures after what engines sent before
        clients = [c.client for c in self._loop.peers()]
        return {"stats": self.service.stats(clients)}


def _late(by: Any) -> str | None:
    """Why an evict or clear whose deadline is ``by`` (its engine's time.monotonic(), one
    clock for the host) is refused now, or None: it is not past (or has none)."""
    if by is None:
        return None
    if isinstance(by, bool) or not isinstance(by, (int, float)):
        raise ProtocolError(f"an evict's 'by' is a time.monotonic() deadline, not {by!r}")
    late_s = time.monotonic() - by
    if late_s < 0:
        return None
    return (f"reached the server {late_s:.3f} s after its deadline (the engine had given "
            "up on it); nothing was dropped")


def _ended(raw: Any) -> list[tuple[str, int]]:
    """A hello's "ended": the [server, connection] pairs of this process's dropped
    connections whose copies are over (:mod:`.quarantine`)."""
    if not isinstance(raw, list) or len(raw) > wire.MAX_ENDED or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
            and type(e[1]) is int for e in raw):
        raise ProtocolError(f"a hello's 'ended' is at most {wire.MAX_ENDED} [server, "
                            "connection] pairs")
    return [(e[0], e[1]) for e in raw]
