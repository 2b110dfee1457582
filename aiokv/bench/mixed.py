"""Mixed traffic: offloads of some users and loads of others in flight together, next to
the raw duplex copy of the same machine, measured in the same run.

Serving offloads one set of users while it loads another. A GPU has a copy engine per
direction, so both can move at once; this measures what the engine makes of it: per
repeat, ``users`` fresh histories of ``tokens`` tokens are offloaded while ``users``
others (offloaded and looked up beforehand, untimed) are loaded into fresh pages, all
submitted together and timed from the first submit to the last result. The raw figure is
one pinned device-to-host and one host-to-device copy of the same bytes on two streams
at once; both are reported as GiB/s moved in total (both directions added), with the
one-direction raw copy beside them.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig, StoreConfig
from ..engine import OffloadEngine
from ..stores.local import LocalStore
from . import common
from .rounds import Settings

GIB = 1 << 30


def raw_duplex_gib_s(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """(one direction, both at once) GiB/s of ``nbytes`` each way: pinned host buffers,
    one copy per direction on streams of their own. On the CPU, host memcpys (the
    "both" figure then shares one memory bus)."""
    pin = device.type == "cuda"
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host_in = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev_out = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]  # type: ignore[no-untyped-call]
    one: list[float] = []
    both: list[float] = []
    for _ in range(repeats + 1):  # the first warms up
        _sync(device)
        start = time.perf_counter()
        host_out.copy_(dev_out, non_blocking=True)
        _sync(device)
        one.append(time.perf_counter() - start)
        start = time.perf_counter()
        if device.type == "cuda":
            with torch.cuda.stream(streams[0]):
                host_out.copy_(dev_out, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                dev_in.copy_(host_in, non_blocking=True)
        else:
            host_out.copy_(dev_out)
            dev_in.copy_(host_in)
        _sync(device)
        both.append(time.perf_counter() - start)
    return nbytes / GIB / statistics.median(one[1:]), 2 * nbytes / GIB / statistics.median(both[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def measure(
    settings: Settings, device: torch.device, observe: Callable[[str, int], None] | None = None
) -> dict[str, Any]:
    """The engine's mixed figure, ``settings.users[0]`` users of ``settings.tokens[0]``
    tokens each way: GiB/s moved in total, median of the repeats. ``observe(point,
    repeat)``, if given, is called just before each timed round's first submit ("start")
    and just after its last result ("end"); repeat 0 warms up."""
    dtype = common.DTYPES[settings.dtype]
    users = settings.users[0]
    pages_each = settings.tokens[0] // settings.page_size
    # Per repeat: the loaded users' source pages, their target pages, the offloaded
    # users' pages; all disjoint.
    num_pages = 3 * users * pages_each
    caches = common.make_caches(settings.layers, num_pages, settings.page_size,
                                settings.heads, settings.head_dim, dtype, device)
    per_token = common.bytes_per_token(settings.layers, settings.heads, settings.head_dim, dtype)
    each_way = users * pages_each * settings.page_size * per_token
    gib = each_way * 2 * (settings.repeats + 2) / GIB  # every repeat stores two user sets
    store = LocalStore(StoreConfig(cpu_cache_gb=gib, page_size=settings.page_size))
    # Each kind's timed calls fill one batch (max_batch_requests): the loads, submitted
    # first, go to the store thread once the last of them is in, while the offloads are
    # still being submitted, as any full batch does. (With room for both kinds in one
    # batch window, the loads would wait for every offload's submit.) The untimed set-up
    # calls fill theirs too.
    config = EngineConfig(window_us=1_000, max_batch_requests=users, max_pending=4 * users)
    tokens = pages_each * settings.page_size

    def pages(group: int, user: int) -> torch.Tensor:
        first = (group * users + user) * pages_each
        return torch.arange(first, first + pages_each, device=device)

    seconds: list[float] = []
    async with OffloadEngine(store, caches, config) as engine:
        await asyncio.to_thread(store.wait_pinned)  # copies, not start-up
        for repeat in range(settings.warmup + settings.repeats):  # --warmup first, untimed
            loaded = [[f"mix{repeat}-in-{u}"] for u in range(users)]
            offloaded = [[f"mix{repeat}-out-{u}"] for u in range(users)]
            await asyncio.gather(*(engine.offload(u, pages(0, u), tokens, namespace=loaded[u])
                                   for u in range(users)))
            hits = await asyncio.gather(*(engine.lookup(u, tokens, namespace=loaded[u])
                                          for u in range(users)))
            # The pages are the caller's, made before the clock starts (as a server's
            # block table has them); made inside the timed gather, their creation (a
            # kernel launch each) would count as the engine's.
            targets = [pages(1, u) for u in range(users)]
            sources = [pages(2, u) for u in range(users)]
            _sync(device)
            if observe is not None:
                observe("start", repeat)
            start = time.perf_counter()
            results = await asyncio.gather(
                *(engine.load(hits[u], targets[u]) for u in range(users)),
                *(engine.offload(u, sources[u], tokens, namespace=offloaded[u])
                  for u in range(users)),
            )
            elapsed = time.perf_counter() - start
            if observe is not None:
                observe("end", repeat)
            moved = sum(getattr(r, "loaded_tokens", 0) + getattr(r, "stored_tokens", 0)
                        for r in results)
            if moved != 2 * users * tokens:
                raise RuntimeError(f"mixed: moved {moved} tokens of {2 * users * tokens}")
            if repeat >= settings.warmup:
                seconds.append(elapsed)
    one_way, duplex = raw_duplex_gib_s(each_way, device, settings.repeats)
    engine_gib_s = 2 * each_way / GIB / statistics.median(seconds)
    return {
        "users": users, "tokens": tokens, "gib_each_way": each_way / GIB,
        "engine_mixed_gib_s": engine_gib_s, "raw_one_way_gib_s": one_way,
        "raw_duplex_gib_s": duplex, "of_raw_duplex": engine_gib_s / duplex,
    }


def run(settings: Settings, device: torch.device, json_path: str | None) -> int:
    """``aiokv bench bandwidth --mixed``: the bandwidth bench's settings (``--quick``
    included), its first ``users`` and ``tokens`` each way."""
    result = common.run_uvloop(measure(settings, device))
    report(result)
    if json_path:
        document = {"bench": "bandwidth --mixed", "environment": common.environment(device),
                    "result": result}
        Path(json_path).write_text(json.dumps(document, indent=1))
    return 0


def report(result: dict[str, Any]) -> None:
    print(
        f"mixed traffic, {result['users']} users x {result['tokens']} tokens each way "
        f"({result['gib_each_way']:.2f} GiB each way): engine {result['engine_mixed_gib_s']:.1f} "
        f"GiB/s in total, raw duplex {result['raw_duplex_gib_s']:.1f} GiB/s "
        f"({result['of_raw_duplex']:.0%} of it); raw one way {result['raw_one_way_gib_s']:.1f}"
    )
