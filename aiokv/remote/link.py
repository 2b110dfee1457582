"""The embedded store's side of the remote tier: what it holds for the writer, what a
lookup that misses the host tier fetches, and invalidation. Store thread only.

The store calls four things: :meth:`RemoteLink.offer` after a put's host copy (the
blocks are held as readers, so that eviction cannot reuse them while they are sent, and
given back in :meth:`drain`), :meth:`fill` at the start of a lookup (a miss in the host
tier asks Mooncake; what arrives whole becomes ordinary host blocks, and the lookup goes
on as if they had always been there), :meth:`invalidate` from evict and clear, and
:meth:`drain` whenever it looks at finished work.

Where the host tier has free blocks for every page a batch of lookups misses, they are
reserved first and one call asks Mooncake for the values themselves (an absent one
answers for itself); where it would have to evict for them, a first call asks which
blocks Mooncake has, and only those are reserved and read. A lookup waits ``timeout_ms``
at most for each call; a later answer is dropped, and while the reader thread is still
busy with it the next lookups miss at once rather than queue behind it. Host blocks that
a late read still writes into stay reserved until it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..stores.base import Int64Array, NoSpace
from ..stores.local.blocks import Tier
from ..stores.local.digests import chain_digests
from ..stores.local.pool import HostPool
from .client import RemoteIO
from .config import RemoteConfig
from .keys import Keys, geometry_tag, namespace_tag
from .native import unavailable
from .queue import WriteJob

Below = Callable[[tuple[str, ...], list[bytes]], list[bool]] | None
_CLOSE_FLUSH_S = 10.0  # close() finishes queued writes for this long at most


class RemoteLink:
    """The remote tier of one LocalStore; ConfigError (store.remote) where Mooncake's
    client cannot be loaded."""

    def __init__(
        self,
        config: RemoteConfig,
        host: Tier,
        pool: HostPool,
        dtype: torch.dtype,
        page_size: int,
        wake: Callable[[], None],
    ) -> None:
        reason = unavailable()
        if reason is not None:
            raise ConfigError("store.remote", reason)
        self._host = host
        self._page_size = page_size
        self._timeout_s = config.timeout_ms / 1000
        block_shape = tuple(pool.data.shape[1:])
        memory = pool.memory.raw
        self.io = RemoteIO(
            config,
            Keys(geometry_tag(block_shape, dtype, page_size)),
            (memory.data_ptr(), memory.numel()),
            pool.block_bytes,
            pool.num_blocks,
            pool.block_view,
            wake,
        )
        self._tags: dict[tuple[str, ...], str] = {}
        self._late: list[tuple[Future[Any], Int64Array]] = []  # fetches past their wait
        self._busy: Future[Any] | None = None  # the reader's call that outlived its wait
        self._held = 0  # host blocks held by writes
        self._asked: set[tuple[str, ...]] = set()  # namespaces asked in this batch
        self.stats_ = {
            "remote_lookups": 0, "remote_lookup_waits": 0, "remote_hits": 0, "remote_misses": 0,
            "remote_blocks_read": 0, "remote_bytes_read": 0, "remote_timeouts": 0,
            "remote_dropped_queue": 0, "remote_dropped_resting": 0,
            "remote_invalidation_errors": 0, "remote_call_errors": 0,
            "remote_lookup_seconds_total": 0.0, "remote_lookup_seconds_max": 0.0,
        }

    def _tag(self, namespace: tuple[str, ...]) -> str:
        tag = self._tags.get(namespace)
        if tag is None:
            if len(self._tags) > 65536:
                self._tags.clear()
            tag = self._tags[namespace] = namespace_tag(namespace)
        return tag

    # ---- writes --------------------------------------------------------------------

    def offer(self, tasks: Sequence[Any]) -> None:
        """Puts whose host copy is done (their blocks READY, in the index): send their
        new blocks to Mooncake in the background, or drop them (counted) when the queue
        is full or the tier rests."""
        host, io = self._host, self.io
        for task in tasks:
            blocks, space = task.blocks, task.space
            if not len(blocks) or space is None:
                continue
            if io.resting():
                self.stats_["remote_dropped_resting"] += len(blocks)
                continue
            # Held first: once queued, the writer may read them at any moment.
            host.readers[blocks] += 1
            host.index.make_unevictable(blocks)
            if io.queue.put(WriteJob(self._tag(space.key), list(task.digests), blocks)):
                self._held += len(blocks)
            else:
                host.drop_readers(blocks)
                self.stats_["remote_dropped_queue"] += len(blocks)

    def drain(self) -> None:
        """Give back the blocks of finished writes and of late fetches that returned."""
        for blocks in self.io.queue.finished():
            self._give_back(blocks)
        if self._late:
            done = [(f, b) for f, b in self._late if f.done()]
            if done:
                self._late = [(f, b) for f, b in self._late if not f.done()]
                for _, blocks in done:
                    self._host.free(np.sort(blocks))

    def _give_back(self, blocks: Int64Array) -> None:
        self._held -= len(blocks)
        self._host.drop_readers(blocks)

    # ---- reads ---------------------------------------------------------------------

    def fill(self, queries: Sequence[tuple[Int64Array, Sequence[str]]], below: Below = None,
             batch: bool = False) -> None:
        """Bring the pages the host tier lacks, from each query's first missing one on,
        into host blocks where Mooncake has them: one existence call and one read for
        all the queries. ``below``: the SSD tier's ``has``; a query whose first missing
        page it holds is left to the SSD path. ``batch``: the queries of a batch of
        lookups, whose namespaces are then not asked again until :meth:`forget`."""
        wanted: list[tuple[tuple[str, ...], list[bytes]]] = []
        for token_ids, namespace in queries:
            key = tuple(namespace)
            if key in self._asked:
                continue
            if batch:
                self._asked.add(key)
            digests = self._missing(key, token_ids)
            if digests and (below is None or not below(key, digests[:1])[0]):
                wanted.append((key, digests))
        if not wanted:
            return
        began = time.monotonic()
        arrived = self._fill(wanted)
        spent = time.monotonic() - began
        stats = self.stats_
        stats["remote_lookups"] += len(wanted)
        stats["remote_lookup_waits"] += 1
        stats["remote_lookup_seconds_total"] += spent
        stats["remote_lookup_seconds_max"] = max(stats["remote_lookup_seconds_max"], spent)
        hits = sum(map(bool, arrived))
        stats["remote_hits"] += hits
        stats["remote_misses"] += len(wanted) - hits
        stats["remote_blocks_read"] += sum(arrived)
        stats["remote_bytes_read"] += sum(arrived) * self.io.block_bytes

    def forget(self) -> None:
        self._asked.clear()

    def _missing(self, key: tuple[str, ...], token_ids: Int64Array) -> list[bytes]:
        """The digests of the host tier's first gap in this query's pages."""
        digests = chain_digests(token_ids, self._page_size)
        space = self._host.index.space(key)
        if space is None:
            return digests
        found = list(map(space.get, digests))
        if None not in found:
            return []
        start = found.index(None)
        end = next((i for i in range(start, len(found)) if found[i] is not None), len(found))
        return digests[start:end]

    def _fill(self, wanted: list[tuple[tuple[str, ...], list[bytes]]]) -> list[int]:
        """Blocks that arrived, per wanted range."""
        io, host = self.io, self._host
        none = [0] * len(wanted)
        if io.resting() or (self._busy is not None and not self._busy.done()):
            return none
        asked = [(self._tag(key), digests) for key, digests in wanted]
        total = sum(len(digests) for _, digests in wanted)
        if total <= host.alloc.num_free:  # room without evicting: one call
            blocks = host.reserve(total)
            return self._place(wanted, blocks, [len(d) for _, d in wanted],
                               io.submit_read(io.read, asked, blocks.tolist()))
        present: list[list[str]] = self._wait(io.submit_read(io.leading, asked)) or [
            [] for _ in wanted
        ]
        # Earlier queries first, as far as the host tier has room.
        room = host.available()
        counts = []
        for keys in present:
            counts.append(min(len(keys), room))
            room -= counts[-1]
        total = sum(counts)
        if not total:
            return none
        try:
            blocks = host.reserve(total)
        except NoSpace:
            return none
        keys = [key for group, count in zip(present, counts, strict=True) for key in group[:count]]
        return self._place(wanted, blocks, counts,
                           io.submit_read(io.fetch, keys, blocks.tolist(), counts))

    def _place(self, wanted: list[tuple[tuple[str, ...], list[bytes]]], blocks: Int64Array,
               counts: list[int], future: Future[Any]) -> list[int]:
        """Wait for a read into ``blocks`` (``counts`` of them per wanted range, in
        order) that answers, per range, how many leading ones arrived good. Those are
        indexed and published; the rest is freed. Blocks arrived, per range."""
        host = self._host
        good: list[int] | None = self._wait(future)
        if good is None:  # it may still write into them: free once it returns
            self._late.append((future, blocks))
            return [0] * len(wanted)
        arrived, unused, at = [], [], 0
        for (key, digests), count, n in zip(wanted, counts, good, strict=True):
            mine = blocks[at : at + count]
            at += count
            if n:
                host.index.insert(key, digests[:n], mine[:n])
                host.publish([mine[:n]], mine[:n], n)
            unused.append(mine[n:])
            arrived.append(n)
        host.free(np.sort(np.concatenate(unused)))
        return arrived

    def _wait(self, future: Future[Any]) -> Any:
        try:
            return future.result(self._timeout_s)
        except FutureTimeout:
            self.stats_["remote_timeouts"] += 1
            self._busy = future
            return None
        except Exception as exc:  # the client raised: counted, a miss
            self.stats_["remote_call_errors"] += 1
            self.io.rest("a call", exc)
            return None

    # ---- invalidation ---------------------------------------------------------------

    def invalidate(self, namespace: tuple[str, ...] | None) -> None:
        """Before the host tier drops a namespace (None: everything): queued writes of it
        are taken back, the one being written is waited for (so that its blocks can be
        dropped), this host moves to a new generation (or epoch) at once, and the marker
        that tells the other hosts, plus a best-effort remove, follow on the reader."""
        io = self.io
        for blocks in io.queue.cancel(None if namespace is None else self._tag(namespace)):
            self._give_back(blocks)
        if not io.queue.wait_idle(self._timeout_s):
            self.stats_["remote_invalidation_errors"] += 1
        self.drain()
        ns = None if namespace is None else self._tag(namespace)
        epoch, generation = io.keys.current(ns or "")
        if ns is None:
            io.keys.advance("", epoch + 1, 0)
        else:
            io.keys.advance(ns, epoch, generation + 1)
        published = self._wait(io.submit_read(io.invalidate, ns, epoch, generation))
        if not published:
            self.stats_["remote_invalidation_errors"] += 1

    # ---- stats, close ----------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        io = self.io
        stats: dict[str, int | float] = {**self.stats_, **io.write_stats, **io.read_stats}
        stats["remote_write_queue_blocks"] = io.queue.queued_blocks
        stats["remote_blocks_held"] = self._held  # host blocks waiting for their write
        # Lookups' tokens read from Mooncake into the host tier (LocalStore.store_stats
        # takes them out of host_hit_tokens: each hit is counted on one tier).
        stats["remote_hit_tokens"] = stats["remote_blocks_read"] * self._page_size
        stats["remote_dropped_writes"] = (
            stats["remote_dropped_queue"] + stats["remote_dropped_resting"]
            + stats["remote_dropped_full"] + stats["remote_dropped_down"]
        )
        stats["remote_errors"] = (
            stats["remote_read_errors"] + stats["remote_write_errors"]
            + stats["remote_timeouts"] + stats["remote_invalidation_errors"]
            + stats["remote_call_errors"]
        )
        return stats

    def close(self) -> None:
        """Finish the queued writes (bounded), then stop. Before the pool goes."""
        self.io.close(_CLOSE_FLUSH_S)
        self.drain()
