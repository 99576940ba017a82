"""``pathways status``: show islands, workers (speed, memory), links, slices, clients, queues.

Show the cluster as its controller sees it: each island's health and hosts, each worker's
devices, measured speed, memory and load, the links between hosts, the slices placed, the
clients and the runs queued per island.
"""

from __future__ import annotations

import argparse
import sys

from pathways import config
from pathways.errors import PathwaysError
from pathways.protocol.messages import ACTIVE
from pathways.wire import security as sec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=config.ADDRESS.get(), metavar="grpc://HOST:PORT",
                        help=f"the cluster's controller (default: ${config.ADDRESS.name})")
    parser.add_argument("--measure", action="store_true",
                        help="have every worker measure its FLOP/s and links again first, and wait for it")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the controller (default 10) or, with --measure, for the "
                             "measurements (default 60)")
    sec.add_flags(parser, server=False)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathways import cluster

    address, timeout = args.address, args.timeout
    if not address:
        print("no cluster address: pass --address grpc://HOST:PORT or set PATHWAYS_ADDRESS", file=sys.stderr)
        return 2
    security = sec.from_args(args)
    try:
        st = (cluster.measure(address, 60.0 if timeout is None else timeout, security) if args.measure
              else cluster.status(address, 10.0 if timeout is None else timeout, security))
    except PathwaysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print(address, st)
    return 0


def _print(address: str, st: dict) -> None:
    """The status ``st`` of the controller at ``address``, a line per island, worker and client session."""
    print(f"controller {address}: {len(st['workers'])} worker(s), {len(st['sessions'])} client session(s), "
          f"{st['slices']} slice(s), {st['arrays']} live array(s); policy {st['policy']}, "
          f"window {st['window']} run(s) per island")
    if st.get("front_end"):
        f = st["front_end"]
        print(f"  IFRT front end: array bytes {f['from_clients']} from clients, {f['to_clients']} to them; "
              f"{f['to_workers']} to workers, {f['from_workers']} from them")
    for i in st["islands"]:
        name = i["name"] if i["name"] == str(i["island"]) else f"{i['name']} (id {i['island']})"
        recovery = f"; {i['recovery']}" if i.get("recovery") else ""  # who brings the lost host back
        if i.get("healing"):
            state = (f"HEALING ({i['hosts']} of {i['expected_hosts']} hosts joined again; "
                     f"{i.get('lost') or 'a host was lost'}{recovery})")
        elif i["assembling"]:
            state = f"assembling ({i['hosts']} of {i['expected_hosts']} hosts joined; it takes slices once all have)"
        elif not i["healthy"]:
            state = f"UNHEALTHY ({i.get('lost') or 'a host was lost'}{recovery})"
        elif i.get("retiring"):
            state = "RETIRING (an operator retires it: it takes no new slices, its runs drain, then its hosts exit)"
        else:
            state = "healthy"
        print(f"  island {name}: {state}, {i['hosts']} host(s), {i['devices']} device(s), {i['queued']} run(s) "
              f"queued, {i['inflight']} in flight")
        for w in (w for w in st["workers"] if w["island"] == i["island"]):
            speed = f"{w['flops'] / 1e9:.1f} GFLOP/s" if w.get("flops") else "FLOP/s not measured yet"
            slow = (f"; SLOW (sent nothing for {w['slow']:.1f} s, but its host still acknowledges: starved of CPU, "
                    "busy or stopped, not lost)" if w.get("slow") is not None else "")
            print(f"    worker {w['worker']} rank {w['rank']} host {w['host']} pid {w['pid']} {w['address']}: "
                  f"{w['devices']} {w['kind']} device(s), {speed}, {w['memory_bytes'] / 2**30:.1f} GiB memory, "
                  f"slices per device {w['load']}{slow}")
    _print_links(st)
    for c in st["sessions"]:
        state = c.get("state", ACTIVE)
        if state == "suspended":
            state = (f"SUSPENDED ({c.get('suspended_arrays', 0)} array(s), "
                     f"{c.get('suspended_bytes', 0) / 2**20:.1f} MiB off the devices; slices released), ")
        else:  # an active session says nothing; one suspending or resuming says which
            state = "" if state == ACTIVE else f"{state.upper()}, "
        print(f"  client session {c['session']}: {state}weight {c.get('weight', 1.0):g}, {c['slices']} slice(s), "
              f"{c['arrays']} array(s), {c.get('queued', 0)} run(s) queued, {c.get('inflight', 0)} in flight, "
              f"{c.get('completed', 0)} done, {c.get('device_seconds', 0.0):.3f} device-s")


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

