"""The remote tier's I/O: one Mooncake Store client, a writer thread behind a bounded
queue, and a reader thread whose answers the store thread waits for only so long.

Nothing here touches the host tier's bookkeeping: the store thread (:mod:`.link`) hands
over host block numbers it holds, and gets them back through :meth:`RemoteIO.finished`.
Values are zero-copy: the host pool's memory and a table of per-block checksums are
registered with Mooncake, and a value is two pieces, the block's bytes and its 8-byte
xxh3-64 checksum (of the key and the bytes, so a value under the wrong key fails too).

Connecting (``setup``) happens on the first call, not at open, so a master that is down
at start costs nothing but misses. A call that fails for want of the master (or raises)
puts the tier to rest for a while, doubling from ``timeout_ms`` to 30 s: while it rests
lookups miss and writes are dropped at once, without a call. The client reconnects to a
master that comes back by itself; the rest only keeps a dead master from costing every
lookup its full wait.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..stores.base import Int64Array
from .config import RemoteConfig
from .keys import PROBE, Keys
from .native import import_store

log = logging.getLogger("aiokv")

NO_SPACE = -200  # Mooncake: no segment can take the value now
_DOWN = -900  # this code and below: the master or the transport failed (RPC_FAIL, ...)
_MAX_REST_S = 30.0
_CONNECT_WAIT_S = 10.0
_WRITE_BATCH = 64  # blocks per batch_put call
_MARKERS_FRESH_S = 1.0  # how long the writer trusts what it learned of the markers
CHECKSUM_BYTES = 8


def _local_hostname(config: RemoteConfig) -> str:
    if config.local_hostname:
        return config.local_hostname
    if config.on_loopback():
        return "127.0.0.1"
    # The address this host would use towards the master (a UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((config.master_host, 9))
        return str(probe.getsockname()[0])


@dataclass(slots=True)
class WriteJob:
    ns: str
    digests: list[bytes]
    blocks: Int64Array


class RemoteIO:
    """Mooncake calls for one store. ``memory``: the host pool as one buffer (its address,
    its size); block ``b`` is at ``address + b * block_bytes``; ``view(b)`` its bytes.
    ``wake`` is called (from the writer thread) when written blocks can be given back."""

    def __init__(
        self,
        config: RemoteConfig,
        keys: Keys,
        memory: tuple[int, int],
        block_bytes: int,
        num_blocks: int,
        view: Callable[[int], memoryview],
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.keys = keys
        self._base, self._size = memory
        self.block_bytes = block_bytes
        self._view = view
        self._wake = wake
        self._sums = np.zeros(num_blocks, dtype=np.uint64)  # per host block, registered
        self._sums_base = self._sums.ctypes.data
        self._client: Any = None
        self._connect_lock = threading.Lock()
        self._rest_s = config.timeout_ms / 1000
        self._retry_at = 0.0  # time.monotonic() before which calls are not tried
        # One writer each: counts of the writer thread and of the reader thread.
        self.write_stats = {"remote_blocks_written": 0, "remote_bytes_written": 0,
                            "remote_dropped_full": 0, "remote_dropped_down": 0,
                            "remote_write_errors": 0, "remote_write_seconds": 0.0}
        self.read_stats = {"remote_checksum_failures": 0, "remote_read_errors": 0}
        self._queue: deque[WriteJob] = deque()
        self._queued = 0  # blocks in _queue
        self._writing = False
        self._cond = threading.Condition()
        self._closed = False
        self._finished: deque[Int64Array] = deque()  # written (or dropped): to give back
        # Writer thread: namespace -> when its markers need asking again before a write.
        self._checked: dict[str, float] = {}
        self._writer = threading.Thread(target=self._write_loop, name="aiokv-remote-write",
                                        daemon=True)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="aiokv-remote-read")
        self._writer.start()
        self._reader.submit(self._ready)  # connect now, so the first lookup need not wait

    # ---- connection ----------------------------------------------------------------

    def resting(self) -> bool:
        return time.monotonic() < self._retry_at

    def rest(self, what: str, detail: object) -> None:
        if not self.resting():
            log.warning("aiokv: remote tier: %s failed (%s); resting %.1f s",
                        what, detail, self._rest_s)
        self._retry_at = time.monotonic() + self._rest_s
        self._rest_s = min(_MAX_REST_S, self._rest_s * 2)

    def _succeeded(self) -> None:
        self._rest_s = self.config.timeout_ms / 1000

    def client(self) -> Any:
        """The Mooncake client these calls use (None while not connected): for a
        benchmark's raw calls side by side with the tier's."""
        return self._ready()

    def _ready(self) -> Any:
        """The set-up client, or None (resting, or setup failed now)."""
        if self._client is not None:
            return self._client
        # Another thread may be connecting: wait for it (a connect is bounded by the
        # probe below, but Mooncake's own setup is not: do not wait for ever).
        if self.resting() or not self._connect_lock.acquire(timeout=_CONNECT_WAIT_S):
            return None
        try:
            if self._client is None:
                self._client = self._connect()
        finally:
            self._connect_lock.release()
        return self._client

    def _connect(self) -> Any:
        config = self.config
        try:
            # Mooncake's setup retries an absent master for 90 s; a plain TCP connect
            # says within the timeout whether one listens.
            socket.create_connection(config.master_address, config.timeout_ms / 1000).close()
            client = import_store().MooncakeDistributedStore()
            rc = client.setup(
                _local_hostname(config), config.metadata, 0, config.local_buffer_mb << 20,
                config.protocol, config.devices, config.master,
            )
            if rc == 0:
                rc = client.register_buffer(self._base, self._size) or client.register_buffer(
                    self._sums_base, self._sums.nbytes
                )
            if rc != 0:
                client.close()
                self.rest("setup", f"code {rc}")
                return None
        except (ImportError, RuntimeError, OSError) as exc:
            self.rest("setup", exc)
            return None
        self._succeeded()
        return client

    def _codes(self, what: str, codes: Sequence[int]) -> bool:
        """Whether a batch call reached Mooncake (else the tier rests)."""
        if any(code <= _DOWN for code in codes):
            self.rest(what, f"code {min(codes)}")
            return False
        self._succeeded()
        return True

    # ---- reads (the reader thread; the store thread waits on the futures) -----------

    def submit_read(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._reader.submit(function, *args)

    def leading(self, ns: str, digests: list[bytes]) -> list[str]:
        """Keys of the leading blocks Mooncake has for these digests, under the newest
        epoch and generation of the namespace (learned from the markers on the way)."""
        client = self._ready()
        if client is None:
            return []
        keys = self.keys
        for _ in range(8):  # each pass moves past at least one marker
            epoch, generation = keys.current(ns)
            block_keys = keys.blocks(ns, epoch, generation, digests)
            found = client.batch_is_exist(keys.probes(ns, epoch, generation) + block_keys)
            if not self._codes("batch_is_exist", found):
                return []
            if any(code < 0 for code in found):
                self.read_stats["remote_read_errors"] += 1
                return []
            cleared = _leading_ones(found[:PROBE])
            evicted = _leading_ones(found[PROBE : 2 * PROBE])
            if cleared or evicted:
                keys.advance(ns, epoch + cleared, generation + evicted)
                continue
            return block_keys[: _leading_ones(found[2 * PROBE :])]
        return []

    def fetch(self, block_keys: list[str], blocks: list[int]) -> int:
        """Read the values into these host blocks; how many leading ones arrived whole and
        passed their checksum."""
        client = self._ready()
        if client is None:
            return 0
        size, sums = self.block_bytes, self._sums_base
        got = client.batch_get_into_multi_buffers(
            block_keys,
            [[self._base + b * size, sums + b * CHECKSUM_BYTES] for b in blocks],
            [[size, CHECKSUM_BYTES]] * len(blocks),
        )
        if not self._codes("batch_get_into", got):
            return 0
        whole = size + CHECKSUM_BYTES
        for i, (key, block, count) in enumerate(zip(block_keys, blocks, got, strict=True)):
            if count != whole:
                if count >= 0:  # the wrong size: not ours
                    self.read_stats["remote_checksum_failures"] += 1
                return i
            if self._checksum(key, block) != int(self._sums[block]):
                self.read_stats["remote_checksum_failures"] += 1
                return i
        return len(blocks)

    def invalidate(self, ns: str | None, epoch: int, generation: int) -> bool:
        """Publish the marker of the epoch (``ns`` None) or the namespace's generation that
        ended, then remove its blocks; whether the marker is in Mooncake."""
        client = self._ready()
        if client is None:
            return False
        keys = self.keys
        marker = keys.cleared(epoch) if ns is None else keys.evicted(ns, generation)
        config = import_store().ReplicateConfig()
        config.with_hard_pin = True  # a marker must outlive the LRU
        rc = int(client.put(marker, b"1", config))
        if not self._codes("put", [rc]):
            return False
        pattern = keys.all_pattern() if ns is None else keys.namespace_pattern(ns)
        client.remove_by_regex(pattern, True)  # best effort: the marker already hides them
        return rc == 0

    def _refresh(self, client: Any, namespaces: set[str]) -> bool:
        """Move past the markers of these namespaces (and of the epoch) that other hosts
        published, so that a write never lands under a key already invalidated (a new
        host would otherwise write under epoch 0 after a clear); whether Mooncake
        answered."""
        keys, names = self.keys, sorted(namespaces)
        for _ in range(8):
            current = [keys.current(ns) for ns in names]
            epoch = current[0][0]
            probes = [keys.cleared(epoch + i) for i in range(PROBE)]
            for ns, (_, generation) in zip(names, current, strict=True):
                probes += [keys.evicted(ns, generation + i) for i in range(PROBE)]
            found = client.batch_is_exist(probes)
            if not self._codes("batch_is_exist", found):
                return False
            cleared = _leading_ones(found[:PROBE])
            moved = bool(cleared)
            for i, (ns, (_, generation)) in enumerate(zip(names, current, strict=True)):
                evicted = _leading_ones(found[PROBE * (i + 1) : PROBE * (i + 2)])
                keys.advance(ns, epoch + cleared, generation + evicted)
                moved = moved or bool(evicted)
            if not moved:
                break
        # A marker published meanwhile costs at most this long of writes nobody reads.
        until = time.monotonic() + _MARKERS_FRESH_S
        if len(self._checked) > 65536:
            self._checked.clear()
        self._checked.update(dict.fromkeys(names, until))
        return True

    def _checksum(self, key: str, block: int) -> int:
        digest = xxhash.xxh3_64(key.encode())
        digest.update(self._view(block))
        return digest.intdigest()

    # ---- writes --------------------------------------------------------------------

    def submit_write(self, job: WriteJob) -> bool:
        """Queue a write; False (nothing queued) when the queue is full or closed."""
        with self._cond:
            if self._closed or self._queued + len(job.blocks) > self.config.write_queue_blocks:
                return False
            self._queue.append(job)
            self._queued += len(job.blocks)
            self._cond.notify()
        return True

    def cancel_writes(self, ns: str | None) -> list[Int64Array]:
        """Take the queued writes of a namespace (None: all) back; their blocks."""
        with self._cond:
            kept = deque(j for j in self._queue if ns is not None and j.ns != ns)
            taken = [j.blocks for j in self._queue if ns is None or j.ns == ns]
            self._queue = kept
            self._queued = sum(len(j.blocks) for j in kept)
        return taken

    def wait_writes(self, timeout_s: float) -> bool:
        """Block until the writer is idle with nothing queued (or the timeout)."""
        with self._cond:
            return bool(self._cond.wait_for(lambda: not self._queue and not self._writing,
                                            timeout_s))

    @property
    def queued_blocks(self) -> int:
        return self._queued

    def finished(self) -> list[Int64Array]:
        """Blocks whose writes ended (written or dropped), each given once."""
        done = self._finished
        return [done.popleft() for _ in range(len(done))]

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                jobs: list[WriteJob] = []
                count = 0
                while self._queue and count < _WRITE_BATCH:
                    jobs.append(self._queue.popleft())
                    count += len(jobs[-1].blocks)
                self._queued -= count
                self._writing = True
            began = time.monotonic()
            try:
                self._write(jobs)
            except Exception as exc:  # a bug or the client's: count it, keep the thread
                self.write_stats["remote_write_errors"] += count
                log.exception("aiokv: remote tier: a write failed: %s", exc)
            finally:
                self.write_stats["remote_write_seconds"] += time.monotonic() - began
                self._finished.extend(job.blocks for job in jobs)
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()
                self._wake()

    def _write(self, jobs: list[WriteJob]) -> None:
        stats = self.write_stats
        count = sum(len(job.blocks) for job in jobs)
        client = self._ready()
        if client is None:
            stats["remote_dropped_down"] += count
            return
        now = time.monotonic()
        stale = {job.ns for job in jobs if self._checked.get(job.ns, 0.0) < now}
        if stale and not self._refresh(client, stale):
            stats["remote_dropped_down"] += count
            return
        keys: list[str] = []
        blocks: list[int] = []
        for job in jobs:
            epoch, generation = self.keys.current(job.ns)
            keys += self.keys.blocks(job.ns, epoch, generation, job.digests)
            blocks += job.blocks.tolist()
        size, sums = self.block_bytes, self._sums
        for key, block in zip(keys, blocks, strict=True):
            sums[block] = self._checksum(key, block)
        codes = client.batch_put_from_multi_buffers(
            keys,
            [[self._base + b * size, self._sums_base + b * CHECKSUM_BYTES] for b in blocks],
            [[size, CHECKSUM_BYTES]] * len(blocks),
        )
        if not self._codes("batch_put_from", codes):
            stats["remote_dropped_down"] += count
            return
        written = codes.count(0)
        full = codes.count(NO_SPACE)
        stats["remote_blocks_written"] += written
        stats["remote_bytes_written"] += written * size
        stats["remote_dropped_full"] += full
        stats["remote_write_errors"] += len(codes) - written - full

    # ---- close ---------------------------------------------------------------------

    def close(self, flush_timeout_s: float) -> None:
        """Finish the queued writes (up to ``flush_timeout_s``; the rest are dropped),
        stop both threads, and let go of Mooncake."""
        self.wait_writes(flush_timeout_s)
        dropped = self.cancel_writes(None)
        self.write_stats["remote_dropped_down"] += sum(map(len, dropped))
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        self._reader.shutdown(wait=True)
        client, self._client = self._client, None
        if client is not None:
            client.unregister_buffer(self._base)
            client.unregister_buffer(self._sums_base)
            client.close()


def _leading_ones(codes: Sequence[int]) -> int:
    for i, code in enumerate(codes):
        if code != 1:
            return i
    return len(codes)
