"""The worker process: the gRPC shell around the store, executables and executor.

It attaches to the controller with one long-lived stream (registration up, op batches
down) and serves the data plane (puts, fetches, peer pushes) on its own port. When the
controller's stream ends, the worker exits: a worker without a controller has no work.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import trio

from pathways.errors import ConnectError, WireError
from pathways.wire import codec, rpc

log = logging.getLogger("pathways.worker")

_CONTROLLER_MESSAGES = {
    "welcome": {"worker": int},
    "peers": {"peers": dict},
    "compile": {"fn": int, "name": str, "blob": bytes, "ins": list, "outs": list},
    "define": {"key": int, "nvalues": int, "ncopies": int, "ops": list},
    "run": {"key": int, "base": int, "tbase": int, "args": dict},
    "delete": {"handles": list},
    "drop_session": {"session": int},
}
_PUT_FIELDS = {"put": {"handle": int, "layout": list}}
_FETCH_FIELDS = {"fetch": {"handle": int, "wait": (int, float), "data": bool}}


class Worker:
    def __init__(self, wait_timeout: float) -> None:
        import jax  # configured by main() before the first import of a backend

        from pathways.worker.executables import Executables
        from pathways.worker.executor import Executor
        from pathways.worker.store import ObjectStore

        self.jax = jax
        self.store = ObjectStore()
        self.executables = Executables()
        self.peers: dict[int, str] = {}
        self._peer_put: dict[int, Any] = {}
        self._send_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pathways-send")
        self.wait_timeout = wait_timeout
        self.executor = Executor(self.store, self.executables, self.send, wait_timeout)
        self.outbox = rpc.Outbox()

    # ---- control plane --------------------------------------------------------------

    def on_batch(self, payload: bytes) -> None:
        try:
            batch = codec.unpack_batch(payload, _CONTROLLER_MESSAGES)
        except WireError as e:
            self.outbox.put({"t": "error", "message": f"worker dropped a batch: {e}"})
            return
        for msg in batch:
            try:
                self._on_message(msg)
            except WireError as e:
                self.outbox.put({"t": "error", "message": f"worker dropped {msg['t']!r}: {e}"})

    def _on_message(self, msg: dict) -> None:
        from pathways.ir import Layout

        kind = msg["t"]
        if kind == "compile":
            self.executables.register(msg["fn"], msg["name"], msg["blob"],
                                      [Layout.from_wire(x) for x in msg["ins"]],
                                      [Layout.from_wire(x) for x in msg["outs"]])
        elif kind == "define":
            self.executor.define(msg)
        elif kind == "peers":
            self.peers.update({int(k): v for k, v in msg["peers"].items()})
        elif kind == "welcome":
            self.executor.worker_id = msg["worker"]
        else:
            if kind == "run" and not all(isinstance(k, int) and isinstance(v, int) for k, v in msg["args"].items()):
                raise WireError("run args must map register numbers to handles")
            if kind == "delete":
                codec.int_list(msg["handles"], "delete handles")
            self.executor.submit(msg)

    # ---- data plane -----------------------------------------------------------------

    def send(self, peer: int, handle: int, value: Any, layout: list) -> None:
        self._send_pool.submit(self._push, peer, handle, value, layout)

    def _push(self, peer: int, handle: int, value: Any, layout: list) -> None:
        from pathways.worker.store import Poison

        header: dict = {"t": "put", "handle": handle, "layout": layout}
        chunks: list[bytes] | Iterator[bytes] = []
        if type(value) is Poison:
            header["poison"] = value.message
        else:
            try:
                array = self.jax.device_get(value)
                header["array"] = codec.array_header(array)
                chunks = codec.array_chunks(array)
            except Exception as e:
                header["poison"] = f"computing an array on worker {self.executor.worker_id} failed: {e}"
        try:
            put = self._peer_put.get(peer)
            if put is None:
                put = rpc.method(rpc.open_channel(self.peers[peer]), rpc.WORKER_SERVICE, "Put", "stream_unary")
                self._peer_put[peer] = put
            reply = codec.unpack(put(_prepend(codec.pack(header), chunks), timeout=self.wait_timeout))
            if "error" in reply:
                log.error("worker %s refused array %#x: %s", peer, handle, reply["error"])
        except (grpc.RpcError, KeyError) as e:
            log.error("sending array %#x to worker %s failed: %s", handle, peer, e)

    def put(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        from pathways.ir import Layout
        from pathways.worker.store import Poison

        try:
            chunks = iter(request_iterator)
            header = codec.validate(codec.unpack(next(chunks, b"")), _PUT_FIELDS)
            handle = header["handle"]
            layout = Layout.from_wire(header["layout"])
            if self.store.get(handle) is not None:
                raise WireError(f"array {handle:#x} already exists on this worker")
            if isinstance(header.get("poison"), str):
                value: Any = Poison(header["poison"])
            else:
                array = codec.assemble_array(header.get("array"), chunks)
                value = self.jax.device_put(array, self.executables.sharding(layout))
            self.store.put(handle, value)
            return codec.pack({"ok": True})
        except WireError as e:
            return codec.pack({"error": str(e)})

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        from pathways.worker.store import Poison

        try:
            req = codec.validate(codec.unpack(request), _FETCH_FIELDS)
        except WireError as e:
            yield codec.pack({"state": "error", "message": str(e)})
            return
        wait = min(max(float(req["wait"]), 0.0), 3600.0)
        deadline = time.monotonic() + wait
        value = self.store.wait(req["handle"], wait)
        if value is None:
            yield codec.pack({"state": "pending"})
            return
        if type(value) is Poison:
            yield codec.pack({"state": "error", "message": value.message})
            return
        pause = 0.0002
        while not value.is_ready():
            if time.monotonic() >= deadline:
                yield codec.pack({"state": "pending"})
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        if not req["data"]:
            yield codec.pack({"state": "ready"})
            return
        try:
            array = self.jax.device_get(value)
        except Exception as e:
            yield codec.pack({"state": "error", "message": f"computation failed on worker "
                                                          f"{self.executor.worker_id}: {e}"})
            return
        yield codec.pack({"state": "ready", "array": codec.array_header(array)})
        yield from codec.array_chunks(array)

    def stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return codec.pack({"worker": self.executor.worker_id, "handles": len(self.store),
                           "sessions": self.store.session_counts(),
                           "executables": len(self.executables), "compiled": self.executables.compiled(),
                           "programs": self.executor.programs})

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Put": rpc.stream_unary(self.put), "Fetch": rpc.unary_stream(self.fetch),
                "Stats": rpc.unary_unary(self.stats)}

    def close(self) -> None:
        self.outbox.close()
        self.executor.stop()
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        self.executables.close()


def _prepend(first: bytes, rest: Any) -> Iterator[bytes]:
    yield first
    yield from rest


def main(controller: str, devices: int, island: int, wait_timeout: float, connect_timeout: float) -> None:
    """Configure JAX for ``devices`` CPU devices, then serve until the controller goes away."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    trio.run(_serve, controller, devices, island, wait_timeout, connect_timeout)


async def _serve(controller: str, devices: int, island: int, wait_timeout: float, connect_timeout: float) -> None:
    worker = Worker(wait_timeout)
    server, port = rpc.make_server(rpc.WORKER_SERVICE, worker.handlers())
    channel = rpc.open_channel(controller)
    ended = trio.Event()
    token = trio.lowlevel.current_trio_token()
    try:
        await trio.to_thread.run_sync(rpc.wait_ready, channel, controller, connect_timeout)
        worker.outbox.put({"t": "register", "address": f"grpc://127.0.0.1:{port}", "kind": "cpu",
                           "devices": devices, "island": island, "pid": os.getpid(), "host": socket.gethostname(),
                           "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")})
        attach = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Attach", "stream_stream")
        responses = attach(worker.outbox.batches())

        def read() -> None:
            try:
                for payload in responses:
                    worker.on_batch(payload)
            except Exception as e:  # RpcError, or ValueError once shutdown closed the channel
                log.info("controller stream ended: %s", e)
            finally:
                try:
                    token.run_sync_soon(ended.set)
                except trio.RunFinishedError:
                    pass

        threading.Thread(target=read, name="pathways-attach", daemon=True).start()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async def stop_on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                nursery.start_soon(stop_on_signal)
                await ended.wait()
                nursery.cancel_scope.cancel()
    except ConnectError as e:
        log.error("%s", e)
    finally:
        worker.close()
        server.stop(grace=0.5)
        channel.close()
