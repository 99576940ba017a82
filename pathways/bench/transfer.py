"""``python -m pathways bench transfer``: worker-to-worker transfer bandwidth next to raw TCP.

One local cluster of three worker processes: an island of two hosts and an island of one
host, one CPU device each. An array is put once on a slice of island 0's first host; a
``@pw.program`` calls a cheap compiled function (``x[-1:]``) on a slice of another host, so
every call moves the whole array over the data plane (worker-to-worker TCP, wire/tcp.py),
either to the island's other host or to the other island (the paper's DCN case). The same sizes go
through a plain TCP socket between two helper processes on loopback (a sender ``sendall``s
a preallocated buffer, a receiver ``recv_into``s one and acks with one byte), the most this
machine can move between two processes with one stream.

For every size, in every round, the cases run alternately so that machine noise hits them
alike. Each sample is the mean time of a few back-to-back runs, each waited for before the
next; MB/s is 10^6 bytes of array per second of that time. The fixed cost of one run (a
one-element array) is reported too, and the "net" column is the rate with it subtracted.
"""

from __future__ import annotations

import math
import os
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from pathways.bench import report

MiB = 1 << 20
SIZES: tuple[int, ...] = (1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
ROUTES = ("same island", "other island")
_SAMPLE_BYTES = 64 * MiB  # runs per sample: enough that small sizes are not timer noise
_MAX_RUNS = 20
_TIMEOUT = 120.0  # the longest one run, one raw transfer or a helper's start may take
_IDLE_TIMEOUT = 600.0  # the longest the raw TCP helpers wait for the next transfer
_GRACE_SECONDS = 3.0
_HEADER = struct.Struct("!Q")


def _runs(nbytes: int) -> int:
    return max(2, min(_MAX_RUNS, _SAMPLE_BYTES // max(nbytes, 1)))


TITLE = "Transfers: worker-to-worker bandwidth next to a raw TCP socket"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 5
TINY_SIZES = (4096, 2 * MiB)  # copied into one write with the header, and sent from the array

ABOUT = """
An array on one host is read by a cheap computation (`x[-1:]`) on another host of the same
island, or on another island, so every run moves the whole array over the data plane
(worker-to-worker TCP). The baseline is a plain TCP socket between two helper processes on
loopback (`sendall` of a preallocated buffer, `recv_into` one, a one-byte ack), the most
this machine moves between two processes with one stream. Each sample is the mean of a few
back-to-back runs, each waited for; MB/s is 10^6 bytes of array per second. "Net" subtracts
the fixed cost of one run (a one-element array: dispatch, two workers, the client's fetch).
Target: pathways >= 0.5x raw TCP from 16 MiB.
"""


def measure(rounds: int, tiny: bool, progress: Any) -> dict[str, Any]:
    """``rounds`` alternating rounds for each size (whole float32 arrays): per size and
    route, the median, min and max bytes/s, the raw socket's, and the fixed cost per run."""
    return _measure(rounds, TINY_SIZES if tiny else SIZES, progress)


def _measure(rounds: int, sizes: Sequence[int], progress: Any) -> dict[str, Any]:
    # Imported here, not at module level: the raw socket helpers run this file as a script
    # and should start without importing jax.
    import numpy as np

    import pathways as pw

    sizes = [max(4, s - s % 4) for s in sizes]
    progress.expect(1 + rounds * (len(sizes) + 1))
    progress.step("starting 3 hosts on 2 islands")
    with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1),
                                   pw.Island(hosts=1, devices_per_host=1)]):
        raw = _RawSocket(max(sizes))
        try:
            source = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)
            routes = {"same island": pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0),
                      "other island": pw.make_virtual_device_set().add_slice(cpu_devices=1, island=1)}
            if routes["same island"].workers == source.workers:
                raise RuntimeError(f"both island-0 slices were placed on worker {source.workers}; "
                                   "the benchmark needs them on different hosts")
            programs = {route: _touch_program(pw, s) for route, s in routes.items()}
            arrays = {n: pw.device_put(np.arange(n // 4, dtype=np.float32), source.devices)
                      for n in [4, *sizes]}
            for n, x in arrays.items():  # warm up: compile, and check that the array's end arrives
                want = np.arange(n // 4, dtype=np.float32)[-1:]
                for route, program in programs.items():
                    got = np.asarray(program(x))
                    if not np.array_equal(got, want):
                        raise RuntimeError(f"{route}: a {n}-byte transfer delivered {got!r}, not {want!r}")
                raw.seconds(n, 1)
            cases: dict[str, Callable[[int, int], float]] = {
                route: lambda n, k, p=program: _time_runs(p, arrays[n], k) for route, program in programs.items()}
            cases["raw TCP"] = raw.seconds
            samples: dict[str, dict[int, list[float]]] = {c: {n: [] for n in arrays} for c in cases}
            for r in range(rounds):
                for n in arrays:
                    progress.step(f"{_size(n)} (round {r + 1}/{rounds})")
                    for case, timed in cases.items():
                        samples[case][n].append(timed(n, _runs(n)))
        finally:
            raw.close()
    return _report(samples, sizes)


def _touch_program(pw: Any, target: Any) -> Any:
    touch = pw.jit(lambda x: x[-1:], mesh=target.mesh("d"))

    @pw.program
    def program(x: Any) -> Any:
        return touch(x)

    return program


def _time_runs(program: Any, x: Any, runs: int) -> float:
    """Seconds per run over ``runs`` runs, each waited for before the next."""
    start = time.perf_counter()
    for _ in range(runs):
        program(x).block_until_ready(timeout=_TIMEOUT)
    return (time.perf_counter() - start) / runs


def _report(samples: dict[str, dict[int, list[float]]], sizes: list[int]) -> dict[str, Any]:
    overhead = {route: statistics.median(samples[route][4]) for route in ROUTES}
    rows = []
    for n in sizes:
        raw = n / statistics.median(samples["raw TCP"][n])
        for route in ROUTES:
            times = samples[route][n]
            median = statistics.median(times)
            net = median - overhead[route]
            rows.append({"size": n, "route": route, "pathways": n / median, "min": n / max(times),
                         "max": n / min(times), "net": n / net if net > 0 else float("nan"),
                         "raw": raw, "ratio": n / median / raw})
    return {"rows": rows, "overhead_s": overhead, "raw_round_trip_s": statistics.median(samples["raw TCP"][4])}


def tables(data: dict) -> list:
    rows = [[_size(r["size"]), r["route"], f"{r['pathways'] / 1e6:,.0f} ({r['min'] / 1e6:,.0f}-{r['max'] / 1e6:,.0f})",
             _rate(r["net"]), f"{r['raw'] / 1e6:,.0f}", report.times(r["ratio"])] for r in data["rows"]]
    return [report.Table("MB/s (10^6 bytes), median (min-max) of the rounds",
                         ["size", "route", "pathways", "net of fixed cost", "raw TCP", "pathways/raw"], rows)]


def summary(data: dict) -> list[str]:
    lines = ["fixed cost per run (one float32): " + ", ".join(
        f"{route} {1e3 * s:.2f} ms" for route, s in data["overhead_s"].items())
        + f"; raw TCP round trip {1e3 * data['raw_round_trip_s']:.3f} ms"]
    for r in data["rows"]:
        if r["size"] >= 16 * MiB:
            verdict = "met" if r["ratio"] >= 0.5 else f"**missed** by {0.5 - r['ratio']:.2f}x"
            lines.append(f"{_size(r['size'])}, {r['route']}: {r['ratio']:.2f}x raw TCP (target >= 0.5x): {verdict}")
    return lines


def notes(data: dict) -> str:
    return """
Small arrays are dominated by the fixed cost of a run. At 256 MiB, per-transfer timestamps
show either the raw socket's rate or transfers 5-9x slower, stuck in the socket copy while
the receiver faults in fresh memory for the array; runs vary with it.
"""


def plot(data: dict, path: str) -> None:
    sizes = sorted({r["size"] for r in data["rows"]})
    series = [(route, [s / MiB for s in sizes], [next(r["pathways"] / 1e6 for r in data["rows"]
                                                     if r["size"] == s and r["route"] == route) for s in sizes])
              for route in ROUTES]
    series.append(("raw TCP", [s / MiB for s in sizes],
                   [next(r["raw"] / 1e6 for r in data["rows"] if r["size"] == s) for s in sizes]))
    report.plot_lines(path, "Worker-to-worker transfer bandwidth", "array size (MiB)", "MB/s", series,
                      logx=True, logy=True)


def _rate(bytes_per_second: float) -> str:
    # Not a number when a run took no longer than the median fixed cost.
    return "-" if math.isnan(bytes_per_second) else f"{bytes_per_second / 1e6:,.0f}"


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B"


class _RawSocket:
    """Two helper processes (this file run as a script) joined by one loopback TCP stream.

    Started once and kept for the whole benchmark, so process start is never timed; the
    sender takes ``SIZE RUNS`` lines on stdin and answers with the seconds per run.
    """

    def __init__(self, capacity: int) -> None:
        self.procs: list[subprocess.Popen] = []
        try:
            receiver = self._start("receive", str(capacity))
            port = report.read_line(receiver, _TIMEOUT, "a raw TCP helper")
            self.sender = self._start("send", str(capacity), port)
            if report.read_line(self.sender, _TIMEOUT, "a raw TCP helper") != "connected":
                raise RuntimeError("the raw TCP sender did not connect")
        except BaseException:
            self.close()
            raise

    def _start(self, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def seconds(self, nbytes: int, runs: int) -> float:
        self.sender.stdin.write(f"{nbytes} {runs}\n")
        self.sender.stdin.flush()
        return float(report.read_line(self.sender, _TIMEOUT, "a raw TCP helper"))

    def close(self) -> None:
        # The sender exits when its stdin closes, the receiver when the stream closes.
        for proc in self.procs:
            proc.stdin.close()
        deadline = time.monotonic() + _GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_GRACE_SECONDS)
            proc.stdout.close()


def _connect_options(sock: socket.socket) -> None:
    # Without it the ack (and a short tail of the data) may wait for a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _receive(capacity: int) -> None:
    buf = memoryview(bytearray(b"\0") * capacity)  # written now, so no page faults are timed
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(_TIMEOUT)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(_IDLE_TIMEOUT)  # the sender idles while the cluster is measured
        _connect_options(conn)
        while True:
            header = _recv_exactly(conn, memoryview(bytearray(_HEADER.size)))
            if header is None:
                return
            nbytes, = _HEADER.unpack(header)
            if nbytes > capacity or _recv_exactly(conn, buf[:nbytes]) is None:
                return
            conn.sendall(b"\1")


def _recv_exactly(conn: socket.socket, view: memoryview) -> memoryview | None:
    pos = 0
    while pos < len(view):
        got = conn.recv_into(view[pos:])
        if not got:
            return None
        pos += got
    return view


def _send(capacity: int, port: int) -> None:
    data = memoryview(bytearray(b"\x5a") * capacity)
    with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT) as conn:
        conn.settimeout(_TIMEOUT)
        _connect_options(conn)
        print("connected", flush=True)
        ack = bytearray(1)
        with selectors.DefaultSelector() as sel:
            sel.register(sys.stdin, selectors.EVENT_READ)
            while sel.select(_IDLE_TIMEOUT) and (line := sys.stdin.readline()):
                nbytes, runs = map(int, line.split())
                start = time.perf_counter()
                for _ in range(runs):
                    conn.sendall(_HEADER.pack(nbytes))
                    conn.sendall(data[:nbytes])
                    if conn.recv_into(ack) != 1:
                        raise RuntimeError("the raw TCP receiver closed the stream")
                print((time.perf_counter() - start) / runs, flush=True)


if __name__ == "__main__":
    # The benchmark ends the helpers by closing their streams, also after a Ctrl-C that
    # reached the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.argv[1] == "receive":
        _receive(int(sys.argv[2]))
    else:
        _send(int(sys.argv[2]), int(sys.argv[3]))
