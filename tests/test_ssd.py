"""The embedded store's SSD tier, through the engine where it can be: round trips after
host eviction, persistence, integrity, several directories, errors and backpressure."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import held

import aiokv
from aiokv.stores.base import NoSpace
from aiokv.stores.local import ssd as ssd_module
from aiokv.stores.local import ssd_format, ssd_io, ssd_voids
from aiokv.stores.local.layout import block_stride

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 160, 16, 2, 16
BLOCK = LAYERS * 2 * PAGE * HEADS * DIM * 4  # float32: 8 KiB, a whole number of 4 KiB pages
SLOT = ssd_format.HEADER_BYTES + BLOCK
USER_PAGES = 8  # pages per user
HOST_BLOCKS = 16  # two users


def caches_for(seed: int = 0, layers: int = LAYERS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGES, 2, PAGE, HEADS, DIM, generator=generator) for _ in range(layers)]


def ssd_config(directory: Any, slots: int = 128, **keys: Any) -> aiokv.StoreConfig:
    # HOST_BLOCKS blocks, with a remote tier's trailer after each where there is one, in
    # whole memory pages (as a store server's region takes its GiB).
    stride = block_stride(BLOCK, keys.get("remote") is not None)
    return aiokv.StoreConfig(
        cpu_cache_gb=-(-HOST_BLOCKS * stride // 4096) * 4096 / (1 << 30),
        ssd_cache_gb=slots * SLOT / (1 << 30),
        ssd_cache_dir=directory,
        **keys,
    )


def source_pages(user: int) -> torch.Tensor:
    return torch.arange(USER_PAGES * user, USER_PAGES * (user + 1))


async def offload(engine: aiokv.OffloadEngine, user: int) -> aiokv.OffloadResult:
    """One user's offload. While the host tier is full of blocks in flight to SSD the
    engine holds it and matches it again (backpressure): no retry here."""
    return await engine.offload(user, source_pages(user), USER_PAGES * PAGE)


async def load_back(engine: aiokv.OffloadEngine, user: int, target: torch.Tensor) -> int:
    hit = await engine.lookup(user, USER_PAGES * PAGE)
    if hit.cached_tokens == 0:
        hit.release()
        return 0
    return (await engine.load(hit, target[: hit.cached_tokens // PAGE])).loaded_tokens


def same(caches: list[torch.Tensor], original: list[torch.Tensor], got: torch.Tensor,
         want: torch.Tensor) -> bool:
    return all(torch.equal(c[got], o[want]) for c, o in zip(caches, original, strict=True))


TARGET = torch.arange(PAGES - USER_PAGES, PAGES)  # load destination, never a source


def engine_on(
    directory: Any, **keys: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], aiokv.LocalStore, aiokv.OffloadEngine]:
    """Fresh caches, a copy of them, and an engine on an SSD-tiered store in directory."""
    caches = caches_for()
    store = aiokv.LocalStore(ssd_config(directory, **keys))
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig())
    return caches, [c.clone() for c in caches], store, engine


async def check_loads(
    engine: aiokv.OffloadEngine, users: Any, caches: list[torch.Tensor],
    original: list[torch.Tensor],
) -> None:
    """Every user loads back whole and bit-exact."""
    for user in users:
        assert await load_back(engine, user, TARGET) == USER_PAGES * PAGE, user
        assert same(caches, original, TARGET, source_pages(user)), user


async def write_users(directory: Any, users: int, seed: int = 0, **keys: Any) -> dict[str, Any]:
    caches = caches_for(seed)
    store = aiokv.LocalStore(ssd_config(directory, **keys))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        for user in range(users):
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
    return dict(store.store_stats())


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_round_trip_through_ssd_after_host_eviction(tmp_path: Path, policy: str) -> None:
    caches, original, store, engine = engine_on(tmp_path, ssd_write_policy=policy)
    users = 6  # three times the host tier
    async with engine:
        for user in range(users):
            await offload(engine, user)
        await check_loads(engine, range(users), caches, original)
    stats = store.store_stats()
    assert stats["bytes_ssd_read"] >= (users - 2) * USER_PAGES * BLOCK  # evicted, read back
    assert stats["bytes_ssd_written"] >= (users - 2) * USER_PAGES * BLOCK
    assert stats["checksum_failures"] == 0 and stats["ssd_write_errors"] == 0
    assert stats["host_blocks_total"] == HOST_BLOCKS


@pytest.mark.asyncio
async def test_write_back_writes_only_what_the_host_evicts(tmp_path: Path) -> None:
    back, through = tmp_path / "back", tmp_path / "through"
    back.mkdir()
    through.mkdir()
    caches, original, store, engine = engine_on(back, ssd_write_policy="write_back")
    async with engine:
        await offload(engine, 0)
        await check_loads(engine, [0], caches, original)
        assert store.store_stats()["bytes_ssd_written"] == 0  # one user fits the host tier
    # Closing copies what only the host held, so that a reopen finds it.
    assert store.store_stats()["bytes_ssd_written"] == USER_PAGES * BLOCK
    caches, _, store, engine = engine_on(back, ssd_write_policy="write_back")
    async with engine:
        await check_loads(engine, [0], caches, original)
    (tmp_path / "back3").mkdir()
    stats = await write_users(tmp_path / "back3", 3, ssd_write_policy="write_back")
    assert stats["bytes_ssd_written"] == 3 * USER_PAGES * BLOCK  # each block once
    stats = await write_users(through, 1)  # write_through: copied at once
    assert stats["bytes_ssd_written"] == USER_PAGES * BLOCK


@pytest.mark.asyncio
async def test_reopen_serves_what_was_cached_before(tmp_path: Path) -> None:
    original = caches_for()
    await write_users(tmp_path, 4)
    caches = [torch.zeros_like(c) for c in original]  # a fresh process: nothing on the GPU
    store = aiokv.LocalStore(ssd_config(tmp_path))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        assert store.store_stats()["ssd_blocks_used"] == 4 * USER_PAGES
        for user in range(4):
            assert await load_back(engine, user, TARGET) == USER_PAGES * PAGE, user
            assert same(caches, original, TARGET, source_pages(user)), user
        assert await load_back(engine, 4, TARGET) == 0  # never stored


@pytest.mark.asyncio
async def test_a_block_of_no_whole_number_of_4_kib_pages_comes_back_from_ssd(
    tmp_path: Path,
) -> None:
    """Such a block's slot ends in padding (buffered I/O): its reads fill that too."""
    original = [c.half() for c in caches_for(layers=1)]  # 2 KiB blocks
    caches = [c.clone() for c in original]
    async with aiokv.OffloadEngine(aiokv.LocalStore(ssd_config(tmp_path)), caches) as engine:
        for user in range(4):
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
    caches = [torch.zeros_like(c) for c in original]  # reopened: only the SSD has them
    async with aiokv.OffloadEngine(aiokv.LocalStore(ssd_config(tmp_path)), caches) as engine:
        for user in range(4):
            assert await load_back(engine, user, TARGET) == USER_PAGES * PAGE, user
            assert same(caches, original, TARGET, source_pages(user)), user


def slot_of(directory: Path, user: int, page: int, count: int = 1) -> tuple[Path, int]:
    """The data file and offset of a user's page on disk (as the engine names users)."""
    from aiokv.stores.local.digests import chain_digests

    digest = chain_digests(np.arange((page + 1) * PAGE, dtype=np.int64), PAGE)[page]
    for k in range(count):
        path = directory / f"{k}" / ssd_io.SUBDIR / ssd_format.DATA_NAME if count > 1 else (
            directory / ssd_io.SUBDIR / ssd_format.DATA_NAME
        )
        data = path.read_bytes()
        for offset in range(0, len(data), SLOT):
            header = ssd_format.unpack_header(data[offset : offset + ssd_format.HEADER_BYTES])
            if header and header.digest == digest and header.namespace == (f"uid:{user}",):
                return path, offset
    raise AssertionError(f"user {user} page {page} is not on disk")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.asyncio
async def test_a_flipped_byte_is_a_miss_not_garbage(tmp_path: Path) -> None:
    original = caches_for()
    await write_users(tmp_path, 1)
    path, offset = slot_of(tmp_path, 0, page=5)
    flip_byte(path, offset + ssd_format.HEADER_BYTES + BLOCK // 2)  # mid page 5's data
    caches = [torch.zeros_like(c) for c in original]
    store = aiokv.LocalStore(ssd_config(tmp_path))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        loaded = await load_back(engine, 0, TARGET)
        assert loaded == 5 * PAGE  # pages 0..4; the damaged page and all after it missed
        assert same(caches, original, TARGET[:5], source_pages(0)[:5])
        assert all(not c[TARGET[5:]].any() for c in caches)  # nothing else written
        assert store.store_stats()["checksum_failures"] == 1
        hit = await engine.lookup(0, USER_PAGES * PAGE)
        assert hit.cached_tokens == 5 * PAGE  # the damaged block is gone from the index
        hit.release()


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["list", "semicolons"])
async def test_several_directories_share_the_blocks(tmp_path: Path, form: str) -> None:
    dirs = [tmp_path / str(k) for k in range(3)]
    for d in dirs:
        d.mkdir()
    value: Any = [str(d) for d in dirs] if form == "list" else ";".join(map(str, dirs))
    original = caches_for()
    await write_users(value, 3, slots=129)
    for d in dirs:  # every directory holds a third of them
        data = (d / ssd_io.SUBDIR / ssd_format.DATA_NAME).read_bytes()
        headers = [ssd_format.unpack_header(data[o : o + ssd_format.HEADER_BYTES])
                   for o in range(0, len(data), SLOT)]
        assert sum(h is not None for h in headers) == USER_PAGES
        assert os.stat(d / ssd_io.SUBDIR).st_mode & 0o777 == 0o700
        assert os.stat(d / ssd_io.SUBDIR / ssd_format.DATA_NAME).st_mode & 0o777 == 0o600
    caches = [torch.zeros_like(c) for c in original]
    store = aiokv.LocalStore(ssd_config(value, slots=129))
    async with aiokv.OffloadEngine(store, caches, aiokv.EngineConfig()) as engine:
        for user in range(3):
            assert await load_back(engine, user, TARGET) == USER_PAGES * PAGE
            assert same(caches, original, TARGET, source_pages(user))


def test_a_directory_of_another_geometry_is_refused(tmp_path: Path) -> None:
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    store.close()
    other = aiokv.LocalStore(ssd_config(tmp_path))
    with pytest.raises(aiokv.ConfigError, match=r"layers 2 != 3") as caught:
        other.register(caches_for(layers=3))
    assert caught.value.key == "store.ssd_cache_dir"
    half = [c.half() for c in caches_for()]
    with pytest.raises(aiokv.ConfigError, match=r"dtype 'float32' != 'float16'"):
        aiokv.LocalStore(ssd_config(tmp_path)).register(half)
    reset = aiokv.LocalStore(ssd_config(tmp_path, ssd_reset_on_mismatch=True))
    reset.register(caches_for(layers=3))
    assert reset.store_stats()["ssd_blocks_used"] == 0
    reset.close()


@pytest.mark.parametrize("text", [
    "[]", "null", '{"format": 1, "geometry": null, "stripe": [0, 1], "slots": 1, "epoch": 0}',
    '{"format": 1, "geometry": {}, "stripe": [0], "slots": 1, "epoch": 0}'])
@pytest.mark.parametrize("reset", [False, True])
def test_a_meta_file_of_another_shape_is_a_config_error_or_reset(
    tmp_path: Path, text: str, reset: bool
) -> None:
    # Valid JSON of another shape raised AttributeError or IndexError, reset or not.
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    store.close()
    next(tmp_path.rglob("meta.json")).write_text(text)
    again = aiokv.LocalStore(ssd_config(tmp_path, ssd_reset_on_mismatch=reset))
    if reset:
        again.register(caches_for())
        assert again.store_stats()["ssd_blocks_used"] == 0
        again.close()
    else:
        with pytest.raises(aiokv.ConfigError, match="not aiokv's") as caught:
            again.register(caches_for())
        assert caught.value.key == "store.ssd_cache_dir"


@pytest.mark.parametrize("breakage", ["a directory", "a dangling link"])
def test_a_data_file_that_cannot_be_opened_is_a_config_error(
    tmp_path: Path, breakage: str
) -> None:
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    store.close()
    data = next(tmp_path.rglob("blocks.dat"))
    data.unlink()
    if breakage == "a directory":
        data.mkdir()
    else:
        data.symlink_to(tmp_path / "gone" / "blocks.dat")
    with pytest.raises(aiokv.ConfigError, match="cannot open") as caught:
        aiokv.LocalStore(ssd_config(tmp_path)).register(caches_for())
    assert caught.value.key == "store.ssd_cache_dir"


def test_missing_unwritable_and_too_large(tmp_path: Path) -> None:
    with pytest.raises(aiokv.ConfigError, match="missing' does not exist") as caught:
        aiokv.LocalStore(ssd_config(tmp_path / "missing")).register(caches_for())
    assert caught.value.key == "store.ssd_cache_dir"
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(aiokv.ConfigError, match="file' is not a directory") as caught:
        aiokv.LocalStore(ssd_config(tmp_path / "file")).register(caches_for())
    assert caught.value.key == "store.ssd_cache_dir"
    if os.geteuid() == 0:
        unwritable = Path("/proc")  # root writes anywhere a filesystem lets it
    else:
        unwritable = tmp_path / "ro"
        unwritable.mkdir(mode=0o500)
    with pytest.raises(aiokv.ConfigError, match="not writable") as caught:
        aiokv.LocalStore(ssd_config(unwritable)).register(caches_for())
    assert caught.value.key == "store.ssd_cache_dir"
    huge = aiokv.StoreConfig(cpu_cache_gb=0.001, ssd_cache_gb=1e9, ssd_cache_dir=str(tmp_path))
    with pytest.raises(aiokv.ConfigError, match="GiB free") as caught:
        aiokv.LocalStore(huge).register(caches_for())
    assert caught.value.key == "store.ssd_cache_gb"


def test_too_large_for_a_small_filesystem_names_figures_a_user_can_tell_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SSD tier of 12 MiB on a filesystem with 6 MiB free: the ConfigError names both
    figures so that they differ (before, in GiB to two places: "needs 0.01 GiB more ...
    which has 0.01 GiB free")."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ssd_io.shutil, "disk_usage",
                        lambda path: usage._replace(free=6 << 20))
    with pytest.raises(aiokv.ConfigError, match="free") as caught:
        aiokv.LocalStore(ssd_config(tmp_path, slots=1024)).register(caches_for())
    assert caught.value.key == "store.ssd_cache_gb"
    found = re.search(r"needs (.+) more .* which has (.+) free", str(caught.value))
    assert found is not None
    need, free = found.groups()
    assert need != free
    assert need.startswith("12.0 MiB") and free.startswith("6.0 MiB")


@pytest.mark.parametrize("backend", ["local", "flexkv"])
def test_configs_ssd_yml_is_valid_for_both_backends(backend: str) -> None:
    import yaml

    root = Path(__file__).resolve().parent.parent
    document = yaml.safe_load((root / "configs" / "ssd.yml").read_text())
    document["store"]["backend"] = backend
    _, store = aiokv.config.parse_config(document)
    assert store.ssd_cache_gb > store.cpu_cache_gb > 0
    assert store.ssd_dirs() and store.ssd_write_policy == "write_through"


@pytest.mark.parametrize(
    ("value", "dirs"),
    [("/a", ("/a",)), ("/a;/b", ("/a", "/b")), (["/a", "/b"], ("/a", "/b")), (None, ())],
)
def test_ssd_cache_dir_forms(value: Any, dirs: tuple[str, ...]) -> None:
    config = aiokv.StoreConfig(ssd_cache_dir=value)
    assert config.ssd_dirs() == dirs
    assert not isinstance(config.ssd_cache_dir, list)  # a list became a tuple: frozen


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"ssd_write_policy": "sometimes"}, "store.ssd_write_policy"),
        ({"ssd_reset_on_mismatch": "yes"}, "store.ssd_reset_on_mismatch"),
        ({"ssd_cache_dir": ["/a", 3]}, "store.ssd_cache_dir"),
        ({"ssd_cache_dir": "/a;/a"}, "store.ssd_cache_dir"),
        ({"ssd_cache_gb": 2.0, "ssd_cache_dir": ";"}, "store.ssd_cache_dir"),
    ],
)
def test_bad_ssd_keys_name_the_key(keys: dict[str, Any], key: str) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.StoreConfig(**keys)
    assert caught.value.key == key


async def figure(store: aiokv.LocalStore, name: str, value: int) -> None:
    """Wait (5 s at most) until the store's figure ``name`` is ``value``: SSD writes land
    on their own threads and are applied on the store thread after."""
    for _ in range(250):
        if store.store_stats()[name] == value:
            return
        await asyncio.sleep(0.02)
    assert store.store_stats()[name] == value


@pytest.mark.asyncio
async def test_an_evict_while_the_key_is_written_to_ssd_drops_it_for_good(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_through (the default): an evict right after an offload, its SSD write still
    running (held back here): the key is gone at once, stays gone once the write lands,
    and after a reopen; another key's stays."""
    gate = held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *args: request.is_write)
    _, _, store, engine = engine_on(tmp_path)
    try:
        async with engine:
            for user in (0, 1):
                assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
            assert await engine.evict(0) == USER_PAGES * PAGE
            assert await load_back(engine, 0, TARGET) == 0
            gate.set()
            await figure(store, "ssd_blocks_used", USER_PAGES)  # the writes landed: user 1's
            assert await load_back(engine, 0, TARGET) == 0
            assert await load_back(engine, 1, TARGET) == USER_PAGES * PAGE
    finally:
        gate.set()
    monkeypatch.undo()
    caches, original, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0
        assert await load_back(engine, 1, TARGET) == USER_PAGES * PAGE
        assert same(caches, original, TARGET, source_pages(1))


@pytest.mark.asyncio
async def test_an_evict_returns_once_its_ssd_voids_are_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """So that a process killed right after it (kill -9) does not find the key again:
    the voided headers are on disk before evict returns."""
    _, _, store, engine = engine_on(tmp_path)
    async with engine:
        assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", USER_PAGES * BLOCK)  # its slots idle
        gate = held(monkeypatch, ssd_voids.HeaderVoids, "_void_one")
        evict = asyncio.ensure_future(engine.evict(0))
        done, _ = await asyncio.wait([evict], timeout=0.5)
        assert not done, "evict returned before its SSD voids were written"
        gate.set()
        assert await evict == USER_PAGES * PAGE


@pytest.mark.asyncio
async def test_an_evict_while_its_ssd_write_runs_waits_for_that_write_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write's header made, its pwrite held: the evict returns once that write and
    the void right behind it are done (not after the other writes queued), and the key
    is gone after a reopen."""
    gate = held(monkeypatch, ssd_io.SsdFiles, "write",
                lambda files, k, offset, buffers: len(buffers) > 1)  # data, not a void
    _, _, _, engine = engine_on(tmp_path)
    try:
        async with engine:
            assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
            assert await asyncio.to_thread(gate.entered.wait, 10)  # its header made
            evict = asyncio.ensure_future(engine.evict(0))
            done, _ = await asyncio.wait([evict], timeout=0.5)
            assert not done, "evict returned while the key's SSD write could still land"
            gate.set()
            assert await evict == USER_PAGES * PAGE
    finally:
        gate.set()
    monkeypatch.undo()
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


def named_on_disk(directory: Path, user: int) -> int:
    """How many slots' headers on disk name the user's key (what a restart would find)."""
    data = (directory / ssd_io.SUBDIR / ssd_format.DATA_NAME).read_bytes()
    heads = (ssd_format.unpack_header(data[o : o + ssd_format.HEADER_BYTES])
             for o in range(0, len(data), SLOT))
    return sum(1 for h in heads if h is not None and h.namespace == (f"uid:{user}",))


@pytest.mark.asyncio
async def test_a_write_that_lands_after_its_key_was_evicted_names_nothing_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a kill -9 right after that write would leave: no header of the key, even
    with every later void held back."""
    writes = held(monkeypatch, ssd_module.SsdTier, "_run",
                  lambda tier, request, *args: request.is_write)
    voids = held(monkeypatch, ssd_voids.HeaderVoids, "_void_one")
    _, _, store, engine = engine_on(tmp_path)
    try:
        async with engine:
            assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
            assert await engine.evict(0) == USER_PAGES * PAGE  # its write not started
            writes.set()
            await figure(store, "bytes_ssd_written", USER_PAGES * BLOCK)
            assert named_on_disk(tmp_path, 0) == 0
            voids.set()
    finally:
        writes.set()
        voids.set()


def writes_of(user: int) -> Any:
    """``held``'s pick: the SSD tier's write requests of one user's key."""
    name = ssd_format.encode_namespace((f"uid:{user}",))
    return lambda tier, request, *args: request.is_write and request.namespaces[0] == name


@pytest.mark.asyncio
async def test_an_evict_voids_slots_recycled_for_another_key_before_that_write_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SSD tier of two users' slots: users 2 and 3 take users 0's and 1's slots, whose
    headers name the old users until the new writes land. Evicting user 1 while user 3's
    write waits in the lane leaves no header of user 1 (a kill -9 then would not bring
    it back), and the late writes still land and load bit-exact, also after a reopen."""
    caches, original, store, engine = engine_on(tmp_path, slots=2 * USER_PAGES)
    async with engine:
        for user in (0, 1):
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", 2 * USER_PAGES * BLOCK)
        assert named_on_disk(tmp_path, 1) == USER_PAGES
        late = held(monkeypatch, ssd_module.SsdTier, "_run", writes_of(3))
        first = held(monkeypatch, ssd_module.SsdTier, "_run", writes_of(2))
        try:
            for user in (2, 3):
                assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
            assert await asyncio.to_thread(first.entered.wait, 10)  # user 3's write queued
            dropped = threading.Event()  # the evict's voids queued, ahead of user 3's write
            real_drop = ssd_module.SsdTier.drop_namespace

            def drop_namespace(tier: Any, namespace: Any) -> Any:
                done = real_drop(tier, namespace)
                dropped.set()
                return done

            monkeypatch.setattr(ssd_module.SsdTier, "drop_namespace", drop_namespace)
            evict = asyncio.ensure_future(engine.evict(1))
            # Only then user 2's write ends: on a busy box user 3's could otherwise take
            # the lane (and wait on its gate) before the evict queued its voids.
            assert await asyncio.to_thread(dropped.wait, 10)
            first.set()
            assert await asyncio.to_thread(late.entered.wait, 10)  # user 3's write next
            await asyncio.wait_for(evict, 10)
            assert named_on_disk(tmp_path, 1) == 0
            assert named_on_disk(tmp_path, 2) == USER_PAGES
        finally:
            first.set()
            late.set()
        await figure(store, "bytes_ssd_written", 4 * USER_PAGES * BLOCK)
        assert named_on_disk(tmp_path, 3) == USER_PAGES
        assert await load_back(engine, 1, TARGET) == 0
    monkeypatch.undo()
    caches, original, _, engine = engine_on(tmp_path, slots=2 * USER_PAGES)
    async with engine:
        assert await load_back(engine, 1, TARGET) == 0
        await check_loads(engine, (2, 3), caches, original)


@pytest.mark.asyncio
async def test_an_evict_voids_the_ssd_slots_a_held_lookup_reads_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Lookup of a user only the SSD tier holds keeps its slots in use; an evict while
    it is held leaves no header of the user on disk once it returns (before the lookup
    is let go), the held lookup loads nothing of it, and nothing is counted as damage."""
    caches, original, store, engine = engine_on(tmp_path)
    async with engine:
        for user in (0, 1, 2):  # the host tier holds two users: user 0 only on SSD
            assert (await offload(engine, user)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "bytes_ssd_written", 3 * USER_PAGES * BLOCK)
        reads = held(monkeypatch, ssd_module.SsdTier, "_run",
                     lambda tier, request, *args: not request.is_write)
        try:
            hit = await engine.lookup(0, USER_PAGES * PAGE)
            assert hit.cached_tokens == USER_PAGES * PAGE
            await engine.evict(0)
            assert named_on_disk(tmp_path, 0) == 0
            reads.set()
            assert (await engine.load(hit, TARGET)).loaded_tokens == 0
        finally:
            reads.set()
        assert await load_back(engine, 0, TARGET) == 0
        await check_loads(engine, (1, 2), caches, original)
        assert store.store_stats()["checksum_failures"] == 0
    monkeypatch.undo()
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


@pytest.mark.asyncio
async def test_an_evict_voids_an_older_copy_of_the_key_a_restart_left_on_disk(
        tmp_path: Path) -> None:
    """Two headers of one block (a crash between a slot's reuse and the write that
    retires the old copy leaves them): the newer is served, and an evict voids both, so
    the older cannot come back at the next restart."""
    await write_users(tmp_path, 1)
    path = tmp_path / ssd_io.SUBDIR / ssd_format.DATA_NAME
    data = bytearray(path.read_bytes())
    head = ssd_format.unpack_header(bytes(data[:ssd_format.HEADER_BYTES]))
    assert head is not None
    spare = len(data) - SLOT  # the last slot: free
    data[spare : spare + SLOT] = data[:SLOT]  # the same block, one generation older
    ssd_format.pack_header(memoryview(data)[spare : spare + ssd_format.HEADER_BYTES],
                           head.epoch, head.generation - 1, head.data_sum, head.digest,
                           ssd_format.encode_namespace(head.namespace) or b"")
    path.write_bytes(bytes(data))
    assert named_on_disk(tmp_path, 0) == USER_PAGES + 1
    caches, original, _, engine = engine_on(tmp_path)
    async with engine:
        await check_loads(engine, (0,), caches, original)
        assert await engine.evict(0) == USER_PAGES * PAGE
    assert named_on_disk(tmp_path, 0) == 0


def snapshot(src: Path, dst: Path) -> Path:
    """The SSD files as a kill -9 right now would leave them (no lock file)."""
    (dst / ssd_io.SUBDIR).mkdir(parents=True)
    for name in (ssd_format.DATA_NAME, ssd_format.META_NAME):
        shutil.copy(src / ssd_io.SUBDIR / name, dst / ssd_io.SUBDIR / name)
    return dst


@pytest.mark.asyncio
async def test_an_evict_voids_the_half_of_a_write_that_landed_in_one_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two directories, the second's write lane slow: the first's half of user 0's write
    # has landed, naming the user, while the write as a whole has not ended.
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    gate = held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, k, *a: request.is_write and k == 1)
    _, _, _, engine = engine_on([str(d) for d in dirs], slots=64)
    try:
        async with engine:
            assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
            assert await asyncio.to_thread(gate.entered.wait, 10)
            for _ in range(500):
                if named_on_disk(dirs[0], 0) == USER_PAGES // 2:
                    break
                await asyncio.sleep(0.01)
            assert named_on_disk(dirs[0], 0) == USER_PAGES // 2
            assert await engine.evict(0) == USER_PAGES * PAGE
            left = [named_on_disk(d, 0) for d in dirs]
            for k, d in enumerate(dirs):
                snapshot(d, tmp_path / f"killed{k}")
            gate.set()
    finally:
        gate.set()
    assert left == [0, 0]
    _, _, _, engine = engine_on([str(tmp_path / f"killed{k}") for k in range(2)], slots=64)
    async with engine:  # a restart from what a kill -9 right after the evict left
        assert await load_back(engine, 0, TARGET) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("short", [False, True])
async def test_an_evict_voids_what_a_failed_write_left_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: bool) -> None:
    # The write's first slot lands, then the disk fails it (a short write, as ENOSPC on
    # a sparse file gives; ``short``: saying how far it got): its slots go back, the
    # landed header naming the user.
    real = ssd_io.SsdFiles.write
    fail = [True]

    def write(self: Any, k: int, offset: int, buffers: Any) -> None:
        if len(buffers) > 2 and fail[0]:  # a write of several slots
            fail[0] = False
            real(self, k, offset, buffers[:2])  # the first slot's header and bytes
            if short:
                raise ssd_io.ShortIO(errno.ENOSPC, "No space left on device",
                                     ssd_format.HEADER_BYTES + BLOCK)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, k, offset, buffers)

    monkeypatch.setattr(ssd_io.SsdFiles, "write", write)
    _, _, store, engine = engine_on(tmp_path)
    async with engine:
        assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
        await figure(store, "ssd_write_errors", 1)
        assert await engine.evict(0) == USER_PAGES * PAGE
        assert named_on_disk(tmp_path, 0) == 0
    monkeypatch.undo()
    _, _, _, engine = engine_on(tmp_path)
    async with engine:
        assert await load_back(engine, 0, TARGET) == 0


@pytest.mark.asyncio
async def test_an_evict_does_not_overtake_the_void_of_a_failed_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The failed write's void is queued behind the lane's writes; the evict's voids go
    # ahead of them. The evict must not answer while the failed write's landed header
    # still names the key (a kill -9 then, and a restart finds it).
    real = ssd_io.SsdFiles.write
    lane_free = threading.Event()
    fail = [True]

    def write(self: Any, k: int, offset: int, buffers: Any) -> None:
        if len(buffers) > 2 and fail[0]:
            fail[0] = False
            real(self, k, offset, buffers[:2])  # the first slot lands, naming the key
            self.submit(k, lambda: lane_free.wait(30), read=False)  # other work queued
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, k, offset, buffers)

    monkeypatch.setattr(ssd_io.SsdFiles, "write", write)
    # The failed write's own void (of no key) is slow once its turn comes.
    slow_void = held(monkeypatch, ssd_voids.HeaderVoids, "_void_one",
                     lambda voids, done, slot, only_if, key: key is None)
    _, _, store, engine = engine_on(tmp_path)
    try:
        async with engine:
            assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
            await figure(store, "ssd_write_errors", 1)
            # Its voids queued ahead of the failed write's while the lane is busy, seen
            # (a lane freed first ran the failed write's void, which held it until its
            # gate's timeout, and the key was voided whatever the evict did).
            queued = threading.Event()
            void = ssd_voids.HeaderVoids.void

            def voiding(voids: Any, *args: Any, **kwargs: Any) -> Any:
                done = void(voids, *args, **kwargs)
                if kwargs.get("front"):
                    queued.set()
                return done

            monkeypatch.setattr(ssd_voids.HeaderVoids, "void", voiding)
            evict = asyncio.ensure_future(engine.evict(0))
            assert await asyncio.to_thread(queued.wait, 30), "the evict queued no voids"
            lane_free.set()
            assert await evict == USER_PAGES * PAGE
            assert named_on_disk(tmp_path, 0) == 0
            slow_void.set()
    finally:
        lane_free.set()
        slow_void.set()


@pytest.mark.asyncio
async def test_a_store_closed_right_after_evicting_a_key_being_written_closes_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The key's SSD write is still queued (a slow disk) at the evict; the store closes
    # before it is applied: applying it voids its slots, after the SSD threads stopped.
    gate = held(monkeypatch, ssd_module.SsdTier, "_run",
                lambda tier, request, *a: request.is_write)
    _, _, store, engine = engine_on(tmp_path)
    timer = threading.Timer(0.5, gate.set)
    try:
        async with engine:
            assert (await offload(engine, 0)).stored_tokens == USER_PAGES * PAGE
            assert await engine.evict(0) == USER_PAGES * PAGE
            timer.start()  # the disk catches up while the close waits for it
    finally:
        gate.set()
    assert store._link is None and store._pool is None  # every part of the close ran
    assert named_on_disk(tmp_path, 0) == 0


def _store_put(store: aiokv.LocalStore, user: int) -> None:
    """``user``'s pages offloaded through the store's own calls, waited for. Its match
    waits (10 s at most) while the host tier's blocks are still being copied to SSD: the
    previous user's, on a busy box."""
    tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64) + 1000 * user
    for _ in range(2000):
        try:
            task, _ = store.put_match(tokens, [str(user)])
            break
        except NoSpace:
            store.try_wait([])
            time.sleep(0.005)
    else:
        raise AssertionError(f"user {user}'s put found no room in 10 s")
    store.launch([task], [source_pages(user)], [None])
    _store_wait(store, task)


def _settled(store: aiokv.LocalStore) -> None:
    """Until the host tier's blocks are all free or evictable (its SSD copies done), 10 s
    at most."""
    host = store._host
    assert host is not None
    for _ in range(2000):
        store.try_wait([])
        if host.available() == HOST_BLOCKS:
            return
        time.sleep(0.005)


def _store_wait(store: aiokv.LocalStore, task: int) -> Any:
    for _ in range(2000):
        answers = store.try_wait([task])
        if task in answers:
            return answers[task]
        time.sleep(0.005)
    raise AssertionError(f"task {task} never ended")


@pytest.mark.parametrize("how", ["evict", "clear"])
def test_a_load_waiting_for_host_room_at_an_evict_never_brings_the_key_back(
        tmp_path: Path, how: str) -> None:
    # Users 0 and 1 are on SSD only; user 0's lookup takes the room prefetches may have,
    # so user 1's waits, unstaged, when the key goes. Room comes back after: staging it
    # then would put the dropped pages into a live host table, where a put of the key
    # would find them (and its own blocks would be lost to the index).
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches_for())
    try:
        for user in range(4):
            _store_put(store, user)
        _settled(store)  # every SSD copy done: the host tier's blocks evictable
        tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
        first, _ = store.get_match(tokens + 0, ["0"])
        waiting, mask = store.get_match(tokens + 1000, ["1"])
        assert mask.all()
        assert store.evict(["1"]) if how == "evict" else store.clear()
        anew, mask = store.put_match(tokens + 1000, ["1"])  # the key written again
        assert mask.all()
        store.cancel([first])  # room: the waiting load may stage now
        store.launch([waiting], [TARGET], [None])
        assert not _store_wait(store, waiting).mask.any()  # nothing of the dropped key
        store.launch([anew], [source_pages(1)], [None])
        _store_wait(store, anew)
        again, mask = store.get_match(tokens + 1000, ["1"])
        assert mask.all()  # the new put's pages, all of them
        store.cancel([again])
        for user in (5, 6, 7, 8):  # others, which evict it from the host tier
            _store_put(store, user)
        _settled(store)
        assert store._host is not None
        assert store._host.available() == HOST_BLOCKS  # none lost (unlisted, never freed)
    finally:
        store.close()


def test_gets_launched_past_their_deadline_copy_nothing(tmp_path: Path) -> None:
    # One get wholly on the host, one of a user only the SSD tier has (read into the host
    # at its match): given a deadline already past, neither copies into its pages.
    caches = caches_for()
    store = aiokv.LocalStore(ssd_config(tmp_path))
    store.register(caches)
    try:
        for user in range(4):  # users 0 and 1 end up on SSD only
            _store_put(store, user)
        _settled(store)
        tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
        targets = [TARGET - USER_PAGES, TARGET]
        before = [[c[target].clone() for c in caches] for target in targets]

        def get_both(deadline: float | None) -> list[Any]:
            gets = [store.get_match(tokens + 1000 * user, [str(user)])[0] for user in (3, 0)]
            if deadline is not None:
                store.set_deadlines(gets, [deadline] * len(gets))
            store.launch(gets, targets, [None, None])
            return [_store_wait(store, task) for task in gets]

        late = get_both(time.monotonic() - 1.0)
        assert [r.status for r in late] == [aiokv.stores.TaskStatus.EXPIRED] * 2
        assert store.store_stats()["ssd_hit_tokens"] == USER_PAGES * PAGE  # user 0's
        assert all(torch.equal(c[target], b) for target, was in zip(targets, before, strict=True)
                   for c, b in zip(caches, was, strict=True))
        # What they held went back: the same gets, in time, load both whole.
        on_time = get_both(time.monotonic() + 60.0)
        assert [r.status for r in on_time] == [aiokv.stores.TaskStatus.SUCCESS] * 2
        assert same(caches, caches, targets[0], source_pages(3))
        assert same(caches, caches, targets[1], source_pages(0))
    finally:
        store.close()


async def only_on_ssd(config: aiokv.StoreConfig, users: tuple[int, ...]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``users`` offloaded by an engine that is then closed: a store opened on ``config``
    next finds them on the SSD only. Returns (the caches, a copy of their contents)."""
    caches = caches_for()
    original = [c.clone() for c in caches]
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches) as first:
        for user in users:
            await offload(first, user)
    return caches, original


@pytest.mark.asyncio
async def test_write_through_puts_whose_ssd_write_found_no_slot_are_on_ssd_after_a_restart(
    tmp_path: Path,
) -> None:
    # Every SSD slot held by lookups of keys only the SSD has (reopened): the next put's
    # write finds no slot and is skipped. The close must copy it down: the put completed,
    # and a restart must find it.
    config = ssd_config(tmp_path, slots=HOST_BLOCKS)  # write_through
    caches, original = await only_on_ssd(config, (0, 1))
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches) as again:
        hits = [await again.lookup(user, USER_PAGES * PAGE) for user in (0, 1)]
        try:
            assert [hit.cached_tokens for hit in hits] == [USER_PAGES * PAGE] * 2
            assert (await offload(again, 2)).stored_tokens == USER_PAGES * PAGE
            assert store.store_stats()["bytes_ssd_written"] == 0  # no slot for its copy
        finally:
            for hit in hits:
                hit.release()
    caches = [torch.zeros_like(c) for c in original]
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches) as reopened:
        assert await load_back(reopened, 2, TARGET) == USER_PAGES * PAGE
        assert same(caches, original, TARGET, source_pages(2))


@pytest.mark.asyncio
async def test_a_put_evicted_for_a_prefetch_while_another_lookups_reads_are_in_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, on a loaded host: user 0's lookup prefetched its SSD pages, and their reads
    # were not in when its release came. That release let user 1's lookup (still held)
    # stage its prefetch, whose room evicted user 2's put from the host; its copy down
    # found every SSD slot held (user 0's by those reads), and eviction dropped it: a
    # completed put, lost at the restart.
    config = ssd_config(tmp_path, slots=HOST_BLOCKS)  # write_through
    caches, original = await only_on_ssd(config, (0, 1))
    reads = held(monkeypatch, ssd_io.SsdFiles, "read")  # user 0's prefetch: a slow SSD
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches) as again:
        try:
            hits = [await again.lookup(user, USER_PAGES * PAGE) for user in (0, 1)]
            try:
                assert [hit.cached_tokens for hit in hits] == [USER_PAGES * PAGE] * 2
                assert (await offload(again, 2)).stored_tokens == USER_PAGES * PAGE
                assert store.store_stats()["bytes_ssd_written"] == 0  # no slot for its copy
            finally:
                for hit in hits:
                    hit.release()
            # A lookup after the releases: once answered, the store thread has taken them.
            assert (await again.lookup(3, USER_PAGES * PAGE)).cached_tokens == 0
        finally:
            reads.set()
    caches = [torch.zeros_like(c) for c in original]
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches) as reopened:
        assert await load_back(reopened, 2, TARGET) == USER_PAGES * PAGE
        assert same(caches, original, TARGET, source_pages(2))
    assert store.store_stats()["ssd_full_drops"] == 0  # nothing given up on the way


@pytest.mark.asyncio
async def test_a_put_evicted_by_a_put_while_a_released_lookups_reads_are_in_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every SSD slot held by lookups, user 0's by its prefetch's reads, still out when
    # its Lookup was released: user 3's put, evicting user 2's put (no SSD copy yet),
    # found no slot for its copy down and eviction dropped it, though those reads were
    # about to give theirs back. It now waits for them, and is copied down.
    config = ssd_config(tmp_path, slots=4 * USER_PAGES)  # write_through
    on_ssd = (0, 1, 4, 5)  # fill the SSD tier
    caches, original = await only_on_ssd(config, on_ssd)
    reads = held(monkeypatch, ssd_io.SsdFiles, "read")  # user 0's prefetch: a slow SSD
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches) as again:
        try:
            hits = [await again.lookup(user, USER_PAGES * PAGE) for user in on_ssd]
            try:
                assert [hit.cached_tokens for hit in hits] == [USER_PAGES * PAGE] * 4
                assert (await offload(again, 2)).stored_tokens == USER_PAGES * PAGE
                assert store.store_stats()["bytes_ssd_written"] == 0  # no slot for its copy
                hits[0].release()
                third = asyncio.ensure_future(offload(again, 3))
                # Until it waits for room (or, as before, evicted user 2 with no copy).
                deadline = asyncio.get_running_loop().time() + 30  # a hang's bound
                while not third.done() and again.stats().space_waits == 0:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
            finally:
                for hit in hits:
                    hit.release()
        finally:
            reads.set()
        assert (await third).stored_tokens == USER_PAGES * PAGE
    caches = [torch.zeros_like(c) for c in original]
    async with aiokv.OffloadEngine(aiokv.LocalStore(config), caches) as reopened:
        for user in (2, 3):
            assert await load_back(reopened, user, TARGET) == USER_PAGES * PAGE, user
            assert same(caches, original, TARGET, source_pages(user)), user
    assert store.store_stats()["ssd_full_drops"] == 0  # nothing given up on the way


SMALL = 512  # bytes a block of small_caches(): its SSD slot is 16 times that


def small_caches() -> list[torch.Tensor]:
    return [torch.randn(PAGES, 2, 4, 2, 4) for _ in range(LAYERS)]


@pytest.mark.asyncio
@pytest.mark.parametrize("dirs", [1, 3])
async def test_an_ssd_tier_of_fewer_slots_than_host_blocks_is_refused_naming_the_size_that_fits(
    tmp_path: Path, dirs: int
) -> None:
    # 1.5 times cpu_cache_gb held 46 slots (a 4 KiB header and a 4 KiB page each) for 500
    # host blocks: write_back's copies outgrew the SSD and every offload failed StoreFull.
    paths = [tmp_path / f"d{k}" for k in range(dirs)]
    for path in paths:
        path.mkdir()
    host = 500 * SMALL / (1 << 30)

    def config(gb: float) -> aiokv.StoreConfig:
        return aiokv.StoreConfig(cpu_cache_gb=host, ssd_cache_gb=gb,
                                 ssd_cache_dir=[str(p) for p in paths],
                                 ssd_write_policy="write_back")

    slots = -(-500 // dirs) * dirs  # each directory the same count
    need = slots * 2 * ssd_format.HEADER_BYTES / (1 << 30)
    for bad in (1.5 * host, need - 1 / (1 << 30)):  # one byte short: one slot short
        with pytest.raises(aiokv.ConfigError) as caught:
            aiokv.LocalStore(config(bad)).register(small_caches())
        assert caught.value.key == "store.ssd_cache_gb"
        assert f"{bad!r} GiB holds" in str(caught.value)
        assert f"fewer than the host tier's 500 blocks; set at least {need!r}" in str(
            caught.value)
    async with aiokv.OffloadEngine(aiokv.LocalStore(config(need)), small_caches()) as engine:
        assert engine.stats().ssd_blocks_total == slots


@pytest.mark.asyncio
async def test_write_back_puts_get_their_room_while_lookups_hold_most_ssd_slots(
    tmp_path: Path,
) -> None:
    # 14 of 16 SSD slots held. write_back copied 8 blocks ahead of eviction (the largest
    # put) in one all-or-nothing SSD write: none were written, and they went back to the
    # host LRU's oldest end, ahead of the blocks copied at eviction before them. Eviction
    # copied them in turn, taking the slots of those copies, which then had to be copied
    # again: a put of 2 new pages waited for room until StoreFull, round after round.
    config = ssd_config(tmp_path, slots=HOST_BLOCKS, ssd_write_policy="write_back")
    caches, original = await only_on_ssd(config, (0, 1))  # written down: every slot
    store = aiokv.LocalStore(config)
    async with aiokv.OffloadEngine(store, caches,
                                   aiokv.EngineConfig(request_timeout_ms=2000)) as engine:
        hits = [await engine.lookup(0, USER_PAGES * PAGE), await engine.lookup(1, 6 * PAGE)]
        try:
            assert [hit.cached_tokens for hit in hits] == [USER_PAGES * PAGE, 6 * PAGE]
            await offload(engine, 2)
            for key in range(100, 130):
                pages = torch.arange(2 * (key % 40), 2 * (key % 40) + 2)
                assert (await engine.offload(key, pages, 2 * PAGE)).stored_tokens == 2 * PAGE
        finally:
            for hit in hits:
                hit.release()
        pages = torch.arange(2 * (129 % 40), 2 * (129 % 40) + 2)
        hit = await engine.lookup(129, 2 * PAGE)
        assert (await engine.load(hit, TARGET[:2])).loaded_tokens == 2 * PAGE
        assert same(caches, original, TARGET[:2], pages)


def damage_meta(directory: Path, damage: str) -> None:
    meta = next(directory.rglob("meta.json"))
    if damage == "removed":
        meta.unlink()
        return
    raw = bytearray(meta.read_bytes())
    at = raw.index(b'"epoch": 1') + len(b'"epoch": ')
    raw[at] ^= 0x01  # "1" -> "0"
    meta.write_bytes(bytes(raw))


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["removed", "one bit flipped"])
async def test_a_lost_or_damaged_meta_file_never_brings_cleared_keys_back(
    tmp_path: Path, damage: str
) -> None:
    # The meta file holds the current epoch; read as older (a flipped bit) or missing
    # (epoch 0), the headers a clear dropped would be current again.
    generator = torch.Generator().manual_seed(9)
    kv = [torch.randn(64, 2, 16, 2, 16, generator=generator) for _ in range(2)]

    def engine(reset: bool = False) -> aiokv.OffloadEngine:
        config = aiokv.StoreConfig(cpu_cache_gb=0.0005, ssd_cache_gb=0.005,
                                   ssd_cache_dir=str(tmp_path), ssd_reset_on_mismatch=reset)
        return aiokv.OffloadEngine(aiokv.LocalStore(config), [c.clone() for c in kv])

    async with engine() as first:
        await first.offload(0, torch.arange(8), 128)
        await first.offload(1, torch.arange(8, 16), 128)
        await first.clear()
        await first.offload(2, torch.arange(16, 24), 128)  # reuses some cleared slots
    damage_meta(tmp_path, damage)
    if damage != "removed":
        with pytest.raises(aiokv.ConfigError, match=r"store\.ssd_cache_dir: .*checksum"):
            async with engine():
                pass
    async with engine(reset=damage != "removed") as again:
        for user in (0, 1):
            async with await again.lookup(user, 128) as hit:
                assert hit.cached_tokens == 0  # cleared: never back
