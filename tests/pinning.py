"""A host tier whose pinning is held or stops short (a memlock limit, simulated), for the
tests of a store that serves with the blocks pinned so far."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from aiokv.stores.local import hostmem
from aiokv.stores.local import pool as pool_module
from aiokv.stores.local.layout import block_stride


def pin_in_chunks(
    monkeypatch: pytest.MonkeyPatch, chunks: int, stop_at: int,
    reached: threading.Event | None = None, go_on: threading.Event | None = None,
    fails: bool = True,
) -> list[hostmem.HostMemory]:
    """Host tiers made from now on are pinned in ``chunks`` chunks (of a whole number of
    blocks), their mappings appended to the list returned. Registering chunk ``stop_at``
    (0 the first) sets ``reached``, waits for ``go_on`` (where given), then fails (the
    store serves with the chunks before it) or, ``fails=False``, succeeds (pinning was
    only held)."""
    memories: list[hostmem.HostMemory] = []

    def short(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
              pin: bool, trailer: bool = False) -> hostmem.HostMemory:
        registered: list[int] = []

        def register(address: int, size: int) -> None:
            if len(registered) == stop_at:
                if reached is not None:
                    reached.set()
                if go_on is not None:
                    go_on.wait(60)
                if fails:
                    raise RuntimeError("cudaHostRegister failed: 2 (a memlock limit, simulated)")
            registered.append(address)

        block = block_stride(math.prod(block_shape) * torch.empty(0, dtype=dtype).element_size(),
                             trailer)
        memories.append(hostmem.HostMemory(
            num_blocks, block_shape, dtype, True, trailer=trailer,
            chunk_bytes=max(1, num_blocks // chunks) * block,
            register=register, unregister=lambda address: None))
        return memories[-1]

    monkeypatch.setattr(pool_module, "HostMemory", short)
    return memories
