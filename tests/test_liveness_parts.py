"""Heartbeats as pure arithmetic (a fake clock), a silent peer judged slow or lost by what
the kernel knows of its connection (faked, and a real zero-window connection), and on the
controller's worker stream in this process: heartbeats go out when the stream is idle, at
the pace the worker asks for; a registered worker that sends nothing is slow, not lost,
while its host acknowledges, and lost once its host stops acknowledging; one that only sends
heartbeats is kept; the data plane gives up on a stalled peer, naming it."""

import math
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pathways.controller import server as controller_server
from pathways.protocol import messages as m
from pathways.wire import frames, tcp
from pathways.wire.liveness import BEATS_PER_TIMEOUT, MIN_INTERVAL, Heartbeats, TcpState, Verdict, check_timeout, judge
from tests.conftest import wait_until
from tests.rawworker import RawWorker
from tests.inprocess import InProcessController


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_heartbeats_fall_due_after_an_idle_interval_and_sending_anything_resets_it():
    clock = Clock()
    beats = Heartbeats(10.0, clock)
    assert beats.interval == 10.0 / BEATS_PER_TIMEOUT
    assert not beats.beat_due() and beats.until_beat() == pytest.approx(2.0)
    clock.now += 1.5
    beats.sent()  # other traffic counts as a sign of life
    clock.now += 1.9
    assert not beats.beat_due() and beats.until_beat() == pytest.approx(0.1)
    clock.now += 0.1
    assert beats.beat_due() and beats.until_beat() == pytest.approx(1e-3), "never zero: no spinning loop"


def test_a_peer_is_silent_only_past_the_timeout_since_it_was_last_heard():
    clock = Clock()
    beats = Heartbeats(10.0, clock)
    clock.now += 9.9
    assert beats.silent_for() is None and beats.until_silent() == pytest.approx(0.1)
    beats.heard()
    clock.now += 10.0
    assert beats.silent_for() is None, "exactly the timeout is not yet past it"
    clock.now += 0.5
    assert beats.silent_for() == pytest.approx(10.5)


def test_the_pace_follows_the_smaller_timeout_and_a_peer_cannot_make_it_flood():
    clock = Clock()
    beats = Heartbeats(10.0, clock)
    beats.learn(1.0)  # the peer gives up after 1 s: it must hear from us every 0.2 s
    assert beats.interval == pytest.approx(0.2)
    assert beats.timeout == 10.0, "our own tolerance is unchanged"
    beats.learn(60.0)
    assert beats.interval == pytest.approx(2.0), "a patient peer does not slow us below our own pace"
    beats.learn(1e-9)
    assert beats.interval == MIN_INTERVAL


def _tcp(open=True, heard=60.0, acked=0.1, retrying=False):
    return TcpState(open=open, heard=heard, acked=acked, retrying=retrying)


def test_a_silent_peer_whose_host_acknowledges_is_slow_and_one_whose_host_does_not_is_lost():
    clock = Clock()
    beats = Heartbeats(10.0, clock)
    clock.now += 9.0
    assert judge(beats, None) is Verdict.ANSWERING, "within the timeout nothing is judged"
    clock.now += 3.0  # 12 s of silence
    assert judge(beats, _tcp()) is Verdict.SLOW, "its host acknowledges what we send: starved, busy or stopped"
    assert judge(beats, _tcp(retrying=True, acked=0.3)) is Verdict.SLOW, "a zero window's probes answered"
    assert judge(beats, _tcp(retrying=True, acked=10.5)) is Verdict.LOST, "nothing acknowledged: cut or dead"
    assert judge(beats, _tcp(retrying=False, acked=10.5)) is Verdict.SLOW, \
        "nothing to acknowledge (this side sent nothing for a while, its own loop starved) is no evidence"
    assert judge(beats, _tcp(open=False)) is Verdict.LOST
    assert judge(beats, None) is Verdict.LOST, "where the kernel cannot say, silence alone is lost"


def test_bytes_the_kernel_holds_are_no_silence():
    clock = Clock()
    beats = Heartbeats(10.0, clock)
    clock.now += 12.0  # this process has read nothing for 12 s (its loop was starved) ...
    assert judge(beats, _tcp(heard=0.5)) is Verdict.ANSWERING  # ... but the peer's bytes came 0.5 s ago
    assert beats.silent_for() is None and beats.until_silent() == pytest.approx(9.5)
    beats.heard_ago(5.0)
    assert beats.until_silent() == pytest.approx(9.5), "an older word from the kernel never moves it back"


def test_the_kernel_keeps_answering_for_a_peer_that_stopped_reading():
    """A real connection whose peer reads nothing (a stopped or starved process) once its
    buffers are full: this side's kernel probes the zero window and the peer's answers, for
    longer than a short timeout; a peer that closes is no longer open. (TCP_USER_TIMEOUT, in
    contrast, ends such a connection: measured on Linux 6.18, within its timeout.)"""
    from pathways.wire.tcp import tcp_state
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    try:
        sender.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:
                sender.send(b"x" * 65536)
        beats = Heartbeats(0.5)
        start = time.monotonic()
        while time.monotonic() - start < 2.0:
            time.sleep(0.1)
            state = tcp_state(sender)
            assert state is not None and state.open, state
            verdict = judge(beats, state)
            assert verdict is Verdict.SLOW or time.monotonic() - start < 0.6, (verdict, state)
        receiver.close()
        wait_until(lambda: not tcp_state(sender).open, timeout=5.0, what="the closed peer's connection to end")
        assert judge(beats, tcp_state(sender)) is Verdict.LOST
    finally:
        sender.close()
        receiver.close()
        server.close()


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "10", True, None])
def test_a_timeout_must_be_a_finite_positive_number(bad):
    with pytest.raises(ValueError, match="--heartbeat-timeout must be a finite number of seconds above 0"):
        check_timeout(bad)
    with pytest.raises(ValueError, match="heartbeat timeout"):
        Heartbeats(bad)


def test_the_cli_refuses_a_bad_heartbeat_timeout():
    for role in (["controller"], ["worker", "--controller", "grpc://127.0.0.1:1"]):
        out = subprocess.run([sys.executable, "-m", "pathways", *role, "--heartbeat-timeout", "nan"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "--heartbeat-timeout must be a finite number" in out.stderr, out.stderr


@pytest.fixture
def fast():
    """A controller in this process whose heartbeat timeout is 1 s."""
    c = InProcessController(heartbeat_timeout=1.0)
    yield c
    c.close()


def test_an_idle_controller_sends_heartbeats_at_the_pace_the_worker_asks_for(fast):
    raw = RawWorker(fast.attach)
    try:
        raw.register(island=1000)
        start = time.monotonic()
        beats = raw.until(lambda x: type(x) is m.Heartbeat)
        assert beats[-1].timeout == 1.0, "the controller says how long it tolerates silence"
        raw.send_messages(m.Heartbeat(0.25))  # this worker gives up after 0.25 s of silence
        seen, start = 0, time.monotonic()
        while time.monotonic() - start < 1.0:
            raw.send_messages(m.Heartbeat(0.25))  # and keeps itself alive
            seen += sum(type(x) is m.Heartbeat for x in raw.read())
        assert seen >= 10, f"heartbeats every 0.05 s expected, got {seen} in a second"
        assert fast.lost == []
    finally:
        raw.close()


def test_a_worker_that_sends_nothing_is_slow_not_lost_until_its_host_stops_acknowledging(fast, monkeypatch):
    """Registered and silent past the timeout, its connection open and its host (this
    process's kernel) acknowledging: kept, and marked slow in the status until it speaks
    again. Once the kernel says its host acknowledged nothing for the timeout while ours
    retried (faked here: a cut needs a network, test_slow.py cuts one), it is lost, naming
    both silences."""
    quiet, chatty = RawWorker(fast.attach), RawWorker(fast.attach)

    def workers():
        async def get():
            return {w["worker"]: w for w in fast.controller.core.status().as_dict()["workers"]}
        return fast.run(get())

    try:
        silent_id = quiet.register(island=1000)
        kept_id = chatty.register(island=1001)
        start = time.monotonic()
        while time.monotonic() - start < 2.5:
            chatty.send_messages(m.Heartbeat(1.0))
            time.sleep(0.15)
        assert not quiet.closed_by_peer(0.3), "the silent worker's connection is kept"
        assert fast.lost == [] and fast.workers() == sorted([silent_id, kept_id])
        assert workers()[silent_id]["slow"] > 1.0

        quiet.send_messages(m.Heartbeat(1.0))  # it speaks again: no longer slow
        wait_until(lambda: workers()[silent_id]["slow"] is None, timeout=5.0, what="the slow mark to go")

        from pathways.wire import tcp
        cut, real = TcpState(open=True, heard=30.0, acked=30.0, retrying=True), tcp.tcp_state
        # the quiet worker's host acknowledges nothing any more, as the kernel tells it
        monkeypatch.setattr(tcp, "tcp_state", lambda sock: cut if sock.getpeername() == quiet.sock.getsockname()
                            else real(sock))
        start = time.monotonic()
        while time.monotonic() - start < 2.5 and not fast.lost:
            chatty.send_messages(m.Heartbeat(1.0))
            time.sleep(0.15)
        assert quiet.closed_by_peer(1.0), "the cut worker's connection is dropped"
        assert fast.lost == [silent_id] and fast.workers() == [kept_id]

        async def lost():
            return fast.controller.core.status().as_dict()["islands"]
        islands = {i["island"]: i for i in fast.run(lost())}
        assert not islands[1000]["healthy"] and islands[1001]["healthy"]
        assert islands[1000]["lost"].startswith(f"worker {silent_id} on host fake at grpc://127.0.0.1:1 (pid 1")
        assert "stopped answering for 1." in islands[1000]["lost"], islands[1000]["lost"]
        assert "its host acknowledged nothing for 30.0 s either" in islands[1000]["lost"], islands[1000]["lost"]
    finally:
        quiet.close()
        chatty.close()


def test_a_stranger_that_never_registers_is_dropped_after_the_timeout(fast):
    stranger = RawWorker(fast.attach)
    try:
        assert stranger.closed_by_peer(5.0)
        # the stream reports its end just after it closes the connection
        wait_until(lambda: fast.lost == [-1], timeout=5.0, what="the stranger's stream to end")
        assert fast.workers() == []
    finally:
        stranger.close()


def test_a_worker_that_trickles_a_large_frame_is_not_taken_for_silent(fast, monkeypatch):
    monkeypatch.setattr(controller_server, "FRAME_SECONDS", 30.0)
    raw = RawWorker(fast.attach)
    try:
        worker = raw.register(island=1000)
        payload = m.encode_batch([m.Notice("x" * (3 << 20))])  # 3 MiB, sent over 2.5 s
        framed = frames.frame(payload)
        pieces = [framed[i:i + (1 << 18)] for i in range(0, len(framed), 1 << 18)]
        for piece in pieces:
            raw.sock.sendall(piece)
            time.sleep(2.5 / len(pieces))
        raw.send_messages(m.Heartbeat(1.0))
        time.sleep(0.3)
        assert fast.lost == [] and fast.workers() == [worker]
    finally:
        raw.close()


# ---- the data plane -------------------------------------------------------------------------

def test_a_send_to_a_peer_that_stops_reading_fails_within_the_timeout_naming_it():
    """The listener's process is alive (its kernel acknowledges) but never reads: the send
    stalls once the buffers fill, and gives up after the timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    links = tcp.Links(1.0)
    try:
        big = np.zeros(64 << 20, np.uint8)  # far more than socket buffers hold
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"the peer at {address} took nothing for 1 s"):
            links.send(address, {"t": "put"}, [(((0, big.size),), big)])
        assert time.monotonic() - start < 5.0
    finally:
        links.close()
        server.close()
        for conn, _ in accepted:
            conn.close()


def test_a_slow_peer_that_keeps_reading_is_not_given_up():
    """Each piece of a send has the timeout, not the whole: 48 MiB to a reader that takes
    them at about 24 MiB/s for 2 s goes through with a 1 s timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    got = []

    def slow_reader():
        conn, _ = server.accept()
        with conn:
            total = 0
            while chunk := conn.recv(1 << 20):
                total += len(chunk)
                time.sleep(0.04)
            got.append(total)

    threading.Thread(target=slow_reader, daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    links = tcp.Links(1.0)
    try:
        data = np.ones(48 << 20, np.uint8)
        links.send(address, {"t": "put"}, [(((0, data.size),), data)])
    finally:
        links.close()
        server.close()
    wait_until(lambda: got, timeout=20, what="the reader to finish")
    assert got[0] > data.size


def test_connecting_to_an_address_nobody_serves_names_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectionError, match=f"could not connect to tcp://127.0.0.1:{port}"):
            tcp.connect(f"tcp://127.0.0.1:{port}", 1.0)


def test_data_connections_have_keepalive_bounded_by_the_timeout():
    listener = tcp.Listener(lambda header, pieces: None, timeout=10.0)
    try:
        sock = tcp.connect(listener.address, 10.0)
        with sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            assert idle + interval * probes <= 10
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10000
            assert sock.gettimeout() == 10.0
    finally:
        listener.close()
