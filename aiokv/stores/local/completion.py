"""How LocalStore's tasks end: a task's record, and its copy jobs' completions turned
into published (or rolled back) blocks and terminal answers.

The copy threads only append each finished :class:`~.transfer.CopyJob` to a deque and
wake the engine (``_job_done``); ``try_wait``, on the store thread, takes them in order,
counts the bytes moved, tells the SSD link (a load's chunk), ends the job's tasks with a
few array operations for the whole job (``end_tasks``), and keeps their answers until
they are asked for, each given once. :class:`TaskEnds` is LocalStore's part that does it
(a base class, so that these run as LocalStore's own methods, with no call in between).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..base import BoolArray, Int64Array, TaskResult, TaskStatus
from .blocks import READY, Tier
from .index import Space
from .loads import Load
from .pool import HostPool
from .tiering import TierLink
from .transfer import CopyJob

if TYPE_CHECKING:
    from ...remote.link import RemoteLink


@dataclass(slots=True)
class Task:
    is_put: bool
    mask: BoolArray
    blocks: Int64Array  # host blocks of the mask's True pages, in order
    digests: list[bytes]  # a put's new digests (of ``blocks``), for a roll back
    space: Space | None  # a put's namespace table
    task_id: int = 0  # set at launch
    shared: bool = False  # a get that found some of its blocks read by another get
    load: Load | None = None  # a get's part that comes from the SSD tier


def concat(arrays: list[Int64Array]) -> Int64Array:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class TaskEnds:
    """LocalStore's completion bookkeeping; the state is LocalStore's (its ``__init__``)."""

    _pool: HostPool | None
    _host: Tier | None
    _link: TierLink | None
    _finished: dict[int, TaskResult]
    _done_jobs: deque[CopyJob]
    # id(CopyJob) -> its tasks, and their common block count (0: they differ)
    _launched: dict[int, tuple[list[Task], int]]
    _notify: Callable[[], None] | None
    _bytes: dict[str, int]
    _remote: RemoteLink | None

    if TYPE_CHECKING:

        def _require_host(self) -> Tier: ...

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """Terminal answers among ``task_ids``, each given once; never blocks."""
        if self._link is not None and self._host is not None:
            self._link.drain()
        if self._remote is not None:
            self._remote.drain()
        done, finished = self._done_jobs, self._finished
        while done:
            job = done.popleft()
            tasks, size = self._launched.pop(id(job))
            moved = len(job.host_blocks) * (self._pool.block_bytes if self._pool else 0)
            self._bytes["bytes_d2h" if job.to_host else "bytes_h2d"] += moved
            if self._link is not None and self._host is not None:
                self._link.job_done(job)
            if not tasks:
                continue  # a load's chunk: its task ends with the load's last job
            error = job.error
            loads = [task.load for task in tasks if task.load is not None]
            if loads:
                error = error or loads[0].error
            if self._pool is not None:  # after close() the blocks went with the pool
                blocks = None if loads else job.host_blocks
                self.end_tasks(tasks, error is None, blocks, size)
            if error is None:
                results = [TaskResult(TaskStatus.SUCCESS, task.mask) for task in tasks]
            else:
                results = [TaskResult(TaskStatus.FAILED, t.mask, error) for t in tasks]
            finished.update(zip(job.task_ids, results, strict=True))
        if self._link is not None and self._pool is not None:
            self._link.stage_waiting()  # what the jobs that ended held is room now
        if not finished:
            return {}
        return {t: finished.pop(t) for t in task_ids if t in finished}

    def end_tasks(
        self,
        tasks: Sequence[Task],
        success: bool,
        blocks: Int64Array | None = None,
        size: int = 0,
    ) -> None:
        """Tasks of one job (all puts or all gets) are over, in this order: publish or roll
        back their blocks, with a few array operations for the whole job. ``blocks``: all
        their blocks in task order, when the caller has them; ``size``: the tasks' common
        block count, when known (0: unknown, or they differ)."""
        if not tasks:
            return
        host = self._require_host()
        if tasks[0].is_put and not success:
            for task in tasks:
                host.roll_back(task.space, task.digests, task.blocks)
            return
        if blocks is None:
            blocks = concat([task.blocks for task in tasks])
            size = len(blocks) if len(tasks) == 1 else 0
        if len(blocks) == 0:
            return
        per_task = [task.blocks for task in tasks]
        if not tasks[0].is_put:
            host.end_reads(per_task, [task.shared for task in tasks], blocks, size)
        elif self._link is not None and self._link.write_through:
            host.state[blocks] = READY
            # The SSD copies hold their blocks (as readers) until they are written.
            self._link.write_through_puts(tasks, blocks)
        else:
            host.publish(per_task, blocks, size)
        if self._remote is not None and tasks[0].is_put:  # to Mooncake, after the host
            self._remote.offer(tasks)

    def _wake(self) -> None:  # any thread
        if self._notify is not None:
            self._notify()

    def _job_done(self, job: CopyJob) -> None:  # copy thread
        self._done_jobs.append(job)  # deque append and popleft are atomic: no lock
        if self._notify is not None:
            self._notify()
