"""The worker process: the gRPC and socket shell around the worker's core (core.py).

It attaches to the controller with one long-lived stream, a TCP connection of frames
(wire/frames.py) at the address the controller's AttachAddress method names (registration
and done reports up, op batches down; a reader and a sender thread), serves clients' puts
and fetches over gRPC, and hands the data plane's frames from peers (wire/tcp.py) to the
core. In the background the core measures
its FLOP/s and its links to the other workers (measure.py). The hosts of an island of
several hosts form one ``jax.distributed`` group (CPU collectives over gloo; accelerators
use their own). When the
controller's stream ends, or the controller says the island is lost, the worker exits: a
worker without a controller or island has no work.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Iterator

import grpc
import trio

from pathways.errors import ConnectError, WireError
from pathways.platforms import kind_of
from pathways.protocol.messages import FETCH, MAX_MESSAGE_BYTES, Register
from pathways.wire import codec, frames, rpc, tcp
from pathways.worker.core import WorkerCore
from pathways.worker.measure import host_memory_bytes

log = logging.getLogger("pathways.worker")


class WorkerService:
    """The worker's gRPC methods (Put, Fetch, Stats) over a core."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def put(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            chunks = iter(request_iterator)
            header = codec.unpack(next(chunks, b""))
        except WireError as e:
            return codec.pack({"error": str(e)})
        error = self.core.receive(header, chunks)
        return codec.pack({"error": error} if error else {"ok": True})

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req = FETCH.decode_one(request)
        except WireError as e:
            yield codec.pack({"state": "error", "kind": "WireError", "message": f"the worker refused a fetch: {e}"})
            return
        # A caller that hangs up (cancels, or runs past its deadline) wakes the waiter, which
        # then sees it is no longer wanted and gives its thread back.
        if not context.add_callback(self.core.store.wake):
            return  # the call already ended
        yield from self.core.fetch(req, context.is_active)

    def stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return codec.pack(self.core.stats())

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Put": rpc.stream_unary(self.put), "Fetch": rpc.unary_stream(self.fetch),
                "Stats": rpc.unary_unary(self.stats)}


@dataclass(frozen=True)
class IslandMembership:
    """This host's place in a multi-host island: the jax.distributed group it joins."""

    coordinator: str  # host:port of the group's coordination service (run by rank 0)
    hosts: int
    rank: int


def main(controller: str, devices: int, island: int, wait_timeout: float, connect_timeout: float,
         membership: IslandMembership | None = None, unsafe_local_order: bool = False,
         platform: str | None = None) -> None:
    """Configure JAX for ``platform`` (cpu, cuda, rocm, tpu; None: whichever JAX finds), with
    ``devices`` virtual devices when it is the CPU, joining the island's jax.distributed group
    when it has several hosts; then serve until the controller goes away."""
    import jax

    if not (math.isfinite(wait_timeout) and wait_timeout > 0 and math.isfinite(connect_timeout)
            and connect_timeout > 0):
        raise SystemExit(f"--wait-timeout and --connect-timeout must be finite numbers of seconds above 0, "
                         f"got {wait_timeout!r} and {connect_timeout!r}")

    if platform is not None:
        jax.config.update("jax_platforms", platform)
    # Only the CPU backend reads these; with an accelerator they shape nothing it uses.
    jax.config.update("jax_num_cpu_devices", devices)
    if membership is not None:
        if platform in (None, "cpu"):
            # Collectives between CPU devices of several hosts; accelerators bring their own (NCCL, ICI).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # A lost host is the controller's to handle (it fails the island's work and stops
        # the other hosts); without this, jax aborts every other process of the group.
        jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(membership.coordinator, membership.hosts, membership.rank,
                                   initialization_timeout=int(connect_timeout))
    kind, count = kind_of(jax.devices()[0].platform), jax.local_device_count()
    log.info("serving %d %s device(s) (JAX platform %s)", count, kind, jax.default_backend())
    rank = membership.rank if membership else 0
    # Under jax.distributed, a process with several CPU devices hangs after a few dozen
    # multi-device computations dispatched back to back (even ones local to the process);
    # waiting for each before the next is safe (measured: DESIGN.md, BENCHMARKS.md).
    sync = membership is not None and kind == "cpu" and count > 1
    trio.run(_serve, controller, kind, count, island, rank, wait_timeout, connect_timeout, sync, unsafe_local_order)
    if membership is not None:
        # jax.distributed's exit handler waits at a barrier for every host of the island,
        # which never comes when one of them is lost.
        logging.shutdown()
        os._exit(0)


def _attach(channel: grpc.Channel, controller: str, timeout: float) -> socket.socket:
    """Ask the controller at ``controller`` where workers attach, and connect there, within
    ``timeout`` seconds each."""
    ask = rpc.method(channel, rpc.CONTROLLER_SERVICE, "AttachAddress", "unary_unary")
    try:
        sock = tcp.connect(codec.unpack(ask(b"", timeout=timeout))["address"], timeout)
    except (grpc.RpcError, OSError, WireError, KeyError, TypeError, ValueError) as e:
        raise ConnectError(f"could not attach to the controller at {controller} ({type(e).__name__}: {e}); "
                           "check that it is running and that it is a pathways controller of this version "
                           "(`python -m pathways status` asks it)") from None
    sock.settimeout(None)  # between frames the controller may stay quiet as long as it likes
    return sock


async def _serve(controller: str, kind: str, devices: int, island: int, rank: int, wait_timeout: float,
                 connect_timeout: float, sync_collectives: bool, unsafe_local_order: bool) -> None:
    ended = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def end() -> None:
        try:
            token.run_sync_soon(ended.set)
        except trio.RunFinishedError:
            pass

    outbox = rpc.Outbox()
    core = WorkerCore(outbox.put, wait_timeout, sync_collectives, unsafe_local_order, end)
    listener = tcp.Listener(core.receive_frame, wait_timeout)
    server, port = rpc.make_server(rpc.WORKER_SERVICE, WorkerService(core).handlers())
    channel = rpc.open_channel(controller)
    sock: socket.socket | None = None
    try:
        await trio.to_thread.run_sync(rpc.wait_ready, channel, controller, connect_timeout)
        sock = await trio.to_thread.run_sync(_attach, channel, controller, connect_timeout)
        outbox.put(Register(f"grpc://{rpc.LOOPBACK}:{port}", listener.address, kind, devices, island, rank,
                            os.getpid(), socket.gethostname(), host_memory_bytes()))
        reader = frames.FrameReader(sock)

        def send() -> None:
            try:
                for payload in outbox.batches():
                    sock.sendall(frames.frame(payload))
            except OSError as e:
                log.info("controller stream ended while sending: %s", e)
                end()

        def read() -> None:
            try:
                # No deadline within a frame: the controller is this worker's one trusted
                # peer, and when its process ends the kernel closes the connection.
                while (payload := reader.read(MAX_MESSAGE_BYTES)) is not None:
                    core.on_batch(payload)
                log.info("controller stream ended")
            except Exception as e:  # OSError or WireError, or ValueError once shutdown closed the reader
                log.info("controller stream ended: %s", e)
            finally:
                end()

        threading.Thread(target=send, name="pathways-attach-send", daemon=True).start()
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
        outbox.close()
        if sock is not None:
            with contextlib.suppress(OSError):  # the controller may have closed it already
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread
            sock.close()
        listener.close()
        core.close()
        server.stop(grace=0.5)
        channel.close()
