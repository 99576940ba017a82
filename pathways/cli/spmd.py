"""``pathways spmd``: run a script multi-controller: N processes under jax.distributed.

Run SCRIPT in N processes of one jax.distributed group (CPU devices, collectives over gloo), as
classic multi-controller JAX does; each output line is prefixed with its process's rank. Exits
with 0 when every process does, else with the first failing code.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("processes", type=int, help="number of processes")
    parser.add_argument("script", help="the Python script every process runs as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.add_argument("--devices-per-process", type=int, default=1, metavar="N",
                        help="CPU devices of each process (default 1)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds before the processes are stopped (default 3600)")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways.errors import SpmdError
    from pathways.spmd import launch

    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("spmd needs at least 1 process and 1 device per process")
    try:
        return launch(args.processes, args.script, args.args, args.devices_per_process, args.timeout)
    except SpmdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
