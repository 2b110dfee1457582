"""The engine-facing core of the recsys-examples storage (:mod:`aiokv.integrations.recsys`):
aiokv on a loop thread of its own (``run_in_background``), driven from the manager's
thread with plain ids, lengths and page-id tensors. It imports nothing of recsys.

One hop per manager call: the users of a call go to the engine's loop in one hand-over
(:class:`aiokv.portal.Portal`) whose calls the engine accepts in one loop iteration, so
they form one batch (one store round), not one hop and one window each. So the engine's
batch window only delays them: the core runs it at 0 (the next loop iteration) unless the
config sets ``engine.window_us``. The engine accepts the manager's calls in the order it
made them: an ``evict_all`` (``clear``) made after an offload launch drops what that
offload stores. On a GPU, a call's copies wait for one CUDA event
recorded here, in the manager's thread, on its current stream (the stream, or CUDA
graph, that wrote the pages), after the page ids were copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from typing import Any

import torch
import yaml

from .. import direct
from ..engine import OffloadEngine
from ..errors import EngineClosed, InvalidRequest
from ..handles import BackgroundLookup
from ..open import ConfigSource, read_config
from ..requests import LoadResult, OffloadResult
from ..stores import make_store
from ..sync import BackgroundEngine, run_in_background
from .pending import PendingCalls
from .recsys_math import offload_lengths

log = logging.getLogger("aiokv")

Call = Callable[[OffloadEngine], Coroutine[Any, Any, Any]]


class RecsysCore:
    """aiokv for one recsys-examples manager: lookups, loads, offloads and evictions of a
    batch of users, each batch one hop onto the engine's loop. Call it from one thread
    (the manager's); :meth:`close` when done. The calls that wait (:meth:`lookup`,
    :meth:`evict`, :meth:`clear`, :meth:`close` and :class:`PendingCalls`' outcomes)
    raise BlockingCallOnLoop on the engine's loop thread, as the handle's do."""

    def __init__(self, kv: BackgroundEngine) -> None:
        self.kv = kv
        self.page_size = kv.engine.page_size
        self._drops = _Drops()  # the evicts and clears made through this core

    @property
    def max_offload_tokens(self) -> int | None:
        """The most tokens one offload can store now (None where the store does not say):
        the host tier's blocks x page_size, from the store's latest figures (no store
        call; see :func:`_host_bound`)."""
        return _host_bound(self.kv.engine)

    @classmethod
    def open(
        cls,
        config: ConfigSource,
        kv_caches: Sequence[torch.Tensor],
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        wait_pinned: bool = True,
    ) -> RecsysCore:
        """An engine over ``kv_caches`` (``aiokv.open_engine(config, ...)``, with
        ``window_us`` 0 where ``config`` leaves it unset), started on a loop thread of its
        own. Raises what ``open_engine`` and ``start`` raise.

        ``wait_pinned``: return once the host tier is pinned whole (where the store pins
        in this process: the embedded and shared stores), as FlexKVStorage's host tier is
        made before its constructor returns; otherwise the engine serves from its first
        pinned chunk at once, and a first batch larger than it waits for the next chunks
        (about 0.1 s/GiB), which the manager would see as that batch's latency.

        ``request_timeout_ms`` is 0 here whatever the config says (a value it sets is
        logged as not used): the manager reuses a call's pages once its wait answers, so a
        wait answers only once the call's copies have ended, and a deadline would answer
        it while a copy launched before it still reads or writes them (an offload's late
        copy would store the pages' next user under this one). A load still ends at its
        store's own deadline for staging SSD pages (30 s after its launch), copies done."""
        engine_config, store_config = read_config(config)
        if not sets_window(config):
            engine_config = dataclasses.replace(engine_config, window_us=0)
        if engine_config.request_timeout_ms:
            if sets_engine_key(config, "request_timeout_ms"):
                log.warning(
                    "aiokv: recsys storage: engine.request_timeout_ms=%d is not used (0): a "
                    "wait answers once its copies have ended, so that the manager reuses "
                    "no page a copy still touches", engine_config.request_timeout_ms)
            engine_config = dataclasses.replace(engine_config, request_timeout_ms=0)
        store = make_store(store_config)
        engine = OffloadEngine(store, kv_caches=kv_caches, config=engine_config)
        core = cls(run_in_background(engine, loop_factory=loop_factory))
        pinned = getattr(store, "wait_pinned", None)
        if wait_pinned and pinned is not None:
            pinned()  # False where pinning stopped short: served with less, as logged
        return core

    def _hop(self, name: str, calls: list[Call]) -> PendingCalls:
        # One hand-over, each call its own task, made in order (aiokv.portal): the engine
        # accepts them in one iteration (one batch), after every call handed over before
        # and before any after. A coroutine gathering them would have started them one
        # iteration late, behind an evict_all made after it. BackgroundEngine's own
        # submit: it refuses (EngineClosed) once the handle closes, rather than leave
        # calls on a stopped loop.
        engine = self.kv.engine
        futures = self.kv._submit_all([functools.partial(call, engine) for call in calls])
        return PendingCalls(futures, functools.partial(self.kv._refuse_on_loop, name))

    def lookup(
        self, user_ids: Sequence[Hashable], num_tokens: Sequence[int]
    ) -> list[BackgroundLookup | None]:
        """Each user's hit (its ``cached_tokens`` reserved for :meth:`load`), waiting for
        them; None where the lookup failed, which is logged and reads as a miss (the
        manager then recomputes; a cache that fails open)."""
        self.kv._refuse_on_loop("lookup")  # before any reservation is made
        calls: list[Call] = [
            _lookup_call(user, tokens) for user, tokens in zip(user_ids, num_tokens, strict=True)
        ]
        outcomes = self._hop("lookup", calls).outcomes()
        hits: list[BackgroundLookup | None] = []
        for user, answer in zip(user_ids, outcomes, strict=True):
            if isinstance(answer, BaseException):
                log.warning("aiokv: lookup of user %r failed, read as a miss: %r", user, answer)
                hits.append(None)
            else:
                hits.append(BackgroundLookup(answer, self.kv.portal))
        return hits

    def load(
        self, hits: Sequence[BackgroundLookup], page_ids: Sequence[torch.Tensor]
    ) -> PendingCalls:
        """Load each hit into its pages (``LoadResult`` outcomes); does not wait. On a GPU
        the copies start after what this thread's current stream has queued now."""
        self.kv._refuse_on_loop("load")
        self.kv._refuse_in_fork()  # as the hop would: nothing of the parent's runs here
        if self.kv._closing is not None:  # as the hop refuses it: the whole call
            raise EngineClosed("the background engine is closed")
        engine = self.kv.engine
        ready = engine._caller_event()
        taken: dict[int, direct.Taken | BaseException] = {}
        calls: list[Call] = []
        # Queued by this thread, one job, where their pages are on the host
        # (aiokv.direct); a user's error is its own outcome, as on the loop. Behind
        # calls handed to the loop that have not begun (a release), they go through the
        # loop too: they must not overtake those.
        started: list[direct.Taken | BaseException | None] = [None] * len(hits)
        if not self.kv.portal.in_hand():
            # Counted for the interpreter's exit, which waits for it: this thread runs
            # the copies' torch calls (HandOverGate.counted); once the exit began, the
            # hop answers them.
            ran, got = self.kv._gate.counted(lambda: direct.start_many(
                engine, [hit.lookup for hit in hits], page_ids, ready))
            if ran and got is not None:
                if self.kv._gate.exiting:
                    # The exit's refusal (the copier stopped taking jobs), not a close's:
                    # the hop answers them as any hand-over once the exit began.
                    got = [None if isinstance(one, EngineClosed) else one for one in got]
                started = got
        for at, (hit, pages, one) in enumerate(zip(hits, page_ids, started, strict=True)):
            if one is None:
                calls.append(_load_call(hit, pages, ready))
            else:
                taken[at] = one
        try:
            pending = self._hop("load", calls) if calls else PendingCalls(
                [], functools.partial(self.kv._refuse_on_loop, "load"))
        except BaseException:
            # The hop refused (a close began meanwhile): nothing will wait for the loads
            # this thread queued, so it waits for them now (their reservations go back).
            for one in taken.values():
                if isinstance(one, direct.Taken):
                    with contextlib.suppress(Exception):
                        one.wait()
            raise
        return pending.with_taken(taken)

    def offload(
        self,
        user_ids: Sequence[Hashable],
        page_ids: Sequence[torch.Tensor],
        num_tokens: Sequence[int],
        stored: list[int] | None = None,
    ) -> PendingCalls:
        """Store each user's full pages of its first ``num_tokens`` tokens, held in its
        ``page_ids`` (``OffloadResult`` outcomes); does not wait. On a GPU the copies
        start after what this thread's current stream has queued now: the pages must
        stay as they are until the outcomes are in.

        A sequence longer than one offload can store (:attr:`max_offload_tokens` as the
        engine takes the call) stores its longest prefix that fits. One the store refuses
        all the same as more than it can ever hold (figures still of a store server since
        restarted with a smaller host tier: the engine asks for them again before it
        answers the refusal) is made again once, with the prefix the new figures allow,
        unless an evict or clear was made through this core since this call: made after
        the call, it must drop what the call stores, and the second try would come after
        it. ``stored``: one entry per user, each set to the tokens that user's offload
        was made with before its outcome is in (the length the store holds once it
        succeeded)."""
        if stored is None:
            stored = [0] * len(user_ids)
        elif len(stored) != len(user_ids):
            raise InvalidRequest("stored", f"has {len(stored)} entries for {len(user_ids)} users")
        ready = self.kv.engine._caller_event()
        made = self._drops.made
        calls: list[Call] = [
            _offload_call(user, pages, tokens, ready, _Slot(stored, i, self._drops, made))
            for i, (user, pages, tokens) in enumerate(
                zip(user_ids, page_ids, num_tokens, strict=True))
        ]
        return self._hop("offload", calls)

    def release(self, hits: Sequence[BackgroundLookup | None]) -> None:
        """Give back the reservations of hits that will not be loaded; does not wait."""
        for hit in hits:
            if hit is not None:
                hit.release()

    def evict(self, user_ids: Sequence[Hashable]) -> int:
        """Drop what the store holds for these users (``engine.evict`` each, one hop);
        returns the tokens dropped. Raises the first error of a call that failed."""
        self.kv._refuse_on_loop("evict")  # before anything is dropped
        self._drops.made += 1  # before it is handed over: see offload
        calls: list[Call] = [_evict_call(user) for user in user_ids]
        outcomes = self._hop("evict", calls).outcomes()
        for failed in outcomes:
            if isinstance(failed, BaseException):
                raise failed
        return sum(outcomes)

    def clear(self) -> int:
        """Drop everything the store holds; returns the tokens dropped."""
        self.kv._refuse_on_loop("clear")  # before it counts as made
        self._drops.made += 1  # before it is handed over: see offload
        return self.kv.clear()

    def close(self) -> None:
        """Drain and close the engine, stop its loop thread. Idempotent."""
        self.kv.close()


# One closure per call kind: what runs on the loop, given the engine.


def _lookup_call(user: Hashable, tokens: int) -> Call:
    async def call(engine: OffloadEngine) -> Any:
        return await engine.lookup(user, int(tokens))

    return call


def _load_call(hit: BackgroundLookup, pages: torch.Tensor, ready: Any) -> Call:
    async def call(engine: OffloadEngine) -> LoadResult:
        return await engine.load(hit.lookup, pages, _ready_event=ready)

    return call


class _Drops:
    """The evicts and clears made through a core, counted on the manager's thread before
    each is handed over to the engine's loop."""

    __slots__ = ("made",)

    def __init__(self) -> None:
        self.made = 0


@dataclasses.dataclass(slots=True)
class _Slot:
    """One user's offload's entry in ``stored`` (written on the loop), and the evicts
    and clears made when its manager call was."""

    stored: list[int]
    index: int
    drops: _Drops
    made: int


def _offload_call(user: Hashable, pages: torch.Tensor, tokens: int, ready: Any, slot: _Slot
                  ) -> Call:
    async def call(engine: OffloadEngine) -> OffloadResult:
        asked = slot.stored[slot.index] = _cut(int(tokens), engine)

        def again(refused: InvalidRequest) -> int | None:
            # Told on the loop, the second try made at once after it (engine.offload's
            # _again): an evict or clear counted after this check reaches the engine
            # after the second offload, and drops it.
            shorter = _cut(int(tokens), engine)
            if refused.field != "num_tokens" or shorter >= asked or slot.drops.made != slot.made:
                return None
            slot.stored[slot.index] = shorter
            return shorter

        return await engine.offload(user, pages, asked, _ready_event=ready, _again=again)

    return call


def _cut(tokens: int, engine: OffloadEngine) -> int:
    """The full pages of ``tokens``, at most what one offload can store now."""
    return offload_lengths([tokens], engine.page_size, _host_bound(engine))[0]


def _host_bound(engine: OffloadEngine) -> int | None:
    """The most tokens one offload can store now: the host tier's blocks x page_size, from
    the store's latest figures (read from any thread, no store call; at most REFRESH_S
    old while the store works, and asked again before the engine answers a put refused as
    more than the store can ever hold), or None where the store does not say. The store
    takes a put's new pages on the host tier at once (an SSD tier only adds room behind
    it, and the engine's own bound, capacity_tokens, counts both), and a store server
    may restart with another host tier (``store.backend: shared``), or pinning stop short
    of the embedded store's."""
    worker = engine._worker
    blocks = int(worker.figures.latest.get("host_blocks_total", 0)) if worker else 0
    return blocks * engine.page_size if blocks > 0 else None


def _evict_call(user: Hashable) -> Call:
    async def call(engine: OffloadEngine) -> int:
        return await engine.evict(user)

    return call


def sets_window(config: ConfigSource) -> bool:
    """Whether ``config`` (as :func:`aiokv.open_engine` takes it) sets
    ``engine.window_us``. Read after :func:`~aiokv.open.read_config` accepted it."""
    return sets_engine_key(config, "window_us")


def sets_engine_key(config: ConfigSource, key: str) -> bool:
    """Whether ``config`` (as :func:`aiokv.open_engine` takes it) sets ``engine.<key>``.
    Read after :func:`~aiokv.open.read_config` accepted it."""
    if config is None:
        return False
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as file:
            config = yaml.safe_load(file)
    if not isinstance(config, Mapping):
        return False
    engine = config.get("engine")
    return isinstance(engine, Mapping) and key in engine
