"""aiokv's embedded store: index (block digests, LRU), pool (host blocks), tiers, and
store (LocalStore, the Store protocol over them); its copies are :mod:`aiokv.copy`'s."""

from .store import LocalStore

__all__ = ["LocalStore"]
