"""A background engine's end when its closer is interrupted or its loop dies: the store is
closed and the threads end either way, later calls raise EngineClosed, and a second
``close()`` returns (an interrupted close cancelled the engine's close half-way, leaving
its store open and its threads running; a dead loop left every call raising
RuntimeError and a call handed over in its last iteration unresolved). A process that exits
with its engine never closed, mid-transfer, exits cleanly (it aborted in torch's copy)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import exits_cleanly_never_closed, hold_the_loop, make_caches
from test_sync import LOOPS

import aiokv
from aiokv.testing import FakeStore

ROOT = Path(__file__).resolve().parents[1]


class Interrupted(BaseException):
    """What a signal handler raises in the main thread, as KeyboardInterrupt does."""


class SlowStore(FakeStore):
    """Each launch takes half a second; ``closed`` once closed."""

    closed = False

    def launch(self, task_ids: Sequence[int], pages: Sequence[Any], ready: Sequence[Any]) -> None:
        time.sleep(0.5)
        super().launch(task_ids, pages, ready)

    def close(self) -> None:
        self.closed = True
        super().close()


class HeldStore(FakeStore):
    """Each launch waits for ``finish`` (``launching`` is set once one does): a launch
    that cannot end before the test lets it. ``closed`` once closed."""

    closed = False

    def __init__(self) -> None:
        super().__init__()
        self.launching, self.finish = threading.Event(), threading.Event()

    def launch(self, task_ids: Sequence[int], pages: Sequence[Any], ready: Sequence[Any]) -> None:
        self.launching.set()
        self.finish.wait(30)
        super().launch(task_ids, pages, ready)

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")
def test_a_close_whose_waiter_is_interrupted_still_drains_closes_and_ends() -> None:
    # No sleeps: a signal sent on a timer came after the close had returned where the
    # host was slow (pytest.raises saw nothing, and Interrupted struck later).
    store = HeldStore()
    engine = aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(window_us=0))
    kv = aiokv.run_in_background(engine)
    offloading = kv.submit_offload(1, torch.arange(0, 2), 8)
    assert store.launching.wait(30)  # dispatched: the store thread is in its launch

    def interrupt(signum: int, frame: object) -> None:
        store.finish.set()  # the drain could not end before this
        raise Interrupted

    def once_draining() -> None:
        deadline = time.monotonic() + 30
        while engine.state is not aiokv.EngineState.DRAINING and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=once_draining, daemon=True).start()
        with pytest.raises(Interrupted):
            kv.close()  # a drain: it waits for the launch
    finally:
        signal.signal(signal.SIGUSR1, previous)
    kv.close()  # waits for the same close; it was not cancelled
    assert offloading.result(timeout=0).stored_tokens == 8  # drained, not cancelled
    assert store.closed
    assert engine.state is aiokv.EngineState.CLOSED
    assert not kv._thread.is_alive()
    with pytest.raises(aiokv.EngineClosed):
        kv.offload(2, torch.arange(2, 4), 8)


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_a_close_whose_loop_tasks_a_shutdown_cancels_still_closes_the_engine(
    loop_kind: str,
) -> None:
    # A shutdown on the engine's own loop cancels every task there, the close's too, while
    # close() waits in another thread: close() returned CancelledError (every later one
    # too) and the engine stayed draining, its store open and its threads running.
    store = HeldStore()
    engine = aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(window_us=0))
    kv = aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind])
    offloading = kv.submit_offload(1, torch.arange(0, 2), 8)
    assert store.launching.wait(30)  # the close's drain waits for this launch
    outcome: list[BaseException | None] = []

    def close() -> None:
        try:
            kv.close(timeout=30)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    deadline = time.monotonic() + 30
    while engine.state is not aiokv.EngineState.DRAINING and time.monotonic() < deadline:
        time.sleep(0.005)

    def cancel_every_task() -> None:
        for task in asyncio.all_tasks():
            task.cancel()

    kv.loop.call_soon_threadsafe(cancel_every_task)
    store.finish.set()
    closer.join(30)
    assert outcome == [None]
    kv.close()  # a second close returns too
    assert store.closed
    assert engine.state is aiokv.EngineState.CLOSED
    assert not kv._thread.is_alive()
    with pytest.raises(aiokv.EngineClosed):
        kv.offload(2, torch.arange(2, 4), 8)
    assert offloading.done()


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
def test_a_close_a_shutdown_cancelled_keeps_its_callers_timeout(loop_kind: str) -> None:
    # The close finished after the shutdown ran with aclose's default 30 s, not the
    # caller's 1 s: close(timeout=1) blocked its thread for 30 s behind a stuck store.
    store = HeldStore()
    engine = aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(window_us=0))
    kv = aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind])
    kv.submit_offload(1, torch.arange(0, 2), 8)
    assert store.launching.wait(30)  # stuck in its launch until the test ends
    took: list[float] = []

    def close() -> None:
        began = time.monotonic()
        kv.close(timeout=1.0)
        took.append(time.monotonic() - began)

    closer = threading.Thread(target=close)
    closer.start()
    deadline = time.monotonic() + 30
    while engine.state is not aiokv.EngineState.DRAINING and time.monotonic() < deadline:
        time.sleep(0.005)
    kv.loop.call_soon_threadsafe(
        lambda: [task.cancel() for task in asyncio.all_tasks()])
    try:
        closer.join(60)
        assert len(took) == 1 and took[0] < 15  # 1 s and the loop's latency; was 30 s
        assert engine.state is aiokv.EngineState.CLOSED
    finally:
        store.finish.set()  # the store thread, left to end on its own, ends


def _exit() -> None:
    raise SystemExit("a callback on the engine's loop exits")


@pytest.mark.parametrize("loop_kind", sorted(LOOPS))
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it dies
def test_a_loop_that_dies_closes_the_engine_and_answers_every_call(loop_kind: str) -> None:
    store = SlowStore()
    engine = aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(window_us=0))
    kv = aiokv.run_in_background(engine, loop_factory=LOOPS[loop_kind])
    release = hold_the_loop(kv)
    kv.loop.call_soon_threadsafe(_exit)  # the loop dies at this callback ...
    handed = kv.submit_offload(2, torch.arange(2, 4), 8)  # ... with this one queued behind
    release.set()
    with pytest.raises((aiokv.EngineClosed, concurrent.futures.CancelledError)):
        handed.result(timeout=30)
    with pytest.raises(aiokv.EngineClosed):
        kv.offload(3, torch.arange(4, 6), 8)
    kv.close()  # returns, once the engine is closed
    assert store.closed
    assert engine.state is aiokv.EngineState.CLOSED
    assert not kv._thread.is_alive()
    assert kv.stats().pending == 0


@pytest.mark.parametrize("device", [
    "cpu",
    # On a GPU: the copy engines' threads, the host tier's pinning thread (aiokv-pin).
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")),
])
@pytest.mark.parametrize("scenario", ["thread", "asyncio"])
def test_a_process_exiting_mid_transfer_with_its_engine_never_closed_exits_cleanly(
    scenario: str, device: str, tmp_path: Path
) -> None:
    # Its copy thread, a daemon inside torch's copy when the interpreter finalized, was
    # ended there by CPython: std::terminate, the process aborted (SIGABRT) 9 times in 10.
    stores: list[dict[str, object]] = []
    for run in range(3):
        store: dict[str, object] = {"cpu_cache_gb": 0.05}
        if scenario == "asyncio":  # the SSD tier's threads too, a directory each
            ssd_dir = tmp_path / f"ssd{run}"
            ssd_dir.mkdir()
            store.update(ssd_cache_gb=0.2, ssd_cache_dir=str(ssd_dir))
        stores.append(store)
    exits_cleanly_never_closed(scenario, device, *stores)


# A child forked while a thread of its parent is in the middle of a submit (it holds the
# handle's lock, as a submit does: taken here by hand so that the fork finds it held
# every time); the child touches nothing of aiokv and exits normally, its atexit hooks
# run. Prints whether it had exited 30 s on.
_FORKED_EXIT = """
import os, signal, sys, threading, time, torch, aiokv
caches = [torch.zeros(256, 2, 16, 2, 8) for _ in range(2)]
kv = aiokv.run_in_background(aiokv.open_engine({"store": {"cpu_cache_gb": 0.02}},
                                               kv_caches=caches))
kv.submit_offload("u", torch.arange(4), 64).result()
in_submit, fork_done = threading.Event(), threading.Event()
def submitting():
    with kv._lock:
        in_submit.set()
        fork_done.wait()
threading.Thread(target=submitting, daemon=True).start()
in_submit.wait()
pid = os.fork()
if pid == 0:
    sys.exit(0)
fork_done.set()
deadline = time.monotonic() + 30
while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.02)
exited = time.monotonic() < deadline
if not exited:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
kv.close()
print("exited" if exited else "hung", flush=True)
"""


def test_a_child_forked_mid_submit_beside_a_background_engine_exits() -> None:
    # The exit hook stopped the parent's engines in the child too: it took the handle's
    # lock, held by a parent's thread the child does not have, and waited for ever
    # (8 children in 40 forked beside two submitting threads never exited).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FORKED_EXIT], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["exited"], (done.stdout, done.stderr[-2000:])
