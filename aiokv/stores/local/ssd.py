"""The SSD tier: slots on disk under one prefix index, written and read in runs.

The tier below the host pool (see :mod:`.blocks` for the states and :mod:`.ssd_format`
for the format and why it is self-describing). The store calls it on its own thread:
``write`` copies host blocks out (write_through after a put; write_back ahead of eviction),
``read`` copies slots into host blocks (a load's SSD part, one request per chunk), and
``drain`` applies finished requests to the index and hands them back to the store. The
I/O threads (:mod:`.ssd_io`) move bytes, compute and verify checksums, and report; they
touch no metadata. A failed write leaves the block where it was (the host tier keeps it).
A block a read could not bring (an I/O error, a file cut short) or whose checksum (or
header) does not match is dropped from the tier, counted, and never reaches the host pool:
the load that asked for it stops short there, as at any miss, rather than fail (a failed
read would fail every later load of the key too, the block being still indexed).
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base import BoolArray, Int64Array, NoSpace
from ..dirlock import DirLock
from . import ssd_recency
from .blocks import READY, WRITING, Tier
from .index import Space
from .layout import ALIGN
from .pool import BlockAllocator, HostPool
from .ssd_format import (
    HEADER_BYTES,
    checksum,
    encode_namespace,
    pack_header,
    unpack_header,
)
from .ssd_io import ShortIO, SsdFiles
from .ssd_voids import HeaderVoids, VoidsDone

log = logging.getLogger("aiokv")

READ_CHUNK_BYTES = 32 << 20  # per read request: large for the disk, small for the pipeline


@dataclass(slots=True, eq=False)
class SsdRequest:
    """One write or read of a run of slots; ``ops`` file requests, ``arrived`` done."""

    is_write: bool
    slots: Int64Array
    host_blocks: Int64Array
    digests: list[bytes]
    namespaces: list[bytes]  # encoded, per block
    owner: Any = None  # the store's bookkeeping (a flush, a load)
    # A read's verified slots stay held once it is in (a prefetch's: staging.py); its owner
    # may clear this until then.
    keep: bool = False
    generation: int = 0  # of its first block's header (a write), one more per block
    ok: BoolArray = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    # A read's blocks the disk did not give back (ShortIO: an I/O error, a file cut short).
    unread: BoolArray = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    error: str | None = None
    ops: int = 0
    arrived: int = 0


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SsdTier:
    def __init__(
        self,
        dirs: Sequence[str],
        capacity_bytes: float,
        pool: HostPool,
        geometry: dict[str, Any],
        *,
        reset_on_mismatch: bool,
        notify: Callable[[], None],
        held: Sequence[DirLock] | None = None,
    ) -> None:
        """``held``: the directories' locks, kept by the caller (SsdFiles)."""
        from ...errors import ConfigError

        self._pool = pool
        self.block_bytes = pool.block_bytes
        self.slot_bytes = HEADER_BYTES + _round_up(self.block_bytes, ALIGN)
        count = len(dirs)
        total = int(capacity_bytes // self.slot_bytes) // count * count
        if total < pool.num_blocks:
            # ssd_cache_gb > cpu_cache_gb means an SSD tier that holds the host tier, but a
            # slot is a header and whole 4 KiB pages: in bytes, small blocks take several
            # times their size there. Fewer slots than host blocks and write_back's copies
            # outgrow the SSD, and a close cannot write down what only the host holds.
            need = -(-pool.num_blocks // count) * count * self.slot_bytes
            raise ConfigError(
                "store.ssd_cache_gb",
                f"{capacity_bytes / (1 << 30)!r} GiB holds {total} slots of "
                f"{self.slot_bytes} bytes (a {HEADER_BYTES}-byte header and the "
                f"{self.block_bytes}-byte block in whole 4 KiB pages) over {count} "
                f"director{'y' if count == 1 else 'ies'}, fewer than the host tier's "
                f"{pool.num_blocks} blocks; set at least {need / (1 << 30)!r} for these "
                f"caches",
            )
        geometry = {**geometry, "slot_bytes": self.slot_bytes}
        # O_DIRECT reads into and writes from the blocks themselves: each must start on
        # a 4 KiB boundary and be whole 4 KiB pages.
        direct = self.block_bytes % ALIGN == 0 and pool.block_stride % ALIGN == 0
        self.files = SsdFiles(
            dirs, total, geometry, direct=direct, reset_on_mismatch=reset_on_mismatch,
            held=held,
        )
        if not self.files.direct:
            log.info(
                "aiokv: SSD tier in %s uses buffered I/O with fdatasync (%s)",
                ", ".join(map(str, self.files.paths)),
                "a block is not a whole number of 4 KiB pages, or a remote tier's "
                "trailers keep blocks off 4 KiB boundaries"
                if not direct
                else "the filesystem refuses O_DIRECT",
            )
        self.stats = {"bytes_ssd_written": 0, "bytes_ssd_read": 0, "checksum_failures": 0,
                      "ssd_read_errors": 0, "ssd_write_errors": 0, "ssd_full_drops": 0,
                      # Header voids and new epochs the disk refused (ssd_voids counts).
                      "ssd_invalidation_errors": 0}
        # What still names a dropped key on disk, and its voids (ssd_voids says why).
        self.voids = HeaderVoids(self.files, notify, self.stats)
        self.tier = Tier("ssd", BlockAllocator(total), demote=self._recycled,
                         forget=self.voids.void_later)
        # Told the keys of slots the SSD's LRU gives to other keys: a host block of one
        # is the only copy from then on (the link marks it not clean).
        self.on_recycled: Callable[[list[Space], list[bytes]], None] | None = None
        # A slot's tail past its block: zeros to write, and a scratch buffer to read it
        # into (preadv needs writable buffers; what lands there is never looked at, so
        # the read threads share one).
        pad = self.slot_bytes - HEADER_BYTES - self.block_bytes
        self._pads = (bytes(pad), bytearray(pad)) if pad else None
        self._done: deque[SsdRequest] = deque()
        # Requests submitted and not drained yet: their slots may come back at their drain
        # (a write's become evictable, a read's hold goes), which the link waits for
        # rather than evict a block the SSD has no copy of (tiering: _demote).
        self.in_flight = 0
        self._notify = notify
        self._generation = 1
        # Each READY slot's header generation: the LRU order a close saves names them
        # (ssd_recency), so that the next open can tell the order still fits the disk.
        self._generations = np.zeros(total, dtype=np.int64)
        self._failures_logged = False
        try:
            self._recover()
        except BaseException:
            self.files.close()
            raise

    # ---- open ----------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the index from the headers (the newest header of each key wins), in
        the LRU order the last clean close saved where it still fits (ssd_recency)."""
        files = self.files
        saved = ssd_recency.take(files.paths[0])  # gone before anything is written
        best: dict[tuple[tuple[str, ...], bytes], tuple[int, int]] = {}
        for k in range(files.count):
            epoch = files.metas[k].epoch
            for j, raw in enumerate(files.scan_headers(k)):
                header = unpack_header(raw)
                if header is None or header.epoch != epoch:
                    continue
                key = (header.namespace, header.digest)
                slot = j * files.count + k
                if key in best:  # the older copy stays on disk, free: stale
                    older = min(best[key], (header.generation, slot))
                    self.voids.older_copy(older[1], header.namespace)
                if key not in best or best[key][0] < header.generation:
                    best[key] = (header.generation, slot)
                self._generation = max(self._generation, header.generation + 1)
        if not best:
            return
        by_space: dict[tuple[str, ...], list[tuple[int, bytes]]] = {}
        for (namespace, digest), (_, slot) in best.items():
            by_space.setdefault(namespace, []).append((slot, digest))
        tier = self.tier
        for namespace, entries in by_space.items():
            entries.sort()
            slots = np.array([s for s, _ in entries], dtype=np.int64)
            tier.index.insert(namespace, [d for _, d in entries], slots)
            tier.alloc.take(slots)
            tier.state[slots] = READY
        generations = np.array([g for g, _ in best.values()], dtype=np.int64)
        slots = np.array([s for _, s in best.values()], dtype=np.int64)
        self._generations[slots] = generations
        tier.index.make_evictable(ssd_recency.newest_first(
            saved, [m.epoch for m in files.metas], slots, generations, tier.num_blocks))
        log.info("aiokv: SSD tier recovered %d blocks from %s", len(best), files.paths)

    # ---- lookups -------------------------------------------------------------------

    def has(self, namespace: tuple[str, ...], digests: Sequence[bytes]) -> list[bool]:
        """Whether each digest is on SSD (or being written there)."""
        space = self.tier.index.space(namespace)
        if space is None:
            return [False] * len(digests)
        return [d in space for d in digests]

    # ---- requests ------------------------------------------------------------------

    def _recycled(self, slots: Int64Array, spaces: list[Space], digests: list[bytes]
                  ) -> Int64Array:
        kept = self.voids.recycled(slots, spaces, digests)
        if self.on_recycled is not None:
            self.on_recycled(spaces, digests)
        return kept

    def write(
        self, host_blocks: Int64Array, spaces: Sequence[Space], digests: Sequence[bytes],
        owner: Any,
    ) -> SsdRequest | None:
        """Start copying host blocks (held by the caller until it is done) to SSD. Blocks
        already there, or whose namespace does not fit a header, are left out, and so are
        those past the slots free or evictable now; None when nothing is written (then
        nothing will be reported)."""
        tier = self.tier
        keep = []
        encoded: dict[int, bytes | None] = {}
        for i, (space, digest) in enumerate(zip(spaces, digests, strict=True)):
            ns = encoded.get(id(space), b"")
            if ns == b"":
                ns = encoded[id(space)] = encode_namespace(space.key)
            sspace = tier.index.space(space.key)
            if ns is not None and (sspace is None or digest not in sspace):
                keep.append(i)
        # No more than the slots not being written or read (asked for all, a copy down
        # larger than that wrote nothing): the first ones, the host LRU's oldest.
        keep = keep[: tier.available()]
        if not keep:  # all there, or the SSD full of blocks being written or read
            return None
        if len(keep) != len(digests):
            host_blocks = host_blocks[keep]
            spaces = [spaces[i] for i in keep]
            digests = [digests[i] for i in keep]
        try:
            slots = tier.reserve(len(keep))
        except NoSpace:
            return None  # host-only for now
        # One table insert per namespace (usually one).
        starts = [0] + [i for i in range(1, len(spaces)) if spaces[i] is not spaces[i - 1]]
        for start, end in zip(starts, [*starts[1:], len(spaces)], strict=True):
            tier.index.insert(spaces[start].key, digests[start:end], slots[start:end])
        namespaces = [encoded[id(s)] or b"" for s in spaces]
        request = SsdRequest(True, slots, host_blocks, list(digests), namespaces, owner)
        self._submit(request)
        return request

    def read(
        self, slots: Int64Array, host_blocks: Int64Array, namespace: tuple[str, ...],
        digests: Sequence[bytes], owner: Any, keep: bool = False,
    ) -> list[SsdRequest]:
        """Start reading READY slots (held by the caller with ``tier.hold``; ``drain``
        drops that hold, except on the verified slots of a request whose ``keep`` is
        still set then) into host blocks, in chunks in order; each chunk is reported by
        ``drain`` with ``ok`` per block."""
        ns = encode_namespace(namespace) or b""
        per = max(1, READ_CHUNK_BYTES // self.slot_bytes)
        per = -(-len(slots) // -(-len(slots) // per))  # even chunks: 16 slots are 8 + 8
        requests = []
        for start in range(0, len(slots), per):
            end = min(start + per, len(slots))
            request = SsdRequest(
                False, slots[start:end], host_blocks[start:end], list(digests[start:end]),
                [ns] * (end - start), owner, keep,
            )
            requests.append(request)
            self._submit(request)
        return requests

    def _submit(self, request: SsdRequest) -> None:
        count = self.files.count
        n = len(request.slots)
        request.ok = np.zeros(n, dtype=np.bool_)
        request.unread = np.zeros(n, dtype=np.bool_)
        by_file = request.slots % count
        groups = [np.flatnonzero(by_file == k) for k in range(count)] if count > 1 else [
            np.arange(n)
        ]
        groups = [g for g in groups if len(g)]
        request.ops = len(groups)
        self.in_flight += 1
        generation = request.generation = self._generation
        self._generation += n
        for positions in groups:
            k = int(request.slots[positions[0]] % count)
            op = functools.partial(self._run, request, k, positions, generation)
            self.files.submit(k, op, read=not request.is_write)

    def _run(self, request: SsdRequest, k: int, positions: Int64Array, generation: int) -> None:
        """One file's share of a request (I/O thread): consecutive slots go in one
        request each; checksums are made before a write and checked after a read. A read
        that stops short reads the rest of its run again, slot by slot
        (:meth:`_read_singly`), and marks the slots that still do not come in whole
        ``unread`` (the others are checked); the next run is read all the same: one bad
        sector costs only the blocks on it."""
        files, pool = self.files, self._pool
        try:
            slots = request.slots[positions] // files.count
            cuts = np.flatnonzero(np.diff(slots) != 1) + 1
            for run in np.split(np.arange(len(positions)), cuts):
                idx = positions[run]
                headers = mmap.mmap(-1, HEADER_BYTES * len(idx))  # zeros: a void header
                views = memoryview(headers)
                buffers: list[Any] = []
                if request.is_write:
                    self._pack(request, k, idx, generation, views)
                for j, i in enumerate(idx.tolist()):
                    head = views[j * HEADER_BYTES : (j + 1) * HEADER_BYTES]
                    buffers += (head, pool.block_view(int(request.host_blocks[i])))
                    if self._pads is not None:
                        buffers.append(self._pads[not request.is_write])
                offset = int(slots[run[0]]) * files.slot_bytes
                if request.is_write:
                    # How many of the run's slots the write reached: a failed one may
                    # have made their headers; it left those past them as they were.
                    written, landed, reached = request.slots[idx].tolist(), False, len(idx)
                    try:
                        files.write(k, offset, buffers)
                        landed = True
                    except ShortIO as exc:  # (not a failed fdatasync: all went out)
                        reached = -(-exc.moved // files.slot_bytes)
                        raise
                    finally:
                        self.voids.written(written, landed, reached)
                    request.ok[idx] = True
                else:
                    read = np.ones(len(idx), dtype=np.bool_)  # slots read in whole
                    try:
                        files.read(k, offset, buffers)
                    except ShortIO as exc:
                        read = self._read_singly(k, offset, buffers, len(idx),
                                                 exc.moved // files.slot_bytes)
                        request.unread[idx[~read]] = True
                        log.warning("aiokv: SSD read failed in %s: %r; %d block(s) not "
                                    "read, dropped from the tier (misses)", files.paths[k],
                                    exc, len(idx) - int(np.count_nonzero(read)))
                    for j, i in enumerate(idx.tolist()):
                        if read[j]:
                            raw = views[j * HEADER_BYTES : (j + 1) * HEADER_BYTES]
                            request.ok[i] = self._intact(request, i, raw)
                # ``headers`` is left to the collector: the slices of it in ``buffers``
                # keep it exported, and closing it would raise.
        except Exception as exc:  # reported: the request fails, the thread lives on
            # (a write's I/O error; a read's ends in misses above, so a read fails here
            # only on a fault of ours, and fails its load rather than drop the blocks)
            log.warning("aiokv: SSD %s failed in %s: %r",
                        "write" if request.is_write else "read", files.paths[k], exc)
            request.error = f"SSD {'write' if request.is_write else 'read'} failed: {exc!r}"
        self._done.append(request)  # deque append is atomic
        self._notify()

    def _read_singly(self, k: int, offset: int, buffers: Sequence[Any], n: int, first: int
                     ) -> BoolArray:
        """After the read of a run of ``n`` slots at ``offset`` of file ``k`` stopped short
        at its slot ``first``: that slot and those past it read again one request each
        (I/O thread), so that only the slots the disk cannot give back are lost. Under
        O_DIRECT a request over one bad sector fails whole and brings none of the run,
        readable slots around it included (a run can be thousands of slots). Returns
        which of the run's slots came in whole."""
        files = self.files
        per = len(buffers) // n  # a slot's buffers: header, block and its pad if any
        read = np.zeros(n, dtype=np.bool_)
        read[:first] = True
        for j in range(first, n):
            try:
                files.read(k, offset + j * files.slot_bytes, buffers[j * per : (j + 1) * per])
            except ShortIO:
                continue
            read[j] = True
        return read

    def _pack(self, request: SsdRequest, k: int, idx: Int64Array, generation: int,
              views: memoryview) -> None:
        """Make the headers of a run of a write (I/O thread): a slot whose key was
        dropped before keeps its zero header (the write lands naming nothing); the
        others are running from now on (a drop meanwhile voids them right after this
        write: :meth:`.HeaderVoids.claim`)."""
        positions = idx.tolist()
        named, epoch = self.voids.claim([int(request.slots[i]) for i in positions], k)
        for j, (i, name) in enumerate(zip(positions, named, strict=True)):
            if name:
                data = self._pool.block_view(int(request.host_blocks[i]))
                pack_header(views[j * HEADER_BYTES : (j + 1) * HEADER_BYTES],
                            epoch, generation + i, checksum(data),
                            request.digests[i], request.namespaces[i])

    def _intact(self, request: SsdRequest, i: int, raw: memoryview) -> bool:
        """Whether block ``i`` of a read came back as written: its header names it and
        its bytes match the header's checksum."""
        head = unpack_header(raw)
        return (
            head is not None
            and head.digest == request.digests[i]
            and encode_namespace(head.namespace) == request.namespaces[i]
            and head.data_sum == checksum(self._pool.block_view(int(request.host_blocks[i])))
        )

    # ---- completion (store thread) -------------------------------------------------

    def drain(self) -> list[SsdRequest]:
        """Finished requests, SSD side applied: written slots READY (or rolled back),
        read slots released, slots that failed their checks or could not be read dropped
        (counted: ``checksum_failures``, ``ssd_read_errors``)."""
        out = []
        done, tier, stats = self._done, self.tier, self.stats
        while done:
            request = done.popleft()
            request.arrived += 1
            if request.arrived < request.ops:
                continue
            self.in_flight -= 1
            slots = request.slots
            if request.is_write:
                if request.error is None:
                    self.voids.applied(slots.tolist())
                    tier.state[slots] = READY
                    self._generations[slots] = request.generation + np.arange(len(slots))
                    tier.index.make_evictable(slots)
                    stats["bytes_ssd_written"] += len(slots) * self.block_bytes
                else:
                    stats["ssd_write_errors"] += 1
                    # Parts of it may have landed, naming the key: voided before the
                    # slots go back (a write that reuses one queues behind the void).
                    self.voids.failed(slots)
                    for i, slot in enumerate(slots.tolist()):
                        space, _ = tier.index.key_of(slot)
                        tier.roll_back(space, [request.digests[i]], slots[i : i + 1])
            else:
                # Slots a drop voided while they were read fail by design: not damage.
                # (Known before drop_readers, which may free them and end their record.)
                voided = self.voids.voided_mask(slots)
                if request.error is not None:
                    request.ok[:] = False
                tier.drop_readers(slots[~request.ok] if request.keep else slots)
                if request.error is None:
                    unread = request.unread
                    stats["bytes_ssd_read"] += (len(slots) - int(np.count_nonzero(unread))
                                                ) * self.block_bytes
                    damaged = ~request.ok if voided is None else ~(request.ok | voided)
                    bad = slots[damaged]
                    if len(bad):
                        lost = int(np.count_nonzero(damaged & unread))
                        stats["ssd_read_errors"] += lost
                        if len(bad) > lost:
                            self._checksum_failures(request, len(bad) - lost)
                        self.voids.void(tier.drop_idle(np.sort(bad)))
            out.append(request)
        if tier.buried:  # written slots of a dropped key: listed above, past the tier
            tier.sweep()
        return out

    def _checksum_failures(self, request: SsdRequest, count: int) -> None:
        self.stats["checksum_failures"] += count
        if not self._failures_logged:
            self._failures_logged = True
            log.warning(
                "aiokv: %d SSD block(s) in %s failed their checksum; they are misses "
                "(counted in engine.stats().checksum_failures and the metric "
                "aiokv_store_errors_total{error=\"checksum\"}; logged once)",
                count, self.files.paths,
            )

    # ---- invalidation --------------------------------------------------------------

    def begin_clear(self) -> None:
        """A clear's first step, taken before any tier drops anything (the stores'
        clear, :meth:`drop_namespace`): a new epoch in every meta file, which voids
        every header made before; the drop voids those made since. OSError (naming what
        to do) when a meta file cannot be written (the disk full, the directory read
        only): then the clear must drop nothing, in any tier.

        Why nothing: a clear's only durable form is that epoch. Dropped from memory
        with the old epoch still current, every block's header on disk still names its
        key: a restart serves the cleared keys again, and a key stored again meanwhile
        comes back as its new pages followed by cleared ones (new and old headers are
        both current, under distinct digests): data the caller never stored together.
        (An evict voids its key's headers one by one, and where even that fails keeps
        them listed to void again; a clear would have every slot's header to void.) Kept
        whole, the tiers serve what they served before, which the failed clear told the
        caller, who may clear again; where some directories took the new epoch before
        one refused it, their blocks are misses after a restart (forgotten, never
        brought back). Once written, the epoch serves until the drop: called again
        before it (a clear that failed after this step), nothing more is written."""
        if self.voids.clear_begun:  # and not dropped yet: its epoch still serves
            return
        self.voids.begin_clear()  # before the epoch: a header made with it is tracked
        try:
            self.files.new_epoch()
        except OSError as exc:
            self.voids.abort_clear()  # no new epoch to drop under: none tracked
            self.voids.refused()
            raise OSError(
                exc.errno or errno.EIO,
                "the SSD tier could not write its new epoch in "
                f"{', '.join(map(str, self.files.paths))} "
                f"({exc!r}), which alone keeps a restart from finding what a clear drops: "
                "nothing was cleared, in any tier; clear again once the disk is well",
            ) from exc

    def drop_namespace(self, namespace: tuple[str, ...] | None) -> VoidsDone:
        """Forget one namespace's slots (None: all; Tier.drop_namespace) and void them on
        disk (None: under the new epoch of :meth:`begin_clear`, which the clear's entry
        point, LocalStore._drop or the shared Answers._invalidate, has written before
        any tier dropped anything). Returns an event set once no slot on disk names the
        namespace's blocks, so that a restart, even after a kill -9, does not find them
        again (or once its ``failure`` says
        why one may: :mod:`.ssd_voids`); that takes moments, not the writes queued
        before (their lanes are not waited for):

        - idle slots, and slots a held lookup or a read still uses (that read then
          fails, as a load of a dropped key should): voided ahead of the queued writes;
        - slots being written whose header is not made yet: the write makes it void
          (it lands, naming nothing);
        - slots whose write is running now: voided right after it, ahead of the rest;
        - slots taken for another key whose write has not landed (their old header
          names this one): voided ahead of that write, unless it landed first."""
        # A clear's every older header is void at once, by the epoch its entry point
        # wrote first: dropping without it would leave them all naming their keys.
        assert namespace is not None or self.voids.clear_begun, "clear not begun"
        tier = self.tier
        buried = len(tier.buried)
        dropped = tier.drop_namespace(namespace)
        in_use = [s for space in tier.buried[buried:] for s in space.values()]
        return self.voids.drop(namespace, dropped,
                               [s for s in in_use if tier.state[s] == WRITING],
                               [s for s in in_use if tier.state[s] == READY])

    def stop(self) -> None:
        """Finish the queued requests (:meth:`drain` applies them after); voids queued
        from now on are written at once, on the caller's thread."""
        self.files.stop()

    def close(self) -> None:
        """Stop (if not yet), save the LRU order for the next open, close the files."""
        try:
            self.files.stop()
            self._save_order()
        finally:
            self.files.close()
            self.voids.close()

    def _save_order(self) -> None:
        """The evictable slots, least recently used first (ssd_recency): slots held now
        are left out; the next open ranks them above these."""
        index = self.tier.index
        slots = index.oldest(index.evictable)
        try:
            ssd_recency.save(self.files.paths[0], [m.epoch for m in self.files.metas],
                             slots, self._generations[slots])
        except OSError as exc:  # the next open ranks by generation: slower, not wrong
            log.warning("aiokv: cannot save the SSD tier's LRU order in %s (%r)",
                        self.files.paths[0], exc)

