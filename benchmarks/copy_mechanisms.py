"""Candidate data-plane mechanisms for aiokv's embedded store (issue 34), each measured
alone and beside the same model stand-in as ``aiokv bench model``, in one run.

A batch is ``--users`` x ``--tokens`` of scattered GPU pages (``--placement random``:
any page anywhere, as ``aiokv bench bandwidth`` places them; ``user``: each user's pages
adjacent) moved into host blocks ``0..n-1`` of a pinned pool (``--host-layout block``:
aiokv's pool today, ``[block, layer, ...]``; ``layer``: ``[layer, block, ...]``, where
adjacent pages of a layer coalesce into one copy), then back into other pages. The
mechanisms are described in ``copy_movers.py``: a (today's gather + staging copy),
b (one torch copy per run), c (the same through cuda.bindings), d (one
``cuMemcpyBatchAsync``), e (a copy kernel with 4, 8, 16 blocks over the pinned pool's
device address); ``reference`` is plain 256 MiB copies of one buffer, the copy engines'
rate. Every mechanism runs on a thread of its own, never the model's, on streams of its
own (``--high-priority``: high-priority streams, whose kernels' blocks go ahead of the
model's queued ones).

Before it is timed, each mechanism moves the batch out and back once and the bytes are
checked: the pool holds exactly the source pages, the target pages exactly their bytes,
every other page is untouched. A mechanism that fails the check, or raises, reports
"FAILED: why" and no number; one that cannot run here reports "skipped: why".

Per mechanism: copies per batch each way, GiB/s each way alone (the model idle), and at
each ``--depth`` the GiB/s beside the model and the model's slowdown (beside / alone, each
beside run right after an alone run, median of ``--repeats``).

    python benchmarks/copy_mechanisms.py [--quick] [--json out.json]    # ~3 min on an H200
    python benchmarks/copy_mechanisms.py --device cpu                   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from copy_movers import (
    BatchCopy,
    BindingsRuns,
    Gather,
    Kernel,
    Mechanism,
    Pages,
    TorchRuns,
)
from copy_plans import LAYOUTS, Geometry

from aiokv.bench import common, standin
from aiokv.bench.beside import Beside, Rates, ReferenceCopier, Side, Unit, measure_copier
from aiokv.bench.standin import GIB, StandIn, depth_name, parse_depths


@dataclass(frozen=True)
class Settings(standin.BesideSettings):
    repeats: int = 2
    placement: str = "random"
    host_layout: str = "block"
    kernel_blocks: tuple[int, ...] = (4, 8, 16)
    only: str = ""
    high_priority: bool = False
    seed: int = common.or_zero(0)


QUICK: dict[str, object] = {"users": 8, "tokens": 1024, "model_s": 0.5, "alone_s": 0.5,
                            "repeats": 1}
CPU: dict[str, object] = {**QUICK, **standin.SMOKE}
HELPS = {
    **standin.HELPS,
    "alone_s": "seconds each mechanism runs with the model idle",
    "placement": "random: pages anywhere; user: each user's pages adjacent",
    "host_layout": f"host pool layout, one of {LAYOUTS} (block: aiokv's today)",
    "kernel_blocks": "thread blocks of the copy kernels (one mechanism each)",
    "only": "comma-separated mechanism names or prefixes to run (e.g. ref,a,d,e-kernel-8)",
    "high_priority": "the mechanisms' streams at high priority (their kernels' blocks go "
    "ahead of the model's queued ones)",
    "device": "cpu: a smoke run at tiny sizes (mechanisms a and b only)",
}


class CheckFailed(RuntimeError):
    pass


class Batch:
    """The caches, the pool, and one batch's page ids: ``src`` (offloaded) and ``dst``
    (loaded into), disjoint, on the device."""

    def __init__(self, s: Settings, device: torch.device) -> None:
        if s.tokens % s.page_size:
            raise SystemExit(f"--tokens {s.tokens} is not a multiple of --page-size {s.page_size}")
        if s.placement not in ("random", "user"):
            raise SystemExit(f"--placement must be random or user, got {s.placement!r}")
        each = s.tokens // s.page_size
        n = s.users * each
        num_pages = 2 * n + n // 4 + each
        dtype = torch.bfloat16
        generator = torch.Generator().manual_seed(s.seed)
        filler = torch.Generator(device=device).manual_seed(s.seed)
        self.caches = common.make_caches(s.layers, num_pages, s.page_size, s.heads, s.head_dim,
                                         dtype, device)
        for cache in self.caches:
            cache.normal_(generator=filler)
        page_shape = tuple(self.caches[0].shape[1:])
        page_bytes = self.caches[0][0].numel() * self.caches[0].element_size()
        geometry = Geometry(s.layers, page_bytes, n, s.host_layout)
        lead = (n, s.layers) if s.host_layout == "block" else (s.layers, n)
        pool = torch.zeros(lead + page_shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.pages = Pages(self.caches, pool, geometry)
        if s.placement == "random":
            order = torch.randperm(num_pages, generator=generator)
            src, dst = order[:n], order[n:2 * n]
        else:
            slots = torch.randperm(num_pages // each, generator=generator)[: 2 * s.users]
            spans = [torch.arange(slot * each, (slot + 1) * each) for slot in slots.tolist()]
            src, dst = torch.cat(spans[: s.users]), torch.cat(spans[s.users:])
        self.src, self.dst = src.to(device), dst.to(device)
        self.nbytes = n * s.layers * page_bytes
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def check(self, mechanism: Mechanism) -> None:
        """Out and back once; raise CheckFailed unless every byte is where it belongs."""
        before = [cache.clone() for cache in self.caches]
        self.pages.pool.zero_()
        for cache in self.caches:
            cache.index_fill_(0, self.dst, 0)
        mechanism.move(True, self.src)
        mechanism.finish()
        mechanism.move(False, self.dst)
        mechanism.finish()
        problems = []
        n = len(self.src)
        for layer, (cache, old) in enumerate(zip(self.caches, before, strict=True)):
            expected = old.clone()
            expected[self.dst] = old[self.src]
            bad = _differing(cache, expected)
            if bad:
                problems.append(f"layer {layer}: GPU pages {bad} differ")
            host = self.pages.pool_layer(layer, 0, n).to(cache.device)
            bad = _differing(host, old[self.src])
            if bad:
                problems.append(f"layer {layer}: host blocks {bad} differ")
        for cache, old in zip(self.caches, before, strict=True):
            cache.copy_(old)
        if problems:
            raise CheckFailed("; ".join(problems[:4]))


def _differing(got: torch.Tensor, want: torch.Tensor) -> str:
    """The first few page (or block) numbers whose bytes differ, or ''."""
    rows = (got.view(torch.int16) != want.view(torch.int16)).flatten(1).any(1)
    bad = rows.nonzero().flatten()[:5].tolist()
    return "" if not bad else f"{bad}{' ...' if int(rows.sum()) > len(bad) else ''}"


class MechanismCopier:
    """A mechanism as a copier for :class:`aiokv.bench.beside.Beside`: checked once,
    then a batch out and back per unit."""

    def __init__(self, mechanism: Mechanism, batch: Batch) -> None:
        self.mechanism = mechanism
        self.batch = batch
        self.copies: dict[str, int] = {}
        self._set_up = False

    def setup(self) -> None:
        self.mechanism.setup()
        self._set_up = True
        self.batch.check(self.mechanism)

    def unit(self) -> list[Unit]:
        units = []
        for kind, to_host, pages in (("offload", True, self.batch.src),
                                     ("load", False, self.batch.dst)):
            start = time.perf_counter()
            self.copies[kind] = self.mechanism.move(to_host, pages)
            self.mechanism.finish()
            units.append(Unit(kind, self.batch.nbytes, start, time.perf_counter()))
        return units

    def close(self) -> None:
        if self._set_up:
            self.mechanism.close()


def _wanted(s: Settings, name: str) -> bool:
    """Whether ``--only`` (empty: everything) names ``name`` or a prefix of it."""
    wanted = [w.strip() for w in s.only.split(",") if w.strip()]
    return not wanted or any(name.startswith(w) for w in wanted)


def _mechanisms(s: Settings, batch: Batch) -> list[Mechanism]:
    p = batch.pages
    priority = -1 if s.high_priority else 0
    found: list[Mechanism] = [
        kind(p, priority) for kind in (Gather, TorchRuns, BindingsRuns, BatchCopy)
    ]
    found += [Kernel(p, blocks, priority) for blocks in s.kernel_blocks]
    return [m for m in found if _wanted(s, m.name)]


def _row(name: str, copier: Any, model: StandIn, steps: int, depths: tuple[int, ...],
         s: Settings) -> dict[str, Any]:
    row: dict[str, Any] = {"mechanism": name, "status": "ok"}
    checked = isinstance(copier, MechanismCopier)
    try:
        alone, sides = measure_copier(Beside(copier, f"copy-{name}"), model, steps, depths,
                                      s.alone_s, s.repeats)
    except Exception as exc:  # one mechanism failing must not hide the others' figures
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        row["status"] = f"FAILED: {type(cause).__name__}: {cause}"
        print(f"{name}: {row['status']}", file=sys.stderr)
        return row
    row["copies"] = dict(copier.copies) if checked else {"offload": 1, "load": 1}
    row["status"] = "ok (bytes checked)" if checked else "ok"
    row["alone"] = _directions(alone)
    row["sides"] = [_side(side) for side in sides]
    return row


def _directions(rates: Rates) -> dict[str, float]:
    return {kind: rates.get(kind) for kind in ("offload", "load")}


def _side(side: Side) -> dict[str, Any]:
    return {"depth": depth_name(side.depth), "model_alone_s": side.model_alone_s,
            "model_beside_s": side.model_beside_s, "slowdown": side.slowdown,
            **{f"{k}_gib_s": v for k, v in _directions(side.rates).items()}}


def _pair(values: dict[str, float], fmt: str = "{:.1f}") -> str:
    return " / ".join("-" if math.isnan(values[k]) else fmt.format(values[k])
                      for k in ("offload", "load"))


def _print(rows: list[dict[str, Any]], depths: tuple[int, ...], s: Settings,
           batch: Batch, device: torch.device, model: str) -> None:
    headers = ["mechanism", "copies out / in", "alone GiB/s out / in"]
    for depth in depths:
        headers += [f"beside({depth_name(depth)}) GiB/s", f"slowdown({depth_name(depth)})"]
    headers.append("status")
    table = []
    for row in rows:
        if not row["status"].startswith("ok"):
            table.append([row["mechanism"]] + ["-"] * (len(headers) - 2) + [row["status"]])
            continue
        cells = [row["mechanism"], f"{row['copies']['offload']} / {row['copies']['load']}",
                 _pair(row["alone"])]
        for side in row["sides"]:
            cells += [_pair({k: side[f"{k}_gib_s"] for k in ("offload", "load")}),
                      f"{side['slowdown']:.3f}x"]
        table.append([*cells, row["status"]])
    g = batch.pages.geometry
    common.print_table(
        f"data-plane mechanisms on {device}: {s.users} users x {s.tokens} tokens, {s.layers} "
        f"layers, {s.heads} heads x {s.head_dim} bf16, page {s.page_size} "
        f"({g.page_bytes >> 10} KiB a page a layer; {batch.nbytes / GIB:.3g} GiB each way); "
        f"placement {s.placement}, host layout {s.host_layout}"
        f"{', high-priority streams' if s.high_priority else ''}; model: {model}",
        headers, table,
    )
    print("  (slowdown: the model's time beside / alone; depth all: every step queued at "
          "once, N: N steps then a host sync; '-': no batch finished inside the window)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write settings, environment, results")
    parser.add_argument("--quick", action="store_true", help="a smaller batch, shorter runs")
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)
    args = parser.parse_args(argv)
    cpu = standin.smoke_run(args.device)
    args.quick = args.quick or cpu
    with standin.one_thread(cpu):
        return _run(args, argv, common.settings_from_args(Settings, args, CPU if cpu else QUICK))


def _run(args: argparse.Namespace, argv: list[str] | None, s: Settings) -> int:
    if s.host_layout not in LAYOUTS:
        raise SystemExit(f"--host-layout must be one of {LAYOUTS}, got {s.host_layout!r}")
    try:
        depths = parse_depths(s.depth)
    except ValueError as exc:
        raise SystemExit(f"--{exc}") from None
    device = common.pick_device(s.device)
    batch = Batch(s, device)
    model = StandIn(device, s.matrix)
    steps = model.steps_for(s.model_s)
    rows = []
    if _wanted(s, "reference"):
        ref = ReferenceCopier(device, s.ref_mib << 20)
        rows.append(_row(f"reference {s.ref_mib} MiB", ref, model, steps, depths, s))
    for mechanism in _mechanisms(s, batch):
        why = mechanism.why_not()
        if why:
            print(f"{mechanism.name}: skipped: {why}", file=sys.stderr)
            rows.append({"mechanism": mechanism.name, "status": f"skipped: {why}"})
            continue
        copier = MechanismCopier(mechanism, batch)
        rows.append(_row(mechanism.name, copier, model, steps, depths, s))
    _print(rows, depths, s, batch, device, model.describe(steps))
    if args.json:
        common.write_json(args.json, "copy_mechanisms", s, device, argv,
                          {"steps": steps, "batch_gib": batch.nbytes / GIB, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Batch", "CheckFailed", "MechanismCopier", "Settings", "main"]
