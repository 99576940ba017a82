import numpy as np
import pytest

from pathways.errors import WireError
from pathways.ir import Layout, Node, ProgramGraph
from pathways.wire import codec

@pytest.mark.parametrize("array", [
    np.float32(3.5), np.arange(12, dtype=np.int64).reshape(3, 4), np.zeros((0, 5), np.float16),
    np.array([True, False]), np.linspace(0, 1, 5 * 1024 * 1024 // 8 + 3),  # spans two chunks
])
def test_array_round_trip(array):
    array = np.asarray(array)
    back = codec.assemble_array(codec.array_header(array), codec.array_chunks(array))
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_array_bytes_must_match_header():
    array = np.arange(4, dtype=np.float32)
    header = codec.array_header(array)
    with pytest.raises(WireError, match="header announced"):
        codec.assemble_array(header, [array.tobytes()[:-1]])
    with pytest.raises(WireError, match="exceeds"):
        codec.assemble_array(header, [array.tobytes() + b"x"])
    with pytest.raises(WireError, match="not allowed"):
        codec.assemble_array({**header, "dtype": "object"}, [])
    with pytest.raises(WireError, match="needs"):
        codec.assemble_array({**header, "nbytes": 3}, [])


def test_a_reused_packer_packs_what_pack_does_before_and_after_a_large_object():
    for obj in ([1, "small", b"\x00"], [b"x" * (codec._KEPT_PACKER_BYTES + 1)], {"after": [2.5, None]}):
        assert codec.pack_each(obj) == codec.pack(obj)
    with pytest.raises(TypeError):
        codec.pack_each([object()])
    assert codec.pack_each([3]) == codec.pack([3]), "a failed pack leaves nothing behind"


def test_a_large_payload_of_small_values_is_refused_past_the_bound_and_one_of_bytes_is_not():
    """Decoding holds the GIL: a payload of more than MAX_DECODED_VALUES bytes is decoded
    counting the entries of its lists and maps, nested ones included, and refused past the
    bound; a large payload of few values (a function's blob) decodes whole."""
    n = codec.MAX_DECODED_VALUES
    nested = codec.pack([[0, [0]]] * (n // 3))  # 4 values each
    assert len(nested) > n
    with pytest.raises(WireError, match=f"holds more than {n} values in its lists and maps"):
        codec.unpack(nested)
    maps = codec.pack([{"k": i} for i in range(n // 2 + 1)])
    with pytest.raises(WireError, match=f"more than {n} values"):
        codec.unpack(maps)
    blob = codec.pack(["define", {"blob": bytes(3 * n)}, list(range(1000))])
    assert codec.unpack(blob) == ["define", {"blob": bytes(3 * n)}, list(range(1000))]
    under = [[i] for i in range(n // 3)]  # about 2n/3 values, in more than n bytes
    assert len(codec.pack(under)) > n and codec.unpack(codec.pack(under)) == under


def test_layout_and_graph_wire_forms():
    layout = Layout((1, 2), ((0, 0), (0, 1), (1, 0), (1, 1)), (2, 2), ("x", "y"), (("x", "y"), None))
    assert Layout.from_wire(codec.unpack(codec.pack(layout.to_wire()))) == layout
    graph = ProgramGraph(3, (0,), (Node(7, (0,), (1,)), Node(7, (1,), (2,))), (2,),
                         (("float32", (2, 3)), ("bfloat16", ()), ("int8", (0,))))
    assert ProgramGraph.from_wire(codec.unpack(codec.pack(graph.to_wire()))) == graph


@pytest.mark.parametrize("raw, needle", [
    ([[0], [0, 0, 0, 1], [3], ["x"], []], "does not fit"),
    ([[0], [0, 0], [1], ["x"], ["z"]], "names no axis"),
    ([[0], [0, 0, 0], [1], ["x"], []], "pairs"),
    ([[0], [0, 0, 0, 0], [2], ["x"], []], "distinct"),
    ([[], [0, 0], [1], ["x"], []], "non-empty"),
    ("layout", "must be a list"),
])
def test_bad_layouts(raw, needle):
    with pytest.raises(WireError, match=needle):
        Layout.from_wire(raw)


_TYPES = [["float32", [2]], ["float32", [2]]]


@pytest.mark.parametrize("graph, needle", [
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [1], [0]]], "outputs": [0], "types": _TYPES},
     "before any node defines"),
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [0]]], "outputs": [0], "types": _TYPES}, "defined twice"),
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [5]]], "outputs": [0], "types": _TYPES}, "outside"),
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [1]]], "outputs": [3], "types": _TYPES}, "never defined"),
    ({"nvalues": 2, "inputs": [0], "nodes": [], "outputs": []}, "non-empty"),
    ({"nvalues": -1}, "positive"),
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [1]]], "outputs": [1]}, "types"),
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [1]]], "outputs": [1],
      "types": [["object", []], ["int8", []]]}, "allowed dtype"),
    ({"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [1]]], "outputs": [1],
      "types": [["int8", [-1]], ["int8", []]]}, "negative"),
])
def test_bad_graphs(graph, needle):
    with pytest.raises(WireError, match=needle):
        ProgramGraph.from_wire(graph)


def test_pieces_round_trip_and_assemble_from_several_senders():
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    top = [(((0, 2), (0, 6)), full[:2])]
    bottom = [(((2, 4), (0, 3)), full[2:, :3]), (((2, 4), (3, 6)), full[2:, 3:])]
    assembly = None
    for pieces in (top, bottom):
        header = codec.unpack(codec.pack(codec.pieces_header(full.dtype, full.shape, pieces)))
        chunks = iter(list(codec.pieces_chunks(pieces)))
        dtype, shape, got = codec.read_pieces(header, chunks)
        codec.expect_end(chunks)
        assembly = assembly or codec.Assembly(dtype, shape)
        assembly.add(got)
    np.testing.assert_array_equal(assembly.result(), full)


def test_an_assembly_of_some_regions_takes_only_what_covers_them():
    full = np.arange(32, dtype=np.int32).reshape(8, 4)
    wanted = [((0, 4), (0, 4)), ((4, 8), (0, 4))]
    assembly = codec.Assembly(full.dtype, full.shape, wanted)
    assembly.add([(((0, 2), (0, 4)), full[:2])])
    assert not assembly.complete
    assembly.add([(((2, 6), (0, 4)), full[2:6]), (((0, 2), (0, 4)), full[:2])])  # a replica is ignored
    assembly.add([(((6, 8), (0, 4)), full[6:])])
    assert assembly.complete
    np.testing.assert_array_equal(assembly.region(wanted[0]), full[:4])
    np.testing.assert_array_equal(assembly.region(wanted[1]), full[4:])
    pieces = [(((0, 4), (0, 4)), full[:4])]
    np.testing.assert_array_equal(codec.cut(pieces, ((1, 3), (2, 4))), full[1:3, 2:])
    with pytest.raises(WireError, match="no piece"):
        codec.cut(pieces, ((3, 5), (0, 4)))


def test_missing_or_misplaced_pieces_are_errors():
    full = np.zeros((4,), np.int32)
    assembly = codec.Assembly(full.dtype, full.shape)
    assembly.add([(((0, 2),), full[:2])])
    with pytest.raises(WireError, match="do not cover"):
        assembly.result()
    header = codec.pieces_header(full.dtype, full.shape, [(((2, 6),), full[:4])])
    with pytest.raises(WireError, match="does not fit"):
        codec.read_pieces(header, iter(codec.pieces_chunks([(((2, 6),), full[:4])])))
    header = codec.pieces_header(full.dtype, full.shape, [(((0, 3),), full[:2])])
    with pytest.raises(WireError, match="does not match its index"):
        codec.read_pieces(header, iter(codec.pieces_chunks([(((0, 3),), full[:2])])))


def test_a_large_receive_buffer_is_used_again_only_once_nothing_uses_it():
    recycler = codec._Recycler()

    def take(n):
        return recycler.take(n, lambda raw: raw[:n - 64].view(np.float32), "a test array")

    n = 2 << 20
    first = take(n)
    address = first.ctypes.data
    assert take(n).ctypes.data != address, "a buffer in use is not handed out again"
    held = [first[5:9], memoryview(first), first.reshape(2, -1).T]
    del first
    while held:
        assert take(n).ctypes.data != address, "a view or an export of the buffer still uses it"
        held.pop()
    again = take(n)
    assert again.ctypes.data == address, "a buffer nothing uses any more is used again"
    assert take(n + 4096).ctypes.data != address, "only for the same size"
    small = take(codec._Recycler.MIN_BYTES - 128)
    big = take(codec._Recycler.MAX_BYTES + 4096)
    del small, big
    assert len(recycler._buffers) <= codec._Recycler.KEEP
    assert all(codec._Recycler.MIN_BYTES <= b.nbytes <= codec._Recycler.MAX_BYTES for b in recycler._buffers)
