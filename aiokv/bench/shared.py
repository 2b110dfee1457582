"""``aiokv bench shared --processes N``: one ``aiokv store-server`` and N engine processes
on ``store.backend: shared``, against the same work done without the server.

From one run: (1) bandwidth: every process offloads ``--batches`` x ``--users`` fresh
histories at once (concurrent calls, which each process's engine batches ``--users`` at a
time, so that several batches stream back to back), looks them up and loads them
back into other pages, each phase started in all processes together; the aggregate GiB/s
of each direction (all processes' bytes over the span from the first start to the last
end) next to the raw copy of the same run, all processes at once: on a GPU each
process's one pinned copy of the same bytes each way; on the CPU the same pages between
its caches and a plain host tensor of blocks with the same torch ops. (2) The control
traffic of one batch (``--users`` matches in one message and its answer; the batch's end
in another, sent without an answer; the two together; and an empty message's round trip,
what the socket costs without the index's work), median and p99, from a client in this
process. The server handles an end after the engine has gone on, so the next message may
wait for it: the empty message, timed right after, carries that. (3) The hit ratio of a
workload whose users land on a random process at each request (look up the history, load
it, offload it grown by a page), with the shared store against N private engines (each
on its own embedded store with 1/N of the server's host memory), in tokens hit over
tokens asked.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from .. import EngineConfig, OffloadEngine, StoreConfig, flags, run_in_background
from ..errors import ConfigError, StoreError
from ..handles import BackgroundLookup
from ..stores import make_store
from . import common

NAME = "shared"
HELP = "N processes on one aiokv store-server: aggregate GiB/s vs raw copy, round trip, hits"


@dataclass(frozen=True)
class Settings:
    processes: int = 2
    users: int = 8
    batches: int = 1
    tokens: int = 1024
    rounds: int = 3
    layers: int = 8
    page_size: int = 16
    heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    device: str = "auto"
    hit_users: int = 64
    hit_requests: int = 8
    round_trips: int = 300


QUICK = {"tokens": 256, "layers": 4, "heads": 2, "head_dim": 64, "rounds": 2,
         "hit_users": 32, "hit_requests": 6, "round_trips": 200}
HELPS = {
    "processes": "engine processes", "users": "concurrent users per process and batch",
    "batches": "batches each process offloads (and loads) back to back in a round, submitted "
    "at once: 1 times one batch's latency, more the stream a serving process keeps up",
    "tokens": "tokens per user history", "rounds": "bandwidth rounds (best one reported)",
    "hit_users": "users of the hit-ratio workload", "round_trips": "control round trips timed",
    "hit_requests": "requests per user in the hit-ratio workload",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _block_bytes(s: Settings) -> int:
    return common.bytes_per_token(s.layers, s.heads, s.head_dim, common.DTYPES[s.dtype]) * (
        s.page_size)


def _server_gb(s: Settings) -> float:
    """Room for one bandwidth round of every process and the whole hit workload, twice."""
    pages = s.processes * s.batches * s.users * s.tokens // s.page_size
    pages += s.hit_users * (s.tokens // s.page_size + s.hit_requests)
    return 2 * pages * _block_bytes(s) / (1 << 30)


def _cache_pages(s: Settings) -> int:
    """Pages of each engine process's caches: a round's histories, and their copies."""
    pages_per_user = s.tokens // s.page_size
    return max(2 * s.batches * s.users * pages_per_user,
               2 * (pages_per_user + s.hit_requests))


def _raw_blocks(s: Settings) -> int:
    """Blocks of each engine process's host tensor for the raw copy."""
    return 2 * s.batches * s.users * (s.tokens // s.page_size)


def _check_fits(s: Settings) -> None:
    """A usage error before the server starts, where the run's host memory, all processes
    together, would not fit in this machine: the server's own refusal would come from its
    process (as a log), and the engines' buffers could get them killed by the kernel."""
    block, server = _block_bytes(s), int(_server_gb(s) * (1 << 30))
    on_host = _device(s.device).type == "cpu"
    needs = {
        "server store": server,
        "private stores": server,  # the N private engines share the server's size
        "caches": s.processes * _cache_pages(s) * block if on_host else 0,
        "raw copy blocks": s.processes * _raw_blocks(s) * block,
        "round-trip caches": s.users * (s.tokens // s.page_size) * block,
    }
    asked = ", ".join(f"--{name.replace('_', '-')} {getattr(s, name)}" for name in (
        "processes", "users", "batches", "tokens", "layers", "page_size", "heads", "head_dim",
        "hit_users", "hit_requests"))
    flags.check_fits(asked, needs)


# ---- the engine processes --------------------------------------------------------------


class _Worker:
    def __init__(self, s: Settings, socket_path: str, index: int) -> None:
        self.s, self.index = s, index
        device = _device(s.device)
        self.pages_per_user = s.tokens // s.page_size
        self.streams = s.batches * s.users  # a round's users, over its batches
        dtype = common.DTYPES[s.dtype]
        self.caches = common.make_caches(s.layers, _cache_pages(s), s.page_size, s.heads,
                                         s.head_dim, dtype, device)
        for cache in self.caches:
            cache.normal_()
        engine = EngineConfig(window_us=2000, max_batch_requests=s.users,
                              request_timeout_ms=120_000)
        self.shared_store = make_store(StoreConfig(backend="shared", socket=socket_path))
        self.shared = run_in_background(OffloadEngine(self.shared_store, self.caches, engine))
        private = StoreConfig(cpu_cache_gb=_server_gb(s) / s.processes)
        self.private = run_in_background(OffloadEngine(make_store(private), self.caches,
                                                       engine))
        self.block_bytes = _block_bytes(s)
        self._hits: list[BackgroundLookup] = []  # a round's lookups, from lookup to load
        self.raw_pool = torch.empty((_raw_blocks(s), s.layers, 2, s.page_size, s.heads, s.head_dim),
                                    dtype=dtype, pin_memory=device.type == "cuda")
        # On a GPU the raw figure is the link's: one contiguous pinned copy of the same
        # bytes each way (the shared store copies with the copy engines, not torch ops).
        self.raw_device = (torch.empty(self.raw_pool.nbytes, dtype=torch.uint8, device=device)
                           if device.type == "cuda" else None)

    def _user_pages(self, user: int, offset: int) -> torch.Tensor:
        first = offset * self.streams * self.pages_per_user + user * self.pages_per_user
        return torch.arange(first, first + self.pages_per_user)

    # The bandwidth round in three phases, each started in every process at once (the
    # pool waits for all before the next): a process that lags in one phase then cannot
    # stretch the next phase's span, from the first start to the last end.

    def offload(self, round_: int) -> dict[str, float]:
        kv, s = self.shared, self.s
        wait_pinned = getattr(self.shared_store, "wait_pinned", None)
        if round_ == 0 and wait_pinned is not None:  # copies, not start-up: pinned first
            wait_pinned()
        start = time.monotonic()
        futures = [kv.submit_offload(u, self._user_pages(u, 0), s.tokens,
                                     namespace=self._names(round_, u))
                   for u in range(self.streams)]
        stored = sum(f.result().stored_tokens for f in futures)
        return {"offload_start": start, "offload_end": time.monotonic(),
                "offload_bytes": stored * self.block_bytes / s.page_size}

    def lookup(self, round_: int) -> dict[str, float]:
        kv, s = self.shared, self.s
        self._hits = [f.result() for f in [
            kv.submit_lookup(u, s.tokens, namespace=self._names(round_, u))
            for u in range(self.streams)]]
        return {}

    def load(self, round_: int) -> dict[str, float]:
        kv, s = self.shared, self.s
        start = time.monotonic()
        loads = [kv.submit_load(h, self._user_pages(u, 1)) for u, h in enumerate(self._hits)]
        loaded = sum(f.result().loaded_tokens for f in loads)
        end = time.monotonic()
        for hit in self._hits:
            hit.release()
        self._hits = []
        return {"load_start": start, "load_end": end,
                "load_bytes": loaded * self.block_bytes / s.page_size}

    def _names(self, round_: int, user: int) -> list[str]:
        return [f"bw{round_}:{self.index}:{user}"]

    def raw(self, round_: int) -> dict[str, float]:
        """On the CPU, the same pages through the same torch ops as the shared store's
        copies, with a plain host tensor of blocks in place of the region; on a GPU, one
        pinned copy of the same bytes each way."""
        if self.raw_device is not None:
            return self._raw_link(self.pages_per_user * self.streams * self.block_bytes)
        pages = torch.cat([self._user_pages(u, 0) for u in range(self.streams)])
        back = torch.cat([self._user_pages(u, 1) for u in range(self.streams)])
        blocks = torch.arange(len(pages))
        device = self.caches[0].device
        start = time.monotonic()
        stacked = torch.stack([c.index_select(0, pages.to(device)) for c in self.caches], 1)
        self.raw_pool.index_copy_(0, blocks, stacked.to("cpu"))
        offloaded = time.monotonic()
        got = self.raw_pool.index_select(0, blocks)
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(0, back.to(device), got[:, layer].to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.monotonic()
        moved = len(pages) * self.block_bytes
        return {"offload_start": start, "offload_end": offloaded, "load_start": offloaded,
                "load_end": end, "offload_bytes": moved, "load_bytes": moved}

    def _raw_link(self, moved: int) -> dict[str, float]:
        assert self.raw_device is not None
        host = self.raw_pool.view(-1).view(torch.uint8)[:moved]
        device = self.raw_device[:moved]
        torch.cuda.synchronize(device.device)
        start = time.monotonic()
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize(device.device)
        offloaded = time.monotonic()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device.device)
        end = time.monotonic()
        return {"offload_start": start, "offload_end": offloaded, "load_start": offloaded,
                "load_end": end, "offload_bytes": moved, "load_bytes": moved}

    def hits(self, kind: str, users: list[int], grown: list[int]) -> dict[str, float]:
        """One request of each user: look up its history, load it, offload it grown."""
        kv = self.shared if kind == "shared" else self.private
        s = self.s
        asked = hit = 0
        for user, extra in zip(users, grown, strict=True):
            tokens = s.tokens + extra * s.page_size
            pages = torch.arange(tokens // s.page_size)
            with kv.lookup(user, tokens, namespace=[f"hit:{user}"]) as found:
                asked, hit = asked + tokens, hit + found.cached_tokens
                if found.cached_tokens:
                    kv.load(found, pages[: found.cached_tokens // s.page_size])
            kv.offload(user, pages, tokens, namespace=[f"hit:{user}"])
        return {"asked": asked, "hit": hit}

    def close(self) -> dict[str, float]:
        self.shared.close()
        self.private.close()
        return {}


def _serve(s: Settings, socket_path: str, index: int,
           conn: multiprocessing.connection.Connection) -> None:
    worker = _Worker(s, socket_path, index)
    conn.send({})
    while True:
        op, args = conn.recv()
        conn.send(getattr(worker, op)(*args))
        if op == "close":
            return


class _Pool:
    def __init__(self, s: Settings, socket_path: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns = []
        self.processes = []
        for index in range(s.processes):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(s, socket_path, index, child),
                                      name=f"aiokv-bench-{index}", daemon=True)
            process.start()
            self.conns.append(parent)
            self.processes.append(process)
        for conn in self.conns:
            conn.recv()

    def all(self, op: str, *args: Any) -> list[dict[str, float]]:
        for conn in self.conns:
            conn.send((op, args))
        return [conn.recv() for conn in self.conns]

    def some(self, calls: dict[int, tuple[Any, ...]], op: str) -> list[dict[str, float]]:
        for index, args in calls.items():
            self.conns[index].send((op, args))
        return [self.conns[index].recv() for index in calls]

    def close(self) -> None:
        self.all("close")
        for process in self.processes:
            process.join(30)


def _aggregate(parts: list[dict[str, float]], direction: str) -> float:
    start = min(p[f"{direction}_start"] for p in parts)
    end = max(p[f"{direction}_end"] for p in parts)
    return sum(p[f"{direction}_bytes"] for p in parts) / max(end - start, 1e-9) / (1 << 30)


def _round_trips(s: Settings, socket_path: str) -> dict[str, list[float]]:
    """A batch of ``users`` matches in one message, and its end in another, timed; then
    the two as one batch's."""
    from ..stores.shared import SharedStore

    store = SharedStore(StoreConfig(backend="shared", socket=socket_path))
    caches = common.make_caches(s.layers, s.users * (s.tokens // s.page_size), s.page_size,
                                s.heads, s.head_dim, common.DTYPES[s.dtype],
                                torch.device("cpu"))
    store.register(caches)
    tokens = np.arange(s.tokens, dtype=np.int64)
    match_s, end_s, ping_s = [], [], []
    try:
        for i in range(s.round_trips):
            t0 = time.perf_counter()
            store.ping()
            ping_s.append(time.perf_counter() - t0)
            queries = [(tokens, [f"rt{i}:{u}"]) for u in range(s.users)]
            t0 = time.perf_counter()
            answers = store.put_match_many(queries)
            match_s.append(time.perf_counter() - t0)
            ids = [a[0] for a in answers if isinstance(a, tuple)]
            t0 = time.perf_counter()
            store.cancel(ids)  # a batch's end, one message
            end_s.append(time.perf_counter() - t0)
        store.clear()
    finally:
        store.close()
    return {"empty": ping_s, "match": match_s, "end": end_s,
            "batch": [m + e for m, e in zip(match_s, end_s, strict=True)]}


def _hit_ratio(s: Settings, pool: _Pool, kind: str, seed: int) -> float:
    rng = np.random.default_rng(seed)
    asked = hit = 0.0
    for request in range(s.hit_requests):
        landing = rng.integers(0, s.processes, size=s.hit_users)
        calls = {p: ([int(u) for u in np.flatnonzero(landing == p)],
                     [request] * int((landing == p).sum()))
                 for p in range(s.processes) if (landing == p).any()}
        for part in pool.some({p: (kind, *args) for p, args in calls.items()}, "hits"):
            asked, hit = asked + part["asked"], hit + part["hit"]
    return hit / max(asked, 1)


def run(args: argparse.Namespace) -> int:
    if args.plot:  # nothing draws it: say so rather than write no file
        raise ConfigError("--plot", "this bench draws no plot")
    s = common.settings_from_args(Settings, args, QUICK)
    # Each process submits a round's offloads (and lookups, loads) all at once, to an
    # engine of the default max_pending.
    common.check_in_flight(s, "users", "batches", max_pending=EngineConfig.max_pending)
    _check_fits(s)
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-shared-") as directory:
        socket_path = str(Path(directory) / "run" / "store.sock")
        config = Path(directory) / "server.yml"
        config.write_text(yaml.safe_dump({"store": {"cpu_cache_gb": _server_gb(s)}}))
        log = open(Path(directory) / "server.log", "wb")  # noqa: SIM115  # lives with it
        server = subprocess.Popen(
            [sys.executable, "-m", "aiokv", "store-server", "--socket", socket_path,
             "--config", str(config)], stderr=log, env=dict(os.environ))
        try:
            while not os.path.exists(socket_path):
                if (status := server.poll()) is not None:
                    raise _server_failed(status, (Path(directory) / "server.log").read_text())
                time.sleep(0.05)
            results = _measure(s, socket_path)
        finally:
            server.terminate()
            server.wait(60)
            log.close()
    _report(s, results)
    if args.json:
        common.write_json(args.json, NAME, s, _device(s.device), args.bench_argv, results)
    return 0


# The server's log lines begin "<date> <time> <LEVEL> <logger>: ".
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ [A-Z]+ [\w.]+: ")


def _server_failed(status: int, log: str) -> Exception:
    """What to raise where the store server exited before it listened: its own last word
    on stderr (its refusal, or a traceback's last line) in one line, as a StoreError;
    a RuntimeError where that says the sizes did not fit (bench.main's usage error)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    said = _LOG_PREFIX.sub("", lines[-1]) if lines else "nothing on stderr"
    if flags.too_large(RuntimeError(said)) is not None:
        return RuntimeError(said)
    return StoreError(f"the store server exited at start (status {status}): {said}")


def _measure(s: Settings, socket_path: str) -> dict[str, Any]:
    pool = _Pool(s, socket_path)
    try:
        best: dict[str, float] = {}
        for round_ in range(s.rounds):
            offloads = pool.all("offload", round_)
            pool.all("lookup", round_)
            loads = pool.all("load", round_)
            shared = [{**o, **lo} for o, lo in zip(offloads, loads, strict=True)]
            raw = pool.all("raw", round_)
            for direction in ("offload", "load"):
                for kind, parts in (("shared", shared), ("raw", raw)):
                    key = f"{kind}_{direction}_gib_s"
                    best[key] = max(best.get(key, 0.0), _aggregate(parts, direction))
        trips = _round_trips(s, socket_path)
        hits = {kind: _hit_ratio(s, pool, kind, seed=31) for kind in ("shared", "private")}
    finally:
        pool.close()
    return {"bandwidth": best, "round_trips_us": {
        k: [float(np.percentile(v, p)) * 1e6 for p in (50, 99)] for k, v in trips.items()},
        "hit_ratio": hits}


def _report(s: Settings, results: dict[str, Any]) -> None:
    bw = results["bandwidth"]
    rows = [[d, bw[f"shared_{d}_gib_s"], bw[f"raw_{d}_gib_s"],
             bw[f"shared_{d}_gib_s"] / max(bw[f"raw_{d}_gib_s"], 1e-9)]
            for d in ("offload", "load")]
    common.print_table(
        f"{s.processes} processes x {s.batches} batch(es) x {s.users} users x {s.tokens} tokens "
        f"({_block_bytes(s) >> 10} KiB a page), best of {s.rounds}",
        ["direction", "shared GiB/s", "raw GiB/s", "shared/raw"], rows)
    trips = results["round_trips_us"]
    common.print_table(f"control messages, a batch of {s.users} ({s.round_trips} timed)",
                       ["message", "median us", "p99 us"],
                       [[k, *v] for k, v in trips.items()])
    hits = results["hit_ratio"]
    common.print_table(
        f"hit ratio, {s.hit_users} users x {s.hit_requests} requests on random processes",
        ["shared", "private", "private/shared"],
        [[hits["shared"], hits["private"], hits["private"] / max(hits["shared"], 1e-9)]])


__all__ = ["HELP", "NAME", "add_arguments", "run"]
