"""The remote tier's write queue: bounded in blocks, filled by the store thread, emptied
by the writer thread a batch at a time, with an explicit end (closed: nothing more is
taken) and a deque of finished writes whose held host blocks the store thread gives back;
the namespaces whose markers puts under way want asked for before they are offered; and
the puts that landed, whose markers the writer thread asks for after them.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from ..stores.base import Int64Array

_MOST_ASKED = 1024  # namespaces waiting for their markers' call; past it, puts ask none
_MOST_LANDED = 1024  # puts landed waiting for their markers' call; past it, the LRU's


@dataclass(slots=True)
class WriteJob:
    ns: str  # the namespace's tag (keys.namespace_tag)
    digests: list[bytes]
    blocks: Int64Array  # host blocks, held as readers until the job is finished
    # The lifetime, epoch and namespace's generation when the put was offered
    # (:meth:`.keys.Keys.view`): its keys', so that a write under way when its key is
    # evicted lands under the generation the evict's marker ends (hidden from every
    # host), never under the next one; and none lands where the hosts of a master that
    # restarted since look (its keys name the lifetime's boot id).
    view: tuple[int, int, int] = (0, 0, 0)


@dataclass(slots=True)
class Landed:
    """A put that landed (the put thread's, :meth:`WriteQueue.landed`): under the
    lifetime ``lifetime``, at ``at`` (time.monotonic()), its keys of these (namespace,
    epoch, generation). Another host's evict or clear may have ended them while the put
    was in Mooncake's call, its removal run before the put landed: only a markers call
    begun after ``at`` tells (:meth:`.writer.Writer._learn`)."""

    lifetime: int
    at: float
    views: list[tuple[str, int, int]]


class WriteQueue:
    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = capacity_blocks
        self._jobs: deque[WriteJob] = deque()
        self._queued = 0  # blocks in _jobs
        # The namespaces of the batches taken and not done, but for the jobs set aside
        # (the writer has two batches at most): being checked, or in Mooncake's put.
        self._writing: Counter[str] = Counter()
        # Jobs checked and summed that wait for the put before theirs (:meth:`set_aside`):
        # an evict, a clear or a restart takes them back as it takes the queued ones,
        # rather than wait for another key's put.
        self._aside: list[WriteJob] = []
        self._asked: dict[str, None] = {}  # namespaces whose markers to ask for, in order
        self._landed: list[Landed] = []  # puts landed, their markers to ask for after them
        self._closed = False
        self._cond = threading.Condition()
        self._finished: deque[Int64Array] = deque()  # written or dropped: to give back

    @property
    def queued_blocks(self) -> int:
        return self._queued

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, job: WriteJob) -> bool:
        """Queue a write (store thread); False (nothing queued) when full or closed."""
        with self._cond:
            if self._closed or self._queued + len(job.blocks) > self._capacity:
                return False
            self._jobs.append(job)
            self._queued += len(job.blocks)
            self._cond.notify()
        return True

    def ask(self, ns: str) -> None:
        """A put of the namespace started (store thread): the writer asks for its markers
        (:meth:`asked`) before the put is offered, if it can."""
        with self._cond:
            if self._closed or ns in self._asked or len(self._asked) >= _MOST_ASKED:
                return
            self._asked[ns] = None
            self._cond.notify()

    def landed(self, put: Landed) -> None:
        """A put landed (put thread): the writer asks for its markers (:meth:`asked`).
        None once closed: close does not wait for a markers call more (the LRU takes
        what an evict ended meanwhile)."""
        with self._cond:
            if self._closed or len(self._landed) >= _MOST_LANDED:
                return
            self._landed.append(put)
            self._cond.notify()

    def asked(self) -> tuple[list[str], list[Landed]]:
        """Writer thread: the namespaces asked for, and the puts landed, since the last
        call."""
        with self._cond:
            asked, self._asked = list(self._asked), {}
            landed, self._landed = self._landed, []
        return asked, landed

    def cancel(self, ns: str | None) -> list[Int64Array]:
        """Take the queued writes of a namespace (None: all) back, and those set aside;
        their blocks."""
        with self._cond:
            taken = [j.blocks for j in self._jobs if ns is None or j.ns == ns]
            self._jobs = deque(j for j in self._jobs if ns is not None and j.ns != ns)
            self._queued = sum(len(j.blocks) for j in self._jobs)
            taken += [j.blocks for j in self._aside if ns is None or j.ns == ns]
            self._aside = [j for j in self._aside if ns is not None and j.ns != ns]
        return taken

    def wait_idle(self, timeout_s: float, ns: str | None = None) -> bool:
        """Block until nothing is queued or being written (or the timeout); with ``ns``,
        nothing of that namespace (an evict's: other keys' writes do not hold it up, and
        it takes its jobs set aside back before, :meth:`cancel`)."""
        if ns is None:
            def idle() -> bool:
                return not self._jobs and not self._writing and not self._aside
        else:
            def idle() -> bool:
                return ns not in self._writing and all(
                    j.ns != ns for jobs in (self._jobs, self._aside) for j in jobs)
        with self._cond:
            return bool(self._cond.wait_for(idle, timeout_s))

    def next_batch(self, max_blocks: int, room: Callable[[], bool]) -> list[WriteJob] | None:
        """Writer thread: block for the next jobs (about ``max_blocks`` blocks) once
        ``room()`` says the writer may take a batch (checked under this queue's lock,
        which :meth:`done` takes after room is made), or for namespaces asked for
        or puts landed (:meth:`asked`; then none, also while there is no room: a put's
        offer is not to wait for the batches in hand to learn its markers); None once
        closed with nothing queued."""
        with self._cond:
            self._cond.wait_for(lambda: self._asked or self._landed
                                or (self._closed and not self._jobs)
                                or (self._jobs and room()))
            if not self._jobs:
                return None if self._closed else []
            if not room():
                return []  # asked for: the markers first
            jobs: list[WriteJob] = []
            count = 0
            while self._jobs and count < max_blocks:
                jobs.append(self._jobs.popleft())
                count += len(jobs[-1].blocks)
            self._queued -= count
            self._writing.update(job.ns for job in jobs)
            return jobs

    def set_aside(self, jobs: list[WriteJob], keep: Callable[[WriteJob], bool]
                  ) -> list[WriteJob]:
        """Writer thread: a batch checked (and summed) waits for its put. Those of its
        jobs that ``keep`` still wants (asked here: an evict of theirs that came during
        the checks is waiting for them, and drops them; one that comes later takes them
        back, :meth:`cancel`) are set aside until :meth:`start`; the others end now."""
        with self._cond:
            kept = [job for job in jobs if keep(job)]
            ids = {id(job) for job in kept}
            self._aside += kept
            self.give_back([job.blocks for job in jobs if id(job) not in ids])
            self._not_writing(jobs)
        return kept

    def start(self, jobs: list[WriteJob]) -> list[WriteJob]:
        """Put thread: those of the jobs set aside that nothing took back since, in
        Mooncake's put from now on (until :meth:`done`)."""
        with self._cond:
            ids = {id(job) for job in self._aside}
            kept = [job for job in jobs if id(job) in ids]
            ids = {id(job) for job in kept}
            self._aside = [job for job in self._aside if id(job) not in ids]
            self._writing.update(job.ns for job in kept)
        return kept

    def done(self, jobs: list[WriteJob]) -> None:
        """Writer's threads: these jobs (taken, or started) ended, written or not."""
        self.give_back([job.blocks for job in jobs])
        with self._cond:
            self._not_writing(jobs)

    def _not_writing(self, jobs: list[WriteJob]) -> None:
        self._writing.subtract(job.ns for job in jobs)
        self._writing = +self._writing  # drops the namespaces at 0
        self._cond.notify_all()

    def give_back(self, blocks: list[Int64Array]) -> None:
        """Blocks of writes that ended, or that were taken back (any thread)."""
        self._finished.extend(blocks)

    def finished(self) -> list[Int64Array]:
        """Blocks whose writes ended, each given once (store thread)."""
        done = self._finished
        return [done.popleft() for _ in range(len(done))]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
