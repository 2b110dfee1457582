"""benchmarks/recsys_client.py's parts that need no GPU: its refusal without CUDA, the
order and choice of its jobs, and the report's ratios and verdicts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import recsys_client
import recsys_report


def _snapshot(tmp_path: Path) -> Path:
    (tmp_path / "corelib" / "recsys_kvcache_manager").mkdir(parents=True)
    return tmp_path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_stops_saying_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        recsys_client.main(["--recsys", str(_snapshot(tmp_path)), "--build-dir", str(tmp_path)])


def test_a_folder_that_is_no_recsys_snapshot_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no corelib/recsys_kvcache_manager"):
        recsys_client.main(["--recsys", str(tmp_path)])


def test_cases_must_be_whole_pages() -> None:
    assert recsys_client.parse_cases("1024, 4096") == [1024, 4096]
    with pytest.raises(Exception, match="multiples of 32"):
        recsys_client.parse_cases("1000")


def test_jobs_run_phases_first_then_the_targeted_lengths() -> None:
    jobs = recsys_client.job_list([1024, 2048, 4096], flexkv=True)
    assert jobs[:2] == [("aiokv", "phases"), ("flexkv", "phases")]
    assert [j for _, j in jobs[2:]] == ["steps:2048"] * 2 + ["steps:4096"] * 2 + ["steps:1024"] * 2
    assert {s for s, _ in recsys_client.job_list([2048], flexkv=False)} == {"aiokv"}


def _round(offload_wait: float, onboard_wait: float) -> dict[str, float]:
    return {"step1.offload_launch": 1.0, "step1.offload_wait": offload_wait,
            "step3.onboard_launch": 1.0, "step3.onboard_wait": onboard_wait}


def test_report_gives_ratios_against_flexkv_and_the_raw_copy() -> None:
    nbytes = 96 << 20
    steps = {"bytes": nbytes, "pages": 512, "host_pages": 4096, "raw_copy_ms": 2.0}
    results = {
        "device": "GPU", "torch": "x", "batch": 8, "cases": [2048],
        "jobs": {
            "aiokv:phases": {"phases": {"1": {"ok": True}, "5": {
                "ok": False, "where": "test_flexkv.py:722", "error": "AssertionError: ",
                "line": "assert torch.allclose(...)", "note": "after the host evict"}},
                "host_evict": "False for phases 1-5"},
            "flexkv:phases": {"error": "ImportError: no flexkv"},
            # round 0 warms up and must not count: its 100 ms would change every median
            "aiokv:steps:2048": {**steps, "rounds": [_round(100, 100)] + [_round(4.0, 1.5)] * 3},
            "flexkv:steps:2048": {**steps, "rounds": [_round(100, 100)] + [_round(9.0, 19.0)] * 3},
        },
    }
    text = recsys_report.format_report(results)
    # the medians: offload 5 vs 10 ms, onboard 2.5 vs 20 ms
    assert "offload launch+wait, median: aiokv/FlexKVStorage 0.50 (target <= 0.7: met)" in text
    assert "onboard launch+wait, median: aiokv/FlexKVStorage 0.12 (target <= 0.7: met)" in text
    # the first rounds: 101 ms each
    assert "offload launch+wait, first: aiokv/FlexKVStorage 1.00 (target <= 0.7: NOT met)" in text
    # 96 MiB in 2.5 ms = 37.5 GiB/s against 46.9 raw: 80%
    assert "onboard aiokv median: 37.5 GiB/s, 80% of raw (target >= 80%: met)" in text
    assert "phase 5: FAILED at test_flexkv.py:722" in text
    assert "(after the host evict)" in text
    assert "host_evict: False for phases 1-5" in text
    assert "could not run: ImportError: no flexkv" in text
    assert "30.655" in text  # the published H100 offload_wait at 8 x 2048


def test_report_says_when_a_target_is_missed() -> None:
    steps = {"bytes": 1 << 30, "pages": 1024, "host_pages": 4096, "raw_copy_ms": 20.0}
    results = {"batch": 8, "cases": [4096], "jobs": {
        "aiokv:steps:4096": {**steps, "rounds": [{}, _round(9.0, 39.0)]},
        "flexkv:steps:4096": {**steps, "rounds": [{}, _round(9.0, 39.0)]},
    }}
    text = recsys_report.format_report(results)
    assert "offload launch+wait, median: aiokv/FlexKVStorage 1.00 (target <= 0.7: NOT met)" in text
    assert "onboard aiokv median: 25.0 GiB/s, 50% of raw (target >= 80%: NOT met)" in text
    assert "first: aiokv" not in text  # round 0 has no steps: no ratio of the first rounds


def test_report_of_an_earlier_run_needs_no_gpu(tmp_path: Path, capsys: Any) -> None:
    steps = {"bytes": 1 << 30, "pages": 1024, "host_pages": 4096, "raw_copy_ms": 20.0}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"batch": 8, "cases": [4096], "jobs": {
        "aiokv:steps:4096": {**steps, "warmup": 2,
                             "rounds": [_round(50, 50), _round(50, 50), _round(4.0, 9.0)]},
    }}))
    recsys_client.main(["--report", str(saved)])
    out = capsys.readouterr().out
    assert "onboard aiokv median: 100.0 GiB/s, 200% of raw" in out  # 1 GiB in 10 ms
    assert "FlexKVStorage" not in out.split("==", 1)[1].split("\n", 1)[0]
