"""The store thread, ``aiokv-store``: every Store call happens here.

Loop → worker: :meth:`StoreWorker.submit` puts a batch or a release on an inbox with an
explicit end (a sentinel); what was accepted before :meth:`StoreWorker.stop` is processed.
Worker → loop: each drained set of outcomes goes back in one ``call_soon_threadsafe``,
as (request, outcome) pairs with exceptions as values.

The store thread holds the GIL while it runs Python; once it has run ``store_slice_us``
it hands the GIL to a waiting event loop between store calls (:mod:`aiokv.worker.handoff`).

Per batch: its store round (:mod:`aiokv.worker.rounds`: match, plan, execute: cancels, then one
launch). Then poll ``try_wait`` on launched ids until each is terminal.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import EngineClosed, StoreError
from ..exiting import stop_at_exit
from ..invalidation import HeldKeys, Invalidation, give_back, give_back_taken, invalidate
from ..loop.batcher import Batch
from ..requests import Kind, Request
from ..store_figures import StoreFigures, StoreSideStats, StoreStatsAnswer, StoreStatsQuery
from ..stores.base import Capabilities, Store, capacity_tokens, no_yield
from .calls import StoreCalls
from .handoff import GilSlice
from .plans import outcome as outcome_of
from .recovery import EVICT_POLL_ATTEMPTS, PollFailures, retry_timeout
from .rounds import Rounds

log = logging.getLogger("aiokv")

Deliver = Callable[[list[tuple[Request, object]]], None]


class _Release:
    __slots__ = ("task_ids",)

    def __init__(self, task_ids: Sequence[int]) -> None:
        self.task_ids = list(task_ids)


_STOP = object()
_WAKE = object()  # a task may have ended: poll the store
_NOTIFIED_POLL_S = 0.01  # fallback poll of a store that notifies (set_notify)
_HELD_CHECK_S = 0.1  # while Lookups are held: a store's check_held (stores.base.ChecksHeld)


class StoreWorker:
    """Owns the store and the thread that calls it."""

    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        poll_interval_us: int,
        kv_caches: Sequence[torch.Tensor],
        registered: concurrent.futures.Future[None],
        side_stream: Any = None,
        store_slice_us: int = 0,
        clock_offset_s: float = 0.0,
    ) -> None:
        self._store = store
        self._kv_caches = kv_caches
        self._registered = registered  # resolved once store.register() returned
        self._loop = loop
        self._deliver = deliver
        self._page_size = 0  # the store's, read once it is registered
        self._poll_interval_s = poll_interval_us / 1e6
        self._slice = GilSlice(store_slice_us)  # when to hand the GIL to the loop
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._accepting = True
        self._accept_lock = threading.Lock()
        self._launched: dict[int, Request] = {}  # launched ids -> request, until terminal
        self._reserved: set[int] = set()  # lookup matches held for a load
        self._held_keys = HeldKeys()  # their keys, for an evict
        self._outbox: list[tuple[Request, object]] = []
        self._in_hand: Batch | None = None  # the batch being matched or launched
        # Its optional features (stores/base.py); the engine reads detach from here too.
        self.caps = Capabilities.of(store)
        self._calls = StoreCalls(store, self._slice.yield_if_used)
        self._polls = PollFailures()  # try_wait failures in a row, and the next poll's due
        # Set by stop(): when launched tasks stop being waited through a try_wait outage.
        self._give_up_at: float | None = None
        self._exiting = False  # the interpreter exits (aiokv.exiting): stop where it is
        self._rounds = Rounds(  # each batch's store round (aiokv.worker.rounds)
            store, self.caps, self._calls, self._slice, side_stream,
            self._launched, self._reserved, self._held_keys, self.release_one,
            self._renew_capacity,
            clock_offset_s,  # time.monotonic() - loop.time(): deadlines on this thread's clock
        )
        self.stats = StoreSideStats()  # store latency; written here, read by scrapes
        self.figures = StoreFigures(self.caps.store_stats)  # written here, read anywhere
        self._capacity_from: StoreStatsAnswer | None = None  # the figures the bound is from
        self._thread = threading.Thread(target=self._run, name="aiokv-store", daemon=True)

    # ---- loop side -------------------------------------------------------------------

    @property
    def tasks_open(self) -> int:
        """Ids matched or launched and not yet terminal (read racily from the loop)."""
        return len(self._launched) + len(self._reserved) + len(self._calls.owed)

    def _note_capacity(self) -> None:
        """The bound from the latest figures (store thread). Asked again with each answer:
        a host tier whose pinning stopped short after registration (a memlock limit)
        holds only the pinned blocks: a refusal that named all of them named a size that
        the store then refused too."""
        figures = self._capacity_from = self.figures.latest
        self._rounds.capacity_tokens = capacity_tokens(
            None if self.caps.store_stats is None else lambda: figures, self._page_size)

    def _renew_capacity(self) -> None:
        """The store's figures asked now, and the bound taken from them (store thread,
        before the bound refuses an offload or cuts a lookup): a store server restarted
        since the last answer may hold more. A store that cannot answer now leaves the
        bound as it was."""
        try:
            self.figures.ask()
        except Exception:  # the bound known stands (the figures kept)
            log.debug("aiokv: store_stats() for the store's bound failed", exc_info=True)
        self._note_capacity()

    def start(self) -> None:
        self._thread.start()
        stop_at_exit(self)

    def submit(self, item: Batch | _Release | StoreStatsQuery | Invalidation) -> None:
        with self._accept_lock:
            if not self._accepting:
                raise EngineClosed("the store thread has stopped accepting work")
            self._inbox.put(item)

    def release_one(self, task_id: int) -> None:
        """A Reservation's way back to the store (loop thread): see :meth:`release`."""
        self.release((task_id,))

    def release(self, task_ids: Sequence[int]) -> None:
        """Cancel lookup reservations. After stop, the worker cancels them itself."""
        with self._accept_lock:
            if self._accepting:
                self._inbox.put(_Release(task_ids))

    def forget_in_fork(self) -> None:
        """In a forked child of this process: this thread does not exist there, so take
        nothing more (a lookup's release is dropped, a submit raises EngineClosed). The
        lock is a new one: the store thread may have held the parent's at the fork."""
        self._accept_lock = threading.Lock()
        self._accepting = False

    def stop(self, give_up_s: float) -> None:
        """End the inbox: work already accepted is processed, open reservations are
        cancelled, launched tasks are waited for, then the store is closed. A ``try_wait``
        that still fails ``give_up_s`` seconds from now (the close's deadline) fails the
        launched requests still waited for: the store closes next."""
        with self._accept_lock:
            if self._accepting:
                self._accepting = False
                self._give_up_at = time.perf_counter() + give_up_s
                self._inbox.put(_STOP)

    def closing(self) -> None:
        """The engine's close began (loop thread): the store hears it now
        (stores.base.HearsOfClose), not once this thread gets to it, which may be inside
        a call whose failure would otherwise start a new child process."""
        if self.caps.closing is not None:
            try:
                self.caps.closing()
            except Exception:  # the close goes on: it is a hint to the store
                log.exception("store.closing() failed")

    def terminate(self) -> bool:
        """The close timed out with this thread still busy (loop thread): have the store
        end what this thread waits on (stores.base.Terminates). Whether it can."""
        if self.caps.terminate is None:
            return False
        try:
            self.caps.terminate()
        except Exception:
            log.exception("store.terminate() failed")
            return False
        return True

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop_at_exit(self) -> None:
        """The interpreter exits (:mod:`aiokv.exiting`): this thread ends after the store
        call it is in, handles nothing more from its inbox and leaves the store as it is,
        unclosed (a close would wait for every copy queued: the engine's close drains,
        the exit does not). The requests not answered by then stay unresolved."""
        self._exiting = True
        self._inbox.put(_WAKE)

    def join_at_exit(self, timeout: float) -> bool:
        return self.join(timeout)

    # ---- store thread ----------------------------------------------------------------

    def _run(self) -> None:
        # The store is registered here, not on the loop: it may take seconds (FlexKV
        # starts its transfer engine) and every store call belongs to this thread.
        # A store that can say when a task may have ended (LocalStore's copy thread)
        # wakes this thread through the inbox; others are polled every poll_interval_us.
        set_notify = self.caps.set_notify
        notified = set_notify is not None
        # A store with points of its own where the GIL may go to the loop (set_yield).
        # Passed even with no slice (it replaces an earlier engine's on a shared store),
        # and taken back when this thread ends (finally, below).
        set_yield = self.caps.set_yield
        try:
            self._store.register(self._kv_caches)
            if set_notify is not None:
                set_notify(lambda: self._inbox.put(_WAKE))
            if set_yield is not None:
                set_yield(self._slice.yield_if_used)
        except BaseException as exc:  # any of them: the engine's start fails with it
            # A start() that was cancelled cancelled this future: nobody is told then.
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self._registered.set_exception(exc)
            self._close_store()
            return
        self._page_size = self._rounds.page_size = self._store.page_size
        # Asked once now: engine.stats() shows the tiers from the start, not once the
        # store has first worked; the capacity comes from that answer.
        self.figures.changed()
        self.figures.refresh(now=True)
        self._note_capacity()
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # as above
            self._registered.set_result(None)
        self._slice.restart()  # registering is not this thread's work
        stopping = False
        check_held = self.caps.check_held
        held_check_at = 0.0
        try:
            while not stopping or self._launched:
                timeout = None
                if self._launched:
                    # A notifying store is still polled now and then: a wake-up that came
                    # before the answer was ready (a wrapper holding it back, say) must
                    # cost latency, not a hang.
                    timeout = _NOTIFIED_POLL_S if notified else self._poll_interval_s
                if stopping:
                    # After the sentinel only wake-ups arrive; poll as a fallback.
                    timeout = self._poll_interval_s
                timeout = retry_timeout(timeout, self._calls.owed, self._polls, self._launched)
                timeout = self.figures.timeout(timeout)  # wake to read figures work moved
                if self._reserved and check_held is not None:
                    timeout = _HELD_CHECK_S if timeout is None else min(timeout, _HELD_CHECK_S)
                item: object = None
                before = time.perf_counter()
                with contextlib.suppress(queue.Empty):
                    item = self._inbox.get(timeout=timeout)
                after = time.perf_counter()
                self._slice.waited(after - before, after)
                worked = item is not None
                woke = False
                while item is not None and not self._exiting:
                    if item is _STOP:
                        stopping = True
                        # No load can consume them now: their room goes back before the
                        # launched tasks are waited for, one of which may be a load
                        # waiting for that room in the store (base.ParksLoads).
                        if self._reserved:
                            self._calls.cancel(sorted(self._reserved))
                            self._reserved.clear()
                    elif item is _WAKE:
                        woke = True
                    else:
                        self._handle(item)
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        item = None
                if self._exiting:
                    return  # the store is left unclosed (finally, below)
                if self._launched and self._polls.due():
                    # Out first: the store may hand the GIL over inside try_wait.
                    self._post()
                    self._poll()
                    worked = True
                elif woke and not self._launched:
                    self._settle()
                self._calls.owed.retry()
                if self._reserved and check_held is not None and after >= held_check_at:
                    held_check_at = after + _HELD_CHECK_S
                    with contextlib.suppress(StoreError):  # a store gone: its calls say so
                        give_back_taken(check_held, self._calls, self._reserved, self._held_keys)
                self._post()
                if worked:
                    self.figures.changed()
                self.figures.refresh()
                if self.figures.latest is not self._capacity_from:
                    self._note_capacity()
            self._calls.owed.retry(final=True)  # the store closes next
            self.figures.refresh(now=True)  # what a store gone after its close (a child) did
        except BaseException:  # a bug here must not strand futures: fail what we hold
            log.exception("aiokv store thread crashed")
            self._fail_everything(StoreError("the store thread crashed; see the aiokv log"))
            raise
        finally:
            if not self._exiting:
                self._close_store()
            if set_yield is not None:  # the store outlives this thread: take ours back
                set_yield(no_yield)
        self.figures.after_close()  # final: what the close finished counts too

    def _fail_everything(self, error: StoreError) -> None:
        """After a crash: stop accepting (later batches fail at dispatch, with
        EngineClosed), and fail the batch in hand, what was launched, and every batch
        still in the inbox."""
        with self._accept_lock:
            self._accepting = False
        # The batch in hand too: it may have launched some before the crash.
        in_hand = self._in_hand.requests if self._in_hand is not None else []
        self._detach([*in_hand, *self._launched.values()])
        if self._in_hand is not None:
            held = self._in_hand
            self._in_hand = None
            with contextlib.suppress(Exception):  # it cancels in the store, which may fail
                self._fail_unanswered(held, error)
        self._outbox.extend((r, error) for r in self._launched.values())
        self._launched.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Batch):
                self._outbox.extend((r, error) for r in item.requests)
            elif isinstance(item, Invalidation):
                item.answer(error)
        self._post()

    def _close_store(self) -> None:
        try:
            self._store.close()
        except Exception:
            log.exception("store.close() failed")

    def _handle(self, item: object) -> None:
        if isinstance(item, _Release):
            held = [t for t in item.task_ids if t in self._reserved]
            self._reserved.difference_update(held)
            if held:
                self._calls.cancel(held)
        elif isinstance(item, StoreStatsQuery):  # a scrape (aiokv.metrics)
            item.run(self.figures.ask)
        elif isinstance(item, Batch):
            self._in_hand = item  # for _fail_everything, should this thread crash
            try:
                if self._slice.used():
                    self._post()  # the batches before this one are answered
                    self._slice.hand_over()
                posted = len(self._outbox)
                if item.kind is Kind.LOOKUP:
                    self._rounds.lookup(item, self._outbox)
                else:
                    self._rounds.move(item, self._outbox)
                self._observe_unanswered(item, posted)
            except Exception as exc:  # e.g. a CUDA error in a page view's index
                error = StoreError(f"batch failed before launch: {exc!r}")
                error.__cause__ = exc
                self._fail_unanswered(item, error)
            self._in_hand = None
        elif isinstance(item, Invalidation):
            self._invalidate(item)
        else:
            raise TypeError(f"unexpected inbox item {item!r}")

    def _observe_unanswered(self, batch: Batch, posted: int) -> None:
        """The store time of the batch's tries that get no outcome: callers that left
        (or whose deadline passed) before the store answered, their tries cancelled or
        never asked. They are the slow ones: the store-time histogram counts each try."""
        answered = {id(request) for request, _ in self._outbox[posted:]}
        launched = self._launched  # read here, not the stage, which the loop may change
        left = [request for request in batch.requests if id(request) not in answered
                and (request.task_id is None or launched.get(request.task_id) is not request)]
        if left:
            self.stats.observe(left)

    def _settle(self) -> None:
        """A wake-up with no task in flight: the store's background work ended (a remote
        write, an SSD write). An empty ``try_wait`` lets it settle that on this thread (give
        the blocks back, so they count as free and can be evicted); the figures follow."""
        try:
            self._calls.call(self._store.try_wait, [])
        except StoreError:
            log.warning("store.try_wait([]) failed after a wake-up", exc_info=True)

    def _detach(self, requests: Iterable[Request]) -> None:
        """Offloads about to fail while their copies may run on (the store's close waits
        for them), reading pages their callers reuse once told: detached first, as at a
        timeout, so that the store keeps none of them (a shared server would)."""
        detach = self.caps.detach
        if detach is None:
            return
        for request in requests:
            if request.kind is Kind.OFFLOAD and request.task_id is not None:
                with contextlib.suppress(Exception):  # only a flag; a miss keeps the bytes
                    detach(request.task_id)

    def _poll(self) -> StoreError | None:
        """Ask the store about the launched ids and take its answers; the error, if
        ``try_wait`` failed."""
        try:
            results = self._calls.call(self._store.try_wait, list(self._launched))
        except StoreError as error:
            # Their copies still run: the requests stay pending (their deadlines apply)
            # and their ids are asked about again, after a backoff (recovery.py).
            if self._polls.failed():
                log.warning(
                    "store.try_wait failed; %d launched tasks stay pending, asked again with "
                    "backoff until it answers", len(self._launched), exc_info=True,
                )
            give_up_at = self._give_up_at
            if give_up_at is not None and time.perf_counter() >= give_up_at:
                # The engine closes and its deadline has passed: the store closes next.
                log.error(
                    "store.try_wait still fails as the engine closes; failing %d launched "
                    "tasks", len(self._launched),
                )
                self._detach(self._launched.values())
                self._outbox.extend((r, error) for r in self._launched.values())
                self._launched.clear()
            return error
        outage = self._polls.answered()
        if outage is not None:
            log.warning("store.try_wait answers again, after %d failures over %.3fs", *outage)
        launched, page_size = self._launched, self._page_size
        for task_id, result in results.items():
            if self._slice.used():
                self._post()  # answers are independent: these callers go on now
                self._slice.hand_over()
            request = launched.get(task_id)
            if request is None:
                log.warning("store answered unknown task id %s", task_id)
                continue
            outcome = outcome_of(request, result, page_size)  # should it raise, it is still held
            del launched[task_id]
            self._outbox.append((request, outcome))
        return None

    def _invalidate(self, item: Invalidation) -> None:
        """An evict or clear, in inbox order: its reservations given back, then once what
        was launched before it is terminal (and answered),
        :func:`aiokv.invalidation.invalidate`. A ``try_wait`` that keeps failing fails the
        evict instead (nothing dropped), and the launched tasks are waited for as usual."""
        if item.expired:  # its caller heard RequestTimeout while it sat in the inbox
            return
        try:
            try:
                give_back(item, self._calls, self._reserved, self._held_keys)
            finally:
                item.settled()  # loads of its keys accepted after it find them given back
            failure: StoreError | None = None
            while self._launched:
                if self._exiting:  # its copies will not end: the evict stays unanswered
                    return
                if item.expired:  # given up on the loop: nothing dropped, as said there
                    self._post()
                    return
                self._post()
                if self._polls.due():  # a failing try_wait is retried after its backoff,
                    failure = self._poll()  # as outside an evict, not failed by a fast loop
                if self._launched and self._only_parked():
                    break
                if self._launched and self._polls.failures >= EVICT_POLL_ATTEMPTS:
                    self._post()
                    error = StoreError(
                        f"store.try_wait keeps failing ({self._polls.failures} times in a "
                        f"row): {len(self._launched)} tasks launched before this "
                        f"{item.verb} may still write; nothing was dropped"
                    )
                    error.__cause__ = failure
                    item.answer(error)
                    return
                if self._launched and item.give_up_at is not None and (
                        time.monotonic() >= item.give_up_at) and item.expire():
                    self._post()
                    item.answer(item.timed_out(
                        asked=False, why=f"{len(self._launched)} tasks launched before it "
                        "still run"))
                    return
                if self._launched:
                    time.sleep(max(self._poll_interval_s, self._polls.wait_s()))
            self._post()
        except BaseException:  # a crash of this thread (_run): its caller is told too
            item.answer(StoreError("the store thread crashed; see the aiokv log"))
            raise
        invalidate(item, self.caps, self._calls)

    def _only_parked(self) -> bool:
        """Whether every task still launched is a load waiting for room in the store
        (base.ParksLoads): the evict goes ahead of them rather than wait for room that
        lookups queued behind it may hold (its drop ends those of its key)."""
        parked = self.caps.parked
        if parked is None:
            return False
        try:
            passed = self._calls.call(parked, sorted(self._launched))
        except StoreError:
            return False  # waited for as usual
        return set(self._launched) <= set(passed)

    def _fail_unanswered(self, batch: Batch, error: StoreError) -> None:
        """Fail the batch's requests that have no outcome yet. A load among them still
        holds its lookup's reservation: it is consumed with the load, launched or not,
        so it is given back here rather than at the caller's release."""
        answered = {id(r) for r, _ in self._outbox}
        held: list[int] = []
        for request in batch.requests:
            task_id = request.task_id
            if id(request) not in answered and task_id not in self._launched:
                self._outbox.append((request, error))
                if task_id is not None and task_id in self._reserved:
                    held.append(task_id)
        if held:
            self._reserved.difference_update(held)
            self._calls.cancel(held)

    def _post(self) -> None:
        if not self._outbox:
            return
        drained, self._outbox = self._outbox, []
        self.stats.posted(drained)
        try:
            self._loop.call_soon_threadsafe(self._deliver, drained)
        except RuntimeError:
            # The loop is closed: nobody is left to resolve these futures.
            log.warning("event loop closed; dropped %d outcomes", len(drained))
