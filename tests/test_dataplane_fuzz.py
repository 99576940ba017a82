"""A seeded fuzz of the data plane: valid put frames and broken ones (mutated, truncated,
mistyped, oversized, deeply nested, garbage lengths, bad probes) sent to a real listener
and to a real worker. Every frame is delivered intact or its connection closed; no
listener thread dies; memory stays put; afterwards ordinary transfers still work."""

import random
import socket
import struct
import threading
import time

import numpy as np

import pathways as pw
from pathways.cluster import status
from pathways.wire import codec, tcp
from tests.conftest import check_a_transfer_between_the_hosts, worker_pids
from tests.test_dataplane_bounds import Collector, closed_by_peer, connect, frame, rss_bytes, thread_deaths

_SEED = 20261122
_FRAMES = 4_000
_WORKER_FRAMES = 500
_SECONDS = 60  # the generator stops early rather than run past this
_DTYPES = ["bool", "int8", "uint16", "int32", "float32", "float64", "complex64", "bfloat16"]
_JUNK = [None, True, -1, 0.5, "x", b"\x00", [], {}, [[[]]], {"a": [1]}, 1 << 63, (1 << 64) - 1, -(1 << 63)]


class Fuzzer:
    """Deterministic frames from ``rng``: ``valid()`` gives (header, payload, id, pieces),
    ``broken()`` the bytes of a frame that is malformed in one of eight ways."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def valid(self):
        rng = self.rng
        dtype = codec.dtype_of_name(rng.choice(_DTYPES))
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
        full = np.frombuffer(rng.randbytes(int(np.prod(shape)) * dtype.itemsize), np.uint8).view(dtype).reshape(shape)
        if shape and shape[0] > 1 and rng.random() < 0.5:  # two pieces along the first axis
            cut = rng.randint(1, shape[0] - 1)
            rest = tuple((0, d) for d in shape[1:])
            pieces = [(((0, cut),) + rest, full[:cut]), (((cut, shape[0]),) + rest, full[cut:])]
        else:
            pieces = [(codec.full_region(shape), full)]
        ident = rng.getrandbits(62)
        header = {"t": "put", "id": ident, **codec.pieces_header(dtype, shape, pieces)}
        return header, b"".join(a.tobytes() for _, a in pieces), ident, pieces

    def broken(self):
        rng = self.rng
        header, payload, _, _ = self.valid()
        kind = rng.randrange(8)
        if kind == 0:  # bytes flipped anywhere
            data = bytearray(frame(header, payload))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            return bytes(data)
        if kind == 1:  # cut short
            data = frame(header, payload)
            return data[:rng.randrange(len(data))]
        if kind == 2:  # a field of the wrong type, anywhere in the array description
            target = rng.choice([header["array"]] + [p for p in header["pieces"]] + [p["array"] for p in header["pieces"]]
                                + [header])
            target[rng.choice(sorted(target))] = rng.choice(_JUNK)
            return frame(header, payload)
        if kind == 3:  # oversized: a consistent header announcing far more than is sent
            n = rng.choice([1 << 24, 1 << 30, 1 << 34, 1 << 40, 1 << 62, (1 << 64) - 1])
            array = {"dtype": "uint8", "shape": [n], "nbytes": n}
            pieces = [{"index": [[0, n]], "array": array}] * rng.choice([1, 2, 5000])
            return frame({"t": "put", "array": array, "pieces": pieces}, rng.randbytes(rng.randint(0, 64)))
        if kind == 4:  # deeply nested
            depth = rng.choice([10, 100, 1000, 10_000, 100_000])
            inner = b"\x91" * depth + b"\xc0"
            body = codec.pack({"t": "put", "array": header["array"], "pieces": []})
            body = b"\x84" + body[1:]  # one more entry: the nested one + codec.pack(rng.choice(["pieces", "layout", "deep"])) + inner
            return struct.pack("!I", len(body)) + body + payload
        if kind == 5:  # a garbage length and garbage after it
            return struct.pack("!I", rng.getrandbits(32)) + rng.randbytes(rng.randint(0, 256))
        if kind == 6:  # a probe of a bad size
            n = rng.choice([-1, tcp.MAX_PROBE_BYTES + 1, 1 << 40, "8", [8], {"n": 8}, None, 2.5])
            return frame({"t": "probe", "bytes": n}, rng.randbytes(rng.randint(0, 32)))
        # a length that disagrees with the header that follows it
        body = codec.pack(header)
        return struct.pack("!I", max(0, len(body) + rng.choice([-3, -1, 1, 7]))) + body + payload


def exchange(address, data, timeout=10.0):
    """Send ``data`` on a fresh connection and wait until the peer closes it."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return  # closed on us while sending: refused
        assert closed_by_peer(sock, timeout), "every connection must end closed by the listener"


def data_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pathways-data")]


def test_fuzzed_frames_are_delivered_intact_or_closed_and_nothing_leaks(monkeypatch, cluster, session):
    deaths = thread_deaths(monkeypatch)
    rng = random.Random(_SEED)
    fuzz = Fuzzer(rng)
    collector = Collector()
    threads_before = data_threads()
    listener = tcp.Listener(collector, timeout=2.0, budget_bytes=256 << 20, connection_bytes=64 << 20)
    worker_data = status(cluster.address)["workers"][0]["data_address"]
    workers = worker_pids(cluster.address)
    # the baseline is of workers that have served (JAX loaded, backend started), whatever ran before
    check_a_transfer_between_the_hosts()
    workers_before = {pid: rss_bytes(pid) for pid in workers}
    expected: dict[int, list] = {}
    frames = broken = to_worker = 0
    start, before, peak = time.monotonic(), rss_bytes(), 0
    try:
        while frames < _FRAMES and time.monotonic() - start < _SECONDS:
            data, valid = b"", []
            for _ in range(rng.randint(0, 3)):  # valid frames first on a connection
                header, payload, ident, pieces = fuzz.valid()
                data += frame(header, payload)
                valid.append((ident, pieces))
            if rng.random() < 0.1:  # a valid probe, answered on the same connection
                data += frame({"t": "probe", "bytes": 16}, bytes(16))
                valid.append(None)
            if rng.random() < 0.85 or not data:
                data += fuzz.broken()
                broken += 1
            frames += len(valid) + (len(valid) < len(data))
            if to_worker < _WORKER_FRAMES and rng.random() < 0.15:
                to_worker += len(valid) + 1
                exchange(worker_data, data)
            else:
                expected.update(v for v in valid if v)
                exchange(listener.address, data)
            if frames % 200 < 4:
                peak = max(peak, rss_bytes() - before)
        elapsed = time.monotonic() - start
        assert frames >= _FRAMES, f"only {frames} frames in {elapsed:.0f} s"
        assert any(t.name == "pathways-data-accept" for t in threading.enumerate())

        delivered = {}
        for header, pieces in collector.frames:
            ident = header.get("id")
            if isinstance(ident, int) and not isinstance(ident, bool) and ident in expected:
                delivered[ident] = pieces
        assert delivered.keys() == expected.keys(), "every valid frame must be delivered"
        for ident, pieces in expected.items():
            got = delivered[ident]
            assert [index for index, _ in got] == [index for index, _ in pieces]
            for (_, a), (_, b) in zip(got, pieces):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        assert listener.budget.used == 0

        good, count = np.arange(12, dtype=np.float32).reshape(3, 4), len(collector.frames)
        with connect(listener) as sock:
            sock.sendall(frame({"t": "put", "id": -1, **codec.pieces_header(good.dtype, good.shape,
                                                                            [(codec.full_region(good.shape), good)])},
                               good.tobytes()))
            collector.wait_for(count + 1)
        np.testing.assert_array_equal(collector.frames[-1][1][0][1], good)
    finally:
        listener.close()
    peak = max(peak, rss_bytes() - before)
    print(f"fuzz: {frames} frames ({broken} broken, {to_worker} to a worker, {len(expected)} valid delivered) "
          f"in {elapsed:.1f} s; RSS grew by at most {peak / 2**20:.1f} MiB")
    assert peak < 100 << 20, f"the listener's process grew by {peak >> 20} MiB"
    assert deaths == [], deaths
    deadline = time.monotonic() + 10
    while len(data_threads()) > len(threads_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(data_threads()) <= len(threads_before), "every data connection's thread should end"

    grown = {pid: rss_bytes(pid) - workers_before[pid] for pid in workers}
    assert max(grown.values()) < 100 << 20, grown
    assert len(status(cluster.address)["workers"]) == 2
    check_a_transfer_between_the_hosts()
