"""The shared tier's soak, quick (benchmarks/shared_soak.py --quick, about 14 s): two
engine processes on one store-server, users on any of them, evicts racing loads, an
engine killed and the server killed and restarted on the way. No load gives KV an evict
had dropped or KV of no epoch, every request is answered, and the server holds nothing
once the engines are gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="the shared region needs memfd_create (Linux)")


def test_quick_shared_soak_loads_nothing_stale_through_kills(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "shared_soak.py"), "--quick", "--json",
         str(out)], capture_output=True, text=True, timeout=240, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text(encoding="utf-8"))
    assert figures["stale_loads"] == figures["corrupt_loads"] == figures["unanswered"] == 0
    # Loads were checked, page by page (--quick goes on until 600 are: a slow runner
    # checked fewer than this in its 9 s).
    assert figures["loads_checked"] > 500
    outcomes = figures["outcomes"]
    assert outcomes["evict:ok"] > 100 and outcomes["engines_killed"] >= 1
    assert outcomes["server_restarts"] >= 1
    after = figures["server_after"]
    assert after["server_tasks_open"] == after["server_blocks_held"] == 0
    # Held gets were taken back on the way (by any of the server's starts).
    assert figures["server_gets_invalidated_total"] > 0
