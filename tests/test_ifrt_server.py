"""The IFRT proxy server with real JAX clients: unmodified programs under
JAX_PLATFORMS=proxy in a subprocess, against a local cluster of two islands (2 hosts x 1
device, 1 host x 2 devices) and an IfrtServer in this process; plus its pure parts."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from ifrt_helpers import PRELUDE, Proxy, RawStream, run_jax, session_metadata, silent_streams
from pathways.client.fetches import Fetches
from pathways.cluster import Island, LocalCluster, status, stop_processes, worker_stats
from pathways.ifrt import types as t
from pathways.ifrt.devices import DeviceTable, SliceInfo
from pathways.proto.xla import xla_data_pb2
from pathways.proto.xla.python.ifrt import serdes_pb2, sharding_pb2, sharding_serdes_pb2
from pathways.proto.xla.python.ifrt_proxy.common import types_pb2
from pathways.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as gpb
from pathways.proto.xla.python.ifrt_proxy.common import ifrt_service_pb2 as pb
from pathways.ifrt import plugin
from pathways.ifrt import server as ifrt_server
from pathways.ifrt.server import MAX_ADMISSION_BYTES, IfrtServer, _lookup_response, _store_data
from pathways.ifrt.handling import STREAMED_PUT_BYTES, IfrtArray, IfrtExecutable
from pathways.ifrt.session import IfrtSession, parse_slice
from pathways.protocol import messages as m, operator
from tests.conftest import connected_to, read_line, wait_until

@pytest.fixture(scope="module")
def server():
    cluster = LocalCluster([Island(2, 1), Island(1, 2)]).start()
    ifrt = IfrtServer(cluster.address)
    try:
        ifrt.start()
        yield ifrt
    finally:
        ifrt.stop()
        cluster.stop()


def test_devices_and_round_trip(server):
    result = run_jax(server.address, """
        import json
        import numpy as np
        devices = jax.devices()
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        back = np.asarray(jax.device_put(x))
        on_last = jax.device_put(np.arange(5, dtype=np.int32), devices[3])
        print("RESULT", json.dumps({
            "n": len(devices), "processes": jax.process_count(), "index": jax.process_index(),
            "local": len(jax.local_devices()), "platform": devices[0].platform,
            "ids": [d.id for d in devices], "islands": [d.island for d in devices],
            "slices": [d.slice_index for d in devices],
            "hosts": [d.host for d in devices], "kinds": [d.device_kind for d in devices],
            "round_trip": back.tolist(), "on_last": np.asarray(on_last).tolist(),
            "last_device": [d.id for d in on_last.devices()]}))
    """)
    assert result["n"] == 4 and result["processes"] == 1 and result["index"] == 0 and result["local"] == 4
    assert result["platform"] == "cpu" and result["kinds"] == ["cpu"] * 4
    assert result["ids"] == [0, 1, 2, 3]
    assert result["islands"] == [0, 0, 1, 1] and result["hosts"] == [0, 1, 0, 0]
    assert result["slices"] == result["islands"], "slice_index is the island, as pathwaysutils reads it"
    assert result["round_trip"] == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    assert result["on_last"] == list(range(5)) and result["last_device"] == [3]


def test_jit(server):
    result = run_jax(server.address, """
        import json
        import numpy as np
        import jax.numpy as jnp
        x = jax.device_put(np.arange(8, dtype=np.float32))
        y = jax.jit(lambda a: a * 2 + 1)(x)
        z = jax.jit(lambda a, b: (a @ b).sum())(jnp.ones((4, 3)), jnp.ones((3, 2)))
        print("RESULT", json.dumps({"y": np.asarray(y).tolist(), "z": float(z)}))
    """)
    assert result["y"] == (np.arange(8, dtype=np.float32) * 2 + 1).tolist()
    assert result["z"] == 24.0


def test_a_wait_for_a_jit_output_and_a_read_of_a_small_one_ask_no_worker(server, monkeypatch):
    """The controller tells the front end when a jit call's outputs are computed, with the
    bytes of the small ones (client/computed.py): only a large output's read asks a worker."""
    asked = []  # (handle, data) of each fetch the front end's sessions make
    fetch = Fetches.fetch

    def counted(self, addresses, handle, wait, data, *args, **kwargs):
        asked.append((handle, data))
        return fetch(self, addresses, handle, wait, data, *args, **kwargs)
    monkeypatch.setattr(Fetches, "fetch", counted)
    result = run_jax(server.address, """
        import json
        import numpy as np
        step = jax.jit(lambda v: v * 2 + 1)
        y = jax.device_put(np.arange(8, dtype=np.float32))
        for _ in range(20):
            y = step(y)
            y.block_until_ready()
        small = np.asarray(y)
        large = np.asarray(jax.jit(lambda v: jax.numpy.tile(v, 1000))(y))  # 32,000 bytes
        # outputs maybe not computed yet, assembled at once: the front end waits for them in
        # the thread that serves the session's requests in order
        pair = jax.devices()[2:]
        halves = [step(jax.device_put(np.full(2, i, np.float32), d)) for i, d in enumerate(pair)]
        mesh = jax.sharding.Mesh(np.array(pair), ("x",))
        whole = jax.make_array_from_single_device_arrays(
            (4,), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")), halves)
        print("RESULT", json.dumps([small.tolist(), large[-8:].tolist(), large.size, np.asarray(whole).tolist()]))
    """)
    expected = np.arange(8, dtype=np.float32)
    for _ in range(20):
        expected = expected * 2 + 1
    assert result == [expected.tolist(), expected.tolist(), 8000, [1.0, 1.0, 3.0, 3.0]]
    # only the reads of the large output and of the assembled array (put from the halves'
    # values, which came with the news) ask a worker
    assert [data for _, data in asked] == [True, True], asked


def test_small_outputs_split_over_devices_in_any_order_read_back_exactly():
    """A small jit output split over a host's devices is read from each device's buffer,
    whatever order its sharding lists them in (a transpose of the input's mesh here): only
    an output on one device, or replicated, comes whole with the news that it was computed."""
    cluster = LocalCluster([Island(1, 4)]).start()
    ifrt = IfrtServer(cluster.address)
    try:
        ifrt.start()
        result = run_jax(ifrt.address, """
            import json
            import numpy as np
            from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
            mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
            x = np.arange(16, dtype=np.int32).reshape(8, 2)
            arr = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
            f = jax.jit(lambda v: (v.T, v * 2, v.sum()), out_shardings=(
                NamedSharding(mesh, P("y", "x")), NamedSharding(mesh, P("x")), NamedSharding(mesh, P())))
            print("RESULT", json.dumps([np.asarray(o).tolist() for o in f(arr)]))
        """)
    finally:
        ifrt.stop()
        cluster.stop()
    x = np.arange(16, dtype=np.int32).reshape(8, 2)
    assert result == [x.T.tolist(), (x * 2).tolist(), int(x.sum())], result


def test_sharded_jit(server):
    result = run_jax(server.address, """
        import json
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        island1 = [d for d in jax.devices() if d.island == 1]
        mesh = Mesh(np.array(island1), ("x",))
        s = NamedSharding(mesh, P("x"))
        x = jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), s)
        y = jax.jit(lambda a: a * 3, out_shardings=s)(x)
        total = jax.jit(lambda a: a.sum())(y)
        print("RESULT", json.dumps({"x": np.asarray(x).tolist(), "y": np.asarray(y).tolist(),
                                    "total": float(total),
                                    "shards": [list(map(int, sh.data.shape)) for sh in y.addressable_shards]}))
    """)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert result["x"] == x.tolist() and result["y"] == (x * 3).tolist()
    assert result["total"] == float((x * 3).sum()) and result["shards"] == [[2, 2], [2, 2]]


def test_executables_without_outputs_run_and_ask_the_controller_for_nothing_it_refuses(server, caplog):
    """JAX drops an unused parameter, so ``jit(lambda v: ())`` compiles to an executable of
    no parameter and no output: its runs succeed, and the server's session asks the
    controller for nothing (a program needs a value; asking would be refused). With the
    parameter kept, the executable runs as a program of one value and no output."""
    caplog.set_level(logging.ERROR, logger="pathways")
    result = run_jax(server.address, """
        import json
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        x = jax.device_put(np.arange(4, dtype=np.float32))
        rows = jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(Mesh(jax.devices()[:2], ("x",)), P("x")))
        nothing = [jax.jit(lambda v: ())(x) for _ in range(2)]
        kept = [jax.jit(lambda v: (), keep_unused=True)(a) for a in (x, rows, x)]
        print("RESULT", json.dumps({"nothing": nothing, "kept": kept,
                                    "after": np.asarray(jax.jit(lambda v: v + 1)(x)).tolist()}))
    """)
    assert result == {"nothing": [[], []], "kept": [[], [], []], "after": [1.0, 2.0, 3.0, 4.0]}
    refused = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not refused, f"the controller refused the session's requests: {refused}"


# ---- pure parts -------------------------------------------------------------------------------

def _table():
    return DeviceTable([SliceInfo(7, "cpu", 1, (5,), ("b:1",), ((0, 0), (0, 1))),
                        SliceInfo(3, "cpu", 0, (1, 2), ("a:1", "a:2"), ((1, 0), (0, 0)))])


def test_an_unreduced_array_made_of_partial_values_keeps_each_devices_own(server):
    result = run_jax(server.address, """
        import json
        import numpy as np
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        out = {}
        for name, devs in (("hosts", jax.devices()[:2]), ("host", jax.devices()[2:4])):
            mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devs)
            unreduced = NamedSharding(mesh, P(None, unreduced={"x"}))
            parts = [jax.device_put(np.full((2, 3), i + 1.0, np.float32), d) for i, d in enumerate(devs)]
            made = jax.make_array_from_single_device_arrays((2, 3), unreduced, parts)
            out[name] = {"shards": [np.asarray(s.data).tolist() for s in made.addressable_shards],
                         "sum": np.asarray(jax.sharding.reshard(made, NamedSharding(mesh, P()))).tolist()}
            with jax.set_mesh(mesh):
                x = jax.device_put(np.arange(4.0, dtype=np.float32), P("x"))
                partial = jax.jit(lambda v: jnp.einsum("a,a->", v, v, out_sharding=P(unreduced={"x"})))(x)
                again = jax.make_array_from_single_device_arrays((), partial.sharding,
                                                                 [s.data for s in partial.addressable_shards])
                out[name]["dot"] = float(jax.sharding.reshard(again, P()))
        print("RESULT", json.dumps(out))
    """)
    for name in ("hosts", "host"):
        assert result[name]["shards"] == [[[1.0] * 3] * 2, [[2.0] * 3] * 2], "each device's own partial value"
        assert result[name]["sum"] == [[3.0] * 3] * 2 and result[name]["dot"] == 14.0, result[name]


def test_large_arrays_stream_through_the_front_end_and_round_trip(server):
    """Arrays beyond STREAMED_PUT_BYTES go to a worker that holds them whole as their host
    buffer arrives, and reads come back as the worker sends them; arrays spread over
    hosts go whole. Every way round trips exactly, and computes."""
    result = run_jax(server.address, """
        import json
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        devices = jax.devices()
        x = np.random.default_rng(0).standard_normal((768, 1024)).astype(np.float32)  # 3 MiB
        one_host = Mesh(np.array(devices[2:4]), ("d",))  # island 1: one host, 2 devices
        two_hosts = Mesh(np.array(devices[:2]), ("d",))  # island 0: a device on each of 2 hosts
        placed = {
            "device": jax.device_put(x, devices[2]),
            "split on one host": jax.device_put(x, NamedSharding(one_host, PartitionSpec("d"))),
            "replicated on one host": jax.device_put(x, NamedSharding(one_host, PartitionSpec())),
            "split over hosts": jax.device_put(x, NamedSharding(two_hosts, PartitionSpec("d"))),
            "replicated over hosts": jax.device_put(x, NamedSharding(two_hosts, PartitionSpec())),
        }
        same = {name: bool(np.array_equal(np.asarray(a), x)) for name, a in placed.items()}
        doubled = {name: bool(np.array_equal(np.asarray(jax.jit(lambda v: v * 2)(a)), x * 2))
                   for name, a in placed.items()}
        print("RESULT", json.dumps({"same": same, "doubled": doubled}))
    """)
    assert all(result["same"].values()), result["same"]
    assert all(result["doubled"].values()), result["doubled"]


def test_a_loop_that_queues_hundreds_of_sharded_steps_runs_them_all(server):
    """JAX's client opens a host-buffer store per shard it sends, all at once: 600 queued
    steps, each putting two host arrays split over 2 devices, are 2,400 stores in flight,
    more than gRPC queues by default before it cancels calls (and the client then drops its
    session). Every step runs, with the client's stores unbounded and with the bound the pathways
    plugin sets."""
    body = """
        import json, os
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        mesh = Mesh(np.array(jax.devices()[2:4]), ("d",))
        split, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
        step = jax.jit(lambda w, x, y: w + (x * y).sum(), in_shardings=(whole, split, split), out_shardings=whole)
        w = jax.device_put(np.float32(0), whole)
        x = np.ones((8, 4), np.float32)
        for i in range(600):
            w = step(w, x, x * i)
        print("RESULT", json.dumps({"w": float(w), "stores": os.environ.get(
            "IFRT_PROXY_GRPC_MAX_ONGOING_HOST_BUFFER_STORES")}))
    """
    stores = "IFRT_PROXY_GRPC_MAX_ONGOING_HOST_BUFFER_STORES"
    for extra, expected in (({stores: "0"}, "0"), ({}, plugin.TRANSFER_LIMITS[stores])):  # 0: no bound
        out = subprocess.run([sys.executable, "-c", PLUGIN + textwrap.dedent(body)], capture_output=True, text=True,
                             env=_proxy_env(server.address, **extra), timeout=240)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        assert out.returncode == 0 and lines, out.stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT "):])
        assert result == {"w": 32 * sum(range(600)), "stores": expected}


def test_hundreds_of_queued_donating_steps_with_collectives_on_one_host_all_run(server):
    """XLA's CPU runtime deadlocks once a few dozen computations with collectives between
    one process's devices are queued; the worker keeps fewer running, and tells when one is
    done by XLA's token of the run, since each step's output is donated to the next (and
    deleted) before anyone waits for it. The client queues the steps several times faster
    than the worker runs them, so the queue stays far deeper than a few dozen."""
    steps = 600
    body = f"""
        import json
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        mesh = Mesh(np.array(jax.devices()[2:4]), ("d",))  # the island of one host with two devices
        split = NamedSharding(mesh, PartitionSpec("d"))

        def mix(x):  # six all-gathers and all-reduces; whole numbers, exact in float32
            for _ in range(6):
                x = (x + ((x @ x.T) % 7).sum()) % 7
            return x

        step = jax.jit(mix, in_shardings=split, out_shardings=split, donate_argnums=0)
        start = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) % 7
        step(jax.device_put(start, split)).block_until_ready()  # compiled: the steps below queue at once
        x = jax.device_put(start, split)
        for i in range({steps}):
            x = step(x)
        print("RESULT", json.dumps(np.asarray(x).tolist()))
    """
    out = subprocess.run([sys.executable, "-c", PLUGIN + textwrap.dedent(body)], capture_output=True, text=True,
                         env=_proxy_env(server.address), timeout=240)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    want = np.arange(128 * 64, dtype=np.float64).reshape(128, 64) % 7
    for _ in range(steps * 6):
        want = (want + ((want @ want.T) % 7).sum()) % 7
    assert json.loads(lines[-1][len("RESULT "):]) == want.tolist()


@pytest.fixture(scope="module")
def in_controller():
    """A local cluster of one host with 2 devices whose controller serves IFRT itself, in its
    own process (as `pathways up --ifrt-port` does): its front end puts large arrays on the
    workers' data listeners."""
    cluster = LocalCluster([Island(1, 2)], ifrt_port=0).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_the_controllers_front_end_streams_large_arrays_on_the_data_plane_and_they_round_trip(in_controller):
    """In the controller's process, the front end sends an array a worker holds whole on
    that worker's data listener as its host buffer arrives (not with a second gRPC hop):
    every placement round trips exactly and computes, and the controller then holds a
    connection to the worker's data port."""
    data_port = int(status(in_controller.address)["workers"][0]["data_address"].rsplit(":", 1)[1])
    controller_pid = in_controller.pids[0]
    assert not connected_to(controller_pid, data_port)
    result = run_jax(in_controller.ifrt_address.removeprefix("grpc://"), """
        import json
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        devices = jax.devices()
        x = np.random.default_rng(0).standard_normal((768, 1024)).astype(np.float32)  # 3 MiB
        mesh = Mesh(np.array(devices), ("d",))
        placed = {
            "device 0": jax.device_put(x, devices[0]),
            "device 1": jax.device_put(x, devices[1]),
            "split": jax.device_put(x, NamedSharding(mesh, PartitionSpec("d"))),
            "replicated": jax.device_put(x, NamedSharding(mesh, PartitionSpec())),
        }
        same = {name: bool(np.array_equal(np.asarray(a), x)) for name, a in placed.items()}
        doubled = {name: bool(np.array_equal(np.asarray(jax.jit(lambda v: v * 2)(a)), x * 2))
                   for name, a in placed.items()}
        many = [jax.device_put(x + i, devices[i % 2]) for i in range(8)]  # in flight at once
        many_same = [bool(np.array_equal(np.asarray(a), x + i)) for i, a in enumerate(many)]
        print("RESULT", json.dumps({"same": same, "doubled": doubled, "many": many_same}))
    """)
    assert all(result["same"].values()), result["same"]
    assert all(result["doubled"].values()), result["doubled"]
    assert result["many"] == [True] * 8
    assert connected_to(controller_pid, data_port), "the front end kept its data-plane connection to the worker"


def _worker_holds(cluster):
    """(arrays, bytes) the one worker of ``cluster`` holds for client sessions now."""
    stats = worker_stats(status(cluster.address)["workers"][0]["address"])
    return stats["handles"], sum(stats["session_bytes"].values())


def test_arrays_read_then_deleted_or_dropped_leave_nothing_on_the_worker(in_controller):
    """An unmodified JAX program puts arrays, reads them (np.asarray, which reads the
    array's cached single-device shard, or a shard of x.addressable_shards) and deletes
    them while still holding the Python objects, or drops them: after each round the
    worker holds none of them within a few seconds, on one device and on two, as after
    block_until_ready. JAX deletes only the array on x.delete(), not the shard it keeps
    cached, as the buffers the two share go with it in JAX's own runtimes; and a copy of
    an array to where it already is (the same data under a second handle) goes once both
    handles are deleted."""
    worker = status(in_controller.address)["workers"][0]["address"]
    result = run_jax(in_controller.ifrt_address.removeprefix("grpc://"), f"""
        import gc, json, time
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from pathways.cluster import worker_stats

        def held():
            stats = worker_stats({worker!r})
            return stats["handles"], sum(stats["session_bytes"].values())

        def settled(base):
            # deletes reach the worker through the controller a moment later, and a put
            # nobody waited for may reach it after the check began: wait a bounded while
            # for the worker to be back at ``base`` and to stay there for half a second
            deadline = time.monotonic() + 10
            since = None  # when the worker was last seen reaching base
            while True:
                now, at = held(), time.monotonic()
                since = (since or at) if now == base else None
                if (since is not None and at - since >= 0.5) or at > deadline:
                    return now
                time.sleep(0.1)

        devices = jax.devices()
        mesh = Mesh(np.array(devices), ("d",))
        value = np.ones(1 << 20, np.float32)  # 4 MiB
        base = held()
        after, kept = {{}}, []

        def waited(x):
            x.block_until_ready()

        def read(x):
            assert np.asarray(x)[-1] == 1.0

        def copied(x):
            # a copy to where x is already: the same array on the workers, under a new handle
            y = jax.device_put(x, x.sharding, may_alias=False)
            y.delete()
            kept.append(y)

        def read_shards(x):
            for shard in x.addressable_shards:
                data = shard.data
                assert np.asarray(data)[-1] == 1.0
                kept.append(data)  # the shard outlives its array's delete

        rounds = {{
            "waited, deleted": (devices[0], waited),
            "read, deleted": (devices[0], read),
            "copied in place, both deleted": (devices[0], copied),
            "shard read, deleted": (devices[0], read_shards),
            "read on 2 devices, deleted": (NamedSharding(mesh, PartitionSpec()), read),
            "shards read on 2 devices, deleted": (NamedSharding(mesh, PartitionSpec("d")), read_shards),
        }}
        for name, (where, use) in rounds.items():
            for _ in range(20):
                x = jax.device_put(value, where)
                use(x)
                x.delete()
                kept.append(x)  # held by the program: only the delete frees it
            after[name] = settled(base)
            kept.clear()
        for _ in range(20):
            x = jax.device_put(value, devices[0])
            read(x)
        del x
        gc.collect()  # JAX deletes an array it drops (and the shard it cached)
        after["read, dropped"] = settled(base)
        print("RESULT", json.dumps({{"base": base, "after": after}}))
    """)
    base = result["base"]
    assert base == [0, 0], f"the worker held arrays before the program put any: {base}"
    kept = {name: f"{now[0]} arrays, {now[1]} bytes" for name, now in result["after"].items() if now != base}
    assert not kept, f"the worker still holds arrays the program deleted or dropped: {kept}"


def test_a_read_in_flight_or_failed_does_not_keep_a_deleted_array_on_the_worker(in_controller):
    """By hand on the front end: an array deleted while a read of it is still coming from
    the worker (its lookup read in part and abandoned) is freed once the read ends; a read
    that fails (into a host buffer handle in use) leaves the array to be freed by its
    delete. Each time the worker holds none of the session's arrays within a few seconds."""
    proxy = Proxy(in_controller.ifrt_address.removeprefix("grpc://"))
    try:
        assert _worker_holds(in_controller) == (0, 0)
        n = 16 << 20  # float32: 64 MiB, read in many lookup messages
        array = proxy.make(np.ones(n, np.float32).tobytes(), None, np.float32, (n,), t.replicated((0,)))
        assert isinstance(array, int), array
        assert _worker_holds(in_controller) == (1, 4 * n)
        chunks = proxy.chunks(array)
        assert len(next(chunks)) > 0  # the read is under way
        proxy.request(lambda r: r.delete_array_request.array_handle.append(array))
        proxy.request(lambda r: r.destruct_array_request.array_handle.append(array))
        chunks.close()  # the client gives the lookup up
        wait_until(lambda: _worker_holds(in_controller) == (0, 0), 20, "the array read while deleted to be freed")

        array = proxy.make(np.ones(1024, np.float32).tobytes(), None, np.float32, (1024,), t.replicated((0,)))
        in_use = proxy.store(b"\0" * 16)

        def copy(r):
            r.copy_to_host_buffer_request.array_handle = array
            r.copy_to_host_buffer_request.host_buffer_handle = in_use
        failed = proxy.request(copy).response_metadata.status
        assert failed.code == t.INVALID_ARGUMENT and "already stored" in failed.message, failed
        assert np.array_equal(proxy.read(array, np.float32, (1024,)), np.ones(1024, np.float32))
        proxy.request(lambda r: r.delete_array_request.array_handle.append(array))
        wait_until(lambda: _worker_holds(in_controller) == (0, 0), 20, "the array whose read failed to be freed")
    finally:
        proxy.close()


@pytest.mark.parametrize("where", ["server", "in_controller"])
def test_a_host_buffer_that_ends_short_fails_its_streamed_array_and_the_session_goes_on(request, where):
    """A store that brings fewer bytes than the array needs: the array put from it as it
    arrived (with gRPC from a server of its own, on the worker's data listener from the
    controller's front end) fails, saying how many bytes came and how many were needed; the
    session's next array is made as usual."""
    front_end = request.getfixturevalue(where)
    address = front_end.address if where == "server" else front_end.ifrt_address.removeprefix("grpc://")
    device = 2 if where == "server" else 1  # a device of an island of one host
    channel = grpc.insecure_channel(address)
    stream = RawStream(channel, session_metadata())
    try:
        session_id = stream.init()
        n = (STREAMED_PUT_BYTES // 4) * 2  # float32: twice the streaming threshold
        # half of the bytes
        assert _put_raw(stream, channel, session_id, 10, 7, 8, n, b"\0" * (n * 2), device) != 0
        message = stream.answered[11].response_metadata.status.message
        assert f"has {n * 2} bytes; a float32[{n}] array needs {n * 4}" in message, message
        assert _put_raw(stream, channel, session_id, 20, 17, 18, n, np.ones(n, np.float32).tobytes(), device) == 0
    finally:
        stream.close()
        channel.close()


def _put_raw(stream, channel, session_id, op_id, buffer_handle, array_handle, n, data, device):
    """Make array ``array_handle`` of float32[n] on ``device`` from a host buffer stored
    with ``data`` (in a store announcing no size), and wait until it is ready: the status
    code of the readiness check (its answer is ``stream.answered[op_id + 1]``)."""
    store = channel.stream_unary(f"/{ifrt_server.SERVICE}/HostBufferStore")
    stream.send(_make_array(op_id, buffer_handle, array_handle, n, device=device))
    meta = gpb.GrpcHostBufferStoreMetadata(session_id=session_id, handle=buffer_handle, buffer_size=0)
    store(iter([gpb.GrpcHostBufferStoreRequest(data=data).SerializeToString()]),
          metadata=((ifrt_server.STORE_METADATA, meta.SerializeToString()),), timeout=30)
    ready = pb.IfrtRequest()
    ready.request_metadata.op_id = op_id + 1
    ready.check_value_ready_request.value_handles.append(array_handle)
    stream.send(ready.SerializeToString())
    stream.wait([op_id, op_id + 1])
    return stream.answered[op_id + 1].response_metadata.status.code


def _make_array(op_id, buffer_handle, array_handle, n, device):
    r = pb.IfrtRequest()
    r.request_metadata.op_id = op_id
    body = r.make_array_from_host_buffer_request
    body.dtype.CopyFrom(t.dtype_proto(np.float32))
    body.shape.CopyFrom(t.shape_proto((n,)))
    body.sharding.CopyFrom(t.sharding_proto(t.replicated((device,))))
    body.host_buffer_handle = buffer_handle
    body.array_handle = array_handle
    return r.SerializeToString()


def test_device_numbering_is_island_then_host_then_index():
    table = _table()
    assert [(d.island, d.rank, d.index, d.worker) for d in table.devices] == [
        (0, 0, 0, 1), (0, 1, 0, 2), (1, 0, 0, 5), (1, 0, 1, 5)]
    place = table.place([1, 0])
    assert place.pairs == ((1, 0), (0, 0)) and place.workers == (1, 2) and place.addresses == ("a:1", "a:2")
    with pytest.raises(t.IfrtError, match="share no interconnect"):
        table.place([0, 2])
    with pytest.raises(t.IfrtError, match="not one of this session's 4 devices"):
        table.get(4)


def test_shard_regions_of_tiled_and_replicated_shardings():
    op = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[2, 1],
                                 tile_assignment_devices=[1, 0])
    sharding = t.Sharding((2, 3), op.SerializeToString())
    assert t.shard_regions(sharding, (5, 3)) == [((3, 5), (0, 3)), ((0, 3), (0, 3))]
    assert t.shard_regions(t.replicated((0, 1)), (2,)) == [((0, 2),), ((0, 2),)]
    manual = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.MANUAL).SerializeToString()
    with pytest.raises(t.IfrtError):
        t.shard_regions(t.Sharding((0, 1), manual), (2,))


def test_shard_regions_of_unreduced_shardings_and_subgroups():
    everywhere = t.Sharding((0, 1), xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.UNREDUCED).SerializeToString())
    assert t.shard_regions(everywhere, (2, 3)) == [((0, 2), (0, 3))] * 2 and t.is_unreduced(everywhere.op)
    assert not everywhere.replicated, "partial values are no replicas"
    # devices=[2,2]<=[2,2]T(1,0) last_tile_dims={unreduced}: rows by tile, a partial sum per device
    rows = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[2, 2],
                                   iota_reshape_dims=[2, 2], iota_transpose_perm=[1, 0],
                                   last_tile_dims=[xla_data_pb2.OpSharding.UNREDUCED]).SerializeToString()
    assert t.shard_regions(t.Sharding((4, 5, 6, 7), rows), (4,)) == [((0, 2),), ((2, 4),), ((0, 2),), ((2, 4),)]
    assert t.is_unreduced(rows) and not t.is_unreduced(t.replicated((0,)).op)
    manual = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[2, 2],
                                     iota_reshape_dims=[4], last_tile_dims=[xla_data_pb2.OpSharding.MANUAL])
    with pytest.raises(t.IfrtError, match="MANUAL"):
        t.shard_regions(t.Sharding((0, 1, 2, 3), manual.SerializeToString()), (4,))


def test_island_parts_of_a_sharding_across_islands():
    op = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[2, 2],
                                 tile_assignment_devices=[0, 1, 2, 3])
    sharding = t.Sharding((0, 1, 2, 3), op.SerializeToString())
    assert _table().islands(sharding.devices) == [[0, 1], [2, 3]]
    box, part = t.island_part(sharding, (8, 6), [2, 3])
    assert box == ((4, 8), (0, 6)) and part.devices == (2, 3)
    assert t.shard_regions(part, (4, 6)) == [((0, 4), (0, 3)), ((0, 4), (3, 6))]
    assert t.island_part(t.replicated((0, 1, 2, 3)), (5,), [0, 1]) == (((0, 5),), t.replicated((0, 1)))
    # rows interleaved between islands: no box of the array is one island's
    rows = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[4, 1],
                                   tile_assignment_devices=[0, 2, 1, 3])
    with pytest.raises(t.IfrtError, match="do not tile one box"):
        t.island_part(t.Sharding((0, 1, 2, 3), rows.SerializeToString()), (8, 6), [0, 1])


def test_host_buffers_with_byte_strides():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    fortran = t.strided_bytes(a, [4, 8])
    assert np.array_equal(t.host_view(memoryview(fortran), np.dtype(np.int32), (2, 3), [4, 8]), a)
    assert t.strided_bytes(a, None).tobytes() == a.tobytes()
    with pytest.raises(t.IfrtError, match="needs 24"):
        t.host_view(b"\0" * 8, np.dtype(np.int32), (2, 3), None)


def test_formats_the_client_parses():
    assert t.default_layout_text(2) == b"{1,0}" and t.default_layout_text(0) == b"{}"
    assert t.dtype_proto(np.float32).version_number == 0 and t.shape_proto((2,)).version_number == 0
    proto = t.sharding_proto(t.replicated((0,)))
    assert proto.serialized_sharding.type_name == "xla::ifrt::HloSharding"
    assert t.parse_sharding(proto, 1) == t.replicated((0,))


def _even(devices, shape, shard_shape):
    """A ConcreteEvenSharding proto, as the client sends for a remap's output."""
    even = sharding_serdes_pb2.ConcreteEvenShardingProto(memory_kind="device", shape=t.shape_proto(shape),
                                                         shard_shape=t.shape_proto(shard_shape))
    even.devices.device_ids.extend(devices)
    return sharding_pb2.ShardingProto(serialized_sharding=serdes_pb2.Serialized(
        type_name=t.CONCRETE_EVEN_SHARDING, data=even.SerializeToString()))


def test_relabelled_shardings_keep_each_devices_block():
    # columns of a 2x2 tiling in iota form ({devices=[2,2]<=[2,2]T(1,0)}) on devices 4..7,
    # relabelled onto the same devices listed backwards
    iota = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[2, 2],
                                   iota_reshape_dims=[2, 2], iota_transpose_perm=[1, 0])
    sharding = t.Sharding((4, 5, 6, 7), iota.SerializeToString())
    moved = t.relabelled(sharding, (7, 6, 5, 4), [3, 2, 1, 0])
    assert dict(zip(moved.devices, t.shard_regions(moved, (4, 6)))) == \
        dict(zip(sharding.devices, t.shard_regions(sharding, (4, 6))))
    assert t.relabelled(t.replicated((0, 1)), (1, 0), [1, 0]) == t.replicated((1, 0))
    with pytest.raises(t.IfrtError, match="not each of the array's 4 shards once"):
        t.relabelled(sharding, (7, 6, 5, 4), [0, 0, 1, 2])
    assert t.even_devices(_even((3, 2), (8,), (4,)), 4) == (3, 2)
    assert t.even_devices(t.sharding_proto(sharding), 8) is None, "an HloSharding says its blocks itself"
    with pytest.raises(t.IfrtError, match="distinct ids"):
        t.even_devices(_even((3, 3), (8,), (4,)), 4)


def test_a_remap_to_the_same_devices_in_another_order_relabels_the_array_without_a_copy():
    # jax.device_put to a mesh of the same devices reversed: the client sends a remap whose
    # output is a ConcreteEvenSharding, each device keeping its block
    rows = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[4, 1],
                                   tile_assignment_devices=[0, 1, 2, 3])
    source = t.Sharding((0, 1, 2, 3), rows.SerializeToString())
    session = _session_without_cluster(_table())
    session._insert([1, 2], [IfrtArray(np.dtype(np.float32), (8, 2), source, handle=41),
                             IfrtArray(np.dtype(np.float32), (8, 2), source, handle=42)])
    body = pb.RemapArraysRequest(array_handles=[1], result_handles=[11],
                                 copy_semantics=types_pb2.ARRAY_COPY_SEMANTICS_DONATE_INPUT)
    for spec, sharding in ((body.plan.input_specs.add(), t.sharding_proto(source)),
                           (body.plan.output_specs.add(), _even((3, 2, 1, 0), (8, 2), (2, 2)))):
        spec.dtype.CopyFrom(t.dtype_proto(np.float32))
        spec.shape.CopyFrom(t.shape_proto((8, 2)))
        spec.sharding.CopyFrom(sharding)
    body.plan.mappings.add(in_array=0, out_array=0, from_start=[0, 1, 2, 3], from_end=[1, 2, 3, 4],
                           from_step=[1] * 4, to_start=[3, 2, 1, 0], to_end=[4, 3, 2, 1], to_step=[1] * 4)
    assert list(session.handle("remap_arrays_request", body).array_handles) == [11]
    out = session._arrays[11]
    assert out.handle == 41 and out.sharding.devices == (3, 2, 1, 0), "the same pathways array, relabelled"
    regions = dict(zip(out.sharding.devices, t.shard_regions(out.sharding, (8, 2))))
    assert regions == dict(zip(source.devices, t.shard_regions(source, (8, 2)))), "each device keeps its block"
    assert session._arrays[1].deleted and session._refs[41] == 1, "donated: the input is gone, its data is not"

    # shards of two arrays gathered into one ConcreteEvenSharding: no block order to take
    body.array_handles[:] = [2, 2]
    body.plan.input_specs.add().CopyFrom(body.plan.input_specs[0])
    del body.plan.mappings[:]
    body.plan.mappings.add(in_array=0, out_array=0, from_start=[0], from_end=[2], from_step=[1],
                           to_start=[0], to_end=[2], to_step=[1])
    body.plan.mappings.add(in_array=1, out_array=0, from_start=[2], from_end=[4], from_step=[1],
                           to_start=[2], to_end=[4], to_step=[1])
    body.result_handles[:] = [12]
    with pytest.raises(t.IfrtError, match="remaps the shards of one array into one of its shape"):
        session.handle("remap_arrays_request", body)
    body.plan.mappings[1].from_end[0] = 5
    with pytest.raises(t.IfrtError, match=r"remap interval \[2, 5\) by 1 is not within the 4 shards"):
        session.handle("remap_arrays_request", body)
    del body.plan.mappings[1]
    with pytest.raises(t.IfrtError, match=r"gives output 0 no shards \[2, 3\]"):
        session.handle("remap_arrays_request", body)


def _session_without_cluster(table):
    """An IFRT session on ``table``'s devices with no cluster behind it (no native session):
    for requests it answers from its own tables."""
    session = IfrtSession(None, 1, {})
    session.devices = table
    return session


class _Releases:
    """Stands in for the native session where only its releases matter."""

    def __init__(self):
        self.released = []

    def release(self, handle):
        self.released.append(handle)


def test_an_arrays_data_stays_while_any_of_its_shards_lives():
    # x.addressable_shards, then x dropped: the shards still read the data x's pathways array
    # holds, so it is released with the last of them, not with x
    rows = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=[2, 1],
                                   tile_assignment_devices=[0, 1])
    session = _session_without_cluster(_table())
    session.native = _Releases()
    session._insert([1], [IfrtArray(np.dtype(np.float32), (4, 2), t.Sharding((0, 1), rows.SerializeToString()),
                                    handle=41)])
    session.handle("disassemble_into_single_device_arrays_request",
                   pb.DisassembleIntoSingleDeviceArraysRequest(array_handle=1, result_handles=[11, 12]))
    for destructed, released in (([1], []), ([11], []), ([12], [41])):
        session.handle("destruct_array_request", pb.DestructArrayRequest(array_handle=destructed))
        assert session.native.released == released, destructed

    # x.delete() frees its data at once, as JAX's own arrays do: its shards then refuse reads
    session._insert([2], [IfrtArray(np.dtype(np.float32), (4, 2), t.Sharding((0, 1), rows.SerializeToString()),
                                    handle=42)])
    session.handle("disassemble_into_single_device_arrays_request",
                   pb.DisassembleIntoSingleDeviceArraysRequest(array_handle=2, result_handles=[21, 22]))
    session.handle("delete_array_request", pb.DeleteArrayRequest(array_handle=[2]))
    assert session.native.released == [41, 42]
    with pytest.raises(t.IfrtError, match="the array this shard is of was deleted"):
        session._wait_ready([session._arrays[21]])
    session.handle("destruct_array_request", pb.DestructArrayRequest(array_handle=[21, 22]))
    assert session.native.released == [41, 42] and not session._views and not session._orphans


def test_a_single_device_arrays_shards_are_it_and_go_with_its_delete():
    # JAX reads x through its cached shard (np.asarray) and deletes x alone on x.delete():
    # the shards of a single-device array name its data without a reference of their own,
    # as views do, so the delete frees it at once and the shards then refuse reads
    session = _session_without_cluster(_table())
    session.native = _Releases()
    one = lambda handle: IfrtArray(np.dtype(np.float32), (4,), t.replicated((5,)), handle=handle)
    session._insert([1], [one(41)])
    session.handle("fully_replicated_shard_request", pb.FullyReplicatedShardRequest(array_handle=1, result_handle=11))
    session.handle("disassemble_into_single_device_arrays_request",
                   pb.DisassembleIntoSingleDeviceArraysRequest(array_handle=11, result_handles=[12]))
    assert session._arrays[12].alias_of is session._arrays[1], "a shard of a shard is of the array itself"
    session.handle("delete_array_request", pb.DeleteArrayRequest(array_handle=[1]))
    assert session.native.released == [41]
    for shard in (11, 12):
        with pytest.raises(t.IfrtError, match="the array this shard is of was deleted"):
            session._array(shard)
        assert session.handle("is_array_deleted_request", pb.IsArrayDeletedRequest(array_handle=shard)).deleted
    session.handle("destruct_array_request", pb.DestructArrayRequest(array_handle=[1, 11, 12]))
    assert session.native.released == [41] and not session._views and not session._refs

    # dropped without a delete while its shard lives: the data goes with the shard
    session._insert([2], [one(42)])
    session.handle("fully_replicated_shard_request", pb.FullyReplicatedShardRequest(array_handle=2, result_handle=21))
    session.handle("destruct_array_request", pb.DestructArrayRequest(array_handle=[2]))
    assert session.native.released == [41] and session._array(21).handle == 42
    session.handle("destruct_array_request", pb.DestructArrayRequest(array_handle=[21]))
    assert session.native.released == [41, 42] and not session._views and not session._orphans

    # a copy to where the array is: a second IFRT array with its own reference to the
    # same data, which goes once both are deleted, in either order
    session._insert([3], [one(43)])
    session.handle("copy_arrays_request", pb.CopyArraysRequest(
        array_handles=[3], result_handles=[31], copy_semantics=types_pb2.ARRAY_COPY_SEMANTICS_ALWAYS_COPY))
    session.handle("delete_array_request", pb.DeleteArrayRequest(array_handle=[31]))
    assert session.native.released == [41, 42] and session._array(3).handle == 43, "the original is usable"
    session.handle("delete_array_request", pb.DeleteArrayRequest(array_handle=[3]))
    assert session.native.released == [41, 42, 43] and not session._refs


def test_the_result_handles_of_a_request_not_served_hold_its_error():
    # else the client, which names the results itself and goes on, meets only "unknown
    # array handle" when it uses them
    session = _session_without_cluster(_table())
    body = pb.BitcastArraysRequest(array_handles=[1], result_handles=[5])
    with pytest.raises(t.IfrtError, match="bitcast_arrays_request is not implemented") as raised:
        session.handle("bitcast_arrays_request", body)
    session.fail_handles("bitcast_arrays_request", body, raised.value)
    with pytest.raises(t.IfrtError, match="bitcast_arrays_request is not implemented"):
        session._array(5)


def _session_with_executable(compiled):
    """An IFRT session holding one executable (handle 7) compiled as ``compiled`` says, with
    no cluster: what its requests about the executable answer depends on that alone."""
    session = _session_without_cluster(DeviceTable([]))
    session._executables[7] = IfrtExecutable(compiled.fn, compiled, (0,), None, "f")
    return session


def test_an_executables_cost_memory_and_text_are_the_workers_or_unimplemented():
    analysis = m.Analysis((("flops", 8960.0), ("fused", True), ("ops", 3)),
                          (("argument_size_in_bytes", 2560), ("peak_memory_in_bytes", 2564)), "HloModule jit_f")
    given = _session_with_executable(m.Compiled(5, "", analysis=analysis))
    cost = given.handle("loaded_executable_cost_analysis_request",
                        pb.LoadedExecutableCostAnalysisRequest(loaded_executable_handle=7))
    assert cost.WhichOneof("result") == "attributes" and cost.attributes.version_number == 0
    assert {k: v.WhichOneof("value") for k, v in cost.attributes.attributes.items()} == {
        "flops": "float_value", "fused": "bool_value", "ops": "int64_value"}
    assert cost.attributes.attributes["flops"].float_value == 8960.0
    text = given.handle("loaded_executable_human_readable_program_text_request",
                        pb.LoadedExecutableHumanReadableProgramTextRequest(loaded_executable_handle=7))
    assert text.human_readable_program_text == "HloModule jit_f"
    meta = given.handle("loaded_executable_metadata_request", pb.LoadedExecutableMetadataRequest(
        loaded_executable_handle=7))
    assert meta.WhichOneof("compiled_memory_stats_oneof") == "compiled_memory_stats"
    assert (meta.compiled_memory_stats.argument_size_in_bytes, meta.compiled_memory_stats.peak_memory_in_bytes,
            meta.compiled_memory_stats.temp_size_in_bytes) == (2560, 2564, 0)

    # a worker whose XLA gave none of them: UNIMPLEMENTED, which JAX turns into "not available"
    none = _session_with_executable(m.Compiled(5, "", analysis=m.Analysis()))
    for kind, request in [("loaded_executable_cost_analysis_request", pb.LoadedExecutableCostAnalysisRequest),
                          ("loaded_executable_human_readable_program_text_request",
                           pb.LoadedExecutableHumanReadableProgramTextRequest)]:
        resp = none.handle(kind, request(loaded_executable_handle=7))
        assert resp.status.code == t.UNIMPLEMENTED and "the worker's XLA gave no" in resp.status.message
    meta = none.handle("loaded_executable_metadata_request", pb.LoadedExecutableMetadataRequest(
        loaded_executable_handle=7))
    assert meta.compiled_memory_stats_error.code == t.UNIMPLEMENTED
    with pytest.raises(t.IfrtError, match="unknown loaded executable handle 8"):
        none.handle("loaded_executable_cost_analysis_request", pb.LoadedExecutableCostAnalysisRequest(
            loaded_executable_handle=8))


def test_pathways_slice_parsing():
    assert parse_slice("cpu:2") == ("cpu", 2, None) and parse_slice("gpu:8@1") == ("gpu", 8, 1)
    for bad in ("cpu", "cpu:x", "fpga:2", "cpu:2@x", 3):
        with pytest.raises(t.IfrtError, match="KIND:COUNT"):
            parse_slice(bad)


def test_copy_between_islands_donation_and_deletion(server):
    result = run_jax(server.address, """
        import json
        import numpy as np
        devices = jax.devices()
        x = jax.device_put(np.arange(6, dtype=np.float32), devices[0])
        moved = jax.device_put(x, devices[2])  # island 0 -> island 1, over the data plane
        step = jax.jit(lambda a: a + 1, donate_argnums=0)
        y = step(moved)
        z = step(y)
        w = jax.device_put(np.ones(3, np.float32))
        w.delete()
        print("RESULT", json.dumps({"moved": np.asarray(moved).tolist() if not moved.is_deleted() else None,
                                    "on": [d.id for d in z.devices()], "z": np.asarray(z).tolist(),
                                    "y_deleted": y.is_deleted(), "w_deleted": w.is_deleted(),
                                    "x": np.asarray(x).tolist()}))
    """)
    assert result["x"] == list(range(6)) and result["on"] == [2]
    assert result["z"] == [float(i + 2) for i in range(6)]
    assert result["y_deleted"] and result["w_deleted"]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 1 << 20])
def test_hand_encoded_lookup_responses_parse_as_the_message(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    raw = _lookup_response(memoryview(data))
    if size:  # (protobuf omits an empty field; the server sends an empty buffer as the empty message)
        assert raw == gpb.GrpcHostBufferLookupResponse(data=data.tobytes()).SerializeToString()
    assert gpb.GrpcHostBufferLookupResponse.FromString(raw).data == data.tobytes()


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16384, 1 << 20])
def test_store_chunks_are_read_from_the_message_without_parsing_it(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    raw = gpb.GrpcHostBufferStoreRequest(data=data).SerializeToString()
    assert bytes(_store_data(raw, None)) == data
    # another field beside the data: parsed as the message
    tagged = raw + b"\x10\x01"
    assert bytes(_store_data(tagged, None)) == data


def test_a_controller_out_of_reach_is_named_in_the_clients_error():
    """A session the server cannot back with a controller session is refused with the
    reason on the client's first request, which the client raises when it gives up."""
    ifrt = IfrtServer("127.0.0.1:1")  # nothing listens there
    ifrt.start()
    try:
        out = subprocess.run([sys.executable, "-c", PLUGIN + "jax.devices()\n"], capture_output=True, text=True,
                             env=_proxy_env(ifrt.address, PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="3"), timeout=120)
    finally:
        ifrt.stop()
    assert out.returncode != 0
    assert "the pathways controller at grpc://127.0.0.1:1 is not reachable" in out.stderr, out.stderr[-3000:]


def test_session_weight_parsing():
    from pathways.ifrt.server import session_weight
    assert session_weight(None) == 1.0 and session_weight("2.5") == 2.5 and session_weight(4) == 4.0
    for bad in ("0", "-1", "heavy", "nan", "inf", "1e7"):
        with pytest.raises(ValueError, match="PATHWAYS_WEIGHT"):
            session_weight(bad)


def test_an_ifrt_session_is_a_weighted_client_session(server):
    """PATHWAYS_WEIGHT, sent as initialization data, is the weight the controller's
    fair-share policy gives the IFRT session's native session."""
    from pathways.client.session import Session
    script = PLUGIN + textwrap.dedent("""
        import sys
        jax.devices()
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    env = _proxy_env(server.address, PATHWAYS_WEIGHT="3.5")
    client = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    observer = None
    try:
        assert client.stdout.readline().strip() == "ready"
        observer = Session(server.controller)
        weights = [s.get("weight") for s in observer.cluster()["sessions"]]
        assert 3.5 in weights, weights
    finally:
        if observer is not None:
            observer.close()
        client.stdin.close()
        client.wait(timeout=60)


# The plugin's own factory (what an installed package registers through its entry point, so
# the same whether or not it is installed), with the environment it reads.
PLUGIN = """
import jax
from jax.extend import backend
from pathways.ifrt import plugin
backend.register_backend_factory("proxy", plugin.make_client, priority=-1)
"""


def _proxy_env(address, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PATHWAYS_", "IFRT_PROXY_", "JAX_"))}
    return dict(env, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{address}", **extra)


def test_an_array_laid_out_across_islands(server):
    """One array over the devices of both islands (held as one pathways array per island):
    read whole and by shards, reassembled, moved to one island, refused by a computation
    spanning islands, and deleted (each island's part released)."""
    script = PRELUDE + textwrap.dedent("""
        import json, sys
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        devices = jax.devices()
        mesh = Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
        x = np.arange(64, dtype=np.int32).reshape(8, 8)
        tiled = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
        rows = jax.device_put(x, NamedSharding(mesh, P("a")))
        everywhere = jax.device_put(x, NamedSharding(mesh, P()))
        shards = {s.device.id: np.asarray(s.data).tolist() for s in tiled.addressable_shards}
        back = jax.make_array_from_single_device_arrays(x.shape, tiled.sharding,
                                                        [s.data for s in tiled.addressable_shards])
        on1 = jax.device_put(tiled, NamedSharding(Mesh(np.array(devices[2:]), ("y",)), P("y")))
        on0 = jax.device_put(everywhere, devices[0])
        doubled = jax.jit(lambda a: a * 2)(on1)
        try:
            jax.jit(lambda a: a + 1)(rows)
            jit_error = ""
        except Exception as e:
            jit_error = str(e)
        print("RESULT", json.dumps({
            "tiled": np.asarray(tiled).tolist(), "rows": np.asarray(rows).tolist(),
            "everywhere": np.asarray(everywhere).tolist(), "back": np.asarray(back).tolist(),
            "shards": {str(k): v for k, v in shards.items()},
            "on1": np.asarray(on1).tolist(), "on1_devices": sorted(d.id for d in on1.devices()),
            "on0": np.asarray(on0).tolist(), "on0_devices": [d.id for d in on0.devices()],
            "doubled": np.asarray(doubled).tolist(), "jit_error": jit_error}), flush=True)
        sys.stdin.readline()
        del back
        for a in (tiled, rows, everywhere):
            a.delete()
        print("RESULT", json.dumps({"deleted": [a.is_deleted() for a in (tiled, rows, everywhere)]}), flush=True)
        sys.stdin.readline()
    """)
    env = dict(os.environ, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{server.address}",
               IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
    env.pop("XLA_FLAGS", None)
    client = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def result():
        line = client.stdout.readline()
        assert line.startswith("RESULT "), f"the JAX client failed: {line!r}"
        return json.loads(line[len("RESULT "):])

    try:
        got = result()
        x = np.arange(64, dtype=np.int32).reshape(8, 8)
        for key in ("tiled", "rows", "everywhere", "back", "on1", "on0"):
            assert got[key] == x.tolist(), key
        assert got["shards"] == {"0": x[:4, :4].tolist(), "1": x[:4, 4:].tolist(),
                                 "2": x[4:, :4].tolist(), "3": x[4:, 4:].tolist()}
        assert got["on1_devices"] == [2, 3] and got["on0_devices"] == [0]
        assert got["doubled"] == (x * 2).tolist()
        assert "share no interconnect" in got["jit_error"], got["jit_error"]
        before = status(server.controller)["arrays"]
        client.stdin.write("\n")
        client.stdin.flush()
        assert result()["deleted"] == [True, True, True]
        # three arrays, each held by two islands: six pathways arrays released
        wait_until(lambda: status(server.controller)["arrays"] == before - 6, 30,
                   "the island parts of the deleted arrays to be released")
    finally:
        client.stdin.close()
        client.wait(timeout=60)


def test_pathways_slice_limits_a_session_to_one_placed_slice(server):
    """PATHWAYS_SLICE=cpu:2@1: the session's devices are one slice of two devices the
    resource manager placed on island 1, and computations run there."""
    script = PLUGIN + textwrap.dedent("""
        import json
        import numpy as np
        devices = jax.devices()
        y = jax.jit(lambda v: v * 3)(jax.device_put(np.arange(4.0), devices[1]))
        print("RESULT " + json.dumps({"islands": [d.island for d in devices], "y": np.asarray(y).tolist()}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env=_proxy_env(server.address, PATHWAYS_SLICE="cpu:2@1"))
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"islands": [1, 1], "y": [0.0, 3.0, 6.0, 9.0]}


LOST_HOST_SCRIPT = PLUGIN + textwrap.dedent("""
    import json, sys
    import numpy as np
    from pathwaysutils.elastic import elastic
    on1 = [d for d in jax.devices() if d.slice_index == 1]
    x = jax.device_put(np.arange(4.0), on1[0])
    y = jax.jit(lambda v: v + 1)(x)
    y.block_until_ready()
    print("READY", flush=True)
    sys.stdin.readline()  # the test kills the host of island 1 meanwhile
    errors = []
    for read in (lambda: np.asarray(x), lambda: jax.jit(lambda v: v * 2)(y).block_until_ready()):
        try:
            read()
            errors.append(None)
        except Exception as e:
            errors.append({"type": type(e).__name__, "message": str(e)[:600],
                           "slice_down": elastic.is_error_due_to_slice_down(e, log_traceback=False)})
    on0 = [d for d in jax.devices() if d.slice_index == 0]
    z = np.asarray(jax.jit(lambda v: v * 3)(jax.device_put(np.arange(2.0), on0[0])))
    print("RESULT " + json.dumps({"errors": errors, "island0": z.tolist()}), flush=True)
""")


def test_a_lost_host_fails_reads_and_runs_with_data_loss_naming_it_as_pathwaysutils_expects():
    """The failure contract of JAX tooling: an array or computation lost with its host fails
    with a JaxRuntimeError carrying DATA_LOSS and the host, which pathwaysutils' elastic
    manager takes for a slice that went down; the other island keeps serving."""
    cluster = LocalCluster([Island(1, 1), Island(1, 1)]).start()
    ifrt = IfrtServer(cluster.address)
    client = None
    try:
        ifrt.start()
        client = subprocess.Popen([sys.executable, "-c", LOST_HOST_SCRIPT], env=_proxy_env(ifrt.address),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert read_line(client, timeout=240).strip() == "READY", client.stderr.read()[-3000:]
        host = next(w for w in status(cluster.address)["workers"] if w["island"] == 1)
        os.kill(host["pid"], signal.SIGKILL)
        wait_until(lambda: not next(i for i in status(cluster.address)["islands"] if i["name"] == "1")["healthy"],
                   30, "the controller to see island 1 lost")
        client.stdin.write("\n")
        client.stdin.flush()
        line = read_line(client, timeout=120)
        assert line.startswith("RESULT "), client.stderr.read()[-3000:]
        result = json.loads(line[len("RESULT "):])
        for error in result["errors"]:
            assert error is not None, "a read or run of what the lost host held must fail"
            assert error["type"] == "JaxRuntimeError" and "DATA_LOSS" in error["message"], error
            assert f"worker {host['worker']}" in error["message"], error
            assert error["slice_down"], error
        assert result["island0"] == [0.0, 3.0]
    finally:
        if client is not None:
            stop_processes([client])
        ifrt.stop()
        cluster.stop()


HEALING_SCRIPT = PLUGIN + textwrap.dedent("""
    import json, sys
    import numpy as np
    from pathwaysutils.elastic import manager as elastic_manager

    def failure(read):
        try:
            read()
        except jax.errors.JaxRuntimeError as e:
            return str(e)[:300]
        return None

    devices = jax.devices()
    on0 = [d for d in devices if d.slice_index == 0]
    on1 = [d for d in devices if d.slice_index == 1]
    step = jax.jit(lambda w: w * 2.0 + 1.0)
    kept = jax.device_put(np.arange(3.0), on0[0])
    w = step(jax.device_put(np.zeros(4, np.float32), on1[0]))
    unread = step(w).block_until_ready()  # computed, never read back: only the lost host held it
    print("READY", np.asarray(w).tolist(), flush=True)
    sys.stdin.readline()  # island 1's host is killed and its island healed meanwhile
    healed = {"lost": failure(lambda: np.asarray(unread)), "kept": np.asarray(kept).tolist(),
              "next": np.asarray(step(jax.device_put(np.ones(4, np.float32), on1[0]))).tolist(),
              "devices": [d.id for d in jax.devices()] == [d.id for d in devices]}

    manager = elastic_manager.Manager()
    state = {"w": np.zeros(4, np.float32), "steps": 0, "attempts": 0}

    @manager.elastic_retry(poll_interval=0.5, timeout=120, retry_policy=lambda attempt, error: attempt < 3)
    def train(steps):
        state["attempts"] += 1
        w = jax.device_put(state["w"], manager.slice_to_devices[1][0])
        while state["steps"] < steps:
            w = step(w)
            state["w"] = np.asarray(w)  # the host's copy of each step: what a retry starts from
            state["steps"] += 1
            if state["steps"] == 2 and state["attempts"] == 1:
                print("READY", flush=True)
                sys.stdin.readline()  # island 1's host is killed again
        return state["w"]

    trained = train(5)
    print("RESULT " + json.dumps({"healed": healed, "trained": trained.tolist(), "attempts": state["attempts"]}),
          flush=True)
""")


def test_a_proxied_script_follows_its_healed_island_and_an_elastic_loop_survives_a_killed_host():
    """A host killed under a running proxied script, its island healed by the local
    supervisor (a new process at a new address, under the same worker id): the array it
    held is lost (DATA_LOSS), an array of the other island is not, and the script's next
    step on the healed island succeeds with the executable compiled before, the devices
    unchanged. Then pathwaysutils' elastic loop around a training step, unchanged: the host
    killed again mid-loop, the loop retries from the host's copy once the island serves
    again, and finishes with the values of an uninterrupted run."""
    cluster = LocalCluster([Island(1, 1), Island(1, 1)], restart_workers=True).start()
    ifrt = IfrtServer(cluster.address)
    client = None

    def kill_and_heal():
        host = next(w for w in status(cluster.address)["workers"] if w["island"] == 1)
        os.kill(host["pid"], signal.SIGKILL)
        wait_until(lambda: any(w["island"] == 1 and w["pid"] != host["pid"] and w["address"] != host["address"]
                               for w in status(cluster.address)["workers"])
                   and next(i for i in status(cluster.address)["islands"] if i["island"] == 1)["healthy"],
                   60, "island 1 to heal with a new process")

    try:
        ifrt.start()
        client = subprocess.Popen([sys.executable, "-c", HEALING_SCRIPT], env=_proxy_env(ifrt.address),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert read_line(client, timeout=240).strip() == "READY [1.0, 1.0, 1.0, 1.0]", client.stderr.read()[-3000:]
        kill_and_heal()
        client.stdin.write("\n")
        client.stdin.flush()
        assert read_line(client, timeout=120).strip() == "READY", client.stderr.read()[-3000:]
        kill_and_heal()
        client.stdin.write("\n")
        client.stdin.flush()
        line = read_line(client, timeout=240)
        assert line.startswith("RESULT "), client.stderr.read()[-3000:]
        result = json.loads(line[len("RESULT "):])
        healed = result["healed"]
        assert healed["lost"] is not None and "DATA_LOSS" in healed["lost"], healed
        assert healed["kept"] == [0.0, 1.0, 2.0] and healed["next"] == [3.0] * 4 and healed["devices"], healed
        assert result["trained"] == [31.0] * 4 and result["attempts"] == 2, result
    finally:
        if client is not None:
            stop_processes([client])
        ifrt.stop()
        cluster.stop()


def test_streams_without_the_token_hold_a_few_of_the_servers_threads_for_seconds_at_most(monkeypatch):
    """70 IFRT session streams opened without the token, sending nothing. A refused
    stream is kept REFUSED_SECONDS at most (to answer the client's requests with why), and
    at most MAX_REFUSED_STREAMS at once (the rest end at once), so the server's threads
    stay free: GetVersion answers at once throughout."""
    import time
    from concurrent import futures

    import grpc

    from pathways.ifrt import server as ifrt_server
    from pathways.wire.security import Security

    monkeypatch.setattr(ifrt_server, "REFUSED_SECONDS", 2.0)
    ifrt = IfrtServer("grpc://127.0.0.1:1", "127.0.0.1:0", Security(token="the-token"))  # never reached
    ifrt.start()
    try:
        with silent_streams(ifrt.address, 70) as (channel, ended):
            wait_until(lambda: len(ended) >= 70 - ifrt_server.MAX_REFUSED_STREAMS, timeout=10,
                       what="the streams beyond the few kept to end at once")
            assert set(ended) == {grpc.StatusCode.UNAUTHENTICATED}
            version = gpb.GrpcGetVersionRequest()
            version.min_version.protocol_version = ifrt_server.PROTOCOL_MIN
            version.max_version.protocol_version = ifrt_server.PROTOCOL_MAX
            ask = channel.unary_unary(f"/{ifrt_server.SERVICE}/GetVersion")
            started = time.monotonic()
            ask(version.SerializeToString(), timeout=5)
            assert time.monotonic() - started < 1.0, "the server's threads are free for others"
            # 70 silent streams, yet 56 callers at once (64 threads less the 8 kept) are all served
            with futures.ThreadPoolExecutor(56) as callers:
                answers = list(callers.map(lambda _: ask(version.SerializeToString(), timeout=10), range(56)))
            assert len(answers) == 56
            wait_until(lambda: len(ended) == 70, timeout=2.0 + 5,
                       what="the kept streams to end after REFUSED_SECONDS")
    finally:
        ifrt.stop()


def test_a_session_the_server_would_refuse_fails_at_once_naming_why(server):
    """The three refusals (a missing or wrong token, a slice the cluster cannot place, a bad
    weight): JAX's client would retry each for its whole connection timeout, so the plugin
    asks the server first, and the server answers within seconds with one line that names
    the cause."""
    import time

    from pathways.ifrt import plugin
    from pathways.wire.security import Security

    guarded = IfrtServer(server.controller, "127.0.0.1:0", Security(token="the-token"))
    guarded.start()
    target = f"grpc://{guarded.address}"
    token = {"PATHWAYS_TOKEN": "the-token"}
    try:
        for env, needle in [({}, "and none was given"), ({"PATHWAYS_TOKEN": "nope"}, "the one given (PATHWAYS_TOKEN) is wrong"),
                            ({**token, "PATHWAYS_SLICE": "cpu:64"}, "no slice of 64 cpu device(s)"),
                            ({**token, "PATHWAYS_SLICE": "gpu:1"}, "no slice of 1 gpu device(s)"),
                            ({**token, "PATHWAYS_SLICE": "cpu"}, "PATHWAYS_SLICE must read KIND:COUNT"),
                            ({**token, "PATHWAYS_WEIGHT": "-1"}, "PATHWAYS_WEIGHT")]:
            started = time.monotonic()
            refused = plugin.admission(target, plugin.initialization_data(env))
            assert refused is not None and needle in refused and "\n" not in refused, (env, refused)
            assert time.monotonic() - started < 5.0
        assert plugin.admission(target, plugin.initialization_data({**token, "PATHWAYS_SLICE": "cpu:2"})) is None
        assert plugin.admission(target, plugin.initialization_data(token)) is None
        assert plugin.admission("grpc://127.0.0.1:1", {}) is None, "no server there: the client's connection decides"
        with grpc.insecure_channel(guarded.address) as channel:  # hostile checks are refused, and it keeps serving
            for hostile in (b"\xc1", m.pack(["admission", {"a": 1}]), m.pack(["admission", [[1, "x"]]]),
                            b"\x90" * (MAX_ADMISSION_BYTES + 1)):
                answer = channel.unary_unary(plugin.ADMISSION)(hostile, timeout=5)
                refused = operator.answer(operator.ADMISSION_REPLY, answer).refused
                assert refused.startswith("the admission check takes a map of initialization data"), refused
        assert plugin.admission(target, plugin.initialization_data(token)) is None
        # through JAX itself: the program fails at once, with the server's reason
        out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import json, time, jax
            started = time.monotonic()
            try:
                jax.devices()
            except RuntimeError as e:
                print(json.dumps({"error": str(e), "seconds": time.monotonic() - started}))
            """)], capture_output=True, text=True, timeout=120,
            env=_proxy_env(guarded.address, PATHWAYS_TOKEN="nope"))
        failed = json.loads(out.stdout.strip().splitlines()[-1])
        assert "refused this program's session" in failed["error"] and "is wrong" in failed["error"], failed
        assert failed["seconds"] < 5.0
    finally:
        guarded.stop()


class _SlowNative:
    """A native session that counts its holds (each a burst of requests sent as one batch)."""

    def __init__(self) -> None:
        self.holds = 0

    @contextmanager
    def holding(self):
        self.holds += 1
        yield


class _SlowSession:
    """What a session stream needs of an IFRT session: requests answered in order, each
    only once ``go`` is set."""

    def __init__(self) -> None:
        self.native = _SlowNative()
        self.go = threading.Event()
        self.served: list[int] = []

    def handle(self, kind, body):
        assert self.go.wait(30)
        self.served.append(body.dtype.kind)
        return pb.GetDefaultLayoutResponse()


@pytest.mark.parametrize("burst_seconds", [60.0, 0.0])
def test_a_session_stream_receives_a_bounded_inbox_ahead_and_serves_a_burst_in_one_hold(monkeypatch, burst_seconds):
    monkeypatch.setattr(ifrt_server, "INBOX", 8)
    monkeypatch.setattr(ifrt_server, "BURST_SECONDS", burst_seconds)
    session, out = _SlowSession(), ifrt_server.queue.SimpleQueue()
    stream = ifrt_server._Stream(session, out)
    received = []

    def requests():
        for i in range(30):
            received.append(i)
            request = pb.IfrtRequest(get_default_layout_request=pb.GetDefaultLayoutRequest())
            request.request_metadata.op_id = i + 1
            request.get_default_layout_request.dtype.kind = i + 1
            yield request.SerializeToString()

    receiver = threading.Thread(target=stream.receive, args=(requests(),))
    handler = threading.Thread(target=stream.handle)
    receiver.start()
    handler.start()
    try:
        wait_until(lambda: len(received) >= 10, 10)
        time.sleep(0.3)
        # one taken by the handler (waiting for go), INBOX queued, one waiting for room
        assert len(received) == 1 + 8 + 1, received
        session.go.set()
        receiver.join(10)
        handler.join(10)
        assert not receiver.is_alive() and not handler.is_alive()
        answered = []
        while (item := out.get(timeout=5)) is not None:
            answered.append(pb.IfrtResponse.FromString(item).response_metadata.op_id)
        assert answered == list(range(1, 31)) and session.served == list(range(1, 31))
        if burst_seconds:  # what queued while the first request waited was served in bursts, not a hold each
            assert session.native.holds < 30
        else:  # each burst is cut short: a run it holds would wait for the rest
            assert session.native.holds == 30
    finally:
        session.go.set()
        stream.closed.set()
