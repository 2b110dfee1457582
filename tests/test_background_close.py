"""A background engine's end when its closer is interrupted or its loop dies: the store is
closed and the threads end either way, later calls raise EngineClosed, and a second
``close()`` returns (an interrupted close cancelled the engine's close half-way, leaving
its store open and its threads running; a dead loop left every call raising
RuntimeError and a call handed over in its last iteration unresolved)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from conftest import hold_the_loop, make_caches
from test_sync import LOOPS

import aiokv
from aiokv.testing import FakeStore


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


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")
def test_a_close_whose_waiter_is_interrupted_still_drains_closes_and_ends() -> None:
    store = SlowStore()
    engine = aiokv.OffloadEngine(store, make_caches(), aiokv.EngineConfig(window_us=0))
    kv = aiokv.run_in_background(engine)
    offloading = kv.submit_offload(1, torch.arange(0, 2), 8)
    time.sleep(0.1)  # dispatched: the store thread is in its slow launch
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
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

