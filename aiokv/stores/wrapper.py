"""StoreWrapper: a store that forwards every call, and the optional capabilities it has,
to another store; the base of the wrappers in :mod:`aiokv.testing` and :mod:`aiokv.faults`
(and of yours). Import it from :mod:`aiokv.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from .base import (
    OPTIONAL_METHODS,
    BoolArray,
    Int64Array,
    Store,
    TaskResult,
    store_restarts,
)


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
    set_deadlines: Callable[[Sequence[int], Sequence[float]], None] | None
    parked: Callable[[Sequence[int]], list[int]] | None
    check_held: Callable[[], Mapping[int, str] | None] | None
    put_match_many: Callable[..., list[Any]] | None
    get_match_many: Callable[..., list[Any]] | None
    evict: Callable[[Sequence[str]], int] | None
    clear: Callable[[], int] | None
    store_stats: Callable[[], Mapping[str, int | float]] | None
    closing: Callable[[], None] | None
    terminate: Callable[[], None] | None
    detach: Callable[[int], None] | None

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

    def launch(
        self, task_ids: Sequence[int], pages: Sequence[torch.Tensor], ready: Sequence[Any]
    ) -> None:
        self.inner.launch(task_ids, pages, ready)

    def cancel(self, task_ids: Sequence[int]) -> None:
        self.inner.cancel(task_ids)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]:
        return self.inner.try_wait(task_ids)

    def close(self) -> None:
        self.inner.close()
