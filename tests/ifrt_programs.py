"""Plain JAX programs, with no pathways import, that the IFRT proxy tests run twice: on
pathways under ``JAX_PLATFORMS=proxy`` and on local CPU JAX with four host devices.

    python tests/ifrt_programs.py PROGRAM OUT.npz [PROGRAM OUT.npz ...]

runs each PROGRAM in turn and writes every result it computed to its OUT.npz, or the
traceback of what it raised to OUT.npz.error (the next program still runs); the test
compares the two files. The tests run every program they need in one process per way of
running (one JAX start each, not one per program). The programs place arrays by device
index, so both runs use the same logical placement: under the proxy the devices are numbered
island by island, host by host, on a cluster of two islands (2 hosts x 1 device, then 1
host x 2 devices), so devices 0 and 1 are island 0's two hosts and devices 2 and 3 island
1's host.

Keys starting with ``approx_`` hold floating-point results of reductions (sums, matmuls,
gradients, training) and are compared to 1e-6; ``meta_`` keys (wall times) are not compared;
every other key must be bit-identical.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Results = dict[str, Any]

STOP_ENV = "IFRT_PROGRAMS_STOP"  # a file: `concurrent` repeats its calls until it exists
REPEAT_LIMIT = 120.0  # seconds


def island0() -> list:
    """Both hosts of island 0 under the proxy."""
    return jax.devices()[:2]


def island1() -> list:
    """The two devices of island 1's one host under the proxy."""
    return jax.devices()[2:4]


def layout(name: str, x: jax.Array, out: Results) -> None:
    """Where ``x``'s shards are, in device order: ids, index bounds (start, stop per dim)
    and each shard's data, next to the whole value."""
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    out[f"{name}_shard_devices"] = np.array([s.device.id for s in shards])
    out[f"{name}_shard_index"] = np.array([[(i.start or 0, x.shape[d] if i.stop is None else i.stop)
                                            for d, i in enumerate(s.index)] for s in shards]).reshape(len(shards), -1)
    for k, s in enumerate(shards):
        out[f"{name}_shard{k}"] = host(s.data)
    out[f"{name}_devices"] = np.array(sorted(d.id for d in x.sharding.device_set))
    out[f"{name}_replicated"] = np.array(x.is_fully_replicated)
    out[name] = host(x)


def host(x: Any) -> np.ndarray:
    """``x`` fetched; ml_dtypes' types (bfloat16, int4, float8, ...) as their bits, in
    unsigned integers of their size (numpy files cannot hold them)."""
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.isbuiltin == 2 else a  # 2: a type numpy does not define


def data(seed: int, *shape: int, dtype: Any = np.float32) -> np.ndarray:
    return np.random.RandomState(seed).standard_normal(shape).astype(dtype)


# ---- the programs ---------------------------------------------------------------------


def devices() -> Results:
    ds = jax.devices()
    return {"count": np.array(len(ds)), "ids": np.array([d.id for d in ds]),
            "platforms": np.array([d.platform for d in ds]), "kinds": np.array([d.device_kind for d in ds]),
            "backend": np.array(jax.default_backend()), "process_count": np.array(jax.process_count()),
            "process_index": np.array(jax.process_index()), "device_count": np.array(jax.device_count()),
            "local_device_count": np.array(jax.local_device_count()),
            "process_indices": np.array([d.process_index for d in ds]),
            "local_ids": np.array([d.id for d in jax.local_devices()])}


def device_put() -> Results:
    out: Results = {}
    x = np.arange(24, dtype=np.float32).reshape(4, 6) * 0.5 - 3.0
    layout("default", jax.device_put(x), out)
    layout("single", jax.device_put(x, jax.devices()[3]), out)
    mesh0, mesh1 = Mesh(island0(), ("x",)), Mesh(island1(), ("y",))
    layout("replicated", jax.device_put(x, NamedSharding(mesh0, P())), out)
    layout("rows", jax.device_put(x, NamedSharding(mesh0, P("x"))), out)
    layout("columns", jax.device_put(x, NamedSharding(mesh1, P(None, "y"))), out)
    layout("replicated1", jax.device_put(x, NamedSharding(mesh1, P())), out)
    # a non-contiguous host buffer
    layout("strided", jax.device_put(x.T, NamedSharding(mesh0, P("x"))), out)
    for dtype in (np.int32, np.uint8, np.bool_, np.float16, np.int8, np.int64, jnp.bfloat16):
        value = (np.arange(16).reshape(2, 8) % 7 - 2).astype(dtype)
        name = np.dtype(dtype).name
        layout(f"dtype_{name}", jax.device_put(value, NamedSharding(mesh0, P("x"))), out)
    out["scalar"] = host(jax.device_put(np.float32(2.5), jax.devices()[1]))
    out["empty"] = host(jax.device_put(np.zeros((0, 3), np.float32), jax.devices()[2]))
    return out


def device_put_all() -> Results:
    """A 2-D mesh over all four devices, both islands: arrays may be laid out across islands
    (only executables may not span them)."""
    out: Results = {}
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    layout("tiled", jax.device_put(x, NamedSharding(mesh, P("a", "b"))), out)
    layout("half", jax.device_put(x, NamedSharding(mesh, P("a"))), out)
    layout("replicated", jax.device_put(x, NamedSharding(mesh, P())), out)
    return out


# every element type jax.numpy has
DTYPES = ("bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 complex64 complex128 "
          "bfloat16 int2 uint2 int4 uint4 float4_e2m1fn float8_e3m4 float8_e4m3 float8_e4m3fn float8_e4m3b11fnuz "
          "float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu").split()


def _unreadable(token: Any) -> bool:
    """Whether reading ``token``'s buffer fails as JAX's runtime says it does: a token has
    no data."""
    try:
        token._buf._value
    except RuntimeError as e:
        return "Cannot convert a token-shape buffer to a numpy array." in str(e)
    return False


def types_and_trivial() -> Results:
    """Every element type put, read, passed through an executable and computed on, on one
    device and across island 0's two hosts; tokens as parameters and outputs; executables
    with no parameter, no output, or outputs that are their inputs."""
    out: Results = {}
    rows = NamedSharding(Mesh(island0(), ("x",)), P("x"))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    # the input as it came, and computed on (one executable each: compiles are most of the time)
    same_and_double = jax.jit(lambda v: (v, (v.astype(jnp.float32) * 2).astype(v.dtype)))
    for name in DTYPES:
        dtype = jnp.dtype(name)
        value = (np.arange(16).reshape(2, 8) % 5 - 2).astype(dtype)
        for where, sharding in (("one", one), ("rows", rows)):
            x = jax.device_put(value, sharding)
            out[f"{name}_{where}_put"] = host(x)
            same, doubled = same_and_double(x)
            out[f"{name}_{where}_same"] = host(same)
            layout(f"{name}_{where}_double", doubled, out)
        out[f"{name}_dtype"] = np.array(str(x.dtype))
        if name in ("int4", "uint2", "float8_e4m3fn", "float4_e2m1fn"):  # from island 0's hosts to island 1
            layout(f"{name}_moved", jax.device_put(x, one), out)
    token = jax.lax.create_token()
    for where, sharding in (("one", one), ("rows", rows)):
        x = jax.device_put(np.arange(8, dtype=np.float32), sharding)
        y, made = jax.jit(lambda v: (v + 1, jax.lax.create_token()))(x)
        passed, z = jax.jit(lambda t, v: (t, v * 3))(made, y)
        w, echoed = jax.jit(lambda v, t: (v - 1, t))(z, token)
        captured, _ = jax.jit(lambda v: (token, v))(w)
        out[f"token_{where}"] = host(w)
        out[f"token_{where}_kinds"] = np.array([type(t).__name__ for t in (made, passed, echoed, captured)])
        out[f"token_{where}_ready"] = np.array(jax.block_until_ready(passed) is passed)
        out[f"token_{where}_unreadable"] = np.array([_unreadable(t) for t in (token, made, passed, echoed, captured)])
        layout(f"no_parameter_{where}", jax.jit(lambda: jnp.arange(8.0) * 2, out_shardings=sharding)(), out)
        out[f"no_output_{where}"] = np.array([len(jax.jit(lambda v: ())(x)),  # the unused parameter dropped
                                              len(jax.jit(lambda v: (), keep_unused=True)(x))])
        same = jax.jit(lambda v: v)(x)
        layout(f"identity_{where}", same, out)
        a, b, c = jax.jit(lambda v, u: (u, 1, v))(x, same * 2)
        layout(f"reordered_{where}", a, out)
        out[f"reordered_{where}_literal"], out[f"reordered_{where}_last"] = host(b), host(c)
        first, second = jax.jit(lambda v: (v, v))(x)
        out[f"twice_{where}"] = np.stack([host(first), host(second)])
        x.delete()  # the identity's outputs are arrays of their own
        out[f"identity_{where}_after_delete"] = np.stack([host(same), host(first)])
        donor = jax.device_put(np.arange(8, dtype=np.int32), sharding)
        layout(f"donated_identity_{where}", jax.jit(lambda v: v, donate_argnums=0)(donor), out)
        out[f"donated_identity_{where}_deleted"] = np.array(donor.is_deleted())
    return out


def jit_elementwise() -> Results:
    out: Results = {}

    @jax.jit
    def f(x, y):
        return jnp.sin(x) * y + jnp.exp(-x * x) - jnp.tanh(y) / (1.0 + x * x), jnp.where(x > y, x, y)

    @jax.jit
    def g(a, b):
        return (a * 3 + b) // 2, a % 5, (a & b) ^ (a | 7), (a > b).astype(jnp.int32), a.astype(jnp.float32) / 3

    x, y = data(0, 16, 8), data(1, 16, 8)
    a = np.arange(128, dtype=np.int32).reshape(16, 8) - 40
    b = np.arange(128, dtype=np.int32)[::-1].reshape(16, 8) + 1
    for k, v in enumerate(f(x, y)):
        out[f"f{k}"] = host(v)
    for k, v in enumerate(g(a, b)):
        out[f"g{k}"] = host(v)
    rows = NamedSharding(Mesh(island0(), ("x",)), P("x"))
    for k, v in enumerate(f(jax.device_put(x, rows), jax.device_put(y, rows))):
        layout(f"sharded_f{k}", v, out)
    on1 = jax.devices()[2]  # the computation follows its committed inputs to island 1
    for k, v in enumerate(g(jax.device_put(a, on1), jax.device_put(b, on1))):
        layout(f"island1_g{k}", v, out)
    out["scalar"] = host(jax.jit(lambda s: s * 2 + 1)(np.float32(3.25)))
    out["bf16"] = host(jax.jit(lambda v: (v * 1.5).astype(jnp.bfloat16))(x))
    return out


def jit_matmul() -> Results:
    out: Results = {}
    a, b = data(2, 64, 32), data(3, 32, 16)
    mm = jax.jit(jnp.matmul)
    out["approx_matmul"] = host(mm(a, b))
    ia, ib = (np.arange(12).reshape(3, 4) - 5).astype(np.int32), (np.arange(8).reshape(4, 2) + 1).astype(np.int32)
    out["int_matmul"] = host(mm(ia, ib))
    out["approx_einsum"] = host(jax.jit(lambda p, q: jnp.einsum("bij,bjk->bik", p, q))(data(4, 3, 5, 6),
                                                                                      data(5, 3, 6, 2)))
    mesh = Mesh(island0(), ("x",))
    # rows sharded: no communication
    rows = mm(jax.device_put(a, NamedSharding(mesh, P("x"))), jax.device_put(b, NamedSharding(mesh, P())))
    out["approx_rows"] = host(rows)
    out["rows_devices"] = np.array(sorted(d.id for d in rows.sharding.device_set))
    # the contraction dimension sharded: an all-reduce across island 0's two hosts
    summed = jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P()))(
        jax.device_put(a, NamedSharding(mesh, P(None, "x"))), jax.device_put(b, NamedSharding(mesh, P("x"))))
    out["approx_contraction"] = host(summed)
    out["contraction_replicated"] = np.array(summed.is_fully_replicated)
    return out


def jit_reductions() -> Results:
    out: Results = {}
    x = data(6, 32, 16)
    i = (np.arange(512).reshape(32, 16) % 13 - 6).astype(np.int32)
    f = jax.jit(lambda v: (v.sum(), v.mean(axis=0), jnp.std(v, axis=1), jax.nn.logsumexp(v), jnp.cumsum(v, axis=0)))
    for k, v in enumerate(f(x)):
        out[f"approx_float{k}"] = host(v)
    g = jax.jit(lambda v: (v.max(), v.min(axis=1), jnp.argmax(v, axis=0), jnp.argmin(v), jnp.sort(v, axis=1)))
    for k, v in enumerate(g(x)):
        out[f"order{k}"] = host(v)
    h = jax.jit(lambda v: (v.sum(), v.sum(axis=1), jnp.prod(v[:4, :4] + 7, axis=0), jnp.cumsum(v, axis=1)))
    for k, v in enumerate(h(i)):
        out[f"int{k}"] = host(v)
    mesh = Mesh(island0(), ("x",))
    sharded = jax.device_put(x, NamedSharding(mesh, P("x")))
    out["approx_sharded_sum"] = host(jax.jit(lambda v: v.sum(axis=0))(sharded))
    out["sharded_max"] = host(jax.jit(lambda v: v.max())(sharded))
    out["sharded_int_sum"] = host(jax.jit(lambda v: v.sum())(jax.device_put(i, NamedSharding(mesh, P("x")))))
    return out


def linalg() -> Results:
    """Linear algebra whose CPU kernels call LAPACK routines (LU, Cholesky, QR, eigen- and
    singular-value decompositions, triangular solves), in float32 and complex64: a worker
    that compiles what the client sent must have them resolved, as local JAX has."""
    out: Results = {}
    m = data(7, 6, 6) + 6 * np.eye(6, dtype=np.float32)
    spd = m @ m.T
    v = data(8, 6, 2)
    f = jax.jit(lambda m, s, v: (
        jnp.linalg.solve(m, v), jnp.linalg.det(m), jnp.linalg.inv(m), jnp.linalg.cholesky(s), jnp.linalg.qr(m)[1],
        jnp.linalg.eigh(s)[0], jnp.linalg.svd(m, compute_uv=False), jax.scipy.linalg.lu(m)[2],
        jax.scipy.linalg.solve_triangular(jnp.tril(m), v, lower=True), jnp.sort_complex(jnp.linalg.eigvals(m))))
    for k, x in enumerate(f(m, spd, v)):
        out[f"approx_linalg{k}"] = host(x)
    c = (m + 1j * data(9, 6, 6)).astype(np.complex64)
    out["approx_complex_solve"] = host(jax.jit(jnp.linalg.solve)(c, v.astype(np.complex64)))
    return out


def _mlp_params(seed: int, sizes: tuple[int, ...]) -> list[dict[str, np.ndarray]]:
    rs = np.random.RandomState(seed)
    return [{"w": (rs.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32), "b": np.zeros(n, np.float32)}
            for m, n in zip(sizes[:-1], sizes[1:])]


def _mlp(params: list, x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def _mse(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((_mlp(params, x) - y) ** 2)


def _flat(prefix: str, tree: Any, out: Results) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[prefix + jax.tree_util.keystr(path).replace("'", "")] = host(leaf)


def mlp_grad() -> Results:
    out: Results = {}
    params = _mlp_params(7, (8, 32, 32, 4))
    x, y = data(8, 16, 8), data(9, 16, 4)
    _flat("approx_grad", jax.jit(jax.grad(_mse))(params, x, y), out)
    loss, grads = jax.jit(jax.value_and_grad(_mse))(params, x, y)
    out["approx_loss"] = host(loss)
    _flat("approx_vgrad", grads, out)
    # with respect to the input too, and unjitted (op by op)
    gx = jax.grad(_mse, argnums=(0, 1))(params, x, y)[1]
    out["approx_grad_x"] = host(gx)
    return out


def vmap() -> Results:
    out: Results = {}
    w = data(10, 8, 3)
    per_example = lambda v, s: jnp.tanh(v @ w) * s  # noqa: E731
    xs, ss = data(11, 5, 8), data(12, 5)
    out["approx_batched"] = host(jax.jit(jax.vmap(per_example))(xs, ss))
    out["approx_in_axes"] = host(jax.vmap(per_example, in_axes=(0, None))(xs, np.float32(2.0)))
    out["approx_nested"] = host(jax.jit(jax.vmap(jax.vmap(lambda a, b: a @ b, (0, None)), (None, 1)))(
        data(13, 4, 6), data(14, 6, 3)))
    out["elementwise"] = host(jax.vmap(lambda a, b: a * b + 1, in_axes=(1, 0), out_axes=1)(data(15, 3, 4), data(16, 4, 3)))
    out["approx_per_example_grads"] = host(jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(jnp.sin(v @ w)))))(xs))
    return out


def loops() -> Results:
    out: Results = {}

    def step(carry, x):
        h = jnp.tanh(carry * 0.9 + x)
        return h, h * 2

    final, ys = jax.jit(lambda xs: jax.lax.scan(step, jnp.zeros(4, jnp.float32), xs))(data(17, 20, 4))
    out["scan_final"], out["scan_ys"] = host(final), host(ys)
    out["scan_int"] = host(jax.lax.scan(lambda c, x: (c + x, c * x), 0, np.arange(10, dtype=np.int32))[1])
    out["fori"] = host(jax.jit(lambda n: jax.lax.fori_loop(0, 50, lambda i, v: v * 1.01 + i, n))(np.float32(1.0)))
    out["fori_dynamic"] = host(jax.jit(lambda k: jax.lax.fori_loop(0, k, lambda i, v: v + i * i, 0))(np.int32(30)))
    out["while"] = host(jax.jit(lambda v: jax.lax.while_loop(lambda c: c[0] < 100, lambda c: (c[0] * 3, c[1] + 1),
                                                             (v, 0)))(np.int32(1)))
    out["cond"] = host(jax.jit(lambda p, v: jax.lax.cond(p, jnp.sin, jnp.cos, v))(True, data(18, 3)))
    return out


def random() -> Results:
    out: Results = {}
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    out["key_data"] = host(jax.random.key_data(k1))
    out["normal"] = host(jax.random.normal(k1, (16, 4)))
    out["uniform"] = host(jax.random.uniform(k2, (32,), minval=-1.0, maxval=2.0))
    out["randint"] = host(jax.random.randint(k3, (8, 8), 0, 100))
    out["permutation"] = host(jax.random.permutation(k1, 20))
    out["bernoulli"] = host(jax.random.bernoulli(k2, 0.3, (64,)))
    out["bits"] = host(jax.random.bits(jax.random.PRNGKey(42), (10,)))
    out["legacy_normal"] = host(jax.random.normal(jax.random.PRNGKey(7), (5,)))
    out["jit_split"] = host(jax.random.key_data(jax.jit(lambda k: jax.random.split(k, 4))(key)))
    mesh = Mesh(island0(), ("x",))
    sharded = jax.jit(lambda k: jax.random.normal(k, (8, 4)), out_shardings=NamedSharding(mesh, P("x")))(k2)
    layout("sharded_normal", sharded, out)
    out["fold_in"] = host(jax.random.uniform(jax.random.fold_in(key, 3), (4,)))
    return out


def psum() -> Results:
    """A mesh over both hosts of island 0: collectives cross the two worker processes."""
    out: Results = {}
    mesh = Mesh(island0(), ("x",))
    x = np.arange(16, dtype=np.float32).reshape(8, 2) * 0.25 - 1.0
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    total = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))(xs)
    layout("psum", total, out)
    out["pmean"] = host(jax.jit(jax.shard_map(lambda b: jax.lax.pmean(b, "x"), mesh=mesh, in_specs=P("x"),
                                              out_specs=P()))(xs))
    out["all_gather"] = host(jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b, "x", tiled=True), mesh=mesh,
                                                   in_specs=P("x"), out_specs=P(), check_vma=False))(xs))
    out["ppermute"] = host(jax.jit(jax.shard_map(lambda b: jax.lax.ppermute(b, "x", [(0, 1), (1, 0)]), mesh=mesh,
                                                 in_specs=P("x"), out_specs=P("x")))(xs))
    out["axis_index"] = host(jax.jit(jax.shard_map(lambda b: b * 0 + jax.lax.axis_index("x"), mesh=mesh,
                                                   in_specs=P("x"), out_specs=P("x")))(xs))
    ints = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P("x")))
    out["int_psum"] = host(jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"),
                                                 out_specs=P()))(ints))

    # the same through sharding constraints: the partitioner inserts the all-reduce
    @jax.jit
    def constrained(v):
        v = jax.lax.with_sharding_constraint(v * 2, NamedSharding(mesh, P("x")))
        return jax.lax.with_sharding_constraint(v.sum(axis=0), NamedSharding(mesh, P()))

    layout("constrained", constrained(xs), out)
    return out


def layouts() -> Results:
    """An unreduced output, whose devices hold different partial sums of one block, read
    shard by shard, reduced, and computed on, and an unreduced array made of partial values
    held apart; on island 0's two hosts and on island 1's one host."""
    out: Results = {}
    x = np.arange(8, dtype=np.float32).reshape(4, 2) - 3.0
    for name, devs in (("hosts", island0()), ("host", island1())):
        mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devs)
        with jax.set_mesh(mesh):
            a, b = jax.device_put(x.T, P(None, "x")), jax.device_put(x, P("x", None))
            partial = jax.jit(lambda a, b: jnp.einsum("ab,bc->ac", a, b, out_sharding=P(unreduced={"x"})))(a, b)
            shards = sorted(partial.addressable_shards, key=lambda s: s.device.id)
            for k, shard in enumerate(shards):
                out[f"{name}_partial{k}"] = host(shard.data)
            out[f"{name}_reduced"] = host(jax.sharding.reshard(partial, P()))
            out[f"{name}_twice"] = host(jax.sharding.reshard(jax.jit(lambda p: p + p)(partial), P()))
            # an unreduced array made of partial values held apart, one per device
            parts = [jax.device_put(x * (i + 1), d) for i, d in enumerate(devs)]
            made = jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, P(unreduced={"x"})), parts)
            for k, shard in enumerate(sorted(made.addressable_shards, key=lambda s: s.device.id)):
                out[f"{name}_made{k}"] = host(shard.data)
            out[f"{name}_made_reduced"] = host(jax.sharding.reshard(made, P()))
    return out


def _hlo(text: str) -> str:
    """An executable's HLO text without what records where the program was traced (the tables
    of files, functions and stack frames after the module's first line, and references to
    their frames), which differ with how the program was started."""
    first, _, rest = text.partition("\n")
    computations = rest[rest.index("\n%"):] if "\n%" in rest else rest
    return first + re.sub(r" stack_frame_id=\d+", "", computations)


def compiled_analysis() -> Results:
    """What XLA says of compiled executables: cost analysis, memory analysis and HLO text,
    of one device and of executables sharded over one host's two devices and over two hosts."""
    out: Results = {}

    def record(name: str, compiled: Any) -> None:
        for key, value in compiled.cost_analysis().items():
            out[f"{name}_cost_{re.sub(r'[^0-9A-Za-z]', '_', key)}"] = np.asarray(value)
        memory = compiled.memory_analysis()
        for field in ("generated_code_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                      "alias_size_in_bytes", "temp_size_in_bytes", "peak_memory_in_bytes"):
            out[f"{name}_memory_{field}"] = np.asarray(getattr(memory, field))
        out[f"{name}_text"] = np.frombuffer(_hlo(compiled.as_text()).encode(), np.uint8)

    x, y = data(30, 32, 16), data(31, 16, 8)
    record("one_device", jax.jit(lambda a, b: jnp.sin(a @ b).sum() + 2.0 * a.mean()).lower(x, y).compile())
    for name, devices in (("one_host", island1()), ("two_hosts", island0())):
        mesh = Mesh(devices, ("x",))
        cols, rows = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x"))
        f = jax.jit(lambda a, b: jnp.tanh(a @ b), in_shardings=(cols, rows), out_shardings=NamedSharding(mesh, P()))
        record(name, f.lower(x, y).compile())
    return out


def move() -> Results:
    """Arrays between devices of one island and between the islands."""
    out: Results = {}
    x = jax.device_put(data(19, 6, 4), jax.devices()[0])
    other_island = jax.device_put(x, jax.devices()[2])
    layout("to_island1", other_island, out)
    computed = jax.jit(lambda v: v * 2 + 1)(other_island)
    layout("computed_on_island1", computed, out)
    back = jax.device_put(computed, jax.devices()[1])
    layout("back_to_island0", back, out)
    layout("same_island", jax.device_put(x, jax.devices()[1]), out)
    mesh0, mesh1 = Mesh(island0(), ("x",)), Mesh(island1(), ("y",))
    rows0 = jax.device_put(data(20, 8, 4), NamedSharding(mesh0, P("x")))
    layout("sharded_to_island1", jax.device_put(rows0, NamedSharding(mesh1, P("y"))), out)
    layout("resharded_to_island1", jax.device_put(rows0, NamedSharding(mesh1, P(None, "y"))), out)
    layout("resharded_in_island0", jax.device_put(rows0, NamedSharding(mesh0, P(None, "x"))), out)
    layout("gathered_on_one", jax.device_put(rows0, jax.devices()[3]), out)
    out["source_intact"] = host(x)
    # a mesh of the same devices in another order: the client regroups the shards (a remap)
    for name, devices in (("one_host", island1()), ("two_hosts", island0())):
        rows = jax.device_put(data(25, 8, 4), NamedSharding(Mesh(devices, ("x",)), P("x")))
        backwards = Mesh(devices[::-1], ("x",))
        layout(f"reordered_{name}", jax.device_put(rows, NamedSharding(backwards, P("x"))), out)
        layout(f"reordered_resharded_{name}", jax.device_put(rows, NamedSharding(backwards, P(None, "x"))), out)
        layout(f"reordered_source_{name}", rows, out)
    return out


def donation() -> Results:
    out: Results = {}
    add = jax.jit(lambda a, b: a + b, donate_argnums=0)
    x, y = jax.device_put(data(21, 8, 4)), jax.device_put(data(22, 8, 4))
    z = add(x, y)
    out["result"] = host(z)
    out["donated_deleted"] = np.array(x.is_deleted())
    out["kept_deleted"] = np.array(y.is_deleted())
    try:
        np.asarray(x)
        out["read_donated_raised"] = np.array(False)
    except RuntimeError:
        out["read_donated_raised"] = np.array(True)
    # a training-style loop over sharded state, donated every step
    mesh = Mesh(island0(), ("x",))
    state = jax.device_put(np.ones((8, 2), np.float32), NamedSharding(mesh, P("x")))
    step = jax.jit(lambda s, k: s * 1.5 + k, donate_argnums=0)
    olds = []
    for k in range(5):
        olds.append(state)
        state = step(state, np.float32(k))
    out["loop_state"] = host(state)
    out["loop_olds_deleted"] = np.array([o.is_deleted() for o in olds])
    # offered, but XLA finds no output of its shape to give its buffer: it stays usable
    rows = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("x")))
    out["unusable_result"] = host(jax.jit(lambda v: v @ v.T, donate_argnums=0)(rows))
    out["unusable_deleted"] = np.array(rows.is_deleted())
    out["unusable_read"] = host(rows)
    return out


def deletion() -> Results:
    out: Results = {}
    x = jax.device_put(data(23, 4, 4), jax.devices()[1])
    y = x + 1
    out["before"] = np.array(x.is_deleted())
    x.delete()
    out["after"] = np.array(x.is_deleted())
    try:
        np.asarray(x)
        out["read_raised"] = np.array(False)
    except RuntimeError:
        out["read_raised"] = np.array(True)
    try:
        jax.jit(lambda v: v * 2)(x)
        out["use_raised"] = np.array(False)
    except RuntimeError:
        out["use_raised"] = np.array(True)
    out["other_intact"] = host(y)
    s = jax.device_put(data(24, 4, 4), NamedSharding(Mesh(island0(), ("x",)), P("x")))
    s.delete()
    out["sharded_after"] = np.array(s.is_deleted())
    x.delete()  # deleting twice is allowed
    out["twice"] = np.array(x.is_deleted())
    # many arrays made and dropped: the runtime keeps working
    for k in range(50):
        t = jax.device_put(np.full((64,), k, np.float32), jax.devices()[k % 4])
        del t
    out["still_works"] = host(jax.jit(lambda v: v.sum())(jax.device_put(np.arange(10, dtype=np.int32))))
    return out


def train_optax(steps: int = 100) -> Results:
    """100 steps of an MLP regression trained with adam; the loss curve and the parameters."""
    import optax

    params = _mlp_params(25, (4, 32, 32, 1))
    rs = np.random.RandomState(26)
    xs = rs.standard_normal((256, 4)).astype(np.float32)
    ys = (np.sin(xs.sum(axis=1, keepdims=True)) + 0.1 * rs.standard_normal((256, 1))).astype(np.float32)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_mse)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for k in range(steps):
        batch = slice(32 * (k % 8), 32 * (k % 8 + 1))
        params, state, loss = step(params, state, xs[batch], ys[batch])
        losses.append(loss)
    out: Results = {"approx_losses": np.array([host(v) for v in losses])}
    _flat("approx_params", params, out)
    out["improved"] = np.array(out["approx_losses"][-8:].mean() < out["approx_losses"][:8].mean())
    return out


def flax_model() -> Results:
    """A flax nnx model and a linen model: forward, and backward with respect to the parameters."""
    from flax import linen, nnx

    out: Results = {}

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(6, 16, rngs=rngs)
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.l2 = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.gelu(self.norm(self.l1(x))))

    model = Model(nnx.Rngs(0))
    x, y = data(27, 10, 6), data(28, 10, 3)
    out["approx_nnx_forward"] = host(nnx.jit(lambda m, v: m(v))(model, x))
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2)))(model)
    out["approx_nnx_loss"] = host(loss)
    _flat("approx_nnx_grad", nnx.state(grads), out)

    class Linen(linen.Module):
        @linen.compact
        def __call__(self, v):
            v = linen.Conv(4, (3,))(v)
            return linen.Dense(2)(linen.relu(v).reshape(v.shape[0], -1))

    net = Linen()
    images = data(29, 2, 8, 3)
    variables = jax.jit(net.init)(jax.random.key(1), images)
    _flat("approx_linen_init", variables, out)
    out["approx_linen_forward"] = host(jax.jit(net.apply)(variables, images))
    _flat("approx_linen_grad", jax.jit(jax.grad(lambda p: jnp.sum(net.apply(p, images) ** 2)))(variables), out)
    return out


def concurrent(calls: int = 40) -> Results:
    """A loop of small collectives across island 0's two hosts, for running alongside other
    clients: ``calls`` different ones; then, when STOP_ENV names a file, a started marker
    beside it (:func:`started`) and the same calls again until that file exists (at most
    REPEAT_LIMIT seconds), so that the test decides how long clients overlap. ``meta_``
    keys say when it ran."""
    start = time.time()
    mesh = Mesh(island0(), ("x",))
    f = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b * b, "x") + 1.0, mesh=mesh, in_specs=P("x"), out_specs=P()))
    x = jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), NamedSharding(mesh, P("x")))
    values = [host(f(x + k)) for k in range(calls)]
    again, k = [], 0
    stop = os.environ.get(STOP_ENV)
    if stop:
        Path(f"{stop}.started-{os.getpid()}").touch()
        deadline = time.monotonic() + REPEAT_LIMIT
        while not os.path.exists(stop) and time.monotonic() < deadline:
            again.append(np.array_equal(host(f(x + k % calls)), values[k % calls]))
            k += 1
    return {"values": np.stack(values), "repeats_equal": np.array(all(again)), "meta_start": np.array(start),
            "meta_end": np.array(time.time()), "meta_calls": np.array(calls + k)}


def started(stop: str | Path) -> list[Path]:
    """The markers of the ``concurrent`` programs that run until ``stop`` exists and have
    made their first calls."""
    stop = Path(stop)
    return sorted(stop.parent.glob(f"{stop.name}.started-*"))


PROGRAMS: dict[str, Callable[[], Results]] = {
    f.__name__: f for f in (devices, device_put, device_put_all, types_and_trivial, jit_elementwise, jit_matmul,
                            jit_reductions, linalg, mlp_grad, vmap, loops, random, psum, layouts, compiled_analysis,
                            move, donation, deletion, train_optax, flax_model, concurrent)}


def main(argv: list[str]) -> int:
    pairs = list(zip(argv[::2], argv[1::2]))
    if not pairs or len(argv) % 2 or any(name not in PROGRAMS for name, _ in pairs):
        print(f"usage: ifrt_programs.py {{{','.join(PROGRAMS)}}} OUT.npz [PROGRAM OUT.npz ...]", file=sys.stderr)
        return 2
    failed = 0
    for name, path in pairs:
        try:
            results = {k: np.asarray(v) for k, v in PROGRAMS[name]().items()}
        except Exception:  # reported in the program's own file; the next program still runs
            Path(error_path(path)).write_text(traceback.format_exc())
            failed += 1
            continue
        np.savez(path, **results)
    return 1 if failed else 0


def error_path(out: str | Path) -> str:
    """Where a program that raised leaves its traceback instead of OUT.npz."""
    return f"{out}.error"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
