"""``aiokv store-server``: one process per host that owns the shared region, the index, the
SSD tier and the remote tier (:mod:`.service`), serving engines over a UNIX socket.

One thread, one ``selectors`` loop (here; what each request gets is :mod:`.answers`, and
when a reply that waits is sent, :mod:`.held`): each engine's requests are answered in
order, one reply per request (none to a batch's end or to its gets' launch), each in the
order they arrive across engines. A request is a batch (all of a batch's matches, or all of its
finished tasks), so the server sees two messages per batch (three when it loads) and
answers one. Before it answers a lookup, an evict or figures, it applies what other
engines have waiting (:meth:`StoreServer.absorb`): an engine reports a put done once its
end is sent, so every lookup (and evict) after that sees it. A batch of gets whose pages
are partly on SSD (or Mooncake) only is answered once those are read into host blocks (or
Mooncake's ``timeout_ms`` is up); an evict or clear once the loads of the key other
engines have under way are over (:meth:`.answers.Answers._invalidate`). Meanwhile the server
answers the other engines (that engine is blocked in its call and sends nothing more;
what it sends anyway waits for the answer).

Who may connect: the socket lives in a directory only the server's uid can enter (made
0700, or refused when it is open to others), the socket itself is 0600, and every
connection's peer credentials (SO_PEERCRED) must name the server's uid. A peer that sends
a malformed or oversized frame, an unknown request, or names a task it does not hold is
logged and disconnected; its tasks are rolled back as when it dies, and the others go
on. SIGTERM (or SIGINT) drains: no new connection or match is taken, the tasks open then
may end (up to ``drain_timeout_s``), the SSD tier finishes its writes, and the process
exits 0.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

from ...config import MAX_SOCKET_PATH_BYTES, StoreConfig
from ...errors import ConfigError
from ...remote.native import unavailable
from ..dirlock import SERVER, DirLock
from . import sockets, wire
from .answers import Answers, ProtocolError
from .connection import Connection
from .held import HeldReplies
from .quarantine import Kept, Quarantine
from .service import Service
from .tasks import Client, Foreign

log = logging.getLogger("aiokv.server")

# A peer that does not read its replies for this long is dropped, as is one whose replies
# to one turn of its requests are not all out by then (it reads them too slowly).
SEND_TIMEOUT_S = 5.0
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LENGTH = struct.Struct("<I")  # a frame's length word (then its op: wire.HEAD)
_SERVER: dict[str, str] = {"holder": SERVER, "hint": ""}  # the socket's DirLock's words
_CHUNK = 1 << 16  # read per call: a large buffer per call costs more than calls
# An absorb reads a connection this many times at most: more than its socket buffers hold
# (what it had sent before the lookup that absorbs), so a peer that keeps writing cannot
# keep the lookup waiting.
_ABSORB_READS = 16
_ACCEPT_PAUSE_S = 0.5  # out of descriptors: new connections wait this long in the backlog
_ABSORB_DEPTH = 16  # lookups met while absorbing absorb too, this deep



def check_socket_path(path: Path) -> None:
    """Refuse (ConfigError naming ``--socket``) a path no socket can be bound at, or one
    that holds something other than a socket: start removes a dead server's socket
    there, and must never remove a user's file (a config passed as --socket, say)."""
    if "\0" in str(path):  # the kernel would bind at the path up to it
        raise ConfigError("--socket", f"{str(path)!r} contains a NUL byte")
    size = len(os.fsencode(str(path)))
    if size > MAX_SOCKET_PATH_BYTES:
        raise ConfigError("--socket", f"{str(path)!r} is {size} bytes long; a UNIX socket "
                          f"path holds at most {MAX_SOCKET_PATH_BYTES}")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:  # a file where a directory of the path should be, say
        raise ConfigError("--socket", f"{str(path)!r}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ConfigError("--socket", f"{str(path)!r} exists and is not a socket: "
                          "refusing to replace it")


def private_directory(path: Path) -> None:
    """Make ``path`` (the socket's directory) 0700, or refuse one that others may enter
    or that another uid owns (ConfigError naming it)."""
    if not path.exists():
        try:
            path.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise ConfigError("--socket", f"cannot make its directory {str(path)!r}: "
                              f"{exc.strerror or exc}") from exc
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ConfigError("--socket", f"{str(path)!r} belongs to uid {info.st_uid}, not "
                          f"this server's {os.getuid()}: use a directory of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError("--socket", f"{str(path)!r} is open to other users "
                          f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 700 it, or use "
                          "a directory of its own, such as $XDG_RUNTIME_DIR/aiokv")


class StoreServer:
    """``StoreServer(socket_path, config).serve()`` until :meth:`stop` (any thread) or
    SIGTERM; :meth:`start` binds first (ConfigError for a directory in use)."""

    def __init__(self, socket_path: str | Path, config: StoreConfig,
                 drain_timeout_s: float = 30.0) -> None:
        if config.backend != "local":
            raise ConfigError("store.backend", f"the server runs the embedded store; "
                              f"leave backend out or local, got {config.backend!r}")
        # The server is the store's process: it starts no child, so these would be ignored.
        if config.own_process:
            raise ConfigError("store.own_process", "the server is the store's process of "
                              "its own; leave own_process out, got True")
        if config.store_restarts != StoreConfig.store_restarts:
            raise ConfigError("store.store_restarts", "restarts a store in a child process, "
                              "which the server does not start (run it under systemd "
                              f"with Restart=); leave it out, got {config.store_restarts}")
        if config.remote is not None and (why := unavailable()) is not None:
            raise ConfigError("store.remote", why)  # at start, not at the first engine
        self.path = Path(socket_path)
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # A wake (stop from any thread or a signal handler, the SSD threads' notices)
        # writes under it and the close takes the pipe away under it: a write never
        # reaches a closed descriptor, nor one the process reused since. Reentrant: a
        # signal handler may run stop() inside the close's hold.
        self._wake_lock = threading.RLock()
        self.service = Service(config, self._wake)
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._connections: dict[int, Connection] = {}  # fileno -> connection
        self._locks: list[DirLock] = []
        self._numbers = 0
        self._stopping = False
        self._stop_at = 0.0
        self._absorbing = 0  # nested absorb calls
        self._accept_at = 0.0  # listening again from then on, once out of descriptors
        self._answers = Answers(self.service, self)
        self._held = HeldReplies(self.service, self)  # replies that wait (:mod:`.held`)
        self._quarantine = Quarantine()  # blocks of dropped engines still alive

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, handle_signals: bool = False) -> None:
        """Bind and listen (ConfigError for a socket or SSD directory in use, ...);
        ``handle_signals`` (the command's, on the main thread): :meth:`handle_signals`
        once those refusals are behind it and before it says it listens, so that a signal
        sent then finds them, not the default that ends the process. A start refused gives
        back what it took (the socket's and SSD directories' locks, the region's memory):
        a server started after it in this process, its config fixed, may have them."""
        try:
            self._start(handle_signals)
        except BaseException:
            self._close(stopped=False)
            raise

    def _start(self, handle_signals: bool) -> None:
        check_socket_path(self.path)
        private_directory(self.path.parent)
        self._locks.append(DirLock(self.path.parent, "--socket", str(self.path),
                                   name=self.path.name + ".lock", **_SERVER))
        # Refused now, not at every engine's register; held from now on (Service.lock_ssd).
        self.service.lock_ssd()
        self.service.allocate()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a dead server's: the lock says none is alive
        if handle_signals:
            self.handle_signals()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
        except BaseException:
            listener.close()
            raise
        self._listener = listener  # from here its path is this server's (_close unlinks it)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        log.info("aiokv store-server: listening on %s (pid %d)", self.path, os.getpid())

    def stop(self) -> None:
        """Drain and exit :meth:`serve` (any thread, or a signal handler)."""
        self._stopping = True
        self._wake()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def peers(self) -> list[Connection]:
        return list(self._connections.values())

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:  # stopped already: stop() again is a no-op
                return
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")

    def handle_signals(self) -> None:
        """SIGTERM and SIGINT drain (:meth:`stop`), SIGUSR1 writes every thread's stack
        to stderr (from C, by faulthandler: also while the serving thread is blocked in a
        call). The main thread's only (ValueError on another)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop())
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    def serve(self) -> None:
        if self._listener is None:
            self.start()
        try:
            while not self._drained():
                wait_s = self._held.wait_s(self.service.wait_s(0.5))
                for key, _ in self._selector.select(timeout=wait_s):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        self.service.poll()
                    elif isinstance(key.data, tuple):  # ("exited", pid): a dropped engine
                        self.release(key.data[1])
                    else:
                        self._readable(key.data)
                self.service.expire()
                if self._accept_at and time.monotonic() >= self._accept_at:
                    self._accept_at = 0.0
                    if self._listener is not None:
                        self._selector.register(self._listener, selectors.EVENT_READ,
                                                "accept")
                self._held.send()
                if self._stopping and self._listener is not None:
                    self._stop_listening()
        finally:
            self._close()

    def _stop_listening(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(KeyError, ValueError):  # not while accepting was paused
            self._selector.unregister(self._listener)
        self._listener.close()
        self._listener = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._stop_at = time.monotonic() + self.drain_timeout_s
        log.info("aiokv store-server: draining (%d engines, %d tasks open)",
                 len(self._connections),
                 sum(len(c.client.tasks) for c in self._connections.values()))

    def _drained(self) -> bool:
        if not self._stopping or self._listener is not None:
            return False
        clients = [c.client for c in self._connections.values()]
        if self.service.idle(clients) and not self._held.holding():
            return True
        if time.monotonic() >= self._stop_at:
            log.warning("aiokv store-server: drain timed out with tasks open; rolled back")
            return True
        return False

    def release(self, pid: int) -> None:
        """A dropped engine's process exited (or the server closes): its blocks held
        since (:mod:`.quarantine`) are free now."""
        self._unhold(*self._quarantine.release(pid))

    def ended(self, pid: int, connection: int) -> None:
        """``pid`` says the copies of its dropped ``connection`` have ended: that
        connection's blocks held since (:mod:`.quarantine`) are free now."""
        self._unhold(*self._quarantine.ended(pid, connection))

    def _unhold(self, pidfd: int | None, kept: Kept) -> None:
        if len(kept):
            self.service.free(kept)
        if pidfd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(pidfd)
            os.close(pidfd)

    def _close(self, stopped: bool = True) -> None:
        """Let go of everything (``stopped``: after serving; else a start refused)."""
        for conn in list(self._connections.values()):
            self.drop(conn, None)
        for pid in self._quarantine.pids():
            self.release(pid)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.service.close()
        self._selector.close()
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        with self._wake_lock:
            pipe = (self._wake_r, self._wake_w)
            self._wake_r = self._wake_w = -1
        for fd in pipe:
            if fd >= 0:  # closed already: a start refused, then serve() called anyway
                os.close(fd)
        if stopped:
            log.info("aiokv store-server: stopped")

    # ---- connections ---------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # out of descriptors (EMFILE, ENFILE), memory, aborted
            # The connection waits in the backlog; the engines served go on being served.
            log.warning("aiokv store-server: cannot accept a connection (%s); %d engines "
                        "connected, new ones wait %.1f s", exc, len(self._connections),
                        _ACCEPT_PAUSE_S)
            self._selector.unregister(self._listener)
            self._accept_at = time.monotonic() + _ACCEPT_PAUSE_S
            return
        pid, uid, _gid = _CRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid != os.getuid():
            log.warning("aiokv store-server: refused pid %d of uid %d (serving uid %d only)",
                        pid, uid, os.getuid())
            sock.close()
            return
        sockets.kernel_timeouts(sock, send_s=SEND_TIMEOUT_S)
        self._numbers += 1
        conn = Connection(sock, Client(self._numbers, pid))
        self._connections[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        log.info("aiokv store-server: engine pid %d connected", pid)

    def _readable(self, conn: Connection) -> int:
        """Read once from ``conn`` and answer its whole frames; the bytes read (0 when
        there were none, or the peer is gone)."""
        try:
            # Never blocking: the selector's list can be stale, as absorb may have read
            # the connection since (its socket blocks, for sendall's kernel timeout).
            data = conn.sock.recv(_CHUNK, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            self.drop(conn, f"connection broke: {exc}")
            return 0
        if not data:
            self.drop(conn, None)
            return 0
        if conn.waits:  # answered after its batch's (or evict's) answer
            if len(conn.inbox) + len(data) > wire.MAX_FRAME + wire.HEAD.size:
                # An engine waiting for its reply has nothing to send: kept, this would
                # grow for as long as the reply waits.
                self.drop(conn, "sent more than a frame while its reply waited")
                return 0
            conn.inbox += data
        else:
            self._frames(conn, data)
        return len(data)

    def _frames(self, conn: Connection, data: bytes) -> None:
        """Answer the whole frames of ``conn``'s inbox and ``data``, in order, up to a
        batch that is deferred; keep the rest in its inbox."""
        if conn.inbox:  # the rest of a frame that came in pieces
            conn.inbox += data
            if len(conn.inbox) >= 4:
                (length,) = _LENGTH.unpack_from(conn.inbox, 0)
                with contextlib.suppress(wire.WireError):  # a bad one: dropped below
                    wire.check_length(length)
                    if len(conn.inbox) < 4 + length:
                        return  # still coming: no copy of the pieces per piece
            data = bytes(conn.inbox)  # bytes: the requests' arrays may view it
            conn.inbox.clear()
        at = 0
        conn.busy = True
        conn.reply_by = time.monotonic() + SEND_TIMEOUT_S  # this turn's replies, all
        try:
            while len(data) - at >= 4 and not conn.waits:
                (length,) = _LENGTH.unpack_from(data, at)
                wire.check_length(length)  # at once: a bad length is not waited for
                end = at + 4 + length
                if end > len(data):
                    break
                (op,) = _LENGTH.unpack_from(data, at + 4)
                self._answers.answer(conn, op, memoryview(data)[at + 8 : end])
                at = end
            if at < len(data):
                conn.inbox += data[at:]
        except (wire.WireError, ProtocolError, Foreign) as exc:
            self.drop(conn, f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            self.drop(conn, f"reply failed: {exc}")
        except Exception as exc:  # a request the checks missed: that peer goes, not all
            log.exception("aiokv store-server: request of engine pid %d failed",
                          conn.client.pid)
            self.drop(conn, f"{type(exc).__name__}: {exc}")
        finally:
            conn.busy = False

    def absorb(self) -> None:
        """Answer the frames other engines have waiting, before a lookup or figures.

        An engine reports a put done once its end is sent (ends are not answered), and a
        lookup from any engine after that must find the put. The end is then waiting here
        already, but the selector's order alone does not put it first: a connection made
        ready by an older request can be listed before it. One ``select(0)`` when other
        engines are connected; a connection whose frames are being answered (the asking
        one, and those that led here) is not read again, so each engine's frames keep
        their order."""
        if len(self._connections) < 2 or self._absorbing >= _ABSORB_DEPTH:
            return
        self._absorbing += 1
        try:
            for key, _ in self._selector.select(0):
                conn = key.data
                if isinstance(conn, Connection) and not conn.busy:
                    for _ in range(_ABSORB_READS):
                        if self._readable(conn) != _CHUNK:
                            break
        finally:
            self._absorbing -= 1

    def deliver(self, conn: Connection, reply: bytes) -> None:
        """Send ``conn`` the reply it waited for (:mod:`.held`), then answer the frames its
        engine sent meanwhile; a reply that fails drops the peer."""
        try:
            conn.reply_by = time.monotonic() + SEND_TIMEOUT_S
            conn.reply(reply)
        except OSError as exc:
            self.drop(conn, f"reply failed: {exc}")
            return
        if conn.inbox:
            self._frames(conn, b"")

    def drop(self, conn: Connection, why: str | None) -> None:
        """Disconnect ``conn`` (logged, with ``why`` when it is the server's doing): its
        tasks are rolled back, its puts' blocks and gets' reads held while its process lives."""
        if self._connections.pop(conn.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        self._held.abandon(conn)
        pid = conn.client.pid
        pidfd = None if self._stopping else Quarantine.alive(pid)
        rolled, kept = self.service.drop(conn.client, keep=pidfd is not None)
        if pidfd is not None and not len(kept):
            os.close(pidfd)
        elif pidfd is not None and self._quarantine.hold(pid, conn.client.number, pidfd,
                                                         kept):
            self._selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
        conn.sock.close()
        if why is not None:
            log.warning("aiokv store-server: disconnected engine pid %d: %s (%d tasks "
                        "rolled back)", conn.client.pid, why, rolled)
        else:
            log.info("aiokv store-server: engine pid %d disconnected (%d tasks rolled back)",
                     conn.client.pid, rolled)
