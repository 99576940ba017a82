"""gRPC plumbing: generic handlers over raw bytes, channels, and batched stream outboxes.

There is no protoc step: methods are registered with generic handlers and payloads are
msgpack (see codec.py), decoded by the handlers themselves so a malformed payload becomes
an error reply instead of a broken stream.

Two kinds of server: ``make_server`` (a thread pool; a streaming call holds a thread for
its lifetime, fine for a worker's few streams) and ``start_aio_server`` (grpc.aio on the
running asyncio loop; a stream costs a coroutine, not a thread, as the controller needs
for thousands of sessions and workers). ``Outbox`` feeds a synchronous stream from any
thread; ``LoopOutbox`` feeds an aio stream (gRPC, or framed TCP: wire/frames.py) from its loop.

Given a ``Security`` (security.py), servers check every call's token with an interceptor
and serve TLS, and channels carry the token and verify the server's certificate.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import time
import weakref
from concurrent import futures
from typing import Awaitable, Callable, Iterator, Optional

import grpc
import grpc.experimental  # not loaded by `import grpc`: open_channel's option names live there

from pathways.errors import AuthenticationError, ConnectError
from pathways.protocol.messages import MAX_BATCH_MESSAGES, MAX_MESSAGE_BYTES, Message, encode_item, join_items
from pathways.wire import security as sec
from pathways.wire.addresses import join_host_port, split_host_port, unreachable
from pathways.wire.codec import list_header
from pathways.wire.security import Security

CONTROLLER_SERVICE = "pathways.Controller"
LOOPBACK = "127.0.0.1"  # where servers listen unless told otherwise (--bind)
WORKER_SERVICE = "pathways.Worker"

# How long a refused connection is retried by default: a few reconnection attempts (see
# INITIAL_RECONNECT_BACKOFF_MS) for a server that is just starting, instead of the caller's
# whole timeout.
REFUSED_GRACE_SECONDS = 2.0
# wait_ready's probe: a method no server has, and the pauses between probes while refused
_PROBE_SERVICE = "pathways.Probe"
_PROBE_FIRST_PAUSE, _PROBE_MAX_PAUSE = 0.01, 0.2
START_ADVICE = ("check the address (the one `python -m pathways up` printed), or start a cluster with "
                "`python -m pathways up`")

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# A channel with calls in flight pings its server every KEEPALIVE_TIME_MS and drops the
# connection when a ping goes unanswered for KEEPALIVE_TIMEOUT_MS, failing its calls with
# UNAVAILABLE ("ping timeout"): a frozen or vanished server (its kernel may still
# acknowledge TCP) ends a client's session stream or fetch within about 8 s instead of
# hanging. grpcio 1.85 times a keepalive ping out by the ping timeout, hence both; the pings
# go on however long the server sends no data (a session waiting for work). Servers accept
# pings that often; they do not ping their clients (a paused client keeps its session).
KEEPALIVE_TIME_MS = 3000
KEEPALIVE_TIMEOUT_MS = 5000
# A channel whose server is not (yet, or no longer) there tries again after these pauses,
# growing from the first to the most. gRPC's defaults (1 s, growing 1.6-fold to 120 s) leave
# a worker started before its controller, or waiting for one that restarts, idle for
# seconds to minutes after the server is back; the processes of a cluster start in seconds.
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000
_CHANNEL_OPTIONS = [*_OPTIONS, ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS), ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
                    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                   ("grpc.http2.max_ping_strikes", 0)]


def parse_address(address: str) -> str:
    """``grpc://host:port`` -> ``host:port``; anything else raises ConnectError at once, so
    that a mistyped address does not wait for a connection that cannot happen."""
    target = address[len("grpc://"):] if isinstance(address, str) and address.startswith("grpc://") else ""
    host, sep, port = target.rpartition(":")
    if not sep or not host or any(c in host for c in "/ @") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectError(
            f"address {address!r} is not of the form grpc://HOST:PORT (e.g. grpc://127.0.0.1:50051); "
            "pass the address `python -m pathways up` printed"
        )
    return target


def _role(service: str) -> str:
    return "controller" if service == CONTROLLER_SERVICE else "worker"


def _bind(server: grpc.Server | grpc.aio.Server, host: str, port: int, security: Security, what: str) -> int:
    sec.check_bind(host, security, what)
    return _add_port(server, join_host_port(host, port), security)


def make_server(service: str, handlers: dict[str, grpc.RpcMethodHandler], host: str = LOOPBACK,
                max_workers: int = 16, security: Security | None = None) -> tuple[grpc.Server, int]:
    """A server on a free port of ``host`` running ``handlers``; returns (server, port).
    With ``security``: its token required on every call, and TLS if it has a certificate."""
    security = security or Security()
    interceptors = [_TokenCheck(security, _role(service))] if security.token is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_SERVER_OPTIONS,
                         interceptors=interceptors)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = _bind(server, host, 0, security, f"the {_role(service)}'s gRPC server")
    server.start()
    return server, port


# HTTP/2 streams a client may have open on one connection to the aio server: each session
# or worker is one long-lived stream, and a client process may hold many.
MAX_CONCURRENT_STREAMS = 1 << 16


async def start_aio_server(service: str, handlers: dict[str, grpc.RpcMethodHandler], bind: str = "127.0.0.1:0",
                           security: Security | None = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server on ``bind`` (HOST:PORT; port 0 for a free one), serving coroutine
    ``handlers`` on the running loop; returns (server, port). ``security`` as for make_server."""
    security = security or Security()
    host, port = split_host_port(bind)
    interceptors = [_AioTokenCheck(security, _role(service))] if security.token is not None else []
    server = grpc.aio.server(options=[*_SERVER_OPTIONS, ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS)],
                             interceptors=interceptors)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = _bind(server, host, port, security, f"the {_role(service)}'s gRPC server")
    await server.start()
    return server, port


def _add_port(server: grpc.Server | grpc.aio.Server, target: str, security: Security) -> int:
    """Bind ``target`` (over TLS if ``security`` has a certificate); gRPC reports a failed
    bind as port 0 (or a RuntimeError), which becomes an error that names the address."""
    try:
        if security.serves_tls:
            port = server.add_secure_port(target, server_credentials(security))
        else:
            port = server.add_insecure_port(target)
    except RuntimeError as e:
        port, why = 0, f": {e}"
    else:
        why = ""
    if not port:
        raise ConnectError(f"could not listen on {target}{why}; pass a host that is an address of this machine "
                           "(or 0.0.0.0 for all of them) and a port that is free (or 0 for any)")
    return port


# ---- the token and TLS ---------------------------------------------------------------------

def server_credentials(security: Security) -> grpc.ServerCredentials:
    sec.server_context(security)  # a bad certificate or key file fails here, named, not in gRPC's core
    return grpc.ssl_server_credentials([(sec.read_pem(security.tls_key, "--tls-key"),
                                         sec.read_pem(security.tls_cert, "--tls-cert"))])


def channel_credentials(security: Security) -> grpc.ChannelCredentials:
    sec.client_context(security)
    return grpc.ssl_channel_credentials(root_certificates=sec.read_pem(security.tls_ca, "--tls-ca"))


def _offered_token(metadata: object) -> object:
    for key, value in metadata or ():
        if key == sec.TOKEN_METADATA:
            return value
    return None


def _refusing(handler: grpc.RpcMethodHandler, deny: Callable) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that runs ``deny`` instead."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](deny)


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses every call of a synchronous server that does not carry the token, before
    its handler runs."""

    def __init__(self, security: Security, role: str) -> None:
        self._security = security
        self._refusal = sec.refusal(role)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        if handler is None or self._security.allows(_offered_token(details.invocation_metadata)):
            return handler

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal)

        return _refusing(handler, deny)


class _AioTokenCheck(grpc.aio.ServerInterceptor):
    """The same for a grpc.aio server."""

    def __init__(self, security: Security, role: str) -> None:
        self._security = security
        self._refusal = sec.refusal(role)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or self._security.allows(_offered_token(details.invocation_metadata)):
            return handler

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal)

        return _refusing(handler, deny)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                             "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = ((sec.TOKEN_METADATA, token),)

    def _with_token(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), *self._metadata), d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: object) -> object:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: object) -> object:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: grpc.ClientCallDetails, requests: object) -> object:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Callable, details: grpc.ClientCallDetails, requests: object) -> object:
        return continuation(self._with_token(details), requests)


def refusal(error: grpc.RpcError, address: str) -> Optional[AuthenticationError]:
    """The AuthenticationError for a call that ``address`` refused for its token; None for
    any other failure."""
    code = getattr(error, "code", None)
    if code is None or code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    return AuthenticationError(f"{address} refused the call: {error.details()}")


def stream_stream(fn: Callable) -> grpc.RpcMethodHandler:
    return grpc.stream_stream_rpc_method_handler(fn)


def stream_unary(fn: Callable) -> grpc.RpcMethodHandler:
    return grpc.stream_unary_rpc_method_handler(fn)


def unary_stream(fn: Callable) -> grpc.RpcMethodHandler:
    return grpc.unary_stream_rpc_method_handler(fn)


def unary_unary(fn: Callable) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(fn)


def open_channel(address: str, security: Security | None = None, caller_reads_streams: bool = False) -> grpc.Channel:
    """A channel to ``grpc://HOST:PORT``; with ``security``, over TLS if it has a CA, and
    carrying its token on every call. ``caller_reads_streams``: a unary-stream call's
    replies are read on the calling thread; otherwise gRPC starts a thread to drive the
    channel's calls whenever none is in flight, a thread per call on a mostly idle channel."""
    target = parse_address(address)
    options = _CHANNEL_OPTIONS
    if caller_reads_streams:
        options = [*options, (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
    if security is not None and security.uses_tls:
        channel = grpc.secure_channel(target, channel_credentials(security), options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if security is not None and security.token is not None:
        channel = grpc.intercept_channel(channel, _TokenMetadata(security.token))
    return channel


def open_aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(parse_address(address), options=_CHANNEL_OPTIONS)


def wait_ready(channel: grpc.Channel, address: str, timeout: float, advice: str = START_ADVICE,
               refused_grace: float = REFUSED_GRACE_SECONDS, security: Security | None = None) -> None:
    """Wait until ``channel`` is connected. A refused connection (or a host name that does not
    resolve) fails after ``refused_grace`` seconds, time for a few reconnection attempts in
    case the server is just starting, instead of waiting for the whole ``timeout`` (a caller
    that expects the server to start later passes its whole timeout); a server that accepts
    the connection but not its TLS (or lack of it) fails after REFUSED_GRACE_SECONDS however
    long the grace: ``security`` is the channel's, to say which. ``advice`` ends the error
    message: what the caller can do about it.

    It probes with a call to a method no server has: any answer (UNIMPLEMENTED) means
    connected, UNAVAILABLE means not (gRPC fails such a call at once while the channel waits
    to try again). Not gRPC's connectivity subscription: its poller keeps a 0.2 s watch
    pending that ``channel.close()`` then waits for."""
    probe = method(channel, _PROBE_SERVICE, "Ready", "unary_unary")
    deadline = time.monotonic() + timeout
    refused_at = checked_at = None
    accepting = False  # the server accepted a connection when last looked at
    pause = _PROBE_FIRST_PAUSE
    while True:
        now = time.monotonic()
        if now >= (deadline if refused_at is None else min(deadline, refused_at + refused_grace)):
            break
        if refused_at is not None and now >= checked_at + REFUSED_GRACE_SECONDS:
            # Every REFUSED_GRACE_SECONDS, look whether it is the handshake that fails: a server that
            # accepted connections for a whole period, in which the channel tried again (at most
            # MAX_RECONNECT_BACKOFF_MS later), without the channel getting ready.
            if accepting:
                raise ConnectError(_handshake_failure(address, security or Security()))
            accepting = unreachable(*split_host_port(parse_address(address)), timeout=1.0) is None
            checked_at = now
        limit = deadline if refused_at is None else min(deadline, refused_at + refused_grace,
                                                        checked_at + REFUSED_GRACE_SECONDS)
        try:
            probe(b"", timeout=max(0.01, limit - now))
            return  # no server has the method; answered all the same, so connected
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # still connecting
            if code != grpc.StatusCode.UNAVAILABLE:
                return  # UNIMPLEMENTED, or any other answer of a connected server
        if refused_at is None:
            refused_at = checked_at = time.monotonic()
        time.sleep(max(0.0, min(pause, limit - time.monotonic())))
        pause = min(2 * pause, _PROBE_MAX_PAUSE)
    why = unreachable(*split_host_port(parse_address(address)))
    if why is not None:
        raise ConnectError(f"could not connect to {address}: {why}; {advice}")
    if refused_at is not None:
        raise ConnectError(_handshake_failure(address, security or Security()))
    raise ConnectError(f"{address} accepts connections but its gRPC server did not answer within {timeout:.0f} s; "
                       f"{advice}")


def _handshake_failure(address: str, security: Security) -> str:
    if security.uses_tls:
        return (f"{address} accepts connections but not over TLS verified with --tls-ca {security.tls_ca} "
                f"(tls_ca=, {sec.TLS_CA_ENV}): either the server does not use TLS (then connect without a CA), "
                "or its certificate is not signed by that CA or not issued for this host name or address")
    return (f"{address} accepts connections but does not answer plain gRPC: if the server uses TLS, verify it with "
            f"its CA certificate: pw.connect(address, tls_ca=PATH), --tls-ca PATH or {sec.TLS_CA_ENV}")


def method(channel: grpc.Channel, service: str, name: str, kind: str) -> Callable:
    path = f"/{service}/{name}"
    return getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)


def payloads(items: list[bytes]) -> Iterator[bytes]:
    """Messages encoded each by ``encode_item``, joined into payloads of at most
    MAX_MESSAGE_BYTES and MAX_BATCH_MESSAGES messages (one, unless halving is needed to stay
    within them): what queued up while a peer was slow to read may be more than one payload
    may carry. A single message larger than that goes alone, for its receiver to refuse.
    Each payload is what ``encode_batch`` makes of its messages."""
    if not items:
        return
    if len(items) > MAX_BATCH_MESSAGES:
        yield from payloads(items[:MAX_BATCH_MESSAGES])
        yield from payloads(items[MAX_BATCH_MESSAGES:])
        return
    if len(items) == 1 or len(list_header(len(items))) + sum(map(len, items)) <= MAX_MESSAGE_BYTES:
        yield join_items(items)
        return
    half = len(items) // 2
    yield from payloads(items[:half])
    yield from payloads(items[half:])


class Outbox:
    """A thread-safe queue of messages drained as batches by a gRPC stream generator
    (``batches``), or by a LocalStream's reads on the server's loop (``take``).

    Whatever has queued up while the stream was busy goes out as one payload (or several:
    ``payloads``). ``release(handle)`` notes a handle the peer may forget: the handles
    released before a batch starts go out at its end as one message, ``releases(handles)``
    (after every message put before them, which may still name them). Releases ride along
    with the next batch; those of a stream with nothing else to send are flushed within
    RELEASE_SECONDS by one thread of the process: a release costs no message of its own,
    and an idle stream no wake-ups. ``hold`` keeps what is put until it ends, to go out as
    one batch.
    """

    _CLOSE, _FLUSH = object(), object()

    def __init__(self, releases: Optional[Callable[[list[int]], Message]] = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._releases = releases
        self._released: collections.deque[int] = collections.deque()
        self._flushing = False  # a flush is queued and its batch not yet begun
        self._flush_lock = threading.Lock()
        self._closed = False
        # ``hold``: while held, what is put and released waits here, in order, for ``send_held``
        # (reentrant: a release may come from a __del__ run by a thread that holds the lock)
        self._holds = 0
        self._held: list[Message] = []
        self._held_releases: list[int] = []
        self._hold_lock = threading.RLock()
        # ``take``'s reader: how to wake it, whether it waits, whether it has taken the close
        self._wake: Optional[Callable[[], None]] = None
        self._waiting = False
        self._taken_all = False
        if releases is not None:
            _RELEASE_FLUSHER.watch(self)

    def put(self, message: Message) -> None:
        if self._holds:
            with self._hold_lock:
                if self._holds:
                    self._held.append(message)
                    return
        self._queued(message)

    def release(self, handle: int) -> None:
        """Note ``handle`` for ``releases`` (none once closed); safe from ``__del__`` in any thread."""
        assert self._releases is not None, "this outbox was made without releases"
        if self._closed:
            return
        if self._holds:
            with self._hold_lock:
                if self._holds:  # after the messages held before it, which may name the handle
                    self._held_releases.append(handle)
                    return
        self._released.append(handle)

    def hold(self) -> None:
        """Keep what is put and released from now on (from any thread) until ``unhold``, to
        go out then as one batch; holds nest."""
        with self._hold_lock:
            self._holds += 1

    def unhold(self) -> None:
        """End a ``hold``; the last one's end sends what was held."""
        with self._hold_lock:
            self._holds -= 1
            if not self._holds:
                self.send_held()

    def send_held(self) -> None:
        """Queue what is held now, a hold going on (for whoever is about to wait on an answer
        to it), and the releases held after it."""
        with self._hold_lock:
            held, self._held = self._held, []
            released, self._held_releases = self._held_releases, []
            if held:
                self._queued(held)
            # after the messages: a batch takes the releases noted before it starts, so these
            # go out in the messages' batch or a later one, never ahead of them
            self._released.extend(released)

    def flush(self) -> None:
        """Have the stream send the releases noted so far, if any (one flush queued at a
        time: a stream no one reads does not pile them up)."""
        with self._flush_lock:
            if self._released and not self._flushing and not self._closed:
                self._flushing = True
                self._queued(self._FLUSH)

    def close(self) -> None:
        """End the stream after whatever was put before."""
        self._closed = True
        self._queued(self._CLOSE)

    def _queued(self, item: object) -> None:
        self._queue.put(item)
        if self._waiting:  # a reader on a loop waits for it (``take``)
            self._waiting = False
            assert self._wake is not None
            self._wake()

    def batches(self) -> Iterator[bytes]:
        """Yield packed batches until closed (everything put before the close goes out)."""
        closing = False
        while not closing:
            batch, closing = self._drain(self._queue.get())
            if batch:
                yield from payloads(batch)

    def take(self, wake: Callable[[], None]) -> Optional[list[bytes]]:
        """For a reader on an event loop (LocalStream), instead of ``batches``: the payloads
        of what is queued now, or [] when nothing is (``wake`` is then called, from any
        thread, once something is: the reader waits for that, then takes again); None
        once the outbox closed and everything before the close was taken."""
        if self._taken_all:
            return None
        self._wake = wake
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            self._waiting = True
            try:  # what came in before the reader was seen waiting would wake no one
                item = self._queue.get_nowait()
            except queue.Empty:
                return []
            self._waiting = False
        batch, self._taken_all = self._drain(item)
        return list(payloads(batch))

    def _drain(self, item: object) -> tuple[list[bytes], bool]:
        """The encoded messages of ``item`` and of everything queued after it, then the
        releases noted before; and whether the close was among them."""
        self._flushing = False
        # Taken before the queue is drained: a message that names a released handle was
        # put before the release, so it is in this batch, ahead of the releases.
        released = [self._released.popleft() for _ in range(len(self._released))]
        batch: list[bytes] = []
        closing = False
        while True:
            if item is self._CLOSE:
                closing = True
                break
            if type(item) is list:  # what a hold kept (send_held)
                batch.extend(map(encode_item, item))
            elif item is not self._FLUSH:
                batch.append(encode_item(item))
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        if released:
            assert self._releases is not None
            batch.append(encode_item(self._releases(released)))
        return batch, closing


RELEASE_SECONDS = 0.05  # how long a release waits for a batch to ride along with


class _ReleaseFlusher:
    """The one thread of a process that flushes its outboxes' releases, every
    RELEASE_SECONDS, started with the first outbox that takes releases."""

    def __init__(self) -> None:
        self._outboxes: "weakref.WeakSet[Outbox]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._pid = 0  # the process the thread runs in (a forked child starts its own)

    def watch(self, outbox: Outbox) -> None:
        with self._lock:
            self._outboxes.add(outbox)
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="pathways-releases", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(RELEASE_SECONDS)
            with self._lock:
                outboxes = list(self._outboxes)
            for outbox in outboxes:
                outbox.flush()


_RELEASE_FLUSHER = _ReleaseFlusher()


# What a stream's outbox may hold unsent, in messages and in their encoded bytes, before the
# stream stops reading its peer's requests (``LoopOutbox.room``): a peer that sends without
# reading its replies gets no more served until it does, instead of growing the server's
# memory. The count bounds many small replies; the bytes bound a few large ones (an Error's
# text may be MAX_TEXT, 64 KiB: 10,000 of those would hold 640 MiB). 16 MiB is more than
# 10,000 usual replies take (a few hundred bytes each), so the count stays the bound that an
# ordinary backlog meets, and about 250 replies of the largest text.
MAX_QUEUED_MESSAGES = 10_000
MAX_QUEUED_BYTES = 16 << 20


class LoopOutbox:
    """The messages waiting for one stream served on an event loop; used only from that loop.

    ``put`` encodes a message (its size is known from then on, and the writer only joins
    what was encoded), appends it and wakes the stream's writer, which sends whatever has
    queued by the time it runs as one payload (several where one would be too large:
    ``payloads``): everything one inbound batch caused goes out together.
    While a payload waits for the peer to take it (flow control), later messages queue
    here; ``room`` is how the stream's reader waits until what is unsent, queued or being
    sent, is below both bounds again.
    """

    __slots__ = ("_items", "_unsent", "_unsent_bytes", "_wake", "_closed", "_room")

    def __init__(self) -> None:
        self._items: list[bytes] = []  # encoded, not yet taken by the writer
        self._unsent = 0  # messages put and not yet sent: those queued and those being sent
        self._unsent_bytes = 0
        self._wake: Optional[asyncio.Future] = None
        self._closed = False
        self._room: Optional[asyncio.Future] = None

    async def room(self) -> None:
        """Return once fewer than MAX_QUEUED_MESSAGES messages and MAX_QUEUED_BYTES bytes of
        them are unsent (or it closed)."""
        while (self._unsent >= MAX_QUEUED_MESSAGES or self._unsent_bytes >= MAX_QUEUED_BYTES) and not self._closed:
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def _free(self) -> None:
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    def put(self, message: Message) -> None:
        if self._closed:  # the stream is ending: nobody will send it
            return
        item = encode_item(message)
        self._items.append(item)
        self._unsent += 1
        self._unsent_bytes += len(item)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def close(self) -> None:
        """End the stream after whatever was put before."""
        self._closed = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        self._free()

    async def write_to(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send batches with ``send`` (a gRPC call's ``write``, or a framed socket's) until
        closed and drained, or until the stream ends. The stream's reader learns of an
        ended stream itself (EOF, a reset, or cancellation)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._items:
                if self._closed:
                    return
                self._wake = loop.create_future()
                await self._wake
                continue
            # the writer sends one batch at a time, so what is unsent now is exactly what it takes
            batch, self._items = self._items, []
            sending, sending_bytes = self._unsent, self._unsent_bytes
            try:
                for payload in payloads(batch):
                    await send(payload)
            except Exception:  # the stream ended under it (peer gone, server stopping): nothing more goes out
                self._closed = True
                self._items.clear()
                self._free()  # a reader waiting for room goes on, to find the stream's end
                return
            self._unsent -= sending
            self._unsent_bytes -= sending_bytes
            self._free()


class LocalStream:
    """One bidirectional stream between a client's threads and a server's asyncio loop in the
    same process, with no gRPC in between: to the client it is what a grpc stream_stream call
    returns (an iterator of reply payloads, ``cancel()``); to the server's handler it is what
    grpc.aio's ServicerContext is (``read``, ``write``, ``abort``).

    The server's reads take the client's Outbox directly (``Outbox.take``), on the loop:
    each read is everything the client queued since the last one, as one batch, and a
    server that stops reading (its backpressure) leaves the client's messages queued, as a
    gRPC stream's flow control would. A read that finds nothing waits for the client's next
    put to wake it; no thread stands in between. Replies queue at most LOCAL_IN_FLIGHT deep
    before the server's writes wait for the client."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: Outbox) -> None:
        self._loop = loop
        self._outbox = outbox
        self._taken: collections.deque[bytes] = collections.deque()  # payloads taken, not yet read
        self._ended = False  # the requests ended: the outbox closed, or the client cancelled
        self._put: Optional[asyncio.Future] = None  # what a read that found nothing waits on
        self._replies: queue.Queue = queue.Queue()  # its writes wait while LOCAL_IN_FLIGHT are unread
        self._cancelled = threading.Event()

    # ---- the client's side ----------------------------------------------------------------

    def _wake(self) -> None:
        """Something was put (or the stream cancelled): a read waiting for it goes on. From
        any thread."""
        try:
            self._loop.call_soon_threadsafe(self._woken)
        except RuntimeError:  # the loop closed: the server is gone
            self._cancelled.set()

    def _woken(self) -> None:
        if self._put is not None and not self._put.done():
            self._put.set_result(None)

    def __iter__(self) -> "LocalStream":
        return self

    def __next__(self) -> bytes:
        item = self._replies.get()
        if item is self._END:
            self._replies.put(item)  # every later call ends too
            raise StopIteration
        if isinstance(item, BaseException):
            self._replies.put(self._END)
            raise item
        return item

    def cancel(self) -> None:
        """End the stream from the client's side: the server sees the requests end."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()
        self._replies.put(self._END)

    # ---- the server's side (on the loop) --------------------------------------------------

    async def read(self) -> object:
        """The next request payload, or grpc.aio.EOF once the client's requests ended."""
        while not self._taken:
            if self._ended or self._cancelled.is_set():
                return grpc.aio.EOF
            try:
                taken = self._outbox.take(self._wake)
            except Exception as e:  # a message the client put does not encode: the stream ends
                self._replies.put(e)
                self._ended = True
                continue
            if taken is None:
                self._ended = True
            elif taken:
                self._taken.extend(taken)
            else:
                self._put = self._loop.create_future()
                if not self._cancelled.is_set():
                    await self._put
                self._put = None
        return self._taken.popleft()

    async def write(self, payload: bytes) -> None:
        while self._replies.qsize() >= LOCAL_IN_FLIGHT and not self._cancelled.is_set():
            await asyncio.sleep(0.001)  # the client's reader is behind: wait for it, not the loop
        if not self._cancelled.is_set():
            self._replies.put(payload)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.finish(ConnectError(f"{code.name}: {details}"))
        raise asyncio.CancelledError

    def finish(self, error: Optional[BaseException] = None) -> None:
        """The server's handler ended: the client's iterator ends (raising ``error`` if given)."""
        if error is not None:
            self._replies.put(error)
        self._replies.put(self._END)


LOCAL_IN_FLIGHT = 256  # reply payloads a LocalStream holds before the server's writes wait
