"""Throwaway probe (2026-12-07): one batch's server-side put match (decode, match_many,
encode; 8 x 256 tokens) in one process, back to back and after a 300 us sleep."""

import os
import select
import socket
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "/work/main")
import aiokv
from aiokv.stores.shared import wire
from aiokv.stores.shared.region import Geometry
from aiokv.stores.shared.service import Service
from aiokv.stores.shared.tasks import Client

caches = [torch.zeros(1, 2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
service = Service(aiokv.StoreConfig(cpu_cache_gb=0.1), lambda: None)
service.allocate()
service.register(Geometry.of(caches))
client = Client(1, os.getpid())
tokens = np.arange(256, dtype=np.int64)
idle, _ = socket.socketpair()
for mode in ("hot", "sleep 300us", "select 300us", "hot"):
    took = []
    for i in range(400):
        if mode.startswith("sleep"):
            time.sleep(0.0003)
        if mode.startswith("select"):
            select.select([idle], [], [], 0.0003)
        frame = wire.encode_match(wire.PUT, [(tokens, [f"{mode}{i}:{u}"]) for u in range(8)],
                                  16, [])
        began = time.perf_counter()
        request = wire.decode_match(memoryview(frame)[8:], 16)
        answers = service.match_many(client, True, request.queries)
        wire.encode_answers(answers)
        took.append((time.perf_counter() - began) * 1e6)
        end = wire.encode_end([], [a[0] for a in answers if isinstance(a[0], int)])
        service.finish(client, *wire.decode_end(memoryview(end)[8:]))
    print(mode, round(statistics.median(took[50:]), 1))
