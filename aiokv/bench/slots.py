"""Slot mapping for a batch: the fused path against two ways without it, and against
this machine's floor, one plain copy of the batch's page ids to the host.

Each user holds 1024-4096 tokens (random) in random pages of ``page_size``. A batch must
end as host int64 slots (``page * page_size + offset``) of every used page of every
user, one array (a view is fine) per user.

  fused     FlexKV's launch path: aiokv.copy.fused.fuse_page_ids (one concat and
            one expansion on the device, one write into pinned memory), the wait for
            it (FusedPages.wait_slots), the check of every page id (bad_requests), then
            the per-user views (FusedPages.split). On the current stream; the store
            runs it on a copy stream made to wait for each request's event, a few more
            CUDA calls per launch that are not timed here.
  per-user  (a-np) one .cpu() of each user's used page ids and a numpy expansion.
  CSR loop  (b-np) one bulk copy of every user's used page ids, then a numpy loop.
  copy      one ``.cpu()`` of the batch's page ids, already concatenated on the device:
            no method that brings page ids to the host can beat it, so ``fused / copy``
            is how close the fused path comes to this machine's limit.

A second, secondary table repeats each method with every user's store mask applied
(the slots FlexKV is given; here a put's mask, a suffix of whole pages). fused+mask
fuses the page views the engine hands the store (each user's masked pages, a slice); the
others select each user's masked slots on the host.

Page ids are not range-checked by the baselines. Each timing wraps a complete,
host-visible result (the device is synchronized before it starts); median of repeats;
all methods must agree before any is timed. On CUDA when present; on the CPU this is a
smoke test. The project's comparison with NVIDIA's recommender examples, and its
targets, are in benchmarks/slots_recsys.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import flags
from ..copy.fused import FusedPages, fuse_page_ids
from ..stores.base import BoolArray, Int64Array
from . import common

NAME = "slots"
HELP = "fused slot mapping vs per-user copies, a bulk copy + loop, and one plain copy"


@dataclass(frozen=True)
class Settings:
    users: tuple[int, ...] = (8, 64, 256)
    min_tokens: int = 1024
    max_tokens: int = 4096
    page_size: int = 32
    repeats: int = 50
    warmup: int = common.or_zero(5)
    seed: int = common.or_zero(0)
    device: str = "auto"


QUICK: dict[str, object] = {"repeats": 5, "warmup": 1}
HELPS = {
    "users": "users per batch, one row each",
    "min_tokens": "fewest tokens of a user",
    "max_tokens": "most tokens of a user",
    "page_size": "tokens per page",
    "repeats": "timed repeats per method (median reported)",
    "warmup": "untimed repeats first",
    "seed": "random seed",
    "device": "where the page ids live",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_settings_arguments(parser, Settings, QUICK, HELPS)


@dataclass
class Batch:
    """One batch's inputs: per-user page ids on the device, pages to map, masks."""

    page_ids: list[torch.Tensor]
    pages_used: list[int]
    masks: list[BoolArray]
    csr: torch.Tensor  # every user's used pages, concatenated on the device
    offsets: list[int]  # host offsets into csr, one more than users
    indptr: torch.Tensor  # the same offsets on csr's device, as serving code holds them
    page_size: int
    arange: Int64Array  # 0..page_size-1 for the baselines' expansion, made once
    num_pages: int  # page ids are below this (the fused path checks them, as the worker)


def make_batch(
    users: int, settings: Settings, device: torch.device, rng: np.random.Generator
) -> Batch:
    tokens = rng.integers(settings.min_tokens, settings.max_tokens + 1, size=users)
    page_size = settings.page_size
    pages_used = [int(t) // page_size for t in tokens]
    pool = torch.randperm(sum(pages_used) * 2, device=device)
    page_ids, start = [], 0
    masks = []
    for used, count in zip(pages_used, tokens.tolist(), strict=True):
        page_ids.append(pool[start : start + -(-count // page_size)].clone())
        start += -(-count // page_size)
        # A put's mask: a suffix of whole pages after some already-stored prefix.
        mask = np.zeros(used * page_size, dtype=np.bool_)
        mask[int(rng.integers(0, used)) * page_size :] = True
        masks.append(mask)
    csr = torch.cat([ids[:used] for ids, used in zip(page_ids, pages_used, strict=True)])
    offsets = np.concatenate(([0], np.cumsum(pages_used))).tolist()
    arange = np.arange(page_size, dtype=np.int64)
    indptr = torch.tensor(offsets, dtype=torch.int64, device=device)
    return Batch(
        page_ids, pages_used, masks, csr, offsets, indptr, page_size, arange, len(pool)
    )


def _expand(pages: Int64Array, batch: Batch) -> Int64Array:
    return (pages[:, None] * batch.page_size + batch.arange).reshape(-1)


# ---- headline: every used page's slots, per user ------------------------------------


def _fused_slots(batch: Batch) -> tuple[FusedPages, Int64Array]:
    """As the store thread takes a batch: fuse, wait for the slots, check every page id."""
    used = zip(batch.page_ids, batch.pages_used, strict=True)
    pages = fuse_page_ids([ids[:n] for ids, n in used], None, batch.page_size)
    slots = pages.wait_slots(batch.page_size)
    if len(pages.bad_requests(slots, batch.num_pages, batch.page_size)):
        raise RuntimeError("the fused path found a page id out of range")
    return pages, slots


def fused(batch: Batch) -> list[Int64Array]:
    pages, slots = _fused_slots(batch)
    return pages.split(slots, batch.page_size)


def per_user_copy_np(batch: Batch) -> list[Int64Array]:
    """(a-np): one .cpu() of each user's used page ids, numpy expansion."""
    return [
        _expand(ids[:used].cpu().numpy(), batch)
        for ids, used in zip(batch.page_ids, batch.pages_used, strict=True)
    ]


def csr_loop_np(batch: Batch) -> list[Int64Array]:
    """(b-np): one bulk copy, then a numpy loop."""
    host = batch.csr.cpu().numpy()
    offsets = batch.offsets
    return [_expand(host[offsets[i] : offsets[i + 1]], batch) for i in range(len(offsets) - 1)]


# ---- secondary: the same with each user's store mask applied ------------------------


def fused_mask(batch: Batch) -> list[Int64Array]:
    size = batch.page_size
    views = []  # as the engine hands them to the store: each user's masked pages, a slice
    for ids, used, mask in zip(batch.page_ids, batch.pages_used, batch.masks, strict=True):
        first = int(mask[::size].argmax())
        views.append(ids[first:used])
    pages = fuse_page_ids(views, None, size)
    return pages.split(pages.wait_slots(size), size)


def per_user_copy_mask(batch: Batch) -> list[Int64Array]:
    return [
        _expand(ids[:used].cpu().numpy(), batch)[mask]
        for ids, used, mask in zip(batch.page_ids, batch.pages_used, batch.masks, strict=True)
    ]


def csr_loop_mask(batch: Batch) -> list[Int64Array]:
    host = batch.csr.cpu().numpy()
    offsets = batch.offsets
    return [
        _expand(host[offsets[i] : offsets[i + 1]], batch)[mask]
        for i, mask in enumerate(batch.masks)
    ]


def plain_copy(batch: Batch) -> Int64Array:
    """The floor: one copy of the batch's page ids to the host, nothing else."""
    host: Int64Array = batch.csr.cpu().numpy()
    return host


Method = Callable[[Batch], list[Int64Array]]
METHODS: dict[str, Method] = {
    "fused": fused,
    "per_user_np": per_user_copy_np,
    "csr_loop_np": csr_loop_np,
}
MASKED: dict[str, Method] = {
    "fused_mask": fused_mask,
    "per_user_mask": per_user_copy_mask,
    "csr_loop_mask": csr_loop_mask,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_method(
    method: Callable[[Batch], object], batch: Batch, device: torch.device,
    settings: Settings,
) -> float:
    """Median seconds of one complete call (host-visible results)."""
    times = []
    for i in range(settings.warmup + settings.repeats):
        _sync(device)
        start = time.perf_counter()
        method(batch)
        _sync(device)
        if i >= settings.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_slots(batch: Batch, methods: Mapping[str, Method], masked: bool = False) -> None:
    """Every method must give every used page's slots (``masked``: their masked part), as
    (b-np) computes them plainly on the host, or the timings compare nothing."""
    reference = csr_loop_np(batch)
    if masked:
        reference = [slots[mask] for slots, mask in zip(reference, batch.masks, strict=True)]
    for name, method in methods.items():
        got = method(batch)
        if len(got) != len(reference) or any(
            not np.array_equal(a, b) for a, b in zip(got, reference, strict=True)
        ):
            raise RuntimeError(f"slots bench: {name} gives the wrong slots")


def settings_of(args: argparse.Namespace) -> Settings:
    settings = common.settings_from_args(Settings, args, QUICK)
    if not 0 < settings.min_tokens <= settings.max_tokens:
        raise SystemExit("--min-tokens must be > 0 and <= --max-tokens")
    if settings.min_tokens < settings.page_size:
        raise SystemExit("--min-tokens must be at least one page")
    # A batch holds a put mask (a byte) and expanded slots (an int64) per token of its
    # users' full pages, and tensors of its own per user: at least this many of each.
    users = max(settings.users)
    tokens = settings.min_tokens // settings.page_size * settings.page_size
    flags.check_fits(
        f"--users {users}, --min-tokens {settings.min_tokens}, "
        f"--page-size {settings.page_size}",
        {"put masks": users * tokens, "slot ids": 8 * users * tokens,
         "per-user tensors": 2 * users * common.TENSOR_OVERHEAD})
    return settings


def measure(
    settings: Settings,
    device: torch.device,
    methods: Mapping[str, Callable[[Batch], object]],
    check: Callable[[Batch], None],
) -> list[tuple[Batch, dict[str, float]]]:
    """For each user count, a batch (``check``-ed first) and every method's median ms."""
    rng = np.random.default_rng(settings.seed)
    measured = []
    with common.progress(len(settings.users) * len(methods), "slots bench", "run") as bar:
        for users in settings.users:
            batch = make_batch(users, settings, device, rng)
            check(batch)
            ms = {}
            for name, method in methods.items():
                ms[name] = time_method(method, batch, device, settings) * 1e3
                bar.update()
            measured.append((batch, ms))
    return measured


def _check(batch: Batch) -> None:
    check_slots(batch, METHODS)
    check_slots(batch, MASKED, masked=True)


def run(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    device = common.pick_device(settings.device)
    rows = []
    for batch, ms in measure(settings, device, {**METHODS, **MASKED, "copy": plain_copy}, _check):
        rows.append(
            {
                "users": len(batch.pages_used),
                "tokens": int(sum(len(m) for m in batch.masks)),
                "masked_tokens": int(sum(np.count_nonzero(m) for m in batch.masks)),
                "fused_ms": ms["fused"],
                "copy_ms": ms["copy"],
                "fused_of_copy": ms["fused"] / ms["copy"],
                "per_user_np_ms": ms["per_user_np"],
                "csr_loop_np_ms": ms["csr_loop_np"],
                "speedup_vs_per_user_np": ms["per_user_np"] / ms["fused"],
                "speedup_vs_csr_loop_np": ms["csr_loop_np"] / ms["fused"],
                "fused_mask_ms": ms["fused_mask"],
                "per_user_mask_ms": ms["per_user_mask"],
                "csr_loop_mask_ms": ms["csr_loop_mask"],
                "mask_speedup_vs_per_user": ms["per_user_mask"] / ms["fused_mask"],
                "mask_speedup_vs_csr_loop": ms["csr_loop_mask"] / ms["fused_mask"],
            }
        )
    common.print_table(
        f"slot mapping per batch on {device} (page {settings.page_size}, "
        f"{settings.min_tokens}-{settings.max_tokens} tokens/user, median of {settings.repeats}): "
        "every used page's slots",
        ["users", "tokens", "fused ms", "copy ms", "fused/copy", "(a-np) ms", "(b-np) ms",
         "vs (a-np)", "vs (b-np)"],
        [
            [r["users"], r["tokens"], r["fused_ms"], r["copy_ms"], f"{r['fused_of_copy']:.2f}x",
             r["per_user_np_ms"], r["csr_loop_np_ms"],
             f"{r['speedup_vs_per_user_np']:.1f}x", f"{r['speedup_vs_csr_loop_np']:.1f}x"]
            for r in rows
        ],
    )
    print("  (copy: one .cpu() of the batch's page ids, already concatenated: the floor"
          + ("" if device.type == "cuda" else "; on the CPU it copies nothing") + ")")
    common.print_table(
        "secondary: the same with each user's store mask applied "
        "(fused: fuse_page_ids over each user's masked page slice; (a-np), (b-np): a boolean "
        "mask per user)",
        ["users", "masked tokens", "fused+mask ms", "(a-np)+mask ms", "(b-np)+mask ms",
         "vs (a-np)+mask", "vs (b-np)+mask"],
        [
            [r["users"], r["masked_tokens"], r["fused_mask_ms"], r["per_user_mask_ms"],
             r["csr_loop_mask_ms"], f"{r['mask_speedup_vs_per_user']:.1f}x",
             f"{r['mask_speedup_vs_csr_loop']:.1f}x"]
            for r in rows
        ],
    )
    if args.json:
        common.write_json(args.json, NAME, settings, device, args.bench_argv, {"rows": rows})
    if args.plot:
        _plot(args.plot, rows, device)
    return 0


def _plot(path: str, rows: list[dict[str, Any]], device: torch.device) -> None:
    def draw(axes: Any) -> None:
        users = [r["users"] for r in rows]
        for (key, label), color in zip(
            (
                ("fused", "fused (aiokv.slots)"),
                ("per_user", "(a-np) one copy per user"),
                ("csr_loop", "(b-np) bulk copy + per-user loop"),
            ),
            ("C0", "C1", "C2"),
            strict=True,
        ):
            plain = "fused_ms" if key == "fused" else f"{key}_np_ms"
            axes.plot(users, [r[plain] for r in rows], "o-", color=color, label=label)
            axes.plot(users, [r[f"{key}_mask_ms"] for r in rows], "x--", color=color,
                      alpha=0.6, label=f"{label} + mask (secondary)")
        axes.plot(users, [r["copy_ms"] for r in rows], ":", color="gray",
                  label="one plain copy (floor)")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("users per batch")
        axes.set_ylabel("ms per batch")
        axes.legend(fontsize="small")

    common.save_plot(path, f"slot mapping per batch ({device})", draw)


__all__ = ["HELP", "NAME", "Settings", "add_arguments", "run"]
