"""A session's host buffers: chunks read while they arrive, whole buffers, the byte limit,
and failures reaching whoever reads (pure: threads, no processes)."""

import threading
import time

import numpy as np
import pytest

from pathways.ifrt.host_buffers import HostBuffers
from pathways.ifrt.types import INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, IfrtError


def test_a_reader_gets_each_chunk_as_it_arrives_and_ends_with_the_last():
    buffers = HostBuffers()
    got, arrived = [], threading.Event()
    buffer = buffers.open(1, 6)

    def read():
        for chunk in buffers.chunks(1, timeout=10):
            got.append(bytes(chunk))
            arrived.set()

    reader = threading.Thread(target=read)
    reader.start()
    buffers.add(buffer, b"abc")
    assert arrived.wait(10) and got == [b"abc"], "the first chunk is read before the rest arrives"
    buffers.add(buffer, memoryview(b"def"))
    buffers.finish(buffer)
    reader.join(10)
    assert got == [b"abc", b"def"]
    assert bytes(buffers.get(1, timeout=1)) == b"abcdef", "a lookup does not consume the buffer"


def test_a_taken_buffer_is_gone_and_its_bytes_are_freed_as_they_are_read():
    buffers = HostBuffers(limit=100)
    buffer = buffers.open(2, 10)
    assert buffers.used == 10
    chunks = buffers.chunks(2, timeout=1, take=True)
    buffers.add(buffer, b"0123456789")
    buffers.finish(buffer)
    assert [bytes(c) for c in chunks] == [b"0123456789"]
    assert buffers.used == 0 and not buffers.delete(2)
    buffers.open(2, 4)  # the handle can be stored again


def test_a_reader_of_a_buffer_not_stored_yet_waits_for_it_bounded():
    buffers = HostBuffers()
    threading.Timer(0.05, lambda: buffers.store(3, np.arange(4, dtype=np.int32))).start()
    assert buffers.get(3, timeout=10).view(np.int32).tolist() == [0, 1, 2, 3]
    with pytest.raises(IfrtError) as e:
        list(buffers.chunks(4, timeout=0.05))
    assert e.value.code == NOT_FOUND and "not stored within" in e.value.message


def test_a_buffer_whose_bytes_stop_coming_fails_its_reader_after_the_wait():
    buffers = HostBuffers()
    buffer = buffers.open(5, 8)
    buffers.add(buffer, b"1234")
    with pytest.raises(IfrtError) as e:
        list(buffers.chunks(5, timeout=0.05))
    assert e.value.code == UNAVAILABLE and "4 arrived" in e.value.message


def test_a_failed_buffer_gives_its_error_to_readers_and_frees_its_bytes():
    buffers = HostBuffers()
    buffer = buffers.open(6, 8)
    buffers.add(buffer, b"1234")
    buffers.fail(buffer, IfrtError(UNAVAILABLE, "the store ended early"))
    assert buffers.used == 0
    for read in (lambda: list(buffers.chunks(6, timeout=1)), lambda: buffers.get(6, timeout=1)):
        with pytest.raises(IfrtError, match="the store ended early"):
            read()
    buffers.add(buffer, b"5678")  # what still comes is dropped
    assert buffers.used == 0


def test_the_bytes_announced_are_enforced():
    buffers = HostBuffers()
    buffer = buffers.open(7, 4)
    with pytest.raises(IfrtError) as e:
        buffers.add(buffer, b"12345")
    assert e.value.code == INVALID_ARGUMENT and "more than the 4 bytes announced" in e.value.message
    buffers.add(buffer, b"12")
    with pytest.raises(IfrtError, match="got 2 bytes of the 4 announced"):
        buffers.finish(buffer)
    with pytest.raises(IfrtError, match="already stored"):
        buffers.open(7, 4)


def test_the_session_limit_counts_announced_and_unannounced_bytes():
    buffers = HostBuffers(limit=10)
    buffers.open(8, 6)
    with pytest.raises(IfrtError) as e:
        buffers.open(9, 6)
    assert e.value.code == RESOURCE_EXHAUSTED and "10 bytes of host buffers" in e.value.message
    unannounced = buffers.open(10, None)
    buffers.add(unannounced, b"1234")
    with pytest.raises(IfrtError):
        buffers.add(unannounced, b"1")
    assert buffers.used == 10
    assert buffers.delete(8) and buffers.delete(10) and buffers.used == 0


def test_an_array_its_buffers_hold_in_part_is_admitted_by_its_full_size_beside_the_bytes_stored():
    buffers = HostBuffers(limit=100)
    buffers.open(12, 40)
    buffers.admit(60, "a float32[15] array")
    with pytest.raises(IfrtError) as e:
        buffers.admit(61, "a float32[61] array made from a strided host buffer")
    assert e.value.code == RESOURCE_EXHAUSTED
    assert "float32[61] array made from a strided host buffer is 61 bytes" in e.value.message
    assert "bound of 100 bytes" in e.value.message and "40 in use" in e.value.message
    assert buffers.used == 40, "admitting holds nothing"


def test_closing_wakes_every_reader_with_the_reason():
    buffers = HostBuffers()
    buffers.open(11, 8)
    errors = []

    def read():
        try:
            list(buffers.chunks(11, timeout=30))
        except IfrtError as e:
            errors.append(e.message)

    reader = threading.Thread(target=read)
    reader.start()
    buffers.close("the IFRT session ended")
    reader.join(10)
    assert not reader.is_alive() and errors == ["the IFRT session ended"]


def test_a_client_trickling_a_buffer_is_failed_by_the_reader_and_its_store_ended(monkeypatch):
    """A client's buffer (one whose store can be ended) must keep the minimum pace: its
    reader, finding a window that brought too few bytes, fails it with DEADLINE_EXCEEDED and
    ends the store; the store's next chunk gets the same error. A buffer the server fills
    from a worker (no store to end) may wait as long as the worker computes."""
    import functools

    from pathways.ifrt import host_buffers
    from pathways.ifrt.types import DEADLINE_EXCEEDED

    monkeypatch.setattr(host_buffers, "Pace", functools.partial(host_buffers.Pace, rate=1000, window=0.2))
    buffers = HostBuffers()
    cancelled = threading.Event()
    buffer = buffers.open(7, 10_000, cancel=cancelled.set)
    buffers.add(buffer, b"x")
    with pytest.raises(IfrtError) as e:
        list(buffers.chunks(7, timeout=10))
    assert e.value.code == DEADLINE_EXCEEDED and "came too slowly" in e.value.message
    assert cancelled.is_set() and buffers.used == 0
    with pytest.raises(IfrtError) as again:
        buffers.add(buffer, b"y")
    assert again.value.code == DEADLINE_EXCEEDED

    served = buffers.open(8, None)  # the server's, from a worker: no pace
    threading.Timer(0.5, lambda: (buffers.add(served, b"late"), buffers.finish(served))).start()
    assert [bytes(c) for c in buffers.chunks(8, timeout=10)] == [b"late"]


def test_a_store_that_sends_too_slowly_fails_on_its_next_chunk(monkeypatch):
    import functools

    from pathways.ifrt import host_buffers
    from pathways.ifrt.types import DEADLINE_EXCEEDED

    monkeypatch.setattr(host_buffers, "Pace", functools.partial(host_buffers.Pace, rate=10_000, window=0.1))
    buffers = HostBuffers()
    cancelled = threading.Event()
    buffer = buffers.open(9, 10_000, cancel=cancelled.set)
    buffers.add(buffer, b"x" * 100)
    time.sleep(0.15)
    with pytest.raises(IfrtError) as e:
        buffers.add(buffer, b"x")
    assert e.value.code == DEADLINE_EXCEEDED and "101 bytes in the last 0.1 s" in e.value.message
    assert not cancelled.is_set(), "the store itself gets the error: nothing to end from outside"


def test_chunks_arriving_for_a_deleted_buffer_are_dropped_and_not_counted():
    buffers = HostBuffers(limit=100)
    buffer = buffers.open(10, None)  # a read from the workers, its size not announced
    buffers.add(buffer, b"x" * 40)
    assert buffers.delete(10) and buffers.used == 0
    buffers.add(buffer, b"y" * 40)  # the read goes on after the client deleted the buffer
    buffers.finish(buffer)
    assert buffers.used == 0, "bytes of a deleted buffer count against the session's bound"
    buffers.open(11, 100)  # the whole bound is there again
