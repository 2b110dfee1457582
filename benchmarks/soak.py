"""A soak with faults that must lose nothing.

Thousands of simulated users send mixed offload / lookup / load / evict requests through
``CheckingStore(FaultyStore(LocalStore))`` on CPU caches: 5% of launched tasks fail, 1%
of the calls of every store verb raise, answers come back after random delays, and 30%
of the calls are cancelled at a random moment (queued, waiting for room, matched or in
flight). Every user's KV is a function of (user, epoch, position), with distinct values
for the int user ``n`` and the str user ``"n"``, so any load that succeeds is checked bit
for bit against what that key may hold. A user's epoch goes up at each of its evicts, and
its offloads from then on write the new epoch's KV: a load must give, page by page, the KV
of an epoch no older than that of the user's last evict that returned (an evict that was
cancelled or failed may or may not have run), or miss.

It prints, and writes as JSON with ``--json PATH``: requests, resolved, failed_as_injected,
cancelled, lost (started and never resolved), leaked_tasks (store ids left open),
violations (CheckingStore), mismatches (loads not bit-exact), evicts (that returned) and
evicted_tokens, peak RSS and p50/p99 latency. A store without evict (stores/base.py:
Evicts) fails every evict with StoreError, filed under ``other_outcomes``.

    python benchmarks/soak.py                # 100,000 requests
    python benchmarks/soak.py --quick        # about 5,000, for CI

A request kind is a coroutine in ``KINDS``, with its weight in ``WEIGHTS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import sys
import threading
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv.testing import VERBS, CheckingStore, FaultyStore

LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 2, 16, 1, 8
HISTORY_PAGES = 8  # a user's history: up to this many pages
HISTORY_TOKENS = HISTORY_PAGES * PAGE_SIZE
TTL_MS = 1_000  # lookup_ttl_ms: some lookups are left to it
QUARANTINE_S = 2.0  # a slot whose call did not succeed may still be copied into or from
_EXACT = 1 << 23  # values below this are exact in float32


class BudgetSpent(Exception):
    """The soak has made all its requests."""


def user_code(user: int | str) -> int:
    """Distinct for the int n and the str "n": the soak checks that they never share."""
    return 2 * int(user) + isinstance(user, str)


def kv_of(user: int | str, pages: int, layer: int, epoch: int = 0) -> torch.Tensor:
    """The KV a user's first ``pages`` pages hold in ``layer`` in ``epoch`` (its evicts so
    far): [pages, 2, page, heads, dim]."""
    position = torch.arange(pages * PAGE_SIZE, dtype=torch.int64).view(pages, 1, PAGE_SIZE, 1, 1)
    element = torch.arange(2 * HEADS * HEAD_DIM, dtype=torch.int64).view(1, 2, 1, HEADS, HEAD_DIM)
    value = user_code(user) * 1_000_003 + epoch * 7_919 + position * 1_009 + layer * 97 + element
    return (value % _EXACT).to(torch.float32)


def pages_of_epochs(
    got: torch.Tensor, user: int | str, layer: int, epochs: range
) -> torch.Tensor:
    """Per page of ``got`` (a load's pages of ``layer``): whether it holds the KV of one of
    ``epochs``."""
    pages = got.shape[0]
    match = torch.zeros(pages, dtype=torch.bool)
    for epoch in epochs:
        same = got == kv_of(user, pages, layer, epoch)
        match |= same.view(pages, -1).all(dim=1)
    return match


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.slots = args.slots
        self.caches = [
            torch.zeros(self.slots * HISTORY_PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM)
            for _ in range(LAYERS)
        ]
        block_bytes = LAYERS * self.caches[0][0].numel() * 4
        # Room for about half of all keys' full histories: hits, misses and eviction.
        store_gb = args.users * HISTORY_PAGES * block_bytes / 2 / (1 << 30)
        self.faulty = FaultyStore(
            aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=store_gb)),
            seed=args.seed,
            fail_rate=args.fail_rate,
            error_rate=args.error_rate,
            error_verbs=args.error_verbs,
            delay_s=args.delay_ms / 1e3,
            call_delay_s=args.call_delay_us / 1e6,
        )
        self.checked = CheckingStore(self.faulty, loop_thread=threading.get_ident())
        self.engine = aiokv.OffloadEngine(self.checked, self.caches, aiokv.EngineConfig(
            window_us=200, max_batch_requests=64, max_pending=args.max_pending,
            overload="wait", request_timeout_ms=args.request_timeout_ms, lookup_ttl_ms=TTL_MS,
        ))
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(self.slots):
            self.free.put_nowait(slot)
        self.quarantined: deque[tuple[float, int]] = deque()
        self.budget = args.requests  # requests not yet started
        self.started = 0
        self.open: set[int] = set()  # started requests not yet resolved
        self.outcomes: Counter[str] = Counter()
        self.latencies_s: list[float] = []
        self.loads_checked = 0
        # Per user: (the epoch of its last evict that returned, its epoch now).
        self.epochs: dict[int | str, tuple[int, int]] = {}
        self.evicts = 0
        self.evicted_tokens = 0
        self.mismatches: list[str] = []
        self.loop_errors: list[str] = []

    def pages(self, slot: int, count: int) -> torch.Tensor:
        return torch.arange(slot * HISTORY_PAGES, slot * HISTORY_PAGES + count)

    async def call(self, kind: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """Make and await one engine call and file its outcome (re-raising what it
        raised). Raises BudgetSpent once the soak's requests have all been made."""
        if self.budget <= 0:
            raise BudgetSpent
        self.budget -= 1
        awaitable = make()
        number = self.started
        self.started += 1
        self.open.add(number)
        loop = asyncio.get_running_loop()
        begun = loop.time()
        try:
            result = await awaitable
        except asyncio.CancelledError:
            self.outcomes["cancelled"] += 1
            raise
        except aiokv.StoreError as error:
            injected = "injected" in repr(error) or "injected" in repr(error.__cause__)
            name = "failed_as_injected" if injected else f"{kind}:{type(error).__name__}"
            self.outcomes[name] += 1
            raise
        except aiokv.InvalidRequest as error:
            # A Lookup whose caller resumed after lookup_ttl_ms (a busy loop) is expired.
            expired = "expired" in str(error)
            self.outcomes[f"{kind}:{'expired' if expired else type(error).__name__}"] += 1
            raise
        except Exception as error:
            self.outcomes[f"{kind}:{type(error).__name__}"] += 1
            raise
        finally:
            self.open.discard(number)
        self.outcomes["ok"] += 1
        self.latencies_s.append(loop.time() - begun)
        return result

    async def with_slot(self, use: Callable[[int], Awaitable[None]]) -> None:
        """Run ``use`` on a free slot; a slot whose call failed is quarantined."""
        slot = await self.free.get()
        succeeded = False
        try:
            await use(slot)
            succeeded = True
        finally:
            if succeeded:
                self.free.put_nowait(slot)
            else:  # a cancelled or failed call's transfer may still run: keep off it
                self.quarantined.append((asyncio.get_running_loop().time(), slot))

    async def offload(self, user: int | str) -> None:
        pages = self.rng.randint(1, HISTORY_PAGES)
        tokens = self.rng.randint((pages - 1) * PAGE_SIZE + 1, pages * PAGE_SIZE)

        async def use(slot: int) -> None:
            target = self.pages(slot, pages)
            epoch = self.epochs.get(user, (0, 0))[1]
            for layer, cache in enumerate(self.caches):
                cache[target] = kv_of(user, pages, layer, epoch)
            await self.call("offload", lambda: self.engine.offload(user, target, tokens))

        await self.with_slot(use)

    async def lookup(self, user: int | str) -> None:
        hit = await self.call("lookup", lambda: self.engine.lookup(user, HISTORY_TOKENS))
        if self.rng.random() < 0.8:
            hit.release()  # else: left to lookup_ttl_ms

    async def load(self, user: int | str) -> None:
        async def use(slot: int) -> None:
            hit = await self.call("lookup", lambda: self.engine.lookup(user, HISTORY_TOKENS))
            if hit.cached_tokens == 0:
                return
            pages = hit.cached_tokens // PAGE_SIZE
            target = self.pages(slot, pages)
            for cache in self.caches:
                cache[target] = float("nan")
            try:
                got = await self.call("load", lambda: self.engine.load(hit, target))
            except BudgetSpent:
                hit.release()
                raise
            if got.loaded_tokens == 0:
                return  # a miss: its reservation was given back to an evict
            if got.loaded_tokens != hit.cached_tokens:
                self.mismatches.append(f"{user!r}: {got.loaded_tokens} of {hit.cached_tokens}")
            floor, epoch = self.epochs.get(user, (0, 0))
            for layer, cache in enumerate(self.caches):
                if not pages_of_epochs(cache[target], user, layer, range(floor, epoch + 1)).all():
                    self.mismatches.append(
                        f"{user!r}: layer {layer} of {pages} pages differs from epochs "
                        f"{floor}..{epoch}"
                    )
            self.loads_checked += 1

        await self.with_slot(use)

    async def evict(self, user: int | str) -> None:
        """Evict the user's key: its offloads from now on write the next epoch's KV; once
        the evict returns, no older epoch may be loaded."""
        floor, epoch = self.epochs.get(user, (0, 0))
        self.epochs[user] = (floor, epoch + 1)
        dropped = await self.call("evict", lambda: self.engine.evict(user))
        floor, now = self.epochs[user]
        self.epochs[user] = (max(floor, epoch + 1), now)
        self.evicts += 1
        self.evicted_tokens += dropped

    async def user(self, index: int) -> None:
        user: int | str = index // 2 if index % 2 == 0 else str(index // 2)
        rng = self.rng
        while self.budget > 0:
            kind = rng.choices(list(KINDS), WEIGHTS)[0]
            task = asyncio.ensure_future(KINDS[kind](self, user))
            if rng.random() < self.args.cancel_rate:
                if rng.random() < 0.5:
                    for _ in range(rng.randint(0, 6)):
                        await asyncio.sleep(0)
                else:
                    await asyncio.sleep(rng.uniform(0, 3e-3))
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this user was cancelled, not its call
            except aiokv.AiokvError:
                pass  # filed by call()
            except BudgetSpent:
                return

    async def release_quarantine(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.quarantined and self.quarantined[0][0] + QUARANTINE_S <= loop.time():
                self.free.put_nowait(self.quarantined.popleft()[1])
            await asyncio.sleep(0.05)

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: self.loop_errors.append(repr(context)))
        begun = loop.time()
        await self.engine.start()
        releaser = asyncio.ensure_future(self.release_quarantine())
        users = [asyncio.ensure_future(self.user(u)) for u in range(self.args.users)]
        # Requests still open after a stall of stall_s are lost: no timer of the engine's
        # may end them (request_timeout_ms is 0 unless asked for).
        last, stalled_at = -1, loop.time()
        while True:
            done, pending = await asyncio.wait(users, timeout=1.0)
            finished = self.started - len(self.open)
            if not pending:
                break
            if finished != last:
                last, stalled_at = finished, loop.time()
            elif loop.time() - stalled_at > self.args.stall_s:
                break
        lost = len(self.open)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # nothing unexpected escaped a user
        await asyncio.sleep(TTL_MS / 1e3 + 0.2)  # lookups left to lookup_ttl_ms expire
        open_before_close = self.engine.stats().store_tasks_open
        elapsed_s = loop.time() - begun
        await self.engine.aclose()
        releaser.cancel()
        stats = self.engine.stats()
        problems = self.checked.problems()
        latencies = np.array(self.latencies_s or [0.0]) * 1e3
        outcomes = dict(self.outcomes)
        return {
            "requests": self.started,
            "resolved": self.started - lost,
            "ok": outcomes.pop("ok", 0),
            "failed_as_injected": outcomes.pop("failed_as_injected", 0),
            "cancelled": outcomes.pop("cancelled", 0),
            "other_outcomes": outcomes,
            "lost": lost,
            "leaked_tasks": max(open_before_close, stats.store_tasks_open)
            + len(problems) - len(self.checked.violations),
            "violations": len(self.checked.violations),
            "problems": problems[:20],
            "mismatches": len(self.mismatches),
            "mismatch_examples": self.mismatches[:10],
            "loads_checked": self.loads_checked,
            "evicts": self.evicts,
            "evicted_tokens": self.evicted_tokens,
            "loop_errors": self.loop_errors[:10],
            "injected": dict(self.faulty.injected),
            "engine": {k: getattr(stats, k) for k in (
                "submitted", "completed", "failed", "cancelled", "timed_out", "pending",
                "batches", "store_tasks_open")},
            "users": self.args.users,
            "elapsed_s": round(elapsed_s, 2),
            "requests_per_s": round(self.started / elapsed_s),
            "latency_p50_ms": round(float(np.percentile(latencies, 50)), 3),
            "latency_p99_ms": round(float(np.percentile(latencies, 99)), 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }


KINDS: dict[str, Callable[[Soak, int | str], Awaitable[None]]] = {
    "offload": Soak.offload,
    "lookup": Soak.lookup,
    "load": Soak.load,
    "evict": Soak.evict,
}
WEIGHTS = [0.38, 0.19, 0.38, 0.05]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 5,000 requests, for CI")
    parser.add_argument("--requests", type=int, default=None, help="default 100000 (quick 5000)")
    parser.add_argument("--users", type=int, default=None, help="default 4000 (quick 1000)")
    parser.add_argument("--slots", type=int, default=1024, help="users' page sets in the caches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-rate", type=float, default=0.05, help="launched tasks that fail")
    parser.add_argument("--error-rate", type=float, default=0.01, help="store calls that raise")
    parser.add_argument("--error-verbs", default=",".join(VERBS), help="verbs that may raise")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="max delay of an answer")
    parser.add_argument("--call-delay-us", type=float, default=20.0, help="max delay of a call")
    parser.add_argument("--cancel-rate", type=float, default=0.3, help="calls cancelled")
    parser.add_argument("--max-pending", type=int, default=1024)
    parser.add_argument("--request-timeout-ms", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=30.0, help="no progress this long: stop")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    args.requests = args.requests or (5_000 if args.quick else 100_000)
    args.users = args.users or (1_000 if args.quick else 4_000)
    args.error_verbs = [verb for verb in args.error_verbs.split(",") if verb]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    logged: Counter[str] = Counter()  # the engine logs store failures; count, don't print

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged[record.levelname] += 1

    log = logging.getLogger("aiokv")
    log.addHandler(Count())
    log.propagate = False
    torch.set_num_threads(1)
    if args.loop == "uvloop":
        import uvloop

        report = uvloop.run(Soak(args).run())
    else:
        report = asyncio.run(Soak(args).run())
    report["logged"] = dict(logged)
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    for key, value in report.items():
        if key != "args":
            print(f"{key:>20}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    figures = main()
    sys.exit(0 if figures["lost"] == figures["leaked_tasks"] == figures["violations"]
             == figures["mismatches"] == 0 else 1)
