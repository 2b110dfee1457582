"""ProcessStore's start message on its way to the child, with the caches' shared memory
as file descriptors passed over the child's socket (SCM_RIGHTS).

Why not torch's own reduction (``torch.multiprocessing``, "file_descriptor" sharing):
it hands each CPU tensor's shared memory through multiprocessing's resource sharer,
where a duplicate of its descriptor waits in this process until the receiver asks for
it. A child that never asks (killed during a start or a restart's registration, or
failing before it unpickles the caches) left that duplicate here for good, keeping the
cache's shared memory alive: two descriptors per failed start with two layers, still
open after the store closed. A descriptor passed over the socket is the kernel's while in
flight, and goes with the socket: whenever the child dies, nothing is left here.

Parent: :func:`send` pickles the message with torch's reductions (CUDA tensors still
travel as CUDA IPC handles), except that each CPU storage becomes an index into the
descriptors sent after it. Child: :func:`receive` takes the descriptors, maps each
storage once, and closes them.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

_FDS_PER_MESSAGE = 200  # descriptors per sendmsg: the kernel takes up to 253 (SCM_MAX_FD)
_STORAGE = "cpu-storage"  # the persistent id's tag: (tag, index into the fds, bytes)


def send(conn: Connection, message: object) -> None:
    """Send ``message`` on ``conn`` for :func:`receive`: ``(descriptor count, pickled
    message)``, then the descriptors. OSError if the child is gone."""
    fds: list[int] = []
    pickled = io.BytesIO()
    _Pickler(pickled, fds).dump(message)
    conn.send((len(fds), pickled.getvalue()))
    if not fds:
        return
    sock = socket.socket(fileno=conn.fileno())  # the same socket, not a copy: detached below
    sock.setblocking(True)  # as Connection uses it, whatever socket.setdefaulttimeout() says
    try:
        for start in range(0, len(fds), _FDS_PER_MESSAGE):
            socket.send_fds(sock, [b"F"], fds[start : start + _FDS_PER_MESSAGE])
    finally:
        sock.detach()


def receive(conn: Connection) -> Any:
    """The message :func:`send` sent on ``conn``'s other end, its CPU tensors mapping the
    sender's shared memory. EOFError if the sender is gone."""
    count, pickled = conn.recv()
    fds: list[int] = []
    try:
        if count:
            sock = socket.socket(fileno=conn.fileno())
            sock.setblocking(True)  # as Connection uses it (socket.setdefaulttimeout())
            try:
                while len(fds) < count:
                    data, got, flags, _ = socket.recv_fds(sock, 1, count - len(fds))
                    fds.extend(got)
                    if not data or flags & socket.MSG_CTRUNC:
                        raise EOFError(f"{len(fds)} of {count} cache descriptors came")
            finally:
                sock.detach()
        return _Unpickler(io.BytesIO(pickled), fds).load()
    finally:
        for fd in fds:  # each storage holds a duplicate of its own
            os.close(fd)


class _Pickler(ForkingPickler):
    """ForkingPickler (torch's tensor reductions), with each CPU storage's shared memory
    (made shared in place, as torch's reduction does) an index into ``fds``."""

    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file)  # the protocol Connection.send uses
        self._fds = fds

    def persistent_id(self, obj: object) -> object:
        if type(obj) is not torch.UntypedStorage or obj.device.type != "cpu" or not obj.nbytes():
            return None
        fd, size = obj._share_fd_cpu_()
        if fd not in self._fds:  # one storage, reached through several tensors
            self._fds.append(fd)
        return (_STORAGE, self._fds.index(fd), size)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file)
        self._fds = fds
        self._storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> torch.UntypedStorage:
        tag, index, size = pid
        if tag != _STORAGE or not 0 <= index < len(self._fds):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        storage = self._storages.get(index)
        if storage is None:  # mapped once (torch duplicates the descriptor)
            new_shared = torch.UntypedStorage._new_shared_fd_cpu  # type: ignore[attr-defined]
            storage = new_shared(self._fds[index], size)
            self._storages[index] = storage
        return storage
