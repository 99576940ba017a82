"""gRPC plumbing: generic handlers over raw bytes, channels, and batched stream outboxes.

There is no protoc step: methods are registered with generic handlers and payloads are
msgpack (see codec.py), decoded by the handlers themselves so a malformed payload becomes
an error reply instead of a broken stream.

Two kinds of server: ``make_server`` (a thread pool; a streaming call holds a thread for
its lifetime, fine for a worker's few streams) and ``start_aio_server`` (grpc.aio on the
running asyncio loop; a stream costs a coroutine, not a thread, as the controller needs
for thousands of sessions and workers). What flows on the streams, batched messages, is
protocol/streams.py's.

Given a ``Security`` (security.py), servers check every call's token with an interceptor
and serve TLS, and channels carry the token and verify the server's certificate.
"""

from __future__ import annotations

import collections
import time
from concurrent import futures
from typing import Callable, Optional

import grpc
import grpc.experimental  # not loaded by `import grpc`: open_channel's option names live there

from pathways import config
from pathways.errors import AuthenticationError, ConnectError
from pathways.wire import security as sec
from pathways.wire.addresses import join_host_port, split_host_port, unreachable
from pathways.wire.codec import MAX_MESSAGE_BYTES
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
                f"(tls_ca=, {config.TLS_CA.name}): either the server does not use TLS (then connect without a CA), "
                "or its certificate is not signed by that CA or not issued for this host name or address")
    return (f"{address} accepts connections but does not answer plain gRPC: if the server uses TLS, verify it with "
            f"its CA certificate: pw.connect(address, tls_ca=PATH), --tls-ca PATH or {config.TLS_CA.name}")


def method(channel: grpc.Channel, service: str, name: str, kind: str) -> Callable:
    path = f"/{service}/{name}"
    return getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
