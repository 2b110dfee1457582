"""The SSD tier's files and I/O threads.

One preallocated data file per directory (``<dir>/aiokv-ssd/blocks.dat``, mode 0600 in a
0700 directory, next to its meta file and the lock file that keeps a second store out:
:mod:`aiokv.stores.dirlock`, taken by :func:`lock_directory`; ``aiokv store-server`` takes it
at its start and hands it to its tier). Slots are striped across the files one block at a
time (slot ``s`` is slot ``s // n`` of file ``s % n``), so a run of slots is one
contiguous range in each file and several directories (disks) share every large request.
Each file has one write thread, ``aiokv-ssd-<i>-write``, which runs writes in the order
they were queued (so a slot's invalidation stays ahead of its reuse), and a few read
threads, ``aiokv-ssd-<i>-read``, so that several reads are in flight (a load waits for
the disk; a write_through copy does not). A read never races a write of its slot: a slot
being read is held, and one being written is not readable.

Requests are ``os.preadv``/``os.pwritev`` of whole slot runs. The files are opened with
O_DIRECT when the filesystem takes it and the host blocks are whole 4 KiB pages (the host
pool is 4 KiB aligned); otherwise (tmpfs refuses O_DIRECT) with buffered I/O and an
``fdatasync`` per write request, which the tier logs once at open.
"""

from __future__ import annotations

import collections
import errno
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...config import size_text
from ...errors import ConfigError
from ..dirlock import STORE, DirLock, require_directory
from .ssd_format import DATA_NAME, HEADER_BYTES, Meta, geometry_difference, read_meta, write_meta

log = logging.getLogger("aiokv")

SUBDIR = "aiokv-ssd"
IOV_MAX = 1024  # os.sysconf("SC_IOV_MAX") on Linux
# Reads in flight per file: one O_DIRECT request at a time leaves a disk idle between
# requests, and loads wait on reads. Writes keep one thread per file, which also keeps a
# slot's invalidation ahead of its reuse (the order they were queued in).
READ_THREADS = 8
_DIRECT = getattr(os, "O_DIRECT", 0)

Op = Callable[[], None]


class ShortIO(OSError):
    """A request that stopped short (an I/O error, or a file shorter than it: truncated):
    its first ``moved`` bytes went through, in order (a read's landed in its buffers;
    past them the buffers hold what they held)."""

    def __init__(self, code: int, message: str, moved: int) -> None:
        super().__init__(code, message)
        self.moved = moved


def open_data_file(path: Path, direct: bool) -> tuple[int, bool]:
    """``path`` opened read-write (created 0600), with O_DIRECT where asked and the
    filesystem takes it; returns (fd, whether O_DIRECT is on)."""
    flags = os.O_RDWR | os.O_CREAT
    if direct and _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o600), False


def lock_directory(directory: str, holder: str = STORE) -> DirLock:
    """The lock of the SSD tier in ``directory`` (in ``<directory>/aiokv-ssd``, made if
    missing), for a ``holder`` of that kind; ConfigError naming store.ssd_cache_dir when
    it is missing, not writable, or held."""
    return DirLock(_prepare(directory), "store.ssd_cache_dir", directory, holder=holder)


def _prepare(directory: str) -> Path:
    """``<directory>/aiokv-ssd``, created if missing, mode 0700: the lock file's home
    (an idempotent change, harmless to a store that may be using it)."""
    require_directory(directory, "store.ssd_cache_dir")
    path = Path(directory) / SUBDIR
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    except OSError as exc:
        raise ConfigError(
            "store.ssd_cache_dir", f"{directory!r} is not writable: {exc}"
        ) from exc
    return path


class SsdFiles:
    """The data files of every directory, their meta files and their I/O threads."""

    def __init__(
        self,
        dirs: Sequence[str],
        total_slots: int,
        geometry: dict[str, Any],
        *,
        direct: bool,
        reset_on_mismatch: bool,
        held: Sequence[DirLock] | None = None,
    ) -> None:
        """``held``: each directory's lock (:func:`lock_directory`), taken by the caller,
        who keeps it past :meth:`close` (a store-server holds its directories from its
        start to its end, whatever its tier does); None: taken here, released at close."""
        self.count = len(dirs)
        self.slot_bytes = int(geometry["slot_bytes"])
        self.slots_per_file = total_slots // self.count
        self.paths: list[Path] = []
        self.metas: list[Meta] = []
        self.fds: list[int] = []
        self._locks: list[DirLock] = []
        self.direct = True
        if held is not None and len(held) != len(dirs):
            raise ValueError(f"SsdFiles: {len(held)} locks held for {len(dirs)} directories")
        try:
            # Every directory locked before any of them is read or changed (the scan,
            # a reset on mismatch): another store may be using one.
            for directory in dirs:
                if held is None:
                    self._locks.append(lock_directory(directory))
                self.paths.append(Path(directory) / SUBDIR)
            for k, path in enumerate(self.paths):
                self.metas.append(self._check_meta(path, k, geometry, reset_on_mismatch))
            self._check_space()
            for path in self.paths:
                try:
                    fd, on = open_data_file(path / DATA_NAME, direct)
                except OSError as exc:  # a directory in its place, a dangling link, ...
                    raise ConfigError("store.ssd_cache_dir",
                                      f"cannot open {str(path / DATA_NAME)!r}: {exc}") from exc
                self.fds.append(fd)
                self.direct &= on
                self._preallocate(fd, path)
        except BaseException:
            for fd in self.fds:
                os.close(fd)
            for lock in self._locks:
                lock.release()
            raise
        # Per file: one lock; reads and writes queued apart, each kind with its threads.
        self._queues = [(collections.deque[Op](), collections.deque[Op]()) for _ in dirs]
        locks = [threading.Lock() for _ in dirs]
        self._cond = [(threading.Condition(lock), threading.Condition(lock)) for lock in locks]
        self._closed = False
        self._stopped = False  # every thread has ended (stop)
        # A clear (store thread) and a void's fallback (a write lane) both renew epochs.
        self._meta_lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._run, args=(k, kind), name=f"aiokv-ssd-{k}-{name}", daemon=True
            )
            for k in range(self.count)
            for kind, name, threads in ((0, "read", READ_THREADS), (1, "write", 1))
            for _ in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    # ---- open ----------------------------------------------------------------------

    def _check_meta(
        self, path: Path, k: int, geometry: dict[str, Any], reset: bool
    ) -> Meta:
        wanted = Meta(geometry, (k, self.count), self.slots_per_file, 0)
        try:
            stored = read_meta(path)
            difference = "" if stored is None else geometry_difference(stored, wanted)
        except ConfigError as exc:
            if not reset:
                raise
            stored, difference = None, str(exc)
        data = path / DATA_NAME
        if stored is None and not difference and data.exists() and data.stat().st_size:
            # Blocks, and no meta file to say which epoch is current (removed, or lost):
            # epoch 0's headers would read as current, those a clear dropped among them.
            log.warning("aiokv: discarding the SSD cache in %s: it has no meta file", path)
            os.truncate(data, 0)
        if stored is not None and not difference:
            wanted = Meta(geometry, (k, self.count), self.slots_per_file, stored.epoch)
        elif difference:
            if not reset:
                raise ConfigError(
                    "store.ssd_cache_dir",
                    f"{str(path)!r} was written with another geometry ({difference}); "
                    "use another directory, or set ssd_reset_on_mismatch: true to discard it",
                )
            log.warning("aiokv: discarding the SSD cache in %s (%s)", path, difference)
            data = path / DATA_NAME
            if data.exists():
                os.truncate(data, 0)  # every old header goes with it
        try:
            write_meta(path, wanted)  # also records a new size
        except OSError as exc:
            raise ConfigError("store.ssd_cache_dir",
                              f"cannot write the meta file in {str(path)!r}: {exc}") from exc
        return wanted

    def _check_space(self) -> None:
        need: dict[int, int] = {}  # st_dev -> bytes still to allocate there
        free: dict[int, int] = {}
        size = self.slots_per_file * self.slot_bytes
        for path in self.paths:
            data = path / DATA_NAME
            have = data.stat().st_blocks * 512 if data.exists() else 0
            dev = os.stat(path).st_dev
            need[dev] = need.get(dev, 0) + max(0, size - have)
            free[dev] = shutil.disk_usage(path).free
        for dev, bytes_needed in need.items():
            if bytes_needed > free[dev]:
                raise ConfigError(
                    "store.ssd_cache_gb",
                    f"needs {size_text(bytes_needed, 1)} more ({bytes_needed} bytes) on the "
                    f"filesystem of {', '.join(str(p) for p in self.paths)}, which has "
                    f"{size_text(free[dev], 1)} free ({free[dev]} bytes)",
                )

    def _preallocate(self, fd: int, path: Path) -> None:
        size = self.slots_per_file * self.slot_bytes
        try:
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ConfigError(
                    "store.ssd_cache_gb", f"no room for {size} bytes in {str(path)!r}"
                ) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)  # sparse: the filesystem cannot preallocate

    def scan_headers(self, k: int) -> list[bytes]:
        """Every slot header of file ``k``, in slot order (runs at open)."""
        buf = mmap.mmap(-1, HEADER_BYTES)  # page aligned, as O_DIRECT wants
        fd, out = self.fds[k], []
        for slot in range(self.slots_per_file):
            if os.preadv(fd, [buf], slot * self.slot_bytes) != HEADER_BYTES:
                raise OSError(errno.EIO, f"short header read in {self.paths[k]}")
            out.append(bytes(buf))
        buf.close()
        return out

    # ---- I/O -----------------------------------------------------------------------

    def submit(self, k: int, op: Op, *, read: bool, front: bool = False) -> None:
        """Queue ``op`` on file ``k``'s read or write lane; ``front``: ahead of what is
        queued there (after the op running now). Once :meth:`stop` has finished every
        lane, ``op`` runs here and now (what applying the last requests still voids)."""
        kind = 0 if read else 1
        cond = self._cond[k][kind]
        if self._stopped and self.fds:
            op()
            return
        with cond:
            if self._closed:
                raise RuntimeError("the SSD tier is closed")
            if front:
                self._queues[k][kind].appendleft(op)
            else:
                self._queues[k][kind].append(op)
            cond.notify()

    def write(self, k: int, offset: int, buffers: Sequence[Any]) -> None:
        """``os.pwritev`` of ``buffers`` at ``offset`` of file ``k`` (I/O thread)."""
        self._io(os.pwritev, k, offset, buffers)
        if not self.direct:
            os.fdatasync(self.fds[k])

    def read(self, k: int, offset: int, buffers: Sequence[Any]) -> None:
        """``os.preadv`` into ``buffers`` at ``offset`` of file ``k`` (I/O thread);
        ShortIO where not all of them were filled."""
        self._io(os.preadv, k, offset, buffers)

    def _io(self, call: Callable[..., int], k: int, offset: int, buffers: Sequence[Any]) -> None:
        """ShortIO where it stops short, saying how far it got."""
        fd, moved = self.fds[k], 0
        for start in range(0, len(buffers), IOV_MAX):
            part = buffers[start : start + IOV_MAX]
            want = sum(len(b) for b in part)
            try:
                done = call(fd, part, offset + moved)
            except OSError as exc:
                raise ShortIO(exc.errno or errno.EIO,
                              f"{call.__name__}: {exc.strerror or exc} after {moved} bytes",
                              moved) from exc
            if done != want:
                raise ShortIO(errno.EIO, f"{call.__name__}: {done} of {want} bytes",
                              moved + done)
            moved += want

    def _run(self, k: int, kind: int) -> None:
        queue, cond = self._queues[k][kind], self._cond[k][kind]
        while True:
            with cond:
                while not queue and not self._closed:
                    cond.wait()
                if not queue:
                    return  # closed and drained
                op = queue.popleft()
            op()  # each op reports its own errors

    def stop(self) -> None:
        """Finish the queued requests and stop the threads; the files stay open (ops
        submitted from now on run on the caller's thread) until :meth:`close`."""
        for pair in self._cond:
            with pair[0]:
                self._closed = True
                for cond in pair:
                    cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._stopped = True

    def close(self) -> None:
        """:meth:`stop`, then close the files and let go of their locks."""
        if not self._stopped:
            self.stop()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for lock in self._locks:  # last: nothing of this store touches the files now
            lock.release()

    def new_epoch(self, k: int | None = None) -> None:
        """Void every header written before in file ``k`` (None: in every file, a clear):
        a new epoch in its meta file, past every epoch it had. OSError when a meta file
        cannot be written (that file keeps its epoch, on disk and here)."""
        with self._meta_lock:
            epoch = 1 + max(m.epoch for m in (self.metas if k is None else [self.metas[k]]))
            for j in range(len(self.paths)) if k is None else [k]:
                meta = self.metas[j]
                meta = Meta(meta.geometry, meta.stripe, meta.slots, epoch)
                write_meta(self.paths[j], meta)
                self.metas[j] = meta
