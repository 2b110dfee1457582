"""A model stand-in: a serving model's load on the GPU without a model (``aiokv bench
model``, ``benchmarks/copy_mechanisms.py``; :mod:`.beside` runs copies beside it).

Square matmuls (bf16 8192 x 8192 on a GPU) launched from the calling thread, the main
thread, on its current stream, as a model's forward is. ``depth`` says how far it runs
ahead: 0 queues every step at once and waits once at the end; N launches N steps, then
waits for its stream (a host sync), and so on, as a model that runs about one step
ahead. A copier that takes the GIL from that thread, or SMs from its kernels, makes it
slower: what is measured is the stand-in's time beside a copier over its time alone.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

GIB = float(1 << 30)
ALL = 0  # depth: every step queued at once


def depth_flag(text: str) -> str:
    """``--depth`` for argparse: ``text``, once :func:`parse_depths` takes it (else a
    usage error naming the flag and the value)."""
    try:
        parse_depths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("depth: ")) from None
    return text


@dataclass(frozen=True)
class BesideSettings:
    """What the benches beside the model share: a batch's geometry (bf16) and the runs."""

    users: int = 32
    tokens: int = 2048
    layers: int = 8
    heads: int = 8
    head_dim: int = 128
    page_size: int = 32
    depth: str = field(default="all,4", metadata={"type": depth_flag})
    matrix: int = 8192
    model_s: float = 1.5
    alone_s: float = 1.0
    repeats: int = 3
    ref_mib: int = 256
    device: str = "auto"


# Smoke-run sizes (a CPU, tests): tiny matmuls and caches, short runs.
SMOKE: dict[str, object] = {
    "users": 4,
    "tokens": 64,
    "layers": 2,
    "heads": 2,
    "head_dim": 64,
    "page_size": 16,
    "matrix": 128,
    "model_s": 0.2,
    "alone_s": 0.2,
    "repeats": 1,
    "ref_mib": 4,
}
HELPS = {
    "users": "users per batch",
    "tokens": "tokens per user",
    "depth": "model steps launched between host syncs, comma-separated; all (or 0): every "
    "step queued at once",
    "matrix": "the stand-in's matmul size (square)",
    "model_s": "seconds of one model run alone (sets its step count)",
    "alone_s": "seconds each copier runs with the model idle",
    "repeats": "model runs alone and beside, per depth and copier (median)",
    "ref_mib": "size of the reference copy, MiB",
    "device": "where the caches and the model live (cpu: a smoke run at --quick sizes)",
}


def smoke_run(device: str | None) -> bool:
    """Whether ``--device`` asks for the CPU (or leaves it to a box without CUDA)."""
    return device == "cpu" or (device in (None, "auto") and not torch.cuda.is_available())


@contextlib.contextmanager
def one_thread(smoke: bool) -> Iterator[None]:
    """In a smoke run, torch keeps to one intra-op thread meanwhile: with more, each of
    the stand-in's CPU matmuls waits at an OpenMP barrier whenever a copier thread holds
    a core, and its time swings a hundredfold."""
    before = torch.get_num_threads()
    if smoke:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_depths(text: str) -> tuple[int, ...]:
    """``"all,4"`` -> ``(0, 4)``: ``all`` (or 0) queues every step at once."""
    depths = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "all":
            depths.append(ALL)
            continue
        try:
            value = int(part)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"depth: expected 'all' or an integer >= 0, got {part!r}")
        depths.append(value)
    if not depths:
        raise ValueError(f"depth: expected 'all' or integers, got {text!r}")
    return tuple(depths)


def depth_name(depth: int) -> str:
    return "all" if depth == ALL else str(depth)


def host_bytes(size: int, device: torch.device) -> dict[str, int]:
    """The host memory a :class:`StandIn` of ``size`` takes on ``device`` (none on a GPU),
    for :func:`aiokv.bench.common.check_round_fits`."""
    if device.type != "cpu":
        return {}
    return {"stand-in matrices": 3 * size * size * 4}  # float32 on a CPU


class StandIn:
    """``size`` x ``size`` matmuls of ``dtype`` on ``device``, into a fixed output (no
    allocation per step). The default dtype is bf16 on a GPU, float32 on a CPU (whose
    bf16 matmuls are slow and erratic, too much so for a smoke run)."""

    def __init__(self, device: torch.device, size: int, dtype: torch.dtype | None = None) -> None:
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.device = device
        self.size = size
        self.dtype = dtype
        generator = torch.Generator(device=device).manual_seed(0)
        self._a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
        self._b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
        self._out = torch.empty(size, size, device=device, dtype=dtype)
        # The last run's seconds inside its launch calls (torch lets the GIL go in them).
        # A launch blocks while its hardware work queue is full, and streams share those
        # queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default): a share near 1 says that the
        # queued steps fill theirs, so copies on a stream that shares it wait behind them.
        self.launching_s = 0.0

    def describe(self, steps: int) -> str:
        kind = str(self.dtype).removeprefix("torch.")
        return f"{kind} {self.size}x{self.size} matmuls, {steps} per run"

    def sync(self) -> None:
        """Wait for what was queued on the current stream."""
        # The model's own stream only: a device-wide sync would also wait for the copies.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def run(self, steps: int, depth: int) -> float:
        """Seconds for ``steps`` matmuls, from the first launch to the last step done."""
        self.sync()
        clock = time.perf_counter
        launching = 0.0
        start = clock()
        for step in range(1, steps + 1):
            before = clock()
            torch.matmul(self._a, self._b, out=self._out)
            launching += clock() - before
            if depth and step % depth == 0:
                self.sync()
        self.sync()
        self.launching_s = launching
        return clock() - start

    def queue(self, steps: int) -> None:
        """Launch ``steps`` matmuls on the current stream and return without waiting for
        them (on a CPU: done by then): one layer of a model's forward."""
        for _ in range(steps):
            torch.matmul(self._a, self._b, out=self._out)

    def steps_for(self, seconds: float) -> int:
        """How many steps take about ``seconds`` alone (after a warm-up)."""
        self.run(3, ALL)
        probe = 10
        took = self.run(probe, ALL)
        while took < max(0.05, seconds / 4) and probe < 1 << 20:  # time enough of them
            probe *= 4
            took = self.run(probe, ALL)
        took = min(took, self.run(probe, ALL))  # the first runs warm up
        return max(1, math.ceil(seconds * probe / took))


__all__ = [
    "ALL",
    "GIB",
    "HELPS",
    "SMOKE",
    "BesideSettings",
    "StandIn",
    "depth_flag",
    "depth_name",
    "host_bytes",
    "one_thread",
    "parse_depths",
    "smoke_run",
]
