"""The remote tier's I/O: one Mooncake Store client (:mod:`.connection`), a writer
thread behind a bounded queue (:mod:`.writer`), and a reader thread whose answers the
store thread waits for only so long: lookups' reads, and invalidations' markers
(:mod:`.markers`).

Nothing here touches the host tier's bookkeeping: the store thread (:mod:`.link`) hands
over host block numbers it holds, and gets them back through the queue's ``finished``.
The host pool's memory is registered with Mooncake; :mod:`.values` moves the values (the
block, then its checksum) in and out of it, one :class:`~.values.Values` per thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .checksums import Checksums
from .config import RemoteConfig
from .connection import ABSENT, Connection
from .keys import Keys, leading_ones
from .markers import Markers
from .queue import WriteJob, WriteQueue
from .values import Values
from .writer import Writer


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
        self.connection = Connection(config, self._buffers)
        # The reader thread's counts, and where its time goes (the existence checks,
        # Mooncake's get, the checksums: remote_tier.py prints the split).
        self.read_stats: dict[str, float] = dict.fromkeys((
            "remote_checksum_failures", "remote_read_errors", "remote_exist_seconds",
            "remote_get_seconds", "remote_read_checksum_seconds"), 0)
        self.markers = Markers(keys, self.connection, self.read_stats)
        self.queue = WriteQueue(config.write_queue_blocks)
        self._checksums = Checksums(view, block_bytes, config.threads_for_checksums)
        self._writer = Writer(self.queue, self.connection, self.markers,
                              (self._base, block_bytes, num_blocks), self._checksums, wake)
        self.write_stats = self._writer.stats
        self._reads = Values(self._base, block_bytes, num_blocks, self._checksums,
                             self.read_stats, ("remote_get_seconds",
                                               "remote_read_checksum_seconds"))
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="aiokv-remote-read")
        self._writer.thread.start()
        # Connect now, so the first lookup need not wait.
        self._reader.submit(self.connection.ready)

    def resting(self) -> bool:
        return self.connection.resting()

    def rest(self, what: str, detail: object) -> None:
        self.connection.rest(what, detail)

    def client(self) -> Any:
        """The Mooncake client these calls use (None while not connected): for a
        benchmark's raw calls side by side with the tier's."""
        return self.connection.ready()

    def _buffers(self) -> list[tuple[int, int]]:
        return [(self._base, self._size), *self._writer.values.buffers(),
                *self._reads.buffers()]

    # ---- reads (the reader thread; the store thread waits on the futures) -----------

    def submit_read(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._reader.submit(function, *args)

    def leading(self, items: Sequence[tuple[str, list[bytes]]]) -> list[list[str]]:
        """Per (namespace, digests): the keys of the leading blocks Mooncake has, under
        the newest epoch and generation (learned from the markers on the way); all in
        one ``batch_is_exist``. Empty lists where Mooncake cannot be asked."""
        client = self.connection.ready()
        began = time.monotonic()
        found = None if client is None else self.markers.past(client, items)
        self.read_stats["remote_exist_seconds"] += time.monotonic() - began
        return found if found is not None else [[] for _ in items]

    def read(self, items: Sequence[tuple[str, list[bytes]]], blocks: list[int]) -> list[int]:
        """Per (namespace, digests), how many of its leading blocks arrived whole and
        passed their checksums, read into ``blocks`` (one per digest, item after item):
        the markers and the values in one get, no existence check first (an absent
        value answers for itself, as cheaply)."""
        client = self.connection.ready()
        if client is None:
            return [0] * len(items)
        for _ in range(8):  # each pass moves past at least one marker
            probes, asked, advance = self.keys.ask(items)
            markers, got, good = self._reads.get(
                client, [key for group in asked for key in group], blocks, probes)
            if not self.connection.codes("batch_get_into", markers + got):
                break
            if any(code not in (1, ABSENT) for code in markers):
                self.read_stats["remote_read_errors"] += 1
                break
            if not advance([int(code == 1) for code in markers]):
                return self._leading(got, good, [len(group) for group in asked])
        return [0] * len(items)

    def fetch(self, block_keys: list[str], blocks: list[int], counts: list[int]) -> list[int]:
        """Read the values into these host blocks, ``counts`` of them per range; per
        range, how many leading ones arrived whole and passed their checksums."""
        client = self.connection.ready()
        if client is None:
            return [0] * len(counts)
        _, got, good = self._reads.get(client, block_keys, blocks)
        if not self.connection.codes("batch_get_into", got):
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

    # ---- invalidation (the reader thread) --------------------------------------------

    def invalidate(self, ns: str | None, epoch: int, generation: int) -> bool:
        """End the epoch (``ns`` None) or the namespace's generation that is current now
        (:meth:`.markers.Markers.end`), then remove its blocks; whether the marker is
        in Mooncake."""
        client = self.connection.ready()
        if client is None:
            return False
        pattern = self.markers.end(client, ns, epoch, generation)
        if pattern is None:
            return False
        # Best effort (the marker already hides them), and after the answer: only the
        # blocks of what ended, never those of the next one, written from now on.
        with contextlib.suppress(RuntimeError):  # closing: left to the LRU
            self._reader.submit(self._remove, pattern)
        return True

    def _remove(self, pattern: str) -> None:
        client = self.connection.ready()
        if client is not None:
            client.remove_by_regex(pattern, True)

    # ---- close ---------------------------------------------------------------------

    def close(self, flush_timeout_s: float) -> None:
        """Finish the queued writes (up to ``flush_timeout_s``; the rest are dropped),
        stop both threads, and let go of Mooncake."""
        queue = self.queue
        queue.wait_idle(flush_timeout_s)
        dropped = queue.cancel(None)
        self.write_stats["remote_dropped_down"] += sum(map(len, dropped))
        queue.close()
        self._writer.thread.join()
        queue.done([WriteJob("", [], blocks) for blocks in dropped])  # to be given back
        self._reader.shutdown(wait=True)
        self._checksums.close()
        self.connection.close()

