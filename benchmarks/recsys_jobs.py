"""The child side of benchmarks/recsys_client.py: builds recsys-examples' two CUDA
extensions, makes recsys's own ``KVCacheManager`` over aiokv's storage or over recsys's
FlexKVStorage, and runs one job: ``test_flexkv.py``'s phases (and phase 6, ours), or the
profiler's three steps at one sequence length.

recsys code is read from the snapshot and run as it is; what this module does around it:
the managers are built here (the tests' own builders hard-wire FlexKVStorage), with the
tests' geometry; the profiler's steps get the manager's backend (at 43465aea they read
``ongoing_offload_tasks``, which after that commit's refactor only the backend has); and
on FlexKV 34ab141 the layout patch described in recsys_client.py.
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

JOB_KINDS = ("phases", "steps")
KV_DIR = Path("corelib/recsys_kvcache_manager")
OPS_DIR = Path("examples/commons/ops/cuda_ops/csrc")
TEST_FILE = KV_DIR / "test/test_flexkv.py"
PROFILER_FILE = KV_DIR / "test/breakdown_1/test_flexkv_profiler.py"

# Both tests' geometry: 3 layers, 4 heads x 128, page 32, chunk 128, bf16.
LAYERS, HEADS, HEAD_DIM, PAGE = 3, 4, 128, 32
PAGE_BYTES_PER_LAYER = 2 * PAGE * HEADS * HEAD_DIM * 2  # k and v, bf16
# FlexKVStorage's default host tier (flexkv_num_cpu_blocks), given to aiokv as well in the
# profiler cases: the profiler's own host_capacity_per_layer is max_seq_len x batch pages.
HOST_PAGES = 4096
# test_flexkv.py's __main__: the longest history of users 0..15 over its five phases.
TEST_MAX_LENGTHS = [2500, 1024, 1280, 2377, 1854, 1365, 2729, 2049,
                    689, 1417, 1174, 1987, 596, 520, 1538, 1189]
PHASE_4_LENGTHS = [689, 1417, 1174, 1987, 596, 520, 1538, 1189]  # users 8..15
NVCC_FLAGS = [
    "-O3", "-std=c++20", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
]
CXX_FLAGS = ["-O3", "-std=c++20", "-DWITH_PYBIND11=1", "-fvisibility=hidden"]
NVTX_LINE = re.compile(r"^\[NVTX\] (\S+)\s+([0-9.]+) ms$")


def extension_specs(recsys: Path) -> list[tuple[str, list[Path], list[Path]]]:
    """(name, sources, include dirs) of the two extensions, as recsys's setup.py files
    list them, minus their link flags (zmq, nvcomp) that these sources do not use."""
    kv, ops = recsys / KV_DIR / "src", recsys / OPS_DIR
    kv_sources = ["pybind.cpp", "gpu_kvcache_manager_impl.cpp",
                  "native_host_kvcache_manager_impl.cpp", "gather_scatter.cpp",
                  "gather_scatter_kernels.cu"]
    return [
        ("kvcache_cpp", [kv / s for s in kv_sources], [kv, kv / "runtime", kv / "torch_binding"]),
        ("paged_kvcache_ops",
         [ops / "paged_kvcache_ops_cuda.cpp", ops / "paged_kvcache_ops_kernel.cu"], [ops]),
    ]


def build_extensions(recsys: Path, build_dir: Path, verbose: bool = False) -> None:
    """Build (or load, when built) both extensions, register them under their import
    names and put recsys's package on sys.path. Builds for this GPU's arch only."""
    from torch.utils.cpp_extension import load

    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    for name, sources, includes in extension_specs(recsys):
        missing = [str(s) for s in sources if not s.exists()]
        if missing:
            raise SystemExit(f"--recsys {recsys}: missing {', '.join(missing)}")
        target = build_dir / name
        target.mkdir(parents=True, exist_ok=True)
        sys.modules[name] = load(
            name=name, sources=[str(s) for s in sources],
            extra_include_paths=[str(i) for i in includes], extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=NVCC_FLAGS, build_directory=str(target), verbose=verbose,
        )
    package_root = str(recsys / KV_DIR)
    if package_root not in sys.path:
        sys.path.insert(0, package_root)


def load_file(path: Path, name: str) -> ModuleType:
    """Import a recsys test file by its path, under a name of our own."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kvcache_config(batch: int, max_seq_len: int, pages: int, host_pages: int) -> Any:
    """The tests' get_kvcache_config call (test_flexkv.py, the profiler)."""
    from recsys_kvcache_manager.kvcache_config import get_kvcache_config

    return get_kvcache_config(
        num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
        offload_chunksize=128, num_primary_cache_pages=pages, num_buffer_pages=0,
        host_capacity_per_layer=host_pages * PAGE_BYTES_PER_LAYER, max_batch_size=batch,
        max_seq_len=max_seq_len, dtype=torch.bfloat16, device=torch.cuda.current_device(),
        host_kvstorage_backend="flexkv", offload_timeout_ms=100.0, offload_mode="lazy",
        extra_configs={"flexkv_mode": "direct", "flexkv_host_kvstorage_fail_policy": "fail_open",
                       "flexkv_enable_mps": 0, "flexkv_as_batch": 1},
    )


def prepare_flexkv(tag: str) -> str:
    """Before each FlexKVStorage: its own IPC endpoints (FlexKV binds fixed ipc:// paths,
    and one process here makes several), and the layout patch where needed. Returns what
    was patched."""
    from flexkv.common import storage
    from flexkv.common.config import GLOBAL_CONFIG_FROM_ENV
    from recsys_kvcache_manager import flex_kvcache_manager

    base = f"ipc:///tmp/recsys_client_{os.getpid()}_{tag}"
    GLOBAL_CONFIG_FROM_ENV.server_recv_port = base  # KVManager's own endpoints
    os.environ["FLEXKV_SERVER_RECV_PORT"] = base
    os.environ["FLEXKV_GPU_REGISTER_PORT"] = base + "_gpu_register"  # FlexKVStorage's
    layout_cls = storage.KVCacheLayout
    if "is_mla" in {f.name for f in dataclasses.fields(layout_cls)}:
        return "none: this FlexKV's KVCacheLayout takes is_mla"

    def layerblock(**kw: Any) -> Any:
        # recsys's FlexKVCacheLayout: type LAYERFIRST with a [layer, block, kv, token,
        # head, dim] shape of its own; FlexKV 34ab141 calls that shape LAYERBLOCK.
        kw.pop("type")
        kv_dim = 1 if kw.pop("is_mla") else 2
        return layout_cls(type=storage.KVCacheLayoutType.LAYERBLOCK, kv_dim=kv_dim,
                          num_kv_heads=kw["num_head"], **kw)

    flex_kvcache_manager.FlexKVCacheLayout = layerblock
    return ("recsys's FlexKVCacheLayout(LAYERFIRST, is_mla=False) replaced at run time by "
            "FlexKV's KVCacheLayout(LAYERBLOCK, kv_dim=2): the same per-layer tensors")


def aiokv_storage(config: Any, aiokv_config: str | None) -> tuple[Any, str]:
    """aiokv's HostKVStorageBase (aiokv.integrations.recsys) for a recsys KVCacheConfig,
    and what it runs with: ``aiokv_config`` (a YAML path), else aiokv's defaults with a
    host tier of recsys's own size, host_capacity_per_layer x num_layers."""
    from aiokv.integrations.recsys import AiokvHostStorage

    if aiokv_config is not None:
        return AiokvHostStorage(aiokv_config), aiokv_config
    gib = config.host_capacity_per_layer * config.num_layers / 2**30
    return (AiokvHostStorage({"store": {"backend": "local", "cpu_cache_gb": gib}}),
            f"aiokv defaults, store.backend local, cpu_cache_gb {gib:.4g}")


def make_manager(storage: str, config: Any, tag: str,
                 aiokv_config: str | None = None) -> tuple[Any, dict[str, Any]]:
    """recsys's KVCacheManager over the named storage; (manager, notes)."""
    from recsys_kvcache_manager.default_kvcache_backend import DefaultKVCacheBackend
    from recsys_kvcache_manager.kvcache_manager import KVCacheManager

    if storage == "flexkv":
        patch = prepare_flexkv(tag)
        return KVCacheManager.from_config(config), {"layout_patch": patch}
    from recsys_kvcache_manager.gpu_kvcache_manager import DeviceKVCache

    # DefaultKVCacheBackend.from_config's own construction, with aiokv as the host storage.
    gpu = DeviceKVCache(
        config.num_layers, config.num_heads, config.head_dim, config.page_size,
        config.offload_chunksize, config.num_primary_cache_pages, config.num_buffer_pages,
        config.max_batch_size, math.ceil(config.max_seq_len / config.page_size) * config.page_size,
        config.dtype, config.device,
    )
    host, described = aiokv_storage(config, aiokv_config)
    backend = DefaultKVCacheBackend(gpu, host, config.offload_mode,
                                    config.host_kvstorage_fail_policy)
    return KVCacheManager(backend), {"aiokv_config": described}


def close_manager(manager: Any) -> None:
    host = manager.host_kvstorage_manager
    client = getattr(host, "_client", None)  # FlexKVStorage: its KVManager
    closer = getattr(client, "shutdown", None) or getattr(host, "close", None)
    if closer is not None:
        closer()


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


def run_phases(storage: str, recsys: Path, aiokv_config: str | None) -> dict[str, Any]:
    test_file = (recsys / TEST_FILE).resolve()
    test = load_file(test_file, "recsys_test_flexkv")
    torch.manual_seed(2026)
    keys = [torch.randn((LAYERS, n, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda()
            for n in TEST_MAX_LENGTHS]
    values = [torch.randn((LAYERS, n, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda()
              for n in TEST_MAX_LENGTHS]
    if storage == "flexkv":  # the test's own builder: FlexKVStorage from its config
        notes = {"layout_patch": prepare_flexkv("phases")}
        manager = test.create_testing_kvcache_manager()
    else:  # the same config (create_testing_kvcache_manager's), over aiokv
        config = kvcache_config(8, 2048, 512, 1024)
        manager, notes = make_manager(storage, config, "phases", aiokv_config)
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


def run_steps(storage: str, recsys: Path, batch: int, length: int, rounds: int,
              aiokv_config: str | None, result: dict[str, Any]) -> None:
    prof = load_file((recsys / PROFILER_FILE).resolve(), "recsys_test_flexkv_profiler")
    torch.manual_seed(2026)
    keys = [torch.randn((LAYERS, length, HEADS, HEAD_DIM), dtype=torch.bfloat16).cuda()
            for _ in range(batch)]
    values = [torch.randn_like(k) for k in keys]
    pages = max(512, math.ceil(batch * length / PAGE))  # the profiler's 512 holds 8 x 2048
    config = kvcache_config(batch, 8192, pages, HOST_PAGES)  # 8192: its --max-seq-len
    result.update(pages=pages, host_pages=HOST_PAGES, rounds=[],
                  bytes=LAYERS * batch * length * PAGE_BYTES_PER_LAYER // PAGE)
    result["raw_copy_ms"] = raw_copy_ms(result["bytes"])  # first: there even if a round fails
    for number in range(rounds + 1):  # round 0 warms up (CUDA, allocators, FlexKV's start)
        manager, notes = make_manager(storage, config, f"r{number}", aiokv_config)
        result.update(notes)
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                prof.run_step_1_offload(manager.backend, keys, values, len_per_seq=length,
                                        batch_size=batch)
                prof.run_step_2_evict_gpu(manager.backend, batch_size=batch)
                prof.run_step_3_onboard(manager.backend, len_per_seq=length, batch_size=batch)
        finally:
            print(f"-- round {number}{' (warm-up)' if number == 0 else ''}")
            print(text.getvalue(), end="")
            close_manager(manager)
        result["rounds"].append(parse_nvtx(text.getvalue()))


def run_job(storage: str, job: str, recsys: Path, build_dir: Path, batch: int,
            rounds: int, aiokv_config: str | None = None) -> dict[str, Any]:
    """One job in this process; failures come back in the result, not as exceptions."""
    os.environ.setdefault("FLEXKV_ENABLE_MPS", "0")  # read once, at FlexKV's import
    os.environ.setdefault("FLEXKV_LOG_LEVEL", "WARNING")  # its INFO is a line per call
    result: dict[str, Any] = {"flexkv_log_level": os.environ["FLEXKV_LOG_LEVEL"]}
    try:
        build_extensions(recsys, build_dir)
        if job == "phases":
            result.update(run_phases(storage, recsys, aiokv_config))
        else:
            length = int(job.split(":")[1])
            run_steps(storage, recsys, batch, length, rounds, aiokv_config, result)
    except Exception as exc:
        traceback.print_exc()
        result.update(failure(exc))
    sys.stdout.flush()
    return result
