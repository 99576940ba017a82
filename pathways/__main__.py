"""The ``pathways`` command line: controller, worker, up, run, status, demo, bench, spmd, plan, trace."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathways.wire.security import Security


def _logging(level: str) -> None:
    # Child processes (a local cluster's controller and workers) log at the same level.
    os.environ["PATHWAYS_LOG_LEVEL"] = level
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # stdout closed early (`pathways status | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit flush cannot fail
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    from pathways_bench.suite import EXPERIMENTS
    from pathways.defaults import DEFAULT_WINDOW, HEARTBEAT_TIMEOUT
    from pathways.keeper import RECONNECT_TIMEOUT
    from pathways.platforms import PLATFORMS
    from pathways.wire import security
    from pathways.worker.launchers import LAUNCHERS

    parser = argparse.ArgumentParser(prog="pathways", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("PATHWAYS_LOG_LEVEL", "warning"))
    sub = parser.add_subparsers(dest="command", required=True)

    controller = sub.add_parser("controller", help="run a controller; prints its address on stdout",
                                description="Run a controller. Once serving, it prints `PATHWAYS_CONTROLLER_"
                                            "ADDRESS grpc://HOST:PORT` on stdout: the address clients and "
                                            "workers use.")
    controller.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT",
                            help="where clients and workers reach it (default 127.0.0.1:0: this machine only, "
                                 "any free port). Its gRPC server takes PORT; workers' streams take another "
                                 "free port of HOST, which workers learn from the controller. With a wildcard "
                                 "host (0.0.0.0, or [::] for IPv6) it serves on every address of the machine "
                                 "and prints the address of the interface its default route uses (without a "
                                 "default route, its first address that is not loopback); peers may use any "
                                 "address of the machine")
    controller.add_argument("--ifrt-bind", metavar="HOST:PORT", default=None,
                            help="also serve unmodified JAX programs (JAX_PLATFORMS=proxy) over the IFRT proxy "
                                 "protocol there, e.g. 127.0.0.1:0; prints `ifrt grpc://HOST:PORT` on the line "
                                 "after its address. Beyond loopback it requires the token, like --bind")
    controller.add_argument("--policy", choices=["fair", "fifo"], default="fair",
                            help="order of runs between clients: proportional share by weight, or FIFO")
    controller.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="runs in flight per island")
    security.add_flags(controller, server=True, data_plane=False)
    controller.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT, metavar="S",
                            help="seconds a worker may send nothing (not even a heartbeat) before it is lost "
                                 "and its island marked unhealthy")

    worker = sub.add_parser("worker", help="run a worker host attached to a controller")
    worker.add_argument("--controller", required=True, help="grpc://HOST:PORT of the controller")
    worker.add_argument("--bind", metavar="HOST",
                        help="the address its servers (gRPC, data plane, and on an island's rank 0 the "
                             "island's jax.distributed coordinator) listen on (default: --advertise if given, "
                             "else the local address this machine uses to reach the controller; 0.0.0.0 "
                             "for every address)")
    worker.add_argument("--advertise", metavar="HOST",
                        help="the host name or address clients and other workers reach it at (default: the "
                             "bind address, or for a wildcard bind the local address this machine uses to "
                             "reach the controller)")
    worker.add_argument("--platform", choices=PLATFORMS, default=None,
                        help="the JAX platform it serves (default: whichever JAX finds); slices ask for its "
                             "devices as cpu_devices=, gpu_devices= (cuda, rocm) or tpu_devices=")
    worker.add_argument("--devices", type=int, default=None,
                        help="virtual CPU devices on this host (default 1); CPU only: an accelerator worker "
                             "serves the devices JAX finds on the host")
    worker.add_argument("--island", default=None, metavar="NAME",
                        help="the island (hosts joined by a fast interconnect, one jax.distributed group) this "
                             "host belongs to (default: the launcher's, e.g. a JobSet's Job, else 0)")
    worker.add_argument("--island-hosts", type=int, default=None, metavar="H",
                        help="hosts in this worker's island; the island takes work once all H have joined "
                             "(default: the launcher's task count, else 1)")
    worker.add_argument("--rank", type=int, default=None,
                        help="this host's index within its island, 0 to H-1 (default: the launcher's task "
                             "index, else the controller gives ranks in order of arrival)")
    worker.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                        help="read rank and island size from the launcher's environment: auto (Slurm's srun "
                             "or a Kubernetes indexed Job / JobSet, whichever started it), slurm, kubernetes, "
                             "or none (flags only). Flags win over the environment")
    worker.add_argument("--wait-timeout", type=float, default=300.0,
                        help="seconds an op waits for an input array before poisoning its outputs")
    worker.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach the controller")
    worker.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT, metavar="S",
                        help="seconds the controller may send nothing (not even a heartbeat) before this "
                             "worker gives it up and exits; also how long a data-plane peer may stall")
    worker.add_argument("--reconnect-timeout", type=float, default=RECONNECT_TIMEOUT, metavar="S",
                        help="when the controller goes away, restart and attach again once it is back, trying for "
                             "S seconds (0: exit at once); the controller's arrays and sessions are gone either way")
    worker.add_argument("--join-timeout", type=float, default=300.0,
                        help="seconds to wait for the island's rank 0 host to register, and then for every "
                             "host of the island to join its jax.distributed group")
    worker.add_argument("--unsafe-local-order", action="store_true",
                        help="debugging only: order runs of different clients locally instead of in "
                             "the island's gang order (collectives across hosts can hang)")
    security.add_flags(worker, server=True)

    up = sub.add_parser("up", help="run a local cluster until Ctrl-C; prints its address")
    _island_flags(up)
    up.add_argument("--policy", choices=["fair", "fifo"], default="fair")
    up.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    security.add_flags(up, server=True)
    up.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                    help=f"seconds of silence after which controller and workers give each other up "
                         f"(default {HEARTBEAT_TIMEOUT:g})")
    up.add_argument("--restart-workers", action="store_true",
                    help="start a worker that dies again (with a back-off): its island heals")
    up.add_argument("--ifrt-port", type=int, default=None, metavar="PORT",
                    help="also serve unmodified JAX programs over the IFRT proxy protocol on this loopback "
                         "port (0: any free one): JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://127.0.0.1:PORT")

    run = sub.add_parser("run", help="run an unmodified JAX script on an embedded local cluster (IFRT proxy)",
                         description="Start a local cluster whose controller serves the IFRT proxy protocol, run "
                                     "the script with JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET set (no pathways "
                                     "import needed in it), stop the cluster, and exit with the script's code.")
    _island_flags(run)
    run.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="seconds before the script is stopped (exit code 124; default: no limit)")
    run.add_argument("--token-file", metavar="PATH",
                     help="file holding a token the cluster requires of every connection (default: "
                          "$PATHWAYS_TOKEN; none); the script is given it as PATHWAYS_TOKEN")
    run.add_argument("script", help="the Python script, run as `python SCRIPT ARGS...`")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")

    status = sub.add_parser("status", help="show islands, workers (speed, memory), links, slices, clients, queues")
    status.add_argument("--address", default=os.environ.get("PATHWAYS_ADDRESS"))
    status.add_argument("--measure", action="store_true",
                        help="have every worker measure its FLOP/s and links again first, and wait for it")
    status.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the controller (default 10) or, with --measure, for the "
                             "measurements (default 60)")
    security.add_flags(status, server=False)

    demo = sub.add_parser("demo", help="run the paper's Figure 2 program")
    demo.add_argument("--address", default=None)
    security.add_flags(demo, server=False)

    bench = sub.add_parser("bench", help="run a benchmark, or all of them (regenerates BENCHMARKS.md)")
    bench.add_argument("name", choices=[*EXPERIMENTS, "all"])
    bench.add_argument("--rounds", type=int, default=None,
                       help="alternating repetitions of each measurement (default: the benchmark's own)")
    bench.add_argument("--tiny", action="store_true", help="the smallest sizes, to check that it runs")
    bench.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot (one benchmark)")
    bench.add_argument("--out", default="BENCHMARKS.md", help="all: the markdown file to write")
    bench.add_argument("--plots", default="docs/bench", help="all: the folder for the plots")
    bench.add_argument("--from-json", metavar="PATH",
                       help="all: rewrite the markdown and plots from the JSON of an earlier `bench all --json`")

    spmd = sub.add_parser("spmd", help="run a script multi-controller: N processes under jax.distributed")
    spmd.add_argument("processes", type=int, help="number of processes")
    spmd.add_argument("script", help="the Python script every process runs as __main__")
    spmd.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    spmd.add_argument("--devices-per-process", type=int, default=1)
    spmd.add_argument("--timeout", type=float, default=3600.0, help="seconds before the processes are stopped")

    plan = sub.add_parser("plan", help="plan a pipeline partition or a DAG schedule from a JSON file",
                          add_help=False)
    plan.add_argument("plan_args", nargs=argparse.REMAINDER,
                      help="pipeline|dag FILE.json [options]; see `python -m pathways plan --help`")

    trace = sub.add_parser("trace", help="summarize a timeline file (pw.trace, PATHWAYS_TRACE); draw it with --png")
    trace.add_argument("file", help="the timeline's Chrome trace-event JSON")
    trace.add_argument("--png", metavar="PATH", help="write a Gantt chart: a row per process and thread")

    # Known arguments only, so that `plan --help` reaches the planner's own parser.
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "plan":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _logging(args.log_level)
    try:
        return _run(parser, args, unknown)
    except security.SecurityConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> int:
    from pathways.wire import security

    if args.command in ("controller", "worker"):
        from pathways.keeper import exit_with_parent
        exit_with_parent()
    if args.command == "controller":
        from pathways.controller.server import main as controller_main
        controller_main(args.policy, args.window, args.bind, security.from_args(args), args.heartbeat_timeout,
                        args.ifrt_bind)
    elif args.command == "worker":
        from pathways import keeper
        if os.environ.get(keeper.KEPT_ENV) != "1":  # the host's process becomes the keeper of the worker
            os.execv(sys.executable, keeper.command(args.reconnect_timeout, [sys.executable, *sys.orig_argv[1:]]))
        from pathways.platforms import find_devices
        from pathways.worker.launchers import LaunchError, resolve
        from pathways.worker.server import IslandMembership, main as worker_main
        try:
            launch = resolve(os.environ, args.launcher, args.rank, args.island_hosts, args.island)
            devices = find_devices(args.platform, args.devices)
        except (LaunchError, ValueError) as e:
            parser.error(str(e))
        logging.getLogger("pathways.worker").info("island place from %s: %s", launch.source, launch)
        island = launch.island if launch.island is not None else "0"
        if not island.strip():
            parser.error("--island needs a name, e.g. --island 0 or --island rack-a")
        worker_main(args.controller, devices, IslandMembership(island, launch.hosts, launch.rank),
                    args.wait_timeout, args.connect_timeout, args.join_timeout, args.bind, args.advertise,
                    args.unsafe_local_order, security.from_args(args), args.heartbeat_timeout,
                    args.reconnect_timeout)
    elif args.command == "up":
        from pathways.cluster import LocalCluster
        try:
            cluster = LocalCluster(_islands(parser, args), policy=args.policy, window=args.window,
                                   security=security.from_args(args), heartbeat_timeout=args.heartbeat_timeout,
                                   ifrt_port=args.ifrt_port, restart_workers=args.restart_workers,
                                   restart_controller=True)
        except ValueError as e:
            parser.error(str(e))
        cluster.start()
        lines = [f"pathways cluster up at {cluster.address}; export PATHWAYS_ADDRESS={cluster.address}"]
        if cluster.ifrt_address:
            lines.append(f"IFRT proxy at {cluster.ifrt_address}; run unmodified JAX programs with "
                         f"JAX_PLATFORMS=proxy JAX_BACKEND_TARGET={cluster.ifrt_address}")
        print("\n".join(lines), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the cluster on SIGTERM too
        try:
            while True:  # the supervisor restarts the controller, and says so, should it die
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.stop()
    elif args.command == "run":
        from pathways.ifrt.launch import run_script

        islands = _islands(parser, args)
        if args.timeout is not None and not args.timeout > 0:
            parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        try:
            return run_script(islands, args.script, args.args, _run_security(args), args.timeout)
        except FileNotFoundError as e:
            parser.error(str(e))
    elif args.command == "status":
        return _status(args.address, args.measure, args.timeout, security.from_args(args))
    elif args.command == "demo":
        from pathways.demo import figure2
        # the flags only: pw.connect reads PATHWAYS_TOKEN and PATHWAYS_TLS_CA itself, and
        # applies the CA only to a cluster at an address
        token = security.read_token_file(args.token_file) if args.token_file else None
        figure2(args.address, token, args.tls_ca)
    elif args.command == "bench":
        from pathways_bench import suite

        if args.from_json:
            if args.name != "all":
                parser.error("--from-json redraws BENCHMARKS.md: use it with `bench all`")
            with open(args.from_json) as f:
                suite.render(json.load(f), args.out, args.plots)
        elif args.name == "all":
            suite.run_all(args.rounds, args.tiny, args.out, args.plots, args.json)
        else:
            suite.run(args.name, args.rounds, args.tiny, args.json, args.plot)
    elif args.command == "spmd":
        from pathways.errors import SpmdError
        from pathways.spmd import launch

        if args.processes < 1 or args.devices_per_process < 1:
            parser.error("spmd needs at least 1 process and 1 device per process")
        try:
            return launch(args.processes, args.script, args.args, args.devices_per_process, args.timeout)
        except SpmdError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif args.command == "plan":
        from pathways.planner.cli import main as plan_main

        return plan_main([*unknown, *args.plan_args])
    elif args.command == "trace":
        from pathways.timeline_view import TimelineFileError, gantt, load, summary

        try:
            spans = load(args.file)
        except TimelineFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(summary(spans))
        if args.png:
            gantt(spans, args.png, f"pathways timeline: {os.path.basename(args.file)}")
            print(f"wrote {args.png}")
    return 0


def _island_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--islands", default=None,
                        help="comma-separated islands, each HOSTSxDEVICES or HOSTS (with --devices-per-host), "
                             "e.g. 2x1,1x4 (default 2x2)")
    parser.add_argument("--devices-per-host", type=int, default=None, metavar="N",
                        help="CPU devices of each host of the islands given as HOSTS in --islands (default 2)")


def _islands(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """The islands of --islands and --devices-per-host; a usage error names what is wrong."""
    from pathways.cluster import Island

    spec = args.islands or "2"
    per_host = args.devices_per_host
    if per_host is not None and per_host < 1:
        parser.error(f"--devices-per-host must be at least 1, got {per_host}")
    islands = []
    for part in spec.split(","):
        hosts, x, devices = part.strip().partition("x")
        if x and per_host is not None:
            parser.error(f"--islands {spec!r} gives the devices per host already ({part!r}); give HOSTS in "
                         "--islands with --devices-per-host, or HOSTSxDEVICES without it")
        if not hosts.isdigit() or not (devices.isdigit() if x else True) or int(hosts) < 1 \
                or (x and int(devices) < 1):
            parser.error(f"--islands {spec!r} is not a list like 2x1,1x4 (HOSTSxDEVICES per island, at least 1 "
                         "of each) or 2,1 with --devices-per-host")
        islands.append(Island(int(hosts), int(devices) if x else per_host or 2))
    return islands


def _run_security(args: argparse.Namespace) -> Security:
    """The embedded cluster's settings: the token of --token-file or PATHWAYS_TOKEN, no TLS
    (it listens on loopback, and the IFRT proxy client speaks plain gRPC or ALTS only)."""
    from pathways.wire import security

    token = security.read_token_file(args.token_file) if args.token_file else security.env_token()
    return security.Security(token=token)


def _status(address: str | None, measure: bool = False, timeout: float | None = None,
            security: Security | None = None) -> int:
    from pathways import cluster
    from pathways.errors import PathwaysError

    if not address:
        print("no cluster address: pass --address grpc://HOST:PORT or set PATHWAYS_ADDRESS", file=sys.stderr)
        return 2
    try:
        st = (cluster.measure(address, 60.0 if timeout is None else timeout, security) if measure
              else cluster.status(address, 10.0 if timeout is None else timeout, security))
    except PathwaysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"controller {address}: {len(st['workers'])} worker(s), {len(st['sessions'])} client session(s), "
          f"{st['slices']} slice(s), {st['arrays']} live array(s); policy {st['policy']}, "
          f"window {st['window']} run(s) per island")
    for i in st["islands"]:
        name = i["name"] if i["name"] == str(i["island"]) else f"{i['name']} (id {i['island']})"
        if i.get("healing"):
            state = (f"HEALING ({i['hosts']} of {i['expected_hosts']} hosts joined again; "
                     f"{i.get('lost') or 'a host was lost'})")
        elif not i["healthy"]:
            state = f"UNHEALTHY ({i.get('lost') or 'a host was lost'})"
        elif i["assembling"]:
            state = f"assembling ({i['hosts']} of {i['expected_hosts']} hosts joined; it takes slices once all have)"
        else:
            state = "healthy"
        print(f"  island {name}: {state}, {i['hosts']} host(s), {i['devices']} device(s), {i['queued']} run(s) "
              f"queued, {i['inflight']} in flight")
        for w in (w for w in st["workers"] if w["island"] == i["island"]):
            speed = f"{w['flops'] / 1e9:.1f} GFLOP/s" if w.get("flops") else "FLOP/s not measured yet"
            print(f"    worker {w['worker']} rank {w['rank']} host {w['host']} pid {w['pid']} {w['address']}: "
                  f"{w['devices']} {w['kind']} device(s), {speed}, {w['memory_bytes'] / 2**30:.1f} GiB memory, "
                  f"slices per device {w['load']}")
    _print_links(st)
    for c in st["sessions"]:
        state = c.get("state", "active")
        if state == "suspended":
            state = (f"SUSPENDED ({c.get('suspended_arrays', 0)} array(s), "
                     f"{c.get('suspended_bytes', 0) / 2**20:.1f} MiB off the devices; slices released), ")
        else:  # an active session says nothing; one suspending or resuming says which
            state = "" if state == "active" else f"{state.upper()}, "
        print(f"  client session {c['session']}: {state}weight {c.get('weight', 1.0):g}, {c['slices']} slice(s), "
              f"{c['arrays']} array(s), {c.get('queued', 0)} run(s) queued, {c.get('inflight', 0)} in flight, "
              f"{c.get('completed', 0)} done, {c.get('device_seconds', 0.0):.3f} device-s")
    return 0


def _print_links(st: dict) -> None:
    """The measured links as two matrices, latency in us and bandwidth in MB/s (row: from,
    column: to; ? where not measured)."""
    ids = [w["worker"] for w in st["workers"]]
    if len(ids) < 2:
        return
    links = {(x["src"], x["dst"]): x for x in st.get("links", [])}
    for title, field, scale in (("latency in us", "latency", 1e6), ("bandwidth in MB/s", "bandwidth", 1e-6)):
        print(f"  links, {title} (row: from worker, column: to worker):")
        print("    " + " " * 6 + "".join(f"{w:>8}" for w in ids))
        for a in ids:
            cells = ["-" if a == b else f"{links[(a, b)][field] * scale:.0f}" if (a, b) in links else "?"
                     for b in ids]
            print(f"    {a:>6}" + "".join(f"{c:>8}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
