"""FaultyStore: a wrapper that injects faults into the store it wraps, by knob or at
random from a seed. Import it (and :class:`InjectedFault`, :func:`no_space`,
:data:`VERBS`) from :mod:`aiokv.testing`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .stores.base import BoolArray, Int64Array, NoSpace, Store, TaskResult, TaskStatus
from .stores.wrapper import StoreWrapper

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

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        self._enter("launch")
        if self.launch_error is not None:
            raise self.launch_error
        self.inner.launch(task_ids, pages, ready)
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
