"""``aiokv demo``: a simulated serving workload on the embedded store (or the store a
``--config`` file names) under uvloop.

User coroutines grow append-only histories, each append writing fresh random KV into that
user's own pages and offloading it, and now and then look their history up and load it
into scratch pages, which must equal their own pages bit for bit (history pages never
change once written, so they are the reference). A user whose history reaches its page
budget restarts under a fresh namespace. Ctrl-C (SIGINT) or SIGTERM stops it early: the
users finish their request in flight, the engine drains, and the summary is printed. The
exit status is 1 when any load mismatched or any request failed, else 128 + the signal's
number when one stopped it (0 when it ran its course).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import EngineConfig, StoreConfig
from .config_file import load_config
from .engine import OffloadEngine
from .errors import AiokvError, ConfigError, EngineClosed
from .flags import check_fits, too_large
from .stats import EngineStats
from .stores import make_store
from .stores.base import Store

GIB = float(1 << 30)
VERIFY_SHARE = 0.25  # of a user's steps that look up + load + check instead of appending
MAX_APPEND_PAGES = 3  # an append adds up to this many pages of tokens
# The store holds users x budget pages: every user has at most one request in flight, and
# it pins at most its budget (pages being written, or a looked-up history being loaded),
# so a match can always evict enough and no request finds the store full. Live
# histories average half their budget, so the rest of the store fills with the garbage
# of restarted histories, which eviction clears; lookups almost always hit in full.
STORE_PAGES_PER_USER_BUDGET = 1.0
# The default history budget keeps the caches under this, unless even MAX_APPEND_PAGES
# pages a user do not fit under it (the memory check in _build then bounds them).
CACHES_BYTES_CAP = 256 << 20
NOISE_BYTES = 16 << 20  # pool of random KV that appends copy from
ERRORS_KEPT = 5  # errors quoted in the summary; the rest are only counted
RETRY_PAUSE_S = 0.001  # a user's pause after a failed call, before its next
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Tally:
    """What the users did, counted on the loop."""

    offloads: int = 0
    lookups: int = 0
    loads: int = 0
    full_hits: int = 0
    partial_hits: int = 0
    misses: int = 0
    restored_pages: int = 0  # pages offloaded again because the store had evicted them
    restarts: int = 0
    verified: int = 0
    mismatches: int = 0
    failures: int = 0  # requests that raised an AiokvError in a user
    errors: list[str] = field(default_factory=list)  # the first ERRORS_KEPT of them


@dataclass
class Workload:
    caches: list[torch.Tensor]
    own: list[torch.Tensor]  # each user's history pages, in order, on the caches' device
    scratch: list[torch.Tensor]  # each user's load target pages
    page_size: int
    budget_pages: int
    noise: torch.Tensor  # random pages; appends copy windows of it (see random_pages)
    rng: np.random.Generator

    def random_pages(self, count: int) -> torch.Tensor:
        """``count`` pages of random KV: a window of the noise pool at a random element
        offset, so every append writes different data for the cost of a copy (drawing
        fresh normals on the CPU would cost the loop hundreds of microseconds)."""
        page_numel = self.caches[0][0].numel()
        start = int(self.rng.integers(0, len(self.noise) - count * page_numel + 1))
        window = self.noise[start : start + count * page_numel]
        return window.view(count, *self.caches[0].shape[1:])


class DemoUser:
    """One user: an append-only history in its own pages, offloaded after every append,
    sometimes looked up and loaded into scratch pages and compared with its own."""

    def __init__(self, index: int, work: Workload, engine: OffloadEngine, tally: Tally) -> None:
        self.index = index
        self.work = work
        self.engine = engine
        self.tally = tally
        self.generation = 0
        self.tokens = 0
        self.stored_pages = 0  # pages the store held after our last offload

    @property
    def namespace(self) -> list[str]:
        return [f"demo:{self.index}:{self.generation}"]

    async def step(self) -> None:
        work = self.work
        if self.stored_pages and work.rng.random() < VERIFY_SHARE:
            await self.verify()
        else:
            await self.append()

    async def append(self) -> None:
        work = self.work
        page_size = work.page_size
        grow = int(work.rng.integers(1, MAX_APPEND_PAGES * page_size + 1))
        if self.tokens + grow > work.budget_pages * page_size:
            self.generation += 1  # a fresh namespace: the old history is garbage now
            self.tokens = self.stored_pages = 0
            self.tally.restarts += 1
        first = self.tokens // page_size  # never a stored page: only full pages are stored
        self.tokens += grow
        last = -(-self.tokens // page_size)
        pages = work.own[self.index][first:last]
        for cache in work.caches:
            cache.index_copy_(0, pages, work.random_pages(len(pages)))
        result = await self.engine.offload(
            self.index, self.work.own[self.index][:last], self.tokens, namespace=self.namespace
        )
        self.tally.offloads += 1
        new_pages = result.cached_tokens // page_size - self.stored_pages
        self.tally.restored_pages += max(result.stored_tokens // page_size - new_pages, 0)
        self.stored_pages = result.cached_tokens // page_size

    async def verify(self) -> None:
        work = self.work
        page_size = work.page_size
        hit = await self.engine.lookup(self.index, self.tokens, namespace=self.namespace)
        self.tally.lookups += 1
        async with hit:
            hit_pages = hit.cached_tokens // page_size
            if hit_pages == 0:
                self.tally.misses += 1
                return
            if hit_pages == self.stored_pages:
                self.tally.full_hits += 1
            else:
                self.tally.partial_hits += 1  # part of the history was evicted
            scratch = work.scratch[self.index][:hit_pages]
            for cache in work.caches:
                cache.index_fill_(0, scratch, float("nan"))  # a load that writes nothing fails
            loaded = await self.engine.load(hit, scratch)
        self.tally.loads += 1
        pages = loaded.loaded_tokens // page_size
        # Bit-exact: compare the raw 16-bit patterns (NaN payloads included).
        same = all(
            torch.equal(
                cache.index_select(0, scratch[:pages]).view(torch.int16),
                cache.index_select(0, work.own[self.index][:pages]).view(torch.int16),
            )
            for cache in work.caches
        )
        self.tally.verified += 1
        if not same or pages != hit_pages:
            self.tally.mismatches += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except AiokvError as exc:  # counted, and the user carries on
                self.tally.failures += 1
                if len(self.tally.errors) < ERRORS_KEPT:
                    self.tally.errors.append(f"user {self.index}: {exc!r}")
                if isinstance(exc, EngineClosed):
                    return  # every later call would fail at once, without a pause
                # A call refused at once (Overloaded: more users than max_pending) raises
                # before it ever yields: trying again without a pause would keep the loop
                # from the results that free the room, and from the stop (its timer, the
                # signals) for good.
                await asyncio.sleep(RETRY_PAUSE_S)


def _build(args: argparse.Namespace) -> tuple[OffloadEngine, Workload, int]:
    from .running import pick_device  # auto = GPU if any

    device = pick_device(args.device)
    dtype = torch.bfloat16
    # The flags' ranges are checked where they are parsed (aiokv.cli, aiokv.flags).
    page_bytes = args.layers * 2 * args.page_size * args.heads * args.head_dim * dtype.itemsize
    budget = args.history_pages or max(
        MAX_APPEND_PAGES, min(32, CACHES_BYTES_CAP // (2 * args.users * page_bytes))
    )
    num_pages = 2 * args.users * budget
    page_numel = page_bytes // args.layers // dtype.itemsize
    noise_numel = max(NOISE_BYTES // dtype.itemsize, 4 * MAX_APPEND_PAGES * page_numel)
    store_bytes = int(STORE_PAGES_PER_USER_BUDGET * args.users * budget * page_bytes)
    _check_fits(args, device, budget, num_pages * page_bytes, store_bytes, noise_numel)
    caches = [
        torch.zeros(num_pages, 2, args.page_size, args.heads, args.head_dim, dtype=dtype,
                    device=device)
        for _ in range(args.layers)
    ]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # Scattered pages, so transfers gather and scatter as they would in a real cache.
    order = torch.randperm(num_pages, generator=generator, device=device)
    own = list(order[: args.users * budget].view(args.users, budget))
    scratch = list(order[args.users * budget :].view(args.users, budget))
    if args.config:
        engine_config, store_config = load_config(args.config)
    else:
        engine_config = EngineConfig()
        store_config = StoreConfig(cpu_cache_gb=store_bytes / GIB)
    store: Store = make_store(store_config)
    engine = OffloadEngine(store, caches, engine_config)
    noise = torch.randn(noise_numel, generator=generator, device=device).to(dtype)
    work = Workload(
        caches, own, scratch, args.page_size, budget, noise, np.random.default_rng(args.seed)
    )
    store_bytes_real = int(store_config.cpu_cache_gb * GIB)
    return engine, work, store_bytes_real


def _check_fits(args: argparse.Namespace, device: torch.device, budget: int,
                caches_bytes: int, store_bytes: int, noise_numel: int) -> None:
    """A usage error (MemoryError, see aiokv.flags.check_fits) before anything is made,
    where what the flags ask for would not fit in this machine's memory: the history
    budget never goes under MAX_APPEND_PAGES, so large pages or many users can ask for
    far more than CACHES_BYTES_CAP."""
    on_host = device.type == "cpu"
    needs = {
        "caches": caches_bytes if on_host else 0,
        # A --config names its store, and its host tier was checked where it was read.
        "store": 0 if args.config else store_bytes,
        "noise": noise_numel * 6 if on_host else 0,  # drawn as float32, kept as bfloat16
    }
    asked = (f"--users {args.users}, --layers {args.layers}, --page-size {args.page_size}, "
             f"--heads {args.heads}, --head-dim {args.head_dim}, {budget} history pages")
    check_fits(asked, needs)


@dataclass
class DemoRun:
    tally: Tally
    elapsed_s: float
    store_bytes: int
    stats: EngineStats
    stopped_by: signal.Signals | None = None  # the signal that ended it early


class _Stopper:
    """SIGINT and SIGTERM, while installed, end the run early: the first sets ``stop``
    (users finish their request, the engine drains, the summary follows); a second one
    cancels the run without waiting for that."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.signal: signal.Signals | None = None
        self._main = asyncio.current_task()
        self._installed: list[signal.Signals] = []

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            # Not where signals cannot be had: off the main thread, or on Windows.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.signal is not None and self._main is not None:
            self._main.cancel()
        self.signal = self.signal or sig
        self.stop.set()


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Whether ``stop`` is set within ``seconds``."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def _run_demo(args: argparse.Namespace) -> DemoRun:
    stopper = _Stopper(asyncio.Event())
    stopper.install()  # before the set-up: a Ctrl-C during it ends the run once it starts
    try:
        return await _serve_users(args, stopper)
    finally:
        stopper.remove()


async def _serve_users(args: argparse.Namespace, stopper: _Stopper) -> DemoRun:
    from tqdm import tqdm

    engine, work, store_bytes = _build(args)
    tally, stop = Tally(), stopper.stop
    users = [DemoUser(i, work, engine, tally) for i in range(args.users)]
    async with engine:
        tasks = [asyncio.create_task(u.run(stop), name=f"demo-user-{u.index}") for u in users]
        start = time.perf_counter()
        print(f"aiokv demo: {args.users} users on {work.caches[0].device} for "
              f"{args.seconds:g} s; Ctrl-C ends it early", flush=True)
        bar_format = "{l_bar}{bar}| {n:.1f}/{total:.0f}s {postfix}"
        with tqdm(total=args.seconds, desc="aiokv demo", file=sys.stderr, disable=None,
                  leave=False, bar_format=bar_format) as bar:
            while (elapsed := time.perf_counter() - start) < args.seconds:
                if await _stopped_within(stop, min(0.25, args.seconds - elapsed)):
                    break
                elapsed = time.perf_counter() - start
                bar.n = min(elapsed, args.seconds)
                done = tally.offloads + tally.lookups + tally.loads
                bar.set_postfix_str(f"{done / elapsed:,.0f} req/s")
        stop.set()
        # Users finish the request in flight; leaving the block drains the engine.
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        stats = engine.stats()
    return DemoRun(tally, elapsed, store_bytes, stats, stopper.signal)


def demo(args: argparse.Namespace) -> int:
    """Run the demo workload and print its summary; 1 on any mismatch or failure."""
    from .running import run_uvloop

    try:
        result = run_uvloop(_run_demo(args))
    except ConfigError as exc:  # a bad --config, or one whose page size differs
        print(f"aiokv demo: {exc}", file=sys.stderr)
        return 2
    except AiokvError as exc:  # the store cannot serve (a store server not running, say)
        print(f"aiokv demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as exc:
        if (message := too_large(exc)) is None:
            raise
        print(f"aiokv demo: error: {message}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:  # a second Ctrl-C: no drain, no summary
        print("aiokv demo: stopped by a second signal", file=sys.stderr)
        return 128 + signal.SIGINT
    _summary(args, result)
    stats, tally = result.stats, result.tally
    failed = stats.failed + stats.timed_out + stats.rejected + tally.failures
    if tally.mismatches or failed:
        return 1
    return 0 if result.stopped_by is None else 128 + result.stopped_by


def _summary(args: argparse.Namespace, run: DemoRun) -> None:
    tally, stats, elapsed = run.tally, run.stats, run.elapsed_s
    total = tally.offloads + tally.lookups + tally.loads
    stopped = f" (stopped by {run.stopped_by.name})" if run.stopped_by is not None else ""
    print(
        f"aiokv demo: {args.users} users for {elapsed:.2f} s{stopped}; store "
        f"{run.store_bytes / 2**20:.0f} MiB, {stats.bytes_offloaded / max(run.store_bytes, 1):.1f}x"
        " its size offloaded"
    )
    print(
        f"  requests/s     {total / elapsed:,.0f}: offload {tally.offloads / elapsed:,.0f}, "
        f"lookup {tally.lookups / elapsed:,.0f}, load {tally.loads / elapsed:,.0f}"
    )
    print(
        f"  batches        {stats.batches:,}, mean {stats.mean_batch_requests:.1f} requests; "
        f"latency p50 {stats.latency_p50_ms:.2f} ms, p99 {stats.latency_p99_ms:.2f} ms"
    )
    print(
        f"  moved          offload {stats.bytes_offloaded / GIB:.3f} GiB "
        f"({stats.bytes_offloaded / GIB / elapsed:.3f} GiB/s), load "
        f"{stats.bytes_loaded / GIB:.3f} GiB ({stats.bytes_loaded / GIB / elapsed:.3f} GiB/s)"
    )
    print(
        f"  lookups        {tally.full_hits} full hits, {tally.partial_hits} partial "
        f"(evicted tail), {tally.misses} misses; {tally.restored_pages} evicted pages "
        f"offloaded again; {tally.restarts} history restarts"
    )
    print(f"  verified       {tally.verified} loads bit-exact, {tally.mismatches} mismatches")
    failed = stats.failed + stats.timed_out + stats.rejected
    print(f"  failed         {failed} requests ({tally.failures} errors seen by users)")
    for error in tally.errors:
        print(f"    {error}")
    sys.stdout.flush()  # now, not at the interpreter's exit: it may tear torch down slowly
