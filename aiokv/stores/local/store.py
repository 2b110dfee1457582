"""LocalStore: aiokv's embedded store, host blocks under a prefix index, with an
optional SSD tier below (``ssd_cache_gb``).

This module owns the Store protocol's tasks and copy jobs; how a job's end ends its
tasks is :mod:`.completion`'s, which launch a copy ahead is for :mod:`.prestaging`'s,
block states, readers and eviction are a tier's (:mod:`.blocks`), the GPU <-> host
copies the copy threads' (:mod:`.transfer`), and moving blocks between the host and
the SSD tier the link's (:mod:`.tiering`). All
metadata is touched only on the caller's thread (the engine's store thread); the copy
and I/O threads only move bytes and report. That thread holds the GIL for all of it, so
the bookkeeping is done per task or per copy job with numpy over arrays of blocks and
C-level dict operations, never a Python loop per block.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from ...config import StoreConfig
from ...errors import ConfigError
from ...remote.link import RemoteLink
from ..base import BoolArray, Int64Array, MatchAnswers, Queries, TaskResult
from .assembly import build
from .blocks import NO_BLOCKS, READY, Tier
from .checks import check_pages
from .completion import Task, TaskEnds, concat
from .index import BlockIndex, chain_digests
from .pool import HostPool
from .prestaging import Prestaging
from .tiering import TierLink
from .transfer import CopyJob, Transfer


class LocalStore(TaskEnds, Prestaging):
    """The embedded store. ``LocalStore(StoreConfig(cpu_cache_gb=..., ssd_cache_gb=...,
    ssd_cache_dir=...))``.

    Sized by ``cpu_cache_gb``: one host block per GPU page (all layers). Host memory is
    pinned when the caches are on a GPU. ``page_size`` comes from the config or, when
    that is None, from the caches at ``register``, which also opens the SSD tier (and
    raises ConfigError for its directories, size or a geometry mismatch).
    """

    def __init__(self, config: StoreConfig | None = None) -> None:
        self._config = config or StoreConfig()
        if self._config.ssd_cache_gb > 0 and not self._config.ssd_dirs():
            raise ConfigError(
                "store.ssd_cache_gb",
                f"is {self._config.ssd_cache_gb}, but store.ssd_cache_dir names no directory",
            )
        self.page_size = self._config.page_size or 0
        self._pool: HostPool | None = None
        self._transfer: Transfer | None = None  # offloads, and on the CPU loads too
        self._load_transfer: Transfer | None = None  # loads, on a GPU
        self._host: Tier | None = None
        self._link: TierLink | None = None
        self._gpu_pages = 0  # pages per cache table, known at register
        self._tasks: dict[int, Task] = {}
        self._finished: dict[int, TaskResult] = {}
        self._done_jobs: deque[CopyJob] = deque()
        self._ids = itertools.count(1)
        # id(CopyJob) -> its tasks, and their common block count (0: they differ)
        self._launched: dict[int, tuple[list[Task], int]] = {}
        self._start_prestaging()
        self._notify: Callable[[], None] | None = None
        self._wait_timeout_s: float | None = None  # set_wait_timeout
        self._bytes = {"bytes_d2h": 0, "bytes_h2d": 0}
        # Tokens get_match found on the host tier / only on SSD (EngineStats' tier hits).
        self._hits = {"host_hit_tokens": 0, "ssd_hit_tokens": 0}
        self._remote: RemoteLink | None = None  # store.remote: Mooncake, below all
        # The SSD and remote tiers' figures at their close: what they did stays readable.
        self._closed_stats: dict[str, int | float] = {}

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
        parts = build(
            self._config, kv_caches, page_size, self._wake, self._copy, self.end_tasks,
            self._job_done, self._wait_timeout_s,
        )
        self._pool, self._host, self._link = parts.pool, parts.host, parts.link
        self._transfer, self._load_transfer = parts.transfer, parts.load_transfer
        self._remote = parts.remote
        self._gpu_pages = int(first.shape[0])

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks if self._pool is not None else 0

    @property
    def _index(self) -> BlockIndex:  # the host tier's, for tests that look inside
        return self._require_host().index


    @property
    def free_blocks(self) -> int:
        return self._pool.num_free if self._pool is not None else 0

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until the host tier is pinned whole (it grows in chunks after register;
        at once where nothing is pinned); whether it is. Any thread: it only waits on
        the pinning threads, and touches none of the store's state. For benchmarks that
        measure steady copies rather than start-up."""
        pool = self._pool
        return pool is not None and pool.memory.wait_all(timeout)

    # ---- Store protocol ------------------------------------------------------------

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """Reserve blocks for the pages not yet stored (in either tier); mask True = must
        write. Raises NoSpace when some page is new and the host tier cannot take all new
        pages now (also while blocks it would evict are still being written to SSD)."""
        host = self._require_host()
        link = self._link
        if link is not None:
            link.drain()
        if self._remote is not None:
            self._remote.drain()
        page_size = self.page_size
        key = tuple(namespace)
        digests = chain_digests(token_ids, page_size)
        n = len(digests)
        space = host.index.space(key)
        present: list[int | None] | None = (
            list(map(space.get, digests)) if space is not None else None
        )
        if link is not None:
            present = link.mark_stored_below(key, digests, present)
        missing_count = n if present is None else present.count(None)
        if present is not None and missing_count < n:
            # Stored (or being written) pages become the most recent; while new blocks are
            # reserved, they are out of the LRU so that eviction cannot take them.
            held = np.array([b for b in present if b is not None and b >= 0], dtype=np.int64)
            listed = host.index.make_unevictable(held)
        else:
            listed = None
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        blocks = NO_BLOCKS
        new_digests: list[bytes] = []
        owner = space
        if missing_count:
            try:
                if link is not None:
                    link.leave_owed(missing_count)  # loads launched before it wait for room
                blocks = host.reserve(missing_count)
            finally:
                if listed is not None:
                    host.index.make_evictable(listed)
            if present is None or missing_count == n:
                first, new_digests = 0, digests
            else:
                first = present.index(None)
                new_digests = [d for d, b in zip(digests, present, strict=True) if b is None]
            owner = host.index.insert(key, new_digests, blocks)
            if n - first == missing_count:  # the usual: a suffix
                mask[first * page_size : n * page_size] = True
            else:
                pages = mask[: n * page_size].reshape(-1, page_size)
                assert present is not None
                pages[[i for i, b in enumerate(present) if b is None]] = True
        elif listed is not None:
            host.index.make_evictable(listed)
        return self._new_task(Task(True, mask, blocks, new_digests, owner)), mask

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """The longest READY prefix, host pages first, then pages the SSD tier has (read
        into host blocks from now on); its blocks are held (not evictable) until the task
        ends or is cancelled. mask True = will load; a load may report fewer (a block that
        fails its checksum, and all after it, are not loaded)."""
        host = self._require_host()
        link = self._link
        if link is not None:
            link.drain()
        key = tuple(namespace)
        if self._remote is not None:  # a host miss asks Mooncake first
            self._remote.drain()
            self._remote.fill([(token_ids, key)], link.ssd.has if link is not None else None)
        space = host.index.space(key)
        # No prefix of the key is longer than the pages its tables hold (host, SSD): hash
        # no further, so a lookup costs what the key has stored, not what was asked.
        held = (len(space) if space is not None else 0) + (
            link.ssd_pages(key) if link is not None else 0
        )
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        token_ids = token_ids[: held * self.page_size]
        hit = NO_BLOCKS
        digests: list[bytes] | None = None
        found: list[int | None] = []
        if space is not None:
            digests = chain_digests(token_ids, self.page_size)
            found = list(map(space.get, digests))
            if None in found:
                found = found[: found.index(None)]
            if found:
                hit = np.fromiter(found, dtype=np.int64, count=len(found))
                not_ready = host.state[hit] != READY
                if np.count_nonzero(not_ready):  # cheaper than argmax when none
                    hit = hit[: int(np.argmax(not_ready))]
        shared = bool(len(hit)) and host.hold(hit)  # unique: one block per page of a key
        host.shared_gets += shared
        task = Task(False, mask, hit, [], None, shared=shared)
        if link is not None and (len(hit) == len(found)):
            if digests is None:
                digests = chain_digests(token_ids, self.page_size)
            task.load = link.start_load(key, digests, len(hit), task)
        pages = task.load.match_pages if task.load is not None else len(hit)
        mask[: pages * self.page_size] = True
        self._hits["host_hit_tokens"] += len(hit) * self.page_size
        self._hits["ssd_hit_tokens"] += (pages - len(hit)) * self.page_size
        return self._new_task(task), mask

    @property
    def get_match_many(self) -> Callable[[Queries], MatchAnswers] | None:
        """Offered with a remote tier only (elsewhere None: the engine matches one by
        one): ``get_match`` of each query in order (an answer or the exception it
        raised), Mooncake asked once for all their host misses."""
        return self._get_match_many if self._config.remote is not None else None

    def _get_match_many(self, queries: Queries) -> MatchAnswers:
        remote, link = self._remote, self._link
        if remote is not None:
            remote.drain()
            remote.fill(queries, link.ssd.has if link is not None else None, batch=True)
        answers: MatchAnswers = []
        try:
            for token_ids, namespace in queries:
                try:
                    answers.append(self.get_match(token_ids, namespace))
                except Exception as exc:  # that query's answer, as one by one
                    answers.append(exc)
        finally:
            if remote is not None:
                remote.forget()
        return answers

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        """Queue the copies of these matched tasks; never blocks on them."""
        if len(task_ids) != len(slot_mappings):
            raise ValueError("launch: one slot mapping per task id")
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("launch: a task id is given twice")
        self._require_transfer()
        page_size = self.page_size
        gets: list[tuple[Task, Int64Array]] = []  # (task, the first slot of each page)
        puts: list[tuple[Task, Int64Array]] = []
        loads: list[tuple[Task, Int64Array]] = []  # gets with an SSD part
        firsts: list[Int64Array] = []  # per task, in task_ids order: checked at once
        lasts: list[Int64Array] = []  # the last slot of each page
        for task_id, slots in zip(task_ids, slot_mappings, strict=True):
            task = self._tasks.get(task_id)
            if task is None:
                raise ValueError(f"launch: task {task_id} is not a matched, unlaunched task")
            pages = task.load.match_pages if task.load is not None else len(task.blocks)
            needed = pages * page_size  # the mask's True positions at match
            if len(slots) != needed:
                raise ValueError(f"launch: task {task_id} needs {needed} slots, got {len(slots)}")
            slots = np.asarray(slots)
            first = slots[::page_size]
            firsts.append(first)
            lasts.append(slots[page_size - 1 :: page_size])
            task.task_id = task_id
            chosen = loads if task.load is not None else gets if not task.is_put else puts
            chosen.append((task, first))
        check_pages(task_ids, firsts, lasts, page_size, self._gpu_pages)
        tags = self._launch_tags([t.task_id for t, _ in gets], [t.task_id for t, _ in puts])
        # From here on the tasks belong to their job (cancel ignores them, as it does ids
        # it does not know), and try_wait finds them through it.
        deque(map(self._tasks.pop, task_ids), maxlen=0)
        # Loads first, as the engine; each job with the tag of its copy ahead (or 0).
        for is_put, chosen, early in ((False, gets, tags[0]), (True, puts, tags[1])):
            if not chosen:
                continue
            tasks = [task for task, _ in chosen]
            size = len(tasks[0].blocks)  # the tasks' common block count, or 0
            if any(len(task.blocks) != size for task in tasks):
                size = 0
            slots = np.asarray(concat([first for _, first in chosen]), dtype=np.int64)
            blocks = concat([task.blocks for task in tasks])
            self._copy(tasks, is_put, slots // page_size, blocks, size, early)
        for task, first in loads:
            assert task.load is not None and self._link is not None
            self._link.launch_load(task.load, np.asarray(first, dtype=np.int64) // page_size)

    def _copy(
        self, tasks: list[Task], to_host: bool, gpu_pages: Int64Array,
        host_blocks: Int64Array, size: int = 0, prestaged: int = 0,
    ) -> CopyJob:
        """Queue one copy job; ``tasks`` (maybe none: a load's chunk) end with it.
        ``prestaged``: the tag of the prestage of exactly these blocks, in order (or 0)."""
        job = CopyJob(
            task_ids=[task.task_id for task in tasks],
            to_host=to_host,
            gpu_pages=gpu_pages,
            host_blocks=host_blocks,
            prestaged=prestaged,
        )
        self._launched[id(job)] = (tasks, size)
        transfer = self._require_transfer()
        if not to_host and self._load_transfer is not None:
            transfer = self._load_transfer
        transfer.submit(job)
        return job

    def wait_queued(self) -> None:
        """Block until the copies of every offload launched (or prestaged) so far are
        queued on the device (base.QueuesCopies): the engine's store thread sleeps here
        between a large batch's first launch and its remaining matches."""
        if self._transfer is not None:
            self._transfer.wait_queued()

    def cancel(self, task_ids: Sequence[int]) -> None:
        """Roll back matched tasks. Launched tasks are left to finish; unknown ids are
        ignored (they may have finished already)."""
        self._settle_puts(task_ids)
        for task_id in task_ids:
            task = self._tasks.pop(task_id, None)
            if task is None:
                continue
            if task.load is not None and self._link is not None:
                self._link.cancel_load(task.load)  # ends the task once its reads are in
            else:
                self.end_tasks([task], success=False)
        if self._link is not None:
            self._link.stage_waiting()  # what the cancelled tasks held is room now

    def close(self) -> None:
        """Finish queued copies (and SSD writes), then release the pool."""
        for transfer in (self._transfer, self._load_transfer):
            if transfer is not None:
                transfer.close()
        self._transfer = self._load_transfer = None
        if self._remote is not None:
            self._remote.close()  # before the pool: its memory is registered with Mooncake
            self._closed_stats.update(self._remote.stats())
            self._remote = None
        if self._link is not None:
            self._link.close()
            self._closed_stats.update(self._link.stats())
            self._link = None
        if self._pool is not None:
            self._pool.close()  # unpinned once nothing copies from it
        self._pool = None

    # ---- optional capabilities -----------------------------------------------------

    def evict(self, namespace: Sequence[str]) -> int:
        """Drop every idle block stored under exactly ``namespace``, in both tiers;
        returns the tokens dropped (blocks * page_size). Blocks being written or read at
        the call stay (they end as their tasks do)."""
        return self._drop(tuple(namespace))

    def clear(self) -> int:
        """Drop every idle block in both tiers; returns the tokens dropped."""
        return self._drop(None)

    def _drop(self, namespace: tuple[str, ...] | None) -> int:
        host = self._require_host()
        if self._remote is not None:
            self._remote.invalidate(namespace)
        link = self._link
        if link is not None:
            link.drain()
            return link.drop(namespace) * self.page_size
        return len(host.drop_namespace(namespace)) * self.page_size

    def store_stats(self) -> Mapping[str, int | float]:
        """Tier occupancy (blocks), tier hits (tokens) and byte counters since the store
        was opened."""
        host = self._host
        stats: dict[str, int | float] = {
            "host_blocks_used": host.used if host is not None else 0,
            "host_blocks_total": host.num_blocks if host is not None else 0,
            # Pinned so far (the pool grows into its size after start); all when unpinned.
            "host_blocks_ready": self._pool.memory.ready_blocks if self._pool is not None else 0,
            **self._bytes,
            **self._hits,
            **self._closed_stats,
        }
        for tier in (self._link, self._remote):
            if tier is not None:
                stats.update(tier.stats())
        # Remote hits are read into the host tier before the match: one tier counts each.
        remote_hits = stats.get("remote_hit_tokens", 0)
        stats["host_hit_tokens"] = max(0, stats["host_hit_tokens"] - remote_hits)
        return stats

    def set_notify(self, callback: Callable[[], None]) -> None:
        """Optional Store extension: ``callback`` is called (from the copy and I/O
        threads) each time tasks may have become terminal, so the engine need not poll
        ``try_wait``."""
        self._notify = callback

    def set_wait_timeout(self, timeout_s: float | None) -> None:
        """Optional Store extension (base.BoundsWaits): a launched load whose SSD pages
        found no host room fails after ``timeout_s`` without copying (None: it waits
        until there is room)."""
        self._wait_timeout_s = timeout_s
        if self._link is not None:
            self._link.wait_timeout_s = timeout_s

    # ---- internals -----------------------------------------------------------------

    def _new_task(self, task: Task) -> int:
        task_id = next(self._ids)
        self._tasks[task_id] = task
        return task_id

    def _require_host(self) -> Tier:
        if self._host is None or self._pool is None:
            raise RuntimeError("LocalStore is not registered (or already closed)")
        return self._host

    def _require_transfer(self) -> Transfer:
        if self._transfer is None:
            raise RuntimeError("LocalStore is not registered (or already closed)")
        return self._transfer

