"""Counters and latency/batch-size samples; :class:`EngineStats` is their snapshot.

All counters are changed on the event loop, in one place each: ``submitted`` at accept,
the outcome counters when a request's future completes, ``batches`` at dispatch.
``pending`` is derived from them, never counted separately. ``d2h_copies`` is the store
thread's count of the copies its fused batches made, read at the snapshot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .errors import RequestTimeout
from .requests import LoadResult, OffloadResult

_SAMPLES = 65_536  # recent latencies and batch sizes kept for percentiles


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. ``pending``: accepted, not yet resolved. ``store_tasks_open``: store ids
    matched or launched and not yet terminal. Latencies are submit-to-resolve, in ms, over
    the most recent requests; bytes count KV moved by completed requests."""

    submitted: int
    completed: int
    failed: int
    cancelled: int
    rejected: int
    timed_out: int
    batches: int
    d2h_copies: int
    pending: int
    store_tasks_open: int
    offloaded_tokens: int
    loaded_tokens: int
    bytes_offloaded: int
    bytes_loaded: int
    mean_batch_requests: float
    latency_p50_ms: float
    latency_p99_ms: float
    store_restarts: int = 0  # the store's backend started again after it died (own_process)


class StatsRecorder:
    """The engine's counters. Loop thread only."""

    def __init__(self) -> None:
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.rejected = 0
        self.timed_out = 0
        self.batches = 0
        self.offloaded_tokens = 0
        self.loaded_tokens = 0
        self._latencies_s: deque[float] = deque(maxlen=_SAMPLES)
        self._batch_sizes: deque[int] = deque(maxlen=_SAMPLES)

    @property
    def resolved(self) -> int:
        return self.completed + self.failed + self.cancelled + self.timed_out

    def record_batch(self, size: int) -> None:
        self.batches += 1
        self._batch_sizes.append(size)

    def record_outcome(self, outcome: object, latency_s: float) -> None:
        """Count one resolved request: ``outcome`` is its result, its exception, or None
        when its caller cancelled it; ``latency_s`` counts for completed ones only."""
        if outcome is None:
            self.cancelled += 1
        elif isinstance(outcome, BaseException):
            if isinstance(outcome, RequestTimeout):
                self.timed_out += 1
            else:
                self.failed += 1
        else:
            self.completed += 1
            self._latencies_s.append(latency_s)
            if isinstance(outcome, OffloadResult):
                self.offloaded_tokens += outcome.stored_tokens
            elif isinstance(outcome, LoadResult):
                self.loaded_tokens += outcome.loaded_tokens

    def snapshot(
        self, store_tasks_open: int, d2h_copies: int, bytes_per_token: int, store_restarts: int = 0
    ) -> EngineStats:
        """The counters now, with the store thread's: its open task ids and the
        device-to-host copies its fused batches made."""
        if self._latencies_s:
            p50, p99 = np.percentile(np.fromiter(self._latencies_s, float), [50, 99]) * 1e3
        else:
            p50 = p99 = 0.0
        mean_batch = float(np.mean(self._batch_sizes)) if self._batch_sizes else 0.0
        return EngineStats(
            submitted=self.submitted,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            rejected=self.rejected,
            timed_out=self.timed_out,
            batches=self.batches,
            d2h_copies=d2h_copies,
            pending=self.submitted - self.resolved,
            store_tasks_open=store_tasks_open,
            offloaded_tokens=self.offloaded_tokens,
            loaded_tokens=self.loaded_tokens,
            bytes_offloaded=self.offloaded_tokens * bytes_per_token,
            bytes_loaded=self.loaded_tokens * bytes_per_token,
            mean_batch_requests=mean_batch,
            latency_p50_ms=float(p50),
            latency_p99_ms=float(p99),
            store_restarts=store_restarts,
        )
