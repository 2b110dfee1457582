"""FlexKV as an aiokv store: :class:`FlexKVStore` (the adapter, store.py) and its start-up
(setup.py)."""

from .setup import HANDOVER, CacheGeometry, attach_caches, flexkv_available
from .store import FlexKVStore

__all__ = ["HANDOVER", "CacheGeometry", "FlexKVStore", "attach_caches", "flexkv_available"]
