"""Every dtype, bit for bit, on both paths: 64-bit integers beyond 2**31, float64, complex128
and uint64 held, moved and computed by the workers as local JAX does, with the client's x64
setting deciding (a worker never narrows what a client sends). One island of one host with
two devices and one of two hosts with one device each; two clients, one with x64 and one
without, on the same workers at once."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pathways as pw
from tests.conftest import pids_alive

ROOT = Path(__file__).resolve().parent.parent

# The values and the computation, the same for every way of running them. Each result is
# reported as its dtype, shape and bytes, so that equality is bit for bit.
VALUES = """
import numpy as np
VALUES = [
    np.array([2**40 + 3, -5, 2**62 + 1, -(2**53) - 1], np.int64),
    np.array([1 / 3, 1e300, -2.5e-310, np.pi]),
    np.array([1 + 2j, 1e200 - 3e-200j, -0.5j, 7.25], np.complex128),
    np.array([2**64 - 1, 2**63 + 5, 7, 0], np.uint64),
]

def compute(a, b, c, d):
    import jax.numpy as jnp
    return [a * 3 + 1, a.sum(), a // 7, b / 3, jnp.sqrt(b * b), b.sum(), c * c.conj(), c * 1j,
            d + np.uint64(1), d // 3, a.astype(b.dtype), a > 7]

def elementwise(a, b, c, d):
    return [a * 3 + 1, b / 3, c * 1j, d + np.uint64(1)]

def report(arrays):
    return [[str(x.dtype), list(x.shape), x.tobytes().hex()] for x in (np.asarray(v) for v in arrays)]
"""

# Local JAX, or unmodified JAX under the proxy: arrays on the first island (one host, two
# devices) and on the second (two hosts); jax.devices() lists both islands' in that order.
JAX_SCRIPT = VALUES + """
import json, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
out = {}
devices = jax.devices()
for name, pair in (("one host", devices[:2]), ("two hosts", devices[2:4])):
    rows = NamedSharding(Mesh(np.array(pair), ("x",)), P("x"))
    placed = [jax.device_put(v, rows) for v in VALUES]
    # an array on the default device resharded by jit: the front end copies it over
    copied = [jax.jit(lambda a: a, in_shardings=rows)(jax.numpy.asarray(v)) for v in VALUES]
    out[name] = report(placed) + report(jax.jit(compute)(*placed)) + report(copied)
single = [jax.device_put(v, devices[0]) for v in VALUES]
out["one device"] = report(single) + report(jax.jit(compute)(*single))
print("RESULT", json.dumps(out))
"""

# The native client against the same cluster, beside local JAX in the same process.
NATIVE_SCRIPT = VALUES + """
import json, sys, jax
import pathways as pw
out, local = {}, {}
pw.connect(sys.argv[1])
for name, island in (("one host", 0), ("two hosts", 1)):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2, island=island)
    mesh = s.mesh(("x",))
    placed = [pw.device_put(v, s.devices) for v in VALUES]
    rows = [v.reshape(2, 2) for v in VALUES]  # pmap: a row per device
    out[name] = (report(placed) + report(pw.jit(lambda *a: compute(*a), mesh=mesh)(*VALUES))
                 + report(pw.pmap(elementwise, devices=s.devices)(*rows)))
    local[name] = (report([jax.device_put(v) for v in VALUES]) + report(jax.jit(compute)(*VALUES))
                   + report(jax.vmap(elementwise)(*rows)))
print("RESULT", json.dumps({"pathways": out, "local": local}))
"""


@pytest.fixture(scope="module")
def cluster():
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=2), pw.Island(hosts=2, devices_per_host=1)],
                          ifrt=True) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"


def _env(x64: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PATHWAYS_", "IFRT_PROXY_", "JAX_", "XLA_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_ENABLE_X64="1" if x64 else "0", **extra)
    return env


def _start(script: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, what: str) -> dict:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{what} failed ({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _local(x64: bool) -> subprocess.Popen:
    return _start(JAX_SCRIPT, _env(x64, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4"))


def _proxied(address: str, x64: bool) -> subprocess.Popen:
    # the backend as the package's jax_plugins entry point registers it
    register = "from pathways.ifrt import plugin; plugin.initialize()\n"
    return _start(register + textwrap.dedent(JAX_SCRIPT), _env(x64, JAX_PLATFORMS="proxy",
                                                                JAX_BACKEND_TARGET=address))


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    problems = [f"{where} result {i}: {g[:2]} {g[2][:48]} against local {w[:2]} {w[2][:48]}"
                for where in want for i, (g, w) in enumerate(zip(got[where], want[where])) if g != w]
    assert not problems, f"{what}: {len(problems)} results differ from local JAX:\n" + "\n".join(problems)


def test_an_x64_client_and_an_x32_client_on_the_same_workers_both_get_local_jaxs_bits(cluster):
    runs = {(way, x64): _local(x64) if way == "local" else _proxied(cluster.ifrt_address, x64)
            for way in ("local", "proxy") for x64 in (True, False)}  # the two proxied clients run at once
    results = {key: _result(proc, f"{key[0]} with x64={key[1]}") for key, proc in runs.items()}
    wide = results[("local", True)]
    assert wide["one device"][0][0] == "int64" and wide["one device"][3][0] == "uint64"
    assert results[("local", False)]["one device"][0][0] == "int32"  # without x64, JAX narrows
    for x64 in (True, False):
        _assert_same(results[("proxy", x64)], results[("local", x64)], f"the proxy with x64={x64}")


def test_native_pmap_jit_and_device_put_of_64_bit_types_equal_local_jax(cluster):
    result = _result(_start(NATIVE_SCRIPT, _env(True), cluster.address),
                     "the native client with x64")
    assert result["local"]["one host"][0][0] == "int64"
    _assert_same(result["pathways"], result["local"], "the native client with x64")
