"""What one batch's first CUDA calls cost after a pause, against the same calls warm.

    python benchmarks/cuda_cold_calls.py     (needs a CUDA GPU)

A fused-copy-like sequence (stream context, cat, add, a copy to pinned memory, an event)
timed call by call (µs, median of 40-150): back to back; after a sleep of 5 or 20 ms;
after a sleep and one earlier call (a tiny kernel, an event record, a stream query)
and a short spin; and behind a queued 256 MiB copy. A lone batch meets its calls after
such a pause: the store and copy threads slept since the batch before.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch

COLUMNS = ("ctx", "cat", "add", "copy", "event", "exit", "total")


def main() -> None:
    device = torch.device("cuda")
    stream = torch.cuda.Stream()
    pages = [torch.arange(i * 32, (i + 1) * 32, device=device) for i in range(8)]
    pinned = torch.empty(8192, dtype=torch.int64, pin_memory=True)
    offsets = torch.arange(32, device=device)
    tiny = torch.zeros(1, device=device)
    big = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    big_host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    clock = time.perf_counter

    def sequence(rows: list[list[float]]) -> None:
        marks = [clock()]
        context = torch.cuda.stream(stream)
        context.__enter__()
        marks.append(clock())
        fused = torch.cat(pages)
        marks.append(clock())
        slots = torch.add(offsets, fused.reshape(-1, 1), alpha=32).view(-1)
        marks.append(clock())
        pinned.copy_(slots, non_blocking=True)
        marks.append(clock())
        event = torch.cuda.Event()
        event.record()
        marks.append(clock())
        context.__exit__(None, None, None)
        marks.append(clock())
        event.synchronize()
        steps = [(b - a) * 1e6 for a, b in itertools.pairwise(marks)]
        rows.append([*steps, (marks[-1] - marks[0]) * 1e6])

    def spin(seconds: float) -> None:
        end = clock() + seconds
        while clock() < end:
            pass

    def report(name: str, rows: list[list[float]]) -> None:
        medians = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"{name:34s}", " ".join(f"{m:6.1f}" for m in medians))

    print(f"{'(µs, median)':34s}", " ".join(f"{c:>6s}" for c in COLUMNS))
    rows: list[list[float]] = []
    for _ in range(200):
        sequence(rows)
    report("warm", rows[50:])
    before: list[tuple[Callable[[], object], str]] = [
        (lambda: tiny.add_(0), "tiny kernel"),
        (lambda: torch.cuda.Event().record(), "event record"),
        (lambda: torch.cuda.current_stream().query(), "stream query"),
    ]
    for idle in (0.005, 0.02):
        rows = []
        for _ in range(40):
            time.sleep(idle)
            sequence(rows)
        report(f"sleep {idle * 1e3:.0f}ms", rows)
        for call, what in before:
            for gap in (0.0, 0.0002, 0.0005):
                rows = []
                for _ in range(40):
                    time.sleep(idle)
                    call()
                    spin(gap)
                    sequence(rows)
                report(f"sleep {idle * 1e3:.0f}ms, {what}, +{gap * 1e6:.0f}us", rows)
        rows = []
        for _ in range(40):
            time.sleep(idle)
            big_host.copy_(big, non_blocking=True)
            sequence(rows)
        report(f"sleep {idle * 1e3:.0f}ms, behind a 256MiB copy", rows)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
