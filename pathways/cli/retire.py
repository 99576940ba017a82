"""``pathways retire``: retire an island (or one host) for good: drain it, shut its hosts
down, forget it.

Retire an island by its name as `pathways status` shows it, or one host with --worker. It takes
no new slices at once; the runs queued and in flight there may finish (for at most --timeout
seconds); then its hosts are told to exit (their keepers do not start them again), whatever
still involves them fails with WorkerLostError saying the operator retired them, its slices
are released, and the island is forgotten: status no longer lists it, and new workers may take
its name. A lost (UNHEALTHY) island is simply forgotten. One host of a larger island is lost on
purpose instead: the island heals once a worker started with its --island replaces the host.
"""

from __future__ import annotations

import argparse
import sys

from pathways import config
from pathways.errors import PathwaysError
from pathways.wire import security as sec

DEFAULT_TIMEOUT = 60.0  # seconds the runs of a retired island may take to finish


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("island", nargs="?", default=None, help="the island's name (or its id)")
    parser.add_argument("--worker", type=int, default=None, metavar="ID",
                        help="retire this one host (its worker id in `pathways status`) instead of an island")
    parser.add_argument("--host", default=None, metavar="ADDRESS",
                        help="retire the one host serving at this address (grpc://HOST:PORT or HOST:PORT, as "
                             "`pathways status` shows it) instead of an island")
    parser.add_argument("--address", default=config.ADDRESS.get(),
                        help=f"the controller, grpc://HOST:PORT (default: ${config.ADDRESS.name})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds to wait for the runs there to finish before retiring it anyway (default "
                             f"{DEFAULT_TIMEOUT:g}; 0: at once, failing them)")
    sec.add_flags(parser, server=False)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Retire what ``args`` names; the exit status (2: usage, 1: refused or failed)."""
    from pathways import cluster
    from pathways.protocol.messages import MAX_WAIT_SECONDS

    given = [x for x in (args.island or None, args.worker, args.host or None) if x is not None]
    if len(given) != 1:
        parser.error("name what to retire: an island's name, --worker ID or --host ADDRESS (one of them)")
    if not args.address:
        parser.error("no cluster address: pass --address grpc://HOST:PORT or set PATHWAYS_ADDRESS")
    if not 0 <= args.timeout <= MAX_WAIT_SECONDS:
        parser.error(f"--timeout must be 0 to {MAX_WAIT_SECONDS:g} seconds, got {args.timeout:g}")
    security = sec.from_args(args)
    try:
        worker = args.worker if args.host is None else _worker_at(args.address, args.host, security)
        # cluster.retire says exactly what retiring does
        report = cluster.retire(args.address, args.island or "", worker, args.timeout, security)
    except PathwaysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(describe(report, args.timeout))
    return 0


def _worker_at(address: str, host: str, security: sec.Security) -> int:
    """The id of the worker serving at ``host`` (its gRPC address, with or without the scheme)."""
    from pathways import cluster

    wanted = host if "://" in host else f"grpc://{host}"
    workers = cluster.status(address, security=security)["workers"]
    found = [w["worker"] for w in workers if w["address"] == wanted]
    if not found:
        raise PathwaysError(f"no worker serves at {host}; the workers serve at: "
                            f"{', '.join(w['address'] for w in workers) or 'none'}")
    return found[0]


def describe(report: dict, timeout: float) -> str:
    """What ``cluster.retire`` did, in a sentence for the operator."""
    name = report["island"] if report["island"] == str(report["id"]) else f"{report['island']} (id {report['id']})"
    if report["was"] == "forgotten":
        return f"island {name} was lost and forgotten while it drained; nothing left to retire"
    runs = ("its runs finished first" if report["drained"] else
            f"{report['runs_cut']} run(s) still there after {timeout:g} s were cut")
    sessions = (f" of client session(s) {report['sessions']}" if report["sessions"] else "")
    if report["worker"] is not None:
        if not report["hosts"]:
            return f"worker {report['worker']} of island {name} was lost while its island drained; nothing to shut down"
        return (f"retired worker {report['worker']} of island {name}: it was told to exit, and the island waits for "
                f"a host to replace it (a worker started with --island {report['island']}); {runs}")
    if report["was"] == "lost":
        return (f"forgot lost island {name}: {report['slices_released']} slice(s){sessions} released; "
                "status no longer lists it")
    return (f"retired island {name} ({report['was']}): worker(s) {report['hosts']} told to exit, "
            f"{report['slices_released']} slice(s){sessions} released; {runs}. Status no longer lists it")
