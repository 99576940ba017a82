"""Connecting to a controller: refused connections and malformed addresses fail fast, with
advice that fits the caller (the library or the command line)."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import free_port


def test_a_refused_connection_fails_within_seconds_with_advice_for_the_library():
    address = f"grpc://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(pw.ConnectError, match="the connection was refused: 127.0.0.1 answers, but nothing "
                                              "listens on port") as info:
        pw.connect(address, timeout=30)
    assert time.monotonic() - started < 5, "a refusal is immediate: no need to wait for the 30 s timeout"
    assert address in str(info.value) and "pw.connect()" in str(info.value)


def test_pathways_address_is_checked_the_same_way(monkeypatch):
    monkeypatch.setenv("PATHWAYS_ADDRESS", f"grpc://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(pw.ConnectError, match="refused"):
        pw.connect()
    assert time.monotonic() - started < 5


def test_a_name_that_does_not_resolve_is_said_so():
    started = time.monotonic()
    with pytest.raises(pw.ConnectError, match="the host name 'nohost.invalid' does not resolve") as info:
        pw.connect("grpc://nohost.invalid:1234", timeout=30)
    assert time.monotonic() - started < 15, "a name that does not resolve fails within the refusal's grace"
    assert "refused" not in str(info.value) and "spelling" in str(info.value)


def test_a_host_that_does_not_answer_is_told_from_a_refusal():
    # A listener whose accept queue is full: the kernel drops further connection attempts
    # unanswered, as a host that is down or behind a dropping firewall does.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        queued = []
        try:
            for _ in range(8):  # enough to fill the queue; the later ones stay pending
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                queued.append(c)
            time.sleep(0.2)
            started = time.monotonic()
            with pytest.raises(pw.ConnectError, match="nothing answered") as info:
                pw.connect(f"grpc://127.0.0.1:{port}", timeout=3)
            assert time.monotonic() - started < 10
        finally:
            for c in queued:
                c.close()
    message = str(info.value)
    assert "refused" not in message and "firewall" in message and f"port {port} is open" in message


@pytest.mark.parametrize("address", ["127.0.0.1:1", "http://127.0.0.1:1", "grpc://127.0.0.1", "grpc://:1",
                                     "grpc://127.0.0.1:99999", "grpc://127.0.0.1:1/x"])
def test_an_address_not_of_the_form_grpc_host_port_is_rejected_at_once(address):
    started = time.monotonic()
    with pytest.raises(pw.ConnectError, match="grpc://HOST:PORT"):
        pw.connect(address)
    assert time.monotonic() - started < 1


def test_a_host_name_is_accepted(cluster):
    port = cluster.address.rpartition(":")[2]
    pw.connect(f"grpc://localhost:{port}", timeout=30)
    try:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
        double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
        assert np.asarray(double(np.array([1.0, 2.0], np.float32))).tolist() == [2.0, 4.0]
    finally:
        pw.disconnect()


def test_status_of_a_refused_address_fails_fast_with_advice_for_the_command_line():
    address = f"grpc://127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", address, "--timeout", "300"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert time.monotonic() - started < 120, "python start-up plus a refusal, not the 300 s timeout asked for"
    assert "refused" in out.stderr and "pathways up" in out.stderr, out.stderr
    assert "pw.connect" not in out.stderr, "advice for the library does not apply on the command line"


def test_a_host_without_a_route_is_told_from_a_refusal_and_a_silent_host(monkeypatch):
    # Only the socket's answer is made up: EHOSTUNREACH, as a machine gets for an address on
    # its own network that no host holds, or one that no route leads to.
    import errno

    from pathways.wire import addresses

    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError(errno.EHOSTUNREACH, os.strerror(errno.EHOSTUNREACH))

    monkeypatch.setattr(addresses.socket, "socket", NoRoute)
    why = addresses.unreachable("192.0.2.77", 50051)
    assert why.startswith("192.0.2.77 cannot be reached from here (No route to host)"), why
    assert "refused" not in why and "nothing answered" not in why and "routes to it" in why


def test_demo_with_an_address_that_refuses_says_so_in_one_line_with_advice_for_the_command_line():
    address = f"grpc://127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "pathways", "demo", "--address", address],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: could not connect"), out.stderr
    assert "refused" in out.stderr and "`pathways demo` without --address" in out.stderr, out.stderr
    assert "pw.connect" not in out.stderr, "advice for the library does not apply on the command line"


# Reports, after pathways' own exit handler, how many gRPC call objects are left: those the
# interpreter's last garbage collection would finalize once gRPC's daemon threads have stopped,
# where a call's finalizer can wait for ever for a lock such a thread held.
_EXIT_PROBE = """
import atexit, gc, json, sys

def calls_left():  # registered before pathways is imported: runs after its exit handler
    import grpc._channel
    print(json.dumps({"calls": sum(isinstance(o, grpc._channel._Rendezvous) for o in gc.get_objects())}), flush=True)

atexit.register(calls_left)
import numpy as np
import pathways as pw
pw.connect(sys.argv[1])
s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
print(json.dumps({"result": np.asarray(double(pw.device_put(np.array([1.0, 2.0], np.float32), s.devices))).tolist()}))
"""


def test_a_client_process_leaves_no_grpc_call_for_the_interpreters_last_collection(cluster):
    """A client that puts, runs and fetches, then exits without closing anything: the exit
    handler closes its session and no gRPC call object outlives it (one left there once made
    a process that had printed its results hang at exit, now and then, under load)."""
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE, cluster.address], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result, left = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert result == {"result": [2.0, 4.0]}
    assert left == {"calls": 0}, "gRPC calls outlived the client's exit handler"
