"""One store per SSD directory: a second opener (an engine of this process, another
process, a store in a process of its own) fails with a ConfigError naming the directory
and the holder, and opens once the first store closes or its process dies (kill -9)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from conftest import PAGE_SIZE, make_caches

import aiokv

BLOCK = 2 * 2 * PAGE_SIZE * 2 * 8 * 4  # conftest's caches: 1 KiB a page
SLOT = 8 << 10  # a 4 KiB header and the block, rounded up to 4 KiB
ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 120.0  # a child imports torch on two busy cores: generous, and bounded
TOKENS = 4 * PAGE_SIZE


def config(directory: Any, **keys: Any) -> aiokv.StoreConfig:
    return aiokv.StoreConfig(
        cpu_cache_gb=64 * BLOCK / (1 << 30), ssd_cache_gb=128 * SLOT / (1 << 30),
        ssd_cache_dir=directory, **keys,
    )


def engine_on(
    directory: Any, caches: list[torch.Tensor], store: aiokv.stores.Store | None = None
) -> aiokv.OffloadEngine:
    store = store or aiokv.LocalStore(config(directory))
    return aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))


async def refused(directory: Path, holder_pid: int, dirs: Any = None) -> None:
    """Starting an engine on ``directory`` (or on ``dirs``, which name it) fails,
    naming the directory and its holder."""
    engine = engine_on(dirs or directory, make_caches())
    with pytest.raises(aiokv.ConfigError) as caught:
        await engine.start()
    assert caught.value.key == "store.ssd_cache_dir"
    assert repr(str(directory)) in str(caught.value)
    assert f"pid {holder_pid} on host {socket.gethostname()}" in str(caught.value)


async def round_trip(engine: aiokv.OffloadEngine, user: int, caches: list[torch.Tensor]) -> None:
    """User ``user``'s pages come back bit for bit from what the store holds."""
    source, target = torch.arange(4 * user, 4 * user + 4), torch.arange(200, 204)
    async with await engine.lookup(user, TOKENS) as hit:
        assert hit.cached_tokens == TOKENS
        assert (await engine.load(hit, target)).loaded_tokens == TOKENS
    assert all(torch.equal(c[target], c[source]) for c in caches)


@pytest.mark.asyncio
async def test_a_second_engine_of_this_process_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    caches = make_caches()
    first = engine_on(tmp_path, caches)
    async with first:
        assert (await first.offload(1, torch.arange(4, 8), TOKENS)).stored_tokens == TOKENS
        await refused(tmp_path, os.getpid())
        # A store of two directories, the second in use: the first is not kept locked.
        other = tmp_path / "other"
        other.mkdir()
        await refused(tmp_path, os.getpid(), dirs=[str(other), str(tmp_path)])
        async with engine_on(other, make_caches()) as elsewhere:
            assert (await elsewhere.offload(0, torch.arange(4), TOKENS)).stored_tokens == TOKENS
        await round_trip(first, 1, caches)  # the refused openers touched nothing of it
    again = engine_on(tmp_path, caches)
    async with again:  # the close released it; the blocks written before are served
        await round_trip(again, 1, caches)


@pytest.mark.asyncio
async def test_a_store_in_a_process_of_its_own_holds_it_and_a_killed_one_lets_go(
    tmp_path: Path,
) -> None:
    caches = make_caches()
    store = aiokv.stores.ProcessStore(config(tmp_path, own_process=True))
    engine = engine_on(tmp_path, caches, store)
    async with engine:
        assert (await engine.offload(1, torch.arange(4, 8), TOKENS)).stored_tokens == TOKENS
        first = store.pid
        assert first is not None
        await refused(tmp_path, first)
        await asyncio.to_thread(kill_9, first)
        # The next call starts a new store process, which opens the directory again.
        assert (await engine.offload(2, torch.arange(8, 12), TOKENS)).stored_tokens == TOKENS
        assert store.pid not in (None, first)
        await refused(tmp_path, store.pid)
    async with engine_on(tmp_path, caches) as after:  # released when the store closed
        await round_trip(after, 2, caches)


@pytest.mark.asyncio
async def test_a_hung_store_process_is_killed_when_the_close_times_out_and_lets_go(
    tmp_path: Path,
) -> None:
    """A child that stops answering (SIGSTOP stands for a deadlocked store) holds the
    store thread and the directory until the engine's close times out; then it is
    killed and reaped, the store thread ends, and the directory opens again."""
    caches = make_caches()
    store = aiokv.stores.ProcessStore(config(tmp_path, own_process=True))
    engine = engine_on(tmp_path, caches, store)
    threads = _store_threads()
    await engine.start()
    pid = store.pid
    assert pid is not None
    try:
        assert (await engine.offload(1, torch.arange(4, 8), TOKENS)).stored_tokens == TOKENS
        os.kill(pid, signal.SIGSTOP)
        in_flight = asyncio.ensure_future(engine.offload(2, torch.arange(8, 12), TOKENS))
        await engine.aclose(timeout=0.5)  # waited out in full: the child never answers
        with pytest.raises((aiokv.EngineClosed, aiokv.StoreError)):
            await in_flight
        assert not _exists(pid)  # killed and reaped
        assert _store_threads() == threads  # the engine's store thread ended
        async with engine_on(tmp_path, caches) as after:  # the lock went with the child
            assert (await after.offload(3, torch.arange(12, 16), TOKENS)).stored_tokens == TOKENS
    finally:
        if _exists(pid):
            os.kill(pid, signal.SIGKILL)  # the test failed: leave no stopped process


def _store_threads() -> int:
    return sum(thread.name == "aiokv-store" for thread in threading.enumerate())


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process, stopped or a zombie not yet reaped included."""
    return os.path.exists(f"/proc/{pid}")


def kill_9(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it has ended (its parent reaps it, not this)."""
    handle = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        assert select.select([handle], [], [], WAIT_S)[0], f"pid {pid} outlived SIGKILL"
    finally:
        os.close(handle)


# Another process: an engine on the directory, one user offloaded, "serving" printed; it
# closes its engine when its stdin ends.
HOLDER = f"""
import asyncio, sys, torch, aiokv
async def main():
    caches = [torch.ones(16, 2, {PAGE_SIZE}, 2, 8) for _ in range(2)]
    store = aiokv.LocalStore(aiokv.StoreConfig(
        cpu_cache_gb={64 * BLOCK / (1 << 30)!r}, ssd_cache_gb={128 * SLOT / (1 << 30)!r},
        ssd_cache_dir=sys.argv[1]))
    async with aiokv.OffloadEngine(store, caches) as engine:
        await engine.offload(1, torch.arange(4), {TOKENS})
        print("serving", flush=True)
        await asyncio.to_thread(sys.stdin.read)
asyncio.run(main())
"""


def start_holder(directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=env, text=True,
    )
    assert child.stdout is not None
    try:
        assert line_within(child.stdout, WAIT_S) == "serving\n"
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child


def line_within(stream: IO[str], seconds: float) -> str:
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no line within {seconds} s"
    return stream.readline()


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["close", "kill -9"])
async def test_another_process_holds_it_until_it_closes_or_is_killed(
    tmp_path: Path, end: str
) -> None:
    child = start_holder(tmp_path)
    try:
        await refused(tmp_path, child.pid)
    finally:
        if end == "close":
            assert child.stdin is not None
            child.stdin.close()  # its engine closes, then it exits
        else:
            child.send_signal(signal.SIGKILL)
        status = await asyncio.to_thread(child.wait, WAIT_S)
        assert child.stdout is not None
        child.stdout.close()
    assert status == (0 if end == "close" else -signal.SIGKILL)
    caches = make_caches()
    async with engine_on(tmp_path, caches) as engine:  # nothing cleaned by hand
        if end == "close":  # what it wrote is there
            async with await engine.lookup(1, TOKENS) as hit:
                assert hit.cached_tokens == TOKENS


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """A fork (a server forking workers after start-up) shares the lock's open file; the
    child lets go of it, so the parent's close releases the directory."""
    caches = make_caches()
    store = aiokv.LocalStore(config(tmp_path))
    store.register(caches)
    read_end, write_end = os.pipe()
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say it runs, then wait until the parent is done
        os.close(write_end)
        os.write(started_write, b"1")  # after fork's handlers ran: the lock is let go
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(started_write)
    # The child lets go of the lock as it starts; on a loaded box it may not have been
    # scheduled yet when fork returns here.
    assert os.read(started_read, 1) == b"1"
    os.close(started_read)
    try:
        store.close()
        again = aiokv.LocalStore(config(tmp_path))
        again.register(caches)  # while the forked child still lives
        again.close()
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)


@pytest.mark.asyncio
async def test_a_lock_file_whose_pid_is_not_ascii_digits_still_refuses_with_a_config_error(
    tmp_path: Path,
) -> None:
    # A damaged (or foreign) lock file, held: "²" passes str.isdigit, and int() refuses it.
    import fcntl

    (tmp_path / "aiokv-ssd").mkdir()
    held = os.open(tmp_path / "aiokv-ssd" / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(held, "² somehost".encode().ljust(512) + b"\n")
        engine = engine_on(tmp_path, make_caches())
        with pytest.raises(aiokv.ConfigError) as caught:
            await engine.start()
    finally:
        os.close(held)
    assert caught.value.key == "store.ssd_cache_dir"
    assert "has not yet written its pid" in str(caught.value)
