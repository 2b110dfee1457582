"""Throwaway probe (2026-12-05, ninth session): ``LocalStore.put_match_many`` of a batch of
new keys (default token ids) on a store with free blocks, each batch cancelled after, so
no eviction; median of 200 after 50.

    python benchmarks/results/cpu_1205i_put_match_many_isolated.py 8 1024
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiokv


def main(users: int, tokens: int, page: int = 32) -> None:
    caches = [torch.zeros(users * tokens // page * 4, 2, page, 1, 8, dtype=torch.bfloat16)
              for _ in range(8)]
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.5, page_size=page))
    store.register(caches)
    positions = np.arange(tokens, dtype=np.int64)

    def one(batch: int) -> float:
        queries = [(positions, (f"n{batch}-{u}",)) for u in range(users)]
        start = time.perf_counter()
        answers = store.put_match_many(queries)
        spent = time.perf_counter() - start
        store.cancel([a[0] for a in answers if not isinstance(a, Exception)])
        return spent

    for batch in range(50):
        one(batch)
    times = sorted(one(batch) for batch in range(50, 250))
    median = times[len(times) // 2] * 1e6
    print(f"put_match_many {users}x{tokens}: median {median:.0f} us, "
          f"{median / users:.1f} us/user")
    store.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
