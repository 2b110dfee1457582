"""Faults of the shared store (issue 31.4) with a real ``aiokv store-server`` process and
a spawned engine process: the server killed while a call waits on it fails that call with
StoreError, later calls fail fast while nothing listens, and the same engine is served
again (with what the SSD tier kept) once a server is back; a second server on a busy SSD
directory refuses, naming it."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shared_host
import torch
from shared_host import (
    PAGE_SIZE,
    Server,
    caches,
    observer,
    start_processes,
    user_kv,
    wait_for,
)
from shared_inprocess import PAGES, TOKENS, Host, load_exact, offload

import aiokv
from aiokv import cli
from aiokv.errors import RequestTimeout, StoreError
from aiokv.stores.base import TaskResult, TaskStatus
from aiokv.stores.shared import SharedStore, link, reconnect
from aiokv.stores.shared.server import StoreServer


def ssd_server(tmp_path: Path) -> Server:
    ssd = tmp_path / "ssd"
    ssd.mkdir(exist_ok=True)
    return Server(tmp_path, {"ssd_cache_gb": 0.01, "ssd_cache_dir": str(ssd)})


def test_server_killed_and_back_the_engine_serves_on_from_ssd(tmp_path: Path) -> None:
    server = ssd_server(tmp_path).start()
    (engine,) = start_processes(server.socket, 1)
    try:
        assert engine("offload", user=7, pages=5) == {"stored": 20, "cached": 20}
        figures = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(server.socket)))
        figures.register(caches())
        # Written through in the back. The kill below leaves the SSD only what landed:
        # ssd_blocks_used counts slots taken for writes still under way too, so wait for
        # the bytes written instead.
        block_bytes = sum(t[0].numel() * t.element_size() for t in caches())
        wait_for(lambda: figures.store_stats()["bytes_ssd_written"] >= 5 * block_bytes,
                 "the SSD copy")
        figures.close()

        server.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        engine.send("load", user=7, pages=5)  # waits on the stopped server
        server.kill()
        assert engine.answer()["error"].startswith("StoreError")

        down = engine("load", user=7, pages=5)  # nothing listens: fails at once
        assert down["error"].startswith("StoreError")
        assert "not reachable" in down["error"]

        server = ssd_server(tmp_path).start()
        assert engine("load", user=7, pages=5) == {"cached": 20, "loaded": 20, "exact": True}
        assert engine("offload", user=8, pages=2) == {"stored": 8, "cached": 8}
        assert engine("load", user=8, pages=2)["exact"]
    finally:
        engine.close()
        server.kill()


def test_a_second_server_on_a_busy_ssd_directory_refuses_naming_it(tmp_path: Path) -> None:
    first = ssd_server(tmp_path).start()
    try:
        second = ssd_server(tmp_path)
        second.socket = tmp_path / "run2" / "other.sock"
        code, log = second.run_here()
        assert code == 2
        assert str(tmp_path / "ssd") in log
        assert f"in use by another aiokv store-server (pid {first.process.pid}" in log  # type: ignore[union-attr]
    finally:
        first.kill()


def test_an_embedded_store_on_the_ssd_directory_of_a_server_without_engines_is_refused(
        tmp_path: Path) -> None:
    # The server's SSD tier opens at its first engine; the directory is the server's from
    # its start all the same, so an embedded store there cannot write under it and keep
    # the server's engines out.
    server = ssd_server(tmp_path).start()
    ssd = tmp_path / "ssd"
    embedded = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.001, ssd_cache_gb=0.01,
                                                  ssd_cache_dir=str(ssd)))
    try:
        with pytest.raises(aiokv.ConfigError) as caught:
            embedded.register(caches())
        assert caught.value.key == "store.ssd_cache_dir"
        assert (f"{str(ssd)!r} is in use by another aiokv store-server "
                f"(pid {server.process.pid} on host") in str(caught.value)  # type: ignore[union-attr]
        store, tables = observer(server.socket)  # the server's engines are served
        try:
            offload(store, tables, 1)
            task, mask = store.get_match(TOKENS, ["user:1"])
            assert mask.all()
            assert load_exact(store, tables, 1, task)
        finally:
            store.close()
    finally:
        embedded.close()
        server.kill()


@pytest.mark.parametrize("mode", [0o755, 0o770], ids=["755", "770"])
def test_a_socket_directory_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(mode)
    code, log = Server(tmp_path).run_here()
    assert code == 2
    assert f"is open to other users (mode {mode:o})" in log


def test_a_socket_path_that_holds_a_file_or_cannot_be_bound_is_a_usage_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    private = tmp_path / "priv"
    private.mkdir(mode=0o700)
    config = private / "store.yml"
    config.write_text("store:\n  cpu_cache_gb: 0.01\n")
    # The two flags swapped: the config must survive. (The command's own entry point, in
    # this process, as below: no interpreter to start.)
    assert cli.main(["store-server", "--socket", str(config), "--config", str(config)]) == 2
    assert "exists and is not a socket" in caplog.text
    caplog.clear()
    assert config.read_text() == "store:\n  cpu_cache_gb: 0.01\n"
    for socket_path, says in [(private, "exists and is not a socket"),
                              (config / "s.sock", "Not a directory"),  # under a file
                              (private / ("s" * 120 + ".sock"), "holds at most 107"),
                              (Path("/proc/aiokv-nope/store.sock"), "cannot make its directory")]:
        # The command's own entry point, in this process: no interpreter to start.
        assert cli.main(["store-server", "--socket", str(socket_path), "--config",
                         str(config)]) == 2
        assert says in caplog.text
        caplog.clear()
    assert sorted(p.name for p in private.iterdir()) == ["store.yml"]  # no lock left


def test_a_server_whose_start_is_refused_leaves_its_directories_to_the_next(
        tmp_path: Path) -> None:
    # Refused for its second SSD directory, it kept the socket's directory and the first
    # SSD directory locked for as long as this process lived: the same server with its
    # config fixed was refused as "in use by another aiokv store-server (this process)".
    first = tmp_path / "ssd"
    first.mkdir()
    socket_path = tmp_path / "run" / "store.sock"
    refused = StoreServer(socket_path, aiokv.StoreConfig(
        cpu_cache_gb=0.01, ssd_cache_gb=0.1,
        ssd_cache_dir=[str(first), str(tmp_path / "missing")]))
    with pytest.raises(aiokv.ConfigError, match=r"^store\.ssd_cache_dir: .*missing"):
        refused.start()
    fixed = StoreServer(socket_path, aiokv.StoreConfig(
        cpu_cache_gb=0.01, ssd_cache_gb=0.1, ssd_cache_dir=str(first)))
    fixed.start()
    serving = threading.Thread(target=fixed.serve)
    serving.start()
    try:
        store, tables = observer(socket_path)
        offload(store, tables, 1)
        task, _ = store.get_match(TOKENS, ["user:1"])
        assert load_exact(store, tables, 1, task)
        store.close()
    finally:
        fixed.stop()
        serving.join(30)


def test_a_server_refuses_a_missing_ssd_directory_at_its_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Not at every engine's register, while it looks healthy to its supervisor.
    private = tmp_path / "priv"
    private.mkdir(mode=0o700)
    config = private / "store.yml"
    missing = tmp_path / "no-such-dir"
    config.write_text(f"store:\n  cpu_cache_gb: 0.01\n  ssd_cache_gb: 0.05\n"
                      f"  ssd_cache_dir: {missing}\n")
    assert cli.main(["store-server", "--socket", str(private / "s.sock"), "--config",
                     str(config)]) == 2
    assert f"store.ssd_cache_dir: '{missing}' does not exist" in caplog.text


@pytest.mark.parametrize(("key", "value"), [("own_process", True), ("store_restarts", 7)])
def test_a_server_refuses_the_keys_of_a_store_process_it_does_not_start(
        tmp_path: Path, key: str, value: object) -> None:
    """The server runs its store in its own process, always: these would be ignored."""
    config = aiokv.StoreConfig(cpu_cache_gb=0.01, **{key: value})
    with pytest.raises(aiokv.ConfigError, match=rf"^store\.{key}: "):
        StoreServer(tmp_path / "s.sock", config)


def test_the_shared_backend_needs_a_socket_and_only_it_takes_one() -> None:
    with pytest.raises(aiokv.ConfigError, match=r"store\.socket"):
        aiokv.StoreConfig(backend="shared")
    with pytest.raises(aiokv.ConfigError, match=r"store\.socket.*backend: shared only"):
        aiokv.StoreConfig(socket="/run/user/1/aiokv/store.sock")


@pytest.mark.parametrize("path", ["\0aiokv/store.sock", "/run/user/1/aiokv\0/store.sock"],
                         ids=["abstract", "inside"])
def test_a_socket_path_with_a_nul_byte_is_refused_naming_the_key(
        tmp_path: Path, path: str) -> None:
    """The kernel ends a socket's path at its first NUL: an engine would connect
    elsewhere than it was told (a leading NUL: to the abstract namespace, where any uid
    may listen), and a server would bind elsewhere."""
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.StoreConfig(backend="shared", socket=path)
    assert caught.value.key == "store.socket"
    assert repr(path) in str(caught.value)
    server = StoreServer(str(tmp_path) + path, aiokv.StoreConfig(cpu_cache_gb=0.001))
    with pytest.raises(aiokv.ConfigError, match=r"^--socket: .*NUL byte"):
        server.start()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["file", "directory"])
async def test_an_engine_on_a_socket_path_that_holds_no_socket_is_refused_naming_it(
        tmp_path: Path, kind: str) -> None:
    # The config file given as the socket, say: the engine said the server there was not
    # reachable, "is `aiokv store-server` running?", which no server start could help.
    path = tmp_path / "store.yml"
    if kind == "file":
        path.write_text("store:\n  cpu_cache_gb: 0.01\n")
    else:
        path.mkdir()
    engine = aiokv.open_engine({"store": {"backend": "shared", "socket": str(path)}},
                               kv_caches=caches())
    with pytest.raises(aiokv.ConfigError) as refused:
        await engine.start()
    assert refused.value.key == "store.socket"
    assert f"{str(path)!r} is a {kind}, not a socket" in str(refused.value)
    await engine.aclose()


@pytest.mark.parametrize(("keys", "named"), [
    ({"cpu_cache_gb": 4.0}, "cpu_cache_gb"),
    ({"ssd_cache_gb": 2.0, "ssd_cache_dir": "/tmp"}, "ssd_cache_gb"),
    ({"ssd_cache_dir": "/tmp"}, "ssd_cache_dir"),
    ({"ssd_write_policy": "write_back"}, "ssd_write_policy"),
    ({"ssd_reset_on_mismatch": True}, "ssd_reset_on_mismatch"),
    ({"flexkv": {"cpu_cache_gb": 1}}, "flexkv"),
    ({"remote": {"backend": "mooncake", "master": "h:1"}}, "remote"),
])
def test_an_engine_on_the_shared_backend_refuses_the_keys_of_the_servers_tiers(
        keys: dict[str, object], named: str) -> None:
    """Set on an engine, they would be ignored: the server's config sizes its tiers."""
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.StoreConfig(backend="shared", socket="/run/user/1/aiokv/store.sock", **keys)
    assert caught.value.key == f"store.{named}"
    same = aiokv.StoreConfig(backend="shared", socket="/s", cpu_cache_gb=1.0, own_process=False)
    assert same.backend == "shared"  # the defaults, spelled out, are fine


def test_a_server_config_it_cannot_honour_is_refused_naming_the_key(tmp_path: Path) -> None:
    code, log = Server(tmp_path, {"backend": "flexkv"}).run_here()
    assert code == 2
    assert "store.backend: the server runs the embedded store" in log


@pytest.mark.skipif(ctypes.util.find_library("ibverbs") is not None,
                    reason="libibverbs is installed system-wide: Mooncake's client loads")
def test_a_server_whose_remote_tier_cannot_load_refuses_to_start_saying_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At start, not at its first engine: Mooncake's client without the libibverbs that
    ``make setup`` unpacks into the venv (here: pointed elsewhere)."""
    monkeypatch.setenv("AIOKV_MOONCAKE_SYS", str(tmp_path / "no-libraries"))
    store = {"remote": {"backend": "mooncake", "master": "127.0.0.1:1"}}
    code, log = Server(tmp_path, store).run_to_end()
    assert code == 2
    assert "store.remote: Mooncake Store's client cannot be loaded" in log
    assert "make setup" in log


def test_store_server_help_says_how_to_run_it_under_systemd(
        capsys: pytest.CaptureFixture[str]) -> None:
    from aiokv.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["store-server", "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert "systemd" in shown and "ExecStart=" in shown and "--socket" in shown


def test_sigterm_lets_open_tasks_end_then_exits_0(tmp_path: Path) -> None:
    # A drain long enough that the holder's release lands in it on a loaded runner.
    server = Server(tmp_path, drain_timeout_s=60).start()
    assert server.process is not None
    (holder,) = start_processes(server.socket, 1, kind="holder")
    try:
        assert holder("hold", user=1, pages=2)["reserved"] == 8
        server.process.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + 20
        while server.socket.exists():  # no new engines from the drain's start on
            assert time.monotonic() < give_up, "the socket stayed"
            time.sleep(0.02)
        assert server.process.poll() is None  # its open tasks may still end
        assert holder("release") == {"put": "success"}
        assert server.process.wait(timeout=20) == 0
        assert "draining (1 engines, 2 tasks open)" in server.text()
    finally:
        holder.close()
        server.kill()



def test_puts_whose_end_finds_the_server_dead_fail_and_the_next_server_misses_them(
        tmp_path: Path) -> None:
    """A batch's end gets no answer, so a put is reported done once its end is sent; an
    end that cannot be sent (the server died after the match) fails its puts instead,
    and a new server does not claim them."""
    server = Server(tmp_path).start()
    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(server.socket)))
    tables = caches()
    store.register(tables)
    try:
        tokens = np.arange(4 * PAGE_SIZE, dtype=np.int64)
        answers = store.put_match_many([(tokens, ["dies:1"]), (tokens, ["dies:2"])])
        ids = [answer[0] for answer in answers]  # type: ignore[index]
        store.launch(ids, [torch.arange(4), torch.arange(4, 8)], [None, None])
        server.kill()
        results: dict[int, TaskResult] = {}
        give_up = time.monotonic() + 20
        while len(results) < 2:
            assert time.monotonic() < give_up, "the puts never ended"
            results.update(store.try_wait(ids))
        assert {r.status for r in results.values()} == {TaskStatus.FAILED}
        assert all("went away" in (r.error or "") for r in results.values())

        server = Server(tmp_path).start()
        get, mask = store.get_match(tokens, ["dies:1"])  # reconnects
        assert not mask.any()
        store.cancel([get])
    finally:
        store.close()
        server.kill()


def test_a_lookup_given_back_while_the_server_is_away_costs_nothing_once_it_is_back(
        tmp_path: Path) -> None:
    # The server that matched the Lookup rolled it back when it went; the one started
    # since must not be told of it (it would take the id for another engine's task).
    host = Host(tmp_path, ssd=False)
    host.start()
    try:
        writer, tables = host.engine()
        reader, _ = host.engine()
        offload(writer, tables, 1)
        task, mask = reader.get_match(TOKENS, ["user:1"])  # a Lookup held
        assert mask.all()
        assert host.server is not None
        host.server.drain_timeout_s = 0.0  # it goes with the Lookup still held
        host.stop()
        with pytest.raises(StoreError):
            reader.ping()  # the engine knows the server is gone
        reader.cancel([task])  # its Lookup given back meanwhile
        host.start()
        task, mask = reader.get_match(TOKENS, ["user:2"])  # the first call once it is back
        assert not mask.any()  # a miss, not a StoreError
        reader.cancel([task])
        reader.ping()  # still connected
        writer.close()
        reader.close()
    finally:
        host.stop()


def test_a_stopped_server_times_out_one_call_then_calls_fail_fast_until_it_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOPped (hung) server: the call in flight fails after CALL_TIMEOUT_S; later
    calls, its figures included, fail at once for a backoff instead of each waiting for a
    timeout again (a hello into the stopped server's backlog waits HELLO_TIMEOUT_S at
    most); once it runs again, the same store is served what it kept."""
    # 3 s: a call that waited CALL_TIMEOUT_S again would fail the "< 3" below.
    monkeypatch.setattr(link, "CALL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(link, "HELLO_TIMEOUT_S", 1.0)
    monkeypatch.setattr(reconnect, "BACKOFF_FIRST_S", 2.0)
    server = Server(tmp_path).start()
    assert server.process is not None
    store, tables = observer(server.socket)
    try:
        offload(store, tables, 1)
        server.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreError) as failed:
                store.ping()
            assert time.monotonic() - started < 30  # CALL_TIMEOUT_S, not for ever
            assert "stopped or wedged" in str(failed.value)
            later: list[Callable[[], object]] = [
                store.ping, lambda: store.get_match(TOKENS, ["user:1"]), store.ping]
            for call in later:  # each waited CALL_TIMEOUT_S again (its hello's)
                started = time.monotonic()
                with pytest.raises(StoreError) as failed:
                    call()
                assert time.monotonic() - started < 3
                assert "not reachable" in str(failed.value)
                assert "tried again in" in str(failed.value)
            started = time.monotonic()
            assert store.store_stats()["server_up"] == 0  # no hello of its own
            assert time.monotonic() - started < 3
        finally:
            server.process.send_signal(signal.SIGCONT)

        def answers() -> bool:
            with contextlib.suppress(StoreError):
                store.ping()
                return True
            return False

        wait_for(answers, "the server answers again")
        task, mask = store.get_match(TOKENS, ["user:1"])
        assert mask.all()
        assert load_exact(store, tables, 1, task)
    finally:
        store.close()
        server.kill()


def test_an_engine_on_a_stopped_server_fails_its_lookups_fast_after_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's view: one lookup waits CALL_TIMEOUT_S; the next ones (and the figures
    refreshed after each batch) fail at once, not a timeout (or two) each."""
    monkeypatch.setattr(link, "CALL_TIMEOUT_S", 3.0)  # one more wait fails the "< 3"
    monkeypatch.setattr(link, "HELLO_TIMEOUT_S", 1.0)
    server = Server(tmp_path).start()
    assert server.process is not None
    engine = shared_host.Host(str(server.socket))
    try:
        assert engine.offload(user=3, pages=PAGES)["cached"] == PAGES * PAGE_SIZE
        server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(StoreError):
                engine.lookup(user=3, pages=PAGES)
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(StoreError, match="not reachable"):
                    engine.lookup(user=3, pages=PAGES)
                assert time.monotonic() - started < 3  # was 2 x 4 s: lookup, figures
        finally:
            server.process.send_signal(signal.SIGCONT)
    finally:
        engine.kv.close()
        server.kill()


def test_an_idle_engine_is_served_by_its_first_call_after_a_server_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server killed while the engine idles and started again before its next call:
    that call (an offload) finds the old connection broken before its request left, and
    goes on a fresh one instead of failing; what it stores loads bit for bit."""
    # The one call an idle engine makes is the figures' refresh after its last batch:
    # none here, so that the offload is the call that meets the broken connection for
    # sure (a refresh that came after the kill on a slow host met it instead, and the
    # offload then had a fresh link whatever became of a call that found one broken).
    monkeypatch.setattr(SharedStore, "store_stats", None)
    server = Server(tmp_path).start()
    engine = shared_host.Host(str(server.socket))
    try:
        assert engine.offload(user=1, pages=PAGES)["cached"] == PAGES * PAGE_SIZE
        server.kill()
        server = Server(tmp_path).start()
        assert engine.offload(user=2, pages=PAGES)["cached"] == PAGES * PAGE_SIZE
        assert engine.load(user=2, pages=PAGES) == {
            "cached": PAGES * PAGE_SIZE, "loaded": PAGES * PAGE_SIZE, "exact": True}
        assert engine.lookup(user=1, pages=PAGES) == {"cached": 0}  # it went with the server
    finally:
        engine.kv.close()
        server.kill()


def test_a_match_resent_after_a_restart_names_no_task_of_the_server_gone(
        tmp_path: Path) -> None:
    """A task to release rides along with the next match; when that match goes to a new
    server (the old one gone before it left), it must not name the task: the new server
    would take its id for another engine's and drop this one."""
    server = Server(tmp_path).start()
    store, tables = observer(server.socket)
    try:
        offload(store, tables, 1)
        task, _ = store.put_match(TOKENS, ["user:2"])
        invalid = task
        store.launch([task], [torch.arange(PAGES - 1)], [None])  # a page short: released
        server.kill()  # with the next message to the server
        server = Server(tmp_path).start()
        task, mask = store.get_match(TOKENS, ["user:1"])  # the first call after the restart
        assert not mask.any()  # a miss (the host tier went with the server), no StoreError
        store.cancel([task])
        assert store.try_wait([invalid])[invalid].status is TaskStatus.INVALID
        store.ping()  # still served on the same connection
        offload(store, tables, 3)
        task, mask = store.get_match(TOKENS, ["user:3"])
        assert mask.all()
        assert load_exact(store, tables, 3, task)
        assert "disconnected engine" not in server.text()
    finally:
        store.close()
        server.kill()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP delivered: it runs nothing more)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


@pytest.mark.asyncio
async def test_evict_and_clear_on_a_stopped_server_time_out_at_their_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOPped server holds the evict it was sent: the caller hears RequestTimeout at
    request_timeout_ms, not when the server answers (or the call's timeout, here 15 s);
    a clear behind it too, the store not asked. The server, resumed, refuses the evict
    that reached it after its deadline: a lookup after the RequestTimeout finds the key
    whole, then again, and loads it bit for bit on the same connection."""
    monkeypatch.setattr(link, "CALL_TIMEOUT_S", 15.0)  # else 60 s before the StoreError
    server = Server(tmp_path).start()
    assert server.process is not None
    tables = caches()
    pages, tokens = 4, 4 * PAGE_SIZE
    for cache, kv in zip(tables, user_kv(1, pages), strict=True):
        cache[:pages] = kv
    config = {"store": {"backend": "shared", "socket": str(server.socket)},
              "engine": {"request_timeout_ms": 1000}}
    engine = aiokv.open_engine(config, kv_caches=tables)
    try:
        async with engine:
            assert (await engine.offload(1, torch.arange(pages), tokens)).stored_tokens == tokens
            server.process.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: _stopped(server.process.pid), "the server stops")  # type: ignore[union-attr]
                loop = asyncio.get_running_loop()
                began = loop.time()
                with pytest.raises(RequestTimeout, match=r"evict .*request_timeout_ms=1000"):
                    await asyncio.wait_for(engine.evict(1), 30)
                with pytest.raises(RequestTimeout, match=r"clear .*nothing was dropped"):
                    await asyncio.wait_for(engine.clear(), 30)
                assert loop.time() - began < 10  # the server stays stopped until below
                assert _stopped(server.process.pid)
            finally:
                server.process.send_signal(signal.SIGCONT)
            for _ in range(2):
                async with await engine.lookup(1, tokens) as hit:
                    assert hit.cached_tokens == tokens
            for cache in tables:
                cache[pages:2 * pages] = 0
            async with await engine.lookup(1, tokens) as hit:
                loaded = await engine.load(hit, torch.arange(pages, 2 * pages))
            assert loaded.loaded_tokens == tokens
            assert all(torch.equal(cache[pages:2 * pages], kv)
                       for cache, kv in zip(tables, user_kv(1, pages), strict=True))
            assert await engine.evict(1) == tokens  # and an evict in time drops it
    finally:
        server.kill()


def test_the_server_refuses_an_evict_or_clear_that_reaches_it_after_its_deadline(
        tmp_path: Path) -> None:
    """What a server resumed after a stop does with the evict its engine gave up on: it
    drops nothing, and says why; one in time drops the key."""
    server = Server(tmp_path).start()
    store, tables = observer(server.socket)
    try:
        offload(store, tables, 1)
        store.set_invalidation_deadline(time.monotonic() - 0.5)
        with pytest.raises(StoreError, match=r"evict reached the server .* after its deadline"):
            store.evict(["user:1"])
        store.set_invalidation_deadline(time.monotonic() - 0.5)
        with pytest.raises(StoreError, match=r"clear reached the server .* after its deadline"):
            store.clear()
        task, mask = store.get_match(TOKENS, ["user:1"])
        assert mask.all()
        assert load_exact(store, tables, 1, task)
        store.set_invalidation_deadline(time.monotonic() + 30)
        assert store.evict(["user:1"]) == PAGES * PAGE_SIZE
        task, mask = store.get_match(TOKENS, ["user:1"])
        assert not mask.any()
        store.cancel([task])
    finally:
        store.close()
        server.kill()


def test_a_stop_whose_wake_is_under_way_as_the_server_closes_raises_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # stop() from another thread (or an SSD thread's notice) wrote its wake byte while
    # the server, already stopping, closed its wake pipe: the write went to a closed
    # descriptor (OSError EBADF in the caller of stop), or to whatever reused its number.
    host = Host(tmp_path, ssd=False)
    host.start()
    server = host.server
    assert server is not None and host.thread is not None
    wake_fd = server._wake_w
    in_write, go_on = threading.Event(), threading.Event()
    real_write = os.write

    def slow_wake(fd: int, data: bytes) -> int:
        if fd == wake_fd and threading.current_thread().name == "late-stop":
            in_write.set()
            go_on.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", slow_wake)
    raised: list[BaseException] = []

    def late_stop() -> None:
        try:
            server.stop()
        except BaseException as exc:  # what the caller of stop would see
            raised.append(exc)

    late = threading.Thread(target=late_stop, name="late-stop")
    late.start()  # its stop: the server drains and closes, its wake still under way
    assert in_write.wait(10)
    host.thread.join(3)  # a close that does not wait for the write ends meanwhile
    go_on.set()
    late.join(10)
    host.thread.join(30)
    assert not host.thread.is_alive() and not late.is_alive()
    assert raised == []


def test_a_server_back_with_smaller_tiers_answers_longer_lookups_and_drops_no_engine(
        tmp_path: Path) -> None:
    # The engine's figures still say what the server before held: a lookup longer than
    # the new one holds was a protocol violation there, the engine dropped (its held
    # Lookups rolled back with it) at every such lookup, and the lookup a StoreError.
    host = Host(tmp_path, ssd=False, cpu_cache_gb=0.002)
    host.start()
    tables = caches()
    engine = aiokv.open_engine({"store": {"backend": "shared", "socket": str(host.socket)}},
                               kv_caches=tables)
    kv = aiokv.run_in_background(engine)
    try:
        assert kv.offload(1, torch.arange(2), 2 * PAGE_SIZE).stored_tokens == 2 * PAGE_SIZE
        _restarted(host, 0.00002)  # 20 blocks: 80 tokens
        kv_1 = _written(tables, 1, 2)
        assert kv.offload(1, torch.arange(2), 2 * PAGE_SIZE).stored_tokens == 2 * PAGE_SIZE
        held = kv.lookup(1, 2 * PAGE_SIZE)
        assert held.cached_tokens == 2 * PAGE_SIZE
        long = kv.lookup(2, 4000)  # more than 80, less than the server before held
        assert long.cached_tokens == 0
        long.release()
        # Refused by the store's answer or, where the engine's figures are already the
        # new server's (asked again 0.1 s after the last), by the engine: 80 either way.
        with pytest.raises(aiokv.InvalidRequest,
                           match=r"num_tokens.*(holds at most 80|can ever hold \(80)"):
            kv.offload(3, torch.arange(32), 32 * PAGE_SIZE)
        assert _loaded_exact(kv, held, tables, 10, kv_1)
    finally:
        kv.close()
        host.stop()


def _small_server(tmp_path: Path) -> tuple[Host, dict[str, Any], list[torch.Tensor],
                                            aiokv.BackgroundEngine]:
    """A server of 20 blocks (80 tokens), its engines' config, and one engine on it."""
    host = Host(tmp_path, ssd=False, cpu_cache_gb=0.00002)
    host.start()
    config = {"store": {"backend": "shared", "socket": str(host.socket)}}
    tables = caches()
    return host, config, tables, aiokv.run_in_background(
        aiokv.open_engine(config, kv_caches=tables))


def _restarted(host: Host, cpu_cache_gb: float) -> None:
    """The server stopped and started again with a host tier of ``cpu_cache_gb``."""
    host.stop()
    host.config = aiokv.StoreConfig(cpu_cache_gb=cpu_cache_gb)
    host.start()


def _written(tables: list[torch.Tensor], user: int, pages: int) -> list[torch.Tensor]:
    """``user``'s KV of ``pages`` pages written into the first pages of the caches."""
    kv = user_kv(user, pages)
    for cache, layer in zip(tables, kv, strict=True):
        cache[:pages] = layer
    return kv


def _loaded_exact(kv: aiokv.BackgroundEngine, held: Any, tables: list[torch.Tensor],
                  at: int, want: list[torch.Tensor]) -> bool:
    """``held`` loaded whole into pages from ``at`` on of zeroed caches, bit for bit."""
    pages = want[0].shape[0]
    for cache in tables:
        cache.zero_()
    loaded = kv.load(held, torch.arange(at, at + pages)).loaded_tokens
    return loaded == pages * PAGE_SIZE and all(
        torch.equal(cache[at : at + pages], layer)
        for cache, layer in zip(tables, want, strict=True))


def test_caches_the_server_cannot_take_are_refused_naming_them_not_a_server_gone(
        tmp_path: Path) -> None:
    # The server dropped the engine without a word: its register said the server at the
    # socket was not reachable, "is `aiokv store-server` running?", while it was.
    host = Host(tmp_path, ssd=False)
    host.start()
    try:
        store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(host.socket)))
        with pytest.raises(aiokv.ConfigError) as refused:
            store.register([torch.zeros(1, 2, 1, 1, 1 << 20)])  # head_dim 1048576
        assert "refused: kv_caches: " in str(refused.value)
        assert "'head_dim': 1048576" in str(refused.value)
        assert "not reachable" not in str(refused.value)
    finally:
        host.stop()


def _stored_and_loaded_whole(kv: aiokv.BackgroundEngine, tables: list[torch.Tensor]
                             ) -> bool:
    """User 1's 32 pages, written afresh, offloaded whole, found whole and loaded back
    bit-exact into other pages."""
    kv_1 = _written(tables, 1, 32)
    assert kv.offload(1, torch.arange(32), 32 * PAGE_SIZE).stored_tokens == 32 * PAGE_SIZE
    held = kv.lookup(1, 32 * PAGE_SIZE)
    assert held.cached_tokens == 32 * PAGE_SIZE
    return _loaded_exact(kv, held, tables, 32, kv_1)


def test_a_server_back_with_larger_tiers_takes_the_offloads_the_one_before_could_not(
        tmp_path: Path) -> None:
    # The engine's figures still said what the smaller server before held: an offload
    # longer than that was refused at submit (InvalidRequest) though the new server takes
    # it, and an engine making only such offloads never asked the store again.
    host, _, tables, kv = _small_server(tmp_path)
    try:
        with pytest.raises(aiokv.InvalidRequest, match=r"num_tokens.*ever hold \(80"):
            kv.offload(1, torch.arange(32), 32 * PAGE_SIZE)
        _restarted(host, 0.002)
        assert _stored_and_loaded_whole(kv, tables)
    finally:
        kv.close()
        host.stop()


def test_an_offload_longer_than_the_server_away_held_fails_as_a_server_away_not_too_large(
        tmp_path: Path) -> None:
    # While the server was away (restarting with larger tiers), an offload longer than
    # the one before held was refused InvalidRequest, "more than the store can ever
    # hold (80", from that server's last figures, though no store had been asked: a
    # bad request to its caller, where a shorter one got StoreError, and the server back
    # a moment later took it.
    host, _, tables, kv = _small_server(tmp_path)
    try:
        host.stop()
        with pytest.raises(aiokv.StoreError, match="not reachable"):
            kv.offload(1, torch.arange(32), 32 * PAGE_SIZE)
        host.config = aiokv.StoreConfig(cpu_cache_gb=0.002)
        host.start()
        assert _stored_and_loaded_whole(kv, tables)
    finally:
        kv.close()
        host.stop()


def test_a_server_back_with_larger_tiers_answers_the_first_lookup_whole(
        tmp_path: Path) -> None:
    # The engine cut its lookups to what the smaller server before held (its figures
    # from then): the first lookup after the restart found 80 of the 128 tokens that
    # another engine had stored there, and loaded only those. A first fix then asked the
    # key again whole and gave the first answer back: the server counted both, and
    # engine.stats() showed 208 host-hit tokens for the 128 one lookup found.
    host, config, tables, kv = _small_server(tmp_path)
    try:
        _restarted(host, 0.002)
        writer_tables = caches()
        writer = aiokv.run_in_background(aiokv.open_engine(config, kv_caches=writer_tables))
        try:
            kv_5 = _written(writer_tables, 5, 32)
            assert writer.offload(5, torch.arange(32), 32 * PAGE_SIZE).stored_tokens == 128
        finally:
            writer.close()
        held = kv.lookup(5, 32 * PAGE_SIZE)
        assert held.cached_tokens == 32 * PAGE_SIZE
        assert _loaded_exact(kv, held, tables, 32, kv_5)
        wait_for(lambda: kv.stats().host_hit_tokens >= 32 * PAGE_SIZE,
                 "the lookup's hit in the figures")
        assert kv.stats().host_hit_tokens == 32 * PAGE_SIZE
    finally:
        kv.close()
        host.stop()


def test_an_offload_whose_full_pages_fill_the_server_is_stored_with_its_partial_page(
        tmp_path: Path) -> None:
    # 82 tokens on a server of 80: its 20 full pages fit (the partial page is never
    # stored), yet the key's 82 tokens were refused as TooLarge (InvalidRequest).
    host, _, tables, kv = _small_server(tmp_path)
    try:
        kv_1 = _written(tables, 1, 21)
        assert kv.offload(1, torch.arange(21), 20 * PAGE_SIZE + 2).stored_tokens == 80
        held = kv.lookup(1, 20 * PAGE_SIZE + 2)
        assert held.cached_tokens == 80
        for cache in tables:
            cache.zero_()
        assert kv.load(held, torch.arange(40, 61)).loaded_tokens == 80
        assert all(torch.equal(cache[40:60], layer[:20])
                   for cache, layer in zip(tables, kv_1, strict=True))
    finally:
        kv.close()
        host.stop()
