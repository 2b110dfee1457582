"""Impossible sizes are a ConfigError naming the key, at configuration, not a raw torch
error when the store allocates at start."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv
from aiokv import config as config_module
from aiokv.config import machine_memory_bytes, parse_config

MEMORY = machine_memory_bytes()
needs_memory_size = pytest.mark.skipif(MEMORY is None, reason="the OS gives no memory size")


def beyond_memory_gb() -> float:
    assert MEMORY is not None
    return math.ceil(2 * MEMORY / (1 << 30))


@needs_memory_size
def test_a_host_tier_larger_than_the_machine_is_a_config_error() -> None:
    too_big = beyond_memory_gb()
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.StoreConfig(cpu_cache_gb=too_big)
    assert caught.value.key == "store.cpu_cache_gb"
    assert str(too_big) in str(caught.value) and "memory" in str(caught.value)


@needs_memory_size
def test_the_yaml_key_beyond_memory_fails_before_any_store_exists(tmp_path: Path) -> None:
    path = tmp_path / "big.yml"
    path.write_text(f"store:\n  cpu_cache_gb: {beyond_memory_gb()}\n", encoding="utf-8")
    with pytest.raises(aiokv.ConfigError, match=r"store\.cpu_cache_gb"):
        aiokv.open_engine(str(path), kv_caches=[])
    with pytest.raises(aiokv.ConfigError, match=r"store\.cpu_cache_gb"):
        parse_config({"store": {"cpu_cache_gb": 100_000 * beyond_memory_gb()}})


@pytest.mark.parametrize(
    "value", [0, -1, float("inf"), float("nan"), 10**400, True, "1", None]
)
def test_other_impossible_host_sizes_name_the_key(value: Any) -> None:
    with pytest.raises(aiokv.ConfigError, match=r"store\.cpu_cache_gb"):
        aiokv.StoreConfig(cpu_cache_gb=value)


def test_a_tier_size_past_a_64_bit_size_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Finite, but inf bytes: the SSD tier's slot count was a bare ValueError at register
    # (and the host tier's too, where the OS gives no memory size to check it against).
    monkeypatch.setattr(config_module.os, "sysconf", lambda name: -1)
    assert machine_memory_bytes() is None
    with pytest.raises(aiokv.ConfigError, match=r"^store\.ssd_cache_gb: .*got 1e\+300$"):
        aiokv.StoreConfig(cpu_cache_gb=0.001, ssd_cache_gb=1e300, ssd_cache_dir=str(tmp_path))
    with pytest.raises(aiokv.ConfigError, match=r"^store\.cpu_cache_gb: .*got 1e\+300$"):
        aiokv.StoreConfig(cpu_cache_gb=1e300)
    # At most 2**63 bytes: a larger SSD size is said against the free space at open.
    assert aiokv.StoreConfig(cpu_cache_gb=1, ssd_cache_gb=2.0**33,
                             ssd_cache_dir=str(tmp_path)).ssd_cache_gb == 2.0**33


@pytest.mark.parametrize("value", [0, -4, 2.5, 10**13, True])
def test_impossible_page_sizes_name_the_key(value: Any) -> None:
    with pytest.raises(aiokv.ConfigError, match=r"store\.page_size"):
        aiokv.StoreConfig(page_size=value)


@needs_memory_size
def test_a_size_that_fits_is_accepted() -> None:
    assert MEMORY is not None
    fits = MEMORY / (1 << 30) / 4
    assert aiokv.StoreConfig(cpu_cache_gb=fits).cpu_cache_gb == fits


def test_without_a_memory_size_from_the_os_the_bound_is_not_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_sysconf(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(config_module.os, "sysconf", no_sysconf)
    assert machine_memory_bytes() is None
    assert aiokv.StoreConfig(cpu_cache_gb=10**9).cpu_cache_gb == 10**9


@pytest.mark.asyncio
async def test_a_host_tier_the_allocator_refuses_at_start_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The size passed the memory check, yet the (pinned) allocation fails at start: on a
    # GPU host, pinned memory is limited well below the machine's memory.
    from aiokv.stores.local import pool

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: out of memory (pinned)")

    monkeypatch.setattr(pool, "HostMemory", refuse)
    caches = [torch.zeros(8, 2, 4, 2, 8)]
    engine = aiokv.OffloadEngine(aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.01)), caches)
    with pytest.raises(aiokv.ConfigError) as caught:
        await engine.start()
    assert caught.value.key == "store.cpu_cache_gb" and "0.01" in str(caught.value)
    assert engine.state is aiokv.EngineState.CLOSED
