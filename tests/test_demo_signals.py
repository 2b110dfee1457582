"""``aiokv demo`` (the README's first command) stops soon after Ctrl-C or SIGTERM, prints
its summary and exits with 128 + the signal's number: a real process, the real signal."""

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
SUMMARY_S = 5.0  # from the signal to the summary (the aim: well under a second)
EXIT_S = 30.0  # ... and to the exit: the interpreter's teardown of torch takes 0.5-3 s here
SMALL = ["--users", "4", "--layers", "1", "--heads", "1", "--head-dim", "16",
         "--history-pages", "3", "--device", "cpu"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_demo_at_once_with_its_summary(sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "aiokv", "demo", "--seconds", "60", *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )
    assert demo.stdout is not None
    output = bytearray()
    try:
        read_until(demo.stdout.fileno(), b"Ctrl-C ends it early", START_S, output)  # serving
        demo.send_signal(sig)
        summary_s = read_until(demo.stdout.fileno(), b"0 mismatches", SUMMARY_S * 6, output)
        demo.wait(EXIT_S)
        read_until(demo.stdout.fileno(), None, EXIT_S, output)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
    printed = output.decode()
    assert demo.returncode == 128 + sig, printed
    assert summary_s < SUMMARY_S, f"{summary_s:.1f} s from {sig.name} to the summary"
    assert "users on cpu for 60 s" in printed
    assert "aiokv demo: 4 users for " in printed and f"(stopped by {sig.name})" in printed
    assert "requests/s" in printed and "Traceback" not in printed, printed


def read_until(fd: int, text: bytes | None, seconds: float, output: bytearray) -> float:
    """Read ``fd`` into ``output`` until it holds ``text`` (None: until its end); the
    seconds that took. AssertionError when that is not within ``seconds``."""
    start = time.monotonic()
    while text is None or text not in output:
        left = start + seconds - time.monotonic()
        ready = left > 0 and select.select([fd], [], [], left)[0]
        assert ready, f"no {text!r} within {seconds} s: {output.decode()!r}"
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            assert text is None, f"the output ended without {text!r}: {output.decode()!r}"
            break
        output += chunk
    return time.monotonic() - start
