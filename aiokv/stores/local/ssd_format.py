"""The SSD tier's on-disk format: self-describing slots and one meta file per directory.

Design, and why: each slot holds one block, a 4 KiB header then the block's bytes. The
header names the block (namespace, 128-bit chained digest, which covers the whole prefix
up to the block, so no parent link is needed), its xxh3-64 checksum, the directory's
epoch and a generation number, and ends with a checksum of its own. Reopening scans the
headers once (4 KiB per slot) and rebuilds the index; there is no separate index file to
keep in step with the data, so no write ordering between two files can be got wrong, and
a kill -9 at any point leaves only slots that are either intact or fail a checksum:

- a torn header fails its own checksum and the slot is free at the next open;
- a header written without all its data (or the reverse) fails the data checksum, which
  is verified on every read: the block is a miss, never data;
- a slot reused for another block is named by its newest header; when two slots name
  one block, the higher generation wins.

The LRU order a clean close saves beside the meta file (:mod:`.ssd_recency`) only ranks
what the headers name, and only where it matches them exactly: it is no index.

``clear`` bumps the epoch in the meta file (written atomically: a temporary file, fsync,
rename), which voids every older header at once; ``evict`` zeroes the headers of the
slots it frees. The meta file also records the geometry (layers, the block's shape,
dtype, page size) and the striping, and a directory written with another is refused
unless ``ssd_reset_on_mismatch``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ...errors import ConfigError

HEADER_BYTES = 4096
MAGIC = b"AIOKVBLK"
FORMAT = 1
META_NAME = "meta.json"
DATA_NAME = "blocks.dat"
# magic, format, epoch, generation, data checksum, digest, namespace length
_FIXED = struct.Struct("<8sIIQQ16sI")
MAX_NAMESPACE_BYTES = HEADER_BYTES - _FIXED.size - 8
EMPTY_HEADER = bytes(HEADER_BYTES)


def checksum(data: Any) -> int:
    """The block checksum (xxh3-64 of the bytes)."""
    return xxhash.xxh3_64_intdigest(data)


def encode_namespace(namespace: tuple[str, ...]) -> bytes | None:
    """The namespace as stored, or None when it does not fit in a header."""
    raw = json.dumps(list(namespace), separators=(",", ":")).encode()
    return raw if len(raw) <= MAX_NAMESPACE_BYTES else None


def pack_header(
    into: memoryview, epoch: int, generation: int, data_sum: int, digest: bytes, ns: bytes
) -> None:
    """Write one header into ``into`` (HEADER_BYTES, zeroed past the namespace)."""
    _FIXED.pack_into(into, 0, MAGIC, FORMAT, epoch, generation, data_sum, digest, len(ns))
    end = _FIXED.size + len(ns)
    into[_FIXED.size : end] = ns
    into[end : HEADER_BYTES - 8] = bytes(HEADER_BYTES - 8 - end)
    struct.pack_into("<Q", into, HEADER_BYTES - 8, checksum(into[: HEADER_BYTES - 8]))


@dataclass(frozen=True, slots=True)
class Header:
    epoch: int
    generation: int
    data_sum: int
    digest: bytes
    namespace: tuple[str, ...]


def unpack_header(raw: memoryview | bytes) -> Header | None:
    """The header in ``raw``, or None when it is empty, torn or not ours."""
    if raw[:8] != MAGIC:
        return None
    (stored,) = struct.unpack_from("<Q", raw, HEADER_BYTES - 8)
    if checksum(raw[: HEADER_BYTES - 8]) != stored:
        return None
    _, fmt, epoch, generation, data_sum, digest, ns_len = _FIXED.unpack_from(raw, 0)
    if fmt != FORMAT or ns_len > MAX_NAMESPACE_BYTES:
        return None
    try:
        namespace = json.loads(bytes(raw[_FIXED.size : _FIXED.size + ns_len]))
    except ValueError:
        return None
    return Header(epoch, generation, data_sum, bytes(digest), tuple(map(str, namespace)))


@dataclass(frozen=True, slots=True)
class Meta:
    geometry: dict[str, Any]  # layers, block_shape, dtype, page_size, slot_bytes
    stripe: tuple[int, int]  # (this directory's index, number of directories)
    slots: int  # slots in this directory's data file
    epoch: int

    def to_json(self) -> str:
        fields = {
            "format": FORMAT,
            "geometry": self.geometry,
            "stripe": list(self.stripe),
            "slots": self.slots,
            "epoch": self.epoch,
        }
        return json.dumps({**fields, "checksum": _meta_sum(fields)}, indent=1)


def _meta_sum(fields: dict[str, Any]) -> int:
    """crc32 of the meta's fields: a bit flipped in its epoch would otherwise read as an
    older epoch, under which blocks a clear dropped are current again."""
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def read_meta(directory: Path) -> Meta | None:
    """The directory's meta file; None when there is none (a new directory)."""
    path = directory / META_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}")
        fields = {k: v for k, v in raw.items() if k != "checksum"}
        if "checksum" in raw and raw["checksum"] != _meta_sum(fields):  # older files: none
            raise ValueError("its checksum does not match its contents")
        geometry, stripe = raw["geometry"], tuple(raw["stripe"])
        if not isinstance(geometry, dict) or len(stripe) != 2:
            raise ValueError(f"geometry {geometry!r}, stripe {list(stripe)!r}")
        return Meta(geometry, (int(stripe[0]), int(stripe[1])), int(raw["slots"]),
                    int(raw["epoch"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            "store.ssd_cache_dir",
            f"{str(path)!r} is unreadable or not aiokv's ({exc!r}); remove it, or set "
            "ssd_reset_on_mismatch: true",
        ) from exc


def write_meta(directory: Path, meta: Meta) -> None:
    """Replace the meta file atomically (and durably: fsync of file and directory)."""
    replace_durably(directory, META_NAME, meta.to_json().encode())


def replace_durably(directory: Path, name: str, data: bytes) -> None:
    """Replace ``directory / name`` with ``data`` atomically: a temporary file, fsync,
    rename, then fsync of the directory, so that a crash leaves the old file or the new
    one, whole."""
    tmp = directory / (name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it whole, except past 2 GiB a call
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / name)
    sync_directory(directory)


def sync_directory(directory: Path) -> None:
    """fsync a directory: a rename or an unlink in it is durable once this returns."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse a directory fsync
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def geometry_difference(stored: Meta, wanted: Meta) -> str:
    """What differs between a directory's meta and this store's, or "" for nothing."""
    parts = [
        f"{key} {stored.geometry.get(key)!r} != {value!r}"
        for key, value in wanted.geometry.items()
        if stored.geometry.get(key) != value
    ]
    if tuple(stored.stripe) != wanted.stripe:
        parts.append(f"directory {stored.stripe[0]} of {stored.stripe[1]} != "
                     f"{wanted.stripe[0]} of {wanted.stripe[1]}")
    return "; ".join(parts)
