"""A plain jax.numpy transformer block, with no sharding anywhere, distributed by ``pw.conduct``.

The block (layernorm, causal multi-head attention, an MLP, residuals) and its loss are
ordinary JAX. ``pw.conduct`` traces them, prices every way of sharding each operation over a
slice of 4 devices with the cluster's measured figures, and runs the cheapest plan; with a
memory limit below what plain attention needs on a device, the plan turns attention into
ring attention. Each result is checked against plain JAX in this process.

    pip install ".[planner]"                          # the solver the conductor's search uses
    python examples/conduct_transformer.py            # embedded cluster: one host, 4 devices
    python examples/conduct_transformer.py --seq 1024  # a longer sequence
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw

HEADS = 4


def layernorm(x, gain, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * gain + bias


def block(params, x):
    batch, seq, width = x.shape
    d = width // HEADS

    def heads(t):
        return t.reshape(batch, seq, HEADS, d).transpose(0, 2, 1, 3)

    h = layernorm(x, params["g1"], params["b1"])
    q, k, v = heads(h @ params["wq"]), heads(h @ params["wk"]), heads(h @ params["wv"])
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(d)
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    attended = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
    x = x + attended.transpose(0, 2, 1, 3).reshape(batch, seq, width) @ params["wo"]
    h = layernorm(x, params["g2"], params["b2"])
    return x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]


def loss(params, x):
    return (block(params, x) ** 2).mean()


def init(width, seq, batch, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"g1": (width,), "b1": (width,), "wq": (width, width), "wk": (width, width), "wv": (width, width),
              "wo": (width, width), "g2": (width,), "b2": (width,), "w1": (width, 4 * width),
              "w2": (4 * width, width)}
    params = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    params["g1"] += 1.0
    params["g2"] += 1.0
    return params, rng.standard_normal((batch, seq, width)).astype(np.float32)


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length (a multiple of 4)")
    parser.add_argument("--width", type=int, default=32, help="model width (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    params, x = init(args.width, args.seq, args.batch)
    with pw.local_cluster(islands=[pw.Island(hosts=1, devices_per_host=4)]):
        devices = pw.make_virtual_device_set().add_slice(cpu_devices=4).devices

        free = pw.conduct(block, devices)
        out = free(params, x)
        print(free.plan)
        print(f"without a memory limit: ring attention {free.plan.uses_ring_attention}, "
              f"error vs plain JAX {relative_error(pw.device_get(out), block(params, x)):.1e}\n")

        # The score matrix split 4 ways: plain attention needs twice that on a device (its
        # exponentials and its probabilities), however it is split.
        scores = args.batch * HEADS * args.seq * args.seq * 4
        limit = scores // 4
        tight = pw.conduct(loss, devices, memory_limit=limit)
        grads = pw.device_get(tight.grad()(params, x))
        want = jax.grad(loss)(params, x)
        print(f"memory limit {limit / 2 ** 20:.2f} MiB per device: ring attention {tight.plan.uses_ring_attention}, "
              f"predicted peak {tight.plan.peak_bytes / 2 ** 20:.2f} MiB, largest gradient error vs plain JAX "
              f"{max(relative_error(grads[k], want[k]) for k in want):.1e}")


if __name__ == "__main__":
    main()
