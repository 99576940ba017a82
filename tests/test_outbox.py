"""A stream's outbox on the controller's loop (wire/rpc.py LoopOutbox): its bounds in
messages and in bytes, and payloads joined from messages encoded as they were put."""

import asyncio

from pathways.protocol import messages as m
from pathways.wire import rpc


def test_joined_items_are_the_bytes_of_an_encoded_batch():
    for n in (0, 1, 15, 16, 65535, 65536):  # each form of msgpack's list header, either side of its limits
        batch = [m.ClusterRequest(i + 1) for i in range(n)]
        assert m.join_items([m.encode_item(x) for x in batch]) == m.encode_batch(batch), n
    mixed = [m.SessionWelcome(3, b"c" * m.CREDENTIAL_BYTES), m.Error(None, "RemoteError", "x" * m.MAX_TEXT),
             m.Error(7, "AccessDeniedError", "é" * 100), m.ClusterReply(9, {"workers": [{"rank": 0}], "slices": 1})]
    assert list(rpc.payloads([m.encode_item(x) for x in mixed])) == [m.encode_batch(mixed)]


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
