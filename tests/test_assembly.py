"""Islands that assemble themselves, and servers that bind and advertise chosen hosts.

The pure parts (rank assignment, island names, address choice) run in this process; the
rest runs a controller and worker processes started as a user would, on loopback (and on
loopback aliases, 127.0.0.2 and 127.0.0.3, which Linux routes like 127.0.0.1).
"""

import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status, stop_processes
from pathways.controller.core import ControllerCore
from pathways.controller.islands import Islands, Recovery, Refused
from pathways.controller.membership import WorkerConn
from pathways.defaults import ADDRESS_LINE
from pathways.errors import PlacementError
from pathways.ir import Layout
from pathways.protocol import messages as m
from pathways.protocol.handles import first_handle
from pathways.protocol.messages import Health
from pathways.wire import addresses
from pathways.worker.island import worker_hosts
from tests.conftest import child_of, read_line, tcp_sockets, wait_until
from tests.test_controller import Box, _of

START_SECONDS = 120.0


# ---- the pure parts -------------------------------------------------------------------------

def test_ranks_follow_arrival_and_everyone_is_welcomed_once_rank_0_is_known():
    islands = Islands()
    a, _, rank_a, welcome_a = islands.join(10, "rack", 3, None, "h0:1")
    b, _, rank_b, welcome_b = islands.join(11, "rack", 3, None, "h1:1")
    assert (rank_a, rank_b) == (0, 1) and a is b
    assert welcome_a == [(10, 0)] and welcome_b == [(11, 1)], "rank 0 came first: each is welcomed at once"
    assert a.coordinator == "h0:1", "the coordinator is rank 0's reserved address"
    assert a.assembling and a.health is Health.ASSEMBLING and not islands.healthy(a.id)
    islands.join(12, "rack", 3, None, "h2:1")
    assert a.assembled and a.health is Health.HEALTHY and islands.healthy(a.id)


def test_asked_ranks_are_honoured_and_hosts_before_rank_0_wait_for_it():
    islands = Islands()
    island, _, rank, welcome = islands.join(5, "x", 3, 2, "h2:7")
    assert rank == 2 and welcome == [], "no coordinator yet: rank 2 waits"
    _, _, rank, welcome = islands.join(6, "x", 3, None, "h?:7")
    assert rank == 0, "an unranked host takes the lowest free rank"
    assert welcome == [(6, 0), (5, 2)] and island.coordinator == "h?:7"
    _, _, rank, welcome = islands.join(7, "x", 3, None, "h1:7")
    assert rank == 1 and welcome == [(7, 1)]


@pytest.mark.parametrize("joins, needle", [
    ([("a", 2, 1), ("a", 2, 1)], "rank 1 of island 'a' is already taken by worker 0; give each host of the "
                                 "island its own --rank (free: [0]), or leave --rank out"),
    ([("a", 2, 2)], "asks for rank 2 (--rank) in island 'a' of 2 host(s); ranks run from 0 to 1"),
    ([("a", 2, None), ("a", 3, None)], "has 3 host(s) (--island-hosts), but the hosts that joined it first said 2"),
    ([("a", 1, None), ("a", 1, None)], "island 'a' already has all its 1 host(s)"),
    ([(" ", 1, None)], "names no island; start it with --island NAME"),
])
def test_a_registration_that_cannot_fit_is_refused_with_what_to_fix(joins, needle):
    islands = Islands()
    *fine, (name, hosts, rank) = joins
    for i, (n, h, r) in enumerate(fine):
        islands.join(i, n, h, r, "h:1")
    before = {i: dict(island.members) for i, island in islands.by_id.items()}
    with pytest.raises(Refused) as refused:
        islands.join(len(fine), name, hosts, rank, "h:1", " on box (pid 7)")
    assert needle in str(refused.value)
    assert before == {i: dict(island.members) for i, island in islands.by_id.items()}, "a refusal changes nothing"


def test_island_names_map_to_ids_and_numbers_keep_theirs():
    islands = Islands()
    assert islands.join(0, "1", 1, None, "")[0].id == 1, "a numeric name is its id"
    assert islands.join(1, "rack-a", 1, None, "")[0].id == 0, "another name takes the lowest free id"
    assert islands.join(2, "0", 1, None, "")[0].id == 2, "0 is taken: the next free one"
    assert islands.join(3, "007", 1, None, "")[0].id == 3, "only canonical numbers are ids"


def test_a_lost_island_heals_under_its_id_and_its_ranks_keep_their_worker_ids():
    islands = Islands()
    island, _, _, _ = islands.join(10, "rack", 3, None, "h0:1")
    islands.join(11, "rack", 3, None, "h1:1")
    islands.join(12, "rack", 3, None, "h2:1")
    islands.lose(island.id, "worker 11 was lost")
    assert island.health is Health.LOST and not island.members and island.coordinator == "" and not island.assembling
    assert island.lost_by == "worker 11 was lost"
    again, worker, rank, welcome = islands.join(20, "rack", 3, 1, "h1:2")
    assert again is island and (worker, rank) == (11, 1), "rank 1 takes the worker id rank 1 had"
    assert welcome == [] and island.health is Health.HEALING and island.assembling
    _, worker, rank, welcome = islands.join(21, "rack", 3, None, "h0:2")
    assert (worker, rank) == (10, 0) and welcome == [(10, 0), (11, 1)] and island.coordinator == "h0:2"
    _, worker, rank, _ = islands.join(22, "rack", 3, None, "h2:2")
    assert (worker, rank) == (12, 2) and island.assembled and island.health is Health.HEALING, \
        "healing until the core says healed"
    assert not islands.healthy(island.id) and island.lost_by == "worker 11 was lost"
    islands.healed(island.id)
    assert islands.healthy(island.id) and island.lost_by is None
    with pytest.raises(Refused, match="already has all its 3 host"):
        islands.join(23, "rack", 3, None, "h3:2")


@pytest.mark.parametrize("recovery, says", [
    (Recovery.RESTART, ["restarting (attempt 1): 2 of its 2 host(s) to join", "restarting (attempt 1): 1 of its 2",
                        "restarting (attempt 2): 2 of its 2 host(s) to join"]),
    (Recovery.ELSEWHERE, ["waiting for 2 host(s) started elsewhere to join (`pathways worker --island rack "
                          "--island-hosts 2", "waiting for 1 host(s) started elsewhere", "waiting for 2 host(s)"]),
    (Recovery.NONE, ["lost, not restarted: 2 of its 2 host(s) gone", "lost, not restarted: 1 of its 2",
                     "lost, not restarted: 2 of its 2"]),
])
def test_a_lost_islands_recovery_says_who_brings_its_hosts_back_and_counts_the_attempts(recovery, says):
    islands = Islands(recovery)
    island, _, _, _ = islands.join(10, "rack", 2, None, "h0:1")
    islands.join(11, "rack", 2, None, "h1:1")
    islands.lose(island.id, "worker 11 was lost")
    assert islands.recovery(island).startswith(says[0]), islands.recovery(island)
    islands.join(20, "rack", 2, None, "h0:2")
    assert islands.recovery(island).startswith(says[1]), islands.recovery(island)
    islands.lose(island.id, "worker 10 was lost")  # lost again before it healed: the next attempt
    assert islands.recovery(island).startswith(says[2]), islands.recovery(island)
    islands.join(21, "rack", 2, None, "h0:3")
    islands.join(22, "rack", 2, None, "h1:3")
    islands.healed(island.id)
    islands.lose(island.id, "worker 10 was lost")  # a new loss after healing counts from 1 again
    assert islands.recovery(island).startswith(says[0]), islands.recovery(island)


def test_a_multi_host_worker_must_bring_a_coordinator_port():
    with pytest.raises(Refused, match="without reserving a coordinator port"):
        Islands().join(0, "a", 2, None, "")


def test_advertised_and_bound_hosts_default_to_the_route_to_the_controller():
    route = {("10.0.0.1", 5): "10.0.0.9", ("ctl.example", 5): "10.1.0.9"}
    pick = lambda host, port: route[(host, port)]  # noqa: E731
    assert worker_hosts("10.0.0.1", 5, None, None, pick) == ("10.0.0.9", "10.0.0.9")
    assert worker_hosts("ctl.example", 5, None, None, pick) == ("10.1.0.9", "10.1.0.9"), "host names resolve"
    assert worker_hosts("10.0.0.1", 5, "0.0.0.0", None, pick) == ("0.0.0.0", "10.0.0.9"), "wildcard: route"
    assert worker_hosts("10.0.0.1", 5, "10.0.0.7", None, pick) == ("10.0.0.7", "10.0.0.7")
    assert worker_hosts("10.0.0.1", 5, None, "me.example", pick) == ("me.example", "me.example")
    assert worker_hosts("10.0.0.1", 5, "0.0.0.0", "[2001:db8::5]", pick) == ("0.0.0.0", "2001:db8::5")
    assert worker_hosts("127.0.0.1", 5, None, None) == ("127.0.0.1", "127.0.0.1"), "a local controller: loopback"


def test_addresses_split_join_and_name_a_reachable_host_for_a_wildcard():
    assert addresses.split_host_port("[::1]:80") == ("::1", 80)
    assert addresses.split_host_port("h.example:0") == ("h.example", 0)
    assert addresses.join_host_port("::1", 80) == "[::1]:80" and addresses.join_host_port("h", 1) == "h:1"
    for bad, needle in (("::1:80", "in brackets"), ("h", "HOST:PORT"), ("h:x", "HOST:PORT"), ("h:70000", "HOST:PORT")):
        with pytest.raises(ValueError, match=needle):
            addresses.split_host_port(bad)
    assert addresses.reachable_host("127.0.0.2") == "127.0.0.2"
    wild = addresses.reachable_host("0.0.0.0")
    assert wild and not addresses.is_wildcard(wild), "a wildcard bind prints an address peers can use"


def test_a_wildcard_without_a_default_route_names_an_interface_address_then_the_host_name(monkeypatch):
    def no_route(host, port):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(addresses, "route_to", no_route)
    monkeypatch.setattr(addresses, "interface_addresses", lambda: ["10.1.2.3", "10.9.9.9"])
    assert addresses.reachable_host("0.0.0.0") == "10.1.2.3"
    monkeypatch.setattr(addresses, "interface_addresses", lambda: [])
    assert addresses.reachable_host("[::]") == socket.gethostname()
    monkeypatch.undo()
    assert all(not a.startswith("127.") for a in addresses.interface_addresses())


def test_a_coordinator_port_reservation_lets_a_reuseport_server_bind_beside_it_and_no_one_else():
    reservation = addresses.PortReservation("127.0.0.1")
    try:
        with pytest.raises(OSError):
            socket.create_server(("127.0.0.1", reservation.port))
        beside = socket.socket()
        beside.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        beside.bind(("127.0.0.1", reservation.port))
        beside.listen()
        beside.close()
    finally:
        reservation.close()


def _register(core, name, hosts, rank=None, coordinator="h:9"):
    conn = WorkerConn(Box())
    core.on_worker_batch(conn, m.encode_batch([m.Register(
        "grpc://h:1", "tcp://h:2", "cpu", 1, name, hosts, rank, coordinator, 1, "h", 1 << 30)]))
    return conn


def test_an_assembling_island_takes_no_slices_and_status_says_how_many_hosts_joined():
    core = ControllerCore()
    first = _register(core, "pair", 2, rank=1)
    assert _of(first.outbox, m.WorkerWelcome) == [], "rank 1 waits for rank 0's coordinator"
    [island] = core.status().as_dict()["islands"]
    assert island["assembling"] and island["hosts"] == 1 and island["expected_hosts"] == 2
    assert island["state"] == "assembling" and not island["healthy"], "healthy: it takes slices, not yet"
    with pytest.raises(PlacementError, match="still assembling"):
        core.rm.place(1, "cpu")
    second = _register(core, "pair", 2, coordinator="h0:5")
    copies = core._next_copy  # no run yet: every copy a peer sends them is a fresh one
    assert _of(first.outbox, m.WorkerWelcome) == [m.WorkerWelcome(first.worker, 0, 1, "h0:5", copies)]
    assert _of(second.outbox, m.WorkerWelcome) == [m.WorkerWelcome(second.worker, 0, 0, "h0:5", copies)]
    assert not core.status().as_dict()["islands"][0]["assembling"] and core.status().as_dict()["islands"][0]["healthy"]
    assert core.rm.place(2, "cpu").workers == (second.worker, first.worker), "hosts in rank order"
    assert [w["rank"] for w in core.status().as_dict()["workers"]] == [1, 0]


def test_a_host_lost_while_its_island_assembles_takes_the_island_down():
    core = ControllerCore()
    waiting = _register(core, "pair", 2, rank=1)
    lost = _register(core, "other", 2, rank=1)
    assert {i["name"] for i in core.status().as_dict()["islands"]} == {"pair", "other"}
    core.worker_lost(lost)
    islands = {i["name"]: i for i in core.status().as_dict()["islands"]}
    assert not islands["other"]["healthy"] and not islands["other"]["assembling"]
    assert islands["other"]["state"] == "lost" and islands["other"]["lost"].startswith(f"worker {lost.worker} ")
    assert islands["pair"]["state"] == "assembling" and waiting.worker in core.workers
    refused = _register(core, "pair", 3)
    assert "said 2" in _of(refused.outbox, m.Shutdown)[0].reason and refused.worker == -1


# ---- processes --------------------------------------------------------------------------------

def _controller(*args):
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "controller", *args], stdout=subprocess.PIPE,
                            text=True)
    line = read_line(proc, timeout=60.0)
    assert line.startswith(ADDRESS_LINE), line
    return proc, line.split()[1]


def _worker(address, *args, stderr=subprocess.DEVNULL):
    return subprocess.Popen([sys.executable, "-m", "pathways", "worker", "--controller", address, *args],
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def _island(address, name):
    return next((i for i in status(address)["islands"] if i["name"] == name), None)


def _assembled(address, name):
    island = _island(address, name)
    return island is not None and not island["assembling"] and island["healthy"]


def _psum_on(address, island):
    pw.connect(address)
    try:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=island)
        total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)
        return np.asarray(total(np.array([3.0, 4.0], np.float32)))
    finally:
        pw.disconnect()


def test_a_two_host_island_started_without_ranks_assembles_in_arrival_order_and_runs_a_psum():
    controller, address = _controller()
    procs = [controller]
    try:
        procs.append(_worker(address, "--island", "pair", "--island-hosts", "2"))
        first = wait_until(lambda: status(address)["workers"], START_SECONDS, "the first worker to register")
        procs.append(_worker(address, "--island", "pair", "--island-hosts", "2"))
        wait_until(lambda: _assembled(address, "pair"), START_SECONDS, "the island to assemble")
        workers = {w["pid"]: w for w in status(address)["workers"]}
        one, two = child_of(procs[1].pid), child_of(procs[2].pid)  # the workers their keepers run
        assert workers[one]["rank"] == 0 and workers[two]["rank"] == 1, "ranks by arrival"
        assert workers[one]["worker"] == first[0]["worker"]
        assert all(w["island_name"] == "pair" for w in workers.values())
        np.testing.assert_array_equal(_psum_on(address, _island(address, "pair")["island"]), [7.0, 7.0])
    finally:
        stop_processes(procs)
        controller.stdout.close()


def test_asked_ranks_are_honoured_a_duplicate_is_refused_and_an_island_opens_once_complete():
    controller, address = _controller()
    procs = [controller]
    try:
        procs.append(_worker(address, "--island", "duo", "--island-hosts", "2", "--rank", "1"))
        wait_until(lambda: _island(address, "duo"), START_SECONDS, "rank 1 to register")
        twin = _worker(address, "--island", "duo", "--island-hosts", "2", "--rank", "1", stderr=subprocess.PIPE)
        procs.append(twin)
        _, err = twin.communicate(timeout=START_SECONDS)
        assert twin.returncode != 0
        assert "rank 1 of island 'duo' is already taken by worker 0; give each host of the island its own " \
               "--rank (free: [0])" in err, err

        island = _island(address, "duo")
        assert island["assembling"] and island["hosts"] == 1 and island["expected_hosts"] == 2
        shown = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", address],
                               capture_output=True, text=True, timeout=60)
        assert "island duo (id 0): assembling (1 of 2 hosts joined" in shown.stdout, shown.stdout
        pw.connect(address)
        try:
            with pytest.raises(PlacementError, match="still assembling"):
                pw.make_virtual_device_set().add_slice(cpu_devices=1)
        finally:
            pw.disconnect()

        procs.append(_worker(address, "--island", "duo", "--island-hosts", "2", "--rank", "0"))
        wait_until(lambda: _assembled(address, "duo"), START_SECONDS, "the island to assemble")
        ranks = {w["pid"]: w["rank"] for w in status(address)["workers"]}
        assert ranks == {child_of(procs[1].pid): 1, child_of(procs[3].pid): 0}
        np.testing.assert_array_equal(_psum_on(address, island["island"]), [7.0, 7.0])
    finally:
        stop_processes(procs)
        controller.stdout.close()


def _listening(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def _listens_on(pid, host, port):
    """Whether process ``pid`` has a TCP socket listening on ``host``:``port`` (bound to it
    or to every address). Not a connection attempt: tests running beside this one listen
    on ports of 127.0.0.1 of their own, and one may have the same number."""
    # an IPv6 socket holds an IPv4 address as ::ffff:a.b.c.d, and :: takes IPv4 too
    word = socket.inet_aton(host)[::-1].hex().upper()
    wanted = {f"{a}:{port:04X}" for a in (word, "00000000", "0000000000000000FFFF0000" + word, "0" * 32)}
    return any(local in wanted and state == "0A" for local, _, state in tcp_sockets(pid))


def test_servers_bind_and_advertise_the_hosts_they_are_given():
    controller, address = _controller("--bind", "127.0.0.2:0")
    procs = [controller]
    try:
        assert address.startswith("grpc://127.0.0.2:")
        port = int(address.rsplit(":", 1)[1])
        assert _listens_on(controller.pid, "127.0.0.2", port), "the controller binds 127.0.0.2"
        assert not _listens_on(controller.pid, "127.0.0.1", port), "the controller binds 127.0.0.2 only"
        procs.append(_worker(address, "--advertise", "127.0.0.3", "--devices", "2"))
        procs.append(_worker(address, "--island", "plain"))
        workers = wait_until(lambda: len(status(address)["workers"]) == 2 and status(address)["workers"],
                             START_SECONDS, "both workers to register")
        by_pid = {w["pid"]: w for w in workers}
        aliased, plain = by_pid[child_of(procs[1].pid)], by_pid[child_of(procs[2].pid)]
        assert aliased["address"].startswith("grpc://127.0.0.3:") and aliased["data_address"].startswith("tcp://127.0.0.3:")
        port = int(aliased["address"].rsplit(":", 1)[1])
        worker = child_of(procs[1].pid)
        assert _listening("127.0.0.3", port) and _listens_on(worker, "127.0.0.3", port), "it binds what it advertises"
        assert not _listens_on(worker, "127.0.0.1", port), "it binds what it advertises only"
        # with neither flag: the address this host uses to reach 127.0.0.2, which is 127.0.0.1
        assert plain["address"].startswith("grpc://127.0.0.1:")
        demo = subprocess.run([sys.executable, "-m", "pathways", "demo", "--address", address],
                              capture_output=True, text=True, timeout=START_SECONDS)
        assert demo.stdout.strip().endswith("[3. 5.] [2. 4.]"), (demo.stdout, demo.stderr)
    finally:
        stop_processes(procs)
        controller.stdout.close()


def test_a_bind_that_cannot_work_is_refused_with_advice():
    out = subprocess.run([sys.executable, "-m", "pathways", "controller", "--bind", "192.0.2.77:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot listen on --bind 192.0.2.77:0" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "pathways", "controller", "--bind", "::1:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "in brackets" in out.stderr, out.stderr


def test_the_core_heals_an_island_for_its_sessions_and_refuses_runs_until_it_is_whole():
    core = ControllerCore()
    rank0, rank1 = _register(core, "pair", 2, rank=0, coordinator="h0:1"), _register(core, "pair", 2, rank=1)
    sid, client = 1, Box()
    core.session_opened(sid, client)
    core.on_session_batch(sid, m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0), m.SliceRequest(1, "cpu", 1, None, 0,
                                                                                               False)]))
    [reply] = _of(client, m.SliceReply)
    assert reply.workers == (rank0.worker,)
    layout = Layout(reply.workers, ((0, 0),), (1,), ("x",), ())
    fn, program, data, base = (first_handle(sid) + i for i in (1, 2, 3, 10))
    graph = m.GRAPH.check({"nvalues": 2, "inputs": [0], "nodes": [[fn, [0], [1]]], "outputs": [1],
                           "types": [["float32", [2]]] * 2}, "graph")
    body = m.FunctionBody("f", b"artifact", (layout,), (layout,))
    core.on_session_batch(sid, m.encode_batch([m.DefineFunction(fn, reply.slice, body),
                                               m.DefineProgram(program, graph, "parallel")]))

    core.worker_lost(rank1)
    assert [type(x) for x in rank0.outbox if type(x) in (m.Reset, m.Shutdown)] == [m.Reset], \
        "the surviving host is told to restart and rejoin, not to stop"
    survivor = _register(core, "pair", 2, rank=0, coordinator="h0:2")
    core.on_session_batch(sid, m.encode_batch([m.PutNotice(data, layout), m.Run(program, base, {0: data})]))
    [poisoned] = [x for x in _of(client, m.Poisoned) if base + 1 in x.handles]
    assert poisoned.kind == "WorkerLostError" and "healing" in poisoned.message, "no run on an island not yet whole"
    assert not _of(survivor.outbox, m.RunProgram)

    copies = core._next_copy
    replacement = _register(core, "pair", 2, coordinator="h1:2")
    assert (survivor.worker, replacement.worker) == (rank0.worker, rank1.worker), "each rank keeps its worker id"
    assert [w.copies for w in _of(replacement.outbox, m.WorkerWelcome)] == [copies]
    assert core.status().as_dict()["islands"][0]["healthy"]
    moved = _of(client, m.SliceMoved)
    assert [(x.slice, x.workers, x.island) for x in moved] == [(reply.slice, reply.workers, 0)]
    assert _of(survivor.outbox, m.Compile), "the function compiles on the new host"
    core.on_session_batch(sid, m.encode_batch([m.PutNotice(data + 1, layout, 0)]))
    [stale] = [x for x in _of(client, m.Poisoned) if data + 1 in x.handles]
    assert "never arrived" in stale.message, "a put sent before the client saw the move went to the old address"
    core.on_session_batch(sid, m.encode_batch([m.PutNotice(data + 2, layout, 1), m.Run(program, base + 5, {0: data + 2})]))
    assert _of(survivor.outbox, m.RunProgram), "the island runs again"


def _run_from_a_pair_to_one_host():
    """A core with an island of two hosts and one of one, and a run in flight whose program
    computes on the pair and moves its result, split over both hosts, to the single host.
    Returns the core, the pair's two hosts, the single host and the transfer copy the single
    host waits for."""
    core = ControllerCore()
    rank0, rank1 = _register(core, "pair", 2, rank=0, coordinator="h0:1"), _register(core, "pair", 2, rank=1)
    single = _register(core, "one", 1, coordinator="h2:1")
    sid, client = 1, Box()
    core.session_opened(sid, client)
    core.on_session_batch(sid, m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0),
                                               m.SliceRequest(1, "cpu", 2, None, 0, False),
                                               m.SliceRequest(2, "cpu", 1, None, 1, False)]))
    pair, one = sorted(_of(client, m.SliceReply), key=lambda r: r.req)
    halves = Layout(pair.workers, ((0, 0), (1, 0)), (2,), ("i",), ("i",))  # an array split over both hosts
    whole = Layout(one.workers, ((0, 0),), (1,), ("x",), ())
    f, g, program, data, base = (first_handle(sid) + i for i in (1, 2, 3, 4, 10))
    graph = m.GRAPH.check({"nvalues": 3, "inputs": [0], "nodes": [[f, [0], [1]], [g, [1], [2]]], "outputs": [2],
                           "types": [["float32", [2]]] * 3}, "graph")
    core.on_session_batch(sid, m.encode_batch([
        m.DefineFunction(f, pair.slice, m.FunctionBody("f", b"x", (halves,), (halves,))),
        m.DefineFunction(g, one.slice, m.FunctionBody("g", b"x", (whole,), (whole,))),
        m.DefineProgram(program, graph, "parallel"), m.PutNotice(data, halves), m.Run(program, base, {0: data})]))
    assert not _of(client, m.Error) and _of(single.outbox, m.RunProgram), "the run went out to all three hosts"
    d = core.scheduler.running(_of(single.outbox, m.RunProgram)[0].id).payload
    senders = sorted(sender for sender, receiver, _ in d.lowered.transfers if receiver == single.worker)
    assert senders == sorted(pair.workers), "both hosts send their half to the single host"
    return core, rank0, rank1, single, d.tbase + d.lowered.transfers[0][2] - d.nvalues


def test_a_lost_island_poisons_each_copy_bound_elsewhere_once_however_many_of_its_senders_it_had():
    core, _, rank1, single, copy = _run_from_a_pair_to_one_host()

    core.worker_lost(rank1, error="ConnectionResetError: [Errno 104] Connection reset by peer")
    poisoned = _of(single.outbox, m.Poisoned)
    assert [x.handles for x in poisoned] == [(copy,)], \
        "one poison per copy: a second would outlive the run that read the first, in the store, for good"
    assert poisoned[0].kind == "WorkerLostError"
    assert "the connection was cut: ConnectionResetError" in poisoned[0].message, "the loss says what ended it"


def test_a_copy_its_sender_could_not_deliver_is_poisoned_at_its_live_receiver_and_only_its_sender_is_heard():
    core, rank0, _, single, copy = _run_from_a_pair_to_one_host()

    core.on_worker_message(single, m.Undelivered(rank0.worker, (copy,), "a copy it owes nobody"))
    core.on_worker_message(rank0, m.Undelivered(single.worker, (copy + 1,), "a copy of no run"))
    assert not _of(single.outbox, m.Poisoned) and not _of(rank0.outbox, m.Poisoned), \
        "a worker cannot poison copies that other senders owe, or that no run reads"
    core.on_worker_message(rank0, m.Undelivered(single.worker, (copy,), "worker 0 could not send it: refused"))
    [poisoned] = _of(single.outbox, m.Poisoned)
    assert poisoned.handles == (copy,) and poisoned.kind == "RemoteError" and "could not send it" in poisoned.message
    assert core.status().as_dict()["islands"][1]["healthy"], "the receiver is kept: only the run that read the copy fails"
