"""The public API in one screen: offload a few users' KV pages, look them up, load them
back into other pages, and check the bytes. Runs on the CPU, or on a GPU if there is one.

    python examples/quickstart.py [configs/default.yml]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

import aiokv

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 4, 256, 16, 2, 64
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yml"


async def main(config_path: str) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv_caches = [
        torch.randn(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    engine = aiokv.open_engine(config_path, kv_caches=kv_caches)
    users = 8
    history_tokens = 100  # 6 full pages of 16 and 4 tokens that are not stored
    async with engine:
        # Each user's history sits in 7 pages of its own; offload them all at once: the
        # engine batches the eight calls into one store round.
        pages = [torch.arange(7 * u, 7 * u + 7, device=device) for u in range(users)]
        stored = await asyncio.gather(
            *(engine.offload(u, pages[u], history_tokens) for u in range(users))
        )
        print("offloaded:", [r.stored_tokens for r in stored])

        # Later: bring user 3 back into free pages 200..206.
        target = torch.arange(200, 207, device=device)
        async with await engine.lookup(3, history_tokens) as hit:
            print("cached tokens for user 3:", hit.cached_tokens)
            loaded = await engine.load(hit, target)
        full = loaded.loaded_tokens // PAGE_SIZE
        same = all(torch.equal(c[target[:full]], c[pages[3][:full]]) for c in kv_caches)
        print(f"loaded {loaded.loaded_tokens} tokens, bit-exact: {same}")
        print(engine.stats())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else str(CONFIG))))
