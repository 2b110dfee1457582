"""How the mechanisms of ``copy_movers.py`` reach CUDA where torch does not: cuda.bindings'
runtime (mechanism c), and the driver itself through ctypes (d: ``cuMemcpyBatchAsync``;
e: the pinned pool's device address). Every call's result is checked; a failure raises
RuntimeError naming the call and the driver's error name.
"""

from __future__ import annotations

import ctypes
from typing import Any

# The batch call's pieces are aiokv's own (aiokv/copy/driver.py), as the store uses them.
from aiokv.copy.driver import (  # noqa: F401  (re-exported for copy_movers.py)
    CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    MemcpyAttributes,
    batch_entry,
)


def runtime() -> Any:
    """cuda.bindings' runtime module; ImportError names the package."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise ImportError(f"cuda.bindings is not importable ({exc}); pip install "
                          "cuda-bindings matching the driver") from exc
    return runtime


def _driver_call(name: str, *args: Any) -> None:
    """Call a driver function through ctypes; RuntimeError with the error's name if it
    fails."""
    lib = ctypes.CDLL("libcuda.so.1")
    err = getattr(lib, name)(*args)
    if err:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(text))
        raise RuntimeError(f"{name} failed: {(text.value or b'?').decode()} ({err})")


def device_address(host_pointer: int) -> int:
    """The pinned pool's address on the device (cuMemHostGetDevicePointer)."""
    address = ctypes.c_uint64(0)
    _driver_call("cuMemHostGetDevicePointer_v2", ctypes.byref(address),
                 ctypes.c_void_p(host_pointer), ctypes.c_uint(0))
    return address.value
