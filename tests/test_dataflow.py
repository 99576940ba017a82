"""Sharded transfers between slices and sequential dispatch, on a real cluster.

Arrays are generated on the source slice and checked element by element on the
destination slice, so that even 256 MiB moves are verified exactly without passing
through the client.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from tests.conftest import connected, running_cluster


@pytest.fixture(scope="module")
def cluster():
    """Island 0: two hosts of two devices (one jax.distributed group); island 1: one host
    of two devices."""
    for c in running_cluster(pw.Island(hosts=2, devices_per_host=2), pw.Island(hosts=1, devices_per_host=2)):
        yield from connected(c)


@pytest.fixture(scope="module")
def slices(cluster):
    vds = pw.make_virtual_device_set()
    src = vds.add_slice(cpu_devices=2, island=0)
    other_host = vds.add_slice(cpu_devices=2, island=0)
    other_island = vds.add_slice(cpu_devices=2, island=1)
    both_hosts = vds.add_slice(cpu_devices=4, island=0)
    one_device = vds.add_slice(cpu_devices=1, island=0)
    assert other_host.workers != src.workers and other_island.island == 1
    assert set(both_hosts.workers) == set(src.workers) | set(other_host.workers)
    assert one_device.workers == src.workers, "the 1-device slice shares the source's host"
    return {"src": src, "same host": one_device, "other host": other_host,
            "other island": other_island, "both hosts": both_hosts}


def _pattern(shape):
    """Distinct int32 values for every element (wrapping arithmetic, exact everywhere)."""
    n = int(np.prod(shape, dtype=np.int64))
    return (jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(2654435761)).astype(jnp.int32).reshape(shape)


def _specs(kind, where):
    """(source spec, destination spec): rows are split over the source's devices; the
    destination splits columns (rows on the four-device slice), or replicates."""
    src = pw.P("x") if kind[0] == "sharded" else pw.P()
    if kind[1] == "replicated":
        return src, pw.P()
    return src, pw.P("x") if where == "both hosts" else pw.P(None, "x")


def _move(slices, shape, kind, where):
    """Run a program that makes the array on the source and checks it on the destination;
    returns (all elements equal, the moved array)."""
    src_spec, dst_spec = _specs(kind, where)
    dst_slice = slices[where]
    if where == "same host" and kind[1] == "sharded":
        dst_slice = slices["src"]  # a sharded layout on the source's own devices
    src_mesh, dst_mesh = slices["src"].mesh("x"), dst_slice.mesh("x")
    make = pw.jit(lambda seed: _pattern(shape) + seed, mesh=src_mesh, out_shardings=src_spec)
    check = pw.jit(lambda x: (jnp.all(x == _pattern(shape) + 1), x), mesh=dst_mesh,
                   in_shardings=dst_spec, out_shardings=(pw.P(), dst_spec))

    @pw.program
    def move(seed):
        return check(make(seed))

    ok, moved = move(np.int32(1))
    assert moved.sharding.mesh.slice is dst_slice and moved.sharding.spec == dst_spec
    return bool(np.asarray(ok)), moved


KINDS = [("replicated", "replicated"), ("replicated", "sharded"), ("sharded", "replicated"),
         ("sharded", "sharded")]
WHERE = ["same host", "other host", "other island", "both hosts"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", KINDS, ids=["-".join(k) for k in KINDS])
def test_small_and_multi_chunk_arrays_move_exactly(slices, kind, where):
    ok, moved = _move(slices, (8, 6), kind, where)
    assert ok
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(jax.jit(_pattern, static_argnums=0)((8, 6))) + 1)
    # 10 MiB: several 4 MiB chunks per sender
    ok, _ = _move(slices, (1280, 2048), kind, where)
    assert ok


@pytest.mark.parametrize("where", WHERE)
def test_scalars_move_exactly(slices, where):
    ok, moved = _move(slices, (), ("replicated", "replicated"), where)
    assert ok and np.asarray(moved) == np.asarray(_pattern(())) + 1


@pytest.mark.parametrize("kind, where", [
    (("sharded", "replicated"), "other island"),
    (("replicated", "sharded"), "both hosts"),
    (("sharded", "sharded"), "other host"),
    (("replicated", "replicated"), "same host"),
])
def test_256_mib_arrays_move_exactly(slices, kind, where):
    ok, _ = _move(slices, (8192, 8192), kind, where)
    assert ok


def test_sequential_and_parallel_dispatch_compute_the_same_chain(slices):
    """A chain that hops between hosts and islands gives the same numbers either way."""
    fns = [pw.jit(lambda x, i=i: x * 2 + i, mesh=slices[where].mesh("x"))
           for i, where in enumerate(["src", "other host", "other island", "both hosts", "src"])]

    def chain(x):
        for f in fns:
            x = f(x)
        return x

    x = np.arange(4, dtype=np.float32)
    expected = x
    for i in range(len(fns)):
        expected = expected * 2 + i
    parallel, sequential = pw.program(chain), pw.program(chain, dispatch="sequential")
    for step in range(3):
        np.testing.assert_array_equal(np.asarray(parallel(x + step)), expected + step * 32)
        np.testing.assert_array_equal(np.asarray(sequential(x + step)), expected + step * 32)


def test_sequential_programs_keep_failures_and_fan_in(slices):
    """A node with two predecessors on different islands waits for both; a failure in one
    poisons what follows, and the cluster keeps serving."""
    a = pw.jit(lambda x: x + 1, mesh=slices["other host"].mesh("x"))
    b = pw.jit(lambda x: x * 3, mesh=slices["other island"].mesh("x"))
    join = pw.jit(lambda x, y: x - y, mesh=slices["src"].mesh("x"))
    boom = pw.jit(lambda x: jnp.ones((1 << 42,), jnp.float32) * x[0], mesh=slices["other island"].mesh("x"))
    head = pw.jit(lambda big: big[:4], mesh=slices["other island"].mesh("x"))

    fan_in = pw.program(lambda x: join(a(x), b(x)), dispatch="sequential")
    np.testing.assert_array_equal(np.asarray(fan_in(np.ones(4, np.float32))), [-1.0] * 4)
    broken = pw.program(lambda x: join(a(x), head(boom(x))), dispatch="sequential")
    with pytest.raises(pw.RemoteError, match="RESOURCE_EXHAUSTED|[Oo]ut of memory"):
        np.asarray(broken(np.ones(4, np.float32)))
    np.testing.assert_array_equal(np.asarray(fan_in(np.full(4, 2.0, np.float32))), [-3.0] * 4)


def test_unknown_dispatch_modes_are_refused():
    with pytest.raises(ValueError, match="'parallel'.*'sequential'"):
        pw.program(lambda x: x, dispatch="eager")


@pytest.mark.parametrize("specs", [(pw.P("x"), pw.P(None, "x")), (pw.P(), pw.P("x")), (pw.P("x"), pw.P())],
                         ids=["rows-to-columns", "replicated-to-rows", "rows-to-replicated"])
def test_resharding_within_a_multi_host_slice_is_exact(slices, specs):
    """Both ends span the same two hosts: each host keeps what it holds and takes the rest
    of its new blocks from the other."""
    mesh = slices["both hosts"].mesh("x")
    shape = (8, 4096)
    make = pw.jit(lambda seed: _pattern(shape) + seed, mesh=mesh, out_shardings=specs[0])
    check = pw.jit(lambda x: jnp.all(x == _pattern(shape) + 1), mesh=mesh, in_shardings=specs[1])
    assert bool(np.asarray(pw.program(lambda seed: check(make(seed)))(np.int32(1))))


@pytest.mark.parametrize("spec", [pw.P("x"), pw.P(None, "x"), pw.P()])
def test_a_put_across_hosts_gives_each_host_its_blocks(slices, spec):
    """A host array put on a slice of two hosts is sent to each host as the blocks of its
    own devices; the array reads back whole and computes as on one machine."""
    mesh = slices["both hosts"].mesh("x")
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) * 0.5
    arr = pw.device_put(value, pw.NamedSharding(mesh, spec))
    np.testing.assert_array_equal(arr.to_numpy(), value)
    total = pw.jit(lambda v: (v * 2).sum(axis=0), mesh=mesh, in_shardings=spec, out_shardings=pw.P())(arr)
    np.testing.assert_array_equal(total.to_numpy(), (value * 2).sum(axis=0))
