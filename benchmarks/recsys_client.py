"""NVIDIA recsys-examples' own KV-cache manager test and profiler steps, run on aiokv's
recsys storage and on recsys's own FlexKVStorage over FlexKV, side by side with the
H100 figures recsys-examples publishes.

    python benchmarks/recsys_client.py --recsys PATH [--flexkv on|off] [--cases 1024,2048,4096]
                                       [--batch 8] [--rounds 5] [--warmup 2] [--build-dir DIR]
                                       [--aiokv-config YAML] [--flexkv-as-batch 0|1]
                                       [--budget-s S] [--json FILE]

``--recsys`` is a snapshot of github.com/NVIDIA/recsys-examples (written against
43465aea, v26.06.01; only its ``corelib/recsys_kvcache_manager`` and
``examples/commons/ops/cuda_ops/csrc`` are read). Nothing of it is copied here: the
harness builds its two CUDA extensions (``kvcache_cpp``, ``paged_kvcache_ops``) with
``torch.utils.cpp_extension.load`` into ``--build-dir`` (default: ``build/`` in the
snapshot), without the ``-lzmq`` and nvcomp link flags that these sources do not use.

Jobs, each in a child process (a crash or hang of one, bounded by ``--job-timeout-s``,
costs that job only, and FlexKV's IPC endpoints and pinned memory go with the process):
- ``phases``: ``test/test_flexkv.py``'s ``run_phase_1`` .. ``run_phase_5``, unchanged, on
  one manager with that test's geometry (3 layers, 4 heads x 128, page 32, 512 pages,
  bf16), then phase 6 of this harness: a host evict drops the users' tokens (lookup 0),
  other users keep theirs, and new content offloaded under the same keys reloads as the
  new content, nothing stale.
- ``steps:L``: ``test/breakdown_1/test_flexkv_profiler.py``'s ``run_step_1_offload``,
  ``run_step_2_evict_gpu`` and ``run_step_3_onboard`` at ``--batch`` x L on one manager:
  ``--warmup`` rounds, then ``--rounds`` measured (medians reported), the users dropped
  from GPU and host between rounds; the step times are the profiler's own ``[NVTX]``
  lines. Before them, a raw pinned host-to-device copy of the same bytes.

aiokv runs with its defaults and a host tier of the recsys config's size
(``host_capacity_per_layer`` x layers), or ``--aiokv-config``. The FlexKVStorage side
needs FlexKV importable. recsys 43465aea targets FlexKV 0a73205; on FlexKV 34ab141 two
things differ, and the harness says what it did about each: ``KVCacheLayout`` has
``kv_dim`` instead of ``is_mla`` (recsys's ``FlexKVCacheLayout`` is replaced at run time,
in the child only, by FlexKV's ``LAYERBLOCK`` layout of the same per-layer tensors), and
``launch(as_batch=True)`` answers under a new batch id that FlexKVStorage does not wait
on, so its batched offloads never complete (``--flexkv-as-batch 0``, the default here,
keeps it on its per-user path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Run from a checkout without installing: the repository root holds the package, and
# this folder the harness's other two modules (the jobs, the report).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recsys_jobs import JOB_KINDS, JobOptions, run_job
from recsys_report import format_report
from recsys_setup import build_extensions

STORAGES = ("aiokv", "flexkv")


def parse_cases(text: str) -> list[int]:
    """``1024,2048`` -> [1024, 2048]; each a positive multiple of the page size (32), as
    the profiler's onboard step needs every token back from the host."""
    cases = [int(part) for part in text.split(",") if part.strip()]
    bad = [c for c in cases if c <= 0 or c % 32]
    if not cases or bad:
        raise argparse.ArgumentTypeError(f"--cases: positive multiples of 32, got {text!r}")
    return cases


def job_list(cases: list[int], flexkv: bool) -> list[tuple[str, str]]:
    """(storage, job) in the order they run: the phases first, then the cases the
    issue's targets name (2048, 4096) before the rest, each aiokv then FlexKVStorage."""
    storages = STORAGES if flexkv else STORAGES[:1]
    first = [c for c in (2048, 4096) if c in cases]
    ordered = first + [c for c in cases if c not in first]
    jobs = [(s, "phases") for s in storages]
    jobs += [(s, f"steps:{c}") for c in ordered for s in storages]
    return jobs


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "recsys_client needs a CUDA GPU: recsys-examples' KV-cache manager and its "
            "extensions (kvcache_cpp, paged_kvcache_ops) run on CUDA only, and "
            f"torch {torch.__version__} here sees no CUDA device"
        )


def run_child(args: argparse.Namespace, storage: str, job: str, timeout_s: float) -> dict[str, Any]:
    """Run one job in a child process of its own session; its output is echoed with a
    prefix, its result read back from a JSON file. A job that times out is killed with
    its whole process group (FlexKV's transfer process included)."""
    out = Path(args.build_dir) / f"job_{storage}_{job.replace(':', '_')}_{os.getpid()}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--recsys", str(args.recsys),
        "--build-dir", str(args.build_dir), "--batch", str(args.batch),
        "--rounds", str(args.rounds), "--warmup", str(args.warmup),
        "--flexkv-as-batch", str(args.flexkv_as_batch),
        "--job", f"{storage}:{job}", "--job-out", str(out),
    ]
    if args.aiokv_config:
        cmd += ["--aiokv-config", args.aiokv_config]
    cmd += ["--aiokv-wait-pinned", args.aiokv_wait_pinned]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
    with contextlib.suppress(ProcessLookupError):  # what the child left running
        os.killpg(proc.pid, signal.SIGKILL)  # (FlexKV's workers), by its group id
    for line in (text or "").splitlines():
        print(f"  [{storage} {job}] {line}")
    wall_s = time.monotonic() - start
    if out.exists():
        result: dict[str, Any] = json.loads(out.read_text())
        out.unlink()
    else:
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit code {proc.returncode}"
        tail = " | ".join((text or "").strip().splitlines()[-3:])
        result = {"error": f"child {why} without a result; last lines: {tail}"}
    result["wall_s"] = round(wall_s, 1)
    return result


def build_only(args: argparse.Namespace) -> None:
    start = time.monotonic()
    build_extensions(Path(args.recsys), Path(args.build_dir), verbose=args.verbose)
    print(f"extensions built in {args.build_dir} ({time.monotonic() - start:.0f} s)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recsys", help="a recsys-examples snapshot (root)")
    parser.add_argument("--report", default=None,
                        help="print the report of a --json file of an earlier run, and stop")
    parser.add_argument("--flexkv", default="on", choices=("on", "off"),
                        help="also run recsys's own FlexKVStorage (needs FlexKV importable)")
    parser.add_argument("--cases", type=parse_cases, default=[1024, 2048, 4096],
                        help="tokens per user for the profiler steps")
    parser.add_argument("--aiokv-config", default=None,
                        help="aiokv's YAML (default: its defaults, host tier of recsys's size)")
    parser.add_argument("--aiokv-wait-pinned", default="on", choices=("on", "off"),
                        help="AiokvHostStorage(wait_pinned=...): registration returns once "
                        "the host tier is pinned whole (on) or at once (off)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per case")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before them, not counted")
    parser.add_argument("--flexkv-as-batch", type=int, default=0, choices=(0, 1),
                        help="FlexKVStorage's flexkv_as_batch (1 fails on FlexKV 34ab141)")
    parser.add_argument("--build-dir", default=None, help="default: build/ in the snapshot")
    parser.add_argument("--job-timeout-s", type=float, default=150.0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no job after this many seconds (the rest: not run)")
    parser.add_argument("--build-only", action="store_true", help="build the extensions, stop")
    parser.add_argument("--verbose", action="store_true", help="show the compilers' output")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a child's job
    parser.add_argument("--job-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report is not None:  # no GPU needed
        results: dict[str, Any] = json.loads(Path(args.report).read_text())
        print(format_report(results, flexkv=any(k.startswith("flexkv") for k in results["jobs"])))
        return results
    if args.recsys is None:
        parser.error("--recsys is required (or --report)")
    recsys = Path(args.recsys)
    if not (recsys / "corelib" / "recsys_kvcache_manager").is_dir():
        raise SystemExit(f"--recsys {recsys}: no corelib/recsys_kvcache_manager in it")
    if args.batch <= 0 or args.rounds <= 0 or args.warmup < 0:
        raise SystemExit(f"--batch, --rounds (> 0), --warmup (>= 0): got {args.batch}, "
                         f"{args.rounds}, {args.warmup}")
    args.build_dir = str(Path(args.build_dir or recsys / "build").resolve())
    require_cuda()
    Path(args.build_dir).mkdir(parents=True, exist_ok=True)
    if args.job is not None:
        storage, _, job = args.job.partition(":")
        if storage not in STORAGES or job.split(":")[0] not in JOB_KINDS:
            raise SystemExit(f"--job: unknown {args.job!r}")
        options = JobOptions(recsys, Path(args.build_dir), args.batch, args.rounds,
                             args.warmup, args.aiokv_config, args.flexkv_as_batch,
                             args.aiokv_wait_pinned == "on")
        result = run_job(storage, job, options)
        Path(args.job_out).write_text(json.dumps(result))
        return result
    build_only(args)
    if args.build_only:
        return {}
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "batch": args.batch, "rounds": args.rounds, "warmup": args.warmup,
        "flexkv_as_batch": args.flexkv_as_batch, "cases": args.cases, "jobs": {},
    }
    for storage, job in job_list(args.cases, args.flexkv == "on"):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 20:
            results["jobs"][f"{storage}:{job}"] = {"error": "not run: --budget-s spent"}
            continue
        timeout = args.job_timeout_s if left is None else min(args.job_timeout_s, left)
        print(f"== {storage} {job}", flush=True)
        results["jobs"][f"{storage}:{job}"] = run_child(args, storage, job, timeout)
    print(format_report(results, flexkv=args.flexkv == "on"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
