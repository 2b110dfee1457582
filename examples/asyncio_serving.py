"""A recommender-style serving loop on aiokv, for many users at once.

Each request of a user extends that user's history (an append-only sequence of tokens,
so token ids are positions and aiokv's default key fits) and runs one step:

    lookup  -> how much of the history the store still holds (a reservation)
    allocate pages for the whole history from a shared pool of GPU pages
    load    -> the cached prefix into the new pages
    compute -> the KV of every token not loaded (here: deterministic random KV)
    offload -> the history's full pages, for the user's next request
    free the pages

Every load is checked bit for bit: a page's KV is a function of (user, page index), so
what came back must equal what was computed when it was written. The web examples
(fastapi_app.py, aiohttp_app.py) serve the same step over HTTP.

    python examples/asyncio_serving.py [--users 64] [--steps 6]

Runs on the CPU (or a GPU if there is one) in seconds; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any

import torch

import aiokv

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 4, 512, 16, 2, 32
# Small enough for any CI machine: older histories get evicted and are computed again.
CONFIG = {"engine": {"window_us": 500}, "store": {"cpu_cache_gb": 0.05}}


def page_kv(user: Hashable, index: int, device: torch.device) -> torch.Tensor:
    """The KV of a user's page ``index`` for every layer: [layers, 2, page, heads, dim].
    Deterministic, so a loaded page can be checked against a recomputation."""
    generator = torch.Generator().manual_seed(hash((user, index)) & 0x7FFF_FFFF)
    shape = (LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(device)


class PagePool:
    """The GPU pages of the caches, handed out to requests and given back."""

    def __init__(self, pages: int) -> None:
        self.size = pages
        self._free = list(range(pages))
        self._changed = asyncio.Condition()

    async def take(self, count: int) -> list[int]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._free) >= count)
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    async def give_back(self, pages: list[int]) -> None:
        async with self._changed:
            self._free.extend(pages)
            self._changed.notify_all()


@dataclass
class StepResult:
    history_tokens: int  # after this step
    loaded_tokens: int  # came back from the store
    computed_tokens: int  # computed again (new, or evicted from the store)
    stored_tokens: int  # newly written to the store
    verified: bool  # the loaded pages equal their KV bit for bit


class Recommender:
    """Users' histories over one engine: the serving side of the example."""

    def __init__(self, engine: aiokv.OffloadEngine, kv_caches: list[torch.Tensor]) -> None:
        self.engine = engine
        self.caches = kv_caches
        self.device = kv_caches[0].device
        self.pool = PagePool(kv_caches[0].shape[0])
        self.histories: dict[Hashable, int] = {}
        self._locks: dict[Hashable, asyncio.Lock] = {}  # one step of a user at a time

    async def cached(self, user: Hashable, num_tokens: int) -> int:
        """How many of the user's first ``num_tokens`` tokens the store holds."""
        async with await self.engine.lookup(user, num_tokens) as hit:
            return hit.cached_tokens

    async def step(self, user: Hashable, new_tokens: int) -> StepResult:
        if new_tokens < 1:
            raise aiokv.InvalidRequest("new_tokens", f"must be >= 1, got {new_tokens}")
        async with self._locks.setdefault(user, asyncio.Lock()):
            history = self.histories.get(user, 0)
            total = history + new_tokens
            needed = -(-total // PAGE_SIZE)
            if needed > self.pool.size:
                raise aiokv.InvalidRequest(
                    "new_tokens", f"a history of {total} tokens would not fit in the caches"
                )
            async with await self.engine.lookup(user, history) as hit:  # reserved till load
                pages = await self.pool.take(needed)
                try:
                    result = await self._step(user, hit, total, pages)
                finally:
                    await self.pool.give_back(pages)
            self.histories[user] = total
            return result

    async def _step(
        self, user: Hashable, hit: aiokv.Lookup, total: int, pages: list[int]
    ) -> StepResult:
        page_ids = torch.tensor(pages, device=self.device)
        loaded = (await self.engine.load(hit, page_ids)).loaded_tokens
        full = loaded // PAGE_SIZE
        verified = all(self._page_is(user, i, pages[i]) for i in range(full))
        for i in range(full, len(pages)):  # "compute": the KV of what was not loaded
            kv = page_kv(user, i, self.device)
            for layer, cache in enumerate(self.caches):
                cache[pages[i]] = kv[layer]
        stored = await self.engine.offload(user, page_ids, total)
        return StepResult(total, loaded, total - full * PAGE_SIZE, stored.stored_tokens, verified)

    def _page_is(self, user: Hashable, index: int, page: int) -> bool:
        kv = page_kv(user, index, self.device)
        return all(torch.equal(cache[page], kv[layer]) for layer, cache in enumerate(self.caches))


def make_caches() -> list[torch.Tensor]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device) for _ in range(LAYERS)]


# How the web examples answer an aiokv error: the most specific class first.
HTTP_STATUS: list[tuple[type[aiokv.AiokvError], int]] = [
    (aiokv.InvalidRequest, 422),  # the caller's request is malformed
    (aiokv.Overloaded, 503),  # max_pending reached: retry later
    (aiokv.EngineClosed, 503),  # starting up or shutting down
    (aiokv.RequestTimeout, 504),
    (aiokv.StoreFull, 507),  # nothing could be reserved for new pages
    (aiokv.AiokvError, 500),  # StoreError, ConfigError: the server's fault
]


def http_status(error: aiokv.AiokvError) -> int:
    return next(status for kind, status in HTTP_STATUS if isinstance(error, kind))


def error_body(error: aiokv.AiokvError) -> dict[str, str]:
    return {"error": type(error).__name__, "detail": str(error)}


Call = Callable[[str, str], Awaitable[tuple[int, Any]]]


async def exercise(call: Call, users: int = 8, steps: int = 3) -> list[str]:
    """Drive a running web example through ``call(method, path) -> (status, json)``;
    returns what went wrong (empty: nothing). Used by the examples' --self-test."""
    problems: list[str] = []

    async def user_steps(user: int) -> None:
        history = 0
        for step in range(steps):
            status, body = await call("POST", f"/users/{user}/step?new_tokens=40")
            expected_load = history // PAGE_SIZE * PAGE_SIZE  # nothing evicted at this size
            history += 40
            if status != 200 or not body["verified"] or body["history_tokens"] != history:
                problems.append(f"user {user} step {step}: {status} {body}")
            elif body["loaded_tokens"] != expected_load:
                problems.append(f"user {user} step {step}: loaded {body['loaded_tokens']}")

    await asyncio.gather(*(user_steps(u) for u in range(users)))
    status, body = await call("GET", f"/users/0/cached?num_tokens={40 * steps}")
    if (status, body.get("cached_tokens")) != (200, 40 * steps // PAGE_SIZE * PAGE_SIZE):
        problems.append(f"cached: {status} {body}")
    status, body = await call("GET", "/users/0/cached?num_tokens=-5")
    if (status, body.get("error")) != (422, "InvalidRequest") or "num_tokens" not in body["detail"]:
        problems.append(f"a bad num_tokens: {status} {body}")
    # Sizes no store could answer fail at once, naming the bound (an int above it), or
    # the field (not an int: the framework's own 422 where it parses the query).
    for huge in ("300000000", "1000000000000", "1e12"):
        status, body = await call("GET", f"/users/0/cached?num_tokens={huge}")
        bound = "max_lookup_tokens" if huge.isdigit() else "num_tokens"
        if status != 422 or "num_tokens" not in str(body) or bound not in str(body):
            problems.append(f"num_tokens={huge}: {status} {body}")
    status, body = await call("GET", "/stats")
    if status != 200 or body["completed"] < users * steps * 2:
        problems.append(f"stats: {status} {body}")
    return problems


def free_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, held from here on: no race for it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def report(app: str, port: int, problems: list[str]) -> int:
    for problem in problems:
        print("FAILED:", problem)
    print(f"{app} self-test on port {port}: {'ok' if not problems else 'failed'}")
    return 1 if problems else 0


def web_main(
    doc: str,
    self_test: Callable[[], Coroutine[Any, Any, int]],
    serve: Callable[[int], None],
    port: int,
) -> int:
    """The web examples' command line: serve on 127.0.0.1, or --self-test."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--self-test", action="store_true", help="serve, drive, check, exit")
    parser.add_argument("--port", type=int, default=port)
    args = parser.parse_args()
    if args.self_test:
        return asyncio.run(self_test())
    serve(args.port)
    return 0


async def serve(users: int, steps: int, seed: int) -> int:
    caches = make_caches()
    engine = aiokv.open_engine(CONFIG, kv_caches=caches)
    rng = random.Random(seed)
    async with engine:
        app = Recommender(engine, caches)

        async def session(user: int) -> list[StepResult]:
            return [await app.step(user, rng.randint(5, 60)) for _ in range(steps)]

        sessions = await asyncio.gather(*(session(u) for u in range(users)))
        stats = engine.stats()
    results = [r for s in sessions for r in s]
    loaded = sum(r.loaded_tokens for r in results)
    computed = sum(r.computed_tokens for r in results)
    bad = sum(not r.verified for r in results)
    print(
        f"{len(results)} steps of {users} users: {loaded} tokens loaded, {computed} computed, "
        f"{bad} mismatched; {stats.batches} batches for {stats.completed} calls "
        f"(mean {stats.mean_batch_requests:.1f} a batch)"
    )
    return 1 if bad or stats.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return asyncio.run(serve(args.users, args.steps, args.seed))


if __name__ == "__main__":
    sys.exit(main())
