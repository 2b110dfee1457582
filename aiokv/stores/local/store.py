"""LocalStore: aiokv's embedded store, a host-memory KV block store with a prefix index.

Block life: FREE -> WRITING (reserved by put_match, in the index but not readable) ->
READY (copy done; readable by get_match; evictable while no load reads it) -> FREE
(evicted, or rolled back by cancel or a failed copy). All metadata is touched only on the
caller's thread (the engine's store thread); the copy thread only moves bytes and reports.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...config import StoreConfig
from ...errors import ConfigError
from ..base import BoolArray, Int64Array, NoSpace, TaskResult, TaskStatus
from .index import BlockIndex, chain_digests
from .pool import HostPool, as_index
from .transfer import CopyJob, Transfer

# Block states, plain ints: compared against numpy elements on the hot path, where an
# IntEnum costs a few microseconds a comparison.
FREE, WRITING, READY = 0, 1, 2


@dataclass
class _Task:
    is_put: bool
    mask: BoolArray
    blocks: Int64Array  # host blocks of the mask's True pages, in order
    digests: list[bytes]  # their digests
    launched: bool = False


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
        self._index = BlockIndex()
        self._state: np.ndarray = np.zeros(0, dtype=np.int8)
        self._readers: np.ndarray = np.zeros(0, dtype=np.int32)
        self._tasks: dict[int, _Task] = {}
        self._finished: dict[int, TaskResult] = {}
        self._done_jobs: collections.deque[CopyJob] = collections.deque()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _done_jobs against the copy thread
        self._notify: Callable[[], None] | None = None

    # ---- set-up --------------------------------------------------------------------

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
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
        self._pool = HostPool(num_blocks, block_shape, first.dtype, pin)
        self._state = np.zeros(num_blocks, dtype=np.int8)
        self._readers = np.zeros(num_blocks, dtype=np.int32)
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
        digests = chain_digests(token_ids, namespace, self.page_size)
        present = self._index.lookup(digests)
        missing = [i for i, block in enumerate(present) if block is None]
        self._index.touch([b for b in present if b is not None])
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        blocks = np.empty(0, dtype=np.int64)
        if missing:
            # Keep this key's stored pages from being evicted to make room for its new ones.
            kept = [b for b in present if b is not None and self._state[b] == READY]
            self._add_readers(kept)
            try:
                blocks = self._reserve(len(missing))
            finally:
                self._drop_readers(kept)
            new_digests = [digests[i] for i in missing]
            self._index.insert(new_digests, blocks.tolist())
            self._state[as_index(blocks)] = WRITING
            if missing[-1] - missing[0] == len(missing) - 1:  # the usual suffix
                mask[missing[0] * self.page_size : (missing[-1] + 1) * self.page_size] = True
            else:
                pages = mask[: len(digests) * self.page_size].reshape(-1, self.page_size)
                pages[missing] = True
        else:
            new_digests = []
        return self._new_task(_Task(True, mask, blocks, new_digests)), mask

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """The longest READY prefix; its blocks are held (not evictable) until the task
        ends or is cancelled. mask True = will load."""
        self._require_pool()
        digests = chain_digests(token_ids, namespace, self.page_size)
        blocks: list[int] = []
        for digest in digests:
            block = self._index.get(digest)
            if block is None or self._state[block] != READY:
                break
            blocks.append(block)
        self._index.touch(blocks)
        self._add_readers(blocks)
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        mask[: len(blocks) * self.page_size] = True
        hit = np.asarray(blocks, dtype=np.int64)
        return self._new_task(_Task(False, mask, hit, digests[: len(blocks)])), mask

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        """Queue the copies of these matched tasks; never blocks on them."""
        if len(task_ids) != len(slot_mappings):
            raise ValueError("launch: one slot mapping per task id")
        transfer = self._require_transfer()
        plans = []
        for task_id, slots in zip(task_ids, slot_mappings, strict=True):
            task = self._tasks.get(task_id)
            if task is None or task.launched:
                raise ValueError(f"launch: task {task_id} is not a matched, unlaunched task")
            if len(slots) != int(task.mask.sum()):
                raise ValueError(
                    f"launch: task {task_id} needs {int(task.mask.sum())} slots, got {len(slots)}"
                )
            plans.append((task_id, task, np.asarray(slots, dtype=np.int64)[:: self.page_size]))
        for is_put in (False, True):  # loads first, as the engine orders them
            chosen = [p for p in plans if p[1].is_put is is_put]
            if not chosen:
                continue
            for _, task, _ in chosen:
                task.launched = True
            job = CopyJob(
                task_ids=[task_id for task_id, _, _ in chosen],
                to_host=is_put,
                gpu_pages=np.concatenate([first // self.page_size for _, _, first in chosen]),
                host_blocks=np.concatenate([task.blocks for _, task, _ in chosen]),
            )
            transfer.submit(job)

    def cancel(self, task_ids: Sequence[int]) -> None:
        """Roll back matched tasks. Launched tasks are left to finish; unknown ids are
        ignored (they may have finished already)."""
        for task_id in task_ids:
            task = self._tasks.get(task_id)
            if task is None or task.launched:
                continue
            del self._tasks[task_id]
            self._end(task, success=False)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """Terminal answers among ``task_ids``, each given once; never blocks."""
        with self._lock:
            jobs = list(self._done_jobs)
            self._done_jobs.clear()
        for job in jobs:
            for task_id in job.task_ids:
                task = self._tasks.pop(task_id)
                self._end(task, success=job.error is None)
                if job.error is None:
                    self._finished[task_id] = TaskResult(TaskStatus.SUCCESS, task.mask)
                else:
                    self._finished[task_id] = TaskResult(TaskStatus.FAILED, task.mask, job.error)
        return {t: self._finished.pop(t) for t in task_ids if t in self._finished}

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

    def _end(self, task: _Task, success: bool) -> None:
        """A task is over: publish or roll back its blocks."""
        if task.is_put:
            if success:
                self._state[as_index(task.blocks)] = READY
                self._index.make_evictable(task.blocks.tolist(), task.digests)
            else:
                for digest in task.digests:
                    self._index.remove(digest)
                self._state[as_index(task.blocks)] = FREE
                self._require_pool().release(task.blocks)
        else:
            self._drop_readers(task.blocks.tolist(), task.digests)

    def _add_readers(self, blocks: list[int]) -> None:
        for block in blocks:
            self._readers[block] += 1
            self._index.make_unevictable(block)

    def _drop_readers(self, blocks: list[int], digests: Sequence[bytes] | None = None) -> None:
        back: list[int] = []
        back_digests: list[bytes] = []
        for i, block in enumerate(blocks):
            self._readers[block] -= 1
            if self._readers[block] == 0 and self._state[block] == READY:
                back.append(block)
                back_digests.append(digests[i] if digests else self._index.digest_of(block))
        if back:
            self._index.make_evictable(back, back_digests)

    def _reserve(self, count: int) -> Int64Array:
        pool = self._require_pool()
        if count > pool.num_free + self._index.evictable:
            raise NoSpace(
                f"need {count} blocks; {pool.num_free} free, {self._index.evictable} "
                f"evictable of {pool.num_blocks}"
            )
        evicted = self._index.evict(count - pool.num_free)
        if evicted:
            # LRU order is not block order; as_index (in release) needs them sorted.
            blocks = np.sort(np.asarray(evicted, dtype=np.int64))
            self._state[blocks] = FREE
            pool.release(blocks)
        return pool.allocate(count)

    def set_notify(self, callback: Callable[[], None]) -> None:
        """Optional Store extension: ``callback`` is called (from the copy thread) each time
        tasks may have become terminal, so the engine need not poll ``try_wait``."""
        self._notify = callback

    def _job_done(self, job: CopyJob) -> None:  # copy thread
        with self._lock:
            self._done_jobs.append(job)
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
