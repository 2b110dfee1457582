"""FlexKVStore against fake managers, so it runs without FlexKV.

- launch when FlexKV's launch raises: a launch that raises has launched nothing and every
  id stays matched (the engine then cancels them); when loads already went out and the
  offloads' launch fails, the offloads fail alone through try_wait and their matches are
  rolled back.
- put_match of a key whose blocks are still being written: FlexKV's put counts them as
  present (an all-False mask) while its get does not; that is "already stored", not
  "no space"."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import aiokv
from aiokv import validate
from aiokv.stores.base import NoSpace, TaskStatus
from aiokv.stores.flexkv import CacheGeometry, FlexKVStore

PAGE = 4


class Manager:
    def __init__(self, fail_kind: str | None) -> None:
        self.fail_kind = fail_kind  # the kind whose launch raises
        self.kinds: dict[int, str] = {}
        self.launched: list[list[int]] = []
        self.cancelled: list[int] = []
        self.slots: list[np.ndarray] = []  # what each launched task was given
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
        self.slots.extend(np.array(s, dtype=np.int64) for s in slots)
        return [1000 + ids[0]] if as_batch else list(ids)

    def cancel(self, ids: Sequence[int]) -> None:
        self.cancelled.extend(ids)


PAGES = 64  # the caches' pages, as register() would find them


def store(manager: Manager) -> FlexKVStore:
    flexkv = FlexKVStore(aiokv.StoreConfig(backend="flexkv", page_size=PAGE))
    flexkv.page_size = PAGE
    flexkv._manager = manager  # as register() leaves it, without starting FlexKV
    flexkv._slots.num_pages = PAGES
    return flexkv


def pages(count: int) -> torch.Tensor:
    return torch.arange(count)


def launch(flexkv: FlexKVStore, ids: Sequence[int], page_ids: Sequence[torch.Tensor]) -> None:
    flexkv.launch(ids, page_ids, [None] * len(page_ids))


def test_a_launch_that_raises_leaves_every_id_matched_for_the_engine_to_cancel() -> None:
    manager = Manager(fail_kind="put")
    flexkv = store(manager)
    ids = [flexkv.put_match(np.arange(2 * PAGE), [f"u{i}"])[0] for i in range(2)]
    with pytest.raises(RuntimeError, match="transfer engine gone"):
        launch(flexkv, ids, [pages(2), pages(2)])
    flexkv.cancel(ids)  # what the engine does next: must roll both back in FlexKV
    assert manager.cancelled == ids
    with pytest.raises(ValueError, match="not a matched"):
        launch(flexkv, ids, [pages(2), pages(2)])  # rolled back: nothing left to launch


def test_offloads_whose_launch_fails_after_the_loads_went_out_fail_alone() -> None:
    manager = Manager(fail_kind="put")
    flexkv = store(manager)
    get_id = flexkv.get_match(np.arange(PAGE), ["u"])[0]
    put_ids = [flexkv.put_match(np.arange(PAGE), [f"v{i}"])[0] for i in range(2)]
    launch(flexkv, [get_id, *put_ids], [pages(1)] * 3)  # does not raise: the load runs
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
    launch(flexkv, [moving, empty], [pages(2), pages(0)])  # must not raise: moving runs
    assert manager.launched == [[moving]]
    assert flexkv.try_wait([empty])[empty].status is TaskStatus.SUCCESS
    with pytest.raises(ValueError, match="cannot cancel launched"):
        flexkv.cancel([moving])  # launched, and known to be: it is waited for
    # With nothing launched, the failed release still raises (every id stays matched).
    lone = flexkv.put_match(np.arange(PAGE - 1), ["w"])[0]
    with pytest.raises(RuntimeError, match="cancel broke"):
        launch(flexkv, [lone], [pages(0)])


class IndexManager:
    """FlexKV's matching rules, from flexkv/cache/cache_engine.py: a put matches every
    block on its path, ready or not (_put_impl_local, num_matched_blocks), inserts its
    new blocks not ready, and answers all-False when all are matched or when it cannot
    take a block for each new one; a get matches ready blocks only
    (num_ready_matched_blocks). A launched put's blocks turn ready when try_wait answers."""

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self.ready: dict[tuple[str, bytes], bool] = {}  # block key -> ready
        self.tasks: dict[int, list[tuple[str, bytes]]] = {}  # put id -> blocks it inserted
        self.running: list[int] = []
        self._next = 0

    def _blocks(self, tokens: np.ndarray, namespace: list[str]) -> list[tuple[str, bytes]]:
        return [
            (namespace[0], tokens[: (i + 1) * PAGE].tobytes())
            for i in range(len(tokens) // PAGE)
        ]

    def put_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        blocks = self._blocks(tokens, namespace)
        matched = 0
        while matched < len(blocks) and blocks[matched] in self.ready:
            matched += 1
        new = blocks[matched:]
        self._next += 1
        mask = np.zeros(len(tokens), dtype=np.bool_)
        if new and len(new) <= self.free:
            self.free -= len(new)
            self.ready.update(dict.fromkeys(new, False))
            mask[matched * PAGE : len(blocks) * PAGE] = True
            self.tasks[self._next] = new
        return self._next, mask

    def get_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        blocks = self._blocks(tokens, namespace)
        hit = 0
        while hit < len(blocks) and self.ready.get(blocks[hit]):
            hit += 1
        self._next += 1
        mask = np.zeros(len(tokens), dtype=np.bool_)
        mask[: hit * PAGE] = True
        return self._next, mask

    def cancel(self, ids: Sequence[int]) -> None:
        # FlexKV rolls back only leaves (radixtree.py remove_unready_leaf): a block that
        # another block hangs below stays, not ready, for good.
        for task_id in ids:
            for block in reversed(self.tasks.pop(task_id, [])):
                below = any(other[0] == block[0] and len(other[1]) > len(block[1])
                            and other[1].startswith(block[1]) for other in self.ready)
                if not below:
                    del self.ready[block]
                    self.free += 1

    def launch(self, ids: Sequence[int], slots: Sequence[np.ndarray], as_batch: bool) -> list[int]:
        assert not as_batch and len(ids) == 1  # one put at a time here
        self.running.extend(ids)
        return list(ids)

    def try_wait(self, ids: Sequence[int]) -> dict[int, object]:
        from types import SimpleNamespace

        answers: dict[int, object] = {}
        for task_id in ids:
            if task_id in self.running:
                self.running.remove(task_id)
                for block in self.tasks.pop(task_id, []):
                    self.ready[block] = True
                status = SimpleNamespace(value="success")
                answers[task_id] = SimpleNamespace(status=status, return_mask=None)
        return answers


@pytest.fixture
def flexkv_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlexKVStore._poll imports FlexKV's status enum; give it a stand-in."""
    import sys
    import types

    request = types.ModuleType("flexkv.common.request")
    request.KVResponseStatus = types.SimpleNamespace(NOTFOUND=object())  # type: ignore[attr-defined]
    for name in ("flexkv", "flexkv.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flexkv.common.request", request)


def test_a_repeat_put_while_the_first_is_written_waits_then_reads_already_stored(
    flexkv_statuses: None,
) -> None:
    flexkv = store(IndexManager(capacity=8))  # type: ignore[arg-type]
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    first, mask = flexkv.put_match(tokens, ["u"])
    assert mask.all()
    # Matched, not launched; then launched, not answered: no space (matched again once it
    # ends), never "stored" on the word of a put that may still fail.
    for repeat in (tokens, tokens[:PAGE], np.arange(3 * PAGE, dtype=np.int64)):
        with pytest.raises(NoSpace, match="still being written"):
            flexkv.put_match(repeat, ["u"])
    launch(flexkv, [first], [pages(2)])
    with pytest.raises(NoSpace, match="still being written"):
        flexkv.put_match(tokens, ["u"])
    assert flexkv.try_wait([first])[first].status is TaskStatus.SUCCESS
    assert not flexkv.put_match(tokens, ["u"])[1].any()  # now ready: already stored
    # Not the same key: another namespace, or another first page, needs its own blocks.
    assert flexkv.put_match(tokens, ["v"])[1].all()
    assert flexkv.put_match(tokens + 1, ["u"])[1].all()


def test_a_longer_put_over_a_put_that_then_fails_stores_the_whole_key(
    flexkv_statuses: None,
) -> None:
    # A (one page) matched; B (two pages, the same start) would hang its block below A's
    # not-ready one, and A cancelled (a bad page id, a timeout) would leave that block
    # unready for good: B reported stored, the key never read again.
    manager = IndexManager(capacity=8)
    flexkv = store(manager)  # type: ignore[arg-type]
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    short = flexkv.put_match(tokens[:PAGE], ["u"])[0]
    with pytest.raises(NoSpace):
        flexkv.put_match(tokens, ["u"])
    flexkv.cancel([short])
    longer, mask = flexkv.put_match(tokens, ["u"])  # matched again after A's end
    assert mask.all()
    launch(flexkv, [longer], [pages(2)])
    assert flexkv.try_wait([longer])[longer].status is TaskStatus.SUCCESS
    probe = manager.get_match(tokens, ["u"])[1]  # what a lookup of the key finds
    assert probe.all()


def test_a_put_that_finds_no_block_is_still_no_space(flexkv_statuses: None) -> None:
    flexkv = store(IndexManager(capacity=1))  # type: ignore[arg-type]
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    with pytest.raises(NoSpace, match="8 new tokens"):
        flexkv.put_match(tokens, ["u"])
    first = flexkv.put_match(tokens[:PAGE], ["u"])[0]  # one block: fits
    # The longer history's second block finds no room, though its first is being
    # written: no space, not "already stored".
    with pytest.raises(NoSpace):
        flexkv.put_match(tokens, ["u"])
    flexkv.cancel([first])


class FlakyIndexManager(IndexManager):
    """FlexKV whose next cancel, or next get_match, raises once (a transient failure of
    its call, as a zmq send that times out)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.fail_next: str | None = None
        self.open: set[int] = set()  # matched, neither launched nor cancelled

    def _maybe_fail(self, call: str) -> None:
        if self.fail_next == call:
            self.fail_next = None
            raise RuntimeError(f"{call}: resource temporarily unavailable")

    def put_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        task, mask = super().put_match(tokens, namespace)
        self.open.add(task)
        return task, mask

    def get_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        self._maybe_fail("get_match")
        task, mask = super().get_match(tokens, namespace)
        self.open.add(task)
        return task, mask

    def cancel(self, ids: Sequence[int]) -> None:
        self._maybe_fail("cancel")
        super().cancel(ids)
        self.open.difference_update(ids)


def test_a_cancel_that_failed_once_reaches_flexkv_when_asked_again() -> None:
    # The engine asks again for a cancel that raised (its owed cancels): the match must
    # still be known then, or its blocks stay reserved in FlexKV for good.
    manager = FlakyIndexManager(capacity=2)
    flexkv = store(manager)  # type: ignore[arg-type]
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    task, _ = flexkv.put_match(tokens, ["u"])
    manager.fail_next = "cancel"
    with pytest.raises(RuntimeError, match="cancel"):
        flexkv.cancel([task])
    flexkv.cancel([task])
    assert manager.open == set() and manager.free == 2
    other, mask = flexkv.put_match(tokens + 100, ["v"])  # the room is there again
    assert mask.all()
    flexkv.cancel([other])


def test_a_put_whose_probe_fails_leaves_no_match_behind() -> None:
    # An all-False put is probed with a get; that get raising must not leave the put's
    # own match open (its id never reached the engine, which could not cancel it).
    manager = FlakyIndexManager(capacity=1)
    flexkv = store(manager)  # type: ignore[arg-type]
    tokens = np.arange(2 * PAGE, dtype=np.int64)
    first, _ = flexkv.put_match(tokens[:PAGE], ["u"])  # one block: fits
    manager.fail_next = "get_match"
    with pytest.raises(RuntimeError, match="get_match"):
        flexkv.put_match(tokens + 100, ["v"])  # two new blocks, room for none
    flexkv.cancel([first])
    assert manager.open == set() and manager.free == 1  # nothing of either is held


class SlowIndexManager(IndexManager):
    """Answers nothing on the first poll of a task, as FlexKV while the copy runs."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.polled: set[int] = set()

    def try_wait(self, ids: Sequence[int]) -> dict[int, object]:
        first = [t for t in ids if t not in self.polled]
        self.polled.update(ids)
        return {} if first else super().try_wait(ids)


def test_the_yield_point_comes_after_flexkvs_answers_and_before_their_fan_out(
    flexkv_statuses: None,
) -> None:
    flexkv = store(SlowIndexManager(capacity=8))  # type: ignore[arg-type]
    answered_at_yield: list[int] = []
    flexkv.set_yield(lambda: answered_at_yield.append(len(flexkv._done)))
    task = flexkv.put_match(np.arange(2 * PAGE, dtype=np.int64), ["u"])[0]
    launch(flexkv, [task], [pages(2)])
    assert flexkv.try_wait([task]) == {}  # still copying: no answer, so no yield
    assert answered_at_yield == []
    assert flexkv.try_wait([task])[task].status is TaskStatus.SUCCESS
    # Once, with FlexKV's answer in hand and none of ours built yet.
    assert answered_at_yield == [0]


def test_cache_geometry_checks_the_caches_as_the_engine_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = [torch.zeros(6, 2, PAGE, 3, 8, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(aiokv.ConfigError, match="kv_caches: FlexKV needs CUDA caches"):
        CacheGeometry.of(layers)
    with pytest.raises(aiokv.ConfigError, match=r"kv_caches\[1\]: has shape \[6, 2, \d+, 3, 4\]"):
        CacheGeometry.of([layers[0], torch.zeros(6, 2, PAGE, 3, 4, dtype=torch.bfloat16)])
    # The shapes it reads, as if the caches were on the second GPU.
    checked = validate.kv_caches(layers)
    monkeypatch.setattr(
        validate, "kv_caches", lambda caches: (*checked[:2], torch.device("cuda", 1), checked[3])
    )
    assert CacheGeometry.of(layers) == CacheGeometry(
        num_layers=2, num_pages=6, page_size=PAGE, heads=3, head_dim=8,
        dtype=torch.bfloat16, device_index=1,
    )


def test_a_bad_page_id_fails_its_task_alone_as_invalid_naming_the_id(
    flexkv_statuses: None,
) -> None:
    manager = Manager(fail_kind=None)
    flexkv = store(manager)
    puts = [flexkv.put_match(np.arange(2 * PAGE), [f"u{i}"])[0] for i in range(3)]
    gets = [flexkv.get_match(np.arange(2 * PAGE), [f"g{i}"])[0] for i in range(2)]
    launch(flexkv, puts, [torch.tensor([5, 6]), torch.tensor([7, PAGES]), torch.tensor([-9, 1])])
    launch(flexkv, gets, [torch.tensor([3, 3]), torch.tensor([8, 9], dtype=torch.int32)])
    # The good ones reach FlexKV with their own slots, each launch as one batch.
    assert manager.launched == [[puts[0]], [gets[1]]]
    assert [s.tolist() for s in manager.slots] == [
        list(range(5 * PAGE, 7 * PAGE)), list(range(8 * PAGE, 10 * PAGE))
    ]
    assert sorted(manager.cancelled) == sorted([puts[1], puts[2], gets[0]])  # given back
    answers = flexkv.try_wait([puts[1], puts[2], gets[0]])
    assert {t: r.status for t, r in answers.items()} == dict.fromkeys(
        [puts[1], puts[2], gets[0]], TaskStatus.INVALID
    )
    assert answers[puts[1]].error == f"holds {PAGES}, outside [0, {PAGES})"
    assert answers[puts[2]].error == f"holds -9, outside [0, {PAGES})"
    assert answers[gets[0]].error == "holds 3 twice; a load writes each page once"
    assert flexkv.store_stats()["d2h_copies"] == 0  # CPU page ids: nothing to copy


class BytesManager:
    """A FlexKV-shaped manager that moves the bytes its slots name: a put copies the
    caches' pages at its slots into blocks of its own, a get copies them back, so that
    what the engine handed over is checked by the bytes that land."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.blocks: dict[tuple[str, ...], list[list[torch.Tensor]]] = {}
        self.tasks: dict[int, tuple[str, tuple[str, ...], np.ndarray]] = {}
        self.launches: list[list[np.ndarray]] = []  # each launch's slots, per task
        self.done: dict[int, list[np.ndarray]] = {}
        self._next = 0

    def _task(self, kind: str, names: list[str], mask: np.ndarray) -> tuple[int, np.ndarray]:
        self._next += 1
        self.tasks[self._next] = (kind, tuple(names), mask)
        return self._next, mask

    def put_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        have = len(self.blocks.get(tuple(namespace), [])) * PAGE
        mask = np.zeros(len(tokens), dtype=np.bool_)
        mask[have : len(tokens) // PAGE * PAGE] = True
        return self._task("put", namespace, mask)

    def get_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        have = min(len(self.blocks.get(tuple(namespace), [])) * PAGE, len(tokens))
        mask = np.zeros(len(tokens), dtype=np.bool_)
        mask[:have] = True
        return self._task("get", namespace, mask)

    def launch(self, ids: Sequence[int], slots: Sequence[np.ndarray], as_batch: bool) -> list[int]:
        self.launches.append([np.array(s) for s in slots])
        for task_id, task_slots in zip(ids, slots, strict=True):
            kind, names, mask = self.tasks.pop(task_id)
            page_ids = (np.asarray(task_slots)[::PAGE] // PAGE).tolist()
            if kind == "put":
                stored = self.blocks.setdefault(names, [])
                stored.extend([cache[p].clone() for cache in self.caches] for p in page_ids)
            else:
                for block, page in zip(self.blocks[names], page_ids, strict=False):
                    for cache, layer in zip(self.caches, block, strict=True):
                        cache[page] = layer
            self.done.setdefault(1000 + ids[0] if as_batch else task_id, []).append(mask)
        return [1000 + ids[0]] if as_batch else list(ids)

    def cancel(self, ids: Sequence[int]) -> None:
        for task_id in ids:
            self.tasks.pop(task_id, None)

    def shutdown(self) -> None:
        self.tasks.clear()

    def try_wait(self, ids: Sequence[int]) -> dict[int, object]:
        from types import SimpleNamespace

        success = SimpleNamespace(value="success")
        return {
            fid: SimpleNamespace(status=success, return_mask=self.done.pop(fid))
            for fid in ids if fid in self.done
        }


class Ready:
    """Stands in for a caller's CUDA event: the store must wait for it before it reads."""

    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


@pytest.mark.asyncio
async def test_a_flexkv_shaped_store_gets_one_launch_per_batch_with_each_page_view(
    flexkv_statuses: None,
) -> None:
    caches = [torch.randn(PAGES, 2, PAGE, 2, 8) for _ in range(2)]
    original = [c.clone() for c in caches]
    manager = BytesManager(caches)

    class Fake(FlexKVStore):
        def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
            self.page_size, self._manager = PAGE, manager  # no FlexKV to start
            self._slots.num_pages = PAGES

    flexkv = Fake(aiokv.StoreConfig(backend="flexkv", page_size=PAGE, own_process=False))
    ready = [Ready() for _ in range(3)]
    engine = aiokv.OffloadEngine(flexkv, caches, aiokv.EngineConfig(window_us=50_000))
    sources = [torch.arange(10 * u + 10, 10 * u + 13) for u in range(3)]  # 3 pages each
    targets = [torch.arange(10 * u + 40, 10 * u + 43) for u in range(3)]
    tokens = 3 * PAGE - 1  # two full pages each
    async with engine:
        # Stored before: user 1's first page, user 2's two pages.
        await asyncio.gather(engine.offload(1, sources[1], PAGE), engine.offload(2, sources[2], 2 * PAGE))
        stored = await asyncio.gather(*(
            engine.offload(u, sources[u], tokens, _ready_event=ready[u]) for u in range(3)
        ))
        hits = await asyncio.gather(*(engine.lookup(u, tokens) for u in range(3)))
        loaded = await asyncio.gather(*(
            engine.load(h, t) for h, t in zip(hits, targets, strict=True)
        ))
        stats = engine.stats()
    assert [r.stored_tokens for r in stored] == [2 * PAGE, PAGE, 0]
    assert [r.loaded_tokens for r in loaded] == [2 * PAGE] * 3
    first_pages = [[int(p) for p in s[::PAGE] // PAGE] for s in manager.launches[1]]
    # One launch for the offload batch, with each request's new pages (a view of its
    # tensor): user 0's first two, user 1's second (its first was stored), user 2 none.
    assert first_pages == [[10, 11], [21]]
    assert all(np.array_equal(s, np.arange(s[0], s[0] + len(s))) for s in manager.launches[1])
    assert [r.waited for r in ready] == [1, 1, 0]  # read after their events; 2 moved none
    # One launch for the load batch, into each request's first two pages.
    assert [[int(p) for p in s[::PAGE] // PAGE] for s in manager.launches[2]] == [
        [40, 41], [50, 51], [60, 61]
    ]
    assert len(manager.launches) == 3
    for cache, before in zip(caches, original, strict=True):
        for u in range(3):
            assert torch.equal(cache[targets[u][:2]], before[sources[u][:2]])
    assert stats.d2h_copies == 0 and stats.store_tasks_open == 0
