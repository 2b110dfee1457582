"""ProcessStore: a store in a child process of its own, what crosses the socket, and what
happens when either side dies. (The Store contract itself runs on it in
test_store_contract.py, as local-cpu-process here and flexkv-process on a GPU.)"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, launch_slots, make_caches

import aiokv
import aiokv.testing
from aiokv import space
from aiokv.stores import NoSpace, ProcessStore, TooLarge, make_store
from aiokv.stores.flexkv import FlexKVStore
from aiokv.stores.wire import pack_results, portable, unpack_results
from aiokv.worker.handoff import store_slice_us as _store_slice_us

# LocalStore blocks of conftest's caches: 2 layers x 2 x 4 tokens x 2 heads x 8 float32.
BLOCK_BYTES = 2 * 2 * PAGE_SIZE * 2 * 8 * 4


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _run_with_a_store(body: str) -> None:
    """Run ``body`` in a fresh Python process after it has registered a ProcessStore,
    ``store``. No pipes: the store's child inherits the process's stdout, and a pipe
    would make run() wait for the child too."""
    preamble = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import aiokv
        from conftest import make_caches
        store = aiokv.ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
        store.register(make_caches())
        """
    )
    script = preamble + textwrap.dedent(body)
    subprocess.run([sys.executable, "-c", script], timeout=120, check=True)


def _wait_gone(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not _gone(pid):
        assert time.monotonic() < deadline, f"store process {pid} outlived its parent"
        time.sleep(0.05)


def test_answers_cross_packed_and_come_back_equal() -> None:
    results = {
        7: aiokv.TaskResult(aiokv.TaskStatus.SUCCESS, np.array([True, False, True])),
        3: aiokv.TaskResult(aiokv.TaskStatus.FAILED, None, "copy failed"),
        9: aiokv.TaskResult(aiokv.TaskStatus.CANCELLED, np.zeros(0, dtype=np.bool_)),
        4: aiokv.TaskResult(aiokv.TaskStatus.SUCCESS, np.array([False, True])),
    }
    back = unpack_results(pickle.loads(pickle.dumps(pack_results(results))))
    assert list(back) == list(results)
    for task_id, result in results.items():
        got = back[task_id]
        assert (got.status, got.error) == (result.status, result.error)
        if result.mask is None:
            assert got.mask is None
        else:
            assert got.mask is not None and got.mask.tolist() == result.mask.tolist()
    assert unpack_results(pack_results({})) == {}


def test_an_error_that_does_not_pickle_crosses_as_a_store_error_naming_it() -> None:
    class Unpicklable(Exception):
        def __init__(self) -> None:
            super().__init__("the store broke")
            self.lock = __import__("threading").Lock()

    crossed = portable(Unpicklable())
    assert isinstance(crossed, aiokv.StoreError)
    assert "Unpicklable" in str(crossed) and "the store broke" in str(crossed)
    kept = ValueError("bad slots")
    assert portable(kept) is kept


def test_aiokv_errors_keep_their_field_across_processes() -> None:
    config_error = pickle.loads(pickle.dumps(aiokv.ConfigError("store.page_size", "8 != 4")))
    assert config_error.key == "store.page_size" and str(config_error) == "store.page_size: 8 != 4"
    invalid = pickle.loads(pickle.dumps(aiokv.InvalidRequest("page_ids", "too short")))
    assert invalid.field == "page_ids" and str(invalid) == "page_ids: too short"
    noted = aiokv.ConfigError("store.backend", "no")
    noted.where = "the store process"  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(noted)).where == "the store process"


def test_launch_arguments_are_checked_before_they_travel() -> None:
    store = ProcessStore(aiokv.StoreConfig())  # not registered: no child
    with pytest.raises(ValueError, match="2 task ids but 1 page id arrays"):
        store.launch([1, 2], [torch.arange(4)], [None])
    with pytest.raises(ValueError, match="1 page id tensors for 2 ready events"):
        store.launch([1], [torch.arange(4)], [None, None])
    with pytest.raises(RuntimeError, match="closed or not registered"):  # well-formed: sent
        store.launch([1], [torch.arange(4)], [None])


def test_make_store_runs_the_configured_store_in_its_own_process_when_asked() -> None:
    assert isinstance(make_store(aiokv.StoreConfig(own_process=True)), ProcessStore)
    assert isinstance(make_store(aiokv.StoreConfig()), aiokv.LocalStore)
    assert isinstance(make_store(aiokv.StoreConfig(own_process=False)), aiokv.LocalStore)


def test_by_default_flexkv_runs_in_a_child_and_the_local_store_here() -> None:
    assert aiokv.StoreConfig().own_process is None
    assert not aiokv.StoreConfig().in_own_process()
    assert aiokv.StoreConfig(backend="flexkv").in_own_process()
    assert not aiokv.StoreConfig(backend="flexkv", own_process=False).in_own_process()
    assert aiokv.StoreConfig(own_process=True).in_own_process()


def test_a_store_in_a_child_advises_no_hand_over_in_this_process() -> None:
    # FlexKV advises a hand-over where its Python runs on this process's GIL; in a child
    # it does not (re-measured on the H200: it no longer paid). An explicit setting wins.
    # Neither starts a child here.
    flexkv_child = ProcessStore(aiokv.StoreConfig(backend="flexkv"))
    assert FlexKVStore.store_slice_us == 200
    assert flexkv_child.store_slice_us == 0
    assert _store_slice_us(aiokv.EngineConfig(), flexkv_child) == 0
    assert _store_slice_us(aiokv.EngineConfig(store_slice_us=200), flexkv_child) == 200
    local_child = ProcessStore(aiokv.StoreConfig())
    assert _store_slice_us(aiokv.EngineConfig(), local_child) == 0


def test_the_child_store_errors_come_back_as_themselves() -> None:
    caches = make_caches()
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=2 * BLOCK_BYTES / 2**30))
    store.register(caches)
    pid = store.pid
    assert pid is not None and pid != os.getpid() and store.page_size == PAGE_SIZE
    tokens = np.arange(3 * PAGE_SIZE, dtype=np.int64)
    with pytest.raises(TooLarge) as never:  # 3 new pages, 2 blocks: not even once empty
        store.put_match(tokens, ["big"])
    one, _ = store.put_match(tokens[:PAGE_SIZE], ["one"])
    with pytest.raises(NoSpace) as full:  # 2 new pages, 1 block free now
        store.put_match(tokens[: 2 * PAGE_SIZE], ["two"])
    store.cancel([one])
    if sys.version_info >= (3, 11):  # exception notes
        for caught in (never, full):
            assert f"raised in the store process (pid {pid})" in caught.value.__notes__
    with pytest.raises(ValueError, match="not a matched"):
        launch_slots(store, [12345], [np.arange(PAGE_SIZE, dtype=np.int64)])
    # The child still serves after its errors.
    task, mask = store.put_match(tokens[: 2 * PAGE_SIZE], ["fits"])
    assert mask.all()
    store.cancel([task])
    store.close()
    store.close()  # twice is fine
    assert _gone(pid)
    with pytest.raises(RuntimeError, match="closed"):
        store.put_match(tokens, ["late"])
    with pytest.raises(RuntimeError, match="already called"):
        store.register(caches)


def test_a_child_that_cannot_register_raises_its_error_here_and_exits() -> None:
    store = ProcessStore(aiokv.StoreConfig(page_size=2 * PAGE_SIZE))
    with pytest.raises(aiokv.ConfigError) as caught:
        store.register(make_caches())
    assert caught.value.key == "store.page_size"
    assert store.pid is not None and _gone(store.pid)
    store.close()


def test_the_caches_cross_as_descriptors_of_their_own_shared_memory() -> None:
    import socket
    from multiprocessing.connection import Connection

    from aiokv.stores import cache_fds

    here, there = socket.socketpair()
    sender, receiver = Connection(here.detach()), Connection(there.detach())
    cache = torch.zeros(4, 8)
    cache_fds.send(sender, ("start", [cache, cache[1:3]]))  # two tensors, one storage
    word, (whole, view) = cache_fds.receive(receiver)
    assert word == "start" and cache.is_shared()  # made shared in place, as torch does
    whole[1, 0] = 7.0  # the receiver writes the sender's memory, once mapped for both
    assert cache[1, 0] == 7.0 and view[0, 0] == 7.0
    sender.close()
    receiver.close()


def _only_in(pid: int) -> aiokv.StoreConfig:
    if os.getpid() != pid:
        raise RuntimeError("this config unpickles in the test's own process only")
    return aiokv.StoreConfig()


class _OnlyInThisProcess(aiokv.StoreConfig):
    """A config that the child fails to unpickle, before the caches that follow it."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _only_in, (os.getpid(),)


def test_a_child_that_fails_before_it_maps_the_caches_leaves_no_descriptor_here() -> None:
    """The caches' shared memory crosses as descriptors over the child's socket. Through
    multiprocessing's resource sharer, a duplicate of each waited here for a child that
    never came for it (it failed, or was killed, first): two more open here per start,
    each keeping a cache's shared memory alive after the store closed."""
    caches = make_caches()
    for cache in caches:
        cache.share_memory_()  # as register does: the caches' own descriptors stay

    def failed_start() -> None:
        store = ProcessStore(_OnlyInThisProcess(cpu_cache_gb=0.01))
        with pytest.raises((ImportError, RuntimeError)):  # the child could not unpickle it
            store.register(caches)
        store.close()

    failed_start()  # whatever the first start opens for good
    # Descriptors that earlier tests' garbage still holds close when it is collected,
    # which may fall in the loop below: collected first, and the count may only fall.
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    failed_start()  # a leak is of every start: one more shows it
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_closed_store_keeps_no_descriptor_of_its_children() -> None:
    """Each child came with a table of detached puts in shared memory (.detaches); the
    store kept the last one after its close, a descriptor and its mapping open here for
    as long as the closed store (or its engine) was referenced."""
    caches = make_caches()
    for cache in caches:
        cache.share_memory_()  # as register does: the caches' own descriptors stay

    def closed_store() -> ProcessStore:
        store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
        store.register(caches)
        store.close()
        return store

    kept = [closed_store()]  # whatever the first start opens for good
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    kept.append(closed_store())  # a leak is of every closed store: one more shows it
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


@pytest.mark.asyncio
async def test_when_the_child_dies_callers_get_its_exit_code_not_a_hang() -> None:
    caches = make_caches()
    # No restart (test_process_restart.py has those): every later call is told at once.
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01, store_restarts=0))
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    async with engine:
        stored = await engine.offload("a", torch.arange(4), 4 * PAGE_SIZE)
        assert stored.stored_tokens == 4 * PAGE_SIZE
        assert store.pid is not None
        os.kill(store.pid, signal.SIGKILL)
        for user in ("b", "c"):  # the first call finds it dead; the next is told at once
            with pytest.raises(aiokv.StoreError, match=r"killed by signal 9 \(SIGKILL\)"):
                await engine.offload(user, torch.arange(4, 8), 4 * PAGE_SIZE)
        assert engine.stats().pending == 0
    assert engine.stats().failed == 2


def test_the_child_closes_its_store_and_exits_when_this_process_dies(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    _run_with_a_store(
        f"""
        with open({str(pid_file)!r}, "w") as f:
            f.write(str(store.pid))
        os._exit(0)  # no close, no exit hooks: as a crash
        """
    )
    _wait_gone(int(pid_file.read_text()), 60)


def test_the_child_imports_this_aiokv_not_one_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("python -P (no working directory on sys.path) is 3.11+")
    impostor = tmp_path / "aiokv"
    impostor.mkdir()
    (impostor / "__init__.py").write_text("raise ImportError('the impostor was imported')\n")
    monkeypatch.chdir(tmp_path)
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches())
    store.close()


def test_the_child_finds_aiokv_where_this_process_did(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.stores import spawn as process  # where the child's environment is made

    root = os.path.realpath(os.path.dirname(os.path.dirname(aiokv.__file__)))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    # A checkout: its root goes first on the child's path.
    monkeypatch.setattr(process.site, "getsitepackages", lambda: ["/nowhere"])
    assert process._child_env()["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])
    # An installed aiokv: the child's interpreter finds it; PYTHONPATH stays as it was
    # (a site directory there would come before the standard library).
    monkeypatch.setattr(process.site, "getsitepackages", lambda: [root])
    assert process._child_env()["PYTHONPATH"] == "/elsewhere"


def test_the_child_has_a_session_of_its_own_so_ctrl_c_here_does_not_end_it() -> None:
    # A Ctrl-C goes to the terminal's whole process group; the engine drains through
    # the child after it, so the child must not be in that group.
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches())
    try:
        assert store.pid is not None and os.getpgid(store.pid) != os.getpgid(0)
    finally:
        store.close()


def test_an_interrupted_call_breaks_the_store_rather_than_shift_every_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches())
    real_receive = store._receive

    def interrupted(*args: object) -> object:
        raise KeyboardInterrupt  # after the request went out, before its answer is read

    monkeypatch.setattr(store, "_receive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["put"])
    monkeypatch.setattr(store, "_receive", real_receive)
    # The put's answer is still on the socket: a get must not take it for its own.
    with pytest.raises(aiokv.StoreError, match="interrupted"):
        store.get_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["nothing here"])
    store.close()
    assert store.pid is not None and _gone(store.pid)


def test_a_call_interrupted_while_its_request_is_half_sent_breaks_the_store_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Ctrl-C inside a large send: the child has part of a request; the next call's
    # bytes must not be read as the rest of it (a wedged child, a call timed out).
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01), call_timeout_s=120)
    store.register(make_caches())
    assert store._link is not None
    conn = store._link.conn

    def half_sent(message: object, *, start: bool = False, bound: object = None) -> None:
        conn._send(struct.pack("!i", 1 << 20) + pickle.dumps(message)[:16])  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(store._link, "send", half_sent)
    with pytest.raises(KeyboardInterrupt):
        store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["put"])
    monkeypatch.undo()
    began = time.monotonic()
    with pytest.raises(aiokv.StoreError, match="interrupted"):
        store.get_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["nothing here"])
    assert time.monotonic() - began < 60  # refused at once, not timed out at 120 s
    store.close()


class _OddAnswers(aiokv.testing.FakeStore):
    """A store whose evict answers what does not pickle and whose clear raises
    SystemExit: each call must fail alone, typed, and the child serve on."""

    def evict(self, namespace: Any) -> Any:
        import threading

        return threading.Lock()

    def clear(self) -> int:
        raise SystemExit(3)


def test_an_answer_that_does_not_pickle_or_a_system_exit_fails_its_call_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn, ends, thread = _serve_in_thread(monkeypatch, _OddAnswers(PAGE_SIZE))
    conn.send(("evict", (("n",), None)))  # (namespace, deadline)
    assert conn.poll(60), "the child answered nothing"
    ok, error = conn.recv()
    assert not ok and isinstance(error, aiokv.StoreError) and "cannot pickle" in str(error)
    conn.send(("clear", None))
    assert conn.poll(60), "the child answered nothing"
    ok, error = conn.recv()
    assert not ok and isinstance(error, aiokv.StoreError) and "SystemExit" in str(error)
    conn.send(("put_match", (np.arange(2 * PAGE_SIZE, dtype=np.int64), ("n",))))
    assert conn.poll(60), "the child stopped serving"
    ok, _ = conn.recv()
    assert ok  # served on
    conn.send(("close", None))
    thread.join(10)
    conn.close()
    ends.close()


def test_a_child_that_cannot_build_its_store_says_why() -> None:
    store = ProcessStore(aiokv.StoreConfig())
    # Past StoreConfig's own checks, as a config only the child's store rejects.
    object.__setattr__(store._config, "ssd_cache_gb", 1.0)
    with pytest.raises(aiokv.ConfigError) as caught:
        store.register(make_caches())
    assert caught.value.key == "store.ssd_cache_gb"
    store.close()


class _Watched:
    """A lock that sets ``waited`` when a thread finds it held and waits for it."""

    def __init__(self, lock: Any, waited: threading.Event) -> None:
        self._lock, self._waited = lock, waited

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waited.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_close_from_another_thread_waits_for_the_call_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches())
    assert store.pid is not None and store._link is not None
    # Each step is seen to have happened, not assumed after a sleep: the call waits for
    # its answer, then the close waits (for the call, or, were it not to, for an answer
    # of its own) before the child goes on. Else a close that came after the answer
    # would pass, whatever it does with a call in flight.
    in_flight, close_waits = threading.Event(), threading.Event()
    receive = store._link.receive

    def receiving(deadline: float, what: str) -> Any:
        (in_flight if what.startswith("put_match") else close_waits).set()
        return receive(deadline, what)

    monkeypatch.setattr(store._link, "receive", receiving)
    monkeypatch.setattr(store, "_calling", _Watched(store._calling, close_waits))
    answers: list[object] = []
    os.kill(store.pid, signal.SIGSTOP)  # the call below waits for its answer
    try:
        caller = threading.Thread(
            target=lambda: answers.append(
                store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["in flight"])
            )
        )
        caller.start()
        assert in_flight.wait(30), "the call did not go out"
        closer = threading.Thread(target=store.close)
        closer.start()
        assert close_waits.wait(30), "the close did not wait"
        assert closer.is_alive()  # waiting for the call, not reading its answer
    finally:
        os.kill(store.pid, signal.SIGCONT)
    caller.join(30)
    closer.join(60)
    assert not caller.is_alive() and not closer.is_alive()
    assert len(answers) == 1
    task_id, mask = answers[0]  # type: ignore[misc]
    assert isinstance(task_id, int) and mask.all()
    assert _gone(store.pid)


def test_a_forked_process_neither_uses_the_store_nor_keeps_the_child_alive(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen"
    _run_with_a_store(
        f"""
        pid = store.pid
        if os.fork() == 0:  # a worker forked by the program, say; outlives its parent
            try:
                store.cancel([])
                said = "served"
            except Exception as exc:
                said = repr(exc)
            with open({str(seen)!r}, "w") as f:
                f.write(f"{{pid}}\\n{{said}}")
            time.sleep(25)  # longer than the wait for the store process below
            os._exit(0)
        deadline = time.monotonic() + 60
        while not os.path.exists({str(seen)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(0)  # the parent dies; the fork lives on
        """
    )
    child, said = seen.read_text().split("\n", 1)
    assert said.startswith("StoreError") and "forked child" in said
    _wait_gone(int(child), 20)


# ---- put_match_many: a batch's matches in one call (one round trip to the child) ----


def test_put_match_many_answers_as_put_match_would_one_by_one() -> None:
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=4 * BLOCK_BYTES / 2**30))
    store.register(make_caches())
    two_pages = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    answers = store.put_match_many(
        [
            (two_pages, ["a"]),  # 2 new pages, 4 free blocks: reserved
            (np.arange(3 * PAGE_SIZE, dtype=np.int64), ["b"]),  # 3 new pages, 2 free: no space
            (two_pages, ["a"]),  # the first one's pages, not written yet: no room yet either
        ]
    )
    first, full, repeat = answers
    assert not isinstance(first, Exception) and first[1].all()
    assert isinstance(full, NoSpace)
    if sys.version_info >= (3, 11):
        assert f"raised in the store process (pid {store.pid})" in full.__notes__
    assert isinstance(repeat, NoSpace) and "being written" in str(repeat)
    store.cancel([first[0]])
    store.close()


class MatchesAtOnce(aiokv.testing.StoreWrapper):
    """FakeStore with put_match_many, recording its calls; ``refuse`` names namespaces
    whose match raises NoSpace, ``broken`` fails the whole call."""

    def __init__(self) -> None:
        super().__init__(aiokv.testing.FakeStore())
        self.calls: list[list[str]] = []
        self.single_calls = 0
        self.refuse: set[str] = set()
        self.broken = False
        self.answers_short = False

    def put_match(self, token_ids: Any, namespace: Any) -> Any:
        self.single_calls += 1
        return super().put_match(token_ids, namespace)

    def put_match_many(self, requests: Any) -> list[Any]:
        self.calls.append([n[0] for _, n in requests])
        if self.broken:
            raise RuntimeError("the store process is gone")
        answers = [
            NoSpace("full") if names[0] in self.refuse else self.inner.put_match(tokens, names)
            for tokens, names in requests
        ]
        return answers[:-1] if self.answers_short else answers


@pytest.mark.asyncio
async def test_the_store_thread_matches_an_offload_batch_in_one_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = MatchesAtOnce()
    store.refuse = {"u1"}
    # No request deadline: the refused one waits for room 0.3 s from its first no-space
    # answer (and so is matched again at least once), and the two that fit have no
    # deadline to miss. A 300 ms request_timeout_ms failed those two with RequestTimeout,
    # and the refused one with no second match, when a loaded runner stalled the batch.
    monkeypatch.setattr(space, "NO_TIMEOUT_WAIT_S", 0.3)
    config = aiokv.EngineConfig(window_us=50_000, max_batch_requests=3, request_timeout_ms=0)
    engine = aiokv.OffloadEngine(store, make_caches(), config)
    async with engine:
        outcomes = await asyncio.gather(
            *(engine.offload(u, torch.arange(4 * u, 4 * u + 4), 4 * PAGE_SIZE,
                             namespace=[f"u{u}"]) for u in range(3)),
            return_exceptions=True,
        )
        assert store.calls[0] == ["u0", "u1", "u2"] and store.single_calls == 0
        # The refused one waits for room, matched again alone, until it gives up.
        assert len(store.calls) > 1 and all(call == ["u1"] for call in store.calls[1:])
        assert isinstance(outcomes[1], aiokv.StoreFull)  # its own answer fails it alone
        assert [o.stored_tokens for o in (outcomes[0], outcomes[2])] == [4 * PAGE_SIZE] * 2
        store.broken = True  # the whole call fails: each of its requests, once
        failed = await asyncio.gather(
            *(engine.offload(u, torch.arange(4), 4 * PAGE_SIZE, namespace=[f"v{u}"])
              for u in range(2)),
            return_exceptions=True,
        )
        assert all(isinstance(f, aiokv.StoreError) for f in failed)
        assert all(str(f).startswith("store.put_match failed") and "gone" in str(f) for f in failed)
        store.broken, store.answers_short = False, True  # one answer short: none is used,
        short = await asyncio.gather(  # and what was matched is given back
            *(engine.offload(u, torch.arange(4), 4 * PAGE_SIZE, namespace=[f"w{u}"])
              for u in range(2)),
            return_exceptions=True,
        )
        assert all(isinstance(f, aiokv.StoreError) and "1 answers to 2" in str(f) for f in short)
        # w0's match, answered, was cancelled; w1's answer never came, so it stays.
        held = store.inner._tasks.values()  # type: ignore[attr-defined]
        assert [names for _, names, _, _ in held] == [("w1",)]
        assert engine.stats().pending == 0


def test_a_wrapper_forwards_put_match_many_unless_it_wraps_put_match() -> None:
    inner = MatchesAtOnce()
    assert aiokv.testing.SharedStore(inner).put_match_many == inner.put_match_many
    assert aiokv.testing.CheckingStore(inner).put_match_many is None  # sees each match
    assert aiokv.testing.StoreWrapper(aiokv.testing.FakeStore()).put_match_many is None


# ---- notices of ended tasks: the child polls, this process asks when told -------------


def test_the_child_polls_a_store_that_does_not_notify_and_tells_once_answers_wait() -> None:
    import socket

    from aiokv.stores.child import _Ends

    store = aiokv.testing.FakeStore(PAGE_SIZE)  # answers at its next try_wait, no notices
    here, theirs = socket.socketpair()
    ends = _Ends(store, theirs)
    assert not ends.store_notifies and not ends.polling
    task, _ = store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["p"])
    launch_slots(store, [task], [np.arange(2 * PAGE_SIZE, dtype=np.int64)])
    ends.launched([task])
    assert ends.polling
    ends.poll()
    assert not ends.polling
    here.settimeout(5)
    assert here.recv(16) == b"!"  # told
    answers = ends.take([task])
    assert answers[task].status is aiokv.TaskStatus.SUCCESS
    again = ends.take([task]).get(task)  # handed out once: nothing, or not a success
    assert again is None or again.status is not aiokv.TaskStatus.SUCCESS
    here.close()
    theirs.close()


def test_this_process_hears_of_ended_tasks_from_the_child() -> None:
    import threading

    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches())
    told = threading.Event()
    store.set_notify(told.set)
    task, _ = store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["n"])
    launch_slots(store, [task], [np.arange(2 * PAGE_SIZE, dtype=np.int64)])
    assert told.wait(30)  # no try_wait asked: the child said so by itself
    deadline = time.monotonic() + 30
    answers: dict[int, aiokv.TaskResult] = {}
    while task not in answers:
        assert time.monotonic() < deadline
        answers.update(store.try_wait([task]))
    assert answers[task].status is aiokv.TaskStatus.SUCCESS
    reader = store._notices.reader
    store.close()
    assert reader is not None
    reader.join(60)
    assert not reader.is_alive()  # close ends the reader thread


class Unnotifying(aiokv.testing.FakeStore):
    """No set_notify (as FlexKV): its tasks end while not ``held``; counts try_wait calls;
    the next one raises while ``failing``."""

    def __init__(self) -> None:
        super().__init__(PAGE_SIZE)
        self.waits = 0
        self.held = False
        self.failing = False

    def try_wait(self, task_ids: Any) -> dict[int, aiokv.TaskResult]:
        self.waits += 1
        if self.failing:
            self.failing = False
            raise RuntimeError("transient try_wait failure")
        return {} if self.held else super().try_wait(task_ids)


def _serve_in_thread(monkeypatch: pytest.MonkeyPatch, store: Any) -> tuple[Any, Any, Any]:
    """aiokv.stores.child.serve on ``store``, in a thread: (its conn, its ends, thread)."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    import aiokv.stores.child as child
    from aiokv.stores import cache_fds
    from aiokv.stores.detaches import DetachTable

    monkeypatch.setattr(child, "make_store", lambda config: store)
    monkeypatch.setattr(child, "_register", lambda *args: None)
    here, theirs = socket.socketpair()
    ends_here, ends_theirs = socket.socketpair()
    conn = Connection(here.detach())
    thread = threading.Thread(
        target=child.serve, args=(Connection(theirs.detach()), ends_theirs), daemon=True
    )
    thread.start()
    # The start message, as ProcessStore sends it: config, payload, detached puts' table,
    # whether it is a restart.
    cache_fds.send(conn, (None, None, DetachTable().tensor, False))
    assert conn.recv() == ("ready", PAGE_SIZE)
    ends_here.settimeout(60)
    return conn, ends_here, thread


def _launch_one(conn: Any) -> int:
    tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    conn.send(("put_match", (tokens, ("n",))))
    ok, (task, _) = conn.recv()
    assert ok
    pages = np.arange(2, dtype=np.int64)  # page ids travel, one array for the launch
    conn.send(("launch", ([task], [len(pages)], pages, {})))
    assert conn.recv() == (True, None)
    return int(task)


def _try_wait(conn: Any, task: int) -> dict[int, aiokv.TaskResult]:
    conn.send(("try_wait", [task]))
    ok, packed = conn.recv()
    assert ok, packed
    return unpack_results(packed)


def test_the_child_loop_polls_a_store_that_does_not_notify_and_tells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiokv.stores.child as child

    waits: list[float] = []
    real_request_within = child._request_within

    def request_within(conn: Any, seconds: float) -> bool:
        waits.append(seconds)
        return real_request_within(conn, seconds)

    monkeypatch.setattr(child, "_request_within", request_within)
    store = Unnotifying()
    store.held = True
    conn, ends, thread = _serve_in_thread(monkeypatch, store)
    task = _launch_one(conn)
    deadline = time.monotonic() + 60
    while store.waits < 3:  # polled again and again while its task runs
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert set(waits) == {child._POLL_S}
    store.held = False
    assert ends.recv(16).startswith(b"!")
    assert _try_wait(conn, task)[task].status is aiokv.TaskStatus.SUCCESS
    conn.send(("close", None))
    assert conn.recv() == (True, None)
    thread.join(10)


def test_the_child_waits_for_requests_with_microsecond_resolution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # conn.poll's poll(2) takes milliseconds: 100 µs would become 1 ms between polls.
    import select
    import socket
    from multiprocessing.connection import Connection

    from aiokv.stores.child import _request_within

    timeouts: list[float] = []
    real_select = select.select

    def recording_select(r: Any, w: Any, x: Any, timeout: float) -> Any:
        timeouts.append(timeout)
        return real_select(r, w, x, timeout)

    monkeypatch.setattr(select, "select", recording_select)
    here, theirs = socket.socketpair()
    with Connection(here.detach()) as conn, Connection(theirs.detach()) as other:
        assert not _request_within(conn, 100e-6)
        other.send("request")
        assert _request_within(conn, 100e-6)
    assert timeouts == [100e-6, 100e-6]


def test_a_failed_poll_in_the_child_is_not_the_end_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Unnotifying()
    store.failing = True  # the child's own poll raises, once
    conn, ends, thread = _serve_in_thread(monkeypatch, store)
    task = _launch_one(conn)
    assert ends.recv(16).startswith(b"!")  # told: the parent asks and sees for itself
    assert thread.is_alive()
    assert _try_wait(conn, task)[task].status is aiokv.TaskStatus.SUCCESS
    conn.send(("close", None))
    assert conn.recv() == (True, None)
    thread.join(10)


def test_evict_and_clear_cross_to_the_child_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    store = aiokv.testing.FakeStore(PAGE_SIZE)
    conn, _, thread = _serve_in_thread(monkeypatch, store)
    for key in ("n", "m"):
        tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)
        conn.send(("put_match", (tokens, (key,))))
        ok, (task, _) = conn.recv()
        assert ok
        pages = np.arange(2, dtype=np.int64)  # page ids travel, one array for the launch
        conn.send(("launch", ([task], [len(pages)], pages, {})))
        assert conn.recv() == (True, None)
        assert _try_wait(conn, task)[task].status is aiokv.TaskStatus.SUCCESS
    conn.send(("evict", (("n",), None)))  # (namespace, deadline)
    assert conn.recv() == (True, 2 * PAGE_SIZE)
    conn.send(("clear", None))
    assert conn.recv() == (True, 2 * PAGE_SIZE)
    conn.send(("close", None))
    assert conn.recv() == (True, None)
    thread.join(10)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP delivered: it runs nothing more)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _wait_stopped(pid: int) -> None:
    give_up = time.monotonic() + 20
    while not _stopped(pid):  # the signal's delivery, not ordering work
        assert time.monotonic() < give_up, f"process {pid} never stopped"
        time.sleep(0.001)


@pytest.mark.asyncio
async def test_evict_and_clear_on_a_stopped_child_time_out_at_their_deadline() -> None:
    """A SIGSTOPped store process holds the evict it was sent: the caller hears
    RequestTimeout at request_timeout_ms, not when the child answers (or is killed at
    call_timeout_s, here 15 s); a clear behind it too, the store not asked. The child,
    resumed, refuses the evict it reads after its deadline: the key is still whole."""
    caches = make_caches()
    kv = [cache[:4].clone() for cache in caches]
    store = ProcessStore(aiokv.StoreConfig(cpu_cache_gb=0.01), call_timeout_s=15.0)
    config = aiokv.EngineConfig(window_us=0, request_timeout_ms=1000)
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        tokens = 4 * PAGE_SIZE
        assert (await engine.offload("a", torch.arange(4), tokens)).stored_tokens == tokens
        assert store.pid is not None
        os.kill(store.pid, signal.SIGSTOP)
        try:
            _wait_stopped(store.pid)
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(aiokv.RequestTimeout, match=r"evict .*request_timeout_ms=1000"):
                await asyncio.wait_for(engine.evict("a"), 30)
            with pytest.raises(aiokv.RequestTimeout, match=r"clear .*nothing was dropped"):
                await asyncio.wait_for(engine.clear(), 30)
            assert loop.time() - began < 10  # the child stays stopped until below
            assert _stopped(store.pid)
        finally:
            os.kill(store.pid, signal.SIGCONT)
        async with await engine.lookup("a", tokens) as hit:
            assert hit.cached_tokens == tokens
            loaded = await engine.load(hit, torch.arange(8, 12))
        assert loaded.loaded_tokens == tokens
        assert all(torch.equal(cache[8:12], want) for cache, want in zip(caches, kv, strict=True))
        assert await engine.evict("a") == tokens  # and an evict in time drops it
