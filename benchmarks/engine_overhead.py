"""The issue's CPU benchmark: the engine against a per-request baseline, and the
engine's CPU time per request at batch 64. ``python benchmarks/engine_overhead.py
[--quick] [--users 1,8,64,256] [--json PATH] [--plot PATH]``; the same as
``python -m aiokv.bench engine``, whose flags it takes."""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokv.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["engine", *sys.argv[1:]], prog="benchmarks/engine_overhead.py"))
