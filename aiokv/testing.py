"""Stores for tests, yours and ours: a fast fake, a contract checker, a fault injector.

Each wraps or implements the Store protocol, so it drops into ``OffloadEngine(store, ...)``
like any store (the seam httpx's MockTransport gives a client).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .stores.base import (
    OPTIONAL_METHODS,
    BoolArray,
    Int64Array,
    NoSpace,
    Store,
    TaskResult,
    TaskStatus,
    store_restarts,
)


class FakeStore:
    """Keeps only how many tokens of each key it holds; moves no data and completes
    every launched task at the next ``try_wait``. For overhead benchmarks and for tests
    of engine logic that do not need bytes to move. Keys are (namespace, token bytes)
    prefixes of whole pages, as in LocalStore."""

    def __init__(self, page_size: int = 0) -> None:
        self.page_size = page_size
        self._stored: dict[tuple[str, ...], int] = {}
        self._tasks: dict[int, tuple[bool, tuple[str, ...], int, BoolArray]] = {}
        self._launched: list[int] = []
        self._finished: dict[int, TaskResult] = {}
        self._next = 0

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.page_size = self.page_size or int(kv_caches[0].shape[2])

    def _task(self, is_put: bool, namespace: Sequence[str], end: int, mask: BoolArray) -> int:
        self._next += 1
        self._tasks[self._next] = (is_put, tuple(namespace), end, mask)
        return self._next

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        full = len(token_ids) // self.page_size * self.page_size
        have = min(self._stored.get(tuple(namespace), 0), full)
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        mask[have:full] = True
        return self._task(True, namespace, full, mask), mask

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        full = len(token_ids) // self.page_size * self.page_size
        have = min(self._stored.get(tuple(namespace), 0), full)
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        mask[:have] = True
        return self._task(False, namespace, have, mask), mask

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        for task_id, slots in zip(task_ids, slot_mappings, strict=True):
            if len(slots) != np.count_nonzero(self._tasks[task_id][3]):
                raise ValueError(f"task {task_id}: wrong number of slots")
        self._launched.extend(task_ids)

    def cancel(self, task_ids: Sequence[int]) -> None:
        for task_id in task_ids:
            self._tasks.pop(task_id, None)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        done: dict[int, TaskResult] = {}
        for task_id in self._launched:
            is_put, namespace, end, mask = self._tasks.pop(task_id)
            if is_put:
                self._stored[namespace] = max(self._stored.get(namespace, 0), end)
            done[task_id] = TaskResult(TaskStatus.SUCCESS, mask)
        self._launched.clear()
        self._finished.update(done)
        return {t: self._finished.pop(t) for t in task_ids if t in self._finished}

    def evict(self, namespace: Sequence[str]) -> int:
        """Forget the key's tokens; returns how many it held."""
        return self._stored.pop(tuple(namespace), 0)

    def clear(self) -> int:
        """Forget every key; returns the tokens they held."""
        dropped = sum(self._stored.values())
        self._stored.clear()
        return dropped

    def close(self) -> None:
        self._tasks.clear()


class StoreWrapper:
    """Forwards every Store call to ``inner``; subclass it and override what you wrap
    (the wrappers below, and your own: tracing, timing, faults).

    The optional capabilities are forwarded too when ``inner`` has them: ``set_notify``,
    so a wrapped LocalStore still wakes the store thread when a copy ends instead of being
    polled every ``poll_interval_us``. A wrapper that can hold back a finished task's answer
    (FaultyStore's ``hold``) sets ``forward_notify = False``: the store thread then polls
    it, and sees the answer once the wrapper lets it through.
    """

    forward_notify: ClassVar[bool] = True
    set_notify: Callable[[Callable[[], None]], None] | None
    set_yield: Callable[[Callable[[], None]], None] | None
    put_match_many: Callable[..., list[Any]] | None
    get_match_many: Callable[..., list[Any]] | None
    evict: Callable[[Sequence[str]], int] | None
    clear: Callable[[], int] | None
    store_stats: Callable[[], Mapping[str, int | float]] | None

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        # Each optional capability (stores/base.py) is the inner store's, or None where it
        # has none, unless this wrapper defines its own. A match of many is forwarded only
        # while the wrapper leaves the one-by-one verb alone (each match must go through
        # a wrapped put_match/get_match); a notice, unless forward_notify is off.
        own = type(self)
        for name in OPTIONAL_METHODS:
            if getattr(own, name, None) is not None:
                continue
            method = getattr(inner, name, None)
            verb = name.removesuffix("_many")
            wraps_verb = verb != name and getattr(own, verb) is not getattr(StoreWrapper, verb)
            if (name == "set_notify" and not self.forward_notify) or wraps_verb:
                method = None
            setattr(self, name, method if callable(method) else None)

    @property
    def page_size(self) -> int:
        return self.inner.page_size

    @property
    def restarts(self) -> int:
        """The inner store's restarts (stores/base.py: Restarts), 0 without any."""
        return store_restarts(self.inner)

    @property
    def store_slice_us(self) -> int | None:
        """The inner store's advice for EngineConfig.store_slice_us (None without one)."""
        advice: int | None = getattr(self.inner, "store_slice_us", None)
        return advice

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.inner.register(kv_caches)

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        return self.inner.put_match(token_ids, namespace)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        return self.inner.get_match(token_ids, namespace)

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        self.inner.launch(task_ids, slot_mappings)

    def cancel(self, task_ids: Sequence[int]) -> None:
        self.inner.cancel(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        return self.inner.try_wait(task_ids)

    def close(self) -> None:
        self.inner.close()


class CheckingStore(StoreWrapper):
    """Wraps a store and records every breach of the engine's side of the contract:
    a call from a second thread or from the event loop's thread, a matched id launched or
    cancelled twice (or never, see :meth:`problems`), a launched id cancelled, waited after
    it was terminal, or never waited to the end."""

    def __init__(self, inner: Store, loop_thread: int | None = None) -> None:
        super().__init__(inner)
        self.loop_thread = loop_thread if loop_thread is not None else threading.get_ident()
        self.threads: set[int] = set()
        self.violations: list[str] = []
        self.matched: set[int] = set()
        self.launched: set[int] = set()
        self.cancelled: set[int] = set()
        self.terminal: set[int] = set()
        self.calls: dict[str, int] = {}

    def _enter(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        me = threading.get_ident()
        self.threads.add(me)
        if me == self.loop_thread:
            self.violations.append(f"{name} called on the event loop's thread")
        if len(self.threads) > 1:
            self.violations.append(f"{name} called from a second thread")

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._enter("register")
        self.inner.register(kv_caches)

    def _matched(self, result: tuple[int, BoolArray]) -> tuple[int, BoolArray]:
        if result[0] in self.matched:
            self.violations.append(f"store reused task id {result[0]}")
        self.matched.add(result[0])
        return result

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self._enter("put_match")
        return self._matched(self.inner.put_match(token_ids, namespace))

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self._enter("get_match")
        return self._matched(self.inner.get_match(token_ids, namespace))

    def _ending(self, verb: str, task_ids: Sequence[int]) -> None:
        for task_id in task_ids:
            if task_id not in self.matched:
                self.violations.append(f"{verb} of unmatched id {task_id}")
            if task_id in self.launched or task_id in self.cancelled:
                self.violations.append(f"{verb} of id {task_id}, already launched or cancelled")

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        self._enter("launch")
        self._ending("launch", task_ids)
        self.inner.launch(task_ids, slot_mappings)
        self.launched.update(task_ids)

    def cancel(self, task_ids: Sequence[int]) -> None:
        self._enter("cancel")
        self._ending("cancel", task_ids)
        self.inner.cancel(task_ids)
        self.cancelled.update(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        self._enter("try_wait")
        for task_id in task_ids:
            if task_id not in self.launched:
                self.violations.append(f"try_wait of id {task_id} that was never launched")
            if task_id in self.terminal:
                self.violations.append(f"try_wait of id {task_id} after its terminal answer")
        results = self.inner.try_wait(task_ids)
        self.terminal.update(results)
        return results

    def close(self) -> None:
        self._enter("close")
        self.inner.close()

    def problems(self) -> list[str]:
        """Violations, plus ids never launched nor cancelled and launched ids never
        terminal. Call after the engine closed."""
        found = list(self.violations)
        for task_id in sorted(self.matched - self.launched - self.cancelled):
            found.append(f"id {task_id} matched but never launched nor cancelled")
        for task_id in sorted(self.launched - self.terminal):
            found.append(f"id {task_id} launched but never waited to a terminal answer")
        return found


VERBS = ("put_match", "get_match", "launch", "cancel", "try_wait")


class InjectedFault(RuntimeError):
    """What FaultyStore raises on purpose (``error_rate``); the engine reports it as a
    StoreError whose message names it."""


class FaultyStore(StoreWrapper):
    """Wraps a store and injects faults, one knob each:

    - ``put_match_error`` / ``get_match_error``: raised by the next matches (NoSpace too);
    - ``no_space_for``: the next this many put_matches raise NoSpace (a store full for a
      while: each later match counts one down), counted as ``injected["no_space"]``;
    - ``fail_tasks``: launched tasks answer FAILED (after the real copy ends);
    - ``hold``: while this Event is clear, ``try_wait`` answers nothing (slow transfers);
    - ``launch_error``: raised by launch, before anything is launched.

    And at random, drawn from ``random.Random(seed)`` (keyword arguments):

    - ``fail_rate``: the fraction of launched tasks that answer FAILED ("injected
      failure") once their real copy ended;
    - ``error_rate``: the fraction of calls of each verb in ``error_verbs`` (default: all
      of :data:`VERBS`) that raise :class:`InjectedFault` before reaching the inner store
      (which so sees nothing of them: a launch took none of its ids, a cancel cancelled
      none, a try_wait lost no answer);
    - ``delay_s``: each task's terminal answer is held back for a uniform random time in
      ``[0, delay_s]`` after the inner store gave it (slow transfers, out of order);
    - ``call_delay_s``: each call sleeps a uniform random time in ``[0, call_delay_s]``
      first (a store slow to answer; the engine's store thread waits for it).

    ``launched`` is an Event set by each successful launch; ``injected`` counts what was
    injected, by kind (``"failed"``, and each verb's name for its exceptions).
    """

    forward_notify = False  # answers held back by ``hold`` must be polled for

    def __init__(
        self,
        inner: Store,
        *,
        seed: int | None = None,
        fail_rate: float = 0.0,
        error_rate: float = 0.0,
        error_verbs: Sequence[str] = VERBS,
        delay_s: float = 0.0,
        call_delay_s: float = 0.0,
    ) -> None:
        super().__init__(inner)
        unknown = set(error_verbs) - set(VERBS)
        if unknown:
            raise ValueError(f"error_verbs: unknown verbs {sorted(unknown)}; known: {VERBS}")
        self.put_match_error: Exception | None = None
        self.no_space_for = 0
        self.get_match_error: Exception | None = None
        self.launch_error: Exception | None = None
        self.fail_tasks = False
        self.hold = threading.Event()
        self.hold.set()
        self.launched = threading.Event()  # set by every launch, for tests to wait on
        self.fail_rate = fail_rate
        self.error_rate = error_rate
        self.error_verbs = frozenset(error_verbs)
        self.delay_s = delay_s
        self.call_delay_s = call_delay_s
        self.injected: dict[str, int] = {}
        self._random = random.Random(seed)  # the store thread's alone, like every call
        self._doomed: set[int] = set()  # launched ids drawn to fail (fail_rate)
        self._answers: dict[int, tuple[float, TaskResult]] = {}  # held back: (due, answer)

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def _enter(self, verb: str) -> None:
        """The random faults of one call: its delay, then maybe its exception."""
        if self.call_delay_s:
            time.sleep(self._random.uniform(0.0, self.call_delay_s))
        if self.error_rate and verb in self.error_verbs and self._random.random() < self.error_rate:
            self._count(verb)
            raise InjectedFault(f"injected: {verb} failed")

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self._enter("put_match")
        if self.put_match_error is not None:
            raise self.put_match_error
        if self.no_space_for > 0:
            self.no_space_for -= 1
            self._count("no_space")
            raise no_space()
        return self.inner.put_match(token_ids, namespace)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        self._enter("get_match")
        if self.get_match_error is not None:
            raise self.get_match_error
        return self.inner.get_match(token_ids, namespace)

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None:
        self._enter("launch")
        if self.launch_error is not None:
            raise self.launch_error
        self.inner.launch(task_ids, slot_mappings)
        if self.fail_rate:
            self._doomed.update(t for t in task_ids if self._random.random() < self.fail_rate)
        self.launched.set()

    def cancel(self, task_ids: Sequence[int]) -> None:
        self._enter("cancel")
        self.inner.cancel(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        self._enter("try_wait")
        if not self.hold.is_set():
            return {}
        answers = self._answers
        results = self.inner.try_wait([t for t in task_ids if t not in answers])
        if self.fail_tasks or self._doomed:
            results = {t: self._failed(t, r) for t, r in results.items()}
        if not self.delay_s and not answers:
            return results
        now = time.monotonic()
        for task_id, result in results.items():
            answers[task_id] = (now + self._random.uniform(0.0, self.delay_s), result)
        due = [t for t in task_ids if t in answers and answers[t][0] <= now]
        return {t: answers.pop(t)[1] for t in due}

    def _failed(self, task_id: int, result: TaskResult) -> TaskResult:
        doomed = task_id in self._doomed
        self._doomed.discard(task_id)
        if doomed and result.status is TaskStatus.SUCCESS:
            self._count("failed")
        elif not self.fail_tasks:
            return result
        return TaskResult(TaskStatus.FAILED, result.mask, "injected failure")


def no_space() -> NoSpace:
    """The exception a store raises when it cannot reserve (for ``put_match_error``)."""
    return NoSpace("injected: no space")


class SharedStore(StoreWrapper):
    """Wraps a store so that several engines, one after another, can drive it (or an engine
    and code of your own, as the benchmarks do): it registers the inner store once and
    leaves closing it to its owner (``close_inner``)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._registered = False

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if not self._registered:
            self.inner.register(kv_caches)
            self._registered = True

    def close(self) -> None:
        """Left to the owner: see :meth:`close_inner`."""

    def close_inner(self) -> None:
        self.inner.close()


__all__ = [
    "VERBS",
    "CheckingStore",
    "FakeStore",
    "FaultyStore",
    "InjectedFault",
    "SharedStore",
    "StoreWrapper",
    "no_space",
]
