"""Probe (twenty-third session): what slows a get of 16 values of 512 KiB against the
raw call of the same bytes? Each rep puts fresh values, then gets them in each way, in
shuffled order:

- ``plain``: into the same host memory each time (as the benchmark's raw gets);
- ``with 5 absent markers``: the same, with five absent keys asked in the same
  ``batch_get_into`` (aiokv's reads ask a lookup's markers with its values);
- ``rotating``: into memory rotating through a 1 GiB pool (as the host tier's allocator
  hands out blocks).
"""

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
    scratch = np.zeros(8, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert store.register_buffer(scratch.ctypes.data, 8) == 0
    buf[: N * SIZE] = np.random.randint(0, 255, N * SIZE, dtype=np.uint8)
    times: dict[str, list[float]] = {"plain": [], "with 5 absent markers": [], "rotating": []}
    at = N * SIZE
    for rep in range(REPS):
        keys = [f"p/{rep}/{i}" for i in range(N)]
        codes = store.batch_put_from(keys, [buf.ctypes.data + i * SIZE for i in range(N)],
                                     [SIZE] * N)
        assert all(c == 0 for c in codes), codes
        order = list(times)
        random.shuffle(order)
        for way in order:
            markers = [f"m/{rep}/{j}" for j in range(5)] if way.startswith("with") else []
            if way == "rotating":
                at = at + N * SIZE if at + 2 * N * SIZE <= POOL else 2 * N * SIZE
                base = buf.ctypes.data + at
            else:
                base = buf.ctypes.data + N * SIZE
            began = time.perf_counter()
            got = store.batch_get_into(
                markers + keys,
                [scratch.ctypes.data] * len(markers) + [base + i * SIZE for i in range(N)],
                [8] * len(markers) + [SIZE] * N)
            times[way].append(time.perf_counter() - began)
            assert all(g == SIZE for g in got[len(markers):]), got
    for way, spent in times.items():
        print(f"{way:>24}: median {statistics.median(spent) * 1e3:.2f} ms")
    store.close()
