import pytest

from pathways.controller.lowering import FnLayouts, lower
from pathways.errors import WireError
from pathways.ir import Layout, Node
from pathways.ir import ProgramGraph as _ProgramGraph
from pathways.protocol.ops import Op


def ProgramGraph(nvalues, inputs, nodes, outputs, shape=(4,)):
    """A graph whose every value is a float32 array of ``shape``."""
    return _ProgramGraph(nvalues, inputs, nodes, outputs, (("float32", shape),) * nvalues)


def layout(worker, devices=(0,), spec=()):
    return Layout((worker,), tuple((0, d) for d in devices), (len(devices),), ("d",), spec)


def fn(worker, n_in=1, n_out=1, devices=(0,), spec=()):
    return FnLayouts((worker,), (layout(worker, devices, spec),) * n_in, (layout(worker, devices, spec),) * n_out)


def two_hosts(spec=("d",)):
    """A slice over workers 5 and 6 of one island, one device each."""
    return Layout((5, 6), ((0, 0), (1, 0)), (2,), ("d",), spec)


def test_a_chain_on_one_worker_is_loads_execs_and_one_output():
    graph = ProgramGraph(4, (0,), tuple(Node(10, (i,), (i + 1,)) for i in range(3)), (3,))
    low = lower(graph, {10: fn(0)}, {0: layout(0)})
    assert low.ncopies == 0 and list(low.ops) == [0]
    kinds = [op[0] for op in low.ops[0]]
    assert kinds == [Op.IN, Op.EXEC, Op.DROP, Op.EXEC, Op.DROP, Op.EXEC, Op.DROP, Op.OUT, Op.DROP]
    assert low.ops[0][0] == [Op.IN, 0, []]  # an input: kept in the store, from no sender
    assert low.output_layouts == {3: layout(0)}


def test_values_crossing_workers_are_sent_once_per_destination_layout():
    # x = a(v) on worker 0; y = b(x) and w = b(x) on worker 1: x crosses once.
    graph = ProgramGraph(4, (0,), (Node(1, (0,), (1,)), Node(2, (1,), (2,)), Node(2, (1,), (3,))), (2, 3))
    low = lower(graph, {1: fn(0), 2: fn(1)}, {0: layout(0)})
    sends = [op for op in low.ops[0] if op[0] == Op.SEND]
    assert sends == [[Op.SEND, 1, 4, layout(1).to_wire(), [[1, 1, [[0, 4]]]]]]
    assert low.transfers == ((0, 1, 4),)
    assert low.ncopies == 1
    assert [Op.IN, 4, [0]] in low.ops[1]  # the copy is taken from its one sender, then removed from the store
    assert low.output_layouts == {2: layout(1), 3: layout(1)}


def test_same_worker_other_layout_is_a_local_reshard():
    sharded = Layout((0,), ((0, 0), (0, 1)), (2,), ("d",), ("d",))
    graph = ProgramGraph(3, (0,), (Node(1, (0,), (1,)), Node(2, (1,), (2,))), (2,))
    fns = {1: fn(0, devices=(0, 1)), 2: FnLayouts((0,), (sharded,), (sharded,))}
    low = lower(graph, fns, {0: layout(0, (0, 1))})
    assert [Op.RESHARD, 1, 3, sharded.to_wire()] in low.ops[0]
    assert not any(op[0] == Op.SEND for op in low.ops[0])


def test_inputs_living_elsewhere_are_moved_and_kept():
    graph = ProgramGraph(2, (0,), (Node(1, (0,), (1,)),), (1,))
    low = lower(graph, {1: fn(1)}, {0: layout(0)})
    assert low.ops[0] == [[Op.IN, 0, []], [Op.SEND, 0, 2, layout(1).to_wire(), [[1, 1, [[0, 4]]]]], [Op.DROP, [0]]]


def test_registers_are_dropped_after_their_last_read():
    graph = ProgramGraph(4, (0,), (Node(1, (0,), (1,)), Node(1, (1,), (2,)), Node(1, (0,), (3,))), (2, 3))
    ops = lower(graph, {1: fn(0)}, {0: layout(0)}).ops[0]
    first_drop_of_0 = next(i for i, op in enumerate(ops) if op[0] == Op.DROP and 0 in op[1])
    last_read_of_0 = max(i for i, op in enumerate(ops) if op[0] == Op.EXEC and 0 in op[2])
    assert first_drop_of_0 == last_read_of_0 + 1


def test_unknown_functions_and_arity_mismatches_are_errors():
    graph = ProgramGraph(2, (0,), (Node(1, (0,), (1,)),), (1,))
    with pytest.raises(WireError, match="unknown compiled function"):
        lower(graph, {}, {0: layout(0)})
    with pytest.raises(WireError, match="takes 2"):
        lower(graph, {1: fn(0, n_in=2)}, {0: layout(0)})
    with pytest.raises(WireError, match="no location"):
        lower(graph, {1: fn(0)}, {})


def test_a_multi_host_computation_runs_on_every_host_of_its_slice():
    mh = two_hosts()
    graph = ProgramGraph(3, (0,), (Node(1, (0,), (1,)), Node(1, (1,), (2,))), (2,))
    low = lower(graph, {1: FnLayouts(mh.workers, (mh,), (mh,))}, {0: mh})
    assert set(low.ops) == {5, 6}
    assert low.ops[5] == low.ops[6], "every host of the slice runs the same stream"
    assert [op[0] for op in low.ops[5]] == [Op.IN, Op.EXEC, Op.DROP, Op.EXEC, Op.DROP, Op.OUT, Op.DROP]
    assert low.output_layouts == {2: mh} and low.transfers == ()


def test_gathering_a_multi_host_array_onto_one_host_sends_each_part():
    mh = two_hosts()
    graph = ProgramGraph(3, (0,), (Node(1, (0,), (1,)), Node(2, (1,), (2,))), (2,))
    low = lower(graph, {1: FnLayouts(mh.workers, (mh,), (mh,)), 2: fn(0)}, {0: mh})
    # each host sends the half it holds; the receiver waits for both senders
    assert [Op.SEND, 1, 3, layout(0).to_wire(), [[0, 2, [[0, 2]]]]] in low.ops[5]
    assert [Op.SEND, 1, 3, layout(0).to_wire(), [[0, 2, [[2, 4]]]]] in low.ops[6]
    assert [Op.IN, 3, [5, 6]] in low.ops[0]
    assert sorted(low.transfers) == [(5, 0, 3), (6, 0, 3)]


def test_scattering_onto_a_sharded_multi_host_slice_sends_each_host_only_its_block():
    mh = two_hosts()
    back = lower(ProgramGraph(2, (0,), (Node(1, (0,), (1,)),), (1,)),
                 {1: FnLayouts(mh.workers, (mh,), (mh,))}, {0: layout(0)})
    assert back.ops[0][1] == [Op.SEND, 0, 2, mh.to_wire(), [[5, 1, [[0, 2]]], [6, 1, [[2, 4]]]]]
    assert all([Op.IN, 2, [0]] in back.ops[h] for h in (5, 6))


def test_a_replicated_source_shares_the_sending_and_keeps_local_blocks_local():
    replicated, sharded = two_hosts(spec=()), two_hosts()
    graph = ProgramGraph(2, (0,), (Node(1, (0,), (1,)),), (1,))
    low = lower(graph, {1: FnLayouts(sharded.workers, (sharded,), (sharded,))}, {0: replicated})
    # both hosts hold everything: each keeps its own block, nothing crosses the network
    assert low.transfers == ((5, 5, 2), (6, 6, 2))
    assert [Op.SEND, 0, 2, sharded.to_wire(), [[5, 1, [[0, 2]]]]] in low.ops[5]
    assert [Op.IN, 2, [5]] in low.ops[5] and [Op.IN, 2, [6]] in low.ops[6], "each host takes its block from itself"
    to_one = lower(ProgramGraph(2, (0,), (Node(1, (0,), (1,)),), (1,), shape=(8,)),
                   {1: FnLayouts((0,), (layout(0, (0, 1), ("d",)),), (layout(0, (0, 1), ("d",)),))},
                   {0: replicated})
    # two replicas feed one host's two blocks: one block each, not the whole array twice
    assert sorted(to_one.transfers) == [(5, 0, 2), (6, 0, 2)]
    assert [Op.IN, 2, [5, 6]] in to_one.ops[0]
    assert to_one.ops[5][1][4] == [[0, 2, [[0, 4]]]] and to_one.ops[6][1][4] == [[0, 2, [[4, 8]]]]


def test_sequential_dispatch_gates_each_node_behind_its_predecessors():
    # a(v) on worker 0, then b on worker 1 twice (the second reads the first)
    graph = ProgramGraph(4, (0,), (Node(1, (0,), (1,)), Node(2, (1,), (2,)), Node(2, (2,), (3,))), (3,))
    low = lower(graph, {1: fn(0), 2: fn(1)}, {0: layout(0)}, sequential=True)
    gates = low.gates
    assert gates.preds == {0: (), 1: (0,), 2: (1,)} and gates.succs == {0: (1,), 1: (2,)}
    assert gates.steps == {0: (0,), 1: (1,), 2: (1,)}
    assert gates.waits == {1: (0, 1), 2: (1,)}, "node 1's sender and runner both wait for its release"
    kinds0 = [op[0] for op in low.ops[0]]
    assert kinds0.index(Op.STEP) < kinds0.index(Op.AWAIT) < kinds0.index(Op.SEND)
    ops1 = [op for op in low.ops[1] if op[0] != Op.DROP]
    assert [op[0] for op in ops1] == [Op.AWAIT, Op.IN, Op.EXEC, Op.STEP, Op.AWAIT, Op.EXEC, Op.STEP, Op.OUT]
    assert lower(graph, {1: fn(0), 2: fn(1)}, {0: layout(0)}).gates is None


def test_an_unreduced_value_is_not_moved_between_layouts():
    # each device holds a partial value: a move would copy one device's as if it were all
    partial = Layout((0,), ((0, 0), (0, 1)), (2,), ("u",), (), ("u",))
    replicated = Layout((0,), ((0, 0), (0, 1)), (2,), ("u",), ())
    graph = ProgramGraph(3, (0,), (Node(1, (0,), (1,)), Node(2, (1,), (2,))), (2,))
    kept = lower(graph, {1: FnLayouts((0,), (partial,), (partial,)), 2: FnLayouts((0,), (partial,), (partial,))},
                 {0: partial})
    assert not any(op[0] in (Op.RESHARD, Op.SEND) for op in kept.ops[0]), "the same layout: used as it is"
    for src, dst in ((partial, replicated), (replicated, partial)):
        fns = {1: FnLayouts((0,), (src,), (src,)), 2: FnLayouts((0,), (dst,), (dst,))}
        with pytest.raises(WireError, match="unreduced axes.*reduce it first"):
            lower(graph, fns, {0: src})
