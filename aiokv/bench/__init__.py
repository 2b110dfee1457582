"""``python -m aiokv.bench {engine,slots,bandwidth,lag,ssd,startup,model,layers,shared}``
(also ``aiokv bench ...``).

Each subcommand is one module with ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status); they share :mod:`aiokv.bench.common`. Every
subcommand takes ``--json PATH``, ``--plot PATH`` and ``--quick``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import AiokvError, ConfigError
from ..flags import too_large
from ..stores.base import TooLarge
from . import bandwidth, engine, lag, layers, model, shared, slots, ssd, startup
from .common import common_parent

SUBCOMMANDS = (engine, slots, bandwidth, lag, ssd, startup, model, layers, shared)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m aiokv.bench",
        description="aiokv benchmarks. Each prints a table; --json and --plot save results.",
    )
    commands = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    parent = common_parent()
    for module in SUBCOMMANDS:
        sub = commands.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.__doc__,
            parents=[parent],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run one benchmark; its exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.bench_argv = list(argv) if argv is not None else None
    try:
        status: int = args.run(args)
    except (ConfigError, TooLarge) as exc:
        # Flags the parser cannot judge alone (a host tier too small for one block of the
        # pages asked for, pages larger than the store takes): a usage error too.
        print(f"{parser.prog} {args.bench}: error: {exc}", file=sys.stderr)
        return 2
    except AiokvError as exc:  # the store cannot serve (a store server not running, say)
        print(f"{parser.prog} {args.bench}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as exc:
        if (message := too_large(exc)) is None:
            raise
        print(f"{parser.prog} {args.bench}: error: {message}", file=sys.stderr)
        return 2
    return status


__all__ = ["SUBCOMMANDS", "build_parser", "main"]
