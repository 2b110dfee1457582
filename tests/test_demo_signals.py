"""``aiokv demo`` (the README's first command) ends soon after Ctrl-C or SIGTERM, with its
summary and 128 + the signal's number, as a real process sent the real signal."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
START_S = 120.0  # imports and set-up on two busy cores: generous, and bounded
STOP_S = 5.0  # from the signal to the exit, summary printed (the aim is under a second)
SMALL = ["--users", "4", "--layers", "1", "--heads", "1", "--head-dim", "16",
         "--history-pages", "3", "--device", "cpu"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_demo_at_once_with_its_summary(sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "aiokv", "demo", "--seconds", "60", *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert demo.stdout is not None
        ready, _, _ = select.select([demo.stdout], [], [], START_S)
        started = demo.stdout.readline() if ready else ""
        assert "Ctrl-C ends it early" in started, started  # serving now
        sent = time.monotonic()
        demo.send_signal(sig)
        out, err = demo.communicate(timeout=STOP_S * 6)  # bounded even if it hangs
        took_s = time.monotonic() - sent
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 128 + sig, out + err
    assert took_s < STOP_S, f"{took_s:.1f} s from {sig.name} to the exit"
    assert "for 60 s" in started
    assert f"(stopped by {sig.name})" in out, out
    assert "0 mismatches" in out and "requests/s" in out, out
    assert "Traceback" not in err, err
