"""aiokv from plain threads: ``aiokv.run_in_background`` runs the engine on a loop thread
of its own, and worker threads call it with blocking methods (or ``submit_*`` for
concurrent futures). Calls from many threads still batch into shared store rounds.

Each worker thread serves its own users in its own slice of the caches' pages, one step
at a time: lookup -> load the cached prefix -> compute the rest -> offload; every load
is checked bit for bit, as in asyncio_serving.py.

    python examples/threaded_client.py [--threads 8] [--steps 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys

import torch
from asyncio_serving import CONFIG, PAGE_SIZE, PAGES, make_caches, page_kv

import aiokv


def worker(
    kv: aiokv.BackgroundEngine, caches: list[torch.Tensor], thread: int, threads: int, steps: int
) -> tuple[int, int]:
    """One thread's users, each grown by ``steps`` steps of 24 tokens; returns (tokens
    loaded, loads that mismatched)."""
    span = PAGES // threads
    pages = list(range(thread * span, (thread + 1) * span))
    users = [f"thread{thread}-user{u}" for u in range(2)]  # str ids: key uid:str:<id>
    loaded_total = mismatches = 0
    history = dict.fromkeys(users, 0)
    for _ in range(steps):
        for user in users:
            total = history[user] + 24
            mine = pages[: -(-total // PAGE_SIZE)]
            page_ids = torch.tensor(mine, device=caches[0].device)
            with kv.lookup(user, history[user]) as hit:  # released by `with` if unused
                loaded = kv.load(hit, page_ids).loaded_tokens
            full = loaded // PAGE_SIZE
            for i, page in enumerate(mine):
                kv_page = page_kv(user, i, caches[0].device)
                if i < full:  # loaded: must be what was written
                    mismatches += not all(
                        torch.equal(c[page], kv_page[layer]) for layer, c in enumerate(caches)
                    )
                else:  # "compute"
                    for layer, cache in enumerate(caches):
                        cache[page] = kv_page[layer]
            kv.offload(user, page_ids, total)
            history[user] = total
            loaded_total += loaded
    return loaded_total, mismatches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    # Users are served one at a time per thread and share its pages: a thread's slice must
    # hold one full history.
    if PAGES // args.threads * PAGE_SIZE < 24 * args.steps:
        parser.error("too many threads or steps for the caches' pages")
    caches = make_caches()
    engine = aiokv.open_engine(CONFIG, kv_caches=caches)
    with aiokv.run_in_background(engine) as kv:
        with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
            results = list(
                pool.map(
                    lambda t: worker(kv, caches, t, args.threads, args.steps), range(args.threads)
                )
            )
        stats = kv.stats()
    loaded = sum(r[0] for r in results)
    mismatches = sum(r[1] for r in results)
    print(
        f"{args.threads} threads: {loaded} tokens loaded, {mismatches} mismatched; "
        f"{stats.batches} batches for {stats.completed} calls"
    )
    return 1 if mismatches or stats.failed else 0


if __name__ == "__main__":
    sys.exit(main())
