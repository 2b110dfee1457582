"""The remote tier's removals: an evict's or clear's best-effort ``remove_by_regex`` of the
blocks its marker ended (and, after a restart of the master, of those under its old boot
id), on a thread of its own (``aiokv-remote-remove``).

Mooncake's master tries the pattern on every key it holds, and keeps one pinned marker per
evict for ever: a removal takes 16 ms at 10k keys, over 200 ms at 100k. On the reader
thread it held up the next evict's marker (and the store thread, which waits for it), and
every lookup's read behind it. Here nothing waits for it: the markers already hide those
blocks, and what is not removed ages out of Mooncake's LRU. So patterns queued together go
in one call (one scan for all of them), those past a bound are dropped (the oldest), and
close drops those not started: counted (``remote_removals_dropped``).

The client is the tier's one, as the writer's: Mooncake's calls release the GIL and go on
side by side from several threads, a lookup's while a removal scans.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence

from .connection import Closed, Connection

log = logging.getLogger("aiokv")

_MAX_QUEUED = 1024  # patterns waiting; past it the oldest is dropped
_PER_CALL = 32  # patterns in one call (a pattern of ~2 KB; one scan costs about 2 single ones)


class Remover:
    """``combine``: one pattern for any of several (:meth:`.keys.Keys.either`)."""

    def __init__(self, connection: Connection, combine: Callable[[Sequence[str]], str]) -> None:
        self._connection = connection
        self._combine = combine
        self.stats = {"remote_removals_dropped": 0, "remote_remove_errors": 0}
        self._queued: dict[str, None] = {}  # in order; a pattern queued twice is one removal
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="aiokv-remote-remove",
                                        daemon=True)
        self._thread.start()

    def submit(self, pattern: str) -> None:
        with self._changed:
            if self._closed:
                self.stats["remote_removals_dropped"] += 1
                return
            self._queued[pattern] = None
            if len(self._queued) > _MAX_QUEUED:
                del self._queued[next(iter(self._queued))]
                self.stats["remote_removals_dropped"] += 1
            self._changed.notify()

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._queued and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                patterns = list(itertools.islice(self._queued, _PER_CALL))
                for pattern in patterns:
                    del self._queued[pattern]
            try:
                made = self._remove(patterns)
            except Closed:  # close returned while it was in the call: figures are final
                return
            except Exception as exc:  # the client's or a bug: keep the thread
                log.warning("aiokv: remote tier: a removal failed: %r", exc)
                made = False
                with self._changed:
                    self.stats["remote_remove_errors"] += 1
            if not made:
                with self._changed:
                    self.stats["remote_removals_dropped"] += len(patterns)

    def _remove(self, patterns: list[str]) -> bool:
        """Remove what any of the patterns matches; whether Mooncake did. Not tried while
        the tier rests (its first call would wait out a master that does not answer)."""
        connection = self._connection
        client = connection.ready()
        if client is None:
            return False
        removed = int(client.remove_by_regex(self._combine(patterns), True))
        if not connection.codes("remove_by_regex", [removed]):
            return False
        if removed < 0:
            if connection.refused():
                with self._changed:
                    self.stats["remote_remove_errors"] += 1
            return False
        return True

    def stop(self) -> None:
        """Drop the removals not started (counted); the thread ends after the one under
        way. Returns at once."""
        with self._changed:
            if not self._closed:
                self._closed = True
                self.stats["remote_removals_dropped"] += len(self._queued)
                self._queued.clear()
            self._changed.notify()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
