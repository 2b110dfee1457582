"""``aiokv store-server --socket PATH --config FILE``: the command line of the host's
store server (:mod:`.server`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ...config_file import load_config
from ...errors import ConfigError
from ...flags import nonnegative_float

DESCRIPTION = """\
One store per host, shared by every serving process on it: the server owns the index,
the host tier (one shared memory region the engines map) and the SSD tier; engines
point at it with `store: {backend: shared, socket: PATH}` and copy their own pages.
FILE is a YAML config whose `store:` section has the embedded store's keys
(cpu_cache_gb, ssd_cache_gb, ssd_cache_dir, ssd_write_policy, remote, ...); its
`engine:` section is checked, not used. With `remote` (a Mooncake Store tier below host and SSD,
configs/remote.yml) the server exits 2 at start where Mooncake's client cannot load. The
cache geometry (layers, page size, heads, head_dim, dtype) is taken from the first
engine that connects; an engine with another one is refused.

Only processes of this server's uid may connect. The socket's directory must be private
to that uid (it is created 0700 when missing). SIGTERM drains: no new work is taken,
open tasks may finish (--drain-timeout), SSD writes complete, exit status 0. The SSD
tier survives a restart; the host tier does not. A second server on the same socket or
SSD directory refuses to start, naming the one that holds it. SIGUSR1 writes the stack of
every thread to stderr (the log) and the server goes on: where one that seems stuck is.

Under systemd (a user unit, so that the socket and region belong to your uid):

  # ~/.config/systemd/user/aiokv-store.service
  [Unit]
  Description=aiokv store server
  [Service]
  ExecStart=/path/to/venv/bin/aiokv store-server \\
      --socket %t/aiokv/store.sock --config %h/aiokv/store.yml
  KillSignal=SIGTERM
  TimeoutStopSec=40
  Restart=on-failure
  [Install]
  WantedBy=default.target

  systemctl --user enable --now aiokv-store   (%t is $XDG_RUNTIME_DIR, private to you)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", required=True, metavar="PATH",
                        help="the UNIX socket to listen on (its directory: private to you)")
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="YAML config; its store: section sizes the tiers")
    parser.add_argument("--drain-timeout", type=nonnegative_float, default=30.0, metavar="S",
                        help="seconds SIGTERM waits for open tasks (default 30)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    from .server import StoreServer

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("aiokv.server")
    try:
        _, store = load_config(args.config)
        server = StoreServer(args.socket, store, drain_timeout_s=args.drain_timeout)
        server.start(handle_signals=True)
    except ConfigError as exc:
        log.error("aiokv store-server: %s", exc)
        return 2
    server.serve()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiokv store-server", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
