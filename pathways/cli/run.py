"""``pathways run``: run an unmodified JAX script on an embedded local cluster (IFRT proxy).

Start a local cluster whose controller serves the IFRT proxy protocol, run the script with
JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET set (no pathways import needed in it), stop the
cluster, and exit with the script's code.
"""

from __future__ import annotations

import argparse

from pathways.cli.common import island_flags, islands, session_memory_flag
from pathways.wire import security


def add_arguments(parser: argparse.ArgumentParser) -> None:
    island_flags(parser)
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds before the script is stopped (exit code 124; default: no limit)")
    parser.add_argument("--token-file", metavar="PATH",
                        help="file holding a token the cluster requires of every connection (default: "
                             "$PATHWAYS_TOKEN; none); the script is given it as PATHWAYS_TOKEN")
    parser.add_argument("--no-restart-workers", dest="restart_workers", action="store_false",
                        help="leave a worker that dies down (by default it is started again and its island heals)")
    session_memory_flag(parser)
    parser.add_argument("script", help="the Python script, run as `python SCRIPT ARGS...`")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways.ifrt.launch import run_script

    found = islands(parser, args)
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    # The embedded cluster's settings: a token, no TLS (it listens on loopback, and the IFRT
    # proxy client speaks plain gRPC or ALTS only).
    token = security.read_token_file(args.token_file) if args.token_file else security.env_token()
    try:
        return run_script(found, args.script, args.args, security.Security(token=token), args.timeout,
                          restart_workers=args.restart_workers, session_memory=args.session_memory)
    except FileNotFoundError as e:
        parser.error(str(e))
