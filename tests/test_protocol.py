"""The typed protocol: every message kind round-trips through its table, and everything a
peer can get wrong is refused with a WireError that names the field."""

import dataclasses
import math
import random

import pytest

from pathways import errors
from pathways.errors import AccessDeniedError, PathwaysError, WireError
from pathways.ir import Layout
from pathways.protocol import check as c
from pathways.protocol import data
from pathways.protocol import messages as m
from pathways.protocol import errors as kinds
from pathways.protocol import operator
from pathways.protocol.errors import error_of, kind_of
from pathways.protocol.handles import HeldReleases, discard, first_handle, fits, session_of, value_handle
from pathways.protocol.ops import Op, decode_op, encode_op
from pathways.wire import codec
from tests import fuzzing

TABLES = [m.SESSION_UP, m.SESSION_DOWN, m.WORKER_UP, m.WORKER_DOWN, m.FETCH, m.MEASURE, operator.STATUS_REPLY,
          operator.RETIRE_REPLY, operator.ATTACH_REPLY, operator.STATS_REPLY, operator.TIMELINE_REPLY,
          operator.ADMISSION_CHECK, operator.ADMISSION_REPLY]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_every_message_kind_round_trips_through_its_table(table):
    rng = random.Random(1)
    for cls in table.kinds.values():
        for _ in range(5):
            msg = table.decode(fuzzing.valid(cls, rng))
            assert type(msg) is cls
            assert table.decode_batch(m.encode_batch([msg])) == [msg]


@pytest.mark.parametrize("payload, needle", [
    (b"\xc1\xff\x00garbage", "not valid msgpack"),
    (m.pack({"t": "hello"}), "must be a list of messages"),
])
def test_a_payload_that_is_no_batch_is_refused(payload, needle):
    with pytest.raises(WireError, match=needle):
        m.SESSION_UP.decode_batch(payload)


@pytest.mark.parametrize("raw, needle", [
    (1, "must be a list \\[tag"),
    (["pong"], "unknown message 'pong'"),
    (["hello", 2], "has 1 fields; it takes 2"),
    (["hello", "2", 1.0], "'version' of message 'hello' must be an integer, got str"),
    (["hello", True, 1.0], "must be an integer, got bool"),
    (["hello", 2, float("nan")], "finite number"),
    (["hello", 2, float("inf")], "finite number"),
    (["hello", 2, 0], r"in \(0, 1e\+06\]"),
    (["slice", 1, {"cpu": 1}, 1, None, None, False], "'kind' of message 'slice' must be a string, got dict"),
    (["slice", 1, "qpu", 1, None, None, False], "must be one of"),
    (["slice", 1, "cpu", 1, [2] * 17, None, False], "must have 1 to 16 entries"),
    (["delete", [1, "2"]], "an entry of field 'handles'"),
    (["delete", [-1]], r"must be in \[0,"),
    (["fn", 1, 1, ["x" * 5000, b"", [], [], "jax.export", b"", []]], "at most 1024"),
    (["fn", 1, 1, ["f", b"", [], [], "hlo", b"", []]], "'format' of field 'body' of message 'fn' must be one of"),
    (["fn", 1, 1, ["f", b"", [], [], "xla", b"", []]], "needs its devices"),
    (["fn", 1, 1, ["f", b"", [], [], "xla", b"", [0]]], "needs its devices as a non-empty flat list"),
    (["fn", 1, 1, ["f", b"", [], [], "xla", b"", [0, 1, 0, 1]]], "names a device twice"),
    (["fn", 1, 1, ["f", b"", [[[0], [0, 0], [1], ["x"], [None]]], [], "xla", b"", [0, 0]]], "takes no layouts"),
    (["fn", 1, 1, ["f", b"", [], [], "jax.export", b"opts", []]], "takes no options or devices"),
    (["fn", 1, 1, ["f", b"", [], [], "xla", b"x" * (2 << 20), [0, 0]]],
     "'options' of field 'body' of message 'fn' has"),
    (["fn", 1, 1, ["f", b""]], "'body' of message 'fn' must be a list of its 7 fields"),
    (["fn", 1, 1, "f"], "'body' of message 'fn' must be a list of its 7 fields .*got str"),
    (["run", 1, 1, [[0, 1, 2]], False, False], "a list of 2 entries"),
    (["run", 1, 1, [], 1, False], "'traced' of message 'run' must be true or false"),
    (["timeline", 1, 10 ** 6], "'max_events' of message 'timeline' must be in"),
    (["program", 1, {"nvalues": 2 ** 40}, "parallel"], "nvalues"),
])
def test_a_malformed_message_is_refused_with_its_field_named(raw, needle):
    with pytest.raises(WireError, match=needle):
        m.SESSION_UP.decode(raw)
    [malformed] = m.SESSION_UP.decode_batch(m.pack([raw]))
    assert type(malformed) is m.Malformed and isinstance(malformed.error, WireError)


def test_compiled_round_trips_and_its_lists_must_agree():
    layout = Layout((3,), ((0, 0),), (1,), ("r",), ())
    ok = m.Compiled(first_handle(2) + 1, "", (layout,), (layout,), (("bfloat16", (4, 2)),), (b"\x08\x01",),
                    (b"",), ((0,),), ((1, 0),), (0,), "ab" * 32, "jit_f")
    for table in (m.WORKER_UP, m.SESSION_DOWN):
        assert table.decode_batch(m.encode_batch([ok])) == [ok]
        tokened = dataclasses.replace(ok, token_outs=(0,))
        assert table.decode_batch(m.encode_batch([tokened])) == [tokened]
    assert m.WORKER_UP.decode(m.Compiled(5, "no such op").encode()) == m.Compiled(5, "no such op")
    for broken, needle in [
        (dataclasses.replace(ok, in_shardings=()), "lists of other lengths"),
        (dataclasses.replace(ok, out_types=()), "lists of other lengths"),
        (dataclasses.replace(ok, donated=(1,)), "donates a parameter it does not have"),
        (dataclasses.replace(ok, token_outs=(1,)), "names a token output it does not have"),
        (dataclasses.replace(ok, out_types=(("object", (1,)),)), "not a dtype"),
        (dataclasses.replace(ok, out_types=(("float32", (-1,)),)), "must be in"),
        (dataclasses.replace(ok, in_layouts=((64,),)), "must be in"),
    ]:
        with pytest.raises(WireError, match=needle):
            m.WORKER_UP.decode(broken.encode())


def test_compiled_carries_what_xla_says_of_the_executable_bounded():
    analysis = m.Analysis((("bytes accessed", 6660.0), ("flops", 8960.0), ("fused", True), ("ops", 7)),
                          (("argument_size_in_bytes", 2560), ("temp_size_in_bytes", 1024)), "HloModule jit_f\n")
    ok = m.Compiled(first_handle(2) + 1, "", analysis=analysis)
    for table in (m.WORKER_UP, m.SESSION_DOWN):
        assert table.decode_batch(m.encode_batch([ok])) == [ok]
    assert m.WORKER_UP.decode(m.Compiled(5, "", analysis=m.Analysis()).encode()).analysis == m.Analysis()
    for broken, needle in [
        (dataclasses.replace(analysis, cost=(("flops", math.nan),)), "finite float"),
        (dataclasses.replace(analysis, cost=(("flops", "many"),)), "finite float"),
        (dataclasses.replace(analysis, cost=(("x", 1.0),) * (m.MAX_COST_ENTRIES + 1)), "entries"),
        (dataclasses.replace(analysis, memory=(("heap_in_bytes", 1),)), "must be one of"),
        (dataclasses.replace(analysis, memory=(("temp_size_in_bytes", -1),)), "must be in"),
        (dataclasses.replace(analysis, memory=(("temp_size_in_bytes", 1),) * 2), "one figure twice"),
        (dataclasses.replace(analysis, text="x" * (m.MAX_PROGRAM_TEXT + 1)), "characters"),
    ]:
        with pytest.raises(WireError, match=needle):
            m.WORKER_UP.decode(m.Compiled(5, "", analysis=broken).encode())


def test_an_analysis_keeps_what_the_protocol_carries():
    kept = m.Analysis.kept({"flops": 2.0, "nan": math.nan, "inf": math.inf, "name": "text", "n": 3},
                           {"argument_size_in_bytes": 8, "heap": 4, "temp_size_in_bytes": -1},
                           "x" * (m.MAX_PROGRAM_TEXT + 1))
    assert kept == m.Analysis((("flops", 2.0), ("n", 3)), (("argument_size_in_bytes", 8),), None)
    many = m.Analysis.kept({f"k{i:05d}": float(i) for i in range(m.MAX_COST_ENTRIES + 5)}, None, "HloModule m")
    assert len(many.cost) == m.MAX_COST_ENTRIES and many.cost[0] == ("k00000", 0.0)
    assert many.memory is None and many.text == "HloModule m"
    m.WORKER_UP.decode(m.Compiled(5, "", analysis=many).encode())  # what is kept passes the checks


def test_compile_names_one_worker_per_host_of_an_xla_function():
    fine = m.Compile(1, m.FunctionBody("f", b"", (), (), "xla", b"", (0, 0, 1, 0, 1, 1)), (4, 7))
    assert m.WORKER_DOWN.decode(fine.encode()) == fine
    with pytest.raises(WireError, match="devices on 2 host"):
        m.WORKER_DOWN.decode(dataclasses.replace(fine, workers=(4,)).encode())
    with pytest.raises(WireError, match="distinct worker"):
        m.WORKER_DOWN.decode(dataclasses.replace(fine, workers=(4, 4)).encode())
    # a jax.export function's defaults travel too (older senders name none of them)
    export = m.Compile(1, m.FunctionBody("f", b"", (), ()))
    assert m.WORKER_DOWN.decode(export.encode()) == export and export.body.format == "jax.export"


def test_a_malformed_request_keeps_its_request_id_so_the_caller_hears_back():
    [bad] = m.SESSION_UP.decode_batch(m.pack([["slice", 42, ["cpu"], 1, None, None, False]]))
    assert (bad.tag, bad.req) == ("slice", 42)


CREDENTIAL = bytes(range(m.CREDENTIAL_BYTES))


def test_waits_are_bounded_and_never_nan():
    for wait in (float("nan"), float("inf"), -1.0, m.MAX_WAIT_SECONDS * 2):
        with pytest.raises(WireError, match="'wait'"):
            m.FETCH.decode(["fetch", 1, wait, True, CREDENTIAL, None])
    assert m.FETCH.decode(["fetch", 1, 0, True, CREDENTIAL, None]).wait == 0.0


@pytest.mark.parametrize("credential, needle", [
    (None, "must be binary, got nil"),
    ("0" * m.CREDENTIAL_BYTES, "must be binary, got str"),
    (CREDENTIAL[:-1], f"at least {m.CREDENTIAL_BYTES} are needed"),
    (CREDENTIAL + b"x", f"at most {m.CREDENTIAL_BYTES} are allowed"),
])
def test_a_session_credential_is_exactly_its_length_of_binary(credential, needle):
    for table, raw in ((m.FETCH, ["fetch", 1, 0, True, credential, None]),
                       (m.SESSION_DOWN, ["welcome", 1, credential]),
                       (m.WORKER_DOWN, ["open_session", 1, credential])):
        with pytest.raises(WireError, match=f"'(credential|digest)'.*{needle}"):
            table.decode(raw)
    assert m.WORKER_DOWN.decode(["open_session", 1, m.digest(CREDENTIAL)]) == m.SessionOpen(1, m.digest(CREDENTIAL))


def test_checkers_bound_what_they_accept():
    assert c.Seq(c.Int(0, 9), max_len=3).check([1, 2], "x") == (1, 2)
    with pytest.raises(WireError, match="0 to 3 entries"):
        c.Seq(c.Int(0, 9), max_len=3).check([1] * 4, "x")
    with pytest.raises(WireError, match="at most 4"):
        c.Bytes(4).check(b"12345", "x")
    with pytest.raises(WireError, match="is malformed"):
        c.Custom(lambda raw: raw["k"], lambda v: v).check([], "x")
    assert math.isclose(c.Float(0, 1).check(1, "x"), 1.0)


def test_ops_decode_only_within_their_register_file():
    layout = fuzzing.LAYOUT
    send = [int(Op.SEND), 1, 2, layout, [[1, 1, [[0, 2]]]]]
    op = decode_op(send, nregs=3)
    assert op[0] is Op.SEND and op[4] == ((1, 1, (((0, 2),),)),)
    assert encode_op(decode_op([int(Op.IN), 0, []], 1)) == [0, 0, []]
    assert decode_op([int(Op.IN), 2, [4, 7]], 3) == (Op.IN, 2, (4, 7))  # a copy, and the workers it comes from
    for raw, needle in [([int(Op.IN), 5, []], "register 5 outside 0..2"), ([99, 0], "op code"),
                        (["in", 0, []], "op code"), ([int(Op.EXEC), 1, [0]], "takes 3"),
                        ([int(Op.IN), 0, True], "must be a list"), ([int(Op.IN), 0, [-1]], "entry"),
                        ([int(Op.SEND), 1, 2, layout, [[1, 1, [[0]]]]], "start, stop")]:
        with pytest.raises(WireError, match=needle):
            decode_op(raw, nregs=3)


def test_handle_arithmetic():
    h = first_handle(3) + 5
    assert session_of(h) == 3 and fits(h, 10) and not fits(first_handle(3) + (1 << 40) - 2, 5)
    assert value_handle(0, base=100, tbase=900, nvalues=4, args={0: 7}) == 7
    assert value_handle(2, base=100, tbase=900, nvalues=4, args={}) == 102
    assert value_handle(5, base=100, tbase=900, nvalues=4, args={}) == 901


def test_error_kinds_map_to_the_errors_readers_raise():
    assert type(error_of("WorkerLostError", "x")) is errors.WorkerLostError
    assert type(error_of("NoSuchError", "x", errors.RemoteError)) is errors.RemoteError
    assert kind_of(errors.PlacementError("x")) == "PlacementError"
    assert kind_of(errors.SpmdError("x")) == "PathwaysError"
    # the names other modules use instead of strings are kinds a reader knows
    named = (kinds.REMOTE, kinds.LOST, kinds.DENIED, kinds.SUSPENDED, kinds.STUCK, kinds.EXHAUSTED, kinds.WIRE)
    assert [type(error_of(k, "x")).__name__ for k in named] == list(named)
    assert kinds.POISON_KINDS < set(named)


def test_a_retire_request_names_an_island_or_a_worker_and_waits_a_bounded_time():
    for req in (m.RetireRequest("rack-a", None, 60.0), m.RetireRequest("", 3, 0.0)):
        assert m.RETIRE.decode_one(m.pack(req.encode())) == req
    for raw, needle in ((["retire", "rack-a", 3, 1.0], "an island or a worker, one of the two"),
                        (["retire", "", None, 1.0], "an island or a worker, one of the two"),
                        (["retire", "rack-a", None, -1.0], "finite number in"),
                        (["retire", "rack-a", None, 1e9], "finite number in"),
                        (["retire", "x" * 200, None, 1.0], "at most 128")):
        with pytest.raises(WireError, match=needle):
            m.RETIRE.decode(raw)


def test_a_release_waits_for_the_last_read_of_its_handle_and_only_for_it():
    reads: HeldReleases[str] = HeldReleases()
    reads.reading([1, 1, 2])
    assert reads.release(3, "c"), "a handle nobody reads is freed at once"
    assert not reads.release(1, "a") and not reads.release(2, "b")
    assert reads.read_done([1, 2]) == {2: "b"}, "handle 1 has a read left"
    assert reads.read_done([1]) == {1: "a"}
    assert reads.read_done([1]) == {} and reads.release(1, "a"), "nothing is held twice"
    waiting = {7: {"x", "y"}}
    discard(waiting, 7, "x")
    assert waiting == {7: {"y"}}
    discard(waiting, 7, "y")
    discard(waiting, 8, "z")
    assert waiting == {}, "a handle leaves the table with its last member"


# ---- the data plane's messages (protocol/data.py) ----------------------------------------------

_CREDENTIAL = bytes(range(m.CREDENTIAL_BYTES))
_LAYOUT = Layout((3,), ((0, 0),), (1,), ("x",), (None,)).to_wire()


@pytest.mark.parametrize("put", [
    data.ArrayPut(7, _LAYOUT),
    data.ArrayPut(first_handle(2) + 5, _LAYOUT, credential=_CREDENTIAL, pieces={"array": {"dtype": "float32"},
                                                                                "pieces": []}),
    data.ArrayPut(9, _LAYOUT, senders=3, run=first_handle(1), poison="its sender failed", kind=kinds.LOST),
    data.ArrayPut(9, _LAYOUT, unstack=_LAYOUT),
], ids=["copy", "client put", "poison", "unstacked"])
def test_an_array_put_round_trips_through_its_header(put):
    assert data.ArrayPut.read(codec.unpack(codec.pack(put.header()))) == put


def test_an_array_puts_poison_of_an_unknown_kind_reads_as_a_failed_computation():
    header = {**data.ArrayPut(9, _LAYOUT, poison="no").header(), "kind": "SomethingNewError"}
    assert data.ArrayPut.read(header).kind == kinds.REMOTE


@pytest.mark.parametrize("header, needle", [
    ([], "must be a map"),
    ({"t": "put", "handle": 1, "layout": _LAYOUT}, "lacks field 'of'"),
    ({"t": "get", "handle": 1, "layout": _LAYOUT, "of": 1}, "field 't'"),
    ({"t": "put", "handle": -1, "layout": _LAYOUT, "of": 1}, "field 'handle'"),
    ({"t": "put", "handle": 1, "layout": _LAYOUT, "of": 0}, "field 'of'"),
    ({"t": "put", "handle": 1, "layout": _LAYOUT, "of": 1, "credential": b"short"}, "field 'credential'"),
    ({"t": "put", "handle": 1, "layout": _LAYOUT, "of": 1, "run": "x"}, "field 'run'"),
    ({"t": "put", "handle": 1, "layout": _LAYOUT, "of": 1, "poison": 5}, "field 'poison'"),
    ({"t": "put", "handle": 1, "layout": _LAYOUT, "of": 1, "poison": "x", "kind": "k" * 33}, "field 'kind'"),
])
def test_a_malformed_array_put_is_refused_with_its_field_named(header, needle):
    with pytest.raises(WireError, match=needle):
        data.ArrayPut.read(header)


@pytest.mark.parametrize("reply", [
    data.FetchReply(data.PENDING), data.FetchReply(data.READY),
    data.FetchReply(data.READY, pieces={"array": {"dtype": "int8"}, "pieces": [{"index": [[0, 1]]}]}),
    data.FetchReply.error("AccessDeniedError", "not yours"),
], ids=["pending", "ready", "ready with data", "error"])
def test_a_fetch_reply_round_trips_through_its_header(reply):
    assert data.FetchReply.read(codec.unpack(codec.pack(reply.header()))) == reply


@pytest.mark.parametrize("header, needle", [
    ("ready", "must be a map"), ({}, "field 'state'"), ({"state": "done"}, "field 'state'"),
    ({"state": "error", "kind": 3, "message": "x"}, "field 'kind'"),
    ({"state": "error", "message": "x" * (c.MAX_TEXT + 1)}, "field 'message'"),
])
def test_a_malformed_fetch_reply_is_refused_with_its_field_named(header, needle):
    with pytest.raises(WireError, match=needle):
        data.FetchReply.read(header)


@pytest.mark.parametrize("answer", [data.PutAnswer(), data.PutAnswer("no room"),
                                    data.PutAnswer("not yours", "AccessDeniedError")])
def test_a_put_answer_round_trips_and_a_malformed_one_is_refused(answer):
    assert data.PutAnswer.read(codec.unpack(codec.pack(answer.header()))) == answer
    for bad in ({}, {"ok": 1}, {"error": 5}, {"error": "x", "kind": 5}, ["ok"]):
        with pytest.raises(WireError, match="put answer|put's answer"):
            data.PutAnswer.read(bad)


# ---- the operator's replies (protocol/operator.py) ----------------------------------------

def _status(**worker_fields) -> m.ClusterStatus:
    worker = m.WorkerStatus(**{**dict(worker=3, address="grpc://127.0.0.1:1", data_address="tcp://127.0.0.1:2",
                                      island=0, island_name="0", rank=0, kind="cpu", devices=4, pid=7, host="h",
                                      memory_bytes=1 << 30, flops=None, load=(1, 0, 0, 0), slow=None),
                               **worker_fields})
    island = m.IslandStatus(0, "0", "healthy", True, None, False, False, 1, 1, False, None, 4, 0, 2)
    session = m.SessionStatus(1, 1, 5, 2, 3, "active", weight=1.0, queued=0, inflight=2, completed=9,
                              device_seconds=0.5)
    return m.ClusterStatus("fair", 8, (island,), (worker,), (m.LinkStatus(3, 4, 1e-4, 1e9),), (session,), 1, 5)


def test_a_status_reply_reads_back_as_the_map_users_see():
    status = operator.answer(operator.STATUS_REPLY, operator.reply(_status()))
    seen = status.as_dict()
    assert seen["workers"][0]["load"] == [1, 0, 0, 0] and seen["workers"][0]["flops"] is None
    assert seen["links"] == [{"src": 3, "dst": 4, "latency": 1e-4, "bandwidth": 1e9}]
    assert seen["islands"][0]["state"] == "healthy" and seen["islands"][0]["inflight"] == 2
    # a session shows the suspension's figures only while suspended, the scheduler's once it has them
    assert "suspended_arrays" not in seen["sessions"][0] and seen["sessions"][0]["completed"] == 9
    assert set(m.SessionStatus(2, 0, 0, 0, 0, "active").as_dict()) == {"session", "slices", "arrays", "programs",
                                                                       "nodes", "state"}


@pytest.mark.parametrize("fields, needle", [
    ({"kind": "abacus"}, "field 'kind' of field 'workers'"),
    ({"load": (-1,)}, "field 'load' of field 'workers'"),
    ({"flops": float("nan")}, "finite number"),
])
def test_a_status_reply_with_a_bad_field_is_refused_naming_it(fields, needle):
    with pytest.raises(WireError, match=needle):
        operator.answer(operator.STATUS_REPLY, operator.reply(_status(**fields)))


def test_a_failed_reply_is_raised_as_its_kind_and_an_unknown_kind_is_refused():
    failed = operator.reply(operator.Failed("no island is named 'x'", "PathwaysError"))
    with pytest.raises(PathwaysError, match="no island is named 'x'") as raised:
        operator.answer(operator.RETIRE_REPLY, failed)
    assert type(raised.value) is PathwaysError
    with pytest.raises(AccessDeniedError, match="credential"):
        operator.answer(operator.STATS_REPLY, operator.reply(operator.Failed("wrong credential", "AccessDeniedError")))
    with pytest.raises(WireError, match="'kind'"):
        operator.answer(operator.STATS_REPLY, m.pack(["failed", "boom", "SystemExit"]))
    with pytest.raises(WireError, match="unknown message 'retired' on the stats reply stream"):
        operator.answer(operator.STATS_REPLY, operator.reply(operator.Retired("0", 0, None, (), 0, 0, (), "lost",
                                                                              False)))


def test_worker_stats_read_back_with_the_compile_cache_as_one_map():
    stats = operator.WorkerStats(2, 10, {0: 3, 5: 7}, {5: 1024}, 1 << 30, 4, 3, 1, 2, 0, 0, 1)
    seen = operator.answer(operator.STATS_REPLY, operator.reply(stats)).as_dict()
    assert seen["sessions"] == {0: 3, 5: 7} and seen["session_bytes"] == {5: 1024}
    assert seen["compile_cache"] == {"hits": 1, "misses": 2} and "cache_hits" not in seen
