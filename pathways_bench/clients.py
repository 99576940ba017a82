"""``python -m pathways bench clients``: throughput and latency of many clients, each a
session doing put + run + fetch rounds, on two islands.

One local cluster of two islands (one host, one CPU device each; policy ``fair``). N
clients (10, 100 and 500) are sessions spread over four driver processes, a thread each:
every client takes a 1-device slice of island ``i % 2``, compiles ``x * 2 + 1`` on it,
and then, round after round, puts an 8-float array, runs the function on it and fetches
the result (checked). A round is one client's put, run and fetch, back to back; each
client has one round in flight at a time, so latency is what a client waits for a round
while all the others run theirs.

For each client count, every client runs rounds from the same moment for a window; the
aggregate rate is the rounds that ended in the window's second part over its length (the
first part lets all clients reach their steady pace), and the percentiles are those of
the same rounds' latencies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from pathways_bench import report

TITLE = "Many clients: put + run + fetch rounds on two islands"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 1
CLIENTS = (10, 100, 500)
DRIVERS = 4  # processes the clients are spread over (their threads share each one's GIL)
WINDOW_SECONDS = 20.0
WARMUP_FRACTION = 0.25  # of the window, before rounds count
TINY_CLIENTS = (2, 10)
TINY_WINDOW_SECONDS = 2.0
_SETUP_TIMEOUT = 600.0  # 500 sessions connect, take slices and compile on a shared 2-core machine
READY, GO = "ready", "go"

ABOUT = f"""
Two islands of one host with one CPU device each. N clients (sessions; {DRIVERS} driver
processes, a thread per client) each take a 1-device slice of an island (alternately),
compile `x * 2 + 1`, and run rounds back to back: `pw.device_put` of 8 floats, the call,
`pw.device_get` of its result (checked). Every client starts at the same moment; the first
{WARMUP_FRACTION:.0%} of a {WINDOW_SECONDS:.0f} s window is warm-up. Reported: rounds per second of
all clients together, and the median and 99th percentile of a round's latency.
"""


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    from pathways.cluster import Island, LocalCluster

    counts = TINY_CLIENTS if tiny else CLIENTS
    window = TINY_WINDOW_SECONDS if tiny else WINDOW_SECONDS
    progress.expect(rounds * len(counts) * 2)
    results: dict[str, list[dict]] = {str(n): [] for n in counts}
    for r in range(rounds):
        for n in counts:
            cluster = LocalCluster([Island(1, 1), Island(1, 1)], policy="fair").start()
            assert cluster.address is not None
            try:
                progress.step(f"{n} clients: connecting (round {r + 1}/{rounds})")
                with _Drivers(cluster.address, n) as drivers:
                    progress.step(f"{n} clients: {window:.0f} s of rounds")
                    results[str(n)].append(drivers.run(window))
            finally:
                cluster.stop()
    return {"clients": list(counts), "window_s": window, "results": results}


class _Drivers:
    """The processes that run the clients, told when to start over their stdin."""

    def __init__(self, address: str, clients: int) -> None:
        from pathways import config

        env = {**os.environ, config.PARENT_PID.name: str(os.getpid())}  # drivers exit if this process dies
        shares = [clients // DRIVERS + (1 if i < clients % DRIVERS else 0) for i in range(DRIVERS)]
        firsts = [sum(shares[:i]) for i in range(DRIVERS)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "pathways_bench.clients", "--driver", address,
                                        str(first), str(share)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
                      for first, share in zip(firsts, shares) if share]
        for i, p in enumerate(self.procs):
            line = report.read_line(p, _SETUP_TIMEOUT, f"client driver {i}")
            if line != READY:
                raise RuntimeError(f"client driver {i} said {line!r} instead of {READY!r}")

    def run(self, window: float) -> dict:
        start = time.time() + 1.0  # every driver has the line by then
        end = start + window
        for p in self.procs:
            p.stdin.write(f"{GO} {start} {end}\n")
            p.stdin.flush()
        spans: list[tuple[float, float]] = []
        errors: list[str] = []
        for i, p in enumerate(self.procs):
            got = json.loads(report.read_line(p, window + _SETUP_TIMEOUT, f"client driver {i}"))
            spans += [tuple(s) for s in got["spans"]]
            errors += got["errors"]
        if errors:
            raise RuntimeError(f"{len(errors)} client(s) failed; the first: {errors[0]}")
        counted_from = start + window * WARMUP_FRACTION
        ended = [b for a, b in spans if counted_from <= b <= end]
        latencies = sorted(b - a for a, b in spans if counted_from <= b <= end)
        return {"rate": len(ended) / (end - counted_from), "rounds": len(ended),
                "p50": _percentile(latencies, 50), "p99": _percentile(latencies, 99), "latencies": len(latencies)}

    def __enter__(self) -> "_Drivers":
        return self

    def __exit__(self, *exc: Any) -> None:
        from pathways.cluster import stop_processes

        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        stop_processes(self.procs)


def _percentile(values: list[float], q: float) -> float:
    """The ``q``th percentile of sorted ``values`` (nearest rank); nan for none."""
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def driver(address: str, first: int, count: int) -> None:
    """Clients ``first`` to ``first + count - 1``: connect each, then on ``go START END``
    run rounds from START to END (wall-clock times) and print their spans as JSON."""
    import pathways as pw
    from pathways.client.session import Session
    from pathways.keeper import exit_with_parent

    exit_with_parent()
    clients = []
    for i in range(first, first + count):
        session = Session(address, connect_timeout=_SETUP_TIMEOUT)
        s = pw.VirtualDeviceSet(session).add_slice(cpu_devices=1, island=i % 2)
        fn = pw.jit(lambda x: x * 2 + 1, mesh=s.mesh("x"))
        x = np.full(8, i, np.float32)
        np.testing.assert_array_equal(pw.device_get(fn(pw.device_put(x, s.devices))), x * 2 + 1)  # compiled
        clients.append((session, s, fn))
    print(READY, flush=True)
    command = sys.stdin.readline().split()
    if not command or command[0] != GO:
        return
    start, end = float(command[1]), float(command[2])
    spans: list[tuple[float, float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def rounds(k: int, s: Any, fn: Any) -> None:
        mine = []
        try:
            time.sleep(max(0.0, start - time.time()))
            while (began := time.time()) < end:
                x = np.full(8, k, np.float32)
                got = pw.device_get(fn(pw.device_put(x, s.devices)))
                mine.append((began, time.time()))
                if not np.array_equal(got, x * 2 + 1):
                    raise AssertionError(f"client {k} got {got} for {x} * 2 + 1")
                k += 1
        except Exception as e:  # reported with the spans; the benchmark fails on it
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
        with lock:
            spans.extend(mine)

    threads = [threading.Thread(target=rounds, args=(first + i, s, fn), daemon=True)
               for i, (_, s, fn) in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(end - time.time() + _SETUP_TIMEOUT)
    print(json.dumps({"spans": spans, "errors": errors}), flush=True)
    for session, _, _ in clients:
        session.close()


def tables(data: dict) -> list[report.Table]:
    rows = []
    for n in data["clients"]:
        rs = data["results"][str(n)]
        rows.append([str(n), report.rate(report.stats([r["rate"] for r in rs]), 1),
                     f"{report.stats([r['p50'] for r in rs])['median'] * 1e3:,.1f}",
                     f"{report.stats([r['p99'] for r in rs])['median'] * 1e3:,.1f}"])
    return [report.Table(f"put + run + fetch rounds of N clients on two islands ({data['window_s']:.0f} s windows)",
                         ["clients", "rounds/s (all clients)", "p50 latency (ms)", "p99 latency (ms)"], rows)]


def summary(data: dict) -> list[str]:
    lines = []
    for n in data["clients"]:
        rs = data["results"][str(n)]
        rate = report.stats([r["rate"] for r in rs])["median"]
        p99 = report.stats([r["p99"] for r in rs])["median"]
        lines.append(f"{n} clients: {rate:,.1f} rounds/s in all, p99 {p99:.3g} s")
    return lines + report.unjudged(data)


def notes(data: dict) -> str:
    return """
Each round is three requests: a put (to the worker, over gRPC), a run (to the controller,
which orders it on the island and dispatches it to the worker) and a fetch (from the worker,
which waits for the run's result). With one round in flight per client, a round's latency
is about N over the aggregate rate: past the point where the controller, the two workers and
the four driver processes fill the machine's cores, more clients add latency, not rounds.
"""


def plot(data: dict, path: str) -> None:
    rates = [report.stats([r["rate"] for r in data["results"][str(n)]])["median"] for n in data["clients"]]
    report.plot_lines(path, "Rounds per second of N clients", "clients", "rounds/s",
                      [("all clients", data["clients"], rates)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="clients of the clients benchmark")
    parser.add_argument("--driver", nargs=3, metavar=("ADDRESS", "FIRST", "COUNT"), required=True)
    args = parser.parse_args()
    driver(args.driver[0], int(args.driver[1]), int(args.driver[2]))
