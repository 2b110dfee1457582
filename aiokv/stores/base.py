"""The Store protocol: what the engine's store thread drives.

The verbs are FlexKV's (``put_match``/``get_match``/``launch``/``cancel``/``try_wait``) so
that :class:`~aiokv.stores.flexkv.FlexKVStore` stays a thin adapter. Every method is
called from one thread, the engine's ``aiokv-store`` thread; a store needs no locking
against the engine, only against threads of its own.

Contract, for any store:

- ``put_match`` / ``get_match`` return ``(task_id, mask)``; ``mask`` is ``np.bool_`` with one
  entry per token. For a put, True means "must write" (the positions not yet stored); for
  a get, True means "will load". Masks are page aligned and a trailing partial page is
  never stored.
- Every id a match returns is passed to ``launch`` or ``cancel`` exactly once. A matched
  id that is neither may hold store blocks forever.
- ``launch(task_ids, pages, ready)`` takes, per task, ``pages[i]``: the caller's page ids
  of exactly the True pages of that task's mask, in order (a 1-D integer tensor as the
  caller gave it: on the CPU, or a view of a tensor on the caches' device, values not yet
  checked), and ``ready[i]``: a CUDA event (or None) after which those ids and the KV in
  those pages are written. Each store makes what it needs of them (FlexKV: host slot
  mappings, fused for the batch; the embedded store: copy plans). It must not block on the
  copy. A page id outside the caches (or, for a get, a page twice) fails only its own
  task, with status INVALID and an error that names the id as the caller gave it. A launch
  that raises has launched none of its ids, which stay matched (the engine then cancels
  them).
- ``try_wait`` answers only the ids that are terminal, each once; it never blocks.
- ``put_match`` raises :class:`NoSpace` when there is something new to write and no block
  can be reserved for it (instead of answering an all-False mask that reads as success).
  It may also raise it while pages it would count as stored are still being written by
  another put, whose failure would roll them back (the embedded store does): the engine
  matches it again later, as for room. It raises :class:`TooLarge` instead when the new
  pages could never all be reserved at once.

Optional features are declared below, one Protocol each (:class:`Notifies`,
:class:`Yields`, :class:`PutMatchesMany`, :class:`GetMatchesMany`, :class:`Evicts`,
:class:`Clears`, :class:`ReportsStats`, :class:`AdvisesSlice`, :class:`Restarts`,
:class:`BoundsWaits`, :class:`BoundsLookups`, :class:`HearsOfClose`,
:class:`Terminates`, :class:`Detaches`); a store implements any
subset, and a
wrapper forwards what its inner store has. The engine reads them once, into
:class:`Capabilities`, when it builds its store thread.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from ..copy.marks import LayerMarks

BoolArray = npt.NDArray[np.bool_]
Int64Array = npt.NDArray[np.int64]


class TaskStatus(enum.Enum):
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # The caller's input was bad (a page id outside the caches, a load's page twice):
    # ``error`` says which value; the engine fails the request with InvalidRequest.
    INVALID = "invalid"
    # The task reached the deadline the engine gave it (:class:`BoundsWaits`) before all
    # of it was queued for its copy: the store queued nothing of it after that (what it
    # queued before may still land); ``error`` says why it stopped. The engine fails the
    # request with RequestTimeout.
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class TaskResult:
    """The terminal answer for one task id.

    ``mask`` is the task's mask as the store reports it (for FlexKV, the mask of the
    sub-task inside a merged batch); ``error`` says why a FAILED task failed.
    """

    status: TaskStatus
    mask: BoolArray | None = None
    error: str = ""


def no_yield() -> None:
    """A store's yield point (set_yield) when no store thread is behind it."""


class NoSpace(Exception):
    """Raised by ``put_match`` when nothing new can be reserved (store full, all locked)."""


class TooLarge(ValueError):
    """Raised by ``put_match`` when the put's new pages are more than the store could ever
    reserve at once (the embedded store's host tier, where every put's pages land first):
    waiting for room would not help. The message names the counts; the engine fails the
    offload with InvalidRequest naming ``num_tokens``."""


@runtime_checkable
class Store(Protocol):
    """What the engine drives. See the module docstring for the contract."""

    @property
    def page_size(self) -> int:
        """Tokens per page; may be 0 until ``register`` takes it from the caches."""
        ...

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None: ...

    def put_match(
        self, token_ids: Int64Array, namespace: Sequence[str]
    ) -> tuple[int, BoolArray]: ...

    def get_match(
        self, token_ids: Int64Array, namespace: Sequence[str]
    ) -> tuple[int, BoolArray]: ...

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None: ...

    def cancel(self, task_ids: Sequence[int]) -> None: ...

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]: ...

    def close(self) -> None: ...


# What a match of many answers: per query, its (task_id, mask) or the exception its
# one-by-one match would have raised (an exception of the whole call fails them all).
MatchAnswers = list[tuple[int, BoolArray] | Exception]
Queries = Sequence[tuple[Int64Array, Sequence[str]]]


@runtime_checkable
class Notifies(Protocol):
    """Calls ``callback()`` from any thread whenever tasks may have become terminal; the
    engine then waits for that instead of polling ``try_wait`` every
    ``poll_interval_us`` (LocalStore and ProcessStore do; FlexKV is polled)."""

    def set_notify(self, callback: Callable[[], None]) -> None: ...


@runtime_checkable
class Yields(Protocol):
    """Calls ``callback()`` at points inside its own calls where the store thread may
    hand the GIL to the event loop (FlexKVStore: between FlexKV's answers and its own
    fan-out of them); the callback does so when ``EngineConfig.store_slice_us`` is set
    and used up. For the store thread only, inside the store's calls: each engine passes
    its own when its store thread starts and :func:`no_yield` when it ends."""

    def set_yield(self, callback: Callable[[], None]) -> None: ...


@runtime_checkable
class PutMatchesMany(Protocol):
    """``put_match`` for each ``(token_ids, namespace)`` in order, in one call
    (ProcessStore: one round trip instead of one per request)."""

    def put_match_many(self, queries: Queries) -> MatchAnswers: ...


@runtime_checkable
class GetMatchesMany(Protocol):
    """``get_match`` for each ``(token_ids, namespace)`` in order, in one call."""

    def get_match_many(self, queries: Queries) -> MatchAnswers: ...


class BoundsLookups(Protocol):
    """A :class:`GetMatchesMany` whose ``get_match_many`` takes ``deadline_s`` (keyword):
    the lookup batch's deadline in ``time.monotonic()`` seconds (one clock for every
    process of a host), the latest of its requests' (``request_timeout_ms`` after each
    call; None where a request has none). A store that waits inside the match (``aiokv
    store-server``: a get's SSD or Mooncake pages read into host blocks first, or room
    for them) answers by then with what it has, as at its own limit: no caller of the
    batch takes an answer after it, and the engine's other calls wait behind this one.
    The engine passes it to a store whose ``get_match_many`` names the parameter
    (:func:`takes_deadline`), and to no other (their signature stays as it was)."""

    def get_match_many(self, queries: Queries, *, deadline_s: float | None = None
                       ) -> MatchAnswers: ...


def takes_deadline(method: Callable[..., Any] | None) -> bool:
    """Whether a store's ``get_match_many`` takes ``deadline_s`` (:class:`BoundsLookups`).
    Asked per batch by a store's child process: the answer is kept per function."""
    if method is None:
        return False
    function = getattr(method, "__func__", method)  # a bound method: its class's function
    try:
        return _names_deadline(function)
    except TypeError:  # a callable that cannot be a key: asked each time
        return _names_deadline.__wrapped__(function)


@functools.lru_cache(maxsize=64)
def _names_deadline(function: Callable[..., Any]) -> bool:
    try:
        return "deadline_s" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a callable with no signature Python can read
        return False


@runtime_checkable
class MarksLayers(Protocol):
    """Per-layer completion of a launched get task: ``layer_marks(task_id)``, asked on the
    store thread right after the launch that took it, gives the task's
    :class:`~aiokv.copy.marks.LayerMarks` (its layers are copied in order and each marked),
    or None where this task's layers are only known at its end (then the engine marks them
    all when the task ends). Stores without it: every load is marked at its end."""

    def layer_marks(self, task_id: int) -> LayerMarks | None: ...


@runtime_checkable
class Evicts(Protocol):
    """Drops every block stored under exactly ``namespace``; returns the tokens dropped
    (blocks * page_size)."""

    def evict(self, namespace: Sequence[str]) -> int: ...


@runtime_checkable
class Clears(Protocol):
    """Drops everything; returns the tokens dropped."""

    def clear(self) -> int: ...


@runtime_checkable
class ReportsStats(Protocol):
    """Tier occupancy and counters, keys from: host_blocks_used, host_blocks_total,
    ssd_blocks_used, ssd_blocks_total, host_hit_tokens, ssd_hit_tokens (tokens get_match
    found on the host tier / only on SSD), bytes_d2h, bytes_h2d, bytes_ssd_written,
    bytes_ssd_read, checksum_failures, ssd_read_errors (SSD blocks a read could not bring:
    misses, as those checksum_failures counts), ssd_write_errors, ssd_invalidation_errors
    (SSD header voids and new epochs the disk refused: an evict or clear says what that
    leaves), ssd_full_drops (host blocks evicted with no SSD copy: every SSD slot in
    use), stage_waits (loads that waited for host room to stage their SSD pages),
    d2h_copies (device-to-host copies of page ids the store made for its launches:
    FlexKV's fused slots, a store process's ids), server_up (0 where the figures are
    the last a store server now away gave: ``shared``); the
    keys the store has; the engine reads them into EngineStats, aiokv.store_figures).
    Asked by the store thread now and then while it works, and once more after
    ``close()``: a closed store may answer (what its close finished counts then) or raise
    (its last answer stands)."""

    def store_stats(self) -> Mapping[str, int | float]: ...


@runtime_checkable
class ResumesFigures(Protocol):
    """A store whose figures are not all its own counts (``shared``: the server's running
    totals, every engine's), so that a store replacing it for the same engine (a new
    store process, :class:`~aiokv.stores.process.ProcessStore`) cannot go on from them by
    adding them to its own: ``figures_state()`` (picklable, asked with each
    ``store_stats()``) is what that store's ``resume_figures`` needs to go on from the
    figures as this one would have. A store without it counts everything it reports
    itself, from 0: ProcessStore adds a dead child's last figures to the next one's."""

    def figures_state(self) -> object: ...

    def resume_figures(self, state: object) -> None: ...


@runtime_checkable
class StartsWhileAway(Protocol):
    """A store whose ``register`` connects to a server (``shared``), which it reconnects to
    at a later call once it lost it: ``start_while_away()``, before ``register``, makes a
    server not there at ``register`` such a loss (StoreError at each call until it is back)
    rather than ``register``'s StoreError. For a store replacing one that served the same
    caches (a new store process, :class:`~aiokv.stores.process.ProcessStore`): the one
    before would have served on once the server came back, and so must it, instead of
    failing its start and spending the restart budget while the server is away."""

    def start_while_away(self) -> None: ...


class AdvisesSlice(Protocol):
    """``store_slice_us``: the store's advice for ``EngineConfig.store_slice_us`` (used
    when the config leaves it None): how long the store thread may run, holding the
    GIL, before it hands it to a waiting event loop. For stores whose calls run Python
    for long (FlexKV: 200); without it (or None), 0."""

    store_slice_us: int | None


class Restarts(Protocol):
    """``restarts``: how many times the store started its backend again after it died
    (ProcessStore: new child processes after the first; ``StoreConfig.store_restarts``
    bounds it). Read racily by ``engine.stats()``; wrappers forward it."""

    restarts: int


def store_restarts(store: object) -> int:
    """The store's :class:`Restarts` count, 0 for a store that never restarts."""
    count: int = getattr(store, "restarts", 0)
    return count


@runtime_checkable
class BoundsWaits(Protocol):
    """``set_deadlines(task_ids, deadlines_s)``: matched get tasks' deadlines, in
    ``time.monotonic()`` seconds (one clock for every process of a host), given on the
    store thread right before the ``launch`` that takes those ids. A store that waits
    inside for something before it queues a task's copy into the caller's pages
    (LocalStore: host room to stage a load's SSD pages, and their reads) queues nothing of
    it after its deadline: the task ends EXPIRED with what it queued before. The engine
    gives each load its request's deadline (``request_timeout_ms`` after the call; 30 s
    after the launch when that is 0), which the engine also times the caller out at: a
    caller told RequestTimeout has nothing queued into its pages after that, only what
    was queued by then. ProcessStore sends them to its child with the launch."""

    def set_deadlines(self, task_ids: Sequence[int], deadlines_s: Sequence[float]) -> None: ...


@runtime_checkable
class BoundsInvalidations(Protocol):
    """``set_invalidation_deadline(deadline_s)``: the ``time.monotonic()`` deadline of the
    ``evict`` or ``clear`` that follows at once on the store thread (its caller's
    ``request_timeout_ms``; not given without one). A store that hands the request to
    another process (a store server, a store process) tells it, and that process drops
    nothing for a request that reaches it after the deadline: the caller heard
    RequestTimeout by then, and the engine's later calls must not find the key dropped
    after they found it (or their offloads dropped) by an evict it gave up on."""

    def set_invalidation_deadline(self, deadline_s: float) -> None: ...


@runtime_checkable
class ParksLoads(Protocol):
    """``parked(task_ids)``: of these launched tasks, the loads that wait for room in the
    store before they copy anything more (LocalStore: host room to stage their SSD
    pages), room that only the engine's later calls can give back (not a load that the
    room coming back by itself, as SSD writes and reads end, will stage); a question,
    nothing changes. Asked by an evict or clear while it waits for the tasks launched
    before it: once only such loads are left it goes ahead, since the room they wait for
    may be held by lookups whose loads queue behind it. Its drop ends those of its key
    with what they queued before (their host pages); the others wait on."""

    def parked(self, task_ids: Sequence[int]) -> list[int]: ...


@runtime_checkable
class ChecksHeld(Protocol):
    """``check_held()``: the gets this store holds for the engine (matched, not launched:
    its callers' Lookups) may have been taken back by another engine's evict or clear
    (``aiokv store-server``): look, so that what they hold goes back now rather than at
    their end. Cheap when nothing changed. Called now and then while any is held.

    Returns those of them taken back, each with ``"evicted"`` or ``"cleared"`` (None or
    empty: none): the engine gives them back (``cancel``) and marks their Lookups so, as
    for an evict or clear of its own, so that they read not held once the other engine's
    evict has returned, without a call of their own."""

    def check_held(self) -> Mapping[int, str] | None: ...


@runtime_checkable
class HearsOfClose(Protocol):
    """``closing()``: the engine that drives the store began to close (``aclose``, before
    its drain); the store's ``close()`` follows once the store thread is done. From then
    on the store starts nothing of its own that only later calls would use (ProcessStore:
    no new child after one died; what the dead one held answers FAILED, and its figures
    are the last it gave). Called from the engine's loop thread, not the store thread
    (that one may be inside a call): it only sets a flag, and never blocks. A wrapper
    that outlives its engines (testing.SharedStore) does not pass it on."""

    def closing(self) -> None: ...


@runtime_checkable
class Terminates(Protocol):
    """``terminate()``: the engine's close timed out with its store thread still busy
    with the store (inside a call, waiting for launched tasks, or in ``close()``): end
    what that thread waits on, now (ProcessStore: kill its child, SIGKILL), so that its
    calls fail at once (launched tasks FAILED) and the thread ends, releasing what the
    store holds (a child's SSD directory lock) instead of waiting on it for good. Called
    from the engine's loop thread after :class:`HearsOfClose`'s ``closing()``; never
    blocks. Not passed on by testing.SharedStore (its owner ends the inner store)."""

    def terminate(self) -> None: ...


@runtime_checkable
class Detaches(Protocol):
    """``detach(task_id)``: the caller of this put (matched, maybe launched) stopped
    waiting, and may reuse its pages from now on: its ``RequestTimeout`` (the deadline's
    timer), its cancellation, or the ``EngineClosed`` of a close that gave up on it.
    Called from the engine's loop thread, before that caller can hear it; it only sets a
    flag, and never blocks; ids the store no longer knows (ended) are ignored. A store
    whose copies read the caller's pages in this process keeps nothing of such a put
    unless the copy of its pages had been seen to end before the call (then it read them
    before the caller was told anything): the task ends FAILED, its blocks rolled back
    (the embedded store and ``shared``, through
    :attr:`aiokv.copy.copier.CopyJob.callers`). The embedded store in its own process
    keeps nothing of a put detached before it took the copy's end in (a table in shared
    memory: :mod:`aiokv.stores.detaches`)."""

    def detach(self, task_id: int) -> None: ...


class TakenLoad(Protocol):
    """A matched get its caller's thread took (:class:`TakesLoads`), its copies queued:
    ``wait()`` blocks until they ran (into the caller's pages) and answers the task's
    terminal result (SUCCESS, INVALID for page ids it refused, FAILED). Any thread; a
    second call answers the same."""

    def wait(self) -> TaskResult: ...


@runtime_checkable
class TakesLoads(Protocol):
    """A store whose matched gets the calling thread may take from it and queue itself,
    with no hop through the engine's loop or the store's thread (``run_in_background``'s
    blocking ``load`` and the recsys adapter; any thread, while the engine runs):

    - ``takes_load(task_id)``: whether ``take_loads`` would take this matched task (a get
      whose pages are all on the host, in this process); a hint, read before the caller
      consumes its Lookup;
    - ``take_loads(task_ids, pages, ready)``: take them (the store's thread will neither
      launch nor cancel them; an evict or clear keeps their blocks until their copies
      ran) and queue their copies, in one job, into ``pages[i]`` (one id per block of
      task i) after the CUDA event ``ready``; one answer per task, None where it was
      given back meanwhile (an evict or clear: nothing to load). Raises EngineClosed once
      the store's close began, ValueError (taking none) for a task that is not such a
      get or a page count that is not its blocks'. The store's close waits for what was
      taken, its copies run."""

    def takes_load(self, task_id: int) -> bool: ...

    def take_loads(
        self, task_ids: Sequence[int], pages: Sequence[Any], ready: Any
    ) -> list[TakenLoad | None]: ...


def capacity_tokens(
    store_stats: Callable[[], Mapping[str, int | float]] | None, page_size: int
) -> int | None:
    """The most tokens a registered store can ever hold: its tiers' blocks (host and SSD,
    from :class:`ReportsStats`) times ``page_size``; None where it does not say (no
    ``store_stats``, no ``host_blocks_total``, or the call fails: FlexKV's adapter), and
    where its figures are those a store server now away gave last (``server_up`` 0):
    the server that serves next may hold more, and until it is asked an offload that
    one held too much of must not be refused as never storable."""
    if store_stats is None or page_size <= 0:
        return None
    try:
        stats = store_stats()
        if stats.get("server_up", 1) == 0:
            return None
        blocks = int(stats["host_blocks_total"]) + int(stats.get("ssd_blocks_total", 0))
    except Exception:  # a store that cannot say is bounded by the engine's config alone
        return None
    return blocks * page_size if blocks > 0 else None


# The optional methods by name, as Capabilities holds them.
OPTIONAL_METHODS = (
    "set_notify",
    "set_yield",
    "set_deadlines",
    "set_invalidation_deadline",
    "parked",
    "check_held",
    "put_match_many",
    "get_match_many",
    "evict",
    "clear",
    "store_stats",
    "layer_marks",
    "closing",
    "terminate",
    "detach",
)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """A store's optional methods, read once (:meth:`of`): each bound method, or None
    where the store lacks it (a wrapper may hold None for what its inner store lacks).
    The slice advice (:class:`AdvisesSlice`) is read with the config, by
    :func:`aiokv.worker.handoff.store_slice_us`."""

    set_notify: Callable[[Callable[[], None]], None] | None = None
    set_yield: Callable[[Callable[[], None]], None] | None = None
    set_deadlines: Callable[[Sequence[int], Sequence[float]], None] | None = None
    set_invalidation_deadline: Callable[[float], None] | None = None
    parked: Callable[[Sequence[int]], list[int]] | None = None
    check_held: Callable[[], Mapping[int, str] | None] | None = None
    put_match_many: Callable[[Queries], MatchAnswers] | None = None
    get_match_many: Callable[[Queries], MatchAnswers] | None = None
    evict: Callable[[Sequence[str]], int] | None = None
    clear: Callable[[], int] | None = None
    store_stats: Callable[[], Mapping[str, int | float]] | None = None
    layer_marks: Callable[[int], LayerMarks | None] | None = None
    closing: Callable[[], None] | None = None
    terminate: Callable[[], None] | None = None
    detach: Callable[[int], None] | None = None
    bounds_lookups: bool = False  # get_match_many takes deadline_s (BoundsLookups)

    @classmethod
    def of(cls, store: object) -> Capabilities:
        found: dict[str, Any] = {}
        for name in OPTIONAL_METHODS:
            method = getattr(store, name, None)
            if callable(method):
                found[name] = method
        return cls(**found, bounds_lookups=takes_deadline(found.get("get_match_many")))
