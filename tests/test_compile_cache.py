"""The workers' persistent compilation cache (pathways/worker/compile_cache.py): an executable
one worker compiled is loaded by another worker of the machine; a damaged entry is compiled
again; a cache that cannot be written costs nothing but the compile."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import xla_bridge
from jax._src.lib import xla_client

import pathways as pw
from pathways import config
from pathways.cluster import status, worker_stats
from pathways.worker import compile_cache
from pathways.worker.compile_cache import CompileCache
from tests.conftest import running_cluster
from tests.test_xla_functions import WAIT, artifact, assert_analysis_is_local_jaxs, run_xla, slice_of


def test_the_directory_comes_from_the_flag_then_pathways_then_jax():
    env = {config.COMPILE_CACHE.name: "/p", compile_cache.JAX_ENV: "/j"}
    assert compile_cache.directory_from("/flag", env) == "/flag"
    assert compile_cache.directory_from(None, env) == "/p"
    assert compile_cache.directory_from(None, {compile_cache.JAX_ENV: "/j"}) == "/j"
    assert compile_cache.directory_from(None, {}) is None


def _compile(f, x):
    blob, options = artifact(f, [jax.ShapeDtypeStruct(x.shape, x.dtype)], 1)
    backend = xla_bridge.get_backend()
    devices = xla_client.DeviceList((jax.devices()[0],))
    return blob, options, backend, devices, xla_client.CompileOptions.ParseFromString(options)


def _call(executable, x):
    [[y]] = executable.execute_sharded([jax.device_put(x, jax.devices()[0])]).disassemble_into_single_device_arrays()
    return np.asarray(y)


def test_a_kept_executable_loads_and_runs_and_a_damaged_one_is_compiled_again(tmp_path, caplog):
    x = np.arange(6, dtype=np.float32)
    blob, options, backend, devices, parsed = _compile(lambda a: jnp.cos(a) * 3, x)
    cache = CompileCache(str(tmp_path / "cache"))
    key = cache.key(backend, blob, options, b"[0]")
    assert key != cache.key(backend, blob, options, b"[1]"), "other devices: another executable"
    assert cache.load(key, backend, devices, parsed) is None and cache.misses == 1
    compiled = backend.compile_and_load(blob, devices, parsed)
    cache.store(key, backend, compiled)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [key], "written whole under its key, nothing else"
    loaded = cache.load(key, backend, devices, parsed)
    assert cache.hits == 1
    np.testing.assert_array_equal(_call(loaded, x), _call(compiled, x))

    (tmp_path / "cache" / key).write_bytes(b"not an executable")
    assert cache.load(key, backend, devices, parsed) is None, "a damaged entry is a miss"
    assert not (tmp_path / "cache" / key).exists(), "and is removed, to be written again"
    assert "could not be loaded" in caplog.text


def test_a_cache_that_cannot_be_written_costs_only_the_compile(tmp_path, caplog):
    x = np.ones(4, np.float32)
    blob, options, backend, devices, parsed = _compile(lambda a: a + 1, x)
    cache = CompileCache(str(tmp_path / "cache"))
    os.rmdir(cache.directory)  # gone under it (a full or unmounted disk would do the same)
    cache.store("k", backend, backend.compile_and_load(blob, devices, parsed))
    assert "could not keep an executable" in caplog.text and not os.path.exists(cache.directory)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def cluster(cache_dir):
    saved = os.environ.get(config.COMPILE_CACHE.name)
    os.environ[config.COMPILE_CACHE.name] = str(cache_dir)  # what the cluster's workers inherit
    try:
        yield from running_cluster(pw.Island(hosts=1, devices_per_host=1), pw.Island(hosts=1, devices_per_host=1))
    finally:
        if saved is None:
            os.environ.pop(config.COMPILE_CACHE.name, None)
        else:
            os.environ[config.COMPILE_CACHE.name] = saved


def test_a_worker_loads_what_another_worker_of_the_machine_compiled(cluster, cache_dir):
    pw.connect(cluster.address)
    try:
        session = pw.default_session()
        x = np.linspace(-2, 2, 8, dtype=np.float32)
        f = lambda a: jnp.tanh(a) * 5 - a  # noqa: E731
        blob, options = artifact(f, [jax.ShapeDtypeStruct(x.shape, x.dtype)], 1)
        addresses_of = {w["worker"]: w["address"] for w in status(cluster.address)["workers"]}
        results, counts = [], []
        for island in (0, 1):  # one worker compiles, then the other loads what it kept
            reply, addresses, devices = slice_of(session, 1, island)
            fn, future = session.define_xla(reply.slice, "tanh", blob, options, devices)
            compiled = future.result(WAIT)
            assert compiled.error == ""
            assert_analysis_is_local_jaxs(compiled.analysis, f, x)  # loaded or compiled, XLA says the same
            results.append(run_xla(session, addresses, compiled, fn, [x])[0])
            counts.append(worker_stats(addresses_of[reply.workers[0]])["compile_cache"])
        assert counts == [{"hits": 0, "misses": 1}, {"hits": 1, "misses": 0}]
        want = np.asarray(jax.jit(f)(x))
        for y in results:
            np.testing.assert_array_equal(y, want)
        kept = [p for p in cache_dir.iterdir() if p.is_file()]
        assert len(kept) == 1, "one executable kept for both workers"

        # jax.export functions (pw.jit) go through JAX's own persistent cache, in DIR/jax
        s = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)
        g = pw.jit(lambda a: jnp.sin(a) + 0.5, mesh=s.mesh("x"))
        np.testing.assert_allclose(np.asarray(g(x)), np.sin(x) + 0.5, rtol=1e-6)
        assert any((cache_dir / "jax").iterdir()), "the worker's jax.jit executables are kept in DIR/jax"
    finally:
        pw.disconnect()
