"""Train a small MLP with optax: a plain JAX script with no pathways import.

It needs optax (`pip install ".[examples]"`). It runs as is on local JAX (`python
examples/train_mlp.py`) and, unchanged, on a pathways cluster through the IFRT proxy:

    python -m pathways run examples/train_mlp.py --steps 200
    JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://127.0.0.1:PORT python examples/train_mlp.py

It fits y = sin(3x) + x/2 on random points and prints the loss every --every steps.
"""

import argparse

import jax
import jax.numpy as jnp
import optax


def init_params(key, sizes):
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in),
                       "b": jnp.zeros((n_out,))})
    return params


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50, help="print the loss every this many steps")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    print(f"devices: {jax.devices()}")
    key = jax.random.PRNGKey(0)
    key, data_key = jax.random.split(key)
    x = jax.random.uniform(data_key, (args.batch, 1), minval=-2.0, maxval=2.0)
    y = jnp.sin(3.0 * x) + 0.5 * x

    params = init_params(key, [1, 64, 64, 64, 1])
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for i in range(1, args.steps + 1):
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % args.every == 0 or i == 1:
            print(f"step {i:5d} loss {float(loss):.6f}", flush=True)


if __name__ == "__main__":
    main()
