"""A connection's notice word: how an evict or clear reaches the gets other engines hold.

In one embedded store, a Lookup held on a key that is then evicted loads nothing, and an
evict returns only after the loads of the key already under way have finished. Across
processes the server cannot take back a get an engine holds (the engine copies from its
blocks with no message), so it tells the engine instead, without a message on the hot
path: each connection has a counter of its own in shared memory (a memfd the server
hands over with the region), which the server bumps when it invalidates gets of that
connection. The engine reads it after it announces a batch of gets (``LAUNCH``, one
unanswered message) and before it copies them, and again before it reports gets done;
when it moved, the engine asks which of its gets were invalidated (one round trip, only
then) and those load nothing.

Why that is enough (the server's side is :meth:`Answers._invalidate
<aiokv.stores.shared.answers.Answers._invalidate>`): the server bumps the counter,
drops the key, then reads every connection's waiting frames. A get whose ``LAUNCH`` it
read by then is under way: the evict's answer waits for that get's end. A get whose
``LAUNCH`` it had not read was announced after that read, so after the bump (the
socket's queue orders the two), and the engine, reading the counter after its
announcement, sees the bump before it copies.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

SIZE = 8  # one uint64


class Notice:
    """The counter, mapped: the server's (``Notice.create()``, writable) or an engine's
    (``Notice(fd)``, read-only). ``fd`` stays open until :meth:`close_fd`."""

    def __init__(self, fd: int, writable: bool = False) -> None:
        if os.fstat(fd).st_size < SIZE:
            raise ValueError(f"a notice holds {SIZE} bytes, this one "
                             f"{os.fstat(fd).st_size}")
        self.fd = fd
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._map = mmap.mmap(fd, SIZE, access=access)
        self._word = np.frombuffer(self._map, dtype=np.uint64, count=1)

    @classmethod
    def create(cls) -> Notice:
        fd = os.memfd_create("aiokv-notice", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SIZE)
            return cls(fd, writable=True)
        except BaseException:
            os.close(fd)
            raise

    @property
    def value(self) -> int:
        return int(self._word[0])

    def bump(self) -> int:
        """The server's: the counter plus one (the engine asks on its next look)."""
        self._word[0] += np.uint64(1)
        return self.value

    def close_fd(self) -> None:
        """The descriptor closed (handed over already); the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
