"""The server's store: the embedded store's index, host tier and SSD tier over the shared
region, with each engine's tasks held in its name.

What :class:`~aiokv.stores.local.store.LocalStore` does on its store thread, minus the
copies: a match reserves (puts) or holds (gets) host blocks and answers their numbers,
the engine copies between its caches and those blocks in the region itself, and then
reports each task's end (:meth:`Service.finish`): a put's blocks are published (and
written through to SSD) or rolled back, a get's readers dropped. A get's pages that only
the SSD tier has are read into host blocks before its match is answered (the SSD link's
load staging), so that an engine only ever copies from the host tier: such a get, and a
get of a key whose pages are being read, waits while the server answers other requests
(:mod:`.deferred`, :meth:`Service.settle`). Where no host block is free for its SSD pages
it first waits for room as the embedded store's load does, but only while room comes
back by itself (SSD copies or remote writes hold host blocks no get reads:
``LoadStaging.room_coming``), not for other engines' tasks to end; otherwise, and once
those copies are in without the room, it is answered with its host pages. Everything
runs on the server's one thread.

Every task belongs to the connection that matched it (a :class:`Client`): a task id
from another connection is a :class:`Foreign` (the server drops that peer), and when a
connection ends, however it ends, its tasks are rolled back (:meth:`Service.drop`).

With ``store.remote`` the server owns a remote tier on Mooncake below both
(:mod:`aiokv.remote.link`, as the embedded store does): a put's blocks follow in the
background once its end is reported, and a batch of gets asks Mooncake, in one read, for
what neither tier has; the gets of those keys wait for it as for another get's SSD reads
(:mod:`.deferred`), bounded by ``timeout_ms``.

An evict or clear drops the key at once from every tier, what is in use included (out of
reach, freed once unused: ``Tier.drop_namespace``), and takes back the gets of it that engines
hold and do not copy yet (:meth:`Service.invalidate`, :mod:`.notice`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from ...config import StoreConfig
from ...errors import ConfigError
from ...remote.config import RemoteConfig
from ...remote.link import RemoteLink
from ...remote.reads import Published
from ..base import BoolArray, Int64Array, NoSpace, capacity_tokens
from ..dirlock import SERVER, DirLock
from ..local.blocks import NO_BLOCKS, READY, Tier
from ..local.ssd_io import lock_directory
from ..local.ssd_voids import VoidsDone
from ..local.tiering import TierLink
from .deferred import DeferredGets, launch_staged
from .puts import match_puts
from .quarantine import Kept
from .region import Geometry, Region, RegionPool, allocate, region_blocks
from .tasks import NO_MASK, Client, Entry, Foreign, PendingGet, Retry, Task
from .wire import Answer, Query

log = logging.getLogger("aiokv.server")

# An evict's tokens, its SSD voids' event and its remote marker (each None without the tier).
Dropped = tuple[int, VoidsDone | None, Published | None]


class Service:
    def __init__(self, config: StoreConfig, wake: Callable[[], None]) -> None:
        self.config = config
        self._wake = wake
        self.geometry: Geometry | None = None
        self.region: Region | None = None
        self.capacity_tokens = 0  # the host and SSD tiers' blocks in tokens, once registered
        self._pool: RegionPool | None = None
        self._host: Tier | None = None
        self._link: TierLink | None = None
        self._remote: RemoteLink | None = None  # store.remote: Mooncake, below both
        self._ids = itertools.count(1)
        self._quarantined = 0  # blocks drop() kept for dropped engines still alive
        self._owner: dict[int, Client] = {}  # task id -> its connection
        self._hits = {"host_hit_tokens": 0, "ssd_hit_tokens": 0, "server_gets_invalidated": 0}
        self._deferred = DeferredGets(self, None, None)  # with the tiers, once registered
        self._memory: int | None = None  # the region's memfd until the first engine
        self._ssd_locks: list[DirLock] = []  # from lock_ssd to close

    def lock_ssd(self) -> None:
        """Lock the SSD directories now (ConfigError naming store.ssd_cache_dir when one
        is missing or held), with the embedded store's own lock: its SSD tier opens at
        the first engine, and until then an engine of the embedded store on one of them
        would take it and write there, refusing every engine of this server. The tier is
        handed these locks; :meth:`close` releases them after it."""
        if self.config.ssd_cache_gb > 0:
            for directory in self.config.ssd_dirs():
                self._ssd_locks.append(lock_directory(directory, SERVER))

    def allocate(self) -> None:
        """The host tier's memory, allocated whole (ConfigError when the host cannot)."""
        self._memory = allocate(self.config.cpu_cache_gb)

    # ---- set-up --------------------------------------------------------------------

    def register(self, geometry: Geometry) -> Region:
        """The region for an engine of ``geometry``: made for the first one (and the SSD
        tier opened), the same one after; ConfigError naming what differs."""
        if self.geometry is not None and self.region is not None:
            differs = self.geometry.differences(geometry)
            if differs:
                raise ConfigError("kv_caches", "differ from the store server's caches: "
                                  + "; ".join(differs))
            return self.region
        if self.config.page_size and self.config.page_size != geometry.page_size:
            raise ConfigError("kv_caches", f"page_size {geometry.page_size} != the server's "
                              f"store.page_size {self.config.page_size}")
        trailer = self.config.remote is not None
        blocks = region_blocks(self.config.cpu_cache_gb, geometry, trailer)
        if self._memory is None:
            self.allocate()
        assert self._memory is not None
        region = Region.create(self._memory, blocks, geometry, trailer)
        self._memory = None
        pool = RegionPool(region)
        link = remote = None
        try:
            if self.config.ssd_cache_gb > 0:
                link = TierLink(self.config, cast(Any, pool), geometry.torch_dtype,
                                geometry.page_size, self._ssd_done, self._no_copy,
                                self._link_ends, held=self._ssd_locks or None)
            host = link.host if link is not None else Tier("host", pool)
            if self.config.remote is not None:  # last: nothing after it can fail
                remote = RemoteLink(RemoteConfig.from_mapping(self.config.remote), host, pool,
                                    geometry.torch_dtype, geometry.page_size, self._wake,
                                    None if link is None else link.ssd)
        except BaseException:
            if link is not None:
                link.close()
            region.close()
            raise
        self._link, self._host, self._remote = link, host, remote
        # Replaces the tierless one: without a tier no get could wait.
        self._deferred = DeferredGets(self, link, remote)
        self.geometry, self.region, self._pool = geometry, region, pool
        # What a client's engine may ask for: it refuses offloads, and cuts lookups, past
        # what its store reports holding, which is these stats.
        self.capacity_tokens = capacity_tokens(lambda: self.stats([]), geometry.page_size) or 0
        log.info("aiokv store-server: region of %d blocks (%d bytes each, %d apart) for %s",
                 region.num_blocks, region.block_bytes, region.block_stride, geometry)
        return region

    def _ssd_done(self) -> None:  # SSD I/O threads
        self._wake()

    # ---- matches -------------------------------------------------------------------

    def match_many(self, client: Client, is_put: bool, queries: Sequence[Query],
                   by: float = math.inf) -> Sequence[Entry]:
        """A batch's matches, each answered as if alone and in order: (task id, one bool
        per page, blocks), or a refusal (wire.Refusal) for a put that cannot have them; a
        get may be a PendingGet or a Retry instead, for :meth:`settle`, until the batch's
        deadline ``by`` (time.monotonic()) at most."""
        if is_put:
            self._drain()
            matched = match_puts(self._require_host(), self._link, client.number, queries)
            if self._remote is not None:  # their offers follow: markers asked meanwhile
                for query, match in zip(queries, matched, strict=True):
                    if isinstance(match, Task) and len(match.blocks):
                        self._remote.expect(query[2])
            return [self._hold(client, m) if isinstance(m, Task) else m for m in matched]
        asked = self._deferred.ask_remote(queries) if (
            self._remote is not None and time.monotonic() < by) else set()
        entries = [self.get_match(client, *query, by=by) for query in queries]
        for entry in entries:
            if isinstance(entry, Retry) and entry.query[2] in asked:
                entry.asked = True  # it waits for its own pages' read
        return entries

    def get_match(self, client: Client, tokens: int, digests: list[bytes],
                  namespace: tuple[str, ...], by: float = math.inf) -> Entry:
        """LocalStore.get_match: the longest READY host prefix, then what either tier has
        after it, the SSD's pages read into host blocks (a PendingGet while the reads
        run); all of them held until the task ends. A Retry while a pending get, or a
        read from Mooncake, reads this key. Past its batch's deadline ``by`` its engine
        waits no more: the host prefix alone, as when the wait is over."""
        late = time.monotonic() >= by
        if not late and self._deferred.reading(namespace):
            return Retry((tokens, digests, namespace), by)
        host, link = self._require_host(), self._link
        self._drain()
        space = host.index.space(namespace)
        stored = (len(space) if space is not None else 0) + (
            link.ssd_pages(namespace) if link is not None else 0
        )
        pages = len(digests)
        digests = digests[:stored]  # a lookup costs what is stored
        found: list[int | None] = list(map(space.get, digests)) if space is not None else []
        if None in found:
            found = found[: found.index(None)]
        hit = np.fromiter(found, dtype=np.int64, count=len(found))
        if len(hit):
            not_ready = host.state[hit] != READY
            if not_ready.any():
                hit = hit[: int(np.argmax(not_ready))]
        shared = bool(len(hit)) and host.hold(hit)
        host.shared_gets += shared
        task = Task(client.number, False, NO_MASK, hit, [], None, shared=shared,
                    namespace=namespace)
        host_pages = len(hit)
        if link is not None and len(hit) == len(found) and not late:
            # Its SSD pages wait for host room (as the embedded store's launched load
            # does: not a miss), then for their reads; but only while room comes back
            # by itself. This engine is blocked in this call: room that its own held
            # Lookups or unended puts hold would never come back, and the lookup would
            # hang till SSD_STAGE_TIMEOUT_S to answer short anyway. Where none comes,
            # the link ends it unstaged at once (finished: the SSD part is a miss), and
            # ends so any get owed room before it that the room there cannot stage,
            # rather than keep this one behind it.
            load = link.loads.start_load(namespace, digests, len(task.blocks), task, waits=True)
            if load is not None and not load.finished:
                return self._deferred.stage(task, load, pages, len(hit), namespace, by)
            elif load is not None:
                host_pages = launch_staged(link, load)
        return self._answer_get(client, task, pages, host_pages)

    def settle(self, client: Client, entries: Sequence[Entry]) -> list[Entry]:
        """A deferred batch's entries again, the ready ones answered (DeferredGets.settle)."""
        return self._deferred.settle(client, entries)

    def abandon(self, entries: Sequence[Entry]) -> None:
        """A deferred batch whose connection went: its pending gets' reads end them
        (DeferredGets.abandon); its answered tasks are the client's, ended by :meth:`drop`."""
        self._deferred.abandon(entries)

    def answer_staged(self, client: Client, pending: PendingGet) -> Answer:
        """A pending get's answer once its reads are in (or given up); taken back at once
        when its key was evicted while it read (it loads nothing)."""
        answer = self._answer_get(client, pending.task, pending.pages, pending.hit)
        if pending.invalidated is not None:
            self._hits["server_gets_invalidated"] += client.take_back([answer[0]],
                                                                      pending.invalidated)
        return answer

    def _answer_get(self, client: Client, task: Task, pages: int, hit: int
                    ) -> tuple[int, BoolArray, Int64Array]:
        task.mask = np.zeros(pages, dtype=np.bool_)
        task.mask[: len(task.blocks)] = True
        page_size = self._page_size()
        self._hits["host_hit_tokens"] += hit * page_size
        self._hits["ssd_hit_tokens"] += (len(task.blocks) - hit) * page_size
        task.matching = False
        return self._hold(client, task)

    def _no_copy(self, *job: Any) -> Any:
        """The SSD link's copy to the GPU: the engine's own, after the match."""
        return None

    def _link_ends(self, tasks: list[Any], success: bool) -> None:
        """The SSD link ends a task whose SSD part was given up at its match: the match
        goes on with its host prefix."""
        for task in tasks:
            if not task.matching:
                self._end(task, False)

    def _hold(self, client: Client, task: Task) -> tuple[int, BoolArray, Int64Array]:
        task_id = next(self._ids)
        client.tasks[task_id] = task
        return task_id, task.mask, task.blocks

    # ---- ends ----------------------------------------------------------------------

    def finish(self, client: Client, done: Sequence[int], failed: Sequence[int]) -> None:
        """Tasks whose copies ended (``done``) or that were cancelled or failed
        (``failed``); Foreign (nothing changed) when one is not this client's."""
        for task_id in itertools.chain(done, failed):
            if task_id not in client.tasks:
                raise Foreign(f"task {task_id} is not held by this connection")
        if len(set(done) | set(failed)) != len(done) + len(failed):
            raise Foreign("a task is named twice")
        tasks = client.tasks
        self._end_many([tasks.pop(t) for t in done], True)
        self._end_many([tasks.pop(t) for t in failed], False)
        self._drain()

    def drop(self, client: Client, keep: bool = False) -> tuple[int, Kept]:
        """A connection ended: its tasks are rolled back (half-written blocks freed,
        reads released); returns how many, and with ``keep`` (its process lives: its
        copies may still run, :mod:`.quarantine`) what is held for :meth:`free` later:
        its puts' blocks, out of the index but not freed, and its gets, still reading."""
        tasks = list(client.tasks.values())
        client.tasks.clear()
        ending, kept = tasks, Kept()
        if keep and self._host is not None:
            puts = [t for t in tasks if t.is_put and len(t.blocks)]
            for task in puts:
                if task.space is not None:
                    self._host.index.remove(task.space, task.digests)
            # Every get, announced or not: a LAUNCH may be in the socket, unread.
            gets = [t for t in tasks if not t.is_put and len(t.blocks)]
            kept = Kept(np.sort(_blocks(puts)) if puts else NO_BLOCKS, gets)
            self._quarantined += len(kept)
            ending = [t for t in tasks if len(t.blocks) == 0]
        self._end_many(ending, False)
        return len(tasks), kept

    def free(self, kept: Kept) -> None:
        """What :meth:`drop` kept: the blocks go back to the host tier, the gets' reads
        end."""
        if self._host is None or not len(kept):
            return
        if len(kept.blocks):
            self._host.free(kept.blocks)
        self._end_many(kept.gets, False)
        self._quarantined -= len(kept)

    def _end(self, task: Task, success: bool) -> None:
        self._end_many([task], success)

    def _end_many(self, tasks: Sequence[Task], success: bool) -> None:
        """Tasks over, with a few array operations for all of them (as LocalStore's
        completion does for a job): puts published or rolled back, gets' reads dropped."""
        host = self._host
        if host is None or not tasks:
            return
        puts = [t for t in tasks if t.is_put and len(t.blocks)]
        gets = [t for t in tasks if not t.is_put]
        if puts and not success:
            host.roll_back_many([(t.space, t.digests) for t in puts], _blocks(puts))
            puts = []
        if puts:
            blocks = _blocks(puts)
            if self._link is not None and self._link.write_through:
                host.state[blocks] = READY
                self._link.write_through_puts(puts, blocks)
            else:
                host.publish([t.blocks for t in puts], blocks, _common_size(puts))
            if self._remote is not None:  # to Mooncake, after the host
                self._remote.offer(puts)
        reading = [t for t in gets if len(t.blocks)]
        if reading:
            host.end_reads([t.blocks for t in reading], [t.shared for t in reading],
                           _blocks(reading), _common_size(reading))
        host.shared_gets -= sum(t.shared for t in gets if not len(t.blocks))

    # ---- gets taken back by an evict or clear -------------------------------------

    def invalidate(self, requester: Client, clients: Sequence[Client],
                   namespace: tuple[str, ...] | None) -> list[tuple[Client, int]]:
        """After an evict of ``namespace`` (None: a clear): each get of it that is not
        under way is taken back (it loads nothing; its client is told, :mod:`.notice`);
        returns the gets under way in other clients, whose ends the evict's answer
        waits for. The requester's own gets are all taken back: it waits for the answer,
        so it cannot end them meanwhile."""
        under_way: list[tuple[Client, int]] = []
        why = "cleared" if namespace is None else "evicted"
        for client in clients:
            taken = []
            for task_id, task in client.gets_of(namespace):
                if task.launched and client is not requester:
                    under_way.append((client, task_id))
                else:
                    taken.append(task_id)
            self._hits["server_gets_invalidated"] += client.take_back(taken, why)
        return under_way

    def release_taken(self, client: Client, ids: Sequence[int]) -> None:
        """Gets taken back, and their engine told so (it never copies them now): those it
        had not announced (LAUNCH) drop their blocks now, their task kept for its END."""
        tasks = [task for t in ids if (task := client.tasks.get(t)) is not None
                 and not task.is_put and not task.launched and len(task.blocks)]
        host = self._host
        if not tasks or host is None:
            return
        host.end_reads([t.blocks for t in tasks], [t.shared for t in tasks], _blocks(tasks),
                       _common_size(tasks))
        for task in tasks:  # their END drops nothing more
            task.blocks, task.shared = NO_BLOCKS, False

    # ---- invalidation, figures -----------------------------------------------------

    def evict(self, namespace: tuple[str, ...]) -> Dropped:
        """The tokens dropped, an event set once the SSD holds none of them (None
        without an SSD tier; its ``failure`` says why it may: the evict's answer is then
        an error), and one set once Mooncake has the marker that hides them from other
        hosts, or its ``timeout_ms`` is up (None without a remote tier)."""
        return self._drop_namespace(namespace)

    def clear(self) -> Dropped:
        return self._drop_namespace(None)

    def begin_clear(self) -> str | None:
        """A clear's first step, before anything is dropped or any get taken back: the
        SSD tier's new epoch (SsdTier.begin_clear says why first). None once written (or
        without an SSD tier), else why the clear must drop nothing."""
        link = self._link
        if link is None:
            return None
        try:
            link.ssd.begin_clear()
        except OSError as exc:
            return exc.strerror or str(exc)
        return None

    def _drop_namespace(self, namespace: tuple[str, ...] | None) -> Dropped:
        """Drop a namespace (None: all) from every tier: its idle blocks freed, and the
        tables that still hold blocks in use out of reach (Tier.drop_namespace); the
        distinct pages dropped, in tokens, the SSD's event (TierLink.drop) and the
        remote marker's (RemoteLink.invalidate: it does not wait, the evict's answer
        does)."""
        host, link = self._host, self._link
        if host is None:
            return 0, None, None
        self._drain()
        # A clear was begun (begin_clear) by its caller, Answers._invalidate, before it
        # took any get back: a refused one never reaches here.
        published = None
        if self._remote is not None:
            published = self._remote.invalidate(namespace, wait=False)
        if link is not None:
            pages, written = link.drop(namespace)
            return pages * self._page_size(), written, published
        # Every page of it found now is out of reach after: dropped, or buried.
        spaces = host.index.spaces() if namespace is None else [host.index.space(namespace)]
        pages = sum(len(space) for space in spaces if space is not None)
        host.drop_namespace(namespace)
        return pages * self._page_size(), None, published

    def stats(self, clients: Sequence[Client]) -> dict[str, int | float]:
        host = self._host
        tasks = [t for c in clients for t in c.tasks.values()]
        stats: dict[str, int | float] = {
            "host_blocks_used": host.used if host is not None else 0,
            "host_blocks_total": host.num_blocks if host is not None else 0,
            "server_clients": len(clients),
            "server_tasks_open": len(tasks),
            "server_gets_staging": self._deferred.staging,
            "server_blocks_held": sum(len(t.blocks) for t in tasks),
            "server_blocks_quarantined": self._quarantined,  # of dropped live engines
            **self._hits,
        }
        for tier in (self._link, self._remote):
            if tier is not None:
                stats.update(tier.stats())
        # Remote hits are read into the host tier before the match: one tier counts each.
        remote_hits = stats.get("remote_hit_tokens", 0)
        stats["host_hit_tokens"] = max(0, stats["host_hit_tokens"] - remote_hits)
        return stats

    def poll(self) -> None:
        """Apply finished SSD requests and remote calls (the server calls it when their
        threads wake it)."""
        self._drain()

    def wait_s(self, longest_s: float) -> float:
        """How long the server may wait for a request or a wake: ``longest_s``, or until
        a remote call is due (:meth:`expire` ends it then)."""
        due = self._remote.reads.due() if self._remote is not None else None
        return longest_s if due is None else min(longest_s, max(0.0, due - time.monotonic()))

    def expire(self) -> None:
        """End the remote calls past their time (a miss), after the server's wait."""
        if self._remote is not None:
            self._remote.reads.poll()

    def _drain(self) -> None:
        """Apply finished SSD requests, finished remote writes and remote calls."""
        if self._link is not None:
            self._link.drain()
        if self._remote is not None:
            self._remote.drain()
            self._remote.reads.poll()

    def idle(self, clients: Sequence[Client]) -> bool:
        return not any(c.tasks for c in clients)

    def close(self) -> None:
        """Finish the remote writes (bounded) and the SSD writes (write_back: what only
        the host holds too), then let the region go."""
        if self._remote is not None:
            self._remote.close()  # before the pool: the region is registered with Mooncake
            self._remote = None
        if self._link is not None:
            self._link.close()
            self._link = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._memory is not None:
            os.close(self._memory)
            self._memory = None
        for lock in self._ssd_locks:  # last: nothing of the tier touches the files now
            lock.release()
        self._ssd_locks.clear()

    # ---- internals -----------------------------------------------------------------

    def _require_host(self) -> Tier:
        if self._host is None:
            raise ConfigError("kv_caches", "no engine has registered with the server yet")
        return self._host

    def _page_size(self) -> int:
        assert self.geometry is not None  # _require_host came first
        return self.geometry.page_size


def _blocks(tasks: Sequence[Task]) -> Int64Array:
    return tasks[0].blocks if len(tasks) == 1 else np.concatenate([t.blocks for t in tasks])


def _common_size(tasks: Sequence[Task]) -> int:
    """The tasks' common block count, 0 when they differ (Tier.publish's ``size``)."""
    size = len(tasks[0].blocks)
    return size if all(len(t.blocks) == size for t in tasks) else 0


__all__ = ["NoSpace", "Service"]
