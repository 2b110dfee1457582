"""The copy threads' two stream primitives (:mod:`.transfer`, :mod:`.ahead`): page ids
uploaded in stream order, and one copy queued on another stream. Called through this
module, so that tests can run the CUDA pipeline on the CPU by replacing them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..base import Int64Array


def to_device(pages: Int64Array, device: torch.device) -> torch.Tensor:
    """``pages`` on ``device``, queued on the current stream (the gather stream).

    Pinned first: to stage a copy from pageable memory, the driver may synchronize with
    the stream (CUDA's "API synchronization behavior"), and the gather stream holds the
    previous job's queued chunks: the copy thread would wait for them to drain, and the
    GPU would idle at the job boundary. From pinned memory the copy is queued like the
    rest (torch's pinned allocator keeps the buffer until it ran). On (and only used on)
    the gather stream, so the caching allocator cannot hand this memory out again before
    those kernels ran."""
    return torch.from_numpy(pages).pin_memory().to(device, non_blocking=True)


def on_stream(stream: Any, back: Any, copy: Callable[..., Any], source: torch.Tensor) -> None:
    """``copy(source, non_blocking=True)`` queued on ``stream``; then ``back`` is this
    thread's current stream again."""
    torch.cuda.set_stream(stream)
    try:
        copy(source, non_blocking=True)
    finally:
        torch.cuda.set_stream(back)
