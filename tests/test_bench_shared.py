"""`aiokv bench shared` on the CPU (a smoke run at --quick sizes): a real store-server, two
engine processes streaming two batches each, and the figures it reports."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

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


def test_a_store_server_that_refuses_to_start_is_one_error_line_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # A temporary directory this deep puts the bench's socket past the 107 bytes a UNIX
    # socket path holds: the server refuses its --socket and exits. The bench raised the
    # server's log as a RuntimeError (a traceback).
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    status = bench_main(["shared", "--device", "cpu", "--quick", "--processes", "1"])
    out, err = capsys.readouterr()
    assert status == 1, out + err
    assert err.count("\n") == 1, err
    assert err.startswith("python -m aiokv.bench shared: StoreError: the store server exited "
                          "at start (status 2): aiokv store-server: --socket: "), err
    assert err.rstrip().endswith(" bytes long; a UNIX socket path holds at most 107"), err
