"""One host, several serving processes, one KV tier: ``aiokv store-server`` and workers on
``store.backend: shared``.

A load balancer without affinity sends each request of a user to a random worker
process (as uvicorn's workers, or one process per GPU, see them). Each request extends
the user's history by a page and runs one step in that worker: look up the history,
load what the store holds into fresh pages (checked bit for bit: a page's KV is a
function of the user and the page's index), compute the rest, offload the history.

With the shared tier, what one worker offloaded is a hit in every other: the example
prints the share of history tokens that came back from the store. ``--private`` runs the
same requests on workers that each have their own embedded store instead (the host
memory cut in as many pieces): a request then hits only where that user's previous
request happened to land, about 1 / workers of the time.

    python examples/shared_host.py [--workers 3] [--users 16] [--steps 5] [--private]

Runs on the CPU in seconds; starts and stops its own server (a socket in a private
temporary directory); exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import aiokv

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 4, 64, 16, 2, 32
HOST_GB = 0.02  # the host tier, all workers together


def page_kv(user: int, index: int) -> torch.Tensor:
    """The KV of a user's page ``index`` for every layer: [layers, 2, page, heads, dim]."""
    generator = torch.Generator().manual_seed(user * 100_003 + index)
    return torch.randn((LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM), generator=generator)


async def step(engine: aiokv.OffloadEngine, caches: list[torch.Tensor], user: int,
               history_pages: int) -> dict[str, int]:
    """One request: the history's first ``history_pages`` pages looked up and loaded
    (checked), the rest and one new page computed, the whole history offloaded."""
    pages = torch.arange(history_pages + 1)  # this worker's caches serve one request
    for cache in caches:
        cache[: history_pages + 1] = 0  # no earlier request's bytes pass for a load's
    async with await engine.lookup(user, history_pages * PAGE_SIZE) as hit:
        loaded = (await engine.load(hit, pages[:history_pages])).loaded_tokens // PAGE_SIZE
    mismatched = sum(
        not torch.equal(torch.stack([cache[page] for cache in caches]), page_kv(user, page))
        for page in range(loaded))
    for page in range(loaded, history_pages + 1):  # "compute" what did not come back
        kv = page_kv(user, page)
        for layer, cache in enumerate(caches):
            cache[page] = kv[layer]
    await engine.offload(user, pages, (history_pages + 1) * PAGE_SIZE)
    return {"asked": history_pages, "loaded": loaded, "mismatched": mismatched}


def worker(store: dict[str, Any], conn: multiprocessing.connection.Connection) -> None:
    """A serving process: its own caches and engine; requests come over ``conn``."""

    async def serve() -> None:
        caches = [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
        loop = asyncio.get_running_loop()
        async with aiokv.open_engine({"store": store}, kv_caches=caches) as engine:
            conn.send("ready")
            while (request := await loop.run_in_executor(None, conn.recv)) is not None:
                conn.send(await step(engine, caches, *request))

    asyncio.run(serve())


def start_server(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``aiokv store-server`` on a socket in ``directory`` (private to this user)."""
    config = directory / "store-server.yml"
    config.write_text(f"store:\n  cpu_cache_gb: {HOST_GB}\n")
    socket_path = directory / "run" / "store.sock"
    server = subprocess.Popen([sys.executable, "-m", "aiokv", "store-server", "--socket",
                               str(socket_path), "--config", str(config)],
                              stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + 60
    while not socket_path.exists():
        if server.poll() is not None or time.monotonic() > give_up:
            raise SystemExit(f"aiokv store-server did not start (exit {server.poll()})")
        time.sleep(0.05)  # waiting for its socket to appear
    return server, str(socket_path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="requests per user")
    parser.add_argument("--private", action="store_true",
                        help="a private embedded store per worker instead of the shared tier")
    args = parser.parse_args()
    if not 1 <= args.steps < PAGES:
        parser.error(f"--steps: between 1 and {PAGES - 1} (the caches' pages), "
                     f"got {args.steps}")
    with tempfile.TemporaryDirectory(prefix="aiokv-shared-") as directory:
        server = None
        if args.private:
            store: dict[str, Any] = {"cpu_cache_gb": HOST_GB / args.workers}
        else:
            server, socket_path = start_server(Path(directory))
            store = {"backend": "shared", "socket": socket_path}
        context = multiprocessing.get_context("spawn")
        conns, processes = [], []
        try:
            for _ in range(args.workers):
                parent, child = context.Pipe()
                process = context.Process(target=worker, args=(store, child))
                process.start()
                conns.append(parent)
                processes.append(process)
            for conn in conns:
                if conn.recv() != "ready":
                    raise SystemExit("a worker did not start")
            totals = {"asked": 0, "loaded": 0, "mismatched": 0}
            rng = random.Random(7)
            for history in range(args.steps):  # every user's request, then the next
                for user in range(args.users):
                    conn = rng.choice(conns)  # no affinity: any worker may serve it
                    conn.send((user, history))
                    for key, value in conn.recv().items():
                        totals[key] += value
            for conn in conns:
                conn.send(None)
            for process in processes:
                process.join(60)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
            if server is not None:
                server.send_signal(signal.SIGTERM)  # drains, then exits 0
                server.wait(60)
    kind = "private stores" if args.private else "one shared store-server"
    share = totals["loaded"] / max(totals["asked"], 1)
    print(f"{args.workers} workers on {kind}, {args.users} users x {args.steps} requests "
          f"on random workers: {totals['loaded']} of {totals['asked']} history pages came "
          f"back from the store ({share:.0%}), {totals['mismatched']} mismatched")
    return 1 if totals["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
