"""Running unmodified JAX scripts under JAX_PLATFORMS=proxy against an IfrtServer."""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Iterator, Optional

from pathways.cluster import stop_processes

# The backend registration pathwaysutils.initialize() does (an installed pathways does it
# through its jax_plugins entry point; these tests run the package uninstalled); what
# follows it is an unmodified JAX program.
PRELUDE = """
import jax
from jax.extend import backend
from jax.extend.backend import ifrt_proxy

def _make_client():
    return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), ifrt_proxy.ClientConnectionOptions())

backend.register_backend_factory("proxy", _make_client, priority=-1)
"""


def run_jax(address: str, body: str, timeout: float = 240.0) -> dict:
    """Run ``body`` as a JAX program against the IFRT server at ``address`` (HOST:PORT);
    it reports by printing one JSON line starting with ``RESULT``. Returns that object."""
    env = dict(os.environ, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{address}",
               IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_processes([proc])
        out, err = proc.communicate()
        raise AssertionError(f"the JAX client did not finish within {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the JAX client failed ({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@contextlib.contextmanager
def silent_streams(address: str, count: int, reopen_after: Optional[float] = None) -> Iterator[tuple]:
    """``count`` IFRT session streams opened at the IFRT server at ``address`` (HOST:PORT)
    without the token, sending nothing, until the block ends. Yields the channel they share
    and the list of the status codes of the streams that ended, in order. ``reopen_after``:
    seconds after which a stream that ended is opened again, so that ``count`` keep coming
    all along; None: each is opened once."""
    import grpc

    from pathways.ifrt import server as ifrt_server
    from pathways.ifrt.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb

    meta = gpb.GrpcIfrtSessionMetadata()
    meta.version.protocol_version = ifrt_server.PROTOCOL_MAX
    metadata = ((ifrt_server.SESSION_METADATA, meta.SerializeToString()),)
    channel = grpc.insecure_channel(address)
    session = channel.stream_stream(f"/{ifrt_server.SERVICE}/IfrtSession")
    done = threading.Event()
    ended: list = []

    def stream() -> None:
        while not done.is_set():
            try:
                list(session(iter(done.wait, True), metadata=metadata, timeout=60))  # sends nothing
            except grpc.RpcError as e:
                ended.append(e.code())
            if reopen_after is None or done.wait(reopen_after):
                return

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield channel, ended
    finally:
        done.set()
        channel.close()
        for t in threads:
            t.join(timeout=10)


class RawStream:
    """One IfrtSession stream spoken by hand: requests from a queue, responses collected by op_id."""

    def __init__(self, channel, metadata):
        import queue

        from pathways.ifrt import server as ifrt_server

        self.requests: queue.Queue = queue.Queue()
        self.answered: dict = {}
        self.ended = threading.Event()
        self.error = None
        call = channel.stream_stream(f"/{ifrt_server.SERVICE}/IfrtSession")
        self.call = call(iter(self.requests.get, None), metadata=metadata, timeout=600)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        import grpc

        from pathways.ifrt.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb

        try:
            for raw in self.call:
                response = pb.IfrtResponse.FromString(raw)
                self.answered[response.response_metadata.op_id] = response
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended.set()

    def init(self) -> int:
        """Open the session (op_id 1); its session id."""
        from pathways.ifrt.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb

        init = pb.IfrtRequest()
        init.request_metadata.op_id = 1
        init.init_request.SetInParent()
        self.send(init.SerializeToString())
        self.wait([1])
        assert 1 in self.answered and self.answered[1].HasField("init_response"), self.error
        return self.answered[1].init_response.session_id

    def send(self, raw: bytes):
        self.requests.put(raw)

    def wait(self, op_ids, timeout=120.0):
        deadline = time.monotonic() + timeout
        while not self.ended.is_set() and not all(o in self.answered for o in op_ids):
            assert time.monotonic() < deadline, f"{sum(o not in self.answered for o in op_ids)} requests unanswered"
            time.sleep(0.02)

    def close(self):
        self.requests.put(None)
        self.ended.wait(30)
        self.call.cancel()


def session_metadata(version=25):
    """The metadata of an IfrtSession stream speaking protocol ``version``."""
    from pathways.ifrt import server as ifrt_server
    from pathways.ifrt.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb

    meta = gpb.GrpcIfrtSessionMetadata()
    meta.version.protocol_version = version
    return ((ifrt_server.SESSION_METADATA, meta.SerializeToString()),)
