"""The host tier's memory, pinned in chunks: bounds, the ready watermark, partial pins."""

from __future__ import annotations

import itertools
import mmap
import threading
import time

import numpy as np
import pytest
import torch

from aiokv.errors import ConfigError
from aiokv.stores.local.hostmem import HostMemory, chunk_bounds
from aiokv.stores.local.layout import TRAILER_BYTES, block_stride
from aiokv.stores.local.pool import HostPool
from aiokv.stores.shared.region import Geometry, region_blocks


def test_chunk_bounds_grow_cover_everything_and_keep_pages_whole() -> None:
    block_bytes = 3 * 1024  # three blocks do not fill a page; four fill three pages
    bounds = chunk_bounds(2_000_001, block_bytes, chunk_bytes=1 << 30)  # about 6 GiB
    assert bounds[0] == 0 and bounds[-1] == 2_000_001
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert all(s > 0 for s in sizes)
    assert sizes[0] * 8 <= sizes[-2]  # the first chunks are the small ones
    assert max(sizes) * block_bytes <= 1 << 30
    for start in bounds[:-1]:
        assert start * block_bytes % mmap.PAGESIZE == 0


def test_unpinned_memory_is_ready_at_once() -> None:
    memory = HostMemory(8, (2, 4), torch.float16, pin=False)
    assert memory.ready_blocks == 8
    assert memory.data.shape == (8, 2, 4) and memory.data.dtype == torch.float16
    memory.data[3] = 1.5  # backed by the mapping, writable
    assert float(memory.data[3].sum()) == 12.0
    memory.wait_first(0)
    assert memory.wait_all(0)


def test_pinned_chunks_register_in_order_and_unregister_on_close() -> None:
    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []
    memory = HostMemory(
        4096, (1024,), torch.uint8, pin=True, threads=3, chunk_bytes=1 << 20,
        register=lambda a, n: registered.append((a, n)), unregister=unregistered.append,
    )
    assert memory.ready_blocks == 0
    memory.start()
    memory.wait_first(10)
    assert memory.ready_blocks > 0
    assert memory.wait_all(10)
    assert memory.ready_blocks == 4096 and memory.error is None
    base = memory.data.data_ptr()
    assert registered[0][0] == base
    assert sum(n for _, n in registered) == 4096 * 1024
    for (a, n), (b, _) in itertools.pairwise(registered):
        assert a + n == b  # contiguous, in order, no page registered twice
    memory.close()
    assert unregistered == [a for a, _ in registered]


def test_a_failed_chunk_stops_at_what_was_pinned(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    def register(address: int, size: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("out of pinnable memory")

    memory = HostMemory(4096, (1024,), torch.uint8, pin=True, chunk_bytes=1 << 20,
                        register=register, unregister=lambda a: None)
    memory.start()
    assert memory.wait_all(10)
    bounds = chunk_bounds(4096, 1024, 1 << 20)
    assert memory.ready_blocks == bounds[2]  # two chunks pinned, then it stopped
    assert isinstance(memory.error, RuntimeError)
    # The log says how much (4 MiB: in GiB alone, "0.00 of 0.00").
    assert f"pinned {bounds[2]} of 4096 blocks" in caplog.text
    memory.wait_first(0)  # something was pinned: no error
    memory.close()


def test_no_chunk_pinned_is_a_config_error_naming_the_key() -> None:
    def register(address: int, size: int) -> None:
        raise RuntimeError("no")

    memory = HostMemory(64, (1024,), torch.uint8, pin=True, register=register,
                        unregister=lambda a: None)
    memory.start()
    with pytest.raises(ConfigError, match="cpu_cache_gb"):
        memory.wait_first(10)
    memory.close()


def test_close_while_pinning_stops_it() -> None:
    def register(address: int, size: int) -> None:
        # The close comes while this chunk is pinned: the call returns only once close()
        # has asked the pinning to stop. (Opened at once, it let a busy runner pin all four
        # chunks before the closer thread got to run.)
        for _ in range(10_000):
            if memory._stop:
                break
            time.sleep(0.001)

    memory = HostMemory(4096, (1024,), torch.uint8, pin=True, chunk_bytes=1 << 20,
                        register=register, unregister=lambda a: None)
    memory.start()
    closer = threading.Thread(target=memory.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert memory.ready_blocks < 4096


def test_a_reserve_beyond_the_pinned_part_waits_for_the_pool_to_grow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At start-up a store that needs more blocks than are pinned yet waits for the next
    chunks (milliseconds) instead of answering "no space"."""

    from aiokv.stores.local import hostmem
    from aiokv.stores.local.blocks import Tier

    monkeypatch.setattr(hostmem, "_cuda_register", lambda address, size: time.sleep(0.02))
    monkeypatch.setattr(hostmem, "_cuda_unregister", lambda address: None)
    pool = HostPool(12288, (16 << 10,), torch.uint8, pin=True)  # chunks of 64, 128 MiB
    tier = Tier("host", pool)
    first_chunk = chunk_bounds(12288, 16 << 10)[1]
    assert first_chunk < 12288
    blocks = tier.reserve(12288)  # the whole pool: waits until all of it is pinned
    assert len(blocks) == 12288 and pool.memory.ready_blocks == 12288
    pool.close()


def test_memory_collected_unclosed_unregisters_before_the_mapping_goes() -> None:
    """A range unmapped while registered would stay in the driver's table, and a later
    mapping at that address could not be registered."""
    import gc

    unregistered: list[int] = []
    memory = HostMemory(1024, (1024,), torch.uint8, pin=True,
                        register=lambda a, n: None, unregister=unregistered.append)
    memory.start()
    assert memory.wait_all(10)
    base = memory.data.data_ptr()
    del memory
    gc.collect()
    assert unregistered and unregistered[0] == base


def test_a_pool_with_trailers_keeps_each_blocks_bytes_clear_of_the_next_trailer() -> None:
    pool = HostPool(5, (2, 3, 5), torch.float16, pin=False, trailer=True)
    try:
        assert pool.block_stride >= pool.block_bytes + TRAILER_BYTES
        raw = pool.raw.numpy()
        for block in range(5):
            pool.data[block] = block + 1
        for block in range(5):
            view = np.frombuffer(pool.block_view(block), dtype=np.float16)
            assert view.tolist() == [block + 1] * (2 * 3 * 5)
            at = block * pool.block_stride + pool.block_bytes
            assert not raw[at : at + TRAILER_BYTES].any()  # the checksum's room, untouched
    finally:
        pool.close()
    # A block of whole 4 KiB pages keeps blocks on 4 KiB boundaries (the SSD tier's
    # O_DIRECT) where the room costs little; without a trailer blocks are back to back.
    assert block_stride(512 << 10, True) % 4096 == 0
    assert block_stride(512 << 10, False) == 512 << 10


def test_cpu_cache_gb_too_small_for_a_block_and_its_trailer_says_what_a_block_takes() -> None:
    # Exactly one 512 KiB block's GiB: with a remote tier's room after it, no block fits,
    # and the message must not say it holds no block of the 512 KiB it holds.
    caches = [torch.zeros(4, 2, 16, 8, 256) for _ in range(2)]
    block, stride = 512 << 10, block_stride(512 << 10, True)
    gb = block / (1 << 30)
    for call in (lambda: HostPool.for_caches(caches, gb, trailer=True),
                 lambda: region_blocks(gb, Geometry.of(caches), trailer=True)):
        with pytest.raises(ConfigError, match=rf"store\.cpu_cache_gb: {gb} GiB holds no block "
                                              rf"of {stride} bytes \(a block of {block} "):
            call()
    pool = HostPool.for_caches(caches, gb)  # without one it fits
    pool.close()
