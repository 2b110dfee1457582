"""A store process that is stuck, stalls, or is left behind by its engine's process never
holds a caller or the host's resources for good: it ends when its engine's process dies
(kill -9), with what it started, even while stuck in a store call; an answer it stops
sending half-way fails its call at ``call_timeout_s``; and a child killed that takes long
to exit is still restarted once it has. Seen on the GPU machine: a FlexKV child stuck in
its transfer engine's start outlived its killed test process by ten minutes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import aiokv
from aiokv.stores import ProcessStore, link, spawn

# Loaded at start-up by every interpreter that has it on PYTHONPATH; in the store process
# it changes the local store as STORE_FAULT says (FAULT_FILE: where it writes pids).
SITECUSTOMIZE = textwrap.dedent(
    """
    import os
    fault = os.environ.get("STORE_FAULT")
    if fault:
        import signal, subprocess, time
        from multiprocessing import connection
        from aiokv.stores.local import LocalStore
        register = LocalStore.register

        def tell(*pids):
            path = os.environ["FAULT_FILE"]
            with open(path + ".tmp", "w") as out:
                out.write(" ".join(map(str, pids)))
            os.replace(path + ".tmp", path)

        def stuck_register(self, kv_caches):  # a call that nothing will ever answer
            tell(os.getpid())
            while True:
                time.sleep(3600)

        def register_and_start(self, kv_caches):  # as FlexKV starts its own processes
            register(self, kv_caches)
            tell(os.getpid(), subprocess.Popen(["sleep", "1000"]).pid)

        def stop_mid_answer(self):  # its answer is written in two parts: stop between
            send = connection.Connection._send

            def _send(conn, buf):
                send(conn, buf)
                if len(buf) == 4:
                    os.kill(os.getpid(), signal.SIGSTOP)
            connection.Connection._send = _send
            return {f"figure_{i}": i for i in range(5000)}

        def stuck_stats(self):
            while True:
                time.sleep(3600)

        def watched_pid(fd):  # the process a pidfd refers to, None for another descriptor
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[pidfd]":
                    return None
                with open(f"/proc/self/fdinfo/{fd}") as info:
                    return next(int(line.split()[1]) for line in info
                                if line.startswith("Pid:"))
            except (OSError, TypeError, StopIteration):
                return None

        def tell_who_is_watched():  # once a wait with no timeout is on a process's end
            import select
            real_select = select.select

            def waiting_select(r, w, x, timeout=None):
                pids = [pid for pid in map(watched_pid, r) if pid is not None]
                if pids and timeout is None:
                    tell(*pids)
                return real_select(r, w, x, timeout)
            select.select = waiting_select

        if fault == "stuck_register":
            LocalStore.register = stuck_register
        elif fault == "starts_a_process":
            LocalStore.register = register_and_start
        elif fault == "stops_mid_answer":
            LocalStore.store_stats = stop_mid_answer
        elif fault == "stuck_stats":
            LocalStore.store_stats = stuck_stats
        elif fault == "tells_who_is_watched":
            tell_who_is_watched()
    """
)

ENGINE = textwrap.dedent(
    """
    import torch
    import aiokv
    import aiokv.stores.spawn as spawn

    spawn.ORPHAN_GRACE_S = 0.5
    store = aiokv.ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register([torch.zeros(16, 2, 4, 2, 8)])
    input()  # serves until killed
    """
)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; its reaper is not ours


def with_fault(tmp_path: Path, fault: str) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dict(os.environ, STORE_FAULT=fault, FAULT_FILE=str(tmp_path / "pids"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path),
                                                         os.environ.get("PYTHONPATH")])))


def pids_when_written(path: Path, engine: subprocess.Popen[bytes] | None) -> list[int]:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert engine is None or engine.poll() is None, "the engine's process ended first"
        assert time.monotonic() < deadline, "the store process never wrote its pids"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


@pytest.mark.parametrize("fault", ["stuck_register", "starts_a_process"])
def test_a_store_process_ends_with_what_it_started_when_its_engine_is_killed(
    tmp_path: Path, fault: str
) -> None:
    # stuck_register: its loop never sees the socket's end; starts_a_process: it does, and
    # closes, but what it started would live on.
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], env=with_fault(tmp_path, fault),
                              stdin=subprocess.PIPE)
    pids: list[int] = []
    try:
        pids = pids_when_written(tmp_path / "pids", engine)
        engine.kill()
        engine.wait()
        deadline = time.monotonic() + 60  # its grace is 0.5 s, its watch looks twice a second
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if alive(pid)], "outlived the engine's process"
    finally:
        if engine.poll() is None:
            engine.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def healthy_calls_get_a_minute(monkeypatch: pytest.MonkeyPatch, store: ProcessStore) -> None:
    """The calls after the one meant to time out are healthy, to a fresh child: the 1 s
    meant for the stuck call would fail them (and kill that child too) wherever a loaded
    runner stalls the child that long."""
    monkeypatch.setattr(store, "_call_timeout_s", 60.0)


def test_an_answer_stopped_half_way_fails_its_call_at_call_timeout_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for key, value in with_fault(tmp_path, "stops_mid_answer").items():
        monkeypatch.setenv(key, value)
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01), call_timeout_s=1.0)
    store.register([torch.zeros(16, 2, 4, 2, 8)])
    try:
        first = store.pid
        started = time.monotonic()
        store.store_stats()  # the figures it gave last ({} here): it failed, not hung
        assert time.monotonic() - started < 60  # failed at 1 s, not waited on for good
        assert "did not finish its answer to store_stats within 1 s" in caplog.text
        healthy_calls_get_a_minute(monkeypatch, store)
        store.get_match(np.arange(8, dtype=np.int64), ())  # a new child serves
        assert store.pid != first
    finally:
        store.close()


def test_a_killed_child_that_exits_late_is_still_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A child that holds gigabytes takes seconds to exit after its kill: the call that
    # killed it no longer waits for that (0 s here), the next one restarts it.
    monkeypatch.setattr(link, "_EXIT_WAIT_S", 0.0)
    for key, value in with_fault(tmp_path, "stuck_stats").items():
        monkeypatch.setenv(key, value)
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01, store_restarts=2),
                         call_timeout_s=1.0)
    store.register([torch.zeros(16, 2, 4, 2, 8)])
    try:
        first = store.pid
        store.store_stats()  # the child is killed at call_timeout_s
        healthy_calls_get_a_minute(monkeypatch, store)
        deadline = time.monotonic() + 60
        while alive(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(100):  # calls fail fast ("not answering") until it is reaped
            try:
                task, _ = store.get_match(np.arange(8, dtype=np.int64), ())
                break
            except aiokv.StoreError:
                time.sleep(0.05)
        assert store.pid != first and store.restarts == 1
        store.cancel([task])
    finally:
        store.close()


@pytest.mark.parametrize("when", ["before the start", "after the start"])
def test_a_default_socket_timeout_anywhere_in_the_program_breaks_no_call(
    when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # socket.setdefaulttimeout() (some libraries set one) makes every socket object
    # non-blocking, one made over the call socket's descriptor too.
    caches = [torch.randn(4096, 2, 16, 2, 16) for _ in range(2)]
    try:
        if when == "before the start":
            socket.setdefaulttimeout(30)
        store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.5))
        store.register(caches)
        socket.setdefaulttimeout(30)
        try:
            tokens = [np.arange(i * 4096, (i + 1) * 4096, dtype=np.int64) for i in range(64)]
            answers = store.put_match_many([(t, ()) for t in tokens])  # answers of 100s of KiB
            assert not [a for a in answers if isinstance(a, BaseException)]
            store.cancel([task for task, _ in answers])  # type: ignore[misc]
            assert store.restarts == 0
        finally:
            store.close()
    finally:
        socket.setdefaulttimeout(None)


def test_a_launcher_between_the_engine_and_its_store_process_is_no_orphaning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sys.executable that runs Python as its child (no exec): the store process's
    # parent is the launcher, and the engine lives.
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\n"{sys.executable}" "$@"\n')
    launcher.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(launcher))
    monkeypatch.setattr(spawn, "ORPHAN_GRACE_S", 0.25)
    for key, value in with_fault(tmp_path, "tells_who_is_watched").items():
        monkeypatch.setenv(key, value)
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register([torch.zeros(16, 2, 4, 2, 8)])
    try:
        # Seen, not assumed after a sleep: the store process's watch waits, with no
        # timeout, for this process's end (the engine's), not for its parent's (the
        # launcher's, which a watch of getppid() took for the engine's end at once).
        assert pids_when_written(tmp_path / "pids", None) == [os.getpid()]
        task, _ = store.get_match(np.arange(8, dtype=np.int64), ())
        store.cancel([task])
        assert store.restarts == 0
    finally:
        store.close()
