"""`aiokv bench layers` on the CPU: the smoke run CI makes, in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiokv.bench import main as bench_main


def test_layers_bench_prints_both_figures_and_writes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "layers.json"
    assert bench_main(["layers", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layerwise / whole" in printed and "layer 0 in place" in printed
    document = json.loads(out.read_text())
    assert document["bench"] == "layers" and document["settings"]["layers"] == 4  # --quick's
    assert document["ratio"] == document["layerwise_s"] / document["whole_s"]
    assert document["ideal"] == 5 / 8
    for key in ("load_s", "compute_s", "whole_s", "layerwise_s", "first_load_s", "layer0_s"):
        assert document[key] > 0
    assert document["steps_per_layer"] >= 1


def test_layers_bench_refuses_first_tokens_beyond_tokens() -> None:
    with pytest.raises(SystemExit, match="first-tokens"):
        bench_main(["layers", "--device", "cpu", "--tokens", "32", "--first-tokens", "64"])
