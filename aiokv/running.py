"""How aiokv's commands run: on which device (``auto`` is the GPU when there is one) and
under which event loop (uvloop where installed). Shared by the demo and the benchmarks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def pick_device(name: str) -> torch.device:
    """``auto`` is the GPU when there is one. Raises SystemExit for ``cuda`` without one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


def run_uvloop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` under uvloop, the loop serving stacks use (asyncio's where uvloop is
    not installed, e.g. on Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result
