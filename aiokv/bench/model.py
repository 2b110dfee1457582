"""What offloading costs a model that runs beside it, and what the model costs the offloads.

The model is a stand-in (:mod:`aiokv.bench.standin`: bf16 8192 x 8192 matmuls launched
from the main thread, ``--depth`` at a time, or all queued at once). Beside it, on a
thread of its own, a copier runs without pause:

  reference  plain copies of one contiguous buffer (``--ref-mib``), device -> pinned
             host, then back, on a stream of its own: the copy engines' rate, and what
             copies that use no SMs cost the model;
  shaped     the engine's copy shape without the engine: a round's pages, at random,
             one copy per page and layer by ``cuMemcpyBatchAsync`` (CUDA 12.8+), to
             pinned host memory and back: of the engine's gap to the reference, what
             its copy shape costs (the rest is its control path);
  engine     the aiokv engine on the store of ``--config`` (the embedded store by
             default; ``own_process: true`` or FlexKV through the config) doing rounds of
             ``--users`` x ``--tokens``: every user offloads a fresh history, looks it up
             and loads it back into other pages (offloads and loads each timed from the
             first submit to the last result). The callers' ready events are recorded on
             a stream of the copier thread's own, never on the model's.

For each depth and copier: the model's time alone and beside it (median of
``--repeats``, each beside run right after an alone run), the slowdown (beside / alone),
and the copier's GiB/s each way while the model ran, with the engine's as a fraction of
the reference's. Each copier's rates with the model idle come first. ``--device cpu``
(or a box without CUDA) gives a smoke run at ``--quick`` sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config import EngineConfig, StoreConfig
from ..copy.driver import batch_entry
from ..engine import OffloadEngine
from ..errors import ConfigError
from ..open import read_config
from ..stores import make_store
from . import common, standin
from .beside import Beside, Rates, ReferenceCopier, ShapedCopier, Side, Unit, measure_copier
from .rounds import IDS, PLACEMENTS, _round
from .standin import GIB, StandIn, depth_name, one_thread, parse_depths, smoke_run

NAME = "model"
HELP = "a model stand-in's slowdown beside the engine's offloads and loads, vs plain copies"


@dataclass(frozen=True)
class Settings(standin.BesideSettings):
    warmup: int = common.or_zero(2)
    config: str = ""
    placement: str = field(default="scattered", metadata={"choices": PLACEMENTS})
    switch_interval_us: int = common.or_zero(0)
    ids: str = field(default="device", metadata={"choices": IDS})
    ahead_mib: int = common.or_zero(0)


QUICK: dict[str, object] = {**standin.SMOKE, "warmup": 1}
HELPS = {
    **standin.HELPS,
    "users": "users per engine round",
    "warmup": "untimed engine rounds first",
    "config": "YAML config whose store the engine runs on (its engine section too, less the "
    "batching, which the rounds set); default: the embedded store, sized for the rounds",
    "placement": "the users' pages: 'scattered' at random or 'runs' (each user's adjacent, "
    "as a fresh allocator hands them out)",
    "ids": "where the rounds' page ids are: 'device' tensors, which the store brings to "
    "the host first, or 'host' (CPU) tensors, as a host-side page allocator has them",
    "switch_interval_us": "sys.setswitchinterval for the whole run (0: Python's 5 ms): how long "
    "the model's thread may wait for the GIL that an engine thread holds",
    "ahead_mib": "MiB of an engine offload queued on the copy engines at once (0: aiokv's "
    "own, 64; more than a round's bytes: offloads unpaced): what pacing costs the engine",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)


class EngineCopier:
    """Engine rounds on an event loop of the copier thread's own; callers on a stream of
    their own."""

    def __init__(
        self,
        settings: Settings,
        device: torch.device,
        engine_config: EngineConfig,
        store_config: StoreConfig,
        page_size: int,
    ) -> None:
        self._settings = settings
        self._device = device
        self._engine_config = engine_config
        self._store_config = store_config
        self._page_size = page_size
        dtype = torch.bfloat16
        self._per_token = common.bytes_per_token(
            settings.layers, settings.heads, settings.head_dim, dtype
        )
        pages_each = -(-settings.tokens // page_size)
        # Slack, so random placement scatters the pages instead of filling them in order.
        self._pages = settings.users * pages_each * 2
        self._caches = common.make_caches(
            settings.layers, self._pages, page_size, settings.heads, settings.head_dim,
            dtype, device,
        )
        for cache in self._caches:
            cache.normal_()
        if device.type == "cuda":  # filled on this thread's stream, used on the copier's
            torch.cuda.synchronize(device)
        self._names = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: OffloadEngine | None = None

    def setup(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_stream(torch.cuda.Stream(self._device))  # type: ignore[no-untyped-call]
        try:
            import uvloop

            self._loop = uvloop.new_event_loop()
        except ImportError:
            self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        store = make_store(self._store_config)
        self._engine = OffloadEngine(store, self._caches, self._engine_config)
        self._loop.run_until_complete(self._engine.start())
        wait_pinned = getattr(store, "wait_pinned", None)
        if wait_pinned is not None:  # copies, not start-up: the host tier pinned first
            wait_pinned()
        for _ in range(self._settings.warmup):
            self.unit()

    def unit(self) -> Sequence[Unit]:
        assert self._loop is not None and self._engine is not None
        s = self._settings
        start = time.perf_counter()
        offload_s, load_s, stored, loaded = self._loop.run_until_complete(
            _round(self._engine, self._pages, 1, s.users, s.tokens, self._page_size,
                   self._device, self._names, s.placement, s.ids)
        )
        end = time.perf_counter()
        if loaded != stored:
            raise RuntimeError(f"model bench: stored {stored} tokens, loaded {loaded}")
        return [Unit("offload", stored * self._per_token, start, start + offload_s),
                Unit("load", loaded * self._per_token, end - load_s, end)]

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if self._engine is not None:
                self._loop.run_until_complete(self._engine.aclose())
        finally:
            self._loop.close()


class RoundSettings(Protocol):
    """What :func:`round_configs` reads of a bench's settings (this one's, and
    ``aiokv bench layers``')."""

    @property
    def config(self) -> str: ...
    @property
    def users(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def page_size(self) -> int: ...


def round_configs(settings: RoundSettings) -> tuple[EngineConfig, StoreConfig, int]:
    """The engine and store configs for rounds of ``users`` x ``tokens`` (bf16), and the
    page size of the caches."""
    s = settings
    if s.config:
        engine_config, store_config = read_config(s.config)
        page_size = store_config.page_size or s.page_size
        _check_holds_a_round(s, store_config, page_size)
    else:
        engine_config, page_size = EngineConfig(), s.page_size
        per_token = common.bytes_per_token(s.layers, s.heads, s.head_dim, torch.bfloat16)
        batch_gib = s.users * s.tokens * per_token / GIB
        store_config = StoreConfig(cpu_cache_gb=max(3 * batch_gib, 0.01), page_size=page_size)
    # One store round per batch (the request count closes the window, never the clock).
    engine_config = dataclasses.replace(
        engine_config,
        window_us=10_000_000,
        max_batch_requests=s.users,
        max_batch_tokens=s.users * s.tokens,
        max_pending=max(4 * s.users, engine_config.max_pending),
    )
    return engine_config, store_config, page_size


def _check_holds_a_round(s: RoundSettings, store_config: StoreConfig, page_size: int) -> None:
    """ConfigError unless the config's tiers hold one round's pages (every user's at once):
    a smaller store made the round's lookups miss, or its offloads wait for room until
    StoreFull, each a traceback once the run had begun. A store server's tiers are the
    server's, unknown here."""
    if store_config.backend == "shared":
        return
    block = common.bytes_per_token(s.layers, s.heads, s.head_dim, torch.bfloat16) * page_size
    gib = store_config.cpu_cache_gb + store_config.ssd_cache_gb
    blocks = int(gib * GIB // block)
    needed = s.users * (s.tokens // page_size)  # only full pages are stored
    if needed > blocks:
        raise ConfigError(
            "store.cpu_cache_gb",
            f"the config's tiers ({gib:g} GiB) hold {blocks} blocks of {block} bytes; a "
            f"round of --users {s.users} x --tokens {s.tokens} needs {needed}: give the "
            "store more, or ask for less",
        )


def _store_name(store_config: StoreConfig) -> str:
    where = "its own process" if store_config.in_own_process() else "this process"
    return f"{store_config.backend} store in {where}"


def shaped_copier(settings: Settings, device: torch.device, page_size: int) -> Beside | None:
    """The shaped copier for these rounds, where the driver has the batch call."""
    if device.type != "cuda" or batch_entry()[0] is None:
        return None
    page_bytes = common.bytes_per_token(1, settings.heads, settings.head_dim,
                                        torch.bfloat16) * page_size
    pages = settings.users * -(-settings.tokens // page_size)
    return Beside(ShapedCopier(device, settings.layers, pages, page_bytes), "aiokv-bench-shaped")


def run(args: argparse.Namespace) -> int:
    smoke = smoke_run(args.device)
    args.quick = args.quick or smoke  # a smoke run: the full sizes are a GPU's
    with one_thread(smoke):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    settings = common.settings_from_args(Settings, args, QUICK)
    device = common.pick_device(settings.device)
    depths = parse_depths(settings.depth)  # --depth took it (standin.depth_flag)
    # A --config's store was checked where it was read; without one it holds 3 rounds.
    common.check_round_fits(settings, device, store=not settings.config,
                            extra={**standin.host_bytes(settings.matrix, device),
                                   **ReferenceCopier.host_bytes(settings.ref_mib << 20, device)},
                            sized_too=("matrix", "ref_mib"))
    engine_config, store_config, page_size = round_configs(settings)
    model = StandIn(device, settings.matrix)
    steps = model.steps_for(settings.model_s)
    copiers = {
        "reference": Beside(ReferenceCopier(device, settings.ref_mib << 20), "aiokv-bench-ref")}
    shaped = shaped_copier(settings, device, page_size)
    if shaped is not None:
        copiers["shaped"] = shaped
    copiers["engine"] = Beside(
        EngineCopier(settings, device, engine_config, store_config, page_size),
        "aiokv-bench-engine",
    )
    measured: dict[str, tuple[Rates, list[Side]]] = {}
    failed: dict[str, str] = {}
    with common.switch_interval(settings.switch_interval_us), \
            common.offloads_ahead(settings.ahead_mib):
        for name, copier in copiers.items():
            try:
                measured[name] = measure_copier(copier, model, steps, depths,
                                                settings.alone_s, settings.repeats)
            except RuntimeError as exc:
                if name != "shaped":
                    raise
                # A reference of the bench's own: its failure must not cost the others.
                failed[name] = str(exc)
                print(f"the shaped copier failed and is left out: {exc}", file=sys.stderr)
    results = _results(measured, depths)
    if failed:
        results["failed"] = failed
    _print(results, settings, device, model.describe(steps), store_config, page_size)
    if args.json:
        results["model"] = {"steps": steps, "matrix": settings.matrix, "page_size": page_size,
                            "store": _store_name(store_config)}
        common.write_json(args.json, NAME, settings, device, args.bench_argv, results)
    if args.plot:
        _plot(args.plot, results["rows"], device)
    return 0


def _plot(path: str, rows: list[dict[str, Any]], device: torch.device) -> None:
    def draw(axes: Any) -> None:
        labels = [f"{r['copier']}, depth {r['depth']}" for r in rows]
        axes.bar(range(len(rows)), [r["slowdown"] for r in rows])
        axes.axhline(1.0, linestyle="--", color="gray")
        axes.set_xticks(list(range(len(rows))), labels, rotation=30, ha="right")
        axes.set_ylabel("model time beside / alone")

    common.save_plot(path, f"model stand-in slowed by copies ({device})", draw)


def _results(
    measured: dict[str, tuple[Rates, list[Side]]], depths: Sequence[int]
) -> dict[str, Any]:
    ref_alone, ref_sides = measured["reference"]
    alone = {name: {k: r.get(k) for k in ("offload", "load")} for name, (r, _) in measured.items()}
    alone["engine_of_reference"] = {
        k: alone["engine"][k] / ref_alone.get(k) for k in ("offload", "load")
    }
    rows = []
    for i, depth in enumerate(depths):
        for name, (_, sides) in measured.items():
            side = sides[i]
            row: dict[str, Any] = {
                "depth": depth_name(depth), "copier": name,
                "model_alone_s": side.model_alone_s, "model_beside_s": side.model_beside_s,
                "slowdown": side.slowdown, "model_in_launches": side.launching,
            }
            for kind in ("offload", "load"):
                row[f"{kind}_gib_s"] = side.rates.get(kind)
                row[f"{kind}_of_reference"] = side.rates.get(kind) / ref_sides[i].rates.get(kind)
                row[f"{kind}_units"] = side.rates.units.get(kind, 0)
            rows.append(row)
    return {"alone": alone, "rows": rows}


def _or_dash(value: float, fmt: str | None = None) -> str:
    """A figure, or '-' where none was measured (no unit done inside the window)."""
    if math.isnan(value):
        return "-"
    return common.format_cell(value) if fmt is None else fmt.format(value)


def _print(
    results: dict[str, Any],
    settings: Settings,
    device: torch.device,
    model: str,
    store_config: StoreConfig,
    page_size: int,
) -> None:
    s = settings
    per_token = common.bytes_per_token(s.layers, s.heads, s.head_dim, torch.bfloat16)
    alone = results["alone"]
    print(
        f"copies with the model idle: reference offload {alone['reference']['offload']:.1f} "
        f"load {alone['reference']['load']:.1f} GiB/s; engine offload "
        f"{alone['engine']['offload']:.1f} load {alone['engine']['load']:.1f} GiB/s "
        f"({alone['engine_of_reference']['offload']:.0%} / "
        f"{alone['engine_of_reference']['load']:.0%} of the reference)\n"
    )
    headers = ["depth", "copier", "model alone s", "beside s", "slowdown", "in launches",
               "offload GiB/s", "load GiB/s", "of reference (offload / load)"]
    table = [
        [r["depth"], r["copier"], r["model_alone_s"], r["model_beside_s"],
         f"{r['slowdown']:.3f}x", _or_dash(r["model_in_launches"], "{:.0%}"),
         _or_dash(r["offload_gib_s"]), _or_dash(r["load_gib_s"]),
         f"{_or_dash(r['offload_of_reference'], '{:.0%}')} / "
         f"{_or_dash(r['load_of_reference'], '{:.0%}')}"]
        for r in results["rows"]
    ]
    common.print_table(
        f"model stand-in on {device}: {model}; engine rounds of {s.users} users x {s.tokens} "
        f"tokens ({s.users * s.tokens * per_token / GIB:.3g} GiB each way; {s.layers} layers, "
        f"{s.heads} heads x {s.head_dim}, page {page_size}) on the "
        f"{_store_name(store_config)}; reference: {s.ref_mib} MiB copies",
        headers,
        table,
    )
    print("  (slowdown: the model's time beside the copier / alone; depth all: every step "
          "queued at once, N: N steps then a host sync; in launches: of the model's time "
          "beside, its thread's inside launch calls, which block while its work queue on the "
          "device is full; GiB/s: the units done wholly while the model ran)")


__all__ = [
    "HELP", "NAME", "EngineCopier", "RoundSettings", "Settings", "add_arguments", "round_configs",
    "run",
]
