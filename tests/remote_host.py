"""One "host" of the remote tier's tests, in a process of its own: an engine on the
embedded store with ``store.remote`` at the master given in argv[1], driven by JSON
lines on stdin (one answer line each on stdout). It shares nothing with the test's
process but Mooncake (:class:`ChildHost` starts it). Each user's KV is made from the user
id, so any host can check a load bit for bit. The geometry and the KV are those of
tests/shared_host.py too: a store server's engines and these hosts share keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import aiokv

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 64, 4, 2, 8


def user_kv(user: int, pages: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + user)
    return [torch.randn(pages, 2, PAGE_SIZE, HEADS, HEAD_DIM, generator=generator)
            for _ in range(LAYERS)]


class Host:
    def __init__(self, master: str) -> None:
        self.caches = [torch.zeros(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
        self.config = aiokv.StoreConfig(cpu_cache_gb=0.01, remote={"master": master})
        self.kv: Any = None
        self.open()

    def open(self) -> None:
        self.store = aiokv.LocalStore(self.config)
        engine = aiokv.OffloadEngine(self.store, self.caches, aiokv.EngineConfig())
        self.kv = aiokv.run_in_background(engine)

    def offload(self, user: int, pages: int) -> dict[str, Any]:
        for cache, kv in zip(self.caches, user_kv(user, pages), strict=True):
            cache[:pages] = kv
        result = self.kv.offload(user, torch.arange(pages), pages * PAGE_SIZE)
        return {"stored": result.stored_tokens}

    def load(self, user: int, pages: int) -> dict[str, Any]:
        target = torch.arange(PAGES - pages, PAGES)
        with self.kv.lookup(user, pages * PAGE_SIZE) as hit:
            cached = hit.cached_tokens
            loaded = self.kv.load(hit, target).loaded_tokens
        full = loaded // PAGE_SIZE
        exact = all(torch.equal(cache[PAGES - pages : PAGES - pages + full], kv[:full])
                    for cache, kv in zip(self.caches, user_kv(user, pages), strict=True))
        return {"cached": cached, "loaded": loaded, "exact": exact}

    def evict(self, user: int) -> dict[str, Any]:
        return {"dropped": self.kv.evict(user)}

    def restart(self) -> dict[str, Any]:
        """A fresh engine and store (an empty host tier): what a new host would see."""
        self.kv.close()
        self.open()
        return {}

    def stats(self) -> dict[str, Any]:
        return dict(self.store.store_stats())


class ChildHost:
    """tests/remote_host.py in a process of its own."""

    def __init__(self, master: str) -> None:
        # This process's path: the aiokv under test, wherever it is checked out.
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), master], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert self._answer() == {"ready": True}

    def _answer(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the child host exited with {self.process.wait()}")
        return json.loads(line)

    def __call__(self, op: str, **args: Any) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> dict[str, Any]:
        stats: dict[str, Any] = self("close")
        assert self.process.wait(30) == 0
        return stats


def main() -> None:
    host = Host(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "close":
            host.kv.close()
            print(json.dumps(host.stats()), flush=True)
            return
        print(json.dumps(getattr(host, op)(**command)), flush=True)


if __name__ == "__main__":
    main()
