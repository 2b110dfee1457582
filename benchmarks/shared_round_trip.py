"""Where one batch's control round trip to ``aiokv store-server`` goes (issue 31's 100 µs).

Two parts, both on CPU caches:

1. Round trips, end to end: a real server process and a ``SharedStore`` in a child
   process, per iteration (interleaved, so that every kind sees the same box): a bare
   Python echo of 16 bytes over a UNIX socket to a ``selectors`` loop in another process
   (the floor: two process wake-ups), an empty message (``ping``), a batch of ``--batch``
   put matches of ``--tokens`` default token ids each in fresh namespaces (``match``) and
   that batch's end (``end``: its tasks given back, one message the server does not
   answer: the server's work on it overlaps the next iteration, whose ``empty`` may wait
   for it); ``batch`` is ``match`` + ``end``, what one batch's control costs the engine;
   ``load`` is a batch of get matches of keys stored once at the start and its launch
   (on this code: its gets announced, the notice word read), up to the copies.
   With ``--compare DIR`` (a checkout of other code, e.g. a ``git worktree`` of an
   older commit) the children alternate between that code and this checkout,
   ``--rounds`` each, so that the box's load moves both alike.
2. The split of one batch, in this process, on this checkout's code: the client's
   encode, the server's decode, handler and encode of the reply, the client's decode,
   and the server's handler for the batch's end.

``python benchmarks/shared_round_trip.py [--compare /tmp/base] [--rounds 3]
[--trips 300] [--batch 8] [--tokens 256]``
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
GEOMETRY = {"layers": 4, "page_size": 16, "heads": 2, "head_dim": 64}  # --quick's caches


def _caches(pages: int) -> list[Any]:
    import torch

    return [torch.zeros(pages, 2, GEOMETRY["page_size"], GEOMETRY["heads"],
                        GEOMETRY["head_dim"], dtype=torch.bfloat16)
            for _ in range(GEOMETRY["layers"])]


# ---- part 1: round trips, in a child on the code under test ----------------------------


def _echo_server(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    conn.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(conn, selectors.EVENT_READ)
    while True:
        for _ in selector.select():
            data = conn.recv(1 << 16)
            if not data:
                return
            conn.sendall(data)


def _start(argv: list[str], ready: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stderr=out, env=dict(os.environ))
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.02)  # waiting for a socket to appear, not ordering work
    return process


def _child(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import aiokv
    from aiokv.stores.shared import SharedStore

    with tempfile.TemporaryDirectory(prefix="aiokv-rt-") as directory:
        root = Path(directory)
        (root / "server.yml").write_text(json.dumps({"store": {"cpu_cache_gb": 0.1}}))
        sock_path, echo_path = root / "run" / "store.sock", root / "echo.sock"
        server = _start([sys.executable, "-m", "aiokv", "store-server", "--socket",
                         str(sock_path), "--config", str(root / "server.yml")], sock_path,
                        root / "server.log")
        echo = _start([sys.executable, __file__, "--echo", str(echo_path)], echo_path,
                      root / "echo.log")
        store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(sock_path)))
        store.register(_caches(args.batch * args.tokens // GEOMETRY["page_size"]))
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(str(echo_path))
        tokens = np.arange(args.tokens, dtype=np.int64)
        times: dict[str, list[float]] = {"echo": [], "empty": [], "match": [], "end": [],
                                         "batch": [], "load": []}
        clock = time.perf_counter
        per_user = args.tokens // GEOMETRY["page_size"]
        pages = [torch.arange(u * per_user, (u + 1) * per_user) for u in range(args.batch)]

        def copied(ids: list[int]) -> None:  # untimed: the copies themselves
            done: dict[int, Any] = {}
            while len(done) < len(ids):
                done.update(store.try_wait(ids))
                time.sleep(0.0002)  # not ordering work: leaves the GIL to the copy thread

        held = store.put_match_many([(tokens, [f"held:{u}"]) for u in range(args.batch)])
        store.launch([a[0] for a in held if isinstance(a, tuple)], pages, [None] * args.batch)
        copied([a[0] for a in held if isinstance(a, tuple)])
        try:
            for i in range(args.trips + 20):  # the first 20 warm up
                t0 = clock()
                peer.sendall(b"x" * 16)
                got = 0
                while got < 16:
                    got += len(peer.recv(64))
                t1 = clock()
                store.ping()
                t2 = clock()
                answers = store.put_match_many([(tokens, [f"rt{i}:{u}"])
                                                for u in range(args.batch)])
                t3 = clock()
                store.cancel([a[0] for a in answers if isinstance(a, tuple)])
                t4 = clock()
                gets = store.get_match_many([(tokens, [f"held:{u}"])
                                             for u in range(args.batch)])
                ids = [a[0] for a in gets if isinstance(a, tuple)]
                store.launch(ids, pages, [None] * args.batch)
                t5 = clock()
                copied(ids)
                if i >= 20:
                    for key, took in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3,
                                                 t4 - t2, t5 - t4), strict=True):
                        times[key].append(took * 1e6)
        finally:
            peer.close()
            store.close()
            server.terminate()
            server.wait(30)
            echo.wait(30)
    print(json.dumps({k: statistics.median(v) for k, v in times.items()}))


def _run_child(code: Path, args: argparse.Namespace) -> dict[str, float]:
    """One child on the code at ``code`` (its server too); a server and client of
    different codes do not speak the same wire."""
    # cwd too: the server's `python -m aiokv` puts the working directory first on sys.path.
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, __file__, "--child", "--trips", str(args.trips),
                          "--batch", str(args.batch), "--tokens", str(args.tokens)],
                         env=env, cwd=code, check=True, capture_output=True, text=True,
                         timeout=300)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def round_trips(args: argparse.Namespace) -> None:
    codes = [("this", HERE)]
    if args.compare:
        codes.append(("compare", Path(args.compare).resolve()))
    print(f"round trips, median us of {args.trips} (a batch of {args.batch} x "
          f"{args.tokens} tokens); load average {os.getloadavg()[0]:.2f}")
    print(f"{'code':8} {'round':>5} {'echo':>8} {'empty':>8} {'match':>8} {'end':>8} "
          f"{'batch':>8} {'load':>8}")
    for round_ in range(args.rounds):
        for name, code in codes:
            r = _run_child(code, args)
            print(f"{name:8} {round_:>5} {r['echo']:8.1f} {r['empty']:8.1f} "
                  f"{r['match']:8.1f} {r['end']:8.1f} {r['batch']:8.1f} "
                  f"{r.get('load', float('nan')):8.1f}")


# ---- part 2: the split of one batch, in this process ------------------------------------


def split(args: argparse.Namespace) -> None:
    """Each stage of a batch in turn, as the two processes run them (so that each finds
    the caches as the previous stage left them), timed one by one."""
    sys.path.insert(0, str(HERE))  # this checkout's code (a child's: by its PYTHONPATH)
    import numpy as np

    import aiokv
    from aiokv.stores.shared import wire
    from aiokv.stores.shared.region import Geometry
    from aiokv.stores.shared.service import Service
    from aiokv.stores.shared.tasks import Client

    service = Service(aiokv.StoreConfig(cpu_cache_gb=0.1), lambda: None)
    service.allocate()
    geometry = Geometry.of(_caches(1))
    service.register(geometry)
    client = Client(1, os.getpid())
    tokens = np.arange(args.tokens, dtype=np.int64)
    page_size = geometry.page_size
    counts = [args.tokens] * args.batch
    stages: dict[str, list[float]] = {k: [] for k in (
        "client encode", "server decode", "server handler", "server encode",
        "client decode", "end encode", "end decode", "end handler")}
    clock = time.perf_counter
    for i in range(args.trips):
        t0 = clock()
        frame = wire.encode_match(wire.PUT, [(tokens, [f"s{i}:{u}"])
                                             for u in range(args.batch)], page_size, [])
        t1 = clock()
        request = wire.decode_match(memoryview(frame)[8:], page_size)
        t2 = clock()
        answers = service.match_many(client, True, request.queries)
        t3 = clock()
        reply = wire.encode_answers(answers)
        t4 = clock()
        got = wire.decode_answers(memoryview(reply)[8:], counts, page_size)
        t5 = clock()
        end = wire.encode_end([], [a[0] for a in got if isinstance(a[0], int)])
        t6 = clock()
        done, failed = wire.decode_end(memoryview(end)[8:])
        t7 = clock()
        service.finish(client, done, failed)
        t8 = clock()
        marks = (t0, t1, t2, t3, t4, t5, t6, t7, t8)
        for stage, begin, finish in zip(stages.values(), marks, marks[1:], strict=False):
            stage.append((finish - begin) * 1e6)
    service.close()
    print(f"\nthe split of one batch of {args.batch} put matches and its end, median us of "
          f"{args.trips} (in one process)")
    for stage, times in stages.items():
        print(f"  {stage:15} {statistics.median(times):8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", metavar="DIR", help="a checkout to alternate with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trips", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--echo", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--no-split", action="store_true", help="only the round trips")
    args = parser.parse_args()
    if args.echo:
        _echo_server(args.echo)
        return 0
    if args.child:
        _child(args)
        return 0
    round_trips(args)
    if not args.no_split:
        split(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
