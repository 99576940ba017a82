"""Per-session memory quotas on workers (worker/quota.py, the object store's accounting):
a session past its quota gets ResourceExhaustedError (RESOURCE_EXHAUSTED through the IFRT
proxy) naming the quota, its usage and the request, while other sessions on the same
workers keep serving; a session that deletes arrays goes on; a closed session's memory
goes back to the system."""

import argparse
import time

import numpy as np
import pytest

import pathways as pw
from pathways.cli import parser
from pathways.client.devices import VirtualDeviceSet
from pathways.client.session import Session
from pathways.cluster import status, worker_stats
from pathways.protocol.handles import SESSION_SHIFT
from pathways.worker.quota import SessionQuota, parse_bytes, release_memory, size_text
from pathways.worker.store import ObjectStore, Poison
from tests.conftest import pids_alive, wait_until
from tests.ifrt_helpers import run_jax

MiB = 1 << 20
QUOTA = 64 * MiB
BIG = 10 * MiB  # float32 elements: 40 MiB, so that two of them exceed the quota and one does not


# ---- the accounting alone ---------------------------------------------------------------------

class Value:
    """A stored value of ``nbytes`` (held_bytes counts what has no sharding by its nbytes)."""

    def __init__(self, nbytes):
        self.nbytes = nbytes


def handle(session, n):
    return (session << SESSION_SHIFT) | n


def test_parse_bytes_takes_plain_counts_suffixes_and_none():
    assert parse_bytes("1048576") == MiB
    assert parse_bytes("8G") == parse_bytes("8GiB") == parse_bytes("8gb") == 8 << 30
    assert parse_bytes("512M") == 512 * MiB
    assert parse_bytes("1.5k") == 1536
    assert parse_bytes("none") == parse_bytes("0") == 0
    for bad in ("", "-1G", "8X", "G", "lots"):
        with pytest.raises(ValueError, match="not a size in bytes"):
            parse_bytes(bad)


def test_session_quota_refuses_past_the_limit_naming_quota_usage_and_request():
    quota = SessionQuota(100)
    quota.charge(1, 60)
    assert quota.refusal(1, 40, "a put") is None  # exactly at the limit is allowed
    refusal = quota.refusal(1, 41, "a put of array 0x7")
    assert refusal.startswith("a put of array 0x7 needs 41 bytes")
    for part in ("a put of array 0x7", "41 bytes", "session 1 holds 60 bytes", "quota is 100 bytes",
                 "--session-memory", "Delete arrays"):
        assert part in refusal
    assert quota.refusal(2, 100, "a put") is None  # another session has its own quota
    quota.release(1, 60)
    assert quota.used(1) == 0 and quota.usage() == {}
    assert SessionQuota(0).refusal(1, 1 << 60, "a put") is None  # 0: no limit
    assert size_text(3 * MiB) == "3.0 MiB (3145728 bytes)"


def test_the_store_charges_what_it_holds_and_releases_it_however_it_goes():
    store = ObjectStore(SessionQuota(100))
    a, b, c, d = handle(1, 1), handle(1, 2), handle(1, 3), handle(2, 1)
    assert store.put_charged(a, Value(60)) is None
    assert store.quota.used(1) == 60
    # a run's output past the quota: stored as the error its reader gets
    assert store.put(b, Value(50))
    assert type(store.get(b)) is Poison and store.get(b).kind == "ResourceExhaustedError"
    assert "session 1 holds 60 bytes" in store.get(b).message and store.quota.used(1) == 60
    # a put past it: refused before reading (``refusal``) and when stored (``put_charged``)
    assert "needs 50 bytes" in store.refusal(c, 50, "a put")
    assert "needs 50 bytes" in store.put_charged(c, Value(50))
    # another session is not affected
    assert store.put_charged(d, Value(100)) is None and store.quota.used(2) == 100
    # replacing a value charges the new one instead of the old
    assert store.put_charged(a, Value(30)) is None and store.quota.used(1) == 30
    store.delete([a])
    assert store.quota.used(1) == 0
    assert store.put_charged(c, Value(90)) is None  # deleting made room
    assert store.pop_if(c, store.get(c)) and store.quota.used(1) == 0
    store.put(c, Value(10))
    store.pop(c)
    assert store.quota.used(1) == 0
    # transfer copies (session 0) are never charged
    assert store.put(handle(0, 5), Value(1000)) and store.quota.usage() == {2: 100}
    assert store.wait(handle(0, 5), 0.0, take=True).nbytes == 1000
    assert store.drop_session(2) == (1, 100)
    assert store.quota.usage() == {}


def test_worker_up_and_run_take_the_flag_and_say_what_it_does():
    commands = {a.dest: a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)}
    commands = next(iter(commands.values())).choices
    for name, args in (("worker", ["--controller", "grpc://127.0.0.1:1"]), ("up", []), ("run", ["script.py"])):
        # before the arguments: `pathways run`'s script takes whatever follows its name
        assert commands[name].parse_args(["--session-memory", "8G", *args]).session_memory == 8 << 30
        assert commands[name].parse_args(["--session-memory", "none", *args]).session_memory == 0
        assert commands[name].parse_args(args).session_memory is None  # the worker's default
        assert "75% of the host's memory" in " ".join(commands[name].format_help().split())


def test_release_memory_trims_where_glibc_can():
    assert release_memory() in (True, False)  # False only without glibc's malloc_trim


# ---- on a cluster -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_quota():
    with pw.local_cluster(hosts=1, devices_per_host=2, session_memory=QUOTA) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"


def test_a_session_over_its_quota_gets_resource_exhausted_and_others_keep_serving(small_quota):
    first = Session(small_quota.address)
    second = Session(small_quota.address)
    try:
        s1 = VirtualDeviceSet(first).add_slice(cpu_devices=1)
        s2 = VirtualDeviceSet(second).add_slice(cpu_devices=1)
        assert s1.addresses == s2.addresses, "both sessions' arrays live on the one worker"
        worker = s1.addresses[0]
        double1 = pw.jit(lambda x: x * 2.0, mesh=s1.mesh("d"))
        double2 = pw.jit(lambda x: x * 2.0, mesh=s2.mesh("d"))
        data = np.arange(BIG, dtype=np.float32)

        held = pw.device_put(data, s1.devices)
        np.testing.assert_array_equal(np.asarray(held), data)
        assert worker_stats(worker)["session_bytes"][first.id] == 40 * MiB
        assert worker_stats(worker)["session_memory"] == QUOTA

        # a put past the quota
        refused = pw.device_put(data, s1.devices)
        with pytest.raises(pw.ResourceExhaustedError) as put_error:
            np.asarray(refused)
        for part in ("needs 40.0 MiB", f"session {first.id} holds 40.0 MiB",
                     "quota is 64.0 MiB", "--session-memory"):
            assert part in str(put_error.value)
        # a run whose output would go past it
        with pytest.raises(pw.ResourceExhaustedError, match=r"the output of .* on worker \d+, array .* needs 40.0 MiB"):
            np.asarray(double1(held))

        # the other session, on the same worker, puts, runs and reads what it wants
        theirs = pw.device_put(data[: BIG // 2] + 1.0, s2.devices)
        np.testing.assert_array_equal(np.asarray(double2(theirs)), (data[: BIG // 2] + 1.0) * 2.0)
        assert worker_stats(worker)["session_bytes"][second.id] == 20 * MiB  # the input; the result went

        # the first session deletes its array and goes on
        held.delete()
        refused.delete()
        wait_until(lambda: worker_stats(worker)["session_bytes"].get(first.id, 0) == 0, 20,
                   "the first session's bytes to be released")
        again = pw.device_put(data[: BIG // 2], s1.devices)  # 20 MiB, and 20 more for its result
        np.testing.assert_array_equal(np.asarray(double1(again)), data[: BIG // 2] * 2.0)
    finally:
        first.close()
        second.close()
    wait_until(lambda: not any(worker_stats(w["address"])["session_bytes"]
                               for w in status(small_quota.address)["workers"]), 20, "both sessions' bytes to go")


def test_through_the_ifrt_proxy_a_put_or_an_output_past_the_quota_is_resource_exhausted():
    with pw.local_cluster(hosts=1, devices_per_host=1, ifrt=True, session_memory=QUOTA) as c:
        result = run_jax(c.ifrt_address.removeprefix("grpc://"), f"""
            import json, jax, numpy as np
            data = np.arange({BIG}, dtype=np.float32)
            held = jax.device_put(data)
            held.block_until_ready()
            refused = jax.device_put(data)
            try:
                np.asarray(refused)
                error = ""
            except Exception as e:
                error = f"{{type(e).__name__}}: {{e}}"
            doubled = jax.jit(lambda v: v * 2)(held)  # its output is past the quota too
            try:
                doubled.block_until_ready()
                waited = ""
            except Exception as e:
                waited = f"{{type(e).__name__}}: {{e}}"
            del doubled
            # the session goes on once it frees its array: a delete reaches the worker in
            # the order of the session's runs, and a put may overtake it, so try a few times
            held.delete()
            del refused
            import time
            deadline, again = time.monotonic() + 30, None
            while again is None:
                try:
                    again = float(np.asarray(jax.device_put(data + 1.0))[-1])
                except Exception as e:
                    if "RESOURCE_EXHAUSTED" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            print("RESULT " + json.dumps({{"error": error, "waited": waited, "again": again}}))
        """)
    assert result["again"] == BIG
    # a wait for a run's output that the quota refused fails too, although the run finished
    assert result["waited"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED:"), result["waited"]
    assert "the output of" in result["waited"], result["waited"]
    error = result["error"]
    assert error.startswith("JaxRuntimeError: RESOURCE_EXHAUSTED:"), error  # the status code, as JAX raises it
    assert error.count("RESOURCE_EXHAUSTED") == 1, error  # the data plane's tag is not shown
    assert "quota is 64.0 MiB" in error and "holds 40.0 MiB" in error and "needs 40.0 MiB" in error


def _rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_closed_sessions_memory_goes_back_to_the_system():
    with pw.local_cluster(hosts=1, devices_per_host=1) as c:
        worker = status(c.address)["workers"][0]
        pid, address = worker["pid"], worker["address"]
        assert worker_stats(address)["session_memory"] > 0  # the default quota is on
        before = _rss(pid)
        session = Session(c.address)
        devices = VirtualDeviceSet(session).add_slice(cpu_devices=1).devices
        arrays = [pw.device_put(np.full(64 * MiB, i, np.float32), devices) for i in range(4)]  # 4 x 256 MiB
        for i, a in enumerate(arrays):
            assert float(np.asarray(a)[-1]) == i
        held = _rss(pid)
        assert held - before > 800 * MiB, (before, held)
        del arrays, a
        session.close()
        # the arrays go at once; the trim follows the session's functions in the executor's order
        low = wait_until(lambda: (lambda r: r if held - r > 512 * MiB else None)(_rss(pid)), 30,
                         "the worker's resident memory to fall")
        print(f"worker RSS: {before / MiB:.0f} MiB before, {held / MiB:.0f} MiB holding 1 GiB, "
              f"{low / MiB:.0f} MiB after close")
