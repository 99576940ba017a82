"""The controller's core without processes: typed messages in, typed messages out. (Pure
logic; the runtime tests run the same programs on a real cluster.)"""

import pytest

from pathways.controller.core import ControllerCore, WorkerConn
from pathways.controller.handles import HandleTable
from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol.check import MAX_TEXT
from pathways.protocol.handles import first_handle


class Box(list):
    def put(self, message):
        self.append(message)


def _of(box, kind):
    return [x for x in box if type(x) is kind]


def register(core, n, devices=1):
    conns = [WorkerConn(Box()) for _ in range(n)]
    for i, conn in enumerate(conns):
        core.on_worker_batch(conn, m.encode_batch([m.Register(
            f"grpc://127.0.0.1:{i + 1}", f"tcp://127.0.0.1:{i + 1}", "cpu", devices, str(i), 1, None, "", 1, "h", 1 << 30)]))
    return conns


def session(core, sid=1):
    client = Box()
    core.session_opened(sid, client)
    core.on_session_batch(sid, m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0)]))
    assert _of(client, m.SessionWelcome) == [m.SessionWelcome(sid, core.sessions[sid].credential)]
    return client


def test_sequential_runs_release_each_node_after_its_predecessors_finish():
    core = ControllerCore()
    workers = register(core, 3)
    sid = 1
    client = session(core, sid)
    core.on_session_batch(sid, m.encode_batch([m.SliceRequest(i + 1, "cpu", 1, None, i, False) for i in range(3)]))
    slices = {x.req - 1: x for x in _of(client, m.SliceReply)}
    layouts = [Layout(slices[i].workers, ((0, 0),), (1,), ("x",), ()) for i in range(3)]
    ids = iter(range(first_handle(sid) + 1, first_handle(sid) + 1000))
    fns = [next(ids) for _ in range(3)]
    program, data, base = next(ids), next(ids), next(ids)
    chain = m.GRAPH.check({"nvalues": 4, "inputs": [0], "nodes": [[fns[i], [i], [i + 1]] for i in range(3)],
                           "outputs": [3], "types": [["float32", [2]]] * 4}, "graph")
    core.on_session_batch(sid, m.encode_batch(
        [m.DefineFunction(fns[i], slices[i].slice, m.FunctionBody(f"f{i}", b"artifact", (layouts[i],), (layouts[i],)))
         for i in range(3)]
        + [m.DefineProgram(program, chain, "sequential"), m.PutNotice(data, layouts[0]), m.Run(program, base, {0: data})]))
    assert not _of(client, m.Error), client
    assert [slices[i].workers for i in range(3)] == [(c.worker,) for c in workers]
    w0, w1, w2 = workers
    run_id = _of(w0.outbox, m.RunProgram)[0].id
    assert all(_of(c.outbox, m.RunProgram) for c in (w0, w1, w2)), "the whole run is sent at once, gated"
    assert all(_of(c.outbox, m.Define)[0].session == sid for c in (w0, w1, w2))
    assert not any(_of(c.outbox, m.Go) for c in (w0, w1, w2))

    def step(conn, node):
        core.on_worker_batch(conn, m.encode_batch([m.Step(run_id, node)]))

    step(w0, 0)
    # node 1 reads node 0's output: its sender (w0) and runner (w1) are released, w2 is not
    assert [x.nodes for x in _of(w0.outbox, m.Go)] == [(1,)]
    assert [x.nodes for x in _of(w1.outbox, m.Go)] == [(1,)]
    assert not _of(w2.outbox, m.Go)
    step(w2, 1)  # a report from a worker that does not run node 1 changes nothing
    assert not _of(w2.outbox, m.Go)
    step(w1, 1)
    assert [x.nodes for x in _of(w1.outbox, m.Go)] == [(1,), (2,)]
    assert [x.nodes for x in _of(w2.outbox, m.Go)] == [(2,)]

    # the session closes: every worker is told to drop its arrays, functions and programs
    key = _of(w0.outbox, m.Define)[0].key
    core.session_closed(sid)
    for c in workers:
        assert _of(c.outbox, m.DropSession) == [m.DropSession(sid, (key,))]
        assert not c.defined


def test_a_malformed_message_is_refused_alone_and_its_request_answered():
    """A list where a string belongs used to raise TypeError, and the controller dropped
    the whole batch without a reply: the valid request in the same batch waited out its
    timeout."""
    core = ControllerCore()
    register(core, 1)
    client = session(core)
    bad = ["slice", 7, ["cpu"], 1, None, None, False]
    core.on_session_batch(1, m.pack([bad, m.ClusterRequest(8).encode(), ["hello", float("nan"), 1.0], "junk"]))
    errors = _of(client, m.Error)
    assert [(e.req, e.kind) for e in errors] == [(7, "WireError"), (None, "WireError"), (None, "WireError")]
    assert "kind" in errors[0].message and "string" in errors[0].message
    assert [r.req for r in _of(client, m.ClusterReply)] == [8]


def test_a_refusal_that_quotes_a_long_request_is_cut_to_a_message_the_client_accepts():
    core = ControllerCore()
    client = session(core)
    quoted = "x" * (2 * MAX_TEXT)
    graph = {"nvalues": 1, "inputs": [0], "nodes": [[1, [0], [0]]], "outputs": [0], "types": [["float32", [], quoted]]}
    core.on_session_batch(1, m.pack([["program", 9, graph, "parallel"]]))
    [error] = _of(client, m.Error)
    assert error.req is None and len(error.message) == MAX_TEXT and error.message.endswith("...")
    assert m.SESSION_DOWN.decode_batch(m.encode_batch([error])) == [error], "the client accepts it"


def test_a_worker_claiming_more_devices_than_a_host_can_have_is_refused():
    """A register claiming 10^8 devices grew the controller by 760 MB and broke status."""
    core = ControllerCore()
    conn = WorkerConn(Box())
    core.on_worker_batch(conn, m.pack([["register", "grpc://h:1", "tcp://h:2", "cpu", 10 ** 8, "0", 1, None, "", 1, "h", 1 << 30, False]]))
    assert conn.worker == -1 and not core.workers
    notices = _of(conn.outbox, m.Notice)
    assert len(notices) == 1 and "devices" in notices[0].message and str(m.MAX_DEVICES_PER_HOST) in notices[0].message
    assert core.status().as_dict()["workers"] == []


def test_handle_table_defers_deletes_of_arrays_queued_runs_still_read():
    layout = Layout((0,), ((0, 0),), (1,), ("x",), ())
    table = HandleTable()
    table.live.update({1: layout, 2: layout})
    table.reads_queued([1, 1])
    assert table.delete([1, 2, 3]) == {2: layout}
    assert table.reads_done([1]) == {}
    assert table.reads_done([1]) == {1: layout}
    table.poison([5], "RemoteError", "failed")
    assert table.delete([5]) == {} and not table.poisoned


@pytest.mark.parametrize("weight", [0.0, -2.0, float("nan"), float("inf"), 1e7])
def test_a_session_weight_outside_its_bounds_is_refused(weight):
    core = ControllerCore()
    client = Box()
    core.session_opened(1, client)
    core.on_session_batch(1, m.pack([["hello", m.PROTOCOL_VERSION, weight]]))
    assert not _of(client, m.SessionWelcome)
    assert "weight" in _of(client, m.Error)[0].message


def test_a_timeline_request_counts_the_traced_runs_whose_done_reports_are_still_due():
    """The controller records a run's last span when its workers report it done, which may
    come after the client's timeline request: the reply says how many traced runs are still
    unfinished, so that the client asks again rather than leave their spans to its next
    recording."""
    core = ControllerCore()
    [worker] = register(core, 1)
    sid = 1
    client = session(core, sid)
    core.on_session_batch(sid, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 0, False)]))
    [reply] = _of(client, m.SliceReply)
    layout = Layout(reply.workers, ((0, 0),), (1,), ("x",), ())
    ids = iter(range(first_handle(sid) + 1, first_handle(sid) + 1000))
    fn, program, data, base, later = next(ids), next(ids), next(ids), next(ids) + 16, next(ids) + 32
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[fn, [0], [1]]], "outputs": [1],
                           "types": [["float32", [2]]] * 2}, "graph")
    core.on_session_batch(sid, m.encode_batch(
        [m.DefineFunction(fn, reply.slice, m.FunctionBody("f", b"artifact", (layout,), (layout,))),
         m.DefineProgram(program, graph, "parallel"), m.PutNotice(data, layout),
         m.Run(program, base, {0: data}, traced=True), m.Run(program, later, {0: data})]))
    assert not _of(client, m.Error), client

    def collect(req):
        core.on_session_batch(sid, m.encode_batch([m.CollectTimeline(req, 1000)]))
        [timeline] = [x for x in _of(client, m.Timeline) if x.req == req]
        return timeline

    assert collect(100).unfinished == 1, "the traced run is in flight; the untraced one is not counted"
    for run in _of(worker.outbox, m.RunProgram):
        core.on_worker_batch(worker, m.encode_batch([m.Done(((run.id, 0.001),))]))
    timeline = collect(101)
    assert timeline.unfinished == 0
    assert [(e[0], e[4]) for e in timeline.events if e[0] == "done"] == [("done", base)]
