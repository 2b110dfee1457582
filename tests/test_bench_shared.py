"""`aiokv bench shared` on the CPU (a smoke run at --quick sizes): a real store-server, two
engine processes streaming two batches each, and the figures it reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

from aiokv.bench import main as bench_main


def test_a_smoke_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "shared.json"
    argv = ["shared", "--device", "cpu", "--quick", "--processes", "2", "--batches", "2",
            "--json", str(out)]
    assert bench_main(argv) == 0
    document = json.loads(out.read_text())
    results = document
    assert document["settings"]["batches"] == 2
    for kind in ("shared", "raw"):
        for direction in ("offload", "load"):
            value = results["bandwidth"][f"{kind}_{direction}_gib_s"]
            assert math.isfinite(value) and value > 0, (kind, direction, value)
    for message in ("empty", "match", "end", "batch"):
        median, p99 = results["round_trips_us"][message]
        assert 0 < median <= p99, message
    # Users land on a random process each request: one shared tier sees every history.
    hits = results["hit_ratio"]
    assert 0 < hits["private"] <= hits["shared"] <= 1
