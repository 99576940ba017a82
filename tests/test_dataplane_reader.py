"""The data listener reads each connection through a buffer: frames that arrive together,
frames cut anywhere, and pieces larger than the buffer all arrive intact and in order."""

import socket
import struct
import threading
import time

import numpy as np

from pathways.wire import codec, tcp


def put_frame(array, **extra):
    pieces = [(codec.full_region(array.shape), array)]
    body = codec.pack({"t": "put", **extra, **codec.pieces_header(array.dtype, array.shape, pieces)})
    return struct.pack("!I", len(body)) + body + np.ascontiguousarray(array).tobytes()


class Collector:
    def __init__(self):
        self.frames = []
        self._arrived = threading.Condition()

    def __call__(self, header, pieces):
        with self._arrived:
            self.frames.append((header["id"], pieces[0][1].copy()))
            self._arrived.notify_all()

    def wait_for(self, n, timeout=30.0):
        with self._arrived:
            assert self._arrived.wait_for(lambda: len(self.frames) >= n, timeout), f"{len(self.frames)} of {n} arrived"


def arrays():
    """Frames of every size class: tiny, a few KiB, and pieces larger than the read buffer."""
    rng = np.random.default_rng(7)
    return [np.float32(1.5).reshape(()), rng.random(3, np.float32), rng.integers(0, 99, (40, 50), np.int64),
            rng.random(3 * tcp._READ_BUFFER // 8), rng.random(5, np.float32)]


def check_arrival(chunks_of):
    """Send the frames of ``arrays()``, cut into writes by ``chunks_of(data)``, on one
    connection; every frame arrives whole and in order."""
    collector = Collector()
    listener = tcp.Listener(collector, timeout=5.0)
    sent = arrays()
    data = b"".join(put_frame(a, id=i) for i, a in enumerate(sent))
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for chunk in chunks_of(data):
                sock.sendall(chunk)
                time.sleep(0.001)
            collector.wait_for(len(sent))
    finally:
        listener.close()
    assert [i for i, _ in collector.frames] == list(range(len(sent)))
    for (_, got), want in zip(collector.frames, sent):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_frames_sent_in_one_write_all_arrive_in_order():
    check_arrival(lambda data: [data])


def test_frames_cut_at_every_few_bytes_arrive_intact():
    # small cuts through the first frames (lengths, headers, payloads), larger ones after
    head = 7 * 86
    check_arrival(lambda data: [data[i:i + 7] for i in range(0, head, 7)]
                  + [data[i:i + 50_000] for i in range(head, len(data), 50_000)])


def test_a_frame_larger_than_the_buffer_between_small_ones_arrives_intact():
    check_arrival(lambda data: [data[:len(data) // 3], data[len(data) // 3:]])
