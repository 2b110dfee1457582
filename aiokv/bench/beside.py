"""Copies beside the model stand-in (:mod:`.standin`): a copier on a thread of its own,
paused while the model runs alone, and the measurements made with it.

A copier does one unit of work after another (a batch each way, an engine round) and
records each unit's bytes and times; between measurements it is paused, so that the
model's time alone is measured on an idle GPU. Its rate beside the model counts the
units done wholly while the model ran (the model runs on, untimed, until at least one
is).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ..copy.driver import BatchCopy
from .standin import GIB, StandIn

_WAIT_S = 600.0  # a bound on waiting for a copier's unit: it is stuck past this
_MORE_S = 120.0  # how long the model runs on (or the copier alone) for a slow copier's unit


class Unit(NamedTuple):
    """One piece of a copier's work: ``kind`` ("offload": to the host, or "load")."""

    kind: str
    nbytes: int
    start_s: float
    end_s: float


class Copier(Protocol):
    """What :class:`Beside` drives, every call on its own thread: ``setup`` once, ``unit``
    until stopped (each returns what it moved), ``close`` once (also after a failure)."""

    def setup(self) -> None: ...

    def unit(self) -> Sequence[Unit]: ...

    def close(self) -> None: ...


@dataclass
class Rates:
    """GiB/s per kind over the units done inside a window (nan: none was)."""

    gib_s: dict[str, float] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)

    def get(self, kind: str) -> float:
        return self.gib_s.get(kind, math.nan)


class Beside:
    """Runs a :class:`Copier` on a named thread of its own, one unit after another while
    resumed; ``pause`` returns once the unit under way is done. A copier's error is
    raised in the calling thread by the next ``pause``, ``resume`` or ``close``."""

    def __init__(self, copier: Copier, name: str) -> None:
        self._copier = copier
        self._cond = threading.Condition()
        self._want = False  # guarded by _cond, like the rest of the state below
        self._stop = False
        self._in_unit = False
        self._started = 0
        self._ready = False
        self._ended = False
        self._error: BaseException | None = None
        self._units: list[Unit] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Beside:
        self._thread.start()
        self._wait(lambda: self._ready)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._raise()

    def resume(self) -> None:
        """Let the copier run; returns once its next unit has started."""
        with self._cond:
            self._want = True
            started = self._started
            self._cond.notify_all()
        self._wait(lambda: self._started > started)

    def pause(self) -> None:
        """Stop after the unit under way; returns once it is done."""
        with self._cond:
            self._want = False
        self._wait(lambda: not self._in_unit)

    def rates(self, start_s: float, end_s: float) -> Rates:
        """Per kind, the bytes over the time of the units done wholly inside the window."""
        with self._cond:
            inside = [u for u in self._units if u.start_s >= start_s and u.end_s <= end_s]
        rates = Rates()
        for kind in sorted({u.kind for u in inside}):
            mine = [u for u in inside if u.kind == kind]
            seconds = sum(u.end_s - u.start_s for u in mine)
            rates.units[kind] = len(mine)
            rates.gib_s[kind] = sum(u.nbytes for u in mine) / GIB / seconds if seconds else math.nan
        return rates

    def covered(self, start_s: float, end_s: float) -> bool:
        """Whether a unit of every kind seen so far was done wholly inside the window."""
        with self._cond:
            seen = {u.kind for u in self._units}
            inside = {u.kind for u in self._units if u.start_s >= start_s and u.end_s <= end_s}
        return bool(inside) and inside >= seen

    def _wait(self, done: Callable[[], bool]) -> None:
        with self._cond:
            finished = self._cond.wait_for(lambda: done() or self._ended, timeout=_WAIT_S)
        self._raise()
        if not finished:
            raise RuntimeError(f"{self._thread.name}: a unit took over {_WAIT_S:.0f} s")
        if not done():
            raise RuntimeError(f"{self._thread.name}: the copier thread ended early")

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self._thread.name} failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            self._copier.setup()
            with self._cond:
                self._ready = True
                self._cond.notify_all()
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._want or self._stop)
                    if self._stop:
                        return
                    self._in_unit = True
                    self._started += 1
                    self._cond.notify_all()
                units = self._copier.unit()
                with self._cond:
                    self._units.extend(units)
                    self._in_unit = False
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the calling thread, never lost
            self._error = exc
        finally:
            try:
                self._copier.close()
            except BaseException as exc:
                self._error = self._error or exc
            with self._cond:
                self._ended = True
                self._in_unit = False
                self._cond.notify_all()


@dataclass
class Side:
    """One copier beside the stand-in at one depth: the model's seconds alone and beside
    (medians of the repeats, each beside run right after an alone run) and the copier's
    rates while the model ran."""

    depth: int
    model_alone_s: float
    model_beside_s: float
    rates: Rates
    launching: float = math.nan  # of the model's time beside, the share inside launches

    @property
    def slowdown(self) -> float:
        return self.model_beside_s / self.model_alone_s


def measure_side(
    model: StandIn, steps: int, depth: int, copier: Beside, repeats: int
) -> Side:
    """The model alone (copier paused), then beside the copier, ``repeats`` times; the
    copier is left paused."""
    alone, beside, launching = [], [], []
    windows: list[tuple[float, float]] = []
    for _ in range(repeats):
        copier.pause()
        alone.append(model.run(steps, depth))
        copier.resume()
        start_s = time.perf_counter()
        beside.append(model.run(steps, depth))
        launching.append(model.launching_s / beside[-1])
        # A slow copier may not finish a unit within one run: the model runs on (untimed)
        # until it has, so that its rate is always measured beside the model.
        while not copier.covered(start_s, now := time.perf_counter()):
            if now - start_s > _MORE_S:
                break
            model.run(steps, depth)
        windows.append((start_s, time.perf_counter()))
    copier.pause()
    merged = Rates()
    per_window = [copier.rates(*w) for w in windows]
    for kind in sorted({k for r in per_window for k in r.gib_s}):
        values = [r.get(kind) for r in per_window if not math.isnan(r.get(kind))]
        merged.gib_s[kind] = _median(values) if values else math.nan
        merged.units[kind] = sum(r.units.get(kind, 0) for r in per_window)
    return Side(depth, _median(alone), _median(beside), merged, _median(launching))


def measure_alone(copier: Beside, seconds: float) -> Rates:
    """The copier's rates with the model idle (this thread sleeps)."""
    copier.resume()
    start_s = time.perf_counter()
    time.sleep(seconds)
    while not copier.covered(start_s, now := time.perf_counter()):  # a whole unit at least
        if now - start_s > _MORE_S:
            break
        time.sleep(min(seconds, 0.05))
    end_s = time.perf_counter()
    copier.pause()
    return copier.rates(start_s, end_s)


def measure_copier(
    copier: Beside,
    model: StandIn,
    steps: int,
    depths: Sequence[int],
    alone_s: float,
    repeats: int,
) -> tuple[Rates, list[Side]]:
    """A copier's rates with the model idle, then beside the model at each depth; the
    copier's thread is started and closed here."""
    with copier:
        alone = measure_alone(copier, alone_s)
        sides = [measure_side(model, steps, depth, copier, repeats) for depth in depths]
    return alone, sides


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class ReferenceCopier:
    """Plain copies of one contiguous buffer, device -> pinned host then back, on a
    stream of its own (on the CPU: host memcpys): the copy engines' rate, and what
    copies that use no SMs cost the model."""

    @staticmethod
    def host_bytes(nbytes: int, device: torch.device) -> dict[str, int]:
        """The host memory one of ``nbytes`` takes on ``device`` (both buffers on a CPU),
        for :func:`aiokv.bench.common.check_round_fits`."""
        return {"reference copy": nbytes * (2 if device.type == "cpu" else 1)}

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self._device = device
        self._nbytes = nbytes
        self._stream: torch.cuda.Stream | None = None
        pin = device.type == "cuda"
        self._host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
        if pin:  # filled on this thread's stream, copied on the copier's
            torch.cuda.synchronize(device)

    def setup(self) -> None:
        if self._device.type == "cuda":
            self._stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            torch.cuda.set_stream(self._stream)

    def _timed(self, kind: str, dst: torch.Tensor, src: torch.Tensor) -> Unit:
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()
        return Unit(kind, self._nbytes, start, time.perf_counter())

    def unit(self) -> Sequence[Unit]:
        return [self._timed("offload", self._host, self._gpu),
                self._timed("load", self._gpu, self._host)]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class ShapedCopier:
    """The engine's copy shape without the engine: ``pages`` pages of ``page_bytes`` at
    random in each of ``layers`` device caches (twice that many pages each, as the
    engine's rounds place theirs), one copy per page and layer to pinned host memory and
    back, by ``cuMemcpyBatchAsync`` calls of at most ``PER_CALL`` copies (as the engine's
    calls, a layer's share of a stream's, are), on a stream of its own. Beside the
    reference it says how much of the engine's gap is the shape of its copies (pages, not
    one buffer) and how much is its own control path. CUDA 12.8+ drivers only."""

    def __init__(self, device: torch.device, layers: int, pages: int, page_bytes: int) -> None:
        # set_device on the copier's own thread needs an index: "cuda" alone is refused
        self._device = (device if device.index is not None
                        else torch.device(device.type, torch.cuda.current_device()))
        self._nbytes = layers * pages * page_bytes
        self._caches = [torch.ones(2 * pages * page_bytes, dtype=torch.uint8, device=device)
                        for _ in range(layers)]
        self._host = torch.ones(self._nbytes, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize(device)  # filled on this thread's stream, copied on another
        order = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(0))[:pages]
        offsets = order.numpy().astype(np.uint64) * np.uint64(page_bytes)
        self._device_addrs = np.concatenate(
            [np.uint64(c.data_ptr()) + offsets for c in self._caches])
        self._host_addrs = (np.uint64(self._host.data_ptr())
                            + np.arange(layers * pages, dtype=np.uint64) * np.uint64(page_bytes))
        self._sizes = np.full(layers * pages, page_bytes, dtype=np.uint64)
        self._stream: torch.cuda.Stream | None = None
        self._copy: BatchCopy | None = None

    def setup(self) -> None:
        torch.cuda.set_device(self._device)
        self._stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        torch.cuda.set_stream(self._stream)
        self._stream.synchronize()  # a runtime call: the context is current for the driver's
        self._copy = BatchCopy()

    PER_CALL = 512

    def _timed(self, kind: str, dsts: np.ndarray, srcs: np.ndarray) -> Unit:
        assert self._copy is not None and self._stream is not None
        stream, step = self._stream.cuda_stream, self.PER_CALL
        start = time.perf_counter()
        for at in range(0, len(self._sizes), step):
            self._copy(dsts[at : at + step], srcs[at : at + step], self._sizes[at : at + step],
                       stream)
        self._stream.synchronize()
        return Unit(kind, self._nbytes, start, time.perf_counter())

    def unit(self) -> Sequence[Unit]:
        return [self._timed("offload", self._host_addrs, self._device_addrs),
                self._timed("load", self._device_addrs, self._host_addrs)]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


__all__ = [
    "Beside",
    "Copier",
    "Rates",
    "ReferenceCopier",
    "ShapedCopier",
    "Side",
    "Unit",
    "measure_alone",
    "measure_copier",
    "measure_side",
]
