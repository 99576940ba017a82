"""The ``pathways`` command line: controller, worker, up, status, demo, bench."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    from pathways.controller.scheduler import DEFAULT_WINDOW

    parser = argparse.ArgumentParser(prog="pathways", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("PATHWAYS_LOG_LEVEL", "warning"))
    sub = parser.add_subparsers(dest="command", required=True)

    controller = sub.add_parser("controller", help="run a controller; prints its address on stdout")
    controller.add_argument("--policy", choices=["fair", "fifo"], default="fair",
                            help="order of runs between clients: proportional share by weight, or FIFO")
    controller.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="runs in flight per island")

    worker = sub.add_parser("worker", help="run a worker host attached to a controller")
    worker.add_argument("--controller", required=True, help="grpc://HOST:PORT of the controller")
    worker.add_argument("--devices", type=int, default=1, help="CPU devices on this host")
    worker.add_argument("--island", type=int, default=0)
    worker.add_argument("--wait-timeout", type=float, default=300.0,
                        help="seconds an op waits for an input array before poisoning its outputs")
    worker.add_argument("--connect-timeout", type=float, default=30.0)
    worker.add_argument("--coordinator", help="HOST:PORT of the island's jax.distributed coordinator "
                                              "(islands of several hosts; rank 0 runs it)")
    worker.add_argument("--island-hosts", type=int, default=1, help="hosts in this worker's island")
    worker.add_argument("--rank", type=int, default=0, help="this host's index within its island")
    worker.add_argument("--unsafe-local-order", action="store_true",
                        help="debugging only: order runs of different clients locally instead of in "
                             "the island's gang order (collectives across hosts can hang)")

    up = sub.add_parser("up", help="run a local cluster until Ctrl-C; prints its address")
    up.add_argument("--islands", default="2x2",
                    help="comma-separated HOSTSxDEVICES per island, e.g. 2x1,1x4 (default 2x2)")
    up.add_argument("--policy", choices=["fair", "fifo"], default="fair")
    up.add_argument("--window", type=int, default=DEFAULT_WINDOW)

    status = sub.add_parser("status", help="show islands, workers, devices, slices, clients and queues")
    status.add_argument("--address", default=os.environ.get("PATHWAYS_ADDRESS"))

    demo = sub.add_parser("demo", help="run the paper's Figure 2 program")
    demo.add_argument("--address", default=None)

    bench = sub.add_parser("bench", help="run a benchmark")
    bench.add_argument("name", choices=["dispatch", "share", "pipeline", "transfer", "train"])
    bench.add_argument("--address", default=None, help="dispatch, share: a running cluster (default: start one)")
    bench.add_argument("--rounds", type=int, default=5, help="repetitions of each measurement")
    bench.add_argument("--seconds", type=float, default=10.0, help="share: measurement window per weight set")

    args = parser.parse_args(argv)
    _logging(args.log_level)

    if args.command in ("controller", "worker"):
        from pathways.cluster import exit_with_parent
        exit_with_parent()
    if args.command == "controller":
        from pathways.controller.server import main as controller_main
        controller_main(args.policy, args.window)
    elif args.command == "worker":
        from pathways.worker.server import IslandMembership, main as worker_main
        membership = None
        if args.island_hosts > 1:
            if not args.coordinator or not 0 <= args.rank < args.island_hosts:
                parser.error("a worker of a multi-host island needs --coordinator and 0 <= --rank < --island-hosts")
            membership = IslandMembership(args.coordinator, args.island_hosts, args.rank)
        worker_main(args.controller, args.devices, args.island, args.wait_timeout, args.connect_timeout,
                    membership, args.unsafe_local_order)
    elif args.command == "up":
        from pathways.cluster import Island, LocalCluster
        try:
            islands = [Island(*map(int, spec.split("x"))) for spec in args.islands.split(",")]
        except ValueError:
            parser.error(f"--islands {args.islands!r} is not a list like 2x1,1x4")
        cluster = LocalCluster(islands, policy=args.policy, window=args.window).start()
        print(f"pathways cluster up at {cluster.address}; export PATHWAYS_ADDRESS={cluster.address}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the cluster on SIGTERM too
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
        import importlib

        bench_main = importlib.import_module(f"pathways.bench.{args.name}").main
        if args.name == "dispatch":
            bench_main(args.address, args.rounds)
        elif args.name == "share":
            bench_main(args.address, args.seconds)
        else:  # these start the clusters they need
            bench_main(args.rounds)
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
    print(f"controller {address}: {len(st['workers'])} worker(s), {len(st['sessions'])} client session(s), "
          f"{st['slices']} slice(s), {st['arrays']} live array(s); policy {st['policy']}, "
          f"window {st['window']} run(s) per island")
    for i in st["islands"]:
        print(f"  island {i['island']}: {'healthy' if i['healthy'] else 'UNHEALTHY (a host was lost)'}, "
              f"{i['hosts']} host(s), {i['devices']} device(s), {i['queued']} run(s) queued, "
              f"{i['inflight']} in flight")
        for w in (w for w in st["workers"] if w["island"] == i["island"]):
            print(f"    worker {w['worker']} rank {w['rank']} host {w['host']} pid {w['pid']} {w['address']}: "
                  f"{w['devices']} {w['kind']} device(s), slices per device {w['load']}")
    for c in st["sessions"]:
        print(f"  client session {c['session']}: weight {c.get('weight', 1.0):g}, {c['slices']} slice(s), "
              f"{c['arrays']} array(s), {c.get('queued', 0)} run(s) queued, {c.get('inflight', 0)} in flight, "
              f"{c.get('completed', 0)} done, {c.get('device_seconds', 0.0):.3f} device-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
