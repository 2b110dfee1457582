"""SharedStore (``store.backend: shared``): an engine's view of ``aiokv store-server``.

The server owns the index, the host tier (the shared region this store maps) and the SSD
tier; this store owns its copies. A batch costs one round trip and one message: its
matches (the server answers masks and region blocks) and, once the copies are done, the
tasks' ends (the server publishes a put's blocks, or drops a get's hold), sent without
waiting for an answer. A put is reported done once its end is sent: the server applies
every engine's waiting ends before it answers a lookup, so a key another engine looks up
after that is a hit. A batch that loads also announces its gets before it copies them
(one more unanswered message) and reads its notice word: a get another engine's evict
took back loads nothing (:mod:`.notice`). Cancels are one message each (or ride along
with the next batch); evicts, clears and figures a round trip each.

Faults: if the server goes away, the call in flight raises StoreError, tasks launched or
matched under it end FAILED, and every later call tries to reconnect first, failing fast
with StoreError (naming the socket) while nothing listens there, or at once for a backoff
after a silent server (:mod:`.reconnect`). Once a server is back, this store registers
again, maps its new region and serves on; the engine is not restarted. The first call
after a restart the store did not see (it idled) finds its old connection broken before
the request left; a match, ping, figures, evict or clear then goes once more on a fresh
connection (a launch or end is not sent again: it names tasks of the server gone).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ...config import StoreConfig
from ...copy.copier import DETACHED, CopyJob
from ...copy.marks import LayerMarks
from ...errors import ConfigError, StoreError
from ...store_figures import carried
from ..base import (
    BoolArray,
    Int64Array,
    MatchAnswers,
    Queries,
    TaskResult,
    TaskStatus,
    TooLarge,
)
from . import link, wire
from .link import Link
from .reconnect import Reconnecting
from .region import Geometry

log = logging.getLogger("aiokv")

_PING = wire.frame(wire.PING)
_T = TypeVar("_T")


def _nothing(body: memoryview) -> None:
    """An empty reply's (OK) decoder."""


@dataclass(slots=True, eq=False)
class _Task:
    server_id: int
    is_put: bool
    mask: BoolArray
    blocks: Int64Array
    generation: int  # the connection it was matched on
    # A put's caller stopped waiting (SharedStore.detach, the loop thread): copied after
    # that, its pages may hold what the caller wrote since; the server keeps none of it.
    detached: bool = False


@dataclass(frozen=True)
class FiguresState:
    """SharedStore.figures_state(): this engine's own counts, the server that gave the
    last figures (its hello's name), the counts of the servers before it, and its last
    figures."""

    own: dict[str, int | float]
    server_named: str | None
    servers_before: dict[str, int | float]
    server_last: dict[str, int | float]


class SharedStore:
    """``SharedStore(StoreConfig(backend="shared", socket=PATH))``. ``register`` connects
    (StoreError when no server listens there, unless ``start_while_away()`` came first;
    ConfigError, naming what differs, when its caches have another geometry than the
    server's, and naming store.socket where the path holds something other than a
    socket)."""

    def __init__(self, config: StoreConfig) -> None:
        if not config.socket:
            raise ConfigError("store.socket", "is required with backend: shared")
        self._path = str(config.socket)
        self.page_size = config.page_size or 0
        self._caches: list[torch.Tensor] = []
        self._conn: Reconnecting | None = None  # from register on
        self._ids = itertools.count(1)
        self._tasks: dict[int, _Task] = {}  # matched, not launched
        self._launched: dict[int, _Task] = {}
        # Put tasks from their match until answered or given back, by id: detach (the
        # loop thread) finds them here, not in _tasks and _launched, between which a
        # launch moves them.
        self._puts: dict[int, _Task] = {}
        self._finished: dict[int, TaskResult] = {}
        self._release: list[int] = []  # server ids to end as failed with the next message
        self._done_jobs: deque[CopyJob] = deque()
        self._marks: dict[int, LayerMarks] = {}  # the last launch's gets', until asked
        self._notify: Callable[[], None] | None = None
        self._bytes = {"bytes_d2h": 0, "bytes_h2d": 0}
        self._server_stats: dict[str, int | float] = {}  # the server's last figures
        self._server_named: str | None = None  # the server that gave them (its hello's name)
        self._stats_before: dict[str, int | float] = {}  # the counts of servers before it
        # This engine's own counts (bytes, d2h_copies) of the store this one took over
        # from (resume_figures: a new store process).
        self._own_before: dict[str, int | float] = {}
        self._block_bytes = 0
        self._closed = False
        self._seen = 0  # the notice word as last asked about
        # Server ids of gets an evict or clear took back: "evicted" or "cleared".
        self._invalidated: dict[int, str] = {}
        self._invalidate_by: float | None = None  # set_invalidation_deadline's, for the next
        self._start_while_away = False  # start_while_away() was called

    def start_while_away(self) -> None:
        """base.StartsWhileAway: ``register`` with no server listening leaves the connect
        to the first call, as after the server went away."""
        self._start_while_away = True

    # ---- set-up --------------------------------------------------------------------

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if self._caches:
            raise RuntimeError("SharedStore.register() was already called")
        geometry = Geometry.of(kv_caches)
        if self.page_size and self.page_size != geometry.page_size:
            raise ConfigError("store.page_size", f"{self.page_size} does not match the "
                              f"caches' {geometry.page_size}")
        self.page_size = geometry.page_size
        self._block_bytes = geometry.block_bytes
        self._caches = list(kv_caches)
        self._conn = Reconnecting(self._path, self._caches, geometry, self._job_done,
                                  self._linked, self._lost)
        with self._conn.lock:
            try:
                self._conn.connect()
            except StoreError:  # a ConfigError still fails: no server will take that
                if not self._start_while_away:
                    raise
                log.warning("aiokv: the store server at %s is away; calls fail until it "
                            "is back", self._path)

    @property
    def _link(self) -> Link | None:
        """The current link (None before register, and between a loss and a call)."""
        return None if self._conn is None else self._conn.link

    @property
    def _generation(self) -> int:
        return 0 if self._conn is None else self._conn.generation

    def _linked(self, link: Link) -> None:
        """A new link (its server's notices start afresh)."""
        self._seen = link.notice.value
        self._invalidated.clear()

    def _lost(self) -> None:
        """The link is gone: its server rolled back everything the link held."""
        self._release.clear()
        self._invalidated.clear()

    def _call(self, request: bytes, what: str, expect: int,
              decode: Callable[[memoryview], _T],
              again: Callable[[], bytes] | None = None) -> _T:
        """One request to the server and its reply's body decoded (under the lock: the
        body views the connection's buffer); StoreError when the server is gone or
        refuses. ``again``: the request for a fresh link, when the link's server was gone
        before this one left (None: a request that names what only that server knew)."""
        retry = None if again is None else (
            lambda link: decode(link.call(again(), what, expect)))
        return self._registered().use(lambda link: decode(link.call(request, what, expect)),
                                      retry)

    def _send(self, request: bytes) -> None:
        """A request that gets no answer (a batch's end); StoreError when the server is
        gone."""
        self._registered().use(lambda link: link.send(request))

    def _registered(self) -> Reconnecting:
        if self._conn is None:
            raise StoreError("the shared store is not registered")
        return self._conn

    def _call_json(self, message: Mapping[str, Any], again: bool = True) -> dict[str, Any]:
        """``again``: the same message for a fresh link if the server was gone before it
        left (False for one about this link's own state)."""
        request = wire.encode_json(message)
        return self._call(request, str(message["op"]), wire.JSON, wire.decode_json,
                          (lambda: request) if again else None)

    # ---- matches -------------------------------------------------------------------

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        return _one(self.put_match_many([(token_ids, namespace)]))

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        return _one(self.get_match_many([(token_ids, namespace)]))

    def put_match_many(self, queries: Queries) -> MatchAnswers:
        return self._matches("put", queries)

    def get_match_many(self, queries: Queries, *, deadline_s: float | None = None
                       ) -> MatchAnswers:
        """base.BoundsLookups: gets whose pages the server reads first (SSD, Mooncake) or
        that wait for room to read them into are answered by ``deadline_s`` (or at the
        server's own limit, deferred.SSD_STAGE_TIMEOUT_S) with what it has then."""
        return self._matches("get", queries, deadline_s)

    def _matches(self, op: str, queries: Queries, by: float | None = None) -> MatchAnswers:
        is_put = op == "put"
        released = self._take_release()
        # On a fresh link, without the ids to release: the server gone rolled them back,
        # and a new one would take them for another engine's (and drop this one).
        replies = self._registered().use(
            lambda link: self._ask(link, is_put, queries, released, by),
            lambda link: self._ask(link, is_put, queries, [], by))
        answers: MatchAnswers = []
        generation = self._generation
        for answer in replies:
            if isinstance(answer, Exception):  # refused: NoSpace, TooLarge, StoreError
                answers.append(answer)
                continue
            server_id, mask, blocks = answer
            local = next(self._ids)
            task = self._tasks[local] = _Task(server_id, is_put, mask, blocks, generation)
            if is_put:
                self._puts[local] = task
            answers.append((local, mask))
        return answers

    def _ask(self, link: Link, is_put: bool, queries: Queries, released: list[int],
             by: float | None) -> list[wire.ClientAnswer]:
        """A batch's matches asked of ``link``'s server (under the lock: the reply views
        the connection's buffer), none longer than it holds (``link.max_tokens``): it drops
        a peer that asks more, and a server restarted with smaller tiers holds less than
        this engine's figures, from the one before, may still say. A longer key is asked
        for that prefix (no more of it could be stored), its mask False past it; a put
        whose full pages are more than that is refused here, TooLarge, as its new pages
        could never be had (a partial page past the limit is never stored: no reason)."""
        limit, page_size = link.max_tokens, self.page_size
        asked = queries
        refused: set[int] = set()
        if limit is not None and any(len(token_ids) > limit for token_ids, _ in queries):
            if is_put:
                refused = {i for i, (token_ids, _) in enumerate(queries)
                           if len(token_ids) // page_size * page_size > limit}
            asked = [(token_ids[:limit], space)
                     for i, (token_ids, space) in enumerate(queries) if i not in refused]
        request = wire.encode_match(wire.PUT if is_put else wire.GET, asked, page_size,
                                    released, by)
        body = link.call(request, "put" if is_put else "get", wire.ANSWERS)
        replies = wire.decode_answers(body, [len(token_ids) for token_ids, _ in asked],
                                      page_size)
        if asked is queries:
            return replies
        out: list[wire.ClientAnswer] = []
        answered = iter(replies)
        for index, (token_ids, _) in enumerate(queries):
            if index in refused:
                out.append(TooLarge(f"a put of {len(token_ids)} tokens; the store server "
                                    f"at {self._path!r} holds at most {limit}"))
                continue
            answer = next(answered)
            if not isinstance(answer, Exception) and len(answer[1]) < len(token_ids):
                mask = np.zeros(len(token_ids), dtype=np.bool_)
                mask[: len(answer[1])] = answer[1]
                answer = (answer[0], mask, answer[2])
            out.append(answer)
        return out

    def _take_release(self) -> list[int]:
        release, self._release = self._release, []
        return release

    # ---- launch --------------------------------------------------------------------

    def launch(self, task_ids: Sequence[int], pages: Sequence[Any], ready: Sequence[Any] = ()
               ) -> None:
        """Queue the copies of these matched tasks (base.Store.launch) on the data plane.
        A page id outside the caches (or, for a load, a page twice) ends its task INVALID
        (the copier checks them, as for the embedded store); a task matched on a
        connection that has since gone ends FAILED."""
        if len(task_ids) != len(pages):
            raise ValueError("launch: one page tensor per task id")
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("launch: a task id is given twice")
        for task_id in task_ids:
            if task_id not in self._tasks:
                raise ValueError(f"launch: task {task_id} is not a matched, unlaunched task")
        if not self._caches or self._closed:
            raise RuntimeError("SharedStore is not registered (or already closed)")
        self._marks = {}
        chosen: dict[bool, list[tuple[int, Any, _Task]]] = {True: [], False: []}
        for task_id, page_ids in zip(task_ids, pages, strict=True):
            task = self._tasks.pop(task_id)
            if task.generation != self._generation or self._link is None:
                self._finished[task_id] = TaskResult(
                    TaskStatus.FAILED, task.mask,
                    "the store server restarted after this task's match")
                continue
            why = self._link.plane.unpinned(task.blocks)
            status = TaskStatus.FAILED
            if len(page_ids) != len(task.blocks):
                why = f"page_ids: {len(page_ids)} pages given for {len(task.blocks)} matched"
                status = TaskStatus.INVALID
            if why is not None:
                self._release.append(task.server_id)
                self._finished[task_id] = TaskResult(status, task.mask, why)
                continue
            self._launched[task_id] = task
            chosen[task.is_put].append((task_id, page_ids, task))
        if chosen[False]:
            chosen[False] = self._announce(chosen)
        for is_put, tasks in chosen.items():
            if not tasks:
                continue
            assert self._link is not None
            marks = [None if is_put else self._new_marks(t) for t, _, _ in tasks]
            self._link.plane.submit(
                is_put, [t for t, _, _ in tasks], [p for _, p, _ in tasks],
                np.concatenate([task.blocks for _, _, task in tasks]), ready, marks,
                [task for _, _, task in tasks] if is_put else ())
        if len(self._finished) and self._notify is not None:
            self._notify()

    def _announce(self, chosen: dict[bool, list[tuple[int, Any, _Task]]]
                  ) -> list[tuple[int, Any, _Task]]:
        """Tell the server that these gets' copies start, then read the notice word: the
        gets an evict took back load nothing (:mod:`.notice`). The gets left to copy;
        when the server is gone, none, and every task chosen ends FAILED."""
        gets = chosen[False]
        try:
            self._send(wire.encode_launch([task.server_id for _, _, task in gets]))
            self._look()
        except StoreError as exc:
            for task_id, _, task in itertools.chain(*chosen.values()):
                self._launched.pop(task_id)
                self._finished[task_id] = TaskResult(TaskStatus.FAILED, task.mask, str(exc))
            chosen[True] = []
            return []
        if not self._invalidated:
            return gets
        left = []
        for entry in gets:
            task_id, _, task = entry
            if task.server_id in self._invalidated:
                self._launched.pop(task_id)
                self._invalidated.pop(task.server_id, None)
                self._release.append(task.server_id)
                self._finished[task_id] = _taken_back(task)
            else:
                left.append(entry)
        return left

    def check_held(self) -> dict[int, str]:
        """base.ChecksHeld: with gets held, ask the server which were taken back if the
        notice word moved; the server then gives their blocks back (an idle engine
        would otherwise hold them until it works again or their Lookups expire).
        Returns the matched gets taken back so far ("evicted" or "cleared"), for the
        engine to give back and mark as its own evict does: their Lookups then say so,
        with no call of their own."""
        if not self._tasks:
            return {}
        self._look()
        if not self._invalidated:
            return {}
        return {task_id: self._invalidated[task.server_id]
                for task_id, task in self._tasks.items()
                if not task.is_put and task.server_id in self._invalidated}

    def _look(self) -> None:
        """Ask the server which gets it took back, if the notice word moved since the
        last time (StoreError when the server is gone)."""
        link = self._link
        if link is None or link.notice.value == self._seen:
            return
        reply = self._call_json({"op": "invalidated"}, again=False)  # this link's
        cleared = {int(i) for i in reply.get("cleared", ())}
        self._invalidated.update((int(i), "cleared" if int(i) in cleared else "evicted")
                                 for i in reply["ids"])
        self._seen = int(reply["seq"])

    def _new_marks(self, task_id: int) -> LayerMarks:
        marks = self._marks[task_id] = LayerMarks(len(self._caches))
        return marks

    def layer_marks(self, task_id: int) -> LayerMarks | None:
        """The per-layer marks of a get task the last launch took (base.MarksLayers);
        None for another id (its layers are marked at its end)."""
        return self._marks.pop(task_id, None)

    def _job_done(self, job: CopyJob) -> None:  # a copier's thread
        self._done_jobs.append(job)
        if self._notify is not None:
            self._notify()

    # ---- ends ----------------------------------------------------------------------

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        """Terminal answers among ``task_ids``, each once. Tasks whose copies are done are
        reported to the server first (one message), and succeed once it has them."""
        done: list[int] = []
        failed: dict[int, TaskResult] = {}
        while self._done_jobs:
            job = self._done_jobs.popleft()
            if job.error is None:
                key = "bytes_d2h" if job.to_host else "bytes_h2d"
                self._bytes[key] += job.copied * self._block_bytes
            for segment, task_id in enumerate(job.names):
                mask = self._launched[task_id].mask
                if job.error is not None:
                    failed[task_id] = TaskResult(TaskStatus.FAILED, mask,
                                                 f"copy failed: {job.error}")
                elif segment in job.invalid:
                    failed[task_id] = TaskResult(TaskStatus.INVALID, mask,
                                                 job.invalid[segment])
                elif segment in job.left:  # ended as failed at the server: rolled back
                    failed[task_id] = TaskResult(TaskStatus.FAILED, mask, DETACHED)
                else:
                    done.append(task_id)
        if done and self._link is not None and (
                self._invalidated or self._link.notice.value != self._seen):
            with contextlib.suppress(StoreError):  # the server gone: _report fails them
                self._look()
            for task_id in [t for t in done if self._launched[t].server_id
                            in self._invalidated and not self._launched[t].is_put]:
                done.remove(task_id)
                failed[task_id] = _taken_back(self._launched[task_id])
        if done or failed or self._release:
            self._report(done, failed)
        if not self._finished:
            return {}
        answers = {t: self._finished.pop(t) for t in task_ids if t in self._finished}
        if self._puts:
            for task_id in answers:
                self._puts.pop(task_id, None)
        return answers

    def _report(self, done: list[int], failed: dict[int, TaskResult]) -> None:
        tasks = {t: self._launched.pop(t) for t in (*done, *failed)}
        for task in tasks.values():
            self._invalidated.pop(task.server_id, None)
        current = {t: task for t, task in tasks.items()
                   if task.generation == self._generation and self._link is not None}
        lost = "the store server went away before this task's end was recorded"
        try:
            if current or self._release:
                self._send(wire.encode_end(
                    [current[t].server_id for t in done if t in current],
                    [current[t].server_id for t in failed if t in current]
                    + self._take_release()))
        except StoreError as exc:
            lost = str(exc)
            current = {}
        for task_id, task in tasks.items():
            if task_id in failed:
                self._finished[task_id] = failed[task_id]
            elif task_id in current:
                self._finished[task_id] = TaskResult(TaskStatus.SUCCESS, task.mask)
            else:
                self._finished[task_id] = TaskResult(TaskStatus.FAILED, task.mask, lost)

    def cancel(self, task_ids: Sequence[int]) -> None:
        """Matched tasks given back (their reservations released at the server at once);
        launched or unknown ids are ignored."""
        for task_id in task_ids:
            task = self._tasks.pop(task_id, None)
            self._puts.pop(task_id, None)
            # Only to the server that matched it: with the link lost, that one rolled it
            # back already, and a server started since would take its id for another
            # engine's (and drop this one for naming it).
            if (task is not None and task.generation == self._generation
                    and self._link is not None):
                self._release.append(task.server_id)
                self._invalidated.pop(task.server_id, None)
        if self._release and self._link is not None:
            with contextlib.suppress(StoreError):  # a lost server released them itself
                self._send(wire.encode_end([], self._take_release()))

    # ---- optional capabilities -----------------------------------------------------

    def detach(self, task_id: int) -> None:
        """base.Detaches: the caller of this put stopped waiting (loop thread; never
        blocks). Unless the copy of its pages had been seen to end by now, the server
        keeps nothing of it (the task ends FAILED). Other ids are ignored."""
        task = self._puts.get(task_id)  # a dict read: atomic against the store thread
        if task is not None:
            task.detached = True

    def set_invalidation_deadline(self, deadline_s: float) -> None:
        """base.BoundsInvalidations: sent with the evict or clear that follows."""
        self._invalidate_by = deadline_s

    def evict(self, namespace: Sequence[str]) -> int:
        return self._invalidate({"op": "evict", "ns": list(namespace)})

    def clear(self) -> int:
        return self._invalidate({"op": "clear"})

    def _invalidate(self, message: dict[str, Any]) -> int:
        """An evict or clear with its deadline (``by``, time.monotonic(): one clock for
        the host's processes), past which the server refuses it, dropping nothing: the
        caller's deadline, or at most the call's timeout (link.CALL_TIMEOUT_S). A stopped
        server may read it only once this engine has given up on it, maybe after a link
        of its own has carried later calls: it must not drop what those found or stored."""
        by, self._invalidate_by = self._invalidate_by, None
        limit = time.monotonic() + link.CALL_TIMEOUT_S
        message["by"] = limit if by is None else min(by, limit)
        return int(self._call_json(message)["tokens"])

    def store_stats(self) -> Mapping[str, int | float]:
        """The server's figures (its tiers, hits and open tasks, every engine's) with this
        engine's own bytes copied; while the server is away, those it gave last. A new
        server (another name in its hello) counts from 0: the counts of the one before are
        added, so that the engine's counters never fall."""
        stats = self._own_counts()
        try:
            server = dict(self._call_json({"op": "stats"})["stats"])
        except StoreError:
            server = dict(self._server_stats)
            stats["server_up"] = 0
        else:
            link = self._link
            named = None if link is None or link.connection is None else link.connection[0]
            if named != self._server_named:
                self._stats_before = carried(self._stats_before, self._server_stats)
                self._server_named = named
            self._server_stats = server
        stats.update(carried(self._stats_before, server))
        return stats

    def _own_counts(self) -> dict[str, int | float]:
        """The counts of this engine's own copies, not the server's."""
        own: dict[str, int | float] = dict(self._bytes)
        own["d2h_copies"] = 0 if self._conn is None else self._conn.d2h_copies
        return carried(self._own_before, own)

    def figures_state(self) -> FiguresState:
        """base.ResumesFigures: what a SharedStore taking this one's place for the same
        engine (a new store process, after this one's died) needs to go on from these
        figures. The server's are its running totals: a new store on the same server
        finds in them what this one reported, and adding this one's figures to its own
        would count them twice; on another server, those of this one's servers are
        carried as this one would have."""
        return FiguresState(self._own_counts(), self._server_named, dict(self._stats_before),
                            dict(self._server_stats))

    def resume_figures(self, state: object) -> None:
        """base.ResumesFigures: go on from ``state`` (:meth:`figures_state`), before the
        first store_stats()."""
        if not isinstance(state, FiguresState):
            raise TypeError(f"resume_figures: need a FiguresState, got {type(state).__name__}")
        self._own_before = dict(state.own)
        self._server_named = state.server_named
        self._stats_before = dict(state.servers_before)
        self._server_stats = dict(state.server_last)

    def ping(self) -> None:
        """One empty round trip to the server (what a batch's control messages cost
        beyond the server's work for them)."""
        self._call(_PING, "ping", wire.OK, _nothing, lambda: _PING)

    def set_notify(self, callback: Callable[[], None]) -> None:
        self._notify = callback

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until this engine's mapping of the region is pinned whole (it is pinned
        in chunks after register, as LocalStore's pool is) or ``timeout`` seconds;
        whether it is. At once on CPU caches (nothing to pin) or before register."""
        if self._conn is None:
            return True
        with self._conn.lock:
            link = self._conn.link
        if link is None or link.plane.pinning is None:
            return True
        return link.plane.pinning.wait_for(link.region.num_blocks, timeout)

    def close(self) -> None:
        """Finish the queued copies, report them, give back the tasks matched and not
        launched, and disconnect. What the server still holds for this connection then
        (a task whose end could not be sent) it keeps while this process lives."""
        conn = self._conn
        link = None
        if conn is not None:
            with conn.lock:
                link = conn.link
        if link is not None:
            link.plane.close()  # its copies reported below, while the link is up
            with contextlib.suppress(StoreError):
                self.try_wait([])
            # Given back here, not left to the disconnect: the server cannot tell a task
            # no copy touches from one whose copy may still land, and keeps every task a
            # live process leaves open (quarantine.py) until that process exits. No copy
            # touches these: launch takes a task out of them before queueing its copy.
            self.cancel(list(self._tasks))
        self._closed = True
        if conn is not None:
            conn.close()

def _taken_back(task: _Task) -> TaskResult:
    """A get an evict or clear took back: it succeeds, having loaded nothing."""
    return TaskResult(TaskStatus.SUCCESS, np.zeros_like(task.mask))


def _one(answers: MatchAnswers) -> tuple[int, BoolArray]:
    answer = answers[0]
    if isinstance(answer, Exception):
        raise answer
    return answer
