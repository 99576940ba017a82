"""Trickled giant puts through the IFRT front end, at full size: a client-token holder
stores host buffers of gigabytes at a byte every 8 s and makes arrays of them. The front
end forwards each to the worker's data listener as its bytes come; the worker reserves the
array's bytes from its receive budget, charged to the put's session, which may hold half
of it. Each trickled put ends within a minute (the minimum pace, on both the front end and
the worker), naming the pace; meanwhile another session's puts go through and read back
exactly. Real processes, real gRPC, real sockets."""

import threading
import time

import numpy as np
import pytest

from ifrt_helpers import Proxy
from pathways.cluster import Island, LocalCluster
from pathways.ifrt import types as t
from pathways.wire.codec import host_memory_bytes

# Two such puts exceed one session's share of a worker's receive budget (half of half of
# the host's memory), and both fit in the session's 8 GiB of host buffers on a host of 24 GiB.
GIANT = host_memory_bytes() // 7 // 4 * 4
TRICKLE_SECONDS = 8.0


@pytest.fixture(scope="module")
def cluster():
    """One host of 2 devices whose controller serves IFRT, as `pathways up --ifrt-port` does."""
    c = LocalCluster([Island(1, 2)], ifrt_port=0).start()
    try:
        yield c
    finally:
        c.stop()


def trickled_put(proxy: Proxy, stop: threading.Event, outcome: dict) -> None:
    """Store a GIANT host buffer a byte every TRICKLE_SECONDS and make a float32 array of it
    on device 0; ``outcome``: the seconds until the array's readiness failed, its status,
    and how the store call ended."""
    buffer, array = next(proxy.handles), next(proxy.handles)

    def trickle():
        yield b"\0"
        while not stop.wait(TRICKLE_SECONDS):
            yield b"\0"

    def stored():
        outcome["store"] = proxy.store_stream(buffer, GIANT, trickle(), timeout=300)

    storing = threading.Thread(target=stored, daemon=True)
    start = time.monotonic()
    storing.start()

    def fill(r):
        body = r.make_array_from_host_buffer_request
        body.dtype.CopyFrom(t.dtype_proto(np.dtype(np.float32)))
        body.shape.CopyFrom(t.shape_proto((GIANT // 4,)))
        body.sharding.CopyFrom(t.sharding_proto(t.replicated((0,))))
        body.host_buffer_handle, body.array_handle = buffer, array
    outcome["status"] = proxy._ready(proxy.request(fill), array)
    outcome["seconds"] = time.monotonic() - start
    storing.join(60)


def test_trickled_giant_puts_end_within_a_minute_while_another_sessions_puts_go_through(cluster):
    address = cluster.ifrt_address.removeprefix("grpc://")
    attacker, honest = Proxy(address), Proxy(address)
    stop = threading.Event()
    outcomes = [{}, {}]
    threads = [threading.Thread(target=trickled_put, args=(attacker, stop, o), daemon=True) for o in outcomes]
    try:
        for thread in threads:
            thread.start()
        time.sleep(3.0)  # the trickled puts hold their reservations now
        rng = np.random.default_rng(0)
        for k, device in enumerate((0, 1, 0, 1)):
            value = rng.standard_normal(4 << 20, dtype=np.float32)  # 16 MiB
            array = honest.make(value.tobytes(), None, np.float32, value.shape, t.replicated((device,)))
            assert isinstance(array, int), f"an honest put failed: {array}"
            if k == 0:
                assert all("seconds" not in o for o in outcomes), "an honest put went through while the trickles held"
            np.testing.assert_array_equal(honest.read(array, np.float32, value.shape), value)
        for thread in threads:
            thread.join(90)
    finally:
        stop.set()
        attacker.close()
        honest.close()
    for outcome in outcomes:
        status = outcome["status"]
        assert not isinstance(status, int), "a trickled put of gigabytes cannot have succeeded"
        assert "came too slowly" in status.message and "minimum pace" in status.message, status.message
        assert outcome["seconds"] < 60, f"a trickled put ended after {outcome['seconds']:.0f} s"
        assert outcome["store"] != "finished", "the trickling store call was ended"


def test_a_store_that_stops_sending_with_nobody_reading_it_is_ended_within_a_pace_window(cluster):
    """A client opens host-buffer stores, sends a byte of each and then nothing, and no
    request reads them: each would hold one of the front end's server threads for as long as
    the client likes. The front end ends them within a pace window, and serves meanwhile."""
    address = cluster.ifrt_address.removeprefix("grpc://")
    client = Proxy(address)
    stop = threading.Event()
    ended = []

    def silent_store():
        def one_byte_then_nothing():
            yield b"\0"
            stop.wait(120)

        start = time.monotonic()
        code = client.store_stream(next(client.handles), 1 << 20, one_byte_then_nothing(), timeout=120)
        ended.append((code, time.monotonic() - start))

    threads = [threading.Thread(target=silent_store, daemon=True) for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        value = np.arange(1024, dtype=np.float32)
        array = client.make(value.tobytes(), None, np.float32, value.shape, t.replicated((0,)))
        np.testing.assert_array_equal(client.read(array, np.float32, value.shape), value)
        for thread in threads:
            thread.join(60)
    finally:
        stop.set()
        client.close()
    assert len(ended) == 8, "every silent store was ended"
    assert all(code != "finished" and seconds < 40 for code, seconds in ended), ended
