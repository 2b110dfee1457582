"""aiokv's tier keys (``store:`` cpu_cache_gb, ssd_cache_gb, ssd_cache_dir,
ssd_write_policy) as FlexKV's own user-config keys, and the checks FlexKV does not make.

- ``ssd_cache_dir``, in any of its three forms (one directory, a list, FlexKV's
  ``;``-separated string), becomes FlexKV's list of directories. FlexKV spreads the SSD
  blocks evenly over them (one "SSD device" each, its files
  ``flexkv_ssd_cache_<dir>_<file>.bin``), so several directories on several disks share
  every request.
- ``ssd_write_policy``: FlexKV writes every put through to its SSD tier (it has no
  write-back mode), so ``write_through`` is the only policy it takes; ``write_back`` is a
  ConfigError naming the key.
- FlexKV's server-client client logs an error for each task a ``wait`` answers TIMEOUT;
  polled with ``timeout=0.0`` (store.py), that is every unfinished task at every poll:
  :func:`quiet_wait_timeouts` filters those lines out.
- The directories must exist and be writable, and their filesystems must have room for
  ``ssd_cache_gb`` (FlexKV would create missing directories and fail, at run time, on a
  full disk). FlexKV truncates its files at start: its SSD tier starts empty every time.

StoreConfig gains ``ssd_write_policy`` and list-valued ``ssd_cache_dir`` with the SSD
tier of the local store; until then they are read with their defaults (getattr).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from ..dirlock import require_directory

_GIB = 1 << 30
_FILES = "flexkv_ssd_cache_*.bin"  # FlexKV's SSD files (storage/allocator.py)


def ssd_dirs(config: Any, fallback: object = None) -> list[str]:
    """``config.ssd_cache_dir`` (else ``fallback``, the ``flexkv:`` mapping's) as a list
    of directories: one path, a list of them, or a ``;``-separated string."""
    dirs = getattr(config, "ssd_dirs", None)
    if callable(dirs) and config.ssd_cache_dir:
        return list(dirs())
    value: Any = config.ssd_cache_dir or fallback
    if value is None:
        return []
    parts = value.split(";") if isinstance(value, str) else [os.fspath(v) for v in value]
    return [part.strip() for part in parts if part.strip()]


def tier_values(config: Any, flexkv_dir: object = None) -> dict[str, Any]:
    """FlexKV's UserConfig tier keys for a StoreConfig: cpu_cache_gb, ssd_cache_gb and
    ssd_cache_dir (a list). ConfigError for what FlexKV cannot do."""
    policy = getattr(config, "ssd_write_policy", "write_through")
    if policy != "write_through":
        raise ConfigError(
            "store.ssd_write_policy",
            f"backend flexkv writes every put through to SSD and has no {policy!r} mode; "
            "use write_through, or backend: local",
        )
    values: dict[str, Any] = {
        "cpu_cache_gb": config.cpu_cache_gb,
        "ssd_cache_gb": config.ssd_cache_gb,
    }
    dirs = ssd_dirs(config, flexkv_dir)
    if config.ssd_cache_gb > 0 and not dirs:
        raise ConfigError("store.ssd_cache_dir", "is required when ssd_cache_gb > 0")
    # FlexKV needs a list even without an SSD tier (it counts the entries).
    values["ssd_cache_dir"] = dirs or ["./flexkv_ssd"]
    return values


def check_ssd_dirs(dirs: Sequence[str], ssd_cache_gb: float) -> None:
    """Each directory exists and is writable, and each filesystem has room for its
    directories' share of ``ssd_cache_gb`` (FlexKV's files there are recreated, so they
    count as room). ConfigError naming the key otherwise. File I/O: not on the loop."""
    need: dict[int, float] = {}  # st_dev -> bytes
    free: dict[int, float] = {}
    for directory in dirs:
        require_directory(directory, "store.ssd_cache_dir")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError("store.ssd_cache_dir", f"{directory!r} is not writable")
        device = os.stat(directory).st_dev
        need[device] = need.get(device, 0.0) + ssd_cache_gb * _GIB / len(dirs)
        if device not in free:
            free[device] = float(shutil.disk_usage(directory).free)
        for path in glob.glob(os.path.join(glob.escape(directory), _FILES)):
            free[device] += os.stat(path).st_blocks * 512  # truncated by FlexKV at start
    for device, wanted in need.items():
        if wanted > free[device]:
            on = [d for d in dirs if os.stat(d).st_dev == device]
            raise ConfigError(
                "store.ssd_cache_gb",
                f"{ssd_cache_gb} GiB puts {wanted / _GIB:.2f} GiB on the filesystem of "
                f"{', '.join(on)}, which has {free[device] / _GIB:.2f} GiB free",
            )


class _NoWaitTimeouts(logging.Filter):
    """Drops the error FlexKV's server-client client logs for every task a ``wait``
    answers TIMEOUT: with ``timeout=0.0`` that answer means "not done yet", every poll."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("wait task ") and message.endswith("TIMEOUT"))


def quiet_wait_timeouts() -> None:
    """Install :class:`_NoWaitTimeouts` on FlexKV's logger (once)."""
    from flexkv.common.debug import flexkv_logger

    target = getattr(flexkv_logger, "logger", None)
    if isinstance(target, logging.Logger) and not any(
        isinstance(f, _NoWaitTimeouts) for f in target.filters
    ):
        target.addFilter(_NoWaitTimeouts())
