"""Per-layer loading: a model that computes each layer as soon as its KV is in place
(``ll.wait_layer(i)``), against one that awaits the whole load and then computes.

The model is the stand-in of :mod:`aiokv.bench.standin` (square matmuls on the calling
thread's stream), one group of matmuls per layer, sized so that a layer's compute takes
about as long as a layer's share of the load (measured first): then the ideal layerwise
time is (n+1)/2n of the whole-load one for n layers. The engine runs through
``run_in_background`` (as a model thread uses it); ``--users`` loads go in one batch.
Each round clears the target pages first and checks the bytes after, outside the timing.

  whole      ``submit_load`` for every user, every result, then every layer's compute
  layerwise  ``submit_load_layerwise`` for every user; per layer, ``wait_layer(i)`` for
             every user, then the layer's compute
  layer 0    at ``--first-tokens``: from the calls to layer 0 in place for every user
             (``wait_layer(0)``, then a sync of the stream), next to the whole load's time

Printed, from one run, side by side (rounds alternate): the medians of ``--repeats``
rounds, layerwise / whole (target at most 0.65 at 8 users x 2048 tokens, 8 layers) and
layer 0's time (target at most 1 ms at 8 x 1024). Stores that mark layers only at the
end (README: per-layer loading) give about 1.0 and the whole load's time.
``--device cpu`` (or a box without CUDA) gives a smoke run at ``--quick`` sizes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import EngineConfig, StoreConfig
from ..engine import OffloadEngine
from ..handles import BackgroundLookup
from ..stores import make_store
from ..sync import BackgroundEngine, run_in_background
from . import common, standin
from .model import round_configs
from .standin import StandIn, one_thread, smoke_run

NAME = "layers"
HELP = "per-layer loading: compute after wait_layer(i) vs after the whole load, one run"


@dataclass(frozen=True)
class Settings:
    users: int = 8
    tokens: int = 2048
    first_tokens: int = 1024
    layers: int = 8
    heads: int = 8
    head_dim: int = 128
    page_size: int = 32
    matrix: int = 2048
    repeats: int = 9
    warmup: int = common.or_zero(2)
    config: str = ""
    device: str = "auto"
    switch_interval_us: int = common.or_zero(0)


QUICK: dict[str, object] = {
    "users": 4, "tokens": 64, "first_tokens": 32, "layers": 4, "heads": 2, "head_dim": 16,
    "page_size": 16, "matrix": 64, "repeats": 3, "warmup": 1,
}
HELPS = {
    "users": "loads per batch",
    "tokens": "tokens per user in the layerwise / whole rounds",
    "first_tokens": "tokens per user in the layer-0 rounds",
    "matrix": "the stand-in's matmul size (square); its step count per layer is measured",
    "repeats": "timed rounds of each kind (median)",
    "warmup": "untimed rounds of each kind first",
    "config": "YAML config whose store the engine runs on (its engine section too, less the "
    "batching); default: the embedded store, sized for the rounds",
    "device": "where the caches and the model live (cpu: a smoke run at --quick sizes)",
    "switch_interval_us": "sys.setswitchinterval for the whole run (0: Python's 5 ms): how "
    "long the engine's threads may wait for the GIL behind a thread running Python",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)


class Rounds:
    """The caches (every user's pages twice: where its KV was offloaded from, and where
    it is loaded to), the engine in the background, and the stand-in."""

    def __init__(
        self, s: Settings, device: torch.device, configs: tuple[EngineConfig, StoreConfig, int]
    ) -> None:
        engine_config, store_config, page_size = configs
        self.s, self.device, self.page_size = s, device, page_size
        pages_each = -(-s.tokens // page_size)
        total = 2 * s.users * pages_each
        self.caches = common.make_caches(
            s.layers, total, page_size, s.heads, s.head_dim, torch.bfloat16, device
        )
        for cache in self.caches:
            cache.normal_()
        # Scattered, as a serving cache's pages are; the first half offloads, the rest loads.
        order = torch.randperm(total, generator=torch.Generator().manual_seed(0)).to(device)
        runs = [order[i * pages_each : (i + 1) * pages_each] for i in range(2 * s.users)]
        self.sources, self.targets = runs[: s.users], runs[s.users :]
        self.model = StandIn(device, s.matrix)
        self.steps = 1  # matmuls per layer, set by calibrate()
        store = make_store(store_config)
        engine = OffloadEngine(store, self.caches, engine_config)
        self.kv: BackgroundEngine = run_in_background(engine)
        wait_pinned = getattr(store, "wait_pinned", None)
        if wait_pinned is not None:  # copies, not start-up: the host tier pinned first
            wait_pinned()
        self.model.sync()  # the caches are written on this thread's stream
        offloads = [self.kv.submit_offload(u, self.sources[u], s.tokens) for u in range(s.users)]
        for future in offloads:
            future.result()

    def close(self) -> None:
        self.kv.close()

    def _hits(self, tokens: int) -> list[BackgroundLookup]:
        hits = [f.result() for f in [self.kv.submit_lookup(u, tokens) for u in range(self.s.users)]]
        if any(hit.cached_tokens != tokens for hit in hits):
            raise RuntimeError(f"layers bench: a lookup of {tokens} tokens missed")
        for layer in self.caches:  # the bytes a load must bring back are gone
            for target in self.targets:
                layer[target] = 0
        self.model.sync()
        return hits

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _check(self, tokens: int) -> None:
        n = tokens // self.page_size
        for layer in self.caches:
            for source, target in zip(self.sources, self.targets, strict=True):
                if not torch.equal(layer[target[:n]], layer[source[:n]]):
                    raise RuntimeError("layers bench: a load's bytes differ from the offload's")

    def whole(self, tokens: int, compute: bool = True) -> float:
        """Seconds from the load calls to the last layer computed (or to the loads done)."""
        hits, n = self._hits(tokens), self._pages(tokens)
        start = time.perf_counter()
        futures = [self.kv.submit_load(h, t[:n]) for h, t in zip(hits, self.targets, strict=True)]
        for future in futures:
            future.result()
        if compute:
            for _ in range(self.s.layers):
                self.model.queue(self.steps)
        self.model.sync()
        took = time.perf_counter() - start
        self._check(tokens)
        return took

    def layerwise(self, tokens: int, first_only: bool = False) -> float:
        """Seconds from the load calls to the last layer computed after its wait_layer
        (``first_only``: to layer 0 in place for every user, nothing computed)."""
        hits, n = self._hits(tokens), self._pages(tokens)
        start = time.perf_counter()
        futures = [
            self.kv.submit_load_layerwise(h, t[:n]) for h, t in zip(hits, self.targets, strict=True)
        ]
        loads = [future.result() for future in futures]
        for layer in range(1 if first_only else self.s.layers):
            for load in loads:
                load.wait_layer(layer)
            if not first_only:
                self.model.queue(self.steps)
        self.model.sync()
        took = time.perf_counter() - start
        for load in loads:
            load.result()
        self._check(tokens)
        return took

    def calibrate(self) -> tuple[float, float]:
        """Size a layer's compute to a layer's share of the load: (load s, compute s)."""
        load_s = statistics.median(self.whole(self.s.tokens, compute=False) for _ in range(3))
        self.steps = self.model.steps_for(load_s / self.s.layers)
        return load_s, statistics.median(self._compute() for _ in range(3))

    def _compute(self) -> float:
        self.model.sync()
        start = time.perf_counter()
        self.model.queue(self.steps * self.s.layers)
        self.model.sync()
        return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    smoke = smoke_run(args.device)
    args.quick = args.quick or smoke  # a smoke run: the full sizes are a GPU's
    with one_thread(smoke):
        return _run(args)


def _side_by_side(
    calls: dict[str, Callable[[], float]], warmup: int, repeats: int
) -> dict[str, float]:
    """Median seconds of each call, the calls alternating round by round."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(call())
    return {name: statistics.median(t) for name, t in times.items()}


def _run(args: argparse.Namespace) -> int:
    s = common.settings_from_args(Settings, args, QUICK)
    if not 0 < s.first_tokens <= s.tokens:
        raise SystemExit(f"--first-tokens must be in [1, --tokens], got {s.first_tokens}")
    device = common.pick_device(s.device)
    common.check_round_fits(s, device, store=not s.config,
                            extra=standin.host_bytes(s.matrix, device), sized_too=("matrix",))
    configs = round_configs(s)
    with common.switch_interval(s.switch_interval_us):
        return _measure(args, s, device, configs)


def _measure(
    args: argparse.Namespace, s: Settings, device: torch.device,
    configs: tuple[EngineConfig, StoreConfig, int],
) -> int:
    rounds = Rounds(s, device, configs)
    try:
        load_s, compute_s = rounds.calibrate()
        main = _side_by_side(
            {"whole": lambda: rounds.whole(s.tokens),
             "layerwise": lambda: rounds.layerwise(s.tokens)},
            s.warmup, s.repeats,
        )
        first = _side_by_side(
            {"load": lambda: rounds.whole(s.first_tokens, compute=False),
             "layer0": lambda: rounds.layerwise(s.first_tokens, first_only=True)},
            s.warmup, s.repeats,
        )
    finally:
        rounds.close()
    results: dict[str, Any] = {
        "load_s": load_s, "compute_s": compute_s, "steps_per_layer": rounds.steps,
        "whole_s": main["whole"], "layerwise_s": main["layerwise"],
        "ratio": main["layerwise"] / main["whole"], "ideal": (s.layers + 1) / (2 * s.layers),
        "first_load_s": first["load"], "layer0_s": first["layer0"],
        "store": configs[1].backend, "page_size": configs[2],
    }
    _print(results, s, device)
    if args.json:
        common.write_json(args.json, NAME, s, device, args.bench_argv, results)
    if args.plot:
        _plot(args.plot, results, device)
    return 0


def _print(r: dict[str, Any], s: Settings, device: torch.device) -> None:
    common.print_table(
        f"per-layer loading on {device}, {r['store']} store: {s.users} users, {s.layers} layers "
        f"({s.heads} heads x {s.head_dim}, page {r['page_size']}); each layer's compute "
        f"{r['steps_per_layer']} x {s.matrix}^2 matmuls",
        ["round", "tokens", "median ms"],
        [
            ["load alone (calibration)", s.tokens, r["load_s"] * 1e3],
            ["compute alone, all layers", "-", r["compute_s"] * 1e3],
            ["whole: load, then compute", s.tokens, r["whole_s"] * 1e3],
            ["layerwise: wait_layer(i), compute", s.tokens, r["layerwise_s"] * 1e3],
            ["load alone", s.first_tokens, r["first_load_s"] * 1e3],
            ["layer 0 in place", s.first_tokens, r["layer0_s"] * 1e3],
        ],
    )
    print(
        f"  layerwise / whole: {r['ratio']:.3f}x (ideal (n+1)/2n = {r['ideal']:.3f}; target "
        f"<= 0.65 at 8 x 2048, 8 layers)\n  layer 0 in place {r['layer0_s'] * 1e3:.3f} ms "
        f"after the calls at {s.users} x {s.first_tokens} (target <= 1 ms; the whole load "
        f"{r['first_load_s'] * 1e3:.3f} ms)"
    )


def _plot(path: str, r: dict[str, Any], device: torch.device) -> None:
    def draw(axes: Any) -> None:
        names = ["whole", "layerwise", "load (first)", "layer 0"]
        values = [r["whole_s"], r["layerwise_s"], r["first_load_s"], r["layer0_s"]]
        axes.bar(names, [v * 1e3 for v in values])
        axes.set_ylabel("ms (median)")

    common.save_plot(path, f"per-layer loading ({device})", draw)


__all__ = ["HELP", "NAME", "Rounds", "Settings", "add_arguments", "run"]
