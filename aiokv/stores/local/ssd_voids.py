"""Which SSD slot headers still name a dropped key, and voiding them (the SSD tier's
invalidation, :meth:`.ssd.SsdTier.drop_namespace`).

A restart rebuilds the index from every slot header of the current epoch, so an evict
is durable only once no header names the key. Besides the slots the index maps to it,
a header of the key can sit in:

- a slot whose write is queued: flagged, so that the write lands naming nothing;
- a slot whose write is running or has landed (its header made) while its request, in
  parts on several lanes or runs, is not applied yet: voided right after that write;
- a slot of a write that failed (a part of it may have landed; not one it never
  reached): voided before it is reused, and again by a drop while that void waits
  behind the queued writes (a drop's voids go ahead of them);
- a slot still in use (a held lookup's, a read's): voided at once, its read then failing
  as a dropped key's should (not counted as damage);
- a slot LRU eviction handed to another key whose write has not landed (stale), or an
  older copy found at recovery: voided ahead of that write, unless it landed first.

Voids are header writes on the files' write lanes (:mod:`.ssd_io`), one op at a time per
file: ahead of the queued writes (``front``) or behind them. The store thread, the I/O
threads and the recovery share this state under one lock.

A void the disk refuses (an I/O error; counted, as each refused new epoch is, in the
tier's ``ssd_invalidation_errors``) would leave the key to a restart. Its file's
headers are retired instead, all at once: a new epoch in the file's meta file, as a
clear does for every file. The file's other blocks are served until then and are misses
after a restart (a cache may forget; it may not bring back what was evicted). Where the
meta file cannot be written either, the slot stays listed as naming its key, so that an
evict of the key voids it again, and the voids' :class:`VoidsDone` says why: an evict
fails with it (:meth:`.store.LocalStore.evict`, the store server's evict).
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..base import BoolArray, Int64Array
from .blocks import NO_BLOCKS
from .index import Space
from .ssd_format import HEADER_BYTES
from .ssd_io import SsdFiles

log = logging.getLogger("aiokv")


class VoidsDone(threading.Event):
    """Set once a batch of voids is written (:meth:`HeaderVoids.void`). ``failure``: why
    a header they were to void may still name its key on disk, for a restart to find
    (None: none can)."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: str | None = None

    @classmethod
    def failed(cls, why: str) -> VoidsDone:
        """One set already, with ``why`` as its failure."""
        done = cls()
        done.failure = why
        done.set()
        return done


class HeaderVoids:
    def __init__(self, files: SsdFiles, notify: Callable[[], None],
                 stats: dict[str, int]) -> None:
        """``stats``: the tier's figures, where the writes the disk refused are counted
        (``ssd_invalidation_errors``, under this lock: the I/O threads count there)."""
        self._files = files
        self._notify = notify
        self._stats = stats
        self._zero_page = mmap.mmap(-1, HEADER_BYTES)  # aligned zeros, to void a header
        self._lock = threading.Lock()
        self._unwritten: set[int] = set()  # queued writes that must land void
        self._packed: set[int] = set()  # writes running, their header made
        # Written, their header naming the key, but their request not applied yet (the
        # store thread applies a request once all its parts ended).
        self._landed: set[int] = set()
        self._stale: dict[int, tuple[str, ...]] = {}  # slot -> the key its header names
        # Slots of failed writes whose void is queued behind the writes, not written yet:
        # a drop's voids go ahead of it, so a drop voids them too.
        self._failing: set[int] = set()
        # Slots of dropped keys voided while in use (store thread only): their void once
        # idle is done already.
        self._voided: set[int] = set()
        # Files that may hold a header of their current epoch: every file at open, and
        # a file once a write names a slot of it (its lane drops it at a retirement).
        self._naming = set(range(files.count))
        # From a clear's new epoch (begin_clear) to its drop: the slots whose header a
        # write made meanwhile, perhaps of the new epoch, which the drop voids (such a
        # write may even be applied before it: the new epoch is written first, before
        # any tier drops anything). None: no clear under way.
        self._since_epoch: set[int] | None = None

    # ---- what the writes and the index report ----------------------------------------

    def recycled(self, slots: Int64Array, spaces: list[Space], digests: list[bytes]
                 ) -> Int64Array:
        """The SSD index's eviction hook: the slots go to other keys' writes, their
        headers naming these keys until those land. Keeps none."""
        with self._lock:
            for slot, space in zip(slots.tolist(), spaces, strict=True):
                self._stale[slot] = space.key
        return NO_BLOCKS

    def older_copy(self, slot: int, namespace: tuple[str, ...]) -> None:
        """Recovery found a newer copy of the block in ``slot``: it stays on disk, free."""
        self._stale[slot] = namespace

    def claim(self, slots: Sequence[int], k: int) -> tuple[list[bool], int]:
        """A write is about to make these slots' headers, all in file ``k`` (I/O
        thread): whether each may name its key (False: its key was dropped first; it
        lands void), and the epoch to make them with. Those that may are running from
        now on, until :meth:`written`. (The epoch is read here, under the lock, so that
        a header made with a clear's new epoch is one :meth:`begin_clear` tracks.)"""
        with self._lock:
            named = [slot not in self._unwritten for slot in slots]
            self._unwritten.difference_update(slots)
            made = [s for s, ok in zip(slots, named, strict=True) if ok]
            self._packed.update(made)
            if self._since_epoch is not None:
                self._since_epoch.update(made)
            self._naming.add(k)
            epoch = self._files.metas[k].epoch
        return named, epoch

    def written(self, slots: Sequence[int], landed: bool, reached: int) -> None:
        """A write of these slots ended; ``landed``: no older header is there now (a
        failed one may have left it: still stale); it reached the first ``reached``
        slots (a failed one left those past them as they were: nothing of it to void
        there). The headers it made there name their key until their request is
        applied (:meth:`applied`, :meth:`failed`)."""
        with self._lock:
            self._landed.update(s for s in slots[:reached] if s in self._packed)
            self._packed.difference_update(slots)
            if landed:
                for slot in slots:
                    self._stale.pop(slot, None)

    def applied(self, slots: Sequence[int]) -> None:
        """A write request's slots are in the index now (store thread)."""
        with self._lock:
            self._landed.difference_update(slots)

    def failed(self, slots: Int64Array) -> None:
        """A write request failed (store thread): what parts of it made no header never
        will, and the headers the others made (a part that landed, or a short write) are
        voided, behind the queued writes, before the slots go back. Slots it never
        reached (a write that moved nothing: a full disk under a sparse file) hold
        nothing of it: none to void (a void there would fail as the write did, and
        every evict after, which voids the failed writes' slots, with it)."""
        listed = slots.tolist()
        with self._lock:
            self._unwritten.difference_update(listed)
            made = [s for s in listed if s in self._landed]
            self._landed.difference_update(made)
            self._failing.update(made)
        self.void(np.array(made, dtype=np.int64))

    def voided_mask(self, slots: Int64Array) -> BoolArray | None:
        """Which of a read's slots a drop voided under it (None: none could be)."""
        return np.isin(slots, list(self._voided)) if self._voided else None

    def refused(self) -> None:
        """The disk refused a write that was to keep dropped blocks from a restart (a
        header void, a new epoch): counted (any thread)."""
        with self._lock:
            self._stats["ssd_invalidation_errors"] += 1

    # ---- a drop -------------------------------------------------------------------

    @property
    def clear_begun(self) -> bool:
        """A clear's new epoch is begun and its :meth:`drop` not yet run (store thread,
        the only one that begins or ends it)."""
        return self._since_epoch is not None

    def begin_clear(self) -> None:
        """A clear's new epoch is about to be written (store thread): the headers made
        from now on are tracked until its :meth:`drop`."""
        with self._lock:
            self._since_epoch = set()

    def abort_clear(self) -> None:
        """The new epoch :meth:`begin_clear` announced was not written (its clear failed,
        dropping nothing): no header is of it, none to track."""
        with self._lock:
            self._since_epoch = None

    def drop(self, namespace: tuple[str, ...] | None, dropped: Int64Array,
             writing: Sequence[int], reading: Sequence[int]) -> VoidsDone:
        """Void what names ``namespace`` (None: a clear, whose new epoch voided every
        header made before :meth:`begin_clear`; those made since are voided here):
        ``dropped`` (idle, out of the index), ``writing`` and ``reading`` (its slots
        still in use). Returns an event set once done."""
        with self._lock:
            # Running, or landed with its request not applied yet: their headers name
            # the key (voided now, after the op running on their lane); the others
            # are still queued (flagged: they land naming nothing).
            made = self._packed | self._landed
            running = [s for s in writing if s in made]
            self._unwritten.update(s for s in writing if s not in made)
            self._landed.difference_update(running)
            if namespace is None:
                stale, failing = [], []
                self._stale.clear()
                # Made since the new epoch was begun: perhaps of it (begin_clear).
                made_since = sorted((self._since_epoch or set()).difference(running))
                self._since_epoch = None
            else:
                stale = [s for s, key in self._stale.items() if key == namespace]
                # Which key a failed write's landed part names is not kept: void them
                # all (rare; no write reuses them before their own void, which is
                # ahead of it on the lane).
                failing = list(self._failing)
                made_since = []
        self._voided.update(reading)
        if namespace is None:
            dropped, reading = NO_BLOCKS, []
        now = np.array([*running, *reading, *failing, *made_since], dtype=np.int64)
        return self.void(np.concatenate([dropped, now]), front=True,
                         stale=np.array(stale, dtype=np.int64), namespace=namespace)

    def void_later(self, slots: Int64Array) -> None:
        """The tier's ``forget``: slots of a dropped key freed once idle, voided behind
        the queued writes (their drop's event covered them already, or their write
        did), except those voided while in use."""
        if self._voided:
            done = np.isin(slots, list(self._voided))
            self._voided.difference_update(slots[done].tolist())
            slots = slots[~done]
        self.void(slots)

    def void(self, slots: Int64Array, front: bool = False, stale: Int64Array = NO_BLOCKS,
             namespace: tuple[str, ...] | None = None) -> VoidsDone:
        """Zero these slots' headers (whose key is ``namespace`` where it is given):
        behind the file's queued writes, or ``front``: ahead of them; and those of
        ``stale`` slots whose header still names ``namespace`` when their turn comes.
        Returns an event set (and the store notified) once they are."""
        files, event = self._files, VoidsDone()
        by_file: dict[int, list[Callable[[], None]]] = {}
        for slot in slots.tolist():
            by_file.setdefault(slot % files.count, []).append(
                functools.partial(self._void_one, event, slot, None, namespace))
        for slot in stale.tolist():
            by_file.setdefault(slot % files.count, []).append(
                functools.partial(self._void_one, event, slot, namespace, namespace))
        if not by_file:
            event.set()
            return event
        left = [len(by_file)]
        lock = threading.Lock()

        def reached() -> None:  # an I/O thread, once a file's voids are written
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            event.set()
            self._notify()

        for k, ops in by_file.items():
            ops.append(reached)
            if front:  # each put first in turn: queued in reverse
                for op in reversed(ops):
                    files.submit(k, op, read=False, front=True)
            else:
                for op in ops:
                    files.submit(k, op, read=False)
        return event

    def _void_one(self, done: VoidsDone, slot: int, only_if: tuple[str, ...] | None,
                  key: tuple[str, ...] | None) -> None:
        """Zero one slot's header (I/O thread, its file's write lane), which names ``key``
        (None: not known); ``only_if``: only while the stale header there names that key
        (no write has landed on it since: the lane runs one op at a time, so none can
        land between check and void)."""
        files = self._files
        k = slot % files.count
        if only_if is not None:
            with self._lock:
                if self._stale.get(slot) != only_if:
                    return
        try:
            files.write(k, slot // files.count * files.slot_bytes, [self._zero_page])
        except OSError as exc:
            self.refused()
            if not self._retire(done, slot, key, exc):
                return
        with self._lock:
            self._stale.pop(slot, None)
            self._failing.discard(slot)

    def _retire(self, done: VoidsDone, slot: int, key: tuple[str, ...] | None,
                error: OSError) -> bool:
        """A void the disk refused: every header of the slot's file made so far is
        retired instead, a new epoch in its meta file (the module docstring says why).
        Whether it was; if not, the slot stays listed as naming ``key`` and ``done``
        says why."""
        files = self._files
        k = slot % files.count
        path = files.paths[k]
        # On the slot's write lane (or after the lanes stopped): no write of the file can
        # make a header between the void's failure and the new epoch.
        with self._lock:
            if k not in self._naming:  # no header made since the last: it is void
                return True
        try:
            files.new_epoch(k)
        except OSError as exc:
            self.refused()
            log.warning("aiokv: voiding an SSD slot header in %s failed (%r), and so did "
                        "retiring the file's headers (%r): a restart may find the key it "
                        "names again", path, error, exc)
            if key is not None:
                with self._lock:
                    self._stale[slot] = key  # an evict of it voids it again
            done.failure = (f"the SSD tier could not void slot {slot}'s header in {path} "
                            f"({error!r}) nor retire that file's headers ({exc!r}): a "
                            "restart may find what was dropped; evict or clear it again "
                            "once the disk is well")
            return False
        with self._lock:
            self._naming.discard(k)
        log.warning("aiokv: voiding an SSD slot header in %s failed (%r); every header of "
                    "that file was retired instead: its blocks are misses after a restart",
                    path, error)
        return True

    def close(self) -> None:
        self._zero_page.close()


__all__ = ["HeaderVoids", "VoidsDone"]
