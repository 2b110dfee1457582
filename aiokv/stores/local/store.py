"""LocalStore: aiokv's embedded store, a host-memory KV block store with a prefix index.

Block life: FREE -> WRITING (reserved by put_match, in the index but not readable) ->
READY (copy done; readable by get_match; evictable while no load reads it) -> FREE
(evicted, or rolled back by cancel or a failed copy). All metadata is touched only on the
caller's thread (the engine's store thread); the copy thread only moves bytes and reports.
That thread holds the GIL for all of it, so the bookkeeping is done per task or per copy
job with numpy over arrays of blocks and C-level dict operations, never a Python loop per
block.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...config import StoreConfig
from ...errors import ConfigError
from ..base import BoolArray, Int64Array, NoSpace, TaskResult, TaskStatus
from .index import BlockIndex, Space, chain_digests
from .pool import HostPool, as_index
from .transfer import CopyJob, Transfer

# Block states, plain ints: compared against numpy elements on the hot path, where an
# IntEnum costs a few microseconds a comparison.
FREE, WRITING, READY = 0, 1, 2


@dataclass(slots=True)
class _Task:
    is_put: bool
    mask: BoolArray
    blocks: Int64Array  # host blocks of the mask's True pages, in order
    digests: list[bytes]  # a put's new digests (of ``blocks``), for a roll back
    space: Space | None  # a put's namespace table
    task_id: int = 0  # set at launch
    shared: bool = False  # a get that found some of its blocks read by another get


def _concat(arrays: list[Int64Array]) -> Int64Array:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


_NO_BLOCKS: Int64Array = np.empty(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False


class LocalStore:
    """The embedded store. ``LocalStore(StoreConfig(cpu_cache_gb=...))``.

    Sized by ``cpu_cache_gb``: one host block per GPU page (all layers). Host memory is
    pinned when the caches are on a GPU. ``page_size`` comes from the config or, when
    that is None, from the caches at ``register``.
    """

    def __init__(self, config: StoreConfig | None = None) -> None:
        self._config = config or StoreConfig()
        if self._config.ssd_cache_gb:
            raise ConfigError("store.ssd_cache_gb", "the local store has no SSD tier")
        self.page_size = self._config.page_size or 0
        self._pool: HostPool | None = None
        self._transfer: Transfer | None = None
        self._gpu_pages = 0  # pages per cache table, known at register
        self._index = BlockIndex()
        self._state: np.ndarray = np.zeros(0, dtype=np.int8)
        self._readers: np.ndarray = np.zeros(0, dtype=np.int32)
        # Open get tasks that found a block already read by another; while none is
        # open, every read block has exactly one reader.
        self._shared_gets = 0
        self._tasks: dict[int, _Task] = {}
        self._finished: dict[int, TaskResult] = {}
        self._done_jobs: deque[CopyJob] = deque()
        self._ids = itertools.count(1)
        # id(CopyJob) -> its tasks, and their common block count (0: they differ)
        self._launched: dict[int, tuple[list[_Task], int]] = {}
        self._notify: Callable[[], None] | None = None

    # ---- set-up --------------------------------------------------------------------

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if self._transfer is not None:
            # A second copy thread and pool would orphan every task of the first.
            raise RuntimeError("LocalStore.register() was already called")
        first = kv_caches[0]
        page_size = int(first.shape[2])
        if self.page_size and self.page_size != page_size:
            raise ConfigError(
                "store.page_size", f"{self.page_size} does not match the caches' {page_size}"
            )
        self.page_size = page_size
        block_shape = (len(kv_caches), *first.shape[1:])
        block_bytes = int(np.prod(block_shape)) * first.element_size()
        num_blocks = int(self._config.cpu_cache_gb * (1 << 30) // block_bytes)
        if num_blocks < 1:
            raise ConfigError(
                "store.cpu_cache_gb",
                f"{self._config.cpu_cache_gb} GiB holds no block of {block_bytes} bytes",
            )
        pin = first.device.type == "cuda"
        try:
            self._pool = HostPool(num_blocks, block_shape, first.dtype, pin)
        except (RuntimeError, MemoryError) as exc:  # torch's allocation (or pinning) failed
            raise ConfigError(
                "store.cpu_cache_gb",
                f"{self._config.cpu_cache_gb} GiB ({num_blocks} blocks of {block_bytes} "
                f"bytes{', pinned' if pin else ''}) could not be allocated: {exc}",
            ) from exc
        self._state = np.zeros(num_blocks, dtype=np.int8)
        self._readers = np.zeros(num_blocks, dtype=np.int32)
        self._index = BlockIndex(num_blocks)
        self._gpu_pages = int(first.shape[0])
        self._transfer = Transfer(kv_caches, self._pool, self._job_done)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks if self._pool is not None else 0

    @property
    def free_blocks(self) -> int:
        return self._pool.num_free if self._pool is not None else 0

    # ---- Store protocol ------------------------------------------------------------

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """Reserve blocks for the pages not yet stored; mask True = must write. Raises
        NoSpace when some page is new and the pool cannot take all new pages."""
        self._require_pool()
        page_size = self.page_size
        key = tuple(namespace)
        digests = chain_digests(token_ids, page_size)
        n = len(digests)
        space = self._index.space(key)
        present = list(map(space.get, digests)) if space is not None else None
        missing_count = n if present is None else present.count(None)
        if present is not None and missing_count < n:
            # Stored (or being written) pages become the most recent; while new blocks are
            # reserved, they are out of the LRU so that eviction cannot take them.
            if missing_count == 0:
                held = np.array(present, dtype=np.int64)
            else:
                held = np.array([b for b in present if b is not None], dtype=np.int64)
            listed = self._index.make_unevictable(held)
        else:
            listed = None
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        blocks = _NO_BLOCKS
        new_digests: list[bytes] = []
        owner = space
        if missing_count:
            try:
                blocks = self._reserve(missing_count)
            finally:
                if listed is not None:
                    self._index.make_evictable(listed)
            if present is None or missing_count == n:
                first, new_digests = 0, digests
            else:
                first = present.index(None)
                new_digests = [d for d, b in zip(digests, present, strict=True) if b is None]
            owner = self._index.insert(key, new_digests, blocks)
            self._state[as_index(blocks)] = WRITING
            if n - first == missing_count:  # the usual: a suffix
                mask[first * page_size : n * page_size] = True
            else:
                pages = mask[: n * page_size].reshape(-1, page_size)
                assert present is not None
                pages[[i for i, b in enumerate(present) if b is None]] = True
        elif listed is not None:
            self._index.make_evictable(listed)
        return self._new_task(_Task(True, mask, blocks, new_digests, owner)), mask

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """The longest READY prefix; its blocks are held (not evictable) until the task
        ends or is cancelled. mask True = will load."""
        self._require_pool()
        space = self._index.space(tuple(namespace))
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        hit = _NO_BLOCKS
        if space is not None:
            found = list(map(space.get, chain_digests(token_ids, self.page_size)))
            if None in found:
                found = found[: found.index(None)]
            if found:
                hit = np.fromiter(found, dtype=np.int64, count=len(found))
                not_ready = self._state[hit] != READY
                if np.count_nonzero(not_ready):  # cheaper than argmax when none
                    hit = hit[: int(np.argmax(not_ready))]
                if len(hit):
                    self._readers[hit] += 1  # unique: one block per page of one key
                    # READY and not in the LRU means read by another get.
                    shared = len(self._index.make_unevictable(hit)) != len(hit)
                    self._shared_gets += shared
                    mask[: len(hit) * self.page_size] = True
                    task = _Task(False, mask, hit, [], None, shared=shared)
                    return self._new_task(task), mask
        return self._new_task(_Task(False, mask, hit, [], None)), mask

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        """Queue the copies of these matched tasks; never blocks on them."""
        if len(task_ids) != len(slot_mappings):
            raise ValueError("launch: one slot mapping per task id")
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("launch: a task id is given twice")
        transfer = self._require_transfer()
        page_size = self.page_size
        gets: list[tuple[_Task, Int64Array]] = []  # (task, the first slot of each page)
        puts: list[tuple[_Task, Int64Array]] = []
        firsts: list[Int64Array] = []  # per task, in task_ids order: checked at once
        lasts: list[Int64Array] = []  # the last slot of each page
        for task_id, slots in zip(task_ids, slot_mappings, strict=True):
            task = self._tasks.get(task_id)
            if task is None:
                raise ValueError(f"launch: task {task_id} is not a matched, unlaunched task")
            needed = len(task.blocks) * page_size  # the mask's True positions
            if len(slots) != needed:
                raise ValueError(f"launch: task {task_id} needs {needed} slots, got {len(slots)}")
            slots = np.asarray(slots)
            first = slots[::page_size]
            firsts.append(first)
            lasts.append(slots[page_size - 1 :: page_size])
            task.task_id = task_id
            (puts if task.is_put else gets).append((task, first))
        self._check_pages(task_ids, firsts, lasts, page_size)
        # From here on the tasks belong to their job (cancel ignores them, as it does ids
        # it does not know), and try_wait finds them through it.
        deque(map(self._tasks.pop, task_ids), maxlen=0)
        for is_put, chosen in ((False, gets), (True, puts)):  # loads first, as the engine
            if not chosen:
                continue
            tasks = [task for task, _ in chosen]
            firsts = [first for _, first in chosen]
            size = len(tasks[0].blocks)  # the tasks' common block count, or 0
            if any(len(task.blocks) != size for task in tasks):
                size = 0
            job = CopyJob(
                task_ids=[task.task_id for task in tasks],
                to_host=is_put,
                gpu_pages=np.asarray(_concat(firsts), dtype=np.int64) // page_size,
                host_blocks=_concat([task.blocks for task in tasks]),
            )
            self._launched[id(job)] = (tasks, size)
            transfer.submit(job)

    def _check_pages(
        self,
        task_ids: Sequence[int],
        firsts: list[Int64Array],
        lasts: list[Int64Array],
        page_size: int,
    ) -> None:
        """Slots must be whole pages in order (``page * page_size + 0..page_size-1``) of
        pages that exist: the copy moves whole pages, and an index past the caches would
        fault the device. Checked on each page's first and last slot, for the whole
        launch at once (a pass over every slot, or a check per task, costs about 1% of a
        batch's copy time); a page whose middle slots are permuted is copied in order."""
        if firsts and self._pages_ok(_concat(firsts), _concat(lasts), page_size):
            return
        for task_id, first, last in zip(task_ids, firsts, lasts, strict=True):
            if not self._pages_ok(first, last, page_size):
                raise ValueError(
                    f"launch: task {task_id}'s slots are not whole pages in order "
                    f"(page * {page_size} + 0..{page_size - 1}) of pages in "
                    f"[0, {self._gpu_pages})"
                )

    def _pages_ok(self, first: Int64Array, last: Int64Array, page_size: int) -> bool:
        return len(first) == 0 or not (
            (first % page_size).any()
            or int(first.min()) < 0
            or int(first.max()) >= self._gpu_pages * page_size
            or (last - first != page_size - 1).any()
        )

    def cancel(self, task_ids: Sequence[int]) -> None:
        """Roll back matched tasks. Launched tasks are left to finish; unknown ids are
        ignored (they may have finished already)."""
        for task_id in task_ids:
            task = self._tasks.pop(task_id, None)
            if task is not None:
                self._end_job([task], success=False)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """Terminal answers among ``task_ids``, each given once; never blocks."""
        done, finished = self._done_jobs, self._finished
        while done:
            job = done.popleft()
            tasks, size = self._launched.pop(id(job))
            if self._pool is not None:  # after close() the blocks went with the pool
                self._end_job(tasks, job.error is None, job.host_blocks, size)
            if job.error is None:
                results = [TaskResult(TaskStatus.SUCCESS, task.mask) for task in tasks]
            else:
                results = [TaskResult(TaskStatus.FAILED, t.mask, job.error) for t in tasks]
            finished.update(zip(job.task_ids, results, strict=True))
        if not finished:
            return {}
        return {t: finished.pop(t) for t in task_ids if t in finished}

    def close(self) -> None:
        """Finish queued copies, then release the pool."""
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
        self._pool = None

    # ---- internals -----------------------------------------------------------------

    def _new_task(self, task: _Task) -> int:
        task_id = next(self._ids)
        self._tasks[task_id] = task
        return task_id

    def _end_job(
        self,
        tasks: list[_Task],
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
        if tasks[0].is_put and not success:
            pool = self._require_pool()
            for task in tasks:
                if task.space is not None:
                    self._index.remove(task.space, task.digests)
                self._state[as_index(task.blocks)] = FREE
                pool.release(task.blocks)
            return
        if blocks is None:
            blocks = _concat([task.blocks for task in tasks])
            size = len(blocks) if len(tasks) == 1 else 0
        if len(blocks) == 0:
            return
        if tasks[0].is_put:
            self._state[blocks] = READY
        elif not self._shared_gets:
            # No open get shares a block with another: every block has this one reader.
            self._readers[blocks] = 0
        else:
            for task in tasks:  # exactly as one task after another
                self._drop_readers(task.blocks)
                self._shared_gets -= task.shared
            return
        # As make_evictable for each task in turn: tails first, later tasks more recent.
        if size:
            self._index.make_evictable_runs(blocks, size)
        else:
            self._index.make_evictable_many([task.blocks for task in tasks])

    def _drop_readers(self, blocks: Int64Array) -> None:
        """One get task's blocks (unique) lose a reader; the unread go back to the LRU."""
        left = self._readers[blocks] - 1
        self._readers[blocks] = left
        back = blocks[(left == 0) & (self._state[blocks] == READY)]
        if len(back):
            self._index.make_evictable(back)

    def _reserve(self, count: int) -> Int64Array:
        pool = self._require_pool()
        if count > pool.num_free + self._index.evictable:
            raise NoSpace(
                f"need {count} blocks; {pool.num_free} free, {self._index.evictable} "
                f"evictable of {pool.num_blocks}"
            )
        if count > pool.num_free:
            # LRU order is not block order; as_index (in release) needs them sorted.
            blocks = np.sort(self._index.evict(count - pool.num_free))
            self._state[blocks] = FREE
            pool.release(blocks)
        return pool.allocate(count)

    def set_notify(self, callback: Callable[[], None]) -> None:
        """Optional Store extension: ``callback`` is called (from the copy thread) each time
        tasks may have become terminal, so the engine need not poll ``try_wait``."""
        self._notify = callback

    def _job_done(self, job: CopyJob) -> None:  # copy thread
        self._done_jobs.append(job)  # deque append and popleft are atomic: no lock
        if self._notify is not None:
            self._notify()

    def _require_pool(self) -> HostPool:
        if self._pool is None:
            raise RuntimeError("LocalStore is not registered (or already closed)")
        return self._pool

    def _require_transfer(self) -> Transfer:
        if self._transfer is None:
            raise RuntimeError("LocalStore is not registered (or already closed)")
        return self._transfer
