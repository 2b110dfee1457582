"""OffloadEngine: the public async API (its lifecycle, admission, deadlines and
resolution have modules of their own).

One offload: ``offload`` validates from shapes and dtypes only (GPU values are never
read on the loop), notes the caller's stream (cuda.py), admits the request against
``max_pending`` and queues it with a future; the batcher (loop/batcher.py) hands a
window's batch to the store thread (worker/thread.py), which matches, plans
(worker/plans.py) and executes the round (worker/rounds.py: cancels, one launch with the
callers' page ids), and posts outcomes to loop/resolution.py, the one place a future is
resolved. The store makes what it needs of the page ids (stores/; the embedded store's
copies: copy/).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from types import TracebackType
from typing import Any

import torch

from . import layerwise, lifecycle, validate
from .config import EngineConfig
from .cuda import ReadyMarks, caller_event
from .direct import TakenGroups
from .errors import (
    ConfigError,
    EngineClosed,
    InvalidRequest,
    Overloaded,
)
from .invalidation import Invalidations
from .lifecycle import EngineState as EngineState  # public as aiokv.engine.EngineState
from .loop import takers
from .loop.admission import Admission
from .loop.batcher import Batch, Batcher
from .loop.binding import check_loop
from .loop.deadlines import Deadlines
from .loop.resolution import Resolver
from .portal import refuse_in_fork
from .requests import (
    Kind,
    LoadResult,
    Lookup,
    OffloadResult,
    Request,
    new_request,
)
from .space import SpaceWaits
from .stats import EngineStats, StatsRecorder
from .store_figures import ClosedFigures
from .stores.base import Store, store_restarts
from .worker.handoff import store_slice_us
from .worker.thread import StoreWorker

# Enum members read as class attributes cost an attribute lookup each; per-call paths read
# them from here.
_OFFLOAD, _LOAD = Kind.OFFLOAD, Kind.LOAD


_RUNNING = EngineState.RUNNING  # read per call: see _OFFLOAD

# What every store has (stores.base.Store): without them an engine fails at start, after
# it half set the store up, with an AttributeError that names no argument.
_STORE_VERBS = ("register", "put_match", "get_match", "launch", "cancel", "try_wait", "close")


def _check_store(store: object) -> None:
    missing = [verb for verb in _STORE_VERBS if not callable(getattr(store, verb, None))]
    if missing or not hasattr(store, "page_size"):
        raise ConfigError("store", f"must be an aiokv store (aiokv.LocalStore(config), "
                                   f"aiokv.stores.make_store(config), ...), got "
                                   f"{type(store).__name__}")


class OffloadEngine:
    """Batches awaited offload/lookup/load calls into store rounds.

    Use ``async with engine:`` or ``await engine.start()`` / ``await engine.aclose()``.
    Every call raises EngineClosed unless the engine is running; the store is owned by the
    engine from construction and closed by ``aclose``.
    """

    def __init__(
        self,
        store: Store,
        kv_caches: Sequence[torch.Tensor],
        config: EngineConfig | None = None,
    ) -> None:
        _check_store(store)
        if config is not None and not isinstance(config, EngineConfig):
            raise ConfigError("config", f"must be an aiokv.EngineConfig or None, got "
                                        f"{type(config).__name__}")
        self._num_pages, self._page_size, self._device, self._bytes_per_token = validate.kv_caches(
            kv_caches
        )
        if store.page_size and store.page_size != self._page_size:
            raise ConfigError(
                "store.page_size",
                f"{store.page_size} does not match the caches' page size {self._page_size}",
            )
        self._store = store
        self._kv_caches = list(kv_caches)
        self._config = config or EngineConfig()
        self._store_slice_us = store_slice_us(self._config, store)
        self._max_lookup_tokens = self._config.max_lookup_tokens  # read per lookup
        self._on_gpu = self._device.type == "cuda"
        self._state = EngineState.NEW
        self._stats = StatsRecorder(self._page_size * self._bytes_per_token)
        self._admission = Admission(self._config, self._stats)  # max_pending, overload
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: StoreWorker | None = None
        self._batcher: Batcher | None = None
        self._batcher_task: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None
        self._started: asyncio.Event | None = None  # set once start() registered (or failed)
        self._deadlines: Deadlines | None = None  # request_timeout_ms, when set
        self._ready_marks: ReadyMarks | None = None  # the callers' CUDA events, on a GPU
        self._closing: asyncio.Future[int] | None = None  # int: requests abandoned
        self._resolver: Resolver | None = None  # resolves every future, once started
        self._space: SpaceWaits | None = None  # offloads waiting for room, once started
        self._invalidations: Invalidations | None = None  # evict and clear, once started
        self._closed_figures: ClosedFigures | None = None  # the store thread's, at close
        # A drain close dispatches what it finds and waits for it (lifecycle.close): only
        # then is a second try of an offload accepted before it taken (offload's _again).
        self._draining = False
        # Launched layerwise loads (weak): a close after the loop was closed ends those
        # that loop never ended (lifecycle.close_orphaned).
        self._layerwise_loads: weakref.WeakSet[layerwise.LayerwiseLoad] = weakref.WeakSet()
        # Loads threads queued themselves (aiokv.direct), not yet waited for.
        self._taken_loads = TakenGroups()
        self._pid: int | None = None  # the process that started it
        self._forked = False  # a forked child's copy (lifecycle._after_fork_in_child)

    # ---- lifecycle ---------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def page_size(self) -> int:
        return self._page_size

    async def start(self) -> None:
        """Register the caches with the store (on the store thread) and start batching.
        Raises EngineClosed if the engine was closed, and the store's error if
        registration fails (then the engine is closed)."""
        await lifecycle.start(self)

    async def aclose(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting calls and shut down, within ``timeout`` seconds (plus the loop's
        own latency) whatever the store does. Idempotent; concurrent calls share one
        close. A close cancelled itself (a shutdown that cancels every task) is taken up
        by the next call, or one waiting that was not cancelled, where it stopped. Raises
        WrongLoop, leaving the engine untouched, off the engine's loop
        (once that loop is closed, any loop may close the engine: its store thread stops
        and the store closes; the futures died with their loop, and the layerwise loads
        it never ended end with EngineClosed, as do the threads' waits on them).

        drain=True: everything accepted is dispatched and resolved, up to ``timeout``
        seconds; then the close escalates as with drain=False. drain=False: queued
        (undispatched) requests fail with EngineClosed at once. Launched transfers are
        never cancelled: the store thread waits for them before it closes the store; if
        it is still busy at the deadline, a store that can be ended at once is
        (stores.base.Terminates: a store's child process is killed, up to a few seconds
        more), else the thread is left to end on its own, and the requests still
        unresolved fail with EngineClosed naming their count (logged as a warning).
        Lookups still held are given back first (a load waiting for the room they hold
        goes on), and read released.
        In a forked child of the process that started it, returns at once: the engine
        and its store are the parent's (every other call there raises EngineClosed).
        Raises InvalidRequest, leaving the engine untouched, for a ``drain`` that is not a
        bool or a ``timeout`` that is not a finite number of seconds >= 0, at most
        threading.TIMEOUT_MAX.
        """
        drain, timeout = validate.close_args(drain, timeout)
        if self._forked:
            return  # the parent's engine, and its store, are the parent's to close
        if self._state is EngineState.NEW:
            self._state = EngineState.CLOSED
            if not lifecycle.store_in_use(self._store):  # else another engine's store
                await asyncio.to_thread(self._store.close)
            return
        if self._state is EngineState.CLOSED and self._closing is None:
            return  # its start failed and closed it
        if self._loop is not None and self._loop.is_closed():
            if self._state is not EngineState.CLOSED:
                await lifecycle.close_orphaned(self, timeout)
            return
        me = asyncio.current_task()
        cancels = me.cancelling() if me is not None else 0
        while True:
            closing = self._closing
            if closing is None or closing.cancelled():
                # A close task cancelled (a shutdown that cancels every task) stopped where
                # it was: this close goes on from there (lifecycle.close redoes nothing
                # that is done), else the engine stayed open and its threads ran on.
                check_loop(self._loop)
                closing = self._closing = asyncio.ensure_future(
                    lifecycle.close(self, drain, timeout))
            elif not closing.done():
                check_loop(self._loop)
            try:
                # Shielded: a caller cancelled while closing must not leave the engine
                # half-closed.
                await asyncio.shield(closing)
                return
            except asyncio.CancelledError:
                # The close task's own cancellation is not this caller's: it closes again.
                if me is None or me.cancelling() > cancels or not closing.cancelled():
                    raise

    async def __aenter__(self) -> OffloadEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def stats(self) -> EngineStats:
        """The counters now (README: the field reference). Any time in the engine's life,
        from its loop or, once it is closed, from any thread: before ``start()`` all 0,
        after ``aclose()`` the final figures. The store's own figures (tier hits, SSD
        bytes, occupancy) are at most ``aiokv.store_figures.REFRESH_S`` old while it
        works. EngineClosed in a forked child of the process that started it (the
        engine open at the fork): the figures there are a copy of the parent's, frozen."""
        if self._forked:
            assert self._pid is not None  # set by the start the fork copied
            refuse_in_fork(self._pid, "engine", "store thread")
        worker = self._worker
        restarts = store_restarts(self._store)
        closed = self._closed_figures
        if closed is not None:
            return self._stats.snapshot(
                closed.tasks_open, self._bytes_per_token, restarts, closed.latest)
        if worker is None:
            return self._stats.snapshot(0, self._bytes_per_token, restarts)
        return self._stats.snapshot(
            worker.tasks_open, self._bytes_per_token, restarts,
            worker.figures.latest,
        )

    # ---- public calls ------------------------------------------------------------------

    async def offload(
        self,
        user_id: Hashable,
        page_ids: torch.Tensor,
        num_tokens: int,
        *,
        token_ids: Any = None,
        namespace: Sequence[str] | None = None,
        _ready_event: Any = None,
        _again: Callable[[InvalidRequest], int | None] | None = None,
    ) -> OffloadResult:
        """Store the full pages of a user's first ``num_tokens`` tokens, held in
        ``page_ids`` (in order). Pages already stored under the same key are skipped.
        On a GPU the copy starts after what the current CUDA stream has queued by now.

        Raises InvalidRequest (bad argument, names it; also more full pages than the
        caches or the store's tiers can ever hold, or, at its match, more pages the key
        lacks than the host tier has blocks), Overloaded, EngineClosed, StoreError /
        StoreFull (the store failed it) or RequestTimeout.

        ``_ready_event`` is internal (run_in_background, aiokv.integrations): a CUDA event
        that the calling thread recorded after its writes (:meth:`_caller_event`), waited
        for instead of this thread's current stream. ``_again`` is internal too (the
        recsys adapter): told, on the loop and before anything else runs there, of the
        InvalidRequest with which the store refused this offload (a put more than it can
        ever hold: the engine asked for its figures again before answering), it returns
        the tokens of a second try (fewer) or None (the refusal is raised). That second
        try is taken while the engine drains, as the first was (a drain close answers
        what was accepted before it), and the two are one call in EngineStats: the
        refused first try is not counted as failed where the second was accepted.
        """
        self._check_running()
        pages = validate.page_ids(page_ids, self._device)
        num_tokens, pages_used = self._offload_tokens(num_tokens, pages)
        # What the store's tiers hold is checked on the store thread, at the batch's match
        # (worker.rounds): the figures it is known from may be another store's by now (a
        # store server restarted with other tiers), and only a store call can tell.
        # Page id *values* are the store's to check, at launch (stores.base.Store.launch):
        # GPU values cannot be read here, and a per-call min/max would cost more than the
        # rest of the submit path. A bad one fails this request alone, naming the id.
        request = self._new_request(
            _OFFLOAD, user_id, num_tokens, token_ids, namespace, pages, pages_used, _ready_event
        )
        if _again is None:
            result: OffloadResult = await self._run(request)
            return result
        # The store's refusal keeps this call's room for its second try (resolution.py):
        # taken back by it below, or given back, before this task awaits anything else.
        request.keeps_room = True
        refused: list[Request] = []
        try:
            result = await self._run(request, refused)
        except InvalidRequest as refusal:
            if not refused:  # not the store's answer
                raise
            second = self._second_try(request, refusal, _again, pages, token_ids, namespace,
                                      _ready_event)
            try:
                result = await self._run(second, again=True)
            except BaseException as exc:
                if second.first_try is not None:  # never accepted: the first's is the call's
                    cancelled = isinstance(exc, asyncio.CancelledError)
                    takers.count(self._stats.record_outcome, request,
                                 None if cancelled else refusal)
                raise
        return result

    def _offload_tokens(self, num_tokens: object, pages: torch.Tensor) -> tuple[int, int]:
        """An offload's ``num_tokens``, checked against its pages, and the full pages of
        it that are stored."""
        num_tokens = validate.num_tokens(num_tokens)
        if num_tokens > pages.numel() * self._page_size:  # 1-D: numel() is shape[0]
            raise InvalidRequest(
                "num_tokens",
                f"{num_tokens} tokens do not fit in {pages.shape[0]} pages of {self._page_size}",
            )
        pages_used = num_tokens // self._page_size  # only full pages are stored
        validate.offload_pages(num_tokens, pages_used, self._num_pages)
        return num_tokens, pages_used

    def _second_try(
        self,
        first: Request,
        refusal: InvalidRequest,
        again: Callable[[InvalidRequest], int | None],
        pages: torch.Tensor,
        token_ids: Any,
        namespace: Sequence[str] | None,
        ready_event: Any,
    ) -> Request:
        """The second try of an offload the store refused (offload's ``_again``), not yet
        accepted; the refusal is counted and raised where none is made."""
        try:
            tokens = again(refusal)
            if tokens is None:
                raise refusal
            self._check_running(draining=True)  # accepted before a drain close, as the first
            # Checked as the first's were: the store would take a negative count as a
            # slice from the end, and one past the pages as a failure of its own.
            tokens, pages_used = self._offload_tokens(tokens, pages)
            second = self._new_request(
                _OFFLOAD, first.user_id, tokens, token_ids, namespace, pages, pages_used,
                ready_event,
            )
        except BaseException:
            assert self._resolver is not None  # started: it took the first try
            self._resolver.give_back_kept()
            takers.count(self._stats.record_outcome, first, refusal)
            raise
        second.first_try = first  # one call with it: _accept
        second.submitted_at = first.submitted_at
        # Its deadline is the call's, from the first's accept (request_timeout_ms).
        second.deadline = first.deadline
        return second

    async def lookup(
        self,
        user_id: Hashable,
        num_tokens: int,
        *,
        token_ids: Any = None,
        namespace: Sequence[str] | None = None,
    ) -> Lookup:
        """How much of this key's first ``num_tokens`` tokens the store holds; the hit is
        reserved for ``load`` until released or ``lookup_ttl_ms`` passes.

        Raises InvalidRequest (a bad argument, or ``num_tokens`` above
        ``engine.max_lookup_tokens``), Overloaded, EngineClosed, StoreError or
        RequestTimeout. The store is asked about no more tokens than it can hold, so a
        lookup costs what the store holds, not what was asked."""
        self._check_running()
        num_tokens = validate.num_tokens(num_tokens)
        validate.at_most(
            "num_tokens", num_tokens, self._max_lookup_tokens, "engine.max_lookup_tokens"
        )
        request = self._new_request(Kind.LOOKUP, user_id, num_tokens, token_ids, namespace)
        result: Lookup = await self._run(request)
        return result

    async def load(
        self, hit: Lookup, page_ids: torch.Tensor, *, _ready_event: Any = None
    ) -> LoadResult:
        """Copy a Lookup's cached prefix into ``page_ids`` (in order). Consumes ``hit``.
        When the returned future resolves, the data is in the caches: ``loaded_tokens``
        is ``hit.cached_tokens`` (0 after an evict or clear of the key; fewer only where
        a block read from SSD failed its checksum). Pages on SSD may wait for host room
        to stage them (``EngineStats.stage_waits``), up to ``request_timeout_ms``: then
        RequestTimeout. On a GPU the copy starts after what the current CUDA stream has
        queued by now (``_ready_event``: as for :meth:`offload`)."""
        request = self._load_request(hit, page_ids, _ready_event)
        if request is None:
            return LoadResult(hit.user_id, 0)
        return await self._await_load(hit, request)

    async def load_layerwise(
        self,
        hit: Lookup,
        page_ids: torch.Tensor,
        *,
        _ready_event: Any = None,
        _on_handed_out: layerwise.HandOut | None = None,
    ) -> layerwise.LayerwiseLoad:
        """:meth:`load`, returned once launched (or ended, if it never launches) as an
        :class:`aiokv.LayerwiseLoad` whose layers can be waited for one by one; its later
        errors come from its waits and ``result()``. Cancelled before it returns, the
        load is cancelled as ``load`` would be."""
        request = self._load_request(hit, page_ids, _ready_event)
        return await layerwise.start(
            len(self._kv_caches), hit, request, self._await_load, self._layerwise_loads,
            _on_handed_out,
        )

    def _load_request(self, hit: Lookup, page_ids: torch.Tensor, ready: Any) -> Request | None:
        """A load's request, checked, not yet submitted; None for an empty hit (counted
        here: nothing to move)."""
        self._check_running()
        if not isinstance(hit, Lookup) or hit._owner is not self._resolver:
            raise InvalidRequest("hit", "must be a Lookup returned by this engine's lookup()")
        pages = validate.page_ids(page_ids, self._device)
        if hit.cached_tokens == 0:
            takers.count(self._stats.record_empty_load)  # a thread may cancel it yet
            return None
        needed = hit._pages_needed(self._page_size)
        if pages.shape[0] < needed:
            raise InvalidRequest(
                "page_ids", f"has {pages.shape[0]} pages; this hit needs at least {needed}"
            )
        reservation = hit._consume()
        request = self._new_request(
            _LOAD, hit.user_id, hit.cached_tokens, None, (), pages, needed, ready
        )
        request.reservation = reservation
        request.task_id, request.mask = reservation.task_id, reservation.mask
        return request

    async def _await_load(self, hit: Lookup, request: Request) -> LoadResult:
        try:
            result: LoadResult = await self._run(request)
        except Overloaded:
            hit._hand_back()  # never accepted: the caller may load it later
            raise
        except BaseException:
            hit._settle(loaded=False)  # the store thread gave its reservation back
            raise
        hit._settle(loaded=True)
        return result

    async def evict(self, user_id: Hashable, *, namespace: Sequence[str] | None = None) -> int:
        """Drop every block stored under this key (the one ``offload(user_id, ...,
        namespace=namespace)`` writes); returns the tokens dropped, 0 if none. Runs after
        every call the engine accepted before it: a load of the key already dispatched
        finishes first; lookup reservations held on the key are given back first (their
        loads then load 0 tokens). See :mod:`aiokv.invalidation`.

        Raises InvalidRequest (``user_id`` / ``namespace``, as offload does), StoreError
        (the store cannot evict, or failed to), RequestTimeout (at ``request_timeout_ms``
        from the call, whatever the store does: it says whether the store had been asked;
        if not, nothing was dropped; if so, the key may have been, by a store server or
        store process only if the request reached it before the deadline), EngineClosed."""
        self._check_running()
        names = validate.namespace(namespace, user_id)
        assert self._invalidations is not None  # made in start()
        return await self._invalidations.run(names)

    async def clear(self) -> int:
        """Drop everything the store holds; returns the tokens dropped. Ordered as
        :meth:`evict`; every lookup reservation is given back first. Raises StoreError
        (the store cannot clear, or failed to), RequestTimeout (as evict), EngineClosed."""
        self._check_running()
        assert self._invalidations is not None
        return await self._invalidations.run(None)

    # ---- validation (shapes and dtypes only: never reads GPU values) -------------------

    def _check_running(self, draining: bool = False) -> None:
        """Every public call that changes the engine starts here (evict and clear too).
        ``draining``: taken while a drain close waits for what it dispatches too
        (offload's ``_again``), not once it gave up on that (drain=False, its timeout):
        nothing would dispatch it, and the close would count it abandoned."""
        if self._state is not _RUNNING and not (draining and self._draining):
            if self._forked:
                assert self._pid is not None  # set by the start the fork copied
                refuse_in_fork(self._pid, "engine", "store thread")
            if self._state is EngineState.NEW:
                raise EngineClosed(
                    "engine is not started: call `await engine.start()` first, or use "
                    "`async with engine:`"
                )
            raise EngineClosed(f"engine is {self._state.value}")
        check_loop(self._loop)

    def _new_request(
        self,
        kind: Kind,
        user_id: Hashable,
        num_tokens: int,
        token_ids: Any,
        namespace: Sequence[str] | None,
        pages: torch.Tensor | None = None,
        pages_used: int = 0,
        ready_event: Any = None,
    ) -> Request:
        assert self._loop is not None
        request = new_request(
            kind, user_id, self._loop.create_future(), num_tokens, token_ids, namespace,
            pages, pages_used,
        )
        if ready_event is not None:
            request.ready_event = ready_event  # recorded by the caller's own thread
        elif self._ready_marks is not None and pages is not None:
            # The copy starts after the caller's stream gets at least this far (the
            # store waits for it: the embedded store's copier on its streams, FlexKV's
            # and a store process's page-id copy before theirs).
            self._ready_marks.mark(request)
        return request

    def _caller_event(self) -> Any:
        """The calling thread's ready event (:func:`aiokv.cuda.caller_event`; None for CPU
        caches), for a call that another thread submits (``_ready_event``)."""
        return caller_event(self._device) if self._on_gpu else None

    # ---- admission, deadlines, resolution ----------------------------------------------

    async def _run(
        self, request: Request, refused: list[Request] | None = None, again: bool = False
    ) -> Any:
        """Admit a request and await its outcome: at once when there is room, else per
        ``overload`` (admission.py). The outcome is counted here, as its caller takes it
        (:mod:`aiokv.loop.takers`), not as its future is resolved: a caller cancelled
        after the answer came, before its task ran again, gets CancelledError, and
        counting the answer then would say completed, with its tokens, for a call its
        caller saw cancelled. ``refused``: where given, a store's InvalidRequest answer
        is not counted here but the request added to it (offload's ``_again``).
        ``again``: the second try of such a refused offload, which takes the room its
        first kept and keeps its deadline: one call with it, accepted once already, that
        neither waits for room (a drain close would fail it) nor is turned away."""
        future = request.future
        try:
            if again:
                self._admission.take_kept()
                result = await self._accept(request, request.deadline)
            elif self._admission.has_room():
                result = await self._accept(request)
            else:
                result = await self._submit_when_room(request)
        except asyncio.CancelledError:
            if future.cancelled():
                assert self._resolver is not None
                # Before the cancellation reaches the caller, who may then reuse its pages.
                self._resolver.detach(request)
                self._resolver.finished(request)
                self._stats.record_outcome(request, None)
            elif future.done():
                # Answered in the loop iteration its caller left in (asyncio.timeout's
                # timer, say): the caller has CancelledError, not the answer, and so do
                # the counts; nobody has the Lookup to release, so its hold goes now.
                error = future.exception()
                if error is None and isinstance(future.result(), Lookup):
                    future.result().release()
                elif request.keeps_room and isinstance(error, InvalidRequest):
                    assert self._resolver is not None
                    self._resolver.give_back_kept()  # no second try will take it
                self._stats.record_outcome(request, None)
            raise  # else never accepted (cancelled while waiting for room)
        except Exception as exc:
            if future.done():  # its answer (else admission's refusal, or a closed engine)
                if refused is not None and isinstance(exc, InvalidRequest):
                    refused.append(request)  # counted by offload, with its second try
                else:
                    takers.count(self._stats.record_outcome, request, exc)
            raise
        takers.count(self._stats.record_outcome, request, result)
        return result

    def _accept(self, request: Request, deadline: float | None = None) -> asyncio.Future[Any]:
        assert self._batcher is not None and self._idle is not None
        if request.first_try is not None:  # one call with the try the store refused
            self._stats.record_again(request, request.first_try)
            request.first_try = None
        else:
            request.submitted_at = time.perf_counter()  # latency; deadlines use the loop clock
            self._stats.record_submit()
        self._admission.admit(request)
        self._idle.clear()
        if self._deadlines is not None:
            # Kept on the request too: an answer that comes after it, before the timer
            # runs, fails it all the same (resolution.py).
            request.deadline = self._deadlines.add(request, deadline)
        self._batcher.enqueue(request)
        return request.future

    async def _submit_when_room(self, request: Request) -> Any:
        try:
            # The deadline runs from the call, the wait for room included.
            deadline = await self._admission.wait_for_room(
                lambda: self._state is EngineState.RUNNING, request.kind
            )
            if self._state is not EngineState.RUNNING:  # closed while we waited
                raise EngineClosed(f"engine is {self._state.value}")
        except BaseException as exc:
            # The load never ran; refused for overload, its Lookup holds it again.
            if request.reservation is not None and not isinstance(exc, Overloaded):
                request.reservation.release()
            raise
        return await self._accept(request, deadline)

    def _on_batch(self, batch: Batch) -> None:
        self._stats.record_batch(batch)

