"""XLA OpShardings as layouts and back (pathways/hlo.py): every sharding kind, checked
against the blocks JAX itself gives each device, round trips, and refusals."""

import json
import subprocess
import sys
import textwrap

import pytest

from pathways.errors import WireError
from pathways.hlo import OpSharding, layout_of_op_sharding, op_sharding_of_layout, replicated
from pathways.ir import Layout, device_regions, partials, stacked

# logical device i of an 8-device executable: two hosts (ranks 3 and 5), devices interleaved
DEVICES = tuple((3 if i % 2 == 0 else 5, i // 2) for i in range(8))
WORKERS = {3: 30, 5: 50}

# (mesh shape, axis names, spec, array shape): NamedShardings JAX turns into OpShardings
_CASES = [
    ((8,), ("x",), ("x",), (16,)),
    ((8,), ("x",), (), (4, 4)),
    ((2, 4), ("a", "b"), ("a", "b"), (4, 8)),
    ((2, 4), ("a", "b"), ("b", "a"), (8, 4)),
    ((2, 4), ("a", "b"), (None, "a"), (3, 4)),
    ((2, 4), ("a", "b"), (("b", "a"),), (16, 2)),
    ((2, 2, 2), ("a", "b", "c"), ("c", None, "a"), (2, 3, 4)),
    ((4, 2), ("a", "b"), ("b",), (6,)),
    ((8,), ("x",), (), ()),
]


def _op(**fields):
    return OpSharding(**fields).SerializeToString()


def test_op_shardings_jax_makes_become_layouts_that_give_each_device_the_same_block():
    script = textwrap.dedent("""
        import json, sys
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        out = []
        for mesh_shape, names, spec, shape in json.loads(sys.stdin.read()):
            mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
            spec = [tuple(e) if isinstance(e, list) else e for e in spec]
            sharding = NamedSharding(mesh, PartitionSpec(*spec))
            op = sharding._to_xla_hlo_sharding(len(shape)).to_proto().SerializeToString()
            index = sharding.devices_indices_map(tuple(shape))
            # logical device i of an executable over these devices is jax device i
            blocks = [[[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(index[dev], shape)]
                      for dev in sorted(index, key=lambda dev: dev.id)]
            out.append([op.hex(), blocks])
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(_CASES), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kinds = set()
    for (mesh_shape, names, spec, shape), (op_hex, blocks) in zip(_CASES, json.loads(done.stdout)):
        op = bytes.fromhex(op_hex)
        parsed = OpSharding.FromString(op)
        kinds.add((parsed.type, bool(parsed.iota_reshape_dims), parsed.replicate_on_last_tile_dim))
        layout = layout_of_op_sharding(op, DEVICES, WORKERS, len(shape))
        assert layout.workers == (30, 50)
        got = dict(zip(layout.devices, device_regions(tuple(shape), layout)))
        want = {DEVICES[i]: tuple(tuple(b) for b in block) for i, block in enumerate(blocks)}
        assert {d: tuple(tuple(b) for b in r) for d, r in got.items()} == want, (mesh_shape, spec, shape)
        back = layout_of_op_sharding(op_sharding_of_layout(layout, DEVICES, len(shape)), DEVICES, WORKERS, len(shape))
        assert dict(zip(back.devices, device_regions(tuple(shape), back))) == got, "op -> layout -> op keeps blocks"
    assert (OpSharding.REPLICATED, False, False) in kinds and (OpSharding.OTHER, True, True) in kinds
    assert (OpSharding.OTHER, True, False) in kinds


def test_replicated_and_maximal_shardings():
    assert layout_of_op_sharding(replicated(), DEVICES[:2], WORKERS, 2) == \
        Layout((30, 50), DEVICES[:2], (2,), ("r",), ())
    maximal = _op(type=OpSharding.MAXIMAL, tile_assignment_dimensions=[1], tile_assignment_devices=[3])
    assert layout_of_op_sharding(maximal, DEVICES, WORKERS, 3) == Layout((50,), (DEVICES[3],), (1,), ("r",), ())
    one = Layout((50,), (DEVICES[3],), (1,), ("r",), ())
    assert OpSharding.FromString(op_sharding_of_layout(one, DEVICES)) == OpSharding.FromString(maximal)
    assert op_sharding_of_layout(one, DEVICES[3:4]) == replicated(), "one device of one: replicated"
    everywhere = Layout((30, 50), DEVICES, (2, 4), ("a", "b"), (None,))
    assert op_sharding_of_layout(everywhere, DEVICES, 1) == replicated()


def test_explicit_and_iota_tile_assignments_and_a_replica_dimension():
    explicit = _op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 1, 2],
                   tile_assignment_devices=[3, 0, 1, 2], replicate_on_last_tile_dim=True)
    layout = layout_of_op_sharding(explicit, DEVICES[:4], WORKERS, 2)
    assert layout == Layout((30, 50), tuple(DEVICES[i] for i in (3, 0, 1, 2)), (2, 1, 2), ("t0", "t1", "r"),
                            ("t0", None))
    as_subgroup = _op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 1, 2],
                      tile_assignment_devices=[3, 0, 1, 2], last_tile_dims=[OpSharding.REPLICATED])
    assert layout_of_op_sharding(as_subgroup, DEVICES[:4], WORKERS, 2) == layout
    iota = _op(type=OpSharding.OTHER, tile_assignment_dimensions=[4, 2], iota_reshape_dims=[2, 4],
               iota_transpose_perm=[1, 0])
    assert layout_of_op_sharding(iota, DEVICES, WORKERS, 2).devices == tuple(DEVICES[i] for i in (0, 4, 1, 5, 2, 6, 3, 7))
    scalar = _op(type=OpSharding.OTHER, tile_assignment_dimensions=[2], tile_assignment_devices=[1, 0],
                 replicate_on_last_tile_dim=True)
    assert layout_of_op_sharding(scalar, DEVICES[:2], WORKERS, 0) == \
        Layout((30, 50), (DEVICES[1], DEVICES[0]), (2,), ("r",), ())


def test_unreduced_shardings_become_layouts_with_unreduced_axes():
    everywhere = layout_of_op_sharding(_op(type=OpSharding.UNREDUCED), DEVICES[:4], WORKERS, 2)
    assert everywhere == Layout((30, 50), DEVICES[:4], (4,), ("u",), (), ("u",))
    assert device_regions((2, 3), everywhere) == [((0, 2), (0, 3))] * 4, "every device holds a partial value of all"
    # XLA's devices=[2,1,2]<=[2,2]T(1,0) last_tile_dims={unreduced}: rows over tiles, partial sums in pairs
    rows = layout_of_op_sharding(_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 1, 2],
                                     iota_reshape_dims=[2, 2], iota_transpose_perm=[1, 0],
                                     last_tile_dims=[OpSharding.UNREDUCED]), DEVICES[:4], WORKERS, 2)
    assert rows == Layout((30, 50), tuple(DEVICES[i] for i in (0, 2, 1, 3)), (2, 1, 2), ("t0", "t1", "u"),
                          ("t0", None), ("u",))
    assert dict(zip(rows.devices, device_regions((4, 2), rows))) == {
        DEVICES[0]: ((0, 2), (0, 2)), DEVICES[2]: ((0, 2), (0, 2)),
        DEVICES[1]: ((2, 4), (0, 2)), DEVICES[3]: ((2, 4), (0, 2))}
    both = layout_of_op_sharding(_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2, 2],
                                     iota_reshape_dims=[8],
                                     last_tile_dims=[OpSharding.UNREDUCED, OpSharding.REPLICATED]),
                                 DEVICES, WORKERS, 1)
    assert (both.mesh_shape, both.axis_names, both.spec, both.unreduced) == ((2, 2, 2), ("t0", "u", "r"), ("t0",),
                                                                             ("u",))
    for layout, ndim in [(everywhere, 2), (rows, 2), (both, 1)]:
        devices = DEVICES[:len(layout.devices)] if len(layout.devices) < len(DEVICES) else DEVICES
        op = op_sharding_of_layout(layout, devices, ndim)
        assert layout_of_op_sharding(op, devices, WORKERS, ndim) == layout, "op -> layout -> op keeps it"
        assert Layout.from_wire(layout.to_wire()) == layout, "the wire keeps the unreduced axes"
    # the stack of partial values: a leading dimension over the unreduced axes, each device its own
    stack = stacked(rows)
    assert partials(rows) == 2 and partials(both) == 2 and partials(Layout((30,), DEVICES[:1], (1,), ("r",), ())) == 1
    assert dict(zip(stack.devices, device_regions((2, 4, 2), stack))) == {
        DEVICES[0]: ((0, 1), (0, 2), (0, 2)), DEVICES[2]: ((1, 2), (0, 2), (0, 2)),
        DEVICES[1]: ((0, 1), (2, 4), (0, 2)), DEVICES[3]: ((1, 2), (2, 4), (0, 2))}
    plain = Layout((30,), (DEVICES[0],), (1,), ("r",), ())
    assert plain.to_wire() == Layout.from_wire(plain.to_wire()).to_wire() and len(plain.to_wire()) == 5


@pytest.mark.parametrize("raw, needle", [
    ([[30], [3, 0, 5, 0], [2], ["x"], ["x"], ["x"]], "the partition spec does not name"),
    ([[30], [3, 0, 5, 0], [2], ["x"], [], ["y"]], "must be distinct axes of mesh"),
    ([[30], [3, 0, 5, 0], [2], ["x"], [], [["x"]]], "must be distinct axes of mesh"),
    ([[30], [3, 0, 5, 0], [2], ["x"], [], ["x", "x"]], "must be distinct axes of mesh"),
])
def test_malformed_unreduced_axes_are_refused_on_the_wire(raw, needle):
    with pytest.raises(WireError, match=needle):
        Layout.from_wire(raw)


def test_canonical_layouts_round_trip_exactly():
    for layout, ndim in [
        (Layout((30, 50), DEVICES, (4, 2), ("t0", "t1"), ("t0", "t1")), 2),
        (Layout((30, 50), DEVICES[::-1], (1, 4, 2), ("t0", "t1", "r"), (None, "t1")), 2),
        (Layout((30,), (DEVICES[0],), (1,), ("r",), ()), 1),
        (Layout((30, 50), DEVICES[2:6], (2, 1, 2), ("t0", "t1", "t2"), ("t0", None, "t2")), 3),
    ]:
        op = op_sharding_of_layout(layout, DEVICES, ndim)
        assert layout_of_op_sharding(op, DEVICES, WORKERS, ndim) == layout


def test_layouts_of_other_axis_names_and_specs_keep_their_blocks():
    shape = (8, 6)
    for layout in [
        Layout((30, 50), DEVICES, (2, 4), ("x", "y"), (("y", "x"),)),
        Layout((30, 50), DEVICES, (2, 2, 2), ("x", "y", "z"), ("z", "x")),
        Layout((30,), DEVICES[0::2], (4,), ("x",), (None, None)),
    ]:
        back = layout_of_op_sharding(op_sharding_of_layout(layout, DEVICES, 2), DEVICES, WORKERS, 2)
        assert dict(zip(back.devices, device_regions(shape, back))) == \
            dict(zip(layout.devices, device_regions(shape, layout)))


@pytest.mark.parametrize("op, ndim, needle", [
    (_op(type=OpSharding.MANUAL), 1, "MANUAL sharding has no pathways layout"),
    (_op(type=OpSharding.TUPLE, tuple_shardings=[OpSharding()]), 1, "TUPLE"),
    (_op(type=OpSharding.UNKNOWN), 1, "UNKNOWN"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2], tile_assignment_devices=[0, 1, 2, 3],
         last_tile_dims=[OpSharding.MANUAL]), 1, "subgroups \\['MANUAL'\\]"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2, 2], iota_reshape_dims=[8],
         last_tile_dims=[OpSharding.UNREDUCED, OpSharding.UNREDUCED]), 1, "only one subgroup each"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2, 2], iota_reshape_dims=[8],
         replicate_on_last_tile_dim=True, last_tile_dims=[OpSharding.UNREDUCED]), 1, "malformed"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2], tile_assignment_devices=[0, 1, 2, 3]), 3,
     "does not fit an array of rank 3"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2], tile_assignment_devices=[0, 0]), 1, "distinct"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[2], tile_assignment_devices=[0, 9]), 1, "distinct"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[4], tile_assignment_devices=[0, 1]), 1,
     "lists 2 devices for 4 tiles"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[4], iota_reshape_dims=[2, 2],
         iota_transpose_perm=[0, 0]), 1, "iota tile assignment"),
    (_op(type=OpSharding.OTHER, tile_assignment_dimensions=[0]), 1, "positive"),
    (b"\xff\xff\xff", 1, "no serialized xla OpSharding"),
])
def test_what_a_layout_cannot_express_is_refused(op, ndim, needle):
    with pytest.raises(WireError, match=needle):
        layout_of_op_sharding(op, DEVICES, WORKERS, ndim)


def test_a_layout_off_the_executables_devices_is_refused():
    with pytest.raises(WireError, match="not among the executable's devices"):
        op_sharding_of_layout(Layout((30,), ((3, 9),), (1,), ("r",), ()), DEVICES)
    with pytest.raises(WireError, match="has no worker"):
        layout_of_op_sharding(replicated(), ((7, 0),), WORKERS, 1)
