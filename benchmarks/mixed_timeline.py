"""Where a mixed round's time goes: offloads and loads in flight together, stage by stage.

    python benchmarks/mixed_timeline.py [--users 32] [--tokens 2048] [--repeats 5]
                                        [--json FILE]      (needs a CUDA GPU)

The rounds of ``aiokv bench bandwidth --mixed`` (``users`` loads and ``users`` offloads of
fresh histories submitted together, loads first; its code, through its round hook), with
the engine's stage functions wrapped in timestamps (no change to the code under test) and
CUDA events around each copy job's queued work (and a load's first chunk copied ahead),
all against one event recorded just before the first submit. Prints
the median, over the repeats, of: when each batch reached the store thread, was matched
and launched, when its copy job was queued, when its first GPU op started and its last
ended (the GPU's own clock), and when its callers were resolved, in ms from the first
submit; with the raw duplex copy of the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv import calls, resolution, worker
from aiokv.bench import mixed
from aiokv.bench.rounds import Settings
from aiokv.running import run_uvloop
from aiokv.stores.local import transfer as local_transfer


class Timeline:
    """Per kind ("offload"/"load"), the first time each stage was reached this round."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.gpu: list[tuple[bool, Any, Any]] = []  # (to_host, start event, end event)
        self.ref: Any = None  # the event recorded just before the round's first submit

    def mark(self, stage: str) -> None:
        self.cpu.setdefault(stage, time.perf_counter())


def _kind_of(item: object) -> str:
    kind = getattr(item, "kind", None)  # a Batch's; other inbox items have none
    return getattr(kind, "name", "other").lower()


def instrument(timeline: Timeline) -> None:
    original_handle = worker.StoreWorker._handle

    def handle(self: Any, item: object) -> None:
        kind = _kind_of(item)
        timeline.mark(f"{kind}:store_thread")
        original_handle(self, item)
        timeline.mark(f"{kind}:handled")

    worker.StoreWorker._handle = handle  # type: ignore[method-assign]
    original_submit = local_transfer.Transfer.submit

    def submit(self: Any, job: Any) -> None:
        timeline.mark(f"{'offload' if job.to_host else 'load'}:launched")
        original_submit(self, job)

    local_transfer.Transfer.submit = submit  # type: ignore[method-assign]
    enqueue = local_transfer.Transfer._enqueue_chunks

    def timed_enqueue(self: Any, job: Any) -> Any:
        kind = "offload" if job.to_host else "load"
        timeline.mark(f"{kind}:copy_thread")
        start = torch.cuda.Event(enable_timing=True)
        start.record(self._gpu_stream if job.to_host else self._copy_stream)
        in_flight = enqueue(self, job)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self._copy_stream if job.to_host else self._gpu_stream)
        timeline.mark(f"{kind}:queued")
        timeline.gpu.append((job.to_host, start, end))
        return in_flight

    local_transfer.Transfer._enqueue_chunks = timed_enqueue  # type: ignore[method-assign]
    original_match = calls.StoreCalls.match

    def match(self: Any, method: Callable[..., Any], *args: Any) -> Any:
        kind = "offload" if getattr(method, "__name__", "") == "put_match" else "lookup"
        result = original_match(self, method, *args)
        timeline.mark(f"{kind}:matched")
        return result

    calls.StoreCalls.match = match  # type: ignore[method-assign]
    original_deliver = resolution.Resolver.deliver

    def deliver(self: Any, *args: Any, **kwargs: Any) -> Any:
        timeline.mark("resolved_first")
        return original_deliver(self, *args, **kwargs)

    resolution.Resolver.deliver = deliver  # type: ignore[method-assign]
    copy_ahead = getattr(local_transfer.Transfer, "_copy_ahead", None)  # if the code has it
    if copy_ahead is None:
        return

    def timed_copy_ahead(self: Any, order: Any) -> None:
        offload = order.gpu_pages is not None
        timeline.mark("offload:prestage" if offload else "load:prestage")
        start = torch.cuda.Event(enable_timing=True)
        start.record(self._gpu_stream if offload else self._copy_stream)
        copy_ahead(self, order)
        timeline.gpu.append((offload, start, start))  # its first GPU op, if it comes first

    local_transfer.Transfer._copy_ahead = timed_copy_ahead  # type: ignore[method-assign]


def observe_rounds(timeline: Timeline, rows: list[dict[str, float]]) -> Callable[[str, int], None]:
    """The bench's round hook: at "start", a clean timeline and its reference event; at
    "end", the round's stages in ms from the start (GPU ones against the event)."""
    start = 0.0

    def observe(point: str, repeat: int) -> None:
        nonlocal start
        if point == "start":
            timeline.cpu.clear()
            timeline.gpu.clear()
            timeline.ref = torch.cuda.Event(enable_timing=True)
            timeline.ref.record()
            start = time.perf_counter()
            return
        end = time.perf_counter()
        torch.cuda.synchronize()
        row = {stage: (at - start) * 1e3 for stage, at in timeline.cpu.items()}
        row["total"] = (end - start) * 1e3
        for to_host, first, last in timeline.gpu:
            kind = "offload" if to_host else "load"
            row.setdefault(f"{kind}:gpu_first", timeline.ref.elapsed_time(first))
            row[f"{kind}:gpu_last"] = timeline.ref.elapsed_time(last)
        if repeat:
            rows.append(row)

    return observe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    timeline = Timeline()
    instrument(timeline)
    rows: list[dict[str, float]] = []
    settings = Settings(users=(args.users,), tokens=(args.tokens,), repeats=args.repeats)
    result = run_uvloop(mixed.measure(settings, torch.device("cuda"),
                                      observe_rounds(timeline, rows)))
    keys = set.intersection(*(set(r) for r in rows))
    medians = {k: statistics.median(r[k] for r in rows) for k in keys}
    result["stages_ms"] = dict(sorted(medians.items(), key=lambda item: item[1]))
    print(f"mixed {args.users}x{args.tokens}: engine {result['engine_mixed_gib_s']:.1f} GiB/s, "
          f"raw duplex {result['raw_duplex_gib_s']:.1f} ({result['of_raw_duplex']:.0%}), "
          f"one way {result['raw_one_way_gib_s']:.1f}")
    print("  ms from the first submit: " + ", ".join(
        f"{stage} {ms:.2f}" for stage, ms in result["stages_ms"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
