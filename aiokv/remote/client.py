"""The remote tier's I/O: one Mooncake Store client, a writer thread behind a bounded
queue, and a reader thread whose answers the store thread waits for only so long.

Nothing here touches the host tier's bookkeeping: the store thread (:mod:`.link`) hands
over host block numbers it holds, and gets them back through :meth:`RemoteIO.finished`.
The host pool's memory is registered with Mooncake; :mod:`.values` moves the values (the
block, then its checksum) in and out of it, one :class:`~.values.Values` per thread.

Connecting (``setup``) happens on the first call, not at open, so a master that is down
at start costs nothing but misses. A call that fails for want of the master (or raises)
puts the tier to rest for a while, doubling from ``timeout_ms`` to 30 s: while it rests
lookups miss and writes are dropped at once, without a call. The client reconnects to a
master that comes back by itself; the rest only keeps a dead master from costing every
lookup its full wait.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .checksums import Checksums
from .config import RemoteConfig
from .keys import PROBE, Keys, leading_ones
from .native import import_store
from .queue import WriteJob, WriteQueue
from .values import Values

log = logging.getLogger("aiokv")

NO_SPACE = -200  # Mooncake: no segment can take the value now
_ABSENT = -704  # OBJECT_NOT_FOUND
_DOWN = -900  # this code and below: the master or the transport failed (RPC_FAIL, ...)
_MAX_REST_S = 30.0
_CONNECT_WAIT_S = 10.0
_WRITE_BATCH = 64  # blocks per batch_put call
_MARKERS_FRESH_S = 1.0  # how long the writer trusts what it learned of the markers


def _local_hostname(config: RemoteConfig) -> str:
    if config.local_hostname:
        return config.local_hostname
    if config.on_loopback():
        return "127.0.0.1"
    # The address this host would use towards the master (a UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((config.master_host, 9))
        return str(probe.getsockname()[0])


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
        self._wake = wake
        self._client: Any = None
        self._connect_lock = threading.Lock()
        self._rest_s = config.timeout_ms / 1000
        self._retry_at = 0.0  # time.monotonic() before which calls are not tried
        # One writer each: counts of the writer thread and of the reader thread, and
        # where their time goes (the marker and existence checks, Mooncake's put and
        # get, the checksums: remote_tier.py prints the split).
        self.write_stats: dict[str, float] = dict.fromkeys((
            "remote_blocks_written", "remote_bytes_written", "remote_dropped_full",
            "remote_dropped_down", "remote_dropped_evicted", "remote_write_errors",
            "remote_write_batches",
            "remote_write_seconds", "remote_marker_seconds", "remote_write_checksum_seconds",
            "remote_put_seconds"), 0)
        self.read_stats: dict[str, float] = dict.fromkeys((
            "remote_checksum_failures", "remote_read_errors", "remote_exist_seconds",
            "remote_get_seconds", "remote_read_checksum_seconds"), 0)
        self.queue = WriteQueue(config.write_queue_blocks)
        # Writer thread: namespace -> when its markers need asking again before a write.
        self._checked: dict[str, float] = {}
        self._writer = threading.Thread(target=self._write_loop, name="aiokv-remote-write",
                                        daemon=True)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="aiokv-remote-read")
        self._checksums = Checksums(view, block_bytes, config.threads_for_checksums)
        self._writes, self._reads = (
            Values(self._base, block_bytes, num_blocks, self._checksums, stats, keys)
            for stats, keys in ((self.write_stats, ("remote_put_seconds",
                                                    "remote_write_checksum_seconds")),
                                (self.read_stats, ("remote_get_seconds",
                                                   "remote_read_checksum_seconds"))))
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
                for address, size in self._buffers():
                    rc = rc or client.register_buffer(address, size)
            if rc != 0:
                client.close()
                self.rest("setup", f"code {rc}")
                return None
        except (ImportError, RuntimeError, OSError) as exc:
            self.rest("setup", exc)
            return None
        self._succeeded()
        return client

    def _buffers(self) -> list[tuple[int, int]]:
        return [(self._base, self._size), *self._writes.buffers(), *self._reads.buffers()]

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

    def leading(self, items: Sequence[tuple[str, list[bytes]]]) -> list[list[str]]:
        """Per (namespace, digests): the keys of the leading blocks Mooncake has, under
        the newest epoch and generation (learned from the markers on the way); all in
        one ``batch_is_exist``. Empty lists where Mooncake cannot be asked."""
        client = self._ready()
        began = time.monotonic()
        found = None if client is None else self._past_markers(client, items)
        _spent(self.read_stats, "remote_exist_seconds", began)
        return found if found is not None else [[] for _ in items]

    def _past_markers(
        self, client: Any, items: Sequence[tuple[str, list[bytes]]]
    ) -> list[list[str]] | None:
        """Ask for the markers past what this host knows of the epoch and of each
        namespace's generation, and for the items' blocks, in one call; move past the
        markers found and ask again (rarely). Per item, its leading present keys; None
        when Mooncake did not answer."""
        for _ in range(8):  # each pass moves past at least one marker
            probes, asked, advance = self.keys.ask(items)
            found = client.batch_is_exist(probes + [key for group in asked for key in group])
            if not self._codes("batch_is_exist", found):
                return None
            if any(code < 0 for code in found):
                self.read_stats["remote_read_errors"] += 1
                return None
            if advance(found[: len(probes)]):
                continue
            answers, at = [], len(probes)
            for group in asked:
                answers.append(group[: leading_ones(found[at : at + len(group)])])
                at += len(group)
            return answers
        return None

    def read(self, items: Sequence[tuple[str, list[bytes]]], blocks: list[int]) -> list[int]:
        """Per (namespace, digests), how many of its leading blocks arrived whole and
        passed their checksums, read into ``blocks`` (one per digest, item after item):
        the markers and the values in one get, no existence check first (an absent
        value answers for itself, as cheaply)."""
        client = self._ready()
        if client is None:
            return [0] * len(items)
        for _ in range(8):  # each pass moves past at least one marker
            probes, asked, advance = self.keys.ask(items)
            markers, got, good = self._reads.get(
                client, [key for group in asked for key in group], blocks, probes)
            if not self._codes("batch_get_into", markers + got):
                break
            if any(code not in (1, _ABSENT) for code in markers):
                self.read_stats["remote_read_errors"] += 1
                break
            if not advance([int(code == 1) for code in markers]):
                return self._leading(got, good, [len(group) for group in asked])
        return [0] * len(items)

    def fetch(self, block_keys: list[str], blocks: list[int], counts: list[int]) -> list[int]:
        """Read the values into these host blocks, ``counts`` of them per range; per
        range, how many leading ones arrived whole and passed their checksums."""
        client = self._ready()
        if client is None:
            return [0] * len(counts)
        _, got, good = self._reads.get(client, block_keys, blocks)
        if not self._codes("batch_get_into", got):
            return [0] * len(counts)
        return self._leading(got, good, counts)

    def _leading(self, got: list[int], good: list[bool], counts: list[int]) -> list[int]:
        """Per range of ``counts`` values, how many leading ones are good; a value that
        arrived (``got``: bytes) and is not good was damaged, or not ours: counted."""
        self.read_stats["remote_checksum_failures"] += sum(
            n >= 0 and not ok for n, ok in zip(got, good, strict=True))
        leading, at = [], 0
        for count in counts:
            leading.append(leading_ones([int(ok) for ok in good[at : at + count]]))
            at += count
        return leading

    def invalidate(self, ns: str | None, epoch: int, generation: int) -> bool:
        """End the epoch (``ns`` None) or the namespace's generation that is current now:
        this host knew ``epoch`` / ``generation``, but other hosts may have ended those
        since, so the first one whose marker is absent is found first; then publish its
        marker and remove its blocks. Whether the marker is in Mooncake."""
        client = self._ready()
        if client is None:
            return False
        keys = self.keys
        marker_of: Callable[[int], str] = (
            keys.cleared if ns is None else lambda g: keys.evicted(ns, g))
        current = self._first_absent(client, marker_of, epoch if ns is None else generation)
        if current is None:
            return False
        config = import_store().ReplicateConfig()
        config.with_hard_pin = True  # a marker must outlive the LRU
        # Another host may publish it meanwhile: a put keeps the first value (code 0),
        # and both meant to end what was current when they began.
        rc = int(client.put(marker_of(current), b"1", config))
        if not self._codes("put", [rc]) or rc != 0:
            return False
        if ns is None:
            keys.advance("", current + 1, 0)
            pattern = keys.epoch_pattern(current)
        else:
            keys.advance(ns, 0, current + 1)
            pattern = keys.generation_pattern(ns, current)
        # Best effort (the marker already hides them), and after the answer: only the
        # blocks of what ended, never those of the next one, written from now on.
        with contextlib.suppress(RuntimeError):  # closing: left to the LRU
            self._reader.submit(self._remove, pattern)
        return True

    def _remove(self, pattern: str) -> None:
        client = self._ready()
        if client is not None:
            client.remove_by_regex(pattern, True)

    def _first_absent(self, client: Any, marker_of: Callable[[int], str],
                      start: int) -> int | None:
        """The first epoch or generation from ``start`` on whose marker (``marker_of``)
        Mooncake lacks: the current one; None when Mooncake did not answer."""
        count = PROBE
        while True:
            found = client.batch_is_exist([marker_of(start + i) for i in range(count)])
            if not self._codes("batch_is_exist", found) or any(code < 0 for code in found):
                return None
            present = leading_ones(found)
            if present < count:
                return start + present
            start, count = start + count, count * 2  # far behind: larger steps

    def _refresh(self, client: Any, namespaces: set[str]) -> bool:
        """Move past the markers of these namespaces (and of the epoch) that other hosts
        published, so that a write never lands under a key already invalidated (a new
        host would otherwise write under epoch 0 after a clear); whether Mooncake
        answered."""
        if self._past_markers(client, [(ns, []) for ns in namespaces]) is None:
            return False
        # A marker published meanwhile costs at most this long of writes nobody reads.
        until = time.monotonic() + _MARKERS_FRESH_S
        if len(self._checked) > 65536:
            self._checked.clear()
        self._checked.update(dict.fromkeys(namespaces, until))
        return True

    # ---- writes --------------------------------------------------------------------

    def _write_loop(self) -> None:
        queue = self.queue
        while (jobs := queue.next_batch(_WRITE_BATCH)) is not None:
            began = time.monotonic()
            try:
                self._write(jobs)
            except Exception as exc:  # a bug or the client's: count it, keep the thread
                self.write_stats["remote_write_errors"] += sum(len(j.blocks) for j in jobs)
                log.exception("aiokv: remote tier: a write failed: %s", exc)
            finally:
                self.write_stats["remote_write_batches"] += 1
                self.write_stats["remote_write_seconds"] += time.monotonic() - began
                queue.done(jobs)
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
        refreshed = not stale or self._refresh(client, stale)
        _spent(stats, "remote_marker_seconds", now)
        if not refreshed:
            stats["remote_dropped_down"] += count
            return
        keys: list[str] = []
        blocks: list[int] = []
        for job in jobs:
            if self.keys.current(job.ns) != (job.epoch, job.generation):
                # Evicted (here, or on another host: the markers just asked) since the
                # put was offered: its keys are hidden already, writing them is waste.
                stats["remote_dropped_evicted"] += len(job.blocks)
                count -= len(job.blocks)
                continue
            keys += self.keys.blocks(job.ns, job.epoch, job.generation, job.digests)
            blocks += job.blocks.tolist()
        if not keys:
            return
        size = self.block_bytes
        codes = self._writes.put(client, keys, blocks)
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
        queue = self.queue
        queue.wait_idle(flush_timeout_s)
        dropped = queue.cancel(None)
        self.write_stats["remote_dropped_down"] += sum(map(len, dropped))
        queue.close()
        self._writer.join()
        queue.done([WriteJob("", [], blocks) for blocks in dropped])  # to be given back
        self._reader.shutdown(wait=True)
        self._checksums.close()
        client, self._client = self._client, None
        if client is not None:
            for address, _ in self._buffers():
                client.unregister_buffer(address)
            client.close()


def _spent(stats: dict[str, float], key: str, began: float) -> float:
    """Add the time since ``began`` (time.monotonic) to ``stats[key]``; now."""
    now = time.monotonic()
    stats[key] += now - began
    return now


