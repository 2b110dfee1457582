"""Every example runs as a user would run it (a subprocess, from the repository root)
and checks itself: loads bit for bit, and the web apps' answers over real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_asyncio_serving_many_users_verify_their_loads() -> None:
    result = run_example("asyncio_serving.py", "--users", "32", "--steps", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "128 steps of 32 users" in result.stdout
    assert ", 0 mismatched" in result.stdout
    loaded = int(result.stdout.split(" tokens loaded")[0].split()[-1])
    assert loaded > 0  # later steps found their history in the store


def test_threaded_client_through_the_facade() -> None:
    result = run_example("threaded_client.py", "--threads", "4", "--steps", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 threads:" in result.stdout and ", 0 mismatched" in result.stdout


@pytest.mark.parametrize("app", ["fastapi_app.py", "aiohttp_app.py"])
def test_web_app_self_test_serves_real_requests(app: str) -> None:
    result = run_example(app, "--self-test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-test on port" in result.stdout and ": ok" in result.stdout
    assert "FAILED" not in result.stdout


def test_shared_host_workers_hit_what_any_of_them_offloaded() -> None:
    """Requests of a user on random workers: on one store-server every history page
    comes back (bit for bit); on private stores only where the user's last request
    landed on the same worker."""
    shared = run_example("shared_host.py", "--workers", "3", "--users", "12", "--steps", "4")
    assert shared.returncode == 0, shared.stdout + shared.stderr
    assert "72 of 72 history pages came back from the store (100%), 0 mismatched" in (
        shared.stdout)
    private = run_example("shared_host.py", "--workers", "3", "--users", "12", "--steps",
                          "4", "--private")
    assert private.returncode == 0, private.stdout + private.stderr
    assert "private stores" in private.stdout and ", 0 mismatched" in private.stdout
    loaded = int(private.stdout.split(" of 72 history pages")[0].split()[-1])
    assert 0 < loaded < 72
