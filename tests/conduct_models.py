"""Plain jax.numpy functions, with no sharding anywhere, that tests/test_conduct.py conducts:
an MLP and its loss, a GPT-style block (layernorm, multi-head attention with a causal mask, MLP,
residuals), its loss, and a sum over a long axis."""

import jax
import jax.numpy as jnp
import numpy as np

from pathways_bench.conduct import block, inputs, loss


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.tanh(h @ params["w2"] + params["b2"])


def mlp_loss(params, x):
    return (mlp(params, x) ** 2).mean()


def mlp_inputs(batch=16, width=32, hidden=64, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": rng.standard_normal((width, hidden)) / np.sqrt(width), "b1": rng.standard_normal(hidden),
              "w2": rng.standard_normal((hidden, width)) / np.sqrt(hidden), "b2": rng.standard_normal(width)}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    return params, rng.standard_normal((batch, width)).astype(np.float32)


def gpt_block(params, x):
    """A GPT block in plain jax.numpy (the one ``bench conduct`` runs): layernorm, causal
    4-head attention, an MLP with gelu, residuals."""
    return block(params, x)


def gpt_loss(params, x):
    return loss(params, x)


def gpt_inputs(batch=2, seq=32, width=64, seed=0):
    return inputs(batch, seq, width, seed)


def column_sums(x):
    """A sum over axis 0, which a memory limit forces the plan to split."""
    return (2.0 * x).sum(0)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())
