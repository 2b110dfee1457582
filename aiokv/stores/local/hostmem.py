"""Host memory for the host tier: one mapping, pinned in chunks on background threads.

One ``torch.empty(n, pin_memory=True)`` of many GiB allocates, zeroes and pins every page
on one thread before it returns, so a large host tier would hold a service's start for
seconds per GiB. Here the tier is one anonymous mapping (page-aligned and backed lazily by
the kernel); background threads fault each chunk in and register it with
``cudaHostRegister``, chunk by chunk, in order. Blocks become usable as a prefix of the
mapping: the store serves from the first chunk as soon as it is pinned and grows into the
rest. The first chunks are small so that the first one is ready almost at once.

The pinning threads only move the ``ready_blocks`` watermark (an int, written by one
thread); the block allocator reads it on the store thread and takes the new blocks there,
so no lock guards the allocator's own state.

Chunk boundaries fall on block boundaries (a block's stride apart, :mod:`.pool`) and on
memory pages: two registrations never share a page (CUDA refuses to register a page
twice).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...errors import ConfigError
from .layout import block_stride, strided_blocks

log = logging.getLogger("aiokv")

_PAGE = mmap.PAGESIZE
_FIRST_CHUNK_BYTES = 64 << 20  # small: the first request waits for it
_CHUNK_BYTES = 1 << 30  # later chunks: large enough that a register call is not overhead
_TOUCH_BYTES = 256 << 20  # one thread's share of a chunk's first touch


def chunk_bounds(num_blocks: int, block_stride: int, chunk_bytes: int = _CHUNK_BYTES) -> list[int]:
    """Block indices where the chunks start, plus ``num_blocks`` at the end: growing from
    ``_FIRST_CHUNK_BYTES`` to ``chunk_bytes``, each a multiple of the blocks that fill
    whole memory pages (blocks ``block_stride`` bytes apart)."""
    step = _PAGE // math.gcd(block_stride, _PAGE)  # blocks per page-aligned unit
    bounds = [0]
    size = min(_FIRST_CHUNK_BYTES, chunk_bytes)
    while bounds[-1] < num_blocks:
        blocks = max(step, size // block_stride // step * step)
        bounds.append(min(num_blocks, bounds[-1] + blocks))
        size = min(size * 2, chunk_bytes)
    return bounds


class HostMemory:
    """``num_blocks`` blocks of ``block_shape`` in host memory, as ``data``
    (``[block, *block_shape]``, blocks ``block_stride`` bytes apart: with ``trailer``,
    room for a remote value's checksum after each, :func:`.pool.block_stride`).

    With ``pin`` the memory is registered with CUDA in chunks by :meth:`start`'s threads;
    ``ready_blocks`` says how many leading blocks are usable (all of them without
    ``pin``). Raises ConfigError naming ``store.cpu_cache_gb`` when the mapping cannot be
    made, or when not even the first chunk can be pinned (from :meth:`wait_first`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin: bool,
        *,
        trailer: bool = False,
        threads: int | None = None,
        chunk_bytes: int = _CHUNK_BYTES,
        register: Callable[[int, int], None] | None = None,
        unregister: Callable[[int], None] | None = None,
    ) -> None:
        element = torch.empty(0, dtype=dtype).element_size()
        self.block_bytes = math.prod(block_shape) * element
        self.block_stride = block_stride(self.block_bytes, trailer)
        self.num_blocks = num_blocks
        nbytes = num_blocks * self.block_stride
        try:
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, OverflowError) as exc:
            raise ConfigError(
                "store.cpu_cache_gb", f"cannot map {nbytes / (1 << 30):.2f} GiB: {exc}"
            ) from exc
        if pin and hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer page faults on the first touch; where THP is off this is a no-op.
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.raw = torch.frombuffer(self._map, dtype=torch.uint8)  # the mapping as bytes
        self.data = strided_blocks(self.raw, num_blocks, block_shape, dtype, self.block_stride)
        self._base = self.data.data_ptr()
        self._bounds = chunk_bounds(num_blocks, self.block_stride, chunk_bytes)
        self.chunk_starts = self._bounds[:-1]  # the block each pinned chunk starts at
        self.pinned = pin
        self.ready_blocks = 0 if pin else num_blocks
        self.error: BaseException | None = None  # why pinning stopped short, if it did
        self.seconds_to_first = 0.0
        self.seconds_to_all = 0.0
        self._registered: list[int] = []  # base addresses of registered chunks
        self._threads = max(1, threads or min(16, os.cpu_count() or 1))
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        # Unregistered before the mapping can go: memory unmapped while registered leaves
        # the driver a stale range, and a later mapping at that address fails to register
        # (cudaErrorHostMemoryAlreadyRegistered). Runs at close(), or when this object is
        # collected unclosed (the pinning thread holds it alive until it ends).
        self._release = weakref.finalize(
            self, _unregister_all, self._map, self._registered, self._unregister
        )
        self._first = threading.Event()
        self._done = threading.Event()
        self._grew = threading.Condition()  # notified at each chunk and at the end
        self._stop = False
        self._thread: threading.Thread | None = None
        if not pin:
            self._first.set()
            self._done.set()

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start pinning in the background (``aiokv-pin`` thread and its touch pool)."""
        if self._thread is not None or not self.pinned:
            return
        self._thread = threading.Thread(target=self._pin_all, name="aiokv-pin", daemon=True)
        self._thread.start()

    def wait_first(self, timeout: float | None = None) -> None:
        """Block until the first chunk is usable; ConfigError if it could not be pinned."""
        self._first.wait(timeout)
        if self.ready_blocks == 0 and self.num_blocks:
            raise ConfigError(
                "store.cpu_cache_gb", f"could not pin any host memory: {self.error!r}"
            ) from self.error

    def wait_grown(self, than: int, timeout: float | None = None) -> bool:
        """Block until more than ``than`` blocks are ready; False once pinning has ended
        without that (nothing more will come)."""
        with self._grew:
            self._grew.wait_for(lambda: self.ready_blocks > than or self._done.is_set(), timeout)
        return self.ready_blocks > than

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until pinning ended (all of it, or where it stopped); whether it did."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop pinning and unregister what was registered. The mapping itself goes with
        the last tensor that views it."""
        self._stop = True
        if self._thread is not None:
            self._thread.join()
        self._release()

    # ---- the pinning thread ------------------------------------------------------------

    def _pin_all(self) -> None:
        started = time.perf_counter()
        bounds = self._bounds
        with ThreadPoolExecutor(self._threads, thread_name_prefix="aiokv-touch") as pool:
            # Chunk i + 1 faults in while chunk i registers: the two are different costs
            # (page clearing against the driver's page pinning).
            touching = self._touch(bounds[0], bounds[1], pool)
            for i in range(len(bounds) - 1):
                for part in touching:
                    part.result()
                if self._stop:
                    break
                if i + 2 < len(bounds):
                    touching = self._touch(bounds[i + 1], bounds[i + 2], pool)
                start, end = bounds[i], bounds[i + 1]
                address = self._base + start * self.block_stride
                try:
                    self._register(address, (end - start) * self.block_stride)
                except Exception as exc:
                    self.error = exc
                    log.warning(
                        # Blocks too: a small tier's GiB round to 0.00 of 0.00.
                        "pinned %d of %d blocks (%.2f of %.2f GiB) of host memory (%r); "
                        "serving with those",
                        start, self.num_blocks,
                        start * self.block_stride / (1 << 30),
                        self.num_blocks * self.block_stride / (1 << 30),
                        exc,
                    )
                    break
                self._registered.append(address)
                with self._grew:
                    self.ready_blocks = end  # one writer; readers take an int
                    self._grew.notify_all()
                if i == 0:
                    self.seconds_to_first = time.perf_counter() - started
                    self._first.set()
            for part in touching:
                part.cancel()
        self.seconds_to_all = time.perf_counter() - started
        self._first.set()
        with self._grew:
            self._done.set()
            self._grew.notify_all()

    def _touch(self, start: int, end: int, pool: ThreadPoolExecutor) -> list[Future[object]]:
        """Start faulting blocks [start, end) in, split among the pool's threads. memset
        through ctypes drops the GIL, so the faults run in parallel."""
        first = self._base + start * self.block_stride
        last = self._base + end * self.block_stride
        return [
            pool.submit(ctypes.memset, a, 0, min(_TOUCH_BYTES, last - a))
            for a in range(first, last, _TOUCH_BYTES)
        ]


def _unregister_all(
    mapping: mmap.mmap, registered: list[int], unregister: Callable[[int], None]
) -> None:
    """Unregister every chunk; ``mapping`` is only held so that it outlives them."""
    for address in registered:
        try:
            unregister(address)
        except Exception:
            log.exception("cudaHostUnregister failed")
    registered.clear()


def _cuda_register(address: int, size: int) -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    status = cudart.cudaHostRegister(address, size, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister({size} bytes) failed: {status}")


def _cuda_unregister(address: int) -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    status = cudart.cudaHostUnregister(address)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostUnregister failed: {status}")
