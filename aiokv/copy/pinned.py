"""Pinned host memory that kernels write: a device view of it (unified addressing), the
one-time probe of whether a device can write it, and the buffers held until the kernels
that write them are done (torch's pinned allocator tracks copies, not kernels' writes).
:mod:`.fused` writes page ids there (a FlexKV launch's, a store process's, and the copier's
while offloads are in flight), so that they do not queue behind a large device-to-host
copy in the copy engines.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger("aiokv")


class _DeviceArray:
    """A pinned host tensor presented to torch as a CUDA array. With unified addressing
    (every 64-bit CUDA platform), pinned memory is mapped into each device's address
    space at its host address, so a device tensor over that address is the host memory:
    what kernels write there, the host reads after the kernels' event."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # keeps the memory alive as long as the device view is
        typestr = {torch.int64: "<i8", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def as_device_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the memory of the pinned, contiguous ``host``."""
    view = torch.as_tensor(_DeviceArray(host), device=device)
    if view.data_ptr() != host.data_ptr():  # torch copied instead of aliasing
        raise RuntimeError("the device view of pinned memory is not the same memory")
    return view


_WRITES_HOST: dict[torch.device, bool] = {}


def writes_host(device: torch.device) -> bool:
    """Whether kernels on ``device`` can write pinned memory through
    :func:`as_device_tensor`, tried once per device: a kernel writes a pattern there and
    the host reads it back. Where not (or on any error), copies are used instead.

    Torch's default pinned allocator uses ``cudaHostAlloc``, whose memory every device
    with unified addressing reaches at its host address (CUDA programming guide,
    "Unified Virtual Address Space")."""
    known = _WRITES_HOST.get(device)
    if known is not None:
        return known
    if "pinned_use_cuda_host_register" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # Pinned memory is then malloc'd and registered, which maps it into the device's
        # address space only when asked to: a kernel's write could fault the context.
        _WRITES_HOST[device] = False
        return False
    try:
        host = torch.zeros(1024, dtype=torch.int64, pin_memory=True)
        pattern = torch.arange(7, 7 + 1024, dtype=torch.int64, device=device)
        torch.add(pattern, 0, out=as_device_tensor(host, device))
        torch.cuda.current_stream(device).synchronize()
        works = bool(torch.equal(host, pattern.cpu()))
    except Exception:
        works = False
    if not works:
        log.warning("aiokv: kernels cannot write pinned memory on %s; fused slots are "
                    "copied instead, behind any copy already queued", device)
    _WRITES_HOST[device] = works
    return works


class _HeldUntilDone:
    """Pinned buffers that kernels write, each held until its event fired. Pruned on
    every :meth:`hold` (one event query per held buffer that is done, oldest first)."""

    def __init__(self) -> None:
        self._held: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._lock = threading.Lock()  # the store thread and a warm-up thread may both hold

    def hold(self, event: Any, memory: torch.Tensor) -> None:
        with self._lock:
            held = self._held
            while held and held[0][0].query():
                held.popleft()
            held.append((event, memory))


HOST_WRITES = _HeldUntilDone()
