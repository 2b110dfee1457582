"""When the store thread hands the GIL to the event loop.

The store thread holds the GIL while it runs Python (FlexKV's matching, answer
processing), and the event loop needs it for every callback. A thread that releases the
GIL for a moment (a syscall) takes it straight back before a waiting thread wakes, so on
its own this thread would hold the loop off for as long as it has work. Once it has run
``store_slice_us`` since it last blocked on its inbox or handed over, it sleeps
``_HANDOFF_S`` at the next point between store calls (or at a store's own yield point,
``set_yield``): long enough for a waiting loop to take the GIL and run (see
:meth:`GilSlice.hand_over`).
"""

from __future__ import annotations

import time

from ..config import EngineConfig, store_slice_from_advice

# The sleep that hands the GIL to a waiting loop: longer than a thread's wake-up, short
# next to a batch's copy (Linux adds its 50 µs timer slack).
_HANDOFF_S = 50e-6
_WAITED_S = 10e-6  # an inbox get that took longer blocked (an item in hand is far quicker)


class GilSlice:
    """The store thread's slice: how long it has run since it last blocked on its inbox
    or handed the GIL over (store thread only)."""

    __slots__ = ("_running_since", "_slice_s")

    def __init__(self, store_slice_us: int) -> None:
        self._slice_s = store_slice_us / 1e6  # 0: never hand the GIL over
        self._running_since = 0.0  # perf_counter at the last block or hand-over

    def restart(self) -> None:
        self._running_since = time.perf_counter()

    def waited(self, waited_s: float, now: float) -> None:
        """An inbox get took ``waited_s``: if it blocked, a waiting loop had its turn."""
        if waited_s > _WAITED_S:
            self._running_since = now

    def used(self) -> bool:
        """Whether this thread has run a slice since it last blocked or handed over."""
        return bool(self._slice_s) and time.perf_counter() - self._running_since > self._slice_s

    def yield_if_used(self) -> None:
        """Hand the GIL over if the slice is used: between store calls, and as the
        store's yield point (set_yield). Posts nothing: it may come in the middle of a
        batch, whose answers must all go out after it is handled."""
        if self.used():
            self.hand_over()

    def hand_over(self) -> None:
        """Sleep so that an event loop waiting for the GIL takes it. A release without a
        wait would not do: this thread would take the GIL back before the loop woke."""
        time.sleep(_HANDOFF_S)
        self._running_since = time.perf_counter()


def store_slice_us(config: EngineConfig, store: object) -> int:
    """The store thread's slice (EngineConfig.store_slice_us): the config's, else the
    store's advice (its ``store_slice_us``), else 0."""
    if config.store_slice_us is not None:
        return config.store_slice_us
    return store_slice_from_advice(getattr(store, "store_slice_us", None), type(store).__name__)
