"""How FlexKV in ProcessStore's child gets the caches, which stay in the parent process
(the backend's :class:`~aiokv.backends.CacheHandover`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..base import Store
from .setup import CacheGeometry, attach_caches, close_client
from .store import FlexKVStore


class FlexKVHandover:
    """How FlexKV in ProcessStore's child gets the caches (aiokv.backends): the child
    starts FlexKV from the caches' geometry, the parent (their owner) registers them by
    CUDA IPC (:func:`attach_caches`), then the child waits until FlexKV is ready."""

    def payload(self, kv_caches: Sequence[torch.Tensor]) -> object:
        return CacheGeometry.of(kv_caches)

    def attach(
        self, value: Any, kv_caches: Sequence[torch.Tensor], payload: Any
    ) -> tuple[object, list[str]]:
        endpoint, socket_files = value
        return attach_caches(endpoint, kv_caches, payload), list(socket_files)

    def detach(self, kept: object) -> None:
        close_client(kept)

    def register(self, store: Store, payload: Any, ask_parent: Callable[[object], None]) -> None:
        if not isinstance(store, FlexKVStore) or not isinstance(payload, CacheGeometry):
            raise TypeError(f"FlexKV's handover got {type(store).__name__}, {payload!r}")
        store.start(payload)
        try:
            ask_parent((store.gpu_register_endpoint, store.socket_files))
        except BaseException:
            store.close()
            raise
        store.wait_attached()


HANDOVER = FlexKVHandover()
