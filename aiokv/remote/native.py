"""Loading Mooncake Store's Python client (the PyPI wheel ``mooncake-transfer-engine-non-cuda``
or a CUDA variant) and finding its programs.

The wheel's extension links ``libibverbs.so.1`` (which needs ``libnl-3`` and
``libnl-route-3``) even when it only speaks TCP. ``make setup`` unpacks Debian's packages
of them into ``<venv>/lib/mooncake-sys`` rather than installing them system-wide (no
root needed). The dynamic loader reads ``LD_LIBRARY_PATH`` once, when the process starts,
so setting it here would not help: instead each library is loaded by its absolute path
with ``RTLD_GLOBAL`` before ``mooncake.store`` is imported, in dependency order; the
loader then finds the extension's ``libibverbs.so.1`` among the libraries already loaded
(matched by soname). Programs started from here (``mooncake_master``, the store process)
get the folders in their ``LD_LIBRARY_PATH``. Where the libraries are installed
system-wide, nothing is preloaded.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

# Each needs the ones before it.
_LIBRARIES = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
SYS_DIR_ENV = "AIOKV_MOONCAKE_SYS"  # where the unpacked Debian packages are, if not the venv's
INSTALL_HINT = (
    "install it with `make setup` (the wheel mooncake-transfer-engine-non-cuda and Debian's "
    "libibverbs1, libnl-3-200, libnl-route-3-200 unpacked into <venv>/lib/mooncake-sys), "
    "or pip install the wheel and apt-get install libibverbs1"
)

_module: ModuleType | None = None
_error: str | None = None


def sys_root() -> Path:
    """The folder the Debian packages were unpacked into (it may not exist)."""
    return Path(os.environ.get(SYS_DIR_ENV) or Path(sys.prefix) / "lib" / "mooncake-sys")


def library_dirs() -> list[str]:
    """The folders under :func:`sys_root` that hold shared libraries."""
    root = sys_root()
    found = {os.path.dirname(p) for name in _LIBRARIES for p in glob.glob(f"{root}/**/{name}",
                                                                         recursive=True)}
    return sorted(found)


def _preload() -> None:
    dirs = library_dirs()
    for name in _LIBRARIES:
        for folder in dirs:
            path = os.path.join(folder, name)
            if os.path.exists(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break


def import_store() -> ModuleType:
    """``mooncake.store``, loaded once. Raises ImportError saying why and how to install."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is None:
        try:
            _preload()
            store = importlib.import_module("mooncake.store")  # only where the tier is used
            _module = store
            return store
        except (ImportError, OSError) as exc:
            _error = f"{type(exc).__name__}: {exc}"
    raise ImportError(f"Mooncake Store's client cannot be loaded ({_error}); {INSTALL_HINT}")


def unavailable() -> str | None:
    """None where the client loads, else why not."""
    try:
        import_store()
    except ImportError as exc:
        return str(exc)
    return None


def program(name: str) -> str:
    """The path of one of the wheel's programs (``mooncake_master``, ``mooncake_client``)."""
    package = importlib.import_module("mooncake")
    path = os.path.join(os.path.dirname(str(package.__file__)), name)
    if not os.access(path, os.X_OK):  # wheels do not always keep the mode
        os.chmod(path, os.stat(path).st_mode | 0o111)
    return path


def program_env() -> dict[str, str]:
    """This process's environment with the unpacked libraries on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    dirs = library_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, env.get("LD_LIBRARY_PATH", "")])
    return env
