"""The candidate data-plane mechanisms of ``copy_mechanisms.py``: each moves one batch of
scattered GPU pages to the host pool (``move(True, pages)``) or back into other pages
(``move(False, pages)``), queued on streams of its own and waited for by ``finish``.
Every one is set up, moved and finished on one thread (the copier's, never the model's).

  a-gather      today's embedded store: the pages gathered on the GPU into a staging
                buffer (``index_select`` per layer), then one copy-engine copy per chunk of
                128 MiB, two buffers deep on two streams (loads: copy in, then scatter)
  b-torch       copy engines only: one ``tensor.copy_(non_blocking=True)`` per run of
                adjacent pages and blocks
  c-bindings    the same copies through cuda.bindings' ``cudaMemcpyAsync``, one call each
  d-batch       the same copies in one ``cuMemcpyBatchAsync`` call (the driver entry of
                ``cudaMemcpyBatchAsync``, CUDA 12.8+), found with the driver's
                ``cuGetProcAddress`` and called through ctypes with numpy arrays: no
                per-copy Python (cuda.bindings' wrapper would convert every element),
                and ctypes releases the GIL during the call
  e-kernel-N    a copy kernel (cupy ``RawKernel``) with N thread blocks reading or writing
                the pinned pool through its device address (zero-copy), from a table of
                the same copies uploaded per batch

Every mechanism gets the page ids as a device tensor, as aiokv's page-based seam hands
them over; b, c, d and e copy them to the host first (one small copy and a sync, timed
with the rest), since their copies are planned on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import copy_driver
import numpy as np
import torch
from copy_plans import Geometry, Plan, check_aligned, plan, runs

from aiokv.copy import driver

STAGING_BYTES = 128 << 20  # per staging buffer, as the embedded store's gathers had
KERNEL_THREADS = 1024

KERNEL = r"""
extern "C" __global__ void copy_segments(const unsigned long long* table, long long count) {
    // table: count destinations, then count sources, then count sizes (bytes, % 16 == 0)
    for (long long s = blockIdx.x; s < count; s += gridDim.x) {
        int4* dst = reinterpret_cast<int4*>(table[s]);
        const int4* src = reinterpret_cast<const int4*>(table[count + s]);
        long long n = (long long)(table[2 * count + s] / 16);
        for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}
"""


def gather_layers(caches: list[torch.Tensor], pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """``blocks[i, layer] = caches[layer][pages[i]]``: one gather kernel per layer (the
    embedded store's data plane before the copy engines took it over)."""
    for layer, cache in enumerate(caches):
        torch.index_select(cache, 0, pages, out=blocks[:, layer])


def scatter_layers(caches: list[torch.Tensor], pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """``caches[layer][pages[i]] = blocks[i, layer]``: one scatter kernel per layer."""
    for layer, cache in enumerate(caches):
        cache.index_copy_(0, pages, blocks[:, layer])


class Pages:
    """The caches, the host pool and where a batch's blocks are (blocks ``0..n-1``, one
    run, as the embedded store's allocator mostly hands them out)."""

    def __init__(self, caches: list[torch.Tensor], pool: torch.Tensor, geometry: Geometry):
        self.caches = caches
        self.pool = pool
        self.geometry = geometry
        self.device = caches[0].device
        self.blocks = np.arange(geometry.num_blocks, dtype=np.int64)

    def pool_layer(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """The pool's blocks ``lo..hi-1`` of one layer: ``[n, 2, page, heads, dim]``."""
        if self.geometry.layout == "block":
            return self.pool[lo:hi, layer]
        return self.pool[layer, lo:hi]

    def plan(self, ids: np.ndarray, to_host: bool, host_base: int | None = None) -> Plan:
        bases = [cache.data_ptr() for cache in self.caches]
        base = self.pool.data_ptr() if host_base is None else host_base
        return plan(self.geometry, ids, self.blocks[: len(ids)], bases, base, to_host)


class Mechanism:
    """Queue a batch's copies (``move``, returns how many copies or kernel table entries),
    wait for them (``finish``)."""

    name = ""

    def __init__(self, pages: Pages, priority: int = 0) -> None:
        self.p = pages
        self.priority = priority  # of its streams: 0, or -1 (high: ahead of the model's)
        self.cuda = pages.device.type == "cuda"
        self.stream: Any = None
        self._ids: torch.Tensor | None = None

    def why_not(self) -> str | None:
        """None, or why this mechanism cannot run here."""
        return None

    def setup(self) -> None:
        if self.cuda:
            self.stream = torch.cuda.Stream(self.p.device, priority=self.priority)
            torch.cuda.set_stream(self.stream)
            # A runtime call on this thread makes the device's context current here, as
            # the driver calls of d and e (copy_driver) need.
            self.stream.synchronize()
            self._ids = torch.empty(self.p.geometry.num_blocks, dtype=torch.int64, pin_memory=True)

    def move(self, to_host: bool, pages: torch.Tensor) -> int:
        raise NotImplementedError

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        self.finish()

    def host_ids(self, pages: torch.Tensor) -> np.ndarray:
        """The page ids on the host: one copy on this mechanism's stream, then a sync."""
        if not self.cuda:
            return pages.numpy()
        assert self._ids is not None
        ids = self._ids[: len(pages)]
        ids.copy_(pages, non_blocking=True)
        self.stream.synchronize()
        return ids.numpy()


def _requires_cuda(mechanism: Mechanism) -> str | None:
    return None if mechanism.cuda else "needs a CUDA device"


class Gather(Mechanism):
    name = "a-gather"

    def setup(self) -> None:
        super().setup()
        g = self.p.geometry
        block_bytes = g.layers * g.page_bytes
        self.chunk = max(1, STAGING_BYTES // block_bytes)
        page_shape = tuple(self.p.caches[0].shape[1:])
        shape = ((self.chunk, g.layers) if g.layout == "block" else (g.layers, self.chunk))
        self.staging = [torch.empty(shape + page_shape, dtype=self.p.caches[0].dtype,
                                    device=self.p.device) for _ in range(2)]
        self.copy_stream = (torch.cuda.Stream(self.p.device, priority=self.priority)
                            if self.cuda else None)
        self.free: list[Any] = [None, None]  # stage i is free once free[i] fired
        self.next = 0

    def _stage(self, which: int, count: int) -> torch.Tensor:
        if self.p.geometry.layout == "block":
            return self.staging[which][:count]
        return self.staging[which][:, :count]

    def _host(self, stage: torch.Tensor, lo: int, hi: int, to_host: bool) -> int:
        """The chunk's copies between its stage and the pool: one, or one per layer."""
        if self.p.geometry.layout == "block":
            pairs = [(self.p.pool[lo:hi], stage)]
        else:
            pairs = [(self.p.pool_layer(i, lo, hi), stage[i]) for i in range(len(stage))]
        for host, staged in pairs:
            if to_host:
                host.copy_(staged, non_blocking=True)
            else:
                staged.copy_(host, non_blocking=True)
        return len(pairs)

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        if self.copy_stream is None:
            yield
            return
        with torch.cuda.stream(self.copy_stream):
            yield

    def _mark(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def move(self, to_host: bool, pages: torch.Tensor) -> int:
        copies, n = 0, len(pages)
        layered = self.p.geometry.layout == "layer"
        for lo in range(0, n, self.chunk):
            hi = min(lo + self.chunk, n)
            which, self.next = self.next, self.next ^ 1
            stage, run = self._stage(which, hi - lo), pages[lo:hi]
            previous = self.free[which]
            if to_host:
                if previous is not None:
                    self.stream.wait_event(previous)
                if layered:
                    for layer, cache in enumerate(self.p.caches):
                        torch.index_select(cache, 0, run, out=stage[layer])
                else:
                    gather_layers(self.p.caches, run, stage)
                ready = self._mark(self.stream)
                if ready is not None:
                    self.copy_stream.wait_event(ready)
                with self._on_copy_stream():
                    copies += self._host(stage, lo, hi, True)
                self.free[which] = self._mark(self.copy_stream)
            else:
                if previous is not None:
                    self.copy_stream.wait_event(previous)
                with self._on_copy_stream():
                    copies += self._host(stage, lo, hi, False)
                ready = self._mark(self.copy_stream)
                if ready is not None:
                    self.stream.wait_event(ready)
                if layered:
                    for layer, cache in enumerate(self.p.caches):
                        cache.index_copy_(0, run, stage[layer])
                else:
                    scatter_layers(self.p.caches, run, stage)
                self.free[which] = self._mark(self.stream)
        return copies

    def finish(self) -> None:
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        super().finish()


class TorchRuns(Mechanism):
    name = "b-torch"

    def setup(self) -> None:
        super().setup()
        self.gpu = [cache.view(-1).view(torch.uint8) for cache in self.p.caches]
        self.host = self.p.pool.view(-1).view(torch.uint8)

    def move(self, to_host: bool, pages: torch.Tensor) -> int:
        ids = self.host_ids(pages)
        g = self.p.geometry
        starts, lengths = runs(ids, self.p.blocks[: len(ids)], g.coalesces)
        gpu_offsets = (ids[starts] * g.page_bytes).tolist()
        sizes = (lengths * g.page_bytes).tolist()
        for layer, gpu in enumerate(self.gpu):
            host_offsets = g.host_offsets(self.p.blocks[starts], layer).tolist()
            for at_gpu, at_host, size in zip(gpu_offsets, host_offsets, sizes, strict=True):
                host, device = self.host[at_host:at_host + size], gpu[at_gpu:at_gpu + size]
                if to_host:
                    host.copy_(device, non_blocking=True)
                else:
                    device.copy_(host, non_blocking=True)
        return len(sizes) * len(self.gpu)


class BindingsRuns(Mechanism):
    name = "c-bindings"

    def why_not(self) -> str | None:
        if not self.cuda:
            return _requires_cuda(self)
        try:
            copy_driver.runtime()
        except ImportError as exc:
            return str(exc)
        return None

    def setup(self) -> None:
        super().setup()
        self.rt = copy_driver.runtime()
        self.kind = self.rt.cudaMemcpyKind.cudaMemcpyDefault
        self.ok = self.rt.cudaError_t.cudaSuccess

    def move(self, to_host: bool, pages: torch.Tensor) -> int:
        p = self.p.plan(self.host_ids(pages), to_host)
        copy, kind, ok = self.rt.cudaMemcpyAsync, self.kind, self.ok
        stream = self.stream.cuda_stream
        for i, (dst, src, size) in enumerate(
            zip(p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist(), strict=True)
        ):
            (err,) = copy(dst, src, size, kind, stream)
            if err != ok:
                raise RuntimeError(f"cudaMemcpyAsync (copy {i} of {len(p)}: {size} bytes from "
                                   f"{src:#x} to {dst:#x}) failed: {err!r}")
        return len(p)


class BatchCopy(Mechanism):
    name = "d-batch"

    def why_not(self) -> str | None:
        if not self.cuda:
            return _requires_cuda(self)
        return copy_driver.batch_entry()[1]

    def setup(self) -> None:
        super().setup()
        self.batch = driver.BatchCopy()  # aiokv's own call, as its copier makes it
        self.keep: Plan | None = None

    def move(self, to_host: bool, pages: torch.Tensor) -> int:
        p = self.p.plan(self.host_ids(pages), to_host)
        self.keep = p  # the arrays outlive the call, whatever the driver keeps of them
        self.batch(p.dsts, p.srcs, p.sizes, self.stream.cuda_stream)
        return len(p)


class Kernel(Mechanism):
    def __init__(self, pages: Pages, blocks: int, priority: int = 0) -> None:
        super().__init__(pages, priority)
        self.blocks = blocks
        self.name = f"e-kernel-{blocks}"

    def why_not(self) -> str | None:
        if not self.cuda:
            return _requires_cuda(self)
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            return f"cupy is not importable ({exc}); pip install cupy-cuda13x (or -cuda12x)"
        return None

    def setup(self) -> None:
        super().setup()
        import cupy

        cupy.cuda.Device(self.p.device.index or 0).use()
        self.kernel = cupy.RawKernel(KERNEL, "copy_segments")
        self.cupy_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream)
        self.host_base = copy_driver.device_address(self.p.pool.data_ptr())
        most = 3 * self.p.geometry.layers * self.p.geometry.num_blocks
        self.table_host = torch.empty(most, dtype=torch.int64, pin_memory=True)
        self.table = torch.empty(most, dtype=torch.int64, device=self.p.device)

    def move(self, to_host: bool, pages: torch.Tensor) -> int:
        p = self.p.plan(self.host_ids(pages), to_host, self.host_base)
        check_aligned(p, 16)
        count = len(p)
        staged = self.table_host[: 3 * count]
        table = staged.numpy().view(np.uint64)
        table[:count], table[count:2 * count], table[2 * count:] = p.dsts, p.srcs, p.sizes
        self.table[: 3 * count].copy_(staged, non_blocking=True)  # on self.stream
        with self.cupy_stream:
            self.kernel((self.blocks,), (KERNEL_THREADS,),
                        (np.uint64(self.table.data_ptr()), np.int64(count)))
        return count
