"""Which thread holds the GIL when a thread that wants it waits: run a script with a probe
thread that sleeps 1 ms at a time; where its wake-up comes late by more than
``--late-ms``, it records where every other thread is at that moment.

    python benchmarks/gil_holders.py [--late-ms 1] [--after-s 0] [--top 25]
        SCRIPT | -m MODULE [ARGS...]

A sleep gives the GIL back; waking, the probe needs it again. A thread that runs Python
without a blocking call keeps it until Python's switch interval (5 ms) forces a switch,
and that thread is then frozen where it was preempted: its frame is the one to blame. A
thread shown in a blocking call (a socket's select, a queue's wait, a driver or Mooncake
call that lets the GIL go) was not holding it. On a box with few cores, a late wake-up is
as often the scheduler (every core busy) as the GIL: read the figures on a host with
cores to spare. The probe's own wake-ups add a little contention of their own.

``--after-s``: record nothing in the first seconds (imports and start-up hold the GIL
in long stretches of their own). Prints, at exit, the late wake-ups' count and delays
and the most frequent stacks (the three innermost frames of each other thread, its name
first).
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gil_variants import run  # the same runner: a script or -m MODULE

late_ms = 1.0
after_s = 0.0
top = 25
stacks: collections.Counter[str] = collections.Counter()
delays: list[float] = []
wakes = [0]


def where(frame: object, name: str) -> str:
    innermost = traceback.extract_stack(frame)[-3:]  # type: ignore[arg-type]
    return f"{name[:26]:<26} " + " <- ".join(
        f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(innermost))


def probe() -> None:
    me = threading.get_ident()
    time.sleep(after_s)
    while True:
        began = time.perf_counter()
        time.sleep(0.001)
        delay = (time.perf_counter() - began) * 1e3 - 1.0
        wakes[0] += 1
        if delay <= late_ms:
            continue
        delays.append(delay)
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident != me:
                stacks[where(frame, names.get(ident, "?"))] += 1


def report() -> None:
    out = sys.stderr
    delays.sort()
    print(f"\n[gil] {len(delays)} of {wakes[0]} wake-ups late by more than {late_ms} ms",
          file=out)
    if delays:
        print(f"[gil] late by: median {delays[len(delays) // 2]:.2f} ms, "
              f"max {delays[-1]:.2f} ms", file=out)
    for stack, count in stacks.most_common(top):
        print(f"[gil] {count:5d}  {stack}", file=out)


def main() -> None:
    global late_ms, after_s, top
    args = sys.argv[1:]
    while args and args[0] in ("--late-ms", "--after-s", "--top"):
        if args[0] == "--late-ms":
            late_ms = float(args[1])
        elif args[0] == "--after-s":
            after_s = float(args[1])
        else:
            top = int(args[1])
        args = args[2:]
    if not args:
        raise SystemExit(__doc__)
    atexit.register(report)
    threading.Thread(target=probe, daemon=True, name="gil-probe").start()
    run(args)


if __name__ == "__main__":
    main()
