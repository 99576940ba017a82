"""Answered put frames on the data plane (tcp.Pool): the controller's IFRT front end streams
a client's array to the worker's listener as its bytes arrive and learns whether the
worker stored it. Real listeners and sockets in this process."""

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

import pathways as pw
from pathways.wire import codec, frames, tcp
from pathways.wire import security as sec
from pathways.wire.handshake import FrameAnswer
from tests.conftest import wait_until

FAST = 5.0


def header(handle, array):
    return {"t": "put", "handle": handle, **codec.pieces_header(array.dtype, array.shape,
                                                                 [(codec.full_region(array.shape), array)])}


def chunks_of(array, sizes):
    """``array``'s bytes as memoryviews of the given sizes, then the rest."""
    view, start = memoryview(array.reshape(-1).view(np.uint8)), 0
    for size in sizes:
        yield view[start:start + size]
        start += size
    yield view[start:]


@pytest.fixture
def listener():
    received = []

    def receive(head, pieces):
        received.append((head, pieces))
        return None if head["handle"] % 2 else f"array {head['handle']} is not wanted here"

    lst = tcp.Listener(receive, timeout=FAST)
    lst.received = received
    yield lst
    lst.close()


def pool_for(listener, **routes):
    route = tcp.Route(listener.address, False, (0, b""))
    return tcp.Pool({"worker": route, **routes}.get, FAST)


def test_a_frame_streamed_in_chunks_is_stored_and_answered_on_a_connection_used_again(listener):
    pool = pool_for(listener)
    try:
        array = np.random.default_rng(0).standard_normal((300, 500)).astype(np.float32)
        connection = pool.take("worker")
        assert pool.request(connection, header(1, array), chunks_of(array, [1, 4095, 100_000])) is None
        (head, pieces), = listener.received
        assert head["handle"] == 1 and head["answer"] is True
        np.testing.assert_array_equal(pieces[0][1], array)
        again = pool.take("worker")
        assert again[0] is connection[0], "the connection is kept for the next request"
        assert pool.request(again, header(2, array), chunks_of(array, [])) == "array 2 is not wanted here"
        assert pool.take("nowhere") is None, "no route: the caller puts another way"
    finally:
        pool.close()


def test_a_source_that_fails_midway_drops_the_frame_and_the_listener_serves_the_next(listener):
    pool = pool_for(listener)
    try:
        array = np.arange(1 << 18, dtype=np.float32)

        def failing():
            yield memoryview(array.view(np.uint8))[:1000]
            raise ValueError("the client's store ended early")

        broken = pool.take("worker")
        with pytest.raises(ValueError, match="ended early"):
            pool.request(broken, header(1, array), failing())
        assert broken[0].fileno() == -1, "a connection left mid-frame is closed"
        fresh = pool.take("worker")
        assert fresh[0] is not broken[0]
        assert pool.request(fresh, header(3, array), chunks_of(array, [12345])) is None
        assert [head["handle"] for head, _ in listener.received] == [3], "the cut frame was never taken"
    finally:
        pool.close()


def test_a_frame_refused_for_want_of_memory_is_answered_and_its_connection_not_used_again():
    received = []
    listener = tcp.Listener(lambda head, pieces: received.append(head), timeout=FAST, connection_bytes=1 << 16)
    pool = pool_for(listener)
    try:
        big, small = np.zeros(1 << 15, np.float32), np.ones(16, np.float32)
        connection = pool.take("worker")
        answer = pool.request(connection, header(1, big), chunks_of(big, []))
        assert answer is not None and "more than the 65536 bytes one connection may hold" in answer
        # the listener said it closes that connection after answering: the pool opens another
        assert connection[0].fileno() == -1
        replacement = pool.take("worker")
        assert replacement[0] is not connection[0]
        assert pool.request(replacement, header(5, small), chunks_of(small, [])) is None
        assert [head["handle"] for head in received] == [5]
    finally:
        pool.close()
        listener.close()


def test_a_receiver_that_never_answers_fails_the_request_within_the_timeout():
    release = threading.Event()
    listener = tcp.Listener(lambda head, pieces: release.wait(FAST) and None, timeout=FAST)
    pool = tcp.Pool({"worker": tcp.Route(listener.address, False, (0, b""))}.get, 0.5)
    try:
        array = np.ones(4, np.float32)
        connection = pool.take("worker")
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=listener.address):
            pool.request(connection, header(1, array), chunks_of(array, []))
        assert time.monotonic() - start < 2.0
        assert connection[0].fileno() == -1
    finally:
        release.set()
        pool.close()
        listener.close()


def test_an_idle_connection_its_listener_closed_is_not_used_again():
    """A listener that answers one put on each connection and closes it: the pool's next
    request opens a new connection instead of failing on the closed one."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(FAST)
    connections = []

    def serve_one_put_per_connection():
        for _ in range(2):
            conn, _ = server.accept()
            connections.append(conn)
            conn.settimeout(FAST)
            for answer in (sec.answer(None), FrameAnswer().frame()):  # the hello, then the put
                (n,) = frames.LENGTH.unpack(conn.recv(4, socket.MSG_WAITALL))
                head = codec.unpack(conn.recv(n, socket.MSG_WAITALL))
                if head.get("t") == "put":
                    conn.recv(head["array"]["nbytes"], socket.MSG_WAITALL)
                conn.sendall(answer)
            conn.close()

    thread = threading.Thread(target=serve_one_put_per_connection, daemon=True)
    thread.start()
    pool = tcp.Pool({"worker": tcp.Route(f"tcp://127.0.0.1:{server.getsockname()[1]}", False, (0, b""))}.get, FAST)
    try:
        array = np.ones(16, np.float32)
        first = pool.take("worker")
        assert pool.request(first, header(1, array), chunks_of(array, [])) is None
        wait_until(lambda: tcp.select.select([first[0]], [], [], 0)[0], timeout=FAST, what="the listener's close")
        second = pool.take("worker")
        assert second[0] is not first[0] and first[0].fileno() == -1
        assert pool.request(second, header(3, array), chunks_of(array, [])) is None
        thread.join(FAST)
        assert len(connections) == 2
    finally:
        pool.close()
        server.close()


def test_a_listener_that_cannot_be_reached_is_not_tried_again_for_a_while():
    spare = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{spare.getsockname()[1]}"
    spare.close()  # nothing listens there now
    pool = tcp.Pool({"worker": tcp.Route(address, False, (0, b""))}.get, FAST)
    try:
        with pytest.raises(OSError, match=address):
            pool.take("worker")
        start = time.monotonic()
        assert pool.take("worker") is None, "the caller puts another way meanwhile"
        assert time.monotonic() - start < 0.1
    finally:
        pool.close()


def test_a_frame_whose_bytes_stop_coming_is_dropped_and_the_sender_told_why():
    """The listener gives a frame's bytes its timeout per read; a source that pauses longer
    gets the frame dropped, and the sender hears why rather than a bare broken connection."""
    received = []
    listener = tcp.Listener(lambda head, pieces: received.append(head), timeout=0.3)
    pool = tcp.Pool({"worker": tcp.Route(listener.address, False, (0, b""))}.get, FAST)
    try:
        array = np.ones(1 << 20, np.float32)  # 4 MiB: more than the sockets' buffers take

        def pausing():
            view = memoryview(array.view(np.uint8))
            yield view[:1000]
            time.sleep(1.0)
            yield view[1000:]

        try:  # raised if the send broke first; the answer if the kernel took all the bytes first
            answer = pool.request(pool.take("worker"), header(1, array), pausing())
        except pw.WireError as e:
            answer = str(e)
        assert answer is not None and "its bytes stopped coming" in answer, answer
        assert received == []
        assert pool.request(pool.take("worker"), header(3, array), chunks_of(array, [])) is None
    finally:
        pool.close()
        listener.close()


def test_a_burst_of_puts_uses_a_bounded_number_of_connections(listener, monkeypatch):
    monkeypatch.setattr(tcp.Pool, "OPEN_PER_ADDRESS", 3)
    pool = pool_for(listener)
    try:
        array = np.ones(16, np.float32)
        taken = [pool.take("worker") for _ in range(3)]
        assert pool.take("worker") is None, "at the bound: the caller puts another way"
        assert pool.request(taken[0], header(1, array), chunks_of(array, [])) is None  # given back, idle
        again = pool.take("worker")
        assert again[0] is taken[0][0]
        with pytest.raises(ValueError):
            pool.request(taken[1], header(3, array), _failing())  # closed: its place is free again
        assert pool.take("worker") is not None
        assert pool.take("worker") is None
    finally:
        pool.close()


def _failing():
    raise ValueError("the source gave out")
    yield


def test_a_frame_refused_for_the_budget_is_read_past_and_answered_naming_the_budget():
    """Another connection's frame holds most of the listener's budget: a put that cannot
    reserve its bytes within the timeout is answered with why (the budget, not a broken
    connection), its bytes read past, and its connection kept for the next put."""
    received = []
    listener = tcp.Listener(lambda head, pieces: received.append(head["handle"]), timeout=1.0,
                            budget_bytes=64 << 20, connection_bytes=48 << 20)
    pool = pool_for(listener)
    holder = socket.create_connection(("127.0.0.1", listener.port))
    done = threading.Event()

    def hold():  # a byte at a time, each within the listener's timeout
        while not done.wait(0.2):
            holder.sendall(b"x")

    try:
        held = np.zeros(40 << 20, np.uint8)
        holder.sendall(frames.frame(codec.pack(header(1, held))))
        threading.Thread(target=hold, daemon=True).start()
        wait_until(lambda: listener.budget.used >= 40 << 20, timeout=FAST, what="the first frame's reservation")
        big = np.ones(30 << 20, np.uint8)
        connection = pool.take("worker")
        answer = pool.request(connection, header(3, big), chunks_of(big, []))
        assert answer is not None and "frames on other connections hold" in answer, answer
        assert "of this listener's budget of 67108864 bytes" in answer and "retry when they are done" in answer
        assert connection[0].fileno() != -1, "the refused frame's connection is kept"
        small = np.arange(16, dtype=np.float32)
        assert pool.request(pool.take("worker"), header(5, small), chunks_of(small, [])) is None
        assert received == [5]
    finally:
        done.set()
        holder.close()
        pool.close()
        listener.close()


def test_a_giant_frame_trickled_a_byte_at_a_time_is_dropped_within_a_pace_window():
    """A 1 GiB frame whose sender sends a byte every 2 s (each read within the timeout) is
    dropped at the end of its first 20 s window, not after the ~17 minutes an average rate
    would allow; a sender that asked for an answer is told why, and the receiver of one
    that did not gets a poison in the array's place, so whoever waits for it learns why."""
    received = []
    listener = tcp.Listener(lambda head, pieces: received.append(head), timeout=FAST)
    giant = {"t": "put", "handle": 9, **codec.whole_array_header(np.dtype(np.uint8), (1 << 30,))}
    pool = pool_for(listener)
    try:
        def trickle():
            for _ in range(60):
                yield b"\0"
                time.sleep(2.0)

        def unanswered():
            with socket.create_connection(("127.0.0.1", listener.port)) as sock:
                sock.sendall(frames.frame(codec.pack(giant)))
                while not received and time.monotonic() - start < 60:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"\0")
                    time.sleep(2.0)

        start = time.monotonic()
        other = threading.Thread(target=unanswered)
        other.start()
        with pytest.raises(pw.WireError, match="came too slowly"):
            pool.request(pool.take("worker"), {**giant, "handle": 11}, trickle())
        answered = time.monotonic() - start
        assert answered < 20 + 2 * FAST, f"the trickled frame was dropped after {answered:.0f} s"
        other.join(60)
        assert received and "came too slowly" in received[0].get("poison", ""), received
        assert received[0]["handle"] == 9 and time.monotonic() - start < 20 + 2 * FAST
        assert listener.budget.used == 0
    finally:
        pool.close()
        listener.close()
