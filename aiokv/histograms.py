"""Fixed-bucket histograms, as Prometheus reads them: :class:`Histogram` is written by one
thread (the loop's :class:`aiokv.stats.StatsRecorder`, the store thread's
:class:`aiokv.store_figures.StoreSideStats`); :class:`HistogramReading` is the copy another thread
reads (``read``: one ``list.copy()`` per list, see :mod:`aiokv.stats`).

The hottest writers inline :meth:`Histogram.observe` on ``counts``, ``bounds`` and
``width``: a bucket is ``row * width + bisect_left(bounds, value)``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

# Histogram upper bounds ("le"); an observation above the last goes to +Inf.
LATENCY_BOUNDS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class Histogram:
    """Counts per fixed bucket, one row per label value; written by one thread only.
    ``counts`` holds each row's buckets (the last is +Inf) back to back."""

    __slots__ = ("bounds", "counts", "sums", "width")

    def __init__(self, bounds: Sequence[float], rows: int = 1) -> None:
        self.bounds = tuple(bounds)
        self.width = len(self.bounds) + 1
        self.counts = [0] * (rows * self.width)
        self.sums = [0.0] * rows

    def observe(self, value: float, row: int = 0) -> None:
        # bisect_left: a value equal to a bound counts in that bound's bucket (le).
        self.counts[row * self.width + bisect_left(self.bounds, value)] += 1
        self.sums[row] += value

    def read(self) -> HistogramReading:
        return HistogramReading(self.bounds, self.counts.copy(), self.sums.copy())


@dataclass(frozen=True)
class HistogramReading:
    bounds: tuple[float, ...]
    counts: list[int]  # per bucket, not cumulative
    sums: list[float]  # per row

    def cumulative(self, row: int = 0) -> list[int]:
        """Row ``row``'s buckets as Prometheus counts them: observations <= each bound,
        then the total (+Inf)."""
        width = len(self.bounds) + 1
        return list(accumulate(self.counts[row * width : (row + 1) * width]))

    def count(self, row: int = 0) -> int:
        return self.cumulative(row)[-1]
