"""``pathways up``: run a local cluster until Ctrl-C; prints its address.

Run a local cluster (a controller and worker processes on this machine, listening on loopback)
until Ctrl-C. It prints the address to export as PATHWAYS_ADDRESS, with --ifrt-port the IFRT
proxy address for unmodified JAX programs, and for each island the command that adds or
replaces a host. A controller that dies is restarted on the same address, and so are workers
unless --no-restart-workers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Optional

from pathways.cli.common import (island_flags, islands, run_timeout_flag, scheduling_flags, session_memory_flag,
                                 worker_rights_flags)
from pathways.defaults import HEARTBEAT_TIMEOUT
from pathways.wire import security

if TYPE_CHECKING:
    from pathways.cluster import LocalCluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    island_flags(parser)
    scheduling_flags(parser)
    security.add_flags(parser, server=True)
    parser.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                        help=f"seconds of silence after which controller and workers judge each other slow "
                             f"(the host still acknowledges) or lost (default {HEARTBEAT_TIMEOUT:g})")
    run_timeout_flag(parser)
    session_memory_flag(parser)
    parser.add_argument("--restart-workers", action=argparse.BooleanOptionalAction, default=True,
                        help="start a worker that dies (killed, crashed, an error) again, with a back-off: its "
                             "island heals (default); --no-restart-workers leaves it down")
    parser.add_argument("--ifrt-port", type=int, default=None, metavar="PORT",
                        help="also serve unmodified JAX programs over the IFRT proxy protocol on this loopback "
                             "port (0: any free one): JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://127.0.0.1:PORT")
    parser.add_argument("--suspend-dir", metavar="DIR",
                        help="the directory under which suspended sessions' arrays may be written to files "
                             "(suspend's path must lie under it; default: none, arrays stay in host memory)")
    worker_rights_flags(parser)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways.cluster import LocalCluster

    try:
        cluster = LocalCluster(islands(parser, args), policy=args.policy, window=args.window,
                               security=security.from_args(args), heartbeat_timeout=args.heartbeat_timeout,
                               ifrt_port=args.ifrt_port, restart_workers=args.restart_workers,
                               restart_controller=True, suspend_dir=args.suspend_dir, run_timeout=args.run_timeout,
                               session_memory=args.session_memory, checkpoint_dir=args.checkpoint_dir,
                               colocated_python=args.colocated_python)
    except ValueError as e:
        parser.error(str(e))
    with tempfile.TemporaryDirectory(prefix="pathways-up-") as private:  # mode 0700: this user's alone
        worker_token_file = args.worker_token_file or _keep_worker_token(cluster.security.worker_token, private)
        cluster.start()
        return _serve(cluster, args, worker_token_file)


def _keep_worker_token(token: Optional[str], directory: str) -> str:
    """Write the worker token the cluster drew into a file only this user can read."""
    path = os.path.join(directory, "worker-token")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(f"{token}\n")
    return path


def _serve(cluster: "LocalCluster", args: argparse.Namespace, worker_token_file: str) -> int:
    lines = [f"pathways cluster up at {cluster.address}; export PATHWAYS_ADDRESS={cluster.address}"]
    if cluster.ifrt_address:
        # jaxlib reads its log level only when it loads: the script's environment alone can hide
        # the proxy client's harmless warnings (insecure credentials, a stack trace at exit)
        lines.append(f"IFRT proxy at {cluster.ifrt_address}; run unmodified JAX programs with "
                     f"JAX_PLATFORMS=proxy JAX_BACKEND_TARGET={cluster.ifrt_address} TF_CPP_MIN_LOG_LEVEL=2 "
                     "(the last hides the proxy client's harmless warnings)")
    token_note = ("" if args.token_file or cluster.security.token is None
                  else " (with PATHWAYS_TOKEN set to the cluster's)")
    for island_id in range(len(cluster.islands)):
        command = shlex.join(cluster.worker_command(island_id, worker_token_file, args.token_file))
        lines.append(f"add or replace a host of island {island_id}{token_note}: {command}")
    print("\n".join(lines), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the cluster on SIGTERM too
    try:
        while True:  # the supervisor restarts the controller, and says so, should it die
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0
