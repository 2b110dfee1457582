"""``aiokv bench ssd``: the embedded store's SSD tier against the disk it runs on.

From one run on one directory: the store's SSD write bandwidth (offloads through a host
tier far smaller than the volume, write_through, until every block is on SSD) and read
bandwidth (a reopened store, host tier empty, loading every user back: SSD -> host ->
caches), next to a plain sequential write + fsync and read of the same volume in the same
directory (large ``os.write``/``os.read``, the page cache dropped before the read), and
the speed of the per-block checksum (xxh3-64) on one core. Ratios are store / plain from
this run; nothing is compared against numbers from elsewhere. Caches live where
``--device`` says (the CPU here; on a GPU the read is the end-to-end SSD -> GPU load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from .. import flags
from ..config import StoreConfig, size_text
from ..errors import ConfigError
from ..flags import existing_directory, positive_float, positive_int
from ..stores.base import NoSpace, TaskStatus
from ..stores.local import LocalStore
from . import common

NAME = "ssd"
HELP = "the SSD tier's write/read bandwidth against plain sequential I/O on the same disk"

LAYERS, PAGE, HEADS, DIM = 8, 32, 4, 256  # bf16: 1 MiB a block (page)
BLOCK = LAYERS * 2 * PAGE * HEADS * DIM * 2
USER_PAGES = 16
CHUNK = 16 << 20  # plain I/O request size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=existing_directory,
                        help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--gb", type=positive_float, help="volume in GiB (default 4; --quick 1)")
    parser.add_argument(
        "--host-gb", type=positive_float, default=1.0,
        help="host tier, GiB (at most a quarter of --gb)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=2,
        help="alternate plain and store this many times; the best of each is reported",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the caches live")


class _Driver:
    """Drives a LocalStore from this thread, as the engine's store thread would."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self._wake = threading.Event()
        store.set_notify(self._wake.set)

    def wait_any(self) -> None:
        self._wake.wait(0.05)
        self._wake.clear()

    def put(self, user: int, tokens: np.ndarray, pages: np.ndarray) -> int:
        while True:
            try:
                task, mask = self.store.put_match(tokens, [f"u{user}"])
                break
            except NoSpace:  # host tier full of blocks still being written: wait
                self.store.try_wait([])
                self.wait_any()
        self.store.launch([task], [torch.from_numpy(pages[mask[::PAGE]])], [None])
        return task

    def finish(self, tasks: set[int], keep: int) -> None:
        """Wait until at most ``keep`` of ``tasks`` are open."""
        while len(tasks) > keep:
            for task, result in self.store.try_wait(list(tasks)).items():
                if result.status is not TaskStatus.SUCCESS:
                    raise RuntimeError(f"task {task}: {result.error}")
                tasks.discard(task)
            if len(tasks) > keep:
                self.wait_any()


def _ssd_gb(gb: float) -> float:
    """The store's SSD tier for a volume of ``gb``: the volume, and room to spare."""
    return gb * 1.02 + 0.01


def _store(directory: Path, caches: list[torch.Tensor], host_gb: float, gb: float) -> LocalStore:
    config = StoreConfig(
        cpu_cache_gb=host_gb, ssd_cache_gb=_ssd_gb(gb), ssd_cache_dir=str(directory)
    )
    store = LocalStore(config)
    store.register(caches)
    return store


def _store_round(
    directory: Path, caches: list[torch.Tensor], host_gb: float, gb: float, users: int
) -> dict[str, float]:
    tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
    pages = np.arange(USER_PAGES, dtype=np.int64)
    store = _store(directory, caches, host_gb, gb)
    driver = _Driver(store)
    volume = users * USER_PAGES * float(caches[0][0].nbytes) * len(caches)
    direct = bool(store._link and store._link.ssd.files.direct)
    start = time.perf_counter()
    tasks: set[int] = set()
    for user in range(users):
        tasks.add(driver.put(user, tokens, pages))
        driver.finish(tasks, 4)
    driver.finish(tasks, 0)
    while store.store_stats()["bytes_ssd_written"] < volume:
        store.try_wait([])
        driver.wait_any()
    write_s = time.perf_counter() - start
    store.close()
    _drop_cache(directory)

    start = time.perf_counter()
    store = _store(directory, caches, host_gb, gb)
    open_s = time.perf_counter() - start
    driver = _Driver(store)
    # Loads staged at once: three quarters of the host tier (the staging area).
    in_flight = max(1, 3 * store.num_blocks // (4 * USER_PAGES))
    start = time.perf_counter()
    for user in range(users):
        task, mask = store.get_match(tokens, [f"u{user}"])
        if not mask.all():
            raise RuntimeError(f"user {user} is not on SSD after the reopen")
        store.launch([task], [torch.from_numpy(pages)], [None])
        tasks.add(task)
        driver.finish(tasks, in_flight - 1)
    driver.finish(tasks, 0)
    read_s = time.perf_counter() - start
    stats = store.store_stats()
    store.close()
    if stats["checksum_failures"] or stats["ssd_read_errors"]:
        # Each loaded short rather than fail, and would time as a read.
        raise RuntimeError(f"{stats['checksum_failures']} checksum failures, "
                           f"{stats['ssd_read_errors']} blocks not read")
    return {"write_s": write_s, "read_s": read_s, "open_s": open_s, "volume": volume,
            "direct": float(direct)}


def _drop_cache(directory: Path) -> None:
    for path in directory.rglob("*.dat"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _plain_round(directory: Path, volume: float) -> dict[str, float]:
    path = directory / "aiokv-bench-plain.dat"
    buffer = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    chunks = max(1, int(volume // CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(chunks):
            os.write(fd, buffer)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        while os.read(fd, CHUNK):
            pass
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    scale = volume / (chunks * CHUNK)
    return {"write_s": write_s * scale, "read_s": read_s * scale}


def _checksum_gbps() -> float:
    data = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    start = time.perf_counter()
    rounds = 8
    for _ in range(rounds):
        xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]  # numpy buffer
    return rounds * len(data) / (time.perf_counter() - start) / (1 << 30)


def _check_sizes(gb: float, host_gb: float, directory: str, on_host: bool) -> None:
    """Refuse, naming the flag, a --host-gb this machine's memory cannot hold (as asked,
    before it is capped at a quarter of --gb: the cap hid it, and the run went on at full
    size), a host tier too small for one user's put, and a --gb its disk has no room for
    (the plain write, which comes first, filled the disk, then an OSError traceback)."""
    flags.check_fits(f"--host-gb {host_gb}", {
        "host tier": int(host_gb * (1 << 30)),
        "caches": USER_PAGES * BLOCK if on_host else 0,
    })
    # One user's put takes all of its new pages in the host tier at once: a smaller tier
    # failed it with a message about the store that named no flag.
    host_bytes = min(host_gb, gb / 4) * (1 << 30)
    if host_bytes < USER_PAGES * BLOCK:
        flag, value = ("--host-gb", host_gb) if host_gb <= gb / 4 else ("--gb", gb)
        raise ConfigError(flag, f"{value} GiB makes a host tier of {size_text(int(host_bytes), 1)} "
                          f"(--host-gb, at most a quarter of --gb), fewer than the "
                          f"{USER_PAGES} blocks of {BLOCK >> 10} KiB one user offloads at once")
    # The plain file is removed before the store's tier is made: the tier is the larger.
    need = int(_ssd_gb(gb) * (1 << 30))
    free = shutil.disk_usage(directory).free
    if need > free:
        raise ConfigError("--gb", f"{gb} GiB needs {size_text(need, 1)} on the disk of "
                          f"{directory!r}, which has {size_text(free, 1)} free; ask for less "
                          f"or name a --dir with room")


def run(args: argparse.Namespace) -> int:
    gb = args.gb if args.gb is not None else (1.0 if args.quick else 4.0)
    _check_sizes(gb, args.host_gb, args.dir or tempfile.gettempdir(), args.device == "cpu")
    host_gb = min(args.host_gb, gb / 4)
    owned = args.dir is None
    base = Path(tempfile.mkdtemp(prefix="aiokv-bench-ssd-") if owned else args.dir)
    work = base / "aiokv-bench-ssd"
    work.mkdir(mode=0o700, exist_ok=True)
    try:
        device = common.pick_device(args.device)  # cuda without one: a message
        caches = [
            torch.randn(USER_PAGES, 2, PAGE, HEADS, DIM, device=device).to(torch.bfloat16)
            for _ in range(LAYERS)
        ]
        block = BLOCK
        users = max(1, int(gb * (1 << 30) // (USER_PAGES * block)))
        plains, stores = [], []
        for _ in range(max(1, args.rounds)):  # alternated: both see the same disk weather
            plains.append(_plain_round(work, users * USER_PAGES * block))
            stores.append(_store_round(work, caches, host_gb, gb, users))
            shutil.rmtree(work / "aiokv-ssd", ignore_errors=True)
        plain = {key: min(p[key] for p in plains) for key in plains[0]}
        store = {key: min(s[key] for s in stores) for key in stores[0]}
        checksum = _checksum_gbps()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if owned:
            shutil.rmtree(base, ignore_errors=True)
    gib = store["volume"] / (1 << 30)
    rows = {
        "plain_write_gibps": gib / plain["write_s"],
        "store_write_gibps": gib / store["write_s"],
        "plain_read_gibps": gib / plain["read_s"],
        "store_read_gibps": gib / store["read_s"],
        "xxh3_gibps": checksum,
    }
    print(f"aiokv bench ssd: {gib:.2f} GiB in {work.parent}, best of {len(plains)} rounds "
          f"(blocks of {block >> 10} KiB, host tier {host_gb:.2f} GiB, "
          f"{'O_DIRECT' if store['direct'] else 'buffered I/O + fdatasync'})")
    print(f"{'':28}{'GiB/s':>8}{'store/plain':>13}")
    print(f"{'plain write + fsync':28}{rows['plain_write_gibps']:8.2f}")
    print(f"{'store SSD write':28}{rows['store_write_gibps']:8.2f}"
          f"{rows['store_write_gibps'] / rows['plain_write_gibps']:12.0%}")
    print(f"{'plain read':28}{rows['plain_read_gibps']:8.2f}")
    print(f"{'store SSD read (to ' + device.type + ')':28}{rows['store_read_gibps']:8.2f}"
          f"{rows['store_read_gibps'] / rows['plain_read_gibps']:12.0%}")
    print(f"{'xxh3-64 checksum, 1 core':28}{checksum:8.2f}"
          f"{checksum / max(rows['plain_write_gibps'], rows['plain_read_gibps']):11.1f}x disk")
    print(f"reopen (header scan): {store['open_s'] * 1000:.0f} ms")
    if args.json:  # with what the header says: the ratios read differently per I/O mode
        environment = {**common.environment(device),
                       "bench_argv": list(getattr(args, "bench_argv", None) or sys.argv[1:])}
        settings = {"gib": gib, "host_gb": host_gb, "rounds": len(plains),
                    "block_bytes": block, "dir": str(work.parent), "direct": bool(store["direct"])}
        Path(args.json).write_text(json.dumps(
            {"bench": NAME, "environment": environment, "settings": settings, "gib": gib,
             **rows, "open_s": store["open_s"]}, indent=1, default=str))
    if args.plot:
        _plot(args.plot, rows, gib, device)
    return 0


def _plot(path: str, rows: dict[str, float], gib: float, device: torch.device) -> None:
    kinds = ["write", "read"]

    def draw(axes: Any) -> None:
        x = np.arange(len(kinds))
        axes.bar(x - 0.2, [rows[f"plain_{k}_gibps"] for k in kinds], 0.4, label="plain file I/O")
        axes.bar(x + 0.2, [rows[f"store_{k}_gibps"] for k in kinds], 0.4, label="store SSD tier")
        axes.set_xticks(x, ["write", f"read (to {device.type})"])
        axes.set_ylabel("GiB/s")
        axes.legend()

    common.save_plot(path, f"aiokv SSD tier vs plain I/O, {gib:.2f} GiB", draw)


__all__ = ["HELP", "NAME", "add_arguments", "run"]
