"""Flags that several commands share: a local cluster's islands (``up``, ``run``) and a
controller's scheduling (``controller``, ``up``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pathways.defaults import DEFAULT_WINDOW
from pathways.protocol.messages import POLICIES

if TYPE_CHECKING:
    from pathways.cluster import Island

def scheduling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", choices=POLICIES, default=POLICIES[0],
                        help="order of runs between clients: fair (device time in proportion to each client's "
                             "weight) or fifo (in order of arrival); default fair")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="N",
                        help=f"runs in flight per island while several clients have runs queued for it (a "
                             f"client alone may run further ahead); default {DEFAULT_WINDOW}")


def session_memory_flag(parser: argparse.ArgumentParser, where: str = "on each of its workers") -> None:
    from pathways.worker.quota import DEFAULT_FRACTION, parse_bytes

    def size(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument("--session-memory", type=size, default=None, metavar="BYTES",
                        help=f"the most memory one client session's arrays may take {where} (e.g. 8G, "
                             f"512M; none: no limit; default {DEFAULT_FRACTION * 100:.0f}%% of the host's memory): a put or "
                             "a run's output past it fails with ResourceExhaustedError (RESOURCE_EXHAUSTED through "
                             "the IFRT proxy), and the worker goes on serving the other sessions")


def worker_rights_flags(parser: argparse.ArgumentParser, who: str = "the workers") -> None:
    """What the operator lets clients have ``who`` do beyond running programs: read and
    write files (checkpoints, profiles) under one directory, and run their own Python."""
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help=f"the directory under which {who} write and read clients' checkpoints and profiles "
                             "(a location must lie under it; gs://BUCKET/PATH names DIR/BUCKET/PATH; default: none, "
                             f"no checkpoints): no client can have {who} read or write elsewhere")
    parser.add_argument("--colocated-python", action="store_true",
                        help=f"let clients run colocated Python functions (jax.experimental.colocated_python) on "
                             f"{who}: their code, in the worker's process, with its rights (default: refused)")


def run_timeout_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-timeout", type=float, default=None, metavar="S",
                        help="reset an island that has had runs in flight and finished none of them for S "
                             "seconds (a host stuck in a computation or a collective): the run fails with "
                             "DeadlineExceededError naming the hosts that had not finished it, they write their "
                             "threads' stacks to their logs, and the island's hosts restart and serve again. "
                             "Default: off (a stuck run waits for ever)")


def island_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--islands", default=None,
                        help="comma-separated islands, each HOSTSxDEVICES or HOSTS (with --devices-per-host), "
                             "e.g. 2x1,1x4 (default 2x2)")
    parser.add_argument("--devices-per-host", type=int, default=None, metavar="N",
                        help="CPU devices of each host of the islands given as HOSTS in --islands (default 2)")


def islands(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Island]:
    """The islands of --islands and --devices-per-host; a usage error names what is wrong."""
    from pathways.cluster import Island

    spec = args.islands or "2"
    per_host = args.devices_per_host
    if per_host is not None and per_host < 1:
        parser.error(f"--devices-per-host must be at least 1, got {per_host}")
    found = []
    for part in spec.split(","):
        hosts, x, devices = part.strip().partition("x")
        if x and per_host is not None:
            parser.error(f"--islands {spec!r} gives the devices per host already ({part!r}); give HOSTS in "
                         "--islands with --devices-per-host, or HOSTSxDEVICES without it")
        if not hosts.isdigit() or not (devices.isdigit() if x else True) or int(hosts) < 1 \
                or (x and int(devices) < 1):
            parser.error(f"--islands {spec!r} is not a list like 2x1,1x4 (HOSTSxDEVICES per island, at least 1 "
                         "of each) or 2,1 with --devices-per-host")
        found.append(Island(int(hosts), int(devices) if x else per_host or 2))
    return found
