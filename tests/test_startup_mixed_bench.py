"""Smoke tests of `aiokv bench startup --quick` and `aiokv bench bandwidth --mixed --quick`:
each runs, moves what it says, and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiokv.bench import main as bench_main


def test_startup_quick_serves_then_reports_the_whole_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "startup.json", tmp_path / "startup.png"
    assert bench_main(["startup", "--quick", "--device", "cpu", "--json", str(out),
                       "--plot", str(png)]) == 0
    result = json.loads(out.read_text())["result"]
    assert result["gib"] > 0 and result["plain_alloc_s"] > 0
    assert 0 < result["first_request_s"] <= result["whole_pool_s"]
    assert result["usable_bytes"] == result["gib"] * (1 << 30)  # all of it usable
    # On a CPU nothing is pinned, and the line says so.
    assert result["pinned_bytes"] == 0
    printed = capsys.readouterr().out
    assert "none pinned" in printed and "pinned 0" not in printed, printed
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_mixed_quick_moves_both_directions_and_compares_to_raw(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    assert bench_main(["bandwidth", "--mixed", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["result"]
    assert result["engine_mixed_gib_s"] > 0 and result["raw_duplex_gib_s"] > 0
    assert result["of_raw_duplex"] == result["engine_mixed_gib_s"] / result["raw_duplex_gib_s"]
