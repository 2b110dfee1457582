"""The shared region: the host tier of ``aiokv store-server`` as one shared memory file
that the server and every engine map.

The server creates it with ``memfd_create`` (no name in any file system, so nothing but
a process the server hands the descriptor to can map it; the uid check on the socket
decides who that is) and passes the descriptor in its answer to an engine's ``hello``
(SCM_RIGHTS). Its layout is the embedded store's host pool's, ``[block, layer, k/v,
token, head, dim]``: one block per page, all layers, so a block is one contiguous range
and the SSD tier moves it as one I/O; blocks are ``stride`` bytes apart, with a trailer
after each where the server has a remote tier (:mod:`..local.layout`). The server says the
stride in its answer to ``hello``.

The geometry comes from the first engine (:class:`Geometry`); an engine with another one
is refused with what differs. On a GPU an engine pins its mapping in chunks in the
background (:class:`Pinning`), as the embedded store pins its own pool, so that its
copies run from pinned memory without holding its start; on the CPU it fills its page
tables for the mapping in the background (:class:`Populating`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from ...exiting import stop_at_exit
from ..local.hostmem import chunk_bounds
from ..local.layout import block_stride, block_text, strided_blocks
from ..local.pool import BlockAllocator

_MAX_SIZE = 1 << 20  # of each of a geometry's sizes, as a server takes it


@dataclass(frozen=True, slots=True)
class Geometry:
    """The caches' shape as the region needs it (one block = one page of every layer)."""

    layers: int
    page_size: int
    heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor]) -> Geometry:
        first = kv_caches[0]
        return cls(len(kv_caches), int(first.shape[2]), int(first.shape[3]),
                   int(first.shape[4]), str(first.dtype).removeprefix("torch."))

    @classmethod
    def from_mapping(cls, raw: Any) -> Geometry:
        """From a peer's message; ValueError unless it is one."""
        if not isinstance(raw, dict) or set(raw) != set(cls.__slots__):
            raise ValueError(f"geometry must have the keys {sorted(cls.__slots__)}: {raw!r}")
        ints = [raw[k] for k in ("layers", "page_size", "heads", "head_dim")]
        if not all(type(v) is int and 0 < v < _MAX_SIZE for v in ints):
            raise ValueError(f"geometry sizes must be positive ints below {_MAX_SIZE}: "
                             f"{raw!r}")
        if not isinstance(raw["dtype"], str) or not isinstance(
            getattr(torch, raw["dtype"], None), torch.dtype
        ):
            raise ValueError(f"geometry dtype {raw['dtype']!r} is not a torch dtype")
        return cls(**raw)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.page_size, self.heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        element = torch.empty(0, dtype=self.torch_dtype).element_size()
        return int(np.prod(self.block_shape)) * element

    def differences(self, other: Geometry) -> list[str]:
        """``name: mine != other's`` for each field that differs."""
        mine, theirs = self.as_dict(), other.as_dict()
        return [f"{k} {theirs[k]} != the server's {mine[k]}" for k in mine if mine[k] != theirs[k]]


class Region:
    """A mapping of the region: ``data`` is ``[block, *geometry.block_shape]``, blocks
    ``block_stride`` bytes apart (``stride``; None: back to back). ValueError where the
    descriptor's file is too small for that, or the stride leaves no room for a block or
    is not whole elements."""

    def __init__(self, fd: int, num_blocks: int, geometry: Geometry,
                 stride: int | None = None) -> None:
        self.fd = fd
        self.num_blocks = num_blocks
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.block_stride = self.block_bytes if stride is None else stride
        if self.block_stride < self.block_bytes:
            raise ValueError(f"a stride of {self.block_stride} bytes holds no block of "
                             f"{self.block_bytes}")
        element = torch.empty(0, dtype=geometry.torch_dtype).element_size()
        if self.block_stride % element:  # the tensor's stride would round it down
            raise ValueError(f"a stride of {self.block_stride} bytes is not a whole number "
                             f"of {geometry.dtype} elements ({element} bytes)")
        size = num_blocks * self.block_stride
        if os.fstat(fd).st_size < size:
            raise ValueError(f"the region holds {os.fstat(fd).st_size} bytes, not {size}: "
                             f"{num_blocks} blocks at a stride of {self.block_stride} bytes")
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)  # outlives the descriptor
        self.raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.data = strided_blocks(self.raw, num_blocks, geometry.block_shape,
                                   geometry.torch_dtype, self.block_stride)
        self.bytes = memoryview(self._map)

    @classmethod
    def create(cls, memory: int, num_blocks: int, geometry: Geometry,
               trailer: bool = False) -> Region:
        """The server's region of ``num_blocks`` blocks in ``memory`` (from
        :func:`allocate`; the region owns it from here), with a trailer after each block
        where ``trailer`` (a remote tier's)."""
        return cls(memory, num_blocks, geometry, block_stride(geometry.block_bytes, trailer))

    def block_view(self, block: int) -> memoryview:
        at = block * self.block_stride
        return self.bytes[at : at + self.block_bytes]

    def close(self) -> None:
        """Unmap and close the descriptor; views still alive keep the mapping (mmap
        refuses to close then), and it goes with them."""
        with contextlib.suppress(BufferError):
            self.bytes.release()
        del self.data, self.raw
        with contextlib.suppress(BufferError):  # a tensor view still alive keeps it
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RegionPool(BlockAllocator):
    """The server's host tier allocator over the region, with what the SSD tier reads
    and writes through (``block_bytes``, ``block_view``), as :class:`~..local.pool.HostPool`
    offers them for a private pool."""

    def __init__(self, region: Region) -> None:
        super().__init__(region.num_blocks)
        self.region = region
        self.block_bytes = region.block_bytes
        self.block_stride = region.block_stride
        self.data = region.data
        self.raw = region.raw  # the remote tier registers it with Mooncake
        self.bytes = region.bytes
        self.chunk_starts = None

    def block_view(self, block: int) -> memoryview:
        return self.region.block_view(block)

    def close(self) -> None:
        self.region.close()


_MADV_POPULATE_WRITE = 23  # linux/mman.h, 5.14+
_POPULATE_BYTES = 64 << 20


def allocate(cpu_cache_gb: float) -> int:
    """A memfd of ``cpu_cache_gb`` GiB, its memory allocated (the server's, at start: the
    geometry, and so the blocks, come later), private to the processes it is handed
    to. ConfigError when the host cannot back it."""
    size = region_bytes(cpu_cache_gb)
    fd = os.memfd_create("aiokv-region", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        # The memory itself now, not at each block's first write: a region the host
        # cannot back would otherwise kill an engine with SIGBUS in the middle of a copy,
        # and each first write would fault and zero a page inside it. About 3.5 s per
        # 10 GiB (measured on the 2-core CI box), before the server listens.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        raise ConfigError("store.cpu_cache_gb", f"a shared region of {cpu_cache_gb} GiB "
                          f"cannot be allocated: {exc}") from exc
    return fd


def region_bytes(cpu_cache_gb: float) -> int:
    """The region's size: ``cpu_cache_gb`` GiB in whole memory pages."""
    return int(cpu_cache_gb * (1 << 30)) // mmap.PAGESIZE * mmap.PAGESIZE


def region_blocks(cpu_cache_gb: float, geometry: Geometry, trailer: bool = False) -> int:
    """Blocks of ``cpu_cache_gb`` GiB (as allocated: whole pages), each with a trailer
    where ``trailer``; ConfigError when that holds none."""
    stride = block_stride(geometry.block_bytes, trailer)
    count = region_bytes(cpu_cache_gb) // stride
    if count < 1:
        raise ConfigError("store.cpu_cache_gb", f"{cpu_cache_gb} GiB holds no block of "
                          f"{block_text(geometry.block_bytes, stride)}")
    return count


class Pinning:
    """An engine's mapping registered with CUDA in chunks, on a background thread
    (``aiokv-pin-region``): ``ready_blocks`` is the pinned prefix, for a copier that
    must not copy from unpinned memory (:meth:`wait_for`)."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.bounds = chunk_bounds(region.num_blocks, region.block_stride)
        self.chunk_starts = np.asarray(self.bounds[:-1], dtype=np.int64)
        self.ready_blocks = 0
        self.error: BaseException | None = None
        self._registered: list[int] = []
        self._stop = False
        self._ended = False
        self._grew = threading.Condition()  # notified at each chunk and at the end
        self._thread = threading.Thread(target=self._run, name="aiokv-pin-region", daemon=True)
        self._thread.start()

    def wait_for(self, blocks: int, timeout: float | None = None) -> bool:
        """Block until the first ``blocks`` blocks are pinned (or ``timeout`` seconds);
        False once pinning has ended short of them (nothing more will come), or on the
        timeout. A chunk takes milliseconds."""
        with self._grew:
            self._grew.wait_for(lambda: self.ready_blocks >= blocks or self._ended, timeout)
        return self.ready_blocks >= blocks

    def _run(self) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        base = self.region.raw.data_ptr()
        size = self.region.block_stride
        try:
            for start, end in zip(self.bounds, self.bounds[1:], strict=False):
                if self._stop:
                    return
                address = base + start * size
                status = cudart.cudaHostRegister(address, (end - start) * size, 0)
                if int(status) != 0:
                    raise RuntimeError(f"cudaHostRegister failed: {status}")
                self._registered.append(address)
                with self._grew:
                    self.ready_blocks = end  # one writer; readers take an int
                    self._grew.notify_all()
        except Exception as exc:  # the rest stays unpinned: its tasks fail, naming this
            self.error = exc
        finally:
            with self._grew:
                self._ended = True
                self._grew.notify_all()

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for address in self._registered:
            cudart.cudaHostUnregister(address)
        self._registered.clear()


class Populating:
    """This process's page tables for the mapping filled on a background thread
    (``aiokv-map-region``), data untouched: a first write into a page of the region
    otherwise faults inside an engine's copy (3.4 against 12.7 GB/s on the 2-core box).
    In steps of ``_POPULATE_BYTES`` through ctypes, so that the GIL is free meanwhile;
    where the kernel lacks MADV_POPULATE_WRITE (before 5.14) it stops at once and pages
    fault as used.

    :meth:`close` stops it between steps and joins it, as :class:`Pinning` does: a walk
    left running outlived the engine's close (a GiB region takes a while) and, in a
    native call at the interpreter's exit, could abort the process there. For an engine
    never closed, the exit stops it too (:mod:`aiokv.exiting`)."""

    def __init__(self, region: Region) -> None:
        self._raw = region.raw  # keeps the mapping alive while the walk runs
        self._size = region.num_blocks * region.block_stride
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="aiokv-map-region", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def _run(self) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = self._raw.data_ptr()
        for start in range(0, self._size, _POPULATE_BYTES):
            if self._stop:
                return
            if madvise(base + start, min(_POPULATE_BYTES, self._size - start),
                       _MADV_POPULATE_WRITE):
                return

    def close(self) -> None:
        self._stop = True
        self._thread.join()

    def stop_at_exit(self) -> None:
        self._stop = True

    def join_at_exit(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()
