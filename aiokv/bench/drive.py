"""How the engine benchmark drives and times calls: a store wrapper that times each call, the
callers, and the per-request client that calls the store itself for each offload (the
baseline that batching is weighed against).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import EngineConfig
from ..requests import OffloadResult
from ..stores.base import Int64Array, Store, TaskStatus
from ..testing import FakeStore, StoreWrapper
from . import common


@dataclass(frozen=True)
class Settings:
    users: tuple[int, ...] = (1, 8, 64, 256)
    seconds: float = 2.0
    warmup_s: float = common.or_zero(0.3)
    pages: int = 4
    layers: int = 4
    page_size: int = 16
    heads: int = 2
    head_dim: int = 64
    dtype: str = "bf16"
    cpu_cache_gb: float = 0.25
    window_us: int = common.or_zero(EngineConfig.window_us)
    poll_interval_us: int = EngineConfig.poll_interval_us
    cpu_users: int = 64
    cpu_requests: int = 20_000



class TimedStore(StoreWrapper):
    """Wraps a store; adds up the CPU time (thread_time) spent inside its methods."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.cpu_s = 0.0
        self.calls = 0

    def _timed(self, method: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        start = time.thread_time()
        try:
            return method(*args)
        finally:
            self.cpu_s += time.thread_time() - start

    def put_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> Any:
        return self._timed(self.inner.put_match, token_ids, namespace)

    def get_match(self, token_ids: Int64Array, namespace: Sequence[str]) -> Any:
        return self._timed(self.inner.get_match, token_ids, namespace)

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        self._timed(self.inner.launch, task_ids, pages, ready)

    def cancel(self, task_ids: Sequence[int]) -> None:
        self._timed(self.inner.cancel, task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> Any:
        return self._timed(self.inner.try_wait, task_ids)


def timing_overhead_s(calls: int = 100_000) -> float:
    """CPU per TimedStore call spent outside the interval it measures (its own frames and
    half of each clock read: a system call). The engine would not pay it without the
    wrapper, yet it lands in the engine's share. Measured on the calling thread around a
    no-op (``FakeStore.cancel([])``); the no-op is subtracted twice (inside the interval
    and as the direct call), so this errs low by one no-op call, a few tens of ns."""
    inner = FakeStore()
    timed = TimedStore(inner)
    ids: list[int] = []
    start = time.thread_time()
    for _ in range(calls):
        inner.cancel(ids)
    direct = time.thread_time() - start
    start = time.thread_time()
    for _ in range(calls):
        timed.cancel(ids)
    wrapped = time.thread_time() - start
    return max(0.0, (wrapped - timed.cpu_s - direct) / calls)


@dataclass(frozen=True)
class Sample:
    requests: int
    wall_s: float
    cpu_s: float  # every thread of the process
    loop_cpu_s: float  # the event loop's thread alone
    started: float = 0.0  # time.perf_counter() as the window opened

    @property
    def per_second(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        return self.cpu_s / self.requests * 1e6 if self.requests else 0.0

    @property
    def loop_cpu_us(self) -> float:
        return self.loop_cpu_s / self.requests * 1e6 if self.requests else 0.0


async def drive(
    users: int,
    one_request: Callable[[int], Awaitable[None]],
    warmup_s: float,
    *,
    seconds: float | None = None,
    requests: int | None = None,
) -> Sample:
    """Run ``users`` closed-loop users of ``one_request(user)``; after ``warmup_s``,
    measure for ``seconds`` or until ``requests`` more completed. The users finish their
    request in flight before this returns; its errors propagate."""
    loop = asyncio.get_running_loop()
    done = 0
    stop = False
    goal: int | None = None
    reached: asyncio.Future[None] = loop.create_future()

    async def user(index: int) -> None:
        nonlocal done
        while not stop:
            await one_request(index)
            done += 1
            if goal is not None and done >= goal and not reached.done():
                reached.set_result(None)

    tasks = [asyncio.create_task(user(i), name=f"bench-user-{i}") for i in range(users)]
    try:
        await asyncio.sleep(warmup_s)
        start_done, start_wall, start_cpu = done, time.perf_counter(), time.process_time()
        start_loop_cpu = time.thread_time()  # drive() runs on the loop's thread
        if requests is not None:
            goal = start_done + requests
            await asyncio.wait([reached, *tasks], return_when=asyncio.FIRST_COMPLETED)
        else:
            # Returns early only if a user failed.
            await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
        sample = Sample(
            done - start_done,
            time.perf_counter() - start_wall,
            time.process_time() - start_cpu,
            time.thread_time() - start_loop_cpu,
            start_wall,
        )
    finally:
        stop = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return sample


class PerRequestClient:
    """The baseline: what a naive integration of the Store API looks like."""

    def __init__(self, store: Store, poll_interval_s: float) -> None:
        self._store = store
        self._poll_interval_s = poll_interval_s
        # One thread: every store call must come from the same thread.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "baseline-store")

    async def start(self, kv_caches: Sequence[torch.Tensor]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._store.register, kv_caches)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._store.close)
        self._executor.shutdown()

    async def offload(self, pages: Int64Array, num_tokens: int, namespace: list[str]) -> int:
        loop = asyncio.get_running_loop()
        stored: int = await loop.run_in_executor(
            self._executor, self._offload, pages, num_tokens, namespace
        )
        return stored

    def _offload(self, pages: Int64Array, num_tokens: int, namespace: list[str]) -> int:
        store = self._store
        page_size = store.page_size
        task_id, mask = store.put_match(np.arange(num_tokens, dtype=np.int64), namespace)
        if not mask.any():
            store.cancel([task_id])
            return 0
        new = mask[::page_size]  # the pages to write
        store.launch([task_id], [torch.from_numpy(pages[: len(new)][new])], [None])
        while (result := store.try_wait([task_id]).get(task_id)) is None:
            time.sleep(self._poll_interval_s)
        if result.status is not TaskStatus.SUCCESS:
            raise RuntimeError(f"baseline task {task_id}: {result.status} {result.error}")
        return int(mask.sum())


async def _callers_only(settings: Settings) -> Sample:
    """The harness alone: each request builds the same arguments as an engine user and
    awaits a future resolved on the next iteration with a result it checks."""
    loop = asyncio.get_running_loop()
    pages = torch.arange(settings.cpu_users * settings.pages).view(
        settings.cpu_users, settings.pages
    )
    tokens = settings.pages * settings.page_size
    names = itertools.count()
    result = OffloadResult(0, tokens, tokens)

    async def resolved_next_iteration(
        user: int, page_ids: torch.Tensor, num_tokens: int, *, namespace: list[str]
    ) -> OffloadResult:  # engine.offload's shape, without the engine
        future: asyncio.Future[OffloadResult] = loop.create_future()
        loop.call_soon(future.set_result, result)
        return await future

    spans: list[tuple[float, float]] = []

    async def one(user: int) -> None:  # as _engine's users do, call for call
        began = time.perf_counter()  # their span bookkeeping too: it is not the engine's
        got = await resolved_next_iteration(
            user, pages[user], tokens, namespace=[f"r{next(names)}"]
        )
        spans.append((began, time.perf_counter()))
        if got.stored_tokens != tokens:
            raise RuntimeError(f"stored {got.stored_tokens} of {tokens} tokens")

    return await drive(
        settings.cpu_users, one, settings.warmup_s, requests=settings.cpu_requests
    )
