"""A stream's outboxes (protocol/streams.py): the client's ``Outbox``, whose released handles go
out after the messages put before them, riding along with them or flushed soon after, and
the controller's ``LoopOutbox``, with its bounds in messages and in bytes and payloads
joined from messages encoded as they were put."""

import asyncio
import gc
import threading
import time

import grpc

from pathways.protocol import messages as m
from pathways.protocol import streams
from tests.inprocess import LoopThread


def test_joined_items_are_the_bytes_of_an_encoded_batch():
    for n in (0, 1, 15, 16, 65535, 65536):  # each form of msgpack's list header, either side of its limits
        batch = [m.ClusterRequest(i + 1) for i in range(n)]
        assert m.join_items([m.encode_item(x) for x in batch]) == m.encode_batch(batch), n
    mixed = [m.SessionWelcome(3, b"c" * m.CREDENTIAL_BYTES), m.Error(None, "RemoteError", "x" * m.MAX_TEXT),
             m.Error(7, "AccessDeniedError", "é" * 100), m.ClusterReply(9, m.ClusterStatus("fair", 8, (), (), (), (), 1, 0))]
    assert list(streams.payloads([m.encode_item(x) for x in mixed])) == [m.encode_batch(mixed)]


def _outbox() -> streams.Outbox:
    return streams.Outbox(releases=lambda handles: m.Delete(tuple(handles)))


def _sent(outbox: streams.Outbox) -> list[list[m.Message]]:
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
    assert time.monotonic() - start < 10 * streams.RELEASE_SECONDS
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


def test_what_is_put_while_held_goes_out_as_one_batch_when_the_hold_ends():
    outbox = _outbox()
    batches = outbox.batches()
    outbox.hold()
    outbox.hold()  # holds nest: the outer one's end sends
    outbox.put(m.ClusterRequest(1))
    outbox.release(0x10)  # held after the message, which may name it
    outbox.put(m.ClusterRequest(2))
    outbox.unhold()
    assert outbox._queue.qsize() == 0 and not outbox._released
    outbox.unhold()
    outbox.put(m.ClusterRequest(3))
    outbox.close()
    assert [m.SESSION_UP.decode_batch(p) for p in batches] == [
        [m.ClusterRequest(1), m.ClusterRequest(2), m.ClusterRequest(3), m.Delete((0x10,))]]


def test_send_held_sends_what_is_held_so_far_and_the_hold_goes_on():
    outbox = _outbox()
    batches = outbox.batches()
    outbox.hold()
    outbox.put(m.ClusterRequest(1))
    outbox.send_held()
    assert m.SESSION_UP.decode_batch(next(batches)) == [m.ClusterRequest(1)]
    outbox.put(m.ClusterRequest(2))
    assert outbox._queue.qsize() == 0  # still held
    outbox.unhold()
    outbox.close()
    assert [m.SESSION_UP.decode_batch(p) for p in batches] == [[m.ClusterRequest(2)]]


def test_a_release_while_held_never_goes_out_ahead_of_the_held_messages():
    # the flusher sends releases on their own within RELEASE_SECONDS: one noted during a
    # hold waits for the messages held before it, which may name its handle
    outbox = _outbox()
    batches = outbox.batches()
    outbox.hold()
    outbox.put(m.ClusterRequest(1))
    outbox.release(0x20)
    time.sleep(5 * streams.RELEASE_SECONDS)
    assert outbox._queue.qsize() == 0
    outbox.unhold()
    outbox.close()
    assert [m.SESSION_UP.decode_batch(p) for p in batches] == [[m.ClusterRequest(1), m.Delete((0x20,))]]


def _fill_and_drain(message: m.Message, puts: int) -> None:
    """``puts`` copies of ``message`` reach a bound: the reader waits for room while they
    are queued and while the writer is sending them, and goes on once they are sent."""

    async def scenario() -> None:
        outbox = streams.LoopOutbox()
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
    puts = -(-streams.MAX_QUEUED_BYTES // len(m.encode_item(large)))
    assert puts < streams.MAX_QUEUED_MESSAGES // 10
    _fill_and_drain(large, puts)


def test_many_small_messages_reach_the_count_bound():
    small = m.Error(1, "RemoteError", "refused")
    assert streams.MAX_QUEUED_MESSAGES * len(m.encode_item(small)) < streams.MAX_QUEUED_BYTES
    _fill_and_drain(small, streams.MAX_QUEUED_MESSAGES)


def test_a_stream_that_ends_under_its_writer_lets_a_waiting_reader_go_on():
    async def scenario() -> None:
        outbox = streams.LoopOutbox()
        for _ in range(streams.MAX_QUEUED_MESSAGES):
            outbox.put(m.Error(1, "RemoteError", "refused"))
        waiting = asyncio.create_task(outbox.room())

        async def send(payload: bytes) -> None:
            raise ConnectionResetError("the peer is gone")

        await asyncio.wait_for(outbox.write_to(send), 1)
        await asyncio.wait_for(waiting, 1)
        outbox.put(m.Error(2, "RemoteError", "refused"))  # ignored: nobody would send it
        await asyncio.wait_for(outbox.room(), 1)

    asyncio.run(scenario())


def test_a_local_stream_carries_requests_to_the_loop_and_replies_back_and_ends_either_way():
    """The IFRT front end's sessions reach the controller in its own process: requests read on
    the loop in order, replies iterated by the client, the client's cancel seen as the end of
    the requests, the server's finish (with an error or not) as the end of the replies."""
    with LoopThread() as loop:
        outbox = streams.Outbox()
        call = streams.LocalStream(loop.loop, outbox)
        reading = asyncio.run_coroutine_threadsafe(call.read(), loop.loop)
        time.sleep(0.1)
        assert not reading.done(), "a read waits for the client's first message"
        outbox.put(m.ClusterRequest(1))  # wakes it
        assert m.SESSION_UP.decode_batch(reading.result(5.0)) == [m.ClusterRequest(1)]
        outbox.put(m.ClusterRequest(2))
        outbox.close()
        assert m.SESSION_UP.decode_batch(loop.run(call.read(), 5.0)) == [m.ClusterRequest(2)]
        assert loop.run(call.read(), 5.0) is grpc.aio.EOF, "the requests ended"
        for reply in (b"x", b"y"):
            loop.run(call.write(reply), 5.0)
        call.finish()
        assert list(call) == [b"x", b"y"] and list(call) == [], "ended, and stays ended"

        forever = streams.LocalStream(loop.loop, streams.Outbox())
        waiting = asyncio.run_coroutine_threadsafe(forever.read(), loop.loop)
        forever.cancel()  # the client closes its session: the server's reads end, a waiting one too
        assert waiting.result(5.0) is grpc.aio.EOF and list(forever) == []

        failed = streams.LocalStream(loop.loop, streams.Outbox())
        failed.finish(ConnectionError("refused"))
        try:
            next(failed)
        except ConnectionError as e:
            assert str(e) == "refused"
        else:
            raise AssertionError("the server's error reaches the client")


def test_a_server_that_does_not_read_a_local_stream_leaves_the_clients_messages_queued():
    """Like a gRPC stream's flow control: nothing is taken from the client's outbox but by
    the server's reads, and a read takes everything queued by then, as one batch."""
    outbox = streams.Outbox()
    with LoopThread() as loop:
        call = streams.LocalStream(loop.loop, outbox)
        for i in range(1, 51):
            outbox.put(m.ClusterRequest(i))
        time.sleep(0.2)
        assert outbox._queue.qsize() == 50
        assert [x.req for x in m.SESSION_UP.decode_batch(loop.run(call.read(), 5.0))] == list(range(1, 51))
        call.cancel()


def test_a_client_outbox_behind_a_local_stream_goes_out_in_batches_while_the_server_is_busy():
    """Messages put one at a time while the server handles a payload wait in the Outbox
    and reach the server as one batch, not as a payload each."""
    outbox = streams.Outbox()
    with LoopThread() as loop:
        call = streams.LocalStream(loop.loop, outbox)
        outbox.put(m.ClusterRequest(1))
        first = loop.run(call.read(), 5.0)  # the server is now busy with it
        for i in range(2, 12):
            outbox.put(m.ClusterRequest(i))
        got = [m.SESSION_UP.decode_batch(first)]
        while sum(map(len, got)) < 11:
            got.append(m.SESSION_UP.decode_batch(loop.run(call.read(), 5.0)))
        assert [x.req for batch in got for x in batch] == list(range(1, 12))
        assert len(got) <= 3, [len(b) for b in got]  # the first, maybe one taken at once, then the rest together
        outbox.close()
        call.cancel()
