"""Where a lone batch's time goes, first submit to last result, on the embedded store.

    python benchmarks/lone_batch.py [--shapes 8x1024,32x2048] [--repeats 5] [--json FILE]
                                    [--trace DIR]

Wraps the engine's stage functions with timestamps (no change to the code under test),
runs lone offload and load batches, and prints the median time of each stage from the
first submit: the batch reaching the store thread, the matches,
the launch, the copy thread queueing the job, its completion, the answers posted and
resolved, next to the GPU's own span of the job (CUDA events around its queued work;
not around a first chunk moved ahead of the job, which runs before them)
and a raw pinned copy of the same bytes measured in the same run: back to back (the
ratio's base) and alone after a pause, as a lone batch meets the device.

``--trace DIR``: one more offload and load batch of each shape under ``torch.profiler``
(CUDA runtime calls of every thread, the GPU's kernels and copies), each written as a
Chrome trace and summarised as a timeline from the batch's first submit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv.bench.bandwidth import raw_copy_gib_s
from aiokv.copy import copier as local_copier
from aiokv.loop import resolution
from aiokv.running import pick_device, run_uvloop
from aiokv.stores.local import completion as local_completion
from aiokv.stores.local import store as local_store
from aiokv.worker import calls
from aiokv.worker import thread as worker

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 256, 32


class Marks:
    """First time each stage was reached in the current batch (perf_counter seconds)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.gpu_ms: list[float] = []
        self.pending_gpu: Callable[[], None] | None = None  # reads the last job's span

    def mark(self, stage: str) -> None:
        self.at.setdefault(stage, time.perf_counter())


def _wrap(owner: Any, name: str, before: str | None, after: str | None, marks: Marks) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            marks.mark(before)
        result = original(*args, **kwargs)
        if after:
            marks.mark(after)
        return result

    setattr(owner, name, wrapped)


def instrument_fine(marks: Marks) -> None:
    """More stages (--fine): each costs a wrapper call (about a microsecond)."""
    from aiokv.worker import rounds
    _wrap(calls.StoreCalls, "match", "match_start", None, marks)
    _wrap(rounds.Rounds, "_execute", "planned", None, marks)
    _wrap(local_store.LocalStore, "launch", "launching", None, marks)
    _wrap(local_copier.Copier, "_queue_driver", "copy_thread", None, marks)
    _wrap(local_copier, "plan", None, "copies_planned", marks)
    _wrap(worker.StoreWorker, "_poll", "polled", None, marks)


def instrument(marks: Marks) -> None:
    _wrap(worker.StoreWorker, "_handle", "store_thread", None, marks)
    _wrap(local_store.LocalStore, "launch", None, "launched", marks)
    _wrap(local_completion.TaskEnds, "job_done", "copied", None, marks)
    _wrap(resolution.Resolver, "deliver", "resolved", None, marks)
    original_post = worker.StoreWorker._post

    def post(self: Any) -> None:
        if self._outbox:
            marks.mark("posted")
        original_post(self)

    worker.StoreWorker._post = post  # type: ignore[method-assign]
    _wrap(calls.StoreCalls, "match", None, "matched", marks)
    enqueue = local_copier.Copier._queue_driver

    def timed_enqueue(self: Any, job: Any, ids: Any, ids_stream: Any, streams: Any,
                      *calls: Any) -> Any:
        # The GPU's span of the job: from its first stream's start to every stream's end.
        start = torch.cuda.Event(enable_timing=True)
        start.record(streams[0])
        queued = enqueue(self, job, ids, ids_stream, streams, *calls)  # as given
        for event in queued.ends:
            streams[0].wait_event(event)
        end = torch.cuda.Event(enable_timing=True)
        end.record(streams[0])
        marks.mark("queued")
        marks.gpu_ms.append(0.0)
        index = len(marks.gpu_ms) - 1

        def measure() -> None:
            end.synchronize()
            marks.gpu_ms[index] = start.elapsed_time(end)

        marks.pending_gpu = measure
        return queued

    local_copier.Copier._queue_driver = timed_enqueue  # type: ignore[method-assign]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_copy_ms(nbytes: int, device: torch.device) -> tuple[float, float]:
    """(device->host, host->device) ms of one pinned copy of ``nbytes``."""
    d2h, h2d = raw_copy_gib_s(nbytes / (1 << 30), device, 3)
    return nbytes / (1 << 30) / d2h * 1e3, nbytes / (1 << 30) / h2d * 1e3


def _lone_copy_ms(nbytes: int, device: torch.device, repeats: int,
                  pause_s: float = 0.01) -> dict[str, float]:
    """The raw copies again, each alone after a pause, as a lone batch meets the device:
    per direction, ms from issuing the copy to its synchronize returning ("wall") and the
    GPU's own span of it (CUDA events), median of ``repeats``. Context for the ratios,
    which stay against the back-to-back figure."""
    if device.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    for name, copy in (("d2h", lambda: host.copy_(gpu, non_blocking=True)),
                       ("h2d", lambda: gpu.copy_(host, non_blocking=True))):
        walls, spans = [], []
        for _ in range(repeats + 1):  # the first warms up
            _sync(device)
            time.sleep(pause_s)
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start = time.perf_counter()
            begin.record()
            copy()
            end.record()
            end.synchronize()
            walls.append((time.perf_counter() - start) * 1e3)
            spans.append(begin.elapsed_time(end))
        out[f"raw_lone_{name}_wall_ms"] = statistics.median(walls[1:])
        out[f"raw_lone_{name}_span_ms"] = statistics.median(spans[1:])
    return out


def summarise_trace(path: Path, label: str) -> list[str]:
    """The traced batch as lines: each GPU op and each CUDA runtime call (ms from the
    batch's start, duration, thread), merging runs of the same call on one thread."""
    events = json.loads(path.read_text())["traceEvents"]
    marker = [e for e in events if e.get("name") == label and e.get("ph") == "X"]
    if not marker:
        return [f"{label}: marker not in the trace"]
    t0, t1 = marker[0]["ts"], marker[0]["ts"] + marker[0]["dur"]
    rows = []
    for e in events:
        if e.get("ph") != "X" or not t0 <= e.get("ts", -1) <= t1:
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver",
                   "cpu_op"):
            where = "GPU" if cat.startswith(("kernel", "gpu")) else f"t{e.get('tid')}"
            rows.append(((e["ts"] - t0) / 1e3, e.get("dur", 0) / 1e3, where, e["name"][:60]))
    rows.sort()
    lines, last = [], None
    for start, dur, where, name in rows:
        if last and last[2] == where and last[3] == name and where != "GPU":
            last[1] += 1
            last[4] = start + dur
            continue
        if last:
            lines.append(last)
        last = [start, 1, where, name, start + dur]
    if last:
        lines.append(last)
    return [f"  {a:8.3f} -> {e:8.3f} ms  {w:>9} x{n:<3} {name}" for a, n, w, name, e in lines]


async def run_shape(users: int, tokens: int, repeats: int, marks: Marks,
                    device: torch.device, trace: Path | None = None) -> dict[str, Any]:
    pages = tokens // PAGE
    num_pages = users * pages * 2
    caches = [torch.randn(num_pages, 2, PAGE, HEADS, HEAD_DIM, device=device,
                          dtype=torch.bfloat16) for _ in range(LAYERS)]
    nbytes = users * pages * LAYERS * 2 * PAGE * HEADS * HEAD_DIM * 2
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=nbytes * (repeats + 3) / 2**30))
    config = aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=users)
    rows: dict[str, list[dict[str, float]]] = {"offload": [], "load": []}
    async with aiokv.OffloadEngine(store, caches, config) as engine:
        await asyncio.to_thread(store.wait_pinned)  # a lone batch, not start-up
        for repeat in range(repeats + 1 + (trace is not None)):  # 0 warms up
            base = repeat * users
            page_ids = [torch.arange(u * pages, (u + 1) * pages, device=device)
                        for u in range(users)]
            for kind in ("offload", "load"):
                lookups = []
                if kind == "load":
                    lookups = await asyncio.gather(
                        *(engine.lookup(base + u, tokens) for u in range(users)))
                    targets = [torch.arange(num_pages // 2 + u * pages,
                                            num_pages // 2 + (u + 1) * pages, device=device)
                               for u in range(users)]
                _sync(device)
                traced = trace is not None and repeat == repeats + 1
                profiler = None
                if traced:
                    from torch.profiler import ProfilerActivity, profile, record_function
                    profiler = profile(activities=[ProfilerActivity.CPU,
                                                   ProfilerActivity.CUDA])
                    profiler.__enter__()
                    label = f"lone-{kind}-{users}x{tokens}"
                    span = record_function(label)
                    span.__enter__()
                marks.at.clear()
                start = time.perf_counter()
                if kind == "offload":
                    await asyncio.gather(*(engine.offload(base + u, page_ids[u], tokens)
                                           for u in range(users)))
                else:
                    await asyncio.gather(*(engine.load(lookups[u], targets[u])
                                           for u in range(users)))
                end = time.perf_counter()
                if profiler is not None and trace is not None:
                    span.__exit__(None, None, None)
                    _sync(device)
                    profiler.__exit__(None, None, None)
                    out = trace / f"{label}.json"
                    profiler.export_chrome_trace(str(out))
                    print(f"{label}: {(end - start) * 1e3:.2f} ms traced")
                    summary = summarise_trace(out, label)
                    out.with_suffix(".txt").write_text("\n".join(summary) + "\n")
                    continue
                gpu = 0.0
                if marks.pending_gpu is not None:
                    marks.pending_gpu()
                    marks.pending_gpu = None
                    gpu = marks.gpu_ms[-1]
                row = {s: (at - start) * 1e3 for s, at in marks.at.items()}
                row["total"] = (end - start) * 1e3
                row["gpu_span"] = gpu
                if repeat:
                    rows[kind].append(row)
    d2h, h2d = _raw_copy_ms(nbytes, device)
    out: dict[str, Any] = {"users": users, "tokens": tokens, "bytes": nbytes,
                           "raw_d2h_ms": d2h, "raw_h2d_ms": h2d,
                           **_lone_copy_ms(nbytes, device, repeats)}
    for kind, kind_rows in rows.items():
        keys = set.intersection(*(set(r) for r in kind_rows))
        medians = {k: statistics.median(r[k] for r in kind_rows) for k in keys}
        out[kind] = dict(sorted(medians.items(), key=lambda item: item[1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x1024,32x2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--fine", action="store_true", help="more stages (instrument_fine)")
    args = parser.parse_args()
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    marks = Marks()
    if args.fine:
        instrument_fine(marks)
    instrument(marks)
    results = []
    for shape in args.shapes.split(","):
        users, tokens = (int(x) for x in shape.split("x"))
        result = run_uvloop(run_shape(users, tokens, args.repeats, marks, device,
                                       args.trace))
        results.append(result)
        for kind, way in (("offload", "d2h"), ("load", "h2d")):
            row, raw = result[kind], result[f"raw_{way}_ms"]
            stages = " ".join(f"{s} {t:.2f}" for s, t in row.items()
                              if s not in ("total", "gpu_span"))
            lone = ""
            if f"raw_lone_{way}_wall_ms" in result:
                lone = (f", raw alone after a pause {result[f'raw_lone_{way}_wall_ms']:.2f} "
                        f"(gpu {result[f'raw_lone_{way}_span_ms']:.2f})")
            print(f"{users}x{tokens} {kind}: total {row['total']:.2f} ms, raw {raw:.2f} ms "
                  f"({raw / row['total']:.0%} of raw){lone}, gpu span {row['gpu_span']:.2f} | "
                  f"ms from first submit: {stages}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
