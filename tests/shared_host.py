"""The processes of the shared store's tests: ``aiokv store-server`` as a subprocess, and
engine processes (multiprocessing spawn) on ``store.backend: shared`` driven by commands
over a pipe, each answered once. Each user's KV is made from the user id, so any process
(and the test) can check a load bit for bit."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

import aiokv
from aiokv.stores.shared import SharedStore, sockets, wire
from aiokv.stores.shared.region import Geometry

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 64, 4, 2, 8
_CONTEXT = multiprocessing.get_context("spawn")


def wait_for(condition: Callable[[], object], what: str) -> None:
    """Poll until ``condition()`` (a server's answers change as it handles its peers)."""
    give_up = time.monotonic() + 60  # a loaded runner has stalled a server for over 10 s
    pause = 0.001  # most conditions hold within a millisecond or two
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"not within 60 s: {what}")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def user_kv(user: int, pages: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + user)
    return [torch.randn(pages, 2, PAGE_SIZE, HEADS, HEAD_DIM, generator=generator)
            for _ in range(LAYERS)]


def caches(head_dim: int = HEAD_DIM, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, head_dim, device=device)
            for _ in range(LAYERS)]


class Server:
    """``aiokv store-server`` in a subprocess; ``start()`` returns once it listens (or
    raises with its log when it exits first)."""

    def __init__(self, directory: Path, store: dict[str, Any] | None = None,
                 socket_path: Path | None = None, drain_timeout_s: float = 5.0) -> None:
        self.socket = socket_path or directory / "run" / "store.sock"
        self.config = directory / "server.yml"
        self.config.write_text(yaml.safe_dump({"store": {"cpu_cache_gb": 0.001,
                                                         **(store or {})}}))
        self.log = directory / f"server-{time.monotonic_ns()}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.drain_timeout_s = drain_timeout_s

    def start(self) -> Server:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "aiokv", "store-server", "--socket", str(self.socket),
                 "--config", str(self.config), "--drain-timeout", str(self.drain_timeout_s)],
                stderr=log, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        while b"listening on" not in self.log.read_bytes():
            if self.process.poll() is not None:
                raise RuntimeError(f"store-server exited {self.process.returncode}: "
                                   + self.log.read_text())
            time.sleep(0.02)  # waiting for a start-up line, not ordering work
        return self

    def run_to_end(self) -> tuple[int, str]:
        """Start it and wait for it to exit (a server that refuses to start)."""
        with open(self.log, "wb") as log:
            done = subprocess.run(
                [sys.executable, "-m", "aiokv", "store-server", "--socket", str(self.socket),
                 "--config", str(self.config)],
                stderr=log, timeout=60, check=False)
        return done.returncode, self.log.read_text()

    def run_here(self) -> tuple[int, str]:
        """:meth:`run_to_end` in this process, through the command's own entry point: no
        interpreter (and torch) to start for a server that refuses to start. (exit
        status, what the server logged). On a thread of its own: a server that does start
        cannot install its signal handlers there and raises, rather than serve for good."""
        from aiokv import cli

        said: list[str] = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("aiokv")
        returned: list[int] = []
        argv = ["store-server", "--socket", str(self.socket), "--config", str(self.config)]
        runs = threading.Thread(target=lambda: returned.append(cli.main(argv)), daemon=True)
        logger.addHandler(handler)
        try:
            runs.start()
            runs.join(60)
        finally:
            logger.removeHandler(handler)
        assert returned, "the store-server did not return; it logged: " + "\n".join(said)
        return returned[0], "\n".join(said)

    def signal(self, signum: int) -> int:
        assert self.process is not None
        self.process.send_signal(signum)
        return self.process.wait(timeout=30)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def text(self) -> str:
        return self.log.read_text()


def observer(socket_path: Path) -> tuple[SharedStore, list[torch.Tensor]]:
    """A client of the test's own (and its caches), for the server's figures and raw
    checks."""
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(socket_path)))
    tables = caches()
    store.register(tables)
    return store, tables


def connect(server: Server) -> socket.socket:
    """A raw connection to the server (no hello yet)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.socket))
    return sock


def hello(sock: socket.socket) -> None:
    """Register a raw connection as an engine of :func:`caches`' geometry."""
    sockets.send(sock, wire.encode_json({"op": "hello", "wire": wire.VERSION,
                                         "geometry": Geometry.of(caches()).as_dict()}))
    reply, fds = sockets.recv_json(sock)
    assert reply["ok"], reply
    for fd in fds:
        os.close(fd)


class Host:
    """One serving process's engine on the shared store (in the child)."""

    def __init__(self, socket_path: str, device: str = "cpu") -> None:
        self.caches = caches(device=device)
        config = {"store": {"backend": "shared", "socket": socket_path},
                  "engine": {"request_timeout_ms": 20_000}}
        engine = aiokv.open_engine(config, kv_caches=self.caches)
        self.kv = aiokv.run_in_background(engine)
        self.held: dict[int, Any] = {}

    def offload(self, user: int, pages: int, first_page: int = 0) -> dict[str, Any]:
        target = slice(first_page, first_page + pages)
        for cache, kv in zip(self.caches, user_kv(user, pages), strict=True):
            cache[target] = kv.to(cache.device)
        result = self.kv.offload(user, torch.arange(target.start, target.stop),
                                 pages * PAGE_SIZE)
        return {"stored": result.stored_tokens, "cached": result.cached_tokens}

    def load(self, user: int, pages: int) -> dict[str, Any]:
        self.lookup(user, pages)
        return self.load_held(user, pages)

    def lookup(self, user: int, pages: int) -> dict[str, Any]:
        """A Lookup kept (its blocks held at the server) until :meth:`load_held`."""
        self.held[user] = self.kv.lookup(user, pages * PAGE_SIZE)
        return {"cached": self.held[user].cached_tokens}

    def held_state(self, user: int) -> dict[str, Any]:
        """What the kept Lookup of ``user`` says now (read, no call to the engine)."""
        hit = self.held[user]
        return {"held": hit.held, "repr": repr(hit)}

    def load_held(self, user: int, pages: int, fill: float | None = None) -> dict[str, Any]:
        """The kept Lookup loaded into the last ``pages`` pages, zeroed first (``fill``:
        set to that instead, and "untouched" says whether the pages past what loaded
        still hold it, byte for byte)."""
        first = PAGES - pages
        for cache in self.caches:
            cache[first:] = 0 if fill is None else fill
        with self.held.pop(user) as hit:
            cached = hit.cached_tokens
            loaded = self.kv.load(hit, torch.arange(first, PAGES)).loaded_tokens
        full = loaded // PAGE_SIZE
        exact = all(torch.equal(cache[first : first + full].cpu(), kv[:full])
                    for cache, kv in zip(self.caches, user_kv(user, pages), strict=True))
        answer = {"cached": cached, "loaded": loaded, "exact": exact}
        if fill is not None:
            answer["untouched"] = all(bool((cache[first + full :] == fill).all())
                                      for cache in self.caches)
        return answer

    def evict(self, user: int) -> dict[str, Any]:
        return {"dropped": self.kv.evict(user)}

    def clear(self) -> dict[str, Any]:
        return {"dropped": self.kv.clear()}


class Holder:
    """A raw SharedStore that matches and then holds (for kill -9 mid-transfer)."""

    def __init__(self, socket_path: str) -> None:
        self.store = SharedStore(aiokv.StoreConfig(backend="shared", socket=socket_path))
        self.caches = caches()
        self.store.register(self.caches)
        self.open: tuple[int, int] = (0, 0)

    def hold(self, user: int, pages: int) -> dict[str, Any]:
        """A put reserved and launched (its pages copied into the region, its end never
        reported: mid-transfer as the server sees it), and a get holding ``user``'s
        stored pages."""
        tokens = np.arange(pages * PAGE_SIZE, dtype=np.int64)
        put, put_mask = self.store.put_match(tokens, [f"new:{user}"])
        self.store.launch([put], [torch.arange(pages)], [None])
        get, get_mask = self.store.get_match(tokens, [f"uid:{user}"])
        self.open = (put, get)
        return {"reserved": int(put_mask.sum()), "held": int(get_mask.sum())}

    def release(self) -> dict[str, Any]:
        """The held get given back, the put's end reported (it succeeds)."""
        put, get = self.open
        self.store.cancel([get])
        results: dict[int, Any] = {}
        while not results:
            results = self.store.try_wait([put])
        return {"put": results[put].status.value}


def _serve(kind: str, socket_path: str, device: str,
           conn: multiprocessing.connection.Connection) -> None:
    try:
        host: Any = Host(socket_path, device) if kind == "engine" else Holder(socket_path)
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"ready": True})
    while True:
        op, args = conn.recv()
        if op == "close":
            if kind == "engine":
                host.kv.close()
            conn.send({})
            return
        try:
            conn.send(getattr(host, op)(**args))
        except Exception as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


class Process:
    """An engine (``kind`` "engine") or a holder in a spawned process."""

    def __init__(self, socket_path: Path, kind: str = "engine", device: str = "cpu") -> None:
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_serve,
                                        args=(kind, str(socket_path), device, child),
                                        daemon=True)
        self.process.start()
        child.close()

    def ready(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.conn.recv()
        return answer

    def send(self, op: str, **args: Any) -> None:
        self.conn.send((op, args))

    def answer(self) -> dict[str, Any]:
        if not self.conn.poll(60):
            raise TimeoutError("no answer in 60 s")
        result: dict[str, Any] = self.conn.recv()
        return result

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.answer()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self("close")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_processes(socket_path: Path, count: int, kind: str = "engine",
                    device: str = "cpu") -> list[Process]:
    """``count`` processes started together (their imports overlap), each ready."""
    processes = [Process(socket_path, kind, device) for _ in range(count)]
    for process in processes:
        answer = process.ready()
        if "error" in answer:
            raise RuntimeError(answer["error"])
    return processes


@contextlib.contextmanager
def running_host(directory: Path, engines: int, device: str = "cpu"
                 ) -> Iterator[tuple[Server, list[Process]]]:
    """A server and ``engines`` engine processes on it, all ended on exit."""
    server = Server(directory).start()
    processes = start_processes(server.socket, engines, device=device)
    try:
        yield server, processes
    finally:
        for process in processes:
            process.close()
        server.kill()
