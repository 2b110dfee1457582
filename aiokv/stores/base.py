"""The Store protocol: what the engine's store thread drives.

The verbs are FlexKV's (``put_match``/``get_match``/``launch``/``cancel``/``try_wait``) so
that :class:`~aiokv.stores.flexkv.FlexKVStore` stays a thin adapter. Every method is
called from one thread, the engine's ``aiokv-store`` thread; a store needs no locking
against the engine, only against threads of its own.

Contract, for any store:

- ``put_match`` / ``get_match`` return ``(task_id, mask)``; ``mask`` is ``np.bool_`` with one
  entry per token. For a put, True means "must write" (the positions not yet stored); for
  a get, True means "will load". Masks are page aligned and a trailing partial page is
  never stored.
- Every id a match returns is passed to ``launch`` or ``cancel`` exactly once. A matched
  id that is neither may hold store blocks forever.
- ``launch`` takes, per task, the int64 slots (``page * page_size + offset``) of exactly
  the True positions of that task's mask, and must not block on the copy. It is all or
  nothing: a launch that raises has launched none of its ids, which stay matched (the
  engine then cancels them).
- ``try_wait`` answers only the ids that are terminal, each once; it never blocks.
- ``put_match`` raises :class:`NoSpace` when there is something new to write and no block
  can be reserved for it (instead of answering an all-False mask that reads as success).

Optional: a store with ``set_notify(callback)`` calls ``callback()`` from any thread
whenever tasks may have become terminal; the engine then waits for that instead of
polling ``try_wait`` every ``poll_interval_us`` (LocalStore and ProcessStore do; FlexKV
is polled).

Optional: ``put_match_many(requests)``, ``put_match`` for each ``(token_ids, namespace)``
in order, answering each one's ``(task_id, mask)`` or the exception its ``put_match``
raised (an exception of the whole call fails them all). The store thread then matches an
offload batch in one call (ProcessStore: one round trip instead of one per request).

Optional: ``store_slice_us``, a store's advice for ``EngineConfig.store_slice_us`` (used
when the config leaves it None): how long the store thread may run, holding the GIL,
before it hands it to a waiting event loop. For stores whose calls run Python for long
(FlexKV: 200); without it (or None), 0.

Optional: a store with ``set_yield(callback)`` calls ``callback()`` at points inside its
own calls where the store thread may hand the GIL to the event loop (between a long
stretch of someone else's Python and its own, say), and the callback does so when
``EngineConfig.store_slice_us`` is set and used up (FlexKVStore calls it between
FlexKV's answers and its own fan-out of them). The callback is for the store thread
only, inside the store's calls: each engine passes its own when its store thread
starts and a no-op when it ends.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

BoolArray = npt.NDArray[np.bool_]
Int64Array = npt.NDArray[np.int64]


class TaskStatus(enum.Enum):
    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class TaskResult:
    """The terminal answer for one task id.

    ``mask`` is the task's mask as the store reports it (for FlexKV, the mask of the
    sub-task inside a merged batch); ``error`` says why a FAILED task failed.
    """

    status: TaskStatus
    mask: BoolArray | None = None
    error: str = ""


def no_yield() -> None:
    """A store's yield point (set_yield) when no store thread is behind it."""


class NoSpace(Exception):
    """Raised by ``put_match`` when nothing new can be reserved (store full, all locked)."""


@runtime_checkable
class Store(Protocol):
    """What the engine drives. See the module docstring for the contract."""

    @property
    def page_size(self) -> int:
        """Tokens per page; may be 0 until ``register`` takes it from the caches."""
        ...

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None: ...

    def put_match(
        self, token_ids: Int64Array, namespace: Sequence[str]
    ) -> tuple[int, BoolArray]: ...

    def get_match(
        self, token_ids: Int64Array, namespace: Sequence[str]
    ) -> tuple[int, BoolArray]: ...

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[Int64Array]) -> None: ...

    def cancel(self, task_ids: Sequence[int]) -> None: ...

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, TaskResult]: ...

    def close(self) -> None: ...
