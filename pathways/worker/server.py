"""The worker process: the gRPC shell around the store, executables and executor.

It attaches to the controller with one long-lived stream (registration up, op batches
and done reports) and serves the data plane (puts, fetches, peer pushes) on its own port.
In the background it measures its FLOP/s and its links to the other workers (measure.py):
once when it joins, for each peer as the peer joins, and again when the controller asks.
The hosts of an island of several hosts form one ``jax.distributed`` group (CPU
collectives over gloo). When the controller's stream ends, or the controller says the
island is lost, the worker exits: a worker without a controller or island has no work.

Arrays cross the data plane as pieces: each sender sends the blocks the receiver's devices
hold (the controller's transfer plan), and a receiver assembles them once every sending
host has delivered. Between workers the bytes go over plain TCP (wire/tcp.py); clients put
and fetch over gRPC.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
import numpy as np
import trio

from pathways.errors import ConnectError, WireError
from pathways.ir import Layout
from pathways.wire import codec, rpc, tcp
from pathways.worker.measure import Measurer, host_memory_bytes
from pathways.worker.store import ObjectStore, Poison, failure

log = logging.getLogger("pathways.worker")

_CONTROLLER_MESSAGES = {
    "welcome": {"worker": int},
    "peers": {"peers": dict},
    "compile": {"fn": int, "name": str, "blob": bytes, "ins": list, "outs": list},
    "define": {"key": int, "nvalues": int, "ncopies": int, "ops": list},
    "run": {"id": int, "key": int, "base": int, "tbase": int, "args": dict},
    "delete": {"handles": list},
    "drop_session": {"session": int},
    "poison": {"handles": list, "kind": str, "message": str},
    "shutdown": {"reason": str},
    "go": {"run": int, "nodes": list},
    "measure": {"id": int},
}
_PUT_FIELDS = {"put": {"handle": int, "layout": list, "of": int}}
_ERROR_KINDS = ("RemoteError", "WorkerLostError")
_FETCH_FIELDS = {"fetch": {"handle": int, "wait": (int, float), "data": bool}}
INLINE_SEND_BYTES = 1 << 20  # computed arrays up to this size are sent by the executor itself


class Worker:
    def __init__(self, wait_timeout: float, sync_collectives: bool, unsafe_local_order: bool,
                 on_shutdown: Any) -> None:
        import jax  # configured by main() before the first import of a backend

        from pathways.worker.executables import Executables
        from pathways.worker.executor import Executor

        self.jax = jax
        self.store = ObjectStore()
        self.executables = Executables()
        self.peers: dict[int, str] = {}
        self._put_shardings: dict[str, Any] = {}
        self.links = tcp.Links(wait_timeout)
        self.listener = tcp.Listener(self._receive_frame, wait_timeout)
        self._send_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pathways-send")
        self._incoming: dict[int, tuple[Any, int]] = {}  # handle -> (assembly, senders seen)
        self._incoming_lock = threading.Lock()
        self._released: set[tuple[int, int]] = set()  # (run, node) released by the controller
        self._release = threading.Condition()
        self._on_shutdown = on_shutdown
        self.wait_timeout = wait_timeout
        self.outbox = rpc.Outbox()
        self.measurer = Measurer(jax, self.outbox.put)
        self._probed: set[int] = set()  # peers whose link has been measured (or is being)
        self.executor = Executor(self.store, self.executables, self, wait_timeout, sync_collectives,
                                 unsafe_local_order)

    # ---- what the executor asks of the host (executor.Controls) -------------------

    def done(self, reports: list) -> None:
        self.outbox.put({"t": "done", "runs": reports})

    def step(self, run: int, node: int) -> None:
        self.outbox.put({"t": "step", "run": run, "node": node})

    def released(self, run: int, node: int, timeout: float) -> bool:
        """Wait until the controller releases ``node`` of ``run`` (sequential dispatch)."""
        key = (run, node)
        with self._release:
            if not self._release.wait_for(lambda: key in self._released, timeout):
                return False
            self._released.discard(key)
        return True

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
        kind = msg["t"]
        if kind == "compile":
            self.executables.register(msg["fn"], msg["name"], msg["blob"],
                                      [Layout.from_wire(x) for x in msg["ins"]],
                                      [Layout.from_wire(x) for x in msg["outs"]])
        elif kind == "define":
            self.executor.define(msg)
        elif kind == "peers":
            if not all(isinstance(k, int) and isinstance(v, str) for k, v in msg["peers"].items()):
                raise WireError("peers must map worker ids to data addresses")
            self.peers.update(msg["peers"])
            self._measure_new_peers(flops=False)
        elif kind == "welcome":
            self.executor.worker_id = msg["worker"]
            self._measure_new_peers(flops=True)
        elif kind == "measure":
            self.measurer.request(msg["id"], True, self._other_peers())
        elif kind == "poison":
            error = msg["kind"] if msg["kind"] in _ERROR_KINDS else "RemoteError"
            for h in codec.int_list(msg["handles"], "poison handles"):
                self.store.put(h, Poison(msg["message"], error), replace=False)
        elif kind == "drop_session":
            # At once, not in executor order: the executor may be waiting for an array the
            # departed client was still sending.
            self.store.drop_session(msg["session"])
        elif kind == "go":
            # At once, not in executor order: the executor is waiting for it.
            with self._release:
                self._released.update((msg["run"], n) for n in codec.int_list(msg["nodes"], "go nodes"))
                self._release.notify_all()
        elif kind == "shutdown":
            log.warning("the controller shut this worker down: %s", msg["reason"])
            self._on_shutdown()
        else:
            if kind == "run" and not all(isinstance(k, int) and isinstance(v, int) for k, v in msg["args"].items()):
                raise WireError("run args must map register numbers to handles")
            if kind == "delete":
                codec.int_list(msg["handles"], "delete handles")
            self.executor.submit(msg)

    def _measure_new_peers(self, flops: bool) -> None:
        """Measure the links to peers not measured yet (and the FLOP/s if ``flops``), once
        this worker knows its own id."""
        if self.executor.worker_id < 0:
            return
        new = {p: a for p, a in self._other_peers().items() if p not in self._probed}
        self._probed.update(new)
        if flops or new:
            self.measurer.request(0, flops, new)

    def _other_peers(self) -> dict[int, str]:
        """Every other worker's data address."""
        return {p: a for p, a in self.peers.items() if p != self.executor.worker_id}

    # ---- data plane -----------------------------------------------------------------

    def send(self, handle: int, value: Any, layout: list, routes: list) -> None:
        # A small array already computed (tiny computations finish during their dispatch on
        # CPU) goes at once, saving a thread handoff on a pipeline's critical path; anything
        # else is sent from the pool so the executor can go on dispatching.
        if type(value) is not Poison and value.nbytes <= INLINE_SEND_BYTES and value.is_ready():
            self._push(handle, value, layout, routes)
        else:
            self._send_pool.submit(self._push, handle, value, layout, routes)

    def _push(self, handle: int, value: Any, layout: list, routes: list) -> None:
        """Send each receiver of ``routes`` its regions of ``value``; to this host itself
        the regions are handed over in memory."""
        poison = value if type(value) is Poison else None
        held: list = []
        if poison is None:
            try:
                dtype, shape, held = self.local_pieces(value)
            except Exception as e:
                poison = failure(f"computing array {handle:#x} on worker {self.executor.worker_id}", e)
        for receiver, senders, regions in routes:
            header: dict = {"t": "put", "handle": handle, "layout": layout, "of": senders}
            pieces: list = []
            if poison is not None:
                header.update(poison=poison.message, kind=poison.kind)
            else:
                try:
                    pieces = [(region, codec.cut(held, region)) for region in regions]
                except WireError as e:
                    header.update(poison=f"array {handle:#x} on worker {self.executor.worker_id}: {e}")
                else:
                    header.update(codec.pieces_header(dtype, shape, pieces))
            if receiver == self.executor.worker_id:
                error = self.receive(header, pieces=pieces)
                if error:
                    log.error("storing array %#x locally failed: %s", handle, error)
                continue
            try:
                self.links.send(self.peers[receiver], header, pieces)
            except (OSError, KeyError) as e:
                log.error("sending array %#x to worker %s failed: %s", handle, receiver, e)

    def _receive_frame(self, header: dict, pieces: list) -> str | None:
        return self.receive(header, pieces=pieces)

    def local_pieces(self, value: Any) -> tuple[Any, tuple[int, ...], list]:
        """The distinct shards of ``value`` this host holds, as (index, numpy array)."""
        shape = tuple(value.shape)
        if value.is_fully_addressable and len(value.sharding.device_set) == 1:
            return value.dtype, shape, [(codec.full_index(shape), np.asarray(value))]
        pieces, seen = [], set()
        for shard in value.addressable_shards:
            index = _region(shard.index, shape)
            if index not in seen:
                seen.add(index)
                pieces.append((index, np.asarray(shard.data)))
        return value.dtype, shape, pieces

    def receive(self, header: dict, chunks: Iterator[bytes] | None = None, pieces: list | None = None) -> str | None:
        """Take one sender's part of an array arriving as handle: its pieces follow in
        ``chunks`` (a gRPC put) or were read already (``pieces``: from a peer's data
        connection, or this host's own); store the array once every sender has delivered.
        Returns an error message, or None."""
        try:
            header = codec.validate(header, _PUT_FIELDS)
            handle, nsenders = header["handle"], header["of"]
            sharding = self._sharding(header["layout"])
            if not 1 <= nsenders <= 4096:
                raise WireError(f"a put needs 1 to 4096 senders, got {nsenders}")
            if isinstance(header.get("poison"), str):
                kind = header.get("kind") if header.get("kind") in _ERROR_KINDS else "RemoteError"
                with self._incoming_lock:
                    self._incoming.pop(handle, None)
                self.store.put(handle, Poison(header["poison"], kind), replace=False)
                return None
            if chunks is not None:
                dtype, shape, pieces = codec.read_pieces(header, chunks)
                codec.expect_end(chunks)
            else:
                dtype, shape, _ = codec.check_array_header(header.get("array"))
                pieces = pieces or []
            with self._incoming_lock:
                if self.store.get(handle) is not None:
                    return None if nsenders > 1 else f"array {handle:#x} already exists on this worker"
                assembly, seen = self._incoming.pop(handle, (None, 0))
                if assembly is None:
                    regions = _regions(sharding, shape)
                    if not regions:
                        raise WireError(f"the layout of array {handle:#x} puts none of it on this worker's devices")
                    assembly = codec.Assembly(dtype, shape, regions)
                elif (assembly.dtype, assembly.shape) != (dtype, shape):
                    raise WireError(f"pieces of array {handle:#x} disagree on its dtype and shape")
                assembly.add(pieces)
                if seen + 1 < nsenders:
                    self._incoming[handle] = (assembly, seen + 1)
                    return None
            if not assembly.complete:
                message = (f"the senders of array {handle:#x} delivered pieces that do not cover "
                           f"what this worker holds of it")
                self.store.put(handle, Poison(message), replace=False)
                return message
            self.store.put(handle, self.jax.make_array_from_callback(
                shape, sharding, lambda index: assembly.region(_region(index, shape))))
            return None
        except WireError as e:
            return str(e)

    def _sharding(self, raw_layout: Any) -> Any:
        """The sharding a put's wire layout names, cached: each run of a program sends the
        same layouts, and parsing one costs more than the rest of a small put."""
        key = repr(raw_layout)
        sharding = self._put_shardings.get(key)
        if sharding is None:
            sharding = self.executables.sharding(Layout.from_wire(raw_layout))
            if len(self._put_shardings) < 4096:
                self._put_shardings[key] = sharding
        return sharding

    def put(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            chunks = iter(request_iterator)
            header = codec.unpack(next(chunks, b""))
        except WireError as e:
            return codec.pack({"error": str(e)})
        error = self.receive(header, chunks)
        return codec.pack({"error": error} if error else {"ok": True})

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
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
            yield codec.pack({"state": "error", "kind": value.kind, "message": value.message})
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
            dtype, shape, pieces = self.local_pieces(value)
        except Exception as e:
            poison = failure(f"the computation of array {req['handle']:#x} on worker {self.executor.worker_id}", e)
            yield codec.pack({"state": "error", "kind": poison.kind, "message": poison.message})
            return
        yield codec.pack({"state": "ready", **codec.pieces_header(dtype, shape, pieces)})
        yield from codec.pieces_chunks(pieces)

    def stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return codec.pack({"worker": self.executor.worker_id, "handles": len(self.store),
                           "sessions": self.store.session_counts(),
                           "executables": len(self.executables), "compiled": self.executables.compiled(),
                           "programs": self.executor.programs})

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Put": rpc.stream_unary(self.put), "Fetch": rpc.unary_stream(self.fetch),
                "Stats": rpc.unary_unary(self.stats)}

    def close(self) -> None:
        self.measurer.stop()
        self.outbox.close()
        self.listener.close()
        self.links.close()
        self.executor.stop()
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        self.executables.close()


def _region(index: tuple, shape: tuple[int, ...]) -> tuple:
    """A jax shard index (a tuple of slices) as ((start, stop), ...)."""
    return tuple((s.start or 0, d if s.stop is None else s.stop) for s, d in zip(index, shape))


@functools.lru_cache(maxsize=4096)
def _regions(sharding: Any, shape: tuple[int, ...]) -> list:
    """The distinct blocks of an array of ``shape`` that this host's devices hold."""
    out: list = []
    for index in sharding.addressable_devices_indices_map(shape).values():
        region = _region(index, shape)
        if region not in out:
            out.append(region)
    return out


@dataclass(frozen=True)
class IslandMembership:
    """This host's place in a multi-host island: the jax.distributed group it joins."""

    coordinator: str  # host:port of the group's coordination service (run by rank 0)
    hosts: int
    rank: int


def main(controller: str, devices: int, island: int, wait_timeout: float, connect_timeout: float,
         membership: IslandMembership | None = None, unsafe_local_order: bool = False) -> None:
    """Configure JAX for ``devices`` CPU devices (joining the island's jax.distributed group
    when it has several hosts), then serve until the controller goes away."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    if membership is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # A lost host is the controller's to handle (it fails the island's work and stops
        # the other hosts); without this, jax aborts every other process of the group.
        jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(membership.coordinator, membership.hosts, membership.rank,
                                   initialization_timeout=int(connect_timeout))
    rank = membership.rank if membership else 0
    # Under jax.distributed, a process with several devices hangs after a few dozen
    # multi-device computations dispatched back to back (even ones local to the process);
    # waiting for each before the next is safe (measured: DESIGN.md, BENCHMARKS.md).
    sync = membership is not None and devices > 1
    trio.run(_serve, controller, devices, island, rank, wait_timeout, connect_timeout, sync, unsafe_local_order)
    if membership is not None:
        # jax.distributed's exit handler waits at a barrier for every host of the island,
        # which never comes when one of them is lost.
        logging.shutdown()
        os._exit(0)


async def _serve(controller: str, devices: int, island: int, rank: int, wait_timeout: float,
                 connect_timeout: float, sync_collectives: bool, unsafe_local_order: bool) -> None:
    ended = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def end() -> None:
        try:
            token.run_sync_soon(ended.set)
        except trio.RunFinishedError:
            pass

    worker = Worker(wait_timeout, sync_collectives, unsafe_local_order, end)
    server, port = rpc.make_server(rpc.WORKER_SERVICE, worker.handlers())
    channel = rpc.open_channel(controller)
    try:
        await trio.to_thread.run_sync(rpc.wait_ready, channel, controller, connect_timeout)
        worker.outbox.put({"t": "register", "address": f"grpc://127.0.0.1:{port}",
                           "data_address": worker.listener.address, "kind": "cpu",
                           "devices": devices, "island": island, "rank": rank, "pid": os.getpid(),
                           "host": socket.gethostname(),
                           "memory_bytes": host_memory_bytes()})
        attach = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Attach", "stream_stream")
        responses = attach(worker.outbox.batches())

        def read() -> None:
            try:
                for payload in responses:
                    worker.on_batch(payload)
            except Exception as e:  # RpcError, or ValueError once shutdown closed the channel
                log.info("controller stream ended: %s", e)
            finally:
                end()

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
