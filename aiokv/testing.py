"""Stores for tests, yours and ours: a fast fake, a contract checker, a fault injector.

Each wraps or implements the Store protocol, so it drops into ``OffloadEngine(store, ...)``
like any store (the seam httpx's MockTransport gives a client). Each lives in a
module of its own and is imported from here: the fakes in :mod:`aiokv.fakes`, the checker
in :mod:`aiokv.checking`, the fault injector in :mod:`aiokv.faults`, the wrappers' base in
:mod:`aiokv.stores.wrapper`; :class:`SharedStore`, the wrapper that lets several engines
drive one store, is here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .checking import CheckingStore
from .fakes import FakeStore, LayeredStore
from .faults import VERBS, FaultyStore, InjectedFault, no_space
from .stores.base import Store
from .stores.wrapper import StoreWrapper


class SharedStore(StoreWrapper):
    """Wraps a store so that several engines, one after another, can drive it (or an engine
    and code of your own, as the benchmarks do): it registers the inner store once and
    leaves closing it to its owner (``close_inner``)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._registered = False

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if not self._registered:
            self.inner.register(kv_caches)
            self._registered = True

    def closing(self) -> None:
        """Not passed on (stores.base.HearsOfClose): one engine's close is not the inner
        store's, which serves the next engine (a ProcessStore still restarts its child)."""

    def terminate(self) -> None:
        """Not passed on (stores.base.Terminates), as :meth:`closing`: the inner store
        is its owner's to end (a ProcessStore's own call bound still ends a hung child)."""

    def close(self) -> None:
        """Left to the owner: see :meth:`close_inner`."""

    def close_inner(self) -> None:
        self.inner.close()


__all__ = [
    "VERBS",
    "CheckingStore",
    "FakeStore",
    "FaultyStore",
    "InjectedFault",
    "LayeredStore",
    "SharedStore",
    "StoreWrapper",
    "no_space",
]
