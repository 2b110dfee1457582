"""Run a benchmark under a variant of the GIL choreography, to ask whether the control
path's time is GIL hand-offs between the caller, the loop, the store and copy threads.

    python benchmarks/gil_variants.py VARIANT[,VARIANT...] (-m MODULE | SCRIPT) ARGS...

    base   nothing changed
    swi    sys.setswitchinterval(1e-4): a waiting thread asks for the GIL after 0.1 ms
           instead of 5 ms
    yield  the store thread sleeps 50 us after handing a job to the copy thread, so that
           the copy thread runs before the loop and the caller
    spin   a copy thread's stream synchronize first spins on query() (GIL held) for up
           to 300 us, so that it does not give the GIL away while the ids come over

Example: ``python benchmarks/gil_variants.py swi,yield benchmarks/hops.py --device cuda``.
The variants patch the running process only (nothing in aiokv changes).
"""

from __future__ import annotations

import runpy
import sys
import time
from typing import Any


def apply(variants: list[str]) -> None:
    if "swi" in variants:
        sys.setswitchinterval(1e-4)
    if "yield" in variants:
        from aiokv.copy import copier

        submit = copier.Copier.submit

        def yielding(self: Any, job: Any) -> None:
            submit(self, job)
            time.sleep(50e-6)

        copier.Copier.submit = yielding  # type: ignore[method-assign]
    if "spin" in variants:
        import torch

        synchronize = torch.cuda.Stream.synchronize

        def spinning(self: Any) -> None:
            end = time.perf_counter() + 300e-6
            while time.perf_counter() < end:
                if torch._C._CudaStreamBase.query(self):
                    return
            synchronize(self)

        torch.cuda.Stream.synchronize = spinning  # type: ignore[method-assign]


def main() -> None:
    variants, args = sys.argv[1].split(","), sys.argv[2:]
    unknown = set(variants) - {"base", "swi", "yield", "spin"}
    if unknown or not args:
        raise SystemExit(__doc__)
    apply(variants)
    print(f"== variant {'+'.join(variants)}", flush=True)
    run(args)


def run(args: list[str]) -> None:
    """Run ``SCRIPT [ARGS]`` or ``-m MODULE [ARGS]`` as ``python`` would, in this process."""
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
