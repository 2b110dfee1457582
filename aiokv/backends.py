"""The store backends, one entry each: how to build one, whether it runs in a child process
by default, whether it can run here, and how a child's store gets the caches.

Entries name their code by ``"module:attribute"`` and import it only when asked (FlexKV is
imported only where it is used), so this module sits under config.py and imports nothing
of aiokv's stores. A new backend is one entry here and a module of its own:
``make_store``, :class:`~aiokv.stores.process.ProcessStore` and its child read the entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

# A Store and a StoreConfig (aiokv.stores.base, aiokv.config): named here by role only, so
# that this module stays below both.
Store = Any
StoreConfig = Any


class CacheHandover(Protocol):
    """How the caches, which stay in the parent process, reach a store built in a child.

    Parent: :meth:`payload` is what it sends with the config; on the child's ``attach``
    request it calls :meth:`attach` and keeps what that returns while the child lives,
    then hands it to :meth:`detach` once the child is gone.
    Child: :meth:`register` registers the store from the payload, and may ask the parent
    to attach once (``ask_parent(value)``; raises what the parent's attach raised)."""

    def payload(self, kv_caches: Sequence[torch.Tensor]) -> object: ...

    def attach(
        self, value: Any, kv_caches: Sequence[torch.Tensor], payload: Any
    ) -> tuple[object, list[str]]:
        """(what to keep alive, files to remove should the child die)."""
        ...

    def detach(self, kept: object) -> None:
        """Let go of what :meth:`attach` returned: the child has ended."""
        ...

    def register(self, store: Store, payload: Any, ask_parent: Callable[[object], None]) -> None:
        ...


class TensorHandover:
    """The caches themselves, through torch's multiprocessing reductions (shared memory for
    CPU tensors, CUDA IPC for GPU ones); the child's store registers them as usual."""

    def payload(self, kv_caches: Sequence[torch.Tensor]) -> object:
        return list(kv_caches)

    def attach(
        self, value: Any, kv_caches: Sequence[torch.Tensor], payload: Any
    ) -> tuple[object, list[str]]:
        raise ConfigError("store.backend", "this backend's child has nothing to attach")

    def detach(self, kept: object) -> None:
        pass  # attach never returns

    def register(self, store: Store, payload: Any, ask_parent: Callable[[object], None]) -> None:
        store.register(payload)


@dataclass(frozen=True)
class Backend:
    """One backend. ``store``: its Store class, built from the StoreConfig; ``own_process``:
    whether it runs in a child when ``StoreConfig.own_process`` is None; ``usable``: a
    function answering None, or why the backend cannot run here (``install`` says how to
    get it); ``handover``: a :class:`CacheHandover` for its child (default: tensors)."""

    name: str
    store: str
    own_process: bool = False
    usable: str | None = None
    install: str = ""
    handover: str | None = None

    def store_class(self) -> Callable[[StoreConfig], Store]:
        built: Callable[[StoreConfig], Store] = _load(self.store)
        return built

    def check_usable(self) -> None:
        """Raise ConfigError (store.backend) where this backend cannot run."""
        if self.usable is None:
            return
        reason = _load(self.usable)()
        if reason is not None:
            raise ConfigError(
                "store.backend", f"{self.name} is not usable here ({reason}). {self.install}"
            )

    def cache_handover(self) -> CacheHandover:
        if self.handover is None:
            return TensorHandover()
        handover: CacheHandover = _load(self.handover)
        return handover


BACKENDS: dict[str, Backend] = {
    "local": Backend("local", "aiokv.stores.local:LocalStore"),
    # The host's `aiokv store-server`: the index and tiers live there, the copies here.
    "shared": Backend("shared", "aiokv.stores.shared:SharedStore"),
    # FlexKV's Python (a finished batch's answers, a batch's launch) holds the GIL for long
    # stretches, and in the loop's process the loop waits for it: in a child only a round
    # trip per call is left to the loop's process.
    "flexkv": Backend(
        "flexkv",
        "aiokv.stores.flexkv:FlexKVStore",
        own_process=True,
        usable="aiokv.stores.flexkv:flexkv_available",
        install=(
            "FlexKV is not on PyPI: build it from source (github.com/taco-project/FlexKV, "
            "needs nvcc and a CUDA GPU) and `pip install` it into this environment, or use "
            "backend: local"
        ),
        handover="aiokv.stores.flexkv:HANDOVER",
    ),
}


def backend(name: str) -> Backend:
    """The entry for ``name``; ConfigError (store.backend) for an unknown one."""
    entry = BACKENDS.get(name)
    if entry is None:
        raise ConfigError("store.backend", f"must be one of {sorted(BACKENDS)}, got {name!r}")
    return entry


def _load(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)
