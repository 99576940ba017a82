"""``pw.pipeline`` on a real cluster: a layered MLP split over three one-host islands by the
planner, run as one program and checked against plain JAX; plans follow the figures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from pathways import cluster
from pathways.client.pipeline import estimate_layers
from pathways.planner import Device, Layer, Link, Topology
from tests.conftest import connected, running_cluster

LAYERS, WIDTH, BATCH = 6, 16, 8


@pytest.fixture(scope="module")
def islands():
    """Three islands of one one-device host each: three workers, one slice on each."""
    yield from running_cluster(*[pw.Island(hosts=1, devices_per_host=1)] * 3)


@pytest.fixture
def client(islands):
    yield from connected(islands)


@pytest.fixture
def slices(client):
    devices = pw.make_virtual_device_set()
    return [devices.add_slice(cpu_devices=1, island=i) for i in range(3)]


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def mlp():
    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(0, 1 / np.sqrt(WIDTH), (WIDTH, WIDTH)).astype(np.float32),
               "b": rng.normal(0, 0.1, (WIDTH,)).astype(np.float32)} for _ in range(LAYERS)]
    x = rng.normal(0, 1, (BATCH, WIDTH)).astype(np.float32)
    return params, x


def reference(params, x):
    for p in params:
        x = layer(p, x)
    return np.asarray(x)


def name(s):
    return "+".join(str(w) for w in s.workers)


def check_stages(pipe, slices):
    """The stages cover every layer once, in order, each on the slice its plan stage names."""
    bounds = [(s.start, s.end) for s in pipe.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == LAYERS
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:])), bounds
    planned = {(s.device, s.start, s.end) for s in pipe.plan.stages if s.start < s.end}
    assert planned == {(name(s.slice), s.start, s.end) for s in pipe.stages}
    assert all(s.slice in slices for s in pipe.stages)


def test_an_mlp_split_by_the_planner_over_measured_slices_matches_plain_jax(islands, slices):
    cluster.measure(islands.address, timeout=60)
    params, x = mlp()
    pipe = pw.pipeline(layer, params, x, slices)
    check_stages(pipe, slices)
    assert {d.id for d in pipe.topology.devices} == {name(s) for s in slices}
    for scale in (1.0, -0.5):  # a second call reuses the stages and the parameters on their slices
        out = pipe(x * scale)
        assert isinstance(out, pw.Array) and out.sharding.mesh.slice is pipe.stages[-1].slice
        np.testing.assert_allclose(np.asarray(out), reference(params, x * scale), rtol=0, atol=1e-5)


def uniform(slices, overrides=None):
    """Three equal devices named like the slices, with fast links; ``overrides`` maps a
    slice's position to Device fields to change."""
    devices = [Device(name(s), 1 << 30, 1e9) for s in slices]
    for i, fields in (overrides or {}).items():
        devices[i] = Device(devices[i].id, fields.get("memory_bytes", 1 << 30), fields.get("flops", 1e9))
    return Topology(devices, default_link=Link(1e-5, 1e9))


def layers_on(pipe, s):
    return sum(st.end - st.start for st in pipe.stages if st.slice is s)


def test_plans_follow_a_slow_or_a_small_device(client, slices):
    params, x = mlp()
    costs = [Layer(flops=1e6, param_bytes=1000, activation_bytes=100)] * LAYERS
    even = pw.pipeline(layer, params, x, slices, layers=costs, topology=uniform(slices))
    assert [layers_on(even, s) for s in slices] == [2, 2, 2], even
    slow = pw.pipeline(layer, params, x, slices, layers=costs, topology=uniform(slices, {1: {"flops": 1e7}}))
    assert layers_on(slow, slices[1]) == 0 and sum(layers_on(slow, s) for s in slices) == LAYERS, slow
    small = pw.pipeline(layer, params, x, slices, layers=costs,
                        topology=uniform(slices, {2: {"memory_bytes": 1500}}))  # room for one layer
    assert layers_on(small, slices[2]) <= 1 and small.plan.fits_memory, small
    assert len({tuple((s.slice.id, s.start, s.end) for s in p.stages) for p in (even, slow, small)}) == 3
    for pipe in (even, slow, small):
        check_stages(pipe, slices)
        np.testing.assert_allclose(np.asarray(pipe(x)), reference(params, x), rtol=0, atol=1e-5)


def test_layer_costs_are_estimated_from_the_function():
    params, x = mlp()
    costs = estimate_layers(layer, params, x)
    assert len(costs) == LAYERS
    for c in costs:
        assert c.flops >= 2 * BATCH * WIDTH * WIDTH, c  # at least the matmul
        assert c.param_bytes == (WIDTH * WIDTH + WIDTH) * 4 and c.activation_bytes == BATCH * WIDTH * 4
    with pytest.raises(pw.SignatureError, match="layer 0 failed to trace"):
        estimate_layers(layer, [{"w": np.ones((3, 3), np.float32), "b": np.ones(3, np.float32)}], x)


def test_bad_slices_layers_and_topologies_are_refused_with_advice(client, slices):
    params, x = mlp()
    crowded = slices + [pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)]
    with pytest.raises(pw.PlacementError, match=f"share worker {slices[0].workers[0]}.*one slice per host"):
        pw.pipeline(layer, params, x, crowded)
    with pytest.raises(pw.SignatureError, match="2 layer costs for 6 layers"):
        pw.pipeline(layer, params, x, slices, layers=[Layer(1.0, 1, 1)] * 2)
    stranger = Topology([Device("elsewhere", 1 << 30, 1e9)])
    with pytest.raises(pw.PlacementError, match="name none of the slices"):
        pw.pipeline(layer, params, x, slices, topology=stranger)
    with pytest.raises(pw.PlacementError, match="list of slices"):
        pw.pipeline(layer, params, x, [])
    with pytest.raises(pw.PathwaysError, match="cannot fit"):
        pw.pipeline(layer, params, x, slices, layers=[Layer(1.0, 1 << 40, 1)] * LAYERS)


def test_matches_plain_jax_with_sequential_dispatch_too(client, slices):
    params, x = mlp()
    pipe = pw.pipeline(jax.jit(layer), params, x, slices, layers=[Layer(1e6, 1000, 100)] * LAYERS,
                       topology=uniform(slices), dispatch="sequential")
    np.testing.assert_allclose(np.asarray(pipe(x)), reference(params, x), rtol=0, atol=1e-5)
