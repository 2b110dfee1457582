"""Probe: a lookup's get + checksums of 16 x 512 KiB, one call then hash, against chunked
pipelines (get chunk i+1 while hashing chunk i) and concurrent chunk gets; puts likewise."""

import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from aiokv.remote.native import import_store
from aiokv.remote.servers import MooncakeServers

N, SIZE, REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 16, 512 << 10, 40
pool = ThreadPoolExecutor(4)
getter = ThreadPoolExecutor(4)


def hsum(keys, addrs, buf0, base):
    out = []
    for k, a in zip(keys, addrs, strict=True):
        d = xxhash.xxh3_64(k.encode())
        d.update(memoryview(buf0)[a - base : a - base + SIZE])
        out.append(d.intdigest())
    return out


def hash_par(keys, addrs, buf, base, threads=2):
    share = -(-len(keys) // threads)
    fs = [
        pool.submit(hsum, keys[i : i + share], addrs[i : i + share], buf, base)
        for i in range(share, len(keys), share)
    ]
    s = hsum(keys[:share], addrs[:share], buf, base)
    for f in fs:
        s += f.result()
    return s


with MooncakeServers(segment_mb=2048, lease_ms=2000) as servers:
    store = import_store().MooncakeDistributedStore()
    assert (
        store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "", servers.master)
        == 0
    )
    buf = np.ones(4 * N * SIZE, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    base = buf.ctypes.data
    buf[: N * SIZE] = np.random.randint(0, 255, N * SIZE, dtype=np.uint8)
    src = [base + i * SIZE for i in range(N)]
    dst = [base + (N + i) * SIZE for i in range(N)]

    def get(keys, addrs):
        got = store.batch_get_into(keys, addrs, [SIZE] * len(keys))
        assert all(g == SIZE for g in got), got

    def put(keys, addrs):
        c = store.batch_put_from(keys, addrs, [SIZE] * len(keys))
        assert all(x == 0 for x in c), c

    ways = {}

    def w_one(keys):
        get(keys, dst)
        hash_par(keys, dst, buf, base)

    def w_pipe(c):
        def f(keys):
            chunks = [(keys[i : i + c], dst[i : i + c]) for i in range(0, N, c)]
            fut = getter.submit(get, *chunks[0])
            for i, (k, a) in enumerate(chunks):
                fut.result()
                if i + 1 < len(chunks):
                    fut = getter.submit(get, *chunks[i + 1])
                hash_par(k, a, buf, base)

        return f

    def w_conc(c):
        def f(keys):
            chunks = [(keys[i : i + c], dst[i : i + c]) for i in range(0, N, c)]
            futs = [getter.submit(get, *ch) for ch in chunks]
            for fu, (k, a) in zip(futs, chunks, strict=True):
                fu.result()
                hash_par(k, a, buf, base)

        return f

    def w_raw(keys):
        get(keys, dst)

    getways = {
        "raw get": w_raw,
        "get then hash": w_one,
        "pipe 4": w_pipe(4),
        "pipe 8": w_pipe(8),
        "conc 8": w_conc(8),
        "conc 4": w_conc(4),
    }

    def p_raw(keys):
        put(keys, src)

    def p_one(keys):
        hash_par(keys, src, buf, base)
        put(keys, src)

    def p_pipe(c):
        def f(keys):
            chunks = [(keys[i : i + c], src[i : i + c]) for i in range(0, N, c)]
            hf = pool.submit(hash_par, *chunks[0], buf, base, 1)
            for i, (k, a) in enumerate(chunks):
                hf.result()
                if i + 1 < len(chunks):
                    hf = pool.submit(hash_par, *chunks[i + 1], buf, base, 1)
                put(k, a)

        return f

    putways = {
        "raw put": p_raw,
        "hash then put": p_one,
        "put pipe 4": p_pipe(4),
        "put pipe 8": p_pipe(8),
    }
    times = {k: [] for k in [*getways, *putways]}
    for rep in range(REPS):
        order = list(putways)
        random.shuffle(order)
        for way in order:
            keys = [f"{way}/{rep}/{i}" for i in range(N)]
            t = time.perf_counter()
            putways[way](keys)
            times[way].append(time.perf_counter() - t)
        keys = [f"raw put/{rep}/{i}" for i in range(N)]
        order = list(getways)
        random.shuffle(order)
        for way in order:
            t = time.perf_counter()
            getways[way](keys)
            times[way].append(time.perf_counter() - t)
        for way in putways:
            store.remove_by_regex(f"^{way}/{rep}/" if way != "raw put" else "^$", True)
    for way, ts in times.items():
        median = statistics.median(ts)
        print(f"{way:>16}: median {median * 1e3:7.3f} ms  {N * SIZE / median / 2**30:6.2f} GiB/s")

# Checksums alone, threads 1, 2, 4, 8: 16 values of 512 KiB as a lookup's (aiokv's Checksums)
from aiokv.remote.checksums import Checksums  # noqa: E402

big = np.random.randint(0, 255, size=256 * SIZE, dtype=np.uint8)
views = [memoryview(big[i * SIZE : (i + 1) * SIZE]) for i in range(256)]
keys = [f"k/{i}" for i in range(256)]
for th in (1, 2, 4, 8):
    c = Checksums(lambda i: views[i], SIZE, th)
    ts = []
    for _ in range(10):
        for s in range(0, 256, 16):
            t = time.perf_counter()
            c(keys[s : s + 16], list(range(s, s + 16)))
            ts.append(time.perf_counter() - t)
    median = statistics.median(ts)
    print(f"checksums of 16 x 512 KiB, {th} threads: median {median * 1e3:.3f} ms, "
          f"{16 * SIZE / median / 2**30:.1f} GiB/s")
    c.close()
