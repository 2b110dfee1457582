"""The soak's quick run (benchmarks/soak.py --quick, about 5,000 requests), in CI: with
faults injected and 30% of calls cancelled, nothing is lost or leaked, the store contract
holds and every load that succeeded is bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every verb may raise (tests/test_store_faults.py reduces cancel and try_wait to one fault).
ERROR_VERBS = "put_match,get_match,launch,cancel,try_wait"


def test_quick_soak_loses_nothing_and_loads_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick",
         "--error-verbs", ERROR_VERBS, "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text(encoding="utf-8"))
    assert figures["lost"] == figures["leaked_tasks"] == figures["violations"] == 0, figures
    assert figures["mismatches"] == 0 and figures["loop_errors"] == []
    assert figures["loads_checked"] > 0  # loads were checked, bit for bit
    assert figures["evicts"] > 0  # and evictions ran among them
    assert figures["requests"] >= 4_500 and figures["resolved"] == figures["requests"]
    # The faults and cancellations really happened, and were told apart.
    assert figures["failed_as_injected"] > 0 and figures["cancelled"] > 0
    assert figures["injected"].get("failed", 0) > 0
    engine = figures["engine"]
    assert engine["pending"] == engine["store_tasks_open"] == 0
