"""The lookup-latency benchmark's quick run: every lookup of every round is a full hit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import lookup_latency


@pytest.mark.parametrize("own_process", ["0", "1"])
def test_quick_run_times_every_round_and_hits_everything(own_process: str) -> None:
    result = lookup_latency.main(["--quick", "--rounds", "3", "--own-process", own_process])
    assert len(result["rounds_ms"]) == 3
    assert result["own_process"] is (own_process == "1")
    assert result["asked_tokens"] > 0
    assert result["hit_tokens"] == result["asked_tokens"]
    assert result["median_ms"] > 0
