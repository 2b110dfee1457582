"""FlexKVStore: the Store protocol as a thin adapter over ``flexkv.kvmanager.KVManager``
(started by :mod:`aiokv.stores.flexkv.setup`).

What this adapter owns (FlexKV's sharp edges, see DESIGN.md):

- ``launch(as_batch=True)`` merges only 2+ tasks of one kind and then answers under a new
  batch id with one mask per sub-task; the sub-task ids become unknown to FlexKV. We split
  a mixed launch per kind (:mod:`.tasks`), keep the batch id, and fan its answer back out
  to the ids the matches gave. Only tasks with a non-empty mask go into a batch: FlexKV
  drops empty sub-tasks from the batch's mask list, which would misalign the fan-out.
- FlexKV forgets a task on its first terminal answer, so answers are cached here, keyed by
  the original id, and handed out once.
- An all-False put mask also means "no space": ``put_match`` tells that apart from
  "already stored" with a ``get_match`` on the same tokens and raises ``NoSpace``.
- FlexKV's put matches blocks another put is still writing as stored and hangs its own
  below them; a put whose first page one of this adapter's puts in flight writes gets
  ``NoSpace`` and is matched again once that put ends (the engine's space waits).
- A launched task is never cancelled (FlexKV would forget it while its copy runs on).
- With an SSD tier, FlexKV writes every put through to SSD and keeps the put's CPU blocks
  locked until that write ends; its ``try_wait`` (``completely=False``) answers once the
  GPU copy is done. A caller told then would find the CPU tier full of locked blocks (its
  next puts get NoSpace, its lookups of SSD blocks miss: they stage through CPU blocks).
  So with an SSD tier a task is polled with ``wait(ids, timeout=0.0, completely=True)``,
  which answers a task only once all of it, SSD write included, is done, answers the
  others TIMEOUT and keeps them (they are asked again later): an offload resolves when
  its CPU blocks are free again.
- Invalidation: ``clear`` resets FlexKV (``KVManager.reset``) once no task of this
  adapter is in flight; ``evict`` (no FlexKV API), or a failed reset, moves keys to a new
  namespace generation (:mod:`.keys`). Both count the tokens this adapter's puts wrote.
- FlexKV takes host slot mappings: a launch's page ids are fused into them with one
  device-to-host copy (:mod:`.slots`), and a task with a bad page id ends INVALID.

FlexKV starts a TransferManager with the ``spawn`` start method: the program's main module
must be import-safe (``if __name__ == "__main__":``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...config import StoreConfig
from ...errors import ConfigError
from ..base import BoolArray, Int64Array, NoSpace, TaskResult, TaskStatus, no_yield
from .keys import KeyGenerations
from .setup import CacheGeometry, attach_caches, close_client, start_manager, wait_ready
from .slots import SlotMaker
from .tasks import group_launch, response_results, unknown_task
from .tiers import quiet_wait_timeouts, tier_values

log = logging.getLogger("aiokv")

_instance_counter = itertools.count()
_POLL_S = 0.001


class FlexKVStore:
    """Store over one FlexKV KVManager (direct mode, one GPU, CPU tier + optional SSD)."""

    # FlexKV runs Python on the store thread for long stretches per call (a batch's
    # launch, a finished batch's answers), holding the GIL: the store thread hands it to a
    # waiting loop between (and inside, set_yield) calls past this slice
    # (EngineConfig.store_slice_us).
    store_slice_us = 200

    def __init__(self, config: StoreConfig, *, ready_timeout_s: float = 60.0) -> None:
        tier_values(config, config.flexkv.get("ssd_cache_dir"))  # ConfigError: say it now
        self._config = config
        self._ready_timeout_s = ready_timeout_s
        self.page_size: int = config.page_size or 0  # fixed by register()
        self._manager: Any = None
        self._tp_client: Any = None  # keeps the registration sockets alive
        self._caches: list[torch.Tensor] = []  # FlexKV maps these by IPC: keep them alive
        # Unique per process and instance: two stores on one host must not share sockets.
        base = os.path.join(
            tempfile.gettempdir(), f"aiokv_flexkv_{os.getpid()}_{next(_instance_counter)}"
        )
        self._endpoint = f"ipc://{base}"
        self._socket_files = [base, f"{base}_gpu_register", f"{base}_gpu_register_control"]
        self._kind: dict[int, str] = {}  # matched, not launched: id -> "put" | "get"
        self._mask: dict[int, BoolArray] = {}  # match masks of open ids (fallback answer)
        self._members: dict[int, list[int]] = {}  # launched FlexKV id -> original ids
        self._owner: dict[int, int] = {}  # launched original id -> FlexKV id to poll
        self._done: dict[int, TaskResult] = {}  # terminal answers not yet handed out
        # Puts that write something, from match to their terminal answer: FlexKV's put
        # counts their blocks as present while its get does not (see put_match).
        self._writing: dict[int, tuple[tuple[str, ...], Int64Array]] = {}
        self._yield: Callable[[], None] = no_yield  # the engine's (set_yield)
        self._keys = KeyGenerations()  # evicted keys' namespaces, tokens written per key
        self._closed = False
        self._slots = SlotMaker()  # a launch's page ids -> FlexKV's host slot mappings
        # With an SSD tier, a task is answered only once its SSD writes are done too.
        self._completely = config.ssd_cache_gb > 0

    # ---- setup -----------------------------------------------------------------------

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Start FlexKV for these caches, register them from this process, wait for ready."""
        caches = list(kv_caches)
        geometry = CacheGeometry.of(caches)
        self.start(geometry)
        try:
            self._tp_client = attach_caches(self.gpu_register_endpoint, caches, geometry)
            self._caches = caches
            self.wait_attached()
            self._slots.warm_up(caches[0].device, self.page_size)
        except BaseException:
            self._shutdown()
            raise

    def start(self, geometry: CacheGeometry) -> None:
        """Start FlexKV's KVManager for caches of this geometry, without the caches: they
        are registered at ``gpu_register_endpoint`` by whichever process owns them
        (:func:`attach_caches`), then :meth:`wait_attached`. ProcessStore runs this in its
        child; :meth:`register` does all three in one process."""
        if self._manager is not None:
            raise RuntimeError("FlexKVStore.register() was already called")
        if self._config.page_size is not None and self._config.page_size != geometry.page_size:
            raise ConfigError(
                "store.page_size",
                f"{self._config.page_size} does not match the caches' page size "
                f"{geometry.page_size}",
            )
        self._manager = start_manager(
            self._config, geometry, self._endpoint, self.gpu_register_endpoint
        )
        if self._completely and getattr(self._manager, "server_client_mode", False):
            quiet_wait_timeouts()
        self.page_size = geometry.page_size
        self._slots.num_pages = geometry.num_pages

    def wait_attached(self) -> None:
        """Wait (ready_timeout_s) until FlexKV has the caches and is ready; shut it down
        and raise StoreError if it does not get there."""
        try:
            self._wait_ready(self._live())
        except BaseException:
            self._shutdown()
            raise

    def _wait_ready(self, manager: Any) -> None:
        wait_ready(manager, self._ready_timeout_s, self._endpoint)

    @property
    def gpu_register_endpoint(self) -> str:
        """Where :func:`attach_caches` registers the caches with this store's FlexKV."""
        return f"{self._endpoint}_gpu_register"

    @property
    def socket_files(self) -> list[str]:
        """The IPC socket files this store's FlexKV creates (removed at close)."""
        return list(self._socket_files)

    # ---- Store protocol --------------------------------------------------------------

    def set_yield(self, callback: Callable[[], None]) -> None:
        """Where the store thread may hand the GIL to the loop: after FlexKV's answers
        (which hold it up to about a millisecond) and before our fan-out of them."""
        self._yield = callback

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        manager = self._live()
        key, namespace = namespace, self._keys.namespace(namespace)  # its generation's
        tokens = np.ascontiguousarray(token_ids, dtype=np.int64)
        full = len(tokens) // self.page_size * self.page_size
        names = tuple(namespace)
        if full and self._shares_a_put_in_flight(names, tokens):
            # FlexKV's put matches the blocks another put is still writing as stored and
            # hangs its own new blocks below them: that put failing would leave this one
            # reported stored while its prefix is gone, and (a node with children is never
            # rolled back) the key unreadable for good. Matched again once that put ends.
            raise NoSpace("a put of this key's pages is still being written")
        task_id, raw = manager.put_match(tokens, namespace=list(namespace))
        mask = np.array(raw, dtype=np.bool_)  # a copy: FlexKV keeps (and may edit) its own
        if full and not mask.any():
            # All-False means "already stored" or "no block could be reserved" (no put of
            # ours writes this key: checked above). Its get matches ready blocks only: ask
            # it. Cancelling the probe releases the locks its match took.
            try:
                probe_id, probe = manager.get_match(tokens, namespace=list(namespace))
                manager.cancel([probe_id])
            except BaseException:
                # The put's id never reaches the engine, which could not cancel it.
                with contextlib.suppress(Exception):
                    manager.cancel([task_id])
                raise
            ready = int(np.count_nonzero(probe))
            if ready < full:
                manager.cancel([task_id])
                raise NoSpace(
                    f"FlexKV reserved no block for {full - ready} new tokens "
                    f"(cpu cache full, all blocks locked, or another client's put of "
                    f"them still in flight)"
                )
        self._kind[task_id], self._mask[task_id] = "put", mask
        if mask.any():
            self._writing[task_id] = (names, tokens)
            self._keys.put_matched(task_id, key, int(np.count_nonzero(mask)))
        return task_id, mask

    def _shares_a_put_in_flight(self, names: tuple[str, ...], tokens: Int64Array) -> bool:
        """Whether a put of this store, matched and not yet answered, writes this key's
        first page (and so the start of its path in FlexKV's tree). Puts of other FlexKV
        clients are not known here."""
        page = self.page_size
        for other_names, other in self._writing.values():
            if other_names == names and len(other) >= page and np.array_equal(
                    other[:page], tokens[:page]):
                return True
        return False

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        manager = self._live()
        namespace = self._keys.namespace(namespace)
        tokens = np.ascontiguousarray(token_ids, dtype=np.int64)
        task_id, raw = manager.get_match(tokens, namespace=list(namespace))
        mask = np.array(raw, dtype=np.bool_)
        self._kind[task_id], self._mask[task_id] = "get", mask
        return task_id, mask

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        manager = self._live()
        gets = [self._kind.get(t) == "get" for t in task_ids]
        # One copy for the launch, every page id checked.
        slot_mappings, errors = self._slots.slots(pages, ready, gets, self.page_size)
        good = [i for i in range(len(task_ids)) if i not in errors]
        # Check everything first: a launch that fails half-way would leave running tasks
        # nobody waits on.
        groups, empty = group_launch(
            [task_ids[i] for i in good], [slot_mappings[i] for i in good], self._kind, self._mask
        )
        launched_any = False
        for kind in ("get", "put"):  # loads first, as the engine orders them
            group = groups[kind]
            if not group:
                continue
            ids = [t for t, _ in group]
            try:
                launched = manager.launch(ids, [s for _, s in group], as_batch=len(ids) > 1)
            except Exception as exc:
                if not launched_any:
                    raise  # nothing launched: every id is still matched (the contract)
                # The loads already run, so this launch cannot raise: the offloads fail
                # alone, through try_wait, and their matches are rolled back.
                log.exception("aiokv: FlexKV launch of %d %s tasks failed", len(ids), kind)
                self._fail_matched(ids, f"FlexKV launch failed: {exc!r}")
                continue
            launched_any = True
            for t in ids:  # launched: no longer matched (only now, if launch raised above)
                del self._kind[t]
            if len(ids) > 1:
                (batch_id,) = launched  # sub-task ids are gone inside FlexKV now
                self._members[batch_id] = ids
                self._owner.update((t, batch_id) for t in ids)
            else:
                self._members[ids[0]] = ids
                self._owner[ids[0]] = ids[0]
        if empty:  # nothing to move: FlexKV already finished them; release them
            try:
                manager.cancel(empty)
            except Exception:
                if not launched_any:
                    raise  # nothing launched: every id is still matched (the contract)
                # Raising now would report launched tasks as not launched. The empties'
                # answer does not depend on this release.
                log.exception("aiokv: FlexKV cancel of %d empty tasks failed", len(empty))
        for task_id in empty:
            del self._kind[task_id]
            self._done[task_id] = TaskResult(TaskStatus.SUCCESS, self._mask.pop(task_id))
        for index, error in errors.items():  # bad page ids: those tasks alone, matched
            self._fail_matched([task_ids[index]], error, TaskStatus.INVALID)

    def _fail_matched(
        self, task_ids: list[int], error: str, status: TaskStatus = TaskStatus.FAILED
    ) -> None:
        """Roll back matched ids and answer them ``status`` through try_wait."""
        try:
            self.cancel(task_ids)
        except Exception:
            log.exception("aiokv: FlexKV cancel of %s failed", task_ids)
            self._forget([t for t in task_ids if t in self._kind])  # answered below
        for t in task_ids:
            self._done[t] = TaskResult(status, None, error)

    def cancel(self, task_ids: Sequence[int]) -> None:
        manager = self._live()
        running = [t for t in task_ids if t in self._owner or t in self._done]
        if running:  # FlexKV would forget them while their copies run on
            raise ValueError(f"cannot cancel launched tasks {running}")
        known = [t for t in task_ids if t in self._kind]
        if known:
            # Rolls back the match (unlocks, frees reserved blocks). First: should it
            # raise, the engine asks again (its owed cancels), and the ids are still ours.
            manager.cancel(known)
        self._forget(known)

    def _forget(self, task_ids: Sequence[int]) -> None:
        """Matched ids rolled back in FlexKV (or given up on): no longer ours."""
        for t in task_ids:
            self._kind.pop(t, None)
            self._mask.pop(t, None)
            self._writing.pop(t, None)
        self._keys.forget(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        if self._manager is not None and not self._closed:
            self._poll({self._owner[t] for t in task_ids if t in self._owner})
        out: dict[int, TaskResult] = {}
        for t in task_ids:
            if t in self._done:
                out[t] = self._done.pop(t)  # handed out once
            elif t not in self._owner and t not in self._kind:
                out[t] = unknown_task(t)
        return out

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._manager is not None:
                if self._kind:  # open matches: roll them back before shutdown
                    self._manager.cancel(list(self._kind))
                    self._kind.clear()
                # Launched copies write into the caller's GPU pages: wait them out.
                self._wait_launched()
        finally:
            self._closed = True
            self._yield = no_yield
            self._shutdown()

    def store_stats(self) -> dict[str, int]:
        """The device-to-host copies its launches' slot mappings took (base.ReportsStats)."""
        return {"d2h_copies": self._slots.copier.d2h_copies}

    def evict(self, namespace: Sequence[str]) -> int:
        """Stop matching the key's blocks (a new generation of its namespace, :mod:`.keys`:
        the blocks stay until FlexKV's LRU takes them); returns the tokens this adapter's
        puts wrote under it since its last evict or clear."""
        self._live()
        return self._keys.evict(namespace)

    def clear(self) -> int:
        """Drop everything FlexKV holds, on every tier (``KVManager.reset``), once no task
        of this adapter is in flight: open matches are rolled back, launched tasks waited
        for (their answers still come through try_wait). Returns the tokens this
        adapter's puts wrote since the last clear. Raises RuntimeError (a StoreError to
        the engine's caller) if launched tasks do not end in time; nothing is reset then."""
        manager = self._live()
        if self._kind:  # the engine gives its reservations back first: a direct caller's
            self.cancel(list(self._kind))
        if not self._wait_launched():
            raise RuntimeError(f"FlexKV tasks {sorted(self._members)} still running: not cleared")
        try:
            manager.reset()  # FlexKV only warns if transfers run: none of ours does now
        except Exception:
            # Whatever reset dropped or not, a new generation for every key means no old
            # block is matched again (see .keys for the known failure).
            log.warning("aiokv: FlexKV's reset() failed; every key moves to a new namespace "
                        "generation (old blocks stay until FlexKV's LRU takes them)",
                        exc_info=True)
            return self._keys.clear(reset=False)
        return self._keys.clear()

    # ---- internals -------------------------------------------------------------------

    def _wait_launched(self) -> bool:
        """Poll until no launched task is unanswered (or a minute passes); whether none is."""
        deadline = time.monotonic() + max(60.0, self._ready_timeout_s)
        while self._members and time.monotonic() < deadline:
            self._poll(set(self._members))
            time.sleep(_POLL_S)
        return not self._members

    def _live(self) -> Any:
        if self._closed or self._manager is None:
            raise RuntimeError("FlexKVStore is closed or not registered")
        return self._manager

    def _poll(self, flexkv_ids: set[int]) -> None:
        """One non-blocking FlexKV try_wait; cache terminal answers per original id."""
        if not flexkv_ids:
            return
        from flexkv.common.request import KVResponseStatus

        ids = sorted(flexkv_ids)
        if self._completely:
            # Non-blocking (timeout 0.0); a task not done answers TIMEOUT and is kept.
            answers = self._manager.wait(ids, timeout=0.0, completely=True) or {}
            pending = KVResponseStatus.TIMEOUT
            responses = {f: r for f, r in answers.items() if r.status is not pending}
        else:
            responses = self._manager.try_wait(ids)
        if responses:
            self._yield()
        for fid, response in responses.items():
            members = self._members.pop(fid, None)
            if members is None:
                continue
            masks = [self._mask.pop(t) for t in members]
            results = response_results(fid, response, KVResponseStatus.NOTFOUND, masks)
            for t, result in zip(members, results, strict=True):
                self._owner.pop(t, None)
                self._writing.pop(t, None)
                self._keys.put_ended(t, result.status is TaskStatus.SUCCESS)
                self._done[t] = result

    def _shutdown(self) -> None:
        manager, self._manager = self._manager, None
        try:
            if manager is not None:
                manager.shutdown()
        finally:
            client, self._tp_client = self._tp_client, None
            close_client(client)
            self._caches = []
            for path in self._socket_files:
                with contextlib.suppress(OSError):
                    os.unlink(path)

