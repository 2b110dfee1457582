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
  engine     engine/baseline >= 5x at 256 users (not measured, so not met, when --users
             has no 256); < 20 us of engine CPU per request at the CPU batch (--cpu-users,
             64 by default).
  bandwidth  issue 34's, for a GPU's copies: offload and load each >= 95% of the raw copy
             on the steady stream in every row (when a stream runs); one batch alone
             >= 85% at 8 x 1024 and >= 95% at 32 x 2048. With --mixed: the engine's two
             directions >= 90% of the raw duplex copy.
  lag        the loaded phase's lateness over time: p99 < 1 ms, max < 5 ms.
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
BANDWIDTH_STEADY = 0.95  # of raw, the steady stream, every row
BANDWIDTH_ONE_BATCH = {(8, 1024): 0.85, (32, 2048): 0.95}  # of raw, one batch alone
MIXED_OF_DUPLEX = 0.90  # of the raw duplex copy, offloads and loads at once
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
    rows = [row for row in document["rows"] if row["users"] == ENGINE_RATIO_USERS]
    ratio = rows[0]["ratio"] if rows else math.nan  # not measured: shown, and not met
    targets = [_target(f"engine/baseline at {ENGINE_RATIO_USERS} users", f">= {ENGINE_RATIO:g}x",
                       ratio, passes([ratio], ENGINE_RATIO), True)]
    cpu = document["cpu"]
    cpu_us = cpu["engine_us_per_request"]
    targets.append(_target(f"engine CPU per request at batch {cpu['users']}",
                           f"< {ENGINE_CPU_US:g} us", cpu_us, cpu_us < ENGINE_CPU_US, True))
    return targets


def bandwidth_targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    """One target per row and figure with a goal (the steady stream's in every row where
    a stream ran; one batch alone's where issue 34 sets one); each row gets its target
    fields too (``target``: its steady goal, or its one-batch goal without a stream)."""
    on_gpu = document["environment"]["device"].startswith("cuda")
    if "rows" not in document:  # --mixed
        share = document["result"]["of_raw_duplex"]
        return [_target("offloads and loads at once, of the raw duplex copy",
                        f">= {MIXED_OF_DUPLEX:.0%}", share, passes([share], MIXED_OF_DUPLEX),
                        on_gpu)]
    targets = []
    for row in document["rows"]:
        shape = f"{row['users']}x{row['tokens']}"
        judged = []
        if "stream_offload_of_raw" in row:
            judged.append(("steady stream", "stream_", BANDWIDTH_STEADY))
        one_batch = BANDWIDTH_ONE_BATCH.get((row["users"], row["tokens"]))
        if one_batch is not None:
            judged.append(("one batch", "", one_batch))
        row["target"] = judged[0][2] if judged else None
        row["target_judged_on"] = judged[0][0] if judged else None
        row["target_applies"] = on_gpu  # the targets are for a GPU's copies
        row["pass"] = None
        for label, prefix, goal in judged:
            fractions = (row[f"{prefix}offload_of_raw"], row[f"{prefix}load_of_raw"])
            ok = passes(fractions, goal)
            row["pass"] = ok if row["pass"] is None else row["pass"] and ok
            targets.append(_target(
                f"{shape} offload and load of raw ({label})", f">= {goal:.0%}",
                # min() may skip a NaN (an unmeasured figure) by its place: shown as one
                min(fractions) if all(map(math.isfinite, fractions)) else math.nan,
                ok, on_gpu))
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
