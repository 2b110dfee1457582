"""The remote tier's I/O: one Mooncake Store client (:mod:`.connection`), a writer
thread behind a bounded queue (:mod:`.writer`), a reader thread whose answers the
store thread waits for only so long: lookups' reads, and invalidations' markers
(:mod:`.markers`), and a thread for the removals that follow the markers, which nobody
waits for (:mod:`.removals`).

Nothing here touches the host tier's bookkeeping: the store thread (:mod:`.link`) hands
over host block numbers it holds, and gets them back through the queue's ``finished``.
The host pool's memory is registered with Mooncake; :mod:`.values` moves the values (the
block, then its checksum) in and out of it, one :class:`~.values.Values` per thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

from ..exiting import stop_at_exit
from .caller import CallThread
from .checksums import Checksums
from .config import RemoteConfig
from .connection import ABSENT, NOT_READY, Closed, Connection
from .keys import Keys, leading_ones
from .markers import Markers
from .queue import WriteQueue
from .removals import Remover
from .values import Layout, Values
from .writer import Writer

log = logging.getLogger("aiokv")

# Close finishes queued writes for this long at most, while Mooncake answers each batch
# within timeout_ms (a master that does not answer ends the flush after timeout_ms).
_FLUSH_S = 10.0
_CHECK_S = 1.0  # an idle tier asks for the boot id and the epoch this often


class RemoteIO:
    """Mooncake calls for one store. ``layout``: where the host pool's blocks are, each
    with room for its checksum after it (:mod:`aiokv.stores.local.layout`); ``view(b)``
    block ``b``'s bytes.
    ``wake`` is called (from the tier's threads) when blocks can be given back;
    ``learned`` with each master's boot id (:class:`.markers.Markers`)."""

    def __init__(
        self,
        config: RemoteConfig,
        keys: Keys,
        layout: Layout,
        view: Callable[[int], memoryview],
        wake: Callable[[], None],
        learned: Callable[[str, int, bool], None] | None = None,
    ) -> None:
        self.config = config
        self.keys = keys
        self.layout = layout
        self.block_bytes = block_bytes = layout.block_bytes
        self.connection = Connection(config, self._buffers)
        # The reader thread's counts, and where its time goes (the existence checks,
        # Mooncake's get, the checksums: remote_tier.py prints the split).
        self.read_stats: dict[str, float] = dict.fromkeys((
            "remote_checksum_failures", "remote_read_errors", "remote_exist_seconds",
            "remote_get_seconds", "remote_read_checksum_seconds"), 0)
        self.markers = Markers(keys, self.connection, self.read_stats, self._restarted,
                               learned)
        self._wake = wake
        self.dropped_at_restart = 0  # queued write blocks dropped when the master restarted
        self.queue = WriteQueue(config.write_queue_blocks)
        self._checksums = Checksums(view, block_bytes, config.threads_for_checksums)
        # The writer sums a batch while the batch before it is put, which takes longer:
        # on its own thread alone, it keeps up and leaves the summing threads (and the
        # GIL between their blocks) to the reads, which a lookup waits for.
        writer_sums = Checksums(view, block_bytes, 1)
        self._remover = Remover(self.connection, keys.either)
        self.remove_stats = self._remover.stats
        self._writer = Writer(self.queue, self.connection, self.markers, layout,
                              writer_sums, wake,
                              self._remover.submit)
        self.write_stats = self._writer.stats
        self._reads = Values(layout, self._checksums, self.read_stats,
                             ("remote_get_seconds", "remote_read_checksum_seconds"))
        # The call that publishes the markers not out yet, if it has not started (then
        # a new evict's marker goes with it).
        self._publishing: Future[bool] | None = None
        self._publishing_started = False
        self._publishing_lock = threading.Lock()
        # The reader thread's last read's or leading's views, per item: the (lifetime,
        # epoch, generation) its keys were of (:meth:`viewed`).
        self.views: list[tuple[int, int, int] | None] = []
        self._reader = CallThread("aiokv-remote-read", self._tend)
        self._writer.thread.start()
        # Connect (and learn where the markers stand) now, so the first lookup need not.
        self._reader.submit(self._check)
        stop_at_exit(self)

    def resting(self) -> bool:
        return self.connection.resting()

    def expect(self, ns: str) -> None:
        """A put of the namespace started: its markers are asked for before it is offered,
        where they were not lately (the writer's, :meth:`.writer.Writer.expect`)."""
        self._writer.expect(ns)

    def failed(self, what: str, detail: object, call: Future[Any]) -> None:
        """The reader thread's ``call`` raised: counted (``remote_call_errors``), and the
        tier rests, once for the call."""
        self.connection.failed(what, detail, call)

    def timed_out(self, future: Future[Any]) -> bool:
        """A lookup or an evict gave up waiting for ``future``: whether to count a timeout.
        The call it waited for timed out: its own, or, not started yet, the call under
        way before it (a slow check, another lookup's read), which is counted once, also
        when it then fails (:meth:`.connection.Connection.timed_out`)."""
        return self.connection.timed_out(self._reader.waits_for(future))

    def client(self) -> Any:
        """The Mooncake client these calls use (None while not connected, and once
        closed): for a benchmark's raw calls side by side with the tier's."""
        return self.connection.ready()

    def _buffers(self) -> list[tuple[int, int]]:
        return [(self.layout.base, self.layout.size), *self._writer.values.buffers(),
                *self._reads.buffers()]

    # ---- reads (the reader thread; the store thread waits on the futures) -----------

    def submit_read(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._reader.submit(function, *args)

    def leading(self, items: Sequence[tuple[str, list[bytes]]]) -> list[list[str]]:
        """Per (namespace, digests): the keys of the leading blocks Mooncake has, under
        the newest epoch and generation (learned from the markers on the way); all in
        one ``batch_is_exist``. Empty lists where Mooncake cannot be asked. The views
        they were asked under: :attr:`views`."""
        client = self.connection.ready()
        began = time.monotonic()
        lifetime = self.keys.view("")[0]
        found = None if client is None else self.markers.past(client, items)
        if found is not None:
            self.views = self._views(found, lifetime)
        self.read_stats["remote_exist_seconds"] += time.monotonic() - began
        return found if found is not None else [[] for _ in items]

    def read(self, items: Sequence[tuple[str, list[bytes]]], blocks: list[int]) -> list[int]:
        """Per (namespace, digests), how many of its leading blocks arrived whole and
        passed their checksums, read into ``blocks`` (one per digest, item after item):
        the markers and the values in one get, no existence check first (an absent
        value answers for itself, as cheaply). The views they were read under:
        :attr:`views`."""
        client = self.connection.ready()
        if client is None:
            return [0] * len(items)
        lifetime = self.keys.view("")[0]

        def get(probes: list[str], asked: list[list[str]]) -> tuple[
                list[bool], tuple[list[int], list[bool]]] | None:
            markers, got, good = self._reads.get(
                client, [key for group in asked for key in group], blocks, probes)
            if not self.connection.codes("batch_get_into", markers + got):
                return None
            if any(code not in (1, ABSENT) for code in markers):
                # A marker not written whole yet (another host's evict publishing it, or
                # one whose host died mid-put) says neither that the evict is done nor
                # that it is not: a miss for now, not an error, and never the blocks it
                # may end (read as absent, an evict acknowledged later under the same
                # marker would not hide them).
                if any(code not in (1, ABSENT, NOT_READY) for code in markers) and (
                        self.connection.refused()):
                    self.read_stats["remote_read_errors"] += 1
                return None
            return [code == 1 for code in markers], (got, good)

        settled = self.markers.settle(client, items, get)
        if settled is None:
            return [0] * len(items)
        asked, (got, good) = settled
        self.views = self._views(asked, lifetime)
        return self._leading(got, good, [len(group) for group in asked])

    def viewed(self, views: list[tuple[int, int, int] | None], call: Callable[..., Any],
               *args: Any) -> Any:
        """The reader thread: ``call`` (:meth:`read`, :meth:`leading`), and ``views``
        filled with the views its items were asked under (none where it told none)."""
        self.views = []
        answer = call(*args)
        views[:] = self.views
        return answer

    def _views(self, asked: Sequence[Sequence[str]], lifetime: int
               ) -> list[tuple[int, int, int] | None]:
        """The views block keys were asked under (:meth:`.keys.Keys.views_of`); None for
        all of them where the master restarted meanwhile (the lifetime is not known)."""
        if self.keys.view("")[0] != lifetime:
            return [None] * len(asked)
        return self.keys.views_of(asked, lifetime)

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
        """Per range of ``counts`` values, how many leading ones are good; a value there
        (``got``: its bytes, or Mooncake's refusal of a value of the wrong length) that
        is not good was damaged, or not ours: counted. Absent, or not written whole yet
        (another host's put under way): a miss, not a damaged value."""
        self.read_stats["remote_checksum_failures"] += sum(
            n not in (ABSENT, NOT_READY) and not ok for n, ok in zip(got, good, strict=True))
        leading, at = [], 0
        for count in counts:
            leading.append(leading_ones([int(ok) for ok in good[at : at + count]]))
            at += count
        return leading

    # ---- invalidation (the reader thread) --------------------------------------------

    def publish(self) -> Future[bool]:
        """Publish the markers of the invalidations not out yet (:meth:`.keys.Keys.unpublish`)
        on the reader thread: the call's answer is whether all of them are out. One
        call for the evicts that come before it starts."""
        with self._publishing_lock:
            if self._publishing is None or self._publishing_started:
                self._publishing_started = False
                self._publishing = self._reader.submit(self._publish_call)
            return self._publishing

    def _publish_queued(self) -> bool:
        """A publish call waits its turn (after the call under way): the markers are its
        to publish. Published here first, a failure would be counted twice: once here,
        and once as the timeout of the evict that waits on that call behind it."""
        with self._publishing_lock:
            return self._publishing is not None and not self._publishing_started

    def _publish_call(self) -> bool:
        with self._publishing_lock:
            self._publishing_started = True
        return self._publish()

    def _publish(self) -> bool:
        """End what is current now of each namespace (and the epoch) with invalidations
        not out yet, but for those of an evict still waiting for its write (its own
        publish follows it); then remove what ended. Whether they all are out."""
        if not self.keys.publishable():
            return True
        client = self.connection.ready()
        # Where the markers stand first: after a restart of the master there is nothing
        # left to end (and a marker would end what was written since).
        if client is None or self.markers.past(client, []) is None:
            return False
        waiting = self.keys.publishable()
        patterns = []
        for ns, count in waiting.items():
            pattern = self.markers.end(client, ns)
            if pattern is None:
                # An answer (counted by the markers), not the master's absence.
                if not self.connection.resting():
                    self.connection.rest("publishing a marker", "refused")
                break
            self.keys.published(ns, count)
            patterns.append(pattern)
        # Best effort (the markers already hide them), and after the answer: only the
        # blocks of what ended, never those of what follows, written from now on. On a
        # thread of its own: the master scans every key it holds for it, which the next
        # marker and the lookups' reads must not queue behind.
        for pattern in patterns:
            self._remover.submit(pattern)  # closing: dropped, left to the LRU
        return len(patterns) == len(waiting)

    def _check(self) -> bool:
        """Ask for the boot id's key and the epoch's markers (no namespace's); whether
        Mooncake answered."""
        client = self.connection.ready()
        return client is not None and self.markers.past(client, []) is not None

    def _restarted(self, boot: str) -> None:
        """The master restarted, and every value with it: the writes queued before are
        of a view that ended (written now, they would land under epochs and generations
        that hosts reach again), and the evidence of evicts went too. Drop them; what
        was put under the old boot id late is removed (:meth:`.writer.Writer.restarted`)."""
        self._writer.restarted(boot)
        dropped = self.queue.cancel(None)
        # Not in the writer's counts: this may be the reader thread (one thread a restart).
        self.dropped_at_restart += sum(map(len, dropped))
        self.queue.give_back(dropped)
        log.warning("aiokv: remote tier: the Mooncake master restarted (its boot id is "
                    "gone): epochs and generations start again from 0")
        self._wake()

    def _tend(self) -> float | None:
        """The reader thread, between calls: publish the markers that could not be
        published earlier, once the tier no longer rests (and no publish call is
        queued: :meth:`_publish_queued`), and ask for the boot id's key and the epoch's
        markers when no call did for ``_CHECK_S`` (a master that restarted, a clear
        elsewhere); how long until it looks again (None: closing).

        Once close stops the thread the pass stops between its steps: close may give up
        on it in a step (a master that stopped answering), and the next one would call
        Mooncake, count its failure or wake the store after close returned."""
        reader = self._reader
        if self.connection.resting():
            return max(0.05, self.connection.rest_left_s())
        answered = True
        try:
            if self.keys.publishable() and not self._publish_queued():
                answered = self._publish()
            if reader.closing:
                return None
            if time.monotonic() - self.keys.checked_at >= _CHECK_S:
                answered = self._check() and answered
        except Closed:  # close returned while a step was under way: nothing more
            return None
        except Exception as exc:  # the client raised: a failed call, the tier rests
            self.connection.failed("a call", exc)
            answered = False
        if reader.closing:
            return None
        if not answered:
            # A failure counted with no lookup or write in sight: the store thread, idle,
            # would not ask for its figures again, and engine.stats() would not show it.
            self._wake()
        if self.connection.resting():
            return max(0.05, self.connection.rest_left_s())
        return max(0.05, self.keys.checked_at + _CHECK_S - time.monotonic())

    # ---- the interpreter's exit (aiokv.exiting) ----------------------------------------

    def stop_at_exit(self) -> None:
        """The interpreter exits with the engine never closed: its threads end after the
        Mooncake call they are in (a daemon thread still in one as the interpreter
        finalizes is unwound through Mooncake's C++ frames: std::terminate). The writes
        queued are dropped and the reads not started cancelled (the store thread sees a
        miss); nothing is flushed or published, and the client is left to the process's
        end, as the store is."""
        dropped = self.queue.cancel(None)
        self.queue.close()
        self.queue.give_back(dropped)
        self._reader.stop()
        self._remover.stop()

    def join_at_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._writer.thread.join(timeout)
        return (self._reader.join(max(0.0, deadline - time.monotonic()))
                and self._remover.join(max(0.0, deadline - time.monotonic()))
                and not self._writer.thread.is_alive())

    # ---- close ---------------------------------------------------------------------

    def close(self, flush: bool = True) -> bool:
        """Publish the markers not out yet, finish the queued writes (``flush``; else
        drop them at once), stop the threads, and let go of Mooncake. Each wait for
        Mooncake is ``timeout_ms`` at most, as a lookup's: the markers' call, a write
        batch in a call (queued writes go on while batches answer, ``_FLUSH_S`` at most),
        and the threads' calls under way. A thread still in a call then (a master that
        stopped answering) is left to end by itself (daemon threads); the client and the
        memory it reads into stay, and False is returned. What close gives up on is
        counted (``remote_invalidations_waiting``, ``remote_dropped_down``) and logged."""
        timeout_s = self.config.timeout_ms / 1000
        queue = self.queue
        if flush and self.keys.unpublished():
            # One call, as an evict's: a tier that rests past it does not answer now.
            rest = self.connection.rest_left_s()
            if rest < timeout_s:
                time.sleep(rest)
                futures_wait([self.publish()], timeout_s - rest)
        deadline = time.monotonic() + (_FLUSH_S if flush else 0.0)
        while not queue.wait_idle(min(0.1, timeout_s, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or self._writer.in_call_s() > timeout_s:
                break
        dropped = queue.cancel(None)
        dropped_blocks = sum(map(len, dropped))
        self._writer.count("remote_dropped_down", dropped_blocks)
        queue.close()
        deadline = time.monotonic() + timeout_s
        self._writer.thread.join(timeout_s)
        queue.give_back(dropped)
        # The removals not started are dropped: the LRU takes what they would have.
        self._remover.stop()
        stopped = (self._reader.close(max(0.0, deadline - time.monotonic()))
                   and self._remover.join(max(0.0, deadline - time.monotonic()))
                   and not self._writer.thread.is_alive())
        # A thread left in a call goes on once it returns: from here on it calls Mooncake
        # no more, and what it meets is not counted (close's figures are final); the
        # write blocks it has in hand are counted dropped now, as the queued ones were.
        abandoned_blocks = self._writer.give_up()
        self.connection.stop()
        waiting = sum(self.keys.unpublished().values())
        if waiting:
            log.warning("aiokv: remote tier: %d evicts or clears closed with their markers "
                        "unpublished: other hosts serve those keys until they age out", waiting)
        if dropped_blocks:
            log.warning("aiokv: remote tier: close dropped %d queued write blocks (Mooncake "
                        "did not take them in time)", dropped_blocks)
        if not stopped:
            log.warning("aiokv: remote tier: Mooncake did not answer within %d ms of close; "
                        "its calls under way are left to end by themselves (%d write "
                        "blocks in them counted dropped)", self.config.timeout_ms,
                        abandoned_blocks)
            return False
        self._checksums.close()
        self.connection.close()
        return True
