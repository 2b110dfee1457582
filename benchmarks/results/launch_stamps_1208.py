"""Throwaway probe (twenty-eighth session): where the wall time of one recsys core load
goes, step by step, on the calling thread. py-spy at 2,000 Hz with --subprocesses could
not keep up with the recsys harness (about 60 samples a second reached aiokv's threads),
so this stamps the steps in-process instead.

    python benchmarks/results/launch_stamps_1208.py --device cuda --tokens 2048 --rounds 200

recsys's geometry (3 layers, 4 heads x 128, page 32, bfloat16), 8 users x ``--tokens``
offloaded once; per round, 8 lookups through the recsys core, then ``RecsysCore.load``
(queued by this thread, aiokv.direct) timed from its call: each wrapped step's first entry
and last exit, in ms from the call, medians over the rounds; then the wait (outcomes).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

import aiokv
from aiokv import direct
from aiokv.copy import copier, queueing
from aiokv.integrations import pending
from aiokv.integrations.recsys_core import RecsysCore
from aiokv.stores.local import jobs
from aiokv.stores.local import store as local_store

_t0 = 0.0
_seen: dict[str, float] = {}


def _wrap(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _seen.setdefault(f"{label} >", time.perf_counter() - _t0)
        try:
            return original(*args, **kwargs)
        finally:
            _seen[f"{label} <"] = time.perf_counter() - _t0

    setattr(owner, name, wrapped)


def main() -> None:
    global _t0
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    layers, heads, dim, page, users, tokens = 3, 4, 128, 32, 8, args.tokens
    pages = tokens // page
    num_pages = 4 * users * pages
    caches = [torch.randn(num_pages, 2, page, heads, dim, device=device, dtype=torch.bfloat16)
              for _ in range(layers)]
    history = sum(c[: users * pages].nbytes for c in caches)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=max(0.05, 3 * history / 1e9),
                                               page_size=page))
    kv = aiokv.run_in_background(aiokv.OffloadEngine(store, caches,
                                                     aiokv.EngineConfig(window_us=0)))
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    sources = [order[u * pages:(u + 1) * pages].to(device) for u in range(users)]
    targets = [order[(users + u) * pages:(users + u + 1) * pages].to(device, torch.int32)
               for u in range(users)]
    for f in [kv.submit_offload(u, sources[u], tokens) for u in range(users)]:
        f.result()
    core = RecsysCore(kv)
    for owner, name, label in [
        (kv.engine, "_caller_event", "caller_event"),
        (kv._gate, "counted", "gate.counted"),
        (direct, "_start_many", "_start_many"),
        (direct, "_view", "_view (per user)"),
        (local_store.LocalStore, "take_loads", "take_loads"),
        (jobs.CopyJobs, "queue_here", "CopyJobs.queue_here"),
        (copier.Copier, "_queue_job", "_queue_job"),
        (copier.Copier, "_host_ids", "ids fetch"),
        (copier.Copier, "_checked", "check"),
        (copier, "plan", "plan"),
        (queueing.Queuer, "prepare", "Queuer.prepare"),
        (queueing.Queuer, "queue", "Queuer.queue"),
        (pending.PendingCalls, "with_taken", "with_taken"),
    ]:
        _wrap(owner, name, label)
    rows: dict[str, list[float]] = defaultdict(list)
    for r in range(args.rounds + 10):
        hits = core.lookup(list(range(users)), [tokens] * users)
        if device.type == "cuda":
            torch.cuda.synchronize()
        _seen.clear()
        _t0 = time.perf_counter()
        waiting = core.load(hits, targets)
        launched = time.perf_counter() - _t0
        done = waiting.outcomes()
        ended = time.perf_counter() - _t0
        if any(getattr(d, "loaded_tokens", None) != tokens for d in done):
            raise RuntimeError(f"core loaded {done}")
        if r >= 10:
            for label, at in _seen.items():
                rows[label].append(at * 1e3)
            rows["~ load returned"].append(launched * 1e3)
            rows["~ outcomes in"].append(ended * 1e3)
    kv.close()
    print(f"8 x {tokens}, {device}, median of {args.rounds}, ms from RecsysCore.load's call:")
    for label, values in sorted(rows.items(), key=lambda kv_: statistics.median(kv_[1])):
        print(f"  {statistics.median(values):8.3f}  {label}")


if __name__ == "__main__":
    main()
