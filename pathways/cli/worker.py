"""``pathways worker``: run a worker host attached to a controller.

Run a worker host: it attaches to the controller, joins its island (one jax.distributed group
per island of several hosts), serves the devices JAX finds (or --devices virtual CPU devices)
and runs what the controller sends, until the controller stops it. It runs under a keeper
process that restarts it when its island lost a host or the controller went away.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pathways import config
from pathways.cli.common import session_memory_flag, worker_rights_flags
from pathways.defaults import HEARTBEAT_TIMEOUT
from pathways.keeper import RECONNECT_TIMEOUT
from pathways.platforms import PLATFORMS
from pathways.wire import security
from pathways.worker import compile_cache
from pathways.worker.launchers import LAUNCHERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--controller", required=True, help="grpc://HOST:PORT of the controller")
    parser.add_argument("--bind", metavar="HOST",
                        help="the address its servers (gRPC, data plane, and on an island's rank 0 the "
                             "island's jax.distributed coordinator) listen on (default: --advertise if given, "
                             "else the local address this machine uses to reach the controller; 0.0.0.0 "
                             "for every address)")
    parser.add_argument("--advertise", metavar="HOST",
                        help="the host name or address clients and other workers reach it at (default: the "
                             "bind address, or for a wildcard bind the local address this machine uses to "
                             "reach the controller)")
    host = parser.add_argument_group("devices and island")
    for flag, options, meaning in (
            ("--platform", dict(choices=PLATFORMS), "the JAX platform it serves (default: whichever JAX finds); "
             "slices ask for its devices as cpu_devices=, gpu_devices= (cuda, rocm) or tpu_devices="),
            ("--devices", dict(type=int), "virtual CPU devices on this host (default 1); CPU only: an accelerator "
             "worker serves the devices JAX finds on the host"),
            ("--island", dict(metavar="NAME"), "the island (hosts joined by a fast interconnect, one "
             "jax.distributed group) this host belongs to (default: the launcher's, e.g. a JobSet's Job, else 0)"),
            ("--island-hosts", dict(type=int, metavar="H"), "hosts in this worker's island; the island takes work "
             "once all H have joined (default: the launcher's task count, else 1)"),
            ("--rank", dict(type=int), "this host's index within its island, 0 to H-1 (default: the launcher's "
             "task index, else the controller gives ranks in order of arrival)"),
            ("--launcher", dict(choices=LAUNCHERS, default="auto"), "read rank and island size from the "
             "launcher's environment: auto (Slurm's srun or a Kubernetes indexed Job / JobSet, whichever started "
             "it), slurm, kubernetes, or none (flags only). Flags win over the environment")):
        host.add_argument(flag, **options, help=meaning)
    timeouts = parser.add_argument_group("timeouts, in seconds")
    for flag, default, meaning in (
            ("--wait-timeout", 300.0, "how long an op waits for an input array before poisoning its outputs"),
            ("--connect-timeout", 30.0, "how long to try to reach the controller"),
            ("--heartbeat-timeout", HEARTBEAT_TIMEOUT,
             "how long the controller may send nothing (not even a heartbeat) before this worker judges it: "
             "slow, and waited for, while its host still acknowledges; lost, and this worker restarts to attach "
             "again, once its host acknowledged nothing for as long; also how long a data-plane peer may stall"),
            ("--reconnect-timeout", RECONNECT_TIMEOUT,
             "when the controller goes away, restart and attach again once it is back, trying for this long (0: "
             "exit at once); the controller's arrays and sessions are gone either way"),
            ("--join-timeout", 300.0, "how long to wait for the island's rank 0 host to register, and then for "
             "every host of the island to join its jax.distributed group")):
        timeouts.add_argument(flag, type=float, default=default, metavar="S", help=f"{meaning} (default {default:g})")
    parser.add_argument("--unsafe-local-order", action="store_true",
                        help="debugging only: order runs of different clients locally instead of in "
                             "the island's gang order (collectives across hosts can hang)")
    parser.add_argument("--suspend-dir", metavar="DIR",
                        help="the directory under which a suspended session's arrays may be written to files "
                             "(a client's suspend path must lie under it; default: none, they stay in host "
                             "memory): no client can have this worker write elsewhere")
    worker_rights_flags(parser, "this worker")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help=f"keep compiled executables in DIR, so that this worker when it restarts, and other "
                             f"workers of this machine, load them instead of compiling again (default: "
                             f"${config.COMPILE_CACHE.name}, else ${compile_cache.JAX_ENV}; none: compile in each process). "
                             "DIR must be writable by the operator alone: loading an executable runs its code")
    session_memory_flag(parser, "on this worker")
    security.add_flags(parser, server=True)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways import keeper
    from pathways.platforms import find_devices
    from pathways.worker.launchers import LaunchError, resolve
    from pathways.worker.server import IslandMembership, main

    keeper.exit_with_parent()
    if not config.WORKER_KEPT.get():  # the host's process becomes the keeper of the worker
        os.execv(sys.executable, keeper.command(args.reconnect_timeout, [sys.executable, *sys.orig_argv[1:]]))
    try:
        launch = resolve(os.environ, args.launcher, args.rank, args.island_hosts, args.island)
        devices = find_devices(args.platform, args.devices)
    except (LaunchError, ValueError) as e:
        parser.error(str(e))
    logging.getLogger("pathways.worker").info("island place from %s: %s", launch.source, launch)
    island = launch.island if launch.island is not None else "0"
    if not island.strip():
        parser.error("--island needs a name, e.g. --island 0 or --island rack-a")
    main(args.controller, devices, IslandMembership(island, launch.hosts, launch.rank), args.wait_timeout,
         args.connect_timeout, args.join_timeout, args.bind, args.advertise, args.unsafe_local_order,
         security.from_args(args), args.heartbeat_timeout, args.reconnect_timeout, args.suspend_dir,
         compile_cache.directory_from(args.compile_cache), args.session_memory, args.checkpoint_dir,
         args.colocated_python)
    return 0
