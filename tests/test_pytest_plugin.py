"""The pytest plugin: a user's test files, run by a pytest session of their own, use its fixtures."""

from __future__ import annotations

import dataclasses
import subprocess
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import PLUGIN_INSTALLED

import aiokv
from aiokv.pytest_plugin import DEFAULT_GEOMETRY, leaks

ROOT = Path(__file__).resolve().parents[1]

USER_TESTS = '''
import asyncio

import pytest
import torch

import aiokv
from aiokv.pytest_plugin import engine_fixture

shared_engine = engine_fixture(scope="module")


@pytest.mark.asyncio
async def test_round_trip(aiokv_engine, aiokv_kv_caches):
    assert aiokv_engine.state is aiokv.EngineState.RUNNING
    assert (await aiokv_engine.offload(1, torch.arange(0, 4), 16)).stored_tokens == 16
    async with await aiokv_engine.lookup(1, 16) as hit:
        await aiokv_engine.load(hit, torch.arange(10, 14))
    assert all(torch.equal(c[10:14], c[0:4]) for c in aiokv_kv_caches)


@pytest.mark.asyncio
async def test_each_test_gets_a_fresh_engine(aiokv_engine):
    async with await aiokv_engine.lookup(1, 16) as hit:
        assert hit.cached_tokens == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_module_engine_first(shared_engine):
    assert (await shared_engine.offload("alice", torch.arange(0, 2), 8)).stored_tokens == 8


@pytest.mark.asyncio(loop_scope="module")
async def test_module_engine_second_sees_the_first(shared_engine):
    assert asyncio.get_running_loop() is shared_engine._loop
    async with await shared_engine.lookup("alice", 8) as hit:
        assert hit.cached_tokens == 8
'''

USER_OVERRIDES = '''
import asyncio

import pytest
import torch

import aiokv
from aiokv.pytest_plugin import make_kv_caches


@pytest.fixture
def aiokv_kv_caches():
    return make_kv_caches(pages=16, page_size=8)


@pytest.fixture
def aiokv_engine_config():
    return aiokv.EngineConfig(window_us=10_000_000, max_batch_requests=2)


@pytest.mark.asyncio
async def test_overridden_geometry_and_config(aiokv_engine):
    assert aiokv_engine.page_size == 8
    results = await asyncio.gather(
        *(aiokv_engine.offload(u, torch.arange(2 * u, 2 * u + 2), 16) for u in range(4))
    )
    assert [r.stored_tokens for r in results] == [16] * 4
    assert aiokv_engine.stats().batches == 2  # only max_batch_requests flushes a 10 s window
'''


USER_MODULE_LOOP = '''
import asyncio

import pytest
import torch

pytestmark = pytest.mark.asyncio(loop_scope="module")
loops = []


async def test_first(aiokv_engine):
    assert aiokv_engine._loop is asyncio.get_running_loop()
    loops.append(asyncio.get_running_loop())
    assert (await aiokv_engine.offload(1, torch.arange(0, 1), 4)).stored_tokens == 4


async def test_second_a_fresh_engine_on_the_same_loop(aiokv_engine):
    assert aiokv_engine._loop is asyncio.get_running_loop() is loops[0]
    async with await aiokv_engine.lookup(1, 4) as hit:
        assert hit.cached_tokens == 0
'''


def run_user_suite(
    pytester: pytest.Pytester, files: dict[str, str], ini: str = ""
) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (pytester.path / name).write_text(textwrap.dedent(text))
    (pytester.path / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\n" + ini)
    # Where the entry point is installed (a fresh `make setup`), pytest loads the plugin by
    # itself, as it would for a user; an older install of this checkout needs -p.
    plugin = [] if PLUGIN_INSTALLED else ["-p", "aiokv.pytest_plugin"]
    # In this process: a session of its own (its config, plugins, modules and working
    # directory), without an interpreter and torch to start for it. The warnings its
    # configure shows (a user's ini without asyncio_default_fixture_loop_scope) go to its
    # stderr, as from a process of its own, not to this test's.
    with warnings.catch_warnings(record=True) as shown:
        result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", *plugin)
    stderr = "".join(f"{w.category.__name__}: {w.message}\n" for w in shown)
    return subprocess.CompletedProcess("pytest", int(result.ret), result.stdout.str(),
                                       result.stderr.str() + stderr)


def test_a_users_suite_runs_on_the_fixtures(pytester: pytest.Pytester) -> None:
    result = run_user_suite(
        pytester, {"test_user.py": USER_TESTS, "test_overrides.py": USER_OVERRIDES}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout


def test_the_engine_fixture_follows_the_default_fixture_loop_scope(
    pytester: pytest.Pytester,
) -> None:
    # A suite whose tests share a module's loop sets pytest-asyncio's default fixture
    # loop scope to match; aiokv_engine then starts on that loop, once per test.
    result = run_user_suite(
        pytester,
        {"test_module_loop.py": USER_MODULE_LOOP},
        ini="asyncio_default_fixture_loop_scope = module\n",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


USER_LEAKS = '''
import pytest
import torch

pytestmark = pytest.mark.asyncio

async def test_leaves_a_lookup_held(aiokv_engine):
    await aiokv_engine.offload(1, torch.arange(0, 1), 4)
    await aiokv_engine.lookup(1, 4)  # never loaded or released

async def test_leaves_nothing(aiokv_engine):
    async with await aiokv_engine.lookup(1, 4):
        pass
'''


def test_a_test_that_leaves_a_lookup_behind_fails(pytester: pytest.Pytester) -> None:
    result = run_user_suite(pytester, {"test_leaks.py": USER_LEAKS})
    assert "2 passed, 1 error" in result.stdout, result.stdout  # its teardown fails
    assert "the test left 1 store tasks matched or launched, not terminal" in result.stdout


def test_pyproject_declares_the_entry_point() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"aiokv": "aiokv.pytest_plugin"}


@pytest.mark.asyncio
async def test_leaks_names_what_a_closed_engine_left(aiokv_engine: aiokv.OffloadEngine) -> None:
    clean = aiokv_engine.stats()
    assert leaks(clean) == []
    left = leaks(dataclasses.replace(clean, pending=2, store_tasks_open=1))
    assert left == [
        "2 requests accepted and never resolved",
        "1 store tasks matched or launched, not terminal",
    ]


def test_default_caches_have_the_documented_geometry(aiokv_kv_caches: list[torch.Tensor]) -> None:
    layers, pages, page_size, heads, head_dim = DEFAULT_GEOMETRY
    assert len(aiokv_kv_caches) == layers
    assert {tuple(c.shape) for c in aiokv_kv_caches} == {(pages, 2, page_size, heads, head_dim)}
    assert not torch.equal(aiokv_kv_caches[0][0], aiokv_kv_caches[0][1])


@pytest.mark.asyncio
async def test_the_engine_fixture_runs_on_the_tests_loop(aiokv_engine: aiokv.OffloadEngine) -> None:
    import asyncio

    assert aiokv_engine._loop is asyncio.get_running_loop()
    assert (await aiokv_engine.offload(0, torch.arange(0, 1), 4)).stored_tokens == 4
