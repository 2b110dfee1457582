"""Effective bandwidth of offload (device pages -> host) and load (host -> device pages)
through the engine on LocalStore, next to the raw copy bandwidth of one large
contiguous pinned buffer measured in the same run.

For each (users, tokens): every repeat places each user's pages at random in the caches
and offloads fresh histories (new namespaces) with concurrent ``offload`` calls, timed
from submit to all resolved; then looks them all up (untimed) and times the concurrent
``load``s into freshly scattered pages. One engine per user count, with a window long
enough and ``max_batch_requests`` = users, so each timed batch is one window; the engines
share one LocalStore (registered once: its pinned pool is the expensive part).

Each row is measured in three views. "One batch": one batch alone, timed from its first
submit to its last result, so it carries the batch's fixed cost in full (submits,
dispatch and matching before its copy starts; completion and resolution after it ends):
the latency-bound view. "Stream, with fill": ``stream_batches`` batches of the same size
(more where a batch is small: a stream holds at least ``stream_gib``) submitted together,
as a server under load keeps submitting them, timed the same way; the engine matches
batch k+1 while batch k copies. "Stream, steady": what each further batch costs once the
pipeline is full, (n - 1) batches over the stream's time less the one batch's, which
takes the fixed cost out (it is paid once in each); this is the throughput a loaded
server sustains. The one batch's noise weighs on that figure in inverse proportion to
the stream's length, hence the floor on its size: with 4 batches of 0.25
GiB (8 users x 1024 tokens), the steady figure moved by 5 points between runs on one
host. Every figure is printed as a fraction of the raw copy, this machine's limit (the
project's targets on them are judged by benchmarks/targets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from typing import Any

import torch

from ..config import EngineConfig, StoreConfig
from ..engine import OffloadEngine
from ..errors import ConfigError
from ..stores.base import Store
from ..stores.local import LocalStore
from ..testing import SharedStore
from . import common, mixed
from .rounds import GIB, Settings, _batch_gib, _round, stream_length

# The batch rows' flags that mixed traffic (aiokv.bench.mixed) does not read.
_NOT_MIXED = ("--cpu-cache-gb", "--placement", "--batch-requests", "--stream-batches",
              "--stream-gib", "--raw-gib", "--switch-interval-us")

NAME = "bandwidth"
HELP = "offload/load GiB/s through the engine vs raw pinned copy bandwidth"


QUICK: dict[str, object] = {
    "users": (8, 16),
    "tokens": (64, 128),
    "layers": 2,
    "heads": 2,
    "head_dim": 64,
    "page_size": 16,
    "repeats": 2,
    "raw_gib": 0.0625,
    "stream_batches": 2,
    "stream_gib": 0.0,
}
HELPS = {
    "users": "concurrent users per batch",
    "tokens": "tokens per user",
    "repeats": "timed batches per row (median reported)",
    "warmup": "untimed batches per row first",
    "cpu_cache_gb": "LocalStore size in GiB (0: room for the largest stream, "
    "(its batches + 0.5) x the batch size; a stream's batches are all stored before they are "
    "loaded back, so a smaller store fails with StoreFull)",
    "switch_interval_us": "sys.setswitchinterval while measuring (0: Python's 5 ms); the "
    "copy thread re-takes the GIL after every torch call, so this bounds its waits",
    "batch_requests": "engine max_batch_requests (0: all users in one store round; smaller "
    "splits the users into rounds whose matching overlaps the previous round's copy)",
    "raw_gib": "size of the raw contiguous copy, GiB",
    "stream_batches": "batches submitted together in the stream measurement (< 2: skip it)",
    "stream_gib": "a stream holds at least this many GiB: more than stream_batches batches "
    "where batches are small, so that the one batch subtracted from the stream weighs as "
    "little on small rows as on large ones",
    "device": "where the caches live",
    "placement": "the users' pages: 'scattered' at random (one copy per page and layer) or "
    "'runs' (each user's adjacent, as a fresh allocator hands them out: 2-D copies)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)
    parser.add_argument(
        "--mixed", action="store_true",
        help="offloads and loads in flight together (the first --users and --tokens each "
        "way), next to the raw duplex copy: see aiokv.bench.mixed",
    )


def raw_copy_gib_s(
    gib: float, device: torch.device, repeats: int
) -> tuple[float, float]:
    """(device->host, host->device) GiB/s of one contiguous buffer, pinned host memory;
    on the CPU, a host memcpy both ways. Median of ``repeats``."""
    count = int(gib * GIB)
    host = torch.empty(count, dtype=torch.uint8, pin_memory=device.type == "cuda")
    other = torch.empty(count, dtype=torch.uint8, device=device)
    host.fill_(1)
    other.fill_(2)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return count / GIB / statistics.median(times[1:])

    d2h = timed(host, other)
    h2d = timed(other, host)
    return d2h, h2d








async def _row(
    engine: OffloadEngine,
    caches_pages: int,
    users: int,
    tokens: int,
    settings: Settings,
    device: torch.device,
    names: itertools.count[int],
    bar: Any,
) -> dict[str, Any]:
    per_token = common.bytes_per_token(
        settings.layers, settings.heads, settings.head_dim, common.DTYPES[settings.dtype]
    )
    in_stream = stream_length(settings, users, tokens)
    row: dict[str, Any] = {
        "users": users,
        "tokens": tokens,
        "batch_gib": _batch_gib(settings, users, tokens),
        "stream_batches": in_stream,
    }
    batch_bytes = row["batch_gib"] * GIB
    seconds: dict[str, float] = {}  # median seconds of a round, per view and direction
    modes = [("", 1)]
    if in_stream > 1:
        modes.append(("stream_fill_", in_stream))
    for prefix, batches in modes:
        offload_s, load_s = [], []
        before = engine.stats().batches
        for repeat in range(settings.warmup + settings.repeats):
            round_offload_s, round_load_s, stored, loaded = await _round(
                engine, caches_pages, batches, users, tokens, settings.page_size, device, names,
                settings.placement,
            )
            if stored != loaded or stored * per_token != batches * batch_bytes:
                raise RuntimeError("bandwidth: a round moved other than every token asked")
            if repeat >= settings.warmup:
                offload_s.append(round_offload_s)
                load_s.append(round_load_s)
            bar.update()
        for direction, times in (("offload", offload_s), ("load", load_s)):
            seconds[f"{prefix}{direction}"] = statistics.median(times)
            row[f"{prefix}{direction}_gib_s"] = batches * batch_bytes / GIB / seconds[
                f"{prefix}{direction}"
            ]
        # 3 per batch expected (offload, lookup, load): more means a batch was split.
        row[f"{prefix}store_rounds_per_batch"] = (engine.stats().batches - before) / (
            batches * (settings.warmup + settings.repeats)
        )
    if len(modes) > 1:
        # Steady state: what each further batch of the stream costs. Both rounds pay the
        # fixed cost once (the first batch's submits and matching before its copy, the
        # last batch's resolution after it), so it drops out of the difference; in the
        # stream, the other submits also compete with the first batch's matching, which
        # only lowers this figure.
        extra = in_stream - 1
        for direction in ("offload", "load"):
            more_s = seconds[f"stream_fill_{direction}"] - seconds[direction]
            row[f"stream_{direction}_gib_s"] = (
                extra * batch_bytes / GIB / more_s if more_s > 0 else float("nan")
            )
    return row


async def _main(settings: Settings, device: torch.device) -> list[dict[str, Any]]:
    dtype = common.DTYPES[settings.dtype]
    page_size = settings.page_size
    rows_asked = list(itertools.product(settings.users, settings.tokens))
    # Batches submitted together in each row: its stream (or 1).
    in_flight = {row: max(stream_length(settings, *row), 1) for row in rows_asked}
    most_pages = max(settings.users) * -(-max(settings.tokens) // page_size)
    # Each batch of a stream loads into pages of its own. Slack, so random placement
    # scatters pages instead of filling the caches in order.
    stream_pages = max(
        n * users * -(-tokens // page_size) for (users, tokens), n in in_flight.items()
    )
    caches_pages = stream_pages + most_pages // 4 + 1
    caches = common.make_caches(
        settings.layers, caches_pages, page_size, settings.heads, settings.head_dim, dtype, device
    )
    for cache in caches:
        cache.normal_()
    # A stream's batches are all stored before they are loaded back.
    store_gib = settings.cpu_cache_gb or max(
        (n + 0.5) * _batch_gib(settings, *row) for row, n in in_flight.items()
    )
    local = LocalStore(StoreConfig(cpu_cache_gb=store_gib))
    shared = SharedStore(local)
    rows = []
    names = itertools.count()
    total = (
        len(settings.users)
        * len(settings.tokens)
        * (settings.warmup + settings.repeats)
        * (2 if settings.stream_batches > 1 else 1)
    )
    try:
        with common.progress(total, "bandwidth bench", "batch") as bar:
            for users in settings.users:
                per_round = min(settings.batch_requests or users, users)
                config = EngineConfig(
                    # With one round per batch the window never triggers (the request count
                    # does); with several, a short window flushes a remainder.
                    window_us=10_000_000 if per_round == users else 1_000,
                    max_batch_requests=per_round,
                    max_batch_tokens=max(users * max(settings.tokens), 1),
                    max_pending=max(
                        (max(in_flight[users, t] for t in settings.tokens) + 1) * users,
                        EngineConfig.max_pending,
                    ),
                )
                store: Store = shared
                async with OffloadEngine(store, caches, config) as engine:
                    # Copies, not start-up: the host tier is pinned whole before timing.
                    await asyncio.to_thread(local.wait_pinned)
                    for tokens in settings.tokens:
                        rows.append(
                            await _row(
                                engine, caches_pages, users, tokens, settings, device, names, bar
                            )
                        )
    finally:
        await asyncio.to_thread(shared.close_inner)
    return rows


def run(args: argparse.Namespace) -> int:
    settings = common.settings_from_args(Settings, args, QUICK)
    device = common.pick_device(settings.device)
    if args.mixed:
        if args.plot:  # nothing draws mixed traffic: say so rather than write no file
            raise ConfigError("--plot", "draws the batch rows; --mixed has no plot")
        given = list(getattr(args, "bench_argv", None) or sys.argv[1:])
        unread = [flag for flag in _NOT_MIXED
                  if any(a == flag or a.startswith(flag + "=") for a in given)]
        if unread:  # mixed sizes its own store and runs no stream: they would be ignored
            raise ConfigError(unread[0], "is for the batch rows; --mixed does not read it")
        return mixed.run(settings, device, args.json)
    raw = int(settings.raw_gib * GIB)  # a host buffer, and one on the device
    common.check_round_fits(settings, device, store=not settings.cpu_cache_gb,
                            extra={"raw copy": raw * (2 if device.type == "cpu" else 1)},
                            sized_too=("raw_gib",))
    raw_d2h, raw_h2d = raw_copy_gib_s(settings.raw_gib, device, max(settings.repeats, 3))
    with common.switch_interval(settings.switch_interval_us):
        rows = common.run_uvloop(_main(settings, device))
    stream = settings.stream_batches > 1
    views = ("", "stream_", "stream_fill_") if stream else ("",)
    for row in rows:
        for prefix in views:
            row[f"{prefix}offload_of_raw"] = row[f"{prefix}offload_gib_s"] / raw_d2h
            row[f"{prefix}load_of_raw"] = row[f"{prefix}load_gib_s"] / raw_h2d
    titles = {"": "1 batch", "stream_": "steady stream", "stream_fill_": "stream with fill"}
    headers = ["users", "tokens", "batch GiB"]
    for prefix in views:
        headers += [f"{titles[prefix]}: offload GiB/s (of raw)", "load"]
    table = []
    for r in rows:
        cells = [r["users"], r["tokens"], r["batch_gib"]]
        for prefix in views:
            for direction in ("offload", "load"):
                cells.append(f"{r[f'{prefix}{direction}_gib_s']:.1f} "
                             f"({r[f'{prefix}{direction}_of_raw']:.0%})")
        table.append(cells)
    common.print_table(
        f"engine bandwidth on {device} ({settings.layers} layers, {settings.heads} heads x "
        f"{settings.head_dim}, {settings.dtype}, page {settings.page_size}); raw copy "
        f"{settings.raw_gib:g} GiB: D2H {raw_d2h:.1f} GiB/s, H2D {raw_h2d:.1f} GiB/s",
        headers,
        table,
    )
    if stream:
        counts = ", ".join(f"{r['users']}x{r['tokens']}: {r['stream_batches']}" for r in rows
                           if r["stream_batches"] != settings.stream_batches)
        more = (
            f", or more to hold {settings.stream_gib:g} GiB ({counts or 'none needed more'})"
            if settings.stream_gib > 0
            else ""
        )
        print(f"  (1 batch, stream with fill: first submit to last result, "
              f"{settings.stream_batches} batches in the stream{more}. Steady: n - 1 "
              "batches over the stream's time less one batch's.)")
    if device.type != "cuda":
        print("  (CPU: the raw copy is a host memcpy)")
    results = {"raw": {"d2h_gib_s": raw_d2h, "h2d_gib_s": raw_h2d}, "rows": rows}
    if args.json:
        common.write_json(args.json, NAME, settings, device, args.bench_argv, results)
    if args.plot:
        _plot(args.plot, rows, raw_d2h, raw_h2d, device)
    return 0


def _plot(
    path: str, rows: list[dict[str, Any]], raw_d2h: float, raw_h2d: float, device: torch.device
) -> None:
    def draw(axes: Any) -> None:
        labels = [f"{r['users']}x{r['tokens']}" for r in rows]
        x = range(len(rows))
        axes.plot(x, [r["offload_gib_s"] for r in rows], "o-", label="offload, one batch")
        axes.plot(x, [r["load_gib_s"] for r in rows], "s-", label="load, one batch")
        if rows and "stream_offload_gib_s" in rows[0]:
            axes.plot(x, [r["stream_offload_gib_s"] for r in rows], "o--", color="C0",
                      alpha=0.6, label="offload, steady stream")
            axes.plot(x, [r["stream_load_gib_s"] for r in rows], "s--", color="C1",
                      alpha=0.6, label="load, steady stream")
        axes.axhline(raw_d2h, linestyle="--", color="C0", label="raw D2H")
        axes.axhline(raw_h2d, linestyle=":", color="C1", label="raw H2D")
        axes.set_xticks(list(x), labels, rotation=45, ha="right")
        axes.set_xlabel("users x tokens")
        axes.set_ylabel("GiB/s")
        axes.legend()

    common.save_plot(path, f"aiokv engine bandwidth ({device})", draw)


__all__ = ["HELP", "NAME", "Settings", "add_arguments", "raw_copy_gib_s", "run"]
