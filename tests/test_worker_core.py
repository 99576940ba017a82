"""The worker's core in one process: typed controller messages in, typed replies out, puts,
fetches and session drops, on real JAX (CPU) with no processes and no sockets listened on."""

import contextlib
import math
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from pathways.errors import AccessDeniedError
from pathways.ir import Layout, stacked
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle, session_of
from pathways.protocol.ops import Op
from pathways.wire import codec, rpc
from pathways.worker.core import WorkerCore
from pathways.worker.server import WorkerService

LAYOUT = Layout((0,), ((0, 0),), (1,), ("d",), ())
SESSION = 5
CREDENTIALS = {SESSION: b"5" * m.CREDENTIAL_BYTES, SESSION + 1: b"6" * m.CREDENTIAL_BYTES}


def export(fun, shape=(3,), dtype=np.float32) -> bytes:
    """A jax.export artifact of ``fun`` on one device, as a client ships it: a flat list
    of outputs."""
    sharding = NamedSharding(AbstractMesh((1,), ("d",)), PartitionSpec())
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    jitted = jax.jit(lambda x: [fun(x)], in_shardings=(sharding,), out_shardings=[sharding])
    return bytes(jax.export.export(jitted)(arg).serialize())


def put_header(handle, array, **fields):
    return {"t": "put", "handle": handle, "layout": LAYOUT.to_wire(), "of": 1,
            **codec.pieces_header(array.dtype, array.shape, [(codec.full_region(array.shape), array)]), **fields}


def frame(core, header, pieces=(), credentials=CREDENTIALS):
    """A data-plane frame arriving at ``core``, with the credential of its handle's session
    in ``credentials`` (a client session's array carries one; the controller's transfer
    copies none)."""
    session = session_of(header["handle"])
    if session:
        header = {**header, "credential": credentials[session]}
    return core.receive_frame(header, list(pieces))


@contextlib.contextmanager
def served(core, credentials):
    """``core`` (told of the sessions of ``credentials``: session -> credential) behind a
    real gRPC server in this process; yields a maker of stubs of its methods by name."""
    core.on_batch(m.encode_batch([m.SessionOpen(s, m.digest(c)) for s, c in credentials.items()]))
    server, port = rpc.make_server(rpc.WORKER_SERVICE, WorkerService(core).handlers(), max_workers=16)
    channel = rpc.open_channel(f"grpc://127.0.0.1:{port}")
    try:
        yield lambda name, kind="unary_unary": rpc.method(channel, rpc.WORKER_SERVICE, name, kind)
    finally:
        channel.close()
        server.stop(grace=0).wait(timeout=5)
        core.close()


def put(core, handle, array, credentials=CREDENTIALS):
    region = codec.full_region(array.shape)
    assert frame(core, put_header(handle, array), [(region, array)], credentials) is None


def fetch(core, handle, wait=10.0, data=True, still_wanted=lambda: True, credential=None, device=None):
    """A client's fetch, with the credential of the handle's session unless one is given."""
    if credential is None:
        credential = CREDENTIALS.get(session_of(handle), bytes(m.CREDENTIAL_BYTES))
    frames = list(core.fetch(m.FetchRequest(handle, wait, data, credential, device), still_wanted))
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
    c.on_batch(m.encode_batch([m.WorkerWelcome(0, 0, 0, ""),
                               *(m.SessionOpen(s, m.digest(cred)) for s, cred in CREDENTIALS.items())]))
    yield c
    c.close()


FN = first_handle(SESSION) + 1
KEY = 11


def compile_on_layout(fn, name, f):
    """Compile ``f`` as function ``fn``, from and to LAYOUT."""
    return m.Compile(fn, m.FunctionBody(name, export(f), (LAYOUT,), (LAYOUT,)))


def define_double(core):
    """Compile ``2 * x`` as FN and define program KEY: input register 0, output 1."""
    core.on_batch(m.encode_batch([
        compile_on_layout(FN, "double", lambda x: 2 * x),
        m.Define(KEY, SESSION, 2, 0, ([int(Op.IN), 0, []], [int(Op.EXEC), FN, [0], [1]], [int(Op.OUT), 1])),
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
    good = [compile_on_layout(FN, "double", lambda x: 2 * x).encode(),
            m.Define(KEY, SESSION, 2, 0, ([int(Op.IN), 0, []], [int(Op.EXEC), FN, [0], [1]],
                                          [int(Op.OUT), 1])).encode()]
    bad = [
        ["run", 1, KEY, [1], 0, []],  # a list where a handle belongs
        ["define", KEY + 1, SESSION, 2, 0, [[int(Op.IN), 5, []]]],  # register outside the file
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
    assert frame(core, {"t": "put", "handle": y, "layout": LAYOUT.to_wire(), "of": 1, "poison": "boom",
                        "kind": "SomethingNew"}) is None
    header, _ = fetch(core, y)
    assert header == {"state": "error", "kind": "RemoteError", "message": "boom"}
    assert up.wait_for(m.Done)[0].runs[0][0] == 1


def test_a_run_sent_with_notify_reports_its_small_outputs_and_failed_runs_as_failed(core, up):
    define_double(core)
    x, poisoned = first_handle(SESSION) + 100, first_handle(SESSION) + 101
    put(core, x, np.arange(3, dtype=np.float32))
    core.on_batch(m.encode_batch([m.Poisoned((poisoned,), "RemoteError", "its put failed")]))
    told, quiet, failed = (first_handle(SESSION) + base for base in (200, 300, 400))
    core.on_batch(m.encode_batch([m.RunProgram(1, KEY, told, 0, {0: x}, False, True),
                                  m.RunProgram(2, KEY, quiet, 0, {0: x}),
                                  m.RunProgram(3, KEY, failed, 0, {0: poisoned}, False, True)]))
    deadline = time.monotonic() + 30
    while sorted(r for d in up if type(d) is m.Done for r, _ in d.runs) != [1, 2, 3]:
        assert time.monotonic() < deadline, up
        time.sleep(0.01)
    done = [d for d in up if type(d) is m.Done]
    values = [v for d in done for v in d.values]
    assert values == [(1, told + 1, np.array([0.0, 2.0, 4.0], np.float32).tobytes())], values
    assert [r for d in done for r in d.failed] == [3]


def test_fetch_of_a_pending_handle_answers_pending_at_its_bound(core):
    start = time.monotonic()
    header, _ = fetch(core, first_handle(SESSION) + 999, wait=0.3)
    took = time.monotonic() - start
    assert header == {"state": "pending"}
    assert 0.3 <= took < 1.5, took


def test_a_fetch_of_one_device_answers_its_own_shard_and_names_a_device_the_island_lacks(core):
    handle = first_handle(SESSION) + 7
    x = np.arange(3, dtype=np.float32)
    put(core, handle, x)
    header, shard = fetch(core, handle, device=(0, 0))
    assert header["state"] == "ready"
    np.testing.assert_array_equal(shard, x)
    header, _ = fetch(core, handle, device=(0, 9))
    assert header["state"] == "error" and "device (0, 9)" in header["message"], header


def test_a_put_of_stacked_partial_values_is_stored_unstacked_and_a_mismatched_one_refused(core):
    partial = Layout((0,), ((0, 0),), (1,), ("u",), (), ("u",))
    stack = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    header = {**put_header(first_handle(SESSION) + 8, stack), "layout": stacked(partial).to_wire(),
              "unstack": partial.to_wire()}
    assert frame(core, header, [(codec.full_region(stack.shape), stack)]) is None
    _, value = fetch(core, first_handle(SESSION) + 8)
    np.testing.assert_array_equal(value, stack[0])
    wrong = {**header, "handle": first_handle(SESSION) + 9, "layout": LAYOUT.to_wire()}
    error = frame(core, wrong, [(codec.full_region(stack.shape), stack)])
    assert "whose stacked layout is field 'layout'" in error, error


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
    before = core.stats().as_dict()
    other = first_handle(SESSION + 1) + 1
    # another session registered the same function: the shared compilation must survive
    core.on_batch(m.encode_batch([compile_on_layout(other, "double", lambda x: 2 * x)]))
    define_double(core)
    core.on_batch(m.encode_batch([compile_on_layout(FN + 1, "inc", lambda x: x + 1)]))
    x = first_handle(SESSION) + 100
    put(core, x, np.ones(3, np.float32))
    run(core, 1, first_handle(SESSION) + 200, x)
    up.wait_for(m.Done)
    during = core.stats().as_dict()
    assert during["executables"] == before["executables"] + 2
    assert during["programs"] == before["programs"] + 1
    assert during["sessions"][SESSION] == 2  # the input, and the output
    core.on_batch(m.encode_batch([m.DropSession(SESSION, (KEY,))]))
    deadline = time.monotonic() + 10
    while core.stats().as_dict()["programs"] != before["programs"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = core.stats().as_dict()
    assert SESSION not in after["sessions"]
    assert after["programs"] == before["programs"]
    assert after["executables"] == before["executables"] + 1  # the other session's
    assert core.executables.get(FN) is None and core.executables.get(other) is not None
    # a late array of the dropped session is refused, and leaves nothing behind
    late = np.ones(3, np.float32)
    error = frame(core, put_header(first_handle(SESSION) + 500, late), [(codec.full_region(late.shape), late)])
    assert "its session 5 has closed" in error, error
    assert SESSION not in core.stats().as_dict()["sessions"]


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
    header = {**put_header(first_handle(SESSION) + 1, good, credential=CREDENTIALS[SESSION]), **fields}
    error = core.client_put(header, iter([good.tobytes()]))
    assert error is not None and needle in error, error
    assert core.client_put([1, 2], iter([])) == "a put header must be a map, got list"


# ---- session isolation ------------------------------------------------------------------

def client_put(core, handle, array, credential=None, **fields):
    """A client's put; returns (reply, whether any of the array's bytes were read)."""
    read = []

    def chunks():
        read.append(True)
        yield array.tobytes()

    if credential is None:
        credential = CREDENTIALS[session_of(handle)]
    return core.client_put(put_header(handle, array, credential=credential, **fields), chunks()), bool(read)


def test_a_client_put_is_stored_only_with_the_credential_of_the_handles_session(core, up):
    mine, theirs = first_handle(SESSION) + 100, first_handle(SESSION + 1) + 100
    assert client_put(core, mine, np.arange(3, dtype=np.float32)) == (None, True)
    for handle, credential in ((mine, CREDENTIALS[SESSION + 1]), (theirs, CREDENTIALS[SESSION]),
                               (first_handle(0) + 3, CREDENTIALS[SESSION])):
        start = time.monotonic()
        with pytest.raises(AccessDeniedError, match=f"refused a put of array {handle:#x}") as refused:
            client_put(core, handle, np.full(3, 9.0, np.float32), credential)
        assert time.monotonic() - start < 1.0, "a known session is refused at once"
        if handle == first_handle(0) + 3:
            assert "copy the controller made" in str(refused.value)
        else:
            assert f"belongs to session {session_of(handle)}" in str(refused.value)
    np.testing.assert_array_equal(fetch(core, mine)[1], [0.0, 1.0, 2.0])
    assert core.store.get(theirs) is None and core.store.get(first_handle(0) + 3) is None
    # a refused put reads none of the array, so a hostile caller costs it no memory
    read = []

    def chunks():
        read.append(True)
        yield np.ones(3, np.float32).tobytes()

    header = put_header(theirs, np.ones(3, np.float32), credential=CREDENTIALS[SESSION])
    with pytest.raises(AccessDeniedError):
        core.client_put(header, chunks())
    assert not read and core.store.get(theirs) is None


def test_a_put_under_another_sessions_pending_output_leaves_the_output_to_its_program(core, up):
    define_double(core)
    x, base = first_handle(SESSION) + 100, first_handle(SESSION) + 200
    put(core, x, np.ones(3, np.float32))
    with pytest.raises(AccessDeniedError):
        client_put(core, base + 1, np.full(3, 666.0, np.float32), CREDENTIALS[SESSION + 1])
    assert core.store.get(base + 1) is None
    run(core, 1, base, x)
    np.testing.assert_array_equal(fetch(core, base + 1)[1], [2.0, 2.0, 2.0])


@pytest.mark.parametrize("credential, needle", [
    (None, "lacks field 'credential'"),
    ("secret", "'credential' must be binary"),
    (b"short", "'credential' has 5 bytes"),
])
def test_a_client_put_without_a_wellformed_credential_is_a_wire_error(core, credential, needle):
    handle = first_handle(SESSION) + 1
    header = put_header(handle, np.ones(3, np.float32))
    if credential is not None:
        header["credential"] = credential
    error = core.client_put(header, iter([np.ones(3, np.float32).tobytes()]))
    assert error is not None and needle in error, error
    assert core.store.get(handle) is None


def test_a_fetch_is_answered_only_with_the_credential_of_the_handles_session(core):
    mine = first_handle(SESSION) + 100
    put(core, mine, np.arange(3, dtype=np.float32))
    for credential in (CREDENTIALS[SESSION + 1], bytes(m.CREDENTIAL_BYTES)):
        for data in (True, False):
            start = time.monotonic()
            header, value = fetch(core, mine, wait=30.0, data=data, credential=credential)
            assert time.monotonic() - start < 1.0
            assert header["state"] == "error" and header["kind"] == "AccessDeniedError" and value is None
            assert "not that session's" in header["message"]
    header, _ = fetch(core, first_handle(0) + 1, wait=30.0, credential=CREDENTIALS[SESSION])
    assert header["kind"] == "AccessDeniedError" and "copy the controller made" in header["message"]
    np.testing.assert_array_equal(fetch(core, mine)[1], [0.0, 1.0, 2.0])


def test_a_session_not_announced_yet_is_waited_for_a_bounded_time(core):
    core.sessions.wait = 0.5
    late, never = SESSION + 2, SESSION + 3
    credential = b"7" * m.CREDENTIAL_BYTES
    threading.Timer(0.2, core.on_batch, [m.encode_batch([m.SessionOpen(late, m.digest(credential))])]).start()
    # a put that races ahead of the announcement waits for it, and is stored
    assert client_put(core, first_handle(late) + 1, np.ones(3, np.float32), credential) == (None, True)
    np.testing.assert_array_equal(fetch(core, first_handle(late) + 1, credential=credential)[1], np.ones(3))
    # a session never announced: a short fetch is pending, a put and a long fetch are refused in time
    assert fetch(core, first_handle(never) + 1, wait=0.1, credential=credential)[0] == {"state": "pending"}
    start = time.monotonic()
    with pytest.raises(AccessDeniedError,
                       match=fr"has not announced its session {never} yet \(a call waits up to 0.5 s"):
        client_put(core, first_handle(never) + 1, np.ones(3, np.float32), credential)
    header, _ = fetch(core, first_handle(never) + 1, wait=30.0, credential=credential)
    assert header["kind"] == "AccessDeniedError" and "has not announced" in header["message"]
    assert 1.0 <= time.monotonic() - start < 3.0


def test_a_closed_session_or_one_closed_before_this_worker_heard_of_it_is_refused_at_once(core):
    mine = first_handle(SESSION) + 100
    put(core, mine, np.ones(3, np.float32))
    core.on_batch(m.encode_batch([m.DropSession(SESSION, ())]))
    for handle in (mine, first_handle(2) + 1):  # session 2 is older than the open session 6
        start = time.monotonic()
        with pytest.raises(AccessDeniedError, match="has closed"):
            client_put(core, handle, np.ones(3, np.float32), CREDENTIALS[SESSION])
        header, _ = fetch(core, handle, wait=30.0, credential=CREDENTIALS[SESSION])
        assert header["kind"] == "AccessDeniedError" and "has closed" in header["message"]
        assert time.monotonic() - start < 1.0


def test_a_data_plane_frame_carries_a_sessions_array_only_with_that_sessions_credential(core):
    """Peers send the controller's transfer copies; a client session's array (the
    controller's IFRT front end puts them on the data plane) is stored only with the
    credential of its session, as a client's Put is."""
    array = np.arange(3, dtype=np.float32)
    pieces = [(codec.full_region(array.shape), array)]
    client_array = first_handle(SESSION) + 1
    error = core.receive_frame(put_header(client_array, array), pieces)
    assert error is not None and "without the session's credential" in error
    for handle, credential in ((client_array, CREDENTIALS[SESSION + 1]), (first_handle(SESSION + 1) + 1,
                                                                           CREDENTIALS[SESSION])):
        error = core.receive_frame(put_header(handle, array, credential=credential), pieces)
        assert error is not None and f"refused a put of array {handle:#x}" in error, error
        assert core.store.get(handle) is None
    assert core.receive_frame(put_header(client_array, array, credential=CREDENTIALS[SESSION]), pieces) is None
    np.testing.assert_array_equal(fetch(core, client_array)[1], array)
    copy = first_handle(0) + 1
    assert core.receive_frame(put_header(copy, array), pieces) is None
    assert core.store.get(copy) is not None


def test_a_peers_copy_is_read_only_from_the_worker_the_run_takes_it_from(up):
    """A run reads transfer copy ``tbase`` from worker 3 (its receive op names it): the
    copy's frame from worker 4 is refused before its bytes are read, and counted; worker
    3's is read, once, whether it comes before the run is known here (within the peer
    timeout) or after; one that no run expects is refused once the peer timeout has passed.
    The run gives worker 3's value, and no copy or expectation is left behind."""
    core = WorkerCore(up.append, wait_timeout=5.0, peer_timeout=0.5)
    try:
        core.on_batch(m.encode_batch([m.WorkerWelcome(0, 0, 0, ""),
                                      m.SessionOpen(SESSION, m.digest(CREDENTIALS[SESSION])),
                                      compile_on_layout(FN, "double", lambda x: 2 * x),
                                      m.Define(KEY, SESSION, 2, 1, ([int(Op.IN), 2, [3]], [int(Op.EXEC), FN, [2], [1]],
                                                                    [int(Op.OUT), 1]))]))
        array, forged = np.arange(3, dtype=np.float32), np.full(3, 666, np.float32)
        tbase, base = first_handle(0) + 40, first_handle(SESSION) + 300
        early = []
        screening = threading.Thread(target=lambda: early.append(core.screen_frame(3, put_header(tbase, array))))
        screening.start()  # worker 3 pushes before this worker heard of the run
        time.sleep(0.1)
        core.on_batch(m.encode_batch([m.RunProgram(9, KEY, base, tbase, {})]))
        screening.join(10)
        assert early == [None], "the run's own sender is read once the run is known"
        refusal = core.screen_frame(4, put_header(tbase, forged))
        assert refusal is not None and "from worker 4" in refusal
        assert core.screen_frame(3, put_header(tbase, forged)) is not None, "a second copy from the same sender"
        assert core.screen_frame(4, put_header(tbase + 1, forged)) is not None, "a copy no run expects"
        assert core.receive_frame(put_header(tbase, array), [(codec.full_region(array.shape), array)]) is None
        np.testing.assert_array_equal(fetch(core, base + 1)[1], 2 * array)
        assert core.screen_frame(3, put_header(tbase, array)) is not None, "taken: refused"
        assert core.screen_frame(4, put_header(first_handle(SESSION) + 1, array)) is None, \
            "a session's array is left to receive_frame, which asks for its credential"
        assert core.stats().as_dict()["refused_copies"] == 4
        assert core.stats().as_dict()["handles"] == 1 and core.store._expected == {}, "only the run's output is kept"
    finally:
        core.close()


def test_arrays_received_again_with_a_known_layout_equal_the_first_and_keep_jaxs_dtype(core):
    """The first array of a layout is made by jax.make_array_from_callback, later ones from
    what it remembered of it: both give the same array; a dtype JAX narrows (float64
    without x64) stays on the general path and is narrowed as JAX does."""
    for dtype in (np.float32, np.int8, np.float64):
        arrays = [np.arange(6, dtype=dtype).reshape(2, 3) * k for k in (1, 2, 3)]
        stored = []
        for k, array in enumerate(arrays):
            handle = first_handle(0) + 100 * (1 + list((np.float32, np.int8, np.float64)).index(dtype)) + k
            put(core, handle, array)
            stored.append(core.store.get(handle))
        first = stored[0]
        for got, want in zip(stored, arrays):
            assert isinstance(got, jax.Array) and got.sharding == first.sharding
            assert got.dtype == jax.dtypes.canonicalize_dtype(dtype) and got.aval == first.aval
            np.testing.assert_array_equal(np.asarray(got), want.astype(got.dtype))
            np.testing.assert_array_equal(np.asarray(got + 1), want.astype(got.dtype) + 1)


def test_a_run_on_the_lean_path_switches_to_the_careful_one_at_a_poisoned_input_and_back(core, up):
    """Once its executables have compiled, a program runs on resolved calls; an input that
    arrives poisoned hands the rest of that run to the careful loop, which passes the
    poison on to the outputs, and the next run is lean again."""
    g = first_handle(SESSION) + 2
    core.on_batch(m.encode_batch([
        compile_on_layout(FN, "double", lambda x: 2 * x),
        compile_on_layout(g, "plus_one", lambda x: x + 1),
        # out = 2 * x + 1
        m.Define(KEY, SESSION, 3, 0, ([int(Op.IN), 0, []], [int(Op.EXEC), FN, [0], [1]],
                                      [int(Op.EXEC), g, [1], [2]], [int(Op.OUT), 2])),
    ]))
    x = first_handle(SESSION) + 100
    put(core, x, np.arange(3, dtype=np.float32))

    def result(run_id, arg):
        base = first_handle(SESSION) + 1000 * run_id
        run(core, run_id, base, arg)
        return fetch(core, base + 2)

    header, value = result(1, x)  # the first run waits for the compiles on the careful loop
    np.testing.assert_array_equal(value, [1.0, 3.0, 5.0])
    header, value = result(2, x)
    np.testing.assert_array_equal(value, [1.0, 3.0, 5.0])
    assert core.executor._programs[KEY].lean is not None, "the second run resolved the program for the lean loop"
    bad = first_handle(SESSION) + 300
    core.on_batch(m.encode_batch([m.Poisoned((bad,), "WorkerLostError", "host 3 of the island was lost")]))
    header, _ = result(3, bad)
    assert header == {"state": "error", "kind": "WorkerLostError", "message": "host 3 of the island was lost"}
    header, value = result(4, x)
    np.testing.assert_array_equal(value, [1.0, 3.0, 5.0])
    done = [r for d in up.wait_for(m.Done) for r, _ in d.runs]
    deadline = time.monotonic() + 30
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
        done = [r for d in up if type(d) is m.Done for r, _ in d.runs]
    assert done == [1, 2, 3, 4], "every run, poisoned or not, is reported done, in order"


def test_a_copy_from_two_senders_read_as_poison_leaves_nothing_behind_whatever_comes_after(core):
    """One sender's half arrives, then the controller's poison (the other sender's island
    was lost), which the run reads: the half, the other half and another poison arriving
    later are all dropped, so the store and the pending assemblies end empty."""
    array = np.arange(3, dtype=np.float32)
    copy = first_handle(0) + 9

    def half(region):
        piece = [(region, array[region[0][0]:region[0][1]])]
        return {**put_header(copy, array, of=2), **codec.pieces_header(array.dtype, array.shape, piece)}, piece

    assert core.receive_frame(*half(((0, 2),))) is None
    assert core._incoming, "half of the copy waits for its other sender"
    core.on_batch(m.encode_batch([m.Poisoned((copy,), "WorkerLostError", "a sender's island was lost")]))
    assert not core._incoming, "the poison ends the assembly"
    assert core.store.wait(copy, 1.0, take=True).kind == "WorkerLostError"
    assert core.receive_frame(*half(((2, 3),))) is None
    core.on_batch(m.encode_batch([m.Poisoned((copy,), "WorkerLostError", "again")]))
    assert core.store.get(copy) is None and len(core.store) == 0 and not core._incoming


def test_a_worker_allowed_no_suspend_directory_writes_no_file_and_says_why(core, up, tmp_path):
    x = first_handle(SESSION) + 100
    put(core, x, np.arange(3, dtype=np.float32))
    core.on_batch(m.encode_batch([m.Offload(SESSION, str(tmp_path))]))
    (offloaded,) = up.wait_for(m.Offloaded)
    assert offloaded.arrays == ((x, (3,)),), "the array is kept, in host memory"
    assert "writes no suspend files" in offloaded.warning and "--suspend-dir" in offloaded.warning
    assert not list(tmp_path.rglob("*")), "and nothing is written where the client asked"


def test_fetch_waits_are_shared_out_per_session_and_in_all():
    from pathways.worker.sessions import FetchWaits

    waits = FetchWaits(per_session=2, total=3)
    assert [waits.slot(1), waits.slot(1), waits.slot(1)] == [True, True, False], "a session's share"
    assert [waits.slot(2), waits.slot(3)] == [True, False], "and the total"
    waits.release(1)
    assert waits.slot(3) and not waits.slot(1)
    for session in (1, 2, 3):
        waits.release(session)
    assert [waits.slot(4), waits.slot(4)] == [True, True], "everything given back"


def test_a_copy_that_cannot_reach_its_receiver_is_reported_to_the_controller(core, up):
    """The run on worker 7 waits for this copy; the push fails (nothing listens at 7's
    address), so the controller is told, to poison the copy there instead of letting the
    run wait out its input bound."""
    core.peers[7] = "tcp://127.0.0.1:1"
    copy = first_handle(0) + 5
    value = jax.numpy.arange(3, dtype=np.float32)
    core.send(copy, value, LAYOUT.to_wire(), ((7, 1, [codec.full_region((3,))]),))
    [told] = up.wait_for(m.Undelivered)
    assert told.receiver == 7 and told.copies == (copy,)
    assert f"could not send array {copy:#x} to worker 7" in told.message and "127.0.0.1:1" in told.message
