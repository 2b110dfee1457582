"""The store server's list of a connection's gets taken back by evicts stays as long as
the gets it still holds: an engine that looks up and lets go, but never loads, never asks
for it, and it grew by one id per evict of what that engine had looked up."""

from __future__ import annotations

import numpy as np

from aiokv.stores.shared.tasks import Client, Task


def a_get() -> Task:
    return Task(client=1, is_put=False, mask=np.ones(1, dtype=np.bool_),
                blocks=np.zeros(0, dtype=np.int64), digests=[], space=None)


def test_the_ids_taken_back_are_kept_only_while_their_gets_are_held() -> None:
    client = Client(number=1, pid=0)
    client.tasks[0] = a_get()  # held throughout: its engine must still be told
    client.take_back([0], "evicted")
    for task_id in range(1, 1001):
        client.tasks[task_id] = a_get()
        client.take_back([task_id], "cleared")
        del client.tasks[task_id]  # released by its engine, which never asked
    assert len(client.invalidated) <= 2
    assert client.take_invalidated() == {0: "evicted"}
