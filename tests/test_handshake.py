"""The records of framed TCP's own frames (wire/handshake.py): each round-trips through its
frame, keeps the keys other processes of this version read, and refuses every malformed
field with a WireError naming it; a listener and a greeting meet malformed ones without an
exception escaping."""

import secrets
import socket
import struct
import threading
import time

import pytest

import pathways as pw
from pathways.errors import WireError
from pathways.wire import codec, frames, tcp
from pathways.wire import security as sec
from pathways.wire.handshake import (HELLO_BYTES, MAX_ANSWER_CHARS, MAX_PROBE_BYTES, MAX_REFUSAL_CHARS,
                                     MAX_TICKET_BYTES, MAX_TOKEN_CHARS, SENDERS, FrameAnswer, Hello, HelloAnswer,
                                     Probe)
from pathways.wire.security import Security

TOKEN = "test-" + secrets.token_urlsafe(24)
FAST = 5.0


def _header(frame: bytes):
    """The decoded header of a whole ``frame``."""
    (n,) = frames.LENGTH.unpack(frame[:frames.LENGTH.size])
    assert len(frame) == frames.LENGTH.size + n
    return codec.unpack(frame[frames.LENGTH.size:])


# ---- round trips, and the keys on the wire ---------------------------------------------------

@pytest.mark.parametrize("record, header", [
    (Hello(TOKEN), {"t": "hello", "token": TOKEN}),
    (Hello(""), {"t": "hello", "token": ""}),
    (Hello(TOKEN, 3, b"t" * 32), {"t": "hello", "token": TOKEN, "from": 3, "ticket": b"t" * 32}),
    (Hello("", -1, b"t" * 32), {"t": "hello", "token": "", "from": -1, "ticket": b"t" * 32}),
    (HelloAnswer(), {"t": "hello"}),
    (HelloAnswer("no token"), {"t": "refused", "error": "no token"}),
    (FrameAnswer(), {"t": "answer", "error": None}),
    (FrameAnswer("full"), {"t": "answer", "error": "full"}),
    (FrameAnswer("too slow", closing=True), {"t": "answer", "error": "too slow", "closing": True}),
    (Probe(0), {"t": "probe", "bytes": 0}),
    (Probe(MAX_PROBE_BYTES), {"t": "probe", "bytes": MAX_PROBE_BYTES}),
])
def test_each_record_round_trips_through_the_keys_other_processes_read(record, header):
    assert _header(record.frame()) == header
    assert type(record).read(header) == record
    assert type(record).read({**header, "later": [1, {"x": 2}]}) == record, "fields it does not know are ignored"


def test_a_hello_without_a_token_reads_as_one_with_none():
    assert Hello.read({"t": "hello"}) == Hello.read({"t": "hello", "token": None}) == Hello("")
    assert not Security(token=TOKEN).allows(Hello.read({"t": "hello"}).token)


def test_writers_cut_messages_to_what_readers_take():
    answer = _header(FrameAnswer("x" * (MAX_ANSWER_CHARS + 10)).frame())
    assert FrameAnswer.read(answer).error == "x" * MAX_ANSWER_CHARS
    refusal = _header(HelloAnswer("y" * (MAX_REFUSAL_CHARS + 10)).frame())
    assert HelloAnswer.read(refusal).refused == "y" * MAX_REFUSAL_CHARS


def test_the_largest_hello_fits_what_a_listener_reads_before_a_greeting():
    largest = Hello("t" * MAX_TOKEN_CHARS, SENDERS[0], b"\xff" * MAX_TICKET_BYTES).frame()
    assert len(largest) - frames.LENGTH.size <= HELLO_BYTES
    assert sec.hello(Security(token=TOKEN), (7, b"k" * 32)) == Hello(TOKEN, 7, b"k" * 32).frame()
    assert sec.hello(Security()) == Hello("").frame()


def test_is_one_reads_the_tag_alone():
    assert Hello.is_one({"t": "hello"}) and Probe.is_one({"t": "probe", "bytes": "x"})
    assert not Hello.is_one({"t": "probe"}) and not Hello.is_one(["hello"]) and not Probe.is_one(None)
    assert FrameAnswer.is_one({"t": "answer"})


# ---- every malformed field ----------------------------------------------------------------------

_HELLO = {"t": "hello", "token": TOKEN, "from": 1, "ticket": b"k" * 32}
_ANSWER = {"t": "answer", "error": None}


@pytest.mark.parametrize("record, decoded, field", [
    # not a map at all
    (Hello, ["hello", TOKEN], "must be a map"),
    (Hello, None, "must be a map"),
    (HelloAnswer, b"hello", "must be a map"),
    (FrameAnswer, 0, "must be a map"),
    (Probe, "probe", "must be a map"),
    # the tag
    (Hello, {**_HELLO, "t": "put"}, "field 't'"),
    (Hello, {k: v for k, v in _HELLO.items() if k != "t"}, "field 't'"),
    (HelloAnswer, {"t": "answer"}, "field 't'"),
    (HelloAnswer, {"error": "x"}, "field 't'"),
    (FrameAnswer, {**_ANSWER, "t": "hello"}, "field 't'"),
    (Probe, {"t": 1, "bytes": 1}, "field 't'"),
    # a hello's fields
    (Hello, {**_HELLO, "token": 5}, "field 'token'"),
    (Hello, {**_HELLO, "token": b"bytes"}, "field 'token'"),
    (Hello, {**_HELLO, "token": "t" * (MAX_TOKEN_CHARS + 1)}, "field 'token'"),
    (Hello, {**_HELLO, "from": "1"}, "field 'from'"),
    (Hello, {**_HELLO, "from": True}, "field 'from'"),
    (Hello, {**_HELLO, "from": 1.0}, "field 'from'"),
    (Hello, {**_HELLO, "from": SENDERS[1] + 1}, "field 'from'"),
    (Hello, {**_HELLO, "from": SENDERS[0] - 1}, "field 'from'"),
    (Hello, {**_HELLO, "from": 1 << 63}, "field 'from'"),
    (Hello, {k: v for k, v in _HELLO.items() if k != "from"}, "field 'from'"),
    (Hello, {**_HELLO, "ticket": "k" * 32}, "field 'ticket'"),
    (Hello, {**_HELLO, "ticket": b"k" * (MAX_TICKET_BYTES + 1)}, "field 'ticket'"),
    (Hello, {k: v for k, v in _HELLO.items() if k != "ticket"}, "field 'ticket'"),
    # a hello's answer
    (HelloAnswer, {"t": "refused"}, "field 'error'"),
    (HelloAnswer, {"t": "refused", "error": 5}, "field 'error'"),
    (HelloAnswer, {"t": "refused", "error": "e" * (MAX_REFUSAL_CHARS + 1)}, "field 'error'"),
    # a put's answer
    (FrameAnswer, {"t": "answer"}, "field 'error'"),
    (FrameAnswer, {**_ANSWER, "error": 0}, "field 'error'"),
    (FrameAnswer, {**_ANSWER, "error": ["x"]}, "field 'error'"),
    (FrameAnswer, {**_ANSWER, "error": "e" * (MAX_ANSWER_CHARS + 1)}, "field 'error'"),
    (FrameAnswer, {**_ANSWER, "closing": 1}, "field 'closing'"),
    (FrameAnswer, {**_ANSWER, "closing": "yes"}, "field 'closing'"),
    # a probe
    (Probe, {"t": "probe"}, "field 'bytes'"),
    (Probe, {"t": "probe", "bytes": "many"}, "field 'bytes'"),
    (Probe, {"t": "probe", "bytes": [1]}, "field 'bytes'"),
    (Probe, {"t": "probe", "bytes": True}, "field 'bytes'"),
    (Probe, {"t": "probe", "bytes": 2.5}, "field 'bytes'"),
    (Probe, {"t": "probe", "bytes": -1}, "field 'bytes'"),
    (Probe, {"t": "probe", "bytes": MAX_PROBE_BYTES + 1}, "field 'bytes'"),
])
def test_a_malformed_field_raises_a_wire_error_naming_it(record, decoded, field):
    with pytest.raises(WireError, match=field) as info:
        record.read(decoded)
    assert len(str(info.value)) < 300, "a hostile value is quoted short"


# ---- hostile hellos at a listener, malformed answers at a greeting ------------------------------

def _refusal_on(listener: tcp.Listener, data: bytes) -> HelloAnswer:
    """What ``listener`` answers a connection that sends ``data`` (then closes it)."""
    host, _, port = listener.address.removeprefix("tcp://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=FAST) as raw:
        raw.sendall(data)
        reader = frames.FrameReader(raw)
        try:
            answer = HelloAnswer.read(codec.unpack(reader.read(1 << 16)))
            assert reader.read(1 << 16) is None, "the listener closes the connection after its refusal"
        finally:
            reader.close()
    return answer


def _frame(header) -> bytes:
    return frames.frame(codec.pack(header))


def test_hostile_hellos_are_refused_alike_and_the_listener_keeps_serving():
    admitted = []

    def admit(hello: Hello):
        admitted.append(hello)
        return None if hello.ticket == b"k" * 32 else "no ticket"

    received = []
    listener = tcp.Listener(lambda header, pieces: received.append(header), timeout=FAST,
                            security=Security(token=TOKEN), admit=admit)
    hostile = [
        _frame(["hello", TOKEN]),  # not a map
        _frame({"t": "hello", "token": "t" * (MAX_TOKEN_CHARS + 1)}),  # a frame within HELLO_BYTES still
        _frame({"t": "hello", "token": TOKEN * 100}),  # a frame too long to be a hello
        _frame({"t": "hello", "token": 42, "from": 1, "ticket": b"k" * 32}),
        _frame({"t": "hello", "token": TOKEN, "from": "one", "ticket": b"k" * 32}),
        _frame({"t": "hello", "token": TOKEN, "from": 1 << 40, "ticket": b"k" * 32}),
        _frame({"t": "hello", "token": TOKEN, "from": 1, "ticket": b"k" * 1000}),
        _frame({"t": "hello", "token": TOKEN, "from": 1}),
        _frame({"t": "hello", "token": "not-" + TOKEN, "from": 1, "ticket": b"k" * 32}),
    ]
    try:
        refusals = {_refusal_on(listener, data).refused for data in hostile}
        assert refusals == {sec.refusal("worker")}, "every malformed or wrong hello reads the same refusal"
        assert listener.refused.count == len(hostile) and admitted == [], "admit sees only well-formed hellos"
        assert _refusal_on(listener, _frame({"t": "hello", "token": TOKEN, "from": 2, "ticket": b"x"})).refused \
            == "no ticket"
        with tcp.connect(listener.address, FAST, Security(token=TOKEN), ticket=(1, b"k" * 32)) as sock:
            tcp.send_frame(sock, {"t": "put", "handle": 1, "poison": "x", "kind": "x", "layout": [], "of": 1}, [])
            probe = Probe(4).frame()
            sock.sendall(probe + bytes(4))
            reply = bytearray(len(probe))
            assert frames.recv_exactly(sock, memoryview(reply)) and bytes(reply) == probe
        assert [h.sender for h in admitted] == [2, 1]
        assert [h["handle"] for h in received] == [1]
    finally:
        listener.close()


def _answering(answer: bytes) -> str:
    """A server that reads a hello and answers it with ``answer``, then closes; its address."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(FAST)

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(FAST)
                (n,) = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))
                Hello.read(codec.unpack(conn.recv(n, socket.MSG_WAITALL)))
                conn.sendall(answer)
                time.sleep(0.2)

    threading.Thread(target=serve, daemon=True).start()
    return f"tcp://127.0.0.1:{server.getsockname()[1]}"


def test_a_greeting_refused_raises_authentication_error_and_a_malformed_answer_connect_error():
    with pytest.raises(pw.AuthenticationError, match="refused this process: go away"):
        tcp.connect(_answering(HelloAnswer("go away").frame()), FAST, Security(token=TOKEN))
    tcp.connect(_answering(HelloAnswer().frame()), FAST, Security(token=TOKEN)).close()
    for bad in (_frame({"t": "refused", "error": 5}), _frame({"t": "welcome"}), _frame([1]),
                _frame({"t": "refused", "error": "e" * (MAX_REFUSAL_CHARS + 1)})):
        with pytest.raises(pw.ConnectError, match="answered its greeting with something else") as info:
            tcp.connect(_answering(bad), FAST, Security(token=TOKEN))
        assert not isinstance(info.value, pw.AuthenticationError)
    with pytest.raises(pw.ConnectError, match="did not answer"):
        tcp.connect(_answering(b"\x00\x00\x00\x01\xc1"), FAST, Security(token=TOKEN))


def test_a_malformed_put_answer_is_a_wire_error():
    for bad, error in ((_frame({"t": "answer", "error": 3}), "field 'error'"),
                       (_frame({"t": "answer", "error": None, "closing": "yes"}), "field 'closing'"),
                       (_frame({"t": "nope"}), "field 't'")):
        left, right = socket.socketpair()
        with left, right:
            right.sendall(bad)
            with pytest.raises(WireError, match=error):
                tcp._read_answer(left, time.monotonic() + FAST)
    left, right = socket.socketpair()
    with left, right:
        right.sendall(FrameAnswer("slow", closing=True).frame())
        assert tcp._read_answer(left, time.monotonic() + FAST) == FrameAnswer("slow", True)
