"""The child side of benchmarks/recsys_client.py: one job in this process, on a manager
that recsys_setup.py makes: ``test_flexkv.py``'s phases 1-5 as they are and phase 6
(ours), or the profiler's three steps at one sequence length.

recsys code is read from the snapshot and run as it is. The profiler's steps get the
manager's backend: at 43465aea they read ``ongoing_offload_tasks``, which after that
commit's refactor only the backend has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import io
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from recsys_setup import (
    HEAD_DIM,
    HEADS,
    HOST_PAGES,
    KV_DIR,
    LAYERS,
    PAGE,
    PAGE_BYTES_PER_LAYER,
    build_extensions,
    close_manager,
    invalidate,
    kvcache_config,
    make_manager,
)

JOB_KINDS = ("phases", "steps")
TEST_FILE = KV_DIR / "test/test_flexkv.py"
PROFILER_FILE = KV_DIR / "test/breakdown_1/test_flexkv_profiler.py"
# test_flexkv.py's __main__: the longest history of users 0..15 over its five phases.
TEST_MAX_LENGTHS = [2500, 1024, 1280, 2377, 1854, 1365, 2729, 2049,
                    689, 1417, 1174, 1987, 596, 520, 1538, 1189]
PHASE_4_LENGTHS = [689, 1417, 1174, 1987, 596, 520, 1538, 1189]  # users 8..15
NVTX_LINE = re.compile(r"^\[NVTX\] (\S+)\s+([0-9.]+) ms$")


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """What every job of a run shares (recsys_client.py's arguments)."""

    recsys: Path
    build_dir: Path
    batch: int = 8
    rounds: int = 5  # measured rounds per case
    warmup: int = 2  # rounds before them, not counted
    aiokv_config: str | None = None  # a YAML path; None: defaults (see aiokv_storage)
    # FlexKVStorage's flexkv_as_batch (test_flexkv.py sets 1, the profiler leaves it at the
    # default, 1). On FlexKV 34ab141 launch(as_batch=True) answers for the batch under one
    # new id; FlexKVStorage, written for 0a73205, waits on the sub-task ids, which FlexKV
    # no longer knows ("task_id N not submitted"): it fails every batched offload. 0 keeps
    # it on its per-user put_async path, which works there.
    flexkv_as_batch: int = 0
    # AiokvHostStorage's wait_pinned: its registration returns once the host tier is
    # pinned whole (False: the first batches wait for the chunks they need).
    aiokv_wait_pinned: bool = True



def load_file(path: Path, name: str) -> ModuleType:
    """Import a recsys test file by its path, under a name of our own."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def failure(exc: BaseException, test_file: Path | None = None) -> dict[str, Any]:
    """An exception as the report shows it: type, message, and the line of the test file
    (else the innermost frame) it came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if test_file is not None and Path(f.filename) == test_file]
    frame = (ours or frames or [None])[-1]
    where = f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"
    inner = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return {"error": f"{type(exc).__name__}: {exc}"[:400], "where": where, "raised_at": inner,
            "line": (frame.line or "") if frame else "", "lineno": frame.lineno if frame else 0}


def host_evict_line(phase_5: Any) -> int:
    """The line of phase 5's host evict, after which test_flexkv.py asserts that the host
    keeps everything (FlexKVStorage's evict is a no-op)."""
    lines, first = inspect.getsourcelines(phase_5)
    for offset, text in enumerate(lines):
        if "for_host=True" in text:
            return first + offset
    return 0


def run_phases(storage: str, options: JobOptions) -> dict[str, Any]:
    test_file = (options.recsys / TEST_FILE).resolve()
    test = load_file(test_file, "recsys_test_flexkv")
    torch.manual_seed(2026)
    keys = [torch.randn((LAYERS, n, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda()
            for n in TEST_MAX_LENGTHS]
    values = [torch.randn((LAYERS, n, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda()
              for n in TEST_MAX_LENGTHS]
    # create_testing_kvcache_manager's config (it builds FlexKVStorage only), with
    # flexkv_as_batch from the options (the test's own builder sets 1).
    config = kvcache_config(8, 2048, 512, 1024, options.flexkv_as_batch)
    manager, notes = make_manager(storage, config, "phases", options.aiokv_config,
                                  options.aiokv_wait_pinned)
    host = manager.host_kvstorage_manager
    if storage == "aiokv":
        # Phase 5 asserts that a host evict keeps everything, as FlexKVStorage's no-op
        # does: phases 1-5 run on those semantics, phase 6 (ours) on real evicts.
        host.host_evict = False
        notes["host_evict"] = "False for phases 1-5 (FlexKVStorage's no-op), True for 6"
    phases: dict[str, Any] = {}
    evict_line = host_evict_line(test.run_phase_5)
    try:
        for number in range(1, 6):
            try:
                getattr(test, f"run_phase_{number}")(manager, keys, values)
                phases[str(number)] = {"ok": True}
            except Exception as exc:  # reported per phase; the next runs on what it left
                phases[str(number)] = {"ok": False, **failure(exc, test_file)}
                if number == 5 and phases["5"]["lineno"] > evict_line > 0:
                    phases["5"]["note"] = ("after the test's host evict, which it asserts is a "
                                           "no-op (FlexKVStorage has none)")
            print(f"phase {number}: {'passed' if phases[str(number)]['ok'] else 'FAILED'}")
        if storage == "aiokv":
            host.host_evict = True
        try:
            run_phase_6(manager, keys, values)
            phases["6"] = {"ok": True}
        except Exception as exc:
            phases["6"] = {"ok": False, **failure(exc, Path(__file__).resolve())}
        print(f"phase 6: {'passed' if phases['6']['ok'] else 'FAILED'}")
    finally:
        close_manager(manager)
    return {"phases": phases, **notes}


def check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def run_phase_6(manager: Any, old_keys: list[Any], old_values: list[Any]) -> None:
    """Ours: users 0..7 evicted from GPU and host look up 0 host tokens while users 8..15
    keep theirs; new content offloaded under the same keys reloads from the host as the
    new content, not the content from before the evict."""
    from recsys_kvcache_manager.host_kvstorage_manager import HostKVTaskStatus

    users, others = torch.arange(0, 8), torch.arange(8, 16)
    lengths = [1024, 512, 768, 2048, 1280, 256, 1536, 1024]  # full pages: all from the host
    seq = torch.tensor(lengths, dtype=torch.int32)
    other_seq = torch.tensor(PHASE_4_LENGTHS, dtype=torch.int32)
    _, before = manager.lookup_kvcache(others, other_seq)
    manager.evict(users, for_gpu=True, for_host=True)
    manager.evict(others, for_gpu=True)
    _, after = manager.lookup_kvcache(users, seq)
    host = after.host_cached_lengths.tolist()
    check(host == [0] * 8, f"host lengths after evict(for_host=True): {host}, expected 0s")
    _, kept = manager.lookup_kvcache(others, other_seq)
    check(torch.equal(kept.host_cached_lengths, before.host_cached_lengths),
          f"other users' host lengths {before.host_cached_lengths.tolist()} became "
          f"{kept.host_cached_lengths.tolist()}")
    keys = [torch.randn((LAYERS, n, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda() for n in lengths]
    values = [torch.randn_like(k) for k in keys]
    meta, lookup = manager.lookup_kvcache(users, seq)
    kv = manager.allocate_kvcache(meta, lookup)
    check(int(kv.new_history_nnz_cuda.item()) == sum(lengths), "evicted users still had tokens")
    for layer in range(LAYERS):
        manager.gpu_kvcache_mgr.put(torch.cat([k[layer] for k in keys]),
                                    torch.cat([v[layer] for v in values]), layer, kv)
    manager.offload_launch(index_meta=meta, kvcache_metadata=kv)
    manager.offload_flush()
    manager.evict(users, for_gpu=True)
    meta, lookup = manager.lookup_kvcache(users, seq)
    check(lookup.host_cached_lengths.tolist() == lengths,
          f"host lengths after the new offload: {lookup.host_cached_lengths.tolist()}")
    kv = manager.allocate_kvcache(meta, lookup)
    handle = manager.onboard_launch(meta, lookup, kv)
    check(handle.status == HostKVTaskStatus.LAUNCHED, f"reload status {handle.status}")
    deadline = time.monotonic() + 60.0
    while not manager.onboard_wait(meta, handle).ready:
        check(time.monotonic() < deadline, "reload not ready after 60 s")
        time.sleep(0.001)
    for i, uid in enumerate(users.tolist()):
        pages = kv.kv_indices[kv.kv_indptr[i]: kv.kv_indptr[i + 1]]
        for layer in range(LAYERS):
            got_k, got_v = manager.gpu_kvcache_mgr.get(pages, kv.kv_last_page_len[i].item(), layer)
            if torch.equal(got_k, keys[i][layer]) and torch.equal(got_v, values[i][layer]):
                continue
            old = old_keys[uid][layer, : lengths[i]]
            stale = got_k.shape == old.shape and torch.equal(got_k, old)
            raise AssertionError(f"user {uid} layer {layer}: reloaded K/V "
                                 f"{'stale (from before the evict)' if stale else 'wrong'}")


def parse_nvtx(text: str) -> dict[str, float]:
    """The profiler's ``[NVTX] name  ms`` lines -> {name: ms}."""
    found = {}
    for line in text.splitlines():
        match = NVTX_LINE.match(line.strip())
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def raw_copy_ms(nbytes: int, repeats: int = 7) -> float:
    """Median wall time of one pinned host -> device copy of ``nbytes`` (copy + sync)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):  # the first warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def run_steps(storage: str, options: JobOptions, length: int, result: dict[str, Any]) -> None:
    """The profiler's steps on one manager: ``warmup`` rounds, then ``rounds`` measured,
    the users invalidated between rounds. One manager, as a server keeps one: a fresh one
    per round would time aiokv's host tier while it is still being pinned (it pins in
    the background after start), which FlexKV does before it is ready."""
    prof = load_file((options.recsys / PROFILER_FILE).resolve(), "recsys_test_flexkv_profiler")
    batch = options.batch
    torch.manual_seed(2026)
    keys = [torch.randn((LAYERS, length, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda()
            for _ in range(batch)]
    values = [torch.randn_like(k) for k in keys]
    pages = max(512, math.ceil(batch * length / PAGE))  # the profiler's 512 holds 8 x 2048
    # 8192: the profiler's --max-seq-len
    config = kvcache_config(batch, 8192, pages, HOST_PAGES, options.flexkv_as_batch)
    result.update(pages=pages, host_pages=HOST_PAGES, rounds=[], warmup=options.warmup,
                  bytes=LAYERS * batch * length * PAGE_BYTES_PER_LAYER // PAGE)
    result["raw_copy_ms"] = raw_copy_ms(result["bytes"])  # first: there even if a round fails
    manager, notes = make_manager(storage, config, "steps", options.aiokv_config,
                                  options.aiokv_wait_pinned)
    result.update(notes)
    try:
        for number in range(options.warmup + options.rounds):
            if number:
                invalidate(manager)
            text = io.StringIO()
            try:
                with contextlib.redirect_stdout(text):
                    prof.run_step_1_offload(manager.backend, keys, values,
                                            len_per_seq=length, batch_size=batch)
                    prof.run_step_2_evict_gpu(manager.backend, batch_size=batch)
                    prof.run_step_3_onboard(manager.backend, len_per_seq=length,
                                            batch_size=batch)
            finally:
                print(f"-- round {number}{' (warm-up)' if number < options.warmup else ''}")
                print(text.getvalue(), end="")
            result["rounds"].append(parse_nvtx(text.getvalue()))
    finally:
        close_manager(manager)


def run_job(storage: str, job: str, options: JobOptions) -> dict[str, Any]:
    """One job in this process; failures come back in the result, not as exceptions."""
    os.environ.setdefault("FLEXKV_ENABLE_MPS", "0")  # read once, at FlexKV's import
    os.environ.setdefault("FLEXKV_LOG_LEVEL", "WARNING")  # its INFO is a line per call
    result: dict[str, Any] = {"flexkv_log_level": os.environ["FLEXKV_LOG_LEVEL"]}
    try:
        build_extensions(options.recsys, options.build_dir)
        if job == "phases":
            result.update(run_phases(storage, options))
        else:
            run_steps(storage, options, int(job.split(":")[1]), result)
    except Exception as exc:
        traceback.print_exc()
        result.update(failure(exc))
    sys.stdout.flush()
    return result
