"""The engine's lifecycle around its public calls: the loop it belongs to, the stores that
running engines hold, the start (its running parts wired, the store registered) and the
close (drain, escalation, a store thread left behind).

An engine belongs to the loop that started it (:mod:`aiokv.loop.binding`): a ``start()``
of a running engine from another loop fails with WrongLoop, as every other call does. A
store drives one engine at a time: a second engine's ``start()`` is refused while the
first holds it.

A fork copies a started engine but none of its threads: in the child nothing would ever
run what its calls queue (a call on the parent's loop object waited forever). So every
engine started in this process and not closed is closed in a forked child, without a word
to its store (the parent's): its calls raise EngineClosed naming the fork, its close
returns at once (:func:`_after_fork_in_child`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import math
import os
import threading
import weakref
from typing import TYPE_CHECKING, Protocol

import torch

from .config import EngineConfig
from .cuda import ReadyMarks
from .errors import ConfigError, EngineClosed
from .invalidation import Invalidations
from .layerwise import LayerwiseLoad
from .loop.admission import Admission
from .loop.batcher import Batch, Batcher
from .loop.binding import check_loop
from .loop.deadlines import Deadlines, monotonic_offset_s
from .loop.resolution import Resolver
from .requests import OffloadResult, Request
from .space import SpaceWaits
from .stats import StatsRecorder
from .store_figures import ClosedFigures
from .stores.base import Store
from .worker.thread import StoreWorker

if TYPE_CHECKING:
    from .direct import TakenGroups

# After store.terminate() (the close timed out), how long the store thread may take to
# finish: its calls then fail at once, so this is a bound, not a wait.
_TERMINATED_JOIN_S = 5.0

log = logging.getLogger("aiokv")


class EngineState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


class EngineParts(Protocol):
    """The engine's parts its lifecycle works on: OffloadEngine satisfies this
    structurally, so the lifecycle is typed without importing the engine (which imports
    the lifecycle). The attributes are settable, hence invariant: each type is exactly
    OffloadEngine's."""

    # Read: built by OffloadEngine.__init__.
    _config: EngineConfig
    _store: Store
    _kv_caches: list[torch.Tensor]
    _num_pages: int
    _page_size: int
    _device: torch.device
    _on_gpu: bool
    _store_slice_us: int
    _stats: StatsRecorder
    _admission: Admission
    # Set by start() and close().
    _state: EngineState
    _loop: asyncio.AbstractEventLoop | None
    _worker: StoreWorker | None
    _batcher: Batcher | None
    _batcher_task: asyncio.Task[None] | None
    _idle: asyncio.Event | None
    _started: asyncio.Event | None
    _deadlines: Deadlines | None
    _ready_marks: ReadyMarks | None
    _resolver: Resolver | None
    _space: SpaceWaits | None
    _invalidations: Invalidations | None
    _closed_figures: ClosedFigures | None
    _layerwise_loads: weakref.WeakSet[LayerwiseLoad]
    _taken_loads: TakenGroups  # loads threads queued themselves (aiokv.direct)
    _draining: bool  # a drain close waits for what it dispatches (OffloadEngine._check_running)
    _pid: int | None  # the process that started it
    _forked: bool  # this is a forked child of that process: the engine is the parent's

    def _on_batch(self, batch: Batch) -> None: ...


# id(store) -> store, for every store a started engine holds (any loop, any thread).
_in_use: dict[int, Store] = {}
_in_use_lock = threading.Lock()


def claim_store(store: Store) -> None:
    """Note that an engine starts on ``store``; ConfigError if another engine holds it."""
    with _in_use_lock:
        if _in_use.get(id(store)) is store:
            raise ConfigError(
                "store",
                f"{type(store).__name__} at {id(store):#x} is already registered with a "
                "running engine (or a closed one's store thread, left to end on its own, "
                "still runs); give each engine a store of its own",
            )
        _in_use[id(store)] = store


def release_store(store: Store) -> None:
    with _in_use_lock:
        if _in_use.get(id(store)) is store:
            del _in_use[id(store)]


def _release_after(worker: StoreWorker, store: Store, stuck: bool) -> None:
    """The store is free for another engine once its store thread has ended: now, or
    (``stuck``: left to end on its own) when it does; until then a new engine on it is
    refused, rather than driven from two threads (and closed under it)."""
    if not stuck:
        release_store(store)
        return

    def then() -> None:
        worker.join()
        release_store(store)

    threading.Thread(target=then, name="aiokv-store-release", daemon=True).start()


def store_in_use(store: Store) -> bool:
    with _in_use_lock:
        return _in_use.get(id(store)) is store


# Every engine started in this process (weak: a dropped one is no business of a fork).
_started: weakref.WeakSet[EngineParts] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """The child's copy of each engine still open: closed, its store thread's intake too
    (a lookup's release there must not reach the parent's store, nor wait on a lock a
    thread gone with the fork held). Its store is left as it is: the parent's to close."""
    for engine in list(_started):
        if engine._state is EngineState.CLOSED:
            continue
        engine._forked = True
        engine._state = EngineState.CLOSED
        if engine._worker is not None:
            engine._worker.forget_in_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


async def start(engine: EngineParts) -> None:
    """Start an engine (OffloadEngine.start): build its running parts (resolver,
    deadlines, store thread, batcher, space waits, invalidations), then register the
    caches on the store thread and start the batcher task. A registration that fails (or
    is cancelled) fails what was accepted meanwhile and closes the engine."""
    if engine._state is EngineState.RUNNING:
        check_loop(engine._loop)  # `async with engine` on another loop must not pass
        if engine._started is not None and not engine._started.is_set():
            await engine._started.wait()  # another start() still registers the store
            if engine._state is not EngineState.RUNNING:
                raise EngineClosed(f"engine failed to start; it is {engine._state.value}")
        return
    if engine._state is not EngineState.NEW:
        raise EngineClosed(f"engine is {engine._state.value}; it cannot be restarted")
    claim_store(engine._store)  # refused (ConfigError) if another engine has it
    loop = asyncio.get_running_loop()
    engine._pid = os.getpid()
    _started.add(engine)
    engine._loop = loop
    engine._idle = asyncio.Event()
    engine._idle.set()
    engine._started = asyncio.Event()  # set once this start() ends, however it ends
    resolver = engine._resolver = Resolver(
        loop,
        engine._stats,
        engine._admission,
        engine._idle,
        engine._config.lookup_ttl_ms / 1e3,
        engine._config.request_timeout_ms,
    )
    if engine._config.request_timeout_ms:
        engine._deadlines = Deadlines(
            loop, engine._config.request_timeout_ms / 1e3, resolver.expire
        )
        resolver.deadlines = engine._deadlines
    registered: concurrent.futures.Future[None] = concurrent.futures.Future()
    # For a page view the worker indexes on the device (a mask with holes): after the
    # caller's event, never behind what the model queues on its own streams.
    side_stream = (
        torch.cuda.Stream(engine._device)  # type: ignore[no-untyped-call]
        if engine._on_gpu
        else None
    )
    engine._worker = StoreWorker(
        engine._store,
        loop,
        resolver.deliver,
        engine._config.poll_interval_us,
        engine._kv_caches,
        registered,
        side_stream,
        engine._store_slice_us,
        # Request deadlines on the store thread's clock: nothing is launched past one, and
        # a store that waits inside queues nothing of a load past it (worker/rounds.py).
        monotonic_offset_s(loop),
    )
    resolver.detach_task = engine._worker.caps.detach
    if engine._on_gpu:
        engine._ready_marks = ReadyMarks(engine._device, loop.call_soon)
    engine._batcher = Batcher(
        engine._config,
        engine._worker.submit,
        resolver.dropped,
        engine._on_batch,
        resolver.dispatch_failed,
        engine._ready_marks.close_window if engine._ready_marks is not None else None,
    )
    resolver.space = engine._space = SpaceWaits(
        loop,
        engine._config.request_timeout_ms,
        engine._stats,
        engine._batcher.requeue,
        resolver.resolve,
    )
    space, batcher = engine._space, engine._batcher

    def before_invalidation(namespace: tuple[str, ...] | None) -> None:
        for request in space.superseded(namespace):
            resolver.resolve(request, OffloadResult(request.user_id, 0, 0))
        batcher.dispatch_all()

    engine._invalidations = Invalidations(
        engine._store, loop, before_invalidation, engine._worker.submit, engine._stats,
        engine._config.request_timeout_ms / 1000,
    )
    # Calls are accepted from here on: they queue until the batcher task starts.
    engine._state = EngineState.RUNNING
    engine._worker.start()
    try:
        await asyncio.wrap_future(registered)
    except BaseException as exc:
        engine._started.set()
        engine._state = EngineState.CLOSED
        engine._worker.stop(give_up_s=0.0)  # nothing was launched
        # Nothing dispatched them (no batcher task yet): fail them now, not after the
        # join, which waits for the registration and which a second cancel may skip.
        fail_accepted(engine, EngineClosed(f"engine failed to start: {exc!r}"))
        await _join(engine._worker, None)
        release_store(engine._store)
        raise
    engine._started.set()
    if engine._state is not EngineState.RUNNING:  # aclose() came while we registered
        raise EngineClosed("engine was closed while it started")
    engine._batcher_task = loop.create_task(engine._batcher.run(), name="aiokv-batcher")


async def close(engine: EngineParts, drain: bool, timeout: float) -> int:
    """Close a started engine (OffloadEngine.aclose), within ``timeout`` seconds whatever
    the store does (and up to _TERMINATED_JOIN_S more where the store could be
    terminated): returns how many requests were abandoned (failed with EngineClosed at
    the deadline, their transfers, if launched, left to the store thread)."""
    batcher, worker, idle = engine._batcher, engine._worker, engine._idle
    resolver, admission = engine._resolver, engine._admission
    assert batcher is not None and worker is not None and idle is not None
    assert resolver is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    engine._state = EngineState.DRAINING
    worker.closing()  # the store starts nothing new for later calls (no new child)
    admission.wake_all()  # callers waiting for room see the state and leave
    # Held Lookups read released once closed anyway, and nothing can load them now: their
    # reservations go back first, as an evict's or a clear's do (aiokv.invalidation). A
    # launched load waiting for host room in the store (stores.base.ParksLoads) may be
    # waiting for that very room, and the drain, or the store thread's wait for launched
    # tasks, would wait for it until the deadline. Those the close drains go back as they
    # are answered.
    resolver.release_lookups()
    if engine._batcher_task is None:
        drain = False  # closed while starting: nothing dispatches what is queued
    if drain:
        batcher.drain()
        if engine._batcher_task is not None and engine._batcher_task.done():
            # Cancelled with every other task by a shutdown: nothing else would dispatch
            # what is queued, and the drain would wait its whole timeout for it.
            engine._batcher_task = loop.create_task(batcher.run(), name="aiokv-batcher")
        engine._draining = True
        try:
            # A call that passed the running check before this close set DRAINING, and is
            # accepted in a task of its own (load_layerwise's), was accepted before the
            # close: that task, already scheduled, runs (and clears idle) before this one
            # looks at idle, which on Python 3.12 on does not yield where idle is set.
            await asyncio.sleep(0)
            # Idle stays clear while a refusal keeps its room for a second try (offload's
            # _again, accepted while draining): that call goes on, and is drained too.
            await asyncio.wait_for(idle.wait(), timeout)
        except TimeoutError:
            log.warning("aiokv: drain timed out after %.1fs; closing now", timeout)
        finally:
            engine._draining = False
    space = engine._space  # offloads waiting for room (aiokv.space) go with the queue
    queued = [*(space.close() if space is not None else ()), *batcher.take_queued()]
    for request in queued:
        resolver.resolve(request, EngineClosed("engine closed before this request ran"))
    if engine._batcher_task is not None:
        engine._batcher_task.cancel()
        # return_exceptions: the batcher's own CancelledError comes back as a value,
        # while a cancellation of this task still propagates.
        await asyncio.gather(engine._batcher_task, return_exceptions=True)
    left_s = max(deadline - loop.time(), 0.0)
    worker.stop(give_up_s=left_s)  # a try_wait outage is waited through until the deadline
    stuck = not await _join(worker, left_s) and not await _terminate(worker)
    await asyncio.sleep(0)  # let outcomes posted before the join arrive
    if not stuck:
        # Loads threads queued themselves and have not waited for: the store's close
        # ran their copies; finished now, they are counted before the figures are final.
        # In a thread: a wait for copies (on a GPU) is no work for the loop. Their counts
        # come to the loop before this task resumes.
        await asyncio.to_thread(engine._taken_loads.finish_all)
        await asyncio.sleep(0)
    if engine._invalidations is not None:
        engine._invalidations.close()  # an evict the store thread never answered
    resolver.resolve_outcomes(budget_s=math.inf)  # and resolve them, then fail the rest
    unfinished = list(admission.live)
    if unfinished or stuck:
        log.warning(
            "aiokv: closed with %d requests unfinished (failed with EngineClosed)%s",
            len(unfinished),
            "; the store thread is still busy and is left to end on its own" if stuck else "",
        )
    abandoned = EngineClosed(
        f"engine closed before this request finished ({len(unfinished)} requests "
        f"abandoned at the close's timeout={timeout}s)"
    )
    for request in unfinished:
        # Its copy may run on, reading pages its caller reuses once told EngineClosed: an
        # offload is detached first, as at its timeout, so that the store keeps none of
        # it (a shared server, or a store another engine drives next, would).
        resolver.detach(request)
        resolver.resolve(request, abandoned)
    if engine._deadlines is not None:
        engine._deadlines.close()
    # Final from here on, also where the store thread is left to end on its own.
    engine._closed_figures = ClosedFigures(
        worker.tasks_open, dict(worker.figures.latest), worker.stats.store.read())
    engine._state = EngineState.CLOSED
    _release_after(worker, engine._store, stuck)
    return len(unfinished)


async def close_orphaned(engine: EngineParts, timeout: float) -> None:
    """Close an engine whose loop was closed without closing it (from any loop): its
    futures died with that loop, so nothing is left to resolve; every request still
    pending is counted (StatsRecorder.settle_orphaned). The store thread stops, waits for
    launched transfers and closes the store. Then the layerwise loads that loop never
    ended end with EngineClosed: threads may wait on them, which no loop wakes."""
    assert engine._worker is not None
    engine._state = EngineState.CLOSED
    # Counted first, as nothing else will (also where this close is cancelled in its
    # joins): the callers' tasks, which take outcomes and count them, went with that loop,
    # those answered in its last iteration included, and pending would stay above 0.
    unanswered = list(engine._admission.live)
    engine._stats.settle_orphaned(unanswered, EngineClosed(
        f"engine closed after its loop was closed without aclose() ({len(unanswered)} "
        "requests never answered)"
    ))
    engine._worker.closing()
    engine._worker.stop(give_up_s=timeout)
    stuck = not await _join(engine._worker, timeout) and not await _terminate(engine._worker)
    if stuck:
        log.warning("aiokv: store thread still busy after %.1fs; left to end on its own", timeout)
    # After the join, as a close fails what it abandons: a wait that raises finds the
    # store's copies into the pages ended, unless the store thread was left behind.
    loads = list(engine._layerwise_loads)
    for load in loads:
        load._end_orphaned()
    # The engine's own tasks on that loop never run again, and what they held is settled
    # above: asyncio would log each "Task was destroyed but it is pending!" (an error, as
    # if work were lost) when it is collected.
    for task in (engine._batcher_task, *(load._end for load in loads)):
        if isinstance(task, asyncio.Task) and not task.done():
            task._log_destroy_pending = False  # type: ignore[union-attr]
    _release_after(engine._worker, engine._store, stuck)


def fail_accepted(engine: EngineParts, error: Exception) -> None:
    """Resolve with ``error`` every request accepted and not resolved, and send the
    callers waiting for room away (a start that failed: no store thread is left)."""
    assert engine._batcher is not None and engine._resolver is not None
    taken: list[Request] = engine._batcher.take_queued()
    for request in [*taken, *engine._admission.live]:
        engine._resolver.resolve(request, error)
    engine._admission.wake_all()
    if engine._deadlines is not None:
        engine._deadlines.close()
    if engine._invalidations is not None:
        engine._invalidations.close()


async def _terminate(worker: StoreWorker) -> bool:
    """The close timed out with the store thread still busy: have the store end what the
    thread waits on (a child process, killed: stores.base.Terminates), then give the
    thread a moment to close the store. Whether it ended."""
    if not worker.terminate():  # a store that cannot: the thread is left to end on its own
        return False
    return await _join(worker, _TERMINATED_JOIN_S)


# The joiners of closes cancelled while they joined (a shutdown that cancels every task),
# by store thread: the close that goes on after them joins them once that thread ended.
_cancelled_joins: weakref.WeakKeyDictionary[StoreWorker, list[threading.Thread]] = (
    weakref.WeakKeyDictionary())


async def _join(worker: StoreWorker, timeout: float | None) -> bool:
    """``worker.join(timeout)`` on a thread of its own, not the loop's default executor:
    that one may be full (a caller's own ``to_thread`` work, or waits for layers), and a
    close must not queue behind it."""
    loop = asyncio.get_running_loop()
    joined: asyncio.Future[bool] = loop.create_future()

    def settle(result: bool) -> None:
        if not joined.done():  # its awaiter may have been cancelled
            joined.set_result(result)

    def run() -> None:
        result = False  # a join that raised is a store thread not seen to end
        try:
            result = worker.join(timeout)
        finally:  # the close never waits on a thread that is gone
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, result)

    joiner = threading.Thread(target=run, name="aiokv-close", daemon=True)
    joiner.start()
    try:
        result = await joined
    except asyncio.CancelledError:
        _cancelled_joins.setdefault(worker, []).append(joiner)  # it runs on
        raise
    # Posting the result is its last step: joined now (at once), so that no aiokv thread
    # outlives the close that started it; those of cancelled closes too, once the store
    # thread they waited for has ended (else they end with it, left to end on its own).
    joiner.join()
    if result:
        for earlier in _cancelled_joins.pop(worker, ()):
            earlier.join()
    return result
