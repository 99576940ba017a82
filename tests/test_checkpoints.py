"""Checkpoints the workers write and read themselves (worker/checkpoints.py): where a
location may lie, blocks read back in any layout, a worker's Save and Load over real gRPC
against hostile callers, and orbax through pathwaysutils' persistence handler on a real
cluster through the IFRT proxy, whose array bytes never pass through the front end."""

import base64
import json
import os
import time

import ml_dtypes
import numpy as np
import pytest

import pathways as pw
from pathways.errors import AccessDeniedError, WireError
from pathways.ifrt import persistence
from pathways.ifrt import types as t
from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol import operator
from pathways.protocol.handles import first_handle
from pathways.wire import codec
from pathways.worker import checkpoints
from pathways.worker.core import WorkerCore
from pathways.worker.sessions import WAITING_FETCHES_PER_SESSION
from tests.conftest import wait_until
from tests.ifrt_helpers import run_jax
from tests.test_worker_core import put
from tests.test_worker_core import served as worker_served

CREDENTIAL = b"7" * m.CREDENTIAL_BYTES  # session 7's
OTHER = b"x" * m.CREDENTIAL_BYTES
ONE_DEVICE = Layout((0,), ((0, 0),), (1,), ("d",), ())


# ---- where a checkpoint may lie ---------------------------------------------------------

def test_a_location_is_read_under_the_checkpoint_directory_and_nowhere_else(tmp_path):
    root = os.path.realpath(tmp_path)
    assert checkpoints.checkpoint_path(root, "gs://bucket/run/7", 0) == os.path.join(root, "bucket", "run", "7")
    assert checkpoints.checkpoint_path(root, "run/7", 0) == os.path.join(root, "run", "7")
    assert checkpoints.checkpoint_path(root, os.path.join(root, "a"), 0) == os.path.join(root, "a")
    (tmp_path / "link").symlink_to("/etc")
    for outside in ("/etc/x", "../x", "gs://../../etc", os.path.join(root, "link", "x")):
        with pytest.raises(AccessDeniedError, match="only under"):
            checkpoints.checkpoint_path(root, outside, 3)
    with pytest.raises(AccessDeniedError, match="--checkpoint-dir"):
        checkpoints.checkpoint_path(None, "run/7", 3)
    with pytest.raises(WireError, match="NUL"):
        checkpoints.checkpoint_path(root, "a\0b", 3)


def test_a_block_is_read_from_saved_blocks_cut_another_way(tmp_path):
    value = np.arange(48, dtype=np.float32).reshape(6, 8)
    for region in (((0, 3), (0, 8)), ((3, 6), (0, 4)), ((3, 6), (4, 8))):  # rows split, then a quarter each
        checkpoints.write_block(str(tmp_path), region, value[tuple(slice(a, b) for a, b in region)])
    blocks = checkpoints.saved_blocks(str(tmp_path))
    assert sorted(blocks) == [((0, 3), (0, 8)), ((3, 6), (0, 4)), ((3, 6), (4, 8))]
    for wanted in (((0, 6), (0, 8)), ((2, 5), (3, 6)), ((0, 3), (0, 8))):
        got = checkpoints.read_region(blocks, wanted, np.dtype(np.float32), "c")
        np.testing.assert_array_equal(got, value[tuple(slice(a, b) for a, b in wanted)])
    del blocks[((3, 6), (4, 8))]
    with pytest.raises(pw.RemoteError, match="does not hold all of block"):
        checkpoints.read_region(blocks, ((0, 6), (0, 8)), np.dtype(np.float32), "c")
    with pytest.raises(pw.RemoteError, match="holds float32 values, not int32"):
        checkpoints.read_region(blocks, ((0, 3), (0, 8)), np.dtype(np.int32), "c")


def test_blocks_of_ml_dtypes_and_scalars_read_back_exactly(tmp_path):
    bf16 = np.dtype(ml_dtypes.bfloat16)
    value = (np.arange(6, dtype=np.float32) / 7).astype(bf16)
    checkpoints.write_block(str(tmp_path), ((0, 6),), value)
    got = checkpoints.read_region(checkpoints.saved_blocks(str(tmp_path)), ((0, 6),), bf16, "c")
    assert got.dtype == bf16 and got.tobytes() == value.tobytes()
    scalar = tmp_path / "s"
    scalar.mkdir()
    checkpoints.write_block(str(scalar), (), np.array(2.5, np.float64))
    assert checkpoints.read_region(checkpoints.saved_blocks(str(scalar)), (), np.dtype(np.float64), "c") == 2.5


# ---- the persistence programs the front end takes ---------------------------------------

def _request(kind="persistenceWriteRequest", **fields):
    item = {"b64_location": base64.b64encode(b"gs://b/ckpt").decode(), "b64_name": base64.b64encode(b"w").decode(),
            "b64_hlo_sharding_string": "", "shape": [4, 2], "devices": {"device_ids": [0, 1]},
            "timeout": {"seconds": 60, "nanos": 0}, **fields}
    return b"__serialized_plugin_program " + json.dumps({kind: item}).encode()


def _parsed(data, ndevices):
    """The persistence program a PluginProgram's bytes hold, parsed as the front end does."""
    return persistence.persistence_program(*persistence.plugin_request(data), ndevices)


def test_persistence_programs_parse_and_malformed_ones_are_refused_saying_why():
    program = _parsed(_request(), 4)
    assert program.write and program.devices == (0, 1)
    assert program.arrays[0].path == "gs://b/ckpt/w" and program.arrays[0].shape == (4, 2)
    read = _parsed(_request("persistenceReadRequest",
                                              shape={"xla_primitive_type_str": "BF16", "dimensions": [4, 2]}), 4)
    assert not read.write and read.arrays[0].dtype == np.dtype(ml_dtypes.bfloat16)
    bulk = b"__serialized_plugin_program " + json.dumps({"bulk_persistence_write_request": {"write_requests": [
        json.loads(_request()[len("__serialized_plugin_program "):])["persistenceWriteRequest"]] * 2}}).encode()
    assert len(_parsed(bulk, 4).arrays) == 2
    for data, needle in [
            (b"{}", "must start with"),
            (b"__serialized_plugin_program {", "not JSON"),
            (_request(devices={"device_ids": [0, 9]}), "distinct devices"),
            (_request(b64_name=base64.b64encode(b"../x").decode()), "one path component"),
            (_request(b64_location="%%%"), "base64"),
            (_request(b64_hlo_sharding_string="AAAA"), "HloSharding"),
            (_request(shape="4"), "list of dimensions"),
            (_request("persistenceReadRequest", shape={"xla_primitive_type_str": "S4"}), "xla_primitive_type_str")]:
        with pytest.raises(t.IfrtError, match=needle) as info:
            _parsed(data, 4)
        assert info.value.code == t.INVALID_ARGUMENT, data
    with pytest.raises(t.IfrtError, match="not supported") as info:
        _parsed(b'__serialized_plugin_program {"reshardRequest": {}}', 4)
    assert info.value.code == t.UNIMPLEMENTED


# ---- a worker's Save and Load over real gRPC --------------------------------------------

@pytest.fixture
def served(tmp_path):
    """A worker core allowed ``tmp_path`` for checkpoints, behind a real gRPC server in this
    process; its Save, Load and Fetch stubs."""
    core = WorkerCore(lambda msg: None, wait_timeout=5.0, checkpoint_dir=str(tmp_path))
    with worker_served(core, {7: CREDENTIAL}) as stub:
        yield core, {"Save": stub("Save"), "Load": stub("Load"), "Fetch": stub("Fetch", "unary_stream")}


def _call(stub, request, timeout=10.0):
    return operator.answer(operator.SAVED_REPLY, stub(m.pack(request.encode()), timeout=timeout))


def test_a_worker_saves_its_blocks_and_loads_them_into_a_new_array(served, tmp_path):
    core, stubs = served
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    handle = first_handle(7) + 1
    put(core, handle, value, {7: CREDENTIAL})
    full = codec.full_region(value.shape)
    assert _call(stubs["Save"], m.SaveRequest(handle, CREDENTIAL, "gs://b/c/w", (full,), 5.0)).nbytes == value.nbytes
    assert os.listdir(tmp_path / "b" / "c" / "w") == ["0-3_0-4.npy"]
    loaded = first_handle(7) + 2
    request = m.LoadRequest(loaded, CREDENTIAL, str(tmp_path / "b" / "c" / "w"), ONE_DEVICE, "float32", (3, 4))
    assert _call(stubs["Load"], request).nbytes == value.nbytes
    np.testing.assert_array_equal(np.asarray(core.store.get(loaded)), value)


def test_save_and_load_refuse_another_sessions_credential_and_places_outside_the_directory(served, tmp_path):
    core, stubs = served
    handle = first_handle(7) + 3
    put(core, handle, np.ones(2, np.float32), {7: CREDENTIAL})
    block = (codec.full_region((2,)),)
    with pytest.raises(AccessDeniedError, match="not that session's"):
        _call(stubs["Save"], m.SaveRequest(handle, OTHER, "c", block, 1.0))
    with pytest.raises(AccessDeniedError, match="only under"):
        _call(stubs["Save"], m.SaveRequest(handle, CREDENTIAL, "/etc/pathways", block, 1.0))
    with pytest.raises(AccessDeniedError, match="not that session's"):
        _call(stubs["Load"], m.LoadRequest(first_handle(7) + 4, OTHER, "c", ONE_DEVICE, "float32", (2,)))
    assert not os.path.exists("/etc/pathways") and os.listdir(tmp_path) == []


def test_malformed_or_impossible_requests_get_errors_and_the_worker_keeps_serving(served, tmp_path):
    core, stubs = served
    for method, raw in (("Save", b"\xc1"), ("Save", m.pack(["save", 1])), ("Load", m.pack(["load", "x"]))):
        with pytest.raises(WireError, match=f"the worker refused a {method.lower()}"):
            operator.answer(operator.SAVED_REPLY, stubs[method](raw, timeout=10))
    missing = first_handle(7) + 5
    with pytest.raises(pw.DeadlineExceededError, match="was not computed within 0.2 s"):
        _call(stubs["Save"], m.SaveRequest(missing, CREDENTIAL, "c", ((),), 0.2))
    held = first_handle(7) + 6
    put(core, held, np.ones(4, np.float32), {7: CREDENTIAL})
    with pytest.raises(WireError, match="holds no block"):
        _call(stubs["Save"], m.SaveRequest(held, CREDENTIAL, "c", (((0, 2),),), 1.0))
    # a load from nowhere fails, and so does what waits for its array, saying why
    lost = first_handle(7) + 7
    with pytest.raises(pw.RemoteError, match="no checkpoint at"):
        _call(stubs["Load"], m.LoadRequest(lost, CREDENTIAL, "nowhere", ONE_DEVICE, "float32", (4,)))
    reply = codec.unpack(next(iter(stubs["Fetch"](m.pack(m.FetchRequest(lost, 1.0, True, CREDENTIAL).encode()),
                                                  timeout=10))))
    assert reply["state"] == "error" and "no checkpoint at" in reply["message"], reply
    full = codec.full_region((4,))
    assert _call(stubs["Save"], m.SaveRequest(held, CREDENTIAL, "c", (full,), 1.0)).nbytes == 16
    # a load past the session's quota is refused before anything is read or allocated
    with pytest.raises(pw.ResourceExhaustedError, match="a load of float32"):
        _call(stubs["Load"], m.LoadRequest(first_handle(7) + 8, CREDENTIAL, "c", ONE_DEVICE, "float32", (1 << 50,)))
    # a block file whose header claims more than the file holds is refused, not read
    (tmp_path / "lying").mkdir()
    header = np.lib.format.header_data_from_array_1_0(np.zeros(4, np.float32))
    with open(tmp_path / "lying" / "0-4.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {**header, "shape": (1 << 40,)})
    with pytest.raises(pw.RemoteError, match=r"has shape \[1099511627776\]"):
        _call(stubs["Load"], m.LoadRequest(first_handle(7) + 9, CREDENTIAL, "lying", ONE_DEVICE, "float32", (4,)))
    # and one whose values are cut short, or run on, is refused as it is read
    for i, (name, values) in enumerate((("short", b"\0" * 12), ("long", b"\0" * 20))):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "0-4.npy", "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(values)
        with pytest.raises(pw.RemoteError, match="holds other than 16 bytes"):
            _call(stubs["Load"], m.LoadRequest(first_handle(7) + 11 + i, CREDENTIAL, name, ONE_DEVICE, "float32", (4,)))
    # an empty array reads no file
    (tmp_path / "empty").mkdir()
    assert _call(stubs["Load"], m.LoadRequest(first_handle(7) + 10, CREDENTIAL, "empty", ONE_DEVICE, "float32",
                                              (0,))).nbytes == 0


def test_a_sessions_saves_wait_on_no_more_threads_than_its_fetches_may(served):
    """A save waits for its array on a server thread: past the waits a session may hold
    (as its fetches), a save of an array not computed yet is answered at once."""
    core, stubs = served
    never = [first_handle(7) + 100 + i for i in range(WAITING_FETCHES_PER_SESSION)]
    calls = [stubs["Save"].future(m.pack(m.SaveRequest(h, CREDENTIAL, "c", ((),), 30.0).encode()), timeout=60)
             for h in never]
    wait_until(lambda: core.fetch_waits.waiting() == WAITING_FETCHES_PER_SESSION, what="the saves to wait")
    started = time.monotonic()
    with pytest.raises(pw.DeadlineExceededError, match="waits on this worker are all taken"):
        _call(stubs["Save"], m.SaveRequest(first_handle(7) + 99, CREDENTIAL, "c", ((),), 30.0))
    assert time.monotonic() - started < 5.0
    for call in calls:
        call.cancel()  # hanging up gives the waits back
    wait_until(lambda: core.fetch_waits.waiting() == 0, what="the abandoned saves to give their waits back")


# ---- orbax through pathwaysutils, on a real cluster -------------------------------------

ORBAX = """
import json, os, sys
os.environ["ENABLE_PATHWAYS_PERSISTENCE"] = "1"
import pathwaysutils
pathwaysutils.initialize()
import jax, ml_dtypes, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
values = {"w": np.arange(32, dtype=np.float32).reshape(8, 4) / 3,
          "b": np.arange(4, dtype=np.int32) - 2,
          "e": (np.arange(16, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)}
shardings = {"w": P("a", "b"), "b": P(), "e": P(("a", "b"))}
state = {k: jax.device_put(v, NamedSharding(mesh, shardings[k])) for k, v in values.items()}
jax.block_until_ready(state)
from pathways import cluster
traffic = [cluster.status(CONTROLLER)["front_end"]]  # the array bytes through the controller's process
mgr = ocp.CheckpointManager(CHECKPOINT_LOCATION)
mgr.save(0, args=ocp.args.StandardSave(state))
mgr.wait_until_finished()
same = mgr.restore(0, args=ocp.args.StandardRestore(
    {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}))
# read back into other layouts: blocks cut another way than they were saved
other = {"w": P("b", None), "b": P("a"), "e": P()}
moved = mgr.restore(0, args=ocp.args.StandardRestore(
    {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, other[k])) for k, a in state.items()}))
jax.block_until_ready((same, moved))
traffic.append(cluster.status(CONTROLLER)["front_end"])
mgr.close()
exact = {k: bool(np.asarray(same[k]).tobytes() == v.tobytes() and np.asarray(moved[k]).tobytes() == v.tobytes()
                 and moved[k].sharding.spec == other[k]) for k, v in values.items()}
# a location outside the workers' checkpoint directory, through pathwaysutils' own call
import datetime
from pathwaysutils.persistence import helper
try:
    helper.write_arrays("/tmp/elsewhere", ["w"], [state["w"]], datetime.timedelta(seconds=60)).result(timeout=120)
    refused = ""
except Exception as e:
    refused = f"{type(e).__name__}: {e}"
traffic.append(cluster.status(CONTROLLER)["front_end"])  # after the reads above
print("RESULT " + json.dumps({"exact": exact, "refused": refused[:2000], "traffic": traffic}))
"""


def test_orbax_through_pathwaysutils_persistence_saves_and_restores_on_the_workers(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    with pw.local_cluster(hosts=2, devices_per_host=2, ifrt=True, checkpoint_dir=str(root)) as cluster:
        path = str(root / "run")
        result = run_jax(cluster.ifrt_address.removeprefix("grpc://"), ORBAX.replace(
            "CHECKPOINT_LOCATION", repr(path)).replace("CONTROLLER", repr(cluster.address)))
    assert result["exact"] == {"w": True, "b": True, "e": True}, result
    # the puts' bytes passed through the controller's process, the saves' and restores' did
    # not, and the reads after them did again: the counters count
    nbytes = 32 * 4 + 4 * 4 + 16 * 2
    before, after, read = result["traffic"]
    assert before["from_clients"] >= nbytes and before["to_workers"] >= nbytes, result["traffic"]
    assert after == before, result["traffic"]
    assert read["to_clients"] >= before["to_clients"] + 2 * nbytes, result["traffic"]
    # each block read once, although "b" and "e" are held whole by both hosts once restored
    assert read["from_workers"] - after["from_workers"] == 2 * nbytes, result["traffic"]
    assert "PERMISSION_DENIED" in result["refused"] and "only under" in result["refused"], result
    assert "--checkpoint-dir" in result["refused"] and not os.path.exists("/tmp/elsewhere/w"), result
    saved = {name: sorted(os.listdir(root / "run" / "0" / "default" / name)) for name in ("w", "b", "e")}
    # each distinct block once, by the host holding it: w in quarters, b (replicated) once, e in fourths
    assert saved == {"w": ["0-4_0-2.npy", "0-4_2-4.npy", "4-8_0-2.npy", "4-8_2-4.npy"], "b": ["0-4.npy"],
                     "e": ["0-4.npy", "12-16.npy", "4-8.npy", "8-12.npy"]}, saved


# ---- the native API -------------------------------------------------------------------------

def test_pw_save_and_load_move_no_bytes_through_the_client_and_load_into_another_layout(tmp_path):
    with pw.local_cluster(hosts=2, devices_per_host=2, checkpoint_dir=str(tmp_path)):
        s = pw.make_virtual_device_set().add_slice(cpu_devices=4, mesh_shape=(2, 2))
        mesh = s.mesh(("a", "b"))
        # larger than the small outputs whose bytes come with a run's news
        w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
        assert w.nbytes > m.SMALL_VALUE_BYTES
        state = {"params": {"w": pw.device_put(w, pw.NamedSharding(mesh, pw.P("a", "b")))},
                 "step": pw.device_put(np.array(7, np.int32), pw.NamedSharding(mesh, pw.P()))}
        doubled = pw.jit(lambda x: x * 2.0, mesh=mesh, in_shardings=pw.P("a", "b"), out_shardings=pw.P("a", "b"))
        state["params"]["w"] = doubled(state["params"]["w"])  # saved once the run computes it
        moved = pw.default_session().array_bytes
        put = (moved.sent, moved.received)
        assert put == (w.nbytes + 2 * 4, 0), moved  # each host its blocks of w; the step on both hosts
        pw.save(state, str(tmp_path / "ckpt"))
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["params.w", "step"]
        assert len(os.listdir(tmp_path / "ckpt" / "params.w")) == 4 and os.listdir(tmp_path / "ckpt" / "step") == [
            "scalar.npy"]
        like = {"params": {"w": pw.device_put(np.zeros_like(w), pw.NamedSharding(mesh, pw.P(None, "b")))},
                "step": pw.device_put(np.array(0, np.int32), pw.NamedSharding(mesh, pw.P()))}
        assert moved.received == 0, moved
        put = (moved.sent, moved.received)
        loaded = pw.load(str(tmp_path / "ckpt"), like)
        assert (moved.sent, moved.received) == put, moved
        np.testing.assert_array_equal(np.asarray(loaded["params"]["w"]), w * 2.0)
        assert loaded["params"]["w"].sharding.spec == pw.P(None, "b") and int(np.asarray(loaded["step"])) == 7
        assert moved.received == w.nbytes + 4, moved  # the two reads just above
        with pytest.raises(pw.AccessDeniedError, match="only under"):
            pw.save(state, "/etc/pathways-checkpoint")
        missing = pw.load(str(tmp_path / "nothing"), like)
        with pytest.raises(pw.RemoteError, match="no checkpoint at"):
            np.asarray(missing["step"])
