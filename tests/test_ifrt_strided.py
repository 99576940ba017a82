"""Strided host buffers (IFRT ``byte_strides``: transposes, steps, stride 0) through the
front end of a controller that serves IFRT in its own process: the array is laid out in C
order a chunk at a time as it is sent to the workers, so a request of a few bytes that
stands for a gigabyte does not make the controller hold a gigabyte; the array's full size
counts against the session's bound of host buffers; the values the workers hold are
numpy's view of the buffer, bit for bit, on one device, split over one host's devices and
over two hosts. Requests spoken by hand on real gRPC (JAX's own client refuses stride 0),
plus one unmodified JAX program putting strided numpy views."""

import itertools

import grpc
import numpy as np
import pytest

from ifrt_helpers import RawStream, run_jax, session_metadata
from pathways.cluster import Island, LocalCluster
from pathways.ifrt import server as ifrt_server
from pathways.ifrt import types as t
from pathways.ifrt.host_buffers import DEFAULT_LIMIT
from pathways.ifrt.proto.xla import xla_data_pb2
from pathways.ifrt.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb
from pathways.ifrt.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.wire.codec import CHUNK_BYTES

_MIB = 1 << 20
_GIB = 1 << 30


@pytest.fixture(scope="module")
def cluster():
    """One island of 2 hosts x 2 devices (devices 0, 1 on the first host, 2, 3 on the
    second) whose controller serves IFRT, as `pathways up --ifrt-port` does."""
    c = LocalCluster([Island(2, 2)], ifrt_port=0).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def proxy(cluster):
    p = Proxy(cluster.ifrt_address.removeprefix("grpc://"))
    try:
        yield p
    finally:
        p.close()


def tiled(devices, tiles):
    """A sharding over ``devices`` splitting dimension k of an array into ``tiles[k]`` blocks."""
    op = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=list(tiles),
                                 tile_assignment_devices=list(range(len(devices))))
    return t.Sharding(tuple(devices), op.SerializeToString())


class Proxy:
    """One IFRT session spoken by hand: host buffers stored, arrays made of them, read back."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * _MIB)])
        self.stream = RawStream(self.channel, session_metadata())
        self.session_id = self.stream.init()
        self.ops = itertools.count(2)
        self.handles = itertools.count(100)

    def close(self):
        self.stream.close()
        self.channel.close()

    def request(self, fill):
        """Send the request ``fill`` writes into an IfrtRequest; its response, waited for."""
        r = pb.IfrtRequest()
        r.request_metadata.op_id = op = next(self.ops)
        fill(r)
        self.stream.send(r.SerializeToString())
        self.stream.wait([op], timeout=180)
        assert op in self.stream.answered, f"no answer to op {op}: {self.stream.error}"
        return self.stream.answered[op]

    def store(self, data):
        """A new host buffer holding ``data``; its handle."""
        handle = next(self.handles)
        meta = gpb.GrpcHostBufferStoreMetadata(session_id=self.session_id, handle=handle, buffer_size=len(data))
        store = self.channel.stream_unary(f"/{ifrt_server.SERVICE}/HostBufferStore")
        store(iter([gpb.GrpcHostBufferStoreRequest(data=bytes(data)).SerializeToString()]),
              metadata=((ifrt_server.STORE_METADATA, meta.SerializeToString()),), timeout=60)
        return handle

    def make(self, data, strides, dtype, shape, sharding):
        """An array of ``shape`` made from a host buffer of ``data`` with ``strides`` (None:
        C order), laid out by ``sharding``, and ready: its handle; the status of the first
        request that failed instead."""
        buffer, array = self.store(data), next(self.handles)

        def fill(r):
            body = r.make_array_from_host_buffer_request
            body.dtype.CopyFrom(t.dtype_proto(np.dtype(dtype)))
            body.shape.CopyFrom(t.shape_proto(shape))
            body.sharding.CopyFrom(t.sharding_proto(sharding))
            if strides is not None:
                body.byte_strides.strides.extend(strides)
            body.host_buffer_handle, body.array_handle = buffer, array
        return self._ready(self.request(fill), array)

    def make_from_shards(self, shards, dtype, shape, sharding):
        """An array of ``shape`` made from one host buffer per shard: ``shards[i]`` is shard
        i's (data, its strides, its shape); ready: its handle, or the failed status."""
        buffers, array = [self.store(data) for data, _, _ in shards], next(self.handles)

        def fill(r):
            spec = r.make_arrays_from_host_buffer_shards_request.specs.add()
            spec.array_spec.dtype.CopyFrom(t.dtype_proto(np.dtype(dtype)))
            spec.array_spec.shape.CopyFrom(t.shape_proto(shape))
            spec.array_spec.sharding.CopyFrom(t.sharding_proto(sharding))
            for i, (buffer, (_, strides, shard_shape)) in enumerate(zip(buffers, shards)):
                spec.addressable_shard_indices.add(indices=[i])
                hb = spec.host_buffers.add(host_buffer_handle=buffer)
                hb.dtype.CopyFrom(t.dtype_proto(np.dtype(dtype)))
                hb.shape.CopyFrom(t.shape_proto(shard_shape))
                if strides is not None:
                    hb.byte_strides.strides.extend(strides)
            r.make_arrays_from_host_buffer_shards_request.array_handles.append(array)
        return self._ready(self.request(fill), array)

    def _ready(self, answer, array):
        if answer.response_metadata.status.code:
            return answer.response_metadata.status
        ready = self.request(lambda r: r.check_value_ready_request.value_handles.append(array))
        return ready.response_metadata.status if ready.response_metadata.status.code else array

    def chunks(self, array):
        """The array's bytes in C order, as the lookup of its host buffer brings them."""
        buffer = next(self.handles)

        def fill(r):
            r.copy_to_host_buffer_request.array_handle = array
            r.copy_to_host_buffer_request.host_buffer_handle = buffer
        status = self.request(fill).response_metadata.status
        assert status.code == 0, status.message
        lookup = self.channel.unary_stream(f"/{ifrt_server.SERVICE}/HostBufferLookup")
        request = gpb.GrpcHostBufferLookupRequest(session_id=self.session_id, handle=buffer)
        for raw in lookup(request.SerializeToString(), timeout=180):
            yield gpb.GrpcHostBufferLookupResponse.FromString(raw).data

    def read(self, array, dtype, shape):
        return np.frombuffer(b"".join(self.chunks(array)), dtype).reshape(shape)


@pytest.mark.parametrize("view", [
    np.arange(6 * 40, dtype=np.int32).reshape(6, 40).T,
    np.broadcast_to(np.arange(3, dtype=np.float32), (50, 7, 3)),
    np.arange(2 * 81, dtype=np.int16).reshape(2, 81)[:, ::2],
    np.arange(8 * 9 * 10, dtype=np.int8).reshape(8, 9, 10).transpose(1, 2, 0)[:, ::3],
    np.broadcast_to(np.float64(2.5), (5, 0, 3)),
    np.arange(5, dtype=np.float32)[::2][1:2].reshape(()),
], ids=["transposed", "stride 0", "rows wider than a chunk", "3-d permuted", "empty", "0-d"])
def test_strided_views_are_chunked_in_c_order_a_chunk_at_a_time(monkeypatch, view):
    """codec.array_chunks of a view that is not C-contiguous: numpy's C-order bytes, in
    chunks of at most CHUNK_BYTES holding whole elements (pure)."""
    from pathways.wire import codec
    monkeypatch.setattr(codec, "CHUNK_BYTES", 64)
    chunks = list(codec.array_chunks(view))
    assert b"".join(chunks) == np.ascontiguousarray(view).tobytes()
    assert all(0 < len(c) <= 64 and len(c) % view.itemsize == 0 for c in chunks), [len(c) for c in chunks]


def _rss(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def test_a_gigabyte_from_four_bytes_with_stride_0_is_streamed_and_the_controller_holds_little(cluster, proxy):
    """A float32 array of 1 GiB made from one 4-byte host buffer with byte strides 0, on one
    device; another split over the 4 devices of both hosts; a third from 4 such buffers,
    one per device's shard: the controller's peak memory grows by far less than any of
    them (each worker's blocks are laid out a chunk at a time as they are sent), and every
    byte the worker holds is the buffer's value."""
    controller = cluster.pids[0]
    value = np.float32(1.5)
    n = _GIB // 4
    with open(f"/proc/{controller}/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from what the controller holds now
    before = _rss(controller, "VmRSS")
    one = proxy.make(value.tobytes(), [0], np.float32, (n,), t.replicated((1,)))
    split = proxy.make(value.tobytes(), [0, 0], np.float32, (1 << 14, 1 << 14), tiled((0, 1, 2, 3), (2, 2)))
    shards = proxy.make_from_shards([(value.tobytes(), [0, 0], (1 << 13, 1 << 13))] * 4, np.float32,
                                    (1 << 14, 1 << 14), tiled((0, 1, 2, 3), (2, 2)))
    grown = _rss(controller, "VmHWM") - before
    assert all(isinstance(a, int) for a in (one, split, shards)), (one, split, shards)
    assert grown < 256 * _MIB, f"the controller's peak grew by {grown >> 20} MiB for three 1 GiB arrays of 4 bytes"

    pattern, got = value.tobytes(), 0
    for chunk in proxy.chunks(one):  # checked as it comes: never a gigabyte in this process
        rest = got % 4
        expected = (pattern * (len(chunk) // 4 + 2))[rest:rest + len(chunk)]
        assert chunk == expected, f"bytes {got}..{got + len(chunk)} differ"
        got += len(chunk)
    assert got == _GIB


@pytest.mark.parametrize("case", ["transposed", "stride 0 on rows", "stride 0 on columns", "every other",
                                  "all stride 0", "3-d permuted"])
@pytest.mark.parametrize("placement", ["one device", "split on one host", "split over hosts", "replicated"])
def test_small_strided_buffers_hold_numpys_view_bit_for_bit(proxy, case, placement):
    base = np.random.default_rng(0).standard_normal(96).astype(np.float32)
    view = {
        "transposed": base.reshape(8, 12).T,
        "stride 0 on rows": np.broadcast_to(base[:12], (8, 12)),
        "stride 0 on columns": np.broadcast_to(base[:8, None], (8, 12)),
        "every other": base.reshape(8, 12)[:, 1::2],
        "all stride 0": np.broadcast_to(base[3:4], (8, 12)),
        "3-d permuted": base.reshape(2, 6, 8).transpose(2, 0, 1),
    }[case]
    sharding = {"one device": t.replicated((3,)),
                "split on one host": tiled((0, 1), (2,) + (1,) * (view.ndim - 1)),
                "split over hosts": tiled((0, 2), (1, 2) + (1,) * (view.ndim - 2)),
                "replicated": t.replicated((0, 1, 2, 3))}[placement]
    array = proxy.make(*host_buffer(view, base), np.float32, view.shape, sharding)
    assert isinstance(array, int), array
    assert proxy.read(array, np.float32, view.shape).tobytes() == np.ascontiguousarray(view).tobytes()


def host_buffer(view, base):
    """The host buffer and byte strides IFRT sends for numpy's ``view`` of the contiguous
    array ``base`` (strides not negative): the bytes from its first element to its last."""
    start = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    span = sum((d - 1) * s for d, s in zip(view.shape, view.strides)) + view.itemsize
    assert 0 <= start and start + span <= base.nbytes
    return base.reshape(-1).view(np.uint8)[start:start + span].tobytes(), list(view.strides)


def test_arrays_larger_than_a_chunk_split_over_hosts_from_strided_buffers_and_shards(proxy):
    """Strided arrays of several chunks, with rows wider than a chunk (cut one dimension
    down) and narrower (several to a chunk), from one buffer and from one strided buffer
    per shard, split over both hosts or replicated on them (each host then gets the whole
    array): they read back exactly, whatever chunk boundaries cut them."""
    base = np.random.default_rng(1).integers(0, 1 << 30, size=CHUNK_BYTES + 64, dtype=np.int32)
    k = CHUNK_BYTES // 4 + 3
    wide = base[:4 * k].reshape(2, -1)[:, ::2]  # 2 rows of a chunk and 12 bytes, every other element
    narrow = base[:4096 * 768].reshape(768, 4096).T  # transposed: rows of 3 KiB
    for view, sharding in ((wide, tiled((0, 2), (2, 1))), (wide, t.replicated((0, 2))),
                           (narrow, tiled((0, 2), (2, 1))), (narrow, tiled((0, 1, 2, 3), (2, 2)))):
        array = proxy.make(*host_buffer(view, base), np.int32, view.shape, sharding)
        assert isinstance(array, int), array
        assert np.array_equal(proxy.read(array, np.int32, view.shape), view)

    # each device's shard from a buffer of its own: blocks of a transposed matrix
    full = base[:1024 * 2048].reshape(2048, 1024).T
    shards = [(*host_buffer(block, base), block.shape) for block in
              (full[i * 512:(i + 1) * 512, j * 1024:(j + 1) * 1024] for i in range(2) for j in range(2))]
    array = proxy.make_from_shards(shards, np.int32, full.shape, tiled((0, 1, 2, 3), (2, 2)))
    assert isinstance(array, int), array
    assert np.array_equal(proxy.read(array, np.int32, full.shape), full)


def test_shards_of_stride_0_split_over_hosts_hold_their_own_values(proxy):
    """Four shards, each one value repeated (a 4-byte buffer, strides 0): each device holds
    its own, and the array reads back as the four blocks."""
    values = np.array([1, 2, 3, 4], np.float32)
    shards = [(v.tobytes(), [0, 0], (4, 6)) for v in values]
    array = proxy.make_from_shards(shards, np.float32, (8, 12), tiled((0, 1, 2, 3), (2, 2)))
    assert isinstance(array, int), array
    expected = np.repeat(np.repeat(values.reshape(2, 2), 4, axis=0), 6, axis=1)
    assert np.array_equal(proxy.read(array, np.float32, (8, 12)), expected)


def test_an_array_over_the_sessions_bound_is_refused_naming_its_size_and_the_next_one_is_made(cluster, proxy):
    """4 bytes with strides 0 standing for 16 GiB, beyond the session's bound of host
    buffers: refused at once with RESOURCE_EXHAUSTED naming both sizes, the controller
    holding nothing of it; the same session then makes an honest array, from one buffer
    and from shards."""
    size = 16 * _GIB
    assert size > DEFAULT_LIMIT
    controller = cluster.pids[0]
    with open(f"/proc/{controller}/clear_refs", "w") as f:
        f.write("5")
    before = _rss(controller, "VmRSS")
    for refused in (proxy.make(b"\0" * 4, [0], np.float32, (size // 4,), t.replicated((0,))),
                    proxy.make_from_shards([(b"\0" * 4, [0], (size // 8,))] * 2, np.float32, (size // 4,),
                                           tiled((0, 2), (2,)))):
        assert refused.code == t.RESOURCE_EXHAUSTED, refused
        assert f"is {size} bytes" in refused.message and f"bound of {DEFAULT_LIMIT} bytes" in refused.message, \
            refused.message
    assert _rss(controller, "VmHWM") - before < 64 * _MIB

    honest = np.arange(24, dtype=np.float32).reshape(4, 6)
    array = proxy.make(*host_buffer(honest.T, honest), np.float32, (6, 4), tiled((0, 2), (2, 1)))
    assert isinstance(array, int), array
    assert np.array_equal(proxy.read(array, np.float32, (6, 4)), honest.T)


def test_jax_puts_strided_numpy_views_that_read_back_exactly(cluster):
    """An unmodified JAX program putting strided numpy views (JAX sends their byte strides,
    per shard for a sharded put) gets them back bit for bit."""
    result = run_jax(cluster.ifrt_address.removeprefix("grpc://"), """
        import json
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        devices = jax.devices()
        base = np.random.default_rng(2).standard_normal((64, 96)).astype(np.float32)
        views = {"transposed": base.T, "every other column": base[:, ::2], "steps": base[::2, 1::2]}
        mesh = Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
        same = {}
        for name, view in views.items():
            for where, target in (("device", devices[3]), ("split", NamedSharding(mesh, PartitionSpec("a", "b"))),
                                  ("rows over hosts", NamedSharding(mesh, PartitionSpec(("a", "b"))))):
                back = np.asarray(jax.device_put(view, target))
                same[f"{name} on {where}"] = back.tobytes() == np.ascontiguousarray(view).tobytes()
        print("RESULT", json.dumps(same))
    """)
    assert len(result) == 9 and all(result.values()), result
