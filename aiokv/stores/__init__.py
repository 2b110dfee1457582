"""Stores the engine can drive, and :func:`make_store` to pick one from a StoreConfig."""

from __future__ import annotations

from ..backends import backend
from ..config import StoreConfig
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
