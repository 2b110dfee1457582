"""FlexKV with an SSD tier under aiokv: offload rounds larger than the CPU tier, then read
every round back.

Through the public API only (``aiokv.open_engine`` on a YAML config, ``backend: flexkv``,
FlexKV in its default child process): ``--rounds`` rounds of ``--users`` users x
``--tokens`` tokens (8 layers, 4 heads x 256, bf16, page 32: 2 GiB a round at 32 x 2048),
each round's offloads awaited together. A caller offloads once and does not retry: an
offload that finds the CPU tier full of blocks still being written to SSD waits for room
inside the engine (backpressure, aiokv/space.py), so ``store_full_seen`` (callers that got
StoreFull) should stay 0, while ``space_waits`` / ``space_wait_ms`` (EngineStats, per
round) count the waits. Then, round by round, every user's key is looked up and its hit
loaded into a second page range, and the loaded pages are compared bit for bit with what
was offloaded (each round's data is regenerated from its seed on the GPU).

Prints one JSON line per round and writes them all with ``--json FILE``. Needs flexkv
and a CUDA GPU: ``python benchmarks/flexkv_ssd.py --ssd-cache-dir /tmp/flexkv_ssd``.
FlexKV starts processes with multiprocessing "spawn": keep the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
import yaml

import aiokv

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 256, 32
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 2  # K and V, bf16


def fill_round(caches: list[torch.Tensor], pages: slice, seed: int) -> None:
    """Write round ``seed``'s data into ``pages`` of every layer (deterministic, on GPU)."""
    for layer, cache in enumerate(caches):
        gen = torch.Generator(device=cache.device).manual_seed(seed * 1000 + layer)
        view = cache[pages]
        view.copy_(torch.randn(view.shape, generator=gen, device=cache.device,
                               dtype=torch.float32).to(cache.dtype))


def expected_round(caches: list[torch.Tensor], pages: slice, seed: int) -> list[torch.Tensor]:
    out = []
    for layer, cache in enumerate(caches):
        gen = torch.Generator(device=cache.device).manual_seed(seed * 1000 + layer)
        shape = cache[pages].shape
        out.append(torch.randn(shape, generator=gen, device=cache.device,
                               dtype=torch.float32).to(cache.dtype))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def offload_once(
    engine: aiokv.OffloadEngine, user: int, pages: torch.Tensor, tokens: int,
    full_seen: list[int],
) -> tuple[int, int, str]:
    """One caller, one offload, no retry. (tokens written, tokens of the key now stored,
    error); a StoreFull is counted in ``full_seen``."""
    try:
        result = await engine.offload(user, pages, tokens)
        return result.stored_tokens, result.cached_tokens, ""
    except aiokv.StoreFull as exc:
        full_seen[0] += 1
        return 0, 0, f"StoreFull: {exc}"
    except aiokv.AiokvError as exc:
        return 0, 0, f"{type(exc).__name__}: {exc}"


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    users, tokens, rounds = args.users, args.tokens, args.rounds
    pages_per_user = tokens // PAGE
    region = users * pages_per_user  # pages of one round; a second region receives loads
    caches = [
        torch.zeros(2 * region, 2, PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=args.device)
        for _ in range(LAYERS)
    ]
    ids = torch.arange(2 * region, device=args.device, dtype=torch.int64)
    out_pages = [ids[u * pages_per_user:(u + 1) * pages_per_user] for u in range(users)]
    in_pages = [ids[region + u * pages_per_user:region + (u + 1) * pages_per_user]
                for u in range(users)]
    config = {
        "engine": {"request_timeout_ms": args.timeout_ms, "max_batch_requests": users},
        "store": {"backend": args.backend, "page_size": PAGE, "cpu_cache_gb": args.cpu_cache_gb},
    }
    if args.backend == "flexkv":
        config["store"].update(ssd_cache_gb=args.ssd_cache_gb, ssd_cache_dir=args.ssd_cache_dir)
        os.makedirs(args.ssd_cache_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(config, f)
    engine = aiokv.open_engine(f.name, caches)
    rows: list[dict[str, Any]] = [{"round": r} for r in range(rounds)]
    t0 = time.perf_counter()
    async with engine:
        print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
        for r in range(rounds):
            fill_round(caches, slice(0, region), r)
            sync(args.device)
            full_seen = [0]
            before = engine.stats()
            start = time.perf_counter()
            results = await asyncio.gather(*(
                offload_once(engine, r * users + u, out_pages[u], tokens, full_seen)
                for u in range(users)
            ))
            elapsed = time.perf_counter() - start
            after = engine.stats()
            stored = sum(s for s, _, _ in results)
            errors = sorted({e for _, _, e in results if e})
            rows[r].update({
                "offload_s": round(elapsed, 3),
                "offload_gib_s": round(stored * BYTES_PER_TOKEN / elapsed / 2**30, 3),
                "offloaded_tokens": stored, "cached_tokens": sum(c for _, c, _ in results),
                "store_full_seen": full_seen[0], "failed_users": sum(1 for *_, e in results if e),
                "space_waits": after.space_waits - before.space_waits,
                "space_wait_ms": round(after.space_wait_ms - before.space_wait_ms, 1),
                "offload_errors": errors[:3],
            })
            print(json.dumps(rows[r]), flush=True)
        if args.settle_s:
            await asyncio.sleep(args.settle_s)  # let SSD writes finish before reading back
        for r in range(rounds):
            hits = await asyncio.gather(*(
                engine.lookup(r * users + u, tokens) for u in range(users)
            ))
            for cache in caches:
                cache[region:].zero_()  # a load that writes nothing cannot pass
            loaded = await asyncio.gather(*(
                engine.load(hit, in_pages[u]) for u, hit in enumerate(hits)
            ))
            sync(args.device)
            want = expected_round(caches, slice(0, region), r)
            exact = 0
            for u, (hit, res) in enumerate(zip(hits, loaded, strict=True)):
                n = res.loaded_tokens // PAGE
                if n == 0:
                    continue
                src = slice(u * pages_per_user, u * pages_per_user + n)
                dst = slice(region + u * pages_per_user, region + u * pages_per_user + n)
                ok = all(torch.equal(c[dst].view(torch.int16), w[src].view(torch.int16))
                         for c, w in zip(caches, want, strict=True))
                exact += ok and res.loaded_tokens == hit.cached_tokens
            rows[r].update({
                "hit_tokens": sum(h.cached_tokens for h in hits), "asked_tokens": users * tokens,
                "users_hit": sum(1 for h in hits if h.cached_tokens), "loads_bit_exact": exact,
                "loaded_tokens": sum(x.loaded_tokens for x in loaded),
            })
            print(json.dumps({k: rows[r][k] for k in (
                "round", "hit_tokens", "asked_tokens", "users_hit", "loads_bit_exact")}),
                flush=True)
        stats = engine.stats()
    os.unlink(f.name)
    print(f"engine stats: {stats}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cpu-cache-gb", type=float, default=3.2)
    parser.add_argument("--ssd-cache-gb", type=float, default=16.0)
    parser.add_argument("--ssd-cache-dir", default=os.path.join(tempfile.gettempdir(),
                                                                "aiokv_flexkv_ssd"))
    parser.add_argument("--timeout-ms", type=int, default=120_000)
    parser.add_argument("--settle-s", type=float, default=0.0,
                        help="seconds to wait between the last offload and the lookups")
    parser.add_argument("--json", default=None)
    parser.add_argument("--backend", choices=("flexkv", "local"), default="flexkv",
                        help="local: a dry run of this script on aiokv's own store")
    parser.add_argument("--device", default="cuda", help="where the caches live")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    rows = asyncio.run(run(args))
    print(f"\n{'round':>5} | {'GiB/s':>6} {'StoreFull':>9} {'waits':>6} {'wait ms':>9} | "
          f"{'hit/asked tokens':>17} | exact")
    for row in rows:
        print(f"{row['round']:>5} | {row['offload_gib_s']:>6.2f} {row['store_full_seen']:>9} "
              f"{row['space_waits']:>6} {row['space_wait_ms']:>9.1f} | "
              f"{row['hit_tokens']:>8}/{row['asked_tokens']:<8} | "
              f"{row['loads_bit_exact']}/{row['users_hit']}")
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                "backend": args.backend, "torch": torch.__version__,
                "argv": sys.argv, "bytes_per_token": BYTES_PER_TOKEN,
                "cpu_cache_gb": args.cpu_cache_gb, "ssd_cache_gb": args.ssd_cache_gb}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
