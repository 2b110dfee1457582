"""Shared fixtures. Every async test runs under the default loop and under uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any

import numpy as np
import pytest
import torch
import uvloop

import aiokv
from aiokv.remote.link import RemoteLink
from aiokv.remote.markers import Markers
from aiokv.remote.native import unavailable
from aiokv.remote.servers import MooncakeServers
from aiokv.stores.local import ssd_io

# The plugin's fixtures (aiokv_engine, ...). An install made before its pytest11 entry
# point existed does not load it by itself.
PLUGIN_INSTALLED = any(ep.value == "aiokv.pytest_plugin" for ep in entry_points(group="pytest11"))
# pytester: test_pytest_plugin.py runs a user's suite in a pytest session of its own.
pytest_plugins = ["pytester"] + ([] if PLUGIN_INSTALLED else ["aiokv.pytest_plugin"])


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 256, 4, 2, 8


def wait_for_exit(pid: int, timeout_s: float = 120.0) -> None:
    """Block until process ``pid`` (a store's child) has exited; its parent reaps it."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # exited and reaped already
    try:
        assert select.select([handle], [], [], timeout_s)[0], f"pid {pid} did not exit"
    finally:
        os.close(handle)


def make_caches(
    pages: int = PAGES, page_size: int = PAGE_SIZE, layers: int = LAYERS, seed: int = 0
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(pages, 2, page_size, HEADS, HEAD_DIM, generator=generator)
        for _ in range(layers)
    ]


@pytest.fixture
def caches() -> list[torch.Tensor]:
    return make_caches()


def one_batch(users: int) -> aiokv.EngineConfig:
    """An engine config whose batches wait for ``users`` requests (or a 10 s window)."""
    return aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=users)


def small_store(cpu_cache_gb: float = 0.01) -> aiokv.LocalStore:
    return aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=cpu_cache_gb))


def failing_first_call(function: Callable[..., Any], message: str) -> Callable[..., Any]:
    """``function``, except that its first call raises RuntimeError(message): for
    monkeypatching one step of the engine into failing once."""
    calls = 0

    def wrapped(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError(message)
        return function(*args)

    return wrapped


def failing_header_voids(monkeypatch: pytest.MonkeyPatch, meta_too: bool = False) -> None:
    """The SSD tier's header voids (a write of one zeroed header, what an evict does to
    the slots that name its key) fail with EIO from now on, and with ``meta_too`` its
    meta files' writes (a new epoch); its data writes go on."""
    real = ssd_io.SsdFiles.write

    def eio() -> OSError:
        return OSError(errno.EIO, os.strerror(errno.EIO))

    def write(files: ssd_io.SsdFiles, k: int, offset: int, buffers: Any) -> None:
        if len(buffers) == 1:
            raise eio()
        real(files, k, offset, buffers)

    def write_meta(*args: Any) -> None:
        raise eio()

    monkeypatch.setattr(ssd_io.SsdFiles, "write", write)
    if meta_too:
        monkeypatch.setattr(ssd_io, "write_meta", write_meta)


def slow_header_voids(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The SSD tier's header voids (one-header writes) wait for the returned event (30 s
    at most) before they are written; its data writes go on."""
    gate = threading.Event()
    real = ssd_io.SsdFiles.write

    def write(files: ssd_io.SsdFiles, k: int, offset: int, buffers: Any) -> None:
        if len(buffers) == 1:  # a header void
            gate.wait(30)
        real(files, k, offset, buffers)

    monkeypatch.setattr(ssd_io.SsdFiles, "write", write)
    return gate


def launch_slots(store: Any, task_ids: Any, slot_mappings: Any) -> None:
    """``store.launch`` for tests written with slot mappings of whole pages (``page *
    page_size + 0..page_size-1``): each task's page ids, on the CPU, ready at once."""
    size = store.page_size
    pages = [torch.as_tensor(np.asarray(s, dtype=np.int64)[::size] // size) for s in slot_mappings]
    store.launch(list(task_ids), pages, [None] * len(pages))


class Gate(threading.Event):
    """An event that calls wait at (:func:`held`); ``entered`` is set once one does."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()


def held(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str,
         when: Callable[..., bool] | None = None) -> Gate:
    """``owner.name`` made to wait for the gate returned (30 s at most) before it runs,
    for the calls ``when(*args)`` picks (all by default): a slow SSD on demand."""
    gate = Gate()
    real = getattr(owner, name)

    def waiting(*args: Any) -> Any:
        if when is None or when(*args):
            gate.entered.set()
            gate.wait(30)
        return real(*args)

    monkeypatch.setattr(owner, name, waiting)
    return gate


def offers_once_learned(monkeypatch: pytest.MonkeyPatch, ns: str,
                        wait_s: float = 30.0) -> threading.Event:
    """Puts' offers (``RemoteLink.offer``) wait (``wait_s`` at most) until a markers call
    that asked for namespace ``ns`` (a tag) returned with its host past an evict of it
    (its generation past 0): a copy slower than that call. Not Mooncake's answer alone:
    the call moves the host's view after it, and an offer between would be of the view
    before. The event returned is set then."""
    learned = threading.Event()
    past, offer = Markers.past, RemoteLink.offer

    def past_then_tell(markers: Markers, client: Any, items: Any) -> Any:
        found = past(markers, client, items)
        if any(asked == ns for asked, _ in items) and markers.keys.view(ns)[2] > 0:
            learned.set()
        return found

    def offer_once_learned(link: RemoteLink, tasks: Any) -> None:
        learned.wait(wait_s)
        offer(link, tasks)

    monkeypatch.setattr(Markers, "past", past_then_tell)
    monkeypatch.setattr(RemoteLink, "offer", offer_once_learned)
    return learned


def hold_the_loop(kv: aiokv.BackgroundEngine) -> threading.Event:
    """Block the loop's thread until the returned event is set (the loop then takes
    nothing submitted meanwhile)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(30)

    kv.loop.call_soon_threadsafe(hold)
    assert held.wait(30)
    return release


def needs_mooncake() -> pytest.MarkDecorator:
    """A module's mark: skip where Mooncake's client cannot load at all; in CI (``make
    test`` installs it) it must run."""
    why_not = unavailable()
    if why_not is not None and os.environ.get("CI"):
        raise RuntimeError(f"CI must run the remote tier's tests: {why_not}")
    return pytest.mark.skipif(why_not is not None, reason=f"Mooncake cannot run: {why_not}")


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServers]:
    """A Mooncake master and store process on 127.0.0.1 for the session (256 MiB: the
    remote tests write tens of MiB, and a store near its high watermark evicts values that
    later tests read: one fresh run of 64 MiB lost three tests so)."""
    with MooncakeServers(segment_mb=256, log_dir=tmp_path_factory.mktemp("mooncake")) as servers:
        yield servers


def outcomes_in_a_forked_child(
    calls: list[tuple[str, Callable[[], Any]]],
) -> tuple[dict[str, str], int]:
    """Fork; the child runs each call, writes one line per outcome and leaves. The
    outcomes by call name, and the child's pid."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            for name, call in calls:
                try:
                    said = f"returned {call()!r}"
                except BaseException as exc:
                    said = f"{type(exc).__name__}: {exc}"
                os.write(write_end, f"{name}: {said}\n".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    lines = b""
    try:
        # A bound on a hang, not a timing: the child answers at once or never.
        while select.select([read_end], [], [], 60)[0]:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            lines += chunk
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a child that hung; gone already otherwise
        os.waitpid(pid, 0)
    return dict(line.split(": ", 1) for line in lines.decode().splitlines()), pid


# An engine never closed, mid-transfer as its process exits (argv: the scenario, the
# caches' device, the store section as JSON): "thread", a run_in_background handle with
# a daemon thread offloading; "asyncio", asyncio.run left with offloads in flight. Each
# offload copies 4 MiB, so the copy thread is in its copy most of the time.
_NEVER_CLOSED = """
import asyncio, json, sys, threading, torch, aiokv
scenario, device, store = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
caches = [torch.randn(512, 2, 16, 4, 64, device=device) for _ in range(4)]
# Batches of 4 offloads: one copy job each, so that jobs are still queued as one ends.
config = {"engine": {"window_us": 0, "max_batch_requests": 4}, "store": store}
# Made once: a thread of the caller's own in torch as the interpreter finalizes aborts
# the process too, aiokv or not.
PAGES = [torch.arange(i * 32, i * 32 + 32) for i in range(16)]
def pages(i):
    return PAGES[i % 16]
if scenario == "thread":
    kv = aiokv.run_in_background(aiokv.open_engine(config, kv_caches=caches))
    offloaded = threading.Event()
    def offload_forever():
        user = 0
        while True:
            for f in [kv.submit_offload(user + i, pages(i), 512) for i in range(16)]:
                f.result()
            user += 16
            offloaded.set()
    threading.Thread(target=offload_forever, daemon=True).start()
    offloaded.wait()
else:
    async def main():
        engine = aiokv.open_engine(config, kv_caches=caches)
        await engine.start()
        await asyncio.gather(*[engine.offload(i, pages(i), 512) for i in range(16)])
        offloads = [asyncio.ensure_future(engine.offload(i, pages(i), 512)) for i in range(16, 64)]
        # Once one ended, the rest were handed to the store: they are copied as main returns.
        await asyncio.wait(offloads, return_when=asyncio.FIRST_COMPLETED)
    asyncio.run(main())
print("offloaded", flush=True)
"""


def exits_cleanly_never_closed(scenario: str, device: str, *stores: dict[str, Any]) -> None:
    """Processes whose engine (``stores`` their store sections, one process each) is never
    closed exit in the middle of their transfers, ``scenario`` "thread" or "asyncio": each
    with status 0, no abort and no traceback. The processes run side by side: an abort
    was a matter of chance per process (not of the others), and each is checked alone."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with contextlib.ExitStack() as files:
        # Files, not pipes: a process must not wait on a full pipe while another is read.
        outputs = [(files.enter_context(tempfile.TemporaryFile("w+")),
                    files.enter_context(tempfile.TemporaryFile("w+"))) for _ in stores]
        processes = [subprocess.Popen([sys.executable, "-c", _NEVER_CLOSED, scenario, device,
                                       json.dumps(store)],
                                      stdout=out, stderr=err, text=True, env=env)
                     for store, (out, err) in zip(stores, outputs, strict=True)]
        try:
            for process, (out, err) in zip(processes, outputs, strict=True):
                process.wait(timeout=120)
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read(), err.read()
                assert "terminate called" not in stderr, stderr[-2000:]
                assert "Traceback" not in stderr, stderr[-2000:]
                assert process.returncode == 0, (process.returncode, stderr[-2000:])
                assert stdout.split() == ["offloaded"], (stdout, stderr[-2000:])
        finally:
            for process in processes:  # one that hung, or left by a failed check
                process.kill()
                process.wait()
