"""The project's targets, judged on a run of the user's tool, ``aiokv bench``.

    python benchmarks/targets.py BENCH [the bench's flags] [--json PATH]

BENCH is ``engine``, ``bandwidth`` or ``lag`` (the slot-mapping targets compare the fused
path with re-creations of NVIDIA's recommender examples: benchmarks/slots_recsys.py).
The bench runs in this process exactly as ``aiokv bench BENCH ...`` would (it prints its
table); then each target is printed with its verdict, and ``--json`` writes the bench's
document with ``targets`` added (bandwidth: each row also gets ``target``,
``target_judged_on``, ``pass`` and ``target_applies``). A target marked not applying
(``applies``: false) was measured on a CPU where it is set for a GPU. The exit status is
the bench's: a miss is a finding to read, not a crash.

Targets:
  engine     engine/baseline >= 5x at 256 users; < 20 us of engine CPU per request at
             the CPU batch (--cpu-users, 64 by default).
  bandwidth  on the steady stream (one batch when --stream-batches is 1), offload and
             load each >= 95% of the raw copy for 32+ users of 2048+ tokens, >= 90% for
             8 users; for a GPU's copies.
  lag        the loaded phase's tick lateness: p99 < 1 ms, max < 5 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv.bench import main as bench_main

ENGINE_RATIO, ENGINE_RATIO_USERS = 5.0, 256  # engine / baseline at 256 users
ENGINE_CPU_US = 20.0  # engine CPU per request at the CPU batch
BANDWIDTH_LARGE = 0.95  # of raw, at >= 32 users of >= 2048 tokens
BANDWIDTH_SMALL = 0.90  # of raw, at 8 users
LAG_P99_MS, LAG_MAX_MS = 1.0, 5.0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def passes(fractions: Sequence[float], goal: float) -> bool:
    """Every fraction of raw meets ``goal``. A NaN (the stream took no longer than one
    batch, so the steady figure could not be measured) fails: ``min`` would skip it or
    not depending on its place."""
    return all(math.isfinite(f) and f >= goal for f in fractions)


def _target(name: str, goal: str, measured: float, ok: bool, applies: bool) -> dict[str, Any]:
    return {"name": name, "goal": goal, "measured": measured, "pass": ok, "applies": applies}


def engine_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    targets = [
        _target(f"engine/baseline at {ENGINE_RATIO_USERS} users", f">= {ENGINE_RATIO:g}x",
                row["ratio"], row["ratio"] >= ENGINE_RATIO, True)
        for row in document["rows"] if row["users"] == ENGINE_RATIO_USERS
    ]
    cpu = document["cpu"]
    cpu_us = cpu["engine_us_per_request"]
    targets.append(_target(f"engine CPU per request at batch {cpu['users']}",
                           f"< {ENGINE_CPU_US:g} us", cpu_us, cpu_us < ENGINE_CPU_US, True))
    return targets


def bandwidth_goal(users: int, tokens: int) -> float | None:
    if users >= 32 and tokens >= 2048:
        return BANDWIDTH_LARGE
    if users == 8:
        return BANDWIDTH_SMALL
    return None


def bandwidth_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    """One target per row with a goal; each row gets its target fields too."""
    on_gpu = document["environment"]["device"].startswith("cuda")
    targets = []
    for row in document["rows"]:
        stream = "stream_offload_of_raw" in row  # judged on the steady stream when run
        judged = "stream_" if stream else ""
        goal = bandwidth_goal(row["users"], row["tokens"])
        fractions = (row[f"{judged}offload_of_raw"], row[f"{judged}load_of_raw"])
        row["target"] = goal
        row["target_judged_on"] = "steady stream" if stream else "one batch"
        row["pass"] = None if goal is None else passes(fractions, goal)
        row["target_applies"] = on_gpu  # the targets are for a GPU's copies
        if goal is not None:
            targets.append(_target(
                f"{row['users']}x{row['tokens']} offload and load of raw "
                f"({row['target_judged_on']})", f">= {goal:.0%}",
                # min() may skip a NaN (an unmeasured figure) by its place: shown as one
                min(fractions) if all(map(math.isfinite, fractions)) else math.nan,
                row["pass"], on_gpu))
    return targets


def lag_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    loaded = document["rows"][-1]
    return [
        _target("p99 lateness", f"< {LAG_P99_MS:g} ms", loaded["p99_ms"],
                loaded["p99_ms"] < LAG_P99_MS, True),
        _target("max lateness", f"< {LAG_MAX_MS:g} ms", loaded["max_ms"],
                loaded["max_ms"] < LAG_MAX_MS, True),
    ]


JUDGES: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "engine": engine_targets,
    "bandwidth": bandwidth_targets,
    "lag": lag_targets,
}


def print_targets(targets: Sequence[dict[str, Any]]) -> None:
    for target in targets:
        shown = verdict(target["pass"]) if target["applies"] else "n/a here (set for a GPU)"
        print(f"  target {target['name']} {target['goal']}: {target['measured']:.3g}  {shown}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every other flag goes to the bench (see aiokv bench BENCH --help).",
    )
    parser.add_argument("bench", choices=sorted(JUDGES))
    parser.add_argument("--json", metavar="PATH", help="the bench's results with the targets")
    args, bench_argv = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        measured = Path(scratch) / "bench.json"
        status = bench_main([args.bench, *bench_argv, "--json", str(measured)])
        if status != 0:
            return status
        document: dict[str, Any] = json.loads(measured.read_text())
    targets = document["targets"] = JUDGES[args.bench](document)
    print_targets(targets)
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
