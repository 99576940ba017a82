"""The JAX side of tests/test_ring_attention.py: run as ``python ring_attention_checks.py GROUP``
in a process with four CPU devices, it runs one group of checks and prints their results as
one JSON object on its last line.

Groups (two, so that the test can run them side by side):

- ``numerics``: ring attention's output and its gradients against plain attention, with and
  without the causal mask, on 4 devices in the default and in another ring order, and on 2
  devices with the batch split over a second axis; and how many block pairs each device
  computed;
- ``lowering``: per-device working memory against plain attention; what the compiled
  program contains (the ring's sends, the causal skip); an AbstractMesh inside ``jax.jit``
  and through ``jax.export``; a mesh with explicit axes.
"""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways.conductor.ring_attention import _ring_attention_counted, attention, ring_attention

SCALE = 0.35


def relative_error(got, want) -> float:
    """The largest difference relative to the largest value: elementwise ratios would blow up
    where the reference is near zero."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    # Scaled up so that rows' maxima change from block to block and the rescaling is exercised.
    return tuple(jnp.asarray(2 * rng.standard_normal(shape), jnp.float32) for _ in range(3))


def with_grads(fn):
    """A function of (q, k, v) giving fn's output, the gradients of a weighted sum of that
    output (weights that differ by position, so that every output element matters), and
    fn's second result."""
    def run(q, k, v):
        out, vjp, aux = jax.vjp(fn, q, k, v, has_aux=True)
        weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return out, vjp(weights), aux
    return run


def numerics() -> dict:
    results = {}
    mesh4 = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,))
    mesh2x2 = jax.make_mesh((2, 2), ("b", "s"), axis_types=(AxisType.Auto,) * 2)
    cases = {"n4": (mesh4, None, None), "n4_order": (mesh4, (0, 2, 3, 1), None), "n2_batch": (mesh2x2, None, "b")}
    q, k, v = inputs((2, 2, 32, 8))
    for causal in (False, True):
        plain = with_grads(lambda q, k, v: (attention(q, k, v, causal=causal, scale=SCALE), None))
        want, want_grads, _ = jax.jit(plain)(q, k, v)
        for name, (mesh, order, batch_axis) in cases.items():
            sharded = NamedSharding(mesh, P(batch_axis, None, "s", None))
            ring = with_grads(lambda q, k, v: _ring_attention_counted(
                q, k, v, mesh=mesh, axis="s", causal=causal, scale=SCALE, order=order, batch_axis=batch_axis))
            # Jitted with the blocks' shardings on a concrete mesh, as a caller would.
            got, got_grads, counts = jax.jit(ring, in_shardings=(sharded,) * 3)(q, k, v)
            results[f"{name}_causal={causal}"] = {
                "output": relative_error(got, want),
                "grads": [relative_error(g, w) for g, w in zip(got_grads, want_grads)],
                "counts": np.asarray(counts).tolist(),
                "out_spec": str(got.sharding.spec),
            }
    return results


def lowering() -> dict:
    results = {}
    mesh = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Auto,))
    spec = P(None, None, "s", None)
    sharded = NamedSharding(mesh, spec)

    # Working memory per device at a sequence long enough for the score blocks to dominate.
    b, h, s, d = 1, 2, 2048, 16
    big = jax.ShapeDtypeStruct((b, h, s, d), jnp.float32)

    def temp_bytes(fn) -> int:
        compiled = jax.jit(fn, in_shardings=(sharded,) * 3, out_shardings=sharded).lower(big, big, big).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    results["memory"] = {
        "plain": temp_bytes(lambda q, k, v: attention(q, k, v, causal=True, scale=SCALE)),
        "ring": temp_bytes(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis="s", causal=True, scale=SCALE)),
        "score_block": b * h * (s // 4) ** 2 * 4,
    }

    # The compiled program: sends follow the ring order; a causal ring branches, a full one not.
    small = jax.ShapeDtypeStruct((1, 2, 32, 8), jnp.float32)
    for causal in (False, True):
        fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis="s", causal=causal, scale=SCALE,
                                                    order=(0, 2, 3, 1)))
        text = fn.lower(small, small, small).compile().as_text()
        results[f"hlo_causal={causal}"] = {
            "pairs": sorted(set(re.findall(r"source_target_pairs=(\{\S*\})", text))),
            "conditionals": text.count(" conditional("),
        }

    q, k, v = inputs((2, 2, 32, 8), seed=1)
    want = attention(q, k, v, causal=True, scale=SCALE)

    # An AbstractMesh inside jax.jit, the arguments sharded on the concrete mesh.
    abstract = mesh.abstract_mesh
    fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=abstract, axis="s", causal=True, scale=SCALE),
                 in_shardings=(sharded,) * 3, out_shardings=sharded)
    got = fn(q, k, v)
    results["abstract_jit"] = {"output": relative_error(got, want), "out_spec": str(got.sharding.spec)}

    # Exported with abstract shardings only (no devices named), then called on the devices.
    abstract_sharded = NamedSharding(abstract, spec)
    arg = jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=abstract_sharded)
    exported = jax.export.export(jax.jit(
        lambda q, k, v: ring_attention(q, k, v, mesh=abstract, axis="s", causal=True, scale=SCALE),
        in_shardings=(abstract_sharded,) * 3, out_shardings=abstract_sharded))(arg, arg, arg)
    placed = [jax.device_put(x, sharded) for x in (q, k, v)]
    results["abstract_export"] = {"output": relative_error(exported.call(*placed), want)}

    # Explicit axes: unsharded arguments are resharded into blocks.
    explicit = jax.make_mesh((4,), ("s",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(explicit):
        replicated = [jax.device_put(x, NamedSharding(explicit, P())) for x in (q, k, v)]
        got = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=explicit, axis="s", causal=True,
                                                     scale=SCALE))(*replicated)
    results["explicit"] = {"output": relative_error(got, want), "out_spec": str(got.sharding.spec)}
    return results


if __name__ == "__main__":
    group = {"numerics": numerics, "lowering": lowering}[sys.argv[1]]
    print(json.dumps(group()))
