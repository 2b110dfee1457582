"""FlexKV as an aiokv store: :class:`FlexKVStore` (the adapter, store.py), its start-up
(setup.py) and how a child process gets the caches (handover.py)."""

from .handover import HANDOVER
from .setup import CacheGeometry, attach_caches, flexkv_available
from .store import FlexKVStore

__all__ = ["HANDOVER", "CacheGeometry", "FlexKVStore", "attach_caches", "flexkv_available"]
