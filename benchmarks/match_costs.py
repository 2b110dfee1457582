"""What a batch's matches cost on the embedded store's thread, per user, the store called
directly (no engine, no loop): the part of a lone batch's control path that is
``put_match_many`` / ``get_match``.

    python benchmarks/match_costs.py [--users 8,32] [--tokens 1024,2048] [--page 32]
                                     [--rounds 40] [--ids positions,random] [--json FILE]

For each users x tokens x ids case, ``--rounds`` rounds of: ``put_match_many`` of fresh
keys (the host tier three batches large, so that from the fourth round on each batch
evicts the oldest), its launch and wait (untimed); ``put_match_many`` of the same keys
again (all stored: nothing to write); ``get_match`` of each key, one call per user (as
the engine asks a store without a remote tier), then their cancels (untimed). Prints the
median and spread (min-max) per user in microseconds of each timed call. ``--ids
positions`` offloads the default token ids (their digests come from a cache), ``random``
a distinct random history per user (hashed each time). CPU caches: 8 layers of one head
of 2 values, so that copies cost next to nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv

LAYERS = 8


def _wait(store: aiokv.LocalStore, task_ids: list[int]) -> None:
    left = set(task_ids)
    while left:
        left -= set(store.try_wait(list(left)))
        if left:
            time.sleep(0.0002)


def run_case(users: int, tokens: int, page: int, rounds: int, ids: str) -> dict[str, Any]:
    pages = tokens // page
    caches = [torch.zeros(users * pages, 2, page, 1, 2) for _ in range(LAYERS)]
    block_bytes = sum(c[0].nbytes for c in caches)
    blocks = 3 * users * pages
    store = aiokv.LocalStore(aiokv.StoreConfig(
        cpu_cache_gb=blocks * block_bytes * 1.0001 / (1 << 30), page_size=page))
    store.register(caches)
    rng = np.random.default_rng(0)
    page_ids = [torch.arange(u * pages, (u + 1) * pages) for u in range(users)]
    times: dict[str, list[float]] = {"put_fresh": [], "put_stored": [], "get": []}
    try:
        for round_ in range(rounds):
            queries = []
            for u in range(users):
                history = (np.arange(tokens, dtype=np.int64) if ids == "positions"
                           else rng.integers(0, 1 << 17, tokens, dtype=np.int64))
                queries.append((history, [f"r{round_}-u{u}"]))
            gc.disable()  # a collection inside a timed call is noise, not its cost
            try:
                start = time.perf_counter()
                answers = store.put_match_many(queries)
                times["put_fresh"].append(time.perf_counter() - start)
                if any(isinstance(a, Exception) for a in answers):
                    raise RuntimeError(f"match_costs: a fresh put failed: {answers}")
                task_ids = [a[0] for a in answers]  # type: ignore[index]
                store.launch(task_ids, page_ids, [None] * users)
                _wait(store, task_ids)

                start = time.perf_counter()
                again = store.put_match_many(queries)
                times["put_stored"].append(time.perf_counter() - start)
                if any(isinstance(a, Exception) or a[1].any() for a in again):
                    raise RuntimeError("match_costs: a stored put had pages to write")
                store.cancel([a[0] for a in again])  # type: ignore[index]

                start = time.perf_counter()
                gets = [store.get_match(*query) for query in queries]
                times["get"].append(time.perf_counter() - start)
                if any(not mask.all() for _, mask in gets):
                    raise RuntimeError("match_costs: a lookup missed a stored page")
                store.cancel([g[0] for g in gets])
            finally:
                gc.enable()
    finally:
        store.close()
    skip = min(3, rounds // 4)  # the first rounds evict nothing and warm the caches
    per_user = {name: [t * 1e6 / users for t in values[skip:]] for name, values in times.items()}
    return {
        "users": users, "tokens": tokens, "page": page, "ids": ids,
        **{name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
           for name, v in per_user.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--users", default="8,32", help="comma-separated batch sizes")
    parser.add_argument("--tokens", default="1024,2048", help="comma-separated tokens per user")
    parser.add_argument("--page", type=int, default=32, help="tokens per page")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--ids", default="positions,random",
                        help="comma-separated: positions (default token ids), random")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    print(f"{'case':<26} {'put fresh':>20} {'put stored':>20} {'get':>20}   us/user, "
          "median (min-max)")
    for ids in args.ids.split(","):
        for users in map(int, args.users.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                result = run_case(users, tokens, args.page, args.rounds, ids)
                results.append(result)
                cells = [f"{r['median_us']:6.1f} ({r['min_us']:.1f}-{r['max_us']:.1f})"
                         for r in (result["put_fresh"], result["put_stored"], result["get"])]
                print(f"{users:>3} x {tokens:<5} {ids:<14} {cells[0]:>20} {cells[1]:>20} "
                      f"{cells[2]:>20}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
