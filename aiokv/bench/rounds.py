"""One timed round of the bandwidth benchmark: every user offloads (then loads) at once, or
in a steady stream of batches.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from ..engine import OffloadEngine
from . import common

IDS = ("device", "host")  # where the rounds' page ids are: see _round
PLACEMENTS = ("scattered", "runs")  # the users' pages: see _round


@dataclass(frozen=True)
class Settings:
    users: tuple[int, ...] = (8, 16, 32, 64)
    tokens: tuple[int, ...] = (1024, 2048, 4096)
    layers: int = 8
    heads: int = 4
    head_dim: int = 256
    page_size: int = 32
    dtype: str = "bf16"
    repeats: int = 3
    warmup: int = common.or_zero(1)
    cpu_cache_gb: float = common.or_zero(0.0)
    raw_gib: float = 2.0
    device: str = "auto"
    batch_requests: int = common.or_zero(0)
    switch_interval_us: int = common.or_zero(0)
    stream_batches: int = common.or_zero(4)
    stream_gib: float = common.or_zero(2.0)
    placement: str = field(default="scattered", metadata={"choices": PLACEMENTS})


GIB = float(1 << 30)
MAX_STREAM_BATCHES = 64  # stream_gib adds batches up to this many


async def _round(
    engine: OffloadEngine,
    caches_pages: int,
    batches: int,
    users: int,
    tokens: int,
    page_size: int,
    device: torch.device,
    names: itertools.count[int],
    placement: str = field(default="scattered", metadata={"choices": PLACEMENTS}),
    ids: str = "device",
) -> tuple[float, float, int, int]:
    """Offload ``batches`` x ``users`` fresh histories at once, then load them all back
    into fresh pages at once: scattered at random, or (``placement`` "runs") each user's
    pages adjacent, at a random place, as a fresh page allocator hands them out. The page
    ids are device tensors, or with ``ids`` "host" CPU ones (the store then has no page
    ids to bring over from the device). Returns (offload seconds, load seconds, tokens
    stored, tokens loaded); each timed from the first submit to the last result."""
    pages_each = -(-tokens // page_size)
    count = batches * users

    where = device if ids == "device" else torch.device("cpu")

    def scatter() -> list[torch.Tensor]:
        if placement == "runs":
            slots = torch.randperm(caches_pages // pages_each, device=where)[:count]
            steps = torch.arange(pages_each, device=where)
            return list(slots[:, None] * pages_each + steps)
        order = torch.randperm(caches_pages, device=where)[: count * pages_each]
        return list(order.view(count, pages_each))

    spaces = [[f"bw{next(names)}"] for _ in range(count)]
    pages = scatter()
    start = time.perf_counter()
    stored = await asyncio.gather(
        *(engine.offload(u, pages[u], tokens, namespace=spaces[u]) for u in range(count))
    )
    offload_s = time.perf_counter() - start
    if any(r.stored_tokens != tokens // page_size * page_size for r in stored):
        raise RuntimeError("bandwidth: an offload of fresh tokens stored less than asked")
    hits = await asyncio.gather(
        *(engine.lookup(u, tokens, namespace=spaces[u]) for u in range(count))
    )
    pages = scatter()
    start = time.perf_counter()
    loaded = await asyncio.gather(*(engine.load(h, pages[u]) for u, h in enumerate(hits)))
    load_s = time.perf_counter() - start
    return (
        offload_s,
        load_s,
        sum(r.stored_tokens for r in stored),
        sum(r.loaded_tokens for r in loaded),
    )


def _batch_gib(settings: Settings, users: int, tokens: int) -> float:
    per_token = common.bytes_per_token(
        settings.layers, settings.heads, settings.head_dim, common.DTYPES[settings.dtype]
    )
    return users * (tokens // settings.page_size * settings.page_size) * per_token / GIB


def stream_length(settings: Settings, users: int, tokens: int) -> int:
    """Batches in a row's stream: ``stream_batches``, or more to hold ``stream_gib``
    (at most ``MAX_STREAM_BATCHES``: a tiny row would otherwise size the caches, the
    store and ``max_pending`` for thousands of batches)."""
    if settings.stream_batches < 2:
        return settings.stream_batches
    batch_gib = _batch_gib(settings, users, tokens)
    wanted = math.ceil(settings.stream_gib / batch_gib) if batch_gib > 0 else 0
    return max(settings.stream_batches, min(wanted, MAX_STREAM_BATCHES))
