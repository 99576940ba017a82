"""The controller process: the gRPC and socket shell around ControllerCore.

One asyncio loop runs everything: grpc.aio serves clients' Session streams and the unary
methods as coroutines, and ``asyncio.start_server`` serves workers' streams as framed TCP
connections (wire/frames.py; a control message costs about a fifth of the CPU it costs
over grpc.aio, BENCHMARKS.md "Control messages"), a coroutine per stream, so thousands of
sessions and workers fit. The core runs on the same loop, called directly by the stream that received
a payload, so it stays single-threaded without a hop between threads. Each stream has a
LoopOutbox and a writer task that sends whatever the core put there since its last write
as one batch. A worker learns the TCP port from the gRPC method AttachAddress and connects
to it at the host it reached the controller at. Both listen on the host of ``--bind``
(loopback by default).

Given a ``Security`` (wire/security.py) with a token, every gRPC call must carry it; a
worker's connection must open with a hello frame carrying the worker token (where there is
one; else the token), answered before any other frame is read; with a certificate, gRPC
and the workers' connections use TLS.

Each worker stream carries heartbeats both ways (wire/liveness.py): a loop timer per
stream queues one when nothing else went out for a while, and judges the worker once it
has been silent for the heartbeat timeout, by what the kernel knows of its connection
(liveness.judge): a worker whose host still acknowledges is slow (a process starved of
CPU, busy compiling, or stopped): it is kept, marked slow in the status
(``WorkerConn.silent``) until it is heard again, and the timer looks again every
heartbeat interval; one whose host stopped acknowledging (a dead host, a cut cable), and
on platforms whose kernel says nothing any silent one, has its connection dropped and the
core handles it as lost, naming how long it was silent. A connection that has not
registered is dropped on silence alone: a stranger has no work to be slow at. What bounds
a slow worker's runs is the run timeout (``run_timeout``). The core itself has no clock.

Given ``ifrt_bind`` and a way to start a front end there (the command line passes
pathways/ifrt/front_end.py's), the process also serves the IFRT proxy protocol, a front end
whose sessions are clients of this controller: started once the controller serves,
announced on the line after its address, stopped before it.

Concurrency: the loop's thread runs the core, every stream and every timer. Other threads
only where a library needs one: asyncio's default executor for work that blocks (starting
and stopping the front end), and, with the IFRT front end, that front end's own gRPC
threads, session threads and pace checker (pathways/ifrt/server.py), which reach the core
only through ``open_local`` streams, whose reads run on the loop (protocol/streams.py
LocalStream).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
from typing import Any, Awaitable, Callable, Optional, Protocol

import grpc

from pathways.controller.core import ControllerCore, WorkerConn
from pathways.controller.islands import Recovery
from pathways.controller.scheduler import DEFAULT_WINDOW
from pathways.defaults import ADDRESS_LINE, CONTROLLER_STOPPED, HEARTBEAT_TIMEOUT, IFRT_LINE
from pathways.errors import ConnectError, DeadlineExceededError, PathwaysError, WireError
from pathways.protocol import messages as m
from pathways.protocol.errors import kind_of
from pathways.protocol.operator import AttachAddress, Failed, reply
from pathways.protocol.handles import MAX_SESSION
from pathways.protocol import streams
from pathways.wire import codec, frames, rpc, tcp
from pathways.wire import security as sec
from pathways.wire.addresses import family_of, join_host_port, reachable_host, split_host_port, strip_brackets
from pathways.wire.codec import MAX_MESSAGE_BYTES
from pathways.wire.handshake import Hello
from pathways.wire.liveness import Heartbeats, TcpState, Verdict, check_timeout, judge
from pathways.wire.security import Security

log = logging.getLogger("pathways.controller")

# After a peer stops sending, how long its stream may take to deliver what is still queued
# for it (a peer that stopped reading too must not hold the stream open forever).
_DRAIN_SECONDS = 5.0
_STOP_GRACE_SECONDS = 0.5
_STOP_SECONDS = 5.0  # how long stopping waits for the streams to end before cancelling them
# How long stopping the IFRT proxy server may take: its calls in flight get a grace of a
# second and its gRPC server some more to end them, then its sessions close.
_IFRT_STOP_SECONDS = 15.0
# A worker's frame, once its length has arrived, must complete within this many seconds: a
# 64 MiB Compile crosses loopback in well under a second, so this leaves ample room for a
# host busy compiling, while a peer that announces a frame and stalls holds its buffer for
# no longer (workers wait for the controller 300 s by default; a frame is a small part).
FRAME_SECONDS = 30.0
# Until a connection has registered, its frames may be at most this long (a Register is a
# few hundred bytes), so that strangers cannot make the controller buffer 64 MiB each.
UNREGISTERED_FRAME_BYTES = 64 * 1024

Read = Callable[[], Awaitable[Optional[bytes]]]  # the next payload of a stream; None at its end


def _guarded(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # the core must outlive any one bad message
        log.exception("controller dropped a message in %s", getattr(fn, "__name__", fn))


class _Keepalive:
    """One worker stream's heartbeat timer on the event loop, from its first ``schedule``
    (once the worker has greeted: nothing is sent to a peer that has not): queues a
    heartbeat when nothing went out for an interval, and once the worker has been silent
    past the timeout judges it (liveness.judge, with ``tcp_state()``, what the kernel
    knows of its connection) at every tick: ``on_slow(seconds)`` while it is slow (the
    timer goes on), ``on_lost(seconds, why)`` once it is lost (the timer stops)."""

    def __init__(self, beats: Heartbeats, outbox: streams.LoopOutbox, tcp_state: Callable[[], Optional[TcpState]],
                 on_slow: Callable[[float], None], on_lost: Callable[[float, Optional[str]], None]) -> None:
        self._beats = beats
        self._outbox = outbox
        self._tcp_state = tcp_state
        self._on_slow = on_slow
        self._on_lost = on_lost
        self._slow = False
        self._loop = asyncio.get_running_loop()
        self._timer: Optional[asyncio.TimerHandle] = None

    def schedule(self) -> None:
        """(Re)arm the timer for whatever falls due first; call it after the intervals change.
        While the worker is slow the next heartbeat is what falls due: it is judged again
        each interval, not in a spin."""
        if self._timer is not None:
            self._timer.cancel()
        due = self._beats.until_beat()
        if not self._slow:
            due = min(due, self._beats.until_silent())
        self._timer = self._loop.call_later(due, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._slow = False
        if self._beats.silent_for() is not None:
            tcp = self._tcp_state()
            verdict = judge(self._beats, tcp)
            silent = self._beats.silent_for()
            if verdict is Verdict.LOST:
                assert silent is not None  # judge says LOST or SLOW only past the timeout
                why = None  # the kernel says nothing: silence alone lost it
                if tcp is not None:
                    why = (f"its host acknowledged nothing for {tcp.acked:.1f} s either: the host is down, or the "
                           "network between is cut") if tcp.open else "its connection is no longer open"
                self._on_lost(silent, why)
                return
            if verdict is Verdict.SLOW:
                assert silent is not None
                self._slow = True
                self._on_slow(silent)
        if self._beats.beat_due():
            self._outbox.put(m.Heartbeat(self._beats.timeout))
            self._beats.sent()  # queued is as good as sent: a blocked writer is the peer's silence to judge
        self.schedule()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_STUCK_CHECKS = 10  # how often, per run timeout, the controller looks for stuck islands
_BROKEN_CHECK_SECONDS = 0.5  # how often it looks for islands whose group broke (ControllerCore.check_broken_groups)


class ControllerServer:
    """``run_timeout``: seconds an island may have runs in flight and finish none before it
    is reset (ControllerCore.check_stuck_runs, asked every ``_STUCK_CHECKS``-th of it);
    None: never. ``recovery``: who brings a lost host back (islands.Recovery)."""

    def __init__(self, policy: str, window: int, security: Security | None = None,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT, run_timeout: float | None = None,
                 recovery: Recovery = Recovery.ELSEWHERE) -> None:
        self.security = security or Security()
        self._attach_security = self.security.for_attach()  # what workers' streams must greet with
        self.core = ControllerCore(policy, window, run_timeout, recovery=recovery)
        self._checks: list[asyncio.Task] = []
        self._refused_attaches = sec.Refusals()  # worker connections refused at (or for want of) their greeting
        self.heartbeat_timeout = check_timeout(heartbeat_timeout)
        self._session_ids = itertools.count(1)
        self._streams: set[asyncio.Task] = set()
        self._stopping = False  # the process is stopping: its streams end, but nothing was lost
        self._attach_server: Optional[asyncio.AbstractServer] = None
        self.worker_address = ""  # tcp://HOST:PORT once listen() ran
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the loop it serves on, once listen() ran
        self.worker_port = 0

    async def _stream(self, read: Read, send: Callable[[bytes], Awaitable[None]], outbox: streams.LoopOutbox,
                      on_payload: Callable[[bytes], None], on_end: Callable[[], None],
                      backpressure: bool = False) -> None:
        """Feed a stream's payloads (from ``read``) to ``on_payload`` while a writer task
        sends its outbox with ``send``. ``on_end`` is called exactly once, whether the peer
        finished sending or the stream was cancelled (the peer vanished), unless the
        controller is stopping. With ``backpressure`` (a client's session), the next payload
        is read only once the outbox has room (streams.MAX_QUEUED_MESSAGES, streams.MAX_QUEUED_BYTES):
        a client that does not read its replies is not served further, and costs no more
        memory."""
        task = asyncio.current_task()
        self._streams.add(task)
        writer = asyncio.create_task(outbox.write_to(send))
        try:
            while (payload := await read()) is not None:
                _guarded(on_payload, payload)
                if backpressure:
                    await outbox.room()
        except asyncio.CancelledError:
            if not self._stopping:
                writer.cancel()
                raise
            # stop() ended it: let a write still in flight complete (ending a call while one is
            # pending fails in gRPC's core), then end cleanly so that the peer sees a clean end
            outbox.close()
            try:
                await asyncio.wait_for(writer, _STOP_GRACE_SECONDS)
            except asyncio.TimeoutError:
                pass
            return
        except BaseException:
            writer.cancel()
            raise
        finally:
            self._streams.discard(task)
            if not self._stopping:
                _guarded(on_end)
            outbox.close()
        try:
            await asyncio.wait_for(writer, _DRAIN_SECONDS)
        except asyncio.TimeoutError:
            pass  # the peer stopped reading too: what was left for it is dropped

    async def listen(self, host: str, advertise: str | None = None) -> str:
        """Accept workers' framed TCP streams (over TLS if the controller has a certificate)
        on a free port of ``host``; returns the address, ``tcp://ADVERTISE:PORT`` (``host``
        by default), that AttachAddress names. Workers use only its port, with the host they
        reached the controller at."""
        self._loop = asyncio.get_running_loop()
        sec.check_bind(host, self.security, "the controller's worker port")
        sec.check_worker_admission(host, self.security)
        tls = {"ssl": sec.server_context(self.security), "ssl_handshake_timeout": sec.HELLO_SECONDS} \
            if self.security.serves_tls else {}
        self._attach_server = await asyncio.start_server(self.attach, strip_brackets(host) or None, 0,
                                                         family=family_of(host), **tls)
        self.worker_port = self._attach_server.sockets[0].getsockname()[1]
        self._checks.append(asyncio.create_task(self._check(self.core.check_broken_groups, _BROKEN_CHECK_SECONDS)))
        if self.core.run_timeout is not None:
            self._checks.append(asyncio.create_task(self._check(self.core.check_stuck_runs,
                                                                self.core.run_timeout / _STUCK_CHECKS)))
        self.worker_address = f"tcp://{join_host_port(advertise or host, self.worker_port)}"
        return self.worker_address

    async def _check(self, check: Callable[[], None], every: float) -> None:
        while True:
            await asyncio.sleep(every)
            _guarded(check)  # a bug there must not end the checks

    async def stop(self, server: grpc.aio.Server) -> None:
        """Stop accepting workers, end every stream (a worker's connection closes after
        what was queued for it), then the gRPC server."""
        self._stopping = True
        for task in self._checks:
            task.cancel()
        if self._attach_server is not None:
            self._attach_server.close()
        stopped = m.Shutdown(CONTROLLER_STOPPED)  # workers exit, rather than wait for it to come back
        for conn in self.core.workers.values():
            conn.outbox.put(stopped)
        streams = list(self._streams)
        for task in streams:
            task.cancel()
        # Let every stream finish its call before the server cancels what is left: a call
        # the server cancels while its handler is finishing fails in gRPC's core, and its
        # peer sees UNAVAILABLE instead of a clean end (on a busy host this takes a while).
        if streams:
            await asyncio.wait(streams, timeout=_STOP_SECONDS)
        await server.stop(grace=_STOP_GRACE_SECONDS)

    def open_local(self, requests: streams.Outbox) -> streams.LocalStream:
        """A session stream opened from another thread of this process (the IFRT front end's
        sessions), whose requests are what the client puts in ``requests``, served as a gRPC
        one is, with no gRPC in between; callable once the controller listens."""
        assert self._loop is not None, "open_local before listen"
        call = streams.LocalStream(self._loop, requests)

        async def serve() -> None:
            try:
                await self.session(None, call)
            finally:
                call.finish()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        return call

    async def session(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        sid = next(self._session_ids)
        if sid > MAX_SESSION:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "session ids exhausted; restart the controller")
        outbox = streams.LoopOutbox()
        self.core.session_opened(sid, outbox)

        async def read() -> Optional[bytes]:
            payload = await context.read()
            return None if payload is grpc.aio.EOF else payload

        await self._stream(read, context.write, outbox, lambda p: self.core.on_session_batch(sid, p),
                           lambda: self.core.session_closed(sid), backpressure=True)

    async def attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's stream: a TCP connection of frames (wire/frames.py). A broken frame
        (over its limit, cut short, or not complete within FRAME_SECONDS) ends the stream
        like a closed connection: the stream cannot be resynchronized. The first frame may
        be a hello (security.py), which is answered; where a token is required it must be
        one, carrying the token, within HELLO_SECONDS, else the connection is refused. A
        worker silent for the heartbeat timeout has its connection dropped and is lost as
        silent."""
        await _WorkerStream(self, reader, writer).serve()

    async def attach_address(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Where workers attach (operator.AttachAddress: "tcp://HOST:PORT" and the port). A worker
        connects to the port at the host it reached the controller at, which works
        whatever the controller bound (a wildcard, or an address behind NAT)."""
        return reply(AttachAddress(self.worker_address, self.worker_port))

    async def status(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply(self.core.status())

    async def measure(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Have every worker measure itself again (one after the other), wait up to the
        request's timeout for all of them, and reply the cluster's status with the new
        figures (ClusterStatus), or Failed."""
        try:
            timeout = m.MEASURE.decode_one(request).timeout
        except WireError as e:
            return reply(Failed(f"measure: {e}", kind_of(e)))
        finished = asyncio.get_running_loop().create_future()
        mid = self.core.measure(lambda: finished.done() or finished.set_result(None))
        try:
            await asyncio.wait_for(finished, timeout)
        except asyncio.TimeoutError:
            silent = self.core.abandon_measurement(mid)
            if silent:
                later = f"; worker(s) {silent[1:]}, which measure after it, were not asked" if silent[1:] else ""
                return reply(Failed(f"worker {silent[0]} did not report its measurements within {timeout:g} s"
                                    f"{later}. The figures of the others are in `python -m pathways status`",
                                    DeadlineExceededError.__name__))
        except asyncio.CancelledError:  # the caller gave up: stop waiting for the workers too
            self.core.abandon_measurement(mid)
            raise
        return reply(self.core.status())

    async def retire(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Retire an island, or one host (messages.RetireRequest): it takes no new slices at
        once; wait up to the request's timeout for its runs to finish, then retire it
        whether they did or not. Replies what was done (operator.Retired, with ``drained``:
        whether its runs finished in time), or Failed. A caller that gives up while it
        waits leaves the island as it was."""
        try:
            req = m.RETIRE.decode_one(request)
        except WireError as e:
            return reply(Failed(f"retire: {e}", kind_of(e)))
        drained = asyncio.get_running_loop().create_future()
        try:
            retirement = self.core.retire(req.island, req.worker, lambda: drained.done() or drained.set_result(None))
        except PathwaysError as e:
            return reply(Failed(f"retire: {e}", kind_of(e)))
        try:
            await asyncio.wait_for(asyncio.shield(drained), req.timeout)
        except asyncio.TimeoutError:
            pass  # retired all the same: what is still running there fails
        except asyncio.CancelledError:
            self.core.abandon_retirement(retirement)
            raise
        retired = self.core.finish_retirement(retirement, drained.done())
        if retired is None:  # a retire of the same island that gave up meanwhile abandoned it
            return reply(Failed(f"retire: the retirement of {retirement.describe()} was abandoned while it drained",
                                PathwaysError.__name__))
        return reply(retired)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Session": rpc.stream_stream(self.session),
                "AttachAddress": rpc.unary_unary(self.attach_address),
                "Status": rpc.unary_unary(self.status), "Measure": rpc.unary_unary(self.measure),
                "Retire": rpc.unary_unary(self.retire)}


class _WorkerStream:
    """One worker's connection to the controller (ControllerServer.attach): its greeting,
    its heartbeats both ways, and what ended it."""

    def __init__(self, server: "ControllerServer", reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server, self.reader, self.writer = server, reader, writer
        self.sock = writer.get_extra_info("socket")
        if self.sock is not None:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer = writer.get_extra_info("peername")
        self.conn = WorkerConn(streams.LoopOutbox())
        self.greeted = server._attach_security.token is None
        self.beats = Heartbeats(server.heartbeat_timeout)
        self.silence: list[float] = []  # how long the worker was silent, once given up for it
        self.cut: list[str] = []  # the error that ended the connection, or why silence did, if either did
        self.keepalive = _Keepalive(self.beats, self.conn.outbox, self._tcp_state, self._on_slow, self._on_lost)
        if self.greeted:
            self.keepalive.schedule()

    async def serve(self) -> None:
        conn, core = self.conn, self.server.core
        try:
            await self.server._stream(self._read, self._send, conn.outbox, self._on_payload,
                                      lambda: core.worker_lost(conn, self.silence[0] if self.silence else None,
                                                               self.cut[0] if self.cut else None))
        finally:
            self.keepalive.stop()
            self.writer.close()  # after what is buffered: the worker sees a clean end
            with contextlib.suppress(Exception):  # a reset peer, or the loop stopping
                await asyncio.wait_for(self.writer.wait_closed(), _DRAIN_SECONDS)

    def _tcp_state(self) -> Optional[TcpState]:
        if self.conn.worker < 0:
            return None  # a stranger has no work to be slow at: its silence alone ends it
        return tcp.tcp_state(self.sock) if self.sock is not None else None

    def _on_slow(self, seconds: float) -> None:
        if self.conn.silent is None:
            log.warning("worker %d (%s) sent nothing for %.1f s, more than the heartbeat timeout of %g s, but "
                        "its host still acknowledges: slow (starved of CPU, busy or stopped), not lost",
                        self.conn.worker, self.peer, seconds, self.beats.timeout)
        self.conn.silent = seconds

    def _on_lost(self, seconds: float, why: Optional[str]) -> None:
        self.silence.append(seconds)
        if why is not None:
            self.cut.append(why)
        log.warning("worker %d (%s) sent nothing for %.1f s, more than the heartbeat timeout of %g s%s: "
                    "dropping its connection", self.conn.worker, self.peer, seconds, self.beats.timeout,
                    f", and {why}" if why else "")
        self.writer.transport.abort()  # a frozen peer would never take what is buffered for it

    async def _read(self) -> Optional[bytes]:
        conn, peer, refusals = self.conn, self.peer, self.server._refused_attaches
        limit = MAX_MESSAGE_BYTES if conn.worker >= 0 else UNREGISTERED_FRAME_BYTES
        try:
            while True:
                frame = frames.read_frame(self.reader, limit, FRAME_SECONDS, self.beats.heard)
                payload = await (frame if self.greeted else asyncio.wait_for(frame, sec.HELLO_SECONDS))
                if payload is None or conn.worker >= 0:
                    return payload
                header = _header(payload)
                if self.greeted and not Hello.is_one(header):
                    return payload  # no token required, and no hello: the stream's first batch
                if not await self._greet(header):
                    return None
        except asyncio.TimeoutError:
            if refused_so_far := refusals.add():
                log.warning("closing the worker connection from %s: it did not greet within %g s (%d refused "
                            "so far)", peer, sec.HELLO_SECONDS, refused_so_far)
        except WireError as e:
            log.warning("closing the worker connection from %s (worker %d): %s", peer, conn.worker, e)
        except OSError as e:  # reset by the peer; worker_lost says so
            log.info("the worker connection from %s (worker %d) ended: %s", peer, conn.worker, e)
            self.cut.append(f"{type(e).__name__}: {e}")
        return None

    async def _greet(self, hello: Any) -> bool:
        """Answer a hello; whether it was admitted (with the worker token, where one is required)."""
        refused = sec.refusal_of(self.server._attach_security, hello, "controller", sec.attach_refusal())
        self.writer.write(sec.answer(refused))  # a whole frame
        await self.writer.drain()
        if refused is not None:
            if refused_so_far := self.server._refused_attaches.add():
                log.warning("refused a worker connection from %s: it did not give the worker token "
                            "(%d refused so far)", self.peer, refused_so_far)
            return False
        self.greeted = True
        self.keepalive.schedule()
        return True

    async def _send(self, payload: bytes) -> None:
        await frames.write_frame(self.writer, payload)
        self.beats.sent()

    def _on_payload(self, payload: bytes) -> None:
        conn = self.conn
        if conn.silent is not None:
            log.info("worker %d (%s) answers again after more than %.1f s of silence", conn.worker, self.peer,
                     conn.silent)
            conn.silent = None
        self.server.core.on_worker_batch(conn, payload)
        if conn.heartbeat is not None and conn.heartbeat != self.beats.peer_timeout:
            self.beats.learn(conn.heartbeat)  # the worker's heartbeats said how often it needs ours
            self.keepalive.schedule()


def _header(payload: bytes) -> object:
    """A frame's payload decoded, or None where it is not msgpack: a greeting is a map, a
    batch a list."""
    try:
        return codec.unpack(payload)
    except WireError:
        return None


class FrontEnd(Protocol):
    """A front end served beside the controller, in its process (the IFRT proxy server)."""

    address: str  # HOST:PORT it serves on

    def stop(self) -> None: ...

    def traffic(self) -> m.ArrayTraffic:
        """The array bytes it moved so far, for the controller's status."""
        ...


# Starts a front end on a bind address (HOST:PORT) in front of the controller at an address
StartFrontEnd = Callable[[str, str, "ControllerServer"], FrontEnd]


def main(policy: str = "fair", window: int = DEFAULT_WINDOW, bind: str = f"{rpc.LOOPBACK}:0",
         security: Security | None = None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
         ifrt_bind: str | None = None, run_timeout: float | None = None,
         recovery: Recovery = Recovery.ELSEWHERE, start_front_end: Optional[StartFrontEnd] = None) -> None:
    """Serve on ``bind`` (``HOST:PORT``) until SIGINT or SIGTERM; a bind that fails exits
    with a message that says why. ``ifrt_bind`` (``HOST:PORT``): also serve the IFRT proxy
    protocol there, with ``start_front_end`` (pathways/ifrt/front_end.py ``start``), in this
    process, stopped with it. ``run_timeout`` and ``recovery``: see ControllerServer."""
    if ifrt_bind is not None and start_front_end is None:
        raise ValueError("ifrt_bind needs start_front_end, the front end to serve there")
    try:
        host, port = split_host_port(bind)
    except ValueError as e:
        raise SystemExit(f"error: --bind {e}") from None
    try:
        check_timeout(heartbeat_timeout)
        if run_timeout is not None:
            check_timeout(run_timeout, "--run-timeout")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if ifrt_bind is not None:
        try:
            ifrt_host, _ = split_host_port(ifrt_bind)
        except ValueError as e:
            raise SystemExit(f"error: --ifrt-bind {e}") from None
        # before anything listens: a refused --ifrt-bind must not leave a controller half up
        try:
            sec.check_bind(ifrt_host, security, "the IFRT proxy server (--ifrt-bind)")
        except sec.SecurityConfigError as e:
            raise SystemExit(f"error: {e}") from None
        if security is not None and security.serves_tls and not security.uses_tls:
            raise SystemExit("error: --ifrt-bind with --tls-cert needs --tls-ca too: the IFRT proxy server's "
                             "sessions connect to this controller and its workers over TLS and verify them with it")
    asyncio.run(_serve(policy, window, host, port, security, heartbeat_timeout, ifrt_bind, run_timeout, recovery,
                       start_front_end))


async def _serve(policy: str, window: int, host: str, port: int, security: Security | None,
                 heartbeat_timeout: float, ifrt_bind: str | None, run_timeout: float | None,
                 recovery: Recovery, start_front_end: Optional[StartFrontEnd]) -> None:
    controller = ControllerServer(policy, window, security, heartbeat_timeout, run_timeout, recovery)
    advertise = reachable_host(host)
    try:
        await controller.listen(host, advertise)  # before the gRPC server: AttachAddress must know it
        server, port = await rpc.start_aio_server(rpc.CONTROLLER_SERVICE, controller.handlers(),
                                                  join_host_port(host, port), security=controller.security)
    except (ConnectError, OSError, sec.SecurityConfigError) as e:
        raise SystemExit(f"error: the controller cannot listen on --bind {join_host_port(host, port)}: {e}") from None
    address = f"grpc://{join_host_port(advertise, port)}"
    lines = [f"{ADDRESS_LINE} {address}"]
    ifrt = None
    if ifrt_bind is not None:
        assert start_front_end is not None  # main checked
        try:
            ifrt = await asyncio.to_thread(start_front_end, address, ifrt_bind, controller)
        except BaseException:
            await controller.stop(server)
            raise
        controller.core.front_end_traffic = ifrt.traffic
        ifrt_host, _ = split_host_port(ifrt_bind)
        _, ifrt_port = split_host_port(ifrt.address)
        lines.append(f"{IFRT_LINE} grpc://{join_host_port(reachable_host(ifrt_host), ifrt_port)}")
    stopping: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_signal(signum: int) -> None:
        if not stopping.done():
            stopping.set_result(signum)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):  # before the address goes out: its reader may stop us at once
        loop.add_signal_handler(signum, on_signal, signum)
    print("\n".join(lines), flush=True)  # one write: a reader of the address line finds the IFRT one too
    try:
        log.info("controller stopping on signal %d", await stopping)
    finally:
        if ifrt is not None:
            await _stop_ifrt(ifrt)
        await controller.stop(server)


async def _stop_ifrt(server: FrontEnd) -> None:
    """Stop the IFRT proxy server first, so that its sessions end while the controller still
    serves them; bounded, so that the controller stops even if it does not."""
    try:
        await asyncio.wait_for(asyncio.to_thread(server.stop), _IFRT_STOP_SECONDS)
    except asyncio.TimeoutError:
        log.warning("the IFRT proxy server did not stop within %g s; stopping the controller anyway",
                    _IFRT_STOP_SECONDS)
    except Exception:  # the controller must stop whatever the front end does
        log.exception("stopping the IFRT proxy server failed")

