"""FlexKVStore.launch when FlexKV's launch raises, against a fake manager, so it runs
without FlexKV: a launch that raises has launched nothing and every id stays matched
(the engine then cancels them); when loads already went out and the offloads' launch
fails, the offloads fail alone through try_wait and their matches are rolled back."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

import aiokv
from aiokv.stores.base import TaskStatus
from aiokv.stores.flexkv import FlexKVStore

PAGE = 4


class Manager:
    def __init__(self, fail_kind: str | None) -> None:
        self.fail_kind = fail_kind  # the kind whose launch raises
        self.kinds: dict[int, str] = {}
        self.launched: list[list[int]] = []
        self.cancelled: list[int] = []
        self._next = 0

    def _match(self, kind: str, tokens: np.ndarray) -> tuple[int, np.ndarray]:
        self._next += 1
        self.kinds[self._next] = kind
        return self._next, np.ones(len(tokens), dtype=np.bool_)

    def put_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        return self._match("put", tokens)

    def get_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        return self._match("get", tokens)

    def launch(self, ids: Sequence[int], slots: Sequence[np.ndarray], as_batch: bool) -> list[int]:
        if self.kinds[ids[0]] == self.fail_kind:
            raise RuntimeError("transfer engine gone")
        self.launched.append(list(ids))
        return [1000 + ids[0]] if as_batch else list(ids)

    def cancel(self, ids: Sequence[int]) -> None:
        self.cancelled.extend(ids)


def store(manager: Manager) -> FlexKVStore:
    flexkv = FlexKVStore(aiokv.StoreConfig(backend="flexkv", page_size=PAGE))
    flexkv.page_size = PAGE
    flexkv._manager = manager  # as register() leaves it, without starting FlexKV
    return flexkv


def slots(count: int) -> np.ndarray:
    return np.arange(count * PAGE, dtype=np.int64)


def test_a_launch_that_raises_leaves_every_id_matched_for_the_engine_to_cancel() -> None:
    manager = Manager(fail_kind="put")
    flexkv = store(manager)
    ids = [flexkv.put_match(np.arange(2 * PAGE), ["u"])[0] for _ in range(2)]
    with pytest.raises(RuntimeError, match="transfer engine gone"):
        flexkv.launch(ids, [slots(2), slots(2)])
    flexkv.cancel(ids)  # what the engine does next: must roll both back in FlexKV
    assert manager.cancelled == ids
    with pytest.raises(ValueError, match="not a matched"):
        flexkv.launch(ids, [slots(2), slots(2)])  # rolled back: nothing left to launch


def test_offloads_whose_launch_fails_after_the_loads_went_out_fail_alone() -> None:
    manager = Manager(fail_kind="put")
    flexkv = store(manager)
    get_id = flexkv.get_match(np.arange(PAGE), ["u"])[0]
    put_ids = [flexkv.put_match(np.arange(PAGE), ["v"])[0] for _ in range(2)]
    flexkv.launch([get_id, *put_ids], [slots(1)] * 3)  # does not raise: the load runs
    assert manager.launched == [[get_id]]
    assert manager.cancelled == put_ids  # their matches were rolled back in FlexKV
    answers = flexkv.try_wait(put_ids)
    assert {t: r.status for t, r in answers.items()} == dict.fromkeys(put_ids, TaskStatus.FAILED)
    assert "transfer engine gone" in answers[put_ids[0]].error
    with pytest.raises(ValueError, match="cannot cancel launched"):
        flexkv.cancel([get_id])  # the load is running: it is waited for, not cancelled


def test_a_failed_release_of_empty_tasks_after_a_launch_does_not_fail_the_launch() -> None:
    class EmptiesCannotBeCancelled(Manager):
        def _match(self, kind: str, tokens: np.ndarray) -> tuple[int, np.ndarray]:
            task_id, mask = super()._match(kind, tokens)
            return task_id, mask if len(tokens) > PAGE else np.zeros_like(mask)

        def cancel(self, ids: Sequence[int]) -> None:
            raise RuntimeError("cancel broke")

    manager = EmptiesCannotBeCancelled(fail_kind=None)
    flexkv = store(manager)
    moving = flexkv.put_match(np.arange(2 * PAGE), ["u"])[0]
    empty = flexkv.put_match(np.arange(PAGE - 1), ["v"])[0]  # under a page: nothing to write
    flexkv.launch([moving, empty], [slots(2), slots(0)])  # must not raise: moving runs
    assert manager.launched == [[moving]]
    assert flexkv.try_wait([empty])[empty].status is TaskStatus.SUCCESS
    with pytest.raises(ValueError, match="cannot cancel launched"):
        flexkv.cancel([moving])  # launched, and known to be: it is waited for
    # With nothing launched, the failed release still raises (every id stays matched).
    lone = flexkv.put_match(np.arange(PAGE - 1), ["w"])[0]
    with pytest.raises(RuntimeError, match="cancel broke"):
        flexkv.launch([lone], [slots(0)])
