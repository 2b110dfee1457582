"""argparse ``type=`` functions for the command line's numeric and path flags (``aiokv demo``,
``aiokv store-server``, ``aiokv bench ...``).

A value out of range is a usage error at parse time: argparse prints
``argument --users: expected an integer >= 1, got '0'`` under the usage line and exits
with status 2, instead of a ConfigError traceback (or a run of nonsense) later on.
Floats must also be finite (``nan`` and ``inf`` are refused).

Sizes have no upper bound here: what fits depends on the machine. Sizes that together ask
for more host memory than it has are refused before their buffers are made
(:func:`check_fits`), or fail where they are made; :func:`too_large` turns either into the
same kind of usage error.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping

from .config import machine_memory_bytes, size_text

# Above this no count or size reaches torch or the OS (an int64): a larger one was an
# "Overflow when unpacking long long" traceback once the run had started.
MAX_INT = 2**63 - 1


def integer(minimum: int, *, or_zero: bool = False) -> Callable[[str], int]:
    """An integer >= ``minimum`` (``or_zero``: or 0, where 0 means "off" or "auto"), at
    most :data:`MAX_INT`."""
    wanted = f"0 or an integer >= {minimum}" if or_zero else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < minimum and not (or_zero and value == 0):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        if value > MAX_INT:
            raise argparse.ArgumentTypeError(f"expected {wanted} and at most {MAX_INT}, "
                                             f"got {text!r}")
        return value

    return parse


positive_int = integer(1)
nonnegative_int = integer(0)


def _number(text: str, *, zero: bool) -> float:
    wanted = "a finite number >= 0" if zero else "a finite number > 0"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a size, a duration)."""
    return _number(text, zero=False)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (where 0 means "none", "auto" or "at once")."""
    return _number(text, zero=True)


def positive_int_list(text: str) -> tuple[int, ...]:
    """``"1,8,64"`` -> ``(1, 8, 64)``: comma-separated integers >= 1."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1 or max(values) > MAX_INT:
        raise argparse.ArgumentTypeError(f"expected integers in 1..{MAX_INT}, got {text!r}")
    return values


def output_file(text: str) -> str:
    """A file to write at the end of a run (``--json``, ``--plot``): its directory must
    exist now, not only once the run is over."""
    directory = os.path.dirname(text) or "."
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"no directory {directory!r} to write {text!r} in")
    if os.path.isdir(text):  # else an IsADirectoryError traceback once the run is over
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a file in it")
    return text


def existing_directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected an existing directory, got {text!r}")
    return text


# How torch says that an allocation failed: on the CPU (DefaultCPUAllocator) and on CUDA
# (torch.OutOfMemoryError), and where a size overflows before anything is allocated.
_ALLOCATION_FAILED = ("can't allocate memory", "out of memory", "integer multiplication overflow")


def too_large(exc: BaseException) -> str | None:
    """The usage error to print for ``exc`` where it says that buffers of the sizes asked
    for could not be made (the flags' sizes are too large for this machine), else None."""
    text = str(exc)
    if not isinstance(exc, MemoryError) and not (
        isinstance(exc, RuntimeError) and any(s in text.lower() for s in _ALLOCATION_FAILED)
    ):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"the sizes asked for do not fit in this machine's memory ({first}); ask for less"


def check_fits(asked: str, needs: Mapping[str, int]) -> None:
    """MemoryError (:func:`too_large` words it as a usage error) where the host buffers
    ``needs`` names, in bytes, add up to more than this machine's memory; ``asked`` names
    the flags and values that sized them. Checked before anything is made: Linux lets a
    process reserve more than the machine has and then kills it (SIGKILL, no message) as
    the pages are touched, so torch's allocator never gets to fail. Nothing is checked
    where the OS gives no memory size."""
    memory = machine_memory_bytes()
    total = sum(needs.values())
    if memory is None or total <= memory:
        return
    parts = " + ".join(f"{name} {size_text(size)}" for name, size in needs.items() if size)
    raise MemoryError(f"{asked}: {parts} = {size_text(total)}, more than this machine's "
                      f"{size_text(memory)}")


__all__ = [
    "check_fits",
    "existing_directory",
    "integer",
    "nonnegative_float",
    "nonnegative_int",
    "output_file",
    "positive_float",
    "positive_int",
    "positive_int_list",
    "too_large",
]
