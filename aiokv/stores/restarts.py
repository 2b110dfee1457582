"""Restarts of :class:`~aiokv.stores.process.ProcessStore`'s child: how many, how soon,
and the task ids across children.

A child that died is replaced (``StoreConfig.store_restarts``), and the new child's store
numbers its tasks from the start again, while the engine still holds ids of the old one
(launched tasks it polls, lookup reservations). So the ids the engine sees carry the
child's generation: generation ``g``'s ids are its store's plus ``g * STRIDE``. An id of
an older generation is never passed to the new child: its ``try_wait`` answers FAILED
with how its child ended, its ``cancel`` is a no-op (the child took its blocks with it),
its ``launch`` raises StoreError. The first child's ids go through unchanged.

When: a call finds the child dead (it fails, naming the exit code or signal: the engine
fails what it had launched), or the notice channel closes with it; the next call starts
the new child, which registers the caches again and starts empty. ``store_restarts``
attempts over the store's life, with backoff; then the store is down for good: every
call raises StoreError saying so. None once the engine's close began (``closing``): a
new child would only serve the close's own calls. The dead child's ids are retired when its death is
handled, whether or not a new child follows: a store down for good still answers them
(FAILED, and their cancel is a no-op), so that the engine lets them go. A child that is
alive but does not answer is not restarted.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence

from ..errors import StoreError
from .base import BoolArray, MatchAnswers, TaskResult, TaskStatus

log = logging.getLogger("aiokv")

STRIDE = 1 << 40  # ids of one child's store stay below this (a counter from 0 or 1)
_BACKOFF_S, _BACKOFF_MAX_S = 0.1, 5.0


def restart_delay_s(attempt: int) -> float:
    """The wait before restart attempt ``attempt`` (1, 2, ...): doubling from 0.1 s, up
    to 5 s, so that a child dying at start does not spin."""
    return float(min(_BACKOFF_S * 2 ** (attempt - 1), _BACKOFF_MAX_S))


def how_it_ended(pid: int, returncode: int | None) -> str:
    """A child's end in words: its exit code, or the signal that killed it."""
    if returncode is None:
        return f"the store process (pid {pid}) is not answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"the store process (pid {pid}) was killed by signal {-returncode} ({name})"
    return f"the store process (pid {pid}) exited with code {returncode}"


class Generations:
    """The current child's id offset and how each earlier child ended."""

    def __init__(self) -> None:
        self.base = 0  # added to the current child's ids
        self._ended: dict[int, str] = {}  # generation -> how its child ended

    def retire(self, why: str) -> None:
        """The current child ended (``why``); the next one's ids start a new generation."""
        self._ended[self.base // STRIDE] = why
        self.base += STRIDE

    def why(self, task_id: int) -> str:
        return self._ended.get(task_id // STRIDE, "an earlier store process ended")

    def split(self, task_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(the current child's own ids among ``task_ids``, the older ids)."""
        base = self.base
        if not base:
            return list(task_ids), []
        return [t - base for t in task_ids if t >= base], [t for t in task_ids if t < base]

    def matches(self, answers: MatchAnswers) -> MatchAnswers:
        """A match of many's answers with the current generation's ids."""
        base = self.base
        if not base:
            return answers
        return [a if isinstance(a, Exception) else (a[0] + base, a[1]) for a in answers]

    def match(self, answer: tuple[int, BoolArray]) -> tuple[int, BoolArray]:
        return answer[0] + self.base, answer[1]

    def died(self, task_ids: Sequence[int], old: Sequence[int], why: str) -> dict[int, TaskResult]:
        """try_wait's answers when the current child died during it: all FAILED."""
        died = TaskResult(TaskStatus.FAILED, None, why)
        return {**dict.fromkeys(task_ids, died), **self.results({}, old)}

    def results(
        self, fresh: dict[int, TaskResult], old: Sequence[int]
    ) -> dict[int, TaskResult]:
        """try_wait's answers: the child's (its ids moved to this generation), then every
        older id FAILED with how its child ended."""
        base = self.base
        out = {t + base: r for t, r in fresh.items()} if base else fresh
        for task_id in old:
            out[task_id] = TaskResult(TaskStatus.FAILED, None, self.why(task_id))
        return out


class Restarts:
    """The restart budget of one store (``limit`` attempts over its life) and its ids."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.attempts = 0
        self.count = 0  # restarts that gave a serving child
        self.ids = Generations()

    def run(
        self, why: str, start: Callable[[], None], closing: Callable[[], bool] = lambda: False
    ) -> None:
        """Start a new child (``start``) after one ended (``why``): attempts with backoff
        while the budget lasts; StoreError, naming the end and the budget, when none is
        left or every attempt left failed, or naming the close once ``closing()`` (no
        child is started for a store about to close). The dead child's ids are retired
        first, in every case: they name blocks that died with it."""
        self.ids.retire(why)
        reason = why
        while self.attempts < self.limit and not closing():
            self.attempts += 1
            time.sleep(restart_delay_s(self.attempts))  # the store thread must wait anyway
            if closing():
                break
            try:
                start()
            except Exception as exc:
                if closing():
                    break  # cut short by the close (ProcessStore.closing kills the child)
                log.warning("aiokv: restart %d of the store process failed", self.attempts,
                            exc_info=True)
                reason = f"{why}; restart {self.attempts} of {self.limit} failed: {exc!r}"
                continue
            self.count += 1
            return
        if closing():
            raise StoreError(f"{reason}; not restarted: the engine is closing")
        raise StoreError(f"{reason}; no restart left (store.store_restarts={self.limit})")
