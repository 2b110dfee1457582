"""Invalidation: ``engine.evict`` and ``engine.clear`` on their way to the store.

Order. An evict or clear is an item on the store thread's inbox, like a batch:

1. The loop first hands every request the engine accepted before the call to the store
   thread (:meth:`aiokv.loop.batcher.Batcher.dispatch_all`), so the item comes after their
   batches on the inbox, and the requests accepted after it come after it. An offload of
   the key held waiting for room (:mod:`aiokv.space`) ends then with nothing stored
   (``stored_tokens == cached_tokens == 0``): what it would store, the evict would drop.
2. On the store thread, lookup reservations held on the key (every held reservation,
   for a clear) are given back to the store: a reservation holds its blocks, which the
   store could not drop. The Lookup that held one stays usable: its load then loads
   nothing (``loaded_tokens == 0``, a miss), never the dropped KV; it reads evicted (or
   cleared), not held, by the time the caller hears the answer (Reservation.taken_back,
   written here, before the answer is posted to the loop). Given back before the
   wait below, not after: no load of them was dispatched before the item (those consumed
   their reservations), so the order changes no answer, and a load that waits for the
   room they hold (a LocalStore load staging SSD pages) is not left waiting on them.
   A store shared with other engines (``aiokv store-server``) tells which reservations
   their evicts and clears took back (:class:`~aiokv.stores.base.ChecksHeld`, asked now
   and then while any is held): given back and marked the same way
   (:func:`give_back_taken`), so that their Lookups read so with no call of their own.
3. The item waits until every task launched before it is terminal: a load of the key
   already dispatched finishes first (with the KV as it was), and an offload already
   dispatched is stored and then dropped. The store thread serves nothing else meanwhile,
   so the wait ends at ``request_timeout_ms`` from the call: a RequestTimeout, nothing
   dropped (the reservations given back stay given back: their loads miss).
4. Then the store's own ``evict(namespace)`` or ``clear()`` runs, and its answer (tokens
   dropped) or its error (a StoreError) goes back to the caller. A store that takes the
   deadline (:class:`~aiokv.stores.base.BoundsInvalidations`: a store server, a store
   process) hears it first, and drops nothing for a request that reaches it later.

The deadline. The caller hears RequestTimeout at ``request_timeout_ms`` from its call, on
the loop's own timer: the store thread may be inside another store call (a lookup's match
that a stopped store server does not answer) and get to the item only later. Whichever
thread gives up first takes the item out of the store's way (:meth:`Invalidation.expire`)
unless the store thread has already asked the store (:meth:`Invalidation.ask`), under one
lock, so the caller's error says which: not asked, nothing was dropped (and nothing of it
runs later); asked, the store may have dropped the key, though a store that took the
deadline only if the request reached it before then. Either way the engine's later calls
reach the store after the store thread is done with this one (it serves its inbox in
order), so none of them sees the key dropped after it found it, or an offload of it
dropped by this evict.

An evict whose caller is cancelled may still take effect: it cannot be taken back once
the store thread has it. A store without the capability (:class:`~aiokv.stores.base.Evicts`,
:class:`~aiokv.stores.base.Clears`) is refused at the call, with a StoreError.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import EngineClosed, RequestTimeout, StoreError
from .loop import takers
from .loop.resolution import settle
from .requests import LookupGrant, Request, Reservation
from .stats import StatsRecorder
from .stores.base import Capabilities, Store
from .worker.calls import StoreCalls

# An Invalidation's course: waiting for the store thread, then asked (the store has it) or
# expired (given up before that: the store never hears of it).
_WAITING, _ASKED, _EXPIRED = object(), object(), object()

# A held-keys map may grow to this many times the open reservations (plus a floor) before
# it is pruned to them: amortized O(1) per lookup.
_PRUNE_FACTOR, _PRUNE_FLOOR = 2, 1024


class Invalidation:
    """An evict (``namespace``) or a clear (``namespace`` None), as the store thread's
    inbox carries it. :meth:`answer` may be called from any thread, once."""

    __slots__ = ("_dropped", "_future", "_lock", "_loop", "_state", "_unsettled",
                 "give_up_at", "namespace", "timeout_ms")

    def __init__(
        self,
        namespace: tuple[str, ...] | None,
        future: asyncio.Future[int],
        loop: asyncio.AbstractEventLoop,
        give_up_at: float | None = None,
        dropped: Callable[[int], None] | None = None,
        timeout_ms: int = 0,
    ) -> None:
        self.namespace = namespace
        # time.monotonic() past which it is given up (request_timeout_ms, ``timeout_ms``,
        # from the call; None: never): the caller hears RequestTimeout then.
        self.give_up_at = give_up_at
        self.timeout_ms = timeout_ms
        self._future = future
        self._loop = loop
        # Told on the loop of the tokens the store dropped, whether or not the caller
        # still waits (a caller that left does not undo the evict), unless it was told
        # the evict failed.
        self._dropped = dropped
        self._lock = threading.Lock()  # the loop's timer and the store thread race for it
        self._state = _WAITING
        # Counted in (Invalidations.unsettled) until its reservations were given back on
        # the store thread, or it will never give any back (given up, answered).
        self._unsettled: Unsettled | None = None

    def count_in(self, unsettled: Unsettled) -> None:
        """Counted as unsettled from now until :meth:`settled` (the loop thread, before
        it is submitted)."""
        unsettled.add()
        self._unsettled = unsettled

    def settled(self) -> None:
        """Its reservations were given back (the store thread), or never will be: counted
        out, once (any thread)."""
        with self._lock:
            unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None:
            unsettled.done()

    def expire(self) -> bool:
        """Give it up (either thread), unless the store was asked already: whether it is
        given up now. Once given up, nothing more of it runs and the store never hears
        of it."""
        with self._lock:
            if self._state is _ASKED:
                return False
            self._state = _EXPIRED
        self.settled()  # nothing more of it runs
        return True

    def ask(self) -> bool:
        """The store thread is about to ask the store: False when it was given up (then
        the store is not asked)."""
        with self._lock:
            if self._state is _EXPIRED:
                return False
            self._state = _ASKED
            return True

    @property
    def expired(self) -> bool:
        return self._state is _EXPIRED

    def timed_out(self, asked: bool, why: str = "the store was not asked by then"
                  ) -> RequestTimeout:
        """The caller's RequestTimeout, saying what may have been dropped."""
        what = f"{self.verb} not done within engine.request_timeout_ms={self.timeout_ms}"
        if not asked:
            return RequestTimeout(f"{what}: {why}; nothing was dropped")
        return RequestTimeout(
            f"{what}: the store was asked and has not answered; it may have dropped "
            f"{'everything' if self.namespace is None else 'the key'} (a store server or "
            "store process: only if the request reached it before the deadline, never "
            "after); the engine's later calls see the store as this evict left it")

    @property
    def verb(self) -> str:
        return "clear" if self.namespace is None else "evict"

    def answer(self, outcome: int | BaseException) -> None:
        """Hand the outcome to the loop, which resolves the caller's future unless it is
        already done (cancelled, or failed at close)."""
        self.settled()
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self._loop.call_soon_threadsafe(self._deliver, outcome)

    def _deliver(self, outcome: int | BaseException) -> None:
        future = self._future
        # A future failed at close told its caller the evict failed: its tokens are not
        # counted (nor do the figures move after the close). One the deadline failed
        # (RequestTimeout, the store asked) said the store may drop them: it did.
        failed = future.done() and not future.cancelled() and isinstance(
            future.exception(), EngineClosed)
        if self._dropped is not None and not isinstance(outcome, BaseException) and not failed:
            self._dropped(outcome)
        settle(future, outcome)


class Unsettled:
    """How many evicts and clears were accepted whose reservations the store thread has
    not given back yet: while any is, a load its caller's thread would queue itself
    (:mod:`aiokv.direct`) goes through the loop, behind them, as one accepted after them
    must (it loads nothing of their keys)."""

    __slots__ = ("_lock", "count")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0  # read from any thread without the lock: an int read

    def add(self) -> None:
        with self._lock:
            self.count += 1

    def done(self) -> None:
        with self._lock:
            self.count -= 1


class HeldKeys:
    """The key of each lookup reservation the store thread holds (store thread only), so
    that an evict can give back the reservations of its key and no others, and mark them
    given back for the Lookups that hold them. A reservation is kept by weak reference:
    its mask is its Lookup's to keep alive, not this map's until it is pruned."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[tuple[str, ...], weakref.ref[Reservation]]] = {}

    def note(self, outcomes: Sequence[tuple[Request, object]], held: set[int]) -> None:
        """Record the reservations a lookup batch's outcomes grant; ``held``: every
        reservation still open (entries for the others are pruned now and then)."""
        keys = self._keys
        for request, outcome in outcomes:
            if isinstance(outcome, LookupGrant) and (
                    reservation := outcome.reservation) is not None:
                keys[reservation.task_id] = (request.namespace, weakref.ref(reservation))
        if len(keys) > _PRUNE_FACTOR * len(held) + _PRUNE_FLOOR:
            self._keys = {t: k for t, k in keys.items() if t in held}

    def take(self, held: set[int], namespace: tuple[str, ...] | None) -> list[int]:
        """The open reservations of ``namespace`` (None: all of them), forgotten here and
        marked taken back ("evicted", or "cleared" for None)."""
        keys = self._keys
        if namespace is None:
            taken = sorted(held)
        else:
            taken = sorted(t for t in held if (entry := keys.get(t)) and entry[0] == namespace)
        self._mark(taken, "cleared" if namespace is None else "evicted")
        if namespace is None:
            keys.clear()
        return taken

    def taken_elsewhere(self, held: set[int], taken: Mapping[int, str]) -> list[int]:
        """Of the reservations another engine's evict or clear took back (a store's
        ``check_held``: id -> "evicted" or "cleared"), those still open here, forgotten
        and marked so."""
        ids = sorted(t for t in taken if t in held)
        for task_id in ids:
            self._mark([task_id], taken[task_id])
        return ids

    def _mark(self, task_ids: Sequence[int], why: str) -> None:
        """Forget these reservations and mark them taken back, for their Lookups."""
        for task_id in task_ids:
            entry = self._keys.pop(task_id, None)
            reservation = None if entry is None else entry[1]()
            if reservation is not None:  # else its Lookup is gone: nobody reads it
                reservation.taken_back = why


def give_back(
    item: Invalidation, calls: StoreCalls, reserved: set[int], held_keys: HeldKeys
) -> None:
    """Step 2 of the module docstring, on the store thread: give back the key's
    reservations (removed from ``reserved``)."""
    held = held_keys.take(reserved, item.namespace)
    if held:
        reserved.difference_update(held)
        calls.cancel(held)


def give_back_taken(
    check: Callable[[], Mapping[int, str] | None], calls: StoreCalls, reserved: set[int],
    held_keys: HeldKeys,
) -> None:
    """On the store thread, now and then while reservations are held: those another
    engine's evict or clear took back (:class:`~aiokv.stores.base.ChecksHeld`) are given
    back (removed from ``reserved``) and marked, as step 2 of the module docstring does
    for this engine's own: their Lookups read evicted (cleared) and their loads load
    nothing."""
    taken = calls.call(check)
    if not taken:
        return
    held = held_keys.taken_elsewhere(reserved, taken)
    if held:
        reserved.difference_update(held)
        calls.cancel(held)


def invalidate(item: Invalidation, caps: Capabilities, calls: StoreCalls) -> None:
    """Step 4 of the module docstring, on the store thread once the key's reservations
    were given back and nothing launched before ``item`` is open: ask the store, answer
    the caller."""
    if not calls.owed.settle():
        item.answer(StoreError(
            f"store.cancel keeps failing: {len(calls.owed)} matched ids are still held, "
            f"and {item.verb} would leave the blocks they hold to be found; nothing was "
            "dropped"
        ))
        return
    namespace = item.namespace
    method: Callable[..., Any] | None = caps.clear if namespace is None else caps.evict
    args = () if namespace is None else (namespace,)
    outcome: int | BaseException = StoreError(f"the store cannot {item.verb}")
    if method is not None:  # else refused at the call already (Invalidations.run)
        give_up_at = item.give_up_at
        if give_up_at is not None and time.monotonic() >= give_up_at:
            item.expire()  # given up before the store was asked (the loop may have already)
        if not item.ask():  # its caller heard RequestTimeout, nothing dropped
            item.answer(item.timed_out(asked=False))
            return
        try:
            if caps.set_invalidation_deadline is not None and give_up_at is not None:
                calls.call(caps.set_invalidation_deadline, give_up_at)
            outcome = int(calls.call(method, *args))
        except StoreError as error:
            outcome = error
            if give_up_at is not None and time.monotonic() >= give_up_at:
                # Refused as late (or not answered): what the loop's timer tells, whichever
                # of the two the caller hears first.
                outcome = item.timed_out(asked=True)
                outcome.__cause__ = error
        except (TypeError, ValueError) as exc:  # an answer that is not a count
            outcome = StoreError(f"store.{item.verb} answered no token count: {exc!r}")
    item.answer(outcome)


class Invalidations:
    """The loop side: sends evicts and clears to the store thread in order and fails
    those still open when the engine closes (loop thread only)."""

    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        dispatch_all: Callable[[tuple[str, ...] | None], None],
        submit: Callable[[Invalidation], None],
        stats: StatsRecorder,
        timeout_s: float = 0.0,
    ) -> None:
        """``timeout_s``: ``request_timeout_ms`` in seconds (0: none)."""
        caps = Capabilities.of(store)
        self._can = {"evict": caps.evict is not None, "clear": caps.clear is not None}
        self._store_name = type(store).__name__
        self._loop = loop
        self._dispatch_all = dispatch_all
        self._submit = submit
        self._stats = stats  # aiokv_requests_total{kind="evict"|"clear"}, EngineStats.evicts...
        self._timeout_s = timeout_s
        self._open: set[asyncio.Future[int]] = set()
        self.unsettled = Unsettled()

    async def run(self, namespace: tuple[str, ...] | None) -> int:
        """Tokens the store dropped under ``namespace`` (None: everything). Counted once
        sent (a store that cannot, refused here, fails it too): its answer, error or the
        caller's cancellation."""
        started = time.perf_counter()
        future: asyncio.Future[int] = self._loop.create_future()
        timeout_s = self._timeout_s
        item = Invalidation(namespace, future, self._loop,
                            time.monotonic() + timeout_s if timeout_s else None,
                            self._stats.record_dropped, round(timeout_s * 1000))
        if not self._can[item.verb]:
            error = StoreError(
                f"this store ({self._store_name}) cannot {item.verb}: it has no "
                f"{item.verb}() method"
            )
            takers.count(self._stats.record_call, item.verb, error,
                         time.perf_counter() - started)
            raise error
        self._dispatch_all(namespace)  # what was accepted before goes first (docstring)
        item.count_in(self.unsettled)
        try:
            self._submit(item)  # EngineClosed once the store thread stopped accepting
        except BaseException:
            item.settled()
            raise
        self._open.add(future)
        # At the deadline, whatever the store thread is doing (module docstring).
        timer = self._loop.call_later(timeout_s, _give_up, item, future) if timeout_s else None
        outcome: object = None  # None: the caller cancelled it
        try:
            dropped = await future
        except Exception as exc:  # not CancelledError: that is the caller's, counted as None
            outcome = exc
            raise
        else:
            outcome = dropped
            return dropped
        finally:
            if timer is not None:
                timer.cancel()
            self._open.discard(future)
            # As its caller takes it: a thread may cancel it yet (aiokv.loop.takers).
            takers.count(self._stats.record_call, item.verb, outcome,
                         time.perf_counter() - started)

    def close(self) -> None:
        """Fail what the store thread never answered (it was abandoned, or crashed)."""
        for future in list(self._open):
            settle(future, EngineClosed("engine closed before this evict or clear finished"))
        self._open.clear()


def _give_up(item: Invalidation, future: asyncio.Future[int]) -> None:
    """The caller's deadline (loop thread): RequestTimeout, saying whether the store had
    been asked by then (the store thread's answer to a caller gone is dropped)."""
    settle(future, item.timed_out(asked=not item.expire()))
