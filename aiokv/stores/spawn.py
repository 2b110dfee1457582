"""Starting ProcessStore's child: ``python -P -m aiokv.stores.child FD ENDS_FD PARENT_PID
GRACE_S`` as a
plain subprocess in a session of its own, with the two sockets it talks on; and ending it.

A plain subprocess, not multiprocessing: it does not re-import the program's
``__main__`` (as multiprocessing's spawn would), no exit hook of multiprocessing waits
for it, and its own session keeps a Ctrl-C to the terminal from reaching it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import site
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from typing import Protocol

log = logging.getLogger("aiokv")

# -P (3.11+): the child's sys.path does not start with the working directory, where a
# checkout of another aiokv (or of anything else) would shadow this one.
_SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def _child_env() -> dict[str, str]:
    """This environment, with aiokv's root on PYTHONPATH where the child would not find
    it by itself (a checkout on sys.path). Not where it is a site directory: entries of
    PYTHONPATH come before the standard library, which a site directory must not."""
    env = dict(os.environ)
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    site_dirs = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


# How long a child whose engine's process died may take to close its store and exit by
# itself (the socket's end reaches its loop) before it kills itself and what it started:
# enough for a store's close to write what it keeps, and a bound for a child stuck in a
# store call, which would otherwise hold its pinned memory and GPU context for good.
ORPHAN_GRACE_S = 30.0


def spawn_child() -> tuple[subprocess.Popen[bytes], Connection, socket.socket, int]:
    """(the child, the call socket, the socket on which it says that tasks ended, the
    call socket's send buffer in bytes)."""
    here, theirs = socket.socketpair()
    ends_here, ends_theirs = socket.socketpair()
    for end in (here, theirs, ends_here, ends_theirs):
        # Blocking, whatever socket.setdefaulttimeout() says: Connection and the child
        # read and write them as blocking sockets (a timeout would also end the notice
        # reader's wait).
        end.setblocking(True)
    send_buffer = here.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    fds = (theirs.fileno(), ends_theirs.fileno())
    try:
        process = subprocess.Popen(
            [sys.executable, *_SAFE_PATH, "-m", "aiokv.stores.child", *map(str, fds),
             str(os.getpid()), repr(ORPHAN_GRACE_S)],
            pass_fds=fds,
            env=_child_env(),
            # Its own session: a Ctrl-C for this process group does not end it (and the
            # processes its store starts) while the parent still drains through it; the
            # parent's close ends it. And its whole group can be killed.
            start_new_session=True,
        )
    except BaseException:
        here.close()
        ends_here.close()
        raise
    finally:
        theirs.close()
        ends_theirs.close()
    return process, Connection(here.detach()), ends_here, send_buffer


def end_child(process: subprocess.Popen[bytes], socket_files: list[str], wait_s: float) -> None:
    """Wait up to ``wait_s`` for the child to exit (its socket closed: a serving child
    closes its store and exits), kill it after that, then kill what it started in its
    session (FlexKV's processes, should the child have died first) and remove the socket
    files it left."""
    if process.poll() is None:
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            if wait_s:
                log.error("aiokv: the store process (pid %d) did not exit; killing it",
                          process.pid)
            process.kill()
            process.wait()
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    for path in socket_files:
        with contextlib.suppress(OSError):
            os.unlink(path)


class Forgetful(Protocol):
    def _forget_in_fork(self) -> None: ...


_LIVE: weakref.WeakSet[Forgetful] = weakref.WeakSet()


def forget_in_forks(owner: Forgetful) -> None:
    """Have ``owner._forget_in_fork()`` called in every forked child of this process,
    while ``owner`` lives: a fork's copy of a child's socket must not keep it open."""
    _LIVE.add(owner)


def _after_fork_in_child() -> None:
    for store in list(_LIVE):
        store._forget_in_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
