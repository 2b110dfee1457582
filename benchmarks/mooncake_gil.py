"""Whether Mooncake's batch put and get let the GIL go while they move bytes: a thread counts
in a Python loop while the main thread puts (or gets) 64 values of 512 KiB back to back for
2 s, against the same 2 s asleep. A call that held the GIL would stop the count; one that
lets it go slows the count only by the CPU its own threads take.

    python benchmarks/mooncake_gil.py [--seconds 2]

Starts a master and a store process on 127.0.0.1 (aiokv.remote.servers), as the remote
tier's tests do.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv.remote.native import import_store
from aiokv.remote.servers import MooncakeServers

VALUES, SIZE = 64, 512 << 10


def counted(seconds: float, work: Any) -> tuple[float, int, float]:
    """(millions counted by a Python thread, calls of ``work`` made, the count's longest
    stall in ms) over ``seconds``. A call that holds the GIL while it waits stalls the
    count for that long, whatever ``sys.setswitchinterval`` says."""
    stop = threading.Event()
    counts = [0]
    longest = [0.0]

    def count() -> None:
        n, last, worst = 0, time.perf_counter(), 0.0
        while not stop.is_set():
            n += 1
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        counts[0], longest[0] = n, worst * 1e3

    thread = threading.Thread(target=count)
    thread.start()
    calls = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work(calls)
        calls += 1
    stop.set()
    thread.join()
    return counts[0] / 1e6, calls, longest[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    with MooncakeServers(segment_mb=512) as servers:
        client = import_store().MooncakeDistributedStore()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", servers.master):
            raise SystemExit("Mooncake client setup failed")
        buffer = np.ones(VALUES * SIZE, dtype=np.uint8)
        base = buffer.ctypes.data
        if client.register_buffer(base, buffer.nbytes):
            raise SystemExit("register_buffer failed")
        addresses, sizes = [base + i * SIZE for i in range(VALUES)], [SIZE] * VALUES
        stored = [f"get{i}" for i in range(VALUES)]
        client.batch_put_from(stored, addresses, sizes)
        half = SIZE - 8
        two_addresses = [[a, a + half] for a in addresses]
        two_sizes = [[half, 8]] * VALUES
        stored2 = [f"get2{i}" for i in range(VALUES)]
        client.batch_put_from_multi_buffers(stored2, two_addresses, two_sizes)
        works = {
            "asleep": lambda call: time.sleep(0.001),
            "put": lambda call: client.batch_put_from(
                [f"put{call}:{i}" for i in range(VALUES)], addresses, sizes),
            "get": lambda call: client.batch_get_into(stored, addresses, sizes),
            # The calls the remote tier makes: each value in two slices (block, checksum).
            "put2": lambda call: client.batch_put_from_multi_buffers(
                [f"put2{call}:{i}" for i in range(VALUES)], two_addresses, two_sizes),
            "get2": lambda call: client.batch_get_into_multi_buffers(
                stored2, two_addresses, two_sizes),
        }
        print(f"a Python thread's count over {args.seconds} s while the main thread calls, "
              f"{VALUES} values of {SIZE >> 10} KiB a call:")
        for _ in range(2):
            for name, work in works.items():
                millions, calls, stall_ms = counted(args.seconds, work)
                print(f"  {name:>6}: {millions:6.2f} M counted, {calls} calls, "
                      f"longest stall {stall_ms:.2f} ms")
        client.close()


if __name__ == "__main__":
    main()
