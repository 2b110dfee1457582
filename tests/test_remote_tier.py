"""The remote tier on a real Mooncake Store: a master and a store process on 127.0.0.1
(conftest's ``mooncake``, for the session), and hosts that share nothing but Mooncake: a child
process (tests/remote_host.py) and engines in this process, each with a host tier of its
own. Skips only where Mooncake's client cannot load at all; in CI (``make test``
installs it) it must run."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import wait as futures_wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import (
    Gate,
    exits_cleanly_never_closed,
    held,
    needs_mooncake,
    offers_once_learned,
    one_batch,
)
from pinning import pin_in_chunks
from prometheus_client import CollectorRegistry
from remote_host import HEAD_DIM, HEADS, LAYERS, PAGE_SIZE, PAGES, ChildHost
from remote_local import TOKENS, USER_PAGES, LocalHost, close_woken, until

import aiokv
import aiokv.metrics
from aiokv.remote import connection as remote_connection
from aiokv.remote.caller import CallThread
from aiokv.remote.client import RemoteIO
from aiokv.remote.connection import NOT_READY
from aiokv.remote.keys import Keys, geometry_tag, namespace_tag
from aiokv.remote.markers import Markers
from aiokv.remote.native import import_store
from aiokv.remote.queue import WriteQueue
from aiokv.remote.servers import MooncakeServers, free_port
from aiokv.remote.values import Values
from aiokv.remote.writer import Writer
from aiokv.stores.local.digests import chain_digests

pytestmark = needs_mooncake()

# For a fresh host whose first lookup must answer (it waits behind the connect), also on a
# loaded machine: a lookup that times out is a miss (the default timeout_ms is 500 ms).
FRESH_MS = 20_000


def offload_until_one_reaches(a: LocalHost, b: LocalHost, first_user: int, why: str) -> None:
    """``a`` offloads fresh users from ``first_user`` on until ``b`` loads one whole from
    the remote tier (within 60 s): after an outage, a write offered while ``a``'s tier
    still rests (its backoff) is dropped, as designed."""
    deadline = time.monotonic() + 60
    for user in itertools.count(first_user):
        assert a.offload(user) == TOKENS
        settle = time.monotonic() + 3
        while time.monotonic() < settle and b.load(user) != (TOKENS, True):
            time.sleep(0.05)
        if b.load(user) == (TOKENS, True):
            return
        assert time.monotonic() < deadline, why


def closed_once_written(host: LocalHost, blocks: int) -> dict[str, Any]:
    """``host`` closed once its remote tier has written ``blocks`` blocks (its figures):
    a close gives a write batch under way timeout_ms (500 ms here), which a loaded
    host's batch can take, and then leaves it unwritten (the CI runner saw it so)."""
    until(lambda: host.stats()["remote_blocks_written"] >= blocks)
    return host.close()


def test_hosts_share_blocks_and_an_evict_reaches_every_host(mooncake: MooncakeServers) -> None:
    a = ChildHost(mooncake.master)
    try:
        assert a("offload", user=1, pages=USER_PAGES) == {"stored": TOKENS}
        assert a("offload", user=2, pages=USER_PAGES) == {"stored": TOKENS}
        # Seen written first: the restart's close gives a write batch under way
        # timeout_ms (500 ms) and drops what is queued behind it.
        until(lambda: a("stats")["remote_blocks_written"] >= 2 * USER_PAGES)
        a("restart")  # A's host tier starts empty
        b = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
        try:
            assert b.load(1) == (TOKENS, True)  # remote -> host -> pages, bit for bit
            assert b.kv.evict(1) == TOKENS
            assert b.load(1)[0] == 0
            stats = b.stats()
        finally:
            b.close()
        assert stats["remote_blocks_read"] == USER_PAGES
        assert stats["remote_bytes_read"] > 0 and stats["remote_errors"] == 0
        assert a("load", user=1, pages=USER_PAGES)["cached"] == 0  # evicted by B
        assert a("load", user=2, pages=USER_PAGES) == {
            "cached": TOKENS, "loaded": TOKENS, "exact": True,
        }
    finally:
        a.close()


# With 128 KiB blocks the eight users' 64 blocks are 8 MiB, past the size at which a
# batch's checksums are split over threads, on the writer and on the reader alike.
@pytest.mark.parametrize(("head_dim", "remote"), [(HEAD_DIM, {}),
                                                  (1024, {"checksum_threads": 3})])
def test_a_batch_of_lookups_on_a_cold_host_brings_every_user(
    mooncake: MooncakeServers, head_dim: int, remote: dict[str, Any]
) -> None:
    users = range(61, 69) if head_dim == HEAD_DIM else range(81, 89)
    # Bytes, not timing: a busy box must not turn the batch's reads into timed-out misses.
    remote = {**remote, "timeout_ms": 20000}
    a = LocalHost(mooncake.master, head_dim=head_dim, **remote)
    for user in users:
        assert a.offload(user) == TOKENS
        # Writes hold at most half the host tier (here 40 of 81 large blocks): one user
        # at a time, none is dropped.
        until(lambda: a.stats()["remote_blocks_held"] == 0)
    assert a.close()["remote_blocks_written"] == len(users) * USER_PAGES
    b = LocalHost(mooncake.master, head_dim=head_dim, **remote)
    try:
        hits = [f.result() for f in [b.kv.submit_lookup(user, TOKENS) for user in users]]
        assert [hit.cached_tokens for hit in hits] == [TOKENS] * len(users)
        target = torch.arange(PAGES - USER_PAGES, PAGES)
        for user, hit in zip(users, hits, strict=True):
            assert b.kv.load(hit, target).loaded_tokens == TOKENS
            assert all(torch.equal(cache[target], kv)
                       for cache, kv in zip(b.caches, b.kv_of(user), strict=True))
    finally:
        b.close()
    assert b.kv.stats().remote_checksum_failures == 0


def test_large_blocks_travel_bit_exact_and_are_evicted_too(mooncake: MooncakeServers) -> None:
    # 512 KiB blocks: the host pool keeps 4 KiB of room after each for its checksum (the
    # SSD tier's alignment), where the other tests' small blocks keep a cache line.
    a = LocalHost(mooncake.master, head_dim=4096)
    assert a.offload(95) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    b = LocalHost(mooncake.master, head_dim=4096, timeout_ms=FRESH_MS)
    try:
        assert b.load(95) == (TOKENS, True)
    finally:
        b.close()
    read = b.kv.stats()
    assert (read.remote_hits, read.remote_checksum_failures) == (1, 0)
    # A fresh host: its evict's marker goes out behind its connect, and neither the evict
    # nor the close waits past timeout_ms for it (then C would still read the user).
    b = LocalHost(mooncake.master, head_dim=4096, timeout_ms=FRESH_MS)
    try:
        assert b.kv.evict(95) == 0  # nothing on B's host tier; the remote tier moves on
    finally:
        b.close()
    # A host that learns it from the marker.
    c = LocalHost(mooncake.master, head_dim=4096, timeout_ms=FRESH_MS)
    try:
        assert c.load(95)[0] == 0
    finally:
        c.close()


def test_a_host_tier_full_of_its_own_blocks_still_takes_a_remote_hit(
    mooncake: MooncakeServers,
) -> None:
    # 128 KiB blocks: 0.01 GB is 81 of them, fewer than B's own 24 users' 192.
    a = LocalHost(mooncake.master, head_dim=1024)
    assert a.offload(91) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    # Its lookup of A's user must hit: a read that a loaded box keeps past the default
    # 500 ms would be a miss.
    b = LocalHost(mooncake.master, head_dim=1024, timeout_ms=FRESH_MS)
    try:
        for user in range(300, 324):
            assert b.offload(user) == TOKENS
        # Until written to Mooncake (or dropped: writes hold at most half the tier), B's
        # blocks cannot be evicted (a load then finds less room: a shorter hit, which is
        # not what this test is about). No offload waited for them.
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        stats = b.stats()  # full: room for A's blocks means evicting some of B's
        assert stats["remote_blocks_written"] + stats["remote_dropped_writes"] == (
            24 * USER_PAGES)
        assert stats["host_blocks_used"] == stats["host_blocks_total"] < 24 * USER_PAGES
        assert b.load(91) == (TOKENS, True)
        assert b.load(300 + 23) == (TOKENS, True)  # its own newest, still on the host
    finally:
        b.close()
    assert b.kv.stats().remote_hits >= 1


def test_a_lookup_keeps_its_host_prefix_while_it_reads_the_rest_from_mooncake(
    mooncake: MooncakeServers,
) -> None:
    # B holds user 92's first half, the least recently used blocks of its full host tier;
    # Mooncake has all of it (A's). The room for the second half is made by evicting:
    # that took the lookup's own first half, and the lookup found 0 tokens.
    a = LocalHost(mooncake.master, head_dim=1024)
    assert a.offload(92) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    # 16 blocks of 128 KiB: what B writes to the session's Mooncake store stays small (a
    # store near full evicts the values later tests read).
    # (A generous timeout_ms: the lookup must hit, not miss behind a loaded box's read.)
    b = LocalHost(mooncake.master, head_dim=1024, cpu_cache_gb=16 * 128 / 2**20,
                  timeout_ms=FRESH_MS)
    try:
        half = USER_PAGES // 2
        for cache, kv in zip(b.caches, b.kv_of(92), strict=True):
            cache[:half] = kv[:half]
        assert b.kv.offload(92, torch.arange(half), half * PAGE_SIZE).stored_tokens > 0
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        left = b.stats()["host_blocks_total"] - half  # filled exactly: nothing evicted yet
        user = 500
        while left:
            pages = min(USER_PAGES, left)
            stored = b.kv.offload(user, torch.arange(pages), pages * PAGE_SIZE).stored_tokens
            assert stored == pages * PAGE_SIZE
            until(lambda: b.stats()["remote_blocks_held"] == 0)
            left -= pages
            user += 1
        stats = b.stats()
        assert stats["host_blocks_used"] == stats["host_blocks_total"]
        assert b.load(92) == (TOKENS, True)
    finally:
        b.close()


def _load_both(host: LocalHost, hits: list[Any]) -> list[list[torch.Tensor]]:
    """Load two hits of one batch into the two halves of the pages: each one's KV."""
    targets = [torch.arange(PAGES - 2 * USER_PAGES, PAGES - USER_PAGES),
               torch.arange(PAGES - USER_PAGES, PAGES)]
    loads = [host.kv.submit_load(hit, target) for hit, target in zip(hits, targets, strict=True)]
    assert [f.result().loaded_tokens for f in loads] == [TOKENS, TOKENS]
    return [[cache[target] for cache in host.caches] for target in targets]


def test_lookups_of_one_namespace_in_a_batch_each_bring_their_own_pages(
    mooncake: MooncakeServers,
) -> None:
    # Prefix caching: two prompts of one namespace sharing their first two pages. On a
    # cold host, only the batch's first lookup asked Mooncake; the other missed, uncounted.
    namespace = ["remote-tier-prompts"]
    prompts = [torch.arange(7000, 7000 + TOKENS), torch.arange(7000, 7000 + TOKENS)]
    prompts[1][2 * PAGE_SIZE :] += 10_000
    a = LocalHost(mooncake.master)
    kvs = [a.kv_of(740), a.kv_of(741)]
    for first, second in zip(*kvs, strict=True):
        second[:2] = first[:2]  # the shared prefix's KV
    for prompt, kv in zip(prompts, kvs, strict=True):
        for cache, layer in zip(a.caches, kv, strict=True):
            cache[:USER_PAGES] = layer
        a.kv.offload(740, torch.arange(USER_PAGES), TOKENS, token_ids=prompt, namespace=namespace)
    assert closed_once_written(a, 2 * USER_PAGES - 2)["remote_blocks_written"] == 2 * USER_PAGES - 2
    b = LocalHost(mooncake.master, engine=one_batch(2), timeout_ms=FRESH_MS)
    try:
        hits = [f.result() for f in [b.kv.submit_lookup(742 + i, TOKENS, token_ids=prompt,
                                                        namespace=namespace)
                                     for i, prompt in enumerate(prompts)]]
        assert [hit.cached_tokens for hit in hits] == [TOKENS, TOKENS]
        loaded = _load_both(b, hits)
        assert all(torch.equal(got, want) for kv, layers in zip(kvs, loaded, strict=True)
                   for got, want in zip(layers, kv, strict=True))
        stats = b.stats()
    finally:
        b.close()
    assert b.kv.stats().batches == 2  # the lookups, then the loads
    # The shared pages are read once, into one host copy.
    assert (stats["remote_lookups"], stats["remote_hits"], stats["remote_misses"]) == (2, 2, 0)
    assert stats["remote_blocks_read"] == 2 * USER_PAGES - 2


def test_a_user_asked_twice_in_a_batch_gets_the_longer_lookup_whole(
    mooncake: MooncakeServers,
) -> None:
    a = LocalHost(mooncake.master)
    assert a.offload(745) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    b = LocalHost(mooncake.master, engine=one_batch(2), timeout_ms=FRESH_MS)
    try:
        half = b.kv.submit_lookup(745, TOKENS // 2)
        whole = b.kv.submit_lookup(745, TOKENS)
        hits = [half.result(), whole.result()]
        assert [hit.cached_tokens for hit in hits] == [TOKENS // 2, TOKENS]
        hits[0].release()
        # Batches of two: an offload beside the load fills its window, which the load
        # alone would wait out. Of a user no other test writes: the session's Mooncake
        # keeps it for the tests after this one.
        loading = b.kv.submit_load(hits[1], torch.arange(PAGES - USER_PAGES, PAGES))
        assert b.kv.offload(7450, torch.arange(USER_PAGES), TOKENS).stored_tokens == TOKENS
        assert loading.result(timeout=30).loaded_tokens == TOKENS
        assert all(torch.equal(cache[PAGES - USER_PAGES :], kv)
                   for cache, kv in zip(b.caches, b.kv_of(745), strict=True))
        stats = b.stats()
    finally:
        b.close()
    assert (stats["remote_lookups"], stats["remote_hits"]) == (2, 2)
    assert stats["remote_blocks_read"] == USER_PAGES  # each page once


def test_a_lookup_asks_mooncake_for_the_pages_past_its_ssd_copy(
    mooncake: MooncakeServers, tmp_path: Path,
) -> None:
    # A's SSD holds user 746's first half; Mooncake holds all of it (B's). After a
    # restart (host tier empty) A's lookup left every page from the SSD's first on to
    # the SSD path, and got only the half, where a host without SSD gets it whole.
    a = LocalHost(mooncake.master, ssd_dir=tmp_path)
    half = USER_PAGES // 2
    for cache, kv in zip(a.caches, a.kv_of(746), strict=True):
        cache[:half] = kv[:half]
    assert a.kv.offload(746, torch.arange(half), half * PAGE_SIZE).stored_tokens == TOKENS // 2
    a.close()
    b = LocalHost(mooncake.master)
    assert b.offload(746) == TOKENS
    assert closed_once_written(b, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    a = LocalHost(mooncake.master, ssd_dir=tmp_path, timeout_ms=20000)
    try:
        assert a.load(746) == (TOKENS, True)  # SSD pages, then Mooncake's, bit for bit
        stats = a.stats()
    finally:
        a.close()
    assert stats["ssd_hit_tokens"] == TOKENS // 2
    assert (stats["remote_hits"], stats["remote_blocks_read"]) == (1, half)


def test_a_lookup_that_asks_twice_waits_timeout_ms_in_all(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # A host tier full of its own blocks asks Mooncake which blocks it has, then reads
    # them: two calls. Each answers within timeout_ms (a slow Mooncake: 0.6 of it), both
    # together do not: the lookup is a miss at timeout_ms, not a hit after twice that.
    a = LocalHost(mooncake.master, head_dim=1024)  # 128 KiB blocks: 81 on the host tier
    assert a.offload(960) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    b = LocalHost(mooncake.master, head_dim=1024, timeout_ms=1000)
    try:
        for user in range(961, 972):  # 88 blocks
            assert b.offload(user) == TOKENS
        # Settled: every write done or dropped (writes hold at most half the tier), so
        # each of B's blocks can be evicted for the read of A's.
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        stats = b.stats()
        assert stats["remote_blocks_written"] + stats["remote_dropped_writes"] == (
            11 * USER_PAGES)
        for name in ("leading", "fetch"):
            monkeypatch.setattr(RemoteIO, name, _slowed(getattr(RemoteIO, name), 0.6))
        assert b.load(960)[0] == 0
        stats = b.stats()
    finally:
        b.close()
    assert stats["remote_timeouts"] == 1 and stats["remote_hits"] == 0


def _slowed(call: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def slow(*args: Any) -> Any:
        time.sleep(seconds)  # a Mooncake that answers late, within one timeout_ms
        return call(*args)
    return slow

def test_blocks_held_for_remote_writes_come_back_while_the_engine_is_idle(
    mooncake: MooncakeServers,
) -> None:
    # After the writes end and nothing else happens, the host blocks they held go back
    # (the scrape's gauge shows none held) without another call to the engine.
    a = LocalHost(mooncake.master)
    registry = CollectorRegistry()
    aiokv.metrics.register(a.engine, registry, store_timeout_s=30)
    try:
        for user in (81, 82):
            assert a.offload(user) == TOKENS

        def held() -> float:
            blocks = _samples(registry, "aiokv_store_blocks")
            return blocks[("aiokv_store_blocks", "remote", "held")]

        until(lambda: held() == 0)
        blocks = _samples(registry, "aiokv_store_blocks")
        assert blocks[("aiokv_store_blocks", "host", "used")] == 2 * USER_PAGES
    finally:
        written = a.close()["remote_blocks_written"]
    assert written == 2 * USER_PAGES


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, ...], float]:
    """One family's samples, by sample name and label values."""
    return {(sample.name, *sample.labels.values()): sample.value
            for family in registry.collect() if family.name == name
            for sample in family.samples}


def test_remote_traffic_shows_in_engine_stats_and_prometheus(mooncake: MooncakeServers) -> None:
    users = (71, 72)
    a = LocalHost(mooncake.master)
    a_metrics = CollectorRegistry()
    aiokv.metrics.register(a.engine, a_metrics, store_timeout_s=30)
    for user in users:
        assert a.offload(user) == TOKENS
    until(lambda: a.stats()["remote_blocks_written"] >= len(users) * USER_PAGES)
    a.close()  # finishes the background writes; the figures are final
    block_bytes = sum(cache[0].numel() * cache.element_size() for cache in a.caches)
    written = a.kv.stats()
    assert written.bytes_remote_written == len(users) * USER_PAGES * block_bytes
    assert (written.remote_dropped_writes, written.remote_errors) == (0, 0)
    assert _samples(a_metrics, "aiokv_bytes")[("aiokv_bytes_total", "d2h", "remote")] == (
        written.bytes_remote_written
    )
    batches = _samples(a_metrics, "aiokv_remote_write_seconds")
    assert batches[("aiokv_remote_write_seconds_count",)] >= 1
    assert batches[("aiokv_remote_write_seconds_sum",)] > 0

    b = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
    b_metrics = CollectorRegistry()
    aiokv.metrics.register(b.engine, b_metrics, store_timeout_s=30)
    try:
        assert b.load(users[0]) == (TOKENS, True)  # from Mooncake
        assert b.load(users[0]) == (TOKENS, True)  # now from B's host tier
        with b.kv.lookup(73, TOKENS) as hit:  # offloaded by nobody: a remote miss
            assert hit.cached_tokens == 0
        # A scrape from a thread without a loop waits for the store thread's answer
        # (up to store_timeout_s: long, so that a loaded machine cannot make it stale).
        lookups = _samples(b_metrics, "aiokv_remote_lookups")
        assert lookups == {("aiokv_remote_lookups_total", "hit"): 1,
                           ("aiokv_remote_lookups_total", "miss"): 1}
        tiers = _samples(b_metrics, "aiokv_tier_hit_tokens")
        assert tiers[("aiokv_tier_hit_tokens_total", "remote")] == TOKENS
        assert tiers[("aiokv_tier_hit_tokens_total", "host")] == TOKENS  # the second load
        moved = _samples(b_metrics, "aiokv_bytes")
        assert moved[("aiokv_bytes_total", "h2d", "remote")] == USER_PAGES * block_bytes
        waits = _samples(b_metrics, "aiokv_remote_lookup_seconds")
        assert waits[("aiokv_remote_lookup_seconds_count",)] == 2  # the hit and the miss
    finally:
        b.close()
    read = b.kv.stats()
    assert (read.remote_hits, read.remote_misses) == (1, 1)
    assert (read.remote_hit_tokens, read.host_hit_tokens) == (TOKENS, TOKENS)
    assert read.lookup_hit_tokens == read.remote_hit_tokens + read.host_hit_tokens
    assert read.bytes_remote_read == USER_PAGES * block_bytes
    assert 0 < read.remote_lookup_mean_ms <= read.remote_lookup_max_ms
    assert (read.remote_errors, read.remote_checksum_failures) == (0, 0)


def test_a_host_with_another_geometry_never_matches(mooncake: MooncakeServers) -> None:
    a = LocalHost(mooncake.master)
    assert a.offload(11) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    other = LocalHost(mooncake.master, dtype=torch.float64)
    try:
        with other.kv.lookup(11, TOKENS) as hit:
            assert hit.cached_tokens == 0
    finally:
        other.close()


# Invalidations other hosts made before a fresh host starts, far past the PROBE markers a
# lookup asks for: before a host caught up, each Mooncake call of a lookup, a write or an
# idle check moved it 32 markers on, and a host's first calls fell short. Clears take
# one marker each, evicts one for each of three users.
BEHIND = {"clear": 1000, "evict": 100}


@pytest.fixture(scope="module", params=sorted(BEHIND))
def far_behind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[str, LocalHost]]:
    """A master of its own (clears move every namespace's epoch), on which hosts A and E
    took turns at ``BEHIND`` clears (or evicts of each of users 1 to 3): each of them
    one marker behind at its turn, so both know every marker. Then A wrote users 1 and
    3 (and holds them; E holds none). A fresh host starts ``BEHIND`` markers behind:
    the master's address, and E."""
    with MooncakeServers(segment_mb=64, log_dir=tmp_path_factory.mktemp("behind")) as servers:
        a = LocalHost(servers.master, timeout_ms=FRESH_MS)
        e = LocalHost(servers.master, timeout_ms=FRESH_MS)
        try:
            for turn in range(BEHIND[request.param]):
                host = (a, e)[turn % 2]
                if request.param == "clear":
                    assert host.kv.clear() == 0
                else:
                    for user in (1, 2, 3):
                        assert host.kv.evict(user) == 0
            for user in (1, 3):
                assert a.load(user)[0] == 0  # the usual flow: learns its generation
                assert a.offload(user) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == 2 * USER_PAGES)
            assert a.stats()["remote_invalidation_errors"] == 0
            yield servers.master, e
        finally:
            a.close()
            e.close()


def test_a_host_started_after_many_invalidations_finds_what_another_host_wrote(
    far_behind: tuple[str, LocalHost],
) -> None:
    master, _ = far_behind
    b = LocalHost(master, timeout_ms=FRESH_MS)
    try:
        assert b.load(1) == (TOKENS, True)  # its first lookup
    finally:
        b.close()


def test_a_host_started_after_many_invalidations_writes_its_first_offload(
    far_behind: tuple[str, LocalHost],
) -> None:
    master, e = far_behind
    b = LocalHost(master, timeout_ms=FRESH_MS)
    try:
        assert b.load(2)[0] == 0  # the usual flow: a lookup before the offload
        assert b.offload(2) == TOKENS
        until(lambda: b.stats()["remote_blocks_held"] == 0)
        stats = b.stats()
    finally:
        b.close()
    assert stats["remote_blocks_written"] == USER_PAGES
    assert stats["remote_errors"] == 0
    assert {k: v for k, v in stats.items() if k.startswith("remote_dropped") and v} == {}
    assert e.load(2) == (TOKENS, True)  # under the generation and epoch other hosts read


def test_a_host_started_after_many_invalidations_gets_its_evicts_marker_out(
    far_behind: tuple[str, LocalHost],
) -> None:
    master, e = far_behind
    c = LocalHost(master, timeout_ms=FRESH_MS)
    try:
        assert c.kv.evict(3) == 0  # A's blocks, on Mooncake only
        stats = c.stats()
    finally:
        c.close()
    assert stats["remote_invalidation_errors"] == 0
    assert stats["remote_invalidations_waiting"] == 0
    assert e.load(3)[0] == 0  # E never held user 3: Mooncake's copy is ended


@pytest.fixture(scope="module")
def bare_client(mooncake: MooncakeServers) -> Iterator[Any]:
    """A Mooncake client of the test's own, that damages values in place: one for the
    module (a client's close takes a second), each test on keys of its own."""
    client = import_store().MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", mooncake.master) == 0
    yield client
    close_woken(client)


# Small blocks' values go through staging slots, large ones as two slices: both checked.
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 4096])
@pytest.mark.parametrize("damage", ["flipped", "longer"])
def test_a_corrupted_value_is_a_miss_from_there_on(
    mooncake: MooncakeServers, bare_client: Any, head_dim: int, damage: str
) -> None:
    # A byte flipped fails the checksum; a value longer than a block's is refused by
    # Mooncake's get: both are a damaged value, a miss, and counted.
    user = 21 if damage == "flipped" else 22
    a = LocalHost(mooncake.master, head_dim=head_dim)
    assert a.offload(user) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    # Damage the third block's value in place (upsert replaces a value; put keeps it).
    block_shape = (LAYERS, 2, PAGE_SIZE, HEADS, head_dim)
    keys = Keys(geometry_tag(block_shape, torch.float32, PAGE_SIZE))
    digests = chain_digests(torch.arange(TOKENS).numpy(), PAGE_SIZE)
    boot = bytes(bare_client.get(keys.boot_key())).decode()
    key = keys.blocks(boot, namespace_tag([f"uid:{user}"]), 0, 0, digests)[2]
    value = bytearray(bare_client.get(key))
    assert len(value) == a.caches[0][0].numel() * 4 * LAYERS + 8
    if damage == "flipped":
        value[100] ^= 0xFF
    else:
        value += bytes(8)
    deadline = time.monotonic() + 60  # the get's lease must end first
    while bare_client.upsert(key, bytes(value)) != 0:
        assert time.monotonic() < deadline
    # A read that timed out would be a miss too: given the time a starved box may need.
    b = LocalHost(mooncake.master, head_dim=head_dim, timeout_ms=10000)
    try:
        assert b.load(user) == (2 * PAGE_SIZE, True)  # the two blocks before it, exact
        assert b.stats()["remote_checksum_failures"] == 1
    finally:
        b.close()
    assert b.kv.stats().remote_checksum_failures == 1


def test_a_full_remote_store_never_fails_a_caller(tmp_path: Path) -> None:
    users = range(100, 148)
    with MooncakeServers(segment_mb=16, log_dir=tmp_path) as small:  # Mooncake's least
        # 64 KiB blocks: 48 users of 512 KiB (24 MiB) for a 16 MiB store.
        a = LocalHost(small.master, head_dim=512)
        try:
            for user in users:
                assert a.offload(user) == TOKENS
        finally:
            stats = a.close()
        assert stats["remote_dropped_writes"] > 0
        assert a.kv.stats().remote_dropped_writes == stats["remote_dropped_writes"]
        offered = len(users) * USER_PAGES
        assert stats["remote_blocks_written"] + stats["remote_dropped_writes"] == offered
        # Fresh, and some of its lookups must hit: a generous timeout_ms (one that runs
        # out behind its connect or a loaded box's read would be a miss).
        b = LocalHost(small.master, head_dim=512, timeout_ms=FRESH_MS)
        try:
            loaded = [b.load(user) for user in users]
        finally:
            b.close()
        assert all(exact or tokens == 0 for tokens, exact in loaded)
        assert any(tokens == TOKENS for tokens, _ in loaded)


def test_the_master_going_away_turns_lookups_into_misses(tmp_path: Path) -> None:
    with MooncakeServers(segment_mb=16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master)
        b = LocalHost(servers.master, timeout_ms=200)
        try:
            assert a.offload(31) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == USER_PAGES)
            servers.stop_master()
            began = time.monotonic()
            assert b.load(31)[0] == 0  # a miss, not an error
            assert time.monotonic() - began < 10  # bounded (the client alone waits longer)
            assert a.offload(32) == TOKENS  # the write is dropped, the offload is not
            servers.start_master()
            servers.wait_store_mounted()
            # Served again (once A's tier ends its rest).
            offload_until_one_reaches(a, b, 33, "no write reached Mooncake again")
        finally:
            a.close()
            b.close()


def test_a_master_gone_between_the_connects_question_and_setup_costs_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The master went away after the connect's question found it up, while Mooncake's
    # setup ran: setup retried it for 90 s with the GIL held, and a lookup waiting then on
    # a host with timeout_ms=200 failed RequestTimeout (its timeout_ms could not run out:
    # the loop and the store thread were stopped with every other thread).
    asked, go = threading.Event(), threading.Event()
    answers, submit = remote_connection.master_answers, RemoteIO.submit_read

    def answers_then_waits(config: Any) -> None:
        answers(config)
        if config.timeout_ms == 200 and not asked.is_set():  # host B's first connect
            asked.set()
            assert go.wait(60)

    def submit_then_go(io: RemoteIO, function: Any, *args: Any) -> Any:
        future = submit(io, function, *args)
        if io.config.timeout_ms == 200:
            go.set()  # B's lookup waits for its read: B's setup goes on, with no master
        return future

    monkeypatch.setattr(remote_connection, "master_answers", answers_then_waits)
    monkeypatch.setattr(RemoteIO, "submit_read", submit_then_go)
    with MooncakeServers(segment_mb=16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master)
        # A lookup stopped past this bound fails RequestTimeout instead of missing.
        b = LocalHost(servers.master, timeout_ms=200,
                      engine=aiokv.EngineConfig(request_timeout_ms=15_000))
        try:
            assert a.offload(31) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == USER_PAGES)
            assert asked.wait(60)  # B's connect found the master up
            servers.stop_master()
            assert b.load(31) == (0, True)  # a miss, not RequestTimeout
            stats = b.stats()  # the failed setup (or the lookup's timeout of it) counted
            assert stats["remote_errors"] >= 1 and stats["remote_misses"] == 1
            servers.start_master()
            servers.wait_store_mounted()
            # B connects once the master is back, and loads what A writes, exact.
            offload_until_one_reaches(a, b, 33, "B never read from Mooncake again")
        finally:
            go.set()
            a.close()
            b.close()


def test_an_idle_tier_whose_check_fails_counts_the_failed_call(tmp_path: Path) -> None:
    # The reader thread asks for the epoch each second; that check failing (the master
    # gone: code -900) puts the tier to rest with no lookup or write in sight, and was
    # counted nowhere: remote_errors stayed 0 while lookups missed and writes dropped.
    with MooncakeServers(segment_mb=16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master, timeout_ms=200)
        try:
            assert a.offload(71) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == USER_PAGES)
            assert a.stats()["remote_errors"] == 0
            servers.stop_master()
            until(lambda: a.stats()["remote_errors"] > 0)  # idle: only the check calls
            stats = a.stats()
            assert stats["remote_call_errors"] > 0 and stats["remote_connect_errors"] == 0
            # engine.stats() reads the store's figures of up to REFRESH_S ago
            until(lambda: a.kv.stats().remote_errors > 0)
        finally:
            a.close()


@pytest.mark.parametrize("pinning", ["whole", "short"])
def test_a_master_that_stops_answering_never_costs_offloads_their_host_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinning: str,
) -> None:
    # Writes wait on a hung master while their blocks are held: with a host tier smaller
    # than the write queue, they must not take the room offloads need (StoreFull). Also
    # where pinning stopped short at half the tier (a memlock limit, simulated): half of
    # all its blocks was every pinned one.
    if pinning == "short":
        pin_in_chunks(monkeypatch, 8, 4)
    with MooncakeServers(segment_mb=64, log_dir=tmp_path) as servers:
        caches = [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, 64) for _ in range(LAYERS)]
        store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01,
                                                   remote={"master": servers.master}))
        kv = aiokv.run_in_background(aiokv.OffloadEngine(
            store, caches, aiokv.EngineConfig(request_timeout_ms=3000)))
        pages = torch.arange(8)
        try:
            store.wait_pinned()
            host_blocks = store.store_stats()["host_blocks_total"]
            assert kv.offload(0, pages, 8 * PAGE_SIZE).stored_tokens == 8 * PAGE_SIZE
            until(lambda: kv.stats().bytes_remote_written > 0)
            servers.pause_master()
            try:
                users = host_blocks // 8 + 40  # more than the host tier holds
                for user in range(1, users):  # each one a StoreFull before the cap
                    assert kv.offload(user, pages, 8 * PAGE_SIZE).cached_tokens == (
                        8 * PAGE_SIZE)
                # dropped, counted (engine.stats() reads the store's figures of up to
                # REFRESH_S ago)
                until(lambda: kv.stats().remote_dropped_writes > 0)
            finally:
                servers.pause_master(False)
        finally:
            kv.close()


def test_writes_of_offloads_made_while_the_tier_is_pinned_are_all_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At start-up the tier is still being pinned (half of it so far, the rest held back
    # here), and a long prompt's offload takes more than half of what is pinned. Every
    # block goes to Mooncake: a cap of half the blocks pinned so far dropped the write
    # whole (remote_dropped_queue), and it was never offered again.
    fifth, go_on = threading.Event(), threading.Event()
    pin_in_chunks(monkeypatch, 8, 4, fifth, go_on, fails=False)
    with MooncakeServers(segment_mb=64, log_dir=tmp_path) as servers:
        caches = [torch.zeros(512, 2, PAGE_SIZE, HEADS, 64) for _ in range(LAYERS)]
        store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01,
                                                   remote={"master": servers.master}))
        kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()))
        try:
            assert fifth.wait(30)
            ready = store.store_stats()["host_blocks_ready"]
            count = 3 * ready // 4  # pages: three quarters of the pinned blocks
            assert ready // 2 < count <= 512
            assert kv.offload(0, torch.arange(count), count * PAGE_SIZE).stored_tokens == (
                count * PAGE_SIZE)
            until(lambda: store.store_stats()["remote_blocks_written"] >= count
                  or store.store_stats()["remote_dropped_queue"] > 0)
            stats = store.store_stats()
            assert (stats["remote_blocks_written"], stats["remote_dropped_queue"]) == (count, 0)
        finally:
            go_on.set()
            kv.close()


def test_an_engine_starts_and_serves_while_the_master_accepts_but_never_answers(
    tmp_path: Path,
) -> None:
    # Mooncake's setup holds the GIL while it waits for the master: connecting to a
    # stopped one froze every thread of the process. The master is continued from
    # outside (this process may be frozen) after a while: each check below that the
    # watchdog has not fired yet shows the process ran while the master was stopped.
    ticks: list[float] = []
    ticking = threading.Event()

    def tick() -> None:
        while not ticking.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    with MooncakeServers(segment_mb=16, log_dir=tmp_path) as servers:
        servers.pause_master()
        watchdog = subprocess.Popen(["sh", "-c", f"sleep 60; kill -CONT {servers.master_pid}"])
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            a = LocalHost(servers.master, timeout_ms=200)
            try:
                assert a.offload(61) == TOKENS  # kept on the host tier
                with a.kv.lookup(62, TOKENS) as hit:
                    assert hit.cached_tokens == 0  # a miss, not a wait for the master
                assert a.load(61) == (TOKENS, True)
                seen = len(ticks)
                until(lambda: len(ticks) > seen + 5)  # other Python threads run
                assert watchdog.poll() is None  # all of it while the master was stopped
                until(lambda: a.stats()["remote_connect_errors"] > 0)  # counted
                watchdog.kill()
                servers.pause_master(False)
                # The tier connects again (after its rest): a second host reads what the
                # first writes, bit for bit.
                b = LocalHost(servers.master, timeout_ms=200)
                try:
                    offload_until_one_reaches(a, b, 63, "the tier never connected again")
                finally:
                    b.close()
            finally:
                stats = a.close()
            assert stats["remote_errors"] >= stats["remote_connect_errors"] > 0
        finally:
            ticking.set()
            watchdog.kill()
            watchdog.wait()
            servers.pause_master(False)


def test_a_store_that_stops_answering_turns_lookups_into_misses(
    mooncake: MooncakeServers,
) -> None:
    a = LocalHost(mooncake.master)
    assert a.offload(51) == TOKENS
    assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
    b = LocalHost(mooncake.master, timeout_ms=300)
    try:
        mooncake.pause_store()
        try:
            began = time.monotonic()
            assert b.load(51)[0] == 0  # the values do not come: a miss
            assert b.load(51)[0] == 0  # and the next one does not queue behind it
            assert time.monotonic() - began < 5
        finally:
            mooncake.pause_store(False)
        until(lambda: b.load(51) == (TOKENS, True))
        assert b.stats()["remote_timeouts"] >= 1
    finally:
        b.close()


def _thread_states(pid: int) -> set[str]:
    """The states (/proc's letter) of the process's threads: ``T`` is stopped."""
    states = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            text = stat.read_text()
            states.add(text[text.rindex(")") + 2])
    return states


def test_a_paused_store_answers_nothing_once_pause_store_returns_however_late_it_stops(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kill() returns once SIGSTOP is queued; the process stops when one of its threads,
    # scheduled, takes the signal and stops the others. On a loaded runner the store still
    # answered a lookup sent in between, in full: a hit where a test meant a stopped store.
    # Here the stop lands late on purpose (the signal sent from a timer).
    pid = mooncake.store_pid
    assert pid is not None
    kill, late = os.kill, []

    def kill_late(target: int, sig: int) -> None:
        if target != pid or sig != signal.SIGSTOP:
            kill(target, sig)
            return
        late.append(threading.Timer(0.2, kill, (target, sig)))
        late[-1].start()

    monkeypatch.setattr(os, "kill", kill_late)
    try:
        mooncake.pause_store()
        assert _thread_states(pid) == {"T"}  # every thread stopped: none answers
    finally:
        for timer in late:
            timer.join()
        mooncake.pause_store(False)
    assert "T" not in _thread_states(pid)


def test_an_engine_starts_and_serves_with_no_master_at_all() -> None:
    # The first connect's failure rests the tier for timeout_ms (2 s): the lookup below
    # comes in that rest, not while a connect is tried (which it would wait for).
    host = LocalHost(f"127.0.0.1:{free_port()}", timeout_ms=2_000)
    try:
        assert host.offload(41) == TOKENS
        assert host.load(41) == (TOKENS, True)  # from its own host tier
        until(lambda: host.stats()["remote_errors"] >= 1)  # the write's connect failed
        with host.kv.lookup(42, TOKENS) as hit:
            assert hit.cached_tokens == 0
    finally:
        stats = host.close()
    assert stats["remote_blocks_written"] == 0
    # The miss asked nobody: no wait for Mooncake is counted (nor its zero seconds,
    # which would pull the mean wait down).
    assert (stats["remote_misses"], stats["remote_lookup_waits"]) == (1, 0)


def test_a_lookup_racing_another_hosts_put_is_a_miss_not_a_damaged_value(
    mooncake: MooncakeServers,
) -> None:
    # B asks for each user while A's put of it is under way: Mooncake answers such a get
    # "not ready" (no value read), which was counted as a value that failed its checksum.
    a = LocalHost(mooncake.master, head_dim=1024, timeout_ms=2000)
    # No lookup of B's may time out (remote_errors counts it): the first waits behind
    # B's connect, which a loaded box can keep past 2 s.
    b = LocalHost(mooncake.master, head_dim=1024, timeout_ms=FRESH_MS)
    try:
        for user in range(3100, 3112):
            go = threading.Barrier(2)
            writer = threading.Thread(target=lambda u=user, g=go: (g.wait(), a.offload(u)))
            writer.start()
            go.wait()
            deadline = time.monotonic() + 60
            # Until all of A's write is there: a lookup may find the first blocks of the
            # put done and the rest not yet (a shorter prefix), never a damaged one.
            while (got := b.load(user))[0] < TOKENS:
                assert got[1], (user, got)
                assert time.monotonic() < deadline, user
            assert got == (TOKENS, True)
            writer.join()
            until(lambda: a.stats()["remote_blocks_held"] == 0)
            assert b.kv.evict(user) == TOKENS  # B's host copy goes: the next starts cold
        stats = b.stats()
    finally:
        a.close()
        b.close()
    assert stats["remote_checksum_failures"] == 0 and stats["remote_errors"] == 0

# A Mooncake client in a process of its own that puts ``key`` (argv[2]) with a value too
# large for the socket's buffers, once told to: on a paused store its transfer cannot
# finish, and Mooncake's master answers the key "not ready" until it does.
_HELD_PUTTER = """
import sys
from aiokv.remote.native import import_store
client = import_store().MooncakeDistributedStore()
assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", sys.argv[1]) == 0
assert client.put(sys.argv[2] + "/warm", b"1") == 0  # the store's handshake, done first
print("ready", flush=True)
sys.stdin.readline()
client.put(sys.argv[2], bytes(32 << 20))
"""


def test_a_lookup_racing_another_hosts_evict_marker_put_is_a_miss_not_an_error(
    tmp_path: Path,
) -> None:
    # Another host's evict of the user is publishing its marker (the put under way, here
    # never to end): B's read gets the marker "not ready" (-703), which was counted in
    # remote_read_errors each lookup. It is a miss (the evict may be done), not an error.
    user = 3150
    with MooncakeServers(segment_mb=128, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master)
        assert a.offload(user) == TOKENS
        assert closed_once_written(a, USER_PAGES)["remote_blocks_written"] == USER_PAGES
        keys = Keys(geometry_tag((LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM), torch.float32,
                                 PAGE_SIZE))
        marker = keys.evicted(namespace_tag([f"uid:{user}"]), 0)  # the one A's blocks are under
        client = import_store().MooncakeDistributedStore()
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                            servers.master) == 0
        scratch = torch.zeros(8, dtype=torch.uint8)
        assert client.register_buffer(scratch.data_ptr(), 8) == 0

        def marker_code() -> int:
            return int(client.batch_get_into([marker], [scratch.data_ptr()], [8])[0])

        putter = subprocess.Popen(
            [sys.executable, "-c", _HELD_PUTTER, servers.master, marker],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            assert putter.stdout is not None and putter.stdin is not None
            assert putter.stdout.readline() == "ready\n"
            servers.pause_store()
            try:
                putter.stdin.write("go\n")
                putter.stdin.flush()
                until(lambda: marker_code() == NOT_READY, 60)
            finally:
                # The putter gone, its put never ends: the marker stays "not ready" while
                # the store serves the blocks again.
                putter.kill()
                putter.wait()
                servers.pause_store(False)
            b = LocalHost(servers.master, timeout_ms=FRESH_MS)
            try:
                assert b.load(user) == (0, True)
                stats = b.stats()
            finally:
                b.close()
            assert marker_code() == NOT_READY  # so it was for B's read too
        finally:
            client.unregister_buffer(scratch.data_ptr())
            close_woken(client)
    assert (stats["remote_hits"], stats["remote_misses"], stats["remote_read_errors"],
            stats["remote_errors"]) == (0, 1, 0, 0)


def _offloaded_into_hand(host: LocalHost, user: int) -> None:
    """``user`` offloaded while the writer's put is held: its batch is checked and summed
    beside that put (the writer's next batch in hand)."""
    summed = host.stats()["remote_write_checksum_seconds"]
    assert host.offload(user) == TOKENS
    until(lambda: host.stats()["remote_write_checksum_seconds"] > summed)


def _evicting(host: LocalHost, user: int) -> tuple[threading.Thread, list[int]]:
    """An evict of ``user`` started on a thread; the list gets its answer."""
    evicted: list[int] = []
    evict = threading.Thread(target=lambda: evicted.append(host.kv.evict(user)))
    evict.start()
    return evict, evicted


def test_an_evict_waits_for_its_users_put_while_the_next_batch_is_summed_beside_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    # The writer checks and sums a batch while the batch before it is in Mooncake's put.
    # An evict of the first batch's user then waits for that put before its remove, or
    # the put lands after the remove and its blocks stay in Mooncake, read by nobody,
    # until its LRU; the second batch's user is written and loads bit-exact elsewhere.
    # The put is held past a pass of the reader thread between its calls (about once a
    # second), which publishes the markers not out yet: it published the evict's, and
    # removed its blocks, before the put landed (a loaded 2-core CI's evict waited that
    # long).
    tended = threading.Event()
    tend = RemoteIO._tend

    def tend_then_tell(io: RemoteIO) -> float | None:
        evicting = bool(io.keys.unpublished())
        wait = tend(io)
        if evicting:
            tended.set()
        return wait

    monkeypatch.setattr(RemoteIO, "_tend", tend_then_tell)
    with MooncakeServers(16, log_dir=tmp_path) as servers:
        bare = import_store().MooncakeDistributedStore()
        assert bare.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                          servers.master) == 0
        gate = held(monkeypatch, Writer, "_put")
        a = LocalHost(servers.master, timeout_ms=20_000)
        try:
            assert a.offload(3301) == TOKENS
            assert gate.entered.wait(60), "the first batch never reached its put"
            _offloaded_into_hand(a, 3302)
            evict, evicted = _evicting(a, 3301)
            assert tended.wait(10), "the reader thread never tended during the evict"
            gate.set()
            evict.join(30)
            assert evicted == [TOKENS]
            until(lambda: a.stats()["remote_blocks_held"] == 0)
            assert a.stats()["remote_blocks_written"] == 2 * USER_PAGES  # both were put
            keys = Keys(geometry_tag((LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM),
                                     torch.float32, PAGE_SIZE))
            boot = bytes(bare.get(keys.boot_key())).decode()
            first = keys.blocks(boot, namespace_tag(["uid:3301"]), 0, 0, chain_digests(
                torch.arange(TOKENS).numpy(), PAGE_SIZE))
            until(lambda: not any(code == 1 for code in bare.batch_is_exist(first)), 10)
        finally:
            gate.set()
            a.close()
            close_woken(bare)
        b = LocalHost(servers.master, timeout_ms=FRESH_MS)
        try:
            assert b.load(3302) == (TOKENS, True)
            assert b.load(3301)[0] == 0
        finally:
            b.close()


def test_an_evict_does_not_wait_for_another_users_put_its_batch_waits_behind(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The writer takes the next batch off the queue while the batch before it is in
    # Mooncake's put. An evict of the next batch's user waited for its write, that is for
    # another user's put first: timeout_ms (20 s here) where Mooncake holds that put. Not
    # put yet, its write is dropped instead, and the evict returns at once.
    gate = held(monkeypatch, Values, "put")
    a = LocalHost(mooncake.master, timeout_ms=20_000)
    try:
        assert a.offload(3401) == TOKENS
        assert gate.entered.wait(60), "the first batch never reached its put"
        _offloaded_into_hand(a, 3402)
        evict, evicted = _evicting(a, 3402)
        evict.join(4)  # 3401's put is held for 30 s; timeout_ms is 20 s
        assert evicted == [TOKENS], "the evict of 3402 waited for 3401's put"
        gate.set()
        until(lambda: a.stats()["remote_blocks_held"] == 0)
        stats = a.stats()
        assert stats["remote_blocks_written"] == USER_PAGES  # 3401's alone
        assert stats["remote_dropped_evicted"] + stats["remote_dropped_stale"] == USER_PAGES
    finally:
        gate.set()
        a.close()
    b = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
    try:
        assert b.load(3401) == (TOKENS, True)
        assert b.load(3402)[0] == 0
    finally:
        b.close()


def _two_in_hand_after_an_evict_elsewhere(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch, base: int,
) -> tuple[Gate, LocalHost]:
    """A host whose writer has two batches in hand (user ``base + 1``'s in a put held
    until the gate returned is set, ``base + 2``'s checked beside it), after another host
    evicted user ``base + 4``, which this one never looked up."""
    gate = held(monkeypatch, Values, "put")
    a = LocalHost(mooncake.master, timeout_ms=20_000)
    try:
        assert a.offload(base + 1) == TOKENS
        assert gate.entered.wait(60), "the first batch never reached its put"
        _offloaded_into_hand(a, base + 2)
        other = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
        try:
            other.kv.evict(base + 4)
            assert other.stats()["remote_invalidation_errors"] == 0
        finally:
            other.close()
    except BaseException:
        gate.set()
        a.close()
        raise
    return gate, a


def test_a_batch_with_a_stale_users_write_beside_another_gives_every_block_back(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another host evicts 3504 before this host, which never asked for its markers,
    # offloads it; its write shares a batch with 3503's, and the batch's markers call
    # learns of the evict: 3504's write is dropped as stale, 3503's goes on. The dropped
    # job's host blocks were never given back (remote_blocks_held stayed at 8) and its
    # user counted as being written for good: its next evict waited timeout_ms.
    # The put's own ask for its markers is left out: answered before the offer (as the
    # writer may, even with two batches in hand), it would offer 3504 under the
    # generation after the evict; left out, the offer came first (the race the README
    # names), which is the case here.
    gate, a = _two_in_hand_after_an_evict_elsewhere(mooncake, monkeypatch, 3500)
    try:
        assert a.offload(3503) == TOKENS
        with monkeypatch.context() as patch:
            patch.setattr(Writer, "expect", lambda self, ns: None)
            assert a.offload(3504) == TOKENS
        until(lambda: a.stats()["remote_write_queue_blocks"] == 2 * USER_PAGES)  # one batch
        gate.set()
        until(lambda: a.stats()["remote_blocks_held"] == 0, 10)
        stats = a.stats()
        assert stats["remote_blocks_written"] == 3 * USER_PAGES
        assert stats["remote_dropped_stale"] == USER_PAGES
        evict, evicted = _evicting(a, 3504)
        evict.join(4)  # timeout_ms is 20 s
        assert evicted == [TOKENS], "the evict of 3504 waited for a write long over"
    finally:
        gate.set()
        a.close()
    b = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
    try:
        assert b.load(3503) == (TOKENS, True)
        assert b.load(3504)[0] == 0
    finally:
        b.close()


def test_a_put_started_while_two_batches_are_in_hand_is_written_after_another_hosts_evict(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another host evicts 3704; this host, which never looked it up, then offloads it
    # while its writer has two batches in hand (one in a put Mooncake holds, the next
    # checked beside it). The put's start asks for the user's markers, but the writer's
    # thread, idle until a batch ended, asked only then: the put was offered (a copy
    # that takes 2 s here) under the generation the evict ended, its write dropped as
    # stale, and no host found the user in Mooncake.
    gate, a = _two_in_hand_after_an_evict_elsewhere(mooncake, monkeypatch, 3700)
    try:
        offers_once_learned(monkeypatch, namespace_tag(["uid:3704"]), wait_s=2)
        assert a.offload(3704) == TOKENS
        gate.set()
        until(lambda: a.stats()["remote_blocks_held"] == 0, 10)
        stats = a.stats()
        assert (stats["remote_blocks_written"], stats["remote_dropped_writes"]) == (
            3 * USER_PAGES, 0)
    finally:
        gate.set()
        a.close()
    b = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
    try:
        assert b.load(3704) == (TOKENS, True)
    finally:
        b.close()


def test_the_writers_busy_time_counts_a_batch_put_while_the_next_one_waits(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3601's put takes 0.3 s at least while 3602's batch waits behind it, then 3602's put
    # is held: the writer is busy throughout. Its busy time (remote_write_seconds, the
    # sum of aiokv_remote_write_seconds) was added only once no batch was in hand: a
    # writer never idle showed batches written in no time at all.
    def of(user: int) -> Callable[..., bool]:
        tag = namespace_tag([f"uid:{user}"])
        return lambda values, client, keys, blocks: f"/{tag}/" in keys[0]

    first = held(monkeypatch, Values, "put", of(3601))
    second = held(monkeypatch, Values, "put", of(3602))
    a = LocalHost(mooncake.master, timeout_ms=20_000)
    try:
        assert a.offload(3601) == TOKENS
        assert first.entered.wait(60), "3601's batch never reached its put"
        began = time.monotonic()
        _offloaded_into_hand(a, 3602)
        time.sleep(max(0.0, began + 0.3 - time.monotonic()))
        first.set()
        assert second.entered.wait(30), "3602's batch never reached its put"
        stats = a.stats()
        assert stats["remote_blocks_written"] == USER_PAGES
        assert stats["remote_write_batches"] == 1
        assert stats["remote_write_seconds"] >= 0.3
    finally:
        first.set()
        second.set()
        a.close()


def test_close_that_gives_up_on_a_held_put_counts_every_offered_block_once(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mooncake holds 3801's put past timeout_ms while 3802's batch waits beside it: close
    # gives up on the put and drops 3802's write. Its figures showed 8 of the 16 blocks
    # offered dropped and none written: the held put's blocks were counted nowhere. Each
    # is counted dropped ("down") at close, and the put ending later changes nothing.
    gate = held(monkeypatch, Values, "put")
    putting: list[threading.Thread] = []
    put = Values.put

    def put_seen(values: Values, *args: Any) -> Any:
        putting.append(threading.current_thread())
        return put(values, *args)

    monkeypatch.setattr(Values, "put", put_seen)
    a = LocalHost(mooncake.master, timeout_ms=300)
    try:
        assert a.offload(3801) == TOKENS
        assert gate.entered.wait(60), "the first batch never reached its put"
        _offloaded_into_hand(a, 3802)
        closed = a.close()
    finally:
        gate.set()
    figures = (closed["remote_blocks_written"], closed["remote_dropped_writes"],
               closed["remote_dropped_down"])
    assert figures == (0, 2 * USER_PAGES, 2 * USER_PAGES)
    putting[0].join(30)  # the held put returned, and its thread counted what it saw
    assert not putting[0].is_alive()
    assert a.stats() == closed


def test_close_that_gives_up_on_a_batchs_held_markers_check_counts_its_blocks_dropped(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mooncake holds the markers call that checks 3901's batch before its put: close gives
    # up on it, and its 8 blocks were counted neither written nor dropped.
    gate = held(monkeypatch, Writer, "_refresh")
    a = LocalHost(mooncake.master, timeout_ms=300)
    try:
        assert a.offload(3901) == TOKENS
        assert gate.entered.wait(60), "the batch never reached its markers check"
        closed = a.close()
    finally:
        gate.set()
    assert (closed["remote_blocks_written"], closed["remote_dropped_writes"],
            closed["remote_dropped_down"]) == (0, USER_PAGES, USER_PAGES)


def test_close_that_gives_up_on_a_held_put_counts_the_batch_checked_while_it_waits(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mooncake holds 4001's put; 4002's batch is in its markers check beside it, which
    # answers only once close has taken the queued writes back: the batch is set aside
    # while close waits for the threads. Close's figures showed 8 of the 16 blocks
    # offered dropped and none written: the batch set aside then was counted nowhere.
    tag = namespace_tag(["uid:4002"])
    put = held(monkeypatch, Values, "put")
    check = held(monkeypatch, Writer, "_refresh",
                 lambda writer, client, namespaces: tag in namespaces)
    close = WriteQueue.close

    def close_then_answer(queue: WriteQueue) -> None:
        close(queue)
        check.set()

    monkeypatch.setattr(WriteQueue, "close", close_then_answer)
    a = LocalHost(mooncake.master, timeout_ms=1000)
    try:
        assert a.offload(4001) == TOKENS
        assert put.entered.wait(60), "the first batch never reached its put"
        assert a.offload(4002) == TOKENS
        assert check.entered.wait(60), "the second batch never reached its markers check"
        closed = a.close()
    finally:
        put.set()
        check.set()
    assert (closed["remote_blocks_written"], closed["remote_dropped_writes"],
            closed["remote_dropped_down"]) == (0, 2 * USER_PAGES, 2 * USER_PAGES)


def test_close_that_gives_up_on_the_markers_asked_for_beside_a_batch_counts_its_blocks(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 4102's write is queued while the writer checks 4101's batch, and its put asked for
    # its markers: the writer takes 4102's batch and asks for them, a call Mooncake
    # holds past close's timeout_ms. Close's figures showed 4101's 8 blocks written and
    # none dropped: 4102's batch, taken before the call, was counted nowhere.
    first, second = namespace_tag(["uid:4101"]), namespace_tag(["uid:4102"])
    check = held(monkeypatch, Writer, "_refresh",
                 lambda writer, client, namespaces: first in namespaces)
    asked = held(monkeypatch, Markers, "past",
                 lambda markers, client, items: any(ns == second for ns, _ in items))
    a = LocalHost(mooncake.master, timeout_ms=300)
    try:
        assert a.offload(4101) == TOKENS
        assert check.entered.wait(60), "the first batch never reached its markers check"
        assert a.offload(4102) == TOKENS
        until(lambda: a.stats()["remote_write_queue_blocks"] == USER_PAGES)
        check.set()
        assert asked.entered.wait(60), "the second batch's markers were never asked for"
        until(lambda: a.stats()["remote_blocks_written"] == USER_PAGES)
        closed = a.close()
    finally:
        check.set()
        asked.set()
    assert (closed["remote_blocks_written"], closed["remote_dropped_writes"],
            closed["remote_dropped_down"]) == (USER_PAGES, USER_PAGES, USER_PAGES)


def test_an_evict_does_not_wait_for_another_users_write(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate, writing = threading.Event(), threading.Event()
    write = Writer._write

    def held_write(writer: Writer, jobs: Any) -> Any:
        if not gate.is_set():
            writing.set()
            gate.wait(30)
        return write(writer, jobs)

    a = LocalHost(mooncake.master, timeout_ms=20_000)
    try:
        gate.set()
        assert a.offload(3201) == TOKENS
        until(lambda: a.stats()["remote_blocks_held"] == 0)
        gate.clear()
        monkeypatch.setattr(Writer, "_write", held_write)
        assert a.offload(3202) == TOKENS  # its write is held under way
        assert writing.wait(60)
        evict, evicted = _evicting(a, 3201)
        evict.join(10)  # the write of 3202 is held for 30 s; timeout_ms is 20 s
        assert evicted == [TOKENS], "the evict of 3201 waited for 3202's write"
        gate.set()
        until(lambda: a.stats()["remote_blocks_held"] == 0)
    finally:
        gate.set()
        a.close()
    b = LocalHost(mooncake.master, timeout_ms=FRESH_MS)
    try:
        assert b.load(3201)[0] == 0 and b.load(3202) == (TOKENS, True)
    finally:
        b.close()


@pytest.mark.parametrize("scenario", ["thread", "asyncio"])
def test_a_process_exiting_mid_write_with_its_engine_never_closed_exits_cleanly(
    mooncake: MooncakeServers, scenario: str
) -> None:
    # The tier's writer (and reader) thread, a daemon inside Mooncake's put when the
    # interpreter finalized, was ended there by CPython: std::terminate, the process
    # aborted (SIGABRT) 6 times in 6. Each offload's blocks go to Mooncake, so the
    # writer is in Mooncake's put most of the time; summing threads as on a host of 8
    # cores or more (half the cores, at most 4; here 1).
    store = {"cpu_cache_gb": 0.05,
             "remote": {"master": mooncake.master, "checksum_threads": 4}}
    exits_cleanly_never_closed(scenario, "cpu", store, store, store)


def test_the_remote_tier_benchmark_runs_every_round_to_its_figures() -> None:
    # Its second round's offloads came right after both hosts' clears: the host that
    # cleared first had not read the other's marker yet, so its writes went under an
    # ended epoch, were dropped as stale, and the run stopped on a TimeoutError.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "remote_tier.py"
    run = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "load: aiokv load / raw get = " in run.stdout
    assert "host-tier load p99 (all rounds' loads pooled)" in run.stdout
    assert "host-tier load p99 (best round)" in run.stdout


def connects(monkeypatch: pytest.MonkeyPatch, timeout_ms: int) -> threading.Event:
    """Set once the reader of the host whose ``timeout_ms`` this is has checked the
    markers (its connect), answered or not."""
    connected = threading.Event()
    check_markers = RemoteIO._check

    def noted_check(io: RemoteIO) -> bool:
        answered = check_markers(io)
        if io.config.timeout_ms == timeout_ms:
            connected.set()
        return answered

    monkeypatch.setattr(RemoteIO, "_check", noted_check)
    return connected


def test_a_lookup_read_that_times_out_and_then_fails_is_one_error(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow Mooncake whose read then fails for want of the master: the lookup gave up
    # at timeout_ms (a miss, its timeout counted), and the call's failure, seen later on
    # the reader thread, was counted again: remote_errors said 2 for one failed call.
    # The lookup comes once the reader has connected: behind a connect slower than
    # timeout_ms (a loaded host) it gives up on the connect's call, whose timeout is
    # counted, and the read that then fails is a second failed call, rightly counted too.
    returned = threading.Event()
    timeout_ms = 203  # this host's own: an earlier test's, closed, may still be in a call
    connected = connects(monkeypatch, timeout_ms)

    def slow_then_down(io: RemoteIO, items: Any, blocks: Any) -> list[int]:
        time.sleep(1.0)  # past the lookup's timeout_ms
        io.connection.codes("batch_get_into", [-900])  # the master's absence
        returned.set()
        return [0] * len(items)

    monkeypatch.setattr(RemoteIO, "read", slow_then_down)
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    try:
        assert connected.wait(30), "the reader did not connect"
        assert b.load(4401) == (0, True)  # a miss, after timeout_ms
        # Both counts are in by then: the timeout's before the load answered, the
        # failure's in the call, before it returned.
        assert returned.wait(60)
        stats = b.stats()
        assert (stats["remote_timeouts"], stats["remote_call_errors"]) == (1, 0), stats
        assert stats["remote_errors"] == 1
    finally:
        b.close()


@pytest.mark.parametrize("master", ["killed", "paused"])
def test_an_evict_whose_marker_cannot_go_out_counts_each_failed_call_once(
        tmp_path: Path, master: str) -> None:
    # The first evict's marker call fails (a killed master: code -900) or times out (a
    # paused one); the second evict makes no call (the tier rests, or its reader is still
    # in that call). remote_errors counted the failed call again as the evict's
    # invalidation error, and the evict that made no call as one: 3 for one failed call.
    with MooncakeServers(segment_mb=16, log_dir=tmp_path) as servers:
        a = LocalHost(servers.master, timeout_ms=2000 if master == "killed" else 300)
        try:
            for user in (4501, 4502):
                assert a.offload(user) == TOKENS
            until(lambda: a.stats()["remote_blocks_written"] == 2 * USER_PAGES)
            if master == "killed":
                servers.stop_master()
            else:
                servers.pause_master()
            assert a.kv.evict(4501) == TOKENS  # served; the marker does not go out
            assert a.kv.evict(4502) == TOKENS
        finally:
            stats = a.close()
            engine = a.kv.stats()  # final after close
            servers.pause_master(False)
    calls = ("remote_call_errors", "remote_connect_errors", "remote_timeouts",
             "remote_read_errors", "remote_write_errors")
    seen = {key: stats[key] for key in (*calls, "remote_errors", "remote_invalidation_errors",
                                        "remote_invalidations_waiting")}
    # Each evict whose marker did not go out is its own count, not a failed call.
    assert (seen["remote_invalidation_errors"], seen["remote_invalidations_waiting"]) == (
        2, 2), seen
    assert seen["remote_errors"] == sum(seen[key] for key in calls), seen
    if master == "killed":  # close's one try at the markers, and the checks, fail too
        # (at once, mostly; on a loaded box a call to the dead master may run out its
        # timeout_ms first: counted a timeout, once, all the same)
        assert seen["remote_call_errors"] + seen["remote_timeouts"] >= 1, seen
    else:  # the one call, still waiting on the master: no other is made
        assert seen["remote_errors"] == seen["remote_timeouts"] == 1, seen
    assert engine.remote_errors == seen["remote_errors"]


def _errors(host: Any, kind: str) -> dict[str, int]:
    """A host's timeouts, ``kind`` errors, unpublished invalidations and remote_errors."""
    stats = host.stats()
    return {key: stats[key] for key in ("remote_timeouts", kind, "remote_invalidation_errors",
                                        "remote_errors")}


def test_an_evict_whose_marker_call_times_out_and_then_fails_is_one_error(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow Mooncake whose marker call then fails for want of the master: the evict gave
    # up at timeout_ms (its timeout counted), and the call's failure, seen later on the
    # reader thread, was counted again: remote_errors said 3 for one failed call. (A fresh
    # host's reader once published the marker itself between its connect and the evict's
    # call, its failure counted apart from the evict's call.) The evict comes once the
    # reader has connected: behind a connect slower than timeout_ms (a loaded host) it
    # gives up on the connect's call, whose timeout is counted, and the marker call that
    # then fails is a second failed call, rightly counted too.
    entered, gate, returned = (threading.Event() for _ in range(3))
    publish = RemoteIO._publish
    timeout_ms = 1_003  # this host's own: an earlier test's, closed, may still be in a call
    connected = connects(monkeypatch, timeout_ms)

    def slow_then_down(io: RemoteIO) -> bool:
        if io.config.timeout_ms != timeout_ms or returned.is_set():
            return publish(io)
        entered.set()
        gate.wait(30)  # past the evict's timeout_ms: the test lets it go after that
        io.connection.codes("batch_is_exist", [-900])  # the master's absence
        returned.set()
        return False

    monkeypatch.setattr(RemoteIO, "_publish", slow_then_down)
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    try:
        assert connected.wait(30), "the reader did not connect"
        # Nothing of it is written: the evict's marker is its one call, at once.
        assert b.kv.evict(4511) == 0  # after timeout_ms, the marker not out
        assert entered.is_set(), "the evict's marker call did not start"
        gate.set()
        assert returned.wait(60)  # the failure is counted in the call, before it returns
        assert _errors(b, "remote_call_errors") == {
            "remote_timeouts": 1, "remote_call_errors": 0,
            "remote_invalidation_errors": 1, "remote_errors": 1}
    finally:
        gate.set()
        b.close()


@pytest.mark.parametrize("check", ["connecting", "idle"])
def test_a_lookup_queued_behind_a_check_that_times_out_and_then_fails_is_one_error(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch, check: str) -> None:
    # The reader thread is in a check of the markers (a fresh host's first, or an idle
    # tier's each second) when a lookup's read queues behind it: the lookup gave up at
    # timeout_ms (its timeout counted), and the check, failing for want of the master,
    # was counted again: remote_errors said 2 for one failed call. (The lookup's own
    # call then makes none: the tier rests.)
    entered, gate, returned = threading.Event(), threading.Event(), threading.Event()
    check_markers = RemoteIO._check
    checks = itertools.count()
    timeout_ms = 301  # this host's own: an earlier test's, closed, may still be in a call

    def slow_then_down(io: RemoteIO) -> bool:
        if io.config.timeout_ms != timeout_ms or returned.is_set() or (
                check == "idle" and next(checks) == 0):
            return check_markers(io)
        entered.set()
        gate.wait(30)  # past the lookup's timeout_ms: the test lets it go after that
        io.connection.codes("batch_is_exist", [-900])  # the master's absence
        returned.set()
        return False

    monkeypatch.setattr(RemoteIO, "_check", slow_then_down)
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    try:
        assert entered.wait(60)
        assert b.load(4701) == (0, True)  # a miss, after timeout_ms
        gate.set()
        assert returned.wait(60)  # the failure is counted in the call, before it returns
        stats = b.stats()
        seen = {key: stats[key] for key in ("remote_timeouts", "remote_call_errors",
                                            "remote_errors")}
        assert seen == {"remote_timeouts": 1, "remote_call_errors": 0, "remote_errors": 1}
    finally:
        gate.set()
        b.close()


def test_an_evict_whose_marker_call_times_out_and_then_is_refused_is_one_error(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # A master paused past the evict's timeout_ms answers the marker's put with an error
    # once it resumes ("publishing a marker failed (refused)"): the evict counted the
    # call's timeout, and the refusal was counted again: remote_errors said 2.
    entered, gate, returned = threading.Event(), threading.Event(), threading.Event()
    end = Markers.end
    timeout_ms = 2001  # this host's own: an earlier test's, closed, may still be in a call

    def slow_then_refused(markers: Markers, client: Any, ns: str | None) -> str | None:
        if markers._connection.config.timeout_ms != timeout_ms or returned.is_set():
            return end(markers, client, ns)
        entered.set()
        gate.wait(30)  # past the evict's timeout_ms: the test lets it go after that
        markers._refused()  # Mooncake's error answer
        returned.set()
        return None

    monkeypatch.setattr(Markers, "end", slow_then_refused)
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    try:
        evicted: list[int] = []
        evict = threading.Thread(target=lambda: evicted.append(b.kv.evict(4711)))
        evict.start()
        assert entered.wait(60)  # the evict's marker call is under way
        evict.join(30)
        assert evicted == [0]  # after timeout_ms, the marker not out
        gate.set()
        assert returned.wait(60)
        assert _errors(b, "remote_read_errors") == {
            "remote_timeouts": 1, "remote_read_errors": 0,
            "remote_invalidation_errors": 1, "remote_errors": 1}
    finally:
        gate.set()
        b.close()


class _Recorded:
    """A Mooncake client that notes each call's thread and method before it makes it."""

    def __init__(self, client: Any, calls: list[tuple[threading.Thread, str]]) -> None:
        self._client, self._calls = client, calls

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.append((threading.current_thread(), name))
            return method(*args, **kwargs)

        return call


class _HeldCheck:
    """Holds the idle pass's check (not the connect's, the first) of the host whose
    ``timeout_ms`` is this one, once, until ``gate`` is set (``wait_s`` at most); ``fails``:
    the check then fails as for the master's absence. ``held``: the thread it held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, timeout_ms: int, wait_s: float,
                 fails: bool = False) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.held: list[threading.Thread] = []
        check_markers = RemoteIO._check
        checks = itertools.count()

        def held_check(io: RemoteIO) -> bool:
            if io.config.timeout_ms != timeout_ms or self.held or next(checks) == 0:
                return check_markers(io)  # the first: the connect's
            self.held.append(threading.current_thread())
            self.entered.set()
            self.gate.wait(wait_s)
            if fails:  # the call under way: the master's absence
                return io.connection.codes("batch_is_exist", [-900])
            return check_markers(io)

        monkeypatch.setattr(RemoteIO, "_check", held_check)


@pytest.mark.parametrize("step", ["answers", "fails"])
def test_a_reader_left_in_its_idle_check_at_close_calls_mooncake_no_more(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, step: str) -> None:
    # Close gave up on the reader thread (its bound, timeout_ms) while the idle pass
    # waited at the start of its check (as behind another thread's connect). Once let go
    # it went on calling Mooncake with the closed engine's client ("answers"), or counted
    # the call under way failing and logged that the tier rests ("fails"); such a thread
    # ran a later test's patched check and failed that test.
    calls: list[tuple[threading.Thread, str]] = []
    timeout_ms = 303  # this host's own: an earlier test's, closed, may still be in a call
    store = import_store()
    monkeypatch.setattr(remote_connection, "import_store", lambda: SimpleNamespace(
        MooncakeDistributedStore=lambda: _Recorded(store.MooncakeDistributedStore(), calls)))
    hold = _HeldCheck(monkeypatch, timeout_ms, 30, fails=step == "fails")
    entered, gate, held = hold.entered, hold.gate, hold.held
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    try:
        assert entered.wait(60), "the idle pass's check did not start"
        b.close()  # gives up on the reader after timeout_ms
        store_stats, engine = b.stats(), b.kv.stats()  # final after close
        caplog.clear()
        closed_at = len(calls)
        with caplog.at_level(logging.WARNING, logger="aiokv"):
            gate.set()
            held[0].join(60)
        assert not held[0].is_alive()
    finally:
        gate.set()
        b.close()
    assert [name for thread, name in calls[closed_at:] if thread is held[0]] == []
    assert [record.getMessage() for record in caplog.records] == []
    assert (b.stats(), b.kv.stats()) == (store_stats, engine)


def test_a_reader_left_in_its_idle_publish_at_close_goes_on_to_no_check(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
    # An evict's marker did not go out; the idle pass was publishing it when close gave
    # up on the reader. Let go, the pass went on to its check of the markers: the thread
    # of a closed engine ran whatever _check was then, a later test's patch among them.
    entered, gate = threading.Event(), threading.Event()
    held: list[threading.Thread] = []
    checked_after_close: list[threading.Thread] = []
    publish, check_markers = RemoteIO._publish, RemoteIO._check
    publishes = itertools.count()
    timeout_ms = 307  # this host's own: an earlier test's, closed, may still be in a call

    def held_publish(io: RemoteIO) -> bool:
        if io.config.timeout_ms != timeout_ms or held:
            return publish(io)
        if next(publishes) == 0:
            return False  # the evict's call: the marker not out (as a refusal)
        held.append(threading.current_thread())
        entered.set()
        gate.wait(30)
        io.keys.checked_at = float("-inf")  # a check is due, as after a long call
        return False

    def noted_check(io: RemoteIO) -> bool:
        if gate.is_set() and threading.current_thread() in held:
            checked_after_close.append(threading.current_thread())
        return check_markers(io)

    monkeypatch.setattr(RemoteIO, "_publish", held_publish)
    monkeypatch.setattr(RemoteIO, "_check", noted_check)
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    try:
        assert b.kv.evict(4721) == 0  # its marker not out: the idle pass publishes it
        assert entered.wait(60), "the idle pass's publish did not start"
        b.close()  # gives up on the reader after timeout_ms
        gate.set()
        held[0].join(60)
        assert not held[0].is_alive()
    finally:
        gate.set()
        b.close()
    assert checked_after_close == []


@pytest.mark.parametrize("call", ["lookup", "evict"])
def test_a_call_queued_behind_the_readers_call_is_answered_once_the_exit_stops_the_tier(
        mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    # The interpreter exits (aiokv.exiting) with a lookup's read, or an evict's marker
    # call, waiting its turn behind the reader thread's call under way: the tier's stop
    # cancelled it, but concurrent.futures.wait (the store thread's wait on it) counts a
    # cancelled future done only once it is marked notified. The store thread sat out
    # the call's whole timeout_ms, and held up the exit (up to its bound) meanwhile.
    queued = threading.Event()
    submit = CallThread.submit
    timeout_ms = 30_011  # this host's own: an earlier test's, closed, may still be in a call
    hold = _HeldCheck(monkeypatch, timeout_ms, 60)
    entered, gate, held = hold.entered, hold.gate, hold.held

    def noted_submit(reader: CallThread, function: Callable[..., Any], *args: Any) -> Any:
        future = submit(reader, function, *args)
        if entered.is_set() and threading.current_thread() not in held:
            queued.set()  # behind the held check
        return future

    monkeypatch.setattr(CallThread, "submit", noted_submit)
    b = LocalHost(mooncake.master, timeout_ms=timeout_ms)
    answers: list[Any] = []
    caller = threading.Thread(target=lambda: answers.append(
        b.load(4741) if call == "lookup" else b.kv.evict(4741)))
    try:
        assert entered.wait(60), "the idle pass's check did not start"
        caller.start()
        assert queued.wait(60), f"the {call}'s call was not submitted"
        assert b.store._remote is not None
        b.store._remote.io.stop_at_exit()  # the interpreter's exit stops the tier
        caller.join(15)  # well inside timeout_ms: the call was cancelled, never made
        assert not caller.is_alive(), f"the {call} still waits for its cancelled call"
        assert answers == [(0, True) if call == "lookup" else 0]  # a miss; nothing evicted
    finally:
        gate.set()
        if caller.ident is not None:
            caller.join(60)
        b.close()


@pytest.mark.parametrize("call", ["lookup", "evict"])
def test_a_lookup_or_evict_after_the_exit_stopped_the_tier_is_a_miss_not_an_error(
        mooncake: MooncakeServers, call: str) -> None:
    # The interpreter's exit (aiokv.exiting) stops the tier under the store thread: a
    # lookup or evict that then submits its call (its first, or a lookup's second once
    # its first returned) was refused with a RuntimeError, and the user saw the store
    # call fail (StoreError "store.get_match failed") instead of a miss.
    b = LocalHost(mooncake.master)
    try:
        assert b.store._remote is not None
        b.store._remote.io.stop_at_exit()
        answer = b.load(4743) if call == "lookup" else b.kv.evict(4743)
        assert answer == ((0, True) if call == "lookup" else 0)  # a miss; nothing evicted
    finally:
        b.close()


def test_a_call_submitted_as_the_exit_stops_the_tier_is_answered_never_left_queued() -> None:
    # The store thread submits a call while the exit stops the reader thread from the
    # main thread: the stop came between submit's check of closed and its put, emptied
    # the queue and put its end marker first, and the call landed behind it: never run,
    # never cancelled, its waiter left to its timeout_ms (a result() without one, for
    # ever). Here the stop is forced into that window: it either returns there, or waits
    # for the submit (what a lock shared by submit and stop makes it do).
    reader = CallThread("aiokv-test-reader", lambda: None)
    stop_went = threading.Event()  # the stop returned, or waits for the submit to end

    def stop() -> None:
        reader.stop()
        stop_went.set()

    stopper = threading.Thread(target=stop)
    calls = reader._calls

    class Racing:
        """The reader's queue, with the stop forced in before the submit's put."""

        def __init__(self) -> None:
            self.raced = False

        def put(self, item: Any) -> None:
            if not self.raced and threading.current_thread() is threading.main_thread():
                self.raced = True
                stopper.start()
                assert stop_went.wait(60), "the stop neither returned nor waited"
            calls.put(item)

        def get(self, timeout: float | None = None) -> Any:
            return calls.get(timeout=timeout)

        def get_nowait(self) -> Any:
            return calls.get_nowait()

    class Observed:
        """A lock that tells when the stopper comes to wait for it."""

        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            if threading.current_thread() is stopper:
                stop_went.set()
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    reader._calls = Racing()  # type: ignore[assignment]
    reader._queueing = Observed()  # type: ignore[assignment]
    future = reader.submit(lambda: "ran")
    stopper.join(60)
    assert reader.join(60), "the reader thread did not end after the stop"
    done, _ = futures_wait([future], 0)  # the store thread's wait
    assert future in done, "the call was neither run nor cancelled"
    assert future.cancelled() or future.result(0) == "ran"
