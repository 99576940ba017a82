"""A ControllerServer served by an event loop on a thread of the test process: its gRPC
methods at ``address`` (grpc://...) and its worker port at ``attach`` (tcp://...), with the
workers it lost counted in ``lost``."""

import asyncio
import threading

from pathways.controller import server as controller_server
from pathways.defaults import DEFAULT_WINDOW, HEARTBEAT_TIMEOUT
from pathways.wire import rpc
from pathways.wire.security import Security


class LoopThread:
    """An asyncio event loop running on a thread of its own, as the controller serves on."""

    def __init__(self, name: str = "loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        self.loop.close()

    def __enter__(self) -> "LoopThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class InProcessController(LoopThread):
    def __init__(self, security: Security | None = None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> None:
        super().__init__("controller")
        self.controller = controller_server.ControllerServer("fair", DEFAULT_WINDOW, security,
                                                             heartbeat_timeout=heartbeat_timeout)
        self.lost: list = []
        core_lost = self.controller.core.worker_lost

        def worker_lost(conn, *rest):  # counts the calls; the core still handles each
            self.lost.append(conn.worker)
            core_lost(conn, *rest)

        self.controller.core.worker_lost = worker_lost
        self.attach = self.run(self.controller.listen(rpc.LOOPBACK))
        self.grpc, port = self.run(rpc.start_aio_server(rpc.CONTROLLER_SERVICE, self.controller.handlers(),
                                                        security=security))
        self.address = f"grpc://127.0.0.1:{port}"

    def workers(self) -> list[int]:
        async def ids():
            return sorted(self.controller.core.workers)
        return self.run(ids())

    def close(self) -> None:
        try:
            self.run(self.controller.stop(self.grpc), 20.0)
        finally:
            self.stop()
