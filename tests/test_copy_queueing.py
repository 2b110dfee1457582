"""Queueing a plan's driver calls (aiokv/copy/queueing.py), in C and in Python, checked on
the CPU by the bytes: a fake driver whose copy calls are memmoves over CPU tensors, whose
events snapshot what is in place when they are recorded, whose streams refuse copies
until they waited for the ready event, and which can fail a chosen call."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch
from conftest import make_caches

from aiokv.copy.copier import paced_layers
from aiokv.copy.driver import BATCH_SIGNATURE, DriverError, Memcpy2D
from aiokv.copy.plan import MIN_RUN, Geometry, plan
from aiokv.copy.queueing import (
    COPY2D_SIGNATURE,
    RECORD_SIGNATURE,
    SYNC_SIGNATURE,
    WAIT_SIGNATURE,
    Entries,
    Queuer,
    native_run,
)

LAYERS = 3
STREAMS = [101, 102, 103, 104]  # fake CUstream handles
READY = 7  # a fake event handle
INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE


@pytest.fixture(params=["native", "python"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native" and native_run() is None:
        pytest.skip("the extension aiokv.copy._queue is not built (pip install -e .)")
    return bool(request.param == "native")


class FakeDriver:
    """Copies are memmoves; an event records, per stream, a snapshot of ``watch`` taken
    when it is recorded. Streams refuse to copy before they waited for READY, where
    ``ready`` is required. ``fail_batch``: (layer, copy in the call) of a batch call to
    fail; ``fail_2d``: the number of 2-D copies to make before one fails."""

    def __init__(self, watch: list[torch.Tensor], dst_layer_of: dict[int, int],
                 ready: bool = False) -> None:
        self.watch = watch
        self.dst_layer_of = dst_layer_of  # a destination address -> its layer
        self.released: set[int] = set() if ready else set(STREAMS)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.fail_batch: tuple[int, int] | None = None
        self.fail_index: int | None = None  # the index a failed batch call reports
        self.fail_2d: int | None = None
        self._calls = [BATCH_SIGNATURE(self._batch), COPY2D_SIGNATURE(self._copy2d),
                       RECORD_SIGNATURE(self._record), WAIT_SIGNATURE(self._wait)]

    @property
    def entries(self) -> Entries:
        batch, copy2d, record, wait = (ctypes.cast(c, ctypes.c_void_p).value or 0
                                       for c in self._calls)
        return Entries(batch, copy2d, record, wait, name_error=lambda err: f"error {err}")

    def _batch(self, dsts: int, srcs: int, sizes: int, count: int, attrs: int,
               attr_idxs: int, num_attrs: int, fail_idx: int, stream: int) -> int:
        if stream not in self.released:
            return INVALID_VALUE
        d, s, n = ((ctypes.c_uint64 * count).from_address(a) for a in (dsts, srcs, sizes))
        for i in range(count):
            if self.fail_batch == (self.dst_layer_of.get(d[i]), i):
                ctypes.c_size_t.from_address(fail_idx).value = (
                    i if self.fail_index is None else self.fail_index)
                return INVALID_VALUE
            ctypes.memmove(d[i], s[i], n[i])
        return 0

    def _copy2d(self, op_ptr: ctypes._Pointer[Memcpy2D], stream: int) -> int:
        if stream not in self.released:
            return INVALID_VALUE
        if self.fail_2d is not None:
            if self.fail_2d == 0:
                return INVALID_VALUE
            self.fail_2d -= 1
        op = op_ptr.contents
        for row in range(op.Height):
            ctypes.memmove(op.dstDevice + row * op.dstPitch, op.srcDevice + row * op.srcPitch,
                           op.WidthInBytes)
        return 0

    def _record(self, event: int, stream: int) -> int:
        self.snapshots[event] = [t.clone() for t in self.watch]
        return 0

    def _wait(self, stream: int, event: int, flags: int) -> int:
        if event == READY:
            self.released.add(stream)
        return 0


def setup(placement: str, to_host: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    """Caches, a pool, (pages, blocks) in runs or scattered, and the plan of the copies."""
    m = MIN_RUN
    caches = make_caches(pages=4 * m, layers=LAYERS, seed=seed)
    pool = torch.zeros(3 * m, LAYERS, *caches[0].shape[1:], dtype=caches[0].dtype)
    if placement == "runs":  # two runs and a few singles
        pages = np.concatenate([np.arange(5, 5 + m), [200, 3], np.arange(m + 9, 2 * m + 20)])
        blocks = np.concatenate([np.arange(0, m), [2 * m + 40, m + 2], np.arange(m + 3, 2 * m + 14)])
    else:
        rng = np.random.default_rng(seed)
        pages = rng.choice(4 * m, size=50, replace=False).astype(np.int64)
        blocks = rng.choice(3 * m, size=50, replace=False).astype(np.int64)
    if not to_host:  # a load: the pool holds the pages, the caches are cleared
        for layer, cache in enumerate(caches):
            pool[torch.from_numpy(blocks), layer] = cache[torch.from_numpy(pages)]
        expect = [cache[torch.from_numpy(pages)].clone() for cache in caches]
        for cache in caches:
            cache.zero_()
    else:
        expect = [cache[torch.from_numpy(pages)].clone() for cache in caches]
    geometry = Geometry.of(caches, pool)
    copies = plan(geometry, pages, blocks, to_host, len(STREAMS))
    return caches, pool, pages, blocks, expect, copies, geometry


def moved(caches: list[torch.Tensor], pool: torch.Tensor, pages: np.ndarray,
          blocks: np.ndarray, to_host: bool, layer: int) -> torch.Tensor:
    if to_host:
        return pool[torch.from_numpy(blocks), layer]
    return caches[layer][torch.from_numpy(pages)]


def layer_of(geometry: Geometry, copies_dsts: np.ndarray) -> dict[int, int]:
    return {int(a): layer for layer in range(copies_dsts.shape[0])
            for a in copies_dsts[layer].tolist()}


@pytest.mark.parametrize("placement", ["runs", "scattered"])
@pytest.mark.parametrize("to_host", [True, False])
def test_every_page_of_every_layer_lands_and_each_layer_is_in_place_at_its_event(
    native: bool, placement: str, to_host: bool
) -> None:
    caches, pool, pages, blocks, expect, copies, geometry = setup(placement, to_host)
    assert (copies.runs is not None) == (placement == "runs")
    watch = [pool] if to_host else caches
    fake = FakeDriver(watch, layer_of(geometry, copies.dsts), ready=True)
    queuer = Queuer(fake.entries, STREAMS, native=native)
    assert queuer.native == native
    used = copies.streams
    layer_events = list(range(1000, 1000 + LAYERS * used))
    ends = list(range(2000, 2000 + used))
    prepared = queuer.prepare(copies, LAYERS, READY, layer_events, ends)
    for layer in range(LAYERS):  # a load's way: one call per layer
        queuer.queue(prepared, layer, layer + 1, wait_ready=layer == 0, end=layer == LAYERS - 1)
        # Layer `layer` is in place when its last stream's event is recorded.
        snapshot = fake.snapshots[layer_events[layer * used + used - 1]]
        got = (snapshot[0][torch.from_numpy(blocks), layer] if to_host
               else snapshot[layer][torch.from_numpy(pages)])
        assert torch.equal(got, expect[layer])
    for layer in range(LAYERS):
        assert torch.equal(moved(caches, pool, pages, blocks, to_host, layer), expect[layer])
    assert set(ends) <= set(fake.snapshots)


@pytest.mark.parametrize("placement", ["runs", "scattered"])
def test_one_call_moves_every_layer(native: bool, placement: str) -> None:
    caches, pool, pages, blocks, expect, copies, geometry = setup(placement, True, seed=3)
    fake = FakeDriver([pool], layer_of(geometry, copies.dsts))
    queuer = Queuer(fake.entries, STREAMS, native=native)
    prepared = queuer.prepare(copies, LAYERS, end_events=list(range(50, 50 + copies.streams)))
    queuer.queue(prepared, 0, LAYERS, wait_ready=True, end=True)
    for layer in range(LAYERS):
        assert torch.equal(moved(caches, pool, pages, blocks, True, layer), expect[layer])
    untouched = torch.from_numpy(np.setdiff1d(np.arange(len(pool)), blocks))
    assert not pool[untouched].any()


def test_no_copy_is_made_before_the_streams_waited_for_the_ready_event(native: bool) -> None:
    caches, pool, pages, blocks, _, copies, geometry = setup("scattered", True, seed=5)
    fake = FakeDriver([pool], layer_of(geometry, copies.dsts), ready=True)
    queuer = Queuer(fake.entries, STREAMS, native=native)
    prepared = queuer.prepare(copies, LAYERS, READY)
    queuer.queue(prepared, 0, LAYERS, wait_ready=True, end=False)  # waits first: copies land
    assert torch.equal(moved(caches, pool, pages, blocks, True, 0), caches[0][torch.from_numpy(pages)])
    # Without the ready event, the fake's streams refuse the first copy.
    fake2 = FakeDriver([pool], layer_of(geometry, copies.dsts), ready=True)
    prepared2 = Queuer(fake2.entries, STREAMS, native=native).prepare(copies, LAYERS)
    with pytest.raises(DriverError, match="cuMemcpyBatchAsync failed"):
        Queuer(fake2.entries, STREAMS, native=native).queue(prepared2, 0, LAYERS, True, True)


def test_a_failed_batch_call_names_the_layer_and_the_copy(native: bool) -> None:
    caches, pool, pages, blocks, _, copies, geometry = setup("scattered", True, seed=6)
    fake = FakeDriver([pool], layer_of(geometry, copies.dsts))
    fake.fail_batch = (1, 2)  # layer 1, the third copy of a call
    queuer = Queuer(fake.entries, STREAMS, native=native)
    prepared = queuer.prepare(copies, LAYERS)
    with pytest.raises(DriverError) as failed:
        queuer.queue(prepared, 0, LAYERS, wait_ready=True, end=True)
    dst, src, size = (int(a[2]) for a in copies.part(1, 0))
    assert str(failed.value) == (
        f"cuMemcpyBatchAsync failed (layer 1, stream 0, copy 2: {size} bytes from {src:#x} "
        f"to {dst:#x}): error {INVALID_VALUE}"
    )
    # Layer 0 was queued in full before the failure; nothing of layer 2 was.
    assert torch.equal(pool[torch.from_numpy(blocks), 0], caches[0][torch.from_numpy(pages)])
    assert not pool[:, 2].any()


def test_a_failed_batch_call_whose_index_names_no_copy_still_fails_the_job_typed(
        native: bool) -> None:
    _, pool, _, _, _, copies, geometry = setup("scattered", True, seed=6)
    fake = FakeDriver([pool], layer_of(geometry, copies.dsts))
    fake.fail_batch, fake.fail_index = (1, 2), 10**6  # outside the call's copies
    queuer = Queuer(fake.entries, STREAMS, native=native)
    prepared = queuer.prepare(copies, LAYERS)
    with pytest.raises(DriverError) as failed:
        queuer.queue(prepared, 0, LAYERS, wait_ready=True, end=True)
    assert str(failed.value) == (
        f"cuMemcpyBatchAsync failed (layer 1, stream 0): error {INVALID_VALUE}")


def test_a_failed_2d_copy_names_its_run(native: bool) -> None:
    _, pool, _, _, _, copies, geometry = setup("runs", True, seed=7)
    assert copies.runs is not None
    fake = FakeDriver([pool], layer_of(geometry, copies.dsts))
    fake.fail_2d = 0
    queuer = Queuer(fake.entries, STREAMS, native=native)
    prepared = queuer.prepare(copies, LAYERS)
    with pytest.raises(DriverError, match=re.escape("cuMemcpy2DAsync failed (layer 0, stream ")
                       + r"\d, run \d: " + str(MIN_RUN)) as failed:
        queuer.queue(prepared, 0, LAYERS, wait_ready=True, end=True)
    assert str(failed.value).endswith(f"error {INVALID_VALUE}")


def test_without_the_extension_the_python_loop_moves_the_bytes_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aiokv.copy import queueing

    monkeypatch.setattr(queueing, "native_run", lambda: None)
    monkeypatch.setattr(queueing, "_python_warned", False)
    caches, pool, pages, blocks, expect, copies, geometry = setup("runs", True, seed=8)
    fake = FakeDriver([pool], layer_of(geometry, copies.dsts))
    with caplog.at_level("WARNING", logger="aiokv"):
        queuers = [Queuer(fake.entries, STREAMS) for _ in range(2)]
    assert not any(q.native for q in queuers)
    warnings = [r.getMessage() for r in caplog.records if "aiokv.copy._queue" in r.getMessage()]
    assert len(warnings) == 1 and "not built" in warnings[0]
    queuers[0].queue(queuers[0].prepare(copies, LAYERS), 0, LAYERS, wait_ready=True, end=True)
    for layer in range(LAYERS):
        assert torch.equal(moved(caches, pool, pages, blocks, True, layer), expect[layer])


class PacedDriver(FakeDriver):
    """The fake driver with a device that runs behind the host: the bytes a stream was
    given count as waiting on the copy engines until the host synchronized an event
    recorded after them; ``most_waiting`` is the most that ever waited at once."""

    def __init__(self, watch: list[torch.Tensor], dst_layer_of: dict[int, int]) -> None:
        super().__init__(watch, dst_layer_of)
        self.given = dict.fromkeys(STREAMS, 0)
        self.ran = dict.fromkeys(STREAMS, 0)
        self.recorded: dict[int, tuple[int, int]] = {}  # event -> (stream, bytes given)
        self.most_waiting = 0
        self._calls.append(SYNC_SIGNATURE(self._sync))

    @property
    def entries(self) -> Entries:
        batch, copy2d, record, wait, sync = (ctypes.cast(c, ctypes.c_void_p).value or 0
                                             for c in self._calls)
        return Entries(batch, copy2d, record, wait, lambda err: f"error {err}", sync)

    def _given(self, stream: int, nbytes: int) -> None:
        self.given[stream] += nbytes
        waiting = sum(self.given[s] - self.ran[s] for s in STREAMS)
        self.most_waiting = max(self.most_waiting, waiting)

    def _batch(self, dsts: int, srcs: int, sizes: int, count: int, attrs: int,
               attr_idxs: int, num_attrs: int, fail_idx: int, stream: int) -> int:
        err = super()._batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx,
                             stream)
        if not err:
            self._given(stream, sum((ctypes.c_uint64 * count).from_address(sizes)))
        return err

    def _copy2d(self, op_ptr: ctypes._Pointer[Memcpy2D], stream: int) -> int:
        err = super()._copy2d(op_ptr, stream)
        if not err:
            self._given(stream, op_ptr.contents.Height * op_ptr.contents.WidthInBytes)
        return err

    def _record(self, event: int, stream: int) -> int:
        self.recorded[event] = (stream, self.given[stream])
        return super()._record(event, stream)

    def _sync(self, event: int) -> int:
        if event not in self.recorded:  # the host would not wait for anything
            return INVALID_VALUE
        stream, given = self.recorded[event]
        self.ran[stream] = max(self.ran[stream], given)
        return 0


@pytest.mark.parametrize("placement", ["runs", "scattered"])
@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_a_paced_offload_keeps_no_more_than_its_layers_ahead_waiting(
    native: bool, placement: str, ahead: int
) -> None:
    caches, pool, pages, blocks, expect, copies, geometry = setup(placement, True, seed=9)
    fake = PacedDriver([pool], layer_of(geometry, copies.dsts))
    queuer = Queuer(fake.entries, STREAMS, native=native)
    used = copies.streams
    prepared = queuer.prepare(copies, LAYERS, layer_events=list(range(300, 300 + LAYERS * used)),
                              end_events=list(range(400, 400 + used)), ahead=ahead)
    queuer.queue(prepared, 0, LAYERS, wait_ready=True, end=True)
    for layer in range(LAYERS):
        assert torch.equal(moved(caches, pool, pages, blocks, True, layer), expect[layer])
    layer_bytes = len(pages) * geometry.page_bytes
    assert fake.most_waiting == (ahead or LAYERS) * layer_bytes


def test_pacing_needs_layer_events_and_the_sync_call() -> None:
    _, pool, _, _, _, copies, geometry = setup("scattered", True, seed=10)
    plain = Queuer(FakeDriver([pool], layer_of(geometry, copies.dsts)).entries, STREAMS)
    paced = Queuer(PacedDriver([pool], layer_of(geometry, copies.dsts)).entries, STREAMS)
    with pytest.raises(ValueError, match="layer events"):
        paced.prepare(copies, LAYERS, ahead=1)
    with pytest.raises(ValueError, match="cuEventSynchronize"):
        plain.prepare(copies, LAYERS, layer_events=[1] * LAYERS * copies.streams, ahead=1)


PAGE_64K = 64 << 10  # bf16, 4 heads x 128, 32 tokens: one page of one layer


def geometry_of(layers: int, page_bytes: int = PAGE_64K) -> Geometry:
    return Geometry(layer_bases=tuple(range(layers)), page_stride=page_bytes,
                    page_bytes=page_bytes, gpu_pages=1 << 20, host_base=0, num_blocks=1 << 20,
                    block_stride=layers * page_bytes)


@pytest.mark.parametrize(("pages", "layers", "ahead"), [
    (128, 8, 0),  # 8 x 8 MiB = MAX: small enough to queue whole
    (256, 8, 4),  # 8 x 1024 tokens, 8 x 16 MiB: four layers are MAX
    (2048, 8, 2),  # 32 x 2048 tokens, 8 x 128 MiB: still two, never fewer
    (4096, 2, 0),  # two layers: pacing could only stall the engines
    (512, 3, 2),
    (114, 10, 8),  # 10 x 7.1 MiB: eight fit in MAX
])
def test_an_offload_is_paced_by_its_whole_bytes(pages: int, layers: int, ahead: int) -> None:
    """The window counts every layer of the job's pages (not one layer's bytes)."""
    assert paced_layers(pages, geometry_of(layers)) == ahead
