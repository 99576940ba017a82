"""Strided host buffers (IFRT ``byte_strides``: transposes, steps, stride 0) through the
front end of a controller that serves IFRT in its own process: the array is laid out in C
order a chunk at a time as it is sent to the workers, so a request of a few bytes that
stands for a gigabyte does not make the controller hold a gigabyte; the array's full size
counts against the session's bound of host buffers; the values the workers hold are
numpy's view of the buffer, bit for bit, on one device, split over one host's devices and
over two hosts. Requests spoken by hand on real gRPC (JAX's own client refuses stride 0),
plus one unmodified JAX program putting strided numpy views."""


import numpy as np
import pytest

from ifrt_helpers import Proxy, run_jax, tiled
from pathways.cluster import Island, LocalCluster
from pathways.ifrt import types as t
from pathways.ifrt.host_buffers import DEFAULT_LIMIT
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
