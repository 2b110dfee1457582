"""What one CUDA call costs from Python, warm and alone, next to how long the lone
batch's stages take (benchmarks/lone_batch.py --fine): the gap between the two is what
the stages pay beyond their calls (cold code paths, thread wake-ups).

    python benchmarks/cuda_call_costs.py

Prints the median of 200 calls of each (microseconds), the wake-up overhead of waiting
for a 16 MiB copy's event with a blocking-sync event, a spinning one and a query loop,
and a thread hand-off through ``queue.SimpleQueue``. Needs a GPU.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch


def median_us(call: Callable[[], object], repeats: int = 200) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def wake_overhead_us(host: torch.Tensor, device_buffer: torch.Tensor, blocking: bool,
                     query_loop: bool = False) -> float:
    """Wall time from enqueueing a copy to this thread running again, less the copy."""
    overheads = []
    for _ in range(30):
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(blocking=blocking, enable_timing=True)
        start = time.perf_counter()
        begin.record()
        host.copy_(device_buffer, non_blocking=True)
        end.record()
        if query_loop:
            while not end.query():
                pass
        else:
            end.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
        overheads.append(wall_ms - begin.elapsed_time(end))
    return statistics.median(overheads) * 1e3


def handoff_us() -> float:
    requests: queue.SimpleQueue[int] = queue.SimpleQueue()
    answers: queue.SimpleQueue[float] = queue.SimpleQueue()

    def echo() -> None:
        while True:
            requests.get()
            answers.put(time.perf_counter())

    threading.Thread(target=echo, daemon=True).start()
    times = []
    for _ in range(200):
        start = time.perf_counter()
        requests.put(1)
        times.append((answers.get() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    pages = np.arange(256, dtype=np.int64)
    pinned = torch.from_numpy(pages).pin_memory()
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    index = torch.arange(256, device=device)
    caches = [torch.empty(512, 2, 32, 4, 256, dtype=torch.bfloat16, device=device)
              for _ in range(8)]
    staging = torch.empty(128, 8, 2, 32, 4, 256, dtype=torch.bfloat16, device=device)

    def record() -> None:
        torch.cuda.Event().record(side)  # type: ignore[no-untyped-call]

    def stream_context() -> None:
        with torch.cuda.stream(side):
            pass

    def gather() -> None:
        for layer, cache in enumerate(caches):
            torch.index_select(cache, 0, index[:128], out=staging[:, layer])

    costs = {
        "pin_memory (256 int64)": median_us(lambda: torch.from_numpy(pages).pin_memory()),
        "pinned .to(device, non_blocking)": median_us(
            lambda: pinned.to(device, non_blocking=True)),
        "Event()": median_us(torch.cuda.Event),
        "Event() + record": median_us(record),
        "with torch.cuda.stream(...)": median_us(stream_context),
        "stream.wait_event": median_us(lambda: side.wait_event(done)),
        "event.synchronize (done)": median_us(done.synchronize),
        "event.query (done)": median_us(done.query),
        "8 x index_select (one chunk, eager)": median_us(gather, 50),
        "torch.cat of 8 small": median_us(
            lambda: torch.cat([index[i * 32:(i + 1) * 32] for i in range(8)]), 100),
    }
    torch.cuda.synchronize()
    for name, micros in costs.items():
        print(f"{name:38s} {micros:8.1f} us")
    host = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    print(f"wake after a 16 MiB copy: blocking event "
          f"{wake_overhead_us(host, device_buffer, True):.1f} us, spinning event "
          f"{wake_overhead_us(host, device_buffer, False):.1f} us, query loop "
          f"{wake_overhead_us(host, device_buffer, False, True):.1f} us")
    print(f"thread hand-off (SimpleQueue): {handoff_us():.1f} us")


if __name__ == "__main__":
    main()
