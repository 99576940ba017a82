"""The runtime end to end: real controller and worker processes, real JAX computations."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status, worker_stats
from tests.conftest import session_handles, wait_until


def new_slice(n, **kw):
    return pw.make_virtual_device_set().add_slice(cpu_devices=n, **kw)


def test_slices_are_placed_on_real_hosts(session, cluster):
    s = new_slice(4)
    assert s.count == 4 and len(s.devices) == 4 and s.cpus == s.devices
    assert len(s.workers) == 1 and s.workers[0] in {w["worker"] for w in status(cluster.address)["workers"]}
    two = new_slice(4, mesh_shape=(2, 2))
    assert two.mesh(("x", "y")).shape == (2, 2)
    with pytest.raises(pw.PlacementError, match="host 0 \\(island 0\\): 4 cpu"):
        new_slice(16)
    with pytest.raises(pw.PlacementError, match="held exclusively|not used by any other slice"):
        for _ in range(3):
            new_slice(4, exclusive=True)
    with pytest.raises(pw.PlacementError, match="2 axis name"):
        two.mesh("x")
    with pytest.raises(pw.PlacementError, match="not gpu"):
        s.gpus


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pmap_matches_jax(session, n):
    devices = new_slice(n).devices
    f = pw.pmap(lambda x, y: {"sum": x + y, "scaled": jnp.sin(x) * 3}, devices=devices)
    x = np.random.default_rng(n).standard_normal((n, 3, 5)).astype(np.float32)
    y = np.arange(n * 3 * 5, dtype=np.float32).reshape(n, 3, 5)
    out = f(x, y)
    assert out["sum"].shape == (n, 3, 5) and out["sum"].dtype == np.float32
    np.testing.assert_allclose(np.asarray(out["sum"]), x + y, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["scaled"]), np.sin(x) * 3, rtol=1e-5)


def test_pmap_collectives_use_the_axis_name(session):
    devices = new_slice(4).devices
    f = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=devices)
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(f(x)), np.full(4, x.sum()))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sharded_jit_matches_jax(session, n):
    s = new_slice(n)
    mesh = s.mesh("x")

    def model(w, x):
        h = jnp.tanh(x @ w["a"])
        return h @ w["b"], jnp.mean(h)

    f = pw.jit(model, mesh=mesh, in_shardings=({"a": None, "b": None}, pw.P("x")),
               out_shardings=(pw.P("x"), None))
    rng = np.random.default_rng(0)
    w = {"a": rng.standard_normal((6, 8)).astype(np.float32), "b": rng.standard_normal((8, 2)).astype(np.float32)}
    x = rng.standard_normal((4 * n, 6)).astype(np.float32)
    out, mean = f(w, x)
    want_out, want_mean = jax.jit(model)(w, x)
    assert out.sharding.spec == pw.P("x") and out.sharding.mesh.shape == (n,)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(want_mean), rtol=1e-5)


def test_two_dimensional_mesh(session):
    s = new_slice(4, mesh_shape=(2, 2))
    f = pw.jit(lambda a: a * 2 + 1, mesh=s.mesh(("x", "y")), in_shardings=pw.P("x", "y"),
               out_shardings=pw.P("y", "x"))
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = f(a)
    assert out.sharding.spec == pw.P("y", "x")
    np.testing.assert_array_equal(np.asarray(out), a * 2 + 1)


def test_figure2_program_moves_data_between_workers(session):
    slices = [new_slice(4) for _ in range(3)]
    assert len({s.workers for s in slices}) == 2, "three 4-device slices should use both hosts"
    a = pw.pmap(lambda x: x * 2.0, devices=slices[0].devices)
    b = pw.pmap(lambda x: x + 1.0, devices=slices[1].devices)
    c = pw.pmap(lambda x: x / 2.0, devices=slices[2].devices)

    @pw.program
    def f(v):
        x = a(v)
        y = b(x)
        z = a(c(x))
        return y, z

    v = np.arange(4, dtype=np.float32)
    y, z = f(v)
    np.testing.assert_array_equal(np.asarray(y), v * 2 + 1)
    np.testing.assert_array_equal(np.asarray(z), v * 2)
    y2, z2 = f(np.asarray(z))  # a second call reuses the traced program; pw.Arrays feed it too
    np.testing.assert_array_equal(np.asarray(y2), v * 4 + 1)
    y3, _ = f(z2)
    np.testing.assert_array_equal(np.asarray(y3), v * 8 + 1)


def test_program_is_one_submission_with_one_node_per_computation(session, monkeypatch):
    s = new_slice(2)
    inc = pw.jit(lambda x: x + 1.0, mesh=s.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))

    @pw.program
    def chain(x):
        for _ in range(128):
            x = inc(x)
        return x

    x = pw.device_put(np.zeros(4, np.float32), pw.NamedSharding(s.mesh("x"), pw.P("x")))
    chain(x)  # trace and register once
    sent = []
    real_send = session.send
    monkeypatch.setattr(session, "send", lambda msg: (sent.append(msg), real_send(msg)))
    out = chain(x)
    assert [x.TAG for x in sent] == ["run"]
    graph = chain._cache[next(iter(chain._cache))].spec.graph
    assert len(graph.nodes) == 128
    np.testing.assert_array_equal(np.asarray(out), np.full(4, 128.0))


def test_program_with_pytrees_and_captured_arrays(session):
    s1, s2 = new_slice(2), new_slice(1)
    scale = pw.device_put(np.float32(10), s2.devices)
    split = pw.jit(lambda d: (d["a"] + d["b"], d["a"] - d["b"]), mesh=s1.mesh("x"))
    combine = pw.jit(lambda p, k: {"out": p[0] * k + p[1]}, mesh=s2.mesh("y"))

    @pw.program
    def f(d):
        return combine(split(d), scale)

    a, b = np.float32(3), np.float32(1)
    out = f({"a": a, "b": b})
    assert set(out) == {"out"}
    assert float(np.asarray(out["out"])) == (a + b) * 10 + (a - b)


def test_op_by_op_calls_pipeline(session):
    s = new_slice(1)
    slow = pw.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, m: jnp.tanh(m @ m), x), mesh=s.mesh("d"))
    inc = pw.jit(lambda x: x + 1.0, mesh=s.mesh("d"))
    m = pw.device_put(np.eye(256, dtype=np.float32) * 0.5, s.devices)
    slow(m).block_until_ready()  # compiled and warm
    first = slow(m)
    x = first
    for _ in range(50):
        x = inc(x)
    # all 51 submissions returned while the first computation was still running
    assert not first.is_ready()
    assert not x.is_ready()
    final = np.asarray(x)
    assert first.is_ready() and x.is_ready()
    np.testing.assert_allclose(final, np.asarray(first) + 50, rtol=1e-5)


def test_what_a_session_holds_goes_out_at_the_end_and_waits_inside_the_hold_send_it_first(session):
    s = new_slice(1)
    inc = pw.jit(lambda x: x + 1.0, mesh=s.mesh("d"))
    x = pw.device_put(np.zeros(4, np.float32), s.devices)
    inc(x).block_until_ready()  # compiled
    with session.holding():
        y = inc(inc(x))
        assert session._outbox._queue.qsize() == 0  # the runs are held
        # a request and a read wait on the controller and the worker: what is held goes
        # first, else they would wait for it until their timeouts
        assert session.cluster()["workers"]
        np.testing.assert_array_equal(y.to_numpy(timeout=30), np.full(4, 2.0))
        z = inc(y)
    np.testing.assert_array_equal(np.asarray(z), np.full(4, 3.0))


def test_futures_fetch_and_device_get(session):
    s = new_slice(2)
    f = pw.jit(lambda x: [x, x * 2], mesh=s.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))
    out = f(np.arange(6, dtype=np.int32))
    assert isinstance(out[0], pw.Array) and out[0].shape == (6,) and out[0].dtype == np.int32
    assert out[1].block_until_ready() is out[1] and out[1].is_ready()
    got = pw.device_get({"a": out, "b": 3})
    np.testing.assert_array_equal(got["a"][1], np.arange(6) * 2)
    assert got["b"] == 3
    assert np.asarray(out[0], dtype=np.float64).dtype == np.float64
    put = pw.device_put({"w": np.ones((2, 2), np.float64)}, pw.NamedSharding(s.mesh("x"), pw.P("x")))
    assert put["w"].dtype == np.float32  # canonicalized like JAX without x64
    np.testing.assert_array_equal(np.asarray(put["w"]), np.ones((2, 2)))


def test_deletes_return_worker_stores_to_empty(cluster):
    session = pw.connect(cluster.address)
    try:
        s = new_slice(2)
        f = pw.jit(lambda x: (x + 1, x * 2), mesh=s.mesh("x"))
        arrays = [f(np.float32(i)) for i in range(20)]
        kept = arrays[0][0]
        wait_until(lambda: session_handles(cluster.address, session.id) == 40, what="40 live buffers")
        arrays[1][0].delete()
        with pytest.raises(pw.ArrayDeletedError, match="was deleted"):
            np.asarray(arrays[1][0])
        del arrays
        wait_until(lambda: session_handles(cluster.address, session.id) == 1, what="dropped arrays freed")
        assert float(np.asarray(kept)) == 1.0
        del kept
        wait_until(lambda: session_handles(cluster.address, session.id) == 0, what="an empty store")
    finally:
        pw.disconnect()


def test_intermediates_and_transfer_copies_are_not_kept(cluster):
    session = pw.connect(cluster.address)
    try:
        s1, s2 = new_slice(4), new_slice(4)
        assert s1.workers != s2.workers
        a = pw.pmap(lambda x: x + 1, devices=s1.devices)
        b = pw.pmap(lambda x: x * 3, devices=s2.devices)

        @pw.program
        def f(x):
            return a(b(a(b(x))))

        out = f(np.zeros(4, np.float32))
        np.testing.assert_array_equal(np.asarray(out), np.full(4, 4.0))
        wait_until(lambda: session_handles(cluster.address, session.id) == 1,
                   what="only the program output left (its input was a temporary put)")
    finally:
        pw.disconnect()


def test_compilation_starts_at_registration_and_is_shared_by_fingerprint(cluster, session):
    s = new_slice(2)
    worker = next(w["address"] for w in status(cluster.address)["workers"] if w["worker"] == s.workers[0])
    before = worker_stats(worker)

    def body(x):
        return jnp.cos(x) * 7.25

    first = pw.jit(body, mesh=s.mesh("x"))
    twin = pw.jit(body, mesh=s.mesh("x"))
    args = (np.zeros(3, np.float32),)
    leaves, treedef = jax.tree.flatten(args)
    avals = [((3,), np.dtype(np.float32))]
    first.specialize(treedef, avals, args)  # registers the function; nothing runs
    wait_until(lambda: worker_stats(worker)["compiled"] == before["compiled"] + 1,
               what="the worker to compile the function without a call")
    np.testing.assert_allclose(np.asarray(twin(*args)), np.full(3, 7.25))
    after = worker_stats(worker)
    assert after["executables"] == before["executables"] + 1, "the twin must reuse the executable"
