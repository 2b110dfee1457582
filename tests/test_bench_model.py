"""`aiokv bench model` on the CPU (a smoke run: tiny matmuls, tiny caches) and the harness
it shares with benchmarks/copy_mechanisms.py: a copier's failure reaches the caller."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from aiokv.bench import main as bench_main
from aiokv.bench.beside import Beside, Unit, measure_copier
from aiokv.bench.standin import ALL, StandIn, parse_depths
from aiokv.copy import copier as copy_plane


def test_model_bench_prints_its_table_and_figures_for_both_copiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.json"
    threads = torch.get_num_threads()
    status = bench_main(["model", "--device", "cpu", "--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    assert torch.get_num_threads() == threads  # the smoke run's one thread is given back
    assert "model stand-in on cpu" in printed and "slowdown" in printed
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert {(r["depth"], r["copier"]) for r in rows} == {
        (d, c) for d in ("all", "4") for c in ("reference", "engine")
    }
    for row in rows:
        assert row["model_alone_s"] > 0 and row["model_beside_s"] > 0
        assert row["slowdown"] == row["model_beside_s"] / row["model_alone_s"]
        assert 0 < row["model_in_launches"] <= 1  # on a CPU the matmuls run in the call
        for kind in ("offload", "load"):
            assert row[f"{kind}_units"] >= 1  # a whole round (or copy) beside the model
            assert math.isfinite(row[f"{kind}_gib_s"]) and row[f"{kind}_gib_s"] > 0
    for copier in ("reference", "engine"):
        assert all(document["alone"][copier][k] > 0 for k in ("offload", "load"))
    assert document["settings"]["depth"] == "all,4"


def test_model_bench_runs_the_store_of_its_config_in_a_process_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "own.yml"
    config.write_text("store:\n  cpu_cache_gb: 0.02\n  page_size: 32\n  own_process: true\n")
    out = tmp_path / "model.json"
    argv = ["model", "--device", "cpu", "--depth", "4", "--config", str(config), "--json",
            str(out), "--ids", "host", "--ahead-mib", "4096"]
    assert bench_main(argv) == 0
    assert "on the local store in its own process" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["model"]["page_size"] == 32  # the config's, not the bench's default
    (engine,) = [r for r in document["rows"] if r["copier"] == "engine"]
    assert engine["offload_units"] >= 1 and engine["load_gib_s"] > 0
    assert document["settings"]["ids"] == "host"
    assert document["settings"]["ahead_mib"] == 4096
    assert copy_plane.MAX_BYTES_AHEAD == 64 << 20  # the run's pacing, given back after it


def test_a_bad_depth_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:  # a usage error, at parse time
        bench_main(["model", "--device", "cpu", "--depth", "all,two"])
    assert caught.value.code == 2
    assert "argument --depth: expected 'all' or an integer >= 0, got 'two'" in (
        capsys.readouterr().err
    )
    assert parse_depths("all, 4") == (ALL, 4)
    assert parse_depths("0") == (ALL,)


class _Failing:
    """Moves one unit, then fails as a broken data plane would."""

    def __init__(self) -> None:
        self.units = 0
        self.closed = False

    def setup(self) -> None:
        pass

    def unit(self) -> Sequence[Unit]:
        self.units += 1
        if self.units > 1:
            raise ValueError("page 7 is out of range")
        return [Unit("offload", 1, 0.0, 0.0)]

    def close(self) -> None:
        self.closed = True


def test_a_copier_error_reaches_the_caller_and_the_copier_is_closed() -> None:
    model = StandIn(torch.device("cpu"), 8, torch.float32)
    failing = _Failing()
    with pytest.raises(RuntimeError, match="page 7 is out of range") as raised:
        measure_copier(Beside(failing, "test-copier"), model, 1, (ALL,), 0.01, 1)
    assert isinstance(raised.value.__cause__, ValueError)
    assert failing.closed


def test_a_failing_shaped_copier_is_left_out_and_the_others_are_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shaped copier is a reference of the bench's own (a GPU's): when it fails, the
    bench says why and still measures the reference and the engine."""
    from aiokv.bench import model as model_bench

    monkeypatch.setattr(model_bench, "shaped_copier",
                        lambda *args: Beside(_Failing(), "test-shaped"))
    out = tmp_path / "model.json"
    assert bench_main(["model", "--device", "cpu", "--quick", "--depth", "4",
                       "--json", str(out)]) == 0
    assert "the shaped copier failed" in capsys.readouterr().err
    document = json.loads(out.read_text())
    assert {r["copier"] for r in document["rows"]} == {"reference", "engine"}
    assert "page 7 is out of range" in document["failed"]["shaped"]
