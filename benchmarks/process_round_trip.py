"""What a store call costs when the store runs in a child process (``own_process``).

The local store on CPU caches, once in this process and once behind ProcessStore, side by
side in one run: per verb, the wall time per call and this thread's CPU time per call
(the part that holds this process's GIL, and so can hold off an event loop), with the
ratio child / here. Verbs: ``cancel([])`` (the bare round trip), ``put_match`` of
``--tokens`` new tokens followed by its ``cancel``, and ``try_wait`` of nothing launched.
CPU only: ``python benchmarks/process_round_trip.py [--calls 2000] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiokv
from aiokv.stores import ProcessStore
from aiokv.stores.base import Store

PAGE = 16


def per_call(call: Callable[[int], object], calls: int) -> tuple[float, float]:
    """(wall, this thread's CPU) per call, in µs, after a warm-up."""
    for i in range(min(50, calls)):
        call(i)
    wall, cpu = time.perf_counter(), time.thread_time()
    for i in range(calls):
        call(i)
    return (
        (time.perf_counter() - wall) / calls * 1e6,
        (time.thread_time() - cpu) / calls * 1e6,
    )


def measure(store: Store, calls: int, tokens: int) -> dict[str, tuple[float, float]]:
    token_ids = np.arange(tokens, dtype=np.int64)

    def put_then_cancel(i: int) -> None:
        task, _ = store.put_match(token_ids, [f"n{i}"])
        store.cancel([task])

    return {
        "cancel([])": per_call(lambda i: store.cancel([]), calls),
        f"put_match({tokens}) + cancel": per_call(put_then_cancel, calls),
        "try_wait([unknown id])": per_call(lambda i: store.try_wait([10**9]), calls),
    }


def measure_batch(
    store: ProcessStore, calls: int, args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    token_ids = np.arange(args.tokens, dtype=np.int64)

    def one_by_one(i: int) -> None:
        tasks = [store.put_match(token_ids, [f"b{i}-{u}"])[0] for u in range(args.batch)]
        store.cancel(tasks)

    def at_once(i: int) -> None:
        answers = store.put_match_many(
            [(token_ids, [f"m{i}-{u}"]) for u in range(args.batch)]
        )
        store.cancel([a[0] for a in answers if not isinstance(a, Exception)])

    return {"one call each": per_call(one_by_one, calls),
            "put_match_many": per_call(at_once, calls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    pages = args.tokens // PAGE + 1
    caches = [torch.zeros(pages, 2, PAGE, 2, 16) for _ in range(2)]
    results: dict[str, dict[str, tuple[float, float]]] = {}
    batch: dict[str, tuple[float, float]] = {}
    for name, own_process in (("here", False), ("child", True)):
        store = aiokv.stores.make_store(aiokv.StoreConfig(cpu_cache_gb=0.05,
                                                          own_process=own_process))
        store.register(caches)
        try:
            results[name] = measure(store, args.calls, args.tokens)
            if isinstance(store, ProcessStore):
                batch = measure_batch(store, max(1, args.calls // args.batch), args)
        finally:
            store.close()
    print(f"{'verb':<30} | {'wall µs, here':>13} {'child':>8} {'ratio':>6} | "
          f"{'CPU µs, here':>12} {'child':>8} {'ratio':>6}")
    rows = []
    for verb, (here_wall, here_cpu) in results["here"].items():
        child_wall, child_cpu = results["child"][verb]
        rows.append({"verb": verb, "here_wall_us": here_wall, "child_wall_us": child_wall,
                     "here_cpu_us": here_cpu, "child_cpu_us": child_cpu})
        print(f"{verb:<30} | {here_wall:>13.1f} {child_wall:>8.1f} {child_wall / here_wall:>6.1f} "
              f"| {here_cpu:>12.1f} {child_cpu:>8.1f} {child_cpu / here_cpu:>6.1f}")
    print("  CPU: this thread's, user and kernel, an upper bound of a call's hold on this "
          "process's GIL; the child's own work is not in it")
    each_wall, each_cpu = batch["one call each"]
    many_wall, many_cpu = batch["put_match_many"]
    print(f"\na batch of {args.batch} put_matches of {args.tokens} tokens in the child, per "
          f"batch: one call each {each_wall:.0f} µs wall / {each_cpu:.0f} µs CPU; "
          f"put_match_many {many_wall:.0f} / {many_cpu:.0f} µs "
          f"(ratio {many_wall / each_wall:.2f} / {many_cpu / each_cpu:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"calls": args.calls, "tokens": args.tokens,
                                               "rows": rows, "batch": args.batch,
                                               "batch_us": batch}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
