"""Running unmodified JAX scripts under JAX_PLATFORMS=proxy against an IfrtServer."""

import contextlib
import itertools
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from typing import Iterator, Optional

import grpc
import numpy as np

from pathways.cluster import stop_processes
from pathways.ifrt import server as ifrt_server
from pathways.ifrt import types as t
from pathways.proto.xla import xla_data_pb2
from pathways.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb

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
            except ValueError:  # "Channel closed!": the block ended between the check above and the call
                if done.is_set():
                    return
                raise
            if reopen_after is None or done.wait(reopen_after):
                return

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield channel, ended
    finally:
        done.set()
        channel.close()
        for thread in threads:
            thread.join(timeout=10)


class RawStream:
    """One IfrtSession stream spoken by hand: requests from a queue, responses collected by op_id."""

    def __init__(self, channel, metadata):
        self.requests: queue.Queue = queue.Queue()
        self.answered: dict = {}
        self.ended = threading.Event()
        self.error = None
        call = channel.stream_stream(f"/{ifrt_server.SERVICE}/IfrtSession")
        self.call = call(iter(self.requests.get, None), metadata=metadata, timeout=600)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
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
    meta = gpb.GrpcIfrtSessionMetadata()
    meta.version.protocol_version = version
    return ((ifrt_server.SESSION_METADATA, meta.SerializeToString()),)


def tiled(devices, tiles):
    """A sharding over ``devices`` splitting dimension k of an array into ``tiles[k]`` blocks."""
    op = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=list(tiles),
                                 tile_assignment_devices=list(range(len(devices))))
    return t.Sharding(tuple(devices), op.SerializeToString())


class Proxy:
    """One IFRT session spoken by hand: host buffers stored, arrays made of them, read back."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * (1 << 20))])
        self.stream = RawStream(self.channel, session_metadata())
        self.session_id = self.stream.init()
        self.ops = itertools.count(2)
        self.handles = itertools.count(100)

    def close(self):
        self.stream.close()
        self.channel.close()

    def request(self, fill):
        """Send the request ``fill`` writes into an IfrtRequest; its response, waited for."""
        r = pb.IfrtRequest()
        r.request_metadata.op_id = op = next(self.ops)
        fill(r)
        self.stream.send(r.SerializeToString())
        self.stream.wait([op], timeout=180)
        assert op in self.stream.answered, f"no answer to op {op}: {self.stream.error}"
        return self.stream.answered[op]

    def store(self, data):
        """A new host buffer holding ``data``; its handle."""
        handle = next(self.handles)
        ended = self.store_stream(handle, len(data), [data], timeout=60)
        assert ended == "finished", f"storing host buffer {handle} ended with {ended}"
        return handle

    def store_stream(self, handle, size, chunks, timeout):
        """Store host buffer ``handle`` of ``size`` bytes announced, one message per chunk of
        ``chunks`` as it comes (a source that pauses pauses the store); how the call ended:
        "finished", or its gRPC status code."""
        meta = gpb.GrpcHostBufferStoreMetadata(session_id=self.session_id, handle=handle, buffer_size=size)
        store = self.channel.stream_unary(f"/{ifrt_server.SERVICE}/HostBufferStore")
        requests = (gpb.GrpcHostBufferStoreRequest(data=bytes(chunk)).SerializeToString() for chunk in chunks)
        try:
            store(requests, metadata=((ifrt_server.STORE_METADATA, meta.SerializeToString()),), timeout=timeout)
        except grpc.RpcError as e:
            return e.code()
        return "finished"

    def make(self, data, strides, dtype, shape, sharding):
        """An array of ``shape`` made from a host buffer of ``data`` with ``strides`` (None:
        C order), laid out by ``sharding``, and ready: its handle; the status of the first
        request that failed instead."""
        buffer, array = self.store(data), next(self.handles)

        def fill(r):
            body = r.make_array_from_host_buffer_request
            body.dtype.CopyFrom(t.dtype_proto(np.dtype(dtype)))
            body.shape.CopyFrom(t.shape_proto(shape))
            body.sharding.CopyFrom(t.sharding_proto(sharding))
            if strides is not None:
                body.byte_strides.strides.extend(strides)
            body.host_buffer_handle, body.array_handle = buffer, array
        return self._ready(self.request(fill), array)

    def make_from_shards(self, shards, dtype, shape, sharding):
        """An array of ``shape`` made from one host buffer per shard: ``shards[i]`` is shard
        i's (data, its strides, its shape); ready: its handle, or the failed status."""
        buffers, array = [self.store(data) for data, _, _ in shards], next(self.handles)

        def fill(r):
            spec = r.make_arrays_from_host_buffer_shards_request.specs.add()
            spec.array_spec.dtype.CopyFrom(t.dtype_proto(np.dtype(dtype)))
            spec.array_spec.shape.CopyFrom(t.shape_proto(shape))
            spec.array_spec.sharding.CopyFrom(t.sharding_proto(sharding))
            for i, (buffer, (_, strides, shard_shape)) in enumerate(zip(buffers, shards)):
                spec.addressable_shard_indices.add(indices=[i])
                hb = spec.host_buffers.add(host_buffer_handle=buffer)
                hb.dtype.CopyFrom(t.dtype_proto(np.dtype(dtype)))
                hb.shape.CopyFrom(t.shape_proto(shard_shape))
                if strides is not None:
                    hb.byte_strides.strides.extend(strides)
            r.make_arrays_from_host_buffer_shards_request.array_handles.append(array)
        return self._ready(self.request(fill), array)

    def _ready(self, answer, array):
        if answer.response_metadata.status.code:
            return answer.response_metadata.status
        ready = self.request(lambda r: r.check_value_ready_request.value_handles.append(array))
        return ready.response_metadata.status if ready.response_metadata.status.code else array

    def chunks(self, array):
        """The array's bytes in C order, as the lookup of its host buffer brings them."""
        buffer = next(self.handles)

        def fill(r):
            r.copy_to_host_buffer_request.array_handle = array
            r.copy_to_host_buffer_request.host_buffer_handle = buffer
        status = self.request(fill).response_metadata.status
        assert status.code == 0, status.message
        lookup = self.channel.unary_stream(f"/{ifrt_server.SERVICE}/HostBufferLookup")
        request = gpb.GrpcHostBufferLookupRequest(session_id=self.session_id, handle=buffer)
        for raw in lookup(request.SerializeToString(), timeout=180):
            yield gpb.GrpcHostBufferLookupResponse.FromString(raw).data

    def read(self, array, dtype, shape):
        return np.frombuffer(b"".join(self.chunks(array)), dtype).reshape(shape)
