"""``pathways controller``: run a controller; prints its address on stdout.

Run a controller. Once serving, it prints `PATHWAYS_CONTROLLER_ADDRESS grpc://HOST:PORT` on
stdout: the address clients and workers use.
"""

from __future__ import annotations

import argparse

from pathways.cli.common import run_timeout_flag, scheduling_flags
from pathways.controller.islands import Recovery
from pathways.defaults import HEARTBEAT_TIMEOUT
from pathways.wire import security


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="where clients and workers reach it (default 127.0.0.1:0: this machine only, "
                             "any free port). Its gRPC server takes PORT; workers' streams take another "
                             "free port of HOST, which workers learn from the controller. With a wildcard "
                             "host (0.0.0.0, or [::] for IPv6) it serves on every address of the machine "
                             "and prints the address of the interface its default route uses (without a "
                             "default route, its first address that is not loopback); peers may use any "
                             "address of the machine")
    parser.add_argument("--ifrt-bind", metavar="HOST:PORT", default=None,
                        help="also serve unmodified JAX programs (JAX_PLATFORMS=proxy) over the IFRT proxy "
                             "protocol there, e.g. 127.0.0.1:0; prints `ifrt grpc://HOST:PORT` on the line "
                             "after its address. Beyond loopback it requires the token, like --bind")
    scheduling_flags(parser)
    security.add_flags(parser, server=True, data_plane=False)
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT, metavar="S",
                        help="seconds a worker may send nothing (not even a heartbeat) before it is judged: "
                             "slow (kept, marked in status) while its host still acknowledges, lost (its "
                             "island marked unhealthy) once its host acknowledged nothing for as long "
                             f"(default {HEARTBEAT_TIMEOUT:g})")
    run_timeout_flag(parser)
    parser.add_argument("--host-recovery", choices=[r.value for r in Recovery], default=Recovery.ELSEWHERE.value,
                        help="who brings a lost host back, as errors and `pathways status` say it: hosts started "
                             "elsewhere, by hand or a scheduler (elsewhere, the default); the local cluster that "
                             "started this controller, which restarts its workers (restart); nothing (none)")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways.controller.server import main
    from pathways.keeper import exit_with_parent

    exit_with_parent()
    # the IFRT front end is the ifrt package's: the controller package imports none of it
    from pathways.ifrt import front_end

    main(args.policy, args.window, args.bind, security.from_args(args), args.heartbeat_timeout, args.ifrt_bind,
         args.run_timeout, Recovery(args.host_recovery), start_front_end=front_end.start)
    return 0
