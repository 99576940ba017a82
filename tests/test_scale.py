"""Scale: one controller holds 1,000 idle client sessions and 256 attached workers at once,
and still answers status promptly and runs a new client's computations."""

import asyncio
import os
import threading
import time
from typing import Any, Coroutine

import numpy as np
import pytest

import pathways as pw
from pathways.cluster import free_port, status
from pathways.protocol import messages as m
from pathways.wire import codec, frames, rpc
from pathways.wire import security as sec
from pathways.wire.security import Security
from tests.conftest import wait_until
from tests.rawworker import attach_address

SESSIONS = 1000
FAKE_WORKERS = 256
CHANNELS = 16  # the streams are spread over several connections, as from several client processes
OPEN_SECONDS = 40.0


class Crowd:
    """Raw Session streams and worker connections held open from an asyncio loop on a thread
    of the test process: idle clients that said hello, and fake workers that registered."""

    def __init__(self, address: str, security: Security) -> None:
        self.address = address
        self.hello = sec.hello(security.for_attach())  # fake workers greet with the cluster's worker token
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="crowd", daemon=True)
        self.thread.start()
        self.calls: list[Any] = []
        self.channels: list[Any] = []
        self.writers: list[asyncio.StreamWriter] = []

    def run(self, coro: Coroutine, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"the controller did not answer the crowd within {timeout:.0f} s") from None

    async def _call(self, i: int, method: str, message: m.Message, replies: m.Table) -> list:
        if not self.channels:
            self.channels = [rpc.open_aio_channel(self.address) for _ in range(CHANNELS)]
        call = self.channels[i % CHANNELS].stream_stream(f"/{rpc.CONTROLLER_SERVICE}/{method}")()
        self.calls.append(call)
        await call.write(m.encode_batch([message]))
        return replies.decode_batch(await call.read())  # the first batch it was sent; the rest is left unread

    async def _attach(self, host: str, port: int, message: m.Message) -> list:
        reader, writer = await asyncio.open_connection(host, port)
        self.writers.append(writer)
        writer.write(self.hello)
        assert codec.unpack(await frames.read_frame(reader, 1 << 16, OPEN_SECONDS)) == {"t": "hello"}
        writer.write(frames.frame(m.encode_batch([message])))
        await writer.drain()
        # the first batch it was sent; the rest is left unread
        return m.WORKER_DOWN.decode_batch(await frames.read_frame(reader, m.MAX_MESSAGE_BYTES, OPEN_SECONDS))

    async def open(self, sessions: int, workers: int) -> tuple[list, list]:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens there: links to fake workers fail fast
        hello = m.Hello(m.PROTOCOL_VERSION, 1.0)
        welcomed = await asyncio.gather(*(self._call(i, "Session", hello, m.SESSION_DOWN) for i in range(sessions)))
        host, _, port = (await asyncio.to_thread(attach_address, self.address)).removeprefix("tcp://").rpartition(":")
        registered = await asyncio.gather(*(self._attach(host, int(port), m.Register(
            f"grpc://{dead}", f"tcp://{dead}", "cpu", 1, str(1000 + i), 1, None, "", os.getpid(), "fake", 1 << 30))
            for i in range(workers)))
        return welcomed, registered

    async def _close(self) -> None:
        for call in self.calls:
            call.cancel()
        for writer in self.writers:
            writer.close()
        for channel in self.channels:
            await channel.close()

    def close(self) -> None:
        try:
            self.run(self._close(), 20.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10.0)


def double_on_island_0() -> np.ndarray:
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
    return np.asarray(pw.pmap(lambda x: x * 2 + 1, devices=s.devices)(np.arange(2, dtype=np.float32)))


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_a_thousand_idle_sessions_and_256_workers_leave_status_and_new_clients_served():
    # The crowd's fake workers send no heartbeats: the timeout outlasts the test.
    with pw.local_cluster(hosts=2, heartbeat_timeout=600.0) as cluster:
        before = len(status(cluster.address)["sessions"])
        crowd = Crowd(cluster.address, cluster.security)
        try:
            start = time.monotonic()
            welcomed, registered = crowd.run(crowd.open(SESSIONS, FAKE_WORKERS), OPEN_SECONDS)
            opened = time.monotonic() - start
            assert all(type(batch[0]) is m.SessionWelcome for batch in welcomed)
            assert len({batch[0].session for batch in welcomed}) == SESSIONS
            assert all(type(batch[0]) is m.WorkerWelcome for batch in registered)

            start = time.monotonic()
            st = status(cluster.address, timeout=10.0)
            answered = time.monotonic() - start
            assert answered < 1.0, f"status took {answered:.2f} s with {SESSIONS} sessions open"
            assert len(st["sessions"]) == before + SESSIONS
            assert len(st["workers"]) == 2 + FAKE_WORKERS

            # The new client replaces the cluster's default session: the count stays `before`.
            client = pw.connect(cluster.address, timeout=20.0)
            crowd_ids = {batch[0].session for batch in welcomed}
            assert client.id not in crowd_ids
            np.testing.assert_array_equal(double_on_island_0(), [1.0, 3.0])
        finally:
            crowd.close()
        try:
            # Every fake session and worker is freed once its stream is gone.
            st = wait_until(lambda: (lambda st: st if len(st["workers"]) == 2 and len(st["sessions"]) == before
                                     else None)(status(cluster.address)),
                            timeout=30.0, what="the crowd's sessions and workers to be freed")
            assert client.id in {s["session"] for s in st["sessions"]}
            assert not crowd_ids & {s["session"] for s in st["sessions"]}
            np.testing.assert_array_equal(double_on_island_0(), [1.0, 3.0])
        finally:
            pw.disconnect()
        print(f"opened {SESSIONS} sessions and {FAKE_WORKERS} workers in {opened:.1f} s; status in {answered:.3f} s")
