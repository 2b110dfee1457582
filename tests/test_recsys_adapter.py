"""The recsys-examples storage (aiokv.integrations.recsys) on the CPU: its arithmetic and
status mapping against recsys's own figures, and its engine-facing core on CPU caches
through aiokv (offload, lookup, onboard, evict, bit for bit). The storage class itself
needs recsys_kvcache_manager; its test here runs where that is importable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import itertools
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiokv
from aiokv.copy.copier import Copier
from aiokv.integrations import recsys
from aiokv.integrations.recsys_core import RecsysCore, sets_window
from aiokv.integrations.recsys_math import (
    host_lengths,
    offload_lengths,
    pages_per_user,
    succeeded,
    user_pages,
    users_to_onboard,
    wait_status,
)
from aiokv.testing import StoreWrapper

HAVE_RECSYS = importlib.util.find_spec("recsys_kvcache_manager") is not None

# recsys-examples' test_flexkv.py, phase 1: 8 users' lengths, page size 32, and the
# kv_indptr that DeviceKVCache.allocate writes for them.
PHASE1_LENGTHS = [700, 128, 336, 624, 486, 358, 716, 537]
PHASE1_INDPTR = [0, 22, 26, 37, 57, 73, 85, 108, 125]

PAGES, PAGE_SIZE = 64, 4


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---- arithmetic and statuses -----------------------------------------------------------


def test_user_pages_cut_kv_indices_as_recsys_allocate_lays_them_out() -> None:
    kv_indices = torch.arange(200, dtype=torch.int32) * 3  # longer than used, as a buffer is
    pages = user_pages(kv_indices, PHASE1_LENGTHS, 32)
    counts = [b - a for a, b in itertools.pairwise(PHASE1_INDPTR)]
    assert pages_per_user(PHASE1_LENGTHS, 32) == counts
    for i, page_ids in enumerate(pages):
        assert page_ids.dtype is torch.int32
        assert torch.equal(page_ids, kv_indices[PHASE1_INDPTR[i] : PHASE1_INDPTR[i + 1]])
    kv_indices.fill_(-1)  # the manager reuses its buffer: the cut pages are a copy
    assert int(pages[0][0]) == 0


def test_user_pages_refuse_kv_indices_too_short_naming_them() -> None:
    with pytest.raises(aiokv.InvalidRequest, match="kv_indices"):
        user_pages(torch.arange(124, dtype=torch.int32), PHASE1_LENGTHS, 32)


def test_host_lengths_are_the_full_pages_recsys_expects_on_the_host() -> None:
    # test_flexkv.py: expected_host_lens = [s // 32 * 32 for s in seqlen]
    assert host_lengths(PHASE1_LENGTHS, 32) == [672, 128, 320, 608, 480, 352, 704, 512]


def test_onboard_loads_host_hits_the_gpu_does_not_cover() -> None:
    # (cached, host, gpu start, gpu length) per user
    users = [
        (700, 672, 0, 700),  # the GPU holds it all (phase 2): skipped
        (640, 640, 0, 0),  # evicted from the GPU, on the host (phase 3): loaded
        (800, 640, 320, 480),  # the GPU lost a prefix: loaded
        (640, 640, 0, 320),  # the GPU holds less than the host: loaded
        (300, 0, 0, 300),  # nothing on the host: skipped
        (0, 0, 0, 0),  # a new user: skipped
    ]
    columns = [list(column) for column in zip(*users, strict=True)]
    assert users_to_onboard(*columns) == [1, 2, 3]


def test_wait_status_maps_outcomes_to_recsys_statuses() -> None:
    ok = aiokv.OffloadResult(1, 32, 32)
    assert wait_status(None, [1, 2]).status == "launched"
    assert wait_status([ok, ok], [1, 2]).ready
    bad = wait_status([ok, aiokv.InvalidRequest("page_ids", "id 99 out of range")], [1, 2])
    assert (bad.status, bad.ready, bad.failed) == ("failed", False, [1])
    assert "user 2" in bad.message and "page_ids" in bad.message
    cancelled = [asyncio.CancelledError(), concurrent.futures.CancelledError()]
    assert wait_status(cancelled, [1, 2]).status == "cancelled"
    assert wait_status([ok, aiokv.RequestTimeout("late")], [1, 2]).status == "timeout"
    mixed = [aiokv.RequestTimeout("late"), aiokv.StoreError("disk")]
    assert wait_status(mixed, [1, 2]).status == "failed"
    assert succeeded([ok, aiokv.StoreError("disk"), ok]) == [1, 0, 1]


def test_wait_status_fails_an_onboard_whose_load_brought_fewer_tokens_than_promised() -> None:
    # The manager counts an onboard's lengths as on the GPU once the wait says ready.
    short = wait_status([aiokv.LoadResult(3, 0), aiokv.LoadResult(4, 8)], [3, 4], [8, 8])
    assert (short.status, short.ready, short.failed) == ("failed", False, [0])
    assert "user 3" in short.message and "loaded 0 of the 8 tokens" in short.message
    assert wait_status([aiokv.LoadResult(3, 8), aiokv.LoadResult(4, 8)], [3, 4], [8, 8]).ready
    late = wait_status([aiokv.RequestTimeout("late"), aiokv.LoadResult(4, 4)], [3, 4], [8, 8])
    assert (late.status, late.failed) == ("failed", [0, 1])  # not only timeouts


def test_the_module_imports_without_recsys_and_the_class_says_what_it_needs() -> None:
    if HAVE_RECSYS:
        pytest.skip("recsys_kvcache_manager is importable here")
    with pytest.raises(ImportError, match="recsys_kvcache_manager"):
        recsys.AiokvHostStorage  # noqa: B018


# ---- the core on CPU caches --------------------------------------------------------------


def caches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(PAGES, 2, PAGE_SIZE, 2, 8, generator=generator) for _ in range(2)]


CONFIG = {"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 0.01}}


@pytest.fixture
def core() -> Iterator[tuple[RecsysCore, list[torch.Tensor]]]:
    kv_caches = caches()
    opened = RecsysCore.open(CONFIG, kv_caches)
    try:
        yield opened, kv_caches
    finally:
        opened.close()


@pytest.fixture
def storage_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[torch.Tensor]]]:
    """The adapter's storage (on the stand-in recsys types) with its caches registered."""
    monkeypatch.setattr(recsys, "_recsys", fake_recsys)
    kv_caches = caches()
    storage: Any = recsys._HostStorage(CONFIG)
    storage.register_gpu_cache_tables(kv_caches)
    try:
        yield storage, kv_caches
    finally:
        storage.close()


def test_core_offloads_looks_up_loads_and_evicts_a_batch_bit_for_bit(
    core: tuple[RecsysCore, list[torch.Tensor]],
) -> None:
    storage, kv_caches = core
    users, lengths = [7, 8, 9], [14, 16, 9]
    sources = [i32(0, 1, 2, 3), i32(4, 5, 6, 7), i32(8, 9, 10)]
    batches = storage.kv.stats().batches
    offloaded = storage.offload(users, sources, lengths).outcomes()
    assert [r.stored_tokens for r in offloaded] == [12, 16, 8]
    assert storage.kv.stats().batches == batches + 1  # one manager call, one batch

    hits = storage.lookup([*users, 10], [*lengths, 8])
    assert [0 if h is None else h.cached_tokens for h in hits] == [12, 16, 8, 0]
    targets = [i32(20, 21, 22, 23), i32(24, 25, 26, 27), i32(28, 29, 30)]
    loaded = storage.load(hits[:3], targets).outcomes()
    assert [r.loaded_tokens for r in loaded] == [12, 16, 8]
    for cache in kv_caches:
        for source, target, tokens in zip(sources, targets, [12, 16, 8], strict=True):
            pages = tokens // PAGE_SIZE
            assert torch.equal(cache[target[:pages].long()], cache[source[:pages].long()])

    assert storage.evict([7, 9]) == 12 + 8
    after = storage.lookup(users, lengths)
    assert [0 if h is None else h.cached_tokens for h in after] == [0, 16, 0]
    storage.release(after)
    assert storage.clear() == 16
    assert [h.cached_tokens for h in storage.lookup(users, lengths) if h is not None] == [0, 0, 0]


def test_sets_window_reads_engine_window_us_from_each_kind_of_config(tmp_path: Any) -> None:
    path = tmp_path / "aiokv.yml"
    path.write_text("engine:\n  window_us: 300\nstore:\n  cpu_cache_gb: 0.01\n")
    bare = tmp_path / "bare.yml"
    bare.write_text("store:\n  cpu_cache_gb: 0.01\n")
    assert sets_window(path) and sets_window(str(path)) and sets_window(CONFIG)
    assert not sets_window(bare)
    assert not sets_window(None)
    assert not sets_window({"store": {"cpu_cache_gb": 0.01}})
    assert not sets_window({"engine": {"max_batch_requests": 4}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_registering_returns_once_the_host_tier_is_pinned_whole() -> None:
    # As FlexKVStorage's host tier is made before it returns: a manager's first batch
    # then never waits for pinning (2 GiB: about 0.2 s of it after the first chunk).
    gpu = [c.cuda() for c in caches()]
    opened = RecsysCore.open({"store": {"cpu_cache_gb": 2.0}}, gpu)
    try:
        assert opened.kv.engine._store.wait_pinned(timeout=0)
    finally:
        opened.close()


def test_wait_pinned_must_be_a_bool() -> None:
    with pytest.raises(aiokv.InvalidRequest, match="wait_pinned"):
        recsys._HostStorage(wait_pinned="yes")  # type: ignore[arg-type]


def test_a_core_without_a_window_in_its_config_still_batches_each_call_once() -> None:
    # window_us left unset: the core runs the engine's window at 0, and one manager
    # call's users still reach the store as one batch.
    opened = RecsysCore.open({"store": {"cpu_cache_gb": 0.01}}, caches())
    try:
        batches = opened.kv.stats().batches
        users = list(range(6))
        sources = [i32(2 * u, 2 * u + 1) for u in users]
        stored = opened.offload(users, sources, [8] * 6).outcomes()
        assert [r.stored_tokens for r in stored] == [8] * 6
        assert opened.kv.stats().batches == batches + 1
    finally:
        opened.close()


def test_core_a_bad_page_id_fails_its_own_user_only(
    core: tuple[RecsysCore, list[torch.Tensor]],
) -> None:
    storage, _ = core
    pending = storage.offload([1, 2], [i32(0, 1), i32(2, PAGES + 5)], [8, 8])
    outcomes = pending.outcomes()
    status = wait_status(outcomes, [1, 2])
    assert (status.status, status.failed) == ("failed", [1])
    assert outcomes[0].stored_tokens == 8


def test_core_an_onboard_after_the_user_was_evicted_reads_as_failed_not_ready(
    core: tuple[RecsysCore, list[torch.Tensor]],
) -> None:
    # lookup_kvcache reported 8 tokens for both users; the manager evicts user 3 before
    # the onboard: its load brings nothing, and the onboard must not answer ready.
    storage, kv_caches = core
    storage.offload([3, 4], [i32(0, 1, 2), i32(3, 4)], [10, 8]).outcomes()
    hits = storage.lookup([3, 4], [10, 8])
    lengths = [0 if hit is None else hit.cached_tokens for hit in hits]
    assert lengths == [8, 8]
    storage.evict([3])
    before = [cache[40:42].clone() for cache in kv_caches]
    outcomes = storage.load(hits, [i32(40, 41, 42), i32(43, 44)]).outcomes()
    assert [r.loaded_tokens for r in outcomes] == [0, 8]
    status = wait_status(outcomes, [3, 4], lengths)
    assert (status.status, status.ready, status.failed) == ("failed", False, [0])
    for cache, old in zip(kv_caches, before, strict=True):
        assert torch.equal(cache[40:42], old)  # user 3's pages: never written
        assert torch.equal(cache[43:45], cache[3:5])


def test_core_poll_answers_none_while_in_flight_then_the_outcomes(
    core: tuple[RecsysCore, list[torch.Tensor]],
) -> None:
    storage, _ = core
    pending = storage.offload([1], [i32(0, 1)], [8])
    outcomes = None
    while outcomes is None:  # the manager's offload_flush, in short
        outcomes = pending.poll(recsys.POLL_WAIT_S)
    assert outcomes[0].stored_tokens == 8


# ---- the storage class, where recsys_kvcache_manager is importable ----------------------


@pytest.mark.skipif(not HAVE_RECSYS, reason="recsys_kvcache_manager is not importable")
def test_storage_class_serves_recsys_manager_calls_bit_for_bit() -> None:
    from recsys_kvcache_manager.host_kvstorage_manager import HostKVStorageBase, HostKVTaskStatus
    from recsys_kvcache_manager.kvcache_utils import KVLookupResult

    kv_caches = caches()
    storage: Any = recsys.AiokvHostStorage(CONFIG)
    assert isinstance(storage, HostKVStorageBase) and storage.backend_name == "flexkv"
    storage.register_gpu_cache_tables(kv_caches)
    try:
        users, lengths = torch.tensor([3, 4]), torch.tensor([10, 8], dtype=torch.int32)
        meta = storage.build_index_meta(users, lengths)
        kv_metadata = types.SimpleNamespace(kv_indices=i32(0, 1, 2, 3, 4, 5))  # 3 + 2 pages
        handle = storage.offload_kvcache_launch(users, i32(0, 0), [], meta, kv_metadata)
        while not storage.offload_kvcache_wait(handle).ready:
            pass
        assert storage.finish_task(handle) == [1, 1]
        uids, starts, stored = recsys.AiokvHostStorage.get_offload_handle_metadata(handle)
        assert (uids.tolist(), starts.tolist(), stored.tolist()) == ([3, 4], [0, 0], [8, 8])

        def lookup(gpu_lengths: list[int]) -> Any:
            gpu = KVLookupResult(
                user_ids=meta.user_ids,
                gpu_cached_start_indices=i32(0, 0),
                gpu_cached_lengths=i32(*gpu_lengths),
            )
            return KVLookupResult.merge(gpu, storage.lookup_kvcache(meta))

        covered = lookup([10, 8])  # the GPU holds both: nothing to onboard
        assert covered.host_cached_lengths.tolist() == [8, 8]
        skipped = storage.onboard_kvcache_launch(meta, covered, kv_metadata)
        assert skipped.status == HostKVTaskStatus.SKIPPED

        onboard_pages = types.SimpleNamespace(kv_indices=i32(40, 41, 42, 43, 44))
        launched = storage.onboard_kvcache_launch(meta, lookup([0, 0]), onboard_pages)
        assert launched.status == HostKVTaskStatus.LAUNCHED
        assert storage.onboard_kvcache_wait(launched).ready
        assert launched.metadata["onboard_lengths"].tolist() == [8, 8]
        for cache in kv_caches:
            assert torch.equal(cache[40:42], cache[0:2]) and torch.equal(cache[43:45], cache[3:5])

        storage.evict(torch.tensor([3]))
        assert storage.lookup_kvcache(meta).host_cached_lengths.tolist() == [0, 8]
        storage.evict_all()
        assert storage.lookup_kvcache(meta).host_cached_lengths.tolist() == [0, 0]
    finally:
        storage.close()


@pytest.mark.skipif(not HAVE_RECSYS, reason="recsys_kvcache_manager is not importable")
def test_storage_class_onboard_of_a_user_evicted_after_the_lookup_fails() -> None:
    from recsys_kvcache_manager.host_kvstorage_manager import HostKVTaskStatus
    from recsys_kvcache_manager.kvcache_utils import KVLookupResult

    kv_caches = caches()
    storage: Any = recsys.AiokvHostStorage(CONFIG)
    storage.register_gpu_cache_tables(kv_caches)
    try:
        users, lengths = torch.tensor([3, 4]), torch.tensor([10, 8], dtype=torch.int32)
        meta = storage.build_index_meta(users, lengths)
        kv_metadata = types.SimpleNamespace(kv_indices=i32(0, 1, 2, 3, 4))
        handle = storage.offload_kvcache_launch(users, i32(0, 0), [], meta, kv_metadata)
        while not storage.offload_kvcache_wait(handle).ready:
            pass
        assert storage.finish_task(handle) == [1, 1]
        gpu = KVLookupResult(
            user_ids=meta.user_ids, gpu_cached_start_indices=i32(0, 0), gpu_cached_lengths=i32(0, 0)
        )
        found = KVLookupResult.merge(gpu, storage.lookup_kvcache(meta))
        assert found.host_cached_lengths.tolist() == [8, 8]
        storage.evict(torch.tensor([3]))  # the manager evicts user 3 before the onboard
        onboard_pages = types.SimpleNamespace(kv_indices=i32(40, 41, 42, 43, 44))
        launched = storage.onboard_kvcache_launch(meta, found, onboard_pages)
        waited = storage.onboard_kvcache_wait(launched)
        assert (waited.status, waited.ready) == (HostKVTaskStatus.FAILED, False)
        assert waited.failed_user_ids == [3] and waited.failed_mask.tolist() == [True, False]
        assert "loaded 0 of the 8 tokens" in waited.message
        # What the manager revokes: the pages the launch gave each user.
        assert launched.metadata["onboard_lengths"].tolist() == [8, 8]
    finally:
        storage.close()


def test_host_evict_false_keeps_the_host_kv_and_warns_as_flexkv_storage_does() -> None:
    # recsys's test_flexkv.py asserts that a host evict keeps everything (FlexKVStorage's
    # is a no-op); host_evict=False gives code written that way the same semantics.
    storage: Any = recsys._HostStorage(CONFIG, host_evict=False)
    storage.register_gpu_cache_tables(caches())
    try:
        users, lengths = [7, 8], [8, 8]
        storage.core.offload(users, [i32(0, 1), i32(2, 3)], lengths).outcomes()

        def cached() -> list[int]:
            hits = storage.core.lookup(users, lengths)
            storage.core.release(hits)
            return [0 if h is None else h.cached_tokens for h in hits]

        with pytest.warns(RuntimeWarning, match=r"evict\(\) keeps"):
            storage.evict(torch.tensor([7]))
        with pytest.warns(RuntimeWarning, match=r"evict_all\(\) keeps"):
            storage.evict_all()
        assert cached() == [8, 8]
        storage.host_evict = True
        storage.evict(torch.tensor([7]))
        assert cached() == [0, 8]
    finally:
        storage.close()


def test_host_evict_must_be_a_bool() -> None:
    with pytest.raises(aiokv.InvalidRequest, match=r"host_evict.*'no'"):
        recsys._HostStorage(CONFIG, host_evict="no")  # type: ignore[arg-type]


class GatedLaunches(StoreWrapper):
    """Each launch waits for ``gate``: copies the engine launched and has not finished."""

    def __init__(self, inner: aiokv.Store) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.gate.wait(30)
        self.inner.launch(*args, **kwargs)


def test_a_cancelled_task_reads_cancelled_only_once_its_copies_ended() -> None:
    # recsys's manager reuses a cancelled task's pages once its wait says so: that must
    # not come while aiokv still copies them (it never aborts a launched copy).
    store = GatedLaunches(aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01)))
    kv = aiokv.run_in_background(aiokv.OffloadEngine(
        store, caches(), aiokv.EngineConfig(window_us=0)))
    core = RecsysCore(kv)
    try:
        pending = core.offload([3, 4], [i32(0, 1), i32(2, 3)], [8, 8])
        assert pending.cancel()
        assert pending.poll(0.2) is None  # the copies are held: no answer yet
        store.gate.set()
        outcomes = pending.outcomes()
        assert [type(o) for o in outcomes] == [concurrent.futures.CancelledError] * 2
        assert wait_status(outcomes, [3, 4]).status == "cancelled"
        assert not pending.cancel()  # all done: nothing left to cancel
    finally:
        store.gate.set()
        kv.close()


def fake_recsys() -> types.SimpleNamespace:
    """recsys's types where recsys_kvcache_manager is not importable: enough for the
    storage's own calls (its statuses, handles and results as plain records)."""
    import enum

    status = enum.Enum("HostKVTaskStatus", {
        name.upper(): name for name in
        ("skipped", "launched", "ready", "timeout", "failed", "cancelled")})

    def record(**fields: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(**fields)

    def lookup_result(**fields: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(**{"cached_lengths": None, "gpu_cached_start_indices": None,
                                        "gpu_cached_lengths": None, **fields})

    return types.SimpleNamespace(
        HostKVTaskHandle=record, HostKVTaskStatus=status, HostKVWaitResult=record,
        KVIndexMeta=record, KVLookupResult=lookup_result)


def until(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError("never")


def test_an_onboard_refused_at_its_launch_gives_its_hits_back(
    storage_of: tuple[Any, list[torch.Tensor]],
) -> None:
    storage, _ = storage_of
    storage.core.offload([3, 4], [i32(0, 1), i32(2, 3)], [8, 8]).outcomes()
    meta = storage.build_index_meta(torch.tensor([3, 4]), torch.tensor([8, 8]))
    found = storage.lookup_kvcache(meta)
    hits = found.extra[recsys.HITS]
    assert [hit.held for hit in hits] == [True, True]
    short = types.SimpleNamespace(kv_indices=i32(40, 41, 42))  # 4 pages needed
    with pytest.raises(aiokv.InvalidRequest, match="kv_indices"):
        storage.onboard_kvcache_launch(meta, found, short)
    until(lambda: not any(hit.held for hit in hits))


@pytest.mark.parametrize(("lengths", "field"), [
    ([8], "index_meta.seq_lengths"), ([8, -1], "index_meta.seq_lengths")])
def test_a_batch_whose_lengths_do_not_fit_its_users_is_refused_naming_them(
    storage_of: tuple[Any, list[torch.Tensor]], lengths: list[int], field: str,
) -> None:
    storage, _ = storage_of
    meta = types.SimpleNamespace(user_ids=torch.tensor([3, 4]),
                                 seq_lengths=torch.tensor(lengths, dtype=torch.int32))
    with pytest.raises(aiokv.InvalidRequest, match=field):
        storage.lookup_kvcache(meta)
    with pytest.raises(aiokv.InvalidRequest, match=field):
        storage.offload_kvcache_launch(torch.tensor([3, 4]), i32(0, 0), [], meta,
                                       types.SimpleNamespace(kv_indices=i32(0, 1, 2, 3)))
    with pytest.raises(aiokv.InvalidRequest, match="kvcache_metadata"):
        storage.offload_kvcache_launch(torch.tensor([3, 4]), i32(0, 0), [], meta, None)


@pytest.mark.parametrize("wrong", ["users swapped", "a column too long"])
def test_an_onboard_of_a_lookup_result_that_is_not_this_batchs_is_refused(
    storage_of: tuple[Any, list[torch.Tensor]], wrong: str,
) -> None:
    # Same size, other users: user 3's KV would land in user 4's pages, answered READY.
    storage, kv_caches = storage_of
    storage.core.offload([3, 4], [i32(0, 1), i32(2, 3)], [8, 8]).outcomes()
    users = [3, 4]
    found = storage.lookup_kvcache(storage.build_index_meta(torch.tensor(users),
                                                            torch.tensor([8, 8])))
    if wrong == "users swapped":
        users, field = [4, 3], "lookup_result"
    else:
        found.gpu_cached_lengths, field = i32(0, 0, 0), "lookup_result.gpu_cached_lengths"
    meta = storage.build_index_meta(torch.tensor(users), torch.tensor([8, 8]))
    hits = found.extra[recsys.HITS]
    before = [cache[40:44].clone() for cache in kv_caches]
    with pytest.raises(aiokv.InvalidRequest, match=rf"^{field}: "):
        storage.onboard_kvcache_launch(meta, found, types.SimpleNamespace(
            kv_indices=i32(40, 41, 42, 43)))
    until(lambda: not any(hit.held for hit in hits))  # given back, not left to the TTL
    assert all(torch.equal(c[40:44], b) for c, b in zip(kv_caches, before, strict=True))


def offload_copies_held(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Offloads' copies to the host wait for the event returned (30 s at most)."""
    gate = threading.Event()
    move = Copier._move_cpu

    def held(copier: Any, job: Any) -> Any:
        if job.to_host:
            gate.wait(30)
        return move(copier, job)

    monkeypatch.setattr(Copier, "_move_cpu", held)
    return gate


def test_a_wait_answers_once_its_copies_ended_whatever_request_timeout_ms_says(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # A wait answered at a deadline, its copy still running: the manager reused the pages
    # and the late copy stored their next user's KV under this user.
    monkeypatch.setattr(recsys, "_recsys", fake_recsys)
    timed = {"engine": {"window_us": 0, "request_timeout_ms": 300},
             "store": {"cpu_cache_gb": 0.01}}
    gate = offload_copies_held(monkeypatch)
    kv_caches = caches()
    original = [cache[0:2].clone() for cache in kv_caches]
    storage: Any = recsys._HostStorage(timed)
    storage.register_gpu_cache_tables(kv_caches)
    try:
        assert "request_timeout_ms=300 is not used" in caplog.text
        meta = storage.build_index_meta(torch.tensor([3]), torch.tensor([8]))
        handle = storage.offload_kvcache_launch(
            meta.user_ids, i32(0), [], meta, types.SimpleNamespace(kv_indices=i32(0, 1)))
        time.sleep(0.6)  # twice the config's timeout: still the copy's
        assert storage.offload_kvcache_wait(handle).status.value == "launched"
        gate.set()
        until(lambda: storage.offload_kvcache_wait(handle).ready)
        for cache in kv_caches:
            cache[0:2] = 7.0  # the manager reuses the pages once the wait answered
        found = storage.lookup_kvcache(meta)
        launched = storage.onboard_kvcache_launch(
            meta, found, types.SimpleNamespace(kv_indices=i32(40, 41)))
        assert storage.onboard_kvcache_wait(launched).ready
        assert all(torch.equal(c[40:42], o) for c, o in zip(kv_caches, original, strict=True))
    finally:
        gate.set()
        storage.close()


def test_cancel_task_of_a_task_already_done_cancels_nothing_and_says_so(
    storage_of: tuple[Any, list[torch.Tensor]],
) -> None:
    # Its copies had ended: cancel_task answered True and marked the handle CANCELLED,
    # while the wait answered READY (the KV stored all the same).
    storage, kv_caches = storage_of
    meta = storage.build_index_meta(torch.tensor([3, 4]), torch.tensor([8, 8]))
    handle = storage.offload_kvcache_launch(
        meta.user_ids, i32(0, 0), [], meta, types.SimpleNamespace(kv_indices=i32(0, 1, 2, 3)))
    handle.handle.pending.outcomes()  # the copies end before the manager polls
    assert storage.cancel_task(handle) is False
    assert handle.status.value == "launched"
    assert storage.offload_kvcache_wait(handle).status.value == "ready"
    assert storage.finish_task(handle) == [1, 1]
    found = storage.lookup_kvcache(meta)
    assert found.host_cached_lengths.tolist() == [8, 8]
    launched = storage.onboard_kvcache_launch(
        meta, found, types.SimpleNamespace(kv_indices=i32(40, 41, 42, 43)))
    assert storage.onboard_kvcache_wait(launched).ready
    assert all(torch.equal(c[40:44], c[0:4]) for c in kv_caches)


def test_cancel_task_of_a_task_in_flight_answers_true_and_its_wait_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(recsys, "_recsys", fake_recsys)
    gate = offload_copies_held(monkeypatch)
    storage: Any = recsys._HostStorage(CONFIG)
    storage.register_gpu_cache_tables(caches())
    try:
        meta = storage.build_index_meta(torch.tensor([3]), torch.tensor([8]))
        handle = storage.offload_kvcache_launch(
            meta.user_ids, i32(0), [], meta, types.SimpleNamespace(kv_indices=i32(0, 1)))
        assert storage.cancel_task(handle) is True
        assert handle.status.value == "cancelled"
        gate.set()
        until(lambda: storage.offload_kvcache_wait(handle).status.value != "launched")
        assert storage.offload_kvcache_wait(handle).status.value == "cancelled"
    finally:
        gate.set()
        storage.close()


def test_a_history_longer_than_the_host_tier_stores_its_longest_prefix_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The manager hands over whole sequences: the engine refused user 1's whole, and the
    # manager then counted the batch's every user as not offloaded (fail_close: raising
    # at every later step with user 1).
    monkeypatch.setattr(recsys, "_recsys", fake_recsys)
    g = torch.Generator().manual_seed(1)
    kv_caches = [torch.randn(256, 2, PAGE_SIZE, 2, 8, generator=g) for _ in range(2)]
    storage: Any = recsys._HostStorage(
        {"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 0.00002}})
    storage.register_gpu_cache_tables(kv_caches)
    try:
        host = storage.core.kv.stats().host_blocks_total * PAGE_SIZE
        assert 0 < host < 100 * PAGE_SIZE
        for users, lengths in (([1], [100 * PAGE_SIZE]), ([1, 2], [100 * PAGE_SIZE, 8])):
            meta = storage.build_index_meta(torch.tensor(users), torch.tensor(lengths))
            handle = storage.offload_kvcache_launch(
                meta.user_ids, i32(*[0] * len(users)), [], meta,
                types.SimpleNamespace(kv_indices=i32(*range(100 + 2 * (len(users) - 1)))))
            until(lambda h=handle: storage.offload_kvcache_wait(h).status.value != "launched")
            assert storage.offload_kvcache_wait(handle).status.value == "ready"
            assert storage.finish_task(handle) == [1] * len(users)
            assert storage.get_offload_handle_metadata(handle)[2].tolist() == [host, 8][
                :len(users)]
            if users == [1]:  # alone: its prefix is all the host holds, bytes exact
                found = storage.lookup_kvcache(meta)
                assert found.host_cached_lengths.tolist() == [host]
                pages = host // PAGE_SIZE
                launched = storage.onboard_kvcache_launch(
                    meta, found, types.SimpleNamespace(kv_indices=i32(*range(128, 228))))
                assert storage.onboard_kvcache_wait(launched).ready
                assert all(torch.equal(c[128:128 + pages], c[0:pages]) for c in kv_caches)
        short = storage.build_index_meta(torch.tensor([2]), torch.tensor([8]))
        found = storage.lookup_kvcache(short)
        assert found.host_cached_lengths.tolist() == [8]
        launched = storage.onboard_kvcache_launch(
            short, found, types.SimpleNamespace(kv_indices=i32(240, 241)))
        assert storage.onboard_kvcache_wait(launched).ready
        assert all(torch.equal(c[240:242], c[100:102]) for c in kv_caches)
    finally:
        storage.close()


def test_offload_lengths_are_full_pages_at_most_what_one_offload_can_store() -> None:
    assert offload_lengths([7, 100, 0], 4, 80) == [4, 80, 0]
    assert offload_lengths([7, 100], 4, 82) == [4, 80]
    assert offload_lengths([7, 100], 4, None) == [4, 100]


def test_cancel_task_from_another_thread_as_the_task_ends_never_recants_its_answer(
    storage_of: tuple[Any, list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # cancel_task on a thread of its own (a request abort) found the copy still running
    # and was descheduled; meanwhile the copy ended and the manager's finish_task answered
    # [1] (stored). cancel_task then answered True and marked the handle CANCELLED: the
    # same task's wait read CANCELLED and finish_task [0] after it had said stored.
    storage, _ = storage_of
    gate = offload_copies_held(monkeypatch)
    meta = storage.build_index_meta(torch.tensor([3]), torch.tensor([8]))
    handle = storage.offload_kvcache_launch(
        meta.user_ids, i32(0), [], meta, types.SimpleNamespace(kv_indices=i32(0, 1)))
    future = handle.handle.pending._futures[0]
    checked, resume = threading.Event(), threading.Event()
    real_done = future.done

    def done_then_descheduled() -> bool:
        answer = real_done()
        if threading.current_thread().name == "canceller" and not checked.is_set():
            checked.set()  # the canceller read the copy as running, and stops here
            assert resume.wait(30)
        return answer

    future.done = done_then_descheduled
    answers: list[bool] = []
    canceller = threading.Thread(
        target=lambda: answers.append(storage.cancel_task(handle)), name="canceller")
    canceller.start()
    try:
        assert checked.wait(30)
        gate.set()
        assert storage.finish_task(handle) == [1]  # the manager saw the KV stored
        seen = storage.offload_kvcache_wait(handle)
        assert (seen.status.value, seen.ready) == ("ready", True)
    finally:
        gate.set()
        resume.set()
        canceller.join(30)
    assert answers == [False]  # nothing was left to cancel by then
    assert handle.status.value == "launched"
    assert storage.offload_kvcache_wait(handle).status.value == "ready"
    assert storage.finish_task(handle) == [1]
