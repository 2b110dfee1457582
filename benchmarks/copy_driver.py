"""How the mechanisms of ``copy_movers.py`` reach CUDA where torch does not: cuda.bindings'
runtime (mechanism c), and the driver itself through ctypes (d: ``cuMemcpyBatchAsync``;
e: the pinned pool's device address). Every call's result is checked; a failure raises
RuntimeError naming the call and the driver's error name.
"""

from __future__ import annotations

import ctypes
from typing import Any

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # a hint: keep the copies off the SMs


def runtime() -> Any:
    """cuda.bindings' runtime module; ImportError names the package."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise ImportError(f"cuda.bindings is not importable ({exc}); pip install "
                          "cuda-bindings matching the driver") from exc
    return runtime


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (cuda.h, 12.8+)
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


# cuMemcpyBatchAsync as of CUDA 12.8 (asked for by that version, so a CUDA 13 driver hands
# out this signature, with failIdx): dsts, srcs, sizes, count, attrs, attrsIdxs,
# numAttrs, failIdx, stream.
_BATCH_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
)


def _libcuda() -> Any:
    """The CUDA driver library, through ctypes (always there where a GPU is)."""
    return ctypes.CDLL("libcuda.so.1")


def _driver_call(name: str, *args: Any) -> None:
    """Call a driver function through ctypes; RuntimeError with the error's name if it
    fails."""
    lib = _libcuda()
    err = getattr(lib, name)(*args)
    if err:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(text))
        raise RuntimeError(f"{name} failed: {(text.value or b'?').decode()} ({err})")


def batch_entry() -> tuple[Any, str | None]:
    """(cuMemcpyBatchAsync as a ctypes function, None), or (None, why not). Found with
    the driver's cuGetProcAddress (through ctypes, else through cuda.bindings), asking
    for the 12.8 signature."""
    try:
        version = ctypes.c_int(0)
        _driver_call("cuDriverGetVersion", ctypes.byref(version))
    except (OSError, AttributeError, RuntimeError) as exc:
        return None, f"no CUDA driver to ask: {exc}"
    if version.value < 12080:
        return None, (f"the driver is CUDA {version.value // 1000}.{version.value % 1000 // 10}"
                      "; cuMemcpyBatchAsync needs 12.8+")
    try:
        address, status = ctypes.c_void_p(0), ctypes.c_int(0)
        _driver_call("cuGetProcAddress_v2", b"cuMemcpyBatchAsync", ctypes.byref(address),
                     ctypes.c_int(12080), ctypes.c_uint64(0), ctypes.byref(status))
        found, why = address.value or 0, f"symbol status {status.value}"
    except (AttributeError, RuntimeError) as exc:
        found, why = _entry_through_bindings(exc)
    if not found:
        return None, f"cuMemcpyBatchAsync not found ({why})"
    return _BATCH_SIGNATURE(found), None


def _entry_through_bindings(first: Exception) -> tuple[int, str]:
    """cuda.bindings' cuGetProcAddress, where the driver's through ctypes failed."""
    try:
        from cuda.bindings import driver

        found = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
    except Exception as exc:
        return 0, f"through ctypes: {first}; through cuda.bindings: {exc!r}"
    if found[0] != driver.CUresult.CUDA_SUCCESS:
        return 0, f"through ctypes: {first}; through cuda.bindings: {found!r}"
    return int(found[1]), ""


def device_address(host_pointer: int) -> int:
    """The pinned pool's address on the device (cuMemHostGetDevicePointer)."""
    address = ctypes.c_uint64(0)
    _driver_call("cuMemHostGetDevicePointer_v2", ctypes.byref(address),
                 ctypes.c_void_p(host_pointer), ctypes.c_uint(0))
    return address.value
