"""NVIDIA recsys-examples' host KV storage on aiokv: ``AiokvHostStorage``, a
``HostKVStorageBase`` (``recsys_kvcache_manager``) for its ``KVCacheManager``::

    from recsys_kvcache_manager import DefaultKVCacheBackend, DeviceKVCache, KVCacheManager
    from aiokv.integrations.recsys import AiokvHostStorage

    gpu = DeviceKVCache(...)
    manager = KVCacheManager(DefaultKVCacheBackend(gpu, AiokvHostStorage("aiokv.yml")))

This module imports without recsys-examples; ``AiokvHostStorage`` is built on first use
and raises ImportError where ``recsys_kvcache_manager`` is not importable. The work is
done by :class:`~aiokv.integrations.recsys_core.RecsysCore` (aiokv, one hop per manager
call) and :mod:`~aiokv.integrations.recsys_math` (the arithmetic); this class translates
recsys's types.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRequest
from ..handles import BackgroundLookup
from ..open import ConfigSource
from .pending import PendingCalls
from .recsys_core import RecsysCore
from .recsys_math import (
    offload_lengths,
    succeeded,
    user_pages,
    users_to_onboard,
    wait_status,
)

# How long offload_kvcache_wait waits for a task before it answers "launched": the
# manager polls it in a loop (offload_flush), and a poll that never released the GIL
# would leave the engine's threads, which finish the task, to Python's 5 ms switch
# interval at every hand-over.
POLL_WAIT_S = 100e-6

HITS = "aiokv_hits"  # where a lookup result's extra keeps its hits, for the onboard


@functools.cache
def _recsys() -> types.SimpleNamespace:
    """recsys-examples' types (ImportError where it is not importable)."""
    storage = importlib.import_module("recsys_kvcache_manager.host_kvstorage_manager")
    utils = importlib.import_module("recsys_kvcache_manager.kvcache_utils")
    return types.SimpleNamespace(
        HostKVStorageBase=storage.HostKVStorageBase,
        HostKVTaskHandle=storage.HostKVTaskHandle,
        HostKVTaskStatus=storage.HostKVTaskStatus,
        HostKVWaitResult=storage.HostKVWaitResult,
        KVIndexMeta=utils.KVIndexMeta,
        KVLookupResult=utils.KVLookupResult,
    )


@dataclass
class Task:
    """What a task handle holds: the calls in flight, the users (int64), and the
    page-aligned lengths the task stores or loads (an offload's calls set theirs as the
    engine takes them: RecsysCore.offload)."""

    pending: PendingCalls
    user_ids: torch.Tensor
    lengths: list[int]
    # An onboard's hits: given back once its loads are in (a no-op for a loaded one; a
    # load refused, Overloaded, left its hit held, and the manager never retries it).
    hits: Sequence[BackgroundLookup] = ()


def _int32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def _lengths(index_meta: Any) -> list[int]:
    """The batch's sequence lengths, one per user, none negative (InvalidRequest)."""
    lengths: list[int] = index_meta.seq_lengths.tolist()
    users = len(index_meta.user_ids)
    if len(lengths) != users:
        raise InvalidRequest(
            "index_meta.seq_lengths", f"has {len(lengths)} lengths for {users} users"
        )
    if any(length < 0 for length in lengths):
        raise InvalidRequest("index_meta.seq_lengths", f"must be >= 0, got {lengths}")
    return lengths


class _HostStorage:
    """A recsys-examples host storage on aiokv (its methods: ``HostKVStorageBase``'s).

    ``AiokvHostStorage(config=None, *, loop_factory=None, host_evict=True,
    wait_pinned=True)``: ``config`` is what ``aiokv.open_engine`` takes (a YAML path, a
    mapping, None for the defaults); the engine starts on a loop thread of its own
    (``run_in_background``) when the manager registers its GPU cache tables, each
    ``[pages, 2, page_size, heads, head_dim]``, and, with ``wait_pinned``, that call returns
    once the host tier is pinned whole (``RecsysCore.open`` says why).
    ``close()`` drains and stops it. ``host_evict=False`` makes ``evict`` and ``evict_all``
    no-ops that warn, as FlexKVStorage's are: code written against FlexKVStorage's
    semantics (recsys's ``test_flexkv.py`` asserts that a host evict keeps everything)
    runs unchanged; the attribute can be set again later.

    ``backend_name`` is ``"flexkv"``, because ``DefaultKVCacheBackend`` dispatches on it
    in three places and only that name fits aiokv: ``offload_launch`` hands over each
    user's whole sequence (``acquire_offload_pages(..., always_offload=True)``, with the
    batch's ``kvcache_metadata``; ``"native"`` would hand over chunks past an offloaded
    length instead), ``onboard_try_wait`` waits (other names than ``"native"`` raise
    NotImplementedError), and ``onboard_wait`` applies ``host_kvstorage_fail_policy`` to a
    failed onboard (for a handle whose ``backend`` is ``"flexkv"``, as these are).

    What differs from FlexKVStorage:
    ``evict`` / ``evict_all`` drop the users' KV by default (FlexKVStorage's are no-ops); lookups
    reserve their hits, and a hit not onboarded is given back by the onboard launch (or
    after ``engine.lookup_ttl_ms``); a failed lookup reads as a miss (logged); an
    onboard's ``onboard_lengths`` are the tokens it loads (page-aligned), not the
    sequence length, and its wait answers ready only where every user's load brought
    them: a user evicted (or cleared) between the lookup and the onboard loads nothing,
    so the wait answers FAILED, naming it in ``failed_user_ids``, and
    ``DefaultKVCacheBackend`` revokes the task's onboard pages (those of all its users,
    by its rule) and applies its fail policy: the manager never counts tokens on the GPU
    that were not loaded. The handle's lengths stay the launch's: the pages revoked.
    An offload stores at most the host tier's blocks of a sequence (the store takes a
    put's new pages on that tier at once): a longer history stores its longest prefix
    that fits, the length its handle reports, rather than fail its whole batch. The
    host tier is the store's as the engine takes the offload (a store server may have
    restarted with another since the storage started).
    ``cancel_task`` never aborts a copy (aiokv does not): the task's wait answers
    CANCELLED once its copies have ended, so that the manager reuses no page they touch.
    It returns False, and leaves the handle as it is, where the copies had all ended
    (nothing to cancel): that task's wait answers what they did.
    """

    backend_name = "flexkv"

    def __init__(
        self,
        config: ConfigSource = None,
        *,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        host_evict: bool = True,
        wait_pinned: bool = True,
    ) -> None:
        if not isinstance(wait_pinned, bool):
            raise InvalidRequest("wait_pinned", f"must be a bool, got {wait_pinned!r}")
        self._config = config
        self._loop_factory = loop_factory
        self._wait_pinned = wait_pinned
        self._core: RecsysCore | None = None
        self.host_evict = host_evict

    @property
    def host_evict(self) -> bool:
        """Whether ``evict`` / ``evict_all`` drop KV (True) or warn and keep it (False)."""
        return self._host_evict

    @host_evict.setter
    def host_evict(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise InvalidRequest("host_evict", f"must be a bool, got {value!r}")
        self._host_evict = value

    @property
    def core(self) -> RecsysCore:
        """The engine-facing core; InvalidRequest before ``register_gpu_cache_tables``."""
        if self._core is None:
            raise InvalidRequest(
                "cache_table_list", "not registered yet: call register_gpu_cache_tables first"
            )
        return self._core

    def close(self) -> None:
        """Drain and close the engine (idempotent; a no-op before registration)."""
        if self._core is not None:
            self._core.close()

    def register_gpu_cache_tables(self, cache_table_list: list[torch.Tensor]) -> None:
        if self._core is not None:
            raise InvalidRequest("cache_table_list", "already registered: one set per storage")
        self._core = RecsysCore.open(
            self._config, list(cache_table_list), self._loop_factory, self._wait_pinned
        )

    def build_index_meta(self, user_ids: torch.Tensor, sequence_lengths: torch.Tensor) -> Any:
        return _recsys().KVIndexMeta(
            user_ids=user_ids.to(torch.int64), seq_lengths=sequence_lengths.to(torch.int32)
        )

    def lookup_kvcache(self, index_meta: Any) -> Any:
        hits = self.core.lookup(index_meta.user_ids.tolist(), _lengths(index_meta))
        cached = _int32([0 if hit is None else hit.cached_tokens for hit in hits])
        return _recsys().KVLookupResult(
            user_ids=index_meta.user_ids,
            host_cached_start_indices=torch.zeros_like(cached),
            host_cached_lengths=cached,
            extra={"backend": "aiokv", HITS: hits},
        )

    def onboard_kvcache_launch(
        self, index_meta: Any, lookup_result: Any, kvcache_metadata: Any
    ) -> Any:
        recsys, core = _recsys(), self.core
        hits = lookup_result.extra.get(HITS)
        if hits is None:
            raise InvalidRequest("lookup_result", "did not come from this storage's lookup")
        try:  # refused: nothing will load its hits, which go back
            chosen, host = _onboarded(index_meta, lookup_result, hits)
        except BaseException:
            core.release(hits)
            raise
        chosen = [i for i in chosen if hits[i] is not None]
        loading = set(chosen)
        core.release([hit for i, hit in enumerate(hits) if i not in loading])
        if not chosen:
            return recsys.HostKVTaskHandle(
                backend="flexkv", handle=None, status=recsys.HostKVTaskStatus.SKIPPED
            )
        loading_hits = [hits[i] for i in chosen]
        try:
            pages = user_pages(kvcache_metadata.kv_indices, _lengths(index_meta), core.page_size)
            pending = core.load(loading_hits, [pages[i] for i in chosen])
        except BaseException:
            core.release(loading_hits)  # nothing of this onboard will load them
            raise
        user_ids = index_meta.user_ids[chosen]
        loaded = _int32([host[i] for i in chosen])
        return recsys.HostKVTaskHandle(
            backend="flexkv",
            user_ids=user_ids,
            handle=Task(pending, user_ids, [host[i] for i in chosen], loading_hits),
            status=recsys.HostKVTaskStatus.LAUNCHED,
            metadata={"onboard_start_indices": torch.zeros_like(loaded), "onboard_lengths": loaded},
        )

    def onboard_kvcache_wait(self, task_handle: Any) -> Any:
        # Ready only where every load brought its onboard_lengths: the manager counts
        # those tokens as on the GPU (recsys_math.wait_status).
        task: Task = task_handle.handle
        outcomes = task.pending.outcomes()
        self.core.release(task.hits)
        return _wait_result(task, outcomes, task.lengths)

    def offload_kvcache_launch(
        self,
        offload_user_ids: torch.Tensor,
        offload_start_indices: torch.Tensor,
        offload_page_indices_list: list[torch.Tensor],
        index_meta: Any = None,
        kvcache_metadata: Any = None,
    ) -> Any:
        # The pages come from the batch's kvcache_metadata, as FlexKVStorage takes them:
        # the page lists of acquire_offload_pages view the GPU manager's own vectors,
        # which its next allocate may move.
        for name, value in (("index_meta", index_meta), ("kvcache_metadata", kvcache_metadata)):
            if value is None:
                raise InvalidRequest(
                    name, "offload needs the batch's index_meta and kvcache_metadata"
                )
        if not torch.equal(offload_user_ids.cpu(), index_meta.user_ids.cpu()):
            raise InvalidRequest(
                "offload_user_ids",
                f"{offload_user_ids.tolist()} are not the batch's {index_meta.user_ids.tolist()}",
            )
        if bool(offload_start_indices.ne(0).any()):
            raise InvalidRequest(
                "offload_start_indices",
                f"must be 0 (whole sequences, backend_name 'flexkv'), got "
                f"{offload_start_indices.tolist()}",
            )
        core = self.core
        lengths = _lengths(index_meta)
        pages = user_pages(kvcache_metadata.kv_indices, lengths, core.page_size)
        # A sequence longer than one offload can store stores its longest prefix that
        # fits (reported as the handle's length): refused whole, the manager would fail
        # the batch's every user with it. The core cuts each as the engine takes it, to
        # the store's figures then (a store server may have restarted with another host
        # tier since), and sets its entry of ``stored``; filled here with the cut that
        # the figures now give, which the handle reports until then.
        stored = offload_lengths(lengths, core.page_size, core.max_offload_tokens)
        pending = core.offload(index_meta.user_ids.tolist(), pages, lengths, stored)
        recsys = _recsys()
        return recsys.HostKVTaskHandle(
            backend="flexkv",
            user_ids=index_meta.user_ids,
            handle=Task(pending, index_meta.user_ids, stored),
            status=recsys.HostKVTaskStatus.LAUNCHED,
        )

    def offload_kvcache_wait(self, task_handle: Any) -> Any:
        task: Task = task_handle.handle
        return _wait_result(task, task.pending.poll(POLL_WAIT_S))

    def finish_task(self, task_handle: Any) -> list[int]:
        task: Task = task_handle.handle
        return succeeded(task.pending.outcomes())

    def cancel_task(self, task_handle: Any) -> bool:
        # True only where something was cancelled, as HostKVStorageBase's answer says: a
        # task whose copies had all ended keeps its status, and its wait answers what
        # they did (ready: the KV is stored or loaded), not CANCELLED.
        if task_handle is None or task_handle.handle is None:
            return False
        if not task_handle.handle.pending.cancel():
            return False
        task_handle.status = _recsys().HostKVTaskStatus.CANCELLED
        return True

    def evict(self, user_ids: torch.Tensor) -> None:
        if self._kept("evict"):
            return
        self.core.evict(user_ids.tolist())

    def evict_all(self) -> None:
        if self._kept("evict_all"):
            return
        self.core.clear()

    def _kept(self, verb: str) -> bool:
        if self._host_evict:
            return False
        warnings.warn(
            f"AiokvHostStorage(host_evict=False): {verb}() keeps the host's KV",
            RuntimeWarning,
            stacklevel=3,
        )
        return True

    @staticmethod
    def get_offload_handle_metadata(
        task_handle: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(users, start indices (0), the page-aligned lengths the offload stores)."""
        task: Task = task_handle.handle
        lengths = _int32(task.lengths)
        return task.user_ids, torch.zeros_like(lengths), lengths


def _onboarded(index_meta: Any, lookup_result: Any, hits: list[Any]
               ) -> tuple[list[int], list[int]]:
    """The indexes of the users to onboard, and the host lengths, of a lookup result that
    is this batch's: InvalidRequest for one of another batch, or with columns that do not
    match its users."""
    users = index_meta.user_ids.tolist()
    asked = [None if hit is None else hit.user_id for hit in hits]
    if len(asked) != len(users) or any(
            user is not None and user != want for user, want in zip(asked, users, strict=True)):
        raise InvalidRequest("lookup_result", f"is a lookup of users {asked}, index_meta's "
                             f"are {users}: a lookup of another batch")
    host = lookup_result.host_cached_lengths.tolist()

    def column(name: str, default: list[int]) -> list[int]:
        tensor: torch.Tensor | None = getattr(lookup_result, name)
        values = default if tensor is None else tensor.tolist()
        if len(values) != len(users):
            raise InvalidRequest(f"lookup_result.{name}",
                                 f"has {len(values)} values for {len(users)} users")
        return values

    # Without the GPU's columns (a lookup result not merged with DeviceKVCache's), the
    # GPU holds nothing.
    zeros = [0] * len(users)
    chosen = users_to_onboard(
        column("cached_lengths", host),
        column("host_cached_lengths", host),
        column("gpu_cached_start_indices", zeros),
        column("gpu_cached_lengths", zeros),
    )
    return chosen, host


def _wait_result(
    task: Task, outcomes: list[Any] | None, lengths: list[int] | None = None
) -> Any:
    recsys = _recsys()
    user_ids = task.user_ids.tolist()
    status = wait_status(outcomes, user_ids, lengths)
    if not status.failed:
        return recsys.HostKVWaitResult(
            status=recsys.HostKVTaskStatus(status.status), ready=status.ready
        )
    failed_mask = torch.zeros(len(user_ids), dtype=torch.bool)
    failed_mask[status.failed] = True
    return recsys.HostKVWaitResult(
        status=recsys.HostKVTaskStatus(status.status),
        ready=False,
        message=status.message,
        failed_mask=failed_mask,
        failed_user_ids=[user_ids[i] for i in status.failed],
    )


@functools.cache
def _storage_class() -> type:
    # HostKVStorageBase is an ABC: _HostStorage comes first, so its methods are the
    # abstract ones' implementations.
    base = _recsys().HostKVStorageBase

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(
            __module__=__name__, __qualname__="AiokvHostStorage", __doc__=_HostStorage.__doc__
        )

    return types.new_class("AiokvHostStorage", (_HostStorage, base), exec_body=body)


def __getattr__(name: str) -> Any:
    if name == "AiokvHostStorage":
        try:
            return _storage_class()
        except ImportError as exc:
            raise ImportError(
                "aiokv.integrations.recsys.AiokvHostStorage needs recsys-examples' "
                f"recsys_kvcache_manager (corelib/recsys_kvcache_manager): {exc}"
            ) from exc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# AiokvHostStorage is left out: `from aiokv.integrations.recsys import *` must work
# without recsys-examples.
__all__ = ["HITS", "POLL_WAIT_S", "RecsysCore", "Task"]
