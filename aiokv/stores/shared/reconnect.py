"""An engine's connection to ``aiokv store-server`` across the server's restarts
(:class:`Reconnecting`): one :class:`.link.Link` at a time, made on the first call that
needs it, lost when a call finds the server gone or silent, and made again on a later call.

A server that stops answering (stopped, wedged) costs the call in flight
``link.CALL_TIMEOUT_S`` (a hello ``link.HELLO_TIMEOUT_S``); since each try of a silent
server costs its caller that long, calls then fail at once, saying when it is tried again,
for a backoff (BACKOFF_FIRST_S doubling to BACKOFF_MAX_S, reset by a hello answered). The
first call after a restart nobody saw (the engine idled) finds its old connection broken
before the request left: such a call goes once more on a fresh connection where its
request means the same there (:meth:`Reconnecting.use`'s ``again``).

The tasks a link carried are :class:`.client.SharedStore`'s: it hears of each new link and
of each one lost (``on_link``, ``on_lost``), and tells a task's link by its generation.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ...copy.copier import CopyJob
from ...errors import ConfigError, StoreError
from . import wire
from .link import Link
from .region import Geometry

log = logging.getLogger("aiokv")

_T = TypeVar("_T")

# After a call or hello that a silent server let time out, no connect is tried for this
# long, doubled at each such try up to BACKOFF_MAX_S (calls meanwhile fail at once).
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class Reconnecting:
    """The current link to the server at ``path`` (None between a loss and the next call),
    for caches of ``geometry``; ``done``: the copy planes' callback for a finished job.
    ``on_link(link)`` runs for each new link, ``on_lost()`` for each link lost, both
    under :attr:`lock`."""

    def __init__(self, path: str, caches: Sequence[torch.Tensor], geometry: Geometry,
                 done: Callable[[CopyJob], None], on_link: Callable[[Link], None],
                 on_lost: Callable[[], None]) -> None:
        self.path = path
        self.lock = threading.Lock()  # one call at a time on the link
        self.link: Link | None = None
        self.generation = 0  # of the current link (each new one counts one more)
        self._caches = list(caches)
        self._geometry = geometry
        self._done = done
        self._on_link = on_link
        self._on_lost = on_lost
        self._closed = False
        self._d2h_gone = 0  # the d2h_copies of the planes of links gone
        # Links lost whose copies are over, told to the server with the next hello: it
        # keeps their put blocks out of use until then (its quarantine).
        self._ended: deque[tuple[str, int]] = deque(maxlen=wire.MAX_ENDED)
        self._backoff_s = 0.0  # the last backoff (0: the last hello was answered)
        self._retry_at = 0.0  # no connect before this (time.monotonic())
        self._silent = ""  # why: the timeout that started the backoff

    @property
    def d2h_copies(self) -> int:
        """Device-to-host copies of every link's plane, those gone included."""
        link = self.link
        return self._d2h_gone + (link.plane.d2h_copies if link is not None else 0)

    def connect(self) -> Link:
        """The current link, or a new one (StoreError while nothing serves there, at once
        during a backoff). Under :attr:`lock`."""
        if self.link is not None:
            return self.link
        if self._closed:
            raise StoreError("the shared store is closed")
        wait = self._retry_at - time.monotonic()
        if wait > 0:  # a silent server: another try would cost this call a timeout
            raise StoreError(f"the store server at {self.path!r} is not reachable: "
                             f"{self._silent}; tried again in {wait:.1f} s")
        try:
            link = Link(self.path, self._caches, self._geometry, self._done,
                        list(self._ended))
        except wire.PeerSilent as exc:
            raise StoreError(f"the store server at {self.path!r} is not reachable: {exc}; "
                             f"tried again in {self._back_off(exc):g} s") from exc
        except (OSError, wire.PeerGone, wire.WireError) as exc:
            what = _not_a_socket(self.path) if isinstance(exc, ConnectionRefusedError) else None
            if what is not None:  # no server could ever listen there: the config's fault
                raise ConfigError("store.socket", f"{self.path!r} is {what}, not a socket: "
                                  "name the one `aiokv store-server --socket` listens "
                                  "on") from exc
            raise StoreError(f"the store server at {self.path!r} is not reachable: {exc} "
                             "(is `aiokv store-server` running?)") from exc
        self._backoff_s = self._retry_at = 0.0
        self.link = link
        self._ended.clear()
        self.generation += 1
        self._on_link(link)
        if self.generation > 1:
            log.warning("aiokv: reconnected to the store server at %s", self.path)
        return link

    def use(self, use: Callable[[Link], _T], again: Callable[[Link], _T] | None = None) -> _T:
        """``use(link)`` under the lock, connecting first; a broken link is lost (its
        tasks end FAILED) and raised as StoreError. A link whose server had gone before
        the request left (the first call after a restart: nothing read from the old
        connection until then) is lost, and ``again`` runs once on a fresh one (None: a
        request that names what only that server knew)."""
        with self.lock:
            link = self.connect()
            try:
                return use(link)
            except wire.NotSent as exc:
                if again is None:
                    raise self._failed(exc) from exc
                self._lose(exc)
            except (OSError, wire.PeerGone, wire.WireError) as exc:
                raise self._failed(exc) from exc
            link = self.connect()
            try:
                return again(link)
            except (OSError, wire.PeerGone, wire.WireError) as exc:
                raise self._failed(exc) from exc

    def close(self) -> None:
        """Disconnect for good (the server rolls back what is left open, and keeps its
        blocks while this process lives: SharedStore.close gives back what it can first)."""
        with self.lock:
            self._closed = True
            link, self.link = self.link, None
            if link is not None:
                link.close()
                self._d2h_gone += link.plane.d2h_copies

    def _failed(self, exc: BaseException) -> StoreError:
        """The link lost to ``exc``, as the caller's error."""
        self._lose(exc)
        if isinstance(exc, wire.PeerSilent):
            return StoreError(f"the store server at {self.path!r}: {exc}; calls fail at "
                              f"once until it is tried again in {self._back_off(exc):g} s")
        return StoreError(f"the store server at {self.path!r} went away: {exc}")

    def _back_off(self, exc: wire.PeerSilent) -> float:
        """No connect for a while after ``exc`` (a silent server): how long."""
        self._backoff_s = min(BACKOFF_MAX_S, 2 * self._backoff_s or BACKOFF_FIRST_S)
        self._retry_at = time.monotonic() + self._backoff_s
        self._silent = str(exc)
        return self._backoff_s

    def _lose(self, exc: BaseException) -> None:
        log.warning("aiokv: lost the store server at %s: %s", self.path, exc)
        link, self.link = self.link, None
        self._on_lost()
        if link is not None:
            link.close()  # its copier threads joined: no copy of it can land any more
            self._d2h_gone += link.plane.d2h_copies
            if link.connection is not None:
                self._ended.append(link.connection)


def _not_a_socket(path: str) -> str | None:
    """What is at ``path`` where that is no socket ("a directory", "a file", ...), else
    None (a socket, a dead server's too, or nothing: a server may yet come)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else (
        "a file" if stat.S_ISREG(mode) else "something else")
