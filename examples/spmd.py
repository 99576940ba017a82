"""The same model, trained two ways on two hosts, with identical numbers:

- single controller: this process drives a pathways cluster of two one-device hosts;
- multi-controller: two processes under jax.distributed each run the training loop
  (``pw.spmd.run``), as classic multi-host JAX does.

The model is a plain function of arrays (``train_step``) and only the mesh differs: a
pathways slice's mesh in one mode, ``pw.spmd.mesh`` over the process group in the other.

    python examples/spmd.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw

STEPS, BATCH, WIDTH, LR = 5, 32, 16, 0.1


def train_step(params, x, y):
    """One SGD step of a two-layer MLP on a batch; with the batch sharded over the mesh, XLA
    adds the all-reduce of the gradients."""
    def loss_fn(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def data():
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((WIDTH, WIDTH), np.float32) / 4,
              "w2": rng.standard_normal((WIDTH, 1), np.float32) / 4}
    batches = [(rng.standard_normal((BATCH, WIDTH), np.float32), rng.standard_normal((BATCH, 1), np.float32))
               for _ in range(STEPS)]
    return params, batches


def train_multi_controller(params, batches):
    """Runs in every process of the group."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = pw.spmd.mesh("data")
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = jax.jit(train_step, in_shardings=(replicated, sharded, sharded), out_shardings=(replicated, replicated))
    params = pw.spmd.device_put(params, replicated)
    losses = []
    for x, y in batches:
        params, loss = step(params, pw.spmd.device_put(x, sharded), pw.spmd.device_put(y, sharded))
        losses.append(loss)
    return losses


def train_single_controller(params, batches):
    hosts = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    step = pw.jit(train_step, mesh=hosts.mesh("data"), in_shardings=(None, pw.P("data"), pw.P("data")))
    losses = []
    for x, y in batches:
        params, loss = step(params, x, y)
        losses.append(loss)
    return pw.device_get(losses)


def main():
    params, batches = data()
    multi = pw.spmd.run(
        functools.partial(train_multi_controller, params, batches), num_processes=2, echo=False)
    with pw.local_cluster(hosts=2, devices_per_host=1):
        single = train_single_controller(params, batches)
    print("multi-controller  losses:", np.round(np.asarray(multi, np.float32), 6))
    print("single controller losses:", np.round(np.asarray(single, np.float32), 6))
    print("identical:", all(float(a) == float(b) for a, b in zip(multi, single)))


if __name__ == "__main__":
    main()
