"""Throwaway probe (2026-12-07): ``aiokv store-server`` spinning on ``select(0)`` for
``SPIN_US`` microseconds before each blocking select (started as the timed probe is)."""

import os
import selectors
import sys
import time
from typing import Any

sys.path.insert(0, os.environ.get("CODE", "/work/main"))
from aiokv.cli import main

SPIN_S = float(os.environ.get("SPIN_US", "200")) / 1e6
_select = selectors.DefaultSelector.select


def select(self: Any, timeout: float | None = None) -> Any:
    if timeout is None or timeout > 0:
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            ready = _select(self, 0)
            if ready:
                return ready
    return _select(self, timeout)


selectors.DefaultSelector.select = select  # type: ignore[method-assign]
sys.exit(main(sys.argv[1:]))
