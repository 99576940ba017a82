"""The controller's worker stream, framed TCP: its bounds on frames (a stranger may send
at most 64 KiB before registering; a frame must finish within its deadline), lost
workers, and a clean end when the controller stops.

The bounds are tested on a ControllerServer run in this process on its own event loop (so
that the frame deadline can be shortened); the rest through a real controller process."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pathways import cluster
from pathways.cluster import stop_processes
from pathways.controller import server as controller_server
from pathways.defaults import ADDRESS_LINE
from pathways.protocol import messages as m
from pathways.wire import frames
from tests.conftest import read_line, wait_until
from tests.inprocess import InProcessController
from tests.rawworker import RawWorker


@pytest.fixture
def inproc():
    c = InProcessController()
    yield c
    c.close()


def test_a_frame_over_the_unregistered_limit_closes_only_its_connection_and_registers_no_worker(inproc):
    stranger = RawWorker(inproc.attach)
    bystander = RawWorker(inproc.attach)
    try:
        too_long = controller_server.UNREGISTERED_FRAME_BYTES + 1
        stranger.sock.sendall(frames.LENGTH.pack(too_long) + b"\0" * 1000)
        assert stranger.closed_by_peer(5.0), "a frame over 64 KiB before registering closes the connection"
        assert inproc.workers() == []
        assert inproc.lost == [-1]  # the end of the connection is reported once; nothing was registered
        # the other connection is served, and a registered worker may send larger frames
        worker = bystander.register(island=1000)
        bystander.send(m.encode_batch([m.Notice("x" * too_long)]))
        bystander.send_messages(m.Step(1, 2))
        assert inproc.workers() == [worker]
    finally:
        stranger.close()
        bystander.close()


def test_a_frame_that_stalls_is_dropped_after_its_deadline_and_its_worker_lost(inproc, monkeypatch):
    monkeypatch.setattr(controller_server, "FRAME_SECONDS", 0.5)
    raw = RawWorker(inproc.attach)
    try:
        worker = raw.register(island=1000)
        assert inproc.workers() == [worker]
        start = time.monotonic()
        raw.sock.sendall(frames.LENGTH.pack(1 << 20) + b"0123456789")  # announces 1 MiB, sends 10 bytes
        assert raw.closed_by_peer(5.0), "a frame that does not finish is dropped with its connection"
        waited = time.monotonic() - start
        assert 0.4 < waited < 5.0, waited
        assert inproc.workers() == []
        assert inproc.lost == [worker], "the worker is lost exactly once"
    finally:
        raw.close()


def test_a_truncated_frame_loses_its_worker(inproc):
    raw = RawWorker(inproc.attach)
    try:
        worker = raw.register(island=1000)
        raw.sock.sendall(frames.LENGTH.pack(100) + b"cut short")
        raw.sock.shutdown(socket.SHUT_WR)  # the controller reads EOF inside the frame
        wait_until(lambda: inproc.lost == [worker], timeout=5.0, what="the worker to be lost")
        assert inproc.workers() == []
    finally:
        raw.close()


@pytest.fixture
def controller_process():
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "controller"], stdout=subprocess.PIPE, text=True)
    try:
        line = read_line(proc, timeout=60.0)
        assert line.startswith(ADDRESS_LINE)
        yield proc, line.split()[1]
    finally:
        stop_processes([proc])
        proc.stdout.close()


FAKE_WORKER = textwrap.dedent("""
    import sys, time
    from tests.rawworker import RawWorker
    raw = RawWorker(sys.argv[1])
    print(raw.register(island=1000), flush=True)
    time.sleep(60)
""")


def test_a_killed_worker_process_is_seen_as_lost(controller_process):
    _, address = controller_process
    fake = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, address], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(read_line(fake, timeout=30.0))
        assert [w["worker"] for w in cluster.status(address)["workers"]] == [worker]
        fake.kill()
        fake.wait(10.0)
        wait_until(lambda: not cluster.status(address)["workers"], timeout=10.0, what="the killed worker to be lost")
    finally:
        stop_processes([fake])
        fake.stdout.close()


def test_sigterm_closes_worker_connections_cleanly(controller_process):
    proc, address = controller_process
    raw = RawWorker(address)
    try:
        raw.register(island=1000)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20.0) == 0
        raw.sock.settimeout(10.0)
        while (batch := raw.read()) is not None:  # a clean end: EOF after whole frames, not a reset
            assert batch
    finally:
        raw.close()


def test_a_worker_started_before_its_controller_waits_for_it_and_attaches(tmp_path):
    port = cluster.free_port()
    address = f"grpc://127.0.0.1:{port}"
    log = tmp_path / "worker.log"
    with open(log, "w") as err:
        procs = [subprocess.Popen([sys.executable, "-m", "pathways", "worker", "--controller", address, "--platform",
                                   "cpu", "--launcher", "none", "--connect-timeout", "120"],
                                  stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PATHWAYS_LOG_LEVEL": "info"})]
    try:
        # the worker's last line before it connects; then refused for longer than a connection's
        # usual grace (rpc.REFUSED_GRACE_SECONDS, 2 s)
        wait_until(lambda: "island place" in log.read_text(), timeout=60.0, what="the worker to start connecting")
        time.sleep(5.0)
        assert procs[0].poll() is None, f"the worker gave up on a controller not listening yet:\n{log.read_text()}"
        procs.append(subprocess.Popen([sys.executable, "-m", "pathways", "controller", "--bind", f"127.0.0.1:{port}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        assert read_line(procs[1]).split()[-1] == address
        wait_until(lambda: cluster.status(address)["workers"], timeout=60.0, what="the worker to attach")
    finally:
        stop_processes(procs)
        if len(procs) > 1:
            procs[1].stdout.close()
