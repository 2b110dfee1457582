"""The report of benchmarks/recsys_client.py: recsys-examples' test phases per storage,
and per sequence length the profiler's step times of aiokv and FlexKVStorage beside the
published H100 figures, with the ratios the issue sets targets for. Pure: a results
dict in, text out.
"""

from __future__ import annotations

import statistics
from typing import Any

# corelib/recsys_kvcache_manager/test/FLEXKV_CPU_BREAKDOWN.md at 43465aea, table 1.2, L1
# (ms, FlexKVStorage on an NVIDIA H100, batch 8), by tokens per user.
PUBLISHED_H100_MS: dict[str, dict[int, float]] = {
    "step1.lookup": {1024: 2.834, 2048: 3.523, 4096: 3.642},
    "step1.allocate": {1024: 0.839, 2048: 1.140, 4096: 1.153},
    "step1.offload_launch": {1024: 3.132, 2048: 3.793, 4096: 4.314},
    "step1.offload_wait": {1024: 25.514, 2048: 30.655, 4096: 39.922},
    "step3.lookup": {1024: 1.830, 2048: 1.951, 4096: 1.997},
    "step3.allocate": {1024: 0.275, 2048: 0.292, 4096: 0.288},
    "step3.onboard_launch": {1024: 1.306, 2048: 1.380, 4096: 1.424},
    "step3.onboard_wait": {1024: 17.341, 2048: 21.244, 4096: 37.272},
}
STEPS = ["step1.lookup", "step1.allocate", "step1.offload_launch", "step1.offload_wait",
         "step2.evict_gpu", "step3.lookup", "step3.allocate", "step3.onboard_launch",
         "step3.onboard_wait"]
OFFLOAD = ("step1.offload_launch", "step1.offload_wait")
ONBOARD = ("step3.onboard_launch", "step3.onboard_wait")
TARGET_RATIO = 0.7  # aiokv's offload and onboard at most 0.7x FlexKVStorage's (issue 30)
TARGET_OF_RAW = 0.8  # aiokv's onboard at least 80% of a raw pinned copy's GiB/s
NAMES = {"aiokv": "aiokv", "flexkv": "FlexKVStorage"}
GIB = float(1 << 30)


def measured(job: dict[str, Any]) -> list[dict[str, float]]:
    """The measured rounds of a steps job (after its warm-up rounds)."""
    return list(job.get("rounds", [])[job.get("warmup", 1):])


def median_of(rounds: list[dict[str, float]], names: tuple[str, ...] | list[str]) -> float | None:
    """Median over rounds of the sum of ``names``; None where a round lacks one."""
    sums = [sum(r[n] for n in names) for r in rounds if all(n in r for n in names)]
    return statistics.median(sums) if sums else None


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def phase_lines(jobs: dict[str, Any], storages: list[str]) -> list[str]:
    lines = ["recsys test/test_flexkv.py phases 1-5 (unchanged) and phase 6 (this harness's):"]
    for storage in storages:
        job = jobs.get(f"{storage}:phases", {})
        lines.append(f"  {NAMES[storage]}:")
        if "phases" not in job:
            lines.append(f"    could not run: {job.get('error', 'no result')}")
            continue
        for number, phase in sorted(job["phases"].items()):
            if phase["ok"]:
                lines.append(f"    phase {number}: passed")
                continue
            lines.append(f"    phase {number}: FAILED at {phase['where']}: {phase['error']}")
            if phase.get("line"):
                lines.append(f"      `{phase['line']}`")
            if phase.get("raised_at", "").rsplit("/", 1)[-1] not in ("", phase["where"]):
                lines.append(f"      raised in {phase['raised_at']}")
            if phase.get("note"):
                lines.append(f"      ({phase['note']})")
        lines += [f"    {note}" for note in notes(job)]
    return lines


def notes(job: dict[str, Any]) -> list[str]:
    """What a job ran with: aiokv's config and host evicts, FlexKV's layout patch and log level."""
    found = []
    if job.get("aiokv_config"):
        found.append(f"aiokv config: {job['aiokv_config']}")
    if job.get("host_evict"):
        found.append(f"host_evict: {job['host_evict']}")
    if job.get("layout_patch"):
        found.append(f"FlexKV layout: {job['layout_patch']}")
        found.append(f"FLEXKV_LOG_LEVEL={job.get('flexkv_log_level')}, "
                     f"flexkv_as_batch={job.get('flexkv_as_batch')}")
    return found


def case_lines(jobs: dict[str, Any], storages: list[str], batch: int, length: int) -> list[str]:
    """One sequence length: per step, each storage's first round (a manager fresh from its
    start, as the published run: one round per process) and median of the measured
    rounds (after the warm-up ones); then the sums, ratios and GiB/s of both views."""
    per = {s: jobs.get(f"{s}:steps:{length}", {}) for s in storages}
    first = next((j for j in per.values() if "bytes" in j), {})
    nbytes, raw_ms = first.get("bytes"), first.get("raw_copy_ms")
    head = f"bs {batch} x {length}"
    if nbytes:
        head += (f": {nbytes / (1 << 20):.1f} MiB a round, {first['pages']} GPU pages, "
                 f"{first['host_pages']} host pages")
    lines = [head + " (ms; 'first': round 0 of a fresh manager, 'median': of the rounds "
             "after the warm-up ones, n = their count)"]
    for storage, job in per.items():
        if notes(job):
            lines.append(f"  {NAMES[storage]}: {'; '.join(notes(job))}")
        if "error" in job:
            lines.append(f"  {NAMES[storage]} failed at {job.get('where', '?')}: {job['error']}")
    views = {  # (storage, view) -> its rounds
        (s, v): (per[s].get("rounds", [])[:1] if v == "first" else measured(per[s]))
        for v in ("first", "median") for s in storages
    }
    cols = [f"{NAMES[s]} {v}" + (f" n={len(r)}" if v == "median" else "")
            for (s, v), r in views.items()] + ["H100 published"]
    lines.append(f"  {'step':<22}" + "".join(f" {c:>23}" for c in cols))
    for step in STEPS:
        row = [fmt(median_of(r, [step])) for r in views.values()]
        row.append(fmt(PUBLISHED_H100_MS.get(step, {}).get(length)))
        lines.append(f"  {step:<22}" + "".join(f" {v:>23}" for v in row))
    for label, names in (("offload launch+wait", OFFLOAD), ("onboard launch+wait", ONBOARD)):
        got = {key: median_of(r, names) for key, r in views.items()}
        published = [PUBLISHED_H100_MS[n].get(length) for n in names]
        total = None if None in published else sum(p for p in published if p is not None)
        lines.append(f"  {label:<22}" + "".join(f" {fmt(v):>23}" for v in got.values())
                     + f" {fmt(total):>23}")
        for view in ("first", "median"):
            mine, theirs = got.get(("aiokv", view)), got.get(("flexkv", view))
            if mine and theirs:
                ratio = mine / theirs
                verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
                lines.append(f"    {label}, {view}: aiokv/FlexKVStorage {ratio:.2f} "
                             f"(target <= {TARGET_RATIO}: {verdict})")
    if nbytes and raw_ms:
        raw = nbytes / GIB / (raw_ms / 1e3)
        lines.append(f"  raw pinned H2D copy of the same bytes: {raw:.1f} GiB/s ({raw_ms:.3f} ms)")
        for (storage, view), r in views.items():
            ms = median_of(r, ONBOARD)
            if not ms:
                continue
            share = nbytes / GIB / (ms / 1e3) / raw
            text = (f"    onboard {NAMES[storage]} {view}: {nbytes / GIB / (ms / 1e3):.1f} GiB/s, "
                    f"{share:.0%} of raw")
            if storage == "aiokv":
                verdict = "met" if share >= TARGET_OF_RAW else "NOT met"
                text += f" (target >= {TARGET_OF_RAW:.0%}: {verdict})"
            lines.append(text)
    return lines


def format_report(results: dict[str, Any], flexkv: bool = True) -> str:
    storages = ["aiokv", "flexkv"] if flexkv else ["aiokv"]
    jobs = results.get("jobs", {})
    lines = [
        "",
        f"== recsys-examples' KV-cache manager on {results.get('device', '?')} "
        f"(torch {results.get('torch', '?')}): " + " vs ".join(NAMES[s] for s in storages),
        "published: FlexKVStorage on an H100, recsys test/FLEXKV_CPU_BREAKDOWN.md (43465aea);",
        "  its configuration table says 8 layers, head_dim 256; the profiler code of that",
        "  commit, which this run executes, builds 3 layers, 4 heads x 128, page 32, bf16.",
        "",
    ]
    lines += phase_lines(jobs, storages)
    for length in results.get("cases", []):
        lines.append("")
        lines += case_lines(jobs, storages, results.get("batch", 8), length)
    walls = [f"{k} {v['wall_s']:.0f} s" for k, v in jobs.items() if "wall_s" in v]
    if walls:
        lines += ["", "job wall times: " + ", ".join(walls)]
    return "\n".join(lines)
