"""The ``aiokv`` command: ``aiokv demo`` (:mod:`aiokv.demo`) and ``aiokv bench ...``
(``python -m aiokv.bench ...``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .flags import integer, nonnegative_int, positive_float, positive_int


def _demo_parser(parser: argparse.ArgumentParser) -> None:
    from .demo import MAX_APPEND_PAGES

    parser.add_argument("--seconds", type=positive_float, default=5.0,
                        help="how long to run (default 5)")
    parser.add_argument("--users", type=positive_int, default=64,
                        help="concurrent users (default 64)")
    parser.add_argument("--layers", type=positive_int, default=4, help="cache layers (default 4)")
    parser.add_argument("--page-size", type=positive_int, default=16,
                        help="tokens per page (default 16)")
    parser.add_argument("--heads", type=positive_int, default=2, help="KV heads (default 2)")
    parser.add_argument("--head-dim", type=positive_int, default=64,
                        help="head dimension (default 64)")
    parser.add_argument(
        "--history-pages",
        # One append adds up to MAX_APPEND_PAGES pages; a smaller budget could not hold it.
        type=integer(MAX_APPEND_PAGES, or_zero=True),
        default=0,
        help=f"page budget of a history before the user restarts, at least "
        f"{MAX_APPEND_PAGES} (default 0: up to 32, fewer to keep the caches under 256 MiB, "
        f"but never under {MAX_APPEND_PAGES}; sizes that do not fit in memory are refused)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--config", metavar="PATH", help="YAML config: its engine settings and store"
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="random seed (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiokv", description="aiokv: an asyncio offload engine for paged GPU KV caches."
    )
    parser.add_argument("--version", action="version", version=f"aiokv {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="simulated serving workload with bit-exact load checks",
        description="A simulated serving workload on the embedded store (or --config's), "
        "under uvloop: users grow append-only histories, offload each append, and now and "
        "then load their history back and check it bit for bit. Ctrl-C or SIGTERM ends it "
        "early with its summary. Exits 1 on any mismatch or failed request, else 128 + "
        "the signal's number when one ended it.",
    )
    _demo_parser(demo)
    from .stores.shared.command import DESCRIPTION, add_arguments

    server = commands.add_parser(
        "store-server",
        help="one store per host, shared by its serving processes (--help: systemd)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(server)
    # Listed for --help only: main() hands everything after "bench" to aiokv.bench.
    commands.add_parser(
        "bench",
        help="benchmarks: aiokv bench "
        "{engine,slots,bandwidth,lag,ssd,startup,model,layers,shared} --help",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aiokv`` console script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(args_list[1:], prog="aiokv bench")
    args = build_parser().parse_args(args_list)
    if args.command == "demo":
        from .demo import demo

        return demo(args)
    if args.command == "store-server":
        from .stores.shared.command import run

        return run(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse requires one


if __name__ == "__main__":
    raise SystemExit(main())
