"""Mooncake's two services on this machine, for tests, benchmarks and one-host setups:
``mooncake_master`` and a store process (the wheel's ``mooncake_client``) that holds the
memory values live in. Engines contribute none: a value lives in the memory of the
process that put it only where that process offered memory, and an engine's memory goes
when it closes. Everything listens on 127.0.0.1, on free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .native import import_store, program, program_env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# Connects to each port given, every 50 ms, until killed; a refused port is left alone.
_WAKER = """
import socket, sys, time
ports = {int(port) for port in sys.argv[1:]}
while ports:
    time.sleep(0.05)
    for port in list(ports):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            ports.discard(port)
"""


def _listening_ports() -> list[int]:
    """The TCP ports this process listens on (IPv4)."""
    sockets: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    with open("/proc/self/net/tcp", encoding="ascii") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return [int(row[1].rsplit(":", 1)[1], 16) for row in rows
            if row[3] == "0A" and row[9] in sockets]  # 0A: LISTEN


@contextlib.contextmanager
def mooncake_closes_woken() -> Iterator[None]:
    """For a Mooncake client's close in the body (of a test, a benchmark, the probe
    here): the close joins the client's handshake listener, a thread in accept() that
    sees the close only when its 1 s receive timeout ends, and holds the GIL meanwhile,
    so no thread of this process can wake it. Another process connects to this
    process's listening ports until the body returns: a connection that is no
    handshake is dropped by its listener, and a closing one ends at once."""
    if not os.path.exists("/proc/self/net/tcp"):
        yield
        return
    waker = subprocess.Popen([sys.executable, "-S", "-c", _WAKER,
                              *map(str, _listening_ports())],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        waker.send_signal(signal.SIGKILL)
        waker.wait()


def _wait_port(name: str, port: int, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on port {port} in {timeout_s} s")


def _all_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (or has ended): none can answer."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # gone: its exit is for the caller to tell
        return False
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as stat:
                text = stat.read()
        except FileNotFoundError:  # it ended meanwhile
            continue
        if text[text.rindex(")") + 2] not in "TtZX":  # stopped, traced, or dead
            return False
    return True


def _pause(name: str, process: subprocess.Popen[bytes] | None, paused: bool,
           timeout_s: float = 10.0) -> None:
    """SIGCONT ``process`` (not ``paused``), or SIGSTOP it and return once it is stopped,
    else raise RuntimeError; nothing where there is no process.

    kill() returns once the signal is queued: the process stops only when one of its
    threads, scheduled, takes the signal and stops the others. Meanwhile its other
    threads still serve: on a loaded runner a lookup sent just after kill() was answered
    in full, a hit where the caller meant a process that does not answer."""
    if process is None:
        return
    if not paused:
        process.send_signal(signal.SIGCONT)
        return
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_stopped(process.pid):
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} (pid {process.pid}) did not stop within "
                               f"{timeout_s} s of SIGSTOP")
        time.sleep(0.001)


def _close_probe(client: Any) -> None:
    with mooncake_closes_woken():
        client.close()


class MooncakeServers:
    """A master and one store process of ``segment_mb`` MiB. ``master`` is the address
    for ``store.remote.master``; :meth:`stop_master` / :meth:`start_master` take the
    master away and bring it back on the same port (its contents are lost, as Mooncake's
    are when a master without HA restarts); :meth:`close` stops both."""

    def __init__(self, segment_mb: int = 256, lease_ms: int = 2000,
                 log_dir: str | os.PathLike[str] | None = None) -> None:
        import_store()  # the same libraries the programs need; ImportError says how
        self.segment_mb = segment_mb
        self.lease_ms = lease_ms
        self._logs = Path(log_dir or tempfile.mkdtemp(prefix="aiokv-mooncake-"))
        self._rpc_port = free_port()
        self._metrics_port = free_port()
        self.master = f"127.0.0.1:{self._rpc_port}"
        self._master: subprocess.Popen[bytes] | None = None
        self._store: subprocess.Popen[bytes] | None = None
        # wait_store_mounted's probe clients, closing: Mooncake's close takes most of a
        # second, which nothing here needs to wait for until the master goes away.
        self._probes_closing: list[threading.Thread] = []
        try:
            self.start_master()
            self._store = self._spawn("store", [
                program("mooncake_client"), "--host=127.0.0.1", f"--port={free_port()}",
                f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE",
                f"--global_segment_size={segment_mb}MB", "--protocol=tcp",
            ])
            self.wait_store_mounted()
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self._logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, env=program_env(), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start_master(self) -> None:
        # A get's lease keeps a value from removal (evict) until it ends, and a read not
        # done within it fails (LEASE_EXPIRED: a miss). 2 s: a loaded box's read takes
        # longer than Mooncake's 200 ms at times, and evicts wait the lease out.
        self._master = self._spawn("master", [
            program("mooncake_master"), "--rpc_address=127.0.0.1",
            f"--rpc_port={self._rpc_port}", "--metrics_host=127.0.0.1",
            f"--metrics_port={self._metrics_port}", f"--default_kv_lease_ttl={self.lease_ms}",
            # A store process paused (pause_store) past this loses its segment and every
            # value in it, pinned ones too: a minute, not Mooncake's 10 s, which a paused
            # store's test on a loaded runner outlasts.
            "--client_ttl=60",
        ])
        _wait_port("mooncake_master", self._rpc_port, self._master, 15.0)

    def stop_master(self) -> None:
        self._probes_closed()
        if self._master is not None:
            self._master.kill()
            self._master.wait()
            self._master = None

    def pause_master(self, paused: bool = True) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the master: one that accepts connections
        but does not answer, as a hung or partitioned master would (each call waits for
        Mooncake's own timeout, about 30 s). A stop returns once every thread of it is
        stopped (RuntimeError where it exited, or did not stop within 10 s)."""
        self._probes_closed()  # a close waiting on a stopped master would never end
        _pause("mooncake_master", self._master, paused)

    @property
    def master_pid(self) -> int | None:
        """The master's process id (None while it is stopped): for a signal sent from
        outside this process, which a test needs where this process may not run."""
        return None if self._master is None else self._master.pid

    @property
    def store_pid(self) -> int | None:
        """The store process's id (None once closed): for a test that watches it."""
        return None if self._store is None else self._store.pid

    def pause_store(self, paused: bool = True) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the store process: a Mooncake that is up
        but does not answer, as a stalled or swapping host would be. A stop returns once
        every thread of it is stopped (RuntimeError where it exited, or did not stop
        within 10 s): a call made after it gets no answer until the store continues."""
        self._probes_closed()
        _pause("the store process", self._store, paused)

    def wait_store_mounted(self, timeout_s: float = 30.0) -> None:
        """Block until the store process's memory takes a put (after a start, or after
        the master came back and the store process mounted its segment again)."""
        client = import_store().MooncakeDistributedStore()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", self.master):
            raise RuntimeError(f"cannot reach the Mooncake master at {self.master}")
        try:
            deadline = time.monotonic() + timeout_s
            while client.put("aiokv-servers-probe", b"1") != 0:
                if self._store is not None and self._store.poll() is not None:
                    raise RuntimeError(f"the store process exited with {self._store.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no store memory mounted at {self.master} "
                                       f"after {timeout_s} s (logs: {self._logs})")
                time.sleep(0.05)
            client.remove("aiokv-servers-probe", True)
        finally:
            closing = threading.Thread(target=_close_probe, args=(client,),
                                       name="aiokv-probe-close", daemon=True)
            closing.start()
            self._probes_closing.append(closing)

    def _probes_closed(self) -> None:
        """Join the probe clients' closes: a client must not outlive its master."""
        while self._probes_closing:
            self._probes_closing.pop().join()

    def close(self) -> None:
        self._probes_closed()
        # The store process first, while the master it unmounts from still answers.
        if self._store is not None and self._store.poll() is None:
            self._store.terminate()
            try:
                self._store.wait(5)
            except subprocess.TimeoutExpired:
                self._store.kill()
                self._store.wait()
        # A master without HA keeps nothing that outlives it (as stop_master assumes),
        # and its exit on SIGTERM waits about a second on a thread of its own.
        self.stop_master()
        self._store = None

    def __enter__(self) -> MooncakeServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
