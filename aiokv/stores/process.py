"""ProcessStore: any store, run in a child process of its own and called over a socket.

Why: a store whose calls run Python for long stretches (FlexKV: a finished batch's
answers, a batch's launch, an eviction) holds the GIL of the process it runs in. In the
event loop's process each such call is a stall of the loop, which no hand-over between
calls can split. In a child, that Python holds the child's GIL. This process keeps the
store thread's part of each call: one message out, one back, and the wait between them
without the GIL. :func:`make_store` uses it where the backend's entry says so
(:data:`aiokv.backends.BACKENDS`) unless ``StoreConfig.own_process`` is false.

How:

- The child is ``python -P -m aiokv.stores.child`` (:mod:`aiokv.stores.child`), a plain
  subprocess in a session of its own: it does not re-import the program's ``__main__``
  (as multiprocessing's spawn would), no exit hook of multiprocessing waits for it, and a
  Ctrl-C to the terminal does not reach it. It builds the store from the same
  :class:`StoreConfig`, with ``own_process=False``.
- The caches stay in this process and reach the child's store as the backend's
  :class:`~aiokv.backends.CacheHandover` says: as tensors (CPU ones' shared memory as
  descriptors over the socket, :mod:`.cache_fds`; GPU ones through torch's CUDA IPC),
  or (FlexKV) registered from here, their owner, once the child has started the store.
- Each call is one request and one reply, in order, on one socket (:mod:`.wire`).
- Launched tasks are watched in the child (polled there, for a store such as FlexKV
  that does not notify), which sends a byte on a second socket when answers wait; a
  reader thread here passes that on (``set_notify``, :mod:`.notices`). So this process
  asks ``try_wait`` when there is something to take, not every poll interval: a poll
  costs a round trip.
- A store's exception travels back and is raised here as itself (with a note naming
  the child) where it pickles, else as StoreError naming it.
- No wait for the child is unbounded: a call not answered within ``call_timeout_s``
  (a deadlocked store), a start past ``start_timeout_s``, a close past its own bound,
  and whatever the store thread still waits on when the engine's close times out
  (``terminate``) end with the child killed (SIGKILL), reaped and counted as dead: its
  ids answer FAILED, and what it held (an SSD directory's lock) is released.
- If the child dies, the calls in flight fail naming its exit; the next call starts a
  new, empty child (:mod:`.restarts`; a ``shared`` store's child starts while its server
  is away, base.StartsWhileAway), unless the engine's close began (``closing``):
  then its ids answer FAILED and the store's figures stay its last. The new child's
  figures go on from the dead one's: added to them, or, where they are not all the
  store's own counts (``shared``: the server's running totals, which the new child finds
  with the dead one's in them), its store is told where to go on from
  (``resume_figures``). If this process dies, the child sees the socket close and closes
  its store.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.multiprocessing  # registers tensor reductions for Connection.send

from ..backends import backend
from ..config import StoreConfig
from ..copy.fused import PageCopier
from ..errors import StoreError
from ..store_figures import carried
from .base import BoolArray, Int64Array, MatchAnswers, Queries, TaskResult
from .detaches import DetachTable
from .link import ChildGone, ChildLink
from .notices import Notices
from .notices import no_notify as no_notify  # a public name of this module too
from .restarts import Restarts
from .spawn import forget_in_forks
from .wire import (
    MIRRORED,
    FiguresAnswer,
    Op,
    PackedResults,
    launch_args,
    noted,
    portable,
    query,
    unpack_results,
)

log = logging.getLogger("aiokv")

_CLOSE_TIMEOUT_S = 180.0  # the child's close waits for launched copies (FlexKV: 60 s+)
_EXIT_TIMEOUT_S = 10.0  # after its close, the child exits in this time or is killed


class ProcessStore:
    """The store ``config`` names (``own_process`` aside), run in a child process.

    ``ProcessStore(StoreConfig(backend="flexkv", ..., own_process=True))``, or
    :func:`~aiokv.stores.make_store` with such a config. The child starts in ``register``
    and ends in ``close``. CPU caches are moved into shared memory at ``register`` (torch's
    ``share_memory_``, in place: their ``data_ptr`` changes, and views taken before no
    longer alias them); CUDA caches stay where they are.
    """

    def __init__(
        self, config: StoreConfig, *, start_timeout_s: float = 300.0,
        call_timeout_s: float = 300.0,
    ) -> None:
        """``start_timeout_s``: the most a child may take to start its store (FlexKV: its
        transfer engine); ``call_timeout_s``: to answer one call (an evict waits up to
        30 s for SSD writes). A child past either is killed: a store deadlocked in it
        would otherwise hold the store thread, and what the child holds, for good."""
        # What the child builds: its store in that process, restarted by this one.
        self._config = replace(config, own_process=False,
                               store_restarts=StoreConfig.store_restarts)
        inner = backend(config.backend).store_class()
        for name in MIRRORED:  # what the child's store lacks, this one lacks too
            if not callable(getattr(inner, name, None)):
                setattr(self, name, None)
        if not callable(getattr(inner, "watch_detaches", None)):
            self.detach = None  # type: ignore[assignment]  # its puts are kept (FlexKV)
        # The current child's table of detached puts, with the base of its ids (one
        # attribute: a detach from the loop thread reads the two of the same child).
        self._detaching: tuple[DetachTable, int] | None = None
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = call_timeout_s
        self.page_size: int = config.page_size or 0  # the child's, once registered
        self._link: ChildLink | None = None  # the current child (link.py)
        # The caches, and what the handover attached: alive as long as the child maps them.
        self._keep: list[Any] = []
        self._detach: list[Callable[[], None]] = []  # the handover's, once the child is gone
        self._socket_files: list[str] = []  # the handover's, removed should the child die
        self._broken: str | None = None  # why the child can no longer be called
        self._ended: str | None = None  # how a served child died: restart at the next call
        self._caches: list[torch.Tensor] = []  # registered, for a new child
        self._restarts = Restarts(config.store_restarts)
        self._ids = self._restarts.ids  # the engine's ids across children
        self._closed = False
        self._deadlines: dict[int, float] = {}  # set_deadlines, sent with the next launch
        self._invalidate_by: float | None = None  # set_invalidation_deadline's, for the next
        self._closing = False  # the engine closes: no new child from now on
        self._restarting = False  # the store thread is starting a new child
        self._last_stats: dict[str, int | float] = {}  # the child's, for when none serves
        self._stats_before: dict[str, int | float] = {}  # the counts of children gone
        # The child store's figures_state() with its last figures (base.ResumesFigures),
        # for the next child's store to go on from: None where the store counts all it
        # reports itself (then _stats_before carries the dead child's counts).
        self._figures_state: object = None
        self._dying = False  # the child that served was lost but had not exited yet
        # One call on the socket at a time: the engine calls from its store thread only,
        # but close() may come from another thread (a store shared by several engines).
        self._calling = threading.Lock()
        # Task ends: the child polls its store and sends a byte here when answers are
        # waiting; a reader thread passes that on (set_notify), so that this process
        # asks try_wait when there is something to take rather than every poll interval.
        self._notices = Notices()
        self._pages = PageCopier()  # launches' page ids to the host, counted

    @property
    def store_slice_us(self) -> int:
        """The advice for EngineConfig.store_slice_us: none. The hand-over exists for a
        store whose Python holds this process's GIL; in a child it holds the child's, and
        this process's store thread only packs messages. With FlexKV in a child, a
        200 µs hand-over (its advice in this process) made neither the loop's worst
        stall nor the throughput better on the H200 (benchmarks/RESULTS.md)."""
        return 0

    @property
    def restarts(self) -> int:
        """New children started after one died (stores/base.py: Restarts)."""
        return self._restarts.count

    @property
    def pid(self) -> int | None:
        """The child's process id (None before register)."""
        return None if self._link is None else self._link.pid

    # ---- setup -----------------------------------------------------------------------

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if self._link is not None or self._closed:
            raise RuntimeError("ProcessStore.register() was already called")
        caches = list(kv_caches)
        try:
            self._start_child(caches)
        except BaseException:
            self._shutdown()
            raise
        self._caches = caches

    def _start_child(self, caches: list[torch.Tensor]) -> None:
        """Spawn a child, hand it the caches and wait until its store is ready."""
        handover = backend(self._config.backend).cache_handover()
        payload = handover.payload(caches)
        link = self._spawn()
        table = DetachTable()
        # A restart (caches registered before) starts while the store's server is away
        # (base.StartsWhileAway): as the child before it would, it serves once it is back.
        again = bool(self._caches)
        self._send((self._config, payload, table.tensor, again), start=True)
        self._detaching = (table, self._ids.base)
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            kind, value = self._receive(deadline, f"its start within {self._start_timeout_s:g} s")
            if kind == "ready":
                self.page_size = int(value)
                break
            if kind == "failed":
                raise noted(value, self.pid)
            if kind != "attach":
                raise StoreError(f"the store process sent {kind!r} during registration")
            try:
                kept, self._socket_files = handover.attach(value, caches, payload)
            except Exception as exc:
                with contextlib.suppress(ChildGone):
                    link.send((False, portable(exc)))
                raise
            self._keep.append(kept)
            self._detach.append(functools.partial(handover.detach, kept))
            self._send((True, None))
        self._keep.append(caches)
        self._notices.start()  # set_notify may have come before register

    def _spawn(self) -> ChildLink:
        link = self._link = ChildLink()
        self._notices.socket = link.ends
        forget_in_forks(self)
        if self._restarting and self._closing:  # closing() may have missed this child
            raise StoreError("not started: the engine is closing")
        return link

    def set_notify(self, callback: Callable[[], None]) -> None:
        """``callback()`` (from a thread of this store's) whenever tasks may have ended."""
        self._notices.callback = callback
        self._notices.start()

    # ---- Store protocol --------------------------------------------------------------

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        matched: tuple[int, BoolArray] = self._call("put_match", query(token_ids, namespace))
        return self._ids.match(matched)

    def put_match_many(self, queries: Queries) -> MatchAnswers:
        """put_match for each (token_ids, namespace), in order, in one round trip: each
        answer or the exception its put_match raised (the worker asks once per batch)."""
        return self._match_many("put_match_many", queries)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        matched: tuple[int, BoolArray] = self._call("get_match", query(token_ids, namespace))
        return self._ids.match(matched)

    def get_match_many(self, queries: Queries, *, deadline_s: float | None = None
                       ) -> MatchAnswers:
        """get_match for each (token_ids, namespace), in order, in one round trip; the
        batch's deadline (base.BoundsLookups) goes with it, to a child's store that
        takes it."""
        return self._match_many("get_match_many", queries, deadline_s)

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        """The page ids go to the host in one copy after the ready events, and to the
        child as numpy (its store launches them with no event left to wait for), with
        the deadlines set_deadlines gave for them. A task matched by a child that ended
        (a Lookup held across a restart) fails alone: it is not launched, and try_wait
        answers it FAILED, naming how that child ended."""
        given, self._deadlines = self._deadlines, {}
        self._revive()
        ids, old = self._ids.split(task_ids)
        if old:
            stale = set(old)
            kept = [i for i, task_id in enumerate(task_ids) if task_id not in stale]
            task_ids = [task_ids[i] for i in kept]
            pages, ready = [pages[i] for i in kept], [ready[i] for i in kept]
            if not ids:
                return
        deadlines = {i: given[t] for i, t in zip(ids, task_ids, strict=True) if t in given}
        self._call("launch", launch_args(ids, self._pages.host_pages(pages, ready), deadlines))

    def cancel(self, task_ids: Sequence[int]) -> None:
        self._revive()
        ids, old = self._ids.split(task_ids)  # the old ones' blocks died with their child
        if ids or not old:
            self._call("cancel", ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        if not task_ids:
            # A wake-up with no task in flight (the worker's settle): the child's store
            # applies its background work (an SSD read of a Lookup given back, a write),
            # giving back what it held, as an embedded store does on the same call; else
            # only its next call would, and its figures would count those blocks till
            # then. A child that died is found by the next call that needs it.
            link = self._link
            if (not self._closed and self._ended is None and self._broken is None
                    and not self._notices.closed
                    and link is not None and link.alive()):
                with contextlib.suppress(StoreError):
                    self._call("try_wait", [])
            return {}
        self._revive()
        ids, old = self._ids.split(task_ids)
        fresh: dict[int, TaskResult] = {}
        if ids:
            try:
                packed: PackedResults = self._call("try_wait", ids)
            except StoreError as error:
                if self._ended is None:  # not a death this store recovers from
                    raise
                return self._ids.died(task_ids, old, str(error))  # its tasks died with it
            fresh = unpack_results(packed)
        return self._ids.results(fresh, old)

    def set_invalidation_deadline(self, deadline_s: float) -> None:
        """base.BoundsInvalidations: sent with the evict or clear that follows; the child
        refuses one it reads after it (a stopped child resumed), dropping nothing."""
        self._invalidate_by = deadline_s

    def evict(self, namespace: Sequence[str]) -> int:
        by, self._invalidate_by = self._invalidate_by, None
        dropped: int = self._call("evict", (tuple(namespace), by))
        return dropped

    def clear(self) -> int:
        by, self._invalidate_by = self._invalidate_by, None
        dropped: int = self._call("clear", by)
        return dropped

    def store_stats(self) -> Mapping[str, int | float]:
        """The child's figures; while no child serves (it died, and no new one follows
        yet or ever), those it gave last."""
        try:
            answer: FiguresAnswer = self._call("store_stats", None)
            self._last_stats, self._figures_state = dict(answer[0]), answer[1]
        except StoreError:
            if self._broken is None:  # the child's own store raised it
                raise
        stats = carried(self._stats_before, self._last_stats)
        stats["d2h_copies"] = stats.get("d2h_copies", 0) + self._pages.d2h_copies
        return stats

    def parked(self, task_ids: Sequence[int]) -> list[int]:
        """base.ParksLoads, asked of the child (a dead child's tasks wait for nothing), its
        answer in this store's ids (the child's plus its generation's base)."""
        base = self._ids.base
        ids, _ = self._ids.split(task_ids)
        if not ids:
            return []
        passed: list[int] = self._call("parked", ids)
        return [task_id + base for task_id in passed]

    def detach(self, task_id: int) -> None:
        """base.Detaches, for the current child's puts: marked in its table (:mod:`.detaches`;
        the loop thread, never blocks), which its store reads as it takes a put's copy in.
        An older child's task died with it."""
        detaching = self._detaching
        if detaching is not None and task_id >= detaching[1]:
            detaching[0].mark(task_id - detaching[1])

    def set_deadlines(self, task_ids: Sequence[int], deadlines_s: Sequence[float]) -> None:
        """base.BoundsWaits: kept for the launch that follows, which takes them to the
        child's store (no round trip of their own). time.monotonic() is one clock for the
        processes of a host."""
        self._deadlines = dict(zip(task_ids, deadlines_s, strict=True))

    def closing(self) -> None:
        """stores.base.HearsOfClose: no new child from now on (any thread; never
        blocks). A child that dies later leaves its ids FAILED and the store down, and a
        new child that is starting now is killed: it would only serve the close."""
        self._closing = True
        if self._restarting:
            self._kill("the engine began to close while it started", logging.WARNING)

    def terminate(self) -> None:
        """stores.base.Terminates: kill the child now (any thread; never blocks). The
        store thread's wait for it ends at once; what it had launched answers FAILED."""
        self._kill("it was still busy when the engine's close timed out")

    def close(self) -> None:
        """Close the child's store (it waits for launched copies), then end the child."""
        with self._calling:  # after a call in flight (from another thread) has its answer
            if self._closed:
                return
            self._closed = True
            try:
                self._close_child()
            finally:
                self._shutdown()

    def _close_child(self) -> None:
        link = self._link
        if link is None or link.conn.closed or self._broken is not None:
            return
        if not link.alive():  # died, and no call found out since
            log.warning("aiokv: %s before its close", link.how_it_ended())
            return
        try:
            self._send(("close", None))
            deadline = time.monotonic() + _CLOSE_TIMEOUT_S
            ok, value = self._receive(deadline, f"its close within {_CLOSE_TIMEOUT_S:g} s")
            if not ok:
                log.error("aiokv: the store process failed to close its store: %r", value)
        except StoreError:
            if link.killed is None:  # else said when it was killed
                log.exception("aiokv: the store process did not close cleanly")

    # ---- internals -------------------------------------------------------------------

    def _match_many(self, op: Op, queries: Queries, deadline_s: float | None = None
                    ) -> MatchAnswers:
        asked = [query(t, n) for t, n in queries]
        answers: MatchAnswers = self._call(
            op, asked if op == "put_match_many" else (asked, deadline_s))
        for answer in answers:
            if isinstance(answer, Exception):
                noted(answer, self.pid)
        return self._ids.matches(answers)

    def _revive(self) -> None:
        """Start a new child if the one that served died (module docstring): found by a
        call, by the notice channel closing, or by its exit status (then no call goes to
        a child known to be dead). The status too: the notice channel's reader thread
        may not have seen the close yet when the next call comes."""
        link = self._link
        if self._ended is None and not self._notices.closed and (link is None or link.alive()):
            return
        with self._calling:
            link = self._link
            if self._closed or link is None:
                return
            if self._ended is None and (self._broken is None or self._dying) and (
                    not link.alive()):
                self._lost()
            if self._ended is not None:
                self._restart(self._ended)

    def _restart(self, why: str) -> None:
        """A new child, or (no restart left, or none came up) the store down for good:
        not raised here, so that what the dead child's ids need (a cancel, a try_wait)
        still succeeds; every call that needs a child raises StoreError saying so."""
        self._restarting = True
        try:
            self._restarts.run(why, self._start_again, lambda: self._closing)
        except StoreError as error:
            self._shutdown(restarting=True)
            self._ended, self._broken = None, f"the store is down: {error}"  # for good
            log.log(logging.WARNING if self._closing else logging.ERROR, "aiokv: %s", self._broken)
            return
        finally:
            self._restarting = False
        self._ended = self._broken = None
        log.warning("aiokv: %s; a new store process (pid %s) serves", why, self.pid)

    def _start_again(self) -> None:
        self._shutdown(restarting=True)
        # The new child counts from 0: the engine's counters go on from what the dead one
        # last reported (what it counted after that is lost with it). A store whose
        # figures are not all its own (a shared server's running totals, which the new
        # child finds with the dead one's in them) is told where to go on from instead:
        # adding the dead child's figures to those would count them twice.
        if self._figures_state is None:
            self._stats_before = carried(self._stats_before, self._last_stats)
            self._last_stats = {}
        self._start_child(self._caches)
        if self._figures_state is not None:
            self._resume_figures(self._figures_state)

    def _resume_figures(self, state: object) -> None:
        """The new child's store goes on from ``state`` (its figures_state()), before any
        store_stats() asks it."""
        what = f"resume_figures within {self._call_timeout_s:g} s"
        self._send(("resume_figures", state), bound=(time.monotonic() + self._call_timeout_s,
                                                     what))
        ok, value = self._receive(time.monotonic() + self._call_timeout_s, what)
        if not ok:
            raise noted(value, self.pid)

    def _call(self, op: Op, args: object) -> Any:
        self._revive()  # before the lock: it takes it
        with self._calling:
            link = self._link
            unlinked = link is None or link.conn.closed
            if self._closed or (unlinked and self._broken is None):
                raise RuntimeError("ProcessStore is closed or not registered")
            if self._broken is not None:
                raise StoreError(self._broken)
            try:
                bound_s = self._call_timeout_s
                self._send((op, args), bound=(time.monotonic() + bound_s,
                                              f"{op} within {bound_s:g} s"))
                ok, value = self._receive(time.monotonic() + bound_s, f"{op} within {bound_s:g} s")
            except BaseException:
                # Interrupted (KeyboardInterrupt in a main-thread caller, say) with the
                # request half sent or the answer unread: a later call would read this
                # one's answer as its own, or the child the rest of it as a request.
                if self._broken is None:
                    self._broken = f"a call to the store process (pid {self.pid}) was interrupted"
                raise
        if ok:
            return value
        raise noted(value, self.pid)

    def _send(self, message: object, *, start: bool = False,
              bound: tuple[float, str] | None = None) -> None:
        """``bound``: (deadline, what) of a call's request (link.py: killed past it)."""
        assert self._link is not None
        try:
            self._link.send(message, start=start, bound=bound)
        except ChildGone as gone:
            raise self._lost() from gone

    def _receive(self, deadline: float, what: str) -> Any:
        """The child's answer to ``what`` (link.py: killed past ``deadline``)."""
        assert self._link is not None
        try:
            return self._link.receive(deadline, what)
        except ChildGone as gone:
            raise self._lost() from gone

    def _lost(self) -> StoreError:
        """The child is gone (or going): this and every later call fail with its end."""
        link = self._link
        assert link is not None
        self._broken = link.how_it_ended()
        # A child that served is restarted once it has exited; one killed that takes
        # longer than how_it_ended's wait to go (gigabytes to free) is, at a later call.
        self._dying = bool(self._caches) and link.alive()
        if self._caches and not self._dying:
            self._ended = self._broken
        return StoreError(self._broken)

    def _kill(self, why: str, level: int = logging.ERROR) -> None:
        """Kill the current child (from any thread): its calls fail with ``why``."""
        link = self._link
        if link is not None:
            link.kill(why, level)

    def _shutdown(self, restarting: bool = False) -> None:
        """End the child (closing the socket ends one that is still serving), then drop
        what it mapped. ``restarting``: a new child follows, for the same engine (its
        notice callback stays; a child still alive is killed at once)."""
        on_end = self._notices.close()
        if self._link is not None:
            self._link.close(self._socket_files, 0.0 if restarting else _EXIT_TIMEOUT_S)
        self._socket_files = []
        detach, self._detach = self._detach, []
        for release in detach:
            try:
                release()
            except Exception:  # the child is gone either way: the next one still starts
                log.exception("the store's cache handover failed to let go of its child")
        self._keep.clear()
        # Its table too: a descriptor and 2 MiB of shared memory, else held as long as
        # this store is (a closed engine's). A detach of its puts has nothing left to do.
        self._detaching = None
        if restarting:
            self._notices.resume(on_end)

    def _forget_in_fork(self) -> None:
        """In a forked child of this process: let go of the sockets without a word, so
        that the store process still sees its parent's death."""
        link, self._link = self._link, None
        ends = self._notices.forget()  # no reader thread here
        self._broken = "ProcessStore is not usable in a forked child"
        self._calling = threading.Lock()  # another thread may have held it at the fork
        if link is not None:
            link.forget()
        if ends is not None:
            with contextlib.suppress(OSError):
                ends.close()  # this process's copy only

