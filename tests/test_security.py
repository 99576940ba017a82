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
import time

import grpc
import numpy as np
import pytest

import pathways as pw
from pathways import cluster
from pathways.controller import server as controller_server
from pathways.defaults import DEFAULT_WINDOW
from pathways.demo import figure2
from pathways.protocol import messages as m
from pathways.wire import codec, frames, rpc, tcp
from pathways.wire import security as sec
from pathways.wire.certs import make_certificates
from pathways.wire.security import Security, SecurityConfigError
from tests.conftest import pids_alive
from tests.inprocess import InProcessController
from tests.rawworker import RawWorker

TOKEN = "test-" + secrets.token_urlsafe(24)
FAST = 5.0  # a refusal arrives within this many seconds: no timeout is waited for
FIGURE_2 = ([3.0, 5.0], [2.0, 4.0])


@pytest.fixture(autouse=True)
def _no_env_security(monkeypatch):
    monkeypatch.delenv(sec.TOKEN_ENV, raising=False)
    monkeypatch.delenv(sec.TLS_CA_ENV, raising=False)


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


def _child_env():
    return {k: v for k, v in os.environ.items() if k not in (sec.TOKEN_ENV, sec.TLS_CA_ENV)}


# ---- the token -------------------------------------------------------------------------------

def test_a_client_without_or_with_a_wrong_token_is_refused_at_once_with_the_same_advice(guarded):
    missing = _refused_fast(lambda: pw.connect(guarded.address, timeout=30))
    wrong = _refused_fast(lambda: pw.connect(guarded.address, timeout=30, token="not-" + TOKEN))
    _teaches(missing)
    assert missing == wrong, "a refusal tells nothing about the token given"


def test_the_right_token_runs_figure_2(guarded, monkeypatch):
    y, z = figure2(guarded.address, token=TOKEN)
    assert (y.tolist(), z.tolist()) == FIGURE_2
    monkeypatch.setenv(sec.TOKEN_ENV, TOKEN)  # or from the environment
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


def test_a_worker_data_listener_refuses_a_connection_without_the_token(guarded):
    data = cluster.status(guarded.address, security=Security(token=TOKEN))["workers"][0]["data_address"]
    _teaches(_refused_fast(lambda: tcp.connect(data, FAST, Security())))
    latency, bandwidth = tcp.probe(data, 30, 1 << 16, security=Security(token=TOKEN))
    assert latency > 0 and bandwidth > 0, "with the token the listener serves"


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
        _teaches(_read_refusal(stranger)["error"])
    assert inproc.workers() == []
    for wrong in (Security(), Security(token="not-" + TOKEN)):
        _teaches(_refused_fast(lambda: RawWorker(inproc.attach, security=wrong)))
    assert inproc.workers() == []
    _refused_fast(lambda: RawWorker(inproc.address), grpc.RpcError)  # AttachAddress itself needs the token
    worker = RawWorker(inproc.address, security=Security(token=TOKEN))
    try:
        registered = worker.register(island=1000)
        assert inproc.workers() == [registered], "a worker with the token registers"
    finally:
        worker.close()


def test_an_attach_connection_that_does_not_greet_is_closed(inproc, monkeypatch):
    monkeypatch.setattr(sec, "HELLO_SECONDS", 0.5)
    with _dial(inproc.attach) as silent:
        started = time.monotonic()
        assert silent.recv(1) == b"", "closed without a word"
        assert time.monotonic() - started < FAST
    assert inproc.workers() == []


def test_a_data_connection_without_the_token_is_refused_and_the_listener_keeps_serving():
    received = []
    listener = tcp.Listener(lambda header, pieces: received.append((header, pieces)), timeout=FAST,
                            security=Security(token=TOKEN))
    try:
        array = np.arange(4, dtype=np.float32)
        header = {"t": "put", "handle": 1, "layout": [], "of": 1,
                  **codec.pieces_header(array.dtype, array.shape, [(codec.full_index(array.shape), array)])}
        with _dial(listener.address) as raw:
            raw.sendall(frames.frame(codec.pack(header)))  # no hello first
            _teaches(_read_refusal(raw)["error"])
        for wrong in (Security(), Security(token="not-" + TOKEN)):
            _teaches(_refused_fast(lambda: tcp.connect(listener.address, FAST, wrong)))
        assert received == []
        links = tcp.Links(FAST, Security(token=TOKEN))
        try:
            links.send(listener.address, header, [(codec.full_index(array.shape), array)])
            deadline = time.monotonic() + FAST
            while not received and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            links.close()
        assert len(received) == 1 and received[0][1][0][1].tolist() == array.tolist()
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
    if encrypted.security.data_plane_tls:
        assert "TLS" in _refused_fast(lambda: tcp.connect(data, FAST, off), pw.ConnectError)
        assert tcp.probe(data, 30, 1 << 16, security=on)[1] > 0
    else:
        assert "TLS" in _refused_fast(lambda: tcp.connect(data, FAST, on), pw.ConnectError)
        assert tcp.probe(data, 30, 1 << 16, security=off)[1] > 0


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
