"""The controller process: the gRPC shell around ControllerCore.

gRPC's threads do not decode; they forward raw payloads: each inbound payload is
handed to the trio thread with ``run_sync_soon`` (about 8 us, measured), where the core
runs single-threaded. Outbound messages leave through per-stream outboxes, batched.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import signal
import threading
from typing import Any, Callable, Iterator

import grpc
import trio

from pathways.controller.core import ControllerCore, WorkerConn
from pathways.controller.scheduler import DEFAULT_WINDOW
from pathways.defaults import ADDRESS_LINE
from pathways.errors import WireError
from pathways.protocol import messages as m
from pathways.protocol.handles import MAX_SESSION
from pathways.wire import rpc

log = logging.getLogger("pathways.controller")



class ControllerServer:
    def __init__(self, token: trio.lowlevel.TrioToken, policy: str, window: int) -> None:
        self.core = ControllerCore(policy, window)
        self._token = token
        self._session_ids = itertools.count(1)

    def _soon(self, fn: Callable, *args: Any) -> None:
        try:
            self._token.run_sync_soon(self._guarded, fn, *args)
        except trio.RunFinishedError:  # shutting down: nobody is left to tell
            pass

    @staticmethod
    def _guarded(fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # the core must outlive any one bad message
            log.exception("controller dropped a message in %s", getattr(fn, "__name__", fn))

    def _pump(self, request_iterator: Iterator[bytes], on_payload: Callable, on_end: Callable) -> None:
        def run() -> None:
            try:
                for payload in request_iterator:
                    self._soon(on_payload, payload)
            except grpc.RpcError:
                pass
            finally:
                self._soon(on_end)

        threading.Thread(target=run, name="pathways-pump", daemon=True).start()

    def session(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        sid = next(self._session_ids)
        if sid > MAX_SESSION:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "session ids exhausted; restart the controller")
        outbox = rpc.Outbox()
        self._soon(self.core.session_opened, sid, outbox)
        self._pump(request_iterator, lambda p: self.core.on_session_batch(sid, p),
                   lambda: (self.core.session_closed(sid), outbox.close()))
        return outbox.batches(context.is_active)

    def attach(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        conn = WorkerConn(rpc.Outbox())
        self._pump(request_iterator, lambda p: self.core.on_worker_batch(conn, p),
                   lambda: (self.core.worker_lost(conn), conn.outbox.close()))
        return conn.outbox.batches(context.is_active)

    def status(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return m.pack(trio.from_thread.run_sync(self.core.status, trio_token=self._token))

    def measure(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Have every worker measure itself again (one after the other), wait up to the
        request's timeout for all of them, and reply ``{"status": ...}`` with the new figures, or ``{"error": ...,
        "kind": ...}``."""
        try:
            timeout = m.MEASURE.decode_one(request).timeout
        except WireError as e:
            return m.pack({"error": f"measure: {e}", "kind": "WireError"})
        finished: concurrent.futures.Future = concurrent.futures.Future()
        mid = trio.from_thread.run_sync(self.core.measure, lambda: finished.set_result(None),
                                        trio_token=self._token)
        try:
            finished.result(timeout)
        except concurrent.futures.TimeoutError:
            silent = trio.from_thread.run_sync(self.core.abandon_measurement, mid, trio_token=self._token)
            if silent:
                later = f"; worker(s) {silent[1:]}, which measure after it, were not asked" if silent[1:] else ""
                return m.pack({"error": f"worker {silent[0]} did not report its measurements within "
                                            f"{timeout:g} s{later}. The figures of the others are in "
                                            "`python -m pathways status`", "kind": "DeadlineExceededError"})
        return m.pack({"status": trio.from_thread.run_sync(self.core.status, trio_token=self._token)})

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Session": rpc.stream_stream(self.session), "Attach": rpc.stream_stream(self.attach),
                "Status": rpc.unary_unary(self.status), "Measure": rpc.unary_unary(self.measure)}


def main(policy: str = "fair", window: int = DEFAULT_WINDOW) -> None:
    trio.run(_serve, policy, window)


async def _serve(policy: str, window: int) -> None:
    controller = ControllerServer(trio.lowlevel.current_trio_token(), policy, window)
    server, port = rpc.make_server(rpc.CONTROLLER_SERVICE, controller.handlers(), max_workers=64)
    print(f"{ADDRESS_LINE} grpc://127.0.0.1:{port}", flush=True)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("controller stopping on signal %d", signum)
                break
    finally:
        server.stop(grace=0.5)
