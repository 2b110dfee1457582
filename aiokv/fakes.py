"""Fake stores for tests and benchmarks: :class:`FakeStore` keeps only token counts and
moves nothing; :class:`LayeredStore` keeps the bytes and loads them layer by layer.
Import them from :mod:`aiokv.testing`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .copy.marks import LayerMarks
from .copy.plan import check_pages
from .stores.base import BoolArray, Int64Array, TaskResult, TaskStatus


class FakeStore:
    """Keeps only how many tokens of each key it holds; moves no data and completes
    every launched task at the next ``try_wait``. For overhead benchmarks and for tests
    of engine logic that do not need bytes to move. Keys are namespaces: unlike
    LocalStore's, which are (namespace, token bytes) prefixes of whole pages, other
    ``token_ids`` under one namespace are the same key here. Page ids are checked as a
    real store checks them (a bad one fails its task alone, INVALID), and a put of pages
    another put is still writing matches none of them, as in LocalStore."""

    def __init__(self, page_size: int = 0) -> None:
        self.page_size = page_size
        self._pages = 0  # the caches' pages, from register
        self._stored: dict[tuple[str, ...], int] = {}
        self._writing: dict[tuple[str, ...], dict[int, int]] = {}  # key -> open put -> end
        self._tasks: dict[int, tuple[bool, tuple[str, ...], int, BoolArray]] = {}
        self._launched: list[int] = []
        self._finished: dict[int, TaskResult] = {}
        self._next = 0

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.page_size = self.page_size or int(kv_caches[0].shape[2])
        self._pages = int(kv_caches[0].shape[0])

    def _task(self, is_put: bool, namespace: Sequence[str], end: int, mask: BoolArray) -> int:
        self._next += 1
        self._tasks[self._next] = (is_put, tuple(namespace), end, mask)
        return self._next

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        key = tuple(namespace)
        full = len(token_ids) // self.page_size * self.page_size
        writing = self._writing.get(key, {})
        have = min(max(self._stored.get(key, 0), *writing.values(), 0), full)
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        mask[have:full] = True
        task_id = self._task(True, namespace, full, mask)
        if have < full:
            self._writing.setdefault(key, {})[task_id] = full
        return task_id, mask

    def _done_writing(self, task_id: int, key: tuple[str, ...]) -> None:
        writing = self._writing.get(key)
        if writing is not None and writing.pop(task_id, None) is not None and not writing:
            del self._writing[key]

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        full = len(token_ids) // self.page_size * self.page_size
        have = min(self._stored.get(tuple(namespace), 0), full)
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        mask[:have] = True
        return self._task(False, namespace, have, mask), mask

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        for task_id, page_ids in zip(task_ids, pages, strict=True):
            if len(page_ids) * self.page_size != np.count_nonzero(self._tasks[task_id][3]):
                raise ValueError(f"task {task_id}: wrong number of page ids")
        if len(ready) != len(task_ids):
            raise ValueError("launch: one ready event per task id")
        for task_id, page_ids in zip(task_ids, pages, strict=True):
            is_put = self._tasks[task_id][0]
            ids = torch.as_tensor(page_ids).reshape(-1).to("cpu", torch.int64).numpy()
            error = check_pages(ids, self._pages, once=not is_put) if self._pages else None
            if error is None:
                self._launched.append(task_id)
            else:  # its own fault, and only its own
                self._done_writing(task_id, self._tasks.pop(task_id)[1])
                self._finished[task_id] = TaskResult(TaskStatus.INVALID, error=error)

    def cancel(self, task_ids: Sequence[int]) -> None:
        for task_id in task_ids:
            task = self._tasks.pop(task_id, None)
            if task is not None:
                self._done_writing(task_id, task[1])

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        done: dict[int, TaskResult] = {}
        for task_id in self._launched:
            is_put, namespace, end, mask = self._tasks.pop(task_id)
            if is_put:
                self._stored[namespace] = max(self._stored.get(namespace, 0), end)
                self._done_writing(task_id, namespace)
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
        self._writing.clear()


class LayeredStore:
    """Keeps the bytes of each key (by namespace, as :class:`FakeStore` keys them) and
    loads them layer by layer on a copy thread of its own, marking each layer as it
    lands (``layer_marks``, stores.base.MarksLayers): a store for tests and smoke runs of
    ``engine.load_layerwise``. Offloads are copied at launch, on the store thread.

    ``marks=False``: ``layer_marks`` answers None, as a store that marks a load's layers
    only at its end. Set ``gate`` to a ``threading.Semaphore``: each layer's copy takes a
    permit first (a test holds layers back and lets them through one by one). Set
    ``fail_at_layer``: loads fail there, the layers before it copied. Caches on the CPU,
    or a GPU (each layer is synchronized before it is marked).
    """

    def __init__(self, marks: bool = True) -> None:
        self.page_size = 0
        self.marks = marks
        self.gate: threading.Semaphore | None = None
        self.fail_at_layer: int | None = None
        self._caches: list[torch.Tensor] = []
        self._stored: dict[tuple[str, ...], torch.Tensor] = {}  # [page, layer, ...] on the CPU
        self._tasks: dict[int, tuple[bool, tuple[str, ...], BoolArray]] = {}
        self._marks: dict[int, LayerMarks] = {}  # launched loads' marks, until asked for
        self._lock = threading.Lock()  # _finished: written by the copy thread too
        self._finished: dict[int, TaskResult] = {}
        self._jobs: queue.SimpleQueue[tuple[int, torch.Tensor, torch.Tensor, LayerMarks] | None]
        self._jobs = queue.SimpleQueue()
        self._notify: Callable[[], None] = _nothing
        self._next = 0
        # A daemon: a gate a test left closed must hang neither its close nor the end of
        # the test session.
        self._thread = threading.Thread(target=self._copy_loads, name="aiokv-test-layers",
                                        daemon=True)

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._caches = list(kv_caches)
        self.page_size = int(kv_caches[0].shape[2])
        self._thread.start()

    def set_notify(self, callback: Callable[[], None]) -> None:
        self._notify = callback

    def _match(
        self, is_put: bool, token_ids: Int64Array, namespace: Sequence[str]
    ) -> tuple[int, BoolArray]:
        key = tuple(namespace)
        full = len(token_ids) // self.page_size * self.page_size
        stored = self._stored.get(key)
        have = min(0 if stored is None else stored.shape[0] * self.page_size, full)
        if is_put:  # pages another put is still to write: not this one's (as LocalStore)
            writing = [int(np.flatnonzero(mask)[-1]) + 1 for put, k, mask in self._tasks.values()
                       if put and k == key and mask.any()]
            have = min(max([have, *writing]), full)
        mask = np.zeros(len(token_ids), dtype=np.bool_)
        mask[have:full] = is_put
        mask[:have] = not is_put
        self._next += 1
        self._tasks[self._next] = (is_put, key, mask)
        return self._next, mask

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        return self._match(True, token_ids, namespace)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> tuple[int, BoolArray]:
        return self._match(False, token_ids, namespace)

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        for task_id, given, event in zip(task_ids, pages, ready, strict=True):
            is_put, key, mask = self._tasks[task_id]
            if event is not None:
                event.synchronize()  # the caller's pages (and ids) are written
            page_ids = given.reshape(-1).to("cpu", torch.int64)
            error = check_pages(page_ids.numpy(), self._caches[0].shape[0], once=not is_put)
            if error is not None:
                self._end(task_id, TaskResult(TaskStatus.INVALID, error=error))
            elif is_put:
                new = torch.stack([cache[page_ids].cpu() for cache in self._caches], dim=1)
                old = self._stored.get(key)
                held = 0 if old is None else old.shape[0]
                start = int(np.argmax(mask)) // self.page_size if mask.any() else held
                if start != held:  # the put it followed was cancelled: a hole before it
                    self._end(task_id, TaskResult(
                        TaskStatus.FAILED, error="the put of the pages before it ended unwritten"))
                    continue
                self._stored[key] = new if old is None else torch.cat([old, new])
                self._end(task_id, TaskResult(TaskStatus.SUCCESS))
            else:
                marks = LayerMarks(len(self._caches))
                self._marks[task_id] = marks
                self._jobs.put((task_id, self._stored[key][: len(page_ids)], page_ids, marks))

    def layer_marks(self, task_id: int) -> LayerMarks | None:
        marks = self._marks.pop(task_id, None)
        return marks if self.marks else None

    def cancel(self, task_ids: Sequence[int]) -> None:
        for task_id in task_ids:
            self._tasks.pop(task_id, None)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        with self._lock:
            done = {t: self._finished.pop(t) for t in task_ids if t in self._finished}
        for task_id in done:
            self._tasks.pop(task_id, None)
            self._marks.pop(task_id, None)  # a plain load's, never asked for
        return done

    def evict(self, namespace: Sequence[str]) -> int:
        stored = self._stored.pop(tuple(namespace), None)
        return 0 if stored is None else stored.shape[0] * self.page_size

    def clear(self) -> int:
        dropped = sum(stored.shape[0] for stored in self._stored.values()) * self.page_size
        self._stored.clear()
        return dropped

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=10.0)  # a gate left closed must not hang the test

    def _end(self, task_id: int, result: TaskResult) -> None:
        with self._lock:
            self._finished[task_id] = result
        self._notify()

    def _copy_loads(self) -> None:
        while (job := self._jobs.get()) is not None:
            task_id, data, page_ids, marks = job
            for layer, cache in enumerate(self._caches):
                if self.gate is not None:
                    self.gate.acquire()
                if layer == self.fail_at_layer:
                    marks.fail(f"injected failure at layer {layer}")
                    self._end(task_id, TaskResult(TaskStatus.FAILED, error="injected"))
                    break
                cache[page_ids.to(cache.device)] = data[:, layer].to(cache.device)
                if cache.is_cuda:
                    torch.cuda.current_stream(cache.device).synchronize()
                marks.layer_done(layer)
            else:
                marks.finish()
                self._end(task_id, TaskResult(TaskStatus.SUCCESS))


def _nothing() -> None:
    """The notify callback until the engine sets one."""
