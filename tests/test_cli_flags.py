"""The command line's numeric flags refuse values that make no sense (negative, zero where
zero means nothing, nan, inf) as argparse usage errors: exit status 2 and a message naming
the flag and the value, before anything runs (they were ConfigError tracebacks, other
tracebacks, or runs of nonsense that exited 0). Zero stays allowed where the help says
what it means."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import aiokv.demo
import aiokv.stores.shared.command
from aiokv import flags
from aiokv.bench import SUBCOMMANDS
from aiokv.bench import build_parser as bench_parser
from aiokv.bench.common import add_settings_arguments, or_zero
from aiokv.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
SERVER = ["store-server", "--socket", "/nonexistent/aiokv.sock", "--config", "x.yml"]

REFUSED = [
    (["bench", "engine", "--cpu-cache-gb"], "-1"),
    (["bench", "engine", "--seconds"], "-1"),
    (["bench", "engine", "--warmup-s"], "-0.5"),
    (["bench", "engine", "--poll-interval-us"], "0"),
    (["bench", "engine", "--users"], "0"),
    (["bench", "engine", "--heads"], str(2**64)),  # past an int64: a traceback at start
    (["bench", "lag", "--tokens"], "99999999999999999999"),
    (["bench", "bandwidth", "--repeats"], "0"),
    (["bench", "bandwidth", "--raw-gib"], "nan"),
    (["bench", "bandwidth", "--tokens"], "64,-5"),
    (["bench", "bandwidth", "--users"], f"8,{2**63}"),
    (["bench", "lag", "--users"], "0"),
    (["bench", "lag", "--tokens"], "-5"),
    (["bench", "lag", "--seconds"], "inf"),
    (["bench", "ssd", "--rounds"], "0"),
    (["bench", "ssd", "--gb"], "-1"),
    (["bench", "ssd", "--host-gb"], "0"),
    (["bench", "startup", "--gib"], "-1"),
    (["bench", "shared", "--processes"], "0"),
    (["bench", "shared", "--round-trips"], "0"),
    (["bench", "slots", "--seed"], "-1"),
    (["bench", "slots", "--repeats"], "1.5"),
    (["bench", "layers", "--page-size"], "0"),
    (["bench", "model", "--depth"], "-1"),
    (["bench", "model", "--model-s"], "0"),
    (["demo", "--users"], "0"),
    (["demo", "--seconds"], "-1"),
    (["demo", "--seed"], "-1"),
    (["demo", "--seed"], str(2**64)),  # beyond torch's uint64 seed: a traceback at start
    (["demo", "--history-pages"], "2"),
    ([*SERVER, "--drain-timeout"], "-1"),
]


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that gets past the parser fails the test at once rather than run the
    command (full-size benchmarks, on a shared box)."""

    def ran(args: argparse.Namespace) -> int:
        raise AssertionError(f"the command ran with {args}")

    for module in SUBCOMMANDS:
        monkeypatch.setattr(module, "run", ran)
    monkeypatch.setattr(aiokv.demo, "demo", ran)
    monkeypatch.setattr(aiokv.stores.shared.command, "run", ran)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2, argv
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(("command", "value"), REFUSED, ids=lambda x: " ".join(x)
                         if isinstance(x, list) else x)
def test_a_value_out_of_range_is_a_usage_error_naming_the_flag_and_value(
    command: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error([*command, value], capsys)
    assert f"argument {command[-1]}: " in err and repr(value) in err, err


def _commands() -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """Every command line's parser: demo, store-server and each bench."""
    for prefix, parser in (([], build_parser()), (["bench"], bench_parser())):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name != "bench":  # listed for --help only
                        yield [*prefix, name], sub


def _numeric_flags() -> list[tuple[list[str], str]]:
    found = []
    for command, parser in _commands():
        for action in parser._actions:
            kind = action.type
            if kind in (flags.output_file, flags.existing_directory):  # paths
                continue
            if kind in (int, float) or getattr(kind, "__module__", "") == flags.__name__:
                found.append((command, action.option_strings[-1]))
    return found


NUMERIC = _numeric_flags()


def test_every_numeric_flag_is_range_checked() -> None:
    assert len(NUMERIC) > 80, NUMERIC  # the survey found them all
    for command, parser in _commands():
        for action in parser._actions:
            assert action.type not in (int, float), (command, action.option_strings)


@pytest.mark.parametrize(("command", "flag"), NUMERIC, ids=lambda x: " ".join(x)
                         if isinstance(x, list) else x)
def test_every_numeric_flag_refuses_a_negative_value(
    command: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if command[0] == "store-server":
        command = SERVER
    err = _usage_error([*command, flag, "-1"], capsys)
    assert f"argument {flag}: " in err and "'-1'" in err, err


def test_zero_still_parses_where_it_means_something() -> None:
    parser = bench_parser()
    args = parser.parse_args(["bandwidth", "--cpu-cache-gb", "0", "--warmup", "0",
                              "--batch-requests", "0", "--stream-batches", "0",
                              "--stream-gib", "0", "--switch-interval-us", "0"])
    assert (args.cpu_cache_gb, args.warmup, args.stream_gib) == (0.0, 0, 0.0)
    args = parser.parse_args(["lag", "--idle-seconds", "0", "--tick-us", "0",
                              "--window-us", "0", "--cpu-cache-gb", "0"])
    assert (args.idle_seconds, args.tick_us, args.window_us) == (0.0, 0, 0)
    args = parser.parse_args(["engine", "--warmup-s", "0", "--window-us", "0"])
    assert (args.warmup_s, args.window_us) == (0.0, 0)
    assert parser.parse_args(["slots", "--seed", "0", "--warmup", "0"]).seed == 0
    assert parser.parse_args(["model", "--depth", "all,0,4", "--warmup", "0"]).depth == "all,0,4"
    assert parser.parse_args(["layers", "--warmup", "0"]).warmup == 0
    args = build_parser().parse_args(["demo", "--history-pages", "0", "--seed", "0"])
    assert (args.history_pages, args.seed) == (0, 0)
    args = build_parser().parse_args([*SERVER, "--drain-timeout", "0"])
    assert args.drain_timeout == 0.0


def test_a_settings_default_its_own_flag_would_refuse_is_caught_when_the_parser_is_built(
) -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        seed: int = 0  # zero is meant: wants or_zero

    with pytest.raises(ValueError, match=r"Settings\.seed: --seed refuses '0'"):
        add_settings_arguments(argparse.ArgumentParser(), Settings, {}, {})

    @dataclasses.dataclass(frozen=True)
    class Fixed:
        seed: int = or_zero(0)

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, Fixed, {}, {})
    assert parser.parse_args(["--seed", "0"]).seed == 0


def test_the_aiokv_command_exits_2_naming_the_flag() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aiokv.cli", "bench", "engine", "--cpu-cache-gb", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "argument --cpu-cache-gb: expected a finite number > 0, got '-1'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["bench", "engine", "--quick", "--json"],
                                     ["bench", "ssd", "--plot"], ["bench", "ssd", "--dir"]])
def test_a_path_flag_whose_directory_is_missing_is_a_usage_error_before_the_run(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "no-such-dir" / "out.json")
    err = _usage_error([*command, missing], capsys)
    assert f"argument {command[-1]}: " in err and "no-such-dir" in err, err


def test_bench_ssd_takes_only_a_device_it_knows(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["bench", "ssd", "--device", "foo"], capsys)
    assert "argument --device: invalid choice: 'foo'" in err, err



@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_file_that_is_a_directory_is_a_usage_error(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was accepted, and the run ended, once over, in an IsADirectoryError traceback.
    err = _usage_error(["bench", "slots", "--quick", flag, str(tmp_path)], capsys)
    assert f"argument {flag}: {str(tmp_path)!r} is a directory" in err, err
