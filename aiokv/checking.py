"""CheckingStore: a wrapper that records every breach of the engine's side of the Store
contract. Import it from :mod:`aiokv.testing`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from .stores.base import BoolArray, Int64Array, Store, TaskResult
from .stores.wrapper import StoreWrapper


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

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        self._enter("launch")
        self._ending("launch", task_ids)
        self.inner.launch(task_ids, pages, ready)
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
