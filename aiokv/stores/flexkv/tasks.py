"""FlexKVStore's tasks in FlexKV's terms (:mod:`.store`): which of a launch's matched
tasks go to FlexKV, grouped per kind (its ``launch(as_batch=True)`` merges tasks of one
kind only, and drops empty ones from the batch's masks), and what its answers mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..base import BoolArray, Int64Array, TaskResult, TaskStatus

# FlexKV's KVResponseStatus values -> ours. NOTFOUND/UNREADY/TIMEOUT on a launched task
# mean FlexKV lost track of it: FAILED.
STATUS = {
    "success": TaskStatus.SUCCESS,
    "cancelled": TaskStatus.CANCELLED,
    "failed": TaskStatus.FAILED,
}


def group_launch(
    task_ids: Sequence[int],
    slot_mappings: Sequence[Int64Array],
    kinds: Mapping[int, str],
    masks: Mapping[int, BoolArray],
) -> tuple[dict[str, list[tuple[int, Int64Array]]], list[int]]:
    """A launch checked whole before anything is launched: (the tasks with something to
    move and their slots, per kind ("get", "put"), the ids of the empty ones). ``kinds``
    and ``masks``: the matched, unlaunched ids' kind and match mask. ValueError for a
    launch the contract does not allow."""
    if len(task_ids) != len(slot_mappings):
        raise ValueError(f"{len(task_ids)} task ids but {len(slot_mappings)} slot mappings")
    groups: dict[str, list[tuple[int, Int64Array]]] = {"get": [], "put": []}
    empty: list[int] = []
    for task_id, slots in zip(task_ids, slot_mappings, strict=True):
        if task_id not in kinds:
            raise ValueError(f"task {task_id} is not a matched, unlaunched task")
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        want = int(np.count_nonzero(masks[task_id]))
        if slots.shape != (want,):
            raise ValueError(
                f"task {task_id}: {slots.shape[0]} slots for {want} True positions"
            )
        if want == 0:
            empty.append(task_id)
        else:
            groups[kinds[task_id]].append((task_id, slots))
    if len(set(task_ids)) != len(task_ids):
        raise ValueError("launch: duplicate task ids")
    return groups, empty


def response_results(
    fid: int, response: Any, notfound: object, masks: Sequence[BoolArray]
) -> list[TaskResult]:
    """The terminal answers of the members of launched FlexKV id ``fid`` from its
    ``response`` (``notfound``: FlexKV's NOTFOUND status); ``masks``: their match masks,
    kept where the response has no mask per member."""
    status = STATUS.get(response.status.value, TaskStatus.FAILED)
    error = "" if status is TaskStatus.SUCCESS else f"FlexKV status {response.status.value}"
    if response.status is notfound:
        error = f"FlexKV lost task {fid} (NOTFOUND)"
    returned = response.return_mask
    results: list[TaskResult] = []
    for index, mask in enumerate(masks):
        if isinstance(returned, list) and len(returned) == len(masks):
            mask = np.asarray(returned[index], dtype=np.bool_)
        elif isinstance(returned, np.ndarray) and len(masks) == 1:
            mask = returned.astype(np.bool_, copy=False)
        results.append(TaskResult(status, mask, error))
    return results


def unknown_task(task_id: int) -> TaskResult:
    """try_wait's answer for an id the adapter does not know (any more)."""
    return TaskResult(
        TaskStatus.FAILED,
        None,
        f"unknown task id {task_id} (never matched, cancelled, or already answered)",
    )
