"""The controller process's shell: signals stop it cleanly, ending its streams with OK."""

import signal
import subprocess
import sys
import threading

import grpc

from pathways.cluster import stop_processes
from pathways.defaults import ADDRESS_LINE
from pathways.protocol import messages as m
from pathways.wire import rpc
from tests.conftest import read_line


def test_sigterm_ends_every_stream_cleanly_and_the_controller_exits():
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "controller"], stdout=subprocess.PIPE, text=True)
    channel = None
    done = threading.Event()
    try:
        line = read_line(proc, timeout=60.0)
        assert line.startswith(ADDRESS_LINE)
        address = line.split()[1]
        channel = rpc.open_channel(address)
        rpc.wait_ready(channel, address, 20.0)
        session = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Session", "stream_stream")
        hello = m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0)])

        def requests():
            yield hello
            done.wait(30.0)  # keep sending open: only the controller may end the stream

        replies = session(requests(), timeout=30.0)
        assert type(m.SESSION_DOWN.decode_batch(next(replies))[0]) is m.SessionWelcome
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20.0) == 0
        assert list(replies) == []  # the stream ended with OK: iterating it raises no RpcError
        assert replies.code() == grpc.StatusCode.OK
    finally:
        done.set()
        if channel is not None:
            channel.close()
        stop_processes([proc])
        proc.stdout.close()
