"""Stores the engine can drive, and :func:`make_store` to pick one from a StoreConfig."""

from __future__ import annotations

from ..backends import backend
from ..config import StoreConfig
from ..errors import ConfigError
from .base import NoSpace, Store, TaskResult, TaskStatus, TooLarge
from .local import LocalStore
from .process import ProcessStore


def make_store(config: StoreConfig) -> Store:
    """The store ``config.backend`` names (:data:`aiokv.backends.BACKENDS`), in a child
    process of its own where ``config.in_own_process()`` says so. A backend's code is
    imported only when asked for; one that cannot run here is a ConfigError."""
    entry = backend(config.backend)
    entry.check_usable()
    if config.in_own_process():
        return ProcessStore(config)
    if config.store_restarts != StoreConfig.store_restarts:
        # Nothing would read it: a store in this process is never started again.
        raise ConfigError("store.store_restarts", f"is for a store in a process of its own "
                          f"(own_process: true; backend {config.backend} runs in this one "
                          f"here), got {config.store_restarts!r}")
    store: Store = entry.store_class()(config)
    return store


__all__ = [
    "LocalStore",
    "NoSpace",
    "ProcessStore",
    "Store",
    "TaskResult",
    "TaskStatus",
    "TooLarge",
    "make_store",
]
