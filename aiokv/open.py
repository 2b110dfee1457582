"""``aiokv.open_engine``: an engine from a YAML file, a mapping, or the packaged defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib.resources import as_file, files
from typing import Any

import torch

from .config import EngineConfig, StoreConfig, parse_config
from .config_file import load_config
from .engine import OffloadEngine
from .errors import ConfigError
from .stores import make_store

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | None

DEFAULT_CONFIG = "default.yml"  # package data; configs/default.yml is the same file


def default_config() -> tuple[EngineConfig, StoreConfig]:
    """The defaults shipped in the package (``aiokv/default.yml``)."""
    with as_file(files(__package__).joinpath(DEFAULT_CONFIG)) as path:
        return load_config(path)


def read_config(config: ConfigSource) -> tuple[EngineConfig, StoreConfig]:
    """Both configs from a YAML path, a mapping in the YAML's shape (``engine:`` and
    ``store:`` sections), or None for the packaged defaults. Raises ConfigError."""
    if config is None:
        return default_config()
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))
    if isinstance(config, Mapping):
        return parse_config(config)
    raise ConfigError(
        "config",
        f"must be a path, a mapping with engine/store sections, or None; got {config!r}",
    )


def open_engine(config: ConfigSource, kv_caches: Sequence[torch.Tensor]) -> OffloadEngine:
    """An engine over the store and settings of ``config`` (see :func:`read_config`):
    not started, so use ``async with engine`` or ``await engine.start()``. Raises
    ConfigError for a bad config, and what the store raises when it cannot be built."""
    engine_config, store_config = read_config(config)
    return OffloadEngine(make_store(store_config), kv_caches=kv_caches, config=engine_config)
