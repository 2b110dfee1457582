"""An engine of the remote tier's tests in this process (:class:`LocalHost`): its own host
tier and Mooncake client, sharing nothing with other hosts but Mooncake. Its KV is
tests/remote_host.py's (the child host's), so either can check the other's loads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from remote_host import HEAD_DIM, HEADS, LAYERS, PAGE_SIZE, PAGES, user_kv

import aiokv
from aiokv.remote.servers import mooncake_closes_woken

USER_PAGES = 8
TOKENS = USER_PAGES * PAGE_SIZE


class LocalHost:
    """An engine in this process, with its own host tier and Mooncake client."""

    def __init__(self, master: str, dtype: torch.dtype = torch.float32,
                 head_dim: int = HEAD_DIM, cpu_cache_gb: float = 0.01,
                 ssd_dir: Path | None = None, engine: aiokv.EngineConfig | None = None,
                 device: str = "cpu", **remote: Any) -> None:
        self.head_dim = head_dim
        self.caches = [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, head_dim, dtype=dtype,
                                   device=device) for _ in range(LAYERS)]
        ssd = {} if ssd_dir is None else {"ssd_cache_gb": 0.1, "ssd_cache_dir": str(ssd_dir)}
        config = aiokv.StoreConfig(cpu_cache_gb=cpu_cache_gb, remote={"master": master, **remote},
                                   **ssd)
        self.store = aiokv.LocalStore(config)
        self.engine = aiokv.OffloadEngine(self.store, self.caches,
                                          engine or aiokv.EngineConfig())
        self.kv = aiokv.run_in_background(self.engine)

    def kv_of(self, user: int) -> list[torch.Tensor]:
        if self.head_dim == HEAD_DIM:
            return user_kv(user, USER_PAGES)  # as the child host makes them
        generator = torch.Generator().manual_seed(user)
        shape = (USER_PAGES, 2, PAGE_SIZE, HEADS, self.head_dim)
        return [torch.randn(shape, generator=generator) for _ in range(LAYERS)]

    def offload(self, user: int) -> int:
        for cache, kv in zip(self.caches, self.kv_of(user), strict=True):
            cache[:USER_PAGES] = kv
        stored: int = self.kv.offload(user, torch.arange(USER_PAGES), TOKENS).stored_tokens
        return stored

    def offload_to_mooncake(self, user: int) -> None:
        """The user's first offload on this host, and its blocks written to Mooncake."""
        assert self.offload(user) == TOKENS
        until(lambda: self.stats()["remote_blocks_written"] == USER_PAGES)

    def load(self, user: int) -> tuple[int, bool]:
        """(tokens loaded, whether they are the user's KV bit for bit)."""
        target = torch.arange(PAGES - USER_PAGES, PAGES)
        with self.kv.lookup(user, TOKENS) as hit:
            loaded: int = self.kv.load(hit, target).loaded_tokens
        full = loaded // PAGE_SIZE
        exact = all(
            torch.equal(cache[PAGES - USER_PAGES : PAGES - USER_PAGES + full].cpu(), kv[:full])
            for cache, kv in zip(self.caches, self.kv_of(user), strict=True)
        )
        return loaded, exact

    def stats(self) -> dict[str, Any]:
        return dict(self.store.store_stats())

    def close(self) -> dict[str, Any]:
        with mooncake_closes_woken():
            self.kv.close()
        return self.stats()


def close_woken(client: Any) -> None:
    """Closes a Mooncake client of the test's own (:func:`mooncake_closes_woken`)."""
    with mooncake_closes_woken():
        client.close()


def until(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    pause = 0.001  # most conditions hold within a few milliseconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
