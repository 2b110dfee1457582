"""What a user gets from the installed package: the packaged defaults, open_engine's
config sources, --version, the license, and annotations that a strict mypy accepts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch

import aiokv
from aiokv.cli import main
from aiokv.open import read_config

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_packaged_defaults_are_configs_default_yml() -> None:
    packaged = ROOT / "aiokv" / "default.yml"
    assert packaged.read_bytes() == (ROOT / "configs" / "default.yml").read_bytes()
    assert read_config(None) == aiokv.load_config(packaged)
    package_data = PROJECT["tool"]["setuptools"]["package-data"]["aiokv"]
    assert {"py.typed", "default.yml"} <= set(package_data)
    assert (ROOT / "aiokv" / "py.typed").exists()


def test_read_config_takes_a_path_a_mapping_or_none(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("engine:\n  window_us: 7\nstore:\n  cpu_cache_gb: 0.5\n")
    from_path = read_config(path)
    from_str = read_config(str(path))
    from_mapping = read_config({"engine": {"window_us": 7}, "store": {"cpu_cache_gb": 0.5}})
    assert from_path == from_str == from_mapping
    assert from_mapping[0].window_us == 7 and from_mapping[1].cpu_cache_gb == 0.5
    assert read_config(None)[0].window_us == aiokv.EngineConfig().window_us


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"engine": {"window_usec": 1}}, "engine.window_usec"),
        ({"store": {"backend": "redis"}}, "store.backend"),
        ({"stores": {}}, "stores"),
        (42, "config"),
        ("/nonexistent/aiokv.yml", "path"),
    ],
)
def test_open_engine_rejects_a_bad_config_naming_the_key(config: object, key: str) -> None:
    with pytest.raises(aiokv.ConfigError) as info:
        aiokv.open_engine(config, kv_caches=[torch.zeros(4, 2, 4, 1, 8)])  # type: ignore[arg-type]
    assert info.value.key == key


@pytest.mark.asyncio
async def test_open_engine_on_the_packaged_defaults_round_trips(
    aiokv_kv_caches: list[torch.Tensor],
) -> None:
    caches = aiokv_kv_caches
    async with aiokv.open_engine(None, kv_caches=caches) as engine:
        assert (await engine.offload(1, torch.arange(0, 2), 8)).stored_tokens == 8
        async with await engine.lookup(1, 8) as hit:
            await engine.load(hit, torch.arange(2, 4))
    assert all(torch.equal(c[2:4], c[0:2]) for c in caches)


def test_version_from_the_cli_and_python_m(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"aiokv {aiokv.__version__}"
    assert aiokv.__version__ == PROJECT["project"]["version"]
    commands = [[sys.executable, "-m", "aiokv", "--version"]]
    script = Path(sys.executable).with_name("aiokv")  # the console script, where installed
    if script.exists():
        commands.append([str(script), "--version"])
    # Started together: each start (an interpreter, torch) takes seconds, on a core each.
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=_env()) for command in commands]
    try:
        for run in runs:
            stdout, _ = run.communicate(timeout=120)
            assert (run.returncode, stdout.strip()) == (0, f"aiokv {aiokv.__version__}")
    finally:
        for run in runs:  # one that timed out, or was not waited for
            if run.poll() is None:
                run.kill()
                run.communicate()


def test_the_license_file_is_the_apache_2_text() -> None:
    assert PROJECT["project"]["license"] == "Apache-2.0"
    assert PROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


DOWNSTREAM = '''
import asyncio
import concurrent.futures

import torch

import aiokv


async def serve(caches: list[torch.Tensor]) -> int:
    async with aiokv.open_engine(None, kv_caches=caches) as engine:
        result: aiokv.OffloadResult = await engine.offload(1, torch.arange(2), 8)
        hit: aiokv.Lookup = await engine.lookup(1, 8)
        loaded: aiokv.LoadResult = await engine.load(hit, torch.arange(2, 4))
        stats: aiokv.EngineStats = engine.stats()
        return result.stored_tokens + loaded.loaded_tokens + stats.completed


def threaded(engine: aiokv.OffloadEngine) -> int:
    with aiokv.run_in_background(engine) as kv:
        future: concurrent.futures.Future[aiokv.OffloadResult] = kv.submit_offload(
            "u", torch.arange(2), 8
        )
        with kv.lookup("u", 8) as hit:
            return future.result().cached_tokens + hit.cached_tokens


def configs() -> tuple[aiokv.EngineConfig, aiokv.StoreConfig]:
    try:
        return aiokv.load_config("x.yml")
    except aiokv.ConfigError as exc:
        print(exc.key)
        raise


asyncio.run(serve([torch.zeros(4, 2, 4, 1, 8)]))
'''


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def test_a_downstream_strict_mypy_accepts_the_import(tmp_path: Path) -> None:
    # Run outside the repository, so that only aiokv's own markers (py.typed) and
    # annotations decide, as for a user who installed the wheel.
    (tmp_path / "downstream.py").write_text(textwrap.dedent(DOWNSTREAM))
    result = subprocess.run(
        # No cache written (/dev/null): a run of its own, and some 2,000 modules less to write.
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", os.devnull,
         "downstream.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout
