"""FlexKV's SSD tier as aiokv configures and polls it, without FlexKV.

- the tier keys (aiokv/stores/flexkv/tiers.py): ssd_cache_dir in its three forms becomes
  FlexKV's list of directories, write_back is refused naming the key, the directories
  and their free space are checked, configs/ssd.yml maps unchanged;
- with an SSD tier, a task is polled with ``wait(ids, timeout=0.0, completely=True)``
  and answered only once its SSD write is done (FlexKV's try_wait answers once the GPU
  copy is, while the put's CPU blocks stay locked); without one, try_wait as before."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import shutil
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import yaml
from conftest import launch_slots

import aiokv
from aiokv.stores.base import TaskStatus
from aiokv.stores.flexkv import FlexKVStore
from aiokv.stores.flexkv.tiers import (
    _NoWaitTimeouts,
    check_ssd_dirs,
    ssd_dirs,
    tier_values,
)

PAGE = 4
SSD_YML = Path(__file__).resolve().parent.parent / "configs" / "ssd.yml"
# The StoreConfig keys of the SSD tier, with their defaults (the local store's SSD work
# adds them to StoreConfig; these tests read a config the way the adapter does).
TIER_DEFAULTS = {"ssd_write_policy": "write_through", "ssd_reset_on_mismatch": False}
HAS_TIER_KEYS = {f.name for f in dataclasses.fields(aiokv.StoreConfig)} >= set(TIER_DEFAULTS)


class Tiers(NamedTuple):
    """The tier keys of a StoreConfig, as the adapter reads them (any object with them)."""

    cpu_cache_gb: float = 1.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: Any = None
    ssd_write_policy: str = "write_through"
    ssd_reset_on_mismatch: bool = False


# ---- the tier keys ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["/mnt/a;/mnt/b", " /mnt/a ; /mnt/b ;", ["/mnt/a", "/mnt/b"], (Path("/mnt/a"), "/mnt/b")],
)
def test_every_form_of_ssd_cache_dir_is_flexkvs_list_of_directories(value: Any) -> None:
    assert ssd_dirs(Tiers(ssd_cache_dir=value)) == ["/mnt/a", "/mnt/b"]
    values = tier_values(Tiers(cpu_cache_gb=2.0, ssd_cache_gb=8.0, ssd_cache_dir=value))
    assert values == {
        "cpu_cache_gb": 2.0, "ssd_cache_gb": 8.0, "ssd_cache_dir": ["/mnt/a", "/mnt/b"]
    }


def test_one_directory_and_the_flexkv_mappings_own_and_none() -> None:
    assert ssd_dirs(Tiers(ssd_cache_dir="/mnt/a")) == ["/mnt/a"]
    assert ssd_dirs(Tiers(), fallback="/x;/y") == ["/x", "/y"]  # flexkv: {ssd_cache_dir}
    assert ssd_dirs(Tiers(ssd_cache_dir="/mnt/a"), fallback="/x") == ["/mnt/a"]  # ours wins
    assert tier_values(Tiers())["ssd_cache_dir"] == ["./flexkv_ssd"]  # no SSD tier


def test_write_back_is_refused_naming_the_key() -> None:
    with pytest.raises(aiokv.ConfigError, match="write_back") as error:
        tier_values(Tiers(ssd_cache_gb=8.0, ssd_cache_dir="/mnt/a", ssd_write_policy="write_back"))
    assert error.value.key == "store.ssd_write_policy"
    with pytest.raises(aiokv.ConfigError) as missing:
        tier_values(Tiers(ssd_cache_gb=8.0))
    assert missing.value.key == "store.ssd_cache_dir"


def test_configs_ssd_yml_maps_unchanged() -> None:
    store = yaml.safe_load(SSD_YML.read_text())["store"]
    keys = {k: store[k] for k in Tiers._fields if k in store}
    assert set(keys) == set(Tiers._fields)  # the file sets every tier key
    values = tier_values(Tiers(**keys))
    assert values["ssd_cache_dir"] == ssd_dirs(Tiers(ssd_cache_dir=store["ssd_cache_dir"]))
    assert values["ssd_cache_gb"] > values["cpu_cache_gb"]  # FlexKV's own rule holds


@pytest.mark.skipif(not HAS_TIER_KEYS, reason="StoreConfig has no ssd_write_policy yet "
                    "(the local store's SSD tier adds it)")
def test_configs_ssd_yml_loads_as_a_flexkv_store_config() -> None:
    document = yaml.safe_load(SSD_YML.read_text())
    document["store"]["backend"] = "flexkv"
    _, config = aiokv.config.parse_config(document)
    values = tier_values(config)
    assert values["ssd_cache_dir"] == ssd_dirs(config) and values["ssd_cache_gb"] > 0


def test_directories_must_exist_be_writable_and_have_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    with pytest.raises(aiokv.ConfigError, match="b' does not exist") as missing:
        check_ssd_dirs([str(a), str(b)], 1.0)
    assert missing.value.key == "store.ssd_cache_dir"
    b.write_bytes(b"")
    with pytest.raises(aiokv.ConfigError, match="b' is not a directory"):
        check_ssd_dirs([str(a), str(b)], 1.0)
    b.unlink()
    b.mkdir()
    check_ssd_dirs([str(a), str(b)], 0.001)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: p != str(b) and real_access(p, m))
    with pytest.raises(aiokv.ConfigError, match="not writable"):
        check_ssd_dirs([str(a), str(b)], 0.001)
    monkeypatch.undo()

    free = 3 << 30

    def usage(path: Any) -> Any:
        return types.SimpleNamespace(total=free, used=0, free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    check_ssd_dirs([str(a), str(b)], 3.0)  # 1.5 GiB each, one filesystem: fits
    with pytest.raises(aiokv.ConfigError, match="free") as full:
        check_ssd_dirs([str(a), str(b)], 3.5)  # both shares land on the same 3 GiB
    assert full.value.key == "store.ssd_cache_gb"
    # FlexKV's own files from a run before are truncated at start: they count as room.
    old = a / "flexkv_ssd_cache_0_0.bin"
    with old.open("wb") as file:
        file.write(os.urandom(1 << 20))
        file.flush()
        os.fsync(file.fileno())  # allocated now, as a written SSD file is
    free = (3 << 30) - (1 << 20)
    check_ssd_dirs([str(a), str(b)], 3.0)


def test_the_adapter_refuses_write_back_when_it_is_built() -> None:
    keys = {**dataclasses.asdict(aiokv.StoreConfig(backend="flexkv")),
            "ssd_write_policy": "write_back"}  # a valid policy for the local store
    config = types.SimpleNamespace(**keys)
    with pytest.raises(aiokv.ConfigError) as error:
        FlexKVStore(config)  # type: ignore[arg-type]
    assert error.value.key == "store.ssd_write_policy"


def test_the_wait_timeout_lines_are_filtered_and_nothing_else() -> None:
    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("flexkv", logging.ERROR, "client.py", 1, message, None, None)

    quiet = _NoWaitTimeouts()
    assert not quiet.filter(record("wait task 12 failed: KVResponseStatus.TIMEOUT"))
    assert quiet.filter(record("wait task 12 failed: KVResponseStatus.FAILED"))
    assert quiet.filter(record("try_wait task 3 failed: KVResponseStatus.NOTFOUND"))


# ---- polling with an SSD tier -------------------------------------------------------


class KVResponseStatus(enum.Enum):  # FlexKV's (flexkv/common/request.py)
    SUCCESS = "success"
    NOTFOUND = "not_found"
    UNREADY = "unready"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    FAILED = "failed"


@pytest.fixture
def flexkv_request_module(monkeypatch: pytest.MonkeyPatch) -> None:
    request = types.ModuleType("flexkv.common.request")
    request.KVResponseStatus = KVResponseStatus  # type: ignore[attr-defined]
    for name in ("flexkv", "flexkv.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flexkv.common.request", request)


class WriteThroughManager:
    """FlexKV's task life with an SSD tier (kvtask.py _wait_impl): a put's GPU copy ends
    (``copied``), then its SSD write (``written``). ``try_wait`` (completely=False) answers
    after the copy; ``wait(timeout=0.0, completely=True)`` answers after the write, TIMEOUT
    before, and keeps the task; an answered task is released (NOTFOUND after)."""

    def __init__(self) -> None:
        self.tasks: dict[int, str] = {}  # id -> matched | running | copied | written
        self.members: dict[int, list[int]] = {}
        self.waits: list[tuple[float, bool]] = []
        self._next = 0

    def put_match(self, tokens: np.ndarray, namespace: list[str]) -> tuple[int, np.ndarray]:
        self._next += 1
        self.tasks[self._next] = "matched"
        return self._next, np.ones(len(tokens), dtype=np.bool_)

    def launch(self, ids: Sequence[int], slots: Sequence[np.ndarray], as_batch: bool) -> list[int]:
        if as_batch:
            self._next += 1
            for t in ids:
                del self.tasks[t]
            self.tasks[self._next] = "running"
            self.members[self._next] = list(ids)
            return [self._next]
        self.tasks.update(dict.fromkeys(ids, "running"))
        return list(ids)

    def cancel(self, ids: Sequence[int]) -> None:
        for t in ids:
            self.tasks.pop(t, None)

    def _answer(self, fid: int, status: KVResponseStatus) -> Any:
        mask: Any = None
        if status is KVResponseStatus.SUCCESS and fid in self.members:
            mask = [np.ones(2 * PAGE, dtype=np.bool_) for _ in self.members[fid]]
        return types.SimpleNamespace(status=status, return_mask=mask)

    def try_wait(self, ids: Sequence[int]) -> dict[int, Any]:
        raise AssertionError("with an SSD tier, try_wait answers before the SSD write ends")

    def wait(self, ids: Sequence[int], timeout: float = 20.0, completely: bool = False
             ) -> dict[int, Any]:
        self.waits.append((timeout, completely))
        out: dict[int, Any] = {}
        for fid in ids:
            state = self.tasks.get(fid)
            if state is None:
                out[fid] = self._answer(fid, KVResponseStatus.NOTFOUND)
            elif state == "written" or (state == "copied" and not completely):
                out[fid] = self._answer(fid, KVResponseStatus.SUCCESS)
                del self.tasks[fid]
            else:
                out[fid] = self._answer(fid, KVResponseStatus.TIMEOUT)
        return out


def ssd_store(tmp_path: Path, manager: WriteThroughManager) -> FlexKVStore:
    config = aiokv.StoreConfig(
        backend="flexkv", page_size=PAGE, cpu_cache_gb=1.0, ssd_cache_gb=2.0,
        ssd_cache_dir=str(tmp_path),
    )
    store = FlexKVStore(config)
    store.page_size = PAGE
    store._manager = manager  # as register() leaves it, without starting FlexKV
    store._slots.num_pages = 1024  # as register() sets it
    return store


def test_with_an_ssd_tier_a_put_is_answered_only_once_its_ssd_write_is_done(
    tmp_path: Path, flexkv_request_module: None
) -> None:
    manager = WriteThroughManager()
    store = ssd_store(tmp_path, manager)
    task = store.put_match(np.arange(2 * PAGE, dtype=np.int64), ["u"])[0]
    launch_slots(store, [task], [np.arange(2 * PAGE, dtype=np.int64)])
    assert store.try_wait([task]) == {}  # copying
    manager.tasks[task] = "copied"  # GPU copy done, CPU blocks locked, SSD write runs
    assert store.try_wait([task]) == {}
    assert task in manager.tasks  # TIMEOUT kept it: FlexKV still knows it
    manager.tasks[task] = "written"
    answer = store.try_wait([task])
    assert answer[task].status is TaskStatus.SUCCESS
    assert store.try_wait([task])[task].status is TaskStatus.FAILED  # answered once only
    assert set(manager.waits) == {(0.0, True)}  # never blocking, always completely


def test_a_batch_is_answered_per_member_once_all_of_it_is_written(
    tmp_path: Path, flexkv_request_module: None
) -> None:
    manager = WriteThroughManager()
    store = ssd_store(tmp_path, manager)
    ids = [store.put_match(np.arange(2 * PAGE, dtype=np.int64), [f"u{i}"])[0] for i in range(2)]
    launch_slots(store, ids, [np.arange(2 * PAGE, dtype=np.int64)] * 2)
    (batch,) = manager.members
    manager.tasks[batch] = "copied"
    assert store.try_wait(ids) == {}
    manager.tasks[batch] = "written"
    answers = store.try_wait(ids)
    assert {t: a.status for t, a in answers.items()} == dict.fromkeys(ids, TaskStatus.SUCCESS)
    assert all(a.mask is not None and a.mask.all() for a in answers.values())


def test_without_an_ssd_tier_try_wait_answers_after_the_copy(
    flexkv_request_module: None,
) -> None:
    class CopyOnly(WriteThroughManager):
        def try_wait(self, ids: Sequence[int]) -> dict[int, Any]:
            return {f: r for f, r in self.wait(ids, 0.0, False).items()
                    if r.status is not KVResponseStatus.TIMEOUT}

    manager = CopyOnly()
    store = FlexKVStore(aiokv.StoreConfig(backend="flexkv", page_size=PAGE))
    store.page_size = PAGE
    store._manager = manager
    store._slots.num_pages = 1024  # as register() sets it
    task = store.put_match(np.arange(2 * PAGE, dtype=np.int64), ["u"])[0]
    launch_slots(store, [task], [np.arange(2 * PAGE, dtype=np.int64)])
    manager.tasks[task] = "copied"
    assert store.try_wait([task])[task].status is TaskStatus.SUCCESS
    assert manager.waits == [(0.0, False)]  # through try_wait's completely=False
