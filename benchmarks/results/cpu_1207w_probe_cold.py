"""Probe (twenty-third session): a get of 16 values of 512 KiB into the same host memory
each time (as the benchmark's raw gets) against into memory rotating through a 1 GiB
pool (as the host tier's allocator hands out blocks)."""

import random
import statistics
import time

import numpy as np

from aiokv.remote.native import import_store
from aiokv.remote.servers import MooncakeServers

N, SIZE, REPS, POOL = 16, 512 << 10, 60, 1 << 30
with MooncakeServers(segment_mb=1024, lease_ms=2000) as servers:
    store = import_store().MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "",
                       servers.master) == 0
    buf = np.ones(POOL, dtype=np.uint8)  # every page touched once
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    times: dict[str, list[float]] = {"hot": [], "rotating": []}
    at = N * SIZE
    for rep in range(REPS):
        keys = [f"p/{rep}/{i}" for i in range(N)]
        codes = store.batch_put_from(keys, [buf.ctypes.data + i * SIZE for i in range(N)],
                                     [SIZE] * N)
        assert all(c == 0 for c in codes), codes
        order = list(times)
        random.shuffle(order)
        for way in order:
            if way == "hot":
                base = buf.ctypes.data + N * SIZE
            else:
                at = at + N * SIZE if at + 2 * N * SIZE <= POOL else 2 * N * SIZE
                base = buf.ctypes.data + at
            began = time.perf_counter()
            got = store.batch_get_into(keys, [base + i * SIZE for i in range(N)], [SIZE] * N)
            times[way].append(time.perf_counter() - began)
            assert all(g == SIZE for g in got), got
    for way, spent in times.items():
        print(f"{way:>10}: median {statistics.median(spent) * 1e3:.2f} ms")
    store.close()
