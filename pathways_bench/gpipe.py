"""GPipe pipeline-parallel training of a small MLP on pathways, and its plain-JAX reference.

The model is a stack of ``stages`` residual blocks of width ``width``, each two dense layers
with tanh: ``y = x + tanh(tanh(x @ w1 + b1) @ w2 + b2)``, trained by plain SGD on a mean
squared error. Stage ``s`` lives on its own slice. One training step is one ``@pw.program``:

- forward: every microbatch goes through stages 0..S-2; only each stage's *input* is kept
  (GPipe rematerialization: a backward recomputes its stage's forward with ``jax.vjp``);
- the last stage computes loss, parameter gradients and the gradient of its input at once;
- backward: stages S-2..0 in turn, each accumulating its parameter gradients over the
  microbatches inside the compiled function (the first microbatch starts the sum);
- every stage applies SGD to its own parameters; the program returns them with the loss.

Each microbatch's loss is divided by the number of microbatches, so the accumulated loss and
gradients are those of the mean loss over the global batch. ``reference_train`` runs the
same steps in one process with plain JAX: the whole model differentiated at once per
microbatch, accumulated in the same order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw

StageParams = dict[str, Any]  # "w1", "b1", "w2", "b2": numpy, jax or pw arrays


@dataclass(frozen=True)
class Config:
    stages: int = 4
    microbatches: int = 4
    batch: int = 64  # global batch, split into equal microbatches
    width: int = 32
    hidden: int = 64
    lr: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stages < 2 or self.microbatches < 1 or self.batch % self.microbatches:
            raise ValueError(f"{self}: need stages >= 2 and a batch that divides into the microbatches")


# ---- the model: pure JAX -------------------------------------------------------------------

def init_params(cfg: Config) -> list[StageParams]:
    rng = np.random.default_rng(cfg.seed)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    return [{"w1": dense(cfg.width, cfg.hidden), "b1": np.zeros(cfg.hidden, np.float32),
             "w2": dense(cfg.hidden, cfg.width), "b2": np.zeros(cfg.width, np.float32)}
            for _ in range(cfg.stages)]


def make_batches(cfg: Config, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` (inputs, targets) pairs of a fixed random teacher, ``sin(x @ a)``."""
    rng = np.random.default_rng(cfg.seed + 1)
    teacher = rng.standard_normal((cfg.width, cfg.width)) / np.sqrt(cfg.width)
    batches = []
    for _ in range(steps):
        x = rng.standard_normal((cfg.batch, cfg.width))
        batches.append((x.astype(np.float32), np.sin(x @ teacher).astype(np.float32)))
    return batches


def split(a: np.ndarray, microbatches: int) -> list[np.ndarray]:
    return list(a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:]))


def stage_forward(params: StageParams, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return x + jnp.tanh(h @ params["w2"] + params["b2"])


def model_loss(params: Sequence[StageParams], x: jax.Array, t: jax.Array) -> jax.Array:
    """The mean squared error of the whole model on ``x``."""
    for p in params:
        x = stage_forward(p, x)
    return jnp.mean((x - t) ** 2)


def _add(acc: Any, tree: Any) -> Any:
    return tree if acc is None else jax.tree.map(jnp.add, acc, tree)


def stage_backward(params: StageParams, x: jax.Array, gy: jax.Array, acc: Optional[StageParams],
                   input_grad: bool = True) -> tuple[StageParams, Optional[jax.Array]]:
    """Recompute the stage's forward and pull ``gy`` back: (``acc`` + parameter gradients,
    gradient of ``x``, or None for the first stage, which needs none)."""
    if input_grad:
        _, pullback = jax.vjp(stage_forward, params, x)
        grads, gx = pullback(gy)
    else:
        _, pullback = jax.vjp(lambda p: stage_forward(p, x), params)
        (grads,) = pullback(gy)
        gx = None
    return _add(acc, grads), gx


def last_stage_loss_grad(params: StageParams, x: jax.Array, t: jax.Array, acc: Optional[tuple],
                         microbatches: int) -> tuple[tuple[jax.Array, StageParams], jax.Array]:
    """((``acc`` + this microbatch's share of the loss and of its parameter gradients),
    gradient of ``x``)."""
    def loss(p: StageParams, x: jax.Array) -> jax.Array:
        return jnp.mean((stage_forward(p, x) - t) ** 2) / microbatches

    value, (grads, gx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    return _add(acc, (value, grads)), gx


def sgd(params: StageParams, grads: StageParams, lr: float) -> StageParams:
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


# ---- the pipeline on pathways -------------------------------------------------------------

def data_parallel_step(params: list[StageParams], x: jax.Array, t: jax.Array,
                       lr: float) -> tuple[list[StageParams], jax.Array]:
    """One SGD step of the whole model on a batch: the same code serves pathways (``pw.jit``
    on a slice's mesh) and multi-controller JAX (``jax.jit`` on ``pw.spmd.mesh``); with the
    batch sharded, XLA inserts the gradients' all-reduce."""
    loss, grads = jax.value_and_grad(model_loss)(params, x, t)
    return [sgd(p, g, lr) for p, g in zip(params, grads)], loss


def named(fun: Callable, name: str, **bound: Any) -> Callable:
    """``fun`` with keyword arguments bound, under the name the runtime reports it by."""
    bound_fun = functools.partial(fun, **bound)
    bound_fun.__name__ = name  # type: ignore[attr-defined]
    return bound_fun


class Pipeline:
    """Compiled functions of every stage on ``slices`` (one per stage) and the training-step
    program: ``pipeline.step(params, xs, ts) -> (new params, loss)``, where ``params`` has
    one entry per stage and ``xs``/``ts`` one per microbatch."""

    def __init__(self, cfg: Config, slices: Sequence[pw.Slice]) -> None:
        if len(slices) != cfg.stages:
            raise ValueError(f"{cfg.stages} stages need {cfg.stages} slices, got {len(slices)}")
        self.cfg = cfg
        meshes = [s.mesh(("x",)) for s in slices]
        last = cfg.stages - 1
        self.forward = [pw.jit(named(stage_forward, f"forward{s}"), mesh=meshes[s]) for s in range(last)]
        self.backward = [pw.jit(named(stage_backward, f"backward{s}", input_grad=s > 0), mesh=meshes[s])
                         for s in range(last)]
        self.loss_grad = pw.jit(named(last_stage_loss_grad, f"loss_grad{last}", microbatches=cfg.microbatches),
                                mesh=meshes[last])
        self.update = [pw.jit(named(sgd, f"sgd{s}", lr=cfg.lr), mesh=meshes[s]) for s in range(cfg.stages)]
        self.step = pw.program(self._step)

    def _step(self, params: list[StageParams], xs: list[Any], ts: list[Any]) -> tuple[list[StageParams], Any]:
        last = self.cfg.stages - 1
        # inputs[m][s]: what stage s received for microbatch m, kept for its backward
        inputs: list[list[Any]] = []
        for x in xs:
            inputs.append([x])
            for s in range(last):
                inputs[-1].append(self.forward[s](params[s], inputs[-1][-1]))
        totals = None  # (loss, last stage's gradients), summed over microbatches
        grads: list[Any] = [None] * last
        for acts, t in zip(inputs, ts):
            totals, gy = self.loss_grad(params[last], acts[last], t, totals)
            for s in reversed(range(last)):
                grads[s], gy = self.backward[s](params[s], acts[s], gy, grads[s])
        loss, last_grads = totals
        new = [self.update[s](params[s], g) for s, g in enumerate([*grads, last_grads])]
        return new, loss

    def train(self, params: list[StageParams], batches: Sequence[tuple[np.ndarray, np.ndarray]]
              ) -> tuple[list[StageParams], list[pw.Array]]:
        """Run one step per batch, feeding each step's parameters (pw.Arrays, never fetched)
        into the next; returns the last parameters and the loss of every step, unfetched."""
        losses = []
        for x, t in batches:
            params, loss = self.step(params, split(x, self.cfg.microbatches), split(t, self.cfg.microbatches))
            losses.append(loss)
        return params, losses

    def nodes(self) -> int:
        """Compiled-function calls in one step's program (transfers come on top)."""
        s, m = self.cfg.stages, self.cfg.microbatches
        return 2 * m * (s - 1) + m + s


def stage_slices(stages: int, islands: Optional[Sequence[int]] = None) -> list[pw.Slice]:
    """One single-device slice per stage; with ``islands``, stage s goes on island islands[s]."""
    vds = pw.make_virtual_device_set()
    return [vds.add_slice(cpu_devices=1, island=None if islands is None else islands[s]) for s in range(stages)]


# ---- the reference: one process, plain JAX --------------------------------------------------

def reference_train(cfg: Config, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """The losses of the same training steps computed in this process with plain JAX."""
    m = cfg.microbatches

    @jax.jit
    def step(params: list[StageParams], xs: list[jax.Array], ts: list[jax.Array]) -> tuple[list[StageParams], jax.Array]:
        total = None
        for x, t in zip(xs, ts):
            total = _add(total, jax.value_and_grad(lambda p: model_loss(p, x, t) / m)(params))
        loss, grads = total
        return [sgd(p, g, cfg.lr) for p, g in zip(params, grads)], loss

    params: list[StageParams] = init_params(cfg)
    losses = []
    for x, t in batches:
        params, loss = step(params, split(x, m), split(t, m))
        losses.append(float(loss))
    return losses
