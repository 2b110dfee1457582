"""The arithmetic between recsys-examples' KV-cache manager and aiokv, as plain functions
(no recsys import, so CI tests them on the CPU): page lists, host lengths, which users an
onboard loads, and how a manager call's outcomes read as recsys's task statuses.

Facts of recsys-examples (``recsys_kvcache_manager``, v26.06.01) relied on here:

- ``DeviceKVCache.allocate`` gives user ``i`` of a batch ``ceil(seq_lengths[i] / page_size)``
  pages, laid out user after user in ``kv_indices`` (its ``kv_indptr`` is their running
  sum), holding the sequence's tokens from position 0.
- The host holds a page-aligned prefix of each user's sequence (``host_cached_lengths``,
  starting at 0); a trailing partial page is recomputed.
- ``HostKVTaskStatus`` values: ``launched``, ``ready``, ``failed``, ``cancelled``,
  ``timeout`` (the ones a wait answers here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidRequest
from ..requests import LoadResult

# HostKVTaskStatus values (recsys_kvcache_manager.host_kvstorage_manager).
LAUNCHED, READY, FAILED, CANCELLED, TIMEOUT = "launched", "ready", "failed", "cancelled", "timeout"

_CANCELLED_ERRORS = (asyncio.CancelledError, concurrent.futures.CancelledError)


def pages_per_user(seq_lengths: Sequence[int], page_size: int) -> list[int]:
    """Pages ``DeviceKVCache.allocate`` gives each user: ``ceil(length / page_size)``."""
    return [-(-int(length) // page_size) for length in seq_lengths]


def host_lengths(seq_lengths: Sequence[int], page_size: int) -> list[int]:
    """The tokens of each sequence that the host can hold: its full pages."""
    return [int(length) // page_size * page_size for length in seq_lengths]


def offload_lengths(
    seq_lengths: Sequence[int], page_size: int, capacity: int | None
) -> list[int]:
    """The tokens of each sequence an offload stores: its full pages, at most
    ``capacity`` tokens (the most one offload can store; None: the store does not say).
    The manager hands over whole sequences and cannot offload a shorter prefix itself: a
    longer one would be refused whole, and its offload_try_wait would then count the
    batch's other users as not offloaded too."""
    most = None if capacity is None else capacity // page_size * page_size
    return [
        length if most is None else min(length, most)
        for length in host_lengths(seq_lengths, page_size)
    ]


def user_pages(
    kv_indices: torch.Tensor, seq_lengths: Sequence[int], page_size: int
) -> list[torch.Tensor]:
    """Each user's page ids, cut from a batch's ``kv_indices`` by the layout that
    ``DeviceKVCache.allocate`` writes (so ``kv_indptr``, on the GPU, is never read: that
    read would wait for everything queued on the stream). The ids are copied first, on
    the current stream and without waiting, into a tensor of their own: the manager may
    reuse its metadata buffer for the next batch while a copy still needs them.
    Raises InvalidRequest where ``kv_indices`` holds fewer ids than the lengths need."""
    counts = pages_per_user(seq_lengths, page_size)
    total = sum(counts)
    if kv_indices.ndim != 1 or kv_indices.shape[0] < total:
        raise InvalidRequest(
            "kvcache_metadata.kv_indices",
            f"holds {list(kv_indices.shape)} page ids; sequence lengths "
            f"{list(seq_lengths)} need {total} in one row",
        )
    return list(torch.split(kv_indices[:total].clone(), counts))


def users_to_onboard(
    cached_lengths: Sequence[int],
    host_lengths: Sequence[int],
    gpu_starts: Sequence[int],
    gpu_lengths: Sequence[int],
) -> list[int]:
    """The users (batch indices) an onboard loads from the host: those with a host hit
    that the GPU does not cover, because the GPU holds fewer tokens than the host or
    lost a prefix to eviction (``gpu_start > 0``). FlexKVStorage's rule."""
    chosen = []
    for i, (cached, host, start, length) in enumerate(
        zip(cached_lengths, host_lengths, gpu_starts, gpu_lengths, strict=True)
    ):
        if cached == 0 or host == 0:
            continue
        if host > start + length or start > 0:
            chosen.append(i)
    return chosen


@dataclass(frozen=True)
class WaitStatus:
    """How a manager call's outcomes read for recsys: ``status`` (a HostKVTaskStatus
    value), ``ready``, the batch indices that failed, and a message naming their errors."""

    status: str
    ready: bool
    failed: list[int] = field(default_factory=list)
    message: str = ""


def wait_status(
    outcomes: Sequence[Any] | None,
    user_ids: Sequence[int],
    lengths: Sequence[int] | None = None,
) -> WaitStatus:
    """The status of one task's calls: ``outcomes`` (one per user, a result or the
    exception its call raised; None while any is in flight). ``ready`` when all
    succeeded; else ``cancelled`` or ``timeout`` where every failure was one, and
    ``failed`` otherwise.

    ``lengths``, for an onboard: the tokens each user's load must bring (the handle's
    ``onboard_lengths``, which the manager counts as on the GPU once the wait answers
    ready). A load that brought fewer failed: its user was evicted or cleared after the
    lookup (the load then loads 0 tokens), or a block read from SSD failed its checksum.
    Answering ready would have the model read pages that were never written."""
    if outcomes is None:
        return WaitStatus(LAUNCHED, False)
    failures = {
        i: why
        for i, outcome in enumerate(outcomes)
        if (why := _failure(outcome, None if lengths is None else lengths[i])) is not None
    }
    if not failures:
        return WaitStatus(READY, True)
    failed = list(failures)
    errors = [outcomes[i] for i in failed]  # a short load's is its LoadResult: "failed"
    if all(isinstance(e, _CANCELLED_ERRORS) for e in errors):
        status = CANCELLED
    elif all(isinstance(e, TimeoutError) for e in errors):  # aiokv.RequestTimeout is one
        status = TIMEOUT
    else:
        status = FAILED
    message = "; ".join(f"user {user_ids[i]}: {failures[i]}" for i in failed)
    return WaitStatus(status, False, failed, message)


def _failure(outcome: Any, length: int | None) -> str | None:
    """Why one call failed (None: it did not): its error, or a load short of ``length``."""
    if isinstance(outcome, BaseException):
        return repr(outcome)
    if length is not None and isinstance(outcome, LoadResult) and outcome.loaded_tokens < length:
        return (
            f"loaded {outcome.loaded_tokens} of the {length} tokens the lookup found "
            "(evicted or cleared since, or an SSD block failed its checksum)"
        )
    return None


def succeeded(outcomes: Sequence[Any]) -> list[int]:
    """1 for each call that succeeded, 0 for each that failed (``finish_task``'s answer,
    which the manager passes on as ``offloaded``)."""
    return [0 if isinstance(outcome, BaseException) else 1 for outcome in outcomes]
