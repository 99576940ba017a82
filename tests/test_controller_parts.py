"""Each part of the controller's core on its own, without processes."""

import pytest

from pathways.controller import membership as ms
from pathways.controller.core import ControllerCore, WorkerConn
from pathways.controller.handles import HandleTable
from pathways.controller.islands import Islands, Recovery
from pathways.controller.placement import ResourceManager
from pathways.controller.programs import RunFailure, SessionPrograms
from pathways.controller.lowering import FnLayouts
from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle
from tests.test_controller import Box, _of, register, session


def _register(i, devices=1):
    """Worker ``i`` alone in island ``i``."""
    return m.Register(f"grpc://h:{i}", f"tcp://h:{i}", "cpu", devices, str(i), 1, None, "", 1, "h", 1 << 30)


def test_membership_welcomes_each_worker_and_tells_everyone_every_peer():
    members = ms.Membership(ResourceManager(Islands()))
    conns = [ms.WorkerConn(Box()) for _ in range(3)]
    for i, conn in enumerate(conns):
        members.register(conn, _register(i))
    assert [_of(c.outbox, m.WorkerWelcome) for c in conns] == [[m.WorkerWelcome(i, i, 0, "")] for i in range(3)]
    known = [{p[:2] for x in _of(c.outbox, m.Peers) for p in x.peers} for c in conns]
    assert known == [{(0, "tcp://h:0"), (1, "tcp://h:1"), (2, "tcp://h:2")}] * 3
    assert [len(_of(c.outbox, m.Peers)[0].peers) for c in conns] == [1, 2, 3], "each newcomer gets the full list"
    assert all(len(x.peers) == 1 for c in conns for x in _of(c.outbox, m.Peers)[1:]), "the others, the newcomer"
    # each worker gets its own key first, and for each peer the ticket that peer's key makes
    # for it; no two workers share a key, so no ticket opens another pair's connection
    keys = [_of(c.outbox, m.DataKey) for c in conns]
    assert [[k.worker for k in ks] for ks in keys] == [[0], [1], [2]]
    assert all([type(x) for x in c.outbox].index(m.DataKey) < [type(x) for x in c.outbox].index(m.Peers)
               for c in conns)
    keys = [ks[0].key for ks in keys]
    assert len(set(keys)) == 3
    for i, c in enumerate(conns):
        for x in _of(c.outbox, m.Peers):
            for peer, _, ticket in x.peers:
                assert ticket == m.data_ticket(keys[peer], i) != m.data_ticket(keys[peer], (i + 1) % 3)
    members.register(conns[0], _register(9))
    assert "already registered" in _of(conns[0].outbox, m.Notice)[0].message
    assert members.gone([0, 1, 7]) == [7]


def test_membership_refuses_workers_beyond_its_bound(monkeypatch):
    monkeypatch.setattr(ms, "MAX_WORKERS", 2)
    members = ms.Membership(ResourceManager(Islands()))
    conns = [ms.WorkerConn(Box()) for _ in range(3)]
    for i, conn in enumerate(conns):
        members.register(conn, _register(i))
    assert len(members.workers) == 2 and conns[2].worker == -1
    assert "2 workers" in _of(conns[2].outbox, m.Shutdown)[0].reason


def test_removing_a_worker_forgets_its_links_and_moves_a_measurement_on():
    members = ms.Membership(ResourceManager(Islands()))
    conns = [ms.WorkerConn(Box()) for _ in range(2)]
    for i, conn in enumerate(conns):
        members.register(conn, _register(i))
    members.measured(conns[1], m.Measured(0, 1e9, 1 << 30, ((0, 1e-4, 1e9),)))
    assert members.links == {(1, 0): (1e-4, 1e9)}
    done = []
    mid = members.measure(lambda: done.append(mid))
    assert _of(conns[0].outbox, m.Measure) == [m.Measure(mid)]
    members.remove(0)
    assert members.links == {} and _of(conns[1].outbox, m.Measure) == [m.Measure(mid)]
    members.measured(conns[1], m.Measured(mid, None, 1 << 30, ()))
    assert done == [mid]


def test_the_dispatcher_sends_a_program_once_per_worker_and_frees_the_window_when_all_report():
    core = ControllerCore()
    w0, = register(core, 1)
    client = session(core)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 0, False)]))
    layout = Layout((0,), ((0, 0),), (1,), ("x",), ())
    fn, program, data = (1 << 40) + 1, (1 << 40) + 2, (1 << 40) + 3
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[fn, [0], [1]]], "outputs": [1],
                           "types": [["float32", [1]]] * 2}, "graph")
    core.on_session_batch(1, m.encode_batch([
        m.DefineFunction(fn, _of(client, m.SliceReply)[0].slice, m.FunctionBody("f", b"x", (layout,), (layout,))),
        m.DefineProgram(program, graph, "parallel"), m.PutNotice(data, layout),
        m.Run(program, (1 << 40) + 10, {0: data}), m.Run(program, (1 << 40) + 20, {0: data})]))
    assert not _of(client, m.Error)
    assert len(_of(w0.outbox, m.Define)) == 1, "the op stream goes once; each run is a small message"
    runs = _of(w0.outbox, m.RunProgram)
    assert [r.base for r in runs] == [(1 << 40) + 10, (1 << 40) + 20]
    assert core.scheduler.running(runs[0].id) is not None
    core.on_worker_batch(w0, m.encode_batch([m.Done(((runs[0].id, 0.5), (runs[1].id, 0.25)))]))
    assert core.scheduler.running(runs[0].id) is None and core.scheduler.running(runs[1].id) is None
    assert core.status().as_dict()["sessions"][0]["arrays"] == 3


def test_session_programs_cache_lowerings_and_refuse_poisoned_or_lost_inputs():
    layout = Layout((0,), ((0, 0),), (1,), ("x",), ())
    programs = SessionPrograms()
    programs.fns[7] = FnLayouts((0,), (layout,), (layout,))
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[7, [0], [1]]], "outputs": [1],
                           "types": [["float32", [1]]] * 2}, "graph")
    programs.define(9, graph, sequential=False)
    table = HandleTable(live={100: layout})
    key, lowered = programs.lowered(9, {0: 100}, table, lambda ws: [])
    assert programs.lowered(9, {0: 100}, table, lambda ws: []) == (key, lowered)
    assert programs.keys == [key]
    with pytest.raises(RunFailure, match="gone") as lost:
        programs.lowered(9, {0: 100}, table, lambda ws: list(ws))
    assert lost.value.kind == "WorkerLostError"
    table.poison([100], "RemoteError", "it failed")
    with pytest.raises(RunFailure, match="it failed"):
        programs.lowered(9, {0: 100}, table, lambda ws: [])
    with pytest.raises(RunFailure, match="deleted or never created"):
        programs.lowered(9, {0: 101}, table, lambda ws: [])


# ---- session isolation ------------------------------------------------------------------

def test_each_session_has_its_own_credential_and_every_worker_learns_it_before_the_client():
    core = ControllerCore()
    early, = register(core, 1)
    clients = {sid: session(core, sid) for sid in (1, 2, 3)}
    credentials = {sid: core.sessions[sid].credential for sid in clients}
    assert len(set(credentials.values())) == 3 and all(len(c) == m.CREDENTIAL_BYTES for c in credentials.values())
    assert {sid: _of(c, m.SessionWelcome)[0].credential for sid, c in clients.items()} == credentials
    digests = {sid: m.digest(m.worker_credential(c, early.address)) for sid, c in credentials.items()}
    assert _of(early.outbox, m.SessionOpen) == [m.SessionOpen(sid, digests[sid]) for sid in (1, 2, 3)]
    assert all(c not in digests.values() and m.digest(c) not in digests.values() for c in credentials.values()), \
        "workers get digests of their own credentials, not the session's secret"
    core.session_closed(2)
    assert _of(early.outbox, m.DropSession)[0].session == 2
    # a worker that registers later hears of every open session, in the order they opened,
    # each with the digest of what the session presents to it, which no other worker accepts
    late = WorkerConn(Box())
    core.on_worker_batch(late, m.encode_batch([_register(5)]))
    assert late.address != early.address
    own = {sid: m.digest(m.worker_credential(credentials[sid], late.address)) for sid in (1, 3)}
    assert _of(late.outbox, m.SessionOpen) == [m.SessionOpen(1, own[1]), m.SessionOpen(3, own[3])]
    assert not set(own.values()) & set(digests.values())
    # a second Register on the same stream is refused and announces nothing again
    core.on_worker_batch(late, m.encode_batch([_register(6)]))
    assert len(_of(late.outbox, m.SessionOpen)) == 2


def _two_sessions_with_a_program():
    """Session 1 holds a live array; session 2 has a function and a program of its own."""
    core = ControllerCore()
    w0, = register(core, 1)
    victim, thief = session(core, 1), session(core, 2)
    layout = Layout((0,), ((0, 0),), (1,), ("x",), ())
    victim_array = first_handle(1) + 5
    core.on_session_batch(1, m.encode_batch([m.PutNotice(victim_array, layout)]))
    core.on_session_batch(2, m.encode_batch([m.SliceRequest(1, "cpu", 1, None, 0, False)]))
    fn, program = first_handle(2) + 1, first_handle(2) + 2
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[fn, [0], [1]]], "outputs": [1],
                           "types": [["float32", [1]]] * 2}, "graph")
    core.on_session_batch(2, m.encode_batch([
        m.DefineFunction(fn, _of(thief, m.SliceReply)[0].slice, m.FunctionBody("f", b"x", (layout,), (layout,))),
        m.DefineProgram(program, graph, "parallel")]))
    assert not _of(victim, m.Error) and not _of(thief, m.Error)
    return core, w0, victim, thief, victim_array, program, layout


def test_a_session_cannot_run_its_program_on_another_sessions_array():
    core, w0, victim, thief, victim_array, program, layout = _two_sessions_with_a_program()
    base = first_handle(2) + 100
    core.on_session_batch(2, m.encode_batch([m.Run(program, base, {0: victim_array})]))
    poisoned = _of(thief, m.Poisoned)
    assert [(p.handles, p.kind) for p in poisoned] == [((base + 1,), "AccessDeniedError")]
    assert f"{victim_array:#x}" in poisoned[0].message and "belongs to session 1" in poisoned[0].message
    assert not _of(w0.outbox, m.RunProgram) and not _of(w0.outbox, m.Define), "nothing ran"
    assert not _of(victim, m.Poisoned) and victim_array in core.sessions[1].handles.live
    # the same program on the thief's own array runs
    own = first_handle(2) + 50
    core.on_session_batch(2, m.encode_batch([m.PutNotice(own, layout), m.Run(program, base + 10, {0: own})]))
    assert len(_of(w0.outbox, m.RunProgram)) == 1 and len(_of(thief, m.Poisoned)) == 1


@pytest.mark.parametrize("make, needle", [
    (lambda h, layout: m.PutNotice(h, layout), "does not belong to this session"),
    (lambda h, layout: m.Delete((first_handle(2) + 7, h)), "1 of the 2 array(s) to delete belong to other sessions"),
    (lambda h, layout: m.DefineProgram(h, m.GRAPH.check(
        {"nvalues": 2, "inputs": [0], "nodes": [[first_handle(2) + 1, [0], [1]]], "outputs": [1],
         "types": [["float32", [1]]] * 2}, "graph"), "parallel"), "does not belong to this session"),
])
def test_a_session_naming_another_sessions_handle_is_refused_and_nothing_changes(make, needle):
    core, w0, victim, thief, victim_array, program, layout = _two_sessions_with_a_program()
    own = first_handle(2) + 7
    core.on_session_batch(2, m.encode_batch([m.PutNotice(own, layout)]))
    sent_to_worker = list(w0.outbox)
    core.on_session_batch(2, m.encode_batch([make(victim_array, layout), m.ClusterRequest(9)]))
    errors = _of(thief, m.Error)
    assert len(errors) == 1 and errors[0].kind == "AccessDeniedError", errors
    assert needle in errors[0].message and f"{victim_array:#x}" in errors[0].message
    assert list(w0.outbox) == sent_to_worker, "no worker was told anything"
    assert core.sessions[1].handles.live == {victim_array: layout}
    assert own in core.sessions[2].handles.live, "a refused delete deletes none of its handles"
    assert victim_array not in core.sessions[2].handles.live
    assert [r.req for r in _of(thief, m.ClusterReply)] == [9], "the session goes on"
    assert not _of(victim, m.Error) and not _of(victim, m.Poisoned)


def _island_of_two(core):
    """Two hosts of two devices each, one island; returns their connections, rank order."""
    conns = [WorkerConn(Box()) for _ in range(2)]
    for rank, conn in enumerate(conns):
        core.on_worker_batch(conn, m.encode_batch([m.Register(
            f"grpc://h:{rank}", f"tcp://h:{rank}", "cpu", 2, "isl", 2, rank, f"h:{9 + rank}", 1, "h",
            1 << 30)]))
    return conns


def _graph(fn):
    return m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[fn, [0], [1]]], "outputs": [1],
                          "types": [["float32", [4]]] * 2}, "graph")


def test_an_xla_function_compiles_on_the_hosts_of_its_devices_and_runs_once_the_first_reports():
    core = ControllerCore()
    w0, w1 = _island_of_two(core)
    client = session(core)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 4, None, None, False)]))
    reply, = _of(client, m.SliceReply)
    base = first_handle(1)
    one_host, both, program, data = base + 1, base + 2, base + 3, base + 4
    core.on_session_batch(1, m.encode_batch([
        m.DefineFunction(one_host, reply.slice, m.FunctionBody("f", b"mlir", (), (), "xla", b"opts", (1, 1, 1, 0))),
        m.DefineFunction(both, reply.slice, m.FunctionBody("g", b"mlir", (), (), "xla", b"opts", (1, 0, 0, 0))),
    ]))
    g = m.FunctionBody("g", b"mlir", (), (), "xla", b"opts", (1, 0, 0, 0))
    assert _of(w0.outbox, m.Compile) == [m.Compile(both, g, (w0.worker, w1.worker))], "workers in island-rank order"
    assert [c.fn for c in _of(w1.outbox, m.Compile)] == [one_host, both]
    assert _of(w1.outbox, m.Compile)[0].workers == (w1.worker,)

    layout = Layout((w0.worker, w1.worker), ((1, 0), (0, 0)), (2,), ("r",), ())
    core.on_session_batch(1, m.encode_batch([m.DefineProgram(program, _graph(both), "parallel"),
                                             m.PutNotice(data, layout), m.Run(program, base + 10, {0: data})]))
    poisoned, = _of(client, m.Poisoned)
    assert poisoned.handles == (base + 11,) and "has not finished compiling" in poisoned.message
    assert not _of(w0.outbox, m.RunProgram)

    compiled = m.Compiled(both, "", (layout,), (layout,), (("float32", (4,)),), (b"",), (b"",), ((0,),), ((0,),),
                          (), "ab", "jit_g")
    core.on_worker_batch(w0, m.encode_batch([compiled]))  # not the host of the first device
    assert "worker 1 reports it, not worker 0" in _of(w0.outbox, m.Notice)[-1].message
    core.on_worker_batch(w1, m.encode_batch([m.Compiled(base + 99, "late")]))  # no such function: ignored
    core.on_worker_batch(w1, m.encode_batch([m.Compiled(first_handle(7) + 1, "")]))  # no such session: ignored
    assert not _of(client, m.Compiled)
    core.on_worker_batch(w1, m.encode_batch([compiled]))
    assert _of(client, m.Compiled) == [compiled], "forwarded unchanged"
    core.on_session_batch(1, m.encode_batch([m.Run(program, base + 20, {0: data})]))
    assert [r.base for r in _of(w0.outbox, m.RunProgram)] == [base + 20] == [r.base for r in _of(w1.outbox, m.RunProgram)]

    outside = Layout((w0.worker,), ((0, 1),), (1,), ("r",), ())  # a device the executable does not have
    core.on_worker_batch(w1, m.encode_batch([m.Compiled(one_host, "", (outside,), (), (), (b"",), (), ((0,),), (),
                                                        (), "", "")]))
    assert "outside its own" in _of(client, m.Compiled)[-1].error
    core.on_session_batch(1, m.encode_batch([m.DefineProgram(base + 5, _graph(one_host), "parallel"),
                                             m.Run(base + 5, base + 30, {0: data})]))
    assert "did not compile: the executable of 'f' reported" in _of(client, m.Poisoned)[-1].message


def test_an_xla_function_off_its_slice_or_on_a_lost_host_fails_its_compile():
    core = ControllerCore()
    w0, w1 = _island_of_two(core)
    client = session(core)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 2, None, None, False)]))
    reply, = _of(client, m.SliceReply)
    base = first_handle(1)
    off = next(d for d in ((0, 0), (0, 1), (1, 0), (1, 1)) if d not in zip(reply.devices[::2], reply.devices[1::2]))
    core.on_session_batch(1, m.encode_batch([
        m.DefineFunction(base + 1, reply.slice, m.FunctionBody("f", b"mlir", (), (), "xla", b"", off)),
        m.DefineFunction(base + 2, reply.slice + 5,
                         m.FunctionBody("f", b"mlir", (), (), "xla", b"", reply.devices[:2]))]))
    failed = _of(client, m.Compiled)
    assert [c.fn for c in failed] == [base + 1, base + 2]
    assert "outside slice" in failed[0].error and "not one of this session's slices" in failed[1].error
    assert not _of(w0.outbox, m.Compile) + _of(w1.outbox, m.Compile)
    core.on_session_batch(1, m.encode_batch([
        m.DefineFunction(base + 3, reply.slice, m.FunctionBody("f", b"mlir", (), (), "xla", b"", reply.devices))]))
    core.worker_lost(w1)
    assert _of(client, m.Compiled)[-1].fn == base + 3 and "was lost" in _of(client, m.Compiled)[-1].error


@pytest.mark.parametrize("fmt", ["xla", "export"])
@pytest.mark.parametrize("recovery", list(Recovery))  # a host may be started by hand where nothing restarts it
def test_a_function_defined_on_a_healing_island_compiles_once_it_has_healed(fmt, recovery):
    # what an elastic loop's health check does while a host is being replaced: it compiles
    core = ControllerCore(recovery=recovery)
    w0, w1 = _island_of_two(core)
    client = session(core)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 4, None, None, False)]))
    reply, = _of(client, m.SliceReply)
    core.worker_lost(w1)
    base = first_handle(1)
    everywhere = Layout((w0.worker, w1.worker), ((0, 0), (0, 1), (1, 0), (1, 1)), (4,), ("x",), ("x",))
    body = (m.FunctionBody("f", b"mlir", (), (), "xla", b"", reply.devices) if fmt == "xla"
            else m.FunctionBody("f", b"x", (everywhere,), (everywhere,)))
    core.on_session_batch(1, m.encode_batch([m.DefineFunction(base + 1, reply.slice, body)]))
    assert not _of(client, m.Compiled) and not _of(client, m.Error), "no failure: the island heals"
    new = [WorkerConn(Box()) for _ in range(2)]
    for rank, conn in enumerate(new):
        assert not _of(conn.outbox, m.Compile), "nothing compiles before the island has healed"
        core.on_worker_batch(conn, m.encode_batch([m.Register(
            f"grpc://n:{rank}", f"tcp://n:{rank}", "cpu", 2, "isl", 2, rank, f"n:{9 + rank}", 1, "n", 1 << 30)]))
    assert core.islands.healthy(reply.island)
    for conn in new:
        assert [c.fn for c in _of(conn.outbox, m.Compile)] == [base + 1]


def test_a_jax_export_function_may_use_some_devices_of_its_slice():
    core = ControllerCore()
    w0, w1 = _island_of_two(core)
    client = session(core)
    core.on_session_batch(1, m.encode_batch([m.SliceRequest(1, "cpu", 4, None, None, False)]))
    reply, = _of(client, m.SliceReply)
    base = first_handle(1)
    second_host = Layout((w1.worker,), ((1, 0), (1, 1)), (2,), ("x",), ("x",))
    mislabelled = Layout((w0.worker,), ((1, 0),), (1,), ("x",), ())
    core.on_session_batch(1, m.encode_batch([
        m.DefineFunction(base + 1, reply.slice, m.FunctionBody("f", b"x", (second_host,), (second_host,))),
        m.DefineFunction(base + 2, reply.slice, m.FunctionBody("g", b"x", (mislabelled,), (mislabelled,)))]))
    assert [c.workers for c in _of(w1.outbox, m.Compile)] == [(w1.worker,)] and not _of(w0.outbox, m.Compile)
    assert core.sessions[1].programs.fns[base + 1].workers == (w1.worker,)
    error, = _of(client, m.Error)
    assert "its devices are on workers [1]" in error.message


def _join(core, name, hosts, rank):
    conn = WorkerConn(Box())
    core.on_worker_batch(conn, m.encode_batch([m.Register(
        f"grpc://h:{rank}", f"tcp://h:{rank}", "cpu", 1, name, hosts, rank, "h0:1", 1, f"host{rank}", 1 << 30)]))
    return conn


def test_a_put_or_run_on_a_healing_island_says_which_island_lost_what_and_that_calling_again_works():
    core = ControllerCore()
    rank0, rank1, elsewhere = _join(core, "a", 2, 0), _join(core, "a", 2, 1), _join(core, "b", 1, 0)
    sid, client = 1, Box()
    core.session_opened(sid, client)
    core.on_session_batch(sid, m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0),
                                               m.SliceRequest(1, "cpu", 2, None, None, False)]))
    [reply] = _of(client, m.SliceReply)
    layout = Layout(reply.workers, ((0, 0), (1, 0)), (2,), ("x",), ())
    fn, program, data, base = (first_handle(sid) + i for i in (1, 2, 3, 10))
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[fn, [0], [1]]], "outputs": [1],
                           "types": [["float32", [2]]] * 2}, "graph")
    body = m.FunctionBody("f", b"artifact", (layout,), (layout,))
    core.on_session_batch(sid, m.encode_batch([m.DefineFunction(fn, reply.slice, body),
                                               m.DefineProgram(program, graph, "parallel")]))
    core.worker_lost(rank1, error="connection reset")

    core.on_session_batch(sid, m.encode_batch([m.PutNotice(data, layout)]))
    [put] = [x for x in _of(client, m.Poisoned) if data in x.handles]
    assert put.kind == "WorkerLostError"
    for says in ("island 'a' (id 0) is healing", "worker 1 on host host1", "connection reset",
                 "waiting for 2 host(s) started elsewhere to join", "The array is lost", "calling again, works"):
        assert says in put.message, (says, put.message)

    _join(core, "a", 2, 0)  # one host is back; the island is not whole yet
    other = first_handle(sid) + 20  # an input on the healthy island "b"
    core.on_session_batch(sid, m.encode_batch([m.PutNotice(other, Layout((elsewhere.worker,), ((0, 0),), (1,),
                                                                         ("x",), ()))]))
    core.on_session_batch(sid, m.encode_batch([m.Run(program, base, {0: other})]))
    [run] = [x for x in _of(client, m.Poisoned) if base + 1 in x.handles]
    for says in ("island 'a' (id 0) is healing", "connection reset", "waiting for 1 host(s) started elsewhere to join",
                 "call it again once"):
        assert says in run.message, (says, run.message)
