"""``python -m pathways bench transfer``: worker-to-worker transfer bandwidth next to raw TCP,
with the data plane in the clear and over TLS.

Two local clusters of three worker processes each: an island of two hosts and an island of
one host, one CPU device each; the second requires a token and uses TLS everywhere, the data
plane included (``--data-plane-tls``, with certificates made for the run). On each, an array
is put once on a slice of island 0's first host; a
``@pw.program`` calls a cheap compiled function (``x[-1:]``) on a slice of another host, so
every call moves the whole array over the data plane (worker-to-worker TCP, wire/tcp.py),
either to the island's other host or to the other island (the paper's DCN case). The same sizes go
through a plain TCP socket between two helper processes on loopback (a sender ``sendall``s
a preallocated buffer, a receiver ``recv_into``s one and acks with one byte), the most this
machine can move between two processes with one stream.

Across two network namespaces joined by a bridge (pathways_bench/netns.py; needs root), the
data plane itself is measured, in the clear and over TLS, next to the same raw TCP copy over
the same veth link: a ``tcp.Listener`` in one namespace receives put frames that
``tcp.connect`` and ``tcp.send_frame`` send from the other, and acknowledges each on a side
connection. Where namespaces cannot be made, the results say why and the rest runs as before.

For every size, in every round, the cases run alternately so that machine noise hits them
alike. Each sample is the mean time of a few back-to-back runs, each waited for before the
next; MB/s is 10^6 bytes of array per second of that time. The fixed cost of one run (a
one-element array) is reported too, and the "net" column is the rate with it subtracted.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from pathways_bench import netns, report

MiB = 1 << 20
SIZES: tuple[int, ...] = (1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
ROUTES = ("same island", "other island")
_SAMPLE_BYTES = 64 * MiB  # runs per sample: enough that small sizes are not timer noise
_MAX_RUNS = 20
_TIMEOUT = 120.0  # the longest one run, one raw transfer or a helper's start may take
_IDLE_TIMEOUT = 600.0  # the longest the raw TCP helpers wait for the next transfer
_GRACE_SECONDS = 3.0
_HEADER = struct.Struct("!Q")
LOOPBACK = "127.0.0.1"
NETNS_HOSTS = ("sender", "receiver")
NETNS = "netns "  # starts the names of the cases across namespaces

# The data plane's columns across the namespaces: column -> transport, handed to both helpers
# with a folder holding the run's token and certificates ("plain:DIR", "tls:DIR"), which
# _data_plane_security() turns into tcp.Listener's and tcp.connect's arguments. Both carry the
# token: the receiver listens beyond loopback.
DATA_PLANE = {"pathways": "plain", "pathways TLS": "tls"}
ISLANDS = ((2, 1), (1, 1))  # (hosts, devices per host) of each cluster's two islands


def _runs(nbytes: int) -> int:
    return max(2, min(_MAX_RUNS, _SAMPLE_BYTES // max(nbytes, 1)))


TITLE = "Transfers: worker-to-worker bandwidth next to a raw TCP socket, with and without TLS"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 5
TINY_SIZES = (4096, 2 * MiB)  # copied into one write with the header, and sent from the array

ABOUT = """
An array on one host is read by a cheap computation (`x[-1:]`) on another host of the same
island, or on another island, so every run moves the whole array over the data plane
(worker-to-worker TCP). The same runs go through a second cluster with a token and TLS
everywhere, the data plane included (`--data-plane-tls`), alternated with the first, to show
what data-plane TLS costs. The baseline is a plain TCP socket between two helper processes on
loopback (`sendall` of a preallocated buffer, `recv_into` one, a one-byte ack), the most
this machine moves between two processes with one stream. Each sample is the mean of a few
back-to-back runs, each waited for; MB/s is 10^6 bytes of array per second. "Net" subtracts
the fixed cost of one run on its cluster (a one-element array: dispatch, two workers, the
client's fetch; with TLS on gRPC too). Target: pathways in the clear >= 0.5x raw TCP from
16 MiB.

Across two network namespaces joined by a bridge (a veth pair each; needs root), the data
plane alone is measured, in the clear and over TLS: a `tcp.Listener` in one namespace
receives put frames of the same sizes sent with `tcp.connect` and `tcp.send_frame` from the
other, each acknowledged with one byte, next to the same raw TCP copy over the same link,
alternated in the same rounds.
"""


def measure(rounds: int, tiny: bool, progress: Any) -> dict[str, Any]:
    """``rounds`` alternating rounds for each size (whole float32 arrays): per size and
    route, the median, min and max bytes/s, the raw socket's, and the fixed cost per run."""
    return _measure(rounds, TINY_SIZES if tiny else SIZES, progress)


def _measure(rounds: int, sizes: Sequence[int], progress: Any) -> dict[str, Any]:
    # Imported here, not at module level: the raw socket helpers run this file as a script
    # and should start without importing jax.
    import pathways as pw

    sizes = [max(4, s - s % 4) for s in sizes]
    lengths = [4, *sizes]
    progress.expect(3 + rounds * (len(sizes) + 1))
    with contextlib.ExitStack() as stack:
        secure = _security("tls", _secrets(stack, (LOOPBACK, "localhost")))
        islands = [pw.Island(hosts=h, devices_per_host=d) for h, d in ISLANDS]
        progress.step("starting 3 hosts on 2 islands")
        plain = stack.enter_context(pw.local_cluster(islands=islands))
        progress.step("starting 3 more, with a token and TLS on gRPC and the data plane")
        encrypted = stack.enter_context(pw.local_cluster(islands=islands, security=secure))
        raw = Pair(["raw-receive", str(max(sizes)), LOOPBACK], ["raw-send", str(max(sizes))])
        stack.callback(raw.close)
        cases: dict[str, Callable[[int, int], float]] = {}
        for tls, c in ((False, plain), (True, encrypted)):
            cases.update(_cluster_cases(pw, c.session, tls, lengths))
        cases["raw TCP"] = raw.seconds
        progress.step("starting helpers in two network namespaces")
        across, skipped = _across_namespaces(stack, max(sizes))
        cases.update(across)
        for n in lengths:  # warm up
            for case in ["raw TCP", *across]:
                cases[case](n, 1)
        samples: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in cases}
        for r in range(rounds):
            for n in lengths:
                progress.step(f"{_size(n)} (round {r + 1}/{rounds})")
                for case, timed in cases.items():
                    samples[case][n].append(timed(n, _runs(n)))
    data = _report(samples, sizes)
    data["netns"] = {"skipped": skipped} if skipped else _report_across(samples, sizes)
    return data


def _case(route: str, tls: bool) -> str:
    return f"{route}, TLS" if tls else route


def _cluster_cases(pw: Any, session: Any, tls: bool, lengths: Sequence[int]) -> dict[str, Callable[[int, int], float]]:
    """The timed runs of both routes on the cluster of ``session``, by case name: its arrays
    put, its programs compiled and each checked once."""
    import numpy as np

    from pathways.client.api import set_default_session

    set_default_session(session)  # slices and programs are made on, and run on, the default session
    source = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)
    routes = {"same island": pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0),
              "other island": pw.make_virtual_device_set().add_slice(cpu_devices=1, island=1)}
    if routes["same island"].workers == source.workers:
        raise RuntimeError(f"both island-0 slices were placed on worker {source.workers}; "
                           "the benchmark needs them on different hosts")
    programs = {route: _touch_program(pw, s) for route, s in routes.items()}
    arrays = {n: pw.device_put(np.arange(n // 4, dtype=np.float32), source.devices) for n in lengths}
    for n, x in arrays.items():  # warm up: compile, and check that the array's end arrives
        want = np.arange(n // 4, dtype=np.float32)[-1:]
        for route, program in programs.items():
            got = np.asarray(program(x))
            if not np.array_equal(got, want):
                raise RuntimeError(f"{_case(route, tls)}: a {n}-byte transfer delivered {got!r}, not {want!r}")

    def timed(program: Any, n: int, runs: int) -> float:
        set_default_session(session)
        return _time_runs(program, arrays[n], runs)

    return {_case(route, tls): functools.partial(timed, program) for route, program in programs.items()}


def _secrets(stack: contextlib.ExitStack, hosts: Sequence[str]) -> str:
    """A folder, removed by ``stack``, holding a token and TLS certificates for ``hosts``
    made for this run."""
    import secrets

    from pathways.wire.certs import make_certificates

    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="pathways-bench-"))
    make_certificates(directory, hosts)
    with open(os.open(os.path.join(directory, "token"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_urlsafe(32))
    return directory


def _security(transport: str, directory: str) -> Any:
    """The token (and for ``tls``, the certificates and data-plane TLS) in ``directory``."""
    from pathways.wire.security import Security, read_token_file

    token = read_token_file(os.path.join(directory, "token"))
    if transport == "plain":
        return Security(token)
    if transport == "tls":
        return Security(token, *(os.path.join(directory, f) for f in ("cert.pem", "key.pem", "ca.pem")),
                        data_plane_tls=True)
    raise ValueError(f"unknown data-plane transport {transport!r}; choose one of {sorted(DATA_PLANE.values())}")


def _across_namespaces(stack: contextlib.ExitStack, capacity: int) -> tuple[dict[str, Callable[[int, int], float]],
                                                                           Optional[str]]:
    """The cases across two network namespaces, closed by ``stack``: each data-plane column
    and raw TCP, by name; or none and why namespaces cannot be made here."""
    reason = netns.unavailable()
    if reason:
        return {}, reason
    net = stack.enter_context(netns.Network(NETNS_HOSTS))
    launch = functools.partial(_launch_in, net)
    receiver = net.addr("receiver")
    directory = _secrets(stack, (receiver,))
    cases = {}
    for column, transport in DATA_PLANE.items():
        transport = f"{transport}:{directory}"
        pair = Pair(["dp-receive", transport, receiver], ["dp-send", transport, str(capacity)], launch)
        stack.callback(pair.close)
        cases[NETNS + column] = pair.seconds
    raw = Pair(["raw-receive", str(capacity), receiver], ["raw-send", str(capacity)], launch)
    stack.callback(raw.close)
    cases[NETNS + "raw TCP"] = raw.seconds
    return cases, None


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
    cases = [(route, tls) for route in ROUTES for tls in (False, True)]
    overhead = {_case(*c): statistics.median(samples[_case(*c)][4]) for c in cases}
    rows = []
    for n in sizes:
        raw = n / statistics.median(samples["raw TCP"][n])
        for route, tls in cases:
            times = samples[_case(route, tls)][n]
            median = statistics.median(times)
            net = median - overhead[_case(route, tls)]
            # Net of the fixed cost, a run cannot move the bytes faster than the raw socket does:
            # a rate above it means the fixed cost's spread exceeds the transfer (small arrays).
            net_rate = n / net if net > 0 else math.nan
            rows.append({"size": n, "route": route, "tls": tls, "pathways": n / median, "min": n / max(times),
                         "max": n / min(times), "net": net_rate if net_rate <= raw else math.nan,
                         "raw": raw, "ratio": n / median / raw})
    return {"rows": rows, "overhead_s": overhead, "raw_round_trip_s": statistics.median(samples["raw TCP"][4])}


def _report_across(samples: dict[str, dict[int, list[float]]], sizes: list[int]) -> dict[str, Any]:
    rows = []
    for n in sizes:
        rates = {c: report.stats([n / t for t in samples[NETNS + c][n]]) for c in [*DATA_PLANE, "raw TCP"]}
        rows.append({"size": n, "rates": rates,
                     "ratios": {c: report.ratio(rates[c], rates["raw TCP"]) for c in DATA_PLANE}})
    return {"columns": list(DATA_PLANE), "rows": rows,
            "round_trip_s": {c: statistics.median(samples[NETNS + c][4]) for c in [*DATA_PLANE, "raw TCP"]}}


def tables(data: dict) -> list:
    # Measurements from before the TLS rows have no "tls" field: their data plane was in the clear.
    rows = [[_size(r["size"]), r["route"], "TLS" if r.get("tls") else "clear",
             f"{r['pathways'] / 1e6:,.0f} ({r['min'] / 1e6:,.0f}-{r['max'] / 1e6:,.0f})",
             _rate(r["net"]), f"{r['raw'] / 1e6:,.0f}", report.times(r["ratio"])] for r in data["rows"]]
    out = [report.Table("MB/s (10^6 bytes), median (min-max) of the rounds",
                        ["size", "route", "data plane", "pathways", "net of fixed cost", "raw TCP", "pathways/raw"],
                        rows)]
    across = data.get("netns", {})
    if across.get("rows"):
        columns = across["columns"]
        out.append(report.Table(
            "Across two network namespaces, data plane only: MB/s (10^6 bytes), median (min-max) of the rounds",
            ["size", *columns, "raw TCP", *(f"{c}/raw" for c in columns)],
            [[_size(r["size"]), *(report.rate(_mb(r["rates"][c])) for c in [*columns, "raw TCP"]),
              *(report.times(r["ratios"][c]) for c in columns)] for r in across["rows"]]))
    return out


def summary(data: dict) -> list[str]:
    lines = ["fixed cost per run (one float32): " + ", ".join(
        f"{route} {1e3 * s:.2f} ms" for route, s in data["overhead_s"].items())
        + f"; raw TCP round trip {1e3 * data['raw_round_trip_s']:.3f} ms"]
    lines += report.unjudged(data)
    for route in ROUTES:  # in the clear: the target is the runtime's, not TLS's
        x = data["overhead_s"][route] / data["raw_round_trip_s"]
        verdict = report.verdict(data, x <= 5, f"**missed** by {x - 5:.1f}x")
        lines.append(f"fixed cost of a one-float32 run, {route} / raw TCP round trip: {x:.1f}x (target <= 5x): {verdict}")
    clear = {(r["size"], r["route"]): r for r in data["rows"] if not r.get("tls")}
    for r in data["rows"]:
        if r["size"] < 16 * MiB:
            continue
        if not r.get("tls"):
            verdict = report.verdict(data, r["ratio"] >= 0.5, f"**missed** by {0.5 - r['ratio']:.2f}x")
            lines.append(f"{_size(r['size'])}, {r['route']}: {r['ratio']:.2f}x raw TCP (target >= 0.5x): {verdict}")
        else:
            lines.append(f"{_size(r['size'])}, {r['route']}, data plane over TLS: "
                         f"{r['pathways'] / clear[(r['size'], r['route'])]['pathways']:.2f}x the rate in the clear")
    across = data.get("netns", {})
    if "skipped" in across:
        lines.append(f"across network namespaces: not measured: {across['skipped']}")
    elif across:
        lines.append("across network namespaces, round trip of one float32: " + ", ".join(
            f"{c} {1e3 * s:.3f} ms" for c, s in across["round_trip_s"].items()))
        largest = across["rows"][-1]
        lines.append(f"across network namespaces, {_size(largest['size'])}: " + ", ".join(
            f"{c} {largest['ratios'][c]:.2f}x raw TCP" for c in across["columns"]))
    return lines


def notes(data: dict) -> str:
    return """
Small arrays are dominated by the fixed cost of a run. Timestamps inside that run (see
docs/performance-notes.md, "Shorter hops") split it: with source and consumer on the same
worker (no transfer at all) a run already costs 1.2-2.8 ms, of which the client's
`block_until_ready` on the computed output (a gRPC `Fetch` to the worker) is 0.6-1.1 ms and
the submission through the controller 0.2-0.3 ms; the worker-to-worker transfer adds
0.5-1.1 ms, of which the data plane's own put and ack is about 0.1 ms across namespaces.
The raw round trip is one `sendall` and one `recv` between two idle processes. Closing the
5x gap needs the result fetch and the submission-to-dispatch path made one message each on
warm connections (the fetch alone is several round trips' worth of gRPC and Python on each
side), not a faster data plane.

At 256 MiB, per-transfer timestamps show either the raw socket's rate or transfers 5-9x slower, stuck in the socket copy while
the receiver faults in fresh memory for the array; runs vary with it.
"""


def plot(data: dict, path: str) -> None:
    sizes = sorted({r["size"] for r in data["rows"]})
    series = [(_case(route, tls), [s / MiB for s in sizes],
               [next(r["pathways"] / 1e6 for r in data["rows"]
                     if r["size"] == s and r["route"] == route and r.get("tls", False) == tls) for s in sizes])
              for route in ROUTES for tls in (False, True)
              if any(r["route"] == route and r.get("tls", False) == tls for r in data["rows"])]
    series.append(("raw TCP, loopback", [s / MiB for s in sizes],
                   [next(r["raw"] / 1e6 for r in data["rows"] if r["size"] == s) for s in sizes]))
    across = data.get("netns", {})
    for c in [*across.get("columns", []), "raw TCP"] if across.get("rows") else []:
        series.append((f"{c}, across namespaces", [r["size"] / MiB for r in across["rows"]],
                       [r["rates"][c]["median"] / 1e6 for r in across["rows"]]))
    report.plot_lines(path, "Worker-to-worker transfer bandwidth", "array size (MiB)", "MB/s", series,
                      logx=True, logy=True)


def _rate(bytes_per_second: float) -> str:
    # Not a number when a run took no longer than the median fixed cost, or when what is left
    # would be faster than raw TCP.
    return "-" if math.isnan(bytes_per_second) else f"{bytes_per_second / 1e6:,.0f}"


def _mb(rate: dict[str, float]) -> dict[str, float]:
    return {k: v / 1e6 if k in ("median", "min", "max") else v for k, v in rate.items()}


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B"


Launch = Callable[[str, list], subprocess.Popen]


def _launch_here(role: str, argv: list) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _launch_in(net: netns.Network, role: str, argv: list) -> subprocess.Popen:
    # The helpers run this file as a script: the data plane's need the package on their path.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return net.popen(role, argv, env={"PYTHONPATH": path}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)


class Pair:
    """Two helper processes (this file run as a script) joined by one TCP stream, a receiver
    and a sender, started with ``launch`` (in their roles' namespaces, or here).

    Started once and kept for the whole benchmark, so process start is never timed. The
    receiver, started with the arguments ``receiver``, prints the arguments that the sender
    (started with ``sender`` and those) needs to reach it. The sender takes ``SIZE RUNS``
    lines on stdin and answers with the seconds per run, each run waited for.
    """

    def __init__(self, receiver: list[str], sender: list[str], launch: Launch = _launch_here) -> None:
        self.procs: list[subprocess.Popen] = []
        try:
            rx = self._start(launch, "receiver", receiver)
            peer = report.read_line(rx, _TIMEOUT, f"the {receiver[0]} helper").split()
            self.sender = self._start(launch, "sender", [*sender, *peer])
            if report.read_line(self.sender, _TIMEOUT, f"the {sender[0]} helper") != "connected":
                raise RuntimeError(f"the {sender[0]} helper did not connect")
        except BaseException:
            self.close()
            raise

    def _start(self, launch: Launch, role: str, args: list[str]) -> subprocess.Popen:
        proc = launch(role, [sys.executable, os.path.abspath(__file__), *args])
        self.procs.append(proc)
        return proc

    def seconds(self, nbytes: int, runs: int) -> float:
        self.sender.stdin.write(f"{nbytes} {runs}\n")
        self.sender.stdin.flush()
        return float(report.read_line(self.sender, _TIMEOUT, "a transfer helper"))

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
        self.procs.clear()


def _connect_options(sock: socket.socket) -> None:
    # Without it the ack (and a short tail of the data) may wait for a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _listen(host: str) -> socket.socket:
    server = socket.create_server((host, 0))
    server.settimeout(_TIMEOUT)
    return server


def _accept(server: socket.socket) -> socket.socket:
    """The one connection ``server`` takes; then it closes."""
    with server:
        conn, _ = server.accept()
    _connect_options(conn)
    return conn


def _receive(capacity: int, host: str) -> None:
    buf = memoryview(bytearray(b"\0") * capacity)  # written now, so no page faults are timed
    server = _listen(host)
    print(host, server.getsockname()[1], flush=True)
    with _accept(server) as conn:
        conn.settimeout(_IDLE_TIMEOUT)  # the sender idles while the cluster is measured
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


def _connected(host: str, port: int) -> socket.socket:
    conn = socket.create_connection((host, port), timeout=_TIMEOUT)
    _connect_options(conn)
    return conn


def _serve(transfer: Callable[[int], None]) -> None:
    """Answer every ``SIZE RUNS`` line on stdin with the seconds per ``transfer(SIZE)``; end
    when stdin closes (or stays quiet for the idle timeout)."""
    print("connected", flush=True)
    with selectors.DefaultSelector() as sel:
        sel.register(sys.stdin, selectors.EVENT_READ)
        while sel.select(_IDLE_TIMEOUT) and (line := sys.stdin.readline()):
            nbytes, runs = map(int, line.split())
            start = time.perf_counter()
            for _ in range(runs):
                transfer(nbytes)
            print((time.perf_counter() - start) / runs, flush=True)


def _send(capacity: int, host: str, port: int) -> None:
    data = memoryview(bytearray(b"\x5a") * capacity)
    ack = bytearray(1)
    with _connected(host, port) as conn:

        def transfer(nbytes: int) -> None:
            conn.sendall(_HEADER.pack(nbytes))
            conn.sendall(data[:nbytes])
            if conn.recv_into(ack) != 1:
                raise RuntimeError("the raw TCP receiver closed the stream")

        _serve(transfer)


# The bare gRPC stream: one service of two methods on raw bytes (no serializer, no copy into
# or out of a message class), the receiver keeping no byte, so that only gRPC's own framing
# and copies are timed.
# Put: client streaming, the chunks of one buffer, answered with their byte count (ASCII);
# Get: server streaming, asked for SIZE (ASCII), answered with the chunks of SIZE bytes.
_GRPC_SERVICE = "pathways_bench.Bytes"
_GRPC_OPTIONS = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]


def _chunks(data: bytes, nbytes: int) -> Iterator[bytes]:
    """``nbytes`` bytes as messages of ``len(data)`` bytes: the same prebuilt message each
    time, and a shorter last one."""
    for start in range(0, nbytes, len(data)):
        yield data if nbytes - start >= len(data) else data[:nbytes - start]


def _grpc_receive(chunk: int, host: str) -> None:
    """A gRPC server of ``Put`` and ``Get`` on ``host``, in messages of ``chunk`` bytes; prints
    ``HOST PORT`` and serves until its stdin closes (or stays quiet for the idle timeout)."""
    from concurrent import futures

    import grpc

    data = b"\x5a" * chunk

    def put(requests: Iterator[bytes], context: Any) -> bytes:
        return str(sum(len(r) for r in requests)).encode()

    def get(request: bytes, context: Any) -> Iterator[bytes]:
        return _chunks(data, int(request))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GRPC_SERVICE, {
        "Put": grpc.stream_unary_rpc_method_handler(put),
        "Get": grpc.unary_stream_rpc_method_handler(get),
    }),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    try:
        print(host, port, flush=True)
        with selectors.DefaultSelector() as sel:
            sel.register(sys.stdin, selectors.EVENT_READ)
            while sel.select(_IDLE_TIMEOUT) and sys.stdin.readline():
                pass
    finally:
        server.stop(0)


def _grpc_send(direction: str, chunk: int, host: str, port: int) -> None:
    """Timed ``put``s (one ``Put`` call streaming SIZE bytes to the receiver) or ``get``s (one
    ``Get`` call streaming SIZE bytes back), in messages of ``chunk`` bytes, on one channel."""
    import grpc

    data = b"\x5a" * chunk
    with grpc.insecure_channel(f"{host}:{port}", options=_GRPC_OPTIONS) as channel:
        grpc.channel_ready_future(channel).result(timeout=_TIMEOUT)
        put = channel.stream_unary(f"/{_GRPC_SERVICE}/Put")
        get = channel.unary_stream(f"/{_GRPC_SERVICE}/Get")

        def transfer(nbytes: int) -> None:
            if direction == "put":
                got = int(put(_chunks(data, nbytes), timeout=_TIMEOUT))
            else:
                got = sum(len(m) for m in get(str(nbytes).encode(), timeout=_TIMEOUT))
            if got != nbytes:
                raise RuntimeError(f"a {nbytes}-byte gRPC {direction} moved {got} bytes")

        if direction not in ("put", "get"):
            raise ValueError(f"unknown gRPC direction {direction!r}; choose put or get")
        _serve(transfer)


def _data_plane_security(transport: str) -> dict[str, Any]:
    """The keyword arguments that select ``transport`` (``KIND:DIR``, KIND a value of
    DATA_PLANE, DIR the run's secrets) on tcp.Listener and tcp.connect."""
    kind, _, directory = transport.partition(":")
    return {"security": _security(kind, directory)}


def _dp_receive(transport: str, host: str) -> None:
    """A data-plane listener on ``host`` that acknowledges every frame with one byte on a
    side connection; prints ``LISTENER_ADDRESS HOST ACK_PORT``."""
    from pathways.wire import tcp

    acked: list[socket.socket] = []  # the acknowledgements' connection, once the sender opened it

    def receive(header: dict, pieces: list) -> None:
        # 1 if the array's last element arrived as sent; then the pieces are dropped
        acked[0].sendall(b"\1" if pieces[-1][1][-1] == 1.0 else b"\0")

    listener = tcp.Listener(receive, _TIMEOUT, host=host, **_data_plane_security(transport))
    try:
        server = _listen(host)
        print(listener.address, host, server.getsockname()[1], flush=True)
        with _accept(server) as conn:
            acked.append(conn)
            conn.sendall(b"\1")  # ready: no frame may arrive before this connection is known
            conn.settimeout(_IDLE_TIMEOUT)
            conn.recv(1)  # returns when the sender closes its end, or raises after the idle timeout
    finally:
        listener.close()


def _dp_send(transport: str, capacity: int, address: str, ack_host: str, ack_port: int) -> None:
    """Put frames of SIZE bytes (a float32 array) to the listener at ``address``, as a worker
    sends them to a peer, each waited for until its receiver acknowledged it."""
    import numpy as np

    from pathways.wire import codec, tcp

    data = np.full(capacity // 4, 1.0, np.float32)  # written now, so no page faults are timed
    ack = bytearray(1)
    with _connected(ack_host, ack_port) as acks, \
            tcp.connect(address, _TIMEOUT, **_data_plane_security(transport)) as conn:
        conn.settimeout(_TIMEOUT)
        if acks.recv_into(ack) != 1:
            raise RuntimeError("the data-plane receiver closed its acknowledgements")

        def transfer(nbytes: int) -> None:
            x = data[:nbytes // 4]
            pieces = [(codec.full_region(x.shape), x)]
            tcp.send_frame(conn, {"t": "put", "handle": 1, "layout": [], "of": 1,
                                  **codec.pieces_header(x.dtype, x.shape, pieces)}, pieces)
            if acks.recv_into(ack) != 1:
                raise RuntimeError("the data-plane receiver closed its acknowledgements")
            if ack != b"\1":
                raise RuntimeError(f"a {nbytes}-byte put frame arrived with other data than was sent")

        _serve(transfer)


_HELPERS: dict[str, Callable[..., None]] = {
    "raw-receive": lambda capacity, host: _receive(int(capacity), host),
    "raw-send": lambda capacity, host, port: _send(int(capacity), host, int(port)),
    "grpc-receive": lambda chunk, host: _grpc_receive(int(chunk), host),
    "grpc-send": lambda direction, chunk, host, port: _grpc_send(direction, int(chunk), host, int(port)),
    "dp-receive": _dp_receive,
    "dp-send": lambda transport, capacity, address, host, port: _dp_send(transport, int(capacity), address, host,
                                                                        int(port)),
}

if __name__ == "__main__":
    # The benchmark ends the helpers by closing their streams, also after a Ctrl-C that
    # reached the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _HELPERS[sys.argv[1]](*sys.argv[2:])
