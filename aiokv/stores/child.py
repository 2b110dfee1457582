"""The child side of :class:`~aiokv.stores.process.ProcessStore`.

``python -m aiokv.stores.child FD ENDS_FD``: FD is this end of the socket, ENDS_FD that of
the channel on which the child tells the parent that tasks have ended. The parent sends
``(StoreConfig, payload, detached puts' table, again)`` (:mod:`.wire`; its CPU caches'
shared memory as descriptors over the socket, :mod:`.cache_fds`; ``again``: a restart,
for which a store that connects to a server starts while it is away,
base.StartsWhileAway). The child builds the store, registers it as its backend's cache
handover says (which may ask the parent to attach the caches) and answers ``("ready",
page_size)`` or ``("failed", exception)``. Then it serves ``(op, args)`` requests one at
a time, answering ``(True, value)`` or ``(False, exception)``, until ``("close", None)``
or until the socket closes (the parent is gone); either way it closes its store before it
exits.

Launched tasks are watched here (:class:`_Ends`): a store that notifies (LocalStore) says
when a task may have ended; others (FlexKV) are polled here every ``_POLL_S`` while the
child waits for a request. Either way the child sends a byte on ENDS_FD, and the parent
asks ``try_wait`` then, instead of every poll interval of its own: the polling costs the
child's CPU, not the GIL of the parent's event loop.

FlexKV starts its transfer engine with multiprocessing "spawn", which imports this
module again as its main module: everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing  # registers tensor reductions for Connection.recv

from ..backends import backend
from ..errors import StoreError
from . import cache_fds, make_store
from .base import (
    NoSpace,
    ResumesFigures,
    StartsWhileAway,
    Store,
    TaskResult,
    takes_deadline,
)
from .detaches import DetachTable
from .wire import FiguresAnswer, launch_pages, pack_results, portable

log = logging.getLogger("aiokv")

# Set where the loop finds the call socket closed without a close request: the engine's
# process died, or closed the socket (a restart, a close that does not wait).
_PARENT_GONE = threading.Event()

_POLL_S = 100e-6  # how often a store that does not notify is polled for launched tasks


class _Ends:
    """The launched tasks of the store, and the notices to the parent that some ended."""

    def __init__(self, store: Store, ends: socket.socket) -> None:
        self._store = store
        self._ends = ends
        ends.setblocking(False)  # a notice never waits: one not read yet says as much
        self._open: set[int] = set()  # launched, not yet answered by the store
        self._answered: dict[int, TaskResult] = {}  # answered, not yet taken by the parent
        # A poll's try_wait raised: the parent is told, and its own try_wait (take) says
        # why; no polling until then (a store that keeps failing would fail every 100 µs).
        self._stalled = False
        set_notify = getattr(store, "set_notify", None)
        self.store_notifies = callable(set_notify)
        if self.store_notifies:
            set_notify(self.tell)  # type: ignore[misc]

    @property
    def polling(self) -> bool:
        """Whether launched tasks wait for this process to poll the store."""
        return bool(self._open) and not self.store_notifies and not self._stalled

    def launched(self, task_ids: Sequence[int]) -> None:
        self._open.update(task_ids)

    def poll(self) -> None:
        try:
            answers = self._store.try_wait(list(self._open))
        except Exception:  # not the end of the child: the parent's try_wait will raise it
            log.warning("aiokv store process: try_wait failed while polling", exc_info=True)
            self._stalled = True
            self.tell()
            return
        if answers:
            self._open.difference_update(answers)
            self._answered.update(answers)
            self.tell()

    def take(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """try_wait for the parent: what polling found, then the store for the rest."""
        self._stalled = False
        out = {t: self._answered.pop(t) for t in task_ids if t in self._answered}
        rest = [t for t in task_ids if t not in out]
        if rest or not task_ids:  # none: a wake-up's settle (ProcessStore.try_wait)
            try:
                fresh = self._store.try_wait(rest)
            except Exception:
                # The parent fails the tasks it asked for and asks no more about them.
                self._open.difference_update(rest)
                raise
            self._open.difference_update(fresh)
            out.update(fresh)
        return out

    def tell(self) -> None:
        """Tell the parent that tasks may have ended (from any thread)."""
        with contextlib.suppress(OSError):  # full: the parent has notices to read already
            self._ends.send(b"!")


def _request_within(conn: Connection, seconds: float) -> bool:
    """Whether a request comes within ``seconds``. select, not conn.poll: poll(2) rounds
    100 µs up to a millisecond (select cannot take a descriptor past FD_SETSIZE, though)."""
    fd = conn.fileno()
    if fd < 1024:
        return bool(select.select([fd], [], [], seconds)[0])
    return conn.poll(seconds)


def _launch(store: Store, ends: _Ends, args: Any) -> None:
    task_ids, pages, deadlines = launch_pages(args)  # the page ids: one array, on the host
    tensors = [torch.from_numpy(p) for p in pages]
    if deadlines:  # sent only where this store has set_deadlines (wire.MIRRORED)
        store.set_deadlines(list(deadlines), list(deadlines.values()))  # type: ignore[attr-defined]
    store.launch(task_ids, tensors, [None] * len(tensors))  # the parent waited for them
    ends.launched(task_ids)  # all of them: a launch that raises launched none


def _match_many(store: Store, op: str, args: Any, deadline_s: float | None = None
                ) -> list[Any]:
    """Each match's answer (``op``: put_match or get_match), or the exception it raised,
    in order: the store's own match of many where it has one (with the batch's deadline
    where it takes one: base.BoundsLookups), else one by one."""
    many = getattr(store, f"{op}_many", None)
    if callable(many):
        matched = many(args, deadline_s=deadline_s) if (
            deadline_s is not None and takes_deadline(many)) else many(args)
        return [_for_the_parent(op, a) if isinstance(a, Exception) else a for a in matched]
    match = getattr(store, op)
    answers: list[Any] = []
    for token_ids, namespace in args:
        try:
            answers.append(match(token_ids, namespace))
        except Exception as exc:
            answers.append(_for_the_parent(op, exc))
    return answers


def _for_the_parent(op: str, exc: BaseException) -> BaseException:
    """A store's exception as it crosses to the parent; logged here unless it is one of
    the contract's own (NoSpace, ValueError), which the parent reports itself."""
    if not isinstance(exc, (NoSpace, ValueError)):
        log.warning("aiokv store process: %s failed", op, exc_info=True)
    if not isinstance(exc, Exception):  # SystemExit, say: raised in the engine's store
        return StoreError(f"{type(exc).__name__}: {exc}")  # thread it would end it quietly
    return portable(exc)


def _invalidate(store: Any, namespace: tuple[str, ...] | None, by: float | None) -> int:
    """An evict of ``namespace`` (None: a clear), unless it is read after its deadline
    ``by`` (the engine's time.monotonic(): one clock for the host's processes), as from a
    child stopped and resumed: its caller heard RequestTimeout at the deadline, and what
    that error says (base.BoundsInvalidations) holds only if nothing is dropped later."""
    verb = "clear" if namespace is None else "evict"
    if by is not None and (late_s := time.monotonic() - by) >= 0:
        raise StoreError(f"{verb} reached the store process {late_s:.3f} s after its "
                         "deadline (the engine had given up on it); nothing was dropped")
    dropped: int = store.clear() if namespace is None else store.evict(namespace)
    return dropped


def _stats(store: Any) -> FiguresAnswer:
    """The store's figures, with what a store in a new child needs to go on from them
    where they are not all its own counts (base.ResumesFigures; else None)."""
    stats = dict(store.store_stats())
    state = store.figures_state if isinstance(store, ResumesFigures) else None
    return stats, None if state is None else state()


_CALLS: dict[str, Callable[[Store, _Ends, Any], Any]] = {
    "put_match": lambda store, ends, args: store.put_match(*args),
    "put_match_many": lambda store, ends, args: _match_many(store, "put_match", args),
    "get_match": lambda store, ends, args: store.get_match(*args),
    "get_match_many": lambda store, ends, args: _match_many(store, "get_match", *args),
    "evict": lambda store, ends, args: _invalidate(store, *args),
    "clear": lambda store, ends, args: _invalidate(store, None, args),
    "store_stats": lambda store, ends, args: _stats(store),
    "resume_figures": lambda store, ends, args: store.resume_figures(args),  # type: ignore[attr-defined]
    "parked": lambda store, ends, args: store.parked(args),  # type: ignore[attr-defined]
    "launch": _launch,
    "cancel": lambda store, ends, args: store.cancel(args),
    "try_wait": lambda store, ends, args: pack_results(ends.take(args)),
}


def _register(store: Store, config: Any, payload: Any, conn: Connection) -> None:
    """Register the store as its backend's handover says, answering the parent's attach."""

    def ask_parent(value: object) -> None:
        conn.send(("attach", value))
        attached, error = conn.recv()
        if not attached:
            raise error

    backend(config.backend).cache_handover().register(store, payload, ask_parent)


def serve(conn: Connection, ends_socket: socket.socket) -> int:
    store: Store | None = None
    try:
        config, payload, detached, again = cache_fds.receive(conn)  # tensors: may fail here
        store = make_store(config)  # e.g. FlexKV not importable from this process
        if again and isinstance(store, StartsWhileAway):  # a restart: base.StartsWhileAway
            store.start_while_away()
        _register(store, config, payload, conn)
        watch = getattr(store, "watch_detaches", None)
        if watch is not None:  # the engine marks its detached puts there (.detaches)
            watch(DetachTable(detached).has)
    except Exception as exc:
        if store is not None:
            store.close()
        with contextlib.suppress(OSError):
            conn.send(("failed", portable(exc)))
        return 1
    reply: tuple[bool, Any] = (True, None)
    ends = _Ends(store, ends_socket)
    try:
        try:
            conn.send(("ready", store.page_size))
        except OSError:  # the parent gave up or died meanwhile
            _PARENT_GONE.set()
            return 0
        while True:
            if ends.polling and not _request_within(conn, _POLL_S):
                ends.poll()  # no request meanwhile: look at the launched tasks
                continue
            try:
                op, args = conn.recv()
            except (EOFError, OSError):  # the parent is gone: nobody waits for an answer
                _PARENT_GONE.set()
                return 0
            if op == "close":
                break
            try:
                reply = (True, _CALLS[op](store, ends, args))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit from a store too: the call's error
                reply = (False, _for_the_parent(op, exc))
            try:
                conn.send(reply)  # pickled whole before a byte is written
            except OSError:  # the parent is gone
                _PARENT_GONE.set()
                return 0
            except Exception as exc:  # an answer that does not pickle: the call's error
                try:
                    conn.send((False, StoreError(f"{op}: the store's answer cannot be sent "
                                                 f"to the engine: {exc!r}")))
                except OSError:
                    return 0
    finally:
        try:
            store.close()
            reply = (True, None)
        except Exception as exc:
            log.exception("aiokv store process: close failed")
            reply = (False, portable(exc))
    with contextlib.suppress(OSError):
        conn.send(reply)
    return 0


class EngineProcess:
    """The engine's process, watched from this one: through a pidfd where the kernel has
    them (its exit, not a reused pid), else by signal 0 every ``poll_s``. Not through
    ``getppid()``: a launcher between the two (a ``sys.executable`` that is a wrapper)
    would read as the engine's end at once."""

    def __init__(self, pid: int, poll_s: float = 0.5) -> None:
        self.pid = pid
        self._poll_s = poll_s
        self._fd: int | None = None
        with contextlib.suppress(OSError):  # gone already, or no pidfd: polled
            self._fd = os.pidfd_open(pid)

    def gone(self, timeout_s: float | None = 0.0) -> bool:
        """Whether it has exited, waiting up to ``timeout_s`` (None: until it has)."""
        if self._fd is not None:
            return bool(select.select([self._fd], [], [], timeout_s)[0])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:  # another user's process has its pid now
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self._poll_s if deadline is None else
                       min(self._poll_s, max(deadline - time.monotonic(), 0.0)))


def watch_engine(engine: EngineProcess, grace_s: float) -> None:
    """Once the engine's process is gone, give this one ``grace_s`` to end by itself (the
    socket's end reaches the loop, which closes the store), then kill it and what it
    started (FlexKV's processes share its session and group): its main thread may be stuck
    in a store call that nothing will ever answer. Runs in a daemon thread."""
    engine.gone(None)
    log.warning(
        "aiokv store process %d: the engine's process %d is gone; ending in %g s at most",
        os.getpid(), engine.pid, grace_s,
    )
    time.sleep(grace_s)
    log.error("aiokv store process %d: still running %g s after its engine's process "
              "died; killing it and what it started", os.getpid(), grace_s)
    end_group()
    os._exit(1)


def end_group() -> None:
    """Kill this process and its process group: what its store started (FlexKV's
    processes), which the engine's process, gone, no longer ends."""
    if os.getpgid(0) == os.getpid():  # spawn.py starts it leading its own session
        os.killpg(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s[child]: %(message)s")
    engine = EngineProcess(int(argv[3])) if len(argv) > 4 else None
    if engine is not None:
        threading.Thread(
            target=watch_engine, args=(engine, float(argv[4])),
            name="aiokv-watch-engine", daemon=True,
        ).start()
    with Connection(int(argv[1])) as conn, socket.socket(fileno=int(argv[2])) as ends:
        served = serve(conn, ends)
    # Closed by itself because its engine's process died (its sockets close a moment
    # before its exit shows): what the store started would live on.
    if engine is not None and _PARENT_GONE.is_set() and engine.gone(0.1):
        logging.shutdown()
        end_group()
    return served


if __name__ == "__main__":
    sys.exit(main(sys.argv))
