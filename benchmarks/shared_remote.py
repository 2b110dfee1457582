"""Remote hits through the store server against the embedded store's, in one run.

    python benchmarks/shared_remote.py [--users 16] [--pages 16] [--rounds 3] [--quick]

Starts a Mooncake master and store process, an ``aiokv store-server`` whose config sets
``store.remote`` (a process of its own), and in this process three engines: A, embedded,
offloads each round's users to Mooncake (and waits until every block is written); B, a
fresh embedded store, and S, an engine on the server, then load users that only Mooncake
has (lookup and load, one user at a time, as a host's misses come), B and S alternating
which goes first. Prints each one's GiB/s per round, S / B (best vs best and the median
of rounds), where S's hits came from (the server's ``remote_hit_tokens``), and checks
the bytes S loaded against A's pages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from remote_tier import GIB, aiokv_loads, aiokv_offload, make_caches, round_of, store_config, until

import aiokv
from aiokv.remote.servers import MooncakeServers
from aiokv.stores import make_store


def start_server(directory: Path, master: str, cpu_gb: float) -> tuple[subprocess.Popen[bytes],
                                                                        str]:
    socket_path = str(directory / "run" / "store.sock")
    config = directory / "server.yml"
    config.write_text(yaml.safe_dump({"store": {
        "cpu_cache_gb": cpu_gb, "remote": {"master": master, "timeout_ms": 5000}}}))
    with open(directory / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "aiokv", "store-server", "--socket",
                                   socket_path, "--config", str(config)],
                                  stderr=log, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while not os.path.exists(socket_path):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError((directory / "server.log").read_text())
        time.sleep(0.05)
    return server, socket_path


async def run(args: argparse.Namespace, master: str, socket_path: str) -> None:
    pages = args.pages
    caches_a, total, cpu_gb = round_of(args, " for each loader")
    store_a = aiokv.LocalStore(store_config(master, 2 * cpu_gb))
    store_b = aiokv.LocalStore(store_config(master, cpu_gb))
    store_s = make_store(aiokv.StoreConfig(backend="shared", socket=socket_path))
    caches_s = make_caches(pages, args.quick)
    rows: dict[str, list[float]] = {"embedded": [], "server": []}
    async with contextlib.AsyncExitStack() as stack:
        engine_a = await stack.enter_async_context(
            aiokv.OffloadEngine(store_a, caches_a, aiokv.EngineConfig()))
        engine_b = await stack.enter_async_context(
            aiokv.OffloadEngine(store_b, make_caches(pages, args.quick), aiokv.EngineConfig()))
        engine_s = await stack.enter_async_context(
            aiokv.OffloadEngine(store_s, caches_s, aiokv.EngineConfig()))
        for store in (store_a, store_b):  # first touch outside the timing, as pinning does
            store._pool.memory.raw.zero_()  # type: ignore[union-attr]
        await until(lambda: store_a._remote.io.client() is not None)  # type: ignore[union-attr]
        hits_before = store_s.store_stats()["remote_hit_tokens"]
        for round_ in range(-1, args.rounds):  # -1 warms up
            base = (round_ + 1) * 2 * args.users
            users = {"embedded": range(base, base + args.users),
                     "server": range(base + args.users, base + 2 * args.users)}
            await aiokv_offload(store_a, engine_a, range(base, base + 2 * args.users), pages)
            order = ("embedded", "server") if round_ % 2 else ("server", "embedded")
            seconds = {}
            for name in order:
                engine = engine_b if name == "embedded" else engine_s
                seconds[name] = await aiokv_loads(engine, users[name], pages)
            for layer_s, layer_a in zip(caches_s, caches_a, strict=True):
                if not torch.equal(layer_s, layer_a):
                    raise RuntimeError("the server's remote hit loaded other bytes")
            if round_ < 0:
                continue
            for name in rows:
                rows[name].append(total / seconds[name])
            print(f"  round {round_}: embedded {rows['embedded'][-1] / GIB:.3f}, server "
                  f"{rows['server'][-1] / GIB:.3f} GiB/s ({order[0]} first)")
        hits = store_s.store_stats()["remote_hit_tokens"] - hits_before
        expected = (args.rounds + 1) * args.users * pages * engine_s.page_size
    best = max(rows["server"]) / max(rows["embedded"])
    paired = statistics.median(s / e for s, e in zip(rows["server"], rows["embedded"],
                                                     strict=True))
    print(f"remote hits, lookup + load one user at a time: server / embedded = {best:.1%} "
          f"best vs best, {paired:.1%} median of rounds")
    print(f"the server's remote_hit_tokens: {hits} of {expected} loaded; bytes checked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--segment-mb", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="small blocks (a smoke test)")
    args = parser.parse_args()
    with MooncakeServers(segment_mb=args.segment_mb) as servers, \
            tempfile.TemporaryDirectory(prefix="aiokv-shared-remote-") as directory:
        _, _, server_gb = round_of(args, ", and the server's host tier holds it 2.5 times")
        server, socket_path = start_server(Path(directory), servers.master, server_gb)
        try:
            asyncio.run(run(args, servers.master, socket_path))
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
