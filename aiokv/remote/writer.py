"""The remote tier's writer thread: it takes the queued writes a batch at a time, asks
for the markers of their namespaces first (at most once a second each), and puts the
values under the master's boot id, epoch and generation their put was offered under,
unless those ended meanwhile. Every job ends in :meth:`~.queue.WriteQueue.done`, written
or dropped (counted by reason), so that the store thread gives its host blocks back.
Between batches it asks for the markers of namespaces whose puts started and that no
call asked for lately, so that those puts are offered under what is current."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .checksums import Checksums
from .connection import NO_SPACE, Closed, Connection
from .markers import Markers
from .queue import WriteJob, WriteQueue
from .values import Layout, Values

log = logging.getLogger("aiokv")

_WRITE_BATCH = 64  # blocks per batch_put call
_MARKERS_FRESH_S = 1.0  # how long the writer trusts what it learned of the markers


class Writer:
    """The thread (``aiokv-remote-write``) and its figures (``stats``). ``wake`` is called
    after each batch, when its blocks can be given back; ``remove_boot`` with a boot id
    whose master restarted, once this host's puts under it are over (:meth:`restarted`)."""

    def __init__(self, queue: WriteQueue, connection: Connection, markers: Markers,
                 layout: Layout, checksums: Checksums,
                 wake: Callable[[], None], remove_boot: Callable[[str], None]) -> None:
        self._queue = queue
        self._connection = connection
        self._markers = markers
        self._keys = markers.keys
        self._wake = wake
        self._remove_boot = remove_boot
        # The boot id of the latest batch put (None: none since the restart of its master
        # was seen), and of the one in Mooncake's put now, under this lock: a put under a
        # boot id whose master restarts lands in the new one, where nobody reads it.
        self._wrote_under: str | None = None
        self._putting: str | None = None
        self._boot_lock = threading.Lock()
        self._block_bytes = layout.block_bytes
        # Where its time goes (the marker checks, Mooncake's put, the checksums:
        # remote_tier.py prints the split).
        self.stats: dict[str, float] = dict.fromkeys((
            "remote_blocks_written", "remote_bytes_written", "remote_dropped_full",
            "remote_dropped_down", "remote_dropped_evicted", "remote_dropped_stale",
            "remote_write_errors",
            "remote_write_batches",
            "remote_write_seconds", "remote_marker_seconds", "remote_write_checksum_seconds",
            "remote_put_seconds"), 0)
        self.values = Values(layout, checksums, self.stats,
                             ("remote_put_seconds", "remote_write_checksum_seconds"))
        # Namespace -> when its markers need asking again before a write.
        self._checked: dict[str, float] = {}
        # time.monotonic(), while it writes a batch or asks for markers (_learn): close
        # gives a call under way timeout_ms, whichever it is.
        self._call_began: float | None = None
        self.thread = threading.Thread(target=self._loop, name="aiokv-remote-write",
                                       daemon=True)

    def _loop(self) -> None:
        queue = self._queue
        while (jobs := queue.next_batch(_WRITE_BATCH)) is not None:
            asked = queue.asked()
            if asked:
                self._learn(asked)
            if not jobs:
                continue
            began = self._call_began = time.monotonic()
            try:
                self._write(jobs)
            except Closed:  # close returned while it was in a call: its figures are final
                pass
            except Exception as exc:  # a bug or the client's: count it, keep the thread
                self.stats["remote_write_errors"] += sum(len(j.blocks) for j in jobs)
                log.exception("aiokv: remote tier: a write failed: %s", exc)
            finally:
                self._call_began = None
                self.stats["remote_write_batches"] += 1
                self.stats["remote_write_seconds"] += time.monotonic() - began
                queue.done(jobs)
                self._wake()

    def in_call_s(self) -> float:
        """How long the batch or the markers' call under way has taken so far (0: none)."""
        began = self._call_began
        return 0.0 if began is None else time.monotonic() - began

    def expect(self, ns: str) -> None:
        """A put of the namespace started (the store thread's): unless a call asked for
        its markers lately, the writer asks for them (:meth:`_learn`)."""
        if not self._keys.asked_since(ns, time.monotonic() - _MARKERS_FRESH_S):
            self._queue.ask(ns)

    def _learn(self, namespaces: list[str]) -> None:
        """Ask for the markers of namespaces whose puts started (:meth:`.queue.WriteQueue.ask`),
        not asked for lately. A put offered after the answer is offered under the
        generation that follows an evict the answer told of (that evict came before the
        put ended); one offered before keeps its view, and its write is dropped as stale
        where that ended. Not the check before the write (:meth:`_refresh`): an evict
        may come between."""
        began = time.monotonic()
        since = began - _MARKERS_FRESH_S
        namespaces = [ns for ns in namespaces if not self._keys.asked_since(ns, since)]
        if not namespaces:
            return
        # Jobs may be queued behind this call: a master that stopped answering holds it
        # about 30 s, and close must see it as a call under way, as it sees a write's.
        self._call_began = began
        try:
            client = self._connection.ready()
            if client is not None:  # else the write is dropped, or asks then
                self._markers.past(client, [(ns, []) for ns in namespaces])
        except Closed:  # close returned meanwhile: its figures are final
            pass
        except Exception as exc:  # the client raised: a failed call, the tier rests
            self._connection.failed("asking for markers", exc)
        finally:
            self._call_began = None
            self.stats["remote_marker_seconds"] += time.monotonic() - began

    def _refresh(self, client: Any, namespaces: set[str]) -> bool:
        """Move past the markers of these namespaces (and of the epoch) that other hosts
        published, so that a write never lands under a key already invalidated (a new
        host would otherwise write under epoch 0 after a clear); whether Mooncake
        answered."""
        if self._markers.past(client, [(ns, []) for ns in namespaces]) is None:
            return False
        # A marker published meanwhile costs at most this long of writes nobody reads.
        until = time.monotonic() + _MARKERS_FRESH_S
        if len(self._checked) > 65536:
            self._checked.clear()
        self._checked.update(dict.fromkeys(namespaces, until))
        return True

    def restarted(self, boot: str) -> None:
        """Any thread, once this host's view of the master of ``boot`` ended: what it put
        under that boot id may be in the new master (a put that crossed the restart),
        unread for good. Removed once, and after the put under it under way, if any
        (:meth:`_write` then asks); never what goes under the new boot id."""
        with self._boot_lock:
            if self._wrote_under != boot or self._putting == boot:
                return
            self._wrote_under = None
        self._remove_boot(boot)

    def _write(self, jobs: list[WriteJob]) -> None:
        stats = self.stats
        count = sum(len(job.blocks) for job in jobs)
        client = self._connection.ready()
        if client is None:
            stats["remote_dropped_down"] += count
            return
        now = time.monotonic()
        # The keys name the boot id: where it is not known (a restart seen just now), the
        # markers' call learns it.
        known = self._keys.boot is not None
        stale = {job.ns for job in jobs if not known or self._checked.get(job.ns, 0.0) < now}
        refreshed = not stale or self._refresh(client, stale)
        stats["remote_marker_seconds"] += time.monotonic() - now
        if not refreshed:
            stats["remote_dropped_down"] += count
            return
        keys: list[str] = []
        blocks: list[int] = []
        lifetime = self._keys.view("")[0]
        boot = self._keys.boot_of(lifetime)  # the master's of now (None: restarted just now)
        for job in jobs:
            view = self._keys.view(job.ns)
            offered = self._keys.seen(job.view)
            if (boot is None or offered is None or offered[0] != lifetime
                    or view[0] != lifetime):
                # The master restarted since: a view that ended (or offered cut off
                # before this host reached any master, and one may have restarted).
                stats["remote_dropped_down"] += len(job.blocks)
                count -= len(job.blocks)
                continue
            if not self._keys.usable(job.ns):  # evicted here, its marker not out yet
                stats["remote_dropped_evicted"] += len(job.blocks)
                count -= len(job.blocks)
                continue
            if view != offered:
                # Ended since the put was offered (usually by another host: the markers
                # just asked): its keys are hidden already. Nor may it go under the new
                # generation: the offer may have come before that evict, as far as this
                # host can tell, and it would bring back what the evict ended. Dropped;
                # the host tier keeps the blocks (and does not offer them again).
                stats["remote_dropped_stale"] += len(job.blocks)
                count -= len(job.blocks)
                continue
            # Under the boot id of the master it was offered under: one that restarts
            # after these checks, before the put, gets it where its hosts never look.
            keys += self._keys.blocks(boot, job.ns, job.view[1], job.view[2], job.digests)
            blocks += job.blocks.tolist()
        if not keys:
            return
        with self._boot_lock:
            putting = self._keys.boot_of(lifetime)  # boot, unless the restart was seen now
            if putting is None:
                stats["remote_dropped_down"] += count
                return
            self._putting = self._wrote_under = putting
        try:
            codes = self.values.put(client, keys, blocks)
        finally:
            with self._boot_lock:
                self._putting = None
                crossed = self._keys.boot_of(lifetime) is None
                if crossed:
                    self._wrote_under = None
        if crossed:  # seen while it was under way: removed after it (restarted left it)
            self._remove_boot(putting)
        if not self._connection.codes("batch_put_from", codes):
            stats["remote_dropped_down"] += count
            return
        if self._keys.boot_of(lifetime) is None:
            # The restart was seen meanwhile: what was put went with the old master, or
            # under its boot id into the new one, where nobody reads it. Dropped at the
            # restart, as the writes queued then; the LRU takes them.
            stats["remote_dropped_down"] += count
            return
        written = codes.count(0)
        full = codes.count(NO_SPACE)
        stats["remote_blocks_written"] += written
        stats["remote_bytes_written"] += written * self._block_bytes
        stats["remote_dropped_full"] += full
        stats["remote_write_errors"] += len(codes) - written - full
