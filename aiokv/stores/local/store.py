"""LocalStore: aiokv's embedded store, host blocks under a prefix index, with an
optional SSD tier below (``ssd_cache_gb``).

This module owns the Store protocol's tasks; what a put reserves is :mod:`.puts`', how
a job's end ends them :mod:`.completion`'s, their copy jobs :mod:`.jobs`' (the data
plane, :mod:`aiokv.copy`, checks and plans the callers' page ids off this thread), block
states, readers and eviction a tier's (:mod:`.blocks`), and moving blocks between the
host and the SSD tier the link's (:mod:`.tiering`; a get's SSD pages its ``loads``':
:mod:`.loads`). All metadata is touched only on the caller's thread (the engine's store
thread); the copy and I/O threads only move bytes and report. That thread holds the GIL
for all of it, so the bookkeeping is done per task or per copy job with numpy over
arrays of blocks and C-level dict operations, never a Python loop per block.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...config import StoreConfig, store_config
from ...copy.copier import Here
from ...copy.marks import LayerMarks
from ...errors import ConfigError, EngineClosed
from ...remote.link import RemoteLink
from ..base import BoolArray, Int64Array, MatchAnswers, Queries, TaskResult, TaskStatus
from .assembly import build
from .blocks import NO_BLOCKS, READY, Tier
from .completion import Task, TaskEnds, concat
from .digests import ChainMemo
from .index import BlockIndex
from .jobs import CopyJobs
from .pool import HostPool
from .puts import Puts
from .tiering import TierLink

log = logging.getLogger("aiokv")

SSD_VOID_WAIT_S = 30.0  # an evict waits this long for its SSD voids to be written


class LocalStore:
    """The embedded store. ``LocalStore(StoreConfig(cpu_cache_gb=..., ssd_cache_gb=...,
    ssd_cache_dir=...))``.

    Sized by ``cpu_cache_gb``: one host block per GPU page (all layers). Host memory is
    pinned when the caches are on a GPU. ``page_size`` comes from the config or, when
    that is None, from the caches at ``register``, which also opens the SSD tier (and
    raises ConfigError for its directories, size or a geometry mismatch).
    """

    def __init__(self, config: StoreConfig | None = None) -> None:
        self._config = store_config(config, "local")
        if self._config.ssd_cache_gb > 0 and not self._config.ssd_dirs():
            raise ConfigError(
                "store.ssd_cache_gb",
                f"is {self._config.ssd_cache_gb}, but store.ssd_cache_dir names no directory",
            )
        if self._config.ssd_cache_gb == 0 and self._config.ssd_dirs():
            # A ConfigError would refuse configs kept as templates, sized elsewhere.
            log.warning("aiokv: store.ssd_cache_dir is set but store.ssd_cache_gb is 0: no "
                        "SSD tier (set ssd_cache_gb to use %s)", ", ".join(self._config.ssd_dirs()))
        self.page_size = self._config.page_size or 0
        self._pool: HostPool | None = None
        self._jobs: CopyJobs | None = None  # the copiers, from register to close
        self._host: Tier | None = None
        self._link: TierLink | None = None
        self._puts: Puts | None = None  # put matches, from register
        self._memo: ChainMemo | None = None  # keys' digests (puts' and lookups'), from register
        self._num_layers = 0
        self._gpu_pages = 0  # pages per cache table, known at register
        self._tasks: dict[int, Task] = {}
        self._ends = TaskEnds(self._wake)
        self._ids = itertools.count(1)
        # The last launch's get tasks' marks, until the engine asks (layer_marks).
        self._marks: dict[int, LayerMarks] = {}
        self._notify: Callable[[], None] | None = None
        # Tokens get_match found on the host tier / only on SSD (EngineStats' tier hits).
        self._hits = {"host_hit_tokens": 0, "ssd_hit_tokens": 0}
        self._remote: RemoteLink | None = None  # store.remote: Mooncake, below all
        # The SSD and remote tiers' figures at their close: what they did stays readable.
        self._closed_stats: dict[str, int | float] = {}
        self._d2h_closed = 0  # the copiers' d2h_copies at close
        # take_load (callers' threads) against close: nothing is taken once close began.
        self._take_lock = threading.Lock()
        self._closing = False

    # ---- set-up --------------------------------------------------------------------

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if self._jobs is not None:
            # A second copy thread and pool would orphan every task of the first.
            raise RuntimeError("LocalStore.register() was already called")
        if self._closing:
            # Its tiers went with the close: a second engine would store into a pool
            # whose ends it never takes in (it stored, and every lookup missed).
            raise ConfigError(
                "store", f"LocalStore at {id(self):#x} was closed (with the engine that "
                "closed it): give the next engine a new store")
        first = kv_caches[0]
        page_size = int(first.shape[2])
        if self.page_size and self.page_size != page_size:
            raise ConfigError(
                "store.page_size", f"{self.page_size} does not match the caches' {page_size}"
            )
        self.page_size = page_size
        ends = self._ends
        parts = build(self._config, kv_caches, page_size, self._wake, ends)
        self._pool, self._host, self._link = parts.pool, parts.host, parts.link
        self._jobs = parts.jobs
        self._remote = parts.remote
        self._memo = ChainMemo(page_size)
        self._puts = Puts(parts.host, parts.link, parts.remote, self._memo, page_size,
                          self._new_task)
        ends.host, ends.link, ends.remote = parts.host, parts.link, parts.remote
        ends.block_bytes = parts.pool.block_bytes
        self._num_layers = len(kv_caches)
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
        pages now (also while blocks it would evict are still being written to SSD), and
        while a page of the key is still being written; TooLarge when the new pages are
        more than the host tier can ever hold (:mod:`.claims`, :mod:`.puts`)."""
        return self._require_puts().match(token_ids, namespace)

    def put_match_many(self, queries: Queries) -> MatchAnswers:
        """``put_match`` of each query in order (an answer or the exception it raised),
        a batch's puts of keys never seen in one reservation (:mod:`.puts`)."""
        return self._require_puts().match_many(queries)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        """The longest READY prefix, host pages first, then the pages after them that
        either tier has, in any interleaving (those only the SSD has read into host blocks
        from now on: :mod:`.loads`); its blocks are held (not evictable) until the task
        ends or is cancelled. Pages a cancelled task's reads still bring in (or a load's
        that timed out) count as held: this one takes them over (:mod:`.takeover`). mask
        True = will load; a load may report fewer (an SSD block that fails its checksum or
        that the disk cannot give back, and all pages after it, are not loaded)."""
        return self._get_match(token_ids, namespace, ask_remote=True)

    def _get_match(self, token_ids: Int64Array, namespace: Sequence[str], ask_remote: bool
                   ) -> tuple[int, BoolArray]:
        """``ask_remote``: a host miss asks Mooncake first (else a batch asked for it)."""
        host = self._require_host()
        memo = self._memo
        assert memo is not None  # made with the host tier
        link = self._link
        if link is not None:
            link.drain()
        key = tuple(namespace)
        if self._remote is not None and ask_remote:  # a host miss asks Mooncake first
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
            digests = memo.digests(key, token_ids)
            found = list(map(space.get, digests))
            if None in found:
                found = found[: found.index(None)]
            if found:
                hit = np.fromiter(found, dtype=np.int64, count=len(found))
                not_ready = host.state[hit] != READY
                if np.count_nonzero(not_ready):  # cheaper than argmax when none
                    hit = hit[: int(np.argmax(not_ready))]
        adopted = None
        if link is not None and len(hit) < len(found):
            # A page being read in from SSD: for a released Lookup's prefetch of these
            # pages, this match takes it over (the user looks the key up again).
            assert digests is not None
            adopted = link.loads.adopt(key, digests)
        if adopted is not None:
            task = adopted
            task.mask = mask
        else:
            shared = bool(len(hit)) and host.hold(hit)  # unique: one block per page of a key
            host.shared_gets += shared
            task = Task(False, mask, hit, [], None, shared=shared)
        if link is not None and adopted is None and len(hit) == len(found):
            if digests is None:
                digests = memo.digests(key, token_ids)
            task.load = link.loads.start_load(key, digests, len(hit), task)
        load = task.load
        pages = load.pages if load is not None else len(hit)
        mask[: pages * self.page_size] = True
        # Its host pages, also those after an SSD page (start_load), up to the pages it
        # reports (a load adopted for a prefix holds more until it is cut: takeover.py).
        on_host = int(np.searchsorted(load.host_at, pages)) if load is not None else len(hit)
        self._hits["host_hit_tokens"] += on_host * self.page_size
        self._hits["ssd_hit_tokens"] += (pages - on_host) * self.page_size
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
            remote.fill(queries, link.ssd.has if link is not None else None)
        answers: MatchAnswers = []
        for token_ids, namespace in queries:
            try:
                answers.append(self._get_match(token_ids, namespace, ask_remote=False))
            except Exception as exc:  # that query's answer, as one by one
                answers.append(exc)
        return answers

    def launch(
        self,
        task_ids: Sequence[int],
        pages: Sequence[torch.Tensor | Int64Array],
        ready: Sequence[Any],
    ) -> None:
        """Queue the copies of these matched tasks; never blocks on them. ``pages[i]``:
        task i's page ids, one per True page of its mask (a tensor as the caller gave it:
        checked by the copier, a bad id fails only its task, INVALID); ``ready[i]``: the
        CUDA event (or None) its copies wait for. A get task past its deadline
        (:meth:`set_deadlines`) copies nothing and ends EXPIRED. Raises ValueError
        (launching none of them) for an id that is not a matched task, or a page count
        that is not the mask's."""
        if not len(task_ids) == len(pages) == len(ready):
            raise ValueError("launch: one page id tensor and one ready event per task id")
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("launch: a task id is given twice")
        jobs = self._require_jobs()
        chosen: dict[str, list[tuple[Task, Any, Any]]] = {
            "get": [], "put": [], "load": [], "late": []}
        now = time.monotonic()
        for task_id, task_pages, event in zip(task_ids, pages, ready, strict=True):
            task = self._tasks.get(task_id)
            if task is None:
                raise ValueError(f"launch: task {task_id} is not a matched, unlaunched task")
            needed = task.load.pages if task.load is not None else len(task.blocks)
            if len(task_pages) != needed:
                raise ValueError(f"launch: task {task_id} needs {needed} page ids, "
                                 f"got {len(task_pages)}")
            task.task_id = task_id
            kind = "load" if task.load is not None else "put" if task.is_put else "get"
            if kind == "get" and task.deadline is not None and task.deadline <= now:
                kind = "late"  # (a load checks its own: loads.py)
            chosen[kind].append((task, task_pages, event))
        # From here on the tasks belong to their job (cancel ignores them, as it does ids
        # it does not know), and try_wait finds them through it.
        for task_id in task_ids:
            del self._tasks[task_id]
        self._marks = {}
        for task, _, _ in chosen["get"]:
            task.marks = self._marks[task.task_id] = LayerMarks(self._num_layers)
        # Loads first, as the engine does.
        for kind in ("get", "put"):
            if chosen[kind]:
                tasks = [task for task, _, _ in chosen[kind]]
                jobs.submit(tasks, [p for _, p, _ in chosen[kind]],
                            concat([task.blocks for task in tasks]),
                            [e for _, _, e in chosen[kind]])
        for task, task_pages, event in chosen["load"]:
            assert task.load is not None and self._link is not None
            self._link.loads.launch_load(task.load, task_pages, [event])
        if chosen["late"]:
            self._ends.expire([task for task, _, _ in chosen["late"]])

    def layer_marks(self, task_id: int) -> LayerMarks | None:
        """The per-layer marks of a get task the last launch took (base.MarksLayers);
        None for one with an SSD part (its layers are known at its end) or another id."""
        return self._marks.pop(task_id, None)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """Terminal answers among ``task_ids``, each given once; never blocks."""
        if self._link is not None:
            self._link.drain()
        if self._remote is not None:
            self._remote.drain()
        self._ends.collect()
        return self._ends.answers(task_ids)

    def parked(self, task_ids: Sequence[int]) -> list[int]:
        """base.ParksLoads: launched loads whose SSD pages wait for host room that only
        the engine's later calls give back: room its matched, unlaunched tasks hold
        (.staging)."""
        if self._link is None:
            return []
        return self._link.staging.parked(task_ids, list(self._tasks.values()))

    def cancel(self, task_ids: Sequence[int]) -> None:
        """Roll back matched tasks. Launched tasks are left to finish; unknown ids are
        ignored (they may have finished already, or a caller took them: take_load)."""
        # A taken load's caller gives its reservation back once its copies ran: their
        # end is taken in here, its blocks' reads ended, whether or not this thread
        # polls for anything else.
        self._ends.collect()
        for task_id in task_ids:
            task = self._tasks.pop(task_id, None)
            if task is None:
                continue
            if task.load is not None and self._link is not None:
                self._link.loads.cancel_load(task.load)  # ends the task once its reads are in
            else:
                self._ends.puts.pop(task_id, None)
                self._ends.end_tasks([task], success=False)
        if self._link is not None:
            self._link.staging.stage_waiting()  # what the cancelled tasks held is room now

    def watch_detaches(self, detached: Callable[[int], bool]) -> None:
        """Puts detached in another process (``detached(task_id)``: an engine's table,
        :mod:`aiokv.stores.detaches`, read in this store's child): each put's copy, taken
        in as done, counts for nothing where its id is there by then, as after
        :meth:`detach`."""
        self._ends.detached_elsewhere = detached

    def detach(self, task_id: int) -> None:
        """base.Detaches: the caller of this put stopped waiting (loop thread; never
        blocks). Unless the copy of its pages had been seen to end by now, it keeps
        nothing of them: the task ends FAILED, its blocks rolled back (a put waiting on
        them writes them itself). Any other id (a get, a task that ended) is ignored."""
        task = self._ends.puts.get(task_id)  # a dict read: atomic against the store thread
        if task is not None:
            task.detached = True

    # ---- loads queued by their callers (stores.base.TakesLoads) ----------------------

    def takes_load(self, task_id: int) -> bool:
        """Any thread: whether :meth:`take_loads` would take this matched task (a get with
        no SSD part: its blocks are in the pinned pool, read by no staging)."""
        task = self._tasks.get(task_id)  # a dict read: atomic against the store thread
        return task is not None and not task.is_put and task.load is None

    def take_loads(
        self, task_ids: Sequence[int], pages: Sequence[Any], ready: Any
    ) -> list[_Taken | None]:
        """Any thread (stores.base.TakesLoads): the matched gets ``task_ids`` taken out
        of the store's hands (dict pops, atomic against the store thread, whose launch
        and cancel then find nothing) and their copies queued by this thread, one job,
        into ``pages`` after ``ready``; None for one given back meanwhile (an evict or
        clear). Their blocks stay held as any launched get's do, so an evict keeps them
        until the copies ran; the store thread ends the tasks (their reads) once they did.
        Raises EngineClosed once close began (it waits for what was taken)."""
        if len(task_ids) != len(pages):
            raise ValueError(f"take_loads: {len(pages)} page id tensors for "
                             f"{len(task_ids)} tasks")
        with self._take_lock:  # close flips _closing under it, then closes the copiers
            if self._closing or self._jobs is None:
                raise EngineClosed("the store is closed")
            found = [self._tasks.pop(task_id, None) for task_id in task_ids]
            why = next((
                f"task {task_id} is not a get of host pages"
                if task.is_put or task.load is not None
                else f"task {task_id} needs {len(task.blocks)} page ids, got {len(p)}"
                for task_id, task, p in zip(task_ids, found, pages, strict=True)
                if task is not None and (task.is_put or task.load is not None
                                         or len(p) != len(task.blocks))), None)
            taken = [(task_id, task, p) for task_id, task, p in zip(
                task_ids, found, pages, strict=True) if task is not None]
            here = None
            if why is None and taken:
                for task_id, task, _ in taken:
                    task.task_id, task.taken = task_id, True
                here = self._jobs.queue_here([t for _, t, _ in taken], [p for _, _, p in taken],
                                             ready)
            if here is None and taken:  # refused, or the interpreter exits: all go back
                for task_id, task, _ in taken:
                    task.taken = False
                    self._tasks[task_id] = task
                if why is not None:
                    raise ValueError(f"take_loads: {why}")
                raise EngineClosed("the store is closing: the interpreter exits")
        segments = iter(range(len(taken)))
        return [None if task is None else _Taken(here, task.mask, next(segments))
                for task in found]

    def close(self) -> None:
        """Finish queued copies (and SSD writes, and the loads callers took), then release
        the pool."""
        with self._take_lock:
            self._closing = True
        if self._jobs is not None:
            self._jobs.close()
            self._d2h_closed = self._jobs.d2h_copies
            # The copiers' close reported the loads callers took and nobody waited for:
            # taken in now (their bytes, their blocks' reads), as nothing polls after.
            self._ends.collect()
        self._jobs = None
        self._ends.closed = True
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
        the call stay (they end as their tasks do). OSError when the SSD tier could not
        void what names the key on disk (:mod:`.ssd_voids`), or not within
        SSD_VOID_WAIT_S: dropped here all the same, but a restart may find it; an evict of
        it once the disk is well voids it."""
        return self._drop(tuple(namespace))

    def clear(self) -> int:
        """Drop every idle block in both tiers; returns the tokens dropped. OSError,
        dropping nothing in any tier, when the SSD tier cannot write the new epoch that
        keeps a restart from finding what it drops (:meth:`.ssd.SsdTier.begin_clear`
        says why nothing)."""
        return self._drop(None)

    def _drop(self, namespace: tuple[str, ...] | None) -> int:
        host = self._require_host()
        # Loads their callers took before the call (nothing polls for them) end their
        # reads first, once their copies ran: a load taken before the evict comes before
        # it, as one the loop dispatched does, and its blocks are idle, dropped now.
        if self._jobs is not None:
            self._jobs.wait_taken()
        self._ends.collect()
        link = self._link
        if link is not None and namespace is None:
            link.ssd.begin_clear()  # first: where it fails, nothing is dropped
        if self._remote is not None:
            self._remote.invalidate(namespace)
        if link is not None:
            link.drain()
            pages, written = link.drop(namespace)
            # Answered once the SSD holds none of it: a restart, even after a kill -9,
            # must not bring an evicted key back.
            if not written.wait(SSD_VOID_WAIT_S):  # a disk that slow: told, not hidden
                raise OSError(errno.ETIMEDOUT, f"the evict's SSD voids were not written "
                              f"within {SSD_VOID_WAIT_S:.0f} s: the key is dropped here, "
                              "but a restart before they are may find it")
            if written.failure is not None:
                raise OSError(errno.EIO, written.failure)
            return pages * self.page_size
        return len(host.drop_namespace(namespace)) * self.page_size

    def store_stats(self) -> Mapping[str, int | float]:
        """Tier occupancy (blocks), tier hits (tokens) and byte counters since the store
        was opened."""
        host = self._host
        stats: dict[str, int | float] = {
            "host_blocks_used": host.used if host is not None else 0,
            # Where pinning stopped short (a memlock limit), those pinned: the engine's
            # bound on an offload (capacity_tokens) follows it.
            "host_blocks_total": host.alloc.capacity if host is not None else 0,
            # Pinned so far (the pool grows into its size after start); all when unpinned.
            "host_blocks_ready": self._pool.memory.ready_blocks if self._pool is not None else 0,
            **self._ends.bytes,
            "d2h_copies": self._jobs.d2h_copies if self._jobs else self._d2h_closed,
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

    def set_deadlines(self, task_ids: Sequence[int], deadlines_s: Sequence[float]) -> None:
        """Optional Store extension (base.BoundsWaits): matched get tasks' deadlines
        (``time.monotonic()``), given before the launch that takes them. Nothing of a
        task is queued for its copy into the caller's pages after it: launched later, it
        copies nothing; a load's SSD pages wait for host room (:mod:`.staging`), and are
        queued, until then only. Such a task ends EXPIRED (:mod:`.loads`). A load given
        none waits until there is room. Ids that are not matched get tasks are ignored."""
        for task_id, deadline in zip(task_ids, deadlines_s, strict=True):
            task = self._tasks.get(task_id)
            if task is None or task.is_put:
                continue
            if task.load is not None:
                task.load.deadline = deadline
            else:
                task.deadline = deadline

    # ---- internals -----------------------------------------------------------------

    def _new_task(self, task: Task) -> int:
        task_id = next(self._ids)
        self._tasks[task_id] = task
        if task.is_put:
            task.task_id = task_id  # launch sets it too; ended by its id (TaskEnds.puts)
            self._ends.puts[task_id] = task
        return task_id

    def _require_host(self) -> Tier:
        if self._host is None or self._pool is None:
            raise RuntimeError("LocalStore is not registered (or already closed)")
        return self._host

    def _require_puts(self) -> Puts:
        self._require_host()
        assert self._puts is not None  # made with the host tier
        return self._puts

    def _require_jobs(self) -> CopyJobs:
        if self._jobs is None:
            raise RuntimeError("LocalStore is not registered (or already closed)")
        return self._jobs

    def _wake(self) -> None:  # any thread
        if self._notify is not None:
            self._notify()


class _Taken:
    """A get its caller took (LocalStore.take_loads): segment ``segment`` of a copy job
    queued by that caller."""

    __slots__ = ("_here", "_mask", "_segment")

    def __init__(self, here: Here | None, mask: BoolArray, segment: int) -> None:
        assert here is not None
        self._here, self._mask, self._segment = here, mask, segment

    def wait(self) -> TaskResult:
        job = self._here.wait()
        why = job.invalid.get(self._segment)
        if why is not None:
            return TaskResult(TaskStatus.INVALID, self._mask, why)
        if job.error is not None:
            return TaskResult(TaskStatus.FAILED, self._mask, job.error)
        return TaskResult(TaskStatus.SUCCESS, self._mask)
