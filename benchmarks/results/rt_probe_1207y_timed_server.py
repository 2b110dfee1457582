"""Throwaway probe (2026-12-07): ``aiokv store-server`` with its handlers timed.

Started in place of ``python -m aiokv store-server`` by a copy of
``benchmarks/shared_round_trip.py``; at exit it appends each timed call's median and p90
to the file named by ``PROBE_OUT``.
"""

import atexit
import os
import selectors
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.environ.get("CODE", "/work/main"))
from aiokv.cli import main
from aiokv.stores.shared import answers, connection, server, service

times: dict[str, list[float]] = {}


def timed(cls: type, name: str) -> None:
    inner = getattr(cls, name)
    label = f"{cls.__name__}.{name}"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - began)

    setattr(cls, name, wrapper)


for cls, name in ((server.StoreServer, "_readable"), (answers.Answers, "answer"),
                  (connection.Connection, "reply"), (service.Service, "match_many"),
                  (answers.Answers, "_put"), (answers.Answers, "_get"),
                  (answers.Answers, "_end"), (answers.Answers, "_launch"),
                  (answers.Answers, "_ping")):
    timed(cls, name)

_select = selectors.DefaultSelector.select
_last: list[float] = []


def select(self: Any, timeout: float | None = None) -> Any:
    began = time.perf_counter()
    if _last:
        times.setdefault("between_selects", []).append(began - _last[0])
    ready = _select(self, timeout)
    _last[:] = [time.perf_counter()]
    times.setdefault("select_block", []).append(_last[0] - began)
    return ready


selectors.DefaultSelector.select = select  # type: ignore[method-assign]


def dump() -> None:
    with open(os.environ["PROBE_OUT"], "a") as out:
        for label, values in times.items():
            kept = sorted(values[100:] or values)
            out.write(f"{label:24} n={len(kept):6} median={statistics.median(kept) * 1e6:8.1f}us "
                      f"p90={kept[int(len(kept) * 0.9)] * 1e6:8.1f}\n")


atexit.register(dump)
sys.exit(main(sys.argv[1:]))
