"""Bounds on what an incoming array may cost a receiver: memory committed only as bytes
arrive, per-connection and per-listener budgets on the data plane, WireError (never a
crash) for every malformed array header."""

import logging
import os
import resource
import socket
import struct
import threading
import time

import numpy as np
import pytest

from pathways.cluster import status
from pathways.errors import WireError
from pathways.protocol.handles import first_handle
from pathways.wire import codec, rpc, tcp
from tests.conftest import wait_until, worker_pids

_GIB = 1 << 30


def rss_bytes(pid="self"):
    """Resident memory now (not the peak): what a process holds at this moment."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes(pid="self"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def frame(header, payload=b""):
    body = codec.pack(header)
    return struct.pack("!I", len(body)) + body + payload


def put_header(array, **extra):
    return {"t": "put", **extra, **codec.pieces_header(array.dtype, array.shape, [(codec.full_region(array.shape), array)])}


# ---- 1: memory for an incoming array is committed only as its bytes arrive ---------------

def test_a_huge_announced_array_with_few_bytes_is_refused_quickly_without_memory():
    header = {"dtype": "uint8", "shape": [4 * _GIB], "nbytes": 4 * _GIB}
    before, start = peak_rss_bytes(), time.monotonic()
    with pytest.raises(WireError, match="header announced"):
        codec.assemble_array(header, [b"0123456789"])
    pieces = {"array": header, "pieces": [{"index": [[0, 4 * _GIB]], "array": header}]}
    with pytest.raises(WireError, match="header announced"):
        codec.read_pieces(pieces, iter([b"0123456789"]))
    assert time.monotonic() - start < 1.0
    assert peak_rss_bytes() - before < 64 << 20, "announcing gigabytes must not commit gigabytes"
    for nbytes in (1 << 62, codec.host_memory_bytes() + 1):
        with pytest.raises(WireError, match="exceeds this host's"):
            codec.assemble_array({"dtype": "uint8", "shape": [nbytes], "nbytes": nbytes}, [b"x"])


def test_host_memory_is_the_containers_limit_where_that_is_lower(tmp_path, monkeypatch):
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    unlimited, limited = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    unlimited.write_text("max\n")  # cgroup v2 without a limit: the v1 file is read next
    for limit, expect in ((_GIB, _GIB), (physical * 2, physical)):
        limited.write_text(f"{limit}\n")
        monkeypatch.setattr(codec, "_CGROUP_LIMITS", (str(unlimited), str(limited)))
        codec.host_memory_bytes.cache_clear()
        try:
            assert codec.host_memory_bytes() == expect
        finally:
            codec.host_memory_bytes.cache_clear()  # the real limit again for the tests after this one


def test_an_assembled_array_is_aligned_writable_and_exact():
    array = np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(3, -1)
    back = codec.assemble_array(codec.array_header(array), codec.array_chunks(array))
    np.testing.assert_array_equal(back, array)
    assert back.ctypes.data % 64 == 0 and back.flags.writeable


def test_a_worker_refuses_a_huge_put_without_committing_its_memory(cluster, session):
    worker = next(w for w in status(cluster.address)["workers"] if w["rank"] == 0)
    workers = worker_pids(cluster.address)
    before = {pid: peak_rss_bytes(pid) for pid in workers}
    header = {"dtype": "uint8", "shape": [4 * _GIB], "nbytes": 4 * _GIB}
    put_message = codec.pack({"t": "put", "handle": first_handle(session.id) + 77, "credential": session._stubs(worker["address"]).credential,
                              "layout": [[0], [0, 0], [1], ["d"], []], "of": 1,
                              "array": header, "pieces": [{"index": [[0, 4 * _GIB]], "array": header}]})
    channel = rpc.open_channel(worker["address"])
    try:
        put = rpc.method(channel, rpc.WORKER_SERVICE, "Put", "stream_unary")
        start = time.monotonic()
        reply = codec.unpack(put(iter([put_message, b"0123456789"]), timeout=30))
        assert time.monotonic() - start < 5.0
        assert "header announced" in reply.get("error", ""), reply
        huge = codec.pack({"t": "put", "handle": first_handle(session.id) + 78, "credential": session._stubs(worker["address"]).credential,
                           "layout": [[0], [0, 0], [1], ["d"], []], "of": 1,
                           "array": {"dtype": "uint8", "shape": [1 << 62], "nbytes": 1 << 62}, "pieces": []})
        assert "exceeds this host's" in codec.unpack(put(iter([huge]), timeout=30)).get("error", "")
    finally:
        channel.close()
    grown = {pid: peak_rss_bytes(pid) - before[pid] for pid in workers}
    assert max(grown.values()) < 256 << 20, grown


# ---- 3: every malformed array header is a WireError ------------------------------------

_GOOD = {"dtype": "float32", "shape": [2, 3], "nbytes": 24}
_BAD_HEADERS = [
    {**_GOOD, "dtype": ["float32"]}, {**_GOOD, "dtype": {"a": 1}}, {**_GOOD, "dtype": 5},
    {**_GOOD, "shape": {"a": 1}}, {**_GOOD, "shape": [[2], 3]}, {**_GOOD, "shape": [2.0, 3]},
    {**_GOOD, "shape": "23"}, {**_GOOD, "shape": [1] * 65}, {**_GOOD, "shape": [-2, -3]},
    {**_GOOD, "nbytes": [24]}, {**_GOOD, "nbytes": {"n": 24}}, {**_GOOD, "nbytes": "24"},
    [_GOOD], "header", None,
]


@pytest.mark.parametrize("header", _BAD_HEADERS)
def test_malformed_array_headers_give_wire_errors(header):
    with pytest.raises(WireError):
        codec.check_array_header(header)
    with pytest.raises(WireError):
        codec.assemble_array(header, [bytes(24)])
    with pytest.raises(WireError):
        codec.piece_specs({"array": header, "pieces": []})
    with pytest.raises(WireError):
        codec.piece_specs({"array": _GOOD, "pieces": [{"index": [[0, 2], [0, 3]], "array": header}]})


@pytest.mark.parametrize("pieces", [
    {"x": 1}, [[1]], [{"index": {"a": 1}, "array": _GOOD}], [{"index": [{"a": 1}, [0, 3]], "array": _GOOD}],
    [{"index": [[0, [2]], [0, 3]], "array": _GOOD}], [{"index": [[0, 2], [0, 3, 4]], "array": _GOOD}],
    [{"index": [[0, 2], [0, 3]], "array": _GOOD}] * (codec.MAX_PIECES + 1),
])
def test_malformed_piece_lists_give_wire_errors(pieces):
    with pytest.raises(WireError):
        codec.piece_specs({"array": _GOOD, "pieces": pieces})
    with pytest.raises(WireError):
        codec.piece_specs([{"array": _GOOD, "pieces": pieces}])


# ---- the data-plane listener: its threads survive, its memory is bounded ----------------

class Collector:
    """A listener's receive callback that keeps what it was given."""

    def __init__(self):
        self.frames = []
        self.arrived = threading.Condition()

    def __call__(self, header, pieces):
        with self.arrived:
            self.frames.append((header, pieces))
            self.arrived.notify_all()

    def wait_for(self, count, timeout=10.0):
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.frames) >= count, timeout), \
                f"{count} frames should have arrived, got {len(self.frames)}"


def connect(listener, timeout=10.0):
    host, _, port = listener.address.removeprefix("tcp://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def closed_by_peer(sock, timeout=10.0):
    """True once the other end closed ``sock``; reads and drops whatever precedes that."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def thread_deaths(monkeypatch):
    """Exceptions that end a thread, recorded instead of printed."""
    deaths = []
    monkeypatch.setattr(threading, "excepthook", lambda args: deaths.append(args.exc_value))
    return deaths


def test_a_malformed_header_or_a_failing_receiver_closes_only_its_connection(monkeypatch):
    deaths = thread_deaths(monkeypatch)
    collector = Collector()
    failures = []

    def receive(header, pieces):
        if header.get("fail"):
            failures.append(header)
            raise RuntimeError("a bug in the receiver")
        return collector(header, pieces)

    listener = tcp.Listener(receive, timeout=5)
    try:
        good = np.arange(6, dtype=np.float32).reshape(2, 3)
        bad_frames = [frame({"t": "put", "array": {**_GOOD, "dtype": ["float32"]}, "pieces": []}),
                      frame({"t": "put", "array": _GOOD, "pieces": [{"index": [[0, 2], [0, 3]],
                                                                     "array": {**_GOOD, "shape": {"a": 1}}}]}),
                      frame({"t": "probe", "bytes": [1]}),
                      frame(put_header(good, fail=True), good.tobytes())]
        for bad in bad_frames:
            with connect(listener) as sock:
                sock.sendall(bad)
                assert closed_by_peer(sock)
        assert len(failures) == 1
        with connect(listener) as sock:
            sock.sendall(frame(put_header(good, id=1), good.tobytes()))
            collector.wait_for(1)
        header, pieces = collector.frames[0]
        assert header["id"] == 1
        np.testing.assert_array_equal(pieces[0][1], good)
    finally:
        listener.close()
    assert deaths == [], deaths


def test_trickling_connections_hold_no_more_than_the_listeners_budget(caplog):
    """40 peers announce a 16 MiB frame each and send all of it but its last byte: without
    bounds each would hold 16 MiB; with a 64 MiB budget three at a time do, and the others
    wait for a reservation or are refused once they have waited the listener's timeout."""
    caplog.set_level(logging.ERROR, logger="pathways.wire")
    size, peers, timeout = 16 << 20, 40, 3.0
    listener = tcp.Listener(Collector(), timeout=timeout, budget_bytes=64 << 20, connection_bytes=32 << 20)
    payload = memoryview(bytes(size))
    head = frame(put_header(np.zeros(size, np.uint8)))
    closed = []

    def trickle():
        with connect(listener, timeout=5 * timeout) as sock:
            try:
                sock.sendall(head)
                sock.sendall(payload[:-1])
            except OSError:
                pass  # refused while sending
            closed.append(closed_by_peer(sock, timeout=5 * timeout))

    before = rss_bytes()
    peak, held = 0, 0
    threads = [threading.Thread(target=trickle) for _ in range(peers)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            peak, held = max(peak, rss_bytes() - before), max(held, listener.budget.used)
            time.sleep(0.05)
    finally:
        for t in threads:
            t.join(timeout=30)
    assert len(closed) == peers, "the listener should close every connection whose frame never ends"
    assert 32 << 20 < held <= 64 << 20
    assert peak < 150 << 20, f"{peers} trickling connections made the listener hold {peak >> 20} MiB"
    assert "retry when they are done" in caplog.text
    wait_until(lambda: listener.budget.used == 0, timeout=2 * timeout, what="every reservation to be released")
    collector = Collector()
    listener._receive = collector
    try:
        good = np.arange(10, dtype=np.int64)
        with connect(listener) as sock:
            sock.sendall(frame(put_header(good), good.tobytes()))
            collector.wait_for(1)
        np.testing.assert_array_equal(collector.frames[0][1][0][1], good)
        big = np.zeros(40 << 20, np.uint8)  # more than one connection may hold: refused at once
        with connect(listener) as sock:
            start = time.monotonic()
            sock.sendall(frame(put_header(big)))
            assert closed_by_peer(sock) and time.monotonic() - start < timeout
        assert "more than the 33554432 bytes one connection may hold" in caplog.text
    finally:
        listener.close()


def test_a_frame_trickled_a_byte_at_a_time_is_closed_within_its_deadline():
    listener = tcp.Listener(Collector(), timeout=1.0)
    try:
        data = frame(put_header(np.zeros(4, np.uint8)), bytes(4))
        with connect(listener) as sock:
            start = time.monotonic()
            sock.sendall(data[:4])
            closed = False
            for byte in data[4:]:
                time.sleep(0.3)  # each read is within the per-read timeout
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                sock.settimeout(0.01)
                try:
                    if sock.recv(1) == b"":
                        closed = True
                        break
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError:
                    closed = True
                    break
            assert closed, "a frame may not take for ever to arrive"
            assert time.monotonic() - start < 4.0
    finally:
        listener.close()
