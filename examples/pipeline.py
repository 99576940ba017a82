"""GPipe pipeline-parallel training on pathways, checked against plain JAX.

A 4-stage MLP, one stage per single-device slice, trained with 4 microbatches per step. Each
training step is one ``@pw.program`` (forward of every microbatch through every stage, loss,
backward in reverse stage order with gradient accumulation, SGD on every stage); the
parameters it returns stay on the cluster and feed the next step. Only the losses are
fetched, at the end, and compared with the same training run in this process with JAX.

    pip install ".[planner]"                  # the solver pw.pipeline's optimal split uses
    python examples/pipeline.py               # embedded cluster: one island, 2 hosts x 2 devices
    python examples/pipeline.py --islands 2   # two islands of 2 one-device hosts, 2 stages each

Everything the example trains is defined here; ``pathways_bench.gpipe`` is the benchmarks'
configurable version of the same model.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw

STAGES, MICROBATCHES, BATCH, WIDTH, HIDDEN, LR = 4, 4, 64, 32, 64, 0.3


# ---- the model: plain JAX ------------------------------------------------------------------
# Each stage is a residual block of two dense layers with tanh, trained by SGD on a mean
# squared error against a fixed random teacher, sin(x @ a).

def init_params(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)

    def dense(n_in, n_out):
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    return [{"w1": dense(WIDTH, HIDDEN), "b1": np.zeros(HIDDEN, np.float32),
             "w2": dense(HIDDEN, WIDTH), "b2": np.zeros(WIDTH, np.float32)} for _ in range(STAGES)]


def make_batches(steps: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)
    xs = [rng.standard_normal((BATCH, WIDTH)) for _ in range(steps)]
    return [(x.astype(np.float32), np.sin(x @ teacher).astype(np.float32)) for x in xs]


def stage_forward(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return x + jnp.tanh(h @ p["w2"] + p["b2"])


def model_loss(params, x, t):
    for p in params:
        x = stage_forward(p, x)
    return jnp.mean((x - t) ** 2)


def accumulate(acc, tree):
    """``acc + tree`` leaf by leaf; the first microbatch (``acc`` None) starts the sum."""
    return tree if acc is None else jax.tree.map(jnp.add, acc, tree)


def stage_backward(p, x, gy, acc, input_grad=True):
    """Recompute the stage's forward (GPipe keeps only each stage's input) and pull ``gy``
    back: (``acc`` + parameter gradients, gradient of ``x``; None for the first stage)."""
    if not input_grad:
        _, pullback = jax.vjp(lambda p: stage_forward(p, x), p)
        return accumulate(acc, pullback(gy)[0]), None
    _, pullback = jax.vjp(stage_forward, p, x)
    grads, gx = pullback(gy)
    return accumulate(acc, grads), gx


def last_stage_loss_grad(p, x, t, acc):
    """(``acc`` + this microbatch's share of the loss and of the parameter gradients),
    gradient of ``x``. Dividing by the microbatches makes the sums the mean loss's."""
    def loss(p, x):
        return jnp.mean((stage_forward(p, x) - t) ** 2) / MICROBATCHES

    value, (grads, gx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
    return accumulate(acc, (value, grads)), gx


def sgd(p, grads):
    return jax.tree.map(lambda w, g: w - LR * g, p, grads)


def split(a: np.ndarray) -> list[np.ndarray]:
    return list(a.reshape(MICROBATCHES, a.shape[0] // MICROBATCHES, *a.shape[1:]))


# ---- the pipeline on pathways ----------------------------------------------------------------

def named(fun, name, **bound):
    """``fun`` with keyword arguments bound, under the name the runtime reports it by."""
    f = functools.partial(fun, **bound)
    f.__name__ = name
    return f


def build_step(slices: list[pw.Slice]):
    """The compiled functions of every stage, each on its stage's slice, and the training
    step as one program: ``step(params, xs, ts) -> (new params, loss)``."""
    meshes = [s.mesh(("x",)) for s in slices]
    last = STAGES - 1
    forward = [pw.jit(named(stage_forward, f"forward{s}"), mesh=meshes[s]) for s in range(last)]
    backward = [pw.jit(named(stage_backward, f"backward{s}", input_grad=s > 0), mesh=meshes[s])
                for s in range(last)]
    loss_grad = pw.jit(named(last_stage_loss_grad, f"loss_grad{last}"), mesh=meshes[last])
    update = [pw.jit(named(sgd, f"sgd{s}"), mesh=meshes[s]) for s in range(STAGES)]

    @pw.program
    def step(params, xs, ts):
        inputs = []  # inputs[m][s]: what stage s received for microbatch m, kept for its backward
        for x in xs:
            inputs.append([x])
            for s in range(last):
                inputs[-1].append(forward[s](params[s], inputs[-1][-1]))
        totals, grads = None, [None] * last  # (loss, last stage's gradients), other stages' gradients
        for acts, t in zip(inputs, ts):
            totals, gy = loss_grad(params[last], acts[last], t, totals)
            for s in reversed(range(last)):
                grads[s], gy = backward[s](params[s], acts[s], gy, grads[s])
        loss, last_grads = totals
        return [update[s](params[s], g) for s, g in enumerate([*grads, last_grads])], loss

    return step


def reference_train(batches) -> list[float]:
    """The same steps in this process with plain JAX: the whole model differentiated at once
    per microbatch, the gradients accumulated in the same order."""
    @jax.jit
    def step(params, xs, ts):
        total = None
        for x, t in zip(xs, ts):
            total = accumulate(total, jax.value_and_grad(lambda p: model_loss(p, x, t) / MICROBATCHES)(params))
        loss, grads = total
        return [sgd(p, g) for p, g in zip(params, grads)], loss

    params, losses = init_params(), []
    for x, t in batches:
        params, loss = step(params, split(x), split(t))
        losses.append(float(loss))
    return losses


def train(slices: list[pw.Slice], steps: int) -> None:
    for stage, s in enumerate(slices):
        print(f"stage {stage}: island {s.island}, host(s) {s.workers}")
    step = build_step(slices)
    print(f"one step: a program of {2 * MICROBATCHES * (STAGES - 1) + MICROBATCHES + STAGES} "
          "compiled-function calls")
    batches = make_batches(steps)
    params, losses = init_params(), []
    for x, t in batches:  # the parameters stay on their slices, as pw.Arrays, between steps
        params, loss = step(params, split(x), split(t))
        losses.append(loss)
    pathways_losses = [float(loss.to_numpy()) for loss in losses]
    jax_losses = reference_train(batches)

    print(f"{'step':>4} {'pathways':>10} {'plain JAX':>10}")
    for i, (a, b) in enumerate(zip(pathways_losses, jax_losses)):
        print(f"{i:4d} {a:10.6f} {b:10.6f}")
    diff = float(np.max(np.abs(np.subtract(pathways_losses, jax_losses))))
    print(f"max abs difference: {diff:.3g}")
    assert diff <= 1e-5, "the pipeline's losses differ from plain JAX's"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--islands", type=int, choices=[1, 2], default=1)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.islands == 2:
        with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1),
                                       pw.Island(hosts=2, devices_per_host=1)]):
            vds = pw.make_virtual_device_set()
            train([vds.add_slice(cpu_devices=1, island=i) for i in (0, 0, 1, 1)], args.steps)
    else:  # the first pw.* call starts the embedded cluster
        vds = pw.make_virtual_device_set()
        train([vds.add_slice(cpu_devices=1) for _ in range(STAGES)], args.steps)


if __name__ == "__main__":
    main()
