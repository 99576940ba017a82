"""Colocated Python (``jax.experimental.colocated_python``): a worker running a pickled
function over real gRPC against hostile callers, the front end's parsing of JAX's
programs, and unmodified JAX through the IFRT proxy on a cluster of two hosts, each
running the function on its own shards."""

import numpy as np
import pytest

import jax
import pathways as pw
from pathways.errors import AccessDeniedError
from pathways.ifrt import colocated
from pathways.ifrt import types as t
from pathways.proto.xla.python.ifrt import array_spec_pb2, custom_call_program_pb2
from pathways.protocol import messages as m
from pathways.protocol import operator
from pathways.protocol.handles import first_handle
from pathways.worker import jax_private
from pathways.worker.core import WorkerCore
from pathways.worker.store import Poison
from tests.ifrt_helpers import run_jax
from tests.test_worker_core import LAYOUT, put
from tests.test_worker_core import served as worker_served

CREDENTIAL = b"7" * m.CREDENTIAL_BYTES  # session 7's
OTHER = b"x" * m.CREDENTIAL_BYTES
CLIENT_ID = 40  # the client's id of the worker's one device (a front end numbers devices its own way)


@pytest.fixture
def served():
    """A worker core behind a real gRPC server in this process; its Colocated stub."""
    core = WorkerCore(lambda msg: None, wait_timeout=5.0, colocated_python=True)
    with worker_served(core, {7: CREDENTIAL}) as stub:
        yield core, stub("Colocated")


def pickled(fun, args, results):
    """What JAX's colocated_python sends for ``fun`` taking ``args`` and returning
    ``results``, the worker's one device named by the client's id CLIENT_ID."""
    device = jax.devices()[0]
    in_leaves, in_tree = jax.tree_util.tree_flatten((tuple(args), {}))
    out_leaves, out_tree = jax.tree_util.tree_flatten(results)
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = lambda leaves: tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in leaves)  # noqa: E731
    with jax_private.colocated_device_ids({CLIENT_ID: device}) as s:
        return s._serialize((fun, in_tree, specs(in_leaves), out_tree, specs(out_leaves), s.DeviceList((device,))))


def call(stub, program, inputs, outputs, credential=CREDENTIAL, wait=10.0):
    request = m.ColocatedRequest(7, credential, program, (CLIENT_ID,), (0, 0), tuple(inputs), tuple(outputs), wait)
    return operator.answer(operator.COLOCATED_REPLY, stub(m.pack(request.encode()), timeout=30.0))


def test_a_worker_runs_the_function_on_its_arrays_and_stores_the_results(served):
    core, stub = served
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    x, out = first_handle(7) + 1, first_handle(7) + 2
    put(core, x, value, {7: CREDENTIAL})
    program = pickled(lambda a: a * 3.0 + 1.0, [value], value)
    assert call(stub, program, [x], [m.ColocatedOutput(out, LAYOUT)]).texts == ()
    np.testing.assert_array_equal(np.asarray(core.store.get(out)), value * 3.0 + 1.0)


def test_another_sessions_credential_runs_nothing_and_a_raising_function_poisons_its_results(served):
    core, stub = served
    value = np.ones(4, np.float32)
    x = first_handle(7) + 1
    put(core, x, value, {7: CREDENTIAL})
    ran = []
    with pytest.raises(AccessDeniedError):
        call(stub, pickled(lambda a: ran.append(1) or a, [value], value), [x],
             [m.ColocatedOutput(first_handle(7) + 2, LAYOUT)], credential=OTHER)
    assert core.store.get(first_handle(7) + 2) is None

    def no_data(a):
        raise LookupError("no shard of the dataset here")
    with pytest.raises(pw.RemoteError, match=r"LookupError: no shard of the dataset here \(raised in no_data, line \d+\)"):
        call(stub, pickled(no_data, [value], value), [x], [m.ColocatedOutput(first_handle(7) + 3, LAYOUT)])
    poison = core.store.get(first_handle(7) + 3)
    assert type(poison) is Poison and "no shard of the dataset here" in poison.message
    # results the specs do not describe, and inputs never computed, fail as clearly
    with pytest.raises(pw.RemoteError, match=r"result 0 is a int32\[4\] array; its spec says float32\[4\]"):
        call(stub, pickled(lambda a: a.astype(np.int32), [value], value), [x],
             [m.ColocatedOutput(first_handle(7) + 4, LAYOUT)])
    with pytest.raises(pw.DeadlineExceededError, match="was not computed within 0.2 s"):
        call(stub, pickled(lambda a: a, [value], value), [first_handle(7) + 99],
             [m.ColocatedOutput(first_handle(7) + 5, LAYOUT)], wait=0.2)
    # and the worker keeps serving
    call(stub, pickled(lambda a: a + 1.0, [value], value), [x], [m.ColocatedOutput(first_handle(7) + 6, LAYOUT)])
    np.testing.assert_array_equal(np.asarray(core.store.get(first_handle(7) + 6)), value + 1.0)


UNPICKLED = []


def _mark(what):
    UNPICKLED.append(what)


class _Unpickled:
    """A pickle whose reading alone leaves a mark: what a hostile call would send."""

    def __reduce__(self):
        return _mark, ("read",)


def test_a_call_with_another_sessions_credential_or_arrays_reads_no_pickle(served):
    import pickle
    core, stub = served
    hostile = pickle.dumps(_Unpickled())
    pickle.loads(hostile)
    assert UNPICKLED == ["read"]  # the mark works
    UNPICKLED.clear()
    with pytest.raises(AccessDeniedError, match="the credential presented is not that session's"):
        call(stub, hostile, [], [], credential=OTHER)  # no array named: the session is checked all the same
    core.on_batch(m.encode_batch([m.SessionOpen(8, m.digest(OTHER))]))
    put(core, first_handle(7) + 1, np.ones(2, np.float32), {7: CREDENTIAL})
    with pytest.raises(AccessDeniedError, match="is not that session's"):
        request = m.ColocatedRequest(8, OTHER, hostile, (CLIENT_ID,), (0, 0), (first_handle(7) + 1,), (), 5.0)
        operator.answer(operator.COLOCATED_REPLY, stub(m.pack(request.encode()), timeout=30.0))
    assert UNPICKLED == [] and type(core.store.get(first_handle(7) + 1)) is not Poison


def test_a_worker_its_operator_did_not_allow_runs_no_colocated_python():
    core = WorkerCore(lambda msg: None, wait_timeout=5.0)
    core.on_batch(m.encode_batch([m.SessionOpen(7, m.digest(CREDENTIAL))]))
    value = np.ones(4, np.float32)
    put(core, first_handle(7) + 1, value, {7: CREDENTIAL})
    ran = []
    request = m.ColocatedRequest(7, CREDENTIAL, pickled(lambda a: ran.append(1) or a, [value], value), (CLIENT_ID,),
                                 (0, 0), (first_handle(7) + 1,), (m.ColocatedOutput(first_handle(7) + 2, LAYOUT),), 5.0)
    try:
        with pytest.raises(AccessDeniedError, match="its operator did not allow that .*--colocated-python"):
            core.run_colocated(request, lambda: True)
        assert not ran
    finally:
        core.close()


def test_malformed_colocated_requests_are_refused_saying_why(served):
    _, stub = served
    with pytest.raises(pw.WireError, match="the worker refused a colocated Python call"):
        operator.answer(operator.COLOCATED_REPLY, stub(b"\x93garbage", timeout=10.0))
    with pytest.raises(pw.WireError, match="names 1 device ids but 2"):
        bad = m.ColocatedRequest(7, CREDENTIAL, b"", (1,), (0, 0, 0, 1), (), (), 1.0)
        operator.answer(operator.COLOCATED_REPLY, stub(m.pack(bad.encode()), timeout=10.0))


def test_jaxs_custom_call_programs_parse_and_others_are_refused_saying_why():
    def spec(kind, dims, devices=(0, 1)):
        return array_spec_pb2.ArraySpecProto(
            dtype={"kind": kind}, shape={"dims": list(dims)},
            sharding=t.sharding_proto(t.replicated(tuple(devices))))

    def program(**fields):
        proto = custom_call_program_pb2.CustomCallProgramProto(
            type=colocated.COLOCATED_PYTHON, name="f", serialized_program_text=b"pickle",
            devices={"device_ids": [0, 1]}, input_specs=[spec(11, (4,))], output_specs=[spec(99, ())])
        for name, value in fields.items():
            proto.ClearField(name)
            getattr(proto, name).extend(value) if isinstance(value, list) else setattr(proto, name, value)
        return proto.SerializeToString()

    parsed = colocated.parse_program(program(), 4)
    assert parsed.devices == (0, 1) and parsed.inputs[0].dtype == np.float32 and parsed.outputs[0].dtype is None
    with pytest.raises(t.IfrtError, match="of type 'other' are not supported"):
        colocated.parse_program(program(type="other"), 4)
    with pytest.raises(t.IfrtError, match="not all among the colocated function's"):
        colocated.parse_program(program(input_specs=[spec(11, (4,), (0, 3))]), 4)
    with pytest.raises(t.IfrtError, match="string arguments"):
        colocated.parse_program(program(input_specs=[spec(99, ())]), 4)
    with pytest.raises(t.IfrtError, match="string results must be replicated scalars"):
        colocated.parse_program(program(output_specs=[spec(99, (2,))]), 4)
    with pytest.raises(t.IfrtError, match="does not parse"):
        colocated.parse_program(b"\xff\xff", 4)


def test_string_arrays_go_to_the_client_as_the_proxy_protocol_carries_them():
    value = np.array(["ab", "", "é" * 70], dtype=np.dtypes.StringDType())
    assert t.string_host_buffer(value) == b"\x0a\x02ab" + b"\x0a\x00" + b"\x0a\x8c\x01" + "é".encode() * 70
    assert t.dtype_proto(value.dtype).kind == 99


# ---- unmodified JAX through the IFRT proxy, on two hosts ------------------------------------

SCRIPT = """
import json, os
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import colocated_python
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh

mesh = Mesh(np.array(colocated_python.colocated_cpu_devices(jax.devices())).reshape(2, 2), ("a", "b"))
xs = np.arange(32.0, dtype=np.float32).reshape(8, 4)
ys = np.arange(8, dtype=np.int32)
x = jax.device_put(xs, NamedSharding(mesh, P("a", "b")))
y = jax.device_put(ys, NamedSharding(mesh, P("a")))

@colocated_python.colocated_python
def step(x, y):
    return {"scaled": x * 2 + 1, "next": y + 1, "pid": y * 0 + os.getpid()}  # laid out as y is

calls = [step(x, y) for _ in range(3)]  # the first finds the result specs, the rest know them
exact = all(np.array_equal(np.asarray(c["scaled"]), xs * 2 + 1) and np.array_equal(np.asarray(c["next"]), ys + 1)
            for c in calls)
pids = sorted(set(np.asarray(calls[-1]["pid"]).tolist()))
total = float(jax.jit(lambda a: a.sum())(calls[-1]["scaled"]))  # a result used by a jit

@colocated_python.colocated_python
def broken(x):
    raise LookupError("no shard of the dataset here")
try:
    broken(x)
    failure = ""
except Exception as e:
    failure = f"{type(e).__name__}: {e}"
after = np.array_equal(np.asarray(step(x, y)["next"]), ys + 1)
print("RESULT " + json.dumps({"exact": exact, "pids": pids, "total": total, "failure": failure[:2000],
                              "after": after}))
"""


def test_a_colocated_function_runs_on_each_host_over_its_shards_through_the_proxy():
    with pw.local_cluster(hosts=2, devices_per_host=2, ifrt=True, colocated_python=True) as cluster:
        result = run_jax(cluster.ifrt_address.removeprefix("grpc://"), SCRIPT)
        workers = sorted(w["pid"] for w in pw.cluster.status(cluster.address)["workers"])
    assert result["exact"] and result["total"] == float((np.arange(32.0) * 2 + 1).sum()), result
    # each host ran the function on the shards it holds: the rows of "pid" are its process's
    assert result["pids"] == workers, (result, workers)
    assert "LookupError: no shard of the dataset here" in result["failure"], result
    assert result["after"], result


REFUSED = """
import json
import jax, numpy as np
from jax.experimental import colocated_python

x = jax.device_put(np.ones(4, np.float32), colocated_python.colocated_cpu_devices(jax.devices())[0])
try:
    colocated_python.colocated_python(lambda a: a + 1)(x)
    refused = ""
except Exception as e:
    refused = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps({"refused": refused[:2000], "after": float(jax.jit(lambda a: a.sum())(x))}))
"""


def test_workers_their_operator_did_not_allow_refuse_colocated_python_through_the_proxy():
    with pw.local_cluster(hosts=1, devices_per_host=2, ifrt=True) as cluster:
        result = run_jax(cluster.ifrt_address.removeprefix("grpc://"), REFUSED)
    assert "PERMISSION_DENIED" in result["refused"] and "--colocated-python" in result["refused"], result
    assert result["after"] == 4.0, result  # and the session goes on
