"""The remote tier's writer: it takes the queued writes a batch at a time, asks for the
markers of their namespaces first (at most once a second each), and puts the values under
the master's boot id, epoch and generation their put was offered under, unless those ended
meanwhile. Every job ends in :meth:`~.queue.WriteQueue.done`, written or dropped (counted
by reason), so that the store thread gives its host blocks back. Between batches (and
while it waits for a batch in hand to end) it asks for the markers of namespaces whose
puts started and that no call asked for lately, so that those puts are offered under
what is current, and for those of each put that landed, to remove what another host's
evict or clear ended while it was in Mooncake's put (:meth:`Writer._learn`).

Two threads, a batch each: the writer thread checks a batch, names its keys and sums its
values while the put thread has the batch before it in Mooncake's put. Done in turn, the
sums and checks would add their time to every batch's (writes under way hold host blocks
and fall behind the offloads); side by side, the put alone sets the rate. A batch's checks
may so come one put earlier than its own put: no harder case than a check followed by a
slow put, since a put lands under the view it was offered under, which an evict's marker
then ends. An evict waits for a batch of its key being checked or put
(:meth:`.queue.WriteQueue.wait_idle`); one that waits for the put before it is set aside
(:meth:`.queue.WriteQueue.set_aside`), and the evict takes its jobs back as it takes the
queued ones, rather than wait for another key's put."""

from __future__ import annotations

import logging
import queue as queues
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .checksums import Checksums
from .connection import NO_SPACE, Closed, Connection
from .markers import Markers
from .queue import Landed, WriteJob, WriteQueue
from .values import Layout, Values

log = logging.getLogger("aiokv")

_WRITE_BATCH = 64  # blocks per batch_put call
_MARKERS_FRESH_S = 1.0  # how long the writer trusts what it learned of the markers


@dataclass(slots=True, eq=False)
class _Ready:
    """A batch checked and summed, for the put thread: its jobs set aside, with their
    keys (``parts``), under ``lifetime``'s boot id."""

    parts: list[tuple[WriteJob, list[str]]]
    lifetime: int
    dropped: list[WriteJob]  # the batch's jobs dropped at its checks, to end with it


class Writer:
    """The two threads (``thread``, the writer's, ends after the put thread) and their
    figures (``stats``). ``wake`` is called after each batch, when its blocks can be given
    back; ``remove`` with the pattern of blocks to remove: under a boot id whose master
    restarted, once this host's puts under it are over (:meth:`restarted`), or those of a
    put that landed under a generation ended meanwhile (:meth:`_remove_ended`)."""

    def __init__(self, queue: WriteQueue, connection: Connection, markers: Markers,
                 layout: Layout, checksums: Checksums,
                 wake: Callable[[], None], remove: Callable[[str], None]) -> None:
        self._queue = queue
        self._connection = connection
        self._markers = markers
        self._keys = markers.keys
        self._wake = wake
        self._remove = remove  # a removal's pattern (.removals.Remover.submit)
        # The boot id of the latest batch put (None: none since the restart of its master
        # was seen), and of the one in Mooncake's put now, under this lock: a put under a
        # boot id whose master restarts lands in the new one, where nobody reads it.
        self._wrote_under: str | None = None
        self._putting: str | None = None
        self._boot_lock = threading.Lock()
        self._block_bytes = layout.block_bytes
        # Where its time goes (the marker checks, Mooncake's put, the checksums:
        # remote_tier.py prints the split). Both threads count, under the lock.
        self.stats: dict[str, float] = dict.fromkeys((
            "remote_blocks_written", "remote_bytes_written", "remote_dropped_full",
            "remote_dropped_down", "remote_dropped_evicted", "remote_dropped_stale",
            "remote_write_errors",
            "remote_write_batches",
            "remote_write_seconds", "remote_marker_seconds", "remote_write_checksum_seconds",
            "remote_put_seconds"), 0)
        self._stats_lock = threading.Lock()
        # The blocks of the batch each thread has in hand whose end is not counted yet
        # ("check": the writer thread's, until written, dropped or set aside; "put": the
        # put thread's, in Mooncake's put), under the lock: close counts those of a call it
        # gives up on as dropped (:meth:`give_up`), and after that nothing is counted, so
        # each block offered is counted once, however late that call returns.
        self._uncounted = {"check": 0, "put": 0}
        self._final = False
        self.values = Values(layout, checksums, self.stats,
                             ("remote_put_seconds", "remote_write_checksum_seconds"))
        # Namespace -> when its markers need asking again before a write.
        self._checked: dict[str, float] = {}
        # time.monotonic(), while the writer thread checks a batch or asks for markers
        # (_learn), and while the put thread puts one: close gives a call under way
        # timeout_ms, whichever it is.
        self._call_began: float | None = None
        self._put_began: float | None = None
        # Batches taken from the queue and not done (two at most: one in Mooncake's put,
        # the next checked and summed meanwhile). remote_write_seconds counts the time
        # with one or two in hand (the writer's busy time, which its rate is of).
        self._in_hand = 0
        self._busy_since = 0.0
        self._ready: queues.SimpleQueue[_Ready | None] = queues.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="aiokv-remote-write",
                                       daemon=True)
        self._put_thread = threading.Thread(target=self._put_loop, name="aiokv-remote-put",
                                            daemon=True)

    def count(self, key: str, amount: float) -> None:
        """Add to one of the writer's figures (any thread: its two threads count too);
        nothing once close gave up (:meth:`give_up`)."""
        with self._stats_lock:
            if not self._final:
                self.stats[key] += amount

    def _ended(self, hand: str, blocks: int, counts: Mapping[str, float]) -> None:
        """``blocks`` of the batch in ``hand`` ended, counted as ``counts`` says."""
        with self._stats_lock:
            self._ended_locked(hand, blocks, counts)

    def _ended_locked(self, hand: str, blocks: int, counts: Mapping[str, float]) -> None:
        self._uncounted[hand] -= blocks
        if not self._final:
            for key, amount in counts.items():
                self.stats[key] += amount

    def _failed(self, hand: str) -> None:
        """The batch in ``hand`` failed (a bug or the client's): its blocks not counted
        yet are write errors."""
        with self._stats_lock:
            left = self._uncounted[hand]
            self._ended_locked(hand, left, {"remote_write_errors": left})

    def give_up(self) -> int:
        """Close stops waiting for the threads (store thread): the blocks of the batches
        they still have in hand (a call Mooncake holds), and of the jobs set aside since
        close took the queued ones back, are counted dropped ("down"), and from now on
        nothing more is counted: close's figures are final. How many."""
        with self._stats_lock:
            if self._final:
                return 0
            self._final = True
            # A batch whose checks ended while close waited for the threads was set aside
            # after close took the queued writes back: counted by neither, unless taken
            # back here (under the lock, as the put thread starts them: one or the other).
            aside = self._queue.cancel(None)
            left = self._uncounted["check"] + self._uncounted["put"] + sum(map(len, aside))
            self.stats["remote_dropped_down"] += left
        self._queue.give_back(aside)
        return left

    def _loop(self) -> None:
        queue = self._queue
        self._put_thread.start()
        try:
            while True:
                # With two batches in hand this thread waits for one to end (_finish), but
                # still asks for the markers that puts starting meanwhile want: else under
                # a steady load they are asked for only after those puts were offered,
                # under a generation another host's evict ended, and dropped as stale.
                jobs = queue.next_batch(_WRITE_BATCH, lambda: self._in_hand < 2)
                if jobs is None:
                    break
                if jobs:
                    # In hand from here, before the markers' call below: a close that
                    # gives up on that call counts the batch (:meth:`give_up`).
                    with self._stats_lock:
                        if not self._in_hand:
                            self._busy_since = time.monotonic()
                        self._in_hand += 1
                        self._uncounted["check"] = sum(len(job.blocks) for job in jobs)
                asked, landed = queue.asked()
                if asked or landed:
                    self._learn(asked, landed)
                if not jobs:
                    continue
                ready: _Ready | None = None
                self._call_began = time.monotonic()
                try:
                    ready = self._write(jobs)
                except Closed:  # close returned while it was in a call: its figures are final
                    pass
                except Exception as exc:  # a bug or the client's: count it, keep the thread
                    self._failed("check")
                    log.exception("aiokv: remote tier: a write failed: %s", exc)
                finally:
                    self._call_began = None
                if ready is None:
                    self._finish(jobs)
                elif (ready := self._set_aside(ready)) is None:
                    self._finish([])  # each job dropped and given back
                else:
                    self._ready.put(ready)
        finally:
            self._ready.put(None)  # the put thread ends after the batch it has
            self._put_thread.join()

    def _set_aside(self, ready: _Ready) -> _Ready | None:
        """A batch readied waits for the put before it: its jobs that an evict (a clear,
        a restart) ended during its checks are dropped now (that evict waits for them),
        the others set aside (a later one takes them back). None: none is left."""
        lifetime = ready.lifetime
        boot = self._keys.boot_of(lifetime)
        dropped: Counter[str] = Counter()

        def keep(job: WriteJob) -> bool:
            why = self._dropped(job, lifetime, boot)
            if why is not None:
                dropped[why] += len(job.blocks)
            return why is None

        with self._stats_lock:
            # Under the lock: those set aside are the queue's from here on (an evict, a
            # clear or close that takes them back counts them), never counted twice.
            kept = self._queue.set_aside([job for job, _ in ready.parts], keep)
            self._ended_locked("check", self._uncounted["check"], dropped)
        # Those dropped at the checks end too: their blocks back, their namespaces no
        # longer written (else they stay held for good, and each evict of theirs waits
        # timeout_ms for a write that never ends).
        self._queue.done(ready.dropped)
        if (dropped or ready.dropped) and kept:
            self._wake()  # their blocks are back now, not after the put
        return _kept(ready, kept)

    def _put_loop(self) -> None:
        while (ready := self._ready.get()) is not None:
            # Those of its jobs that no evict, clear, restart or close took back meanwhile.
            with self._stats_lock:  # in hand from the queue's set aside, as one step
                started = _kept(ready, self._queue.start([job for job, _ in ready.parts]))
                jobs = [] if started is None else [job for job, _ in started.parts]
                count = self._uncounted["put"] = sum(len(job.blocks) for job in jobs)
            if started is None:
                self._finish([])
                continue
            if self._queue.closed:
                # The interpreter exits, or close stopped waiting for the writes: a put
                # not begun is not begun now (a daemon thread in Mooncake's call as the
                # interpreter ends takes the process down).
                self._ended("put", count, {"remote_dropped_down": count})
                self._finish(jobs)
                continue
            self._put_began = time.monotonic()
            try:
                self._put(started, count)
            except Closed:
                pass
            except Exception as exc:
                self._failed("put")
                log.exception("aiokv: remote tier: a write failed: %s", exc)
            finally:
                self._put_began = None
                self._finish(jobs)

    def _finish(self, jobs: list[WriteJob]) -> None:
        """A batch ended, written or dropped (either thread): ``jobs``, those of its jobs
        not given back yet."""
        with self._stats_lock:
            self._in_hand -= 1
            # Each batch's end adds the busy time so far, not only the writer's next idle
            # moment: a writer that never idles would show batches written in no time.
            now = time.monotonic()
            if not self._final:
                self.stats["remote_write_batches"] += 1
                self.stats["remote_write_seconds"] += now - self._busy_since
            self._busy_since = now
        self._queue.done(jobs)  # after _in_hand: it wakes the writer thread for room
        self._wake()

    def in_call_s(self) -> float:
        """How long the oldest of the calls under way (a batch's checks or put, the
        markers') has taken so far (0: none)."""
        began = [b for b in (self._call_began, self._put_began) if b is not None]
        return time.monotonic() - min(began) if began else 0.0

    def expect(self, ns: str) -> None:
        """A put of the namespace started (the store thread's): unless a call asked for
        its markers lately, the writer asks for them (:meth:`_learn`)."""
        if not self._keys.asked_since(ns, time.monotonic() - _MARKERS_FRESH_S):
            self._queue.ask(ns)

    def _learn(self, namespaces: list[str], landed: list[Landed]) -> None:
        """Ask for the markers of namespaces whose puts started (:meth:`.queue.WriteQueue.ask`),
        not asked for lately. A put offered after the answer is offered under the
        generation that follows an evict the answer told of (that evict came before the
        put ended); one offered before keeps its view, and its write is dropped as stale
        where that ended. Not the check before the write (:meth:`_refresh`): an evict
        may come between.

        And for those of the puts that landed (:meth:`.queue.WriteQueue.landed`) that no
        call asked for since: an evict or clear by another host that ended them while
        the put was in Mooncake's call ran its removal before the put landed, and this
        host learns of its marker only by asking. Asked here, not on the put thread: a
        call there waits on a master that restarts or a tier that rests, and holds the
        put's blocks and the next put meanwhile."""
        began = time.monotonic()
        since = began - _MARKERS_FRESH_S
        namespaces = [ns for ns in namespaces if not self._keys.asked_since(ns, since)]
        if self._queue.closed:
            landed = []  # close waits for no markers call more: the LRU takes them
        for put in landed:
            if self._keys.boot_of(put.lifetime) is not None:  # else restarted removes it
                namespaces += [ns for ns, _, _ in put.views
                               if not self._keys.asked_since(ns, put.at)]
        namespaces = list(dict.fromkeys(namespaces))
        if namespaces and not self._ask(namespaces, began):
            return  # close returned meanwhile: nothing more
        for put in landed:
            self._remove_ended(put.lifetime, put.views)

    def _ask(self, namespaces: list[str], began: float) -> bool:
        """Ask for the namespaces' markers (:meth:`_learn`); False where close returned
        meanwhile (its figures are final)."""
        # Jobs may be queued behind this call: a master that stopped answering holds it
        # about 30 s, and close must see it as a call under way, as it sees a write's.
        self._call_began = began
        try:
            client = self._connection.ready()
            if client is not None:  # else the write is dropped, or asks then
                self._markers.past(client, [(ns, []) for ns in namespaces])
        except Closed:  # close returned meanwhile: its figures are final
            return False
        except Exception as exc:  # the client raised: a failed call, the tier rests
            self._connection.failed("asking for markers", exc)
        finally:
            self._call_began = None
            self.count("remote_marker_seconds", time.monotonic() - began)
        return True

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
        self._remove(self._keys.boot_pattern(boot))

    def _write(self, jobs: list[WriteJob]) -> _Ready | None:
        """Check a batch, name its keys and sum its values: what the put thread puts
        (None: nothing to put, each block counted)."""
        count = sum(len(job.blocks) for job in jobs)
        client = self._connection.ready()
        if client is None:
            self._ended("check", count, {"remote_dropped_down": count})
            return None
        now = time.monotonic()
        # The keys name the boot id: where it is not known (a restart seen just now), the
        # markers' call learns it.
        known = self._keys.boot is not None
        stale = {job.ns for job in jobs if not known or self._checked.get(job.ns, 0.0) < now}
        refreshed = not stale or self._refresh(client, stale)
        self.count("remote_marker_seconds", time.monotonic() - now)
        if not refreshed:
            self._ended("check", count, {"remote_dropped_down": count})
            return None
        parts: list[tuple[WriteJob, list[str]]] = []
        lifetime = self._keys.view("")[0]
        boot = self._keys.boot_of(lifetime)  # the master's of now (None: restarted just now)
        dropped: Counter[str] = Counter()
        for job in jobs:
            why = self._dropped(job, lifetime, boot)
            if why is not None:
                dropped[why] += len(job.blocks)
                continue
            assert boot is not None  # none is kept without it
            # Under the boot id of the master it was offered under: one that restarts
            # after these checks, before the put, gets it where its hosts never look.
            parts.append((job, self._keys.blocks(boot, job.ns, job.view[1], job.view[2],
                                                 job.digests)))
        self._ended("check", sum(dropped.values()), dropped)
        if not parts:
            return None
        self.values.seal([key for _, keys in parts for key in keys], _blocks(parts))
        put = {id(job) for job, _ in parts}
        return _Ready(parts, lifetime, [job for job in jobs if id(job) not in put])

    def _dropped(self, job: WriteJob, lifetime: int, boot: str | None) -> str | None:
        """Why a job may not be put under ``lifetime`` (its master's ``boot``): the
        stats' name of its drop; None: it may."""
        view = self._keys.view(job.ns)
        offered = self._keys.seen(job.view)
        if boot is None or offered is None or offered[0] != lifetime or view[0] != lifetime:
            # The master restarted since: a view that ended (or offered cut off
            # before this host reached any master, and one may have restarted).
            return "remote_dropped_down"
        if not self._keys.usable(job.ns):  # evicted here, its marker not out yet
            return "remote_dropped_evicted"
        if view != offered:
            # Ended since the put was offered (usually by another host: the markers
            # just asked): its keys are hidden already. Nor may it go under the new
            # generation: the offer may have come before that evict, as far as this
            # host can tell, and it would bring back what the evict ended. Dropped;
            # the host tier keeps the blocks (and does not offer them again).
            return "remote_dropped_stale"
        return None

    def _put(self, ready: _Ready, count: int) -> None:
        """Put a batch the writer thread readied (the put thread; ``count`` blocks), under
        the boot id its keys name, unless its master restarted meanwhile."""
        lifetime = ready.lifetime
        client = self._connection.ready()
        with self._boot_lock:
            putting = self._keys.boot_of(lifetime)  # its keys' boot, unless restarted since
            if putting is None or client is None:
                self._ended("put", count, {"remote_dropped_down": count})
                return
            self._putting = self._wrote_under = putting
        try:
            codes = self.values.put(client, [key for _, keys in ready.parts for key in keys],
                                    _blocks(ready.parts))
        finally:
            with self._boot_lock:
                self._putting = None
                crossed = self._keys.boot_of(lifetime) is None
                if crossed:
                    self._wrote_under = None
        landed_at = time.monotonic()
        if crossed:  # seen while it was under way: removed after it (restarted left it)
            self._remove(self._keys.boot_pattern(putting))
        if not self._connection.codes("batch_put_from", codes):
            self._ended("put", count, {"remote_dropped_down": count})
            return
        if self._keys.boot_of(lifetime) is None:
            # The restart was seen meanwhile: what was put went with the old master, or
            # under its boot id into the new one, where nobody reads it. Dropped at the
            # restart, as the writes queued then; the LRU takes them.
            self._ended("put", count, {"remote_dropped_down": count})
            return
        views = list(dict.fromkeys(_views(ready)))
        left = self._remove_ended(lifetime, views)
        written = codes.count(0)
        if left and written:
            # Another host's marker is learned only by a call that asks for it after the
            # put landed: the writer thread's (_learn), this thread moving on.
            self._queue.landed(Landed(lifetime, landed_at, left))
        full = codes.count(NO_SPACE)
        self._ended("put", count, {
            "remote_blocks_written": written, "remote_bytes_written": written * self._block_bytes,
            "remote_dropped_full": full, "remote_write_errors": len(codes) - written - full})

    def _remove_ended(self, lifetime: int, views: list[tuple[str, int, int]]
                      ) -> list[tuple[str, int, int]]:
        """A batch landed under these (namespace, epoch, generation) of ``lifetime``:
        those an evict or clear ended while it was in Mooncake's put (as far as this
        host knows: through this host, or learned since) may have had that marker's
        removal run before it landed (an evict through a store server, or on another
        host, does not wait for the put), leaving its blocks in Mooncake, read by
        nobody, until the LRU. Removed again now that they are in; a marker that comes
        after this host learned it removes them itself. Those not ended (nor of a
        lifetime that ended: its own removal, :meth:`restarted`)."""
        patterns: dict[str, None] = {}
        left: list[tuple[str, int, int]] = []
        for ns, epoch, generation in views:
            now, epoch_now, generation_now = self._keys.view(ns)
            if now != lifetime:  # a restart: its own removal (restarted)
                continue
            if epoch_now > epoch:
                patterns[self._keys.epoch_pattern(epoch)] = None
            elif generation_now > generation:
                patterns[self._keys.generation_pattern(ns, generation)] = None
            else:
                left.append((ns, epoch, generation))
        for pattern in patterns:
            self._remove(pattern)
        return left


def _views(ready: _Ready) -> list[tuple[str, int, int]]:
    """The (namespace, epoch, generation) each of the batch's jobs' keys name."""
    views = []
    for job, keys in ready.parts:
        if keys:
            epoch, generation = map(int, keys[0].rsplit("/", 2)[1].split("."))
            views.append((job.ns, epoch, generation))
    return views


def _blocks(parts: list[tuple[WriteJob, list[str]]]) -> list[int]:
    return [block for job, _ in parts for block in job.blocks.tolist()]


def _kept(ready: _Ready, jobs: list[WriteJob]) -> _Ready | None:
    """The batch of these of its jobs (None: none)."""
    if not jobs:
        return None
    if len(jobs) == len(ready.parts):
        return ready
    ids = {id(job) for job in jobs}
    return _Ready([part for part in ready.parts if id(part[0]) in ids], ready.lifetime, [])
