"""The worker's core in one process: typed controller messages in, typed replies out, puts,
fetches and session drops, on real JAX (CPU) with no processes and no sockets listened on."""

import math
import time

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle
from pathways.protocol.ops import Op
from pathways.wire import codec
from pathways.worker.core import WorkerCore

LAYOUT = Layout((0,), ((0, 0),), (1,), ("d",), ())
SESSION = 5


def export(fun, shape=(3,), dtype=np.float32) -> bytes:
    """A jax.export artifact of ``fun`` on one device, as a client ships it: a flat list
    of outputs."""
    sharding = NamedSharding(AbstractMesh((1,), ("d",)), PartitionSpec())
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    jitted = jax.jit(lambda x: [fun(x)], in_shardings=(sharding,), out_shardings=[sharding])
    return bytes(jax.export.export(jitted)(arg).serialize())


def put_header(handle, array, **fields):
    return {"t": "put", "handle": handle, "layout": LAYOUT.to_wire(), "of": 1,
            **codec.pieces_header(array.dtype, array.shape, [(codec.full_index(array.shape), array)]), **fields}


def put(core, handle, array):
    assert core.receive(put_header(handle, array), pieces=[(codec.full_index(array.shape), array)]) is None


def fetch(core, handle, wait=10.0, data=True, still_wanted=lambda: True):
    frames = list(core.fetch(m.FetchRequest(handle, wait, data), still_wanted))
    header = codec.unpack(frames[0]) if frames else None
    if header and header["state"] == "ready" and data:
        _, _, pieces = codec.read_pieces(header, iter(frames[1:]))
        return header, pieces[0][1]
    return header, None


class Up(list):
    """What the core says to the controller."""

    def wait_for(self, kind, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [x for x in self if type(x) is kind]
            if found:
                return found
            time.sleep(0.01)
        raise AssertionError(f"no {kind.__name__} within {timeout} s; got {self}")


@pytest.fixture
def up():
    return Up()


@pytest.fixture
def core(up):
    c = WorkerCore(up.append, wait_timeout=5.0)
    c.on_batch(m.encode_batch([m.WorkerWelcome(0, 0, 0, "")]))
    yield c
    c.close()


FN = first_handle(SESSION) + 1
KEY = 11


def define_double(core):
    """Compile ``2 * x`` as FN and define program KEY: input register 0, output 1."""
    core.on_batch(m.encode_batch([
        m.Compile(FN, "double", export(lambda x: 2 * x), (LAYOUT,), (LAYOUT,)),
        m.Define(KEY, SESSION, 2, 0, ([int(Op.IN), 0, True], [int(Op.EXEC), FN, [0], [1]], [int(Op.OUT), 1])),
    ]))


def run(core, run_id, base, arg):
    core.on_batch(m.encode_batch([m.RunProgram(run_id, KEY, base, 0, {0: arg})]))


def test_define_and_run_a_compiled_function(core, up):
    define_double(core)
    x = first_handle(SESSION) + 100
    put(core, x, np.arange(3, dtype=np.float32))
    base = first_handle(SESSION) + 200
    run(core, 7, base, x)
    header, value = fetch(core, base + 1)
    assert header["state"] == "ready"
    np.testing.assert_array_equal(value, [0.0, 2.0, 4.0])
    done = up.wait_for(m.Done)
    assert [r for d in done for r, _ in d.runs] == [7]
    assert all(seconds >= 0 for d in done for _, seconds in d.runs)
    assert not [x for x in up if type(x) is m.Notice], up
    # everything the core said is a message the controller's table accepts
    assert all(type(x) is not m.Malformed for x in m.WORKER_UP.decode_batch(m.encode_batch(list(up))))


def test_a_malformed_message_gets_a_notice_and_the_rest_of_the_batch_runs(core, up):
    x = first_handle(SESSION) + 100
    put(core, x, np.ones(3, np.float32))
    good = [m.Compile(FN, "double", export(lambda x: 2 * x), (LAYOUT,), (LAYOUT,)).encode(),
            m.Define(KEY, SESSION, 2, 0, ([int(Op.IN), 0, True], [int(Op.EXEC), FN, [0], [1]],
                                          [int(Op.OUT), 1])).encode()]
    bad = [
        ["run", 1, KEY, [1], 0, []],  # a list where a handle belongs
        ["define", KEY + 1, SESSION, 2, 0, [[int(Op.IN), 5, True]]],  # register outside the file
        ["define", KEY + 2, SESSION, 2, 0, [[int(Op.EXEC), FN + 99, [0], [1]]]],  # a function never compiled
        ["fetch", 1, 1.0, True],  # a kind this stream does not carry
        ["delete", [math.nan]],
    ]
    core.on_batch(codec.pack([bad[0], good[0], bad[1], bad[2], good[1], bad[3], bad[4]]))
    core.on_batch(b"\xc1 not msgpack")
    notices = [n.message for n in up if type(n) is m.Notice]
    assert len(notices) == 6, notices
    assert "'run'" in notices[0] and "base" in notices[0]
    assert "register 5" in notices[1]
    assert "never compiled" in notices[2]
    assert "unknown message 'fetch'" in notices[3]
    assert "msgpack" in notices[5]
    base = first_handle(SESSION) + 200
    run(core, 3, base, x)
    header, value = fetch(core, base + 1)
    np.testing.assert_array_equal(value, [2.0, 2.0, 2.0])


def test_poison_flows_through_a_run_to_the_reader(core, up):
    define_double(core)
    x = first_handle(SESSION) + 100
    core.on_batch(m.encode_batch([m.Poisoned((x,), "WorkerLostError", "host 3 of the island was lost")]))
    base = first_handle(SESSION) + 200
    run(core, 1, base, x)
    header, _ = fetch(core, base + 1)
    assert header == {"state": "error", "kind": "WorkerLostError", "message": "host 3 of the island was lost"}
    # a poisoned put from a peer, with a kind this worker does not know, reads as a failure
    y = first_handle(SESSION) + 300
    assert core.receive({"t": "put", "handle": y, "layout": LAYOUT.to_wire(), "of": 1, "poison": "boom",
                         "kind": "SomethingNew"}) is None
    header, _ = fetch(core, y)
    assert header == {"state": "error", "kind": "RemoteError", "message": "boom"}
    assert up.wait_for(m.Done)[0].runs[0][0] == 1


def test_fetch_of_a_pending_handle_answers_pending_at_its_bound(core):
    start = time.monotonic()
    header, _ = fetch(core, first_handle(SESSION) + 999, wait=0.3)
    took = time.monotonic() - start
    assert header == {"state": "pending"}
    assert 0.3 <= took < 1.5, took


def test_a_fetch_its_caller_abandoned_returns_at_once(core):
    wanted = [True]
    start = time.monotonic()

    def abandon_soon():
        if time.monotonic() - start > 0.2:
            wanted[0] = False
        return wanted[0]

    header, _ = fetch(core, first_handle(SESSION) + 999, wait=3000.0, still_wanted=abandon_soon)
    assert header is None  # nobody to answer
    assert time.monotonic() - start < 1.5


def test_drop_session_frees_arrays_functions_and_programs(core, up):
    before = core.stats()
    other = first_handle(SESSION + 1) + 1
    # another session registered the same function: the shared compilation must survive
    core.on_batch(m.encode_batch([m.Compile(other, "double", export(lambda x: 2 * x), (LAYOUT,), (LAYOUT,))]))
    define_double(core)
    core.on_batch(m.encode_batch([m.Compile(FN + 1, "inc", export(lambda x: x + 1), (LAYOUT,), (LAYOUT,))]))
    x = first_handle(SESSION) + 100
    put(core, x, np.ones(3, np.float32))
    run(core, 1, first_handle(SESSION) + 200, x)
    up.wait_for(m.Done)
    during = core.stats()
    assert during["executables"] == before["executables"] + 2
    assert during["programs"] == before["programs"] + 1
    assert during["sessions"][SESSION] == 2  # the input, and the output
    core.on_batch(m.encode_batch([m.DropSession(SESSION, (KEY,))]))
    deadline = time.monotonic() + 10
    while core.stats()["programs"] != before["programs"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = core.stats()
    assert SESSION not in after["sessions"]
    assert after["programs"] == before["programs"]
    assert after["executables"] == before["executables"] + 1  # the other session's
    assert core.executables.get(FN) is None and core.executables.get(other) is not None
    # a late array of the dropped session is refused
    put(core, first_handle(SESSION) + 500, np.ones(3, np.float32))
    assert SESSION not in core.stats()["sessions"]


@pytest.mark.parametrize("fields, needle", [
    ({"handle": [1]}, "'handle' must be an integer"),
    ({"handle": {"a": 1}}, "'handle' must be an integer"),
    ({"layout": {"x": 1}}, "'layout'"),
    ({"layout": [[0], [0, 0], [1], [["d"]], []]}, "'layout'"),
    ({"of": "2"}, "'of'"),
    ({"of": 0}, "'of'"),
    ({"t": ["put"]}, "'t'"),
    ({"poison": ["x"]}, "'poison' must be a string"),
    ({"poison": "x", "kind": {"k": 1}}, "'kind' must be a string"),
    ({"array": {"dtype": ["float32"], "shape": [3], "nbytes": 12}}, "is not allowed on the wire"),
])
def test_a_put_header_of_the_wrong_types_is_a_wire_error(core, fields, needle):
    good = np.ones(3, np.float32)
    header = {**put_header(first_handle(SESSION) + 1, good), **fields}
    error = core.receive(header, iter([good.tobytes()]))
    assert error is not None and needle in error, error
    assert core.receive([1, 2], iter([])) == "a put header must be a map, got list"
