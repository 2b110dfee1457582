"""ProcessStore's notices of ended tasks, from its child (:mod:`aiokv.stores.process`).

Launched tasks are watched in the child (polled there, for a store such as FlexKV that
does not notify), which sends a byte on a second socket when answers wait. A reader
thread here passes that on to the ``set_notify`` callback, so that the parent asks
``try_wait`` when there is something to take rather than every poll interval (a poll
costs a round trip). The channel closing is a notice too: the child may have died.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


def no_notify() -> None:
    """ProcessStore's notice of ended tasks before set_notify, and after close."""


class Notices:
    """One child's notice channel at a time (the socket), its reader thread and the
    callback it calls; a new child's channel follows a restart (:meth:`resume`)."""

    def __init__(self) -> None:
        self.socket: socket.socket | None = None  # this process's end, from spawn_child
        self.callback: Callable[[], None] = no_notify
        self.reader: threading.Thread | None = None
        self.closed = False  # the child's end of the channel closed: dead?

    def start(self) -> None:
        """The reader thread, once there is both a channel and a callback."""
        if self.reader is None and self.socket is not None and self.callback is not no_notify:
            self.reader = threading.Thread(
                target=self._read, args=(self.socket,), name="aiokv-store-ends", daemon=True
            )
            self.reader.start()

    def _read(self, ends: socket.socket) -> None:
        # Blocks without the GIL; one wake-up for every burst of notices.
        while True:
            try:
                notices = ends.recv(4096)
            except OSError:
                notices = b""
            if not notices and ends is self.socket:  # not one close() closed
                self.closed = True  # the next call looks whether the child died
            self.callback()  # b"": the child is gone (the store thread finds out now), or closed
            if not notices:
                return

    def close(self) -> Callable[[], None]:
        """Close the channel and wake its reader; returns the callback, for :meth:`resume`."""
        callback = self.callback
        ends, self.socket = self.socket, None
        self.callback = no_notify  # before the reader wakes: it calls no stale callback
        if ends is not None:
            with contextlib.suppress(OSError):
                ends.shutdown(socket.SHUT_RDWR)  # wakes the reader (close alone would not)
            ends.close()
        return callback

    def resume(self, callback: Callable[[], None]) -> None:
        """After :meth:`close`, for a new child of the same engine: its callback again,
        and a reader once the new channel is there (:meth:`start`)."""
        self.callback, self.reader = callback, None  # the next child's reader
        self.closed = False

    def forget(self) -> socket.socket | None:
        """In a forked child: no reader thread here, no callback; returns the socket,
        this process's copy, for the caller to close."""
        ends, self.socket, self.reader = self.socket, None, None
        self.callback = no_notify
        return ends
