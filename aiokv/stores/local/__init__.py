"""aiokv's embedded store: index (block digests, LRU), pool (host blocks), transfer
(the copy thread) and store (LocalStore, the Store protocol over them)."""

from .store import LocalStore

__all__ = ["LocalStore"]
