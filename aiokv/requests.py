"""Request and result types.

Public: :class:`OffloadResult`, :class:`Lookup`, :class:`LoadResult`. Internal:
:class:`Request`, one per awaited call, which carries a call from submit to the
store's terminal answer, and its :class:`Stage`.

Threads and stages. The loop writes a request until the batcher dispatches it; the
batcher writes ``stage = DISPATCHED`` before the batch goes on the store thread's inbox,
so that thread, which takes it off the inbox, sees every earlier write (the queue's
put/get orders them). The store thread then writes the launch fields and ``stage =
LAUNCHED``; it posts every outcome back with ``call_soon_threadsafe``, which orders its
writes before the loop's resolution of it. The loop writes ``stage = TERMINAL`` once the
future is done (resolution.py): the store thread reads it, unordered, as "the caller
left" and skips the request; a caller that leaves just after the read costs a match or a
copy, never a wrong answer (its outcome finds the future done). The one write the two
threads may race on: a caller that leaves while its batch launches can have its TERMINAL
overwritten by LAUNCHED; the launched request's outcome, resolved on the loop after that
write, makes it TERMINAL again (:meth:`aiokv.loop.resolution.Resolver.resolve`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from . import validate
from .errors import InvalidRequest
from .loop.binding import check_loop
from .stores.base import BoolArray, Int64Array

if TYPE_CHECKING:
    from .layerwise import LayerwiseLoad

log = logging.getLogger("aiokv")


@dataclass(frozen=True, slots=True)
class OffloadResult:
    """``stored_tokens``: tokens newly written by this call; ``cached_tokens``: the
    page-aligned prefix of this key that is now in the store."""

    user_id: Hashable
    stored_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class LoadResult:
    """``loaded_tokens``: tokens copied into the caller's pages (the Lookup's prefix)."""

    user_id: Hashable
    loaded_tokens: int


class Kind(enum.IntEnum):
    """Request kinds, in dispatch order: GET batches go before PUT batches."""

    LOOKUP = 0
    LOAD = 1
    OFFLOAD = 2


_LOAD = Kind.LOAD  # a module global: read per call


class Stage(enum.IntEnum):
    """Where a request is: made (and accepted, or waiting for room), handed to the store
    thread, launched in the store, or done (its future resolved or cancelled). Each
    transition is written in one place: the batcher, the worker's launch, resolution."""

    QUEUED = 0
    DISPATCHED = 1
    LAUNCHED = 2
    TERMINAL = 3


# Read per request on hot paths: module globals, not a class attribute lookup each.
QUEUED, DISPATCHED, LAUNCHED, TERMINAL = Stage  # in value order


@dataclass(eq=False, slots=True)
class Request:
    """One awaited call. Written by the loop until dispatch, by the store thread after,
    except ``stage = TERMINAL``, which the loop writes (the module docstring)."""

    kind: Kind
    user_id: Hashable
    future: asyncio.Future[Any]
    num_tokens: int
    token_ids: Int64Array | None  # None: positions, made on the store thread (calls.key_ids)
    namespace: tuple[str, ...]
    page_ids: torch.Tensor | None
    pages_used: int  # leading entries of page_ids this request moves (known from shapes)
    ready_event: Any = None  # torch.cuda.Event on the caller's stream (ReadyMarks), or None
    reservation: Reservation | None = None  # the lookup's, which a LOAD consumes
    stage: Stage = QUEUED
    task_id: int | None = None
    mask: BoolArray | None = None
    moved: int = 0  # True positions of the mask: tokens this request moves
    submitted_at: float = 0.0
    dispatched_at: float = 0.0  # perf_counter; 0.0 while queued (again once held: stats.py)
    resolved_at: float = 0.0  # perf_counter as its future was done: its latency's end
    held: bool = False  # an offload held for room and queued again (its window is observed)
    # Loop time by which it must resolve (request_timeout_ms from the call, a wait for
    # room included), set as it is accepted; None without a timeout. An answer that
    # comes later fails it as its timer would have (resolution.py: a RequestTimeout).
    deadline: float | None = None
    # A load_layerwise's: told of the launch, with the store's layer marks, by the store
    # thread (aiokv.layerwise.note_launches); None for every other request.
    layers: LayerwiseLoad | None = None
    # Its own deadline timer (Deadlines.add, out of FIFO order), cancelled as it resolves.
    timer: asyncio.TimerHandle | None = None
    # An offload's second try, until accepted: the first, which the store refused and
    # which is one call with it in the counts (engine.offload's _again).
    first_try: Request | None = None
    # An offload that may be made again after the store refuses it (engine.offload's
    # _again): a refusal keeps its room for that second try (admission.Admission.leave).
    keeps_room: bool = False


def new_request(
    kind: Kind,
    user_id: Hashable,
    future: asyncio.Future[Any],
    num_tokens: int,
    token_ids: Any,
    namespace: Sequence[str] | None,
    pages: torch.Tensor | None,
    pages_used: int,
) -> Request:
    """A call's Request, its arguments checked (InvalidRequest naming the bad one); a
    LOAD's key is its Lookup's, so it takes no token ids or namespace."""
    try:
        hash(user_id)
    except TypeError as exc:
        raise InvalidRequest("user_id", f"must be hashable, got {type(user_id).__name__}") from exc
    names: tuple[str, ...] = ()
    tokens = None
    if kind is not _LOAD:
        tokens = validate.token_ids(token_ids, num_tokens)
        names = validate.namespace(namespace, user_id)
    # positional: keywords cost more, on every call
    return Request(kind, user_id, future, num_tokens, tokens, names, pages, pages_used)


class Reservation:
    """A lookup's match, held in the store for a load: its task id and mask. Made on the
    store side when the lookup hits, held by the :class:`Lookup`, and handed to the load
    that consumes it (the store thread then launches or cancels it). Until then,
    :meth:`release` gives it back to the store; only the first call does (loop thread).

    An evict or clear gives it back on the store thread instead (aiokv.invalidation),
    which writes ``taken_back`` ("evicted" or "cleared") before it answers the caller:
    the Lookup reads it, so that it no longer says held once the evict has returned (an
    evict of another engine sharing the store: once the store tells of it, ChecksHeld)."""

    __slots__ = ("__weakref__", "_give_back", "end", "mask", "taken_back", "task_id")

    def __init__(
        self, task_id: int, mask: BoolArray, give_back: Callable[[int], None], end: int
    ) -> None:
        self.task_id = task_id
        self.mask = mask
        self.end = end  # one past the mask's last True position, found on the store thread
        self._give_back: Callable[[int], None] | None = give_back
        self.taken_back: str | None = None  # written once, by the store thread

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back(self.task_id)

    def detach(self) -> bool:
        """Forget the way back, for a caller that gives many back in one call (the
        worker's ``release``, aiokv.direct); whether it was still there."""
        give_back, self._give_back = self._give_back, None
        return give_back is not None


@dataclass(frozen=True, slots=True)
class LookupGrant:
    """What the store thread answers for a lookup; the loop turns it into a Lookup."""

    reservation: Reservation | None
    cached_tokens: int


# A Lookup's states in which a load may consume it (Lookup._consume).
_LOADABLE = frozenset(("held", "evicted", "cleared"))


class Lookup:
    """A lookup's answer: ``cached_tokens`` of the key are in the store and reserved
    for a ``load``. Release it (``release()`` or ``async with``) if you will not load;
    an unused reservation is released after ``lookup_ttl_ms`` anyway. A Lookup that
    found tokens is consumed by one ``load``; using it twice raises InvalidRequest. A
    miss (``cached_tokens == 0``) reserves nothing: each load of it, before or after a
    release, answers at once with 0 tokens (counted in ``empty_loads``).

    Its state: empty (a miss), held, loading, loaded, released, expired, or evicted /
    cleared (an ``evict`` of its key or a ``clear`` gave the reservation back: its load
    loads 0 tokens, and ``release()`` has nothing left to give back)."""

    def __init__(
        self,
        user_id: Hashable,
        grant: LookupGrant,
        owner: object,
        call_later: Callable[[float, Callable[[], None]], asyncio.TimerHandle] | None = None,
        ttl_s: float = 0.0,
    ) -> None:
        self.user_id = user_id
        self.cached_tokens = grant.cached_tokens
        self._reservation = grant.reservation
        self._owner = owner  # what answered it: a load through another engine is refused
        self._state = "held" if grant.reservation is not None else "empty"
        # The reservation's TTL: armed here (the loop's call_later), cancelled as it is
        # released or consumed.
        self._ttl_handle: asyncio.TimerHandle | None = None
        self._call_later, self._ttl_s = call_later, ttl_s
        # The engine's loop (whose call_later this is): release() belongs to it.
        self._loop: asyncio.AbstractEventLoop | None = getattr(call_later, "__self__", None)
        self._pid = os.getpid()  # the process whose store holds the reservation
        # Every change of _state: the loop thread's, and a load its caller's thread runs
        # itself (_take: aiokv.direct), which may consume it while the loop releases it.
        self._lock = threading.Lock()
        if self._state == "held" and call_later is not None:
            self._ttl_handle = call_later(ttl_s, self._expire)

    def __repr__(self) -> str:
        return (
            f"Lookup(user_id={self.user_id!r}, cached_tokens={self.cached_tokens}, "
            f"state={self._now()})"
        )

    @property
    def held(self) -> bool:
        """True while the reservation is held (not yet loaded, released, expired, or given
        back by an evict or clear of the key)."""
        return self._now() == "held"

    def _now(self) -> str:
        """The state, with a reservation an evict or clear gave back on the store thread
        read as such. Writes nothing: BackgroundLookup reads it from other threads."""
        state = self._state
        if state == "held" and self._reservation is not None:
            return self._reservation.taken_back or state
        return state

    def _note_taken_back(self) -> str:
        """:meth:`_now`, kept (loop thread): a reservation given back by an evict or clear
        has no TTL left to run out."""
        with self._lock:
            state = self._now()
            changed = state != self._state
            if changed:
                self._state = state
        if changed:
            self._cancel_ttl()
        return state

    def release(self) -> None:
        """Give the reservation back. Idempotent; a no-op once loaded, and in a forked
        child (the reservation is the parent's, as BackgroundLookup's is). On the engine's
        loop only (WrongLoop elsewhere; from threads, run_in_background's BackgroundLookup)."""
        if os.getpid() != self._pid:
            return  # no loop of the engine's runs here, and the parent's hit stays its own
        # _now, not _note_taken_back: this may be the wrong thread, where the TTL timer is
        # not ours to cancel (one given back by an evict finds nothing to do at its TTL).
        if self._now() == "held":
            if self._loop is not None and not self._loop.is_closed():
                check_loop(self._loop)  # its TTL timer is the loop's to cancel
            self._end_hold("released")

    def _end_hold(self, state: str) -> None:
        """Held no more (loop thread): ``state``, the reservation given back; nothing
        where a load consumed it first."""
        with self._lock:
            if self._now() != "held":
                return
            self._state = state
        self._cancel_ttl()
        if self._reservation is not None:
            self._reservation.release()

    def _pages_needed(self, page_size: int) -> int:
        """Pages a load must be given: up to the page of the last position to load. O(1)
        on the loop: the store thread found that position (plans.plan_lookup)."""
        if self._reservation is None:
            return 0
        return -(-self._reservation.end // page_size)

    def _consume(self) -> Reservation:
        """Hand the reservation to a load (loop thread only). One an evict or clear gave
        back goes too: the store thread finds it gone, and the load loads 0 tokens."""
        reservation = self._take()
        self._cancel_ttl()
        return reservation

    def _take(self) -> Reservation:
        """:meth:`_consume` from any thread (a load its caller's thread queues itself:
        aiokv.direct), which leaves the TTL timer to the loop: once it runs it finds the
        Lookup consumed and does nothing."""
        with self._lock:
            state = self._now()
            if state not in _LOADABLE or self._reservation is None:
                raise InvalidRequest(
                    "hit", f"reservation is {state}; a Lookup can be loaded once, "
                    "before it is released or expires"
                )
            self._state = "loading"
            return self._reservation

    def _hand_back(self) -> None:
        """The load that consumed it was never accepted (Overloaded): held again, its
        TTL from now (loop thread)."""
        if self._state == "loading":
            self._state = "held"
            if self._call_later is not None:
                self._ttl_handle = self._call_later(self._ttl_s, self._expire)

    def _settle(self, loaded: bool) -> None:
        """The load that consumed it ended (the loop thread, or the caller's thread of a
        load it queued itself): loaded, or failed or cancelled, in which case the
        reservation went back."""
        with self._lock:
            if self._state == "loading":
                self._state = "loaded" if loaded else "released"

    def _cancel_ttl(self) -> None:
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
            self._ttl_handle = None

    def _expire(self) -> None:
        if self._note_taken_back() == "held":
            self._end_hold("expired")

    async def __aenter__(self) -> Lookup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
