"""Start-up: how soon a new engine serves, and how soon its whole host tier is pinned,
next to one plain pinned allocation of the same size, measured in the same run.

The embedded store pins its host tier in chunks on background threads and serves from
the first chunk. Measured here: the seconds from ``start()`` to the first offload's
result (a one-page history), the seconds from ``start()`` until the whole tier is pinned,
and the seconds of one ``torch.empty(n, pin_memory=True)`` of the tier's size. On the
CPU nothing is pinned: the tier is usable at once, the plain figure is an allocation that
touches every page, and the run is a smoke test. ``--plot`` draws the three times as bars.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from .. import flags
from ..config import EngineConfig, StoreConfig
from ..engine import OffloadEngine
from ..errors import ConfigError
from ..flags import positive_float
from ..stores.local import LocalStore
from . import common

NAME = "startup"
HELP = "time to first served request and to the whole pinned pool vs one plain pinned alloc"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gib", type=positive_float, default=16.0, help="host tier size (--quick: 0.25)"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def plain_seconds(nbytes: int, device: torch.device) -> float:
    """One plain allocation of ``nbytes``: pinned on a GPU host, touched on the CPU."""
    start = time.perf_counter()
    if device.type == "cuda":
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
    seconds = time.perf_counter() - start
    del buffer
    if device.type == "cuda":
        torch._C._host_emptyCache()  # give it back before the engine pins its own
    return seconds


async def engine_seconds(gib: float, device: torch.device) -> dict[str, float]:
    """(start -> first result, start -> whole tier usable) of a new engine, and the bytes
    usable then (``usable_bytes``) and pinned among them (``pinned_bytes``: 0 on a CPU)."""
    caches = common.make_caches(8, 64, 32, 4, 256, torch.bfloat16, device)
    store = LocalStore(StoreConfig(cpu_cache_gb=gib))
    engine = OffloadEngine(store, caches, EngineConfig(window_us=0))
    start = time.perf_counter()
    async with engine:
        await engine.offload(0, torch.arange(1, device=device), 32)
        first = time.perf_counter() - start
        # The bench reads the pool's progress directly: it is a probe of this store.
        memory = store._pool.memory if store._pool is not None else None
        if memory is not None:
            await asyncio.to_thread(memory.wait_all)
        whole = time.perf_counter() - start
        usable = memory.ready_blocks * memory.block_bytes if memory is not None else 0
        pinned = usable if memory is not None and memory.pinned else 0
    return {"first_request_s": first, "whole_pool_s": whole, "usable_bytes": float(usable),
            "pinned_bytes": float(pinned)}


def run(args: argparse.Namespace) -> int:
    device = common.pick_device(args.device)
    gib = 0.25 if args.quick and args.gib == 16.0 else args.gib
    block_bytes = 8 * 2 * 32 * 4 * 256 * 2
    nbytes = int(gib * (1 << 30)) // block_bytes * block_bytes
    # Named here, before the plain allocation: it came first and failed with torch's
    # message, and a tier of no block failed naming the store's key, not the flag.
    if not nbytes:
        raise ConfigError("--gib", f"{gib} GiB holds no block of {block_bytes} bytes; "
                          f"ask for at least {block_bytes / (1 << 30):g}")
    # The plain buffer is freed before the engine's tier is made: one of them at a time,
    # next to the engine's caches (engine_seconds': 64 pages of a block each).
    flags.check_fits(f"--gib {gib}", {"host tier": nbytes,
                                      "caches": 64 * block_bytes if device.type == "cpu" else 0})
    if device.type == "cuda":
        torch.empty(1, device=device)  # the CUDA context, outside every timing
    plain = plain_seconds(nbytes, device)
    measured = common.run_uvloop(engine_seconds(gib, device))
    result: dict[str, Any] = {
        "gib": nbytes / (1 << 30),
        "device": str(device),
        "plain_alloc_s": plain,
        **measured,
        "whole_to_plain": measured["whole_pool_s"] / plain if plain else float("nan"),
    }
    usable_gib = measured["usable_bytes"] / (1 << 30)
    print(
        f"startup, {result['gib']:.2f} GiB host tier on {device}: first request served "
        f"{measured['first_request_s']:.3f} s after start(); whole pool "
        f"{measured['whole_pool_s']:.2f} s; one plain "
        f"{'pinned ' if device.type == 'cuda' else ''}allocation {plain:.2f} s "
        f"(whole pool / plain = {result['whole_to_plain']:.2f}); "
        + (f"pinned {measured['pinned_bytes'] / (1 << 30):.2f} GiB" if measured["pinned_bytes"]
           else f"{usable_gib:.2f} GiB usable, none pinned (the caches are on the CPU)")
    )
    if args.json:
        document = {"bench": NAME, "environment": common.environment(device), "result": result}
        Path(args.json).write_text(json.dumps(document, indent=1))
    if args.plot:
        _plot(args.plot, result)
    return 0


def _plot(path: str, result: dict[str, Any]) -> None:
    labels = ["start() to first result", "start() to whole pool", "one plain allocation"]
    seconds = [result["first_request_s"], result["whole_pool_s"], result["plain_alloc_s"]]

    def draw(axes: Any) -> None:
        axes.bar(labels, seconds, color=["C0", "C0", "C7"])
        axes.set_ylabel("seconds")

    common.save_plot(path, f"start-up, {result['gib']:.2f} GiB host tier ({result['device']})",
                     draw)
