"""The embedded store's side of the remote tier: what it holds for the writer, what a
lookup that misses the host tier fetches, and invalidation. Store thread only.

The store calls four things: :meth:`RemoteLink.offer` after a put's host copy (the
blocks are held as readers, so that eviction cannot reuse them while they are sent, and
given back in :meth:`drain`), :meth:`fill` at the start of a lookup (a miss in the host
tier asks Mooncake; what arrives whole becomes ordinary host blocks, and the lookup goes
on as if they had always been there), :meth:`invalidate` from evict and clear, and
:meth:`drain` whenever it looks at finished work.

A lookup waits ``timeout_ms`` at most for each of its two calls (which blocks Mooncake
has, then their values); a later answer is dropped, and while the reader thread is still
busy with it the next lookups miss at once rather than queue behind it. Host blocks that
a late fetch still writes into stay reserved until it returns.
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
from ..stores.local.index import chain_digests
from ..stores.local.pool import HostPool
from .client import RemoteIO, WriteJob
from .config import RemoteConfig
from .keys import Keys, geometry_tag, namespace_tag
from .native import unavailable

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
        self.stats_ = {
            "remote_lookups": 0, "remote_hits": 0, "remote_misses": 0,
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
            if io.submit_write(WriteJob(self._tag(space.key), list(task.digests), blocks)):
                self._held += len(blocks)
            else:
                host.drop_readers(blocks)
                self.stats_["remote_dropped_queue"] += len(blocks)

    def drain(self) -> None:
        """Give back the blocks of finished writes and of late fetches that returned."""
        for blocks in self.io.finished():
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

    def fill(self, namespace: tuple[str, ...], token_ids: Int64Array,
             below: Callable[[tuple[str, ...], list[bytes]], list[bool]] | None = None) -> None:
        """Bring the pages the host tier lacks, from the first one on, into host blocks
        where Mooncake has them. ``below``: the SSD tier's ``has``; when it holds the
        first missing page, the SSD path serves the lookup and Mooncake is not asked."""
        digests = chain_digests(token_ids, self._page_size)
        space = self._host.index.space(namespace)
        found = list(map(space.get, digests)) if space is not None else [None] * len(digests)
        if None not in found:
            return
        start = found.index(None)
        end = next((i for i in range(start, len(found)) if found[i] is not None), len(found))
        wanted = digests[start:end]
        if below is not None and below(namespace, wanted[:1])[0]:
            return
        began = time.monotonic()
        stats = self.stats_
        stats["remote_lookups"] += 1
        arrived = self._fill(namespace, wanted)
        spent = time.monotonic() - began
        stats["remote_lookup_seconds_total"] += spent
        stats["remote_lookup_seconds_max"] = max(stats["remote_lookup_seconds_max"], spent)
        stats["remote_hits" if arrived else "remote_misses"] += 1
        stats["remote_blocks_read"] += arrived
        stats["remote_bytes_read"] += arrived * self.io.block_bytes

    def _fill(self, namespace: tuple[str, ...], wanted: list[bytes]) -> int:
        io, host = self.io, self._host
        if io.resting() or (self._busy is not None and not self._busy.done()):
            return 0
        ns = self._tag(namespace)
        keys: list[str] = self._wait(io.submit_read(io.leading, ns, wanted)) or []
        count = min(len(keys), host.available())
        if not count:
            return 0
        try:
            blocks = host.reserve(count)
        except NoSpace:
            return 0
        future = io.submit_read(io.fetch, keys[:count], blocks.tolist())
        arrived: int | None = self._wait(future)
        if arrived is None:  # it may still write into them: free once it returns
            self._late.append((future, blocks))
            return 0
        if arrived:
            kept = blocks[:arrived]
            host.index.insert(namespace, wanted[:arrived], kept)
            host.publish([kept], kept, arrived)
        if arrived < count:
            host.free(np.sort(blocks[arrived:]))
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
        for blocks in io.cancel_writes(None if namespace is None else self._tag(namespace)):
            self._give_back(blocks)
        if not io.wait_writes(self._timeout_s):
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
        stats["remote_write_queue_blocks"] = io.queued_blocks
        stats["remote_blocks_held"] = self._held  # host blocks waiting for their write
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
