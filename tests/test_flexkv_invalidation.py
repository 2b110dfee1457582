"""FlexKVStore.evict / clear against a fake KVManager with FlexKV's matching rules (runs
without FlexKV): evict moves the key to a namespace generation whose blocks nothing
matched before, counting from the adapter's records; clear waits for launched tasks,
then resets FlexKV."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from test_flexkv_launch import PAGE, IndexManager, flexkv_statuses, launch, pages, store

from aiokv.stores.base import TaskStatus
from aiokv.stores.flexkv import FlexKVStore

__all__ = ["flexkv_statuses"]  # the fixture, imported for the tests below

TOKENS = 2 * PAGE
pytestmark = pytest.mark.usefixtures("flexkv_statuses")


class GenerationManager(IndexManager):
    """IndexManager keyed by the whole namespace, with reset() and a try_wait that can
    hold its answers back (a copy still running)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.capacity = capacity
        self.namespaces: list[list[str]] = []
        self.resets = 0
        self.hold_polls = 0  # try_wait answers nothing this many more times

    def _blocks(self, tokens: np.ndarray, namespace: list[str]) -> list[tuple[str, bytes]]:
        self.namespaces.append(list(namespace))
        return [("/".join(namespace), tokens[: (i + 1) * PAGE].tobytes())
                for i in range(len(tokens) // PAGE)]

    def try_wait(self, ids: Sequence[int]) -> dict[int, object]:
        if self.hold_polls:
            self.hold_polls -= 1
            return {}
        return super().try_wait(ids)

    def reset(self) -> None:
        assert not self.running, "reset with transfers in flight"
        self.resets += 1
        self.ready.clear()
        self.tasks.clear()
        self.free = self.capacity


def put(flexkv: FlexKVStore, key: str) -> int:
    """A put of TOKENS under ``key``, launched; its id."""
    task_id, mask = flexkv.put_match(np.arange(TOKENS, dtype=np.int64), [key])
    assert mask.all()
    launch(flexkv, [task_id], [pages(2)])
    return task_id


def store_all(flexkv: FlexKVStore, *keys: str) -> None:
    """A put of TOKENS under each key, each waited to SUCCESS."""
    for key in keys:
        task_id = put(flexkv, key)
        assert flexkv.try_wait([task_id])[task_id].status is TaskStatus.SUCCESS


def cached(flexkv: FlexKVStore, key: str) -> int:
    task_id, mask = flexkv.get_match(np.arange(TOKENS, dtype=np.int64), [key])
    flexkv.cancel([task_id])
    return int(np.count_nonzero(mask))


def test_evict_moves_the_key_past_its_blocks_and_counts_what_its_puts_wrote() -> None:
    manager = GenerationManager(capacity=16)
    flexkv = store(manager)  # type: ignore[arg-type]
    store_all(flexkv, "a", "b")
    assert (cached(flexkv, "a"), cached(flexkv, "b")) == (TOKENS, TOKENS)
    assert flexkv.evict(["a"]) == TOKENS
    assert (cached(flexkv, "a"), cached(flexkv, "b")) == (0, TOKENS)
    assert manager.namespaces[-2][0] == "a" and manager.namespaces[-2][1].startswith("aiokv-gen:")
    assert flexkv.evict(["a"]) == 0  # nothing written since
    assert manager.free == 16 - 4  # not freed: the old blocks wait for FlexKV's LRU
    again = put(flexkv, "a")  # a new generation: everything must be written again
    assert flexkv.try_wait([again])[again].status is TaskStatus.SUCCESS
    assert cached(flexkv, "a") == TOKENS
    assert flexkv.evict(["a"]) == TOKENS


def test_a_put_that_ends_after_its_key_was_evicted_is_not_counted_for_the_new_one() -> None:
    flexkv = store(GenerationManager(capacity=16))  # type: ignore[arg-type]
    old = put(flexkv, "a")
    assert flexkv.evict(["a"]) == 0  # not answered yet: not written as far as we know
    assert flexkv.try_wait([old])[old].status is TaskStatus.SUCCESS
    assert flexkv.evict(["a"]) == 0
    assert cached(flexkv, "a") == 0  # written into the old generation


def test_a_cancelled_put_counts_nothing() -> None:
    flexkv = store(GenerationManager(capacity=16))  # type: ignore[arg-type]
    task_id, _ = flexkv.put_match(np.arange(TOKENS, dtype=np.int64), ["a"])
    flexkv.cancel([task_id])
    assert flexkv.evict(["a"]) == 0


def test_clear_waits_for_launched_tasks_then_resets_flexkv() -> None:
    manager = GenerationManager(capacity=16)
    flexkv = store(manager)  # type: ignore[arg-type]
    done = put(flexkv, "a")
    assert flexkv.try_wait([done])[done].status is TaskStatus.SUCCESS
    flexkv.evict(["b"])  # a generation, which clear lets go of
    running = put(flexkv, "b")
    manager.hold_polls = 3  # still copying for three polls
    held, _ = flexkv.get_match(np.arange(TOKENS, dtype=np.int64), ["a"])  # a reservation
    assert flexkv.clear() == 2 * TOKENS  # the running put ended first, then counted
    assert manager.resets == 1 and manager.free == 16
    assert flexkv.try_wait([running])[running].status is TaskStatus.SUCCESS  # still answered
    flexkv.cancel([held])  # rolled back by clear: the engine's cancel is a no-op now
    assert (cached(flexkv, "a"), cached(flexkv, "b")) == (0, 0)
    assert manager.namespaces[-1] == ["b"]  # back to its plain namespace
    assert flexkv.clear() == 0


class BrokenResetManager(GenerationManager):
    """reset() raises before dropping anything, as FlexKV 34ab141's does with the
    expiring-dict it pins (two int entries in its task table)."""

    def reset(self) -> None:
        raise AttributeError("'int' object has no attribute 'is_completed'")


def test_a_clear_whose_reset_fails_moves_every_key_past_its_blocks() -> None:
    manager = BrokenResetManager(capacity=16)
    flexkv = store(manager)  # type: ignore[arg-type]
    store_all(flexkv, "a", "b")
    assert flexkv.clear() == 2 * TOKENS
    assert (cached(flexkv, "a"), cached(flexkv, "b")) == (0, 0)  # the old blocks, unmatched
    assert manager.namespaces[-1][0] == "b" and len(manager.namespaces[-1]) == 2
    again = put(flexkv, "a")  # stored afresh under the new generation, and counted
    assert flexkv.try_wait([again])[again].status is TaskStatus.SUCCESS
    assert cached(flexkv, "a") == TOKENS
    assert flexkv.evict(["a"]) == TOKENS and cached(flexkv, "a") == 0
    assert flexkv.clear() == 0
