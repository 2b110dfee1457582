"""On a GPU, through run_in_background and the recsys-examples core: a thread that writes
its pages on a side stream (as a CUDA graph replay does) and calls aiokv right after,
without synchronizing, gets its pages copied after those writes, and a load lands after
what its stream queued before the call. The CUDA stream that counts is the calling
thread's current one, not the engine loop thread's. Skipped without CUDA."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import aiokv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 64, 16, 2, 64
TOKENS = 4 * PAGE_SIZE
# About 0.1-0.5 s of GPU time on current GPUs: far longer than a batch window, so a copy
# that did not wait for the caller's stream would run before the writes queued behind it.
BUSY_CYCLES = 500_000_000
CONFIG = {"engine": {"window_us": 0}, "store": {"cpu_cache_gb": 0.01}}


class Rig:
    """CUDA caches of zeros, a first write of random pages, and a side stream."""

    def __init__(self, non_blocking: bool) -> None:
        self.device = torch.device("cuda")
        self.caches = [
            torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=self.device)
            for _ in range(LAYERS)
        ]
        self.first = [
            torch.randn(4, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=self.device) for _ in range(LAYERS)
        ]
        self.source = torch.arange(0, 4, device=self.device)
        self.target = torch.arange(8, 12, device=self.device)
        self.source_pages, self.target_pages = slice(0, 4), slice(8, 12)  # the same pages
        self.side, self._keep = side_stream(self.device, non_blocking)
        torch.cuda.synchronize(self.device)  # the tensors above are made and filled

    def write_late(self, pages: slice, data: list[torch.Tensor] | float) -> None:
        """Queue, on the current stream, a long busy kernel and then writes to ``pages``.
        Slices, not an index tensor: indexing with a device tensor can wait for the
        stream on the host, and the race would be gone before aiokv is called."""
        torch.cuda._sleep(BUSY_CYCLES)
        for layer, cache in enumerate(self.caches):
            if isinstance(data, float):
                cache[pages].fill_(data)
            else:
                cache[pages].copy_(data[layer])

    def warm_up(self, offload: Callable[..., Any], lookup: Callable[..., Any],
                load: Callable[..., Any]) -> None:
        """One synchronized round trip of another user first: the first calls allocate
        (pinned pools, device buffers), and an allocation can synchronize the whole
        device, which would hide a missing wait on the caller's stream."""
        warm, back = torch.arange(20, 24, device=self.device), torch.arange(30, 34, device=self.device)
        offload(warm)
        load(lookup(), back)
        torch.cuda.synchronize(self.device)

    def assert_target_holds_first(self) -> None:
        torch.cuda.synchronize(self.device)  # whatever is still queued has landed
        for cache, data in zip(self.caches, self.first, strict=True):
            assert torch.equal(cache[self.target].cpu(), data.cpu())


def side_stream(device: torch.device, non_blocking: bool) -> tuple[Any, Any]:
    """A torch pool stream, or one made with cudaStreamNonBlocking (through CuPy), as a CUDA
    graph's capture stream or another library's stream may be: no implicit ordering with
    the legacy default stream, whose event a caller's thread would otherwise wait on."""
    if not non_blocking:
        return torch.cuda.Stream(device), None  # type: ignore[no-untyped-call]
    cupy = pytest.importorskip("cupy", reason="CuPy makes the non-blocking stream")
    stream = cupy.cuda.Stream(non_blocking=True)
    return torch.cuda.ExternalStream(stream.ptr, device=device), stream


@pytest.fixture(params=[False, True], ids=["pool-stream", "non-blocking-stream"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    yield Rig(request.param)
    torch.cuda.synchronize()


def background_warm_up(rig: Rig, kv: aiokv.BackgroundEngine) -> None:
    def lookup() -> Any:
        return kv.lookup("warm", TOKENS)

    rig.warm_up(lambda pages: kv.offload("warm", pages, TOKENS), lookup,
                lambda hit, pages: kv.load(hit, pages))


def test_background_offload_copies_what_the_callers_side_stream_wrote(rig: Rig) -> None:
    engine = aiokv.open_engine(CONFIG, kv_caches=rig.caches)
    with aiokv.run_in_background(engine) as kv:
        background_warm_up(rig, kv)
        with torch.cuda.stream(rig.side):
            rig.write_late(rig.source_pages, rig.first)
            stored = kv.offload("u", rig.source, TOKENS)  # no synchronize before it
            rig.write_late(rig.source_pages, -1.0)  # the pages are the caller's again
        assert stored.stored_tokens == TOKENS
        with kv.lookup("u", TOKENS) as hit:
            assert kv.load(hit, rig.target).loaded_tokens == TOKENS
        rig.assert_target_holds_first()


def test_background_load_lands_after_what_the_callers_side_stream_queued(rig: Rig) -> None:
    engine = aiokv.open_engine(CONFIG, kv_caches=rig.caches)
    with aiokv.run_in_background(engine) as kv:
        background_warm_up(rig, kv)
        for cache, data in zip(rig.caches, rig.first, strict=True):
            cache[rig.source] = data
        torch.cuda.synchronize(rig.device)
        kv.offload("u", rig.source, TOKENS)
        with torch.cuda.stream(rig.side):
            # The caller still clears its target pages (an old user's, say) when it asks
            # for the load: the load must land after that, not under it.
            rig.write_late(rig.target_pages, 0.0)
            with kv.lookup("u", TOKENS) as hit:
                assert kv.load(hit, rig.target).loaded_tokens == TOKENS
        rig.assert_target_holds_first()


def test_recsys_core_offload_and_onboard_follow_the_callers_side_stream(rig: Rig) -> None:
    # Imported here: the tests above also run on code that predates the integration.
    from aiokv.integrations.recsys_core import RecsysCore

    core = RecsysCore.open(CONFIG, rig.caches)
    try:
        rig.warm_up(
            lambda pages: core.offload([9], [pages], [TOKENS]).outcomes(),
            lambda: core.lookup([9], [TOKENS])[0],
            lambda hit, pages: core.load([hit], [pages]).outcomes(),
        )
        with torch.cuda.stream(rig.side):
            rig.write_late(rig.source_pages, rig.first)
            pages = rig.source.to(torch.int32)  # recsys's page ids, passed as they are
            outcomes = core.offload([7], [pages], [TOKENS]).outcomes()
            rig.write_late(rig.source_pages, -1.0)
            assert outcomes[0].stored_tokens == TOKENS
            hits = core.lookup([7], [TOKENS])
            rig.write_late(rig.target_pages, 0.0)
            assert hits[0] is not None
            loaded = core.load([hits[0]], [rig.target.to(torch.int32)]).outcomes()
            assert loaded[0].loaded_tokens == TOKENS
        rig.assert_target_holds_first()
    finally:
        core.close()
