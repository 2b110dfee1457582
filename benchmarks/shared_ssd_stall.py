"""What one engine's SSD lookups cost the other engines of ``aiokv store-server``.

A real server with a small host tier over an SSD tier (CPU caches). Engine A (a child
process) offloads ``--users`` histories, far more than the host tier holds, then looks
them up in turn: each lookup finds its pages on SSD only, and the server reads them into
host blocks before it answers. Engine B (this process) meanwhile times batches of
``--batch`` put matches of fresh keys (each given back at once), first with A idle, then
with A looking up, alternated ``--rounds`` times. Printed: B's match median and p99 in
each phase, and A's lookups per second and their median.

``python benchmarks/shared_ssd_stall.py [--users 64] [--tokens 2048] [--trips 300]
[--rounds 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 4, 16, 2, 64  # 32 KiB blocks in bfloat16


def _caches(pages: int) -> list[Any]:
    import torch

    return [torch.zeros(pages, 2, PAGE_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            for _ in range(LAYERS)]


def _store(socket_path: str, pages: int) -> Any:
    import aiokv
    from aiokv.stores.shared import SharedStore

    store = SharedStore(aiokv.StoreConfig(backend="shared", socket=socket_path))
    store.register(_caches(pages))
    return store


def _reader(args: argparse.Namespace) -> None:
    """Engine A: offload the users and say so; then, at each "run" line on stdin, look
    them up in turn while the file ``args.flag`` exists, and print how many and their
    median; at "stop" (or the end of stdin), close."""
    import numpy as np
    import torch

    pages = args.tokens // PAGE_SIZE
    store = _store(args.socket, pages)
    tokens = np.arange(args.tokens, dtype=np.int64)
    from aiokv.stores.base import NoSpace

    for user in range(args.users):
        while True:
            try:
                task, _ = store.put_match(tokens, [f"ssd:{user}"])
                break
            except NoSpace:  # the host tier is full until the SSD copies free it
                time.sleep(0.01)
        store.launch([task], [torch.arange(pages)], [None])
        while not store.try_wait([task]):
            time.sleep(0.0005)  # polling a CPU copy, not ordering work
    give_up = time.monotonic() + 60
    while store.store_stats()["ssd_blocks_used"] < args.users * pages:
        if time.monotonic() > give_up:
            raise SystemExit("the SSD copies never came")
        time.sleep(0.05)  # the server writes them through in the background
    print("ready", flush=True)
    times: list[float] = []
    found = 0  # tokens the lookups found (all of them: the SSD holds every user)
    flag = Path(args.flag)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        user = 0
        while flag.exists():
            began = time.perf_counter()
            task, mask = store.get_match(tokens, [f"ssd:{user}"])
            times.append(time.perf_counter() - began)
            found += int(mask.sum())
            store.cancel([task])
            user = (user + 1) % args.users
        print(json.dumps({"lookups": len(times), "median_ms": statistics.median(times) * 1e3
                          if times else 0.0, "found": found / max(len(times) * args.tokens, 1)}),
              flush=True)
        times.clear()
        found = 0
    store.close()


def _matches(store: Any, trips: int, tag: str) -> list[float]:
    import numpy as np

    tokens = np.arange(256, dtype=np.int64)
    times: list[float] = []
    for i in range(trips):
        began = time.perf_counter()
        answers = store.put_match_many([(tokens, [f"{tag}{i}:{u}"]) for u in range(8)])
        times.append(time.perf_counter() - began)
        store.cancel([a[0] for a in answers if isinstance(a, tuple)])
    return times


def _row(name: str, times: list[float], extra: str = "") -> None:
    times = sorted(times)
    p99 = times[int(0.99 * (len(times) - 1))]
    print(f"  {name:28} B's match median {statistics.median(times) * 1e6:8.1f} us, p99 "
          f"{p99 * 1e6:9.1f} us{extra}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--trips", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--flag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        _reader(args)
        return 0
    sys.path.insert(0, str(HERE))
    block = LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * 2
    history = args.users * args.tokens // PAGE_SIZE * block
    with tempfile.TemporaryDirectory(prefix="aiokv-ssd-stall-") as directory:
        root = Path(directory)
        (root / "ssd").mkdir()
        host_gb = max(history / 8, 4 * block * args.tokens // PAGE_SIZE) / (1 << 30)
        (root / "server.yml").write_text(json.dumps({"store": {
            "cpu_cache_gb": host_gb, "ssd_cache_gb": 4 * history / (1 << 30) + host_gb,
            "ssd_cache_dir": str(root / "ssd")}}))
        sock, flag = root / "run" / "store.sock", root / "reading"
        env = {**os.environ, "PYTHONPATH": str(HERE)}
        server = subprocess.Popen([sys.executable, "-m", "aiokv", "store-server", "--socket",
                                   str(sock), "--config", str(root / "server.yml")],
                                  env=env, stderr=subprocess.DEVNULL)
        reader = None
        try:
            while not sock.exists():
                if server.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.02)  # waiting for its socket
            reader = subprocess.Popen(
                [sys.executable, __file__, "--reader", "--socket", str(sock), "--flag",
                 str(flag), "--users", str(args.users), "--tokens", str(args.tokens)],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert reader.stdin is not None and reader.stdout is not None
            if reader.stdout.readline().strip() != "ready":
                raise SystemExit("engine A did not start")
            store = _store(str(sock), 8 * 256 // PAGE_SIZE)
            _matches(store, 20, "warm")
            print(f"host tier {host_gb * 1024:.0f} MiB, {args.users} users x {args.tokens} "
                  f"tokens on SSD ({history >> 20} MiB, {args.tokens // PAGE_SIZE * block >> 10} "
                  f"KiB a lookup); B: batches of 8 put matches x 256 tokens")
            for round_ in range(args.rounds):
                _row(f"round {round_}, A idle", _matches(store, args.trips, f"i{round_}"))
                flag.touch()
                reader.stdin.write("run\n")
                reader.stdin.flush()
                began = time.monotonic()
                times = _matches(store, args.trips, f"b{round_}")
                took = time.monotonic() - began
                flag.unlink()
                done = json.loads(reader.stdout.readline())
                _row(f"round {round_}, A on SSD", times,
                     f"; A: {done['lookups'] / took:.0f} lookups/s, median "
                     f"{done['median_ms']:.2f} ms, {done['found']:.0%} of tokens found")
            reader.stdin.write("stop\n")
            reader.stdin.flush()
            store.close()
        finally:
            if reader is not None:
                reader.kill()
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
