"""Offload throughput on real FlexKV: today's synchronous serving loop vs the aiokv engine.

(a) sync: the recommender-serving style of today, one batch at a time: page ids on the GPU
    copied to the host once per user, slots built per user, ``put_match`` per user, one
    ``launch(as_batch=True)``, then a blocking ``wait``.
(b) aiokv: the same requests through ``OffloadEngine`` on FlexKV with the same settings,
    all issued concurrently (``await engine.offload`` per user); the engine forms batches of
    the same size and overlaps one batch's matching with the previous one's copy. "One
    round" is the engine driven like (a), one batch at a time. By default (b)'s FlexKV runs
    in a child process, as ``make_store`` runs it (``--own-process``); (a)'s runs in this
    process, as serving code calls it today, and is closed before (b) starts.

The event loop's stalls are measured by a 100 µs ticker task in two more passes:
- "paced": the rounds arrive one after another, each round's users at once, at twice the
  rate (b) sustained (so the engine never runs dry). This is serving traffic at full load,
  and the pass the stall target is judged on. Its throughput is printed but not judged:
  the spinning ticker competes for the GIL with the store thread, which bounds the rows
  where matching is the bottleneck (32 x 1024 on FlexKV). Its three worst ticks are
  split into the loop thread's CPU time and the rest (waiting for the GIL, mostly).
- "burst": (b) again, every round's callers made ready in one loop iteration. asyncio runs
  them all in that iteration, so its stall grows with their number whatever they await;
  "floor" is that iteration's stall when the same callers await a no-op.

Every round writes fresh keys (new namespaces), so every page is copied. Needs flexkv and a
CUDA GPU; run as ``python benchmarks/flexkv_offload.py [--json out.json]``. FlexKV starts
its transfer engine with multiprocessing "spawn": keep the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import time
from typing import Any

import numpy as np
import torch
import yaml
from targets import verdict  # benchmarks/targets.py: the project's verdicts

import aiokv
from aiokv.stores.base import Store
from aiokv.stores.flexkv import FlexKVStore, flexkv_available
from aiokv.testing import SharedStore

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 256, 32
WINDOW_US, POLL_US = 300, 50
STORE_SLICE_US: int | None = None  # EngineConfig.store_slice_us; None: the store's advice


def sync_round(manager: Any, page_ids: list[torch.Tensor], tokens: int, tag: str) -> int:
    """One batch the synchronous way; returns tokens written."""
    ids, slot_mappings, written = [], [], 0
    offsets = np.arange(PAGE, dtype=np.int64)
    for user, pages in enumerate(page_ids):
        host_pages = pages.cpu().numpy().astype(np.int64)  # one D2H copy per user
        token_ids = np.arange(tokens, dtype=np.int64)
        task_id, mask = manager.put_match(token_ids, namespace=[f"{tag}-u{user}"])
        slots = (host_pages[:, None] * PAGE + offsets).reshape(-1)[: len(mask)][mask]
        ids.append(task_id)
        slot_mappings.append(slots)
        written += int(mask.sum())
    launched = manager.launch(ids, slot_mappings, as_batch=len(ids) > 1)
    responses = manager.wait(launched, timeout=60.0)
    for response in responses.values():
        if "SUCCESS" not in str(response.status):
            raise RuntimeError(f"FlexKV answered {response.status}")
    return written


async def engine_rounds(
    engine: aiokv.OffloadEngine,
    page_ids: list[torch.Tensor],
    tokens: int,
    tags: list[str],
    pipelined: bool,
    pacing_s: float = 0.0,
) -> int:
    """Offload ``tags`` rounds of every user's pages: one round at a time, all at once
    (``pipelined``), or one round every ``pacing_s`` seconds."""

    async def one_round(tag: str) -> int:
        results = await asyncio.gather(
            *(
                engine.offload(u, pages, tokens, namespace=[f"{tag}-u{u}"])
                for u, pages in enumerate(page_ids)
            )
        )
        return sum(r.stored_tokens for r in results)

    if pacing_s:
        start = time.perf_counter()

        async def round_at(index: int, tag: str) -> int:
            delay = start + index * pacing_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await one_round(tag)

        return sum(await asyncio.gather(*(round_at(i, tag) for i, tag in enumerate(tags))))
    if pipelined:
        return sum(await asyncio.gather(*(one_round(tag) for tag in tags)))
    return sum([await one_round(tag) for tag in tags])


# Every garbage collection in this process, in any thread, as (start, end) perf_counter
# spans: a collection holds the GIL, so a worst tick that overlaps one waited for it.
GC_SPANS: list[tuple[float, float]] = []
_gc_started = [0.0]


def _record_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        GC_SPANS.append((_gc_started[0], time.perf_counter()))


async def ticker(
    lateness_s: list[float], stop: asyncio.Event, loop_cpu_s: list[float] | None = None,
    woke_s: list[float] | None = None,
) -> None:
    """Asks to wake every 100 µs and records how late it woke (perf_counter: uvloop's
    loop.time() moves in 1 ms steps). Under uvloop a sleep this short wakes on the next
    loop iteration, so the ticker spins and the worst lateness is the loop's worst stall.
    ``loop_cpu_s`` gets the loop thread's CPU time over each tick: what of a stall was
    the loop's own work, and what was waiting (for the GIL, mostly)."""
    while not stop.is_set():
        cpu = time.thread_time()
        due = time.perf_counter() + 100e-6
        await asyncio.sleep(100e-6)
        lateness_s.append(max(0.0, time.perf_counter() - due))
        if loop_cpu_s is not None:
            loop_cpu_s.append(time.thread_time() - cpu)
        if woke_s is not None:
            woke_s.append(time.perf_counter())


def worst_ticks(
    lateness_s: list[float], loop_cpu_s: list[float], woke_s: list[float], count: int = 3
) -> list[dict[str, float]]:
    """The ``count`` latest ticks, ms: lateness; the loop thread's CPU time over the tick;
    the rest of the tick's span (lateness + 100 µs), when the loop thread ran no code
    (waiting for the GIL, off the CPU, or idle in the ticker's own sleep); and how much
    of the span garbage collections (any thread's) took."""
    latest = sorted(range(len(lateness_s)), key=lateness_s.__getitem__, reverse=True)

    def gc_overlap(i: int) -> float:
        end = woke_s[i]
        begin = end - lateness_s[i] - 100e-6
        return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in GC_SPANS)

    return [
        {
            "lateness_ms": lateness_s[i] * 1e3,
            "loop_cpu_ms": loop_cpu_s[i] * 1e3,
            "rest_ms": max(0.0, lateness_s[i] + 100e-6 - loop_cpu_s[i]) * 1e3,
            "gc_ms": gc_overlap(i) * 1e3,
        }
        for i in latest[:count]
    ]


async def burst_floor(users: int, rounds: int, repeats: int = 5) -> float:
    """The worst ticker lateness of the watched pass's burst shape (``rounds`` x ``users``
    callers made ready at once) when each caller awaits a no-op instead of the engine:
    what the callers' own coroutines cost the loop in that one iteration, the floor under
    the engine's worst stall. It is the worst over ``repeats`` passes, where the engine's
    burst is one pass, so it errs high: read it as an upper bound of the callers' share.
    (``lag_max_ms`` and ``lag_p99_ms`` in the JSON are this burst pass, as they were when
    it was the only watched pass; the paced pass's are ``paced_*``.)"""
    loop = asyncio.get_running_loop()

    async def no_op() -> None:
        done = loop.create_future()
        loop.call_soon(done.set_result, None)
        await done

    async def one_round() -> None:
        await asyncio.gather(*(no_op() for _ in range(users)))

    worst = 0.0
    for repeat in range(repeats + 1):  # the first warms up
        lateness: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(lateness, stop))
        await asyncio.sleep(0.005)
        lateness.clear()
        await asyncio.gather(*(one_round() for _ in range(rounds)))
        await asyncio.sleep(0.002)
        stop.set()
        await tick
        if repeat:
            worst = max(worst, *lateness, 0.0)
    return worst


async def run_engine(
    store: Store, caches: list[torch.Tensor], page_ids: list[torch.Tensor], tokens: int,
    tags: list[str], pipelined: bool, watch: bool, pacing_s: float = 0.0,
    loop_cpu_s: list[float] | None = None, woke_s: list[float] | None = None,
) -> tuple[int, float, list[float]]:
    config = aiokv.EngineConfig(window_us=WINDOW_US, max_batch_requests=len(page_ids),
                                max_batch_tokens=1 << 30, poll_interval_us=POLL_US,
                                store_slice_us=STORE_SLICE_US)
    engine = aiokv.OffloadEngine(store, caches, config)
    lateness: list[float] = []
    stop = asyncio.Event()
    async with engine:
        await engine_rounds(engine, page_ids, tokens, ["warm-" + t for t in tags[:1]], False)
        gc.collect()
        gc.freeze()  # what a serving process does after start-up: no full GC of old objects
        tick = asyncio.ensure_future(ticker(lateness, stop, loop_cpu_s, woke_s)) if watch else None
        await asyncio.sleep(0.01)
        lateness.clear()
        GC_SPANS.clear()
        for per_tick in (loop_cpu_s, woke_s):
            if per_tick is not None:
                per_tick.clear()
        start = time.perf_counter()
        written = await engine_rounds(engine, page_ids, tokens, tags, pipelined, pacing_s)
        elapsed = time.perf_counter() - start
        stop.set()
        if tick is not None:
            await tick
    return written, elapsed, lateness


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", default="8,32")
    parser.add_argument("--tokens", default="1024,2048")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cpu-cache-gb", type=float, default=16.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--window-us", type=int, default=300)
    parser.add_argument("--poll-us", type=int, default=200)
    parser.add_argument(
        "--store-slice-us", type=int, default=None,
        help="EngineConfig.store_slice_us: the store thread hands the GIL to the loop "
        "after this much work (default: the store's advice, 200 for FlexKV; 0: never)",
    )
    parser.add_argument(
        "--own-process", choices=("auto", "0", "1"), default="auto",
        help="StoreConfig.own_process for (b): 1 runs FlexKV in a child process "
        "(ProcessStore), 0 in this one, auto (the default) as the config's default does "
        "(a child, for FlexKV). (a) always runs FlexKV in this process, as serving code "
        "calls it today",
    )
    parser.add_argument(
        "--switch-interval-us", type=int, default=0,
        help="sys.setswitchinterval for this process (0: leave Python's 5 ms default)",
    )
    parser.add_argument(
        "--flexkv", action="append", default=[], metavar="KEY=VALUE",
        help="a store.flexkv setting, repeatable; e.g. server_client_mode=1 runs FlexKV's "
        "index in a process of its own (FlexKV's server-client mode)",
    )
    args = parser.parse_args(argv)
    flexkv_settings: dict[str, Any] = {}
    for item in args.flexkv:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--flexkv takes KEY=VALUE, got {item!r}")
        flexkv_settings[key] = yaml.safe_load(value)
    global WINDOW_US, POLL_US, STORE_SLICE_US
    WINDOW_US, POLL_US, STORE_SLICE_US = args.window_us, args.poll_us, args.store_slice_us
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    gc.callbacks.append(_record_gc)
    reason = flexkv_available()
    if reason is not None:
        print(f"skipped: FlexKV not usable here ({reason})")
        return 0
    import uvloop

    users_list = [int(x) for x in args.users.split(",")]
    tokens_list = [int(x) for x in args.tokens.split(",")]
    pages_needed = max(users_list) * max(tokens_list) // PAGE
    caches = [
        torch.randn(pages_needed * 2, 2, PAGE, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    bytes_per_token = LAYERS * 2 * HEADS * HEAD_DIM * 2
    config = aiokv.StoreConfig(backend="flexkv", page_size=PAGE, cpu_cache_gb=args.cpu_cache_gb,
                               flexkv=flexkv_settings,
                               own_process={"auto": None, "0": False, "1": True}[
                                   args.own_process])
    generator = torch.Generator().manual_seed(0)
    shapes = [(users, tokens) for users in users_list for tokens in tokens_list]
    page_ids_of = {}
    for users, tokens in shapes:
        perm = torch.randperm(pages_needed * 2, generator=generator)[: users * (tokens // PAGE)]
        page_ids_of[users, tokens] = [p.cuda() for p in perm.view(users, tokens // PAGE)]
    # (a) drives a KVManager in this process, as serving code does today: the store's own
    # when (b) runs FlexKV here too; else one of its own, closed before (b) starts, so
    # that no FlexKV runs in this process while (b) is measured.
    sync_store = FlexKVStore(dataclasses.replace(config, own_process=False))
    # One wrapper for every engine: it registers the store once and leaves it open.
    shared = SharedStore(sync_store)
    t0 = time.perf_counter()
    shared.register(caches)
    print(f"FlexKV ready in {time.perf_counter() - t0:.1f}s", flush=True)
    results: dict[tuple[int, int], dict[str, Any]] = {}
    try:
        for users, tokens in shapes:
            page_ids, tag = page_ids_of[users, tokens], f"{users}x{tokens}"
            sync_round(sync_store._manager, page_ids, tokens, f"warm-sync-{tag}")
            torch.cuda.synchronize()
            start = time.perf_counter()
            written = sum(
                sync_round(sync_store._manager, page_ids, tokens, f"sync-{tag}-{r}")
                for r in range(args.rounds)
            )
            sync_s = time.perf_counter() - start
            results[users, tokens] = {"users": users, "tokens": tokens,
                                      "sync_gib_s": written * bytes_per_token / sync_s / 2**30}
    except BaseException:
        sync_store.close()
        raise
    store: Store = sync_store
    if config.in_own_process():
        sync_store.close()
        store = aiokv.stores.make_store(config)
        shared = SharedStore(store)
        t0 = time.perf_counter()
        shared.register(caches)
        print(f"{type(store).__name__} ready in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    try:
        for users, tokens in shapes:
            page_ids, tag = page_ids_of[users, tokens], f"{users}x{tokens}"
            result = results[users, tokens]
            # "engine": one round at a time, like (a). "concurrent": all rounds' requests
            # at once. "paced" and "watched" (the burst) run with the 100 µs ticker
            # measuring loop stalls (it spins the loop, so they get passes of their own).
            pacing_s = 0.0
            for mode, pipelined, watch in (
                ("engine", False, False),
                ("concurrent", True, False),
                ("paced", True, True),
                ("watched", True, True),
            ):
                tags = [f"{mode}-{tag}-{r}" for r in range(args.rounds)]
                loop_cpu: list[float] = []
                woke: list[float] = []
                written_e, elapsed, lateness = uvloop.run(
                    run_engine(shared, caches, page_ids, tokens, tags, pipelined, watch,
                               pacing_s if mode == "paced" else 0.0, loop_cpu, woke)
                )
                result[f"{mode}_gib_s"] = written_e * bytes_per_token / elapsed / 2**30
                if mode == "concurrent":
                    # Arrivals at twice the rate (b) sustained: the engine never waits
                    # for work, and each round's callers arrive together. (At 1.25x,
                    # a lone first round's latency still showed in 6 rounds' rate.)
                    pacing_s = elapsed / args.rounds / 2
                    result["pacing_ms"] = pacing_s * 1e3
                if watch:
                    lat = np.asarray(lateness) * 1e3 if lateness else np.zeros(1)
                    prefix = "paced_" if mode == "paced" else ""
                    result[f"{prefix}lag_max_ms"] = float(lat.max())
                    result[f"{prefix}lag_p99_ms"] = float(np.percentile(lat, 99))
                    result[f"{prefix}ticks"] = len(lateness)
                    result[f"{prefix}worst_ticks"] = worst_ticks(lateness, loop_cpu, woke)
                if mode == "watched":
                    result["burst_floor_max_ms"] = 1e3 * uvloop.run(
                        burst_floor(users, args.rounds)
                    )
            # b/a from (b), unwatched; the worst stall from the paced pass.
            result["pass"] = (
                result["concurrent_gib_s"] / result["sync_gib_s"] >= 1.2
                and result["paced_lag_max_ms"] < 1.0
            )
            rows.append(result)
            print(json.dumps(result), flush=True)
    finally:
        store.close()
    print(f"\n{'users':>5} {'tokens':>6} | {'(a) sync':>8} | {'(b) aiokv':>9} {'b/a':>5} | "
          f"{'one round':>9} {'/a':>5} | {'paced':>6} {'/a':>5} {'lag p99':>7} {'lag max':>7} | "
          f"{'burst':>6} {'lag max':>7} {'floor':>6} | verdict")
    print(f"{'':>5} {'':>6} | {'GiB/s':>8} | {'GiB/s':>9} {'':>5} | {'GiB/s':>9} {'':>5} | "
          f"{'GiB/s':>6} {'':>5} {'ms':>7} {'ms':>7} | {'GiB/s':>6} {'ms':>7} {'ms':>6} |")
    for r in rows:
        a = r["sync_gib_s"]
        met = r["pass"]
        print(f"{r['users']:>5} {r['tokens']:>6} | {a:>8.1f} | {r['concurrent_gib_s']:>9.1f} "
              f"{r['concurrent_gib_s'] / a:>5.2f} | {r['engine_gib_s']:>9.1f} "
              f"{r['engine_gib_s'] / a:>5.2f} | {r['paced_gib_s']:>6.1f} "
              f"{r['paced_gib_s'] / a:>5.2f} {r['paced_lag_p99_ms']:>7.3f} "
              f"{r['paced_lag_max_ms']:>7.3f} | {r['watched_gib_s']:>6.1f} "
              f"{r['lag_max_ms']:>7.3f} {r['burst_floor_max_ms']:>6.3f} | "
              f"{verdict(met)}")
    for r in rows:
        ticks = ", ".join(
            f"{t['lateness_ms']:.2f} ({t['loop_cpu_ms']:.2f} + {t['rest_ms']:.2f}, "
            f"gc {t['gc_ms']:.2f})"
            for t in r["paced_worst_ticks"]
        )
        print(f"  {r['users']} x {r['tokens']} paced, worst ticks, ms "
              f"(loop CPU + rest, of which GC): {ticks}")
    print("  paced: each round's users at once, rounds at twice the rate (b) sustained, with a "
          "100 µs ticker; verdict: b/a >= 1.2 and the paced pass's worst stall < 1 ms.\n"
          "  burst: every round's callers made ready in one iteration; floor: that burst's "
          "worst stall over 5 passes when the callers await a no-op instead of the engine")
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "argv": sys.argv, "rounds": args.rounds,
                "window_us": WINDOW_US, "poll_interval_us": POLL_US,
                "store": type(store).__name__,
                "store_slice_us": STORE_SLICE_US
                if STORE_SLICE_US is not None else getattr(store, "store_slice_us", 0),
                "switch_interval_s": sys.getswitchinterval(), "flexkv": flexkv_settings}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
