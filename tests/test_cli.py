"""CPU smoke tests of ``aiokv demo`` and ``python -m aiokv.bench <each> --quick``, with the
smallest sizes: each proves the command runs end to end, exits 0, and writes a JSON
with its environment and positive numbers, and a PNG. The project's targets are judged
outside the user's tool, by benchmarks/targets.py and benchmarks/slots_recsys.py: tested
here on the same runs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiokv import flags
from aiokv.bench import SUBCOMMANDS
from aiokv.cli import main
from aiokv.config import machine_memory_bytes

ROOT = Path(__file__).resolve().parent.parent

# Flags that shrink each --quick run further, so the whole file stays well under a minute.
SMALL = {
    "engine": ["--users", "1,8", "--seconds", "0.2", "--warmup-s", "0.05",
               "--cpu-users", "16", "--cpu-requests", "500"],
    "slots": ["--users", "8,64", "--repeats", "3", "--min-tokens", "64", "--max-tokens", "256"],
    "bandwidth": ["--users", "4", "--tokens", "32,64", "--repeats", "1", "--raw-gib", "0.01"],
    "lag": ["--seconds", "0.3", "--idle-seconds", "0.1", "--users", "4", "--tokens", "64"],
}
ENVIRONMENT_KEYS = {"device", "device_name", "torch", "cuda", "python", "argv", "timestamp"}


def test_demo_runs_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--seconds", "1", "--users", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "0 mismatches" in out
    verified = int(out.split("verified")[1].split()[0])
    assert verified > 0, out


def test_demo_reads_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "aiokv.yml"
    config.write_text("engine:\n  window_us: 0\nstore:\n  backend: local\n  cpu_cache_gb: 0.05\n")
    status = main(["demo", "--seconds", "0.5", "--users", "4", "--device", "cpu",
                   "--config", str(config)])
    assert status == 0, capsys.readouterr().out


def test_a_config_that_is_not_yaml_is_one_line_naming_the_file_line_and_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yml"
    config.write_text("engine:\n  page_size: [1, 2\nstore:\n  x: 1\n")
    assert main(["demo", "--device", "cpu", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f"aiokv demo: path: {str(config)!r} is not valid YAML at line 3, column 6: expected "
        "',' or ']', but got ':' (while parsing a flow sequence at line 2, column 14)\n")


def test_a_demo_with_more_users_than_max_pending_ends_and_counts_the_overloads(
        tmp_path: Path) -> None:
    # Its own process: a demo that never ends (its users' refused calls retried without
    # a pause kept the loop from its stop) fails this test at the timeout, not the suite.
    config = tmp_path / "aiokv.yml"
    config.write_text("engine:\n  max_pending: 8\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "aiokv", "demo", "--seconds", "0.5", "--users", "9",
         "--device", "cpu", "--config", str(config)],
        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 1, done.stdout + done.stderr  # requests failed: counted
    assert "Overloaded('8 requests pending (engine.max_pending)')" in done.stdout
    assert " 0 mismatches" in done.stdout


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf"])
def test_demo_refuses_a_duration_that_is_not_a_finite_positive_number(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:  # a usage error (tests/test_cli_flags.py)
        main(["demo", "--seconds", seconds, "--device", "cpu"])
    assert caught.value.code == 2
    assert f"argument --seconds: expected a finite number > 0, got {seconds!r}" in (
        capsys.readouterr().err
    )


def _positive_numbers(rows: list[dict[str, Any]], keys: list[str]) -> None:
    assert rows
    for row in rows:
        for key in keys:
            assert isinstance(row[key], (int, float)) and row[key] > 0, (key, row)


def _run_bench(name: str, tmp_path: Path) -> dict[str, Any]:
    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    command = [sys.executable, "-m", "aiokv.bench", name, "--quick", "--json", str(out_json),
               "--plot", str(out_png), *SMALL[name]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert out_png.stat().st_size > 0
    document: dict[str, Any] = json.loads(out_json.read_text())
    assert document["bench"] == name
    assert set(document["environment"]) >= ENVIRONMENT_KEYS
    assert document["environment"]["argv"][1:] == command[3:]  # the exact command line
    return document


def test_bench_engine(tmp_path: Path) -> None:
    document = _run_bench("engine", tmp_path)
    _positive_numbers(document["rows"], ["users", "baseline_rps", "engine_rps", "ratio"])
    cpu = document["cpu"]
    assert cpu["cpu_us_per_request"] > 0
    # The timing wrapper's own cost is measured and kept out of the engine's share.
    assert 0 <= cpu["timing_wrapper_us_per_request"] < cpu["cpu_us_per_request"]
    assert document["cpu"]["mean_batch"] > 0
    assert "targets" not in document  # the user's tool measures; benchmarks/ judges


def test_a_bench_whose_flags_make_a_store_that_cannot_be_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Values each flag's own range allows, together no store: exit 2 naming the key.
    quick = ["bench", "engine", "--quick", "--users", "1", "--cpu-requests", "10"]
    assert main([*quick, "--cpu-cache-gb", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert "aiokv bench engine: error: store.cpu_cache_gb:" in err and "Traceback" not in err


def test_bench_slots(tmp_path: Path) -> None:
    document = _run_bench("slots", tmp_path)
    _positive_numbers(document["rows"], ["fused_ms", "copy_ms", "fused_of_copy",
                                         "per_user_np_ms", "csr_loop_np_ms",
                                         "speedup_vs_per_user_np", "speedup_vs_csr_loop_np",
                                         "fused_mask_ms", "per_user_mask_ms",
                                         "csr_loop_mask_ms"])
    assert "targets" not in document


def test_bench_bandwidth(tmp_path: Path) -> None:
    document = _run_bench("bandwidth", tmp_path)
    assert document["raw"]["d2h_gib_s"] > 0 and document["raw"]["h2d_gib_s"] > 0
    _positive_numbers(document["rows"], ["offload_gib_s", "load_gib_s", "offload_of_raw",
                                         "load_of_raw", "batch_gib", "stream_batches"])


def test_bench_lag(tmp_path: Path) -> None:
    document = _run_bench("lag", tmp_path)
    phases = {row["phase"]: row for row in document["rows"]}
    assert set(phases) == {"idle", "loaded"}
    _positive_numbers([phases["loaded"]], ["ticks", "requests_per_s", "gib_per_s"])
    assert "targets" not in document


def _run_script(script: str, args: list[str], tmp_path: Path) -> dict[str, Any]:
    out_json = tmp_path / "judged.json"
    command = [sys.executable, f"benchmarks/{script}", *args, "--json", str(out_json)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target " in done.stdout, done.stdout  # each target printed with its verdict
    document: dict[str, Any] = json.loads(out_json.read_text())
    for target in document["targets"]:
        assert set(target) == {"name", "goal", "measured", "pass", "applies"}, target
        assert isinstance(target["pass"], bool) and isinstance(target["measured"], float)
    return document


def test_targets_judge_the_engine_bench(tmp_path: Path) -> None:
    document = _run_script("targets.py", ["engine", "--quick", *SMALL["engine"]], tmp_path)
    _positive_numbers(document["rows"], ["users", "baseline_rps", "engine_rps", "ratio"])
    targets = {t["name"]: t for t in document["targets"]}
    assert set(targets) == {"engine/baseline at 256 users", "engine CPU per request at batch 16"}
    ratio = targets["engine/baseline at 256 users"]  # no 256-user row: not measured, not met
    assert math.isnan(ratio["measured"]) and ratio["pass"] is False
    cpu = targets["engine CPU per request at batch 16"]
    assert cpu["measured"] == document["cpu"]["engine_us_per_request"]
    assert cpu["pass"] is (cpu["measured"] < 20)


def test_targets_judge_the_lag_bench(tmp_path: Path) -> None:
    document = _run_script("targets.py", ["lag", "--quick", *SMALL["lag"]], tmp_path)
    assert {t["name"] for t in document["targets"]} == {"p99 lateness", "max lateness"}


def test_lag_percentiles_are_over_time_not_ticks() -> None:
    # 990 fast wake-ups of 10 us and 10 stalls of 2 ms: by ticks the p99 is 0, but the
    # loop was more than 1 ms late for about two thirds of the time.
    from aiokv.bench.lag import by_time_ms

    late = [0.0] * 990 + [2e-3] * 10
    spans = [10e-6] * 990 + [2.1e-3] * 10
    p50, p99 = by_time_ms(late, spans, [50, 99])
    assert (p50, p99) == (2.0, 2.0)
    assert by_time_ms([0.0] * 1000, [10e-6] * 1000, [99]) == [0.0]
    assert by_time_ms([], [], [50, 99]) == [0.0, 0.0]


def test_targets_judge_every_bandwidth_row_on_the_steady_stream(tmp_path: Path) -> None:
    small = [*SMALL["bandwidth"], "--users", "4,8"]  # the later --users wins
    document = _run_script("targets.py", ["bandwidth", "--quick", *small], tmp_path)
    assert len(document["rows"]) == 4 and len(document["targets"]) == 4  # one a row
    for row in document["rows"]:
        assert row["target"] == 0.95 and row["target_judged_on"] == "steady stream"
        assert row["target_applies"] is False  # measured on a CPU: set for a GPU
        fractions = (row["stream_offload_of_raw"], row["stream_load_of_raw"])
        assert row["pass"] is all(f >= 0.95 for f in fractions)  # a NaN fails too


def _judge(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import runpy

    judge = runpy.run_path(str(ROOT / "benchmarks" / "targets.py"))["bandwidth_targets"]
    return {t["name"]: t for t in judge(document)}


def test_issue_34s_one_batch_targets_are_judged_beside_the_steady_ones() -> None:
    # The H100 figures of 2026-12-06 (benchmarks/RESULTS.md): steady 90-94% misses 95%
    # in every row; one batch 73% misses 85% at 8 x 1024, 90% misses 95% at 32 x 2048.
    figures = {(8, 1024): (0.73, 0.76, 0.90, 0.94), (8, 2048): (0.82, 0.82, 0.93, 0.98),
               (32, 1024): (0.86, 0.87, 0.93, 0.95), (32, 2048): (0.90, 0.92, 0.94, 0.95)}
    rows = [{"users": u, "tokens": t, "offload_of_raw": a, "load_of_raw": b,
             "stream_offload_of_raw": c, "stream_load_of_raw": d}
            for (u, t), (a, b, c, d) in figures.items()]
    targets = _judge({"environment": {"device": "cuda:0"}, "rows": rows})
    assert {name: (t["goal"], t["pass"]) for name, t in targets.items()} == {
        "8x1024 offload and load of raw (steady stream)": (">= 95%", False),
        "8x1024 offload and load of raw (one batch)": (">= 85%", False),
        "8x2048 offload and load of raw (steady stream)": (">= 95%", False),
        "32x1024 offload and load of raw (steady stream)": (">= 95%", False),
        "32x2048 offload and load of raw (steady stream)": (">= 95%", False),
        "32x2048 offload and load of raw (one batch)": (">= 95%", False),
    }
    assert all(row["pass"] is False for row in rows)
    rows[0].update(offload_of_raw=0.86, load_of_raw=0.87, stream_offload_of_raw=0.96,
                   stream_load_of_raw=0.95)
    targets = _judge({"environment": {"device": "cuda:0"}, "rows": rows})
    assert targets["8x1024 offload and load of raw (one batch)"]["pass"] is True
    assert targets["8x1024 offload and load of raw (steady stream)"]["pass"] is True
    assert rows[0]["pass"] is True


def test_mixed_traffic_is_judged_on_the_raw_duplex_copy() -> None:
    for share, met in ((0.85, False), (0.91, True)):
        (target,) = _judge({"environment": {"device": "cuda:0"},
                            "result": {"of_raw_duplex": share}}).values()
        assert (target["goal"], target["measured"], target["pass"]) == (">= 90%", share, met)


def test_a_bandwidth_figure_that_could_not_be_measured_fails_its_target() -> None:
    import runpy

    passes = runpy.run_path(str(ROOT / "benchmarks" / "targets.py"))["passes"]
    nan = float("nan")
    assert passes((0.96, 0.97), 0.95)
    assert not passes((0.96, 0.94), 0.95)
    assert not passes((0.97, nan), 0.95) and not passes((nan, 0.97), 0.95)


def test_slots_recsys_times_the_re_creations_against_the_fused_path(tmp_path: Path) -> None:
    document = _run_script("slots_recsys.py", ["--quick", *SMALL["slots"], "--device", "cpu"],
                           tmp_path)
    _positive_numbers(document["rows"], ["fused_ms", "per_user_ms", "csr_loop_ms",
                                         "speedup_vs_per_user", "speedup_vs_csr_loop"])
    targets = {t["name"]: t for t in document["targets"]}
    assert set(targets) == {"fused vs (a) per-user copies at 64 users",
                            "fused vs (b) CSR copy + loop at 64 users"}
    assert not any(t["applies"] for t in targets.values())  # set for a GPU; this is a CPU


def test_aiokv_bench_delegates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "slots.json"
    status = main(["bench", "slots", "--quick", "--json", str(out_json), *SMALL["slots"],
                   "--device", "cpu"])
    assert status == 0
    assert "fused ms" in capsys.readouterr().out
    document = json.loads(out_json.read_text())
    assert document["environment"]["bench_argv"][:2] == ["slots", "--quick"]


def test_quickstart_example_runs_and_verifies() -> None:
    import runpy

    example = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    module = runpy.run_path(str(example))
    assert asyncio.run(module["main"](str(module["CONFIG"]))) == 0


def test_store_slice_benchmark_runs_both_settings(tmp_path: Path) -> None:
    out_json = tmp_path / "store_slice.json"
    command = [sys.executable, "benchmarks/store_slice.py", "--passes", "1", "--rounds", "2",
               "--users", "4", "--match-us", "50", "--json", str(out_json)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out_json.read_text())
    assert [row["slice_us"] for row in document["rows"]] == [0, 200]
    _positive_numbers(document["rows"], ["lag_max_ms", "requests_per_s"])
    assert set(document["on_over_off"]) == {"lag_max_ms", "lag_p99_ms", "requests_per_s"}


def test_process_round_trip_benchmark_measures_both_sides(tmp_path: Path) -> None:
    out_json = tmp_path / "round_trip.json"
    command = [sys.executable, "benchmarks/process_round_trip.py", "--calls", "20",
               "--tokens", "64", "--batch", "4", "--json", str(out_json)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out_json.read_text())
    assert set(document["batch_us"]) == {"one call each", "put_match_many"}
    assert all(wall > 0 and cpu > 0 for wall, cpu in document["batch_us"].values())
    rows = document["rows"]
    assert [row["verb"] for row in rows] == [
        "cancel([])", "put_match(64) + cancel", "try_wait([unknown id])"
    ]
    _positive_numbers(rows, ["here_wall_us", "child_wall_us", "child_cpu_us"])


def test_demo_verifies_its_loads_with_the_store_in_a_process_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A store small enough to evict: offloads, lookups and loads cross to the child.
    config = tmp_path / "aiokv.yml"
    config.write_text("store:\n  cpu_cache_gb: 0.003\n  own_process: true\n")
    # 1 s offloads 45-70x the store's size on a 2-core box (its clock starts once the
    # store process serves); a box starved by other work managed 0.4x once, so a run that
    # offloaded less than the store holds (nothing evicted: not what this test is for) is
    # run again for longer.
    for seconds in ("1", "8"):
        status = main(["demo", "--seconds", seconds, "--users", "8", "--device", "cpu",
                       "--config", str(config)])
        out = capsys.readouterr().out
        assert status == 0, out
        assert "0 mismatches" in out and int(out.split("verified")[1].split()[0]) > 0, out
        offloaded = float(out.split("store ")[1].split("x its size offloaded")[0].split(", ")[1])
        if offloaded > 1:
            break
    assert offloaded > 1, out


@pytest.mark.parametrize(("argv", "flag"), [
    (["bandwidth", "--mixed", "--plot", "PNG"], "--plot"),
    (["bandwidth", "--mixed", "--raw-gib", "0.01"], "--raw-gib"),
    (["shared", "--plot", "PNG"], "--plot"),
])
def test_a_flag_a_run_would_not_honour_is_a_usage_error(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "out.png"
    argv = [str(png) if a == "PNG" else a for a in argv]
    assert main(["bench", *argv, "--quick"]) == 2
    assert f"error: {flag}: " in capsys.readouterr().err
    assert not png.exists()


@pytest.mark.parametrize("command", [["demo", "--seconds", "0.5", "--users", "2"],
                                     ["bench", "layers", "--quick", "--device", "cpu"]])
def test_a_store_that_cannot_serve_is_a_message_not_a_traceback(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "shared.yml"
    config.write_text(f"store:\n  backend: shared\n  socket: {tmp_path / 'none.sock'}\n")
    assert main([*command, "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "StoreError" in err and "not reachable" in err and "Traceback" not in err


@pytest.mark.parametrize("bench", ["layers", "model"])
def test_a_config_whose_store_cannot_hold_a_round_is_a_usage_error(
    bench: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its lookups missed (layers) or its offloads waited 30 s for room (model), each then
    # a RuntimeError traceback.
    config = tmp_path / "small.yml"
    config.write_text("store:\n  cpu_cache_gb: 0.0001\n")
    assert main(["bench", bench, "--quick", "--device", "cpu", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"aiokv bench {bench}: error: store.cpu_cache_gb: " in err, err
    assert "a round of --users 4 x --tokens 64 needs 16" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "flag"), [
    (["bench", "bandwidth", "--quick", "--head-dim", "100000000", "--device", "cpu"],
     "--head-dim 100000000"),
    # Refused by torch's allocator once, in a message that named no flag.
    (["bench", "startup", "--quick", "--gib", "100000", "--device", "cpu"], "--gib 100000.0"),
])
def test_sizes_larger_than_the_machine_are_a_usage_error_not_a_traceback(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "do not fit in this machine's memory" in err, err
    assert flag in err and "can't allocate memory" not in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "flag"), [
    (["engine", "--layers", "100000000"], "--layers 100000000"),
    (["slots", "--users", "100000000"], "--users 100000000"),
    (["slots", "--page-size", "100000000", "--min-tokens", "100000000",
      "--max-tokens", "100000000"], "--min-tokens 100000000"),
    (["bandwidth", "--users", "100000000", "--tokens", "100000000"], "--tokens 100000000"),
    (["lag", "--tokens", "100000000"], "--tokens 100000000"),  # --users: check_in_flight
    (["model", "--matrix", "100000000"], "--matrix 100000000"),
    (["layers", "--layers", "100000000"], "--layers 100000000"),
    # The reference copy's buffers: torch's "can't allocate memory" naming no flag, and
    # past an int64 a TypeError traceback.
    (["model", "--ref-mib", "100000"], "--ref-mib 100000"),
    (["model", "--ref-mib", str(2**63 - 1)], f"--ref-mib {2**63 - 1}"),
    # --cpu-users' round of its own, after the rows of --users: allocated as asked.
    (["engine", "--users", "1", "--pages", "256", "--cpu-users", "4096"], "--cpu-users 4096"),
    (["startup", "--gib", "1000"], "--gib 1000.0"),
])
def test_bench_sizes_beyond_memory_are_refused_naming_the_flag_before_allocating(
    argv: list[str], flag: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Each was allocated as asked: many small buffers (slots' per-user masks, a cache per
    # layer) that the kernel killed the run for, or a torch traceback where a size
    # overflowed int64 ("Storage size calculation overflowed").
    _memory_of(monkeypatch, 4 << 30)
    device = [] if argv[0] == "engine" else ["--device", "cpu"]
    assert main(["bench", *argv, "--quick", *device]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the run began
    assert err.startswith(f"aiokv bench {argv[0]}: error: the sizes asked for do not fit in "
                          "this machine's memory ("), err
    assert flag in err and "more than this machine's 4.0 GiB); ask for less" in err, err


@pytest.mark.parametrize(("argv", "error"), [
    (["engine", "--users", "1,5000"], "--users: 5000"),
    (["engine", "--users", "1", "--cpu-users", "100000000"], "--cpu-users: 100000000"),
    (["lag", "--users", "5000", "--tokens", "16", "--device", "cpu"], "--users: 5000"),
    (["shared", "--users", "2100", "--batches", "2", "--processes", "1", "--tokens", "16",
      "--hit-users", "1", "--device", "cpu"], "--users: --users 2100 x --batches 2 = 4200"),
])
def test_more_users_than_the_engine_admits_are_a_usage_error_naming_the_flag(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each user keeps one call in flight (shared: a round's batches, at once), on an engine
    # of the default max_pending: those past it failed with Overloaded once the run was
    # under way (exit status 1, naming no flag; shared: a child's traceback).
    assert main(["bench", *argv, "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the run began
    assert err == (f"aiokv bench {argv[0]}: error: {error} calls in flight at once are more "
                   "than the engine's max_pending (4096); ask for fewer\n")


def test_as_many_users_as_the_engine_admits_are_not_refused() -> None:
    from aiokv.bench import common
    from aiokv.bench.drive import Settings

    common.check_in_flight(Settings(users=(1, 4096)), "users", max_pending=4096)


@pytest.fixture
def _ssd_never_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size that gets past ssd's checks fails the test at once rather than write its
    plain file (which filled the disk)."""
    from aiokv.bench import ssd

    def wrote(directory: Path, volume: float) -> dict[str, float]:
        raise AssertionError(f"the run began: {volume} bytes to write in {directory}")

    monkeypatch.setattr(ssd, "_plain_round", wrote)


@pytest.mark.usefixtures("_ssd_never_writes")
def test_bench_ssd_host_tier_beyond_memory_is_refused_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was capped at a quarter of --gb without a word, and the run went on (full size).
    _memory_of(monkeypatch, 4 << 30)
    assert main(["bench", "ssd", "--quick", "--dir", str(tmp_path), "--host-gb", "100000"]) == 2
    err = capsys.readouterr().err
    assert err == ("aiokv bench ssd: error: the sizes asked for do not fit in this machine's "
                   "memory (--host-gb 100000.0: host tier 100,000.0 GiB + caches 16 MiB = "
                   "100,000.0 GiB, more than this machine's 4.0 GiB); ask for less\n")


@pytest.mark.usefixtures("_ssd_never_writes")
def test_bench_ssd_volume_beyond_the_disk_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its plain write came first: it filled the disk, then an OSError traceback.
    assert main(["bench", "ssd", "--quick", "--dir", str(tmp_path), "--gb", "1e9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiokv bench ssd: error: --gb: 1000000000.0 GiB needs "
                          f"1,020,000,000.01 GiB on the disk of {str(tmp_path)!r}, which has "), err
    assert err.endswith(" free; ask for less or name a --dir with room\n"), err


@pytest.mark.usefixtures("_ssd_never_writes")
@pytest.mark.parametrize(("argv", "error"), [
    (["--gb", "0.03"], "--gb: 0.03 GiB makes a host tier of 7.7 MiB"),
    (["--host-gb", "0.001"], "--host-gb: 0.001 GiB makes a host tier of 1.0 MiB"),
])
def test_bench_ssd_host_tier_smaller_than_one_put_is_refused_naming_the_flag(
    argv: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The store refused the put once the plain round was over, naming no flag.
    assert main(["bench", "ssd", "--quick", "--dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err == (f"aiokv bench ssd: error: {error} (--host-gb, at most a quarter of --gb), "
                   "fewer than the 16 blocks of 1024 KiB one user offloads at once\n")


def test_bench_startup_tier_of_no_block_names_the_flag(
    capsys: pytest.CaptureFixture[str]
) -> None:
    # It named the store's key (store.cpu_cache_gb), which the command line has not.
    assert main(["bench", "startup", "--gib", "1e-6", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "aiokv bench startup: error: --gib: 1e-06 GiB holds no block of 1048576 bytes; ask "
        "for at least 0.000976562\n")


def _memory_of(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """This process sees a machine of ``size`` bytes (children see the real one)."""
    real = os.sysconf

    def sysconf(name: str | int) -> int:
        return {"SC_PHYS_PAGES": size // 4096, "SC_PAGE_SIZE": 4096}.get(str(name), real(name))

    monkeypatch.setattr(os, "sysconf", sysconf)


def test_demo_sizes_beyond_memory_are_refused_before_anything_is_allocated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1 MiB pages: even the smallest history budget (3 pages a user) makes 384 MiB of
    # caches, past the 256 MiB the help promises, and a 192 MiB store that alone fits. On
    # a 512 MiB machine they did not fit together, and the demo allocated them anyway: the
    # kernel killed it (`--page-size 100000` asked for ~110 GiB on a 24 GiB machine).
    _memory_of(monkeypatch, 512 << 20)
    status = main(["demo", "--seconds", "1", "--device", "cpu", "--layers", "8",
                   "--page-size", "256"])
    out, err = capsys.readouterr()
    assert status == 2, out + err
    assert out == ""  # refused before the run began
    assert err.startswith("aiokv demo: error: the sizes asked for do not fit in this "
                          "machine's memory (--users 64, --layers 8, --page-size 256")
    assert "caches 384 MiB + store 192 MiB" in err
    assert err.rstrip().endswith("more than this machine's 512 MiB); ask for less")


def test_demo_sizes_within_memory_run() -> None:
    assert main(["demo", "--seconds", "0.3", "--users", "2", "--device", "cpu",
                 "--layers", "1", "--page-size", "256"]) == 0


@pytest.mark.skipif(machine_memory_bytes() is None, reason="the OS gives no memory size")
def test_bench_shared_sizes_beyond_memory_are_a_usage_error_before_the_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    memory = machine_memory_bytes()
    assert memory is not None
    # Pages of 512 KiB: a server store of about 18 x the machine's memory. The server
    # refused it in its own process, and the bench raised its log as a RuntimeError.
    tokens = 16 * -(-memory // (512 << 10))
    status = main(["bench", "shared", "--processes", "1", "--tokens", str(tokens),
                   "--hit-users", "1", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert status == 2, out + err
    assert err.startswith("aiokv bench shared: error: the sizes asked for do not fit in "
                          f"this machine's memory (--processes 1, --users 8, --batches 1, "
                          f"--tokens {tokens},")
    assert "server store " in err and err.rstrip().endswith("; ask for less")


def test_an_error_that_is_not_about_memory_is_not_called_a_usage_error() -> None:
    assert flags.too_large(RuntimeError("CUDA error: an illegal memory access")) is None
    assert flags.too_large(ValueError("out of memory")) is None  # not torch's allocator
    assert flags.too_large(MemoryError()) is not None


def _has_pages(module: object) -> bool:
    settings = getattr(module, "Settings", None)
    return settings is not None and {"tokens", "page_size"} <= {
        f.name for f in dataclasses.fields(settings)}


@pytest.mark.parametrize("bench", [m.NAME for m in SUBCOMMANDS if _has_pages(m)])
def test_tokens_fewer_than_one_page_are_a_usage_error_naming_the_flag(
    bench: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", bench, "--quick", "--page-size", "16", "--tokens", "8",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--tokens: 8 is fewer than one page of --page-size 16" in err
