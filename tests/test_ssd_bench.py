"""CI smoke test of ``aiokv bench ssd --quick``: it runs end to end and prints its table;
and ``aiokv bench --help`` lists it with the others."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from aiokv.cli import main


def test_bench_ssd_quick_prints_store_and_plain_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "ssd.json", tmp_path / "ssd.png"
    # Smaller than --quick's volume: CI checks that it runs, the table shape, the JSON.
    status = main(["bench", "ssd", "--quick", "--gb", "0.0625", "--rounds", "1",
                   "--dir", str(tmp_path), "--json", str(out), "--plot", str(png)])
    assert status == 0
    printed = capsys.readouterr().out
    for row in ("plain write + fsync", "store SSD write", "plain read", "store SSD read",
                "xxh3-64 checksum"):
        assert row in printed
    results = json.loads(out.read_text())
    assert results["store_write_gibps"] > 0 and results["plain_read_gibps"] > 0
    assert not (tmp_path / "aiokv-bench-ssd").exists()  # it cleans up after itself
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_aiokv_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    for name in ("engine", "slots", "bandwidth", "lag", "ssd", "startup"):
        assert re.search(rf"^    {name}\b", printed, re.M), (name, printed)  # its own line


def test_bench_ssd_on_cuda_without_a_gpu_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was an AssertionError traceback ("Torch not compiled with CUDA enabled"), where
    # every other bench says this.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as done:
        main(["bench", "ssd", "--quick", "--device", "cuda", "--dir", str(tmp_path)])
    assert done.value.code == "--device cuda: no CUDA device is available"
    assert not (tmp_path / "aiokv-bench-ssd").exists()
