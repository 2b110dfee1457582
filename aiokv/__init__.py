"""aiokv: an asyncio offload engine for paged GPU KV caches."""

from .config import EngineConfig, StoreConfig
from .config_file import load_config
from .engine import EngineState, OffloadEngine
from .errors import (
    AiokvError,
    BlockingCallOnLoop,
    ConfigError,
    EngineClosed,
    InvalidRequest,
    NotLoaded,
    Overloaded,
    RequestTimeout,
    StoreError,
    StoreFull,
    WrongLoop,
)
from .handles import BackgroundLayerwiseLoad, BackgroundLookup
from .layerwise import LayerwiseLoad
from .open import open_engine
from .requests import LoadResult, Lookup, OffloadResult
from .stats import EngineStats
from .stores.base import Store, TaskResult, TaskStatus
from .stores.local import LocalStore
from .stores.process import ProcessStore
from .sync import BackgroundEngine, run_in_background


def __getattr__(name: str) -> object:
    # FlexKVStore is imported lazily: `import aiokv` must work without flexkv.
    if name == "FlexKVStore":
        from .stores.flexkv import FlexKVStore

        return FlexKVStore
    raise AttributeError(f"module 'aiokv' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "AiokvError",
    "BackgroundEngine",
    "BackgroundLayerwiseLoad",
    "BackgroundLookup",
    "BlockingCallOnLoop",
    "ConfigError",
    "EngineClosed",
    "EngineConfig",
    "EngineState",
    "EngineStats",
    "FlexKVStore",
    "InvalidRequest",
    "LayerwiseLoad",
    "LoadResult",
    "LocalStore",
    "Lookup",
    "NotLoaded",
    "OffloadEngine",
    "OffloadResult",
    "Overloaded",
    "ProcessStore",
    "RequestTimeout",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreFull",
    "TaskResult",
    "TaskStatus",
    "WrongLoop",
    "load_config",
    "open_engine",
    "run_in_background",
]
