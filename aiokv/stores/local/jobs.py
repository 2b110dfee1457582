"""LocalStore's copy jobs: its tasks' page ids and host blocks as
:class:`~aiokv.copy.copier.CopyJob` s on the copiers (one per direction on a GPU, so that
offloads and loads in flight together do not queue behind each other), each known to the
task ends (:class:`~.completion.TaskEnds`) before a copier can report it. Store thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...copy.copier import Copier, CopyJob, Here
from ..base import Int64Array
from .blocks import NO_BLOCKS
from .completion import Task, TaskEnds, concat
from .load import Load


class CopyJobs:
    def __init__(self, copiers: Sequence[Copier], ends: TaskEnds) -> None:
        self._out = copiers[0]  # offloads, and with one copier (CPU caches) loads too
        self._in = copiers[-1]
        self._ends = ends

    def submit(
        self, tasks: list[Task], pages: Sequence[Any], blocks: Int64Array | None,
        ready: Sequence[Any], load: Load | None = None,
    ) -> CopyJob:
        """Queue one job of ``pages[s]`` (segment ``s``) <-> ``blocks`` (None: only check
        the pages); ``tasks`` (maybe none: a load's chunk) end with it, one segment
        each; its errors name ``load``'s task where it has none."""
        is_put = bool(tasks) and tasks[0].is_put
        names = [task.task_id for task in tasks] or ([load.task.task_id] if load else [0])
        events = {id(e): e for e in ready if e is not None}  # a batch's callers share some
        job = CopyJob(
            to_host=is_put,
            pages=pages,
            blocks=NO_BLOCKS if blocks is None else blocks,
            names=names,
            ready=list(events.values()),
            marks=[task.marks for task in tasks],
            check_only=blocks is None,
            load=load.task.task_id if load is not None and load.gpu_pages is not None else 0,
            ends_load=bool(tasks) and load is not None,
            callers=tasks if is_put else (),
        )
        size = len(tasks[0].blocks) if tasks else 0  # the tasks' common block count, or 0
        if any(len(task.blocks) != size for task in tasks):
            size = 0
        self._ends.launched[id(job)] = (tasks, size)
        (self._out if is_put else self._in).submit(job)
        return job

    def queue_here(self, tasks: list[Task], pages: Sequence[Any], ready: Any) -> Here | None:
        """Gets queued as one job by the calling thread (:meth:`Copier.queue_here`),
        known to the task ends before it can be reported; None once the copier stopped
        taking them (the tasks are not known there then)."""
        job = CopyJob(to_host=False, pages=pages,
                      blocks=concat([task.blocks for task in tasks]),
                      names=[task.task_id for task in tasks],
                      ready=[] if ready is None else [ready], marks=[None] * len(tasks))
        size = len(tasks[0].blocks)
        if any(len(task.blocks) != size for task in tasks):
            size = 0
        self._ends.launched[id(job)] = (tasks, size)
        here = self._in.queue_here(job)
        if here is None:
            del self._ends.launched[id(job)]
        return here

    def wait_taken(self) -> None:
        """Wait for the gets callers queued themselves (:meth:`queue_here`) and report
        them (their ends reach the task ends' next collect)."""
        self._in.wait_here()

    def chunk(
        self, tasks: list[Any], pages: Any, blocks: Int64Array | None, load: Load
    ) -> CopyJob:
        """The SSD link's copy of part of a load's pages (loads.Copy)."""
        return self.submit(tasks, [pages], blocks, load.ready, load)

    @property
    def d2h_copies(self) -> int:
        """The copiers' device-to-host copies of page ids (readable after close too)."""
        copiers = {id(c): c for c in (self._out, self._in)}.values()
        return sum(c.d2h_copies for c in copiers)

    def close(self) -> None:
        """Finish the queued jobs, then stop the copiers."""
        self._out.close()
        if self._in is not self._out:
            self._in.close()
