"""A soak of the shared tier: many engine processes on one ``aiokv store-server``, users
landing on any of them, evicts racing loads, engines and the server killed and restarted.

One ``aiokv store-server`` (a small host tier over an SSD tier, so that pages go down to
SSD and come back) and ``--engines`` engine processes on ``store.backend: shared``. This
process drives them: each request goes to a random engine over a pipe, many at once.
Kinds: offload a user's history (1-8 pages); look it up, sometimes hold the Lookup a
while, then load it; evict the user. Every value a user's page holds encodes the user,
the page, the layer and the user's epoch (its evicts so far, counted here), so every load
is checked page by page: each page must be exactly some epoch's KV, and once an evict of
the user has returned, a load called after it must give an epoch past that evict, or 0
tokens (``t_load`` and ``t_evicted`` are CLOCK_MONOTONIC, one clock for every process of
the host). An offload and an evict of one user never run at once (an offload racing an
evict may land on either side of it, which the epochs could not tell apart); loads race
both. With ``--kill-every S`` an engine is killed (SIGKILL) and replaced every S seconds;
with ``--restart-every S`` the server is: what the SSD tier kept comes back, what an evict
dropped must not. With ``--remote`` the server has a Mooncake tier below its SSD tier (a
master and a store process started here), which outlives its restarts: a restarted
server's misses read from it, and an evict must hide the user there too.

It prints, and writes with ``--json PATH``: requests, outcomes by kind, loads checked,
stale loads (an epoch an evict had dropped), corrupt loads (a page no epoch's KV),
unanswered requests (not counting those of killed engines), and the server's open tasks
once the engines are gone.

    python benchmarks/shared_soak.py [--engines 3] [--seconds 60] [--users 32] [--clients 64]
        [--kill-every 0] [--restart-every 0] [--min-loads 0] [--min-evicts 0] [--remote]
        [--json PATH]
    python benchmarks/shared_soak.py --quick   # about 14 s with faults, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS, PAGE, HEADS, DIM = 2, 16, 1, 8
MAX_PAGES = 8  # a user's history: 1 to this many pages
SLOTS = 24  # an engine's page sets (each MAX_PAGES pages) in its caches
EPOCH_UNIT = 1 << 14  # a value is epoch * EPOCH_UNIT + its content: exact in float32 (< 2**24)
_CONTEXT = multiprocessing.get_context("spawn")


def kv(user: int, pages: int, epoch: int) -> list[Any]:
    """The user's first ``pages`` pages in ``epoch``, per layer: [pages, 2, PAGE, HEADS, DIM]."""
    import torch

    page = torch.arange(pages).view(pages, 1, 1, 1, 1)
    element = torch.arange(2 * PAGE * HEADS * DIM).view(1, 2, PAGE, HEADS, DIM)
    return [(epoch * EPOCH_UNIT + (user * 131 + page * 1009 + layer * 7 + element)
             % EPOCH_UNIT).to(torch.float32) for layer in range(LAYERS)]


def epochs_of(user: int, got: list[Any]) -> list[int]:
    """Per page of a load, the epoch whose KV it holds exactly; -1 for none."""
    import torch

    pages = got[0].shape[0]
    first = [int(value) // EPOCH_UNIT for value in got[0][:, 0, 0, 0, 0].tolist()]
    out = []
    for index, epoch in enumerate(first):
        want = kv(user, pages, epoch)
        same = all(torch.equal(layer[index], expect[index])
                   for layer, expect in zip(got, want, strict=True))
        out.append(epoch if same else -1)
    return out


# ---- an engine process ------------------------------------------------------------------


def engine_main(socket_path: str, conn: multiprocessing.connection.Connection) -> None:
    import uvloop

    uvloop.run(_engine(socket_path, conn))


async def _engine(socket_path: str, conn: multiprocessing.connection.Connection) -> None:
    import torch

    import aiokv

    caches = [torch.zeros(SLOTS * MAX_PAGES, 2, PAGE, HEADS, DIM) for _ in range(LAYERS)]
    engine = aiokv.open_engine({"store": {"backend": "shared", "socket": socket_path},
                                "engine": {"request_timeout_ms": 20_000}}, kv_caches=caches)
    await engine.start()
    loop = asyncio.get_running_loop()
    free: asyncio.Queue[int] = asyncio.Queue()
    for slot in range(SLOTS):
        free.put_nowait(slot)

    def pages_of(slot: int, count: int) -> Any:
        return torch.arange(slot * MAX_PAGES, slot * MAX_PAGES + count)

    async def run(request: dict[str, Any]) -> dict[str, Any]:
        kind, user = request["kind"], request["user"]
        if kind == "evict":
            dropped = await engine.evict(user)
            return {"dropped": dropped, "t_evicted": time.monotonic()}
        slot = await free.get()
        ok = False
        try:
            if kind == "offload":
                pages = request["pages"]
                target = pages_of(slot, pages)
                for cache, data in zip(caches, kv(user, pages, request["epoch"]), strict=True):
                    cache[target] = data
                got = await engine.offload(user, target, pages * PAGE)
                ok = True
                return {"stored": got.stored_tokens}
            hit = await engine.lookup(user, MAX_PAGES * PAGE)
            if hit.cached_tokens == 0:
                hit.release()
                ok = True
                return {"loaded": 0}
            if request["hold_s"]:
                await asyncio.sleep(request["hold_s"])  # evicts may run meanwhile
            target = pages_of(slot, hit.cached_tokens // PAGE)
            for cache in caches:
                cache[target] = float("nan")
            t_load = time.monotonic()
            loaded = (await engine.load(hit, target)).loaded_tokens
            ok = True
            full = target[: loaded // PAGE]
            return {"loaded": loaded, "t_load": t_load,
                    "epochs": epochs_of(user, [cache[full] for cache in caches])}
        finally:
            if ok:
                free.put_nowait(slot)
            else:  # a failed call's copy may still land in the slot: keep off it a while
                loop.call_later(2.0, free.put_nowait, slot)

    async def answer(request: dict[str, Any]) -> None:
        try:
            reply = {"id": request["id"], **await run(request)}
        except aiokv.AiokvError as exc:
            reply = {"id": request["id"], "error": type(exc).__name__}
        conn.send(reply)

    tasks: set[asyncio.Task[None]] = set()
    conn.send({"ready": True})
    while True:
        request = await loop.run_in_executor(None, conn.recv)
        if request is None:
            break
        task = asyncio.ensure_future(answer(request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.aclose()
    conn.send({"closed": True})


# ---- the driver -------------------------------------------------------------------------


class Engine:
    """An engine process and its requests in flight (id -> future)."""

    def __init__(self, socket_path: Path) -> None:
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=engine_main, args=(str(socket_path), child),
                                        daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(120) or "ready" not in self.conn.recv():
            raise RuntimeError("an engine process did not start")
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.reader: asyncio.Future[None] | None = None

    @classmethod
    async def start(cls, socket_path: Path) -> Engine:
        engine = await asyncio.to_thread(cls, socket_path)  # its start-up takes seconds
        engine.reader = asyncio.ensure_future(engine._read())
        return engine

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                reply = await loop.run_in_executor(None, self.conn.recv)
            except (EOFError, OSError):
                break
            if "closed" in reply:
                break
            future = self.waiting.pop(reply["id"], None)
            if future is not None and not future.done():
                future.set_result(reply)
        for future in self.waiting.values():  # killed: its requests end with it
            if not future.done():
                future.set_result({"error": "engine killed"})
        self.waiting.clear()

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[request["id"]] = future
        try:
            self.conn.send(request)
        except OSError:  # killed meanwhile
            self.waiting.pop(request["id"], None)
            return {"error": "engine killed"}
        return await future

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    async def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            if self.reader is not None:
                await asyncio.wait_for(self.reader, 60)
            self.process.join(30)
        if self.process.is_alive():
            self.kill()


class Server:
    def __init__(self, root: Path, host_mb: float, ssd_mb: float,
                 remote: str | None = None) -> None:
        self.socket = root / "run" / "store.sock"
        (root / "ssd").mkdir()
        self.config = root / "server.yml"
        store: dict[str, Any] = {"cpu_cache_gb": host_mb / 1024, "ssd_cache_gb": ssd_mb / 1024,
                                 "ssd_cache_dir": str(root / "ssd")}
        if remote is not None:
            store["remote"] = {"master": remote, "timeout_ms": 1000}
        self.config.write_text(json.dumps({"store": store}))
        self.log = root / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        starts = self._starts()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "aiokv", "store-server", "--socket", str(self.socket),
                 "--config", str(self.config)], stderr=log)
        while self._starts() == starts:
            if self.process.poll() is not None:
                raise RuntimeError("store-server exited: " + self.log.read_text()[-2000:])
            time.sleep(0.05)  # waiting for its start-up line

    def _starts(self) -> int:
        return self.log.read_bytes().count(b"listening on") if self.log.exists() else 0

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path, remote: str | None = None) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.server = Server(root, args.host_mb, args.ssd_mb, remote)
        self.engines: list[Engine] = []
        self.epoch = [0] * args.users  # offloads write this epoch's KV
        self.locks = [asyncio.Lock() for _ in range(args.users)]  # offload vs evict
        self.evicts: list[tuple[int, int, float]] = []  # user, epoch dropped, when returned
        self.loads: list[tuple[int, dict[str, Any]]] = []
        self.outcomes: Counter[str] = Counter()
        self.ids = 0
        self.open = 0
        self.lives: list[dict[str, Any]] = []  # the server's figures before each restart
        self.faulted = False  # every fault asked for came at least once (faults())

    async def request(self, kind: str, user: int, **fields: Any) -> dict[str, Any]:
        self.ids += 1
        self.open += 1
        try:
            engine = self.rng.choice(self.engines)
            reply = await engine.call({"id": self.ids, "kind": kind, "user": user, **fields})
        finally:
            self.open -= 1
        self.outcomes[f"{kind}:{reply.get('error', 'ok')}"] += 1
        return reply

    def going(self, until: float) -> bool:
        """Whether the callers go on: until ``until``, every fault asked for and the
        loads checked and evicts returned that were asked for (--min-loads,
        --min-evicts), whichever comes last: a slow box runs longer rather than check
        less."""
        return (time.monotonic() < until or not self.faulted
                or len(self.loads) < self.args.min_loads
                or self.outcomes["evict:ok"] < self.args.min_evicts)

    async def client(self, until: float) -> None:
        """One caller: a request at a time, each for a random user (so that one user's
        loads race its evicts from other callers)."""
        rng = self.rng
        while self.going(until):
            user = rng.randrange(self.args.users)
            kind = rng.choices(("offload", "load", "evict"), (0.4, 0.5, 0.1))[0]
            if kind == "load":
                hold = rng.choice((0.0, 0.0, 0.05, 0.3))
                reply = await self.request("load", user, hold_s=hold)
                if "epochs" in reply and reply["loaded"]:
                    self.loads.append((user, reply))
                continue
            async with self.locks[user]:
                if kind == "offload":
                    await self.request("offload", user, epoch=self.epoch[user],
                                       pages=rng.randint(1, MAX_PAGES))
                else:
                    dropped = self.epoch[user]
                    self.epoch[user] += 1  # offloads from now on write the next epoch
                    reply = await self.request("evict", user)
                    if "t_evicted" in reply:
                        self.evicts.append((user, dropped, reply["t_evicted"]))

    async def faults(self, until: float) -> None:
        args, next_kill, next_restart = self.args, 0.0, 0.0
        begun = time.monotonic()
        if args.kill_every:
            next_kill = begun + args.kill_every
        if args.restart_every:
            next_restart = begun + args.restart_every
        report = begun + 5
        # Each fault asked for comes at least once, the callers going on until it did: on
        # a starved box an engine's restart (its imports) can take past the run's end.
        self.faulted = not (next_kill or next_restart)
        while time.monotonic() < until or not self.faulted:
            self.faulted = ((not next_kill or self.outcomes["engines_killed"] > 0)
                            and (not next_restart or self.outcomes["server_restarts"] > 0))
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if now >= report:  # progress, for a run by hand that seems stuck
                print(f"{now - begun:5.0f} s: {sum(self.outcomes.values())} answers, "
                      f"{self.open} open", file=sys.stderr, flush=True)
                report = now + 5
            if next_kill and now >= next_kill:
                victim = self.engines.pop(self.rng.randrange(len(self.engines)))
                victim.kill()  # its requests in flight end with "engine killed"
                self.outcomes["engines_killed"] += 1
                self.engines.append(await Engine.start(self.server.socket))
                next_kill = now + args.kill_every
            if next_restart and now >= next_restart:
                # Its figures die with it: kept, so that totals cover every start.
                self.lives.append(await asyncio.to_thread(self.figures))
                self.server.kill()
                await asyncio.sleep(0.3)  # engines' calls meanwhile fail fast
                await asyncio.to_thread(self.server.start)
                self.outcomes["server_restarts"] += 1
                next_restart = now + args.restart_every

    def check(self) -> dict[str, Any]:
        """Every load's pages against the evicts that returned before it was called."""
        dropped_before: dict[int, list[tuple[float, int]]] = {}
        for user, epoch, when in self.evicts:
            dropped_before.setdefault(user, []).append((when, epoch))
        stale, corrupt, examples = 0, 0, []
        for user, reply in self.loads:
            epochs = reply["epochs"]
            floor = max((e + 1 for when, e in dropped_before.get(user, ())
                         if when < reply["t_load"]), default=0)
            if min(epochs) < 0:
                corrupt += 1
                examples.append(f"user {user}: a page of no epoch's KV: {epochs}")
            elif min(epochs) < floor:
                stale += 1
                examples.append(f"user {user}: epochs {epochs} loaded after the evict of "
                                f"epoch {floor - 1} returned")
            elif max(epochs) > self.epoch[user]:
                corrupt += 1
                examples.append(f"user {user}: epoch {max(epochs)} never written")
        return {"loads_checked": len(self.loads), "stale_loads": stale,
                "corrupt_loads": corrupt, "examples": examples[:10]}

    async def run(self) -> dict[str, Any]:
        args = self.args
        self.server.start()
        # Started together: their imports (python, torch: seconds each) overlap.
        self.engines = list(await asyncio.gather(
            *(Engine.start(self.server.socket) for _ in range(args.engines))))
        begun = time.monotonic()
        until = begun + args.seconds
        users = [asyncio.ensure_future(self.client(until)) for _ in range(args.clients)]
        faults = asyncio.ensure_future(self.faults(until))
        done, pending = await asyncio.wait(users, timeout=args.seconds + 120)
        unanswered = self.open
        for task in pending:
            task.cancel()
        await faults
        for task in done:
            task.result()
        for engine in self.engines:
            await engine.close()
        stats = await asyncio.to_thread(self.figures)
        self.server.kill()
        requests = sum(v for k, v in self.outcomes.items() if ":" in k)
        return {"engines": args.engines, "users": args.users, "clients": args.clients,
                "seconds": args.seconds,
                "requests": requests, "outcomes": dict(sorted(self.outcomes.items())),
                "unanswered": unanswered, "evicts_returned": len(self.evicts), **self.check(),
                "server_after": stats,
                "server_gets_invalidated_total": sum(
                    life.get("server_gets_invalidated", 0) for life in [*self.lives, stats]),
                "elapsed_s": round(time.monotonic() - begun, 1)}

    def figures(self) -> dict[str, Any]:
        """The server's open tasks and held blocks once every engine has gone."""
        import aiokv
        from aiokv.stores.shared import SharedStore

        store = SharedStore(aiokv.StoreConfig(backend="shared", socket=str(self.server.socket)))
        import torch

        store.register([torch.zeros(1, 2, PAGE, HEADS, DIM) for _ in range(LAYERS)])
        try:
            stats = store.store_stats()
        finally:
            store.close()
        keys = ("server_tasks_open", "server_blocks_held", "server_gets_invalidated",
                "host_blocks_used", "ssd_hit_tokens",
                # since the server's last start; with --remote only
                "remote_hit_tokens", "remote_blocks_written", "remote_blocks_read",
                "remote_dropped_writes", "remote_timeouts")
        return {k: stats[k] for k in keys if k in stats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--clients", type=int, default=64, help="callers at once")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--host-mb", type=float, default=0.25, help="the server's host tier")
    parser.add_argument("--ssd-mb", type=float, default=8.0, help="its SSD tier")
    parser.add_argument("--kill-every", type=float, default=0.0, help="seconds; 0: never")
    parser.add_argument("--restart-every", type=float, default=0.0, help="seconds; 0: never")
    parser.add_argument("--min-loads", type=int, default=0,
                        help="the callers go on past --seconds until this many loads are "
                             "checked")
    parser.add_argument("--min-evicts", type=int, default=0,
                        help="and until this many evicts have returned")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="9 s, 2 engines, one killed every 4 s, the server every 6 s; "
                             "600 loads checked and 120 evicts returned at least")
    parser.add_argument("--remote", action="store_true",
                        help="the server with a Mooncake tier below (a master and a store "
                             "process started here): what a restart lost comes back from it")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.engines, args.kill_every, args.restart_every = 9.0, 2, 4.0, 6.0
        args.min_loads, args.min_evicts = 600, 120
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="aiokv-shared-soak-"))
        master = None
        if args.remote:
            from aiokv.remote.servers import MooncakeServers
            master = stack.enter_context(MooncakeServers(segment_mb=256)).master
        figures = asyncio.run(Soak(args, Path(directory), master).run())
        figures["remote"] = bool(args.remote)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    bad = figures["stale_loads"] or figures["corrupt_loads"] or figures["unanswered"]
    return 1 if bad or figures["server_after"]["server_tasks_open"] else 0


if __name__ == "__main__":
    sys.exit(main())
