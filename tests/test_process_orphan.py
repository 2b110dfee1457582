"""A store process whose engine's process dies (kill -9) while the store is stuck in a
call ends anyway, with what it started: it would otherwise hold its pinned memory (and,
on FlexKV, a GPU context) for good. Seen on the GPU machine: a FlexKV child stuck in its
transfer engine's start outlived its killed test process by ten minutes, until killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# Loaded at start-up by both interpreters (PYTHONPATH): in the store process, the local
# store's register writes this process's pid and never returns, as a store stuck in a
# call that nothing will answer.
SITECUSTOMIZE = textwrap.dedent(
    """
    import os
    if os.environ.get("STUCK_PIDFILE"):
        import time
        from aiokv.stores.local import LocalStore

        def register(self, kv_caches):
            with open(os.environ["STUCK_PIDFILE"] + ".tmp", "w") as out:
                out.write(str(os.getpid()))
            os.replace(os.environ["STUCK_PIDFILE"] + ".tmp", os.environ["STUCK_PIDFILE"])
            while True:
                time.sleep(3600)

        LocalStore.register = register
    """
)

ENGINE = textwrap.dedent(
    """
    import torch
    import aiokv
    import aiokv.stores.spawn as spawn

    spawn.ORPHAN_GRACE_S = 1.0
    store = aiokv.ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register([torch.zeros(16, 2, 4, 2, 8)])  # the child never answers
    """
)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; its reaper is not ours


def test_a_store_process_stuck_in_a_call_ends_when_its_engine_is_killed(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    pidfile = tmp_path / "child.pid"
    env = dict(os.environ, STUCK_PIDFILE=str(pidfile), PYTHONPATH=os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], env=env)
    child = 0
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists():
            assert engine.poll() is None, "the engine's process ended before its store's call"
            assert time.monotonic() < deadline, "the store process never reached its register"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        engine.kill()
        engine.wait()
        deadline = time.monotonic() + 20  # its grace is 1 s, its watch looks twice a second
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the store process outlived its engine's process"
    finally:
        if engine.poll() is None:
            engine.kill()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
