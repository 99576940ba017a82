"""The transfer planner (controller/transfers.py): pure, checked against JAX's own shard
indices and by exhaustive coverage on random layouts."""

import itertools
import json
import random
import subprocess
import sys
import textwrap

import numpy as np

from pathways.controller.transfers import plan
from pathways.ir import Layout, block_holders, device_regions, host_regions, reading_positions

# (mesh shape, axis names, spec, array shape)
_CASES = [
    ((4,), ("x",), ("x",), (8, 3)),
    ((4,), ("x",), (None, "x"), (3, 8)),
    ((2, 2), ("x", "y"), ("x", "y"), (4, 6)),
    ((2, 2), ("x", "y"), ("y", "x"), (4, 6)),
    ((2, 2), ("x", "y"), (("x", "y"),), (8, 2)),
    ((2, 2), ("x", "y"), (("y", "x"),), (8, 2)),
    ((2, 2), ("x", "y"), ("y",), (4, 5)),
    ((2, 4), ("a", "b"), (None, ("b", "a")), (3, 16)),
    ((2, 2, 2), ("a", "b", "c"), ("c", None, "a"), (2, 3, 4)),
    ((4,), ("x",), (), ()),
]


def test_device_blocks_agree_with_jax_named_sharding():
    script = textwrap.dedent("""
        import json, sys
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        out = []
        for mesh_shape, names, spec, shape in json.loads(sys.stdin.read()):
            n = int(np.prod(mesh_shape))
            mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), names)
            spec = [tuple(e) if isinstance(e, list) else e for e in spec]
            index = NamedSharding(mesh, PartitionSpec(*spec)).devices_indices_map(tuple(shape))
            out.append([[[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(index[dev], shape)]
                        for dev in mesh.devices.flat])
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(_CASES), capture_output=True,
                          text=True, timeout=120, check=True)
    for (mesh_shape, names, spec, shape), expected in zip(_CASES, json.loads(done.stdout)):
        layout = Layout((0,), tuple((0, i) for i in range(int(np.prod(mesh_shape)))), mesh_shape, names, spec)
        got = [[list(b) for b in region] for region in device_regions(shape, layout)]
        assert got == expected, (mesh_shape, spec, shape)


def _random_layout(rng, workers, shape):
    """A layout over some of ``workers`` (ranks 0..), a random mesh and a random valid spec."""
    hosts = rng.choice([1, 2, 4])
    per_host = rng.choice([1, 2])
    chosen = tuple(sorted(rng.sample(range(len(workers)), hosts)))
    devices = tuple((rank, d) for rank in chosen for d in range(per_host))
    n = len(devices)
    mesh_shape = rng.choice([(n,), (2, n // 2)] if n >= 2 else [(n,)])
    names = ("x", "y")[:len(mesh_shape)]
    spec = []
    free = list(names)
    for dim in shape:
        options = [None] + [a for a in free if dim % dict(zip(names, mesh_shape))[a] == 0]
        pick = rng.choice(options)
        spec.append(pick)
        if pick is not None:
            free.remove(pick)
    return Layout(tuple(workers[r] for r in chosen), devices, mesh_shape, names, tuple(spec))


def test_every_receiver_gets_each_element_it_holds_exactly_once_from_a_holder():
    rng = random.Random(7)
    workers = (10, 11, 12, 13)
    for _ in range(300):
        shape = rng.choice([(8,), (4, 8), (8, 2, 4), ()])
        src, dst = _random_layout(rng, workers, shape), _random_layout(rng, workers, shape)
        held = {w: set(rs) for w, rs in host_regions(shape, src).items()}
        got = {w: np.zeros(shape, int) for w in dst.workers}
        for route in plan(shape, src, dst):
            assert route.sender in src.workers and route.receiver in dst.workers
            for region in route.regions:
                assert any(all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(region, block))
                           for block in held[route.sender]), "a sender sends only what it holds"
                got[route.receiver][tuple(slice(lo, hi) for lo, hi in region)] += 1
        for w, regions in host_regions(shape, dst).items():
            need = np.zeros(shape, int)
            for region in regions:
                need[tuple(slice(lo, hi) for lo, hi in region)] = 1
            np.testing.assert_array_equal(got[w], need, err_msg=f"{src} -> {dst}")


def test_receivers_holding_a_block_already_copy_it_locally():
    both = Layout((1, 2), ((0, 0), (1, 0)), (2,), ("x",), ())
    rows = Layout((1, 2), ((0, 0), (1, 0)), (2,), ("x",), ("x",))
    routes = plan((4, 4), both, rows)
    assert {(r.sender, r.receiver) for r in routes} == {(1, 1), (2, 2)}


def test_replicas_share_the_sending():
    both = Layout((1, 2), ((0, 0), (1, 0)), (2,), ("x",), ())
    elsewhere = Layout((3,), tuple((0, i) for i in range(4)), (4,), ("x",), ("x",))
    sent = {}
    for route in plan((8, 4), both, elsewhere):
        sent[route.sender] = sent.get(route.sender, 0) + sum(
            int(np.prod([hi - lo for lo, hi in r])) for r in route.regions)
    assert sent == {1: 16, 2: 16}


def test_empty_and_scalar_arrays_still_get_routes():
    one = Layout((1,), ((0, 0),), (1,), ("x",), ())
    two = Layout((2, 3), ((0, 0), (1, 0)), (2,), ("x",), ("x",))
    for shape in ((), (0, 4)):
        assert sorted((r.sender, r.receiver) for r in plan(shape, one, two)) == [(1, 2), (1, 3)]
    assert list(itertools.chain(*(r.regions for r in plan((), one, two)))) == [(), ()]


def test_each_block_has_one_holder_and_a_read_asks_only_the_hosts_holding_new_ones():
    rng = random.Random(3)
    workers = (13, 10, 12, 11)
    for _ in range(300):
        shape = rng.choice([(8,), (4, 8), (8, 2, 4), ()])
        layout = _random_layout(rng, workers, shape)
        holders = block_holders(shape, layout)
        held = host_regions(shape, layout)
        given = [r for rs in holders.values() for r in rs]
        assert len(given) == len(set(given)) == len({r for rs in held.values() for r in rs}), layout
        for w, regions in holders.items():
            assert set(regions) <= set(held[w])
            earlier = layout.workers[:layout.workers.index(w)]
            assert not any(r in held[e] for r in regions for e in earlier), "a block goes to its first holder"
        asked = reading_positions(shape, layout)
        assert [layout.workers[i] for i in asked] == [w for w in layout.workers if w in holders]
    replicated_rows = Layout((1, 2), ((0, 0), (0, 1), (1, 0), (1, 1)), (2, 2), ("a", "b"), (None, "b"))
    assert reading_positions((4, 4), replicated_rows) == (0,)  # host 1 holds only what host 0 does
    unreduced = Layout((1, 2), ((0, 0), (1, 0)), (2,), ("x",), (), ("x",))
    assert reading_positions((4, 4), unreduced) == (0, 1)  # each host's partial values are needed
