"""How benchmarks/recsys_client.py sets recsys-examples up: builds its two CUDA
extensions from a snapshot, and makes its ``KVCacheManager`` over aiokv's storage or over
recsys's own FlexKVStorage, with the geometry of recsys's tests.

The managers are built here, not by the tests' own builders, which hard-wire
FlexKVStorage; on FlexKV 34ab141 the FlexKVStorage side gets the layout patch described
in recsys_client.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

KV_DIR = Path("corelib/recsys_kvcache_manager")
OPS_DIR = Path("examples/commons/ops/cuda_ops/csrc")
# Both tests' geometry: 3 layers, 4 heads x 128, page 32, chunk 128, bf16.
LAYERS, HEADS, HEAD_DIM, PAGE = 3, 4, 128, 32
PAGE_BYTES_PER_LAYER = 2 * PAGE * HEADS * HEAD_DIM * 2  # k and v, bf16
# FlexKVStorage's default host tier (flexkv_num_cpu_blocks), given to aiokv as well in the
# profiler cases: the profiler's own host_capacity_per_layer is max_seq_len x batch pages.
HOST_PAGES = 4096
NVCC_FLAGS = [
    "-O3", "-std=c++20", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
]
CXX_FLAGS = ["-O3", "-std=c++20", "-DWITH_PYBIND11=1", "-fvisibility=hidden"]


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



def kvcache_config(batch: int, max_seq_len: int, pages: int, host_pages: int,
                   as_batch: int) -> Any:
    """The tests' get_kvcache_config call (test_flexkv.py, the profiler)."""
    from recsys_kvcache_manager.kvcache_config import get_kvcache_config

    return get_kvcache_config(
        num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
        offload_chunksize=128, num_primary_cache_pages=pages, num_buffer_pages=0,
        host_capacity_per_layer=host_pages * PAGE_BYTES_PER_LAYER, max_batch_size=batch,
        max_seq_len=max_seq_len, dtype=torch.bfloat16, device=torch.cuda.current_device(),
        host_kvstorage_backend="flexkv", offload_timeout_ms=100.0, offload_mode="lazy",
        extra_configs={"flexkv_mode": "direct", "flexkv_host_kvstorage_fail_policy": "fail_open",
                       "flexkv_enable_mps": 0, "flexkv_as_batch": as_batch},
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


def aiokv_storage(config: Any, aiokv_config: str | None,
                  wait_pinned: bool = True) -> tuple[Any, str]:
    """aiokv's HostKVStorageBase (aiokv.integrations.recsys) for a recsys KVCacheConfig,
    and what it runs with: ``aiokv_config`` (a YAML path), else aiokv's defaults with a
    host tier of recsys's own size, host_capacity_per_layer x num_layers."""
    from aiokv.integrations.recsys import AiokvHostStorage

    pinned = "" if wait_pinned else ", wait_pinned False"
    if aiokv_config is not None:
        return AiokvHostStorage(aiokv_config, wait_pinned=wait_pinned), aiokv_config + pinned
    gib = config.host_capacity_per_layer * config.num_layers / 2**30
    return (AiokvHostStorage({"store": {"backend": "local", "cpu_cache_gb": gib}},
                             wait_pinned=wait_pinned),
            f"aiokv defaults, store.backend local, cpu_cache_gb {gib:.4g}{pinned}")


def make_manager(storage: str, config: Any, tag: str, aiokv_config: str | None = None,
                 wait_pinned: bool = True) -> tuple[Any, dict[str, Any]]:
    """recsys's KVCacheManager over the named storage; (manager, notes)."""
    from recsys_kvcache_manager.default_kvcache_backend import DefaultKVCacheBackend
    from recsys_kvcache_manager.kvcache_manager import KVCacheManager

    if storage == "flexkv":
        patch = prepare_flexkv(tag)
        as_batch = config.extra_configs["flexkv_as_batch"]
        return KVCacheManager.from_config(config), {"layout_patch": patch,
                                                    "flexkv_as_batch": as_batch}
    from recsys_kvcache_manager.gpu_kvcache_manager import DeviceKVCache

    # DefaultKVCacheBackend.from_config's own construction, with aiokv as the host storage.
    gpu = DeviceKVCache(
        config.num_layers, config.num_heads, config.head_dim, config.page_size,
        config.offload_chunksize, config.num_primary_cache_pages, config.num_buffer_pages,
        config.max_batch_size, math.ceil(config.max_seq_len / config.page_size) * config.page_size,
        config.dtype, config.device,
    )
    host, described = aiokv_storage(config, aiokv_config, wait_pinned)
    backend = DefaultKVCacheBackend(gpu, host, config.offload_mode,
                                    config.host_kvstorage_fail_policy)
    return KVCacheManager(backend), {"aiokv_config": described}


def invalidate(manager: Any) -> None:
    """Between rounds: the batch's users gone from the GPU and the host, so that step 1
    starts from nothing again (it asserts so). FlexKVStorage's evict_all is a no-op: its
    FlexKV's own invalidation drops the host tier instead."""
    manager.evict_all(for_gpu=True)
    client = getattr(manager.host_kvstorage_manager, "_client", None)
    if client is None:
        manager.evict_all(for_host=True)
        return
    try:
        client.reset()
    except AttributeError:
        # FlexKV 34ab141 builds its task table as ExpiringDict(max_age_seconds=...,
        # max_len=...), the `expiringdict` package's signature, but imports the
        # `expiring-dict` package it pins (1.1.2), which stores those two keywords as
        # entries; reset() then calls is_completed() on the int 1800 (H200 run of
        # 2026-12-04). What reset() goes on to do for a CPU-only cache, with no transfer
        # in flight between rounds, is this: drop the CPU tier's index and mempool.
        client._clear_cpu_cache()


def close_manager(manager: Any) -> None:
    host = manager.host_kvstorage_manager
    client = getattr(host, "_client", None)  # FlexKVStorage: its KVManager
    closer = getattr(client, "shutdown", None) or getattr(host, "close", None)
    if closer is not None:
        closer()
