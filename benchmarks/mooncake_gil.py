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


def counted(seconds: float, work: Any) -> tuple[float, int]:
    """(millions counted by a Python thread, calls of ``work`` made) over ``seconds``."""
    stop = threading.Event()
    counts = [0]

    def count() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        counts[0] = n

    thread = threading.Thread(target=count)
    thread.start()
    calls = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work(calls)
        calls += 1
    stop.set()
    thread.join()
    return counts[0] / 1e6, calls


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
        works = {
            "asleep": lambda call: time.sleep(0.001),
            "put": lambda call: client.batch_put_from(
                [f"put{call}:{i}" for i in range(VALUES)], addresses, sizes),
            "get": lambda call: client.batch_get_into(stored, addresses, sizes),
        }
        print(f"a Python thread's count over {args.seconds} s while the main thread calls, "
              f"{VALUES} values of {SIZE >> 10} KiB a call:")
        for _ in range(2):
            for name, work in works.items():
                millions, calls = counted(args.seconds, work)
                print(f"  {name:>6}: {millions:6.2f} M counted, {calls} calls")
        client.close()


if __name__ == "__main__":
    main()
