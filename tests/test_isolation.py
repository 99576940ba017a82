"""Session isolation on a real local cluster: a second client that knows the first client's
handles (they are counters, not secrets: here taken from the first client's arrays) can
neither read, overwrite, delete nor compute on the first client's arrays. Each attempt
fails at once with AccessDeniedError, the first client's arrays and its pending result are
unchanged, and both clients go on working."""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw
from pathways.client.array import Array, _Buffer
from pathways.client.devices import VirtualDeviceSet
from pathways.client.session import Session
from pathways.protocol import messages as m
from pathways.protocol.handles import session_of
from tests.conftest import connected, running_cluster, session_handles, wait_until

QUICK = 3.0  # seconds: a refusal comes at once (a session a worker has not heard of would wait 5 s)
# ~1 s of device time or more on a fast core: long enough for the second client to try
# its put while the first client's result is still pending
SLOW_STEPS = 10_000


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster(pw.Island(hosts=1, devices_per_host=2))


@pytest.fixture
def victim(cluster):
    yield from connected(cluster)


@pytest.fixture
def thief(cluster):
    session = Session(cluster.address)
    yield session
    session.close()


def forged(thief, array, sharding):
    """A pw.Array of the thief's session that names the victim's ``array``."""
    return Array(_Buffer(thief, array.handle, array._buffer.addresses), array.shape, array.dtype, sharding)


def test_a_second_client_cannot_read_write_delete_or_compute_on_the_first_clients_arrays(
        cluster, victim, thief, caplog):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=1)
    secret = pw.device_put(np.arange(4, dtype=np.float32), s.devices)
    np.testing.assert_array_equal(np.asarray(secret), np.arange(4))
    start = np.eye(256, dtype=np.float32) * 0.5
    slow = pw.jit(lambda x: jax.lax.fori_loop(0, SLOW_STEPS, lambda i, m: m + 0.0 * jnp.tanh(m @ m), x),
                  mesh=s.mesh("d"))
    pending = slow(pw.device_put(start, s.devices))
    assert session_of(secret.handle) == victim.id != thief.id
    addresses = secret._buffer.addresses
    mine = VirtualDeviceSet(thief).add_slice(cpu_devices=1)
    assert mine.addresses == addresses, "both clients' arrays live on the one worker"
    caplog.set_level(logging.ERROR, logger="pathways.client")

    # read: refused by the worker, whether the array is computed or still pending
    for target, wait in ((secret, 5.0), (pending, 0.0), (pending, 60.0)):
        t0 = time.monotonic()
        with pytest.raises(pw.AccessDeniedError, match="not that session's"):
            thief.fetch(addresses, target.handle, wait, data=True)
        with pytest.raises(pw.AccessDeniedError):
            thief.fetch(addresses, target.handle, wait, data=False)
        assert time.monotonic() - t0 < QUICK

    # write: under the computed array and under the pending result; the worker refuses the
    # bytes and the controller the notice
    t0 = time.monotonic()
    for target in (secret, pending):
        thief.put(addresses, target.handle, target.sharding.layout(), np.full(target.shape, 666.0, np.float32))
    wait_until(lambda: secret.handle in thief.poisoned and pending.handle in thief.poisoned, QUICK,
               "the worker's refusals of both puts")
    wait_until(lambda: sum("does not belong to this session" in r.getMessage() for r in caplog.records) >= 2,
               QUICK, "the controller's refusals of both put notices")
    assert time.monotonic() - t0 < QUICK
    for target in (secret, pending):
        error, message = thief.poisoned[target.handle]
        assert error is pw.AccessDeniedError and "refused the array" in message and "not that session's" in message
    assert not pending.is_ready(), (f"the result was computed before the put was tried: raise SLOW_STEPS "
                                    f"({SLOW_STEPS}) so that the put meets a pending result")

    # compute: a program of the thief's own bound to the victim's array
    sharding = pw.NamedSharding(mine.mesh("d"), pw.P())
    inc = pw.jit(lambda x: x + 1.0, mesh=mine.mesh("d"))
    t0 = time.monotonic()
    stolen = inc(forged(thief, secret, sharding))
    with pytest.raises(pw.AccessDeniedError, match="belongs to session .*a program reads only arrays"):
        np.asarray(stolen)
    assert time.monotonic() - t0 < QUICK

    # delete: refused by the controller; the victim's buffers stay
    held = session_handles(cluster.address, victim.id)
    t0 = time.monotonic()
    forged(thief, secret, sharding).delete()
    wait_until(lambda: any("to delete belong to other sessions" in r.getMessage() for r in caplog.records),
               QUICK, "the controller's refusal of the delete")
    assert time.monotonic() - t0 < QUICK

    # the victim's arrays are untouched, its pending result is its program's
    np.testing.assert_array_equal(np.asarray(secret), np.arange(4))
    np.testing.assert_array_equal(np.asarray(pending), start)
    assert session_handles(cluster.address, victim.id) == held
    assert all(r.name == "pathways.client" for r in caplog.records)
    # and both clients go on working
    np.testing.assert_array_equal(np.asarray(inc(pw.device_put(np.ones(4, np.float32), mine.devices))), np.full(4, 2.0))
    np.testing.assert_array_equal(np.asarray(pw.jit(lambda x: x * 3.0, mesh=s.mesh("d"))(secret)), np.arange(4) * 3.0)


def test_a_closed_sessions_credential_opens_nothing_and_a_new_session_reads_only_its_own(cluster):
    first = Session(cluster.address)
    try:
        s = VirtualDeviceSet(first).add_slice(cpu_devices=1)
        kept = pw.device_put(np.arange(3, dtype=np.float32), s.devices)
        np.testing.assert_array_equal(np.asarray(kept), np.arange(3))
        handle, addresses = kept.handle, kept._buffer.addresses
    finally:
        first.close()
    second = Session(cluster.address)
    try:
        assert second.id > first.id
        # with its own credential, or with the closed session's (had it leaked)
        address = addresses[0]
        own = second._stubs(address)
        for credential in (second._credential, first._credential):
            second._workers[address] = own._replace(credential=m.worker_credential(credential, address))
            t0 = time.monotonic()
            try:
                with pytest.raises(pw.AccessDeniedError, match=f"its session {first.id} has closed"):
                    second.fetch(addresses, handle, 5.0, data=True)
            finally:
                second._workers[address] = own
            assert time.monotonic() - t0 < QUICK
        mine = VirtualDeviceSet(second).add_slice(cpu_devices=1)
        np.testing.assert_array_equal(np.asarray(pw.device_put(np.ones(2, np.float32), mine.devices)), np.ones(2))
    finally:
        second.close()
