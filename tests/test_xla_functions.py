""""xla" functions end to end: a StableHLO portable artifact and xla CompileOptions, as an
IFRT proxy client sends them, compiled by the workers of a real local cluster (island 0:
two hosts of one device, one jax.distributed group; island 1: one host of two devices),
run as a one-node program on arrays put where the executable's metadata says, fetched
and compared with local JAX."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compiler, xla_bridge
from jax._src.lib import xla_client
from jax.sharding import NamedSharding, PartitionSpec as P

import pathways as pw
from pathways import errors
from pathways.client.compiled import abstract_mesh
from pathways.hlo import replicated
from pathways.ir import Layout, Node, ProgramGraph
from pathways.protocol import messages as m
from pathways.wire import codec
from pathways.worker.xla import aliased_parameters, signature
from pathways.cluster import worker_stats
from tests.conftest import running_cluster

WAIT = 120.0


@pytest.fixture(scope="module")
def islands():
    yield from running_cluster(pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=1, devices_per_host=2))


@pytest.fixture(scope="module")
def session(islands):
    pw.connect(islands.address)
    yield pw.default_session()
    pw.disconnect()


def slice_of(session, count, island):
    reply = session.request(lambda req: m.SliceRequest(req, "cpu", count, None, island, False))
    return reply, dict(zip(reply.workers, reply.addresses)), tuple(zip(reply.devices[::2], reply.devices[1::2]))


def artifact(f, avals, n, donate=()):
    """What the IFRT client sends: the StableHLO of ``jax.jit(f)`` over ``n`` partitions
    (``avals``: ShapeDtypeStructs with shardings on an abstract mesh), and its options."""
    exported = jax.export.export(jax.jit(f, donate_argnums=donate))(*avals)
    return exported.mlir_module_serialized, compile_options(n)


def compile_options(n):
    """The serialized CompileOptionsProto an IFRT client sends for ``n`` partitions."""
    options = compiler.get_compile_options(num_replicas=1, num_partitions=n,
                                           device_assignment=np.arange(n).reshape(1, n))
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = True
    return options.SerializeAsString()


def run_xla(session, addresses, compiled, fn, inputs):
    """Put ``inputs`` where ``compiled`` says the parameters live, run ``fn`` as a
    one-node program, and fetch its outputs."""
    handles = []
    for value, layout in zip(inputs, compiled.ins):
        h = session.allocate(1)
        session.put(tuple(addresses[w] for w in layout.workers), h, layout, value)
        handles.append(h)
    n_in, n_out = len(inputs), len(compiled.outs)
    types = [(np.dtype(x.dtype).name, tuple(x.shape)) for x in inputs] + [(d, tuple(s)) for d, s in compiled.out_types]
    graph = ProgramGraph(n_in + n_out, tuple(range(n_in)), (Node(fn, tuple(range(n_in)), tuple(range(n_in, n_in + n_out))),),
                         tuple(range(n_in, n_in + n_out)), tuple(types))
    program = session.allocate(1)
    session.send(m.DefineProgram(program, graph, "parallel"))
    base = session.allocate(graph.nvalues)
    session.send(m.Run(program, base, dict(enumerate(handles))))
    return [session.fetch(tuple(addresses[w] for w in layout.workers), base + n_in + i, WAIT, True)
            for i, layout in enumerate(compiled.outs)]


def test_a_one_device_function_compiles_on_a_host_of_a_multi_host_island_and_runs(session):
    reply, addresses, devices = slice_of(session, 2, 0)
    second = devices[1]  # the host of rank 1: it compiles alone and reports
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    blob, options = artifact(lambda a: jnp.sin(a) * 2 + 1, [jax.ShapeDtypeStruct(x.shape, x.dtype)], 1)
    fn, future = session.define_xla(reply.slice, "elementwise", blob, options, (second,))
    compiled = future.result(WAIT)
    worker = reply.workers[devices.index(second)]
    assert compiled.error == "" and compiled.fn == fn
    assert compiled.ins == compiled.outs == (Layout((worker,), (second,), (1,), ("r",), ()),)
    assert compiled.in_shardings == compiled.out_shardings == (replicated(),), "one device: replicated, not None"
    assert compiled.out_types == (("float32", (2, 3)),) and compiled.in_layouts == compiled.out_layouts == ((1, 0),)
    assert compiled.donated == () and compiled.name.startswith("jit_")
    assert re.fullmatch("[0-9a-f]{64}", compiled.fingerprint), compiled.fingerprint  # a SHA-256, in hex
    assert_analysis_is_local_jaxs(compiled.analysis, lambda a: jnp.sin(a) * 2 + 1, x)
    assert "sine(" in compiled.analysis.text
    [y] = run_xla(session, addresses, compiled, fn, [x])
    np.testing.assert_array_equal(y, np.asarray(jax.jit(lambda a: jnp.sin(a) * 2 + 1)(x)))


def assert_analysis_is_local_jaxs(analysis, f, *args):
    """What the worker's XLA said of its compile of ``f`` (Compiled.analysis) is what local
    JAX's compile of it on one CPU device says: the same cost and memory figures, and HLO
    text naming the same module."""
    local = jax.jit(f).lower(*args).compile()
    assert dict(analysis.cost) == local.cost_analysis() and local.cost_analysis()["flops"] > 0
    memory = local.memory_analysis()
    assert dict(analysis.memory) == {k: getattr(memory, k) for k in m.MEMORY_STATS}
    assert analysis.text.startswith(local.as_text().split(",")[0] + ",")


def test_a_sharded_matmul_on_two_devices_of_one_host_in_the_order_given(session):
    reply, addresses, devices = slice_of(session, 2, 1)
    order = (devices[1], devices[0])  # logical device 0 is the host's second device
    mesh = abstract_mesh((2,), ("x",))
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    b = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    f = jax.jit(lambda a, b: a @ b, in_shardings=(rows, whole), out_shardings=rows)
    blob, options = artifact(f, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows),
                                 jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=whole)], 2)
    fn, future = session.define_xla(reply.slice, "matmul", blob, options, order)
    compiled = future.result(WAIT)
    worker, = reply.workers
    assert compiled.ins[0] == Layout((worker,), order, (2, 1), ("t0", "t1"), ("t0", None))
    assert compiled.ins[1] == Layout((worker,), order, (2,), ("r",), ())
    assert compiled.outs == (compiled.ins[0],) and compiled.out_types == (("float32", (8, 3)),)
    [y] = run_xla(session, addresses, compiled, fn, [a, b])
    np.testing.assert_allclose(y, a @ b, rtol=1e-6)


def test_tokens_and_int4_across_both_hosts_of_an_island(session):
    """A token parameter and token outputs are empty bool arrays, as JAX passes tokens, with
    default layouts (XLA reports none); an int4 array computes as on local JAX. The
    executable stays out of the compile cache these tests share: XLA crashes the hosts
    serializing a multi-host executable that takes a token."""
    reply, addresses, devices = slice_of(session, 2, 0)
    rows = NamedSharding(abstract_mesh((2,), ("x",)), P("x"))
    f = jax.jit(lambda t, a: (t, a * 3, jax.lax.create_token()), in_shardings=(None, rows),
                out_shardings=(None, rows, None))
    x = (np.arange(8) % 5 - 2).astype(jnp.int4)
    # jax.export takes no token parameter: the lowered module's text, which workers compile too
    lowered = f.trace(jax.lax.create_token(), jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)).lower(
        lowering_platforms=("cpu",))
    fn, future = session.define_xla(reply.slice, "tokens", lowered.as_text().encode(), compile_options(2), devices)
    compiled = future.result(WAIT)
    assert compiled.out_types == (("bool", (0,)), ("int4", (8,)), ("bool", (0,)))
    assert compiled.in_layouts == ((0,), (0,)) and compiled.out_layouts == ((0,), (0,), (0,))
    assert compiled.outs[1].workers == tuple(reply.workers), "the int4 output lies on both hosts"
    for k in range(2):  # the second run reuses the executable
        v = (np.arange(8) % 5 - 2 + k).astype(jnp.int4)
        passed, y, made = run_xla(session, addresses, compiled, fn, [np.zeros(0, bool), v])
        assert y.dtype == jnp.int4
        np.testing.assert_array_equal(y, np.asarray(jax.jit(lambda a: a * 3)(v)))
        for token in (passed, made):
            assert token.dtype == np.bool_ and token.shape == (0,), token


# Two parameters tiled over the same devices in opposite orders: XLA's tile assignment lists
# the first's devices as 1,0, so its layout's mesh is in another order than the executable's
# devices (as an iota tile assignment with a transpose, devices=[2,2]<=[2,2]T(1,0), is).
_OPPOSITE_ORDERS = """
module @opposite attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<4x2xf32> {mhlo.sharding = "{devices=[2,1]1,0}"},
                         %b: tensor<4x2xf32> {mhlo.sharding = "{devices=[2,1]0,1}"})
      -> (tensor<4x2xf32> {mhlo.sharding = "{devices=[2,1]1,0}"}) {
    %0 = stablehlo.multiply %a, %a : tensor<4x2xf32>
    %1 = stablehlo.add %0, %b : tensor<4x2xf32>
    return %1 : tensor<4x2xf32>
  }
}
"""


@pytest.mark.parametrize("island", [0, 1], ids=["two hosts", "one host"])
def test_parameters_laid_out_in_another_device_order_than_the_executables(session, island):
    reply, addresses, devices = slice_of(session, 2, island)
    fn, future = session.define_xla(reply.slice, "opposite", _OPPOSITE_ORDERS.encode(), compile_options(2), devices)
    compiled = future.result(WAIT)
    assert compiled.ins[0].devices == devices[::-1] and compiled.ins[1].devices == devices
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    b = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
    [y] = run_xla(session, addresses, compiled, fn, [a, b])
    np.testing.assert_array_equal(y, a * a + b)


def _psum_artifact():
    mesh = abstract_mesh((2,), ("x",))
    rows = NamedSharding(mesh, P("x"))

    def total(x):
        return jax.shard_map(lambda s: jax.lax.psum(s, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    f = jax.jit(total, in_shardings=rows, out_shardings=NamedSharding(mesh, P()))
    return (*artifact(f, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)], 2), x)


def test_a_psum_across_both_hosts_of_an_island(session):
    reply, addresses, devices = slice_of(session, 2, 0)
    blob, options, x = _psum_artifact()
    fn, future = session.define_xla(reply.slice, "psum", blob, options, devices)
    compiled = future.result(WAIT)
    assert compiled.ins[0].workers == tuple(reply.workers) and compiled.ins[0].devices == devices
    assert compiled.outs[0] == Layout(tuple(reply.workers), devices, (2,), ("r",), ())
    [y] = run_xla(session, addresses, compiled, fn, [x])
    np.testing.assert_array_equal(y, x[:2] + x[2:])
    [again] = run_xla(session, addresses, compiled, fn, [x * 2])  # the compiled executable again
    np.testing.assert_array_equal(again, 2 * (x[:2] + x[2:]))


def test_a_host_whose_input_is_poisoned_keeps_its_peer_company_in_the_collective(session):
    """Host 1 of island 0 holds a poisoned part of the input, host 0 a good one: host 1
    runs the executable on placeholders, so host 0's psum completes instead of hanging,
    the output is poisoned, and the island goes on serving."""
    reply, addresses, devices = slice_of(session, 2, 0)
    blob, options, x = _psum_artifact()
    fn, future = session.define_xla(reply.slice, "psum", blob, options, devices)
    compiled = future.result(WAIT)
    layout = compiled.ins[0]
    h = session.allocate(1)
    good, bad = (addresses[w] for w in layout.workers)
    session.put((good,), h, layout, x)
    header = codec.pack({"t": "put", "handle": h, "layout": layout.to_wire(), "of": 1,
                         "credential": session._stubs(bad).credential, "poison": "this part is broken on purpose"})
    assert "error" not in codec.unpack(session._stubs(bad).put(iter([header]), timeout=WAIT))
    program = session.allocate(1)
    session.send(m.DefineProgram(program, ProgramGraph(2, (0,), (Node(fn, (0,), (1,)),), (1,),
                                                       (("float32", x.shape), ("float32", (2, 2)))), "parallel"))
    base = session.allocate(2)
    session.send(m.Run(program, base, {0: h}))
    assert session.fetch((good,), base + 1, WAIT, False), "the healthy host's collective completed"
    with pytest.raises(errors.RemoteError, match="broken on purpose"):
        session.fetch((bad,), base + 1, WAIT, True)
    [y] = run_xla(session, addresses, compiled, fn, [x])
    np.testing.assert_array_equal(y, x[:2] + x[2:])


def test_donated_parameters_and_the_compile_cache(session):
    reply, addresses, devices = slice_of(session, 2, 1)
    x = np.ones((4,), np.float32)
    blob, options = artifact(lambda a, b: (a + b, b * 2), [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2, 1, donate=(0,))
    worker = addresses[reply.workers[0]]
    fn, future = session.define_xla(reply.slice, "donating", blob, options, devices[:1])
    first = future.result(WAIT)
    assert first.donated == (0,) and len(first.ins) == 2 and len(first.outs) == 2
    cached = worker_stats(worker)["executables"]
    again = session.define_xla(reply.slice, "donating", blob, options, devices[:1])[1].result(WAIT)
    assert again.fingerprint == first.fingerprint and worker_stats(worker)["executables"] == cached
    assert again.donated == (0,), "an executable from the compile cache says what it aliases"
    elsewhere = session.define_xla(reply.slice, "donating", blob, options, devices[1:])[1].result(WAIT)
    assert elsewhere.fingerprint != first.fingerprint, "the devices are part of the fingerprint"
    y, z = run_xla(session, addresses, first, fn, [x, x * 3])
    np.testing.assert_array_equal(y, x * 4)
    np.testing.assert_array_equal(z, x * 6)


def test_a_parameter_offered_for_donation_that_no_output_can_take_is_not_donated(session):
    # both offered; XLA aliases b with b + 1 and finds no output of a's shape (the proxy
    # client deletes what the executable reports donated: a must stay usable)
    reply, addresses, devices = slice_of(session, 2, 1)
    rows = NamedSharding(abstract_mesh((2,), ("x",)), P("x"))
    avals = [jax.ShapeDtypeStruct((8, 2), np.float32, sharding=rows),
             jax.ShapeDtypeStruct((8,), np.float32, sharding=rows)]
    blob, options = artifact(lambda a, b: (a @ a.T, b + 1), avals, 2, donate=(0, 1))
    assert signature("unusable", blob)[2] == [0, 1]
    fn, future = session.define_xla(reply.slice, "unusable", blob, options, devices)
    compiled = future.result(WAIT)
    assert compiled.error == "" and compiled.donated == (1,)
    a, b = np.arange(16, dtype=np.float32).reshape(8, 2), np.ones((8,), np.float32)
    y, z = run_xla(session, addresses, compiled, fn, [a, b])
    np.testing.assert_array_equal(y, a @ a.T)
    np.testing.assert_array_equal(z, b + 1)


def test_the_aliased_parameter_of_an_executable_taking_its_arguments_as_one_tuple():
    # XLA names the tuple (parameter 0) and the element's index in it
    avals = [jax.ShapeDtypeStruct((4,), np.float32), jax.ShapeDtypeStruct((3,), np.float32)]
    with pytest.warns(UserWarning, match="donated buffers were not usable"):  # a's: no output fits it
        blob, options = artifact(lambda a, b: (a @ a, b + 1), avals, 1, donate=(0, 1))
    tupled = xla_client.CompileOptions.ParseFromString(options)
    tupled.parameter_is_tupled_arguments = True
    loaded = xla_bridge.get_backend().compile_and_load(blob, xla_client.DeviceList(tuple(jax.devices()[:1])), tupled)
    assert aliased_parameters(loaded, tupled=True) == (1,)


def test_compile_errors_reach_the_caller_and_runs_of_the_function_fail(session):
    reply, addresses, devices = slice_of(session, 2, 1)
    x = np.ones((4,), np.float32)
    blob, options = artifact(lambda a: a + 1, [jax.ShapeDtypeStruct(x.shape, x.dtype)], 1)
    cases = [  # the workers' compile errors, and the controller's refusal of a bad definition
        (b"not an artifact", options, devices[:1], errors.RemoteError, "no StableHLO artifact"),
        (blob, b"\xff\xff garbage", devices[:1], errors.RemoteError, "CompileOptionsProto"),
        (blob, b"", devices[:1], errors.RemoteError, "0 replica\\(s\\) and 0 partition\\(s\\)"),
        (blob, options, devices, errors.RemoteError, "1 replica\\(s\\) x 1 partition\\(s\\) but given 2 device"),
        (blob, options, ((0, 7),), errors.WireError, "outside slice"),
    ]
    for artifact_bytes, opts, devs, error, needle in cases:
        fn, future = session.define_xla(reply.slice, "broken", artifact_bytes, opts, devs)
        with pytest.raises(error, match=needle):
            future.result(WAIT)
    fn, future = session.define_xla(reply.slice, "broken", b"not an artifact", options, devices[:1])
    with pytest.raises(errors.RemoteError):
        future.result(WAIT)
    layout = Layout(tuple(reply.workers), devices[:1], (1,), ("r",), ())
    fake = m.Compiled(fn, "", (layout,), (layout,), (("float32", (4,)),), (replicated(),), (replicated(),),
                      ((0,),), ((0,),), (), "", "")
    with pytest.raises(errors.RemoteError, match="did not compile: .*no StableHLO artifact"):
        run_xla(session, addresses, fake, fn, [x])
    # the workers keep serving
    fn, future = session.define_xla(reply.slice, "fine", blob, options, devices[:1])
    [y] = run_xla(session, addresses, future.result(WAIT), fn, [x])
    np.testing.assert_array_equal(y, x + 1)
