"""One store per directory: an exclusive lock on a file in it, held while the store is open.

Two stores writing one SSD directory (two workers given the same config, or two engines
in one process) would overwrite each other's blocks; the second opener gets a ConfigError
naming the directory and the process that holds it instead. A store takes the lock before
it reads or writes anything else there and releases it when it closes; the kernel
releases it when the process ends however it ends (kill -9 included), so a crash leaves
nothing to clean by hand. The lock file stays (removing it would race a new opener).
It records its holder (pid, host and kind: an embedded store or ``aiokv store-server``),
which the refusal names. The kind goes past the first 512 bytes: an older aiokv reads
only those, and wants exactly a pid and a host there.

``flock``, not ``fcntl.lockf``: a POSIX record lock belongs to the process, so two stores
of one process would both get it; an ``flock`` belongs to the open file description, and
each opening has its own. A fork shares the description, so a forked child of this
process closes its copy: otherwise the lock would outlive the store that took it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from ..errors import ConfigError
from .spawn import forget_in_forks

LOCK_NAME = "lock"
# The kinds of holder a lock file records: an embedded store (an engine's, or a store
# process of its own) and ``aiokv store-server``, which holds its SSD directories from its
# start (the same lock, handed to its SSD tier).
STORE = "aiokv store"
SERVER = "aiokv store-server"
_HOLDER_BYTES = 512  # more than a pid and a host name take


def require_directory(directory: str, key: str) -> None:
    """ConfigError naming ``key`` unless ``directory`` is an existing directory."""
    if not os.path.lexists(directory):
        raise ConfigError(key, f"{directory!r} does not exist")
    if not os.path.isdir(directory):
        raise ConfigError(key, f"{directory!r} is not a directory")


_ONE_EACH = "; give each process its own directory (one per worker)"


class DirLock:
    """The exclusive lock on ``<path>/<name>``; :meth:`release` gives it back
    (idempotent)."""

    def __init__(self, path: Path, key: str, shown: str, *, name: str = LOCK_NAME,
                 holder: str = STORE, hint: str = _ONE_EACH) -> None:
        """Take the lock for a ``holder`` (its kind, recorded with its pid), or raise
        ConfigError naming ``key``, ``shown`` (what the user named), the kind and pid of
        the process that holds it, then ``hint``. ``path`` must exist."""
        try:
            fd = os.open(path / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(key, f"{shown!r} is not writable: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            kind, recorded = _holder(os.pread(fd, 2 * _HOLDER_BYTES, 0))
            os.close(fd)
            raise ConfigError(
                key, f"{shown!r} is in use by another {kind} ({recorded}){hint}"
            ) from exc
        except OSError as exc:
            os.close(fd)
            raise ConfigError(key, f"{shown!r} cannot be locked: {exc}") from exc
        try:
            os.ftruncate(fd, 0)
            where = f"{os.getpid()} {socket.gethostname()}\n".encode()
            os.pwrite(fd, where.ljust(_HOLDER_BYTES) + f"{holder}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise ConfigError(key, f"{shown!r} is not writable: {exc}") from exc
        self._fd = fd
        forget_in_forks(self)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # no stale holder for the next opener's message
        os.close(fd)  # the last reference to the open file description: the lock goes

    def _forget_in_fork(self) -> None:
        """In a forked child: close this process's copy without touching the lock file."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _holder(recorded: bytes) -> tuple[str, str]:
    """The holder as the lock file records it: its kind, and "pid N on host H", marked
    when it is this process. A file without a kind (an older aiokv's) names a store."""
    fields = recorded[:_HOLDER_BYTES].decode(errors="replace").split()
    kind = recorded[_HOLDER_BYTES:].decode(errors="replace").strip() or STORE
    if len(fields) != 2 or not (fields[0].isascii() and fields[0].isdigit()):
        return STORE, "a process that has not yet written its pid into the lock file"
    pid, host = int(fields[0]), fields[1]
    if pid == os.getpid() and host == socket.gethostname():
        return kind, f"this process, pid {pid} on host {host}"
    return kind, f"pid {pid} on host {host}"
