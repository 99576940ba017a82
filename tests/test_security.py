"""The shared token and TLS, on real processes over loopback: every server refuses a peer
without the cluster's token at once, with the same advice for a missing and a wrong one,
and keeps serving; TLS on gRPC, the workers' stream and (with --data-plane-tls) the data
plane gives the same results; a mismatch fails fast; a server refuses to listen beyond
loopback without a token."""

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import pathways as pw
from pathways import cluster, config
from pathways.client.devices import VirtualDeviceSet
from pathways.client.session import Session
from pathways.controller import server as controller_server
from pathways.defaults import DEFAULT_WINDOW
from pathways.demo import figure2
from pathways.protocol import messages as m
from pathways.wire import codec, frames, rpc, tcp
from pathways.wire import security as sec
from pathways.wire.certs import make_certificates
from pathways.wire.handshake import FrameAnswer
from pathways.wire.security import Security, SecurityConfigError
from pathways.worker.peers import PeerTickets
from tests.conftest import pids_alive, wait_until
from tests.inprocess import InProcessController
from tests.rawworker import RawWorker

TOKEN = "test-" + secrets.token_urlsafe(24)
FAST = 5.0  # a refusal arrives within this many seconds: no timeout is waited for
FIGURE_2 = ([3.0, 5.0], [2.0, 4.0])
FORGED_COPIES = 3000  # transfer copies a holder of the clients' token forges at a worker


@pytest.fixture(autouse=True)
def _no_env_security(monkeypatch):
    monkeypatch.delenv(config.TOKEN.name, raising=False)
    monkeypatch.delenv(config.TLS_CA.name, raising=False)
    monkeypatch.delenv(config.WORKER_TOKEN.name, raising=False)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_certificates(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def _cluster(security):
    with pw.local_cluster(hosts=2, devices_per_host=2, security=security) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"


@pytest.fixture(scope="module")
def guarded():
    """A cluster that requires the token, without TLS."""
    yield from _cluster(Security(token=TOKEN))


@pytest.fixture(scope="module", params=[False, True], ids=["grpc-tls", "grpc-and-data-plane-tls"])
def encrypted(request, tls):
    """A cluster with the token and TLS, on gRPC and the workers' stream, and on the data
    plane too in its second variant."""
    yield from _cluster(Security(TOKEN, tls.cert, tls.key, tls.ca, data_plane_tls=request.param))


def _refused_fast(call, error=pw.AuthenticationError):
    started = time.monotonic()
    with pytest.raises(error) as info:
        call()
    assert time.monotonic() - started < FAST, "a refusal is immediate, not a timeout"
    return str(info.value)


def _teaches(message):
    assert "--token-file" in message and "PATHWAYS_TOKEN" in message and "token=" in message, message
    assert TOKEN not in message


def _teaches_workers(message):
    """A refused worker is told which token the controller admits workers with."""
    assert "--worker-token-file" in message and config.WORKER_TOKEN.name in message and TOKEN not in message, message


def _child_env():
    return {k: v for k, v in os.environ.items() if k not in (config.TOKEN.name, config.TLS_CA.name, config.WORKER_TOKEN.name)}


# ---- the token -------------------------------------------------------------------------------

def test_a_client_without_or_with_a_wrong_token_is_refused_at_once_with_the_same_advice(guarded):
    missing = _refused_fast(lambda: pw.connect(guarded.address, timeout=30))
    wrong = _refused_fast(lambda: pw.connect(guarded.address, timeout=30, token="not-" + TOKEN))
    _teaches(missing)
    assert missing == wrong, "a refusal tells nothing about the token given"


def test_the_right_token_runs_figure_2(guarded, monkeypatch):
    y, z = figure2(guarded.address, token=TOKEN)
    assert (y.tolist(), z.tolist()) == FIGURE_2
    monkeypatch.setenv(config.TOKEN.name, TOKEN)  # or from the environment
    y, z = figure2(guarded.address)
    assert (y.tolist(), z.tolist()) == FIGURE_2


def test_status_command_is_refused_without_the_token_and_answers_with_it(guarded, token_file):
    command = [sys.executable, "-m", "pathways", "status", "--address", guarded.address]
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, env=_child_env())
    assert out.returncode == 1, out
    assert time.monotonic() - started < 15, "python start-up plus a refusal, not the status timeout"
    _teaches(out.stderr)
    out = subprocess.run([*command, "--token-file", token_file], capture_output=True, text=True, timeout=60,
                         env=_child_env())
    assert out.returncode == 0, out.stderr
    assert "2 worker(s)" in out.stdout


def test_a_worker_refuses_fetch_and_stats_without_the_token(guarded):
    worker = cluster.status(guarded.address, security=Security(token=TOKEN))["workers"][0]["address"]
    request = m.pack(m.FetchRequest(1, 0.0, False, bytes(m.CREDENTIAL_BYTES)).encode())
    for security in (None, Security(token="not-" + TOKEN)):
        channel = rpc.open_channel(worker, security)
        try:
            fetch = rpc.method(channel, rpc.WORKER_SERVICE, "Fetch", "unary_stream")
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(fetch(request, timeout=30))
            assert time.monotonic() - started < FAST
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            _teaches(info.value.details())
        finally:
            channel.close()
        _teaches(_refused_fast(lambda: cluster.worker_stats(worker, security=security or Security())))
    assert "sessions" in cluster.worker_stats(worker, security=Security(token=TOKEN)), "with the token it serves"


def test_a_worker_data_listener_admits_only_workers_with_their_ticket(guarded):
    """A holder of the clients' token connects to a worker's data listener and sends
    FORGED_COPIES transfer copies, each on a connection of its own after a hello with the
    token and a made-up ticket (none, or one claiming to be the other worker or the worker
    itself), while a client runs programs that move arrays between hosts (of the cluster's
    one island), and on after them until all are sent. Without the ticket the controller
    gave a peer, no connection gets past its hello (whatever id it claims): every one is
    refused and counted, no forged copy is read, and the client's values stay right."""
    client = Security(token=TOKEN)
    st = cluster.status(guarded.address, security=client)
    target, peer = st["workers"]
    data = target["data_address"]
    refused = cluster.worker_stats(target["address"], security=client)["refused_peers"]
    _teaches(_refused_fast(lambda: tcp.connect(data, FAST, Security())))
    for ticket in (None, (peer["worker"], bytes(32)), (peer["worker"], secrets.token_bytes(32)),
                   (target["worker"], secrets.token_bytes(32))):
        message = _refused_fast(lambda: tcp.connect(data, FAST, client, ticket=ticket))
        assert "ticket the controller gave" in message and TOKEN not in message, message
    assert cluster.worker_stats(target["address"], security=client)["refused_peers"] == refused + 4

    copy = np.full(2, 666.0, np.float32)
    claims = [{}, {"from": peer["worker"]}, {"from": target["worker"]}]

    def forged(handle: int) -> bytes:
        hello = {"t": "hello", "token": TOKEN, **claims[handle % 3]}
        if hello.get("from") is not None:
            hello["ticket"] = secrets.token_bytes(32)
        return frames.frame(codec.pack(hello)) + frames.frame(codec.pack(
            {"t": "put", "handle": handle, "layout": [[target["worker"]], [0, 0], [2], ["d"], []], "of": 1,
             **codec.pieces_header(copy.dtype, copy.shape, [(codec.full_region(copy.shape), copy)])})) + copy.tobytes()

    victim_done = threading.Event()
    attempts = []

    def attack() -> None:  # for as long as the victim runs, and to FORGED_COPIES at least
        while not victim_done.is_set() or len(attempts) < FORGED_COPIES:
            with _dial(data) as raw:
                try:
                    raw.sendall(forged(len(attempts) + 1))
                    raw.recv(1 << 16)  # the refusal
                except OSError:
                    pass
            attempts.append(1)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        for run in range(3):
            y, z = figure2(guarded.address, token=TOKEN)
            assert (y.tolist(), z.tolist()) == FIGURE_2, f"run {run} read a wrong value"
    finally:
        victim_done.set()
        attacker.join(timeout=60)
    assert len(attempts) >= FORGED_COPIES
    wait_until(lambda: cluster.worker_stats(target["address"], security=client)["refused_peers"] >=
               refused + 4 + len(attempts), timeout=FAST, what="every forged connection to be counted")


def test_what_a_session_presents_one_worker_opens_nothing_on_another(guarded):
    """A session's credential never reaches a worker: each worker is given its own
    derivation, so what a host that should not have been trusted received cannot be
    replayed at another."""
    session = Session(guarded.address, security=Security(token=TOKEN))
    try:
        s = VirtualDeviceSet(session).add_slice(cpu_devices=4)
        x = pw.device_put(np.arange(4, dtype=np.float32), s.devices)
        first, second = x._buffer.addresses
        np.testing.assert_array_equal(np.asarray(x), np.arange(4))
        own = session._stubs(second)
        assert own.credential not in (session._credential, session._stubs(first).credential)
        session._workers[second] = own._replace(credential=session._stubs(first).credential)
        try:
            started = time.monotonic()
            with pytest.raises(pw.AccessDeniedError, match="not that session's"):
                session.fetch((second,), x.handle, 5.0, data=True)
            assert time.monotonic() - started < FAST
        finally:
            session._workers[second] = own
        np.testing.assert_array_equal(np.asarray(x), np.arange(4))
    finally:
        session.close()


def test_a_process_with_the_clients_token_cannot_attach_as_a_worker(guarded):
    """A process that holds the clients' token (not the worker
    token the cluster's controller and workers share) tries to join as a worker of an
    island of its own, where clients' slices would go. It is refused at its greeting and
    told what it lacks; the cluster keeps its two workers."""
    env = {**_child_env(), config.TOKEN.name: TOKEN}
    out = subprocess.run([sys.executable, "-m", "pathways", "worker", "--controller", guarded.address,
                          "--platform", "cpu", "--launcher", "none", "--island", "rogue", "--connect-timeout", "20",
                          "--reconnect-timeout", "1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0, out.stderr
    assert "worker token" in out.stderr and config.WORKER_TOKEN.name in out.stderr and TOKEN not in out.stderr, out.stderr
    assert len(cluster.status(guarded.address, security=Security(token=TOKEN))["workers"]) == 2


@pytest.fixture
def inproc():
    c = InProcessController(Security(token=TOKEN))
    yield c
    c.close()


def _dial(address: str) -> socket.socket:
    """A plain TCP connection to ``tcp://HOST:PORT``: no TLS, no hello."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=FAST)


def _read_refusal(sock: socket.socket) -> dict:
    """The refusal frame a server sent, after which it closed the connection."""
    sock.settimeout(FAST)
    reader = frames.FrameReader(sock)
    try:
        reply = codec.unpack(reader.read(1 << 16))
        assert reader.read(1 << 16) is None, "the server closes the connection after its refusal"
    finally:
        reader.close()
    assert reply["t"] == "refused"
    return reply


def test_an_attach_connection_without_the_token_cannot_register_and_the_controller_keeps_serving(inproc):
    register = m.Register("grpc://127.0.0.1:1", "tcp://127.0.0.1:1", "cpu", 1, "1000", 1, None, "", 1, "fake", 1 << 30)
    with _dial(inproc.attach) as stranger:
        stranger.sendall(frames.frame(m.encode_batch([register])))  # a Register with no hello first
        _teaches_workers(_read_refusal(stranger)["error"])
    assert inproc.workers() == []
    for wrong in (Security(), Security(token="not-" + TOKEN)):
        _teaches_workers(_refused_fast(lambda: RawWorker(inproc.attach, security=wrong)))
    assert inproc.workers() == []
    _refused_fast(lambda: RawWorker(inproc.address), grpc.RpcError)  # AttachAddress itself needs the token
    worker = RawWorker(inproc.address, security=Security(token=TOKEN))
    try:
        registered = worker.register(island=1000)
        assert inproc.workers() == [registered], "a worker with the token registers"
    finally:
        worker.close()


def test_a_controller_with_a_worker_token_admits_workers_only_with_it():
    worker_token = "worker-" + secrets.token_urlsafe(24)
    controller = InProcessController(Security(token=TOKEN, worker_token=worker_token))
    try:
        for wrong in (Security(token=TOKEN), Security(token=TOKEN, worker_token="not-" + worker_token)):
            message = _refused_fast(lambda: RawWorker(controller.address, security=wrong))
            _teaches_workers(message)
            assert worker_token not in message
        assert controller.workers() == []
        worker = RawWorker(controller.address, security=Security(token=TOKEN, worker_token=worker_token))
        try:
            registered = worker.register(island=1000)
            assert controller.workers() == [registered], "a worker with the worker token registers"
        finally:
            worker.close()
    finally:
        controller.close()


def test_an_attach_connection_that_does_not_greet_is_sent_nothing_and_closed(monkeypatch):
    monkeypatch.setattr(sec, "HELLO_SECONDS", 1.5)
    # heartbeats every 0.1 s to greeted workers: a stranger gets none of them
    controller = InProcessController(Security(token=TOKEN), heartbeat_timeout=0.5)
    try:
        with _dial(controller.attach) as silent:
            started = time.monotonic()
            assert silent.recv(1 << 16) == b"", "closed without a word"
            assert 1.0 < time.monotonic() - started < FAST
        assert controller.workers() == []
    finally:
        controller.close()


def test_a_data_connection_without_the_token_is_refused_and_the_listener_keeps_serving():
    received = []
    listener = tcp.Listener(lambda header, pieces: received.append((header, pieces)), timeout=FAST,
                            security=Security(token=TOKEN))
    try:
        array = np.arange(4, dtype=np.float32)
        header = {"t": "put", "handle": 1, "layout": [], "of": 1,
                  **codec.pieces_header(array.dtype, array.shape, [(codec.full_region(array.shape), array)])}
        with _dial(listener.address) as raw:
            raw.sendall(frames.frame(codec.pack(header)))  # no hello first
            _teaches(_read_refusal(raw)["error"])
        for wrong in (Security(), Security(token="not-" + TOKEN)):
            _teaches(_refused_fast(lambda: tcp.connect(listener.address, FAST, wrong)))
        assert received == []
        links = tcp.Links(FAST, Security(token=TOKEN))
        try:
            links.send(listener.address, header, [(codec.full_region(array.shape), array)])
            deadline = time.monotonic() + FAST
            while not received and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            links.close()
        assert len(received) == 1 and received[0][1][0][1].tolist() == array.tolist()
    finally:
        listener.close()


def test_a_listener_with_peer_tickets_takes_frames_only_from_the_sender_a_ticket_names():
    key = secrets.token_bytes(m.DATA_KEY_BYTES)
    tickets = PeerTickets(key_wait=FAST)
    received = []
    listener = tcp.Listener(lambda header, pieces: received.append(header), timeout=FAST, admit=tickets.admit)
    try:
        with pytest.raises(pw.ConnectError, match="no ticket"):
            tickets.ticket(listener.address)  # this worker has not been told of that peer
        # peers may connect before this worker has its key (they learn of it as it registers)
        threading.Timer(0.3, tickets.learn, [m.DataKey(1, key)]).start()
        sender = PeerTickets()
        sender.learn(m.DataKey(0, secrets.token_bytes(m.DATA_KEY_BYTES)))
        sender.learn(m.Peers(((1, listener.address, m.data_ticket(key, 0)),)))
        assert sender.ticket(listener.address) == (0, m.data_ticket(key, 0))
        links = tcp.Links(FAST, tickets=sender.ticket)
        try:
            links.send(listener.address, {"t": "put", "handle": 5, "poison": "x", "kind": "x", "layout": [], "of": 1}, [])
            deadline = time.monotonic() + FAST
            while not received and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            links.close()
        assert [h["handle"] for h in received] == [5]
        # the controller, which draws every key, shows a ticket of its own (its IFRT front end's puts)
        own = (m.CONTROLLER_SENDER, m.data_ticket(key, m.CONTROLLER_SENDER))
        tcp.connect(listener.address, FAST, ticket=own).close()
        # a ticket shown by another sender than it names, or made under another key, opens nothing
        for ticket in ((2, m.data_ticket(key, 0)), (0, m.data_ticket(secrets.token_bytes(32), 0)), (0, b"short"),
                       (-2, m.data_ticket(key, -2)), (m.CONTROLLER_SENDER, m.data_ticket(key, 0))):
            assert "ticket" in _refused_fast(lambda: tcp.connect(listener.address, FAST, ticket=ticket))
        assert tickets.refused == 5 and len(received) == 1
    finally:
        listener.close()


def test_a_listener_screens_each_frame_by_the_sender_its_hello_proved_and_reads_past_those_it_refuses():
    """A worker's listener asks its screen about each frame, with the sender the
    connection's ticket proved, before reading the frame's bytes: a refused frame's 4 MiB
    are read past (none kept), answered with the refusal where the sender asked for an
    answer, and the connection goes on to the next frame."""
    key = secrets.token_bytes(m.DATA_KEY_BYTES)
    tickets = PeerTickets(key_wait=FAST)
    tickets.learn(m.DataKey(1, key))
    screened, received = [], []
    refusal = "no run here expects copy 13 from that worker"

    def screen(sender, header):
        screened.append((sender, header["handle"]))
        return refusal if header["handle"] == 13 else None

    with pytest.raises(ValueError, match="needs admit"):
        tcp.Listener(lambda header, pieces: None, timeout=FAST, screen=screen)
    listener = tcp.Listener(lambda header, pieces: received.append((header["handle"], pieces)), timeout=FAST,
                            admit=tickets.admit, screen=screen)

    def put(handle, array, **fields):
        pieces = [(codec.full_region(array.shape), array)]
        return {"t": "put", "handle": handle, "layout": [], "of": 1,
                **codec.pieces_header(array.dtype, array.shape, pieces), **fields}, pieces

    big, small = np.ones(1 << 20, np.float32), np.arange(3, dtype=np.float32)
    try:
        with tcp.connect(listener.address, FAST, ticket=(0, m.data_ticket(key, 0))) as sock:
            tcp.send_frame(sock, *put(13, big))
            tcp.send_frame(sock, *put(14, small))
            tcp.send_frame(sock, *put(13, big, answer=True))
            assert tcp._read_answer(sock, time.monotonic() + FAST) == FrameAnswer(refusal)
            tcp.send_frame(sock, *put(15, small, answer=True))
            assert tcp._read_answer(sock, time.monotonic() + FAST) == FrameAnswer()
        assert screened == [(0, 13), (0, 14), (0, 13), (0, 15)]
        assert [h for h, _ in received] == [14, 15]
        np.testing.assert_array_equal(received[0][1][0][1], small)
        wait_until(lambda: listener.budget.used == 0, FAST, "the listener to release every reservation")
    finally:
        listener.close()


def test_refused_data_connections_are_counted_and_logged_once_per_thousand(caplog):
    listener = tcp.Listener(lambda header, pieces: None, timeout=FAST, security=Security(token=TOKEN))
    try:
        with caplog.at_level("WARNING", logger="pathways.wire"):
            for _ in range(5):
                _refused_fast(lambda: tcp.connect(listener.address, FAST, Security(token="not-" + TOKEN)))
            wait_until(lambda: listener.refused.count == 5, timeout=FAST, what="the listener to count the refusals")
        logged = [r for r in caplog.records if "refused a data connection" in r.getMessage()]
        assert len(logged) == 1 and "(1 refused so far)" in logged[0].getMessage(), "strangers do not fill the log"
    finally:
        listener.close()


def test_a_server_refuses_to_listen_beyond_loopback_without_a_token():
    starts = {
        "worker gRPC": lambda: rpc.make_server(rpc.WORKER_SERVICE, {}, host="0.0.0.0"),
        "controller gRPC": lambda: asyncio.run(rpc.start_aio_server(rpc.CONTROLLER_SERVICE, {}, bind="0.0.0.0:0")),
        "worker port": lambda: asyncio.run(controller_server.ControllerServer("fair", DEFAULT_WINDOW).listen("0.0.0.0")),
        "data listener": lambda: tcp.Listener(lambda header, pieces: None, timeout=FAST, host="0.0.0.0"),
    }
    for what, start in starts.items():
        with pytest.raises(SecurityConfigError, match="beyond loopback") as info:
            start()
        assert "--token-file" in str(info.value) and "PATHWAYS_TOKEN" in str(info.value), what
    # the clients' token alone does not do for workers' connections: any client could attach one
    with pytest.raises(SecurityConfigError, match="beyond loopback, without a worker token") as info:
        asyncio.run(controller_server.ControllerServer("fair", DEFAULT_WINDOW, Security(token=TOKEN)).listen("0.0.0.0"))
    assert "--worker-token-file" in str(info.value) and config.WORKER_TOKEN.name in str(info.value)
    with pytest.raises(SecurityConfigError, match="must differ"):
        Security(token=TOKEN, worker_token=TOKEN)


def test_a_token_file_that_cannot_be_read_stops_a_server_at_start(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, says in ((str(tmp_path / "missing"), "cannot read the token"), (str(empty), "printable ASCII")):
        out = subprocess.run([sys.executable, "-m", "pathways", "controller", "--token-file", path],
                             capture_output=True, text=True, timeout=60, env=_child_env())
        assert out.returncode == 2 and says in out.stderr and path in out.stderr, out.stderr


# ---- TLS -------------------------------------------------------------------------------------

def test_figure_2_runs_over_tls_with_the_token(encrypted, tls):
    y, z = figure2(encrypted.address, token=TOKEN, tls_ca=tls.ca)
    assert (y.tolist(), z.tolist()) == FIGURE_2


def test_a_client_without_the_ca_fails_fast_and_with_it_still_needs_the_token(encrypted, tls):
    message = _refused_fast(lambda: pw.connect(encrypted.address, token=TOKEN, timeout=30), pw.ConnectError)
    assert "tls_ca" in message and "PATHWAYS_TLS_CA" in message, message
    _teaches(_refused_fast(lambda: pw.connect(encrypted.address, tls_ca=tls.ca, timeout=30)))


def test_the_data_plane_speaks_tls_exactly_when_told(encrypted, tls):
    data = cluster.status(encrypted.address, security=Security(token=TOKEN, tls_ca=tls.ca))["workers"][0]["data_address"]
    on = Security(TOKEN, tls.cert, tls.key, tls.ca, data_plane_tls=True)
    off = Security(token=TOKEN)
    # with the right settings the greeting is read and answered (a stranger to the
    # workers is refused for want of a ticket); with the wrong ones the TLS handshake fails
    right, wrong = (on, off) if encrypted.security.data_plane_tls else (off, on)
    assert "TLS" in _refused_fast(lambda: tcp.connect(data, FAST, wrong), pw.ConnectError)
    assert "ticket the controller gave" in _refused_fast(lambda: tcp.connect(data, FAST, right))


def test_a_tls_client_of_a_plain_server_fails_fast(guarded, tls):
    message = _refused_fast(lambda: pw.connect(guarded.address, token=TOKEN, tls_ca=tls.ca, timeout=30),
                            pw.ConnectError)
    assert "does not use TLS" in message, message


@pytest.mark.parametrize("flags, says", [
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "--tls-cert /nonexistent/cert.pem"),
    (["--tls-cert", "{ca}", "--tls-key", "{ca}"], "not a PEM certificate and its private key"),
    (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
])
def test_bad_certificate_files_stop_a_server_at_start_with_a_clear_error(tls, flags, says):
    flags = [f.format(ca=tls.ca, cert=tls.cert) for f in flags]
    out = subprocess.run([sys.executable, "-m", "pathways", "controller", *flags], capture_output=True, text=True,
                         timeout=60, env=_child_env())
    assert out.returncode == 2 and says in out.stderr, out.stderr
