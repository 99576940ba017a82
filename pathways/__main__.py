"""The ``pathways`` command line: controller, worker, up, status, demo, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pathways", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("PATHWAYS_LOG_LEVEL", "warning"))
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("controller", help="run a controller; prints its address on stdout")

    worker = sub.add_parser("worker", help="run a worker host attached to a controller")
    worker.add_argument("--controller", required=True, help="grpc://HOST:PORT of the controller")
    worker.add_argument("--devices", type=int, default=1, help="CPU devices on this host")
    worker.add_argument("--island", type=int, default=0)
    worker.add_argument("--wait-timeout", type=float, default=300.0,
                        help="seconds an op waits for an input array before poisoning its outputs")
    worker.add_argument("--connect-timeout", type=float, default=30.0)

    up = sub.add_parser("up", help="run a local cluster until Ctrl-C; prints its address")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--devices-per-host", type=int, default=2)

    status = sub.add_parser("status", help="show the workers, devices and sessions of a cluster")
    status.add_argument("--address", default=os.environ.get("PATHWAYS_ADDRESS"))

    demo = sub.add_parser("demo", help="run the paper's Figure 2 program")
    demo.add_argument("--address", default=None)

    bench = sub.add_parser("bench", help="run a benchmark")
    bench.add_argument("name", choices=["dispatch"])
    bench.add_argument("--address", default=None)
    bench.add_argument("--rounds", type=int, default=5)

    args = parser.parse_args(argv)
    _logging(args.log_level)

    if args.command in ("controller", "worker"):
        from pathways.cluster import exit_with_parent
        exit_with_parent()
    if args.command == "controller":
        from pathways.controller.server import main as controller_main
        controller_main()
    elif args.command == "worker":
        from pathways.worker.server import main as worker_main
        worker_main(args.controller, args.devices, args.island, args.wait_timeout, args.connect_timeout)
    elif args.command == "up":
        from pathways.cluster import LocalCluster
        cluster = LocalCluster.of_hosts(args.hosts, args.devices_per_host).start()
        print(f"pathways cluster up at {cluster.address}; export PATHWAYS_ADDRESS={cluster.address}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.stop()
    elif args.command == "status":
        return _status(args.address)
    elif args.command == "demo":
        from pathways.demo import figure2
        figure2(args.address)
    elif args.command == "bench":
        from pathways.bench import dispatch
        dispatch.main(args.address, args.rounds)
    return 0


def _status(address: str | None) -> int:
    from pathways.cluster import status
    from pathways.errors import PathwaysError

    if not address:
        print("no cluster address: pass --address grpc://HOST:PORT or set PATHWAYS_ADDRESS", file=sys.stderr)
        return 2
    try:
        st = status(address)
    except PathwaysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"controller {address}: {len(st['workers'])} worker(s), {st['sessions']} session(s), "
          f"{st['slices']} slice(s), {st['arrays']} live array(s)")
    for w in st["workers"]:
        print(f"  worker {w['worker']} island {w['island']} host {w['host']} pid {w['pid']} {w['address']}: "
              f"{w['devices']} {w['kind']} device(s), slices per device {w['load']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
