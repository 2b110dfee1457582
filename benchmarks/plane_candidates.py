"""Candidate data planes for the embedded store, alone and beside the model stand-in
(issue 34), one run on an H200: which way of moving a batch's scattered pages keeps its
rate beside a busy model and costs the model least.

A batch is ``USERSxTOKENS`` (argument, default 8x2048) of pages placed at random in 8-layer
bf16 caches (32 tokens, 8 heads x 128: 128 KiB per page and layer), offloaded into host
blocks ``0..n-1`` of a block-major pinned pool and loaded back into other random pages.

  reference   plain 256 MiB copies on a stream of their own (the copy engines' rate)
  cur pP      the gather kernels + staging + one large copy per chunk (the embedded store's
              plane before issue 34), streams of priority P
  layer2d pP  per layer: a gather into a layer staging buffer and one 2-D copy
              (``cuMemcpy2DAsync``) into the block-major pool; loads the reverse
  batchK      copy engines only: one ``cuMemcpyBatchAsync`` per direction, a copy per
              (page, layer), split over K streams

Every candidate's bytes are checked once (out and back) before it is timed. Prints one
JSON line per candidate: GiB/s alone, and beside the model at depth 0 (everything queued)
and 4, with the model's slowdown.

    python benchmarks/plane_candidates.py 8x2048
"""

import json
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")

from aiokv.bench.beside import Beside, ReferenceCopier, Unit, measure_copier
from aiokv.bench.standin import GIB, StandIn
from aiokv.copy.driver import BatchCopy, StridedCopy


def gather_layers(caches: list[torch.Tensor], pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """``blocks[i, layer] = caches[layer][pages[i]]``: one op per layer."""
    for layer, cache in enumerate(caches):
        torch.index_select(cache, 0, pages, out=blocks[:, layer])


def scatter_layers(caches: list[torch.Tensor], pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """``caches[layer][pages[i]] = blocks[i, layer]``: one op per layer."""
    for layer, cache in enumerate(caches):
        cache.index_copy_(0, pages, blocks[:, layer])


L, PS, H, D = 8, 32, 8, 128
dev = torch.device("cuda")
USERS, TOKENS = [int(x) for x in sys.argv[1].split("x")] if len(sys.argv) > 1 else (8, 2048)
N = USERS * TOKENS // PS
CP = 4 * N + 64
caches = [torch.randn(CP, 2, PS, H, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
pool = torch.empty(N, L, 2, PS, H, D, dtype=torch.bfloat16, pin_memory=True)
PB = caches[0][0].numel() * 2
_strided = threading.local()  # a StridedCopy per thread (it reuses one descriptor)


def copy2d(dst, dpitch, src, spitch, width, height, stream):
    if not hasattr(_strided, "copy"):
        _strided.copy = StridedCopy()
    _strided.copy(dst, dpitch, src, spitch, width, height, stream)


def new_pages():
    perm = torch.randperm(CP, device=dev)
    return perm[:N].contiguous(), perm[N : 2 * N].contiguous()


class Base:
    def __init__(self, prio, name):
        self.prio, self.name = prio, name

    def setup(self):
        self.s = torch.cuda.Stream(dev, priority=self.prio)
        self.c = torch.cuda.Stream(dev, priority=self.prio)
        torch.cuda.set_stream(self.s)
        self.s.synchronize()
        self.src, self.dst = new_pages()
        self.src_h, self.dst_h = self.src.cpu().numpy(), self.dst.cpu().numpy()
        torch.cuda.synchronize()

    def unit(self):
        t0 = time.perf_counter()
        self.off()
        torch.cuda.current_stream().synchronize()
        self.c.synchronize()
        self.s.synchronize()
        t1 = time.perf_counter()
        self.load()
        self.c.synchronize()
        self.s.synchronize()
        t2 = time.perf_counter()
        return [Unit("offload", N * L * PB, t0, t1), Unit("load", N * L * PB, t1, t2)]

    def close(self):
        torch.cuda.synchronize()


class Cur(Base):
    """today: gather all layers into block-major staging, 1D copy; load reverse."""

    CH = 128

    def setup(self):
        super().setup()
        self.st = [
            torch.empty(self.CH, L, 2, PS, H, D, dtype=torch.bfloat16, device=dev) for _ in range(2)
        ]
        self.free = [None, None]

    def off(self):
        for i, lo in enumerate(range(0, N, self.CH)):
            hi = min(N, lo + self.CH)
            w = i % 2
            st = self.st[w][: hi - lo]
            if self.free[w] is not None:
                self.s.wait_event(self.free[w])
            gather_layers(caches, self.src[lo:hi], st)
            e = torch.cuda.Event()
            e.record(self.s)
            self.c.wait_event(e)
            with torch.cuda.stream(self.c):
                pool[lo:hi].copy_(st, non_blocking=True)
            f = torch.cuda.Event()
            f.record(self.c)
            self.free[w] = f

    def load(self):
        for i, lo in enumerate(range(0, N, self.CH)):
            hi = min(N, lo + self.CH)
            w = i % 2
            st = self.st[w][: hi - lo]
            if self.free[w] is not None:
                self.c.wait_event(self.free[w])
            with torch.cuda.stream(self.c):
                st.copy_(pool[lo:hi], non_blocking=True)
            e = torch.cuda.Event()
            e.record(self.c)
            self.s.wait_event(e)
            scatter_layers(caches, self.dst[lo:hi], st)
            f = torch.cuda.Event()
            f.record(self.s)
            self.free[w] = f


class Lay(Base):
    """Per layer: a gather into a layer staging, a 2D copy into the block-major pool;
    loads: a 2D copy in, then a scatter."""

    def setup(self):
        super().setup()
        self.st = [torch.empty(N, 2, PS, H, D, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        self.free = [None, None]
        self.base = pool.data_ptr()

    def off(self):
        for layer in range(L):
            w = layer % 2
            st = self.st[w]
            if self.free[w] is not None:
                self.s.wait_event(self.free[w])
            torch.index_select(caches[layer], 0, self.src, out=st)
            e = torch.cuda.Event()
            e.record(self.s)
            self.c.wait_event(e)
            copy2d(self.base + layer * PB, L * PB, st.data_ptr(), PB, PB, N, self.c.cuda_stream)
            f = torch.cuda.Event()
            f.record(self.c)
            self.free[w] = f

    def load(self):
        for layer in range(L):
            w = layer % 2
            st = self.st[w]
            if self.free[w] is not None:
                self.c.wait_event(self.free[w])
            copy2d(st.data_ptr(), PB, self.base + layer * PB, L * PB, PB, N, self.c.cuda_stream)
            e = torch.cuda.Event()
            e.record(self.c)
            self.s.wait_event(e)
            caches[layer].index_copy_(0, self.dst, st)
            f = torch.cuda.Event()
            f.record(self.s)
            self.free[w] = f


class Batch(Base):
    def __init__(self, prio, name, k):
        super().__init__(prio, name)
        self.k = k

    def setup(self):
        super().setup()
        self.batch = BatchCopy()  # aiokv's: the ctypes cuMemcpyBatchAsync the copier uses
        self.ss = [self.c] + [torch.cuda.Stream(dev, priority=self.prio) for _ in range(self.k - 1)]
        bases = np.array([c.data_ptr() for c in caches], dtype=np.uint64)
        hb = pool.data_ptr()
        blocks = np.arange(N, dtype=np.uint64)

        def plan(pages):
            gpu = (bases[:, None] + pages[None, :].astype(np.uint64) * PB).reshape(-1)
            host = (
                hb + (blocks[None, :] * L + np.arange(L, dtype=np.uint64)[:, None]) * PB
            ).reshape(-1)
            return gpu, host

        self.go, self.ho = plan(self.src_h)
        self.gi, self.hi = plan(self.dst_h)
        self.sizes = np.full(N * L, PB, dtype=np.uint64)

    def _do(self, dsts, srcs):
        n = len(dsts)
        per = -(-n // self.k)
        for j, st in enumerate(self.ss):
            a, b = j * per, min(n, (j + 1) * per)
            self.batch(dsts[a:b], srcs[a:b], self.sizes[a:b], st.cuda_stream)

    def off(self):
        self._do(self.ho, self.go)
        for st in self.ss:
            st.synchronize()

    def load(self):
        self._do(self.gi, self.hi)
        for st in self.ss:
            st.synchronize()


def check(c):
    c.setup()
    pool.zero_()
    c.off()
    torch.cuda.synchronize()
    ok1 = all(torch.equal(pool[:, layer].to(dev), caches[layer][c.src]) for layer in range(L))
    [caches[layer][c.dst].clone() for layer in range(L)]
    for layer in range(L):
        caches[layer][c.dst] = 0
    c.load()
    torch.cuda.synchronize()
    ok2 = all(torch.equal(caches[layer][c.dst], pool[:, layer].to(dev)) for layer in range(L))
    c.close()
    torch.cuda.set_stream(torch.cuda.default_stream())
    return ok1 and ok2


model = StandIn(dev, 8192)
steps = model.steps_for(1.0)
out = {"batch": f"{USERS}x{TOKENS}", "pages": N, "gib": N * L * PB / GIB, "steps": steps}
cands = [("reference", ReferenceCopier(dev, 256 << 20))]
for prio in (0, -1):
    cands += [(f"cur p{prio}", Cur(prio, "cur")), (f"layer2d p{prio}", Lay(prio, "lay"))]
cands += [
    ("batch1", Batch(0, "b1", 1)),
    ("batch2", Batch(0, "b2", 2)),
    ("batch4", Batch(0, "b4", 4)),
]
for name, c in cands:
    try:
        ok = True if name == "reference" else check(c)
        alone, sides = measure_copier(Beside(c, name), model, steps, (0, 4), 1.0, 2)
        row = {
            "ok": ok,
            "alone": alone.gib_s,
            **{
                f"d{s.depth}": {
                    "slow": round(s.slowdown, 3),
                    **{k: round(v, 1) for k, v in s.rates.gib_s.items()},
                }
                for s in sides
            },
        }
    except Exception as exc:
        row = {"error": repr(exc)}
    out[name] = row
    print(name, json.dumps(row), flush=True)
print(json.dumps(out))
