"""Retiring islands and hosts (`pathways retire`) in the controller's core, without
processes: draining, shutting hosts down, failing what is left with the operator's reason,
releasing slices, forgetting islands; the bound on remembered lost islands; and the shell's
bounded wait for the drain, on an event loop without gRPC. (tests/test_retire.py runs the
command against a real cluster.)"""

import asyncio

import pytest

from pathways.controller import retiring as retiring_module
from pathways.controller.core import ControllerCore, WorkerConn
from pathways.controller.server import ControllerServer
from pathways.errors import PathwaysError
from pathways.ir import Layout
from pathways.protocol import messages as m, operator
from pathways.protocol.handles import first_handle
from tests.test_controller import Box, _of, register, session


def _register(core, island, hosts=1, address=None):
    conn = WorkerConn(Box())
    address = address or f"127.0.0.1:{100 + len(core.workers) + len(core.islands.by_id)}"
    core.on_worker_batch(conn, m.encode_batch([m.Register(
        f"grpc://{address}", f"tcp://{address}", "cpu", 1, island, hosts, None, "h:1" if hosts > 1 else "", 1, "h",
        1 << 30)]))
    assert conn.worker >= 0, conn.outbox
    return conn


def _islands(core):
    return {i["name"]: i for i in core.status().as_dict()["islands"]}


class Client:
    """A session with a slice on one island, a one-node program there, and an array to run it on."""

    def __init__(self, core, island, sid=1):
        self.core, self.sid = core, sid
        self.box = session(core, sid)
        self.ids = iter(range(first_handle(sid) + 1, first_handle(sid) + 10_000))
        self.send(m.SliceRequest(1, "cpu", 1, None, island, False))
        self.slice = _of(self.box, m.SliceReply)[-1]
        self.layout = Layout(self.slice.workers, ((0, 0),), (1,), ("x",), ())
        self.fn, self.program, self.array = next(self.ids), next(self.ids), next(self.ids)
        graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[self.fn, [0], [1]]], "outputs": [1],
                               "types": [["float32", [2]]] * 2}, "graph")
        self.send(m.DefineFunction(self.fn, self.slice.slice, self.body("f")),
                  m.DefineProgram(self.program, graph, "parallel"), m.PutNotice(self.array, self.layout))
        assert not _of(self.box, m.Error), self.box

    def body(self, name):
        """A jax.export function on this client's one layout."""
        return m.FunctionBody(name, b"artifact", (self.layout,), (self.layout,))

    def send(self, *messages):
        self.core.on_session_batch(self.sid, m.encode_batch(list(messages)))

    def run(self, array=None):
        """Run the program on ``array`` (default: the one it put); returns its output handle."""
        base = next(self.ids)
        self.ids = iter(range(base + 2, base + 10_000))
        self.send(m.Run(self.program, base, {0: self.array if array is None else array}))
        return base + 1

    def put_on(self, island):
        """An array put on a new slice on ``island``."""
        self.send(m.SliceRequest(2, "cpu", 1, None, island, False))
        reply = next(x for x in _of(self.box, m.SliceReply) if x.req == 2)
        handle = next(self.ids)
        self.send(m.PutNotice(handle, Layout(reply.workers, ((0, 0),), (1,), ("x",), ())))
        return handle

    def poisoned(self, handle):
        return [p for p in _of(self.box, m.Poisoned) if handle in p.handles]


def _retire(core, island="", worker=None):
    calls = []
    r = core.retire(island, worker, lambda: calls.append(1))
    return r, calls


def test_a_lost_island_is_forgotten_its_slices_released_and_its_name_free_again():
    core = ControllerCore()
    w0, w1 = register(core, 2)
    client = Client(core, island=1)
    core.worker_lost(w1)
    assert not _islands(core)["1"]["healthy"]

    r, drained = _retire(core, "1")
    assert drained == [1], "a lost island has no runs to wait for"
    report = core.finish_retirement(r).as_dict()
    assert (report["was"], report["hosts"], report["slices_released"], report["sessions"]) == ("lost", [], 1, [1])
    assert list(_islands(core)) == ["0"] and core.status().as_dict()["slices"] == 0, "status no longer lists it"
    assert not _of(w0.outbox, m.Shutdown)

    # the session is told why when it uses the slice or its function
    client.send(m.DefineFunction(next(client.ids), client.slice.slice, client.body("g")))
    error = _of(client.box, m.Error)[-1]
    assert error.kind == "PlacementError" and "retired by the operator" in error.message
    out = client.run(client.put_on(0))  # an input from elsewhere, for the function on the retired island
    assert [p.kind for p in client.poisoned(out)] == ["WorkerLostError"]
    assert "retired by the operator" in client.poisoned(out)[0].message
    put = next(client.ids)
    client.send(m.PutNotice(put, client.layout))
    assert "retired by the operator" in client.poisoned(put)[0].message

    newcomer = _register(core, "1")
    assert newcomer.worker == 2 and _islands(core)["1"]["healthy"], "a new worker takes the name again"
    assert newcomer.worker not in client.slice.workers


def test_a_healthy_island_drains_its_runs_then_its_hosts_are_shut_down_and_its_arrays_fail():
    core = ControllerCore()
    w0, w1 = register(core, 2)
    client = Client(core, island=1)
    out = client.run()
    run_id = _of(w1.outbox, m.RunProgram)[-1].id

    r, drained = _retire(core, "1")
    assert drained == [] and _islands(core)["1"]["retiring"], "a run is in flight there"
    client.send(m.SliceRequest(50, "cpu", 1, None, 1, False), m.SliceRequest(51, "cpu", 1, None, None, False))
    refused = next(e for e in _of(client.box, m.Error) if e.req == 50)
    assert refused.kind == "PlacementError" and "being retired" in refused.message
    assert next(x for x in _of(client.box, m.SliceReply) if x.req == 51).island == 0, "other islands serve"

    core.on_worker_batch(w1, m.encode_batch([m.Done(((run_id, 0.01),))]))
    assert drained == [1]
    report = core.finish_retirement(r).as_dict()
    assert (report["was"], report["hosts"], report["runs_cut"], report["slices_released"]) == ("healthy", [1], 0, 1)
    shutdown = _of(w1.outbox, m.Shutdown)
    assert len(shutdown) == 1 and "retired by the operator" in shutdown[0].reason
    assert list(_islands(core)) == ["0"] and [w["worker"] for w in core.status().as_dict()["workers"]] == [0]
    for array in (client.array, out):  # the run finished, but arrays that live there are gone with it
        lost = client.poisoned(array)
        assert lost and lost[0].kind == "WorkerLostError" and "retired by the operator" in lost[0].message

    before = list(client.box)
    core.worker_lost(w1)  # its stream ends as it exits: nothing more happens
    assert client.box == before and list(_islands(core)) == ["0"]


def test_runs_still_there_when_the_wait_runs_out_fail_with_the_operators_reason():
    core = ControllerCore()
    w0, w1 = register(core, 2)
    client = Client(core, island=1)
    out = client.run()
    r, drained = _retire(core, "1")
    report = core.finish_retirement(r).as_dict()  # the shell's wait ran out
    assert drained == [] and report["runs_cut"] == 1
    assert client.poisoned(out) and all(p.kind == "WorkerLostError" and "retired by the operator" in p.message
                                        for p in client.poisoned(out))
    assert core.status().as_dict()["islands"][0]["inflight"] == 0 and not _of(w0.outbox, m.Shutdown)


def test_a_retirement_the_operator_abandons_leaves_the_island_serving():
    core = ControllerCore()
    w0, w1 = register(core, 2)
    client = Client(core, island=1)
    client.run()
    r, _ = _retire(core, "1")
    core.abandon_retirement(r)
    assert core.finish_retirement(r) is None, "an abandoned retirement does nothing"
    client.send(m.SliceRequest(60, "cpu", 1, None, 1, False))
    assert any(x.req == 60 and x.island == 1 for x in _of(client.box, m.SliceReply))
    assert not _of(w1.outbox, m.Shutdown) and not _islands(core)["1"]["retiring"]


def test_one_host_of_a_larger_island_is_lost_on_purpose_and_replaced_under_its_worker_id():
    core = ControllerCore()
    a0, a1 = _register(core, "rack-a", hosts=2), _register(core, "rack-a", hosts=2)
    r, drained = _retire(core, worker=a1.worker)
    assert drained == [1]
    report = core.finish_retirement(r).as_dict()
    assert (report["worker"], report["hosts"]) == (a1.worker, [a1.worker])
    assert len(_of(a1.outbox, m.Shutdown)) == 1 and not _of(a1.outbox, m.Reset)
    assert len(_of(a0.outbox, m.Reset)) == 1, "the other host restarts to rejoin"
    island = _islands(core)["rack-a"]
    assert not island["healthy"] and "retired by the operator" in island["lost"]
    again, replacement = _register(core, "rack-a", hosts=2), _register(core, "rack-a", hosts=2)
    assert {again.worker, replacement.worker} == {a0.worker, a1.worker}
    assert _islands(core)["rack-a"]["healthy"]


def test_retiring_the_only_host_of_an_island_retires_the_island():
    core = ControllerCore()
    w0, w1 = register(core, 2)
    r, _ = _retire(core, worker=w1.worker)
    report = core.finish_retirement(r).as_dict()
    assert report["hosts"] == [1] and list(_islands(core)) == ["0"]
    assert "retired by the operator" in _of(w1.outbox, m.Shutdown)[0].reason


def test_an_unknown_island_or_worker_and_a_second_retirement_are_refused_with_what_to_do():
    core = ControllerCore()
    register(core, 2)
    _register(core, "rack-b")
    with pytest.raises(PathwaysError, match="no island is named 'nope'.*'rack-b'"):
        core.retire("nope", None, lambda: None)
    with pytest.raises(PathwaysError, match="no worker 9 is attached"):
        core.retire("", 9, lambda: None)
    r, _ = _retire(core, "2")  # an island's id names it too
    assert r.island.name == "rack-b"
    with pytest.raises(PathwaysError, match="being retired already"):
        core.retire("rack-b", None, lambda: None)


def test_lost_islands_nobody_rejoins_are_forgotten_oldest_first_beyond_the_bound(monkeypatch):
    """1,000 registrations that went away left 509 lost islands in status for good."""
    monkeypatch.setattr(retiring_module, "MAX_LOST_ISLANDS", 3)
    core = ControllerCore()
    conns = register(core, 6)
    client = Client(core, island=0)
    for conn in conns[:5]:
        core.worker_lost(conn)
    assert list(_islands(core)) == ["2", "3", "4", "5"], "three lost islands kept, the oldest forgotten"
    out = client.run(client.put_on(5))
    assert "forgotten" in client.poisoned(out)[0].message
    healing = _register(core, "4")
    assert healing.worker == 4, "a remembered lost island heals under its worker id"
    core.worker_lost(conns[5])
    assert list(_islands(core)) == ["2", "3", "4", "5"]


def test_a_thousand_registrations_that_go_away_leave_the_newest_lost_islands_up_to_the_bound():
    """The probe itself, at the real bound: 1,000 one-host islands registered and lost one
    after another leave MAX_LOST_ISLANDS of them, the newest, and no worker."""
    core = ControllerCore()
    for i in range(1000):
        core.worker_lost(_register(core, f"r{i}"))
    status = core.status().as_dict()
    kept = {f"r{i}" for i in range(1000 - retiring_module.MAX_LOST_ISLANDS, 1000)}
    assert {i["name"] for i in status["islands"]} == kept and len(status["islands"]) == len(kept)
    assert status["workers"] == []
    assert len(core.islands.by_id) == retiring_module.MAX_LOST_ISLANDS


# ---- the shell's wait (controller/server.py), on an event loop without gRPC ----------------

def _serve_retire(request, during=None):
    """Call the shell's Retire method with ``request`` on a fresh controller whose island 1
    has a run in flight; ``during(server, w1, run_id)`` runs on the loop while it waits."""
    server = ControllerServer("fair", 8)
    w0, w1 = register(server.core, 2)
    client = Client(server.core, island=1)
    client.run()
    run_id = _of(w1.outbox, m.RunProgram)[-1].id

    async def call():
        task = asyncio.ensure_future(server.retire(m.pack(request.encode()), None))
        if during is not None:
            await asyncio.sleep(0.05)
            during(server, w1, run_id, task)
        try:
            return m.unpack(await task)
        except asyncio.CancelledError:
            return None

    return asyncio.run(call()), server, w1


def test_the_shell_retires_the_island_once_its_runs_finish_or_its_wait_runs_out():
    def finish(server, w1, run_id, task):
        server.core.on_worker_batch(w1, m.encode_batch([m.Done(((run_id, 0.01),))]))

    reply, server, w1 = _serve_retire(m.RetireRequest("1", None, 30.0), finish)
    retired = operator.RETIRE_REPLY.decode(reply)
    assert retired.drained and retired.runs_cut == 0 and retired.hosts == (1,) and _of(w1.outbox, m.Shutdown)

    reply, server, w1 = _serve_retire(m.RetireRequest("1", None, 0.2))  # nobody reports the run done
    retired = operator.RETIRE_REPLY.decode(reply)
    assert not retired.drained and retired.runs_cut == 1 and _of(w1.outbox, m.Shutdown)
    assert [i["name"] for i in server.core.status().as_dict()["islands"]] == ["0"]


def test_the_shell_leaves_the_island_serving_when_the_caller_gives_up_and_answers_errors_as_failed():
    reply, server, w1 = _serve_retire(m.RetireRequest("1", None, 30.0), lambda s, w, r, task: task.cancel())
    assert reply is None and not _of(w1.outbox, m.Shutdown)
    assert not _islands(server.core)["1"]["retiring"]

    reply, _, _ = _serve_retire(m.RetireRequest("nope", None, 1.0))
    failed = operator.RETIRE_REPLY.decode(reply)
    assert failed.kind == "PathwaysError" and "no island is named 'nope'" in failed.error
    bad = asyncio.run(ControllerServer("fair", 8).retire(m.pack(["retire", "", None, 1.0]), None))
    assert operator.RETIRE_REPLY.decode(m.unpack(bad)).kind == "WireError"
