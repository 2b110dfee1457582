"""What crosses the socket between :class:`~aiokv.stores.process.ProcessStore` and its
child (:mod:`aiokv.stores.child`), pickled by ``multiprocessing.connection``.

Start-up, parent -> child: :data:`Start`, sent by :mod:`.cache_fds` (the CPU caches'
shared memory as descriptors over the socket). Child -> parent: :data:`Attach` (at most
once; the parent answers a :data:`Reply`), then :data:`Ready` or :data:`Failed`.

Serving: each :data:`Call` gets one :data:`Reply`, in order; ``("close", None)`` ends it.
Messages are plain tuples, so that a call pickles as little as it can: the types below
say what each holds. Arguments and answers that carry many arrays travel as one array
each (:func:`launch_args`, :func:`pack_results`), so that a batch's 32 answers unpack in
microseconds rather than as 32 unpicklings of a dataclass and an array.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..config import StoreConfig
from ..errors import StoreError
from .base import BoolArray, Int64Array, TaskResult, TaskStatus

Op = Literal[
    "put_match", "put_match_many", "get_match", "get_match_many", "launch", "cancel",
    "try_wait", "evict", "clear", "store_stats", "parked", "resume_figures", "close",
]
# Optional Store methods that cross to the child as calls of their own, where the child's
# store class has them (ProcessStore offers the others itself).
FORWARDED = ("evict", "clear", "store_stats", "parked")
# Those, and the ones that cross inside another call (set_deadlines: with the launch after
# it): ProcessStore lacks each that the child's store class lacks.
MIRRORED = (*FORWARDED, "set_deadlines")
Call = tuple[Op, Any]
# store_stats' answer: the figures, and the store's figures_state() where it has one
# (base.ResumesFigures), which a new child's store is given ("resume_figures") if this
# child dies.
FiguresAnswer = tuple[dict[str, int | float], object]
Reply = tuple[bool, Any]  # (True, value) or (False, the exception raised)
# The config (own_process=False), the handover's payload, the detached puts' table
# (:mod:`.detaches`).
Start = tuple[StoreConfig, object, torch.Tensor]
Attach = tuple[Literal["attach"], object]  # the handover's request to the parent
Ready = tuple[Literal["ready"], int]  # the store's page size
Failed = tuple[Literal["failed"], BaseException]
Query = tuple[Int64Array, tuple[str, ...]]  # (token_ids, namespace) of one match
# ids, page counts, all page ids joined, and set_deadlines' deadlines of some of the ids
LaunchArgs = tuple[list[int], list[int], Int64Array, dict[int, float]]
# Terminal answers: ids, status indexes, errors, all masks joined, mask lengths (-1: None).
PackedResults = tuple[list[int], list[int], list[str], BoolArray, list[int]]

_STATUSES = tuple(TaskStatus)
_STATUS_INDEX = {status: index for index, status in enumerate(_STATUSES)}
_NO_MASKS: BoolArray = np.zeros(0, dtype=np.bool_)
_NO_PAGES: Int64Array = np.zeros(0, dtype=np.int64)


def query(token_ids: Int64Array, namespace: Sequence[str]) -> Query:
    return np.ascontiguousarray(token_ids, dtype=np.int64), tuple(namespace)


def launch_args(
    task_ids: Sequence[int], pages: Sequence[Int64Array], deadlines: dict[int, float]
) -> LaunchArgs:
    """A launch's arguments as one array of page ids (ValueError for what launch refuses),
    with the deadlines (by task id) that the child's store is given before it."""
    if len(task_ids) != len(pages):
        raise ValueError(f"{len(task_ids)} task ids but {len(pages)} page id arrays")
    arrays = [np.ascontiguousarray(p, dtype=np.int64) for p in pages]
    for index, array in enumerate(arrays):
        if array.ndim != 1:
            raise ValueError(f"pages[{index}]: need 1-D, got shape {array.shape}")
    joined = np.concatenate(arrays) if arrays else _NO_PAGES
    return list(task_ids), [len(a) for a in arrays], joined, deadlines


def launch_pages(args: LaunchArgs) -> tuple[list[int], list[Int64Array], dict[int, float]]:
    """:func:`launch_args` undone: the ids, their page ids (views of the one array), the
    deadlines."""
    task_ids, lengths, joined, deadlines = args
    return task_ids, np.split(joined, np.cumsum(lengths)[:-1]) if lengths else [], deadlines


def pack_results(results: dict[int, TaskResult]) -> PackedResults:
    answers = list(results.values())
    masks = [r.mask for r in answers if r.mask is not None]
    return (
        list(results),
        [_STATUS_INDEX[r.status] for r in answers],
        [r.error for r in answers],
        np.concatenate(masks) if masks else _NO_MASKS,
        [-1 if r.mask is None else len(r.mask) for r in answers],
    )


def unpack_results(packed: PackedResults) -> dict[int, TaskResult]:
    ids, statuses, errors, masks, lengths = packed
    out: dict[int, TaskResult] = {}
    start = 0
    for task_id, status, error, length in zip(ids, statuses, errors, lengths, strict=True):
        mask = None
        if length >= 0:
            mask = masks[start : start + length]
            start += length
        out[task_id] = TaskResult(_STATUSES[status], mask, error)
    return out


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a StoreError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return StoreError(f"{type(exc).__name__}: {exc}")
    return exc


def noted(exc: BaseException, pid: int | None) -> BaseException:
    """What to raise for the exception a reply carried (``portable`` made it pickle):
    itself, with a note naming the child ``pid``; StoreError should it be none."""
    if isinstance(exc, BaseException):
        add_note = getattr(exc, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(f"raised in the store process (pid {pid})")
        return exc
    return StoreError(f"the store process answered {exc!r}")
