"""``python -m pathways bench control``: CPU cost of a control message on each transport the
controller could use.

A server process (this file run as a script) answers a client stream opened by the
benchmark's own process; CPU time (user + system, all threads) of both processes is read
from /proc around each sample and divided by the messages sent. Transports:

- sync gRPC: the controller's former design: grpcio's thread-pool server, a pump thread per
  stream handing each payload to a trio thread, replies through a thread-safe Outbox;
- aio gRPC: the controller's current shell (ControllerServer on grpc.aio), unchanged;
- framed TCP: 4-byte length + msgpack over one socket, a thread reading it, as the data plane.

Both gRPC servers run the same stand-in core (decode and validate the batch like the
controller's, answer when asked) and the client is the synchronous grpcio stream that
clients and workers use; only the server side differs.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

from pathways_bench import report
from pathways.wire import frames

TITLE = "Control messages: CPU per message on the controller's transports"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 5
TRANSPORTS = ("sync gRPC", "aio gRPC", "framed TCP")
_KINDS = {"sync gRPC": "sync", "aio gRPC": "aio", "framed TCP": "tcp"}
PING_PONGS, BURST = 2000, 5000
_TINY_PING_PONGS, _TINY_BURST = 100, 200
# Framed TCP is cheap enough that the gRPC counts would take a few clock ticks of CPU (the
# unit /proc counts in): it sends this many times more messages per sample.
_TCP_SCALE = 10
_TIMEOUT = 60.0
_GRACE_SECONDS = 2.0
_MAX_FRAME_BYTES = 1 << 20  # a batch of run or done messages, or a reply: kilobytes
_ANSWER = 1  # the program id of a run message the server answers; others it only decodes

ABOUT = f"""
CPU time (user + system, every thread) of a client process and a server process together,
divided by the control messages they exchanged, on three transports: **sync gRPC**, the
controller's former design (grpcio's thread-pool server, a thread per stream and a pump
thread handing payloads to the core's trio thread); **aio gRPC**, the controller's current
shell (`ControllerServer` on grpc.aio, the core on the same asyncio loop); **framed TCP**, a
4-byte length and msgpack over a socket, read by a thread, as the data plane does. The client
is the synchronous grpcio stream clients and workers use (a plain socket for TCP). Messages
are `run` messages (program, handle base, one input), each its own payload, decoded and
validated by the server as the controller does; replies are a worker's `done` report.
*Ping-pong*: {PING_PONGS} messages, each answered before the next is sent (two messages
per round trip, both counted). *Burst*: {BURST} messages sent without waiting, one answer
at the end. Framed TCP sends {_TCP_SCALE}x as many, so that its samples span enough clock
ticks. The transports alternate within each round.
"""


# ---- the server side (run as a script) ---------------------------------------------


class _EchoCore:
    """Stands in for ControllerCore: decodes and validates each batch like the core, and
    answers run messages of program ``_ANSWER`` with a done report."""

    def __init__(self) -> None:
        self.outboxes: dict[int, Any] = {}

    def handle(self, payload: bytes) -> list:
        from pathways.protocol import messages as m

        return [m.Done(((msg.base, 1e-4),))
                for msg in m.SESSION_UP.decode_batch(payload) if type(msg) is m.Run and msg.program == _ANSWER]

    # ControllerCore's session entry points, for the gRPC shells
    def session_opened(self, sid: int, outbox: Any) -> None:
        self.outboxes[sid] = outbox

    def on_session_batch(self, sid: int, payload: bytes) -> None:
        for reply in self.handle(payload):
            self.outboxes[sid].put(reply)

    def session_closed(self, sid: int) -> None:
        self.outboxes.pop(sid, None)


def _serve_sync() -> None:
    """The controller's former shell: grpcio threads, a pump thread per stream, the core on
    a trio thread reached with run_sync_soon, replies through streams.Outbox."""
    import itertools

    import trio

    from pathways.protocol import streams
    from pathways.wire import rpc

    core = _EchoCore()
    sids = itertools.count(1)

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()

        def session(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
            sid = next(sids)
            outbox = streams.Outbox()
            token.run_sync_soon(core.session_opened, sid, outbox)

            def pump() -> None:
                try:
                    for payload in requests:
                        token.run_sync_soon(core.on_session_batch, sid, payload)
                except Exception:  # the client went away
                    pass
                finally:
                    token.run_sync_soon(core.session_closed, sid)
                    outbox.close()

            threading.Thread(target=pump, daemon=True).start()
            return outbox.batches()

        server, port = rpc.make_server(rpc.CONTROLLER_SERVICE, {"Session": rpc.stream_stream(session)},
                                       max_workers=64)
        print(port, flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        server.stop(grace=0)

    trio.run(main)


def _serve_aio() -> None:
    """The controller's shell itself, with the stand-in core."""
    import asyncio

    from pathways.controller.server import ControllerServer
    from pathways.wire import rpc

    async def main() -> None:
        controller = ControllerServer("fifo", 1)
        controller.core = _EchoCore()
        server, port = await rpc.start_aio_server(rpc.CONTROLLER_SERVICE, controller.handlers())
        print(port, flush=True)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await stop.wait()
        await controller.stop(server)

    asyncio.run(main())


def _serve_tcp() -> None:
    from pathways.protocol.messages import encode_batch

    core = _EchoCore()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = frames.FrameReader(conn)  # buffered: one recv may bring several frames
    with conn:
        while (payload := reader.read(_MAX_FRAME_BYTES)) is not None:
            replies = core.handle(payload)
            if replies:
                conn.sendall(frames.frame(encode_batch(replies)))
    reader.close()


# ---- the client side ---------------------------------------------------------------


class _Transport:
    """A server process and this process's stream to it: ``send(payload)`` queues one
    payload, ``receive()`` waits for the next reply payload."""

    def __init__(self, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), kind], stdout=subprocess.PIPE,
                                     text=True)
        try:
            port = int(report.read_line(self.proc, _TIMEOUT, "a control benchmark server"))
            if kind == "tcp":
                self.sock = socket.create_connection(("127.0.0.1", port), _TIMEOUT)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.reader = frames.FrameReader(self.sock)
                self.send: Callable[[bytes], None] = lambda payload: self.sock.sendall(frames.frame(payload))
                self.receive: Callable[[], bytes] = self._receive_frame
            else:
                self._start_grpc(port)
        except BaseException:
            self.close()
            raise

    def _start_grpc(self, port: int) -> None:
        from pathways.wire import rpc

        address = f"grpc://127.0.0.1:{port}"
        self.channel = rpc.open_channel(address)
        rpc.wait_ready(self.channel, address, _TIMEOUT)
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()

        def requests() -> Iterator[bytes]:
            while (payload := self.outgoing.get()) is not None:
                yield payload  # one payload per message: nothing is coalesced on either side

        responses = rpc.method(self.channel, rpc.CONTROLLER_SERVICE, "Session", "stream_stream")(requests())
        self.send = self.outgoing.put
        self.receive = lambda: next(responses)

    def _receive_frame(self) -> bytes:
        payload = self.reader.read(_MAX_FRAME_BYTES)
        if payload is None:
            raise ConnectionError("the framed TCP server closed the connection")
        return payload

    def close(self) -> None:
        from pathways.cluster import stop_processes

        if hasattr(self, "outgoing"):
            self.outgoing.put(None)
            self.channel.close()
        if hasattr(self, "sock"):
            self.reader.close()
            self.sock.close()
        stop_processes([self.proc], _GRACE_SECONDS)
        self.proc.stdout.close()


def _messages(n: int, answered: Callable[[int], bool]) -> list[bytes]:
    """``n`` packed one-message batches of a realistic run message."""
    from pathways.protocol import messages as m
    from pathways.protocol.handles import first_handle

    return [m.encode_batch([m.Run(_ANSWER if answered(i) else 0, first_handle(1) + 16 * i, {0: first_handle(1) + 3})])
            for i in range(n)]


def _cpu(t: _Transport) -> tuple[float, float]:
    """CPU seconds so far of (this process and the server together, the server alone)."""
    server = report.cpu_seconds([t.proc.pid])
    return report.cpu_seconds([os.getpid()]) + server, server


def _ping_pong(t: _Transport, payloads: list[bytes]) -> tuple[float, float, float]:
    """CPU seconds per message (both ways counted) of both processes and of the server,
    and wall seconds per round trip."""
    (cpu, server), wall = _cpu(t), time.perf_counter()
    for payload in payloads:
        t.send(payload)
        t.receive()
    wall = time.perf_counter() - wall
    cpu_after, server_after = _cpu(t)
    n = 2 * len(payloads)
    return (cpu_after - cpu) / n, (server_after - server) / n, wall / len(payloads)


def _burst(t: _Transport, payloads: list[bytes]) -> tuple[float, float]:
    """CPU seconds per message of a burst answered once, at its last message: both
    processes, and the server."""
    cpu, server = _cpu(t)
    for payload in payloads:
        t.send(payload)
    t.receive()
    cpu_after, server_after = _cpu(t)
    n = len(payloads) + 1
    return (cpu_after - cpu) / n, (server_after - server) / n


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    pings, burst = (_TINY_PING_PONGS, _TINY_BURST) if tiny else (PING_PONGS, BURST)
    scale = {name: _TCP_SCALE if name == "framed TCP" else 1 for name in TRANSPORTS}
    ping_payloads = {name: _messages(pings * scale[name], lambda i: True) for name in TRANSPORTS}
    burst_payloads = {name: _messages(burst * scale[name], lambda i, n=burst * scale[name]: i == n - 1)
                      for name in TRANSPORTS}
    progress.expect(len(TRANSPORTS) * (2 * rounds + 1))
    transports: dict[str, _Transport] = {}
    try:
        for name in TRANSPORTS:
            progress.step(f"start {name}")
            transports[name] = t = _Transport(_KINDS[name])
            _ping_pong(t, ping_payloads[name][:50])  # warm up: connections, threads, first allocations
        walls: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
        servers: dict[str, list[float]] = {f"{name} {case}": [] for name in TRANSPORTS
                                           for case in ("ping-pong", "burst")}

        def ping(name: str) -> float:
            cpu, server, wall = _ping_pong(transports[name], ping_payloads[name])
            servers[f"{name} ping-pong"].append(server)
            walls[name].append(wall)
            return cpu

        def burst_of(name: str) -> float:
            cpu, server = _burst(transports[name], burst_payloads[name])
            servers[f"{name} burst"].append(server)
            return cpu

        cases = {}
        for name in TRANSPORTS:
            cases[f"{name} ping-pong"] = lambda name=name: ping(name)
            cases[f"{name} burst"] = lambda name=name: burst_of(name)
        samples = report.alternate(rounds, cases, progress)
    finally:
        for t in transports.values():
            t.close()
    us = lambda xs: report.stats([1e6 * x for x in xs])  # noqa: E731
    return {"transports": list(TRANSPORTS), "ping_pongs": pings, "burst": burst,
            "ping_cpu_us": {name: us(samples[f"{name} ping-pong"]) for name in TRANSPORTS},
            "burst_cpu_us": {name: us(samples[f"{name} burst"]) for name in TRANSPORTS},
            "ping_server_us": {name: us(servers[f"{name} ping-pong"]) for name in TRANSPORTS},
            "burst_server_us": {name: us(servers[f"{name} burst"]) for name in TRANSPORTS},
            "round_trip_us": {name: us(walls[name]) for name in TRANSPORTS}}


def _us(s: dict) -> str:
    return f"{s['median']:,.1f} ({s['min']:,.1f}-{s['max']:,.1f})"


def tables(data: dict) -> list:
    old = "sync gRPC"
    rows = [[name, _us(data["ping_cpu_us"][name]),
             report.times(report.ratio(data["ping_cpu_us"][name], data["ping_cpu_us"][old])),
             _us(data["burst_cpu_us"][name]),
             report.times(report.ratio(data["burst_cpu_us"][name], data["burst_cpu_us"][old])),
             _us(data["round_trip_us"][name])] for name in data["transports"]]
    servers = [[name, f"{data['ping_server_us'][name]['median']:,.1f}",
                f"{data['burst_server_us'][name]['median']:,.1f}"] for name in data["transports"]]
    return [report.Table("CPU microseconds per message, client and server together, median (min-max) of the rounds",
                         ["transport", "ping-pong", "vs sync", "burst", "vs sync", "round trip wall us"], rows),
            report.Table("of which the server's, median", ["transport", "ping-pong", "burst"], servers)]


def summary(data: dict) -> list[str]:
    ping, burst = data["ping_cpu_us"], data["burst_cpu_us"]
    return [f"aio gRPC costs {report.ratio(ping['aio gRPC'], ping['sync gRPC']):.2f}x the CPU of sync gRPC "
            f"per ping-pong message and {report.ratio(burst['aio gRPC'], burst['sync gRPC']):.2f}x per burst message",
            f"framed TCP costs {report.ratio(ping['framed TCP'], ping['aio gRPC']):.2f}x aio gRPC per ping-pong "
            f"message and {report.ratio(burst['framed TCP'], burst['aio gRPC']):.2f}x per burst message"]


def notes(data: dict) -> str:
    ping, server = data["ping_cpu_us"], data["ping_server_us"]
    return f"""
What it means. Moving the controller to grpc.aio was for scale (a stream costs a coroutine,
not a thread: tests/test_scale.py holds 1,000 sessions and 256 workers on one controller),
and it costs no more CPU per message: the server's side is \
{server['aio gRPC']['median']:.0f} us on grpc.aio against {server['sync gRPC']['median']:.0f} us on the thread pool.
Either way grpcio's Python layer is most of a control message's cost, on both ends:
framed TCP does the same exchange for {report.ratio(ping['framed TCP'], ping['aio gRPC']):.2f}x the CPU of aio gRPC.
The controller-worker streams, which carry every run's `go` and `done`, are therefore the
candidates for the data plane's framing, where it measures cheaper; client sessions stay on gRPC.

The figures include the client's side, the same synchronous grpcio stream for both gRPC
rows (a request-iterator thread and a reading thread), so the difference between those
rows is the server's. The sync row includes the hop to the core's trio thread that the
former controller made for every payload. In a burst nothing is coalesced here; the
controller's outboxes and the clients' coalesce whatever queued while a stream was busy,
which divides the per-message cost by the batch size. CPU is read in clock ticks (10 ms),
hence the round figures.
"""


def plot(data: dict, path: str) -> None:
    report.plot_bars(path, "CPU per control message (client + server)", "CPU us per message",
                     list(data["transports"]),
                     {"ping-pong": [data["ping_cpu_us"][n]["median"] for n in data["transports"]],
                      "burst": [data["burst_cpu_us"][n]["median"] for n in data["transports"]]})


if __name__ == "__main__":
    {"sync": _serve_sync, "aio": _serve_aio, "tcp": _serve_tcp}[sys.argv[1]]()
