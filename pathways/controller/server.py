"""The controller process: the gRPC shell around ControllerCore.

One asyncio loop runs everything: grpc.aio serves the streams as coroutines (no thread
per stream, so thousands of sessions and workers fit), and the core runs on the same
loop, called directly by the stream that received a payload, so it stays single-threaded
without a hop between threads. Each stream has a LoopOutbox and a writer task that sends
whatever the core put there since its last write as one batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
from typing import Any, Callable

import grpc

from pathways.controller.core import ControllerCore, WorkerConn
from pathways.controller.scheduler import DEFAULT_WINDOW
from pathways.defaults import ADDRESS_LINE
from pathways.errors import DeadlineExceededError, WireError
from pathways.protocol import messages as m
from pathways.protocol.errors import kind_of
from pathways.protocol.handles import MAX_SESSION
from pathways.wire import rpc

log = logging.getLogger("pathways.controller")

# After a peer stops sending, how long its stream may take to deliver what is still queued
# for it (a peer that stopped reading too must not hold the stream open forever).
_DRAIN_SECONDS = 5.0
_STOP_GRACE_SECONDS = 0.5


def _guarded(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # the core must outlive any one bad message
        log.exception("controller dropped a message in %s", getattr(fn, "__name__", fn))


class ControllerServer:
    def __init__(self, policy: str, window: int) -> None:
        self.core = ControllerCore(policy, window)
        self._session_ids = itertools.count(1)
        self._streams: set[asyncio.Task] = set()
        self._stopping = False  # the process is stopping: its streams end, but nothing was lost

    async def _stream(self, context: grpc.aio.ServicerContext, outbox: rpc.LoopOutbox,
                      on_payload: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        """Feed a stream's payloads to ``on_payload`` while a writer task sends its outbox.
        ``on_end`` is called exactly once, whether the peer finished sending or the call
        was cancelled (the peer vanished), unless the controller is stopping."""
        task = asyncio.current_task()
        self._streams.add(task)
        writer = asyncio.create_task(outbox.write_to(context))
        try:
            while True:
                payload = await context.read()
                if payload is grpc.aio.EOF:
                    break
                _guarded(on_payload, payload)
        except asyncio.CancelledError:
            writer.cancel()
            if not self._stopping:
                raise
            return  # stop() ended it: the call ends with OK, so that the peer sees a clean end
        except BaseException:
            writer.cancel()
            raise
        finally:
            self._streams.discard(task)
            if not self._stopping:
                _guarded(on_end)
            outbox.close()
        try:
            await asyncio.wait_for(writer, _DRAIN_SECONDS)
        except asyncio.TimeoutError:
            pass  # the peer stopped reading too: what was left for it is dropped

    async def stop(self, server: grpc.aio.Server) -> None:
        """End every stream, then the server."""
        self._stopping = True
        for task in list(self._streams):
            task.cancel()
        await server.stop(grace=_STOP_GRACE_SECONDS)

    async def session(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        sid = next(self._session_ids)
        if sid > MAX_SESSION:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "session ids exhausted; restart the controller")
        outbox = rpc.LoopOutbox()
        self.core.session_opened(sid, outbox)
        await self._stream(context, outbox, lambda p: self.core.on_session_batch(sid, p),
                           lambda: self.core.session_closed(sid))

    async def attach(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        conn = WorkerConn(rpc.LoopOutbox())
        await self._stream(context, conn.outbox, lambda p: self.core.on_worker_batch(conn, p),
                           lambda: self.core.worker_lost(conn))

    async def status(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return m.pack(self.core.status())

    async def measure(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Have every worker measure itself again (one after the other), wait up to the
        request's timeout for all of them, and reply ``{"status": ...}`` with the new figures, or ``{"error": ...,
        "kind": ...}``."""
        try:
            timeout = m.MEASURE.decode_one(request).timeout
        except WireError as e:
            return m.pack({"error": f"measure: {e}", "kind": kind_of(e)})
        finished = asyncio.get_running_loop().create_future()
        mid = self.core.measure(lambda: finished.done() or finished.set_result(None))
        try:
            await asyncio.wait_for(finished, timeout)
        except asyncio.TimeoutError:
            silent = self.core.abandon_measurement(mid)
            if silent:
                later = f"; worker(s) {silent[1:]}, which measure after it, were not asked" if silent[1:] else ""
                return m.pack({"error": f"worker {silent[0]} did not report its measurements within "
                                            f"{timeout:g} s{later}. The figures of the others are in "
                                            "`python -m pathways status`", "kind": DeadlineExceededError.__name__})
        except asyncio.CancelledError:  # the caller gave up: stop waiting for the workers too
            self.core.abandon_measurement(mid)
            raise
        return m.pack({"status": self.core.status()})

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Session": rpc.stream_stream(self.session), "Attach": rpc.stream_stream(self.attach),
                "Status": rpc.unary_unary(self.status), "Measure": rpc.unary_unary(self.measure)}


def main(policy: str = "fair", window: int = DEFAULT_WINDOW) -> None:
    asyncio.run(_serve(policy, window))


async def _serve(policy: str, window: int) -> None:
    controller = ControllerServer(policy, window)
    server, port = await rpc.start_aio_server(rpc.CONTROLLER_SERVICE, controller.handlers())
    print(f"{ADDRESS_LINE} grpc://127.0.0.1:{port}", flush=True)
    stopping: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_signal(signum: int) -> None:
        if not stopping.done():
            stopping.set_result(signum)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        log.info("controller stopping on signal %d", await stopping)
    finally:
        await controller.stop(server)
