"""A stream's outboxes (wire/rpc.py): the client's ``Outbox``, whose released handles go
out after the messages put before them, riding along with them or flushed soon after, and
the controller's ``LoopOutbox``, with its bounds in messages and in bytes and payloads
joined from messages encoded as they were put."""

import asyncio
import gc
import threading
import time

from pathways.protocol import messages as m
from pathways.wire import rpc


def test_joined_items_are_the_bytes_of_an_encoded_batch():
    for n in (0, 1, 15, 16, 65535, 65536):  # each form of msgpack's list header, either side of its limits
        batch = [m.ClusterRequest(i + 1) for i in range(n)]
        assert m.join_items([m.encode_item(x) for x in batch]) == m.encode_batch(batch), n
    mixed = [m.SessionWelcome(3, b"c" * m.CREDENTIAL_BYTES), m.Error(None, "RemoteError", "x" * m.MAX_TEXT),
             m.Error(7, "AccessDeniedError", "é" * 100), m.ClusterReply(9, {"workers": [{"rank": 0}], "slices": 1})]
    assert list(rpc.payloads([m.encode_item(x) for x in mixed])) == [m.encode_batch(mixed)]


def _outbox() -> rpc.Outbox:
    return rpc.Outbox(releases=lambda handles: m.Delete(tuple(handles)))


def _sent(outbox: rpc.Outbox) -> list[list[m.Message]]:
    """The batches ``outbox`` sends until closed, decoded."""
    return [m.SESSION_UP.decode_batch(p) for p in outbox.batches()]


def test_released_handles_go_out_as_one_delete_after_the_messages_put_before_them():
    outbox = _outbox()
    outbox.put(m.ClusterRequest(1))
    outbox.release(0x10)
    outbox.put(m.ClusterRequest(2))  # may still name 0x10 (put before the release came through)
    outbox.release(0x11)
    outbox.close()
    assert _sent(outbox) == [[m.ClusterRequest(1), m.ClusterRequest(2), m.Delete((0x10, 0x11))]]


def test_releases_alone_go_out_within_the_flush_period_and_a_close_sends_what_was_put_before_it():
    outbox = _outbox()
    batches = outbox.batches()
    outbox.release(7)
    start = time.monotonic()
    assert m.SESSION_UP.decode_batch(next(batches)) == [m.Delete((7,))]  # flushed by the process's thread
    assert time.monotonic() - start < 10 * rpc.RELEASE_SECONDS
    outbox.put(m.ClusterRequest(3))
    outbox.release(8)
    outbox.close()
    assert [m.SESSION_UP.decode_batch(p) for p in batches] == [[m.ClusterRequest(3), m.Delete((8,))]]


def test_a_stream_no_one_reads_holds_one_flush_at_most():
    outbox = _outbox()
    outbox.release(5)
    for _ in range(100):
        outbox.flush()
    assert outbox._queue.qsize() == 1
    outbox.close()
    outbox.flush()  # closed: nothing more is queued
    assert outbox._queue.qsize() == 2


def test_a_stream_waits_for_its_first_message_and_a_release_from_a_finalizer_sends_it():
    outbox = _outbox()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(outbox.batches()))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and got == []

    class Array:  # releases its handle when collected, in whichever thread collects it
        def __del__(self) -> None:
            outbox.release(0x42)

    array = Array()
    array.cycle = array  # collected by the cyclic collector, at a moment no code chooses
    del array
    gc.collect()
    outbox.close()
    reader.join(10)
    assert not reader.is_alive()
    assert [m.SESSION_UP.decode_batch(p) for p in got] == [[m.Delete((0x42,))]]


def _fill_and_drain(message: m.Message, puts: int) -> None:
    """``puts`` copies of ``message`` reach a bound: the reader waits for room while they
    are queued and while the writer is sending them, and goes on once they are sent."""

    async def scenario() -> None:
        outbox = rpc.LoopOutbox()
        for _ in range(puts - 1):
            outbox.put(message)
        await asyncio.wait_for(outbox.room(), 1)  # one short of the bound
        outbox.put(message)
        waiting = asyncio.create_task(outbox.room())
        await asyncio.sleep(0.05)
        assert not waiting.done(), "the bound is reached"
        taken, sent = asyncio.Event(), []

        async def send(payload: bytes) -> None:  # a peer that reads only once told to
            await taken.wait()
            sent.append(payload)

        writer = asyncio.create_task(outbox.write_to(send))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "what is being sent counts until it is sent"
        taken.set()
        await asyncio.wait_for(waiting, 1)
        outbox.close()
        await asyncio.wait_for(writer, 1)
        assert sum(len(m.SESSION_DOWN.decode_batch(p)) for p in sent) == puts

    asyncio.run(scenario())


def test_a_few_large_messages_reach_the_byte_bound():
    large = m.Error(None, "RemoteError", "x" * m.MAX_TEXT)
    puts = -(-rpc.MAX_QUEUED_BYTES // len(m.encode_item(large)))
    assert puts < rpc.MAX_QUEUED_MESSAGES // 10
    _fill_and_drain(large, puts)


def test_many_small_messages_reach_the_count_bound():
    small = m.Error(1, "RemoteError", "refused")
    assert rpc.MAX_QUEUED_MESSAGES * len(m.encode_item(small)) < rpc.MAX_QUEUED_BYTES
    _fill_and_drain(small, rpc.MAX_QUEUED_MESSAGES)


def test_a_stream_that_ends_under_its_writer_lets_a_waiting_reader_go_on():
    async def scenario() -> None:
        outbox = rpc.LoopOutbox()
        for _ in range(rpc.MAX_QUEUED_MESSAGES):
            outbox.put(m.Error(1, "RemoteError", "refused"))
        waiting = asyncio.create_task(outbox.room())

        async def send(payload: bytes) -> None:
            raise ConnectionResetError("the peer is gone")

        await asyncio.wait_for(outbox.write_to(send), 1)
        await asyncio.wait_for(waiting, 1)
        outbox.put(m.Error(2, "RemoteError", "refused"))  # ignored: nobody would send it
        await asyncio.wait_for(outbox.room(), 1)

    asyncio.run(scenario())
