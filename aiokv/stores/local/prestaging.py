"""LocalStore's prestages (base.Prestages, base.PrestagesPuts): which launch a copy
ahead is for, and which cancels must wait for one.

A prestage names the tasks that are launched next; the copier moves their first chunk
ahead (:mod:`.ahead`) under a tag, and the launch's job carries that tag only when it
holds exactly those tasks, in that order. A put task named by any prestage, until it is
launched or cancelled, may have blocks a copy ahead still writes: its cancel waits for
the copies ahead first. :class:`Prestaging` is LocalStore's part that keeps these (a base
class, as :class:`~.completion.TaskEnds` is), on the store thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .completion import Task, concat
from .transfer import Transfer


class Prestaging:
    """LocalStore's prestage tags; ``_start_prestaging`` sets the state up."""

    _tasks: dict[int, Task]
    _transfer: Transfer | None  # offloads (and on the CPU loads too)
    _load_transfer: Transfer | None  # loads, on a GPU

    def _start_prestaging(self) -> None:
        # The last prestage of gets, and of puts: its tag (0: none) and task ids, in order.
        self._prestaged: tuple[int, list[int]] = (0, [])
        self._prestaged_puts: tuple[int, list[int]] = (0, [])
        # Put tasks any copy ahead may write, until launched or cancelled (_settle_puts).
        self._written_ahead: set[int] = set()
        self._prestage_tags = itertools.count(1)

    def prestage(self, task_ids: Sequence[int]) -> None:
        """On a GPU, copy in ahead the first chunk of a launch of these get tasks (those
        in host blocks, in order; base.Prestages): the launch of exactly them uses it."""
        held = [(task_id, task) for task_id in task_ids
                if (task := self._tasks.get(task_id)) and not task.is_put and task.load is None]
        self._prestaged = (0, [])
        if self._load_transfer is not None and held:
            tag = next(self._prestage_tags)
            self._load_transfer.prestage(concat([task.blocks for _, task in held]), tag)
            self._prestaged = (tag, [task_id for task_id, _ in held])  # once it is queued

    def prestage_puts(
        self, task_ids: Sequence[int], gpu_pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        """On a GPU, gather and copy out ahead the first chunk of a launch of these put
        tasks (base.PrestagesPuts): ``gpu_pages[i]``, the device page ids of task i's new
        pages, read once the ``ready`` events fired. The launch of exactly them skips
        it; a hint, dropped where a task or its page count does not match."""
        self._prestaged_puts = (0, [])
        if self._load_transfer is None or not task_ids or len(gpu_pages) != len(task_ids):
            return  # not on a GPU (one copier), or nothing this launch can use
        tasks = []
        for task_id, pages in zip(task_ids, gpu_pages, strict=True):
            task = self._tasks.get(task_id)
            if task is None or not task.is_put or not 0 < len(task.blocks) == len(pages):
                return
            tasks.append(task)
        tag = next(self._prestage_tags)
        assert self._transfer is not None
        self._transfer.prestage(concat([task.blocks for task in tasks]), tag, gpu_pages, ready)
        self._prestaged_puts = (tag, list(task_ids))
        self._written_ahead.update(task_ids)

    def _launch_tags(self, gets: list[int], puts: list[int]) -> tuple[int, int]:
        """The tags of the copies ahead that a launch's get job and put job use (0: none).
        A launch ends the gets' prestage, whatever it launched. The puts' stays until a
        job uses it or the next prestage of puts replaces it. Launched put tasks end
        after any copy ahead (queued before their job, on the same streams)."""
        (get_tag, prestaged), self._prestaged = self._prestaged, (0, [])
        put_tag, prestaged_puts = self._prestaged_puts
        if self._written_ahead:
            self._written_ahead.difference_update(puts)
        if puts and puts == prestaged_puts:
            self._prestaged_puts = (0, [])
        else:
            put_tag = 0
        return (get_tag if gets and gets == prestaged else 0), put_tag

    def _settle_puts(self, task_ids: Sequence[int]) -> None:
        """Before these tasks' blocks are freed: where a copy ahead may still write some
        of them, wait for it (the SSD tier refills free blocks off the copy streams)."""
        written = self._written_ahead
        if written and self._transfer is not None and not written.isdisjoint(task_ids):
            # The last copy ahead ran after every older one (the same streams), so one
            # wait covers them all; forgotten only once it returned (a cancel retried
            # after a failed wait waits again).
            self._transfer.settle_ahead()
            written.clear()
