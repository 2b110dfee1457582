"""How LocalStore's tasks end: a task's record, and its copy jobs' ends turned into
published (or rolled back) blocks and terminal answers.

The copy threads only append each finished :class:`~aiokv.copy.copier.CopyJob` to a deque
and wake the engine (:meth:`TaskEnds.job_done`); :meth:`TaskEnds.collect`, on the store
thread, takes them in order, counts the bytes moved, tells the SSD link (a load's chunk),
ends the job's tasks with a few array operations for the whole job (:meth:`end_tasks`),
and keeps their answers until they are asked for, each given once. A task whose page ids
the copier refused ends INVALID with the copier's reason, and its blocks go back as a
failed task's do (a put's are rolled back, a get's reads end); so do a put's whose
caller detached before the copy of its pages ended (``CopyJob.left``), which ends FAILED:
what it read may be what that caller wrote since. A get that reached its
deadline before all of it was queued (launched late: :meth:`TaskEnds.expire`; a load that
stopped waiting for room or reads: :mod:`.staging`, :mod:`.loads`) ends EXPIRED.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...copy.copier import DETACHED, CopyJob
from ...copy.marks import LayerMarks
from ..base import BoolArray, Int64Array, TaskResult, TaskStatus
from .blocks import READY, Tier
from .index import Space
from .load import Load
from .tiering import TierLink

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
    deadline: float | None = None  # a get's without an SSD part (its load's has its own)
    marks: LayerMarks | None = None  # a get's per-layer marks (no SSD part), from launch
    # A put's caller stopped waiting (LocalStore.detach, the loop thread): copied after
    # that, its pages may hold what the caller wrote since; its copy counts for nothing.
    detached: bool = False
    # A get its caller's thread took and queued itself (LocalStore.take_loads): it reads
    # its outcome off its job, so nobody asks try_wait for its answer.
    taken: bool = False


def concat(arrays: list[Int64Array]) -> Int64Array:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class TaskEnds:
    """LocalStore's completion bookkeeping. ``host``, ``link``, ``remote`` and
    ``block_bytes`` are set when the store is registered; ``closed`` when it is closed
    (the blocks went with the pool: jobs that end later only answer)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.host: Tier | None = None
        self.link: TierLink | None = None
        self.remote: RemoteLink | None = None
        self.block_bytes = 0
        self.closed = False
        self._finished: dict[int, TaskResult] = {}
        self._done_jobs: deque[CopyJob] = deque()
        # id(CopyJob) -> its tasks, and their common block count (0: they differ)
        self.launched: dict[int, tuple[list[Task], int]] = {}
        # Put tasks from their match to their end, by id: LocalStore.detach (the loop
        # thread) finds them here; a task that ended is not found and needs nothing.
        self.puts: dict[int, Task] = {}
        # Puts detached in the engine's process when this store runs in a child
        # (LocalStore.watch_detaches): read as each copy is taken in, after it ended.
        self.detached_elsewhere: Callable[[int], bool] | None = None
        self.bytes = {"bytes_d2h": 0, "bytes_h2d": 0}

    def job_done(self, job: CopyJob) -> None:  # copy threads
        self._done_jobs.append(job)  # deque append and popleft are atomic: no lock
        self._wake()

    def answers(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """The terminal answers among ``task_ids`` (after :meth:`collect`), each once."""
        finished = self._finished
        if not finished:
            return {}
        return {t: finished.pop(t) for t in task_ids if t in finished}

    def collect(self) -> None:
        """End the tasks of every job the copiers finished since the last call."""
        done, link = self._done_jobs, self.link
        while done:
            job = done.popleft()
            launched = self.launched.pop(id(job), None)
            if launched is None:
                # Reported again: a caller's wait interrupted after its report (a
                # KeyboardInterrupt as it woke this thread) leaves it to the next wait,
                # which reports it once more. Taken in once: its reads end once.
                continue
            tasks, size = launched
            moved = job.copied * self.block_bytes
            self.bytes["bytes_d2h" if job.to_host else "bytes_h2d"] += moved
            if link is not None and not self.closed:
                link.loads.job_done(job)
            if tasks:
                self._end_job(job, tasks, size)
        if link is not None and not self.closed:
            link.staging.stage_waiting()  # what the jobs that ended held is room now

    def _end_job(self, job: CopyJob, tasks: list[Task], size: int) -> None:
        error = job.error
        expired = None
        loads = [task.load for task in tasks if task.load is not None]
        if loads:  # an SSD load's last job: its one task, and what its chunks found
            error = error or loads[0].error
            expired = loads[0].expired
            if loads[0].invalid and not job.invalid:
                job.invalid[0] = loads[0].invalid
        left = set(job.left)  # puts whose callers detached before their copy ended
        elsewhere = self.detached_elsewhere
        if elsewhere is not None:  # detached before now: maybe before the copy ended
            left.update(s for s, task in enumerate(tasks)
                        if task.is_put and s not in job.invalid and elsewhere(task.task_id))
        good = [t for s, t in enumerate(tasks) if s not in job.invalid and s not in left]
        if not self.closed:
            if job.invalid or left:
                self.end_tasks([t for s, t in enumerate(tasks)
                                if s in job.invalid or s in left], False)
                self.end_tasks(good, error is None)
            else:
                self.end_tasks(tasks, error is None, None if loads else job.blocks, size)
        puts = self.puts
        for segment, task in enumerate(tasks):
            if task.is_put:
                puts.pop(task.task_id, None)
            why = job.invalid.get(segment)
            if why is not None:
                result = TaskResult(TaskStatus.INVALID, task.mask, why)
            elif segment in left:
                result = TaskResult(TaskStatus.FAILED, task.mask, DETACHED)
            elif error is not None:
                result = TaskResult(TaskStatus.FAILED, task.mask, error)
            elif expired is not None:
                result = TaskResult(TaskStatus.EXPIRED, task.mask, expired)
            else:
                result = TaskResult(TaskStatus.SUCCESS, task.mask)
            if not task.taken:
                self._finished[task.task_id] = result

    def expire(self, tasks: Sequence[Task]) -> None:
        """Get tasks launched past their deadline: they end EXPIRED now, nothing copied
        (their blocks' reads end)."""
        self.end_tasks(tasks, False)
        for task in tasks:
            self._finished[task.task_id] = TaskResult(
                TaskStatus.EXPIRED, np.zeros_like(task.mask), "launched after its deadline"
            )
        self._wake()

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
        host = self.host
        assert host is not None
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
        elif self.link is not None and self.link.write_through:
            host.state[blocks] = READY
            # The SSD copies hold their blocks (as readers) until they are written.
            self.link.write_through_puts(tasks, blocks)
        else:
            host.publish(per_task, blocks, size)
        if self.remote is not None and tasks[0].is_put:  # to Mooncake, after the host
            self.remote.offer(tasks)
