"""Islands of several hosts: multi-host SPMD, gang scheduling across clients, lost workers.

Every test here runs real clusters: worker processes of one island form a jax.distributed
group, and clients are separate processes.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.cluster import status
from tests.conftest import connected, read_line, running_cluster, wait_until


@pytest.fixture(scope="module")
def islands():
    """Island 0: two hosts of one device each (one jax.distributed group); island 1: one
    host of two devices."""
    yield from running_cluster(pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=1, devices_per_host=2))


@pytest.fixture
def client(islands):
    yield from connected(islands)


def test_a_slice_spans_the_hosts_of_its_island_and_runs_one_spmd_program(client):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
    assert s.island == 0 and len(s.workers) == 2, "two one-device hosts hold a two-device slice"
    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)
    np.testing.assert_array_equal(np.asarray(total(np.array([3.0, 4.0], np.float32))), [7.0, 7.0])

    mesh = s.mesh("x")
    rows = pw.jit(lambda a: a * 10 + a.sum(), mesh=mesh, in_shardings=pw.P("x"), out_shardings=pw.P("x"))
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    sharded = pw.device_put(a, pw.NamedSharding(mesh, pw.P("x")))
    np.testing.assert_array_equal(np.asarray(sharded), a)  # assembled from both hosts' rows
    np.testing.assert_array_equal(np.asarray(rows(sharded)), a * 10 + a.sum())


def test_programs_move_arrays_between_a_multi_host_slice_and_another_island(client):
    vds = pw.make_virtual_device_set()
    wide = vds.add_slice(cpu_devices=2, island=0)
    local = vds.add_slice(cpu_devices=2, island=1)
    double = pw.jit(lambda a: a * 2, mesh=wide.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))
    shift = pw.jit(lambda a: a + 1, mesh=local.mesh("y"), in_shardings=pw.P(None, "y"), out_shardings=pw.P("y"))

    @pw.program
    def there_and_back(a):
        return double(shift(double(a)))

    a = np.arange(12, dtype=np.float32).reshape(4, 3)[:, :2]
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(there_and_back(a)), (a * 2 + 1) * 2)


def test_thousands_of_queued_collectives_on_one_host_of_two_devices_all_run(client):
    """XLA's CPU runtime deadlocks (and aborts the worker 40 s later) once a few dozen
    computations with collectives between one host's devices are queued; the worker keeps
    fewer than that running, so a client may queue as many as it likes."""
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=1)
    assert len(s.workers) == 1

    def mix(x):  # six collectives, exact in int32
        for _ in range(6):
            x = (x + jax.lax.psum(x, "i")) % 1009
        return x

    def mix_here(x):
        for _ in range(6):
            x = (x + x.sum(axis=0)) % 1009
        return x

    step = pw.pmap(mix, devices=s.devices)
    x = np.arange(2 * 16 * 16, dtype=np.int32).reshape(2, 16, 16)
    want = x
    step(x).block_until_ready(timeout=60)  # compiled: the calls below queue at once
    y = x
    for _ in range(2000):
        y = step(y)
    for _ in range(2000):
        want = mix_here(want)
    np.testing.assert_array_equal(y.to_numpy(timeout=60), want)


CLIENT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import pathways as pw

    address, order, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    until_wrong = sys.argv[4:] == ["until-wrong"]  # stop at the first wrong result
    pw.connect(address)
    vds = pw.make_virtual_device_set()
    a, b = vds.add_slice(cpu_devices=2, island=0), vds.add_slice(cpu_devices=2, island=0)
    f = pw.pmap(lambda x: jax.lax.psum(x * 2.0, "i"), devices=a.devices)
    g = pw.pmap(lambda x: jax.lax.psum(x + 1.0, "i"), devices=b.devices)

    @pw.program
    def f_then_g(x):
        return f(x), g(x)

    @pw.program
    def g_then_f(x):
        y = g(x)
        return f(x), y

    program = f_then_g if order == "fg" else g_then_f
    np.asarray(program(np.zeros(2, np.float32))[0])
    print("ready", flush=True)
    sys.stdin.readline()
    wrong, error, pending = 0, None, []
    try:
        for i in range(iterations):
            pending.append((i, program(np.array([i, i + 1], np.float32))))
            if len(pending) == 16 or i == iterations - 1:
                for j, (fx, gx) in pending:
                    if not (np.all(fx.to_numpy(timeout=20) == 2 * (2 * j + 1))
                            and np.all(gx.to_numpy(timeout=20) == 2 * j + 3)):
                        wrong += 1
                pending = []
                if until_wrong and wrong:
                    break
    except pw.PathwaysError as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"wrong": wrong, "error": error}), flush=True)
""")


def run_clients(address, orders, iterations, victim=False, until_wrong=False):
    """Start one client process per order, release them together, and return each one's
    report. With ``victim``, one more client starts the same work and is SIGKILLed; with
    ``until_wrong``, a client stops at its first wrong result."""
    more = ["until-wrong"] if until_wrong else []
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, address, order, str(iterations), *more],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for order in (*orders, *(("fg",) if victim else ()))]
    try:
        for p in procs:
            assert read_line(p, 120).strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        if victim:
            time.sleep(0.5)
            procs[-1].kill()
        return [json.loads(read_line(p, 240)) for p in procs[:len(orders)]]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_clients_submitting_in_opposite_orders_never_deadlock_and_stay_correct(islands):
    """Two clients run programs whose SPMD computations span the same two hosts, in
    opposite orders, hundreds of times; a third client dies in the middle of its run."""
    before = {c["session"] for c in status(islands.address)["sessions"]}
    reports = run_clients(islands.address, ["fg", "gf"], 200, victim=True)
    assert reports == [{"wrong": 0, "error": None}] * 2
    wait_until(lambda: {c["session"] for c in status(islands.address)["sessions"]} <= before,
               what="the clients' sessions closed")
    assert all(i["healthy"] and i["inflight"] == 0 for i in status(islands.address)["islands"])


def test_without_the_gang_order_the_same_workload_is_unsafe():
    """The debug switch lets each worker interleave the clients' runs by itself. The same
    workload then pairs collectives of different computations across hosts: results come
    out wrong, or the collectives hang until the clients' deadlines."""
    with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1)], unsafe_local_order=True) as c:
        reports = run_clients(c.address, ["fg", "gf"], 200, until_wrong=True)
    assert any(r["wrong"] or r["error"] for r in reports), reports


HALF_PUT = textwrap.dedent("""
    import os, sys, time
    import jax, numpy as np
    import pathways as pw
    from pathways.client.session import Session

    pw.connect(sys.argv[1])
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)
    total(np.ones(2, np.float32)).block_until_ready(timeout=60)
    put = Session.put
    Session.put = lambda self, addresses, *rest: put(self, addresses[:1], *rest)  # one host only
    total(np.ones(2, np.float32))  # its second host waits for an input that never comes
    time.sleep(0.5)
    print("ready", flush=True)
    os._exit(0)  # the client dies without a word
""")


def test_a_client_dying_mid_put_does_not_stall_the_island(client, islands):
    """The dead client's computation spans both hosts of island 0, but only one host got its
    input. Once the client is gone, the other host runs the computation on placeholders so
    its peer's collective completes, and the island serves others at once rather than after
    the workers' input deadline."""
    proc = subprocess.Popen([sys.executable, "-c", HALF_PUT, islands.address], stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(proc, 120).strip() == "ready"
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=s.devices)
    for i in range(10):
        np.testing.assert_array_equal(total(np.full(2, i, np.float32)).to_numpy(timeout=30), [2.0 * i] * 2)


SLOW = 300  # matmul steps of a run on the island that loses a host: a few seconds of work


def test_a_killed_worker_fails_its_islands_futures_quickly_and_the_rest_keeps_serving():
    # no restarts: the island stays healing, with its survivor alone, for the status checked below
    with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1),
                                   pw.Island(hosts=1, devices_per_host=1)], restart_workers=False) as c:
        vds = pw.make_virtual_device_set()
        doomed = vds.add_slice(cpu_devices=2, island=0)
        safe = vds.add_slice(cpu_devices=1, island=1)

        def slow(x):
            w = jax.numpy.eye(x.shape[-1], dtype=x.dtype) * 0.5
            return jax.lax.fori_loop(0, SLOW, lambda i, y: jax.numpy.tanh(y @ w) + y, x)

        heavy = pw.jit(slow, mesh=doomed.mesh("x"), in_shardings=pw.P("x"), out_shardings=pw.P("x"))
        light = pw.jit(lambda x: x * 3, mesh=safe.mesh("x"))
        kept = pw.device_put(np.ones((2, 256), np.float32), pw.NamedSharding(doomed.mesh("x"), pw.P("x")))
        kept.block_until_ready(timeout=60)
        x = np.ones((256, 256), np.float32)
        heavy(x).block_until_ready(timeout=120)  # compiled and warm

        outs = [heavy(x) for _ in range(4)]
        other = light(np.arange(3, dtype=np.float32))
        time.sleep(0.5)  # the first run is computing
        rank1 = next(w for w in status(c.address)["workers"] if w["island"] == 0 and w["rank"] == 1)
        rank0 = next(w for w in status(c.address)["workers"] if w["island"] == 0 and w["rank"] == 0)
        os.kill(rank1["pid"], signal.SIGKILL)
        killed = time.monotonic()
        errors = []
        for out in outs:
            try:
                out.block_until_ready(timeout=60)
                errors.append(None)
            except pw.PathwaysError as e:
                errors.append(e)
        assert all(isinstance(e, pw.WorkerLostError) and "was lost" in str(e) for e in errors), errors
        assert time.monotonic() - killed < 10, "futures must fail within seconds"
        with pytest.raises(pw.WorkerLostError):
            np.asarray(kept)
        with pytest.raises(pw.WorkerLostError):
            heavy(x).block_until_ready(timeout=30)

        np.testing.assert_array_equal(np.asarray(other), [0.0, 3.0, 6.0])
        st = status(c.address)
        assert [i["healthy"] for i in st["islands"]] == [False, True]
        # the island's other host restarts and joins it again, to heal it with whatever replaces the lost host
        wait_until(lambda: [i["hosts"] for i in status(c.address)["islands"]] == [1, 1],
                   what="the island's other host to join it again")
        assert rank0["pid"] not in [w["pid"] for w in status(c.address)["workers"]], "a new process"
        cli = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", c.address],
                             capture_output=True, text=True, timeout=60)
        assert "island 0: HEALING (1 of 2 hosts joined again" in cli.stdout, cli.stdout
        assert "was lost" in cli.stdout and "island 1: healthy" in cli.stdout, cli.stdout
        assert "lost, not restarted: 1 of its 2 host(s) gone" in cli.stdout, cli.stdout

        fresh = pw.make_virtual_device_set().add_slice(cpu_devices=1)
        assert fresh.island == 1, "new slices go to healthy islands"
        with pytest.raises(pw.PlacementError, match="assembling"):
            pw.make_virtual_device_set().add_slice(cpu_devices=2, island=0)
        again = pw.jit(lambda x: x - 1, mesh=fresh.mesh("x"))
        np.testing.assert_array_equal(np.asarray(again(np.ones(2, np.float32))), [0.0, 0.0])
