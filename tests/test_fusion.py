"""Program-level fusion: the grouping over the program graph (pure), and on a real local
cluster, fused programs computing what unfused ones do with fewer nodes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from pathways.controller.lowering import FnLayouts, lower
from pathways.fusion import Group, fused, groups
from pathways.ir import Layout, Node, ProgramGraph
from pathways.protocol.ops import Op
from tests.conftest import connected, running_cluster

# ---- the grouping, pure -------------------------------------------------------------

# Function -> fusion key: 1, 2 and 4 run on slice A's mesh, 3 on slice B, 5 on another mesh of slice A.
KEYS = {1: "A", 2: "A", 3: "B", 4: "A", 5: "A'"}


def graph(inputs, nodes, outputs):
    nvalues = 1 + max(v for _, ins, outs in nodes for v in (*ins, *outs))
    return ProgramGraph(nvalues, tuple(inputs), tuple(Node(f, tuple(i), tuple(o)) for f, i, o in nodes),
                        tuple(outputs), (("float32", ()),) * nvalues)


def test_a_chain_on_one_slice_is_one_group():
    g = graph([0], [(1, [0], [1]), (2, [1], [2]), (4, [2], [3])], [3])
    assert groups(g, KEYS) == [Group((0, 1, 2), (0,), (3,))]
    assert fused(g, groups(g, KEYS), [99]).nodes == (Node(99, (0,), (3,)),)


def test_a_diamond_on_one_slice_is_one_group():
    # 1 is read by two nodes of the group; 4 reads both branches.
    g = graph([0], [(1, [0], [1]), (2, [1], [2]), (2, [1], [3]), (4, [2, 3], [4])], [4])
    assert groups(g, KEYS) == [Group((0, 1, 2, 3), (0,), (4,))]


def test_a_value_read_by_two_groups_is_not_fused_across():
    # Value 1 is read on slice A and on slice B: it must exist, so nothing fuses across it.
    g = graph([0], [(1, [0], [1]), (2, [1], [2]), (3, [1], [3])], [2, 3])
    assert [grp.nodes for grp in groups(g, KEYS)] == [(0,), (1,), (2,)]
    assert fused(g, groups(g, KEYS), [90, 91, 92]) == g, "groups of one node keep their nodes"


def test_a_program_output_in_the_middle_ends_a_group():
    g = graph([0], [(1, [0], [1]), (2, [1], [2]), (4, [2], [3])], [2, 3])
    assert groups(g, KEYS) == [Group((0, 1), (0,), (2,)), Group((2,), (2,), (3,))]
    assert fused(g, groups(g, KEYS), [99, 4]).nodes == (Node(99, (0,), (2,)), Node(4, (2,), (3,)))


def test_another_mesh_of_the_same_slice_is_not_fused():
    g = graph([0], [(1, [0], [1]), (5, [1], [2])], [2])
    assert [grp.nodes for grp in groups(g, KEYS)] == [(0,), (1,)]


def test_interleaved_slices_fuse_per_slice_and_lower_to_one_exec_per_worker():
    # A: 0 -> 1 -> 3; B: 0 -> 2 -> 4, traced alternately.
    g = graph([0], [(1, [0], [1]), (3, [0], [2]), (2, [1], [3]), (3, [2], [4])], [3, 4])
    grouped = groups(g, KEYS)
    assert grouped == [Group((0, 2), (0,), (3,)), Group((1, 3), (0,), (4,))]
    out = fused(g, grouped, [10, 30])
    assert out.nodes == (Node(10, (0,), (3,)), Node(30, (0,), (4,)))
    assert ProgramGraph.from_wire(out.to_wire()) == out, "a fused graph crosses the wire"

    def on(worker):
        return Layout((worker,), ((0, 0),), (1,), ("d",), ())

    fns = {10: FnLayouts((0,), (on(0),), (on(0),)), 30: FnLayouts((1,), (on(1),), (on(1),))}
    lowered = lower(out, fns, {0: on(0)})
    execs = {w: [op[1] for op in ops if op[0] is Op.EXEC] for w, ops in lowered.ops.items()}
    assert execs == {0: [10], 1: [30]}
    assert lowered.transfers, "slice B's input still crosses from worker 0"


def test_a_path_through_another_slice_keeps_nodes_apart():
    # Node 0 (A) makes 1 for node 2 (A) and 2 for node 1 (B), whose 3 node 2 also reads:
    # fusing 0 and 2 would wait for itself.
    g = graph([0], [(1, [0], [1, 2]), (3, [2], [3]), (2, [1, 3], [4])], [4])
    assert [grp.nodes for grp in groups(g, KEYS)] == [(0,), (1,), (2,)]


def test_a_group_reading_another_slice_is_placed_after_it():
    # B's node 1 feeds node 3 of A's chain 0 -> 2 -> 3: the fused A node comes after B's.
    g = graph([0], [(1, [0], [1]), (3, [0], [2]), (2, [1], [3]), (4, [3, 2], [4])], [4])
    grouped = groups(g, KEYS)
    assert grouped == [Group((0, 2, 3), (0, 2), (4,)), Group((1,), (0,), (2,))]
    assert fused(g, grouped, [10, 3]).nodes == (Node(3, (0,), (2,)), Node(10, (0, 2), (4,)))


def test_a_second_output_read_elsewhere_leaves_the_group():
    # Node 0 makes 1 (read by node 1 on A) and 2 (read on B): 2 becomes an output of the group.
    g = graph([0], [(1, [0], [1, 2]), (2, [1], [3]), (3, [2], [4])], [3, 4])
    assert groups(g, KEYS) == [Group((0, 1), (0,), (2, 3)), Group((2,), (2,), (4,))]


def test_a_value_read_twice_by_one_node_is_one_input():
    g = graph([0], [(1, [0, 0], [1]), (2, [1, 1], [2])], [2])
    assert groups(g, KEYS) == [Group((0, 1), (0,), (2,))]


def test_fused_wants_one_function_per_group():
    g = graph([0], [(1, [0], [1]), (2, [1], [2])], [2])
    with pytest.raises(ValueError, match="one function per group"):
        fused(g, groups(g, KEYS), [])


# ---- on a real cluster --------------------------------------------------------------


@pytest.fixture(scope="module")
def islands():
    """Island 0: two hosts of one device each (collectives cross processes); island 1: one
    host of two devices."""
    yield from running_cluster(pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=1, devices_per_host=2))


@pytest.fixture
def client(islands):
    yield from connected(islands)


def program_nodes(address):
    """How many nodes the controller holds over the programs of this client's session."""
    me = pw.default_session().id
    return next(s["nodes"] for s in status(address)["sessions"] if s["session"] == me)


def both(fun):
    return pw.program(fun), pw.program(fun, fuse=True)


def test_a_fused_chain_computes_the_same_bits_with_one_node(islands, client):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=1)
    mesh = s.mesh("d")
    scale = pw.jit(lambda x: x * 1.37 + 0.11, mesh=mesh, in_shardings=jax.P("d"), out_shardings=jax.P("d"))
    wave = pw.jit(lambda x: jnp.sin(x) * x, mesh=mesh, in_shardings=jax.P("d"))  # output replicated
    count = pw.jit(lambda x, n: (x * 3 + n) // 2, mesh=mesh)

    def chain(x, n):
        for _ in range(4):
            x = wave(scale(x))
            n = count(n, n)
        return x, n

    x = np.linspace(-2, 2, 8, dtype=np.float32)
    n = np.arange(8, dtype=np.int32)
    scale(x), wave(x), count(n, n)  # the functions' own one-node programs exist from here on
    unfused, fused_ = both(chain)
    before = program_nodes(islands.address)
    want = [np.asarray(a) for a in unfused(x, n)]
    middle = program_nodes(islands.address)
    got = [np.asarray(a) for a in fused_(x, n)]
    after = program_nodes(islands.address)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype
        np.testing.assert_array_equal(g, w)
    assert middle - before == 12, "the unfused program has a node per call"
    assert after - middle == 2, "the fused one a node per independent chain"


def test_a_fused_collective_chain_across_hosts(islands, client):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
    assert len(s.workers) == 2
    step = pw.pmap(lambda x: jax.lax.pmean(x, "i") * 0.75 + 1.0, devices=s.devices)
    spread = pw.pmap(lambda x: x * (jax.lax.axis_index("i") + 1.5), devices=s.devices)

    def chain(x):
        for _ in range(6):
            x = spread(step(x))
        return x

    unfused, fused_ = both(chain)
    x = np.array([0.3, 1.9], np.float32)
    want = np.asarray(unfused(x))
    before = program_nodes(islands.address)
    got = np.asarray(fused_(x))
    assert program_nodes(islands.address) - before == 1
    np.testing.assert_array_equal(got, want)
    x2 = np.asarray(fused_(got))  # the traced program runs again
    np.testing.assert_array_equal(x2, np.asarray(unfused(want)))


def test_a_fused_program_across_two_islands(islands, client):
    a = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
    b = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=1)
    total = pw.pmap(lambda x: jax.lax.psum(x, "i") + 1.0, devices=a.devices)
    square = pw.jit(lambda v: v * v, mesh=b.mesh("d"))
    shift = pw.jit(lambda v: v - 0.5, mesh=b.mesh("d"))

    def across(x):
        y = total(x)  # island 0
        z = shift(square(shift(y)))  # island 1: one executable
        w = total(total(x))  # island 0 again, independent of island 1
        return total(shift(z)), w, y  # y is an output: its node stays apart

    unfused, fused_ = both(across)
    x = np.array([1.25, -3.0], np.float32)
    want = [np.asarray(v) for v in unfused(x)]
    before = program_nodes(islands.address)
    got = [np.asarray(v) for v in fused_(x)]
    # total(x) | shift, square, shift, shift | total(total(x)) | total of island 1's result
    assert program_nodes(islands.address) - before == 4
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_an_error_in_a_fused_node_names_the_original_node(islands, client):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=1)
    mesh = s.mesh("d")

    def prepare(x):
        return x + 1

    def boom(x):
        return jnp.ones((1 << 42,), jnp.float32) * x

    prepare, boom = pw.jit(prepare, mesh=mesh), pw.jit(boom, mesh=mesh)

    @pw.program(fuse=True)
    def f(x):
        return boom(prepare(x))

    # Its output is past the session's quota (or, without one, the allocation fails after
    # dispatch): either way the worker reports it where the result is read, naming the node.
    with pytest.raises((pw.RemoteError, pw.ResourceExhaustedError),
                       match=r"(RESOURCE_EXHAUSTED|[Oo]ut of memory|the output of).*fused\(prepare, boom\) in program f"):
        np.asarray(f(np.float32(1)))
    fine = pw.program(lambda x: prepare(prepare(x)), fuse=True)
    assert float(np.asarray(fine(np.float32(1)))) == 3.0, "the cluster keeps serving"


def test_fuse_must_be_a_bool():
    with pytest.raises(ValueError, match="fuse="):
        pw.program(lambda x: x, fuse="yes")
