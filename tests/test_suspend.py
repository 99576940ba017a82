"""Suspend and resume: a session's arrays leave the devices (for the workers' host memory,
or files the workers write), its slices are released for other clients, and it resumes
wherever its slices fit then, with the same arrays, functions and programs."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from pathways.client import api
from pathways.client.devices import VirtualDeviceSet
from pathways.client.session import Session
from pathways.cluster import status


@pytest.fixture(scope="module")
def suspend_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("suspend")


@pytest.fixture(scope="module")
def cluster(suspend_dir):
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=2),
                                   pw.Island(hosts=1, devices_per_host=2)], suspend_dir=str(suspend_dir)) as c:
        yield c


@pytest.fixture
def session(cluster):
    """A session of its own, the default one for the test (pw.program, pw.suspend use it)."""
    s = Session(cluster.address, connect_timeout=60)
    previous = api._default
    api.set_default_session(s)
    try:
        yield s
    finally:
        api.set_default_session(previous)
        s.close()


def _state(address, sid):
    return next(c for c in status(address)["sessions"] if c["session"] == sid)


def test_a_session_suspended_on_one_island_resumes_on_the_other_with_its_arrays_functions_and_programs(
        cluster, session):
    s = VirtualDeviceSet(session).add_slice(cpu_devices=2, island=0)
    double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
    total = pw.pmap(lambda x: jax.lax.psum(x, "i") + 1.0, devices=s.devices)

    @pw.program
    def step(v):
        return total(double(v))

    put = pw.device_put(np.arange(8, dtype=np.float32).reshape(2, 4), s.devices)
    doubled = double(put)
    stepped = step(np.array([1.0, 2.0], np.float32))
    big = pw.device_put(np.random.default_rng(0).standard_normal((2, 1 << 18)).astype(np.float32), s.devices)
    before = {name: np.asarray(a) for name, a in
              (("put", put), ("doubled", doubled), ("stepped", stepped), ("big", big))}
    np.testing.assert_array_equal(before["stepped"], [7.0, 7.0])

    session.suspend()
    st = _state(cluster.address, session.id)
    assert st["state"] == "suspended" and st["suspended_arrays"] == 4
    assert st["suspended_bytes"] == sum(a.nbytes for a in before.values())
    out = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", cluster.address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"client session {session.id}: SUSPENDED (4 array(s)" in out.stdout, out.stdout

    # another client takes the whole island the session was on
    other = Session(cluster.address, connect_timeout=60)
    try:
        taken = VirtualDeviceSet(other).add_slice(cpu_devices=2, island=0, exclusive=True)
        y = pw.pmap(lambda x: x + 100.0, devices=taken.devices)(np.zeros(2, np.float32))
        np.testing.assert_array_equal(np.asarray(y), [100.0, 100.0])

        session.resume()
        assert s.island == 1, "island 0 is held exclusively by another client: the slice moved"
        assert _state(cluster.address, session.id)["state"] == "active"
        for name, a in (("put", put), ("doubled", doubled), ("stepped", stepped), ("big", big)):
            np.testing.assert_array_equal(np.asarray(a), before[name], err_msg=name)
        # the same Python objects: arrays as inputs, host inputs put on the moved slice
        np.testing.assert_array_equal(np.asarray(double(put)), before["doubled"])
        np.testing.assert_array_equal(np.asarray(step(np.array([3.0, 4.0], np.float32))), [15.0, 15.0])
        np.testing.assert_array_equal(np.asarray(total(stepped)), [15.0, 15.0])
        # and the other client's exclusive slice is untouched
        np.testing.assert_array_equal(np.asarray(y), [100.0, 100.0])
    finally:
        other.close()


def test_suspend_to_a_path_has_the_workers_write_files_that_resume_reads_back(cluster, session, suspend_dir):
    tmp_path = suspend_dir / "files"
    s = VirtualDeviceSet(session).add_slice(cpu_devices=2)
    x = pw.device_put(np.arange(12, dtype=np.float32).reshape(2, 6), s.devices)
    y = pw.pmap(lambda v: v - 1.0, devices=s.devices)(x)
    expected = np.asarray(y)

    pw.suspend(path=str(tmp_path))
    files = sorted(p for p in tmp_path.rglob("*.npy"))
    # each array as pw.save writes one: a directory holding a file per distinct block (x
    # whole, y in rows)
    blocks = {p.parent.name: sorted(q.name for q in p.parent.iterdir()) for p in files}
    assert sorted(blocks.values()) == [["0-1_0-6.npy", "1-2_0-6.npy"], ["0-2_0-6.npy"]], blocks
    assert all(p.parent.parent.parent.name == f"session-{session.id}" for p in files)
    assert sum(p.stat().st_size for p in files) >= x.size * 4 * 2
    pw.resume()
    np.testing.assert_array_equal(np.asarray(x), np.arange(12, dtype=np.float32).reshape(2, 6))
    np.testing.assert_array_equal(np.asarray(y), expected)
    assert not list(tmp_path.rglob("*.npy")), "the files are removed once read back"


def test_the_workers_write_no_file_outside_the_directory_their_operator_allowed(cluster, session, suspend_dir,
                                                                                 tmp_path):
    s = VirtualDeviceSet(session).add_slice(cpu_devices=2)
    x = pw.device_put(np.arange(4, dtype=np.float32).reshape(2, 2), s.devices)
    (suspend_dir / "link").symlink_to(tmp_path)  # under the directory by name, outside it in fact
    for outside in (tmp_path, suspend_dir / "link"):
        with pytest.warns(RuntimeWarning, match="writes suspend files only under .*--suspend-dir"):
            pw.suspend(path=str(outside))
        assert not list(tmp_path.rglob("*")), "nothing is written outside the allowed directory"
        pw.resume()
        np.testing.assert_array_equal(np.asarray(x), np.arange(4, dtype=np.float32).reshape(2, 2))


@pytest.mark.parametrize("path", ["relative/dir", "/tmp/../etc"])
def test_suspend_refuses_a_relative_path_or_one_that_climbs(cluster, session, path):
    VirtualDeviceSet(session).add_slice(cpu_devices=1)
    with pytest.raises(pw.WireError, match="absolute directory without '..'"):
        session.suspend(path=path)
    assert not session.suspended and _state(cluster.address, session.id)["state"] == "active"


def test_runs_puts_and_reads_of_a_suspended_session_raise_an_error_that_says_to_resume(cluster, session):
    s = VirtualDeviceSet(session).add_slice(cpu_devices=2)
    inc = pw.pmap(lambda v: v + 1.0, devices=s.devices)
    x = inc(np.zeros(2, np.float32))
    x.block_until_ready(timeout=60)
    session.suspend()
    for attempt in (lambda: inc(x), lambda: inc(np.zeros(2, np.float32)), lambda: np.asarray(x),
                    lambda: pw.device_put(np.ones(2, np.float32), s.devices)):
        with pytest.raises(pw.SuspendedError, match=r"call resume\(\)"):
            attempt()
    with pytest.raises(pw.SuspendedError, match="already suspended"):
        session.suspend()
    session.resume()
    with pytest.raises(pw.SuspendedError, match="not suspended"):
        session.resume()
    np.testing.assert_array_equal(np.asarray(inc(x)), [2.0, 2.0])


def test_suspend_waits_for_the_runs_in_flight(cluster, session):
    s = VirtualDeviceSet(session).add_slice(cpu_devices=2)

    def slow(v):  # a few tenths of a second of work
        return jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y), v)

    step = pw.jit(slow, mesh=s.mesh("x"))
    m = np.eye(256, dtype=np.float32) * 0.5
    step(m).block_until_ready(timeout=120)  # compiled
    outs = [step(m) for _ in range(3)]
    session.suspend()
    st = _state(cluster.address, session.id)
    assert st["state"] == "suspended" and st["inflight"] == 0 and st["queued"] == 0
    assert st["completed"] == 4, "the three runs in flight finished before the arrays left the devices"
    session.resume()
    expected = np.asarray(jax.jit(slow)(m))
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_suspend_right_after_a_put_keeps_the_array(cluster, session):
    s = VirtualDeviceSet(session).add_slice(cpu_devices=2)
    value = np.random.default_rng(1).random((2, 16 << 20), dtype=np.float32)  # 128 MiB, still on its way
    put = pw.device_put(value, s.devices)
    session.suspend()
    session.resume()
    np.testing.assert_array_equal(np.asarray(put), value)


def test_the_remap_moves_layouts_functions_and_compiles_position_by_position():
    from pathways.controller.lowering import FnLayouts
    from pathways.controller.placement import SlicePlacement
    from pathways.controller.suspension import Remap
    from pathways.ir import Layout
    from pathways.protocol import messages as m

    # a slice of 4 devices on two hosts (workers 3, 4) moves onto one host (worker 9, devices 4..7)
    old = SlicePlacement(7, (3, 4), 0, "cpu", ((0, 0), (0, 1), (1, 0), (1, 1)), (4,), False, 1)
    new = SlicePlacement(7, (9,), 1, "cpu", ((0, 4), (0, 5), (0, 6), (0, 7)), (4,), False, 1)
    remap = Remap([(old, new)], {9: 0})
    layout = Layout((3, 4), old.devices, (2, 2), ("a", "b"), ("a", None))
    moved = remap.layout(layout)
    assert moved == Layout((9,), new.devices, (2, 2), ("a", "b"), ("a", None))
    assert remap.layout(Layout((5,), ((0, 0),), (1,), ("x",), ())) is None, "not on the session's slices"
    partial = remap.layout(Layout((3, 4), old.devices, (2, 2), ("a", "u"), ("a",), ("u",)))
    assert partial == Layout((9,), new.devices, (2, 2), ("a", "u"), ("a",), ("u",)), "unreduced axes stay"
    part = remap.layout(Layout((4,), ((1, 1),), (1,), ("x",), ()))
    assert part.workers == (9,) and part.devices == ((0, 7),)
    fn = remap.function(FnLayouts((3, 4), (layout,), (layout,)), 7)
    assert fn == FnLayouts((9,), (moved,), (moved,))
    compile_msg = remap.compile(m.Compile(1, m.FunctionBody("f", b"blob", (layout,), (layout,)), (3, 4)), 7)
    assert compile_msg.workers == (9,) and compile_msg.body.ins == (moved,)
    xla = remap.compile(m.Compile(2, m.FunctionBody("g", b"blob", (), (), "xla", b"", (1, 0, 0, 1)), (3, 4)), 7)
    assert xla.body.devices == (0, 6, 0, 5) and xla.workers == (9,)


def test_a_host_lost_while_its_session_offloads_or_resumes_loses_its_arrays_and_the_session_goes_on():
    """The controller's core alone: the suspend completes without the lost host's report
    and its arrays are lost; a sender lost while the session resumes poisons the array it
    was sending, at the client and at its receiver (once), and the resume completes."""
    from pathways.controller.core import ControllerCore
    from pathways.ir import Layout
    from pathways.protocol import messages as m
    from pathways.protocol.handles import first_handle
    from tests.test_assembly import _register
    from tests.test_controller import Box, _of
    from tests.test_controller import session as opened

    core = ControllerCore()
    w0, w1, w2 = (_register(core, name, 1, coordinator=f"{name}:1") for name in "abc")
    client, rival = opened(core, 1), opened(core, 2)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 0, False),
                                             m.SliceRequest(2, "cpu", 1, None, 1, False)]))
    assert [r.workers for r in sorted(_of(client, m.SliceReply), key=lambda r: r.req)] == [(w0.worker,), (w1.worker,)]
    on_a, on_b = (first_handle(1) + i for i in (1, 2))
    core.on_session_batch(1, m.encode_batch([m.PutNotice(on_a, Layout((w0.worker,), ((0, 0),), (1,), ("x",), ())),
                                             m.PutNotice(on_b, Layout((w1.worker,), ((0, 0),), (1,), ("x",), ())),
                                             m.Suspend(3)]))
    assert _of(w0.outbox, m.Offload) and _of(w1.outbox, m.Offload)
    core.on_worker_batch(w1, m.encode_batch([m.Offloaded(1, ((on_b, (2,)),), (), 8)]))
    assert not _of(client, m.Suspended), "it waits for the other holder"
    core.worker_lost(w0)
    [suspended] = _of(client, m.Suspended)
    assert (suspended.req, suspended.arrays) == (3, 1)
    lost = [x for x in _of(client, m.Poisoned) if on_a in x.handles]
    assert [x.kind for x in lost] == ["WorkerLostError"]

    core.on_session_batch(2, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 1, True)]))
    assert _of(rival, m.SliceReply)[0].workers == (w1.worker,), "another client takes island b for itself"
    core.on_session_batch(1, m.encode_batch([m.Resume(4)]))
    assert [x.workers for x in _of(client, m.SliceMoved)] == [(w2.worker,), (w2.worker,)]
    [restore] = _of(w1.outbox, m.Restore)
    [adopt] = _of(w2.outbox, m.Adopt)
    [(copy, handle, senders)] = adopt.arrivals
    assert handle == on_b and restore.moves[0][:2] == (on_b, copy) and senders == (w1.worker,)
    core.worker_lost(w1)
    assert [x.handles for x in _of(w2.outbox, m.Poisoned)] == [(copy,)], "its receiver stops waiting for it"
    assert [x.kind for x in _of(client, m.Poisoned) if on_b in x.handles] == ["WorkerLostError"]
    assert not _of(client, m.Resumed), "the receiver has not answered yet"
    core.on_worker_batch(w2, m.encode_batch([m.Adopted(1, 1, 0)]))
    assert [x.req for x in _of(client, m.Resumed)] == [4]
    assert {x["session"]: x["state"] for x in core.status().as_dict()["sessions"]} == {1: "active", 2: "active"}


def test_a_session_holding_an_unreduced_array_is_not_suspended():
    """The controller's core alone: offloading would keep one of its devices' partial values."""
    from pathways.controller.core import ControllerCore
    from pathways.ir import Layout
    from pathways.protocol import messages as m
    from pathways.protocol.handles import first_handle
    from tests.test_assembly import _register
    from tests.test_controller import _of
    from tests.test_controller import session as opened

    core = ControllerCore()
    w0 = _register(core, "a", 2, coordinator="a:1")
    client = opened(core, 1)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 2, None, 0, False)]))
    partial = Layout((w0.worker,), ((0, 0), (0, 1)), (2,), ("u",), (), ("u",))
    core.on_session_batch(1, m.encode_batch([m.PutNotice(first_handle(1) + 1, partial), m.Suspend(2)]))
    [error] = [e for e in _of(client, m.Error) if e.req == 2]
    assert error.kind == "SuspendedError" and "unreduced arrays" in error.message and "reshard" in error.message
    assert not _of(w0.outbox, m.Offload) and core.status().as_dict()["sessions"][0]["state"] == "active"


def test_an_xla_function_still_compiling_when_its_session_moves_is_compiled_and_reported_on_the_new_host():
    """The controller's core alone: the function's pending compile follows its slice to the
    new host, whose report answers the client."""
    from pathways.controller.core import ControllerCore
    from pathways.protocol import messages as m
    from pathways.protocol.handles import first_handle
    from tests.test_assembly import _register
    from tests.test_controller import _of
    from tests.test_controller import session as opened

    core = ControllerCore()
    w0, w1 = (_register(core, name, 1, coordinator=f"{name}:1") for name in "ab")
    client, rival = opened(core, 1), opened(core, 2)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 0, False)]))
    [reply] = _of(client, m.SliceReply)
    fn = first_handle(1) + 1
    body = m.FunctionBody("f", b"mlir", (), (), "xla", b"opts", (0, 0))
    core.on_session_batch(1, m.encode_batch([m.DefineFunction(fn, reply.slice, body), m.Suspend(2)]))
    assert _of(w0.outbox, m.Compile) == [m.Compile(fn, body, (w0.worker,))]
    core.on_worker_batch(w0, m.encode_batch([m.Offloaded(1, (), (), 0)]))  # it held no array
    assert [x.req for x in _of(client, m.Suspended)] == [2]

    core.on_session_batch(2, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 0, True)]))
    assert _of(rival, m.SliceReply)[0].workers == (w0.worker,), "another client takes island a for itself"
    core.on_session_batch(1, m.encode_batch([m.Resume(3)]))
    assert [x.workers for x in _of(client, m.SliceMoved)] == [(w1.worker,)]
    assert _of(w1.outbox, m.Compile) == [m.Compile(fn, body, (w1.worker,))]
    core.on_worker_batch(w1, m.encode_batch([m.Compiled(fn, "")]))
    assert _of(client, m.Compiled) == [m.Compiled(fn, "")], "the new host reports the compile"
