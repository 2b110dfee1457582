"""Pure pieces: config loading, window planning, slot mapping, the LocalStore index."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, make_caches

import aiokv
from aiokv.batcher import plan_batches
from aiokv.config import parse_config
from aiokv.requests import Kind, Request
from aiokv.slots import fuse_page_ids, select_slots
from aiokv.stores.local.index import chain_digests
from aiokv.stores.local.transfer import contiguous_runs

ROOT = Path(__file__).resolve().parents[1]


# ---- config -------------------------------------------------------------------------


def test_default_config_file_loads() -> None:
    engine, store = aiokv.load_config(ROOT / "configs" / "default.yml")
    assert engine == aiokv.EngineConfig() and store.backend == "local"


@pytest.mark.parametrize(
    ("document", "key"),
    [
        ({"engine": {"window_usec": 5}}, "engine.window_usec"),
        ({"store": {"backend": "redis"}}, "store.backend"),
        ({"engine": {"max_pending": 0}}, "engine.max_pending"),
        ({"engine": {"window_us": "fast"}}, "engine.window_us"),
        ({"engine": {"overload": "drop"}}, "engine.overload"),
        ({"store": {"cpu_cache_gb": -1}}, "store.cpu_cache_gb"),
        ({"store": {"ssd_cache_gb": 4}}, "store.ssd_cache_dir"),
        ({"stor": {}}, "stor"),
    ],
)
def test_bad_config_names_the_key(document: object, key: str) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        parse_config(document)
    assert caught.value.key == key and key in str(caught.value)


def test_open_engine_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("engine:\n  window_us: 7\nstore:\n  cpu_cache_gb: 0.01\n")
    engine = aiokv.open_engine(str(path), kv_caches=make_caches())
    assert engine.page_size == PAGE_SIZE
    path.write_text("engine:\n  window_us: 7\n  bogus: 1\n")
    with pytest.raises(aiokv.ConfigError, match=r"engine\.bogus"):
        aiokv.open_engine(str(path), kv_caches=make_caches())
    with pytest.raises(aiokv.ConfigError, match="path"):
        aiokv.open_engine(str(tmp_path / "missing.yml"), kv_caches=make_caches())


def test_flexkv_backend_without_flexkv_says_how_to_install() -> None:
    from aiokv.stores.flexkv import flexkv_available

    if flexkv_available() is None:
        pytest.skip("flexkv is usable here")
    with pytest.raises(aiokv.ConfigError, match="FlexKV"):
        aiokv.stores.make_store(aiokv.StoreConfig(backend="flexkv"))


def test_caches_are_validated() -> None:
    with pytest.raises(aiokv.ConfigError, match="kv_caches"):
        aiokv.OffloadEngine(aiokv.LocalStore(), [torch.zeros(4, 3, 2)])
    with pytest.raises(aiokv.ConfigError, match="page_size"):
        aiokv.OffloadEngine(aiokv.LocalStore(aiokv.StoreConfig(page_size=8)), make_caches())


# ---- planning -----------------------------------------------------------------------


def _request(kind: Kind, tokens: int, loop: asyncio.AbstractEventLoop) -> Request:
    return Request(kind, "u", loop.create_future(), tokens, None, (), None, 0)


def test_plan_puts_gets_first_and_respects_limits() -> None:
    loop = asyncio.new_event_loop()
    try:
        queue = [
            _request(Kind.OFFLOAD, 10, loop),
            _request(Kind.LOOKUP, 10, loop),
            _request(Kind.OFFLOAD, 10, loop),
            _request(Kind.LOAD, 10, loop),
            _request(Kind.OFFLOAD, 10, loop),
            _request(Kind.OFFLOAD, 100, loop),  # larger than max_tokens: alone
        ]
        plan = plan_batches(queue, max_requests=2, max_tokens=25)
    finally:
        loop.close()
    assert [(kind, [r.num_tokens for r in rs]) for kind, rs in plan] == [
        (Kind.LOOKUP, [10]),
        (Kind.LOAD, [10]),
        (Kind.OFFLOAD, [10, 10]),
        (Kind.OFFLOAD, [10]),
        (Kind.OFFLOAD, [100]),
    ]
    assert plan[2][1] == [queue[0], queue[2]]  # arrival order kept


# ---- slots --------------------------------------------------------------------------


def test_fused_pages_expand_split_and_flag_bad_requests() -> None:
    page_ids = [torch.tensor([3, 1, 2]), torch.tensor([7, 7], dtype=torch.int32), torch.tensor([0, 99])]
    fused = fuse_page_ids(page_ids, [3, 1, 2])
    pages = fused.wait()
    assert fused.d2h_copies == 0 and pages.tolist() == [3, 1, 2, 7, 0, 99]
    assert fused.bad_requests(pages, num_pages=50).tolist() == [2]
    slots = fused.expand(pages, 4)
    assert fused.request_slots(slots, 1, 4).tolist() == [28, 29, 30, 31]
    first = fused.request_slots(slots, 0, 4)
    assert first.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


def test_select_slots_takes_exactly_the_true_positions() -> None:
    slots = np.arange(100, 112)
    suffix = np.zeros(12, bool)
    suffix[4:] = True
    assert select_slots(slots, suffix).tolist() == list(range(104, 112))
    holes = np.zeros(12, bool)
    holes[[0, 1, 8, 9]] = True
    assert select_slots(slots, holes).tolist() == [100, 101, 108, 109]
    assert select_slots(slots, np.zeros(12, bool)).tolist() == []


def test_contiguous_runs_split_at_gaps_and_chunk_size() -> None:
    blocks = np.array([5, 6, 7, 8, 20, 21, 3])
    assert contiguous_runs(blocks, max_len=3) == [(0, 3), (3, 4), (4, 6), (6, 7)]


# ---- index --------------------------------------------------------------------------


def test_chain_digests_depend_on_namespace_and_whole_prefix() -> None:
    tokens = np.arange(16, dtype=np.int64)
    a = chain_digests(tokens, ["uid:1"], 4)
    assert len(a) == 4 and len(set(a)) == 4 and all(len(d) == 16 for d in a)
    assert chain_digests(tokens[:10], ["uid:1"], 4) == a[:2]  # prefixes share digests
    assert chain_digests(tokens, ["uid:2"], 4)[0] != a[0]
    assert chain_digests(tokens, ["uid:", "1"], 4)[0] != a[0]  # no ambiguity in joining
    changed = tokens.copy()
    changed[0] = 99
    assert all(x != y for x, y in zip(chain_digests(changed, ["uid:1"], 4), a, strict=False))


# ---- LocalStore directly ------------------------------------------------------------


def _wait(store: aiokv.LocalStore, ids: list[int]) -> dict[int, aiokv.TaskResult]:
    """Poll until terminal, bounded by time (the copy thread needs the GIL to finish)."""
    results: dict[int, aiokv.TaskResult] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        results.update(store.try_wait([i for i in ids if i not in results]))
        if len(results) == len(ids):
            return results
        time.sleep(0.0005)
    raise AssertionError("tasks did not finish")


def test_local_store_evicts_least_recent_tails_first() -> None:
    caches = make_caches(pages=64)
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=6 * block_bytes / (1 << 30)))
    store.register(caches)
    tokens = np.arange(4 * PAGE_SIZE, dtype=np.int64)
    for user in ("a", "b"):
        task, mask = store.put_match(tokens, [user])
        store.launch([task], [np.arange(mask.sum(), dtype=np.int64)])
        _wait(store, [task])
    # 8 blocks wanted, 6 exist: b's put evicted a's two tail blocks, a's head survives.
    task, mask = store.get_match(tokens, ["a"])
    assert mask.sum() == 2 * PAGE_SIZE
    store.cancel([task])
    store.close()


def test_local_store_rolls_back_cancel_and_failed_copies() -> None:
    caches = make_caches(pages=16)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(caches)
    tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    free = store.free_blocks
    task, mask = store.put_match(tokens, ["u"])
    assert store.free_blocks == free - 2
    store.cancel([task])
    assert store.free_blocks == free
    task, again = store.put_match(tokens, ["u"])
    assert again.all()
    store.launch([task], [np.array([10**9 + i for i in range(2 * PAGE_SIZE)], dtype=np.int64)])
    result = _wait(store, [task])[task]
    assert result.status is aiokv.TaskStatus.FAILED  # page id out of range in the copy
    assert store.try_wait([task]) == {}  # answered once
    assert store.free_blocks == free
    task, mask = store.get_match(tokens, ["u"])
    assert not mask.any()  # nothing readable was left behind
    store.cancel([task])
    store.close()


def test_fused_pages_from_device_slots_or_with_a_host_tail() -> None:
    from aiokv.slots import FusedPages

    starts, counts = np.array([0, 2]), np.array([2, 1])
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7, 36, 37, 38, 39])  # pages 3, 1, 9
    expanded = FusedPages(slots, starts, counts, None, 1, expanded_page_size=4)
    pages = expanded.wait()
    assert pages.tolist() == [3, 1, 9]
    assert expanded.expand(pages, 4).tolist() == slots.tolist()
    with pytest.raises(ValueError, match="page size"):
        expanded.expand(pages, 8)
    mixed = FusedPages(torch.tensor([3, 1]), starts, counts, None, 1, host_tail=torch.tensor([9]))
    assert mixed.wait().tolist() == [3, 1, 9]


def test_local_store_notifies_when_tasks_end() -> None:
    import threading

    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches(pages=16))
    woke = threading.Event()
    store.set_notify(woke.set)
    task, mask = store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["n"])
    assert not woke.is_set()
    store.launch([task], [np.arange(int(mask.sum()), dtype=np.int64)])
    assert woke.wait(10)  # called by the copy thread once the job ended
    assert _wait(store, [task])[task].status is aiokv.TaskStatus.SUCCESS
    store.close()


def test_local_store_keeps_every_surviving_key_intact_under_churn() -> None:
    """Random puts, loads and evictions on a small pool: whatever get_match still finds
    must load back bit-exact. (Caught a release of the wrong blocks when eviction
    order, which is LRU order, was taken for block order.)"""
    rng = np.random.default_rng(3)
    caches = make_caches(pages=64)
    original = [c.clone() for c in caches]
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=12 * block_bytes / (1 << 30)))
    store.register(caches)
    sources: dict[str, np.ndarray] = {}
    for step in range(300):
        key = f"k{int(rng.integers(0, 10))}"
        pages = sources.setdefault(key, rng.choice(32, size=3, replace=False))
        tokens = np.arange(int(rng.integers(1, 4)) * PAGE_SIZE, dtype=np.int64)
        if rng.random() < 0.6:
            try:
                task, mask = store.put_match(tokens, [key])
            except aiokv.stores.NoSpace:
                continue
            slots = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)
            if mask.any():
                store.launch([task], [slots[: len(mask)][mask].astype(np.int64)])
                assert _wait(store, [task])[task].status is aiokv.TaskStatus.SUCCESS
            else:
                store.cancel([task])
        else:
            task, mask = store.get_match(tokens, [key])
            hit = int(mask.sum()) // PAGE_SIZE
            if hit == 0:
                store.cancel([task])
                continue
            target = np.arange(32 + 3 * (step % 10), 32 + 3 * (step % 10) + hit)
            slots = (target[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(-1)
            store.launch([task], [slots.astype(np.int64)])
            assert _wait(store, [task])[task].status is aiokv.TaskStatus.SUCCESS
            for cache, before in zip(caches, original, strict=True):
                assert torch.equal(cache[torch.from_numpy(target)], before[pages[:hit]]), step
    store.close()


def test_local_store_evicts_exactly_the_lru_blocks_whatever_their_order() -> None:
    """LRU order [1, 5, 3] spans three block ids like a run [1, 2, 3]; evicting it must
    free blocks 1, 3 and 5 and leave the key in block 2 intact."""
    caches = make_caches(pages=16)
    original = [c.clone() for c in caches]
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=6 * block_bytes / (1 << 30)))
    store.register(caches)
    one_page = np.arange(PAGE_SIZE, dtype=np.int64)

    def slots(page: int) -> np.ndarray:
        return np.arange(page * PAGE_SIZE, (page + 1) * PAGE_SIZE, dtype=np.int64)

    for key in range(6):  # key k lands in host block k, from GPU page k
        task, _ = store.put_match(one_page, [f"k{key}"])
        store.launch([task], [slots(key)])
        _wait(store, [task])
    for key in (0, 2, 3, 4, 0, 2):  # LRU, oldest first, becomes [1, 5, 3, 4, 0, 2]
        task, _ = store.get_match(one_page, [f"k{key}"])
        store.cancel([task])
    three_pages = np.arange(3 * PAGE_SIZE, dtype=np.int64)
    task, mask = store.put_match(three_pages, ["new"])  # evicts keys 1, 5 and 3
    store.launch([task], [np.concatenate([slots(p) for p in (10, 11, 12)])])
    _wait(store, [task])
    for key, survives in ((1, False), (5, False), (3, False), (2, True), (0, True), (4, True)):
        task, mask = store.get_match(one_page, [f"k{key}"])
        assert bool(mask.any()) is survives, key
        if survives:
            store.launch([task], [slots(15)])
            _wait(store, [task])
            for cache, before in zip(caches, original, strict=True):
                assert torch.equal(cache[15], before[key]), key
        else:
            store.cancel([task])
    store.close()
