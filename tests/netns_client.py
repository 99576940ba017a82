"""Client programs that tests/test_across_machines.py runs inside a network namespace.

``python tests/netns_client.py SCENARIO ADDRESS [ARGS]``: the token comes from PATHWAYS_TOKEN
and the CA certificate (TLS) from PATHWAYS_TLS_CA, as for any client. Each scenario prints
one JSON line last; scenarios that wait for the test print ``ready`` first and read a line
from stdin before they go on.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np

import pathways as pw

for _name in pw.__all__:  # imported now (they are imported when first used): the scenarios time calls
    getattr(pw, _name)


def _islands() -> dict[int, int]:
    """Island id -> hosts, of the healthy islands."""
    st = pw.default_session().cluster()
    return {i["island"]: i["hosts"] for i in st["islands"] if i["healthy"]}


def _island_of(hosts: int) -> int:
    return next(i for i, h in sorted(_islands().items()) if h == hosts)


def _psum_on_two_hosts():
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=_island_of(2))
    assert len(s.workers) == 2, s.workers
    return pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)


def psum() -> dict:
    total = _psum_on_two_hosts()
    return {"psum": np.asarray(total(np.array([3.0, 4.0], np.float32))).tolist()}


def transfer() -> dict:
    """64 MiB from a host of the two-host island to the one-host island and back."""
    vds = pw.make_virtual_device_set()
    there = vds.add_slice(cpu_devices=1, island=_island_of(2))
    here = vds.add_slice(cpu_devices=1, island=_island_of(1))
    double = pw.jit(lambda a: a * 2, mesh=there.mesh("x"))
    shift = pw.jit(lambda a: a + 1, mesh=here.mesh("y"))

    @pw.program
    def there_and_back(a):
        return double(shift(double(a)))

    a = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
    start = time.monotonic()
    out = np.asarray(there_and_back(pw.device_put(a, there.devices)))
    return {"equal": bool(np.array_equal(out, (a * 2 + 1) * 2)), "seconds": time.monotonic() - start}


def host_lost() -> dict:
    """Warm up a program on each island, wait for the test to cut a host of the two-host
    island off, then run on both: the two-host island's run must fail naming the lost host,
    the other island's must keep running."""
    total = _psum_on_two_hosts()
    one = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=_island_of(1))
    inc = pw.jit(lambda a: a + 1, mesh=one.mesh("x"))
    x = np.array([3.0, 4.0], np.float32)
    np.asarray(total(x))
    np.asarray(inc(x))
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    try:
        np.asarray(total(x))
        failure = None
    except pw.PathwaysError as e:
        failure = {"kind": type(e).__name__, "message": str(e)}
    elapsed = time.monotonic() - start
    served = [np.asarray(inc(x)).tolist() for _ in range(3)]
    return {"failure": failure, "seconds": elapsed, "other_island": served}


def controller_lost() -> dict:
    """Start a computation long enough to be pending when the test kills the controller,
    and report what waiting for it gave."""
    one = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=_island_of(1))

    def slow(a):
        return jax.lax.fori_loop(0, 400, lambda i, m: jax.numpy.tanh(m @ m), a)

    f = pw.jit(slow, mesh=one.mesh("x"))
    m = np.eye(512, dtype=np.float32) * 0.5
    np.asarray(f(m))
    pending = [f(m) for _ in range(20)]
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    try:
        for p in pending:
            np.asarray(p)
        failure = None
    except pw.PathwaysError as e:
        failure = {"kind": type(e).__name__, "message": str(e)}
    return {"failure": failure, "seconds": time.monotonic() - start}


def owner() -> dict:
    """Put an array, say its handle and workers, wait for the test (while another client
    tries to take it), and report what the array holds then."""
    s = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=_island_of(1))
    secret = pw.device_put(np.arange(4, dtype=np.float32), s.devices)
    np.asarray(secret)
    print(json.dumps({"handle": secret.handle, "addresses": list(secret._buffer.addresses)}), flush=True)
    sys.stdin.readline()
    return {"value": np.asarray(secret).tolist()}


def thief(handle: str, addresses: str) -> dict:
    """Knowing another client's handle and workers: try to read, overwrite and delete its
    array; report how each attempt ended."""
    from pathways.client.array import Array, _Buffer

    session = pw.default_session()
    where, target = tuple(json.loads(addresses)), int(handle)
    mine = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=_island_of(1))
    sharding = pw.NamedSharding(mine.mesh("d"), pw.P())
    tried = {}
    start = time.monotonic()
    try:
        session.fetch(where, target, 5.0, data=True)
        tried["read"] = "served"
    except pw.PathwaysError as e:
        tried["read"] = type(e).__name__
    session.put(where, target, sharding.layout(), np.full(4, 666.0, np.float32))
    deadline = time.monotonic() + 10
    while target not in session.poisoned and time.monotonic() < deadline:
        time.sleep(0.05)
    tried["overwrite"] = session.poisoned[target][0].__name__ if target in session.poisoned else "accepted"
    Array(_Buffer(session, target, where), (4,), np.dtype(np.float32), sharding).delete()
    tried["seconds"] = time.monotonic() - start
    return tried


def refused(address: str) -> dict:
    """Connect with whatever token and CA the environment gives, and report how long the
    refusal (if any) took and what it said."""
    start = time.monotonic()
    try:
        pw.connect(address)
        pw.make_virtual_device_set().add_slice(cpu_devices=1)
        outcome = {"kind": None, "message": ""}
    except pw.PathwaysError as e:
        outcome = {"kind": type(e).__name__, "message": str(e)}
    return {**outcome, "seconds": time.monotonic() - start}


SCENARIOS = {"psum": psum, "transfer": transfer, "host_lost": host_lost, "controller_lost": controller_lost,
             "owner": owner, "thief": thief}


def main() -> None:
    scenario, address, *args = sys.argv[1:]
    if scenario == "refused":
        print(json.dumps(refused(address)), flush=True)
        return
    pw.connect(address)
    print(json.dumps(SCENARIOS[scenario](*args)), flush=True)


if __name__ == "__main__":
    main()
