"""Fuzzing what faces the network on the control plane: the controller's Session stream
(gRPC) and worker stream (framed TCP, whose frames are broken too) and its Status and Measure requests, and a worker's Put, Fetch, Stats, Save, Load, Colocated and Profile, with
thousands of generated messages, mostly broken (tests/fuzzing.py). Every broken
message gets an error reply, the servers keep serving a normal client correctly, and
their memory stays bounded. (The data plane is fuzzed in its own test.)"""

import queue
import random
import socket
import threading
import time

import grpc
import numpy as np
import pytest

import pathways as pw
from pathways import cluster
from pathways.controller import server as controller_server
from pathways.protocol import messages as m, operator
from pathways.protocol.handles import COUNTER_MASK, MAX_HANDLE
from pathways.wire import codec, frames, rpc
from tests import fuzzing
from tests.conftest import pids_alive, wait_until, worker_pids
from tests.rawworker import RawWorker

MESSAGES = 3_000
RSS_SLACK = 100 * 1024 * 1024


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class RawStream:
    """A bidirectional stream fed with raw payloads, read on a thread."""

    def __init__(self, channel, service, name):
        self._out = queue.SimpleQueue()
        self.replies = queue.SimpleQueue()
        self._call = rpc.method(channel, service, name, "stream_stream")(iter(self._out.get, None), timeout=300)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for payload in self._call:
                self.replies.put(payload)
        except grpc.RpcError as e:
            self.replies.put(e)

    def send(self, payload):
        self._out.put(payload)

    def close(self):
        self._out.put(None)
        self._call.cancel()

    def until(self, table, predicate, timeout=60):
        """Decoded replies up to and including the first one ``predicate`` accepts."""
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                payload = self.replies.get(timeout=1)
            except queue.Empty:
                continue
            assert not isinstance(payload, Exception), f"the stream broke: {payload}"
            for msg in table.decode_batch(payload):
                got.append(msg)
                if predicate(msg):
                    return got
        raise AssertionError(f"no awaited reply within {timeout} s; got {len(got)} messages")


@pytest.fixture(scope="module")
def target():
    with pw.local_cluster(hosts=2) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == []


def _double_on_island_0(address):
    """A normal client's computation over both hosts, checked."""
    pw.connect(address)
    try:
        s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
        double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
        np.testing.assert_array_equal(np.asarray(double(np.array([1.0, 2.0], np.float32))), [2.0, 4.0])
    finally:
        pw.disconnect()


def test_a_normal_client_is_served_correctly_after_thousands_of_hostile_messages(target):
    rng = random.Random(20261122)
    st = cluster.status(target.address)
    worker_address = st["workers"][0]["address"]
    pids = [target.pids[0], *worker_pids(target.address)]  # the controller and the workers (not their keepers)
    # the baseline is of servers that have served: a worker loads JAX in the background while it
    # attaches and starts its backend on its first computation, which the fuzz must not be blamed for
    _double_on_island_0(target.address)
    before = {pid: rss(pid) for pid in pids}
    channel = rpc.open_channel(target.address)
    wchannel = rpc.open_channel(worker_address)
    try:
        # the Session stream: every refused message gets an Error reply, in order
        session = RawStream(channel, rpc.CONTROLLER_SERVICE, "Session")
        session.send(m.encode_batch([m.Hello(m.PROTOCOL_VERSION, 1.0)]))
        refused = sent = 0
        while sent < MESSAGES:
            payload, n = fuzzing.batch(m.SESSION_UP, rng, 100)
            if rng.random() < 0.1:
                session.send(fuzzing.corrupt(payload, rng))
            else:
                session.send(payload)
                refused += n
            sent += 100
        session.send(m.encode_batch([m.ClusterRequest(987654321)]))
        replies = session.until(m.SESSION_DOWN, lambda x: type(x) is m.ClusterReply and x.req == 987654321)
        errors = [x for x in replies if type(x) is m.Error]
        assert len(errors) >= refused, (len(errors), refused)
        assert not [x for x in replies if type(x) is m.Malformed], "the controller's replies are well formed"
        session.close()

        # the worker stream: every refused message gets a Notice; fake workers it registers
        # stay out of the real island
        # registered first: until then a frame may be at most 64 KiB, and a batch of the fuzz
        # is often more (that limit has its own test below); heartbeats keep it attached
        attach = RawWorker(target.address, timeout=60.0, security=target.security)
        attach.register(island=999)
        attach.keep_alive()
        sent = 0
        while sent < MESSAGES:
            # a fake worker is the one host of an island of its own
            pin = {"island": str(1000 + rng.randrange(100)), "island_hosts": 1, "rank": None}
            payload, _ = fuzzing.batch(m.WORKER_UP, rng, 100, pin=pin)
            attach.send(payload if rng.random() >= 0.1 else fuzzing.corrupt(payload, rng))
            sent += 100
        attach.send(m.pack([["end of fuzz"]]))
        notices = attach.until(lambda x: type(x) is m.Notice and "end of fuzz" in x.message)
        assert len([x for x in notices if type(x) is m.Notice]) > MESSAGES // 2
        attach.close()

        # broken frames: each closes its own connection, and only it
        bystander = RawWorker(target.address, security=target.security)
        over_limit = frames.LENGTH.pack(m.MAX_MESSAGE_BYTES + 1) + bytes(100)
        over_stranger_limit = frames.LENGTH.pack(controller_server.UNREGISTERED_FRAME_BYTES + 1) + bytes(100)
        for broken, registered, end_sending in [
                (over_limit, True, False),  # a registered worker's frames may be 64 MiB, not more
                (over_stranger_limit, False, False),  # before registering, 64 KiB
                (frames.LENGTH.pack(1000) + b"\x91\xa3cut", True, True),  # the connection ends inside a frame
                (b"\0\0", False, True)]:  # ... or inside a length
            raw = RawWorker(target.address, security=target.security)
            try:
                if registered:
                    raw.register(island=1000)
                raw.sock.sendall(broken)
                if end_sending:
                    raw.sock.shutdown(socket.SHUT_WR)
                assert raw.closed_by_peer(10.0), f"the controller kept the connection open after {broken[:6]!r}"
            finally:
                raw.close()
        bystander.send(m.pack([["still here"]]))
        assert "still here" in bystander.until(lambda x: type(x) is m.Notice)[-1].message
        bystander.close()
        wait_until(lambda: len(cluster.status(target.address)["workers"]) == 2, timeout=10.0,
                   what="the fake workers to be dropped, the two real ones left")

        # unary requests to the controller
        measure = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Measure", "unary_unary")
        status = rpc.method(channel, rpc.CONTROLLER_SERVICE, "Status", "unary_unary")
        for i in range(500):
            raw, bad = fuzzing.message(m.MEASURE, rng, start={"timeout": 5.0})
            payload = m.pack(raw) if i % 10 else fuzzing.corrupt(m.pack(raw), rng)
            if bad or i % 10 == 0:
                assert type(operator.STATUS_REPLY.decode_one(measure(payload, timeout=30))) is operator.Failed
            assert operator.STATUS_REPLY.decode_one(status(fuzzing.corrupt(payload, rng), timeout=30)).workers

        # a worker's Fetch, Put and Stats
        fetch = rpc.method(wchannel, rpc.WORKER_SERVICE, "Fetch", "unary_stream")
        put = rpc.method(wchannel, rpc.WORKER_SERVICE, "Put", "stream_unary")
        stats = rpc.method(wchannel, rpc.WORKER_SERVICE, "Stats", "unary_unary")
        for i in range(MESSAGES):
            raw, bad = fuzzing.message(m.FETCH, rng, start={"wait": 0.0})
            try:
                first = codec.unpack(next(iter(fetch(m.pack(raw), timeout=5))))
            except grpc.RpcError as e:
                raise AssertionError(f"fetch {raw!r:.200} broke the call: {e.code()}") from None
            if bad:
                assert first.get("state") == "error", (raw, first)
            header = {"t": "put", "handle": rng.randrange(1 << 40), "layout": fuzzing.LAYOUT, "of": 1,
                      "credential": rng.randbytes(m.CREDENTIAL_BYTES),
                      **codec.pieces_header(np.float32, (2,), [(((0, 2),), np.zeros(2, np.float32))])}
            broken = fuzzing.mutate([header[k] for k in header], rng)
            if isinstance(broken, list) and len(broken) >= len(header):
                header = dict(zip(header, broken))
                if type(header["handle"]) is int and COUNTER_MASK < header["handle"] <= MAX_HANDLE:
                    # a session not open yet is waited for (seconds: test_worker_core covers it)
                    header["handle"] &= COUNTER_MASK
            else:
                header = broken
            chunks = [codec.pack(header), rng.randbytes(rng.choice([0, 3, 8, 100]))]
            if i % 10 == 0:
                chunks = [fuzzing.corrupt(chunks[0], rng)]
            reply = codec.unpack(put(iter(chunks), timeout=10))
            assert "error" in reply or reply == {"ok": True}, reply
        assert type(operator.STATS_REPLY.decode_one(stats(b"\xc1", timeout=10))) is operator.WorkerStats

        # a worker's Save, Load, Colocated and Profile: refused, whatever arrives, with a reply saying why
        for name, table, reply, start in (("Save", m.SAVE, operator.SAVED_REPLY, {"wait": 0.0}),
                                          ("Load", m.LOAD, operator.SAVED_REPLY, None),
                                          ("Colocated", m.COLOCATED, operator.COLOCATED_REPLY, {"wait": 0.0}),
                                          ("Profile", m.PROFILE, operator.PROFILED_REPLY, None)):
            method = rpc.method(wchannel, rpc.WORKER_SERVICE, name, "unary_unary")
            for i in range(300):
                raw, _ = fuzzing.message(table, rng, start=start)
                payload = m.pack(raw) if i % 10 else fuzzing.corrupt(m.pack(raw), rng)
                assert type(reply.decode_one(method(payload, timeout=30))) is operator.Failed, (name, raw)

        # the servers still serve a normal client, correctly
        _double_on_island_0(target.address)
        assert len(cluster.status(target.address)["workers"]) == 2, "the real workers are still there"
        after = {pid: rss(pid) for pid in pids}
        grown = {pid: after[pid] - before[pid] for pid in before}
        assert all(g < RSS_SLACK for g in grown.values()), grown
    finally:
        channel.close()
        wchannel.close()
