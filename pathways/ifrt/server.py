"""The IFRT proxy server: ``xla.ifrt.proxy.GrpcIfrtService`` in front of a pathways controller.

JAX's built-in proxy client (``JAX_PLATFORMS=proxy``) speaks this protocol; each of its
sessions (one ``IfrtSession`` stream) becomes one native pathways client session
(session.py), so that its work is gang-ordered with every other client's. Transport
only here: version negotiation, the session stream (requests handled in order, those
that wait run on a bounded pool and are answered when done, matched by op_id), and the
host-buffer side channel (chunked stores and lookups).

Payloads are decoded here, not by gRPC, so that a malformed request gets a status that
says what was wrong instead of a broken stream; every response is built from the
generated protobuf classes, so none is malformed (a malformed one aborts the client).

JAX's client retries a session the server refuses until its connection timeout (two
minutes by default), whatever the status. So the server also answers ``plugin.ADMISSION``,
a method of its own that the pathways plugin (plugin.py) asks before the client connects:
given the session's initialization data (a msgpack map), whether its session would be
refused (the token missing or wrong, the weight out of bounds, the slice not placeable)
and why, so that the program fails at once with that one line.

Concurrency: threads. gRPC's pool (64 threads) serves the calls; each session stream has a
receiving thread, a thread that handles its requests in order, and a pool of POOL_THREADS for the
requests that wait; one thread checks the pace of every session's host-buffer stores each
second. A session reaches its controller through its native pathways session (a stream
served on the controller's loop when the front end runs in the controller's process).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator, Optional

import grpc

from pathways.client.session import Session
from pathways.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.ifrt import types as t
from pathways.errors import WireError
from pathways.ifrt.plugin import ADMISSION_METHOD, ADMISSION_SERVICE
from pathways.ifrt.handling import HOST_BUFFER_WAIT, SLICE_KEY, WAIT_SECONDS, Deferred
from pathways.ifrt.session import IfrtSession
from pathways.ifrt.types import IfrtError
from pathways.protocol import operator, streams
from pathways.protocol.messages import ArrayTraffic
from pathways.threads import Threads
from pathways.wire import tcp
from pathways.wire.counters import ByteCounter
from pathways.wire import security as sec
from pathways.wire.addresses import join_host_port, split_host_port
from pathways.wire.security import Security

log = logging.getLogger("pathways.ifrt")

SERVICE = "xla.ifrt.proxy.GrpcIfrtService"
MAX_ADMISSION_BYTES = 64 * 1024
SESSION_METADATA = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
TOKEN_KEY = "pathways_token"
WEIGHT_KEY = "pathways_weight"  # the session's share in the fair-share policy (PATHWAYS_WEIGHT)
PROTOCOL_MIN, PROTOCOL_MAX = 16, 25  # jaxlib 0.10.2 proposes 16..25
SERDES_MAX = 3
LOOKUP_CHUNK = 1 << 20
REFUSED_ANSWERS = 16  # requests of a refused session answered with its error before the stream ends
# How long a refused session's stream is kept to answer its requests with why (the client
# raises that answer), and how many such streams at once: a caller the server refused
# holds one of its threads that long at most, and strangers hold a few of them at most.
REFUSED_SECONDS = 5.0
MAX_REFUSED_STREAMS = 8
MAX_MESSAGE = 1 << 30  # a compile request carries the whole program
MAX_WAITING = 256  # requests of one session waiting on the pool at once
POOL_THREADS = 8  # per session
INBOX = 1024  # requests of one session received and not yet handled; the client's sends wait beyond
BURST_SECONDS = 0.001  # how long requests are handled before the native messages they caused are sent, at most
_INBOX_POLL = 1.0  # how often the handler waiting for a request checks that the stream is open
_INBOX_FULL_PAUSE = 0.002  # how often a receiver waiting for room in a full inbox looks again
CONNECT_TIMEOUT = 30.0
# How long stopping waits for sessions that ended just before to finish closing: a traced
# one collects its timeline from the controller and the workers (which waits up to 2 s for
# runs still finishing there), and the controller stops once the server has.
CLOSING_SECONDS = 8.0
PACE_CHECK_SECONDS = 1.0  # how often host buffers being stored are checked for their pace (HostBuffers.check_pace)

# Calls gRPC queues before a handler thread takes them, beyond which it cancels new ones:
# JAX's client opens a host-buffer store per array it sends, all at once, and a training
# loop that queues a few hundred steps of sharded batches opens thousands (the pathways
# plugin bounds its client's, plugin.TRANSFER_LIMITS; a bare client does not).
MAX_PENDING_CALLS = 16384
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_ping_strikes", 0), ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)]


class IfrtServer:
    """Serves the IFRT proxy protocol on ``bind``, one native session to ``controller``
    (``HOST:PORT`` or ``grpc://HOST:PORT``) per IFRT session. ``security``: the cluster's
    token and TLS; beyond loopback a token is required, and every IFRT client must then
    present it as initialization data ``pathways_token`` (PATHWAYS_TOKEN). ``open_local``:
    where the server runs in the controller's process, how its native sessions reach that
    controller without a network hop (ControllerServer.open_local); else over gRPC.
    ``data_plane``: there too, the connections its sessions put arrays on (Session); the
    server closes it when it stops."""

    def __init__(self, controller: str, bind: str = "127.0.0.1:0", security: Security | None = None,
                 open_local: Optional[Callable[[streams.Outbox], Any]] = None,
                 data_plane: Optional[tcp.Pool] = None) -> None:
        self.controller = controller if controller.startswith("grpc://") else f"grpc://{controller}"
        self.open_local = open_local
        self.data_plane = data_plane
        self.bind = bind
        self.security = security or Security()
        self._server: Optional[grpc.Server] = None
        self._sessions: dict[int, IfrtSession] = {}
        self._refused = 0  # refused sessions' streams open (``_refuse``)
        self._lock = threading.Lock()
        self._closing = 0  # sessions whose stream ended, still closing (PATHWAYS_TRACE: writing the timeline)
        self._closed = threading.Condition(self._lock)
        self._stopped = threading.Event()
        self._threads = Threads("the IFRT proxy server")  # its pace checker, and each session's reader and handler
        self.address = ""
        self.client_bytes = ByteCounter()  # array bytes its clients stored (received) and looked up (sent)
        self.worker_bytes = ByteCounter()  # what its sessions put on workers and read from them

    def start(self) -> None:
        host, port = split_host_port(self.bind)
        sec.check_bind(host, self.security, "the IFRT proxy server")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="pathways-ifrt"),
                             options=_OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "GetVersion": grpc.unary_unary_rpc_method_handler(self._get_version),
            "IfrtSession": grpc.stream_stream_rpc_method_handler(self._session),
            "HostBufferStore": grpc.stream_unary_rpc_method_handler(self._store),
            "HostBufferLookup": grpc.unary_stream_rpc_method_handler(self._lookup),
            "HostBufferDelete": grpc.unary_unary_rpc_method_handler(self._delete),
            "HostBufferReadFromDisk": grpc.unary_unary_rpc_method_handler(self._read_from_disk),
        }), grpc.method_handlers_generic_handler(ADMISSION_SERVICE, {
            ADMISSION_METHOD: grpc.unary_unary_rpc_method_handler(self._admission),
        })))
        target = join_host_port(host, port)
        try:
            if self.security.serves_tls:
                from pathways.wire.rpc import server_credentials
                bound = server.add_secure_port(target, server_credentials(self.security))
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"the IFRT proxy server could not listen on {target}; pass a free port (or 0 for any)")
        server.start()
        self._server = server
        self.address = join_host_port(host, bound)
        self._threads.start(self._pace_stores, "pathways-ifrt-pace")

    def traffic(self) -> ArrayTraffic:
        """The array bytes this server moved so far: its clients' and its sessions' with the workers."""
        return ArrayTraffic(self.client_bytes.received, self.client_bytes.sent, self.worker_bytes.sent,
                                     self.worker_bytes.received)

    def _pace_stores(self) -> None:
        """Look at every session's host buffers each PACE_CHECK_SECONDS: a store whose bytes
        stopped coming is ended within a pace window, whether or not a request reads it, so
        that clients cannot hold the server's threads with silent stores."""
        while not self._stopped.wait(PACE_CHECK_SECONDS):
            with self._lock:
                sessions = list(self._sessions.values())
            for session in sessions:
                session.buffers.check_pace()

    def stop(self, grace: float = 1.0) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 5.0)
            self._server = None
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.close("the IFRT proxy server stopped")
        with self._closed:  # so that the controller, stopped next, outlives them
            if not self._closed.wait_for(lambda: not self._closing, CLOSING_SECONDS):
                log.warning("%d IFRT session(s) still closing after %g s; stopping anyway", self._closing,
                            CLOSING_SECONDS)
        self._threads.join()
        if self.data_plane is not None:
            self.data_plane.close()

    # ---- version ---------------------------------------------------------------------------

    def _get_version(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(gpb.GrpcGetVersionRequest, raw, context)
        lo = max(request.min_version.protocol_version, PROTOCOL_MIN)
        hi = min(request.max_version.protocol_version, PROTOCOL_MAX)
        if lo > hi:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                f"the client speaks IFRT proxy protocol {request.min_version.protocol_version}.."
                f"{request.max_version.protocol_version}, this server {PROTOCOL_MIN}..{PROTOCOL_MAX}; use a jaxlib "
                "whose proxy client overlaps (0.10.2 does)"))
        serdes = max(min(request.max_version.ifrt_serdes_version_number, SERDES_MAX),
                     request.min_version.ifrt_serdes_version_number)
        response = gpb.GrpcGetVersionResponse()
        response.version.protocol_version = hi
        response.version.ifrt_serdes_version_number = serdes
        return response.SerializeToString()

    # ---- the session stream ------------------------------------------------------------------

    def _refusal(self, init_data: dict[str, Any]) -> Optional[IfrtError]:
        """Why a session of ``init_data`` is refused before it reaches the controller (its
        token, its weight), or None."""
        token = init_data.get(TOKEN_KEY)
        if not self.security.allows(token):
            given = ("none was given: set PATHWAYS_TOKEN in the client's environment" if token is None else
                     "the one given (PATHWAYS_TOKEN) is wrong: give the token the cluster was started with")
            return IfrtError(t.UNAUTHENTICATED, f"this IFRT server requires the cluster's shared token, and {given} "
                                                f"(the pathways plugin passes it as initialization data {TOKEN_KEY!r})")
        try:
            session_weight(init_data.get(WEIGHT_KEY))
        except ValueError as e:
            return IfrtError(t.INVALID_ARGUMENT, str(e))
        return None

    def _admission(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """ADMISSION (operator.AdmissionCheck): why a session of that initialization data
        would be refused, or None (operator.Admission); a slice it asks for
        (PATHWAYS_SLICE) is placed to find out, and released."""
        try:
            if len(raw) > MAX_ADMISSION_BYTES:
                raise WireError(f"the check is {len(raw)} bytes, over the {MAX_ADMISSION_BYTES} it may have")
            init_data = operator.ADMISSION_CHECK.decode_one(raw).init_data
        except WireError as e:
            return operator.reply(operator.Admission(f"the admission check takes a map of initialization data "
                                                     f"(strings): {e}"))
        refused = self._refusal(init_data)
        if refused is None and SLICE_KEY in init_data:
            refused = self._unplaceable(init_data)
        return operator.reply(operator.Admission(None if refused is None else refused.message))

    def _unplaceable(self, init_data: dict[str, str]) -> Optional[IfrtError]:
        """Why the slice ``init_data`` asks for cannot be placed now, or None."""
        try:
            native = Session(self.controller, CONNECT_TIMEOUT, security=self.security, open_local=self.open_local)
        except Exception as e:
            return IfrtError(t.UNAVAILABLE, f"the pathways controller at {self.controller} is not reachable "
                                            f"({type(e).__name__}: {e})")
        try:
            IfrtSession(native, 0, init_data).slices()
        except IfrtError as e:
            return e
        finally:
            native.close()
        return None

    def _refuse(self, requests: Iterator[bytes], context: grpc.ServicerContext, error: IfrtError) -> Iterator[bytes]:
        """A refused session's stream: its requests answered with ``error`` for
        REFUSED_SECONDS at most (then the call is cancelled, which frees its thread), or,
        with MAX_REFUSED_STREAMS refused streams open already, the call aborted at once."""
        with self._lock:
            crowded = self._refused >= MAX_REFUSED_STREAMS
            self._refused += not crowded
        if crowded:
            context.abort(_grpc_code(error.code), error.message)
        timer = threading.Timer(REFUSED_SECONDS, context.cancel)
        timer.daemon = True
        timer.start()
        try:
            yield from _answer_refused(requests, error)
        finally:
            timer.cancel()
            with self._lock:
                self._refused -= 1

    def _session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        metadata = _metadata(context, SESSION_METADATA, gpb.GrpcIfrtSessionMetadata)
        version = metadata.version.protocol_version
        if not PROTOCOL_MIN <= version <= PROTOCOL_MAX:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"IFRT proxy protocol {version} is not one this "
                                                               f"server speaks ({PROTOCOL_MIN}..{PROTOCOL_MAX})")
        init_data = _attribute_values(metadata.initialization_data)
        # Refusals after this point answer the client's requests with the error instead of
        # ending the stream: JAX's proxy client retries either until its connection timeout,
        # but after a broken stream it then says only CANCELLED, whereas the status of its
        # first request (init) is what it raises, message and all.
        refused = self._refusal(init_data)
        if refused is not None:
            yield from self._refuse(requests, context, refused)
            return
        weight = session_weight(init_data.get(WEIGHT_KEY))
        try:
            native = Session(self.controller, CONNECT_TIMEOUT, weight=weight, security=self.security,
                             open_local=self.open_local, data_plane=self.data_plane, array_bytes=self.worker_bytes)
        except Exception as e:
            yield from self._refuse(requests, context, IfrtError(t.UNAVAILABLE, (
                f"the pathways controller at {self.controller} is not reachable ({type(e).__name__}: {e})")))
            return
        native.timeline_label = "client IFRT proxy"  # PATHWAYS_TRACE's rows of the server's own steps
        session_id = secrets.randbits(62) + 1  # unguessable: host-buffer calls name the session by it
        session = IfrtSession(native, session_id, init_data)
        with self._lock:
            self._sessions[session_id] = session
        out: queue.SimpleQueue = queue.SimpleQueue()  # not queue.Queue: its Python-level locking costs each response
        stream = _Stream(session, out)
        self._threads.start(stream.receive, "pathways-ifrt-receive", requests)
        self._threads.start(stream.handle, "pathways-ifrt-session")
        try:
            while True:
                item = out.get()
                if item is None:
                    return
                if isinstance(item, tuple):
                    context.abort(*item)
                yield item
        finally:
            stream.closed.set()
            with self._lock:
                self._sessions.pop(session_id, None)
                self._closing += 1
            stream.pool.shutdown(wait=False, cancel_futures=True)
            try:
                session.close("the IFRT session ended")
            finally:
                with self._closed:
                    self._closing -= 1
                    self._closed.notify_all()

    # ---- host buffers ---------------------------------------------------------------------------

    def _find(self, session_id: int, context: grpc.ServicerContext) -> IfrtSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no IFRT session {session_id} is open on this server")
        return session

    def _store(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        meta = _metadata(context, STORE_METADATA, gpb.GrpcHostBufferStoreMetadata)
        session = self._find(meta.session_id, context)
        try:
            buffer = session.buffers.open(meta.handle, meta.buffer_size or None, cancel=context.cancel)
        except IfrtError as e:
            context.abort(_grpc_code(e.code), e.message)
        try:
            for raw in requests:
                data = _store_data(raw, context)
                self.client_bytes.add_received(data.nbytes)
                session.buffers.add(buffer, data)
            session.buffers.finish(buffer)
        except IfrtError as e:
            session.buffers.fail(buffer, e)
            context.abort(_grpc_code(e.code), e.message)
        except BaseException:
            session.buffers.fail(buffer, IfrtError(t.UNAVAILABLE, (
                f"the client's store of host buffer {meta.handle} ended before its last byte")))
            raise
        return gpb.GrpcHostBufferStoreResponse().SerializeToString()

    def _lookup(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The buffer's bytes in messages of LOOKUP_CHUNK bytes at most, each sent as soon as
        its bytes are here (a read from the workers still arriving is forwarded as it comes)."""
        request = _parse(gpb.GrpcHostBufferLookupRequest, raw, context)
        session = self._find(request.session_id, context)
        sent = False
        try:
            # a read from the workers may wait that long for its array to be computed
            for chunk in session.buffers.chunks(request.handle, WAIT_SECONDS + HOST_BUFFER_WAIT,
                                                open_timeout=HOST_BUFFER_WAIT):
                view = memoryview(chunk)
                for start in range(0, view.nbytes, LOOKUP_CHUNK):
                    piece = view[start:start + LOOKUP_CHUNK]
                    yield _lookup_response(piece)
                    self.client_bytes.add_sent(piece.nbytes)
                    sent = True
        except IfrtError as e:
            context.abort(_grpc_code(e.code), e.message)
        if not sent:
            yield gpb.GrpcHostBufferLookupResponse().SerializeToString()

    def _delete(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(gpb.GrpcHostBufferDeleteRequest, raw, context)
        session = self._find(request.session_id, context)
        if not session.buffers.delete(request.handle):
            context.abort(grpc.StatusCode.NOT_FOUND, f"host buffer {request.handle} is not stored")
        return gpb.GrpcHostBufferDeleteResponse().SerializeToString()

    def _read_from_disk(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "HostBufferReadFromDisk is not implemented by the pathways "
                                                     "IFRT server; store host buffers with HostBufferStore")


def _lookup_response(chunk: memoryview) -> bytes:
    """A serialized ``GrpcHostBufferLookupResponse{data: chunk}``, encoded by hand: field 1,
    length-delimited, then the bytes. One copy of the chunk instead of three (to bytes, into
    the message, out of it); tests check it parses as the message."""
    return b"".join((b"\x0a", t.varint(chunk.nbytes), chunk))


def _store_data(raw: bytes, context: grpc.ServicerContext) -> memoryview:
    """The bytes of a serialized ``GrpcHostBufferStoreRequest{data}``, not copied: the
    message is field 1 alone, so its bytes are the rest of it after the field's tag and
    length. Anything else is parsed as the message."""
    if raw[:1] == b"\x0a":
        n, shift, pos = 0, 0, 1
        while pos < len(raw) and pos < 11:
            byte = raw[pos]
            n |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                if pos + n == len(raw):
                    return memoryview(raw)[pos:]
                break
    return memoryview(_parse(gpb.GrpcHostBufferStoreRequest, raw, context).data)


class _Stream:
    """One session stream's request loop: one thread receives the client's requests into
    ``inbox``, another handles them in order, Deferred ones on a bounded pool; every response
    goes to ``out``.

    Receiving apart from handling is what lets a burst of requests (a pipelined loop of
    jit calls) reach the controller in few batches: gRPC hands over one message per
    receive, so a thread doing both would hand each request's messages to the native session
    alone, and the controller and the worker would each pay their per-batch cost once per
    request. The handler instead takes every request already received before the native
    session sends what they caused (``Session.holding``)."""

    def __init__(self, session: IfrtSession, out: queue.SimpleQueue) -> None:
        self.session = session
        self.out = out
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # at most INBOX deep (``_offer``)
        self.pool = futures.ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="pathways-ifrt-wait")
        self.waiting = threading.BoundedSemaphore(MAX_WAITING)
        self.closed = threading.Event()

    def receive(self, requests: Iterator[bytes]) -> None:
        """Put the client's request payloads into ``inbox``, then None once they end."""
        try:
            for raw in requests:
                if not self._offer(raw):
                    return
        except grpc.RpcError:
            pass  # the client went away
        except Exception:
            log.exception("IFRT session stream failed")
        finally:
            self._offer(None)

    def _offer(self, item: Optional[bytes]) -> bool:
        """Put ``item`` into the inbox once it has room; False if the stream closed first
        (the handler stopped taking them). A full inbox is polled: it is full only while the
        handler is far behind, and a queue with a bound costs every request its locking."""
        while self.inbox.qsize() >= INBOX:
            if self.closed.wait(_INBOX_FULL_PAUSE):
                return False
        if self.closed.is_set():
            return False
        self.inbox.put(item)
        return True

    def handle(self) -> None:
        """Serve the inbox's requests in order until the requests end or one does not parse;
        the native messages of those received together go out as one batch, at least every
        BURST_SECONDS (a run held longer would keep its workers idle while the rest is handled)."""
        try:
            raw = self._take()
            while raw is not None:
                with self.session.native.holding():
                    ends = time.monotonic() + BURST_SECONDS
                    while True:
                        try:
                            request = pb.IfrtRequest.FromString(raw)
                        except Exception as e:
                            self.out.put((grpc.StatusCode.INVALID_ARGUMENT,
                                          f"an IfrtRequest did not parse ({type(e).__name__}); closing the session"))
                            return
                        self.serve(request)
                        try:
                            raw = self.inbox.get_nowait()
                        except queue.Empty:
                            raw = None
                            break
                        if raw is None or self.closed.is_set():
                            return
                        if time.monotonic() >= ends:
                            break  # what the burst caused so far goes out, then the rest
                if raw is None:
                    raw = self._take()
        except Exception:
            log.exception("IFRT session stream failed")
        finally:
            self.out.put(None)

    def _take(self) -> Optional[bytes]:
        """The next request payload received, waiting for it; None once the requests ended
        or the stream closed."""
        while not self.closed.is_set():
            try:
                return self.inbox.get(timeout=_INBOX_POLL)
            except queue.Empty:
                pass
        return None

    def serve(self, request: pb.IfrtRequest) -> None:
        op_id = request.request_metadata.op_id
        kind = t.request_kind(request)
        body = getattr(request, kind) if request.WhichOneof("request") else None
        try:
            if body is None:
                raise t.invalid("the IfrtRequest names no request")
            result = self.session.handle(kind, body)
        except Exception as e:
            error = _as_ifrt(e, kind)
            if body is not None:
                try:
                    self.session.fail_handles(kind, body, error)
                except Exception:
                    log.exception("recording the failure of %s", kind)
            self.out.put(_error(op_id, error))
            return
        if isinstance(result, Deferred):
            if not self.waiting.acquire(blocking=False):
                self.out.put(_error(op_id, IfrtError(t.RESOURCE_EXHAUSTED, (
                    f"this session has {MAX_WAITING} requests waiting already; wait for some before sending more"))))
                return
            if result.answer is not None:
                self.out.put(_ok(op_id, kind, result.answer))
            try:
                self.pool.submit(self._finish, op_id, kind, result)
            except RuntimeError:  # the pool shut down: the session is ending
                self.waiting.release()
            return
        self.out.put(_ok(op_id, kind, result))

    def _finish(self, op_id: int, kind: str, deferred: Deferred) -> None:
        if deferred.answer is not None:  # answered already; the work reports its own failures
            try:
                deferred.run()
            except Exception:
                log.exception("%s failed after its answer", kind)
            finally:
                self.waiting.release()
            return
        try:
            response = _ok(op_id, kind, deferred.run())
        except Exception as e:
            response = _error(op_id, _as_ifrt(e, kind))
        finally:
            self.waiting.release()
        if not self.closed.is_set():
            self.out.put(response)


def _as_ifrt(e: Exception, kind: str) -> IfrtError:
    if isinstance(e, IfrtError):
        return e
    log.warning("%s failed: %s: %s", kind, type(e).__name__, e)
    return t.runtime_failure(e, f"{kind} failed in the pathways IFRT server: ")


def _ok(op_id: int, kind: str, body: Any) -> bytes:
    response = pb.IfrtResponse()
    response.response_metadata.op_id = op_id
    getattr(response, kind[:-len("_request")] + "_response").CopyFrom(body)
    return response.SerializeToString()


def session_weight(value: Any) -> float:
    """An IFRT session's weight from its initialization data (absent: 1, like any client);
    ValueError naming PATHWAYS_WEIGHT when it is no number in (0, 1e6]."""
    if value is None:
        return 1.0
    try:
        weight = float(value)
    except ValueError:
        weight = float("nan")
    if not 0 < weight <= 1e6:
        raise ValueError(f"the session's weight (PATHWAYS_WEIGHT, initialization data {WEIGHT_KEY!r}) must be a "
                         f"number in (0, 1e6], got {str(value)[:40]!r}")
    return weight


def _answer_refused(requests: Iterator[bytes], error: IfrtError) -> Iterator[bytes]:
    """Answer each request of a refused session with ``error``, up to a few (a client
    gives up after its first failed request), then end the stream."""
    for _, raw in zip(range(REFUSED_ANSWERS), requests):
        try:
            op_id = pb.IfrtRequest.FromString(raw).request_metadata.op_id
        except Exception:
            return
        yield _error(op_id, error)


def _error(op_id: int, error: IfrtError) -> bytes:
    response = pb.IfrtResponse()
    response.response_metadata.op_id = op_id
    response.response_metadata.status.code = error.code
    response.response_metadata.status.message = error.message[:16384]
    return response.SerializeToString()


def _parse(cls: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    try:
        return cls.FromString(raw)
    except Exception as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a {cls.__name__} did not parse ({type(e).__name__})")


def _metadata(context: grpc.ServicerContext, key: str, cls: Any) -> Any:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return _parse(cls, v if isinstance(v, bytes) else v.encode(), context)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the call lacks metadata {key!r}; use JAX's IFRT proxy client")


def _attribute_values(proto: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in proto.attributes.items():
        which = value.WhichOneof("value")
        if which == "string_value":
            values[key] = value.string_value.decode("utf-8", "replace")
        elif which in ("bool_value", "int64_value", "float_value"):
            values[key] = getattr(value, which)
    return values


_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _grpc_code(code: int) -> grpc.StatusCode:
    return _GRPC_CODES.get(code, grpc.StatusCode.UNKNOWN)
