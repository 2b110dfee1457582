"""The CUDA driver's ``cuMemcpyBatchAsync`` (CUDA 12.8+) through ctypes: many copies, each
its own (destination, source, size), queued on one stream in one call, run by the copy
engines (no kernel, no SM of the model's).

Found with the driver's ``cuGetProcAddress`` asking for the 12.8 signature, so that a
CUDA 13 driver hands out that one too. A ctypes call releases the GIL while the driver
queues the copies; the arrays it reads are numpy arrays the caller keeps until the call
returned (the driver copies the descriptors before it returns). :func:`batch_entry`
answers why not where the driver lacks it; the copier then falls back to one torch copy
per (page, layer) and says so once. :class:`StridedCopy` is ``cuMemcpy2DAsync``: one copy
of rows a pitch apart on each side, for runs of adjacent pages.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import numpy as np

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
# A hint: prefer the copy engines, keep the copies off the SMs the model computes on.
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_MIN_DRIVER = 12080
_NO_FAILURE = 2**64 - 1  # failIdx's value while no copy failed


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (cuda.h, 12.8+)
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


# dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream (the 12.8 ABI).
BATCH_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
)


class Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D (cuda.h)
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_uint), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_uint), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


# Both sides as unified addresses: device memory, and host memory pinned or registered
# with CUDA (which unified addressing maps), told apart by the driver.
CU_MEMORYTYPE_UNIFIED = 4


class DriverError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


def libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def error_name(lib: Any, err: int) -> str:
    text = ctypes.c_char_p()
    try:
        lib.cuGetErrorName(err, ctypes.byref(text))
    except (AttributeError, OSError):
        return str(err)
    return f"{(text.value or b'?').decode()} ({err})"


def _call(lib: Any, name: str, *args: Any) -> None:
    err = getattr(lib, name)(*args)
    if err:
        raise DriverError(f"{name} failed: {error_name(lib, err)}")


@functools.cache
def batch_entry() -> tuple[Any, str | None]:
    """(cuMemcpyBatchAsync as a ctypes function, None), or (None, why it is absent)."""
    try:
        lib = libcuda()
        version = ctypes.c_int(0)
        _call(lib, "cuDriverGetVersion", ctypes.byref(version))
    except (OSError, AttributeError, DriverError) as exc:
        return None, f"no CUDA driver to ask ({exc})"
    if version.value < _MIN_DRIVER:
        major, minor = version.value // 1000, version.value % 1000 // 10
        return None, f"the driver is CUDA {major}.{minor}; cuMemcpyBatchAsync needs 12.8+"
    address, status = ctypes.c_void_p(0), ctypes.c_int(0)
    try:
        _call(lib, "cuGetProcAddress_v2", b"cuMemcpyBatchAsync", ctypes.byref(address),
              ctypes.c_int(_MIN_DRIVER), ctypes.c_uint64(0), ctypes.byref(status))
    except (AttributeError, DriverError) as exc:
        return None, f"cuGetProcAddress_v2 could not be asked ({exc})"
    if not address.value:
        return None, f"cuMemcpyBatchAsync not found (symbol status {status.value})"
    return BATCH_SIGNATURE(address.value), None


def copy_attributes() -> MemcpyAttributes:
    """The attributes of every batched copy: its source read in stream order (after what
    the stream waited for), on the copy engines rather than the SMs."""
    return MemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                            flags=CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)


class BatchCopy:
    """One stream's ``cuMemcpyBatchAsync`` calls. Made on the thread that calls it, after
    that thread has made the device's context current (any CUDA runtime call does)."""

    def __init__(self) -> None:
        call, why = batch_entry()
        if call is None:
            raise DriverError(why or "cuMemcpyBatchAsync is absent")
        self._call = call
        self._lib = libcuda()
        self._attrs = copy_attributes()
        self._attr_index = ctypes.c_size_t(0)
        self._fail_index = ctypes.c_size_t(0)

    def __call__(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        """Queue ``len(sizes)`` copies on ``stream`` (a CUstream handle); the arrays are
        contiguous uint64. DriverError names the first copy that failed."""
        count = len(sizes)
        if not count:
            return
        self._fail_index.value = _NO_FAILURE
        err = self._call(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
            ctypes.byref(self._attrs), ctypes.byref(self._attr_index), 1,
            ctypes.byref(self._fail_index), stream,
        )
        if err:
            failed = self._fail_index.value
            where = "" if failed == _NO_FAILURE else f", copy {failed}"
            if failed < count:
                where += (f": {int(sizes[failed])} bytes from {int(srcs[failed]):#x} to "
                          f"{int(dsts[failed]):#x}")
            raise DriverError(
                f"cuMemcpyBatchAsync of {count} copies failed: "
                f"{error_name(self._lib, err)}{where}"
            )


class StridedCopy:
    """One stream's ``cuMemcpy2DAsync`` calls (any CUDA driver). Made on the thread that
    calls it, after that thread has made the device's context current."""

    def __init__(self) -> None:
        try:
            self._lib = libcuda()
            self._call = self._lib.cuMemcpy2DAsync_v2
        except (OSError, AttributeError) as exc:
            raise DriverError(f"cuMemcpy2DAsync_v2 is absent ({exc})") from exc
        self._call.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
        self._op = Memcpy2D(srcMemoryType=CU_MEMORYTYPE_UNIFIED,
                            dstMemoryType=CU_MEMORYTYPE_UNIFIED)

    def __call__(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
        stream: int,
    ) -> None:
        """Queue ``height`` rows of ``width`` bytes, ``src + i * src_pitch`` to ``dst + i *
        dst_pitch``, on ``stream``. DriverError names the copy."""
        op = self._op
        op.dstDevice, op.dstPitch, op.srcDevice, op.srcPitch = dst, dst_pitch, src, src_pitch
        op.WidthInBytes, op.Height = width, height
        err = self._call(ctypes.byref(op), stream)
        if err:
            raise DriverError(
                f"cuMemcpy2DAsync of {height} rows x {width} bytes from {src:#x} (pitch "
                f"{src_pitch}) to {dst:#x} (pitch {dst_pitch}) failed: "
                f"{error_name(self._lib, err)}"
            )


CU_EVENT_BLOCKING_SYNC = 0x1  # a synchronize sleeps instead of spinning a core
CU_EVENT_DISABLE_TIMING = 0x2
CUDA_ERROR_NOT_READY = 600


class DriverEvent:
    """A CUDA event the copier records from C (``aiokv.copy._queue``), used as torch's
    are: ``torch.cuda.Stream.wait_event(event)`` calls :meth:`wait`; :meth:`synchronize`
    and :meth:`query` as ``torch.cuda.Event``'s. Owned by an :class:`EventPool`."""

    __slots__ = ("_lib", "handle")

    def __init__(self, handle: int, lib: Any) -> None:
        self.handle = handle
        self._lib = lib

    def wait(self, stream: Any) -> None:
        """Make ``stream`` (a torch.cuda.Stream) wait for this event's last record."""
        _call(self._lib, "cuStreamWaitEvent", ctypes.c_void_p(stream.cuda_stream),
              ctypes.c_void_p(self.handle), ctypes.c_uint(0))

    def record(self, stream: Any) -> None:
        """Record this event on ``stream`` (a torch.cuda.Stream) now."""
        _call(self._lib, "cuEventRecord", ctypes.c_void_p(self.handle),
              ctypes.c_void_p(stream.cuda_stream))

    def synchronize(self) -> None:
        """Block until the last record ran (a ctypes call: the GIL is released)."""
        _call(self._lib, "cuEventSynchronize", ctypes.c_void_p(self.handle))

    def query(self) -> bool:
        err = self._lib.cuEventQuery(ctypes.c_void_p(self.handle))
        if err == CUDA_ERROR_NOT_READY:
            return False
        if err:
            raise DriverError(f"cuEventQuery failed: {error_name(self._lib, err)}")
        return True


class EventPool:
    """CUDA events of one kind, reused: a job takes what it records and gives them back
    once its end events ran (each stream's later records then ran too). A waiter that
    still holds a given-back event waits at worst for a later record of it: longer,
    never less than its own layer. Used from the copy thread and its done thread."""

    def __init__(self, flags: int) -> None:
        self._lib = libcuda()
        self._flags = flags
        self._free: list[DriverEvent] = []
        self._lock = threading.Lock()

    def take(self, count: int) -> list[DriverEvent]:
        with self._lock:
            taken = self._free[len(self._free) - count:] if count else []
            del self._free[len(self._free) - len(taken):]
        while len(taken) < count:
            handle = ctypes.c_void_p(0)
            _call(self._lib, "cuEventCreate", ctypes.byref(handle), ctypes.c_uint(self._flags))
            taken.append(DriverEvent(int(handle.value or 0), self._lib))
        return taken

    def give(self, events: list[DriverEvent]) -> None:
        with self._lock:
            self._free.extend(events)

    def close(self) -> None:
        """Destroy the events given back (once no job or waiter uses them)."""
        with self._lock:
            free, self._free = self._free, []
        for event in free:
            _call(self._lib, "cuEventDestroy_v2", ctypes.c_void_p(event.handle))
