"""What workers measure about themselves (FLOP/s, memory, links) and how the controller
keeps and shows it: on a real local cluster, through the CLI, and in the controller's
state machine with hand-made reports."""

import math
import re
import socket
import struct
import subprocess
import sys
import threading

import pytest

import pathways as pw
from pathways import cluster
from pathways.controller.core import ControllerCore, WorkerConn
from pathways.errors import DeadlineExceededError, WireError
from pathways.planner import Topology
from pathways.protocol import messages as m, operator
from pathways.wire import codec, rpc, tcp
from tests.conftest import running_cluster, wait_until
from tests.rawworker import RawWorker


@pytest.fixture(scope="module")
def islands():
    """An island of two one-device hosts (one jax.distributed group) and one of a two-device host."""
    yield from running_cluster(pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=1, devices_per_host=2))


def fully_measured(st):
    ids = [w["worker"] for w in st["workers"]]
    pairs = {(x["src"], x["dst"]) for x in st["links"]}
    return (all(w["flops"] for w in st["workers"])
            and pairs >= {(a, b) for a in ids for b in ids if a != b})


def check_figures(st, workers=3):
    assert len(st["workers"]) == workers
    for w in st["workers"]:
        assert w["flops"] > 1e6 and math.isfinite(w["flops"]), w
        assert w["memory_bytes"] > 1 << 20, w
    ids = [w["worker"] for w in st["workers"]]
    links = {(x["src"], x["dst"]): x for x in st["links"]}
    assert set(links) == {(a, b) for a in ids for b in ids if a != b}, "every ordered pair of workers"
    for x in links.values():
        assert 0 < x["latency"] < 1.0 and 1e5 < x["bandwidth"] < 1e13, x


def test_workers_measure_themselves_when_they_start(islands):
    st = wait_until(lambda: (s := cluster.status(islands.address)) and fully_measured(s) and s, timeout=60,
                    what="every worker's FLOP/s and links")
    check_figures(st)
    topology = Topology.from_status(st)
    assert sorted(d.id for d in topology.devices) == sorted(str(w["worker"]) for w in st["workers"])
    a, b = topology.devices[0].id, topology.devices[1].id
    assert topology.transfer_time(a, b, 1 << 20) > 0


def test_measure_asks_every_worker_again_and_waits(islands):
    before = cluster.status(islands.address)
    after = cluster.measure(islands.address, timeout=60)
    check_figures(after)
    figures = lambda st: ([w["flops"] for w in st["workers"]], [x["latency"] for x in st["links"]])  # noqa: E731
    assert figures(after) != figures(before), "the figures should be new measurements"
    assert isinstance(cluster.topology(islands.address), Topology)


def test_status_measure_prints_speeds_memory_and_links(islands):
    out = subprocess.run([sys.executable, "-m", "pathways", "status", "--measure", "--address", islands.address],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r"\d+\.\d GFLOP/s, \d+\.\d GiB memory", out.stdout)) == 3, out.stdout
    for title in ("latency in us", "bandwidth in MB/s"):
        block = out.stdout.split(f"links, {title}")[1].splitlines()[2:5]
        assert [len(re.findall(r"\s\d+", row)) for row in block] == [3, 3, 3], out.stdout  # worker id + 2 figures
        assert all(row.count("-") == 1 and "?" not in row for row in block), out.stdout


def test_malformed_measure_requests_get_error_replies(islands):
    channel = rpc.open_channel(islands.address)
    measure = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Measure", "unary_unary")
    try:
        for request, needle in [(b"\xc1garbage", "not valid msgpack"),
                                (codec.pack({"t": "measure"}), "must be a list [tag, field, ...]"),
                                (codec.pack(["measure"]), "it takes 1"),
                                (codec.pack(["measure", "soon"]), "must be a number"),
                                (codec.pack(["measure", -1]), "must be a finite number in (0"),
                                (codec.pack(["measure", float("nan")]), "must be a finite number in (0")]:
            with pytest.raises(WireError, match=re.escape(needle)):
                operator.answer(operator.STATUS_REPLY, measure(request, timeout=10))
    finally:
        channel.close()
    assert fully_measured(cluster.status(islands.address))


def test_a_silent_peer_leaves_its_links_unmeasured_and_the_rest_keeps_working(islands):
    """A worker that registers and sends heartbeats but never answers a measure request,
    with a data port that accepts connections and never replies: the others' probes of it time out, a measurement names it after its
    timeout, and every other figure is still measured."""
    silent = socket.create_server(("127.0.0.1", 0))
    fake_worker = RawWorker(islands.address, security=islands.security)
    try:
        fake = fake_worker.register(island=99, data_address=f"tcp://127.0.0.1:{silent.getsockname()[1]}")
        measured = {"flops": None, "memory_bytes": 1 << 30, "links": []}
        for bad, needle in [({"flops": -1.0}, "'flops' of message 'measured' must be a finite number in (0"),
                            ({"links": [[fake, 1e-5, 1e9]]}, "a link to itself"),
                            ({"links": [[0, None, 1e9]]}, "needs both latency and bandwidth, or neither"),
                            ({"links": [[0, 1e-5]]}, "must be a list of 3 entries"),
                            ({"memory_bytes": 0}, "'memory_bytes' of message 'measured' must be in [1,"),
                            ({"flops": "fast"}, "must be a number, got str")]:
            raw = {**measured, **bad}
            # raw wire fields: what no typed message would let through
            fake_worker.send(m.pack([["measured", 0, raw["flops"], raw["memory_bytes"], raw["links"]]]))
            notice = fake_worker.until(lambda x: type(x) is m.Notice)[-1]
            assert needle in notice.message, (needle, notice)
        threading.Thread(target=fake_worker.drain, daemon=True).start()
        fake_worker.keep_alive()  # alive, only deaf to measure requests
        # workers are asked one at a time, in id order: the real ones first, each waiting
        # PROBE_TIMEOUT for the silent peer, then the silent one, which never answers
        with pytest.raises(DeadlineExceededError, match=rf"worker {fake} did not report"):
            cluster.measure(islands.address, timeout=15)
        st = cluster.status(islands.address)
        real = [w["worker"] for w in st["workers"] if w["worker"] != fake]
        assert not [x for x in st["links"] if fake in (x["src"], x["dst"])], "links to the silent peer are unmeasured"
        assert {(x["src"], x["dst"]) for x in st["links"]} == {(a, b) for a in real for b in real if a != b}
        assert next(w for w in st["workers"] if w["worker"] == fake)["flops"] is None
    finally:
        fake_worker.close()
        silent.close()
    wait_until(lambda: len(cluster.status(islands.address)["workers"]) == 3, what="the silent worker to be dropped")
    check_figures(cluster.measure(islands.address, timeout=60))


# ---- the controller's state machine, without processes ------------------------------------


class Box(list):
    def put(self, message):
        self.append(message)


def register(core, n):
    conns = [WorkerConn(Box()) for _ in range(n)]
    for i, conn in enumerate(conns):
        core.on_worker_batch(conn, m.encode_batch([m.Register(
            f"grpc://127.0.0.1:{i + 1}", f"tcp://127.0.0.1:{i + 1}", "cpu", 2, str(i), 1, None, "", 1, "h", 1 << 30)]))
    return conns


def report(core, conn, mid=0, flops=None, links=(), memory=1 << 30):
    core.on_worker_batch(conn, m.pack([["measured", mid, flops, memory, [list(x) for x in links]]]))


def test_the_controller_keeps_the_latest_figures_and_feeds_placement():
    core = ControllerCore()
    a, b, c = register(core, 3)
    assert [w["flops"] for w in core.status().as_dict()["workers"]] == [None, None, None]
    report(core, a, flops=4e9, links=[[1, 1e-4, 1e9], [2, 2e-4, 5e8]], memory=1 << 31)
    report(core, b, flops=2e9, links=[[0, 1e-4, 1e9], [7, 1e-4, 1e9]])  # worker 7 does not exist: ignored
    st = core.status().as_dict()
    assert [w["flops"] for w in st["workers"]] == [4e9, 2e9, None]
    assert st["workers"][0]["memory_bytes"] == 1 << 31 and core.rm.hosts[0].memory_bytes == 1 << 31
    assert st["links"] == [{"src": 0, "dst": 1, "latency": 1e-4, "bandwidth": 1e9},
                           {"src": 0, "dst": 2, "latency": 2e-4, "bandwidth": 5e8},
                           {"src": 1, "dst": 0, "latency": 1e-4, "bandwidth": 1e9}]
    assert core.rm.hosts[0].flops == 4e9 and core.rm.latency == {(0, 1): 1e-4, (0, 2): 2e-4, (1, 0): 1e-4}
    report(core, a, links=[[2, None, None]])  # the peer stopped answering: the link is unmeasured again
    assert [(x["src"], x["dst"]) for x in core.status().as_dict()["links"]] == [(0, 1), (1, 0)]
    assert core.status().as_dict()["workers"][0]["flops"] == 4e9, "a report without flops keeps the last figure"
    assert not [x for conn in (a, b, c) for x in conn.outbox if type(x) is m.Notice]


def test_a_measurement_asks_one_worker_at_a_time_until_all_reported_or_were_lost():
    core = ControllerCore()
    a, b, c = register(core, 3)
    finished = []

    def asked(mid):
        return [conn.worker for conn in (a, b, c) if m.Measure(mid) in conn.outbox]

    mid = core.measure(lambda: finished.append(True))
    assert asked(mid) == [0]
    report(core, b, 0, 1e9)  # its own measurement, not an answer to the request
    assert asked(mid) == [0]
    report(core, a, mid, 1e9)
    assert asked(mid) == [0, 1]
    core.worker_lost(b)  # the worker measuring was lost: the next one is asked
    assert asked(mid) == [0, 1, 2] and not finished
    report(core, c, mid, 1e9)
    assert finished == [True]
    other = core.measure(lambda: finished.append(False))
    assert core.abandon_measurement(other) == [0, 2] and core.abandon_measurement(other) == []
    report(core, a, other, 1e9)
    assert finished == [True], "an abandoned measurement calls nobody and asks nobody else"
    assert asked(other) == [0]
    lone = ControllerCore()
    lone.measure(lambda: finished.append("none"))
    assert finished[-1] == "none", "with no workers there is nothing to wait for"


def test_malformed_probe_frames_close_their_connection_and_the_listener_keeps_serving():
    listener = tcp.Listener(lambda header, pieces: None, timeout=5)
    host, _, port = listener.address.removeprefix("tcp://").rpartition(":")
    try:
        for header in ({"t": "probe", "bytes": tcp.MAX_PROBE_BYTES + 1}, {"t": "probe", "bytes": -1},
                       {"t": "probe", "bytes": "many"}, {"t": "probe"}):
            body = codec.pack(header)
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(struct.pack("!I", len(body)) + body)
                assert sock.recv(1) == b"", header
        latency, bandwidth = tcp.probe(listener.address, timeout=10, payload_bytes=1 << 16)
        assert 0 < latency < 1 and bandwidth > 0
        with pytest.raises(ValueError, match="payload_bytes"):
            tcp.probe(listener.address, timeout=10, payload_bytes=tcp.MAX_PROBE_BYTES + 1)
    finally:
        listener.close()
    with pytest.raises(OSError):
        tcp.probe(listener.address, timeout=2)


def test_measure_explains_a_bad_address():
    with pytest.raises(pw.ConnectError, match="not of the form"):
        cluster.measure("nowhere")
