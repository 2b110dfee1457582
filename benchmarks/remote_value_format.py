"""What a remote-tier value's shape and Mooncake's call cost: a probe on one client.

    python benchmarks/remote_value_format.py [--values 16] [--reps 60] [--block-kib 512]

Starts a master and a store process on 127.0.0.1 (TCP). Each rep puts fresh values (a
value is read once, right after it was written, as the tier's are) and times each way
of putting and of getting ``--values`` values of ``--block-kib``, in an order shuffled
per rep; it prints the median and quartiles in ms:

- ``one slice``: ``batch_put_from`` / ``batch_get_into`` of the block alone (the raw calls);
- ``two slices``: ``batch_*_multi_buffers``, the block and an 8-byte checksum apart (the
  tier's values until the host pool kept a trailer after each block);
- ``staged``: block + checksum as one slice from (into) a registered staging area, with
  the copy of the block in (out) and, on puts, the checksum;
- ``staged, no copy``: the same one slice without the copies (what the trailer costs;
  the tier's values today: block and trailer, zero-copy from the host pool);
- ``sessions, two slices``: Mooncake's put and get sessions (``batch_*_session_start``,
  ``batch_*_multi_buffer_ranges``, ``*_session_end``), the master asked once;
- ``exist + two slices``: ``batch_is_exist`` then the get (the tier's reads before).

Then the tier's own reads (``aiokv.remote.client.RemoteIO`` over the same kind of memory,
values its writer wrote): a lookup as the store thread makes it, alternated per lookup,
each on fresh values: ``read`` (markers and values in one get: one hand-off to the reader
thread) against ``leading`` then ``fetch`` (existence check, then the get: two hand-offs).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv.remote.client import RemoteIO
from aiokv.remote.config import RemoteConfig
from aiokv.remote.keys import Keys
from aiokv.remote.native import import_store
from aiokv.remote.queue import WriteJob
from aiokv.remote.servers import MooncakeServers
from aiokv.remote.values import Layout
from aiokv.stores.local.layout import block_stride

TRAILER = 8
SLOT_ALIGN = 4096


class Memory:
    """Registered host memory: blocks, a staging area of block + trailer slots, a
    checksum table."""

    def __init__(self, client: Any, block: int, count: int) -> None:
        self.block, self.count = block, count
        self.pool = torch.randint(0, 255, (count * block,), dtype=torch.uint8)
        self.slot = -(-(block + TRAILER) // SLOT_ALIGN) * SLOT_ALIGN
        self.staging = torch.zeros(count * self.slot, dtype=torch.uint8)
        self.sums = np.zeros(count, dtype=np.uint64)
        for ptr, size in ((self.pool.data_ptr(), self.pool.numel()),
                          (self.staging.data_ptr(), self.staging.numel()),
                          (self.sums.ctypes.data, self.sums.nbytes)):
            if client.register_buffer(ptr, size) != 0:
                raise RuntimeError("register_buffer failed")

    def blocks(self) -> list[int]:
        return [self.pool.data_ptr() + i * self.block for i in range(self.count)]

    def slots(self) -> list[int]:
        return [self.staging.data_ptr() + i * self.slot for i in range(self.count)]

    def two(self) -> tuple[list[list[int]], list[list[int]]]:
        sums = self.sums.ctypes.data
        return ([[p, sums + i * TRAILER] for i, p in enumerate(self.blocks())],
                [[self.block, TRAILER]] * self.count)

    def stage_in(self, keys: list[str]) -> None:
        """Each block into its slot (memmove: a plain memcpy, without the GIL), then
        its checksum (of key and the slot's bytes, still in cache) after it."""
        trailers = np.frombuffer(memoryview(self.staging.numpy()), dtype=np.uint8)
        for i, (key, slot, block) in enumerate(zip(keys, self.slots(), self.blocks(),
                                                   strict=True)):
            ctypes.memmove(slot, block, self.block)
            at = i * self.slot + self.block
            digest = xxhash.xxh3_64(key.encode())
            digest.update(memoryview(trailers)[at - self.block : at])  # hot in cache
            trailers[at : at + TRAILER] = np.frombuffer(digest.digest(), dtype=np.uint8)

    def stage_out(self) -> None:
        for slot, block in zip(self.slots(), self.blocks(), strict=True):
            ctypes.memmove(block, slot, self.block)


def check(codes: list[int], want: int) -> None:
    if any(code != want for code in codes):
        raise RuntimeError(f"a call failed: {sorted(set(codes))}")


def ways(client: Any, m: Memory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per way: (put(keys), get(keys)) on the same value shape."""
    n, block, whole = m.count, m.block, m.block + TRAILER
    two = m.two()
    ranges = [[0, block]] * n

    def put_session(keys: list[str]) -> None:
        check(client.batch_put_session_start(keys, [whole] * n), 0)
        check(client.batch_put_from_multi_buffer_ranges(keys, *two, ranges), whole)
        check(client.batch_put_session_end(keys), 0)

    def get_session(keys: list[str]) -> None:
        check(client.batch_get_session_start(keys), 0)
        check(client.batch_get_into_multi_buffer_ranges(keys, *two, ranges), whole)
        client.batch_get_session_end(keys)

    def put_two(keys: list[str]) -> None:
        check(client.batch_put_from_multi_buffers(keys, *two), 0)

    def get_two(keys: list[str]) -> None:
        check(client.batch_get_into_multi_buffers(keys, *two), whole)

    def put_slot(keys: list[str]) -> None:
        check(client.batch_put_from(keys, m.slots(), [whole] * n), 0)

    def get_slot(keys: list[str]) -> None:
        check(client.batch_get_into(keys, m.slots(), [whole] * n), whole)

    def put_staged(keys: list[str]) -> None:
        m.stage_in(keys)
        put_slot(keys)

    def get_staged(keys: list[str]) -> None:
        get_slot(keys)
        m.stage_out()

    def get_exist(keys: list[str]) -> None:
        client.batch_is_exist(keys)
        get_two(keys)

    puts: dict[str, Callable[[list[str]], None]] = {
        "one slice": lambda k: check(client.batch_put_from(k, m.blocks(), [block] * n), 0),
        "two slices": put_two,
        "staged": put_staged,
        "staged, no copy": put_slot,
        "sessions, two slices": put_session,
        "exist + two slices": put_two,
    }
    gets: dict[str, Callable[[list[str]], None]] = {
        "one slice": lambda k: check(client.batch_get_into(k, m.blocks(), [block] * n), block),
        "two slices": get_two,
        "staged": get_staged,
        "staged, no copy": get_slot,
        "sessions, two slices": get_session,
        "exist + two slices": get_exist,
    }
    return puts, gets


def tier_reads(args: argparse.Namespace, master: str) -> None:
    """The tier's lookups, one step (``read``) against two (``leading`` + ``fetch``)."""
    n, block = args.values, args.block_kib << 10
    stride = block_stride(block, True)  # the tier's host pool: a trailer after each block
    pool = torch.randint(0, 255, (n * stride,), dtype=torch.uint8)
    data = memoryview(pool.numpy())
    io = RemoteIO(RemoteConfig(master=master, timeout_ms=5000), Keys("probe"),
                  Layout(pool.data_ptr(), pool.numel(), block, stride, n),
                  lambda b: data[b * stride : b * stride + block], lambda: None)
    blocks = list(range(n))
    users = [(f"user{u}", [u.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)])
             for u in range(2 * args.reps)]
    # Written by the tier's writer as an offload's would be, one user at a time: the users
    # share the pool's blocks, and a batch holds a block once (its checksum's slot).
    for ns, digests in users:
        io.queue.put(WriteJob(ns, digests, np.array(blocks, dtype=np.int64)))
        io.queue.wait_idle(60)
    written = io.write_stats["remote_blocks_written"]
    if written != n * len(users):
        raise RuntimeError(f"the writer wrote {written} of {n * len(users)} values")

    def one_step(item: tuple[str, list[bytes]]) -> int:
        got: list[int] = io.submit_read(io.read, [item], blocks).result()
        return got[0]

    def two_steps(item: tuple[str, list[bytes]]) -> int:
        present: list[list[str]] = io.submit_read(io.leading, [item]).result()
        got: list[int] = io.submit_read(io.fetch, present[0], blocks[: len(present[0])],
                                        [len(present[0])]).result()
        return got[0]

    times: dict[str, list[float]] = {"read (one get)": [], "leading + fetch": []}
    rng = np.random.default_rng(1)
    ways = list(zip(times, (one_step, two_steps), strict=True))
    for rep in range(args.reps):
        for which, item in zip(rng.permutation(2).tolist(), users[2 * rep : 2 * rep + 2],
                               strict=True):
            name, call = ways[which]
            began = time.perf_counter()
            if call(item) != n:
                raise RuntimeError(f"{name}: a lookup missed ({io.read_stats})")
            times[name].append((time.perf_counter() - began) * 1000)
    print(f"the tier's lookups of {n} values, fresh values, {args.reps} each, ms:")
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        print(f"  {name:<26} median {q[1]:>7.3f}   quartiles {q[0]:.3f} - {q[2]:.3f}")
    io.close()


def run(args: argparse.Namespace) -> None:
    with MooncakeServers(segment_mb=args.segment_mb, lease_ms=2000) as servers:
        client = import_store().MooncakeDistributedStore()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", servers.master):
            raise RuntimeError("setup failed")
        memory = Memory(client, args.block_kib << 10, args.values)
        puts, gets = ways(client, memory)
        times: dict[str, list[float]] = {}
        rng = np.random.default_rng(0)
        for rep in range(-1, args.reps):  # -1 warms up
            keys = {name: [f"probe/{rep}/{j}/{i}" for i in range(args.values)]
                    for j, name in enumerate(puts)}
            for what, calls in (("put", puts), ("get", gets)):
                for name in rng.permutation(list(calls)):
                    began = time.perf_counter()
                    calls[name](keys[name])
                    if rep >= 0:
                        times.setdefault(f"{what} {name}", []).append(
                            (time.perf_counter() - began) * 1000)
            if rep % 8 == 7:
                client.remove_by_regex("^probe/", True)
        print(f"{args.values} values of {args.block_kib} KiB a call, fresh values each of "
              f"{args.reps} reps, ms:")
        for name, values in times.items():
            q = statistics.quantiles(values, n=4)
            print(f"  {name:<26} median {q[1]:>7.3f}   quartiles {q[0]:.3f} - {q[2]:.3f}")
        client.remove_by_regex("^probe/", True)
        client.close()
        tier_reads(args, servers.master)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=int, default=512)
    parser.add_argument("--values", type=int, default=16)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--segment-mb", type=int, default=2048)
    run(parser.parse_args())
