"""Failures and bad input: remote errors, malformed wire messages, dead peers, lost clients."""

import contextlib
import os
import resource
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import pathways as pw
from pathways import cluster as clusters
from pathways.client.devices import VirtualDeviceSet
from pathways.client.session import Session
from pathways.cluster import status
from pathways.defaults import HEARTBEAT_TIMEOUT
from pathways.errors import WireError
from pathways.protocol import messages as m, operator
from pathways.protocol.handles import MAX_SESSION, first_handle
from pathways.protocol import streams
from pathways.wire import codec, rpc, tcp
from pathways.wire.security import HELLO_SECONDS
from pathways.wire.tcp import MAX_UNGREETED
from tests.conftest import check_a_transfer_between_the_hosts, pids_alive, read_line, session_handles, wait_until
from tests.rawworker import RawWorker
from pathways.worker.sessions import SESSION_WAIT_SECONDS, WAITING_FETCHES_PER_SESSION
from tests.test_dataplane_bounds import rss_bytes


GROWTH = 100 << 20  # how much a worker's memory may grow while strangers press on its data plane
TRICKLE_EVERY = 8.0  # seconds between the bytes a trickling stranger sends


def new_slice(n, **kw):
    return pw.make_virtual_device_set().add_slice(cpu_devices=n, **kw)


def test_remote_failure_poisons_outputs_and_the_runtime_keeps_serving(session):
    s = new_slice(1)
    boom = pw.jit(lambda x: jnp.ones((1 << 42,), jnp.float32) * x, mesh=s.mesh("d"))
    total = pw.jit(lambda v: v[:2] + 1, mesh=s.mesh("d"))

    @pw.program
    def f(x):
        return total(boom(x))

    bad = boom(np.float32(1))
    with pytest.raises(pw.RemoteError, match="RESOURCE_EXHAUSTED|[Oo]ut of memory"):
        np.asarray(bad)
    assert bad.is_ready()
    downstream = f(np.float32(2))
    with pytest.raises(pw.RemoteError, match="RESOURCE_EXHAUSTED|[Oo]ut of memory"):
        downstream.block_until_ready()
    fine = pw.jit(lambda x: x * 3, mesh=s.mesh("d"))
    assert float(np.asarray(fine(np.float32(2)))) == 6.0


def test_signature_errors_are_raised_before_anything_is_sent(session, monkeypatch):
    s = new_slice(2)
    p = pw.pmap(lambda x: x * 2, devices=s.devices)
    j = pw.jit(lambda x, y: x @ y, mesh=s.mesh("x"), in_shardings=(pw.P("x"), None))
    fixed = pw.jit(lambda x: x, mesh=s.mesh("x"), in_shardings=({"a": pw.P("x")},))
    sent = []
    monkeypatch.setattr(session, "send", sent.append)
    with pytest.raises(pw.SignatureError, match=r"argument \[0\] has shape \(3,\).*leading axis of size 2"):
        p(np.zeros(3, np.float32))
    with pytest.raises(pw.SignatureError, match=r"shapes \[\[4, 3\], \[4, 5\]\].*dot_general"):
        j(np.zeros((4, 3), np.float32), np.zeros((4, 5), np.float32))
    with pytest.raises(pw.SignatureError, match=r"argument \[0\] has shape \(3, 3\).*2 parts"):
        j(np.zeros((3, 3), np.float32), np.zeros((3, 3), np.float32))
    with pytest.raises(pw.SignatureError, match="in_shardings does not match"):
        fixed({"b": np.zeros(2, np.float32)})
    with pytest.raises(pw.SignatureError, match="keyword"):
        p(x=np.zeros(2, np.float32))
    with pytest.raises(pw.SignatureError, match="not an array"):
        p("text")
    assert sent == []


def test_anything_but_compiled_calls_inside_a_program_is_refused(session):
    s = new_slice(1)
    inc = pw.jit(lambda x: x + 1, mesh=s.mesh("d"))
    x = np.float32(1)
    cases = [
        ("used outside a compiled function", lambda v: inc(v) + 1, (x,)),
        (r"argument \[0\] of <lambda> is a float32.*Pass it as an argument", lambda v: inc(np.float32(3)), (x,)),
        (r"argument <root> of <lambda>'s result is a float", lambda v: 2.0, (x,)),
        (r"argument\(s\) \[1\] are never passed to a compiled function", lambda v, w: inc(v), (x, x)),
    ]
    for needle, body, args in cases:
        with pytest.raises(pw.ProgramTraceError, match=needle):
            pw.program(body)(*args)
    with pytest.raises(pw.ProgramTraceError, match="outside a compiled function"):
        pw.program(lambda v: jnp.sin(inc(v)))(x)
    with pytest.raises(pw.ProgramTraceError, match="calls no compiled function"):
        pw.program(lambda v: v)(pw.device_put(x, s.devices))
    with pytest.raises(ValueError, match="dispatch"):
        pw.program(lambda v: v, dispatch="eager")
    assert float(np.asarray(pw.program(lambda v: inc(inc(v)))(x))) == 3.0  # and tracing still works


def test_deleted_arrays_and_timeouts_give_clear_errors(session):
    s = new_slice(1)
    slow = pw.jit(lambda x: jax.lax.fori_loop(0, 300, lambda i, m: jnp.tanh(m @ m), x), mesh=s.mesh("d"))
    m = pw.device_put(np.eye(256, dtype=np.float32) * 0.5, s.devices)
    slow(m).block_until_ready()
    pending = slow(m)
    with pytest.raises(pw.DeadlineExceededError, match="not ready after"):
        pending.block_until_ready(timeout=0.001)
    m.delete()
    with pytest.raises(pw.ArrayDeletedError, match="was deleted"):
        slow(m)
    pending.block_until_ready()


def raw_session(address):
    """A Session stream driven by hand, to send what the client library never would."""
    channel = rpc.open_channel(address)
    outbox = streams.Outbox()
    replies = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Session", "stream_stream")(_raw(outbox))
    return channel, outbox, replies


def _raw(outbox):
    while True:
        item = outbox._queue.get(timeout=30)
        if item is None:
            return
        yield item


def next_messages(replies):
    return m.SESSION_DOWN.decode_batch(next(replies))


def _send_without_reading(cluster, payload, times, requests, refusal, memory):
    """Send ``payload`` (``requests`` requests in all) ``times`` on a raw session without
    reading a reply; the controller's memory grows by less than ``memory`` bytes, other
    clients are served meanwhile, and once the client reads, every request is answered
    with an Error that contains ``refusal``."""
    controller = cluster.pids[0]
    before = rss_bytes(controller)
    channel, outbox, replies = raw_session(cluster.address)
    try:
        outbox.put(m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0)]))
        for _ in range(times):
            outbox.put(payload)
        time.sleep(2.0)  # about as long as the controller takes to go through them all, had it not stopped reading
        grown = rss_bytes(controller) - before
        assert grown < memory, grown
        started = time.monotonic()
        status(cluster.address)
        assert time.monotonic() - started < 2.0, "other clients are served meanwhile"
        refused = 0
        for reply in replies:
            errors = [x for x in m.SESSION_DOWN.decode_batch(reply) if type(x) is m.Error]
            assert all(refusal in x.message for x in errors), errors[0].message[:200]
            refused += len(errors)
            if refused >= requests:
                break
        assert refused == requests, "every request was answered once the client read"
    finally:
        outbox.put(None)
        channel.close()


def test_a_client_that_does_not_read_its_replies_holds_no_more_of_the_controllers_memory(cluster):
    """200,000 requests whose every one is answered (refused deletes), sent without
    reading a reply. The controller stops reading the stream while its replies wait (a
    backlog of at most streams.MAX_QUEUED_MESSAGES, a few MB, where holding all of them takes
    tens), serves other clients meanwhile, and every reply arrives once the client reads."""
    deletes = m.encode_batch([m.Delete((7,))] * 1000)  # the controller's handle: refused each time
    _send_without_reading(cluster, deletes, 200, 200_000, "belong to other sessions", 30 << 20)


def test_a_client_that_does_not_read_large_replies_holds_no_more_than_the_byte_bound(cluster):
    """2,500 requests whose every one is refused with an error of about 48 KB (it quotes
    the malformed value of the request), 120 MB of replies, sent without reading one. The
    controller stops reading the stream once streams.MAX_QUEUED_BYTES of replies wait (far
    fewer than streams.MAX_QUEUED_MESSAGES), serves other clients meanwhile, and every reply
    arrives once the client reads."""
    quoted = "x" * 48_000
    graph = {"nvalues": 1, "inputs": [0], "nodes": [[1, [0], [0]]], "outputs": [0],
             "types": [["float32", [], quoted]]}  # a value type of three entries: refused, quoted
    programs = codec.pack([["program", 1, graph, "parallel"]] * 10)
    _send_without_reading(cluster, programs, 250, 2500, quoted, 3 * streams.MAX_QUEUED_BYTES + (30 << 20))


def test_fetches_that_wait_for_ever_hold_a_few_of_a_workers_threads_and_others_are_served(cluster, session):
    """20 fetches that would wait an hour for arrays that will never exist, from one
    session. Only WAITING_FETCHES_PER_SESSION of them wait (the rest are answered "pending"
    at once), so the worker's other callers are served meanwhile: its Stats, another
    client's session, which puts, runs and fetches there, and the same session, whose own
    fetch finds the waits taken and asks again after a pause, not at once."""
    other = Session(cluster.address)
    try:
        theirs = VirtualDeviceSet(other).add_slice(cpu_devices=1)
        triple = pw.jit(lambda x: x * 3.0, mesh=theirs.mesh("d"))
        np.asarray(triple(np.zeros(3, np.float32)))  # compiled before the fetches wait: what is timed is serving
        worker = theirs.addresses[0]
        stubs = session._stubs(worker)
        forever = [m.pack(m.FetchRequest(first_handle(session.id) + (1 << 30) + i, m.MAX_WAIT_SECONDS, True,
                                         stubs.credential).encode()) for i in range(20)]
        calls = [stubs.fetch(request, timeout=m.MAX_WAIT_SECONDS + 30) for request in forever]
        answered = []

        def read(call):
            try:
                answered.append(codec.unpack(next(call)))
            except grpc.RpcError:
                pass

        readers = [threading.Thread(target=read, args=(c,), daemon=True) for c in calls]
        try:
            for r in readers:
                r.start()
            wait_until(lambda: len(answered) >= 20 - WAITING_FETCHES_PER_SESSION, timeout=10,
                       what="the fetches beyond the session's share to be answered at once")
            assert all(a == {"state": "pending"} for a in answered), answered[:2]
            started = time.monotonic()
            assert "sessions" in clusters.worker_stats(worker)
            tripled = triple(pw.device_put(np.arange(3, dtype=np.float32), theirs.devices))
            np.testing.assert_array_equal(np.asarray(tripled), np.arange(3) * 3.0)
            np.testing.assert_array_equal(np.asarray(pw.device_put(np.arange(3, dtype=np.float32),
                                                                   new_slice(1).devices)), np.arange(3))
            assert time.monotonic() - started < 5.0, "the worker's other callers are served meanwhile"
            assert len(answered) == 20 - WAITING_FETCHES_PER_SESSION, "the session's share still waits"
        finally:
            for c in calls:
                c.cancel()
    finally:
        other.close()


def test_calls_for_a_session_not_open_hold_few_of_a_workers_threads(cluster, session):
    """40 Timeline requests and 20 fetches that would wait an hour, all at once, for a
    session the controller has not opened. A client asks for the timeline of the runs a
    worker ran, so of a session the worker has heard of: those are refused at once. A fetch
    (or put) may race its session's announcement and waits for it, but as one of the
    worker's few waits (FetchWaits): the rest are refused at once. The worker's Stats
    answers meanwhile, and every call ends within SESSION_WAIT_SECONDS."""
    worker = status(cluster.address)["workers"][0]["address"]
    stubs = session._stubs(worker)
    ask = rpc.method(stubs.channel, rpc.WORKER_SERVICE, "Timeline", "unary_unary")
    timeline = m.pack(m.TimelineFetch(MAX_SESSION, stubs.credential, 10).encode())
    started = time.monotonic()
    fetches = [stubs.fetch(m.pack(m.FetchRequest(first_handle(MAX_SESSION) + 1 + i, m.MAX_WAIT_SECONDS, True,
                                                 stubs.credential).encode()), timeout=30) for i in range(20)]
    timelines = [ask.future(timeline, timeout=30) for _ in range(40)]
    fetched = []

    def answer(call):
        try:
            fetched.append((codec.unpack(next(call)), time.monotonic()))
        except grpc.RpcError:
            pass  # cancelled: the test failed already

    readers = [threading.Thread(target=answer, args=(c,), daemon=True) for c in fetches]
    try:
        for r in readers:
            r.start()
        assert "sessions" in clusters.worker_stats(worker, timeout=2.0)
        stats = time.monotonic() - started
        refused = [operator.TIMELINE_REPLY.decode_one(c.result()) for c in timelines]
        timelines_ended = time.monotonic() - started
        wait_until(lambda: len(fetched) == 20, SESSION_WAIT_SECONDS + 3, "every fetch to be answered")
    finally:
        for c in [*timelines, *fetches]:
            c.cancel()
    at_once = sum(at - started < 2.0 for _, at in fetched)
    assert stats < 2.0, "the worker's threads are free for others"
    assert all(type(r) is operator.Failed and r.kind == "AccessDeniedError" and f"session {MAX_SESSION} yet" in r.error
               for r in refused), \
        refused[0]
    assert timelines_ended < 2.0, "each timeline request is refused at once"
    assert all(a["kind"] == "AccessDeniedError" and f"session {MAX_SESSION} yet" in a["message"] for a, _ in fetched)
    assert at_once >= 20 - WAITING_FETCHES_PER_SESSION, "beyond the session's share, fetches do not wait"


def test_a_program_beyond_the_node_limit_is_refused_naming_it(cluster, session):
    """A program may have MAX_PROGRAM_NODES nodes (lowering a million would hold the
    controller's loop past the heartbeat timeout, and its workers would give it up): the
    client refuses more when it traces, the controller when it decodes, at once. Then the
    probe's raw program, a million nodes in one message of about 33 MB: decoding all of it
    held the controller for seconds (its workers gave it up when the machine was busy), so
    the controller stops decoding past codec.MAX_DECODED_VALUES and refuses it naming that
    bound, within a second or so, growing by a few hundred MB at most, and both workers keep
    serving."""
    from pathways.client.program import ProgramTraceError
    from pathways.ir import MAX_PROGRAM_NODES

    s = new_slice(1)
    inc = pw.jit(lambda x: x + 1.0, mesh=s.mesh("d"))

    @pw.program
    def long(x):
        for _ in range(MAX_PROGRAM_NODES + 1):
            x = inc(x)
        return x

    with pytest.raises(ProgramTraceError, match=f"more than the {MAX_PROGRAM_NODES} one may have"):
        long(pw.device_put(np.float32(0), s.devices))
    channel, outbox, replies = raw_session(cluster.address)
    controller = cluster.pids[0]
    try:
        outbox.put(m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0)]))
        sid = next_messages(replies)[0].session
        for count, refusal in [(MAX_PROGRAM_NODES + 1, f"a program of {MAX_PROGRAM_NODES + 1} nodes has more than the "
                                                       f"{MAX_PROGRAM_NODES}"),
                               (1_000_000, f"holds more than {codec.MAX_DECODED_VALUES} values")]:
            nodes = [[first_handle(sid) + 1, [v], [v + 1]] for v in range(count)]
            graph = {"nvalues": len(nodes) + 1, "inputs": [0], "nodes": nodes, "outputs": [len(nodes)],
                     "types": [["float32", []]] * (len(nodes) + 1)}
            program = codec.pack([["program", first_handle(sid) + 2, graph, "parallel"]])
            del nodes, graph
            before = rss_bytes(controller)
            started = time.monotonic()
            outbox.put(program)
            [refused] = next_messages(replies)
            assert type(refused) is m.Error and refusal in refused.message, refused
            assert time.monotonic() - started < 5.0
            assert rss_bytes(controller) - before < 512 << 20, (len(program), rss_bytes(controller) - before)
    finally:
        outbox.put(None)
        channel.close()
    assert len(status(cluster.address)["workers"]) == 2
    check_a_transfer_between_the_hosts()


def test_connections_that_never_greet_hold_a_few_of_a_workers_threads(cluster, session):
    """2,000 data-plane connections that send nothing: a worker serves at most
    MAX_UNGREETED of them at once, each until HELLO_SECONDS, and closes the rest as they
    arrive; its threads and memory stay few and its peers' transfers go on."""
    connections = 2000
    worker = next(w for w in status(cluster.address)["workers"] if w["rank"] == 0)
    check_a_transfer_between_the_hosts(into=worker["worker"])  # the threads a transfer needs are there before counting
    threads, memory = _threads(worker["pid"]), rss_bytes(worker["pid"])
    strangers, ends = [], None
    with _descriptors(connections + 256):
        try:
            for _ in range(connections):
                strangers.append(_dial(worker))
            ends = _Ends(strangers)
            wait_until(lambda: ends.poll() >= connections - MAX_UNGREETED, timeout=30,
                       what="the worker to close the connections beyond the ones it serves")
            assert _threads(worker["pid"]) - threads <= MAX_UNGREETED + 16, (threads, _threads(worker["pid"]))
            assert rss_bytes(worker["pid"]) - memory < GROWTH, (memory, rss_bytes(worker["pid"]))
            check_a_transfer_between_the_hosts(into=worker["worker"])
        finally:
            if ends is not None:
                ends.close()
            for sock in strangers:
                sock.close()


@contextlib.contextmanager
def _descriptors(count):
    """At least ``count`` file descriptors for this process while in the block (the soft
    limit raised, up to the hard one, if need be)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        assert hard == resource.RLIM_INFINITY or hard >= count, f"this process may open only {hard} files"
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class _Ends:
    """When the other end closed each of ``socks``: ``at[sock]`` (time.monotonic()), noted
    by ``poll``, which reads what arrived and never waits."""

    def __init__(self, socks):
        self._selector = selectors.DefaultSelector()
        for sock in socks:
            self._selector.register(sock, selectors.EVENT_READ)
        self.at = {}

    def poll(self):
        """How many have been closed so far."""
        for key, _ in self._selector.select(0):
            try:
                ended = not key.fileobj.recv(1 << 16)
            except OSError:  # reset: closed with bytes of ours unread
                ended = True
            if ended:
                self.at[key.fileobj] = time.monotonic()
                self._selector.unregister(key.fileobj)
        return len(self.at)

    def close(self):
        self._selector.close()


def _threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_a_backlog_larger_than_one_payload_goes_out_in_several():
    batch = [m.Error(i, "RemoteError", "x" * 1000) for i in range(1, 3001)]
    items = [m.encode_item(x) for x in batch]
    limit = len(m.encode_batch(batch)) // 5
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(streams, "MAX_MESSAGE_BYTES", limit)
        payloads = list(streams.payloads(items))
    assert len(payloads) > 5 and all(len(p) <= limit for p in payloads)
    assert [x.req for p in payloads for x in m.SESSION_DOWN.decode_batch(p)] == list(range(1, 3001)), "all, in order"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(streams, "MAX_BATCH_MESSAGES", 1000)
        assert [len(m.SESSION_DOWN.decode_batch(p)) for p in streams.payloads(items[:2500])] == [1000, 1000, 500]
    with pytest.raises(WireError, match="exceeds the 65536"):
        m.SESSION_DOWN.decode_batch(codec.pack([["cluster", 1]] * (m.MAX_BATCH_MESSAGES + 1)))


def test_malformed_session_messages_get_error_replies(cluster, session):
    channel, outbox, replies = raw_session(cluster.address)
    try:
        outbox.put(m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0)]))
        sid = next_messages(replies)[0].session
        victim = session.allocate(1)
        s = new_slice(1)
        victim_array = pw.device_put(np.float32(7), s.devices)
        graph = {"nvalues": 1, "inputs": [0], "nodes": [[1, [3], [0]]], "outputs": [0], "types": [["float32", []]]}
        good = {"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [1]]], "outputs": [1], "types": [["float32", []]] * 2}
        bad_payloads = [
            (b"\x00\xffnot msgpack", "not valid msgpack"),
            (codec.pack({"t": "hello"}), "must be a list"),
            (codec.pack([["launch_missiles"]]), "unknown message 'launch_missiles'"),
            (codec.pack([{"t": "hello", "v": 2, "weight": 1}]), "must be a list [tag, field, ...]"),
            (codec.pack([["slice", 1]]), "it takes 6"),
            (codec.pack([["slice", 1, "cpu", "two", None, None, False]]), "'count' of message 'slice' must be an integer"),
            (codec.pack([["slice", 1, ["cpu"], 2, None, None, False]]), "'kind' of message 'slice' must be a string"),
            (codec.pack([["run", 5, first_handle(sid), [], False, False]]), "never registered"),
            (codec.pack([["program", first_handle(sid) + 1, graph, "parallel"]]), "before any node defines"),
            (codec.pack([["program", first_handle(sid) + 1, {}, "eventually"]]), "graph"),
            (codec.pack([["program", first_handle(sid) + 1, good, "eventually"]]),
             "must be one of ['parallel', 'sequential']"),
            (m.encode_batch([m.DefineProgram(victim, m.GRAPH.check(good, "graph"), "parallel")]),
             "does not belong to this session"),
            (m.encode_batch([m.DefineFunction(first_handle(sid) + 2, s.id, m.FunctionBody("x", b"", (), ()))]),
             "not one of this session's slices"),
            (m.encode_batch([m.Hello(999, 1.0)]), "protocol"),
            (codec.pack([["hello", m.PROTOCOL_VERSION, -2]]), "weight"),
            (codec.pack([["hello", m.PROTOCOL_VERSION, float("nan")]]), "weight"),
        ]
        for payload, needle in bad_payloads:
            outbox.put(payload)
            reply = next_messages(replies)
            assert type(reply[0]) is m.Error and needle in reply[0].message, (needle, reply)
        # a hostile delete of another session's array is refused
        outbox.put(m.encode_batch([m.Delete((victim_array.handle,))]))
        [refused] = next_messages(replies)
        assert refused.kind == "AccessDeniedError" and "belong to other sessions" in refused.message
        outbox.put(m.encode_batch([m.ClusterRequest(9)]))
        assert next_messages(replies)[0].req == 9  # the same stream still works
    finally:
        outbox.put(None)
        channel.close()
    assert float(np.asarray(victim_array)) == 7.0
    assert len(status(cluster.address)["workers"]) == 2


def test_malformed_worker_and_attach_messages_get_error_replies(cluster, session):
    worker = next(w["address"] for w in status(cluster.address)["workers"] if w["rank"] == 0)
    channel = rpc.open_channel(worker)
    put = rpc.method(channel, rpc.WORKER_SERVICE, "Put", "stream_unary")
    fetch = rpc.method(channel, rpc.WORKER_SERVICE, "Fetch", "unary_stream")
    layout = [[0], [0, 0], [1], ["d"], []]
    good = np.arange(3, dtype=np.float32)
    credential = session._stubs(worker).credential

    def put_header(layout=layout, of=1, array=None, pieces=None):
        header = {"t": "put", "handle": first_handle(session.id) + (1 << 30), "layout": layout, "of": of,
                  "credential": credential,
                  **codec.pieces_header(good.dtype, good.shape, [(((0, 3),), good)])}
        if array is not None:
            header["array"] = array
        if pieces is not None:
            header["pieces"] = pieces
        return codec.pack(header)

    cases = [
        ([b"garbage"], "not valid msgpack"),
        ([codec.pack({"t": "put", "handle": 1})], "lacks field 'layout'"),
        ([put_header(layout=[[0], [0, 99], [1], ["d"], []]), good.tobytes()], "island lacks"),
        ([put_header(layout=[[0], [1, 0], [1], ["d"], []]), good.tobytes()], "none of it on this worker"),
        ([put_header(), good.tobytes()[:5]], "header announced"),
        ([put_header(), good.tobytes(), b"extra"], "more array data"),
        ([put_header(of=0), good.tobytes()], "senders"),
        ([put_header(pieces=[{"index": [[1, 3]], "array": codec.array_header(good)}]), good.tobytes()],
         "does not match its index"),
        ([put_header(array={**codec.array_header(good), "dtype": "object"})], "not allowed"),
        ([put_header(pieces=[{"index": [[0, 2]], "array": codec.array_header(good[:2])}]), good[:2].tobytes()],
         "do not cover"),
    ]
    try:
        for chunks, needle in cases:
            reply = codec.unpack(put(iter(chunks), timeout=10))
            assert needle in reply.get("error", ""), (needle, reply)
        reply = [codec.unpack(r) for r in fetch(b"\x93garbage", timeout=10)]
        assert reply[0]["state"] == "error" and "msgpack" in reply[0]["message"]
        request = m.FetchRequest(first_handle(session.id) + 12345, 0.01, True, credential)
        reply = [codec.unpack(r) for r in fetch(m.pack(request.encode()), timeout=10)]
        assert reply == [{"state": "pending"}]
    finally:
        channel.close()
    # a fake worker that sends garbage on the worker stream gets an error and is not registered
    raw = RawWorker(cluster.address, security=cluster.security)
    try:
        raw.send(b"\x01\x02")
        raw.send(codec.pack([["register", "x"]]))
        messages = raw.finish()
        assert [type(x) for x in messages] == [m.Notice, m.Notice]
        assert "msgpack" in messages[0].message and "it takes 12" in messages[1].message
    finally:
        raw.close()
    assert len(status(cluster.address)["workers"]) == 2
    s = new_slice(2)
    f = pw.pmap(lambda x: x - 1, devices=s.devices)
    np.testing.assert_array_equal(np.asarray(f(np.ones(2, np.float32))), np.zeros(2))


CLIENT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pathways as pw
    session = pw.connect(sys.argv[1])
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    f = pw.jit(lambda x: x + 1, mesh=s.mesh("x"))
    keep = [f(np.float32(i)) for i in range(10)]
    keep[-1].block_until_ready()
    print(session.id, flush=True)
    time.sleep(300)
""")


def test_a_disconnected_clients_buffers_and_slices_are_freed(cluster, session):
    slices_before = status(cluster.address)["slices"]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, cluster.address], stdout=subprocess.PIPE, text=True)
    try:
        sid = int(read_line(proc))
        wait_until(lambda: session_handles(cluster.address, sid) == 10, what="the client's 10 arrays")
        assert status(cluster.address)["slices"] == slices_before + 1
    finally:
        proc.kill()
        proc.wait(timeout=10)
    wait_until(lambda: session_handles(cluster.address, sid) == 0, what="the dead client's buffers freed")
    wait_until(lambda: status(cluster.address)["slices"] == slices_before, what="its slice released")


def test_wrong_addresses_fail_fast_with_advice():
    with pytest.raises(pw.ConnectError, match="grpc://HOST:PORT"):
        pw.connect("not-an-address")
    with pytest.raises(pw.ConnectError, match="could not connect to grpc://127.0.0.1:1: the connection was refused"):
        pw.connect("grpc://127.0.0.1:1", timeout=1)
    out = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", "grpc://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "the connection was refused" in out.stderr


def test_a_dead_controller_gives_errors_not_hangs():
    with pw.local_cluster(hosts=1, devices_per_host=1) as c:
        s = new_slice(1)
        f = pw.jit(lambda x: x * 2, mesh=s.mesh("d"))
        y = f(np.float32(4))
        assert float(np.asarray(y)) == 8.0
        os.kill(c.pids[0], signal.SIGKILL)
        with pytest.raises(pw.ConnectError, match="controller at .* (closed|broke)"):
            wait_until(lambda: f(np.float32(1)) is None, timeout=10, what="the session to notice")
        with pytest.raises(pw.ConnectError):
            np.asarray(y)
        # the worker keeps its process, waiting for the controller to come back (--reconnect-timeout)
        assert pids_alive(c.pids[1:]) == c.pids[1:]
    assert pids_alive(c.pids) == []


PARENT = textwrap.dedent("""
    import time
    import pathways as pw
    with pw.local_cluster(hosts=2, devices_per_host=1) as c:
        print(" ".join(map(str, c.pids)), flush=True)
        time.sleep(300)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_no_process_outlives_its_client(sig, tmp_path):
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", PARENT], stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        pids = [int(p) for p in read_line(proc).split()]
        assert len(pids) == 3 and pids_alive(pids) == pids
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack, to say where it hung
            proc.wait(timeout=10)
            raise AssertionError(f"the client did not exit within 30 s of {signal.Signals(sig).name}; "
                                 f"its stderr ends:\n{stderr.read_text()[-6000:]}") from None
        wait_until(lambda: pids_alive(pids) == [], timeout=15, what="every cluster process to exit")
    finally:
        proc.kill()
        proc.wait()


def test_malformed_data_frames_close_their_connection_and_the_worker_keeps_serving(cluster, session):
    worker = status(cluster.address)["workers"][0]
    for frame in [struct.pack("!I", 1 << 30),  # a header larger than any allowed
                  struct.pack("!I", 4) + b"\xc1\xc1\xc1\xc1",  # not msgpack
                  struct.pack("!I", 2) + codec.pack([1]),  # not a map
                  _frame({"t": "put", "array": {"dtype": "object", "shape": [], "nbytes": 8}, "pieces": []}),
                  _announce(worker, 1 << 50)]:  # more memory than any host has
        with _dial(worker) as sock:
            sock.sendall(frame)
            reply = b""
            while chunk := sock.recv(1 << 16):
                reply += chunk
            # closed, at most with a refusal: a frame before a peer's hello is never read as data
            assert reply == b"" or codec.unpack(reply[4:])["t"] == "refused", reply[:200]
    check_a_transfer_between_the_hosts()


def test_giant_frames_from_a_stranger_are_refused_or_cut_at_the_greeting_deadline(cluster, session):
    """Two frames announcing 5.89 GiB each at a worker's data plane, then a byte every 8 s,
    from a process that may hold the clients' token but no worker's ticket (only the
    controller gives tickets, to the workers it admits, and each is good only for the
    worker it names as its sender: test_security.py). A frame before a greeting is
    refused, so the two frames sent whole are refused at once; two more connections send
    the frames from their first byte, a byte every 8 s (all a stranger can hold), and are
    cut HELLO_SECONDS after they opened. Meanwhile the worker's memory stays put and an
    honest transfer into it completes."""
    target, peer = sorted(status(cluster.address)["workers"], key=lambda w: w["rank"])
    giant = _announce(target, int(5.89 * (1 << 30)))
    check_a_transfer_between_the_hosts(into=target["worker"])  # the link and threads it needs are there before
    before = rss_bytes(target["pid"])
    # what each connection sends at once, and what it then trickles (zeros past its end)
    streams = [(giant, b""), (_forged_hello(peer["worker"]) + giant, b""), (giant[:1], giant[1:]),
               (giant[:1], giant[1:])]
    socks, ends, stop, peak = [], None, threading.Event(), 0
    trickler = threading.Thread(target=_trickle, args=(socks, [rest for _, rest in streams], stop), daemon=True)
    try:
        for first, _ in streams:
            socks.append(_dial(target))
            socks[-1].sendall(first)
        opened = time.monotonic()
        ends = _Ends(socks)
        trickler.start()
        wait_until(lambda: ends.poll() and all(s in ends.at for s in socks[:2]), timeout=5.0,
                   what="the frames sent whole to be refused")
        check_a_transfer_between_the_hosts(into=target["worker"])
        assert ends.poll() == 2, "the honest transfer was served while the tricklers were connected"

        def all_cut():
            nonlocal peak
            peak = max(peak, rss_bytes(target["pid"]) - before)
            return ends.poll() == len(socks)

        wait_until(all_cut, timeout=HELLO_SECONDS + 10, what="the trickling connections to be cut")
        lasted = [ends.at[s] - opened for s in socks]
        assert max(lasted[:2]) < 5.0 and max(lasted[2:]) < HELLO_SECONDS + 2.0, lasted
        assert peak < GROWTH, f"the worker grew by {peak >> 20} MiB"
    finally:
        stop.set()
        if trickler.is_alive():
            trickler.join(timeout=30)
        if ends is not None:
            ends.close()
        for sock in socks:
            sock.close()


def _trickle(socks, rests, stop):
    """Send each of ``rests`` on its socket, a byte every TRICKLE_EVERY seconds (zeros past
    its end), until ``stop``; a socket the other end closed is let be."""
    sent = 0
    while not stop.wait(TRICKLE_EVERY):
        for sock, rest in zip(socks, rests):
            try:
                sock.send(rest[sent:sent + 1] or b"\0")
            except OSError:
                pass
        sent += 1


def test_stray_copies_from_a_stranger_are_dropped_and_the_worker_keeps_its_memory(cluster, session):
    """64 transfer copies of 32 MiB that no run reads, pushed at a worker's data plane by
    a process without a worker's ticket, reconnecting whenever it is refused (for 10 s at
    most). Each is refused at its first frame and its bytes are never read: the worker keeps
    no array more, counts the forged greetings, stays within 150 MiB of the memory it had
    (during the push and 2 s after), and an honest client's put, run and fetch give the
    right values."""
    copies, size = 64, 32 << 20
    target, peer = sorted(status(cluster.address)["workers"], key=lambda w: w["rank"])
    payload = memoryview(bytes(size))
    check_a_transfer_between_the_hosts(into=target["worker"])
    before, stats = rss_bytes(target["pid"]), clusters.worker_stats(target["address"])
    offered, peak, started = 0, 0, time.monotonic()
    while offered < copies and time.monotonic() - started < 10:
        with _dial(target, timeout=2.0) as sock:
            try:  # every other copy after a hello claiming to be the other worker
                sock.sendall((_forged_hello(peer["worker"]) if offered % 2 else b"") +
                             _announce(target, size, handle=offered + 1))
                sock.sendall(payload)
            except OSError:
                pass  # refused while sending: offered all the same
        offered += 1
        peak = max(peak, rss_bytes(target["pid"]) - before)
    assert offered == copies, f"only {offered} copies offered in 10 s"
    after = time.monotonic() + 2.0
    while time.monotonic() < after:  # the memory it holds for the next 2 s
        peak = max(peak, rss_bytes(target["pid"]) - before)
        time.sleep(0.1)
    assert peak < 150 << 20, f"the worker grew by {peak >> 20} MiB"
    now = clusters.worker_stats(target["address"])
    assert now["handles"] <= stats["handles"], "no stray copy is kept"
    assert now["refused_peers"] >= stats["refused_peers"] + copies // 2, "every forged greeting is counted"
    check_a_transfer_between_the_hosts(into=target["worker"])


def test_copies_forged_by_an_admitted_worker_are_refused_and_every_run_reads_its_senders_values(cluster, session):
    """A process holding a real worker's ticket (it attached with the cluster's worker token,
    the one host of an island of its own, and holds none of the victim's data) pushes at a
    worker a forged copy, values of the right shape and layout or a poison, for each of the
    next 400 transfer copy numbers the controller gives and for 10 it gave already, each on
    a connection of its own, before a client runs 24 runs of a program that moves an array
    between the two hosts 16 times a run. A copy is taken only from the worker the run's
    receive op names: every run gives the right values, every forged copy is refused before
    its bytes are read and counted (those no run of the worker expects once the peer
    timeout has passed), and once the runs' results are deleted the worker holds no more
    arrays than before. A later transfer into it works."""
    hops, runs = 8, 24
    a, b = new_slice(4), new_slice(4)
    assert a.workers != b.workers, "the two slices should take one host each"
    fa, fb = pw.jit(lambda v: v + 1, mesh=a.mesh("d")), pw.jit(lambda v: v * 2, mesh=b.mesh("d"))

    @pw.program
    def hop(x):
        for _ in range(hops):
            x = fb(fa(x))
        return x

    x = pw.device_put(np.arange(4.0, dtype=np.float32), a.devices)
    want = np.arange(4.0, dtype=np.float32)
    for _ in range(hops):
        want = (want + 1) * 2
    np.testing.assert_array_equal(np.asarray(hop(x)), want)  # compiled, and its copies numbered before the forger came
    target = next(w for w in status(cluster.address)["workers"] if w["worker"] == b.workers[0])
    stats = clusters.worker_stats(target["address"])
    forger = RawWorker(cluster.address, security=cluster.security)
    try:
        forger.send_messages(m.Register("grpc://127.0.0.1:1", "tcp://127.0.0.1:1", "cpu", 1, "forger", 1, None, "", 1,
                                        "forger", 1 << 30))
        told = forger.until(lambda msg: type(msg) is m.Peers)
        welcome = next(msg for msg in told if type(msg) is m.WorkerWelcome)
        ticket = (welcome.worker, next(t for w, _, t in told[-1].peers if w == target["worker"]))
        forger.keep_alive()
        threading.Thread(target=forger.drain, daemon=True).start()
        layout = b.layout((4,), ("d",), PartitionSpec()).to_wire()
        forged = [_forged_copy(h, layout, poison=h % 4 == 0)
                  for h in range(welcome.copies - 10, welcome.copies + runs * 2 * hops + 16)]

        def push(frame):
            with tcp.connect(target["data_address"], 10.0, cluster.security, ticket=ticket) as sock:
                sock.sendall(frame)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(push, forged))
        results = [hop(x) for _ in range(runs)]
        wrong = 0
        for result in results:
            try:
                wrong += not np.array_equal(np.asarray(result), want)
            except pw.PathwaysError:
                wrong += 1
        assert wrong == 0, f"{wrong} of {runs} runs read a forged copy"
        refused = lambda: clusters.worker_stats(target["address"])["refused_copies"] - stats["refused_copies"]
        wait_until(lambda: refused() >= len(forged), timeout=HEARTBEAT_TIMEOUT + 30,
                   what="every forged copy to be refused")
        assert refused() == len(forged)
        for result in results:
            result.delete()
        wait_until(lambda: clusters.worker_stats(target["address"])["handles"] <= stats["handles"],
                   what="the worker to hold no more arrays than before: no forged copy is kept")
    finally:
        forger.close()
    check_a_transfer_between_the_hosts(into=target["worker"])


def _forged_copy(handle, layout, poison=False):
    """The frame of a transfer copy ``handle`` of four float32 laid out as ``layout`` (a
    poison instead, if ``poison``), of no run's making."""
    header = {"t": "put", "handle": handle, "layout": layout, "of": 1}
    if poison:
        return _frame({**header, "poison": "forged", "kind": "RemoteError"})
    values = np.full(4, 666.0, np.float32)
    return _frame({**header, **codec.pieces_header(values.dtype, values.shape,
                                                   [(codec.full_region(values.shape), values)])}) + values.tobytes()


def _frame(header):
    body = codec.pack(header)
    return struct.pack("!I", len(body)) + body


def _dial(worker, timeout=10.0):
    """A plain TCP connection to ``worker``'s data plane (a status entry): no hello."""
    host, _, port = worker["data_address"].removeprefix("tcp://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def _announce(worker, nbytes, handle=1):
    """The frame of a transfer copy of ``nbytes`` bytes for ``worker``, without those bytes."""
    array = {"dtype": "uint8", "shape": [nbytes], "nbytes": nbytes}
    return _frame({"t": "put", "handle": handle, "layout": [[worker["worker"]], [0, 0], [1], ["d"], []], "of": 1,
                   "array": array, "pieces": [{"index": [[0, nbytes]], "array": array}]})


def _forged_hello(claimed):
    """A hello claiming to come from worker ``claimed``, with a made-up ticket."""
    return _frame({"t": "hello", "from": claimed, "ticket": secrets.token_bytes(32)})
