"""The puts whose callers detached (:class:`~aiokv.stores.base.Detaches`), as a
:class:`~aiokv.stores.process.ProcessStore` tells its child: a table in shared memory that
the engine's loop thread writes and the child's store reads.

Why not a message: the child's socket carries one call at a time, the store thread's, and
a detach must be in place before its caller hears its error (it never blocks, and makes
no round trip). A message queued behind a call in flight could reach the child after it
took the put's copy in as done, and the store would keep pages the caller had reused. The
child reads the table as it takes a put's finished copy in (after the copy ended): a put
detached before then keeps nothing; one detached after it read the pages before its
caller was told anything.

Slot ``id % SLOTS`` holds the last child task id marked there: two puts in flight at
once whose ids differ by a multiple of SLOTS (that many matches apart) could lose the
older's detach. A new table comes with each child (its ids start again).
"""

from __future__ import annotations

import torch

SLOTS = 1 << 18  # 2 MiB of int64


class DetachTable:
    """``mark`` (the engine's process) and ``has`` (the child) a child's task id. Made in
    the engine's process; the child receives its tensor (shared memory) and wraps it."""

    def __init__(self, shared: torch.Tensor | None = None) -> None:
        # -1: no id (ids count from 0 or 1). An int64 store or load is atomic: a reader
        # sees the old id or the new one. Shared before it is viewed: sharing a storage
        # later moves its data, and a view taken before would write to freed memory.
        self.tensor = shared if shared is not None else torch.full(
            (SLOTS,), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._ids = self.tensor.numpy()

    def mark(self, task_id: int) -> None:
        self._ids[task_id % SLOTS] = task_id

    def has(self, task_id: int) -> bool:
        return int(self._ids[task_id % SLOTS]) == task_id
