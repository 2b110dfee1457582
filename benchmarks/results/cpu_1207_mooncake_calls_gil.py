"""A throwaway probe (2-core, 2026-12-07): how long Mooncake's small calls take while
another thread of the process runs pure Python. Each call lets the GIL go; returning, it
must take it back from the counting thread, which keeps it until Python's switch
interval (5 ms) forces a switch. Run from the repository root:

    python benchmarks/results/cpu_1207_mooncake_calls_gil.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aiokv.remote.native import import_store
from aiokv.remote.servers import MooncakeServers
from benchmarks.mooncake_gil import counted

with MooncakeServers(segment_mb=256) as servers:
    client = import_store().MooncakeDistributedStore()
    if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", servers.master):
        raise SystemExit("Mooncake setup failed")
    keys = [f"k{i}" for i in range(65)]
    client.put("k1", b"1")
    works = {"asleep 0.2 ms": lambda c: time.sleep(0.0002),
             "batch_is_exist (65 keys)": lambda c: client.batch_is_exist(keys),
             "is_exist": lambda c: client.is_exist("k1"),
             "get (1 byte)": lambda c: client.get("k1"),
             "put (1 byte)": lambda c: client.put(f"m{c}", b"1"),
             "remove": lambda c: client.remove(f"m{c}", True)}
    for name, work in works.items():
        millions, calls, stall = counted(1.5, work)
        print(f"{name:>26}: {millions:6.2f} M counted, {calls} calls "
              f"({1.5 / calls * 1e6:.0f} us each), the count's longest stall {stall:.2f} ms",
              flush=True)
    client.close()
