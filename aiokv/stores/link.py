"""ProcessStore's link to one child (:mod:`aiokv.stores.process`): the process
(:mod:`.spawn`), the socket this process calls it on, and every wait on it.

No wait is unbounded. :meth:`ChildLink.receive` waits for the child's answer without the
GIL (one poll syscall at a time), checks now and then that the child lives, and kills it
(SIGKILL) past its deadline: a store deadlocked in the child would otherwise hold the
caller, and whatever the child holds (an SSD directory's lock), for good. A kill may
come from any thread (:meth:`ChildLink.kill`): the child's end of the socket closes with
it, which ends a wait at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import subprocess
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import cache_fds
from .restarts import how_it_ended
from .spawn import end_child, spawn_child

log = logging.getLogger("aiokv")

_ALIVE_CHECK_MS = 1000  # while an answer is awaited, check this often that the child lives
_EXIT_WAIT_S = 1.0  # how long a child seen going is waited for, to say how it ended


class ChildGone(Exception):
    """The child died, or was killed, under a send or a receive: ask
    :meth:`ChildLink.how_it_ended`."""


class ChildLink:
    """A child just spawned (``python -m aiokv.stores.child``) and its sockets: the call
    socket (``conn``) and that of its notices of ended tasks (``ends``, for
    :mod:`.notices`)."""

    def __init__(self) -> None:
        self.killed: str | None = None  # why this process killed the child (kill)
        self.process, self.conn, self.ends, send_buffer = spawn_child()
        self._poller = select.poll()
        self._poller.register(self.conn.fileno(), select.POLLIN)
        # What a send may leave in the kernel without the child reading: a quarter of
        # the send buffer, which also pays for the kernel's own bookkeeping.
        self._holds = send_buffer // 4

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """Whether the child has not exited (reaped here once it has)."""
        return self.process.poll() is None

    def send(self, message: object, *, start: bool = False,
             bound: tuple[float, str] | None = None) -> None:
        """``start``: the start message, its CPU caches' shared memory passed as
        descriptors over the socket (:mod:`.cache_fds`: none left here should the child
        die before it takes them). ``bound``: (deadline, what): a request larger than
        the socket holds waits for the child to read it, so past the deadline the child
        is killed, which ends the send (a smaller one never waits: the child has read
        every earlier request before it answered it)."""
        try:
            if start:
                cache_fds.send(self.conn, message)
                return
            data = ForkingPickler.dumps(message)  # as Connection.send pickles
            if bound is None or len(data) <= self._holds:
                self.conn.send_bytes(data)
                return
            deadline, what = bound
            watch = threading.Timer(max(deadline - time.monotonic(), 0.0), self.kill,
                                    (f"it did not take {what}",))
            watch.daemon = True
            watch.start()
            try:
                self.conn.send_bytes(data)
            finally:
                watch.cancel()
        except OSError as exc:
            raise ChildGone from exc

    def receive(self, deadline: float, what: str) -> Any:
        """The child's next message, the answer to ``what`` (words for a log line).
        Past ``deadline`` (time.monotonic) the child is killed; ChildGone once it has
        ended with nothing left to read. Read here, as Connection frames it, and not by
        Connection.recv: every part of the answer is waited for with the deadline, and a
        child that stops half-way through one (between its size and its body) is killed
        as one that never answered."""
        self._readable(deadline, f"it did not answer {what}")
        late = f"it did not finish its answer to {what}"
        size: int = struct.unpack("!i", self._read(4, deadline, late))[0]
        if size == -1:  # over 2 GiB: the size follows
            size = struct.unpack("!Q", self._read(8, deadline, late))[0]
        return ForkingPickler.loads(self._read(size, deadline, late))

    def _readable(self, deadline: float, why: str) -> None:
        """Wait until the call socket has something to read (or its end); past
        ``deadline`` kill the child with ``why``. ChildGone once it has ended."""
        while True:
            left_s = deadline - time.monotonic()
            if self._poller.poll(max(min(_ALIVE_CHECK_MS, 1e3 * left_s), 0)):
                return
            if not self.alive() and not self._poller.poll(0):  # nothing left to read
                raise ChildGone
            if left_s <= 0:
                self.kill(why)
                raise ChildGone

    def _read(self, size: int, deadline: float, why: str) -> memoryview:
        """``size`` bytes of the socket (blocking: each read follows a poll that found
        some), waiting for each part up to ``deadline``."""
        data = memoryview(bytearray(size))
        done = 0
        while done < size:
            self._readable(deadline, why)
            try:
                got = os.readv(self.conn.fileno(), [data[done:]])
            except OSError as exc:
                raise ChildGone from exc
            if not got:  # its end: the child died
                raise ChildGone
            done += got
        return data

    def kill(self, why: str, level: int = logging.ERROR) -> None:
        """Kill the child now (SIGKILL; from any thread, never blocking), logging
        ``why``, which :meth:`how_it_ended` says from then on. ``Popen.kill`` polls
        first: a child already reaped is left alone."""
        if not self.alive():
            return
        self.killed = f"the store process (pid {self.pid}) was killed (SIGKILL): {why}"
        log.log(level, "aiokv: %s", self.killed)
        self.process.kill()

    def how_it_ended(self) -> str:
        """The child's end in words, once it has exited (waited for up to _EXIT_WAIT_S:
        it is going); "not answering" if it has not."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=_EXIT_WAIT_S)
        if self.killed is not None and self.process.returncode is not None:
            return self.killed
        return how_it_ended(self.pid, self.process.returncode)

    def close(self, socket_files: list[str], wait_s: float) -> None:
        """Close the call socket (a serving child then closes its store and exits), then
        end the child: spawn.end_child, waiting up to ``wait_s``. Idempotent."""
        if not self.conn.closed:
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(self.conn.fileno())
            self.conn.close()
        end_child(self.process, socket_files, wait_s)

    def forget(self) -> None:
        """In a forked child of this process: close this process's copy of the call
        socket without a word, so that the child still sees its parent's death."""
        with contextlib.suppress(OSError):
            self.conn.close()
