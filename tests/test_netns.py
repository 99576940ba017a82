"""The network-namespace harness (tests/netns.py): hosts reach each other over the bridge and
nothing else, a link can be cut and restored, and nothing outlives a network: no process,
namespace, veth or bridge, whether its block ends normally, on an error or on Ctrl-C, or its
creator was killed."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import pids_alive, read_line, wait_until
from tests.netns import Network, netns_available, sweep, unavailable  # noqa: F401 (a fixture)

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}

# Echoes one message per connection on every address it is given; prints the ports in order.
ECHO = """
import selectors, socket, sys
servers = [socket.create_server((host, 0)) for host in sys.argv[1:]]
print(*(s.getsockname()[1] for s in servers), flush=True)
with selectors.DefaultSelector() as sel:
    for s in servers:
        sel.register(s, selectors.EVENT_READ)
    while events := sel.select(120):
        for key, _ in events:
            conn, _ = key.fileobj.accept()
            with conn:
                conn.settimeout(5)
                conn.sendall(conn.recv(100))
"""

# Sends "ping" to HOST PORT within TIMEOUT seconds; prints the answer or the error's type.
CLIENT = """
import socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(b"ping")
        print(conn.recv(100).decode())
except OSError as e:
    print(type(e).__name__)
"""

IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(300)
"""

# Starts a child in a session of its own, out of reach of its parent's process group.
DETACHES = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""

# Makes a network with a process in it, prints what it made, and waits to be killed.
LEAVES_A_NETWORK = """
import sys, time
from pathways_bench.netns import Network
net = Network(["x"]).__enter__()
sleeper = net.popen("x", [sys.executable, "-c", "import time; time.sleep(300)"])
print(net.namespace("x"), net.veth("x"), net.bridge, sleeper.pid, flush=True)
time.sleep(300)
"""


def send(net, host, address, port, timeout=5.0):
    """What "ping" sent from ``host`` to ``address:port`` brings back, or the error's type."""
    return net.run(host, [PY, "-c", CLIENT, address, str(port), str(timeout)], timeout=timeout + 30,
                   text=True).stdout.strip()


def echo_server(net, host, *addresses):
    server = net.popen(host, [PY, "-c", ECHO, *addresses], stdout=subprocess.PIPE, text=True)
    return read_line(server, 30).split()


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def links():
    return set(os.listdir("/sys/class/net"))


def made_by(net):
    return {net.namespace(h) for h in net.hosts}, {net.bridge, *(net.veth(h) for h in net.hosts)}


@pytest.mark.usefixtures("netns_available")
def test_hosts_reach_each_other_over_the_bridge_and_not_each_others_loopback():
    with Network(["a", "b"]) as net:
        assert (net.addr("a"), net.addr("b")) == ("10.77.0.1", "10.77.0.2")
        port, loopback_port = echo_server(net, "b", net.addr("b"), "127.0.0.1")
        assert send(net, "a", net.addr("b"), port) == "ping"
        assert send(net, "b", "127.0.0.1", loopback_port) == "ping"
        # a's loopback is up (refused, not unreachable) and its own: b's server is not on it
        assert send(net, "a", "127.0.0.1", loopback_port) == "ConnectionRefusedError"


@pytest.mark.usefixtures("netns_available")
def test_link_down_cuts_a_host_off_until_link_up():
    with Network({"a": "10.77.0.10", "b": "10.77.0.20"}) as net:
        port, = echo_server(net, "b", "10.77.0.20")
        assert send(net, "a", "10.77.0.20", port) == "ping"
        net.link_down("b")
        start = time.monotonic()
        # unanswered: a timeout, or "no route to host" once the address cannot be resolved
        assert send(net, "a", "10.77.0.20", port, timeout=2.0) in ("TimeoutError", "OSError")
        assert time.monotonic() - start < 30
        net.link_up("b")
        wait_until(lambda: send(net, "a", "10.77.0.20", port, timeout=2.0) == "ping", timeout=30,
                   what="b to answer again after link_up")


@pytest.mark.usefixtures("netns_available")
@pytest.mark.parametrize("ending", [None, RuntimeError, KeyboardInterrupt])
def test_leaving_the_block_ends_every_process_and_deletes_what_was_made(ending):
    net = Network(["a", "b"], grace=0.5)
    raised = None
    try:
        with net:
            stubborn = net.popen("a", [PY, "-c", IGNORES_TERM], stdout=subprocess.PIPE, text=True)
            assert read_line(stubborn, 30).strip() == "ready"
            parent = net.popen("b", [PY, "-c", DETACHES], stdout=subprocess.PIPE, text=True)
            detached = int(read_line(parent, 30))
            made_namespaces, made_links = made_by(net)
            assert made_namespaces <= namespaces() and made_links <= links()
            if ending:
                raise ending("the block failed")
    except (RuntimeError, KeyboardInterrupt) as e:
        raised = e
    assert type(raised) is ending if ending else raised is None
    assert pids_alive([stubborn.pid, parent.pid, detached]) == []
    assert not made_namespaces & namespaces() and not made_links & links()


@pytest.mark.usefixtures("netns_available")
def test_sweep_deletes_what_a_killed_run_left():
    creator = subprocess.Popen([PY, "-c", LEAVES_A_NETWORK], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **ENV})
    try:
        namespace, veth, bridge, sleeper = read_line(creator, 60).split()
    finally:
        creator.kill()
        creator.wait(30)
    assert namespace in namespaces() and {veth, bridge} <= links() and pids_alive([int(sleeper)])
    assert set(sweep()) >= {namespace, veth, bridge}
    assert namespace not in namespaces() and not {veth, bridge} & links()
    wait_until(lambda: not pids_alive([int(sleeper)]), timeout=10, what="the process left in the namespace to end")


def test_unavailable_says_why_without_root():
    if os.geteuid() != 0:
        assert "needs root" in unavailable()
        return
    # A child that drops root (an executable may not be readable without it) asks again,
    # past the answer this process has cached.
    # (A new process, not a fork of this one, whose JAX threads make a fork unsafe.)
    code = ("import os; from pathways_bench.netns import unavailable; "
            "os.setgroups([]); os.setgid(65534); os.setuid(65534); print(unavailable.__wrapped__())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    said = out.stdout
    assert "needs root" in said, said


@pytest.mark.parametrize("hosts, kw, message", [
    (["a", "a"], {}, "distinct names"),
    ({"a": "10.77.0.1", "b": "10.77.0.1"}, {}, "distinct addresses"),
    ("ab", {}, "a list of names"),
    (["a b"], {}, "letters, digits"),
    ({"a": "10.78.0.1"}, {}, "not a host address of subnet 10.77.0.0/24"),
    ({"a": "10.77.0.255"}, {}, "not a host address"),
    ([f"h{i}" for i in range(3)], {"subnet": "10.77.0.0/31"}, "at most as many"),
    (["a"], {"prefix": "muchtoolong"}, "longer than 15 characters"),
    (["a"], {"subnet": "10.77.0.1/24"}, "subnet must be an IPv4 network"),
])
def test_bad_arguments_say_what_to_change(hosts, kw, message):
    with pytest.raises(ValueError, match=message):
        Network(hosts, **kw)
