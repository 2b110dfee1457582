"""The newcomer's serving loop (issue 29): every user on SSD, a host tier far smaller.

300 users each offload a 128-token history (8 pages of 16 tokens), far more than a 31 MiB
host tier holds, over an SSD tier that holds everyone. Then a serving loop runs
``--concurrency`` users at a time (all 300 by default), 4 requests per user (1,200 loads),
each as examples/asyncio_serving.py serves one: lookup the history, take GPU pages (1,024
in all: 128 users' worth, so most Lookups are held while their users wait for pages), load
into them, check every loaded page bit for bit against the KV it was written with,
offload the history again (nothing new: a no-op put), give the pages back. Run once per
SSD write policy.

It prints, per policy: the hit ratio (lookup_hit_tokens / lookup_tokens, must be >= 0.9),
short loads (a load that brought fewer tokens than its Lookup reported, must be 0),
mismatches (a loaded page not bit for bit what was offloaded, must be 0), the engine's
stage_waits and space_waits, lookup-to-loaded latency and the wall time. Exits 1 when a
target is missed.

    python benchmarks/newcomer_serving.py [--policy write_back] [--out DIR]

CPU caches (or a GPU if there is one); a temporary SSD directory. About 10-30 s a policy
on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

import torch

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from asyncio_serving import PagePool  # the example's pool of GPU pages

import aiokv

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 4, 1024, 16, 2, 32  # float32: 32 KiB a page
USERS, HISTORY_PAGES, STEPS = 300, 8, 4
HISTORY = HISTORY_PAGES * PAGE_SIZE  # 128 tokens
HOST_MIB = 31
PAGE_BYTES = LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * 4
SSD_GIB = 2 * USERS * HISTORY_PAGES * PAGE_BYTES / (1 << 30)  # everyone, twice over


def page_kv(user: int, index: int) -> torch.Tensor:
    """User ``user``'s page ``index`` for every layer: a function of both alone."""
    generator = torch.Generator().manual_seed(user * 1000 + index)
    return torch.randn(LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM, generator=generator)


async def run(policy: str, concurrency: int, ssd_dir: str) -> dict[str, float]:
    caches = [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    config = {
        "engine": {"window_us": 500},
        "store": {"cpu_cache_gb": HOST_MIB / 1024, "ssd_cache_gb": SSD_GIB,
                  "ssd_cache_dir": ssd_dir, "ssd_write_policy": policy},
    }
    pages = PagePool(PAGES)
    counts = {"loads": 0, "short_loads": 0, "mismatches": 0}
    latencies_s: list[float] = []  # per served request: lookup to loaded

    def write(user: int, taken: list[int]) -> None:
        for i, page in enumerate(taken):
            kv = page_kv(user, i)
            for layer, cache in enumerate(caches):
                cache[page] = kv[layer]

    def intact(user: int, taken: list[int], loaded_pages: int) -> bool:
        return all(
            torch.equal(cache[taken[i]], page_kv(user, i)[layer])
            for i in range(loaded_pages)
            for layer, cache in enumerate(caches)
        )

    async def offload(engine: aiokv.OffloadEngine, user: int) -> None:
        taken = await pages.take(HISTORY_PAGES)
        try:
            write(user, taken)
            await engine.offload(user, torch.tensor(taken), HISTORY)
        finally:
            await pages.give_back(taken)

    async def serve(engine: aiokv.OffloadEngine, user: int) -> None:
        start = time.perf_counter()
        async with await engine.lookup(user, HISTORY) as hit:
            taken = await pages.take(HISTORY_PAGES)
            try:
                for cache in caches:
                    cache[taken] = float("nan")  # what a load leaves unwritten shows
                loaded = (await engine.load(hit, torch.tensor(taken))).loaded_tokens
                counts["loads"] += 1
                latencies_s.append(time.perf_counter() - start)
                counts["short_loads"] += loaded < hit.cached_tokens
                if not intact(user, taken, loaded // PAGE_SIZE):
                    counts["mismatches"] += 1
                write(user, taken)  # "compute" what was not loaded
                await engine.offload(user, torch.tensor(taken), HISTORY)
            finally:
                await pages.give_back(taken)

    async with aiokv.open_engine(config, kv_caches=caches) as engine:
        sem = asyncio.Semaphore(concurrency)

        async def bounded(job: Awaitable[None]) -> None:
            async with sem:
                await job

        await asyncio.gather(*(bounded(offload(engine, u)) for u in range(USERS)))
        before = engine.stats()
        order = [u for _ in range(STEPS) for u in random.Random(7).sample(range(USERS), USERS)]
        start = time.perf_counter()
        await asyncio.gather(*(bounded(serve(engine, u)) for u in order))
        wall_s = time.perf_counter() - start
        after = engine.stats()
    asked = after.lookup_tokens - before.lookup_tokens
    hits = after.lookup_hit_tokens - before.lookup_hit_tokens
    return {
        "hit_ratio": hits / asked if asked else 0.0,
        **counts,
        # (getattr: the same loop runs against an aiokv without the counter, for a baseline)
        "stage_waits": getattr(after, "stage_waits", 0) - getattr(before, "stage_waits", 0),
        "space_waits": after.space_waits - before.space_waits,
        "wall_s": wall_s,
        "p50_ms": statistics.median(latencies_s) * 1e3,
        "max_ms": max(latencies_s) * 1e3,
    }


def _commit() -> str:
    """The checkout's commit, for the raw output's first line."""
    root = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=("write_back", "write_through"), action="append")
    parser.add_argument("--concurrency", type=int, default=USERS, help="users served at once")
    parser.add_argument("--out", type=Path, help="also write each policy's lines to "
                        "DIR/newcomer_serving_<label>_<policy>.txt")
    parser.add_argument("--label", default="cpu", help="the machine, in the file names")
    args = parser.parse_args()
    failed = False
    for policy in args.policy or ["write_back", "write_through"]:
        with tempfile.TemporaryDirectory(prefix="aiokv-newcomer-") as ssd_dir:
            got = asyncio.run(run(policy, args.concurrency, ssd_dir))
        ok = got["hit_ratio"] >= 0.9 and got["short_loads"] == 0 and got["mismatches"] == 0
        failed |= not ok
        lines = [
            f"policy {policy}: {USERS} users x {HISTORY} tokens, host tier {HOST_MIB} MiB "
            f"({HOST_MIB * (1 << 20) // PAGE_BYTES} pages), SSD {SSD_GIB * 1024:.0f} MiB, "
            f"{args.concurrency} users at once, {STEPS} requests each",
            f"  loads        {got['loads']}",
            f"  hit ratio    {got['hit_ratio']:.3f}   (target >= 0.9)",
            f"  short loads  {got['short_loads']}   (target 0)",
            f"  mismatches   {got['mismatches']}   (target 0)",
            f"  stage_waits  {got['stage_waits']}   space_waits {got['space_waits']}",
            f"  lookup+load  p50 {got['p50_ms']:.0f} ms, max {got['max_ms']:.0f} ms "
            "(pages taken between them)",
            f"  wall         {got['wall_s']:.1f} s   {'ok' if ok else 'FAILED'}",
        ]
        print("\n".join(lines), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"newcomer_serving_{args.label}_{policy}.txt"
            command = " ".join(["python benchmarks/newcomer_serving.py", *sys.argv[1:]])
            path.write_text("\n".join([f"# {command} (aiokv at {_commit()})", *lines]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
