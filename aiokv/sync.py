"""The engine for threaded callers: ``aiokv.run_in_background(engine)``.

The engine runs on an event loop of its own, in a thread named ``aiokv-loop`` (uvloop
where it is installed). The handle's blocking methods may be called from any other
thread; each is the async call handed to that loop (:class:`aiokv.portal.Portal`, which
starts calls in the order they were made: the engine accepts them in that order) and
waited for, so there is one implementation of every call (anyio's blocking portal).
``submit_*`` return a :class:`concurrent.futures.Future` instead of waiting. A blocking
call from the loop's own thread would wait for itself forever; it raises
:class:`BlockingCallOnLoop` instead.

::

    with aiokv.run_in_background(engine) as kv:       # starts the engine
        kv.offload(user_id, page_ids, num_tokens)
        with kv.lookup(user_id, num_tokens) as hit:   # a BackgroundLookup
            kv.load(hit, other_pages)
    # closed here: drained, loop stopped, thread joined
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import torch

from . import direct, validate
from .engine import EngineState, OffloadEngine
from .errors import BlockingCallOnLoop, EngineClosed, InvalidRequest
from .exiting import HandOverGate, stop_at_exit
from .handles import BackgroundLayerwiseLoad, BackgroundLookup
from .layerwise import LayerwiseLoad
from .loop.resolution import finish_thread_future
from .portal import Call, Portal, forked, outcome, refuse_in_fork
from .requests import LoadResult, Lookup, OffloadResult
from .stats import EngineStats

T = TypeVar("T")

THREAD_NAME = "aiokv-loop"
# At the exit, how often the wait for the loop to park checks that its thread still runs
# (a close that ended meanwhile ends the thread without parking it).
_EXIT_POLL_S = 0.05

log = logging.getLogger("aiokv")


def default_loop_factory() -> asyncio.AbstractEventLoop:
    """uvloop's loop where uvloop is installed (the loop serving stacks use), else
    asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


# The engine's call that does a blocking handle call's work on the loop, where it is not
# ``await engine.<name>(...)``: the hint must work when followed.
_ON_THE_LOOP = {
    "stats": "call engine.stats() instead (not awaited: it does not block)",
    "close": "await engine.aclose(...) instead; close() from another thread then ends "
             "the loop's thread",
    # The engine takes its own Lookup, not the BackgroundLookup the handle's lookup()
    # returned: a hint saying only "await engine.load(...)" failed with InvalidRequest.
    **{name: f"await engine.{name}(hit.lookup, page_ids) instead (hit.lookup: the "
             "engine's Lookup that a BackgroundLookup holds; pass a Lookup as it is)"
       for name in ("load", "load_layerwise")},
}


class BackgroundEngine:
    """A started engine on a loop thread of its own; see :func:`run_in_background`.

    Blocking methods raise what the engine's async methods raise (InvalidRequest,
    Overloaded, EngineClosed, StoreError, RequestTimeout), and BlockingCallOnLoop when
    called from the loop's own thread (code there should await the engine directly).
    After ``close`` every call raises EngineClosed. The handle belongs to the process
    that made it: in a forked child (a server forking workers after a preload) its loop
    thread does not exist, so every call raises EngineClosed at once and ``close``
    returns at once, leaving the parent's engine alone; the child opens an engine of its
    own.
    """

    def __init__(
        self,
        engine: OffloadEngine,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        if engine.state is not EngineState.NEW:
            raise InvalidRequest(
                "engine",
                f"is {engine.state.value}; run_in_background starts the engine on a loop "
                "of its own, so it needs one that was never started",
            )
        self.engine = engine
        self.loop = _servable((loop_factory or default_loop_factory)())
        self.portal = Portal(self.loop)  # every call onto the loop, in order
        self._lock = threading.Lock()  # orders submits against close
        self._closing: concurrent.futures.Future[None] | None = None
        self._stop_sent = False
        # The close() that started the close: its drain, and its deadline (monotonic).
        self._close_args: tuple[bool, float] = (False, 0.0)
        self._gate = HandOverGate(self._lock)  # the interpreter's exit (aiokv.exiting)
        self._thread = threading.Thread(target=self._run_loop, name=THREAD_NAME, daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self._after_loop()

    def _after_loop(self) -> None:
        """The loop stopped: by a close, or (``died``) by something else, such as an
        exception that is not an Exception raised by a callback on it. Then the engine is
        closed here, while the loop can still run it, and calls from now on raise
        EngineClosed; ``close`` returns once that is done. Whatever is still scheduled
        (nothing, after a clean close) is cancelled, hand-overs made in the loop's last
        iteration included, so no caller's future is left unresolved when the loop goes."""
        with self._lock:
            died, self._stop_sent = not self._stop_sent, True
            orphaned: concurrent.futures.Future[None] | None = None
            if died:
                self.portal.close()
                if self._closing is None:
                    self._closing = orphaned = concurrent.futures.Future()
        # A close whose task was cancelled (every task on the loop cancelled, as a
        # shutdown does) stopped the loop too: finished here as well, where aclose takes
        # it up from where it stopped, so that close() does not leave the store open.
        cancelled = self._closing is not None and self._closing.cancelled()
        if died or (cancelled and self.engine.state is not EngineState.CLOSED):
            if died:
                log.error("aiokv: the engine's loop stopped without a close; closing the "
                          "engine")
                finish = self.engine.aclose(drain=False)
            else:  # within what is left of the cancelled close's own bound
                drain, until = self._close_args
                finish = self.engine.aclose(drain, max(0.0, until - time.monotonic()))
            try:
                self.loop.run_until_complete(finish)
            except Exception:
                log.exception("aiokv: closing the engine after its loop stopped failed")
        while leftovers := asyncio.all_tasks(self.loop):
            for task in leftovers:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        if orphaned is not None:
            orphaned.set_result(None)

    def _start(self) -> None:
        self._thread.start()
        stop_at_exit(self)
        try:
            self.portal.start([self.engine.start])[0].result()
        except BaseException:
            self._stop_loop()
            raise

    def _stop_loop(self) -> None:
        with self._lock:
            if self._closing is None:  # a failed start: no close was scheduled
                self._closing = concurrent.futures.Future()
                self._closing.set_result(None)
        self._send_stop()
        self._thread.join()

    def stop_at_exit(self) -> None:
        """The interpreter exits (:mod:`aiokv.exiting`; the store and copy threads stop
        too): no call is handed over any more (:class:`~.exiting.HandOverGate`), and the
        loop thread runs the callbacks already due, then parks for good; nothing is
        closed, and a close under way stays where it is. Stopped rather than parked, the
        loop would leave its tasks to be destroyed pending as the interpreter finalizes;
        ``close()`` returns at once from now on."""
        self._gate.close()
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed: its thread ends by itself
                self.loop.call_soon_threadsafe(self._gate.park)

    def join_at_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._gate.wait_hands_free(timeout)
        parked = self._gate.parked
        while not parked.wait(_EXIT_POLL_S):
            if not self._thread.is_alive() or time.monotonic() >= deadline:
                break
        return parked.is_set() or not self._thread.is_alive()

    def _send_stop(self) -> None:
        # One stop only: a second one, run by the thread's final run_until_complete,
        # would stop that too.
        with self._lock:
            stop, self._stop_sent = not self._stop_sent, True
        if stop:
            self.loop.call_soon_threadsafe(self.loop.stop)

    def close(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Close the engine (``aclose(drain, timeout)``), stop the loop and join its
        thread. Idempotent; concurrent calls wait for the same close, which goes on to its
        end where its waiter is interrupted (KeyboardInterrupt). Raises
        InvalidRequest for bad arguments, as ``aclose`` does, with the engine still open.
        In a forked child it returns at once: the engine is the parent's to close."""
        drain, timeout = validate.close_args(drain, timeout)
        if forked(self.portal.pid):
            return
        if self._gate.exiting:
            return  # the engine stopped with the interpreter's exit: nothing will run it
        self._refuse_on_loop("close")
        with self._lock:
            closing = self._closing
            started = closing is None
            if closing is None:
                # After the calls handed over before it: a drain waits for them.
                aclose = functools.partial(self.engine.aclose, drain=drain, timeout=timeout)
                self._close_args = (drain, time.monotonic() + timeout)
                self._closing = closing = self.portal.start([aclose])[0]
                self.portal.close()  # a late BackgroundLookup.release() is a no-op
        if started:
            # The close stops the loop at its end, whoever waits for it: one whose waiter
            # is interrupted (Ctrl-C) still closes the store and ends the threads, and a
            # later close() waits for it again.
            closing.add_done_callback(lambda _: self._send_stop())
        try:
            closing.result()
        except concurrent.futures.CancelledError:
            # Cancelled on the loop (a shutdown there), not by this thread: the loop's
            # thread finishes the close as it ends (_after_loop).
            self._thread.join()
            if self.engine.state is not EngineState.CLOSED:
                raise
            return
        except Exception:
            self._thread.join()
            raise
        self._thread.join()

    def __enter__(self) -> BackgroundEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- the bridge --------------------------------------------------------------------

    def _refuse_in_fork(self) -> None:
        # A fork copies no thread: nothing in the child would ever run a call handed to
        # the loop, and the handle's lock may be held by a thread that is gone.
        refuse_in_fork(self.portal.pid, "background engine")

    def _refuse_on_loop(self, name: str) -> None:
        if threading.current_thread() is self._thread:
            raise BlockingCallOnLoop(
                f"{name}() blocks until the engine's loop answers, and was called on that "
                f"loop's own thread ({THREAD_NAME}), which would wait for itself forever; "
                f"on the loop, {_ON_THE_LOOP.get(name, f'await engine.{name}(...) instead')}"
            )

    def _submit(self, call: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = self._submit_all([call])[0]
        return future

    def _submit_all(self, calls: Sequence[Call]) -> list[concurrent.futures.Future[Any]]:
        """``calls`` onto the loop in one hand-over (:meth:`Portal.start`: accepted in
        this order, after every call submitted before, in one loop iteration); EngineClosed
        once the close began."""
        self._refuse_in_fork()  # before the lock, which a thread gone with the fork may hold
        # Under the lock, so that nothing is scheduled once close has been: it would run
        # after the engine closed (and fail there with EngineClosed) or not at all.
        with self._lock:
            if (never := self._gate.refused(calls)) is not None:
                return never
            if self._closing is not None:
                raise EngineClosed("the background engine is closed")
            return self.portal.start(calls)

    def _handed(self, page_ids: Any) -> tuple[Any, Any]:
        """The calling thread's ready event and its page ids as they are now
        (:func:`_taken`); neither once the interpreter exits (HandOverGate.handed)."""
        return self._gate.handed(
            lambda: (self.engine._caller_event(), _taken(page_ids)), page_ids
        )

    def _wait(self, name: str, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        self._refuse_on_loop(name)
        return self._submit(call).result()

    # ---- calls -------------------------------------------------------------------------
    #
    # Offloads and loads record their CUDA ready event here, in the calling thread, on its
    # current stream (``engine._caller_event``): the one the caller wrote its pages on.
    # On the loop's thread the engine would see that thread's stream instead.

    def submit_offload(
        self,
        user_id: Hashable,
        page_ids: torch.Tensor,
        num_tokens: int,
        *,
        token_ids: Any = None,
        namespace: Sequence[str] | None = None,
    ) -> concurrent.futures.Future[OffloadResult]:
        """``engine.offload(...)`` on the engine's loop; does not wait. On a GPU the copy
        starts after what this thread's current CUDA stream has queued by now."""
        self._refuse_in_fork()  # before the CUDA event, which a forked child cannot make
        ready, ids = self._handed(page_ids)  # here: CUDA's current stream is per thread
        tokens, names = _taken(token_ids), _named(namespace)
        return self._submit(
            lambda: self.engine.offload(
                user_id, ids, num_tokens, token_ids=tokens, namespace=names,
                _ready_event=ready,
            )
        )

    def submit_lookup(
        self,
        user_id: Hashable,
        num_tokens: int,
        *,
        token_ids: Any = None,
        namespace: Sequence[str] | None = None,
    ) -> concurrent.futures.Future[BackgroundLookup]:
        """``engine.lookup(...)`` on the engine's loop; does not wait. The Lookup comes
        wrapped so that any thread can release it."""
        tokens, names = _taken(token_ids), _named(namespace)

        async def lookup() -> BackgroundLookup:
            hit = await self.engine.lookup(
                user_id, num_tokens, token_ids=tokens, namespace=names
            )
            return BackgroundLookup(hit, self.portal)

        return self._submit(lookup)

    def submit_load(
        self, hit: BackgroundLookup | Lookup, page_ids: torch.Tensor
    ) -> concurrent.futures.Future[LoadResult]:
        """``engine.load(...)`` on the engine's loop; does not wait. When the future's
        result is set, the data is in the caches. On a GPU the copy starts after what
        this thread's current CUDA stream has queued by now."""
        self._refuse_in_fork()
        lookup = hit.lookup if isinstance(hit, BackgroundLookup) else hit
        ready, ids = self._handed(page_ids)
        return self._submit(lambda: self.engine.load(lookup, ids, _ready_event=ready))

    def submit_load_layerwise(
        self, hit: BackgroundLookup | Lookup, page_ids: torch.Tensor
    ) -> concurrent.futures.Future[BackgroundLayerwiseLoad]:
        """``engine.load_layerwise(...)`` on the engine's loop; does not wait. The future's
        result, set once the load is launched, waits for layers from any thread
        (``wait_layer`` orders the calling thread's current CUDA stream). The copy starts
        as for :meth:`submit_load`."""
        self._refuse_in_fork()
        lookup = hit.lookup if isinstance(hit, BackgroundLookup) else hit
        ready, ids = self._handed(page_ids)
        # Resolved on the loop in the callback that brings the launch notice (one hop
        # from the store thread); the task's own outcome only where it comes first: an
        # error at submit, a cancellation, a closed engine.
        handed: concurrent.futures.Future[BackgroundLayerwiseLoad] = concurrent.futures.Future()

        def hand_out(load: LayerwiseLoad, decided: Callable[[bool], None]) -> None:
            # ``decided``: the call's counts, settled before this thread can see the load
            # (a refused load's Overloaded): not at the portal task's end, a step later.
            finish_thread_future(handed, BackgroundLayerwiseLoad(load, self.loop), decided)

        async def load_layerwise() -> BackgroundLayerwiseLoad:
            load = await self.engine.load_layerwise(
                lookup, ids, _ready_event=ready, _on_handed_out=hand_out
            )
            return BackgroundLayerwiseLoad(load, self.loop)

        def last_word(done: concurrent.futures.Future[BackgroundLayerwiseLoad]) -> None:
            # The call's end settles ``handed`` unless the hand-out finished it first. A
            # caller's cancel of ``handed`` runs this in the caller's thread, as the loop
            # may be handing the load out: finish_thread_future lets one of the two in.
            finish_thread_future(handed, outcome(done))

        running = self._submit(load_layerwise)
        running.add_done_callback(last_word)
        handed.add_done_callback(lambda done: done.cancelled() and running.cancel())
        return handed

    def offload(
        self,
        user_id: Hashable,
        page_ids: torch.Tensor,
        num_tokens: int,
        *,
        token_ids: Any = None,
        namespace: Sequence[str] | None = None,
    ) -> OffloadResult:
        """``await engine.offload(...)``, blocking this thread."""
        self._refuse_on_loop("offload")
        return self.submit_offload(
            user_id, page_ids, num_tokens, token_ids=token_ids, namespace=namespace
        ).result()

    def lookup(
        self,
        user_id: Hashable,
        num_tokens: int,
        *,
        token_ids: Any = None,
        namespace: Sequence[str] | None = None,
    ) -> BackgroundLookup:
        """``await engine.lookup(...)``, blocking this thread."""
        self._refuse_on_loop("lookup")
        return self.submit_lookup(
            user_id, num_tokens, token_ids=token_ids, namespace=namespace
        ).result()

    def load(self, hit: BackgroundLookup | Lookup, page_ids: torch.Tensor) -> LoadResult:
        """``await engine.load(...)``, blocking this thread. Where the hit's pages are all
        on the host of the embedded store, this thread queues the copies itself, with no
        hop through the loop (:mod:`aiokv.direct`): the same bytes and result, but it
        takes no room in the engine's queue and has no deadline (never Overloaded, never
        RequestTimeout)."""
        self._refuse_on_loop("load")
        self._refuse_in_fork()
        # Not while calls handed to the loop before (by any thread: Portal.in_hand) wait
        # for their first step there (a release, an evict): they go first, and so does
        # this load then.
        if self._closing is None and not self.portal.in_hand():
            lookup = hit.lookup if isinstance(hit, BackgroundLookup) else hit
            # Counted for the interpreter's exit, which waits for it: this thread runs the
            # load's torch copies, and one inside them as the interpreter finalizes aborts
            # the process. Once the exit began, the hand-over answers (HandOverGate).
            try:
                _, result = self._gate.counted(lambda: direct.load(self.engine, lookup, page_ids))
            except EngineClosed:
                if not self._gate.exiting:
                    raise
                result = None  # the exit's refusal, not a close's: as a hand-over's
            if result is not None:
                return result
        return self.submit_load(hit, page_ids).result()

    def load_layerwise(
        self, hit: BackgroundLookup | Lookup, page_ids: torch.Tensor
    ) -> BackgroundLayerwiseLoad:
        """``await engine.load_layerwise(...)``, blocking this thread until launched."""
        self._refuse_on_loop("load_layerwise")
        return self.submit_load_layerwise(hit, page_ids).result()

    def submit_evict(
        self, user_id: Hashable, *, namespace: Sequence[str] | None = None
    ) -> concurrent.futures.Future[int]:
        """``engine.evict(...)`` on the engine's loop; does not wait. It runs after every
        call submitted before it; the future's result is the tokens dropped."""
        return self._submit(lambda: self.engine.evict(user_id, namespace=namespace))

    def submit_clear(self) -> concurrent.futures.Future[int]:
        """``engine.clear()`` on the engine's loop; does not wait (as :meth:`submit_evict`)."""
        return self._submit(lambda: self.engine.clear())

    def evict(self, user_id: Hashable, *, namespace: Sequence[str] | None = None) -> int:
        """``await engine.evict(...)``, blocking this thread: tokens dropped."""
        tokens: int = self._wait(
            "evict",
            lambda: self.engine.evict(user_id, namespace=namespace),
        )
        return tokens

    def clear(self) -> int:
        """``await engine.clear()``, blocking this thread: tokens dropped."""
        tokens: int = self._wait("clear", lambda: self.engine.clear())
        return tokens

    def stats(self) -> EngineStats:
        """``engine.stats()``: read on the engine's loop while it runs (its counters change
        there); once ``close`` began, after the close: the final figures, read on this
        thread (no counter changes any more)."""

        async def stats() -> EngineStats:
            return self.engine.stats()

        self._refuse_in_fork()  # the figures live in the parent
        self._refuse_on_loop("stats")
        try:
            return self._submit(stats).result()
        except EngineClosed:  # _submit's: the close began
            pass
        with self._lock:
            closing = self._closing
        assert closing is not None  # set, under the lock, before _submit refuses
        concurrent.futures.wait([closing])  # its outcome is close()'s to raise
        return self.engine.stats()


def _servable(loop: object) -> asyncio.AbstractEventLoop:
    """The loop_factory's loop, if this handle's thread can run it: a loop already
    running elsewhere (the application's own) would fail there, and its tasks be cancelled
    from the wrong thread."""
    if not isinstance(loop, asyncio.AbstractEventLoop):
        raise InvalidRequest("loop_factory", f"must make an event loop, made "
                                             f"{type(loop).__name__}")
    if loop.is_closed() or loop.is_running():
        raise InvalidRequest("loop_factory", "must make a new event loop, made one that is "
                                             f"{'closed' if loop.is_closed() else 'running'}")
    return loop


def run_in_background(
    engine: OffloadEngine,
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> BackgroundEngine:
    """Start ``engine`` on a new event loop in a thread of its own (``aiokv-loop``) and
    return a :class:`BackgroundEngine` for blocking or future-returning calls from any
    thread. ``loop_factory`` makes the loop (default: uvloop's where installed).

    Close it with ``close()`` or a ``with`` block; the thread is a daemon, so a handle
    never closed does not hold the interpreter at exit, but its engine is not drained:
    at the exit its threads stop after their current step (:mod:`aiokv.exiting`).
    Raises InvalidRequest for an engine already started or closed, and what
    ``engine.start()`` raises (the thread is stopped then).
    """
    if not isinstance(engine, OffloadEngine):
        raise InvalidRequest("engine", f"must be an aiokv.OffloadEngine, got "
                                       f"{type(engine).__name__}")
    if loop_factory is not None and not callable(loop_factory):
        raise InvalidRequest("loop_factory", f"must make an event loop (a callable), got "
                                             f"{type(loop_factory).__name__}")
    handle = BackgroundEngine(engine, loop_factory)
    handle._start()
    return handle


__all__ = ["BackgroundEngine", "BackgroundLookup", "default_loop_factory", "run_in_background"]


def _taken(page_ids: Any) -> Any:
    """The caller's page ids (or token ids) as they are at the submit. The loop
    validates (and copies) them only when it takes the call, later, while the caller may
    already be reusing a CPU buffer; ids on the GPU are read by the copy itself, ordered
    after the caller's ready event, so they stay the caller's to keep until the future
    resolves, as the pages do. Anything else goes on to the loop's validation as it is."""
    if isinstance(page_ids, np.ndarray):
        return page_ids.copy()
    if isinstance(page_ids, torch.Tensor) and page_ids.is_cpu:
        return page_ids.clone()
    return page_ids


def _named(namespace: Any) -> Any:
    """The caller's namespace as it is at the submit: a list (or another sequence the
    caller may refill with the next key's names meanwhile, a UserList, a list's
    subclass) copied into a list; a tuple, a str and whatever is no sequence go on to
    validation as they are (immutable, or refused there naming ``namespace``)."""
    if isinstance(namespace, (str, bytes, bytearray, tuple)) or not isinstance(
            namespace, Sequence):
        return namespace
    return list(namespace)
