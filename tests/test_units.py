"""Pure pieces: config loading, window planning, slot mapping, the LocalStore index."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, launch_slots, make_caches

import aiokv
from aiokv.config import parse_config
from aiokv.copy.copier import Copier
from aiokv.copy.fused import FusedPages, fuse_page_ids
from aiokv.loop.batcher import plan_batches
from aiokv.requests import Kind, Request
from aiokv.stores.local.digests import ChainMemo, chain_digests

ROOT = Path(__file__).resolve().parents[1]


# ---- config -------------------------------------------------------------------------


def test_default_config_file_loads() -> None:
    engine, store = aiokv.load_config(ROOT / "configs" / "default.yml")
    assert engine == aiokv.EngineConfig() and store.backend == "local"


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yml")))
def test_every_shipped_config_loads(name: str) -> None:
    aiokv.load_config(ROOT / "configs" / name)


def test_the_shared_tier_configs_are_a_server_and_its_engines() -> None:
    _, server = aiokv.load_config(ROOT / "configs" / "store-server.yml")
    _, engine = aiokv.load_config(ROOT / "configs" / "shared.yml")
    assert server.backend == "local" and server.cpu_cache_gb > 0  # what store-server runs
    assert engine.backend == "shared" and str(engine.socket).endswith(".sock")


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
        ({"store": {"ssd_cache_dir": 5}}, "store.ssd_cache_dir"),
        ({"store": {"cpu_cache_gb": 10**400}}, "store.cpu_cache_gb"),
        ({"engine": {"poll_interval_us": 10**400}}, "engine.poll_interval_us"),  # not OverflowError
        ({"engine": {"window_us": 10**13}}, "engine.window_us"),
        (
            {"store": {"backend": "flexkv", "cpu_cache_gb": 4, "ssd_cache_gb": 2,
                       "ssd_cache_dir": "/tmp"}},
            "store.ssd_cache_gb",
        ),
        ({"stor": {}}, "stor"),
        ({"store": {"own_process": "yes"}}, "store.own_process"),
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


@pytest.mark.parametrize(("where", "key", "value"), [
    ("store", "instance_num", 2),
    ("store", "instance_id", "1"),
    ("store", "server_launch_mode", "external"),
    ("env", "instance_num", "4"),
    ("env", "server_launch_mode", "EXTERNAL"),
])
def test_flexkv_shared_between_processes_is_refused_naming_the_key(
    monkeypatch: pytest.MonkeyPatch, where: str, key: str, value: object
) -> None:
    # FlexKV's server-client mode would put a second process's pages in the first one's
    # caches (one registration per GPU): refused at the config, whichever way it is asked.
    name = f"FLEXKV_{key.upper()}"
    flexkv = {key: value} if where == "store" else {}
    if where == "env":
        monkeypatch.setenv(name, str(value))
    with pytest.raises(aiokv.ConfigError, match="does not share one FlexKV") as refused:
        aiokv.StoreConfig(backend="flexkv", flexkv=flexkv)
    assert refused.value.key == (f"store.flexkv.{key}" if where == "store" else name)
    assert repr(value) in str(refused.value)
    if where == "env":  # the other backends ignore FlexKV's variables
        assert aiokv.StoreConfig(backend="local").backend == "local"
        monkeypatch.setenv(name, "1" if key == "instance_num" else "embedded")
    # A single process's values pass.
    aiokv.StoreConfig(backend="flexkv", flexkv={"instance_num": 1, "instance_id": 0,
                                                "server_launch_mode": "embedded"})


def test_a_store_socket_with_flexkv_says_flexkv_cannot_be_shared() -> None:
    with pytest.raises(aiokv.ConfigError, match=r"store\.socket.*does not share one FlexKV"):
        aiokv.StoreConfig(backend="flexkv", socket="/run/user/1/aiokv/store.sock")


def test_a_config_file_that_is_not_utf8_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yml"
    path.write_bytes("engine:\n  window_us: 7 # café\n".encode("latin-1"))
    with pytest.raises(aiokv.ConfigError, match="cannot read") as caught:
        aiokv.load_config(path)
    assert caught.value.key == "path"


def test_caches_are_validated() -> None:
    with pytest.raises(aiokv.ConfigError, match="kv_caches"):
        aiokv.OffloadEngine(aiokv.LocalStore(), [torch.zeros(4, 3, 2)])
    for empty in ((0, 2, 4, 2, 8), (4, 2, 0, 2, 8), (4, 2, 4, 0, 8)):
        with pytest.raises(aiokv.ConfigError, match="empty dimension"):
            aiokv.OffloadEngine(aiokv.LocalStore(), [torch.zeros(empty)])
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


@pytest.mark.parametrize(
    ("count", "tokens", "expected"),
    [
        (0, 10, []),
        (3, 10, [[10, 10, 10]]),  # exactly at max_requests: one batch (the fast path)
        (2, 15, [[15, 15]]),  # exactly at max_tokens: one batch
        (4, 10, [[10, 10, 10], [10]]),  # over max_requests
        (3, 11, [[11, 11], [11]]),  # over max_tokens
        (1, 31, [[31]]),  # one request over max_tokens: a batch of its own
    ],
)
def test_plan_of_one_kind_at_and_over_the_limits(
    count: int, tokens: int, expected: list[list[int]]
) -> None:
    loop = asyncio.new_event_loop()
    try:
        queue = [_request(Kind.OFFLOAD, tokens, loop) for _ in range(count)]
        plan = plan_batches(queue, max_requests=3, max_tokens=30)
    finally:
        loop.close()
    assert [[r.num_tokens for r in rs] for _, rs in plan] == expected
    assert all(kind is Kind.OFFLOAD for kind, _ in plan)
    assert [r for _, rs in plan for r in rs] == queue  # arrival order, nothing lost


# ---- slots --------------------------------------------------------------------------


def test_fused_pages_expand_split_and_flag_bad_requests() -> None:
    page_ids = [torch.tensor([3, 1, 2]), torch.tensor([7], dtype=torch.int32), torch.tensor([0, 99])]
    fused = fuse_page_ids(page_ids)
    pages = fused.wait()
    assert fused.d2h_copies == 0 and pages.tolist() == [3, 1, 2, 7, 0, 99]
    slots = fused.expand(pages, 4)
    assert fused.bad_requests(slots, num_pages=50, page_size=4).tolist() == [2]
    assert fused.request_slots(slots, 1, 4).tolist() == [28, 29, 30, 31]
    first = fused.request_slots(slots, 0, 4)
    assert first.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


def test_page_errors_name_the_bad_value_and_a_page_held_twice() -> None:
    page_ids = [torch.tensor([5, 6, 5]), torch.tensor([7]), torch.tensor([2, 70, -1]),
                torch.tensor([5, 6]), torch.tensor([8, 8])]
    fused = fuse_page_ids(page_ids)
    slots = fused.expand(fused.wait(), 4)
    # Tasks 0-3 are loads, task 4 (a page twice) a put: only loads must not repeat one.
    errors = fused.page_errors(slots, num_pages=64, page_size=4, unique=[0, 1, 2, 3])
    # Task 3 shares pages with task 0: each task is checked on its own pages.
    assert sorted(errors) == [0, 2]
    assert errors[0] == "holds 5 twice; a load writes each page once"
    assert errors[2] == "holds 70, outside [0, 64)"
    assert sorted(fused.page_errors(slots, num_pages=64, page_size=4, unique=())) == [2]


def test_page_errors_name_the_callers_own_id_where_the_slots_hold_it_clamped() -> None:
    page_ids = [torch.tensor([1, -7]), torch.tensor([2, 3])]
    fused = fuse_page_ids(page_ids)
    slots = fused.expand(fused.wait(), 4)  # -7 clamped to -1
    clamped = fused.page_errors(slots, num_pages=64, page_size=4, unique=())
    assert "holds -1," in str(clamped[0])

    def own(index: int, position: int) -> int:
        return int(page_ids[index][position])

    named = fused.page_errors(slots, num_pages=64, page_size=4, unique=(), own_id=own)
    assert sorted(named) == [0] and "holds -7, outside [0, 64)" in str(named[0])
    unknown = fused.page_errors(
        slots, num_pages=64, page_size=4, unique=(), own_id=lambda index, position: None
    )
    assert "holds -1," in str(unknown[0])  # the read failed: the clamped id, still failed


def _gapped_pages() -> tuple[FusedPages, np.ndarray]:
    """Four requests laid out out of order with unowned pages between them, as a
    device batch concatenated whole (or a mixed host/device batch) leaves them."""
    # host pages: 0..11; request 0 -> pages 5..7, 1 -> 0..1, 2 -> 9..9, 3 -> nothing
    starts, counts = np.array([5, 0, 9, 3]), np.array([3, 2, 1, 0])
    fused = FusedPages(torch.arange(100, 112), starts, counts, None, 0)
    return fused, fused.wait_slots(4)


def test_fused_split_gives_each_request_its_slots_as_views() -> None:
    fused, slots = _gapped_pages()
    assert slots.tolist() == (np.arange(100, 112)[:, None] * 4 + np.arange(4)).ravel().tolist()
    parts = fused.split(slots, 4)
    assert len(parts) == 4
    for index, part in enumerate(parts):
        assert part.tolist() == fused.request_slots(slots, index, 4).tolist()
        assert part.size == 0 or np.shares_memory(part, slots)  # views, no copies
    assert parts[0].tolist() == list(range(420, 432)) and parts[3].tolist() == []


def test_fused_slots_are_read_only_after_the_copy_lands() -> None:
    # FlexKV's launch path: wait_slots, then split (every task's slots).
    expected = torch.arange(40, 64)  # slots of 6 pages of 4, as the device expanded them

    class Copy:  # stands in for the copy's CUDA event: the data lands on synchronize
        def __init__(self, host: torch.Tensor) -> None:
            self.host, self.waits = host, 0

        def synchronize(self) -> None:
            self.waits += 1
            self.host.copy_(expected)

    def in_flight() -> FusedPages:
        host = torch.zeros(24, dtype=torch.int64)
        return FusedPages(host, np.array([3, 0]), np.array([2, 3]), Copy(host), 1,
                          expanded_page_size=4)

    fused = in_flight()
    parts = fused.split(fused.wait_slots(4), 4)
    assert fused.copy_done.waits == 1
    assert [p.tolist() for p in parts] == [list(range(52, 60)), list(range(40, 52))]
    plain = fuse_page_ids([torch.tensor([3]), torch.tensor([9])])  # no copy
    assert [p.tolist() for p in plain.split(plain.wait_slots(2), 2)] == [[6, 7], [18, 19]]


def test_fused_wait_slots_of_host_and_device_expanded_pages() -> None:
    fused = fuse_page_ids([torch.tensor([3, 1]), torch.tensor([9], dtype=torch.int32)])
    assert fused.wait_slots(2).tolist() == [6, 7, 2, 3, 18, 19]
    expanded = FusedPages(torch.tensor([6, 7, 2, 3]), np.array([0]), np.array([2]), None, 1,
                          expanded_page_size=2)
    assert expanded.wait_slots(2).tolist() == [6, 7, 2, 3]
    with pytest.raises(ValueError, match="page size"):
        expanded.wait_slots(4)


# ---- index --------------------------------------------------------------------------


def test_chain_digests_depend_on_the_whole_prefix_and_namespaces_stay_apart() -> None:
    tokens = np.arange(16, dtype=np.int64)
    a = chain_digests(tokens, 4)
    assert len(a) == 4 and len(set(a)) == 4 and all(len(d) == 16 for d in a)
    assert chain_digests(tokens[:10], 4) == a[:2]  # prefixes share digests
    changed = tokens.copy()
    changed[0] = 99
    assert all(x != y for x, y in zip(chain_digests(changed, 4), a, strict=False))
    changed = tokens.copy()
    changed[9] = 99  # the third page changes: so do it and every later digest
    same = [x == y for x, y in zip(chain_digests(changed, 4), a, strict=True)]
    assert same == [True, True, False, False]
    # Namespaces are separate tables of the store, not part of the digest: the same
    # tokens stored under one namespace are invisible under another.
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches(pages=16))
    tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    task, mask = store.put_match(tokens, ["uid:1"])
    launch_slots(store, [task], [np.arange(int(mask.sum()), dtype=np.int64)])
    _wait(store, [task])
    for namespace, hit in ((["uid:1"], True), (["uid:2"], False), (["uid:", "1"], False)):
        task, mask = store.get_match(tokens, namespace)
        assert bool(mask.all()) is hit and bool(mask.any()) is hit, namespace
        store.cancel([task])
        task, mask = store.put_match(tokens, namespace)
        assert bool(mask.any()) is not hit, namespace  # the other namespaces write anew
        store.cancel([task])
    store.close()


@pytest.mark.parametrize("namespace_chars", [8, 3900])
def test_a_chain_memo_holds_about_its_bound_in_memory(namespace_chars: int) -> None:
    """Keys of one page each (as many short histories), short namespaces and namespaces
    near their size limit: what the memo keeps in memory stays near ``max_bytes``. It
    counted only token bytes and digests, and held 5x its bound (26x with long keys)."""
    import tracemalloc

    # Keys of several times the bound, so that the memo must forget most of them (what it
    # held over its bound is the same ratio at 1 MiB and 5,000 keys as at larger runs).
    bound = 1 << 20
    rng = np.random.default_rng(1)
    tracemalloc.start()
    try:
        memo = ChainMemo(16, max_bytes=bound)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            tokens = rng.integers(1, 1 << 40, size=16, dtype=np.int64)
            memo.digests((f"uid:{i}" + "x" * namespace_chars,), tokens)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 1.25 * bound, (held, bound)



def test_a_keys_remembered_chain_answers_as_chain_digests() -> None:
    """ChainMemo reuses a key's last chain only where the tokens are equal: histories that
    grow, repeat, shrink, change in one page, change back, and the default positions,
    under a memory bound small enough to forget keys, all answer as chain_digests."""
    rng = np.random.default_rng(7)
    memo = ChainMemo(4, max_bytes=3 * 1600)  # about three keys of 16 tokens
    base = rng.integers(0, 1000, 64)
    for step in range(400):
        key = (f"k{int(rng.integers(6))}",)
        tokens = base[: int(rng.integers(0, 65))].copy()
        if len(tokens) and rng.random() < 0.3:
            tokens[int(rng.integers(len(tokens)))] += 1  # one page differs
        if rng.random() < 0.1:
            tokens = np.arange(len(tokens))
        if rng.random() < 0.1:
            tokens = tokens.astype(np.int32)
        got = memo.digests(key, tokens)
        assert got == chain_digests(tokens, 4), step
        got.clear()  # the caller's list: the memo's own is untouched
        assert memo.digests(key, tokens) == chain_digests(tokens, 4), step


def test_a_lookup_after_the_caller_rewrote_its_tokens_finds_only_equal_pages() -> None:
    """A store remembers a key's last digests, never its caller's array: tokens changed
    in place after an offload, or a history that differs from a page on, find exactly
    the pages that are equal, and a grown history finds every stored page."""
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(make_caches(pages=16))
    try:
        tokens = np.arange(100, 100 + 4 * PAGE_SIZE, dtype=np.int64)
        task, mask = store.put_match(tokens, ["uid:1"])
        launch_slots(store, [task], [np.arange(int(mask.sum()), dtype=np.int64)])
        _wait(store, [task])
        tokens[2 * PAGE_SIZE + 1] = 7  # the caller reuses its array: page 2 on differ
        grown = np.arange(100, 100 + 6 * PAGE_SIZE, dtype=np.int64)
        for asked, pages in ((tokens, 2), (grown, 4), (grown[: 3 * PAGE_SIZE], 3)):
            task, mask = store.get_match(asked, ["uid:1"])
            assert mask.tolist() == [True] * (pages * PAGE_SIZE) + [False] * (
                len(asked) - pages * PAGE_SIZE)
            store.cancel([task])
        task, mask = store.put_match(tokens, ["uid:1"])  # page 2 on are new pages
        assert mask.tolist() == [False] * (2 * PAGE_SIZE) + [True] * (2 * PAGE_SIZE)
        store.cancel([task])
    finally:
        store.close()


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
        launch_slots(store, [task], [np.arange(mask.sum(), dtype=np.int64)])
        _wait(store, [task])
    # 8 blocks wanted, 6 exist: b's put evicted a's two tail blocks, a's head survives.
    task, mask = store.get_match(tokens, ["a"])
    assert mask.sum() == 2 * PAGE_SIZE
    store.cancel([task])
    store.close()


def test_short_requests_on_an_evicted_long_sequence_and_shared_loads_copy_their_own_pages(
) -> None:
    # The LRU gives each short request the next piece of the old sequence, tail first,
    # so the batch's blocks descend request by request; loads of one prefix share blocks.
    caches = make_caches(pages=64)
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=8 * block_bytes / (1 << 30)))
    store.register(caches)
    long = np.arange(8 * PAGE_SIZE, dtype=np.int64)
    task, mask = store.put_match(long, ["old"])
    launch_slots(store, [task], [np.arange(mask.sum(), dtype=np.int64)])
    _wait(store, [task])
    short = np.arange(4 * PAGE_SIZE, dtype=np.int64)
    ids, slots = [], []
    for user, first_page in (("a", 16), ("b", 32)):
        task, mask = store.put_match(short, [user])
        ids.append(task)
        slots.append(np.arange(first_page * PAGE_SIZE, (first_page + 4) * PAGE_SIZE))
    launch_slots(store, ids, slots)
    assert all(r.status is aiokv.TaskStatus.SUCCESS for r in _wait(store, ids).values())
    # Three loads of one stored prefix in one launch share its blocks.
    ids, slots = [], []
    for target in (40, 48, 56):
        task, mask = store.get_match(short, ["a"])
        ids.append(task)
        slots.append(np.arange(target * PAGE_SIZE, (target + 4) * PAGE_SIZE))
    launch_slots(store, ids, slots)
    assert all(r.status is aiokv.TaskStatus.SUCCESS for r in _wait(store, ids).values())
    for cache in caches:
        for target in (40, 48, 56):
            assert torch.equal(cache[target : target + 4], cache[16:20])
    for user, first_page in (("a", 16), ("b", 32)):  # each request's pages, not swapped
        task, mask = store.get_match(short, [user])
        assert mask.all()
        target = np.arange(40 * PAGE_SIZE, 44 * PAGE_SIZE)
        launch_slots(store, [task], [target])
        _wait(store, [task])
        for cache in caches:
            assert torch.equal(cache[40:44], cache[first_page : first_page + 4])
    store.close()


def test_local_store_rolls_back_cancel_and_failed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
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

    def broken_copy(copier: object, job: object) -> None:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(Copier, "_move_cpu", broken_copy)
    launch_slots(store, [task], [np.arange(2 * PAGE_SIZE, dtype=np.int64)])
    result = _wait(store, [task])[task]
    assert result.status is aiokv.TaskStatus.FAILED
    assert "injected copy failure" in result.error
    assert store.try_wait([task]) == {}  # answered once
    assert store.free_blocks == free
    task, mask = store.get_match(tokens, ["u"])
    assert not mask.any()  # nothing readable was left behind
    store.cancel([task])
    store.close()


def test_local_store_answers_tasks_that_ended_before_close_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caches = make_caches(pages=16)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(caches)
    failing, _ = store.put_match(np.arange(2 * PAGE_SIZE, dtype=np.int64), ["u"])

    def broken_copy(copier: object, job: object) -> None:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(Copier, "_move_cpu", broken_copy)
    launch_slots(store, [failing], [np.arange(2 * PAGE_SIZE, dtype=np.int64)])
    store.close()  # waits for the copy: the task ended, unanswered, before the close
    answer = store.try_wait([failing])  # the pool is gone: answered all the same
    assert answer[failing].status is aiokv.TaskStatus.FAILED
    assert store.try_wait([failing]) == {}


def test_fused_pages_from_device_slots_or_with_a_host_tail() -> None:

    starts, counts = np.array([0, 2]), np.array([2, 1])
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7, 36, 37, 38, 39])  # pages 3, 1, 9
    expanded = FusedPages(slots, starts, counts, None, 1, expanded_page_size=4)
    pages = expanded.wait()
    assert pages.tolist() == [3, 1, 9]
    assert expanded.expand(pages, 4).tolist() == slots.tolist()
    with pytest.raises(ValueError, match="page size"):
        expanded.expand(pages, 8)
    # Page ids are checked on the device-expanded slots, without recovering the pages.
    assert expanded.bad_requests(slots.numpy(), num_pages=9, page_size=4).tolist() == [1]
    assert expanded.bad_requests(slots.numpy(), num_pages=10, page_size=4).tolist() == []
    negative = FusedPages(torch.tensor([-4, -3, -2, -1]), starts[:1], counts[:1] // 2, None, 0)
    assert negative.bad_requests(negative.host.numpy(), num_pages=10, page_size=4).tolist() == [0]
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
    launch_slots(store, [task], [np.arange(int(mask.sum()), dtype=np.int64)])
    assert woke.wait(10)  # called by the copy thread once the job ended
    assert _wait(store, [task])[task].status is aiokv.TaskStatus.SUCCESS
    store.close()


def test_wrappers_forward_notify_unless_they_hold_answers_back() -> None:
    from aiokv.testing import CheckingStore, FakeStore, FaultyStore, SharedStore

    local = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    for wrapper in (SharedStore(local), CheckingStore(local)):
        assert wrapper.set_notify == local.set_notify  # the copy thread wakes the worker
    # FaultyStore's hold hides finished tasks: the worker must poll it, not wait for a
    # wake-up that came while the answer was held back.
    assert FaultyStore(local).set_notify is None
    assert SharedStore(FakeStore(PAGE_SIZE)).set_notify is None  # nothing to forward
    local.close()


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
                launch_slots(store, [task], [slots[: len(mask)][mask].astype(np.int64)])
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
            launch_slots(store, [task], [slots.astype(np.int64)])
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
        launch_slots(store, [task], [slots(key)])
        _wait(store, [task])
    for key in (0, 2, 3, 4, 0, 2):  # LRU, oldest first, becomes [1, 5, 3, 4, 0, 2]
        task, _ = store.get_match(one_page, [f"k{key}"])
        store.cancel([task])
    three_pages = np.arange(3 * PAGE_SIZE, dtype=np.int64)
    task, mask = store.put_match(three_pages, ["new"])  # evicts keys 1, 5 and 3
    launch_slots(store, [task], [np.concatenate([slots(p) for p in (10, 11, 12)])])
    _wait(store, [task])
    for key, survives in ((1, False), (5, False), (3, False), (2, True), (0, True), (4, True)):
        task, mask = store.get_match(one_page, [f"k{key}"])
        assert bool(mask.any()) is survives, key
        if survives:
            launch_slots(store, [task], [slots(15)])
            _wait(store, [task])
            for cache, before in zip(caches, original, strict=True):
                assert torch.equal(cache[15], before[key]), key
        else:
            store.cancel([task])
    store.close()


def test_position_digests_are_cached_and_equal_to_hashing() -> None:
    """Token ids 0..n-1 are recognised by content (any dtype or layout) and answered from
    a cache; the cache holds exactly what hashing the tokens gives."""
    for page_size, pages in ((4, 3), (4, 2000), (16, 7), (3, 1)):
        positions = np.arange(pages * page_size + 2, dtype=np.int64)  # + a partial page
        cached = chain_digests(positions, page_size)
        assert len(cached) == pages
        hashed = positions.copy()
        hashed[pages * page_size - 1] = -1  # not positions: hashed, last page differs
        digests = chain_digests(hashed, page_size)
        assert digests[:-1] == cached[:-1] and digests[-1] != cached[-1]
        assert chain_digests(positions.astype(np.int32), page_size) == cached
        assert chain_digests(np.repeat(positions, 2)[::2], page_size) == cached
        assert chain_digests(positions[: page_size - 1], page_size) == []


def test_block_index_lru_matches_a_reference_model() -> None:
    """Random moves in and out of the segment LRU, against an OrderedDict model."""
    from collections import OrderedDict

    from aiokv.stores.local.index import BlockIndex

    rng = np.random.default_rng(7)
    n = 200
    index = BlockIndex(n)
    model: OrderedDict[int, None] = OrderedDict()  # oldest first
    tables = {b: (f"n{b % 3}",) for b in range(n)}
    version = {b: 0 for b in range(n)}

    def store(blocks: list[int]) -> None:  # (re)insert blocks under fresh digests
        for b in blocks:
            version[b] += 1
            index.insert(tables[b], [f"{b}/{version[b]}".encode()], np.array([b]))

    def add(sequence: list[int]) -> None:
        for b in reversed(sequence):
            model[b] = None

    store(list(range(n)))
    for step in range(3000):
        op = rng.integers(0, 5)
        outside = [b for b in rng.permutation(n).tolist() if b not in model]
        if op == 0 and outside:
            sequence = outside[: int(rng.integers(1, 40))]
            index.make_evictable(np.array(sequence, dtype=np.int64))
            add(sequence)
        elif op == 1 and outside:
            cuts = sorted(rng.integers(0, len(outside), size=3).tolist())
            parts = [outside[:cuts[0]], outside[cuts[0]:cuts[1]], outside[cuts[1]:cuts[2]]]
            if rng.random() < 0.5:
                index.make_evictable_many([np.array(p, dtype=np.int64) for p in parts])
            else:  # the same, as runs of equal size
                size = int(rng.integers(1, 5))
                whole = outside[: len(outside) // size * size]
                parts = [whole[i : i + size] for i in range(0, len(whole), size)]
                index.make_evictable_runs(np.array(whole, dtype=np.int64), size)
            for part in parts:
                add(part)
        elif op == 2:
            chosen = rng.permutation(n)[: int(rng.integers(0, 60))].astype(np.int64)
            removed = index.make_unevictable(chosen)
            expected = [b for b in chosen.tolist() if b in model]
            assert removed.tolist() == expected, step
            for b in expected:
                del model[b]
        elif op == 3:
            chosen = rng.permutation(n)[: int(rng.integers(0, 60))].astype(np.int64)
            # A touch: the evictable ones among them become the most recent, in order.
            index.make_evictable(index.make_unevictable(chosen))
            listed = [b for b in chosen.tolist() if b in model]
            for b in listed:
                del model[b]
            add(listed)
        else:
            count = int(rng.integers(0, 50))
            evicted = index.evict(count).tolist()
            expected = [model.popitem(last=False)[0] for _ in range(min(count, len(model)))]
            assert evicted == expected, step
            assert all(index.lookup(tables[b], [f"{b}/{version[b]}".encode()]) == [None]
                       for b in evicted)
            store(evicted)
        assert index.evictable == len(model) and len(index) == n, step
        assert len(index._segments) <= len(model)  # no segment without a listed block


def test_local_store_loads_sharing_blocks_in_one_launch_release_them_once() -> None:
    """Two loads of one key in one launch read the same blocks: each ends once, and the
    blocks are evictable again only when both have ended (and then are)."""
    caches = make_caches(pages=16)
    block_bytes = len(caches) * caches[0][0].numel() * caches[0].element_size()
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=4 * block_bytes / (1 << 30)))
    store.register(caches)
    tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    slots = np.arange(2 * PAGE_SIZE, dtype=np.int64)
    task, _ = store.put_match(tokens, ["a"])
    launch_slots(store, [task], [slots])
    _wait(store, [task])
    first, _ = store.get_match(tokens, ["a"])
    second, mask = store.get_match(tokens, ["a"])
    assert mask.all()
    with pytest.raises(aiokv.stores.NoSpace):  # a's two blocks are held
        store.put_match(np.arange(3 * PAGE_SIZE, dtype=np.int64), ["b"])
    launch_slots(store, [first, second], [slots + 8 * PAGE_SIZE, slots + 10 * PAGE_SIZE])
    results = _wait(store, [first, second])
    assert all(r.status is aiokv.TaskStatus.SUCCESS for r in results.values())
    held, _ = store.get_match(tokens, ["a"])  # held again, by one reader
    with pytest.raises(aiokv.stores.NoSpace):
        store.put_match(np.arange(3 * PAGE_SIZE, dtype=np.int64), ["b"])
    later, _ = store.get_match(tokens, ["a"])  # a second reader, ending first, alone
    launch_slots(store, [later], [slots + 8 * PAGE_SIZE])
    _wait(store, [later])
    with pytest.raises(aiokv.stores.NoSpace):  # still held by the first
        store.put_match(np.arange(3 * PAGE_SIZE, dtype=np.int64), ["b"])
    store.cancel([held])
    task, mask = store.put_match(np.arange(4 * PAGE_SIZE, dtype=np.int64), ["b"])
    assert mask.all()  # a's blocks were evicted to make room
    assert store._index.space(("a",)) is None  # and its emptied table dropped
    store.cancel([task])
    assert store._index.space(("b",)) is None and len(store._index) == 0
    task, mask = store.get_match(tokens, ["a"])
    assert not mask.any()
    store.cancel([task])
    store.close()


def test_local_store_ends_a_task_with_a_bad_page_id_invalid_and_gives_its_blocks_back() -> None:
    caches = make_caches(pages=16)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01))
    store.register(caches)
    with pytest.raises(RuntimeError, match="already"):
        store.register(caches)  # a second pool and copy thread would orphan the first's
    tokens = np.arange(2 * PAGE_SIZE, dtype=np.int64)  # two pages per key
    free = store.free_blocks
    bad = {"past the caches": [16, 3], "negative": [-1, 4], "huge": [2**62, 4]}
    tasks = {name: store.put_match(tokens, [name])[0] for name in bad}
    good, _ = store.put_match(tokens, ["fine"])
    ids = [*tasks.values(), good]
    pages = [torch.tensor(p) for p in bad.values()] + [torch.tensor([3, 4])]
    store.launch(ids, pages, [None] * len(ids))  # one launch: the bad tasks fail alone
    answers = _wait(store, ids)
    for name, task in tasks.items():
        assert answers[task].status is aiokv.TaskStatus.INVALID
        assert answers[task].error == f"holds {bad[name][0]}, outside [0, 16)"
    assert answers[good].status is aiokv.TaskStatus.SUCCESS
    assert store.free_blocks == free - 2  # the bad tasks' blocks went back
    # A load that holds a page twice fails alone too; the same pages once load.
    twice, _ = store.get_match(tokens, ["fine"])
    once, _ = store.get_match(tokens, ["fine"])
    store.launch([twice, once], [torch.tensor([5, 5]), torch.tensor([5, 6])], [None, None])
    answers = _wait(store, [twice, once])
    assert answers[twice].status is aiokv.TaskStatus.INVALID
    assert answers[twice].error == "holds 5 twice; a load writes each page once"
    assert answers[once].status is aiokv.TaskStatus.SUCCESS
    for layer in caches:
        assert torch.equal(layer[5:7], layer[3:5])
    store.close()


def test_pinned_buffers_written_by_kernels_are_held_until_their_event_fired() -> None:
    from aiokv.copy.pinned import _HeldUntilDone

    class FakeEvent:
        def __init__(self) -> None:
            self.fired = False

        def query(self) -> bool:
            return self.fired

    held = _HeldUntilDone()
    first, second = FakeEvent(), FakeEvent()
    buffers = [torch.empty(4), torch.empty(4), torch.empty(4)]
    held.hold(first, buffers[0])
    held.hold(second, buffers[1])
    second.fired = True  # out of order: the older one still pins both in place
    held.hold(FakeEvent(), buffers[2])
    assert [memory for _, memory in held._held] == buffers
    first.fired = True
    held.hold(FakeEvent(), torch.empty(4))
    kept = [memory for _, memory in held._held]
    assert len(kept) == 2 and kept[0] is buffers[2]  # the fired ones were let go


def test_a_bandwidth_stream_holds_at_least_stream_gib() -> None:
    from aiokv.bench.bandwidth import Settings, stream_length

    settings = Settings()  # 8 layers, 4 heads x 256, bf16: 32 KiB per token
    assert stream_length(settings, 8, 1024) == 8  # 0.25 GiB a batch: 8 make 2 GiB
    assert stream_length(settings, 8, 2048) == 4  # 0.5 GiB: 4, as stream_batches
    assert stream_length(settings, 64, 4096) == 4  # 8 GiB: never fewer than stream_batches
    assert stream_length(Settings(stream_gib=0.0), 8, 1024) == 4
    assert stream_length(Settings(stream_batches=1), 8, 1024) == 1  # no stream at all
    assert stream_length(settings, 1, 32) == 64  # a tiny row: capped, not ~65,000 batches


def test_the_engine_bench_times_its_store_wrapper_overhead() -> None:
    from aiokv.bench.engine import TimedStore, timing_overhead_s
    from aiokv.testing import FakeStore

    store = TimedStore(FakeStore(16))
    store.cancel([])
    store.cancel([1])
    assert store.calls == 2 and store.cpu_s >= 0
    overhead = timing_overhead_s(2_000)
    assert 0.0 <= overhead < 1e-4  # a few clock reads and frames, never a tenth of a ms
