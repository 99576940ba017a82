"""Hostile IFRT proxy clients: thousands of generated and mutated IfrtRequests over real
gRPC session streams, garbage bytes and bad metadata. The server answers every request
that parses with a response carrying its op_id (a status at worst) or closes the session,
never dies, and a normal JAX client works afterwards."""

import random

import grpc
import numpy as np
import pytest

from ifrt_helpers import RawStream, run_jax, session_metadata
from pathways.cluster import Island, LocalCluster
from pathways.ifrt import server as ifrt_server
from pathways.ifrt import handling
from pathways.ifrt import types as t
from pathways.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.ifrt.server import IfrtServer

REQUESTS = 2000
PER_SESSION = 500
_HANDLES = [0, 1, 2, 3, 4, 7, 1 << 48, (1 << 48) + 1, (1 << 64) - 1]


def _fill(msg, rng, depth=0):
    """Set random fields of ``msg``, recursively (one member per oneof)."""
    chosen_oneofs = set()
    for f in msg.DESCRIPTOR.fields:
        if rng.random() < 0.45:
            continue
        if f.containing_oneof is not None:
            if f.containing_oneof.name in chosen_oneofs:
                continue
            chosen_oneofs.add(f.containing_oneof.name)
        repeated = f.is_repeated
        count = rng.randint(0, 3) if repeated else 1
        if f.message_type is not None:
            if f.message_type.GetOptions().map_entry or depth > 4:
                continue
            for _ in range(count):
                sub = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
                _fill(sub, rng, depth + 1)
                if not repeated:
                    sub.SetInParent()
            continue
        for _ in range(count):
            value = _scalar(f, rng)
            if repeated:
                getattr(msg, f.name).append(value)
            else:
                setattr(msg, f.name, value)


def _scalar(f, rng):
    if f.type == f.TYPE_BOOL:
        return rng.random() < 0.5
    if f.type in (f.TYPE_STRING,):
        return rng.choice(["", "device", t.HLO_SHARDING, handling.XLA_PROGRAM, "x" * rng.randint(1, 40)])
    if f.type == f.TYPE_BYTES:
        return rng.randbytes(rng.randint(0, 24))
    if f.type == f.TYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values])
    if f.type in (f.TYPE_FLOAT, f.TYPE_DOUBLE):
        return rng.uniform(-1, 1)
    if f.type in (f.TYPE_FIXED64, f.TYPE_UINT64):
        return rng.choice(_HANDLES)
    if f.type in (f.TYPE_INT32, f.TYPE_SINT32, f.TYPE_SFIXED32):
        return rng.randint(-2, 6)
    if f.type in (f.TYPE_UINT32, f.TYPE_FIXED32):
        return rng.randint(0, 6)
    return rng.choice([-1, 0, 1, 2, 3, 5, 1 << 40])  # int64: dims, counts


def _valid_seeds():
    """Well-formed requests that reach deep into the handlers, to be mutated."""
    sharding = t.sharding_proto(t.replicated((0,)))
    seeds = []
    r = pb.IfrtRequest()
    r.make_array_from_host_buffer_request.dtype.CopyFrom(t.dtype_proto(np.float32))
    r.make_array_from_host_buffer_request.shape.CopyFrom(t.shape_proto((2,)))
    r.make_array_from_host_buffer_request.sharding.CopyFrom(sharding)
    r.make_array_from_host_buffer_request.host_buffer_handle = 5
    r.make_array_from_host_buffer_request.array_handle = 3
    seeds.append(r)
    for kind, fields in [("copy_to_host_buffer_request", {"array_handle": 3, "host_buffer_handle": 9}),
                         ("fully_replicated_shard_request", {"array_handle": 3, "result_handle": 4}),
                         ("disassemble_into_single_device_arrays_request", {"array_handle": 3}),
                         ("check_value_ready_request", {"value_handles": [3, 4]}),
                         ("delete_array_request", {"array_handle": [3]}),
                         ("destruct_array_request", {"array_handle": [4]}),
                         ("is_array_deleted_request", {"array_handle": 3}),
                         ("get_default_layout_request", {"dims": [2, 3], "device_id": 1}),
                         ("get_default_device_assignment_request", {"num_replicas": 1, "num_partitions": 2}),
                         ("copy_arrays_request", {"array_handles": [3], "device_ids": [2]}),
                         ("check_future_request", {"future_handle": 1 << 48})]:
        r = pb.IfrtRequest()
        body = getattr(r, kind)
        for name, value in fields.items():
            if isinstance(value, list):
                getattr(body, name).extend(value)
            else:
                setattr(body, name, value)
        body.SetInParent()
        seeds.append(r)
    return seeds


def _generate(rng, seeds):
    """A request: a mutated seed, or every field random; None for garbage bytes."""
    roll = rng.random()
    if roll < 0.45:
        r = pb.IfrtRequest()
        r.CopyFrom(rng.choice(seeds))
        body = getattr(r, r.WhichOneof("request"))
        _fill(body, rng, 2)
    elif roll < 0.95:
        r = pb.IfrtRequest()
        kind = rng.choice(pb.IfrtRequest.DESCRIPTOR.oneofs_by_name["request"].fields)
        _fill(getattr(r, kind.name), rng, 1)
        getattr(r, kind.name).SetInParent()
    else:
        raw = bytearray(rng.choice(seeds).SerializeToString())
        for _ in range(rng.randint(1, 4)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            return pb.IfrtRequest.FromString(bytes(raw))
        except Exception:
            return None
    return r


@pytest.fixture(scope="module")
def server():
    cluster = LocalCluster([Island(2, 1), Island(1, 2)]).start()
    ifrt = IfrtServer(cluster.address)
    try:
        ifrt.start()
        yield ifrt
    finally:
        ifrt.stop()
        cluster.stop()


def _open(channel, rng):
    stream = RawStream(channel, session_metadata())
    session_id = stream.init()
    # a host buffer the seeds' make_array request uses (5), stored through the side channel
    store = channel.stream_unary(f"/{ifrt_server.SERVICE}/HostBufferStore")
    meta = gpb.GrpcHostBufferStoreMetadata(session_id=session_id, handle=5, buffer_size=8)
    store(iter([gpb.GrpcHostBufferStoreRequest(data=b"\0" * 8).SerializeToString()]),
          metadata=((ifrt_server.STORE_METADATA, meta.SerializeToString()),), timeout=30)
    return stream


def test_fuzzed_requests_get_answers_and_the_server_survives(server, monkeypatch):
    # Waits that would be long with a real client are short here, so that thousands of
    # requests naming handles that never come finish quickly (each still waits, bounded).
    monkeypatch.setattr(handling, "WAIT_SECONDS", 0.5)
    monkeypatch.setattr(handling, "HOST_BUFFER_WAIT", 0.05)
    monkeypatch.setattr(ifrt_server, "HOST_BUFFER_WAIT", 0.05)
    rng = random.Random(14)
    seeds = _valid_seeds()
    channel = grpc.insecure_channel(server.address)
    sent = answered = closed = garbage = 0
    kinds = set()
    try:
        while sent < REQUESTS:
            stream = _open(channel, rng)
            op_ids = []
            for _ in range(PER_SESSION):
                request = _generate(rng, seeds)
                sent += 1
                if request is None:  # garbage: the server closes this session
                    garbage += 1
                    stream.send(rng.randbytes(rng.randint(1, 64)) + b"\xff\xff\xff")
                    break
                op_id = 1000 + sent
                if rng.random() < 0.03:
                    request.ClearField("request_metadata")  # bad metadata: no op_id at all
                else:
                    request.request_metadata.op_id = op_id
                    op_ids.append(op_id)
                kinds.add(request.WhichOneof("request"))
                stream.send(request.SerializeToString())
            stream.wait(op_ids)
            answered += sum(o in stream.answered for o in op_ids)
            if stream.ended.is_set() and not all(o in stream.answered for o in op_ids):
                closed += 1
            for o in op_ids:
                if o in stream.answered:
                    response = stream.answered[o]
                    # an answer is a status or the response of the request's own kind
                    assert response.response_metadata.status.code or response.WhichOneof("response")
            stream.close()
        # bad session metadata: the stream is refused with a status, the server goes on
        for metadata in ((), ((ifrt_server.SESSION_METADATA, b"\xff\xfe garbage"),), session_metadata(version=3)):
            stream = RawStream(channel, metadata)
            stream.send(b"")
            assert stream.ended.wait(30) and stream.error is not None
            assert stream.error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            stream.close()
    finally:
        channel.close()
    print(f"sent {sent}, answered {answered}, sessions closed early {closed}, garbage {garbage}")
    assert sent >= REQUESTS and answered > REQUESTS // 2, (sent, answered, closed, garbage)
    assert len(kinds) >= 30 and garbage > 0, (sorted(kinds), garbage)
    monkeypatch.undo()
    result = run_jax(server.address, """
        import json
        import numpy as np
        x = jax.device_put(np.arange(4, dtype=np.float32))
        y = jax.jit(lambda a: a + 1)(x)
        print("RESULT", json.dumps({"y": np.asarray(y).tolist()}))
    """)
    assert result["y"] == [1.0, 2.0, 3.0, 4.0]
