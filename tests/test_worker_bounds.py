"""Resource bounds of the worker against hostile or careless callers: fetches that would
wait forever or spin, fetches their callers abandoned, put headers of the wrong types, and
closed sessions' functions and programs. The gRPC tests serve a worker core in this process
over real gRPC; the last one runs a real cluster."""

import time

import grpc
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status, worker_stats
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle
from pathways.wire import codec, rpc
from pathways.worker.core import WorkerCore
from pathways.worker.sessions import GRPC_THREADS, WAITING_FETCHES, WAITING_FETCHES_PER_SESSION
from pathways.worker.server import WorkerService
from tests.test_worker_core import put, put_header
from tests.conftest import wait_until

THREADS = 16  # a small server: fewer threads than the waits the core allows in all
MISSING = first_handle(9) + 12345
CREDENTIAL = b"9" * m.CREDENTIAL_BYTES  # session 9's


@pytest.fixture
def served():
    """A worker core behind a real gRPC server in this process; its Fetch, Put and PutOne stubs."""
    core = WorkerCore(lambda msg: None, wait_timeout=5.0)
    core.on_batch(m.encode_batch([m.SessionOpen(9, m.digest(CREDENTIAL))]))
    server, port = rpc.make_server(rpc.WORKER_SERVICE, WorkerService(core).handlers(), max_workers=THREADS)
    channel = rpc.open_channel(f"grpc://127.0.0.1:{port}")
    fetch = rpc.method(channel, rpc.WORKER_SERVICE, "Fetch", "unary_stream")
    put_stub = rpc.method(channel, rpc.WORKER_SERVICE, "Put", "stream_unary")
    put_one = rpc.method(channel, rpc.WORKER_SERVICE, "PutOne", "unary_unary")
    yield core, fetch, put_stub, put_one
    channel.close()
    server.stop(grace=0).wait(timeout=5)
    core.close()


def fetch_request(handle, wait, data=True, credential=CREDENTIAL):
    return codec.pack(["fetch", handle, wait, data, credential, None])


def answered(fetch, handle, wait=0.01, timeout=3.0, credential=CREDENTIAL):
    """The reply header of a fetch that must be answered within ``timeout`` seconds."""
    return codec.unpack(list(fetch(fetch_request(handle, wait, credential=credential), timeout=timeout))[0])


def test_a_fetch_with_a_nan_or_infinite_wait_is_refused(served):
    core, fetch, _, _ = served
    start = time.monotonic()
    for wait in [float("nan")] * THREADS + [float("inf"), -1.0, 1e9, "1"]:
        reply = answered(fetch, MISSING, wait)
        assert reply["state"] == "error" and reply["kind"] == "WireError", reply
        assert "'wait'" in reply["message"], reply
    put(core, first_handle(9) + 1, np.arange(3, dtype=np.float32), {9: CREDENTIAL})
    assert answered(fetch, first_handle(9) + 1, 1.0)["state"] == "ready"
    assert time.monotonic() - start < 10


def test_abandoned_fetches_give_their_threads_back(served):
    core, fetch, _, _ = served
    calls = [fetch(fetch_request(MISSING, 3000.0), timeout=0.5) for _ in range(2 * THREADS)]
    waited = 0
    for i, call in enumerate(calls):
        if i % 2:
            call.cancel()  # the caller gives up on its own; the others run past their deadline
        try:
            # beyond the session's share of waiting fetches, one is answered at once
            assert codec.unpack(next(call)) == {"state": "pending"}
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
            waited += 1
    assert waited >= WAITING_FETCHES_PER_SESSION
    start = time.monotonic()
    assert answered(fetch, MISSING, 0.01, timeout=5.0) == {"state": "pending"}
    assert time.monotonic() - start < 2.0


def test_hundreds_of_sessions_wait_for_their_arrays_and_leave_threads_to_the_others():
    """More sessions than the worker lets wait, each waiting for one array (as many clients
    each waiting for its result): up to WAITING_FETCHES wait, on a server of the worker's
    GRPC_THREADS; the rest are answered "pending" at once, and a put and a fetch of a ready
    array are served at once all the while."""
    sessions = range(10, 10 + WAITING_FETCHES + 40)
    core = WorkerCore(lambda msg: None, wait_timeout=5.0)
    credentials = {s: bytes([s % 256]) * m.CREDENTIAL_BYTES for s in sessions}
    core.on_batch(m.encode_batch([m.SessionOpen(s, m.digest(c)) for s, c in credentials.items()]))
    server, port = rpc.make_server(rpc.WORKER_SERVICE, WorkerService(core).handlers(), max_workers=GRPC_THREADS)
    channel = rpc.open_channel(f"grpc://127.0.0.1:{port}")
    try:
        fetch = rpc.method(channel, rpc.WORKER_SERVICE, "Fetch", "unary_stream")
        put_one = rpc.method(channel, rpc.WORKER_SERVICE, "PutOne", "unary_unary")
        waiting, beyond = list(credentials.items())[:WAITING_FETCHES], list(credentials.items())[WAITING_FETCHES:]
        calls = [fetch(fetch_request(first_handle(s) + 1, 60.0, credential=c), timeout=60) for s, c in waiting]
        wait_until(lambda: core.fetch_waits.waiting() == WAITING_FETCHES, timeout=30,
                   what=f"{WAITING_FETCHES} fetches of as many sessions to wait")
        for s, c in beyond:  # one at a time: each is answered at once
            assert answered(fetch, first_handle(s) + 1, 60.0, credential=c) == {"state": "pending"}
        assert core.fetch_waits.waiting() == WAITING_FETCHES
        start = time.monotonic()
        good = np.arange(3, dtype=np.float32)
        header = put_header(first_handle(10) + 2, good, credential=credentials[10])
        assert codec.unpack(put_one(codec.pack([codec.pack(header), good.tobytes()]), timeout=10)) == {"ok": True}
        assert answered(fetch, first_handle(10) + 2, credential=credentials[10])["state"] == "ready"
        assert time.monotonic() - start < 2.0, "the waits left no thread to a put and a fetch"
        for c in calls:
            c.cancel()
        wait_until(lambda: core.fetch_waits.waiting() == 0, timeout=10, what="the cancelled fetches to stop waiting")
    finally:
        channel.close()
        server.stop(grace=0).wait(timeout=5)
        core.close()


@pytest.mark.parametrize("fields, needle", [
    ({"t": ["put"]}, "'t'"),
    ({"handle": [1]}, "'handle' must be an integer"),
    ({"handle": -1}, "'handle'"),
    ({"layout": {"x": 1}}, "'layout'"),
    ({"of": True}, "'of'"),
    ({"array": {"dtype": ["float32"], "shape": [3], "nbytes": 12}}, "is not allowed on the wire"),
    ({"pieces": [{"index": [[0, 3]], "array": {"dtype": {"f": 4}, "shape": [3], "nbytes": 12}}]}, "is not allowed on the wire"),
])
def test_a_put_header_of_the_wrong_types_gets_an_error_reply(served, fields, needle):
    _, _, put_stub, _ = served
    good = np.ones(3, np.float32)
    header = {**put_header(first_handle(9) + 2, good, credential=CREDENTIAL), **fields}
    reply = codec.unpack(put_stub(iter([codec.pack(header), good.tobytes()]), timeout=10))
    assert needle in reply.get("error", ""), reply


def test_a_put_or_fetch_with_another_sessions_credential_is_refused_as_access_denied(served):
    core, fetch, put_stub, _ = served
    good = np.ones(3, np.float32)
    other = b"x" * m.CREDENTIAL_BYTES
    header = put_header(first_handle(9) + 3, good, credential=other)
    start = time.monotonic()
    reply = codec.unpack(put_stub(iter([codec.pack(header), good.tobytes()]), timeout=10))
    assert reply["kind"] == "AccessDeniedError" and "not that session's" in reply["error"], reply
    assert core.store.get(first_handle(9) + 3) is None
    put(core, first_handle(9) + 4, good, {9: CREDENTIAL})
    reply = answered(fetch, first_handle(9) + 4, credential=other)
    assert reply["state"] == "error" and reply["kind"] == "AccessDeniedError", reply
    assert time.monotonic() - start < 3.0
    assert answered(fetch, first_handle(9) + 4)["state"] == "ready"


def test_a_closed_sessions_functions_and_programs_are_freed_on_the_workers():
    with pw.local_cluster(hosts=1, devices_per_host=1) as cluster:
        worker = status(cluster.address)["workers"][0]["address"]
        before = worker_stats(worker)
        session = pw.connect(cluster.address)
        try:
            s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
            double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
            inc = pw.pmap(lambda x: x + 1.0, devices=s.devices)

            @pw.program
            def both(x):
                return inc(double(x))

            np.testing.assert_array_equal(np.asarray(both(np.ones(1, np.float32))), [3.0])
            during = worker_stats(worker)
            assert during["executables"] >= before["executables"] + 2
            assert during["programs"] >= before["programs"] + 1
        finally:
            session.close()
        wait_until(lambda: (lambda now: (now["executables"], now["programs"], now["sessions"])
                            == (before["executables"], before["programs"], before["sessions"]))(worker_stats(worker)),
                   timeout=20, what="the worker to free the closed session's functions, programs and arrays")


@pytest.mark.parametrize("request_bytes, needle", [
    (b"\xc1", "not valid msgpack"),
    (codec.pack({"header": b"x"}), "msgpack list of binaries"),
    (codec.pack([]), "msgpack list of binaries"),
    (codec.pack(["put", b"x"]), "msgpack list of binaries"),
])
def test_a_malformed_one_message_put_gets_an_error_reply_and_the_worker_keeps_serving(served, request_bytes, needle):
    core, fetch, _, put_one = served
    reply = codec.unpack(put_one(request_bytes, timeout=10))
    assert needle in reply.get("error", ""), reply
    good = np.arange(3, dtype=np.float32)
    header = put_header(first_handle(9) + 5, good, credential=CREDENTIAL)
    assert codec.unpack(put_one(codec.pack([codec.pack(header), good.tobytes()]), timeout=10)) == {"ok": True}
    assert answered(fetch, first_handle(9) + 5)["state"] == "ready"
    np.testing.assert_array_equal(core.store.get(first_handle(9) + 5), good)
