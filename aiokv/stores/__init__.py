"""Stores the engine can drive, and :func:`make_store` to pick one from a StoreConfig."""

from __future__ import annotations

from ..config import StoreConfig
from ..errors import ConfigError
from .base import NoSpace, Store, TaskResult, TaskStatus
from .local import LocalStore
from .process import ProcessStore


def make_store(config: StoreConfig) -> Store:
    """The store ``config.backend`` names, in a child process of its own where
    ``config.in_own_process()`` says so (by default, FlexKV). FlexKV is imported only
    when asked for."""
    if config.backend == "flexkv":
        _check_flexkv()
    if config.in_own_process():
        return ProcessStore(config)
    if config.backend == "local":
        return LocalStore(config)
    from .flexkv import FlexKVStore

    return FlexKVStore(config)


def _check_flexkv() -> None:
    from .flexkv import flexkv_available

    reason = flexkv_available()
    if reason is not None:
        raise ConfigError(
            "store.backend",
            f"flexkv is not usable here ({reason}). FlexKV is not on PyPI: build it from "
            "source (github.com/taco-project/FlexKV, needs nvcc and a CUDA GPU) and "
            "`pip install` it into this environment, or use backend: local",
        )


__all__ = [
    "LocalStore",
    "NoSpace",
    "ProcessStore",
    "Store",
    "TaskResult",
    "TaskStatus",
    "make_store",
]
