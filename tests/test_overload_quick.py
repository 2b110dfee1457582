"""benchmarks/overload.py in short (well under a second per phase): behaviour, not speed.
Under ``reject`` the excess is refused with Overloaded raised at submit (the call never
suspends, so it never waited for the store); under ``wait`` it waits and ends as a result
or a RequestTimeout (or, beyond the bound on waiters, is refused at submit); ``pending`` never exceeds max_pending; every call resolves; no
result is resolved after its deadline; the engine serves normally afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overload_is_refused_at_submit_or_waited_for_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    out = tmp_path / "overload.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overload.py"), "--quick", "--seconds", "0.5",
         "--measure-s", "0.3", "--max-pending", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    # Under wait, callers beyond the bound on waiters (aiokv.loop.admission.max_waiting) are
    # refused with Overloaded, at submit like under reject.
    waiting = {"ok", "RequestTimeout", "Overloaded"}
    for policy, allowed in (("reject", {"ok", "Overloaded"}), ("wait", waiting)):
        run = report[policy]
        under = run["overload"]
        assert set(under["outcomes"]) <= allowed, (policy, under["outcomes"])
        assert under["unresolved"] == 0, policy  # every accepted future resolved
        # No result resolved after its deadline (the caller's own `late` also counts the
        # loop's lag in resuming it, so it may not be 0).
        assert under["resolved_late"] == 0, (policy, under)
        assert 0 < under["max_pending_seen"] <= report["max_pending"], policy
        assert under["outcomes"].get("ok", 0) > 0, policy
        # Afterwards the engine serves every call again.
        assert set(run["after"]["outcomes"]) == {"ok"}, (policy, run["after"])
        assert run["engine_pending_at_close"] == run["store_tasks_open_at_close"] == 0
    rejected = report["reject"]["overload"]
    assert rejected["outcomes"].get("Overloaded", 0) > 0
    assert rejected["rejected_after_suspending"] == 0  # raised at submit, never awaited
    assert report["wait"]["overload"]["rejected_after_suspending"] == 0
