"""Blockwise ring attention: scaled dot-product attention with the sequence split over a mesh axis.

Layout ``(B, H, S, D)`` (batch, heads, sequence, head size) for queries, keys, values and the
output. The sequence is cut into ``n`` equal blocks, ``n`` the size of the mesh axis; the
device at position ``p`` of the axis keeps query block ``p`` throughout, and the key/value
blocks travel around a ring of the axis's positions: ``order[k]`` sends to ``order[k + 1]``
(the last back to the first) each step. After ``n`` steps every query block has met every
key/value block, once. Which block a device holds at step ``s`` follows from the ring alone,
so it is a constant table indexed by the device's position.

Each step folds one block pair into a streaming softmax in float32: a running row maximum
``m``, a running normaliser ``l`` and an unnormalised output ``o``, rescaled by
``exp(m_old - m_new)`` whenever the maximum grows, so the result equals the softmax over the
whole row. A device's working memory is a few ``(S/n) x (S/n)`` score blocks per head (the
scores and their exponentials), never ``S x S`` nor ``(S/n) x S``. Under differentiation
each step's block update is recomputed in the backward pass, so what is kept per step is
that step's inputs (the key/value block and the running state, ``O(S/n x D)`` each), not
its scores.

With a causal mask, key block ``j`` meets query block ``p`` only when ``j <= p``: a
``lax.cond`` skips the other pairs, ``n (n - 1) / 2`` of the ``n**2`` (no FLOPs spent on
them), the diagonal pair is masked and the pairs below it are not. Every step's send is issued before that step's
compute, which does not depend on it, so the two can overlap.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

# A running state: output (B, H, Sq, Dv) unnormalised, row maximum and normaliser (B, H, Sq),
# and the number of block pairs computed so far (an int32 scalar).
_State = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float) -> jax.Array:
    """``softmax(q k^T * scale) v`` over the whole sequence, with the causal mask (query ``i``
    sees keys ``<= i``) when ``causal``; layout ``(B, H, S, D)``, softmax in float32, the
    result in ``q``'s dtype."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        s = jnp.where(_lower_triangle(q.shape[2], k.shape[2]), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh | AbstractMesh, axis: str,
                   causal: bool, scale: float, order: Sequence[int] | None = None,
                   batch_axis: str | None = None) -> jax.Array:
    """``attention(q, k, v, causal=causal, scale=scale)`` with the sequence (dimension 2) split
    over mesh axis ``axis`` and, if given, the batch (dimension 0) over ``batch_axis``.

    ``order`` is the ring, a permutation of the axis's positions (for example from
    ``pathways.planner.ring.best_ring``): key/value blocks move from ``order[k]`` to
    ``order[k + 1]``; by default ``0 -> 1 -> ... -> n-1 -> 0``. ``mesh`` may be abstract, for
    a function lowered before its devices are known. Differentiable, and usable inside
    ``jax.jit``.
    """
    return _ring_attention_counted(q, k, v, mesh=mesh, axis=axis, causal=causal, scale=scale, order=order,
                                   batch_axis=batch_axis)[0]


def _ring_attention_counted(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh | AbstractMesh, axis: str,
                            causal: bool, scale: float, order: Sequence[int] | None = None,
                            batch_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``ring_attention``'s output, and how many block pairs each device computed: an int32
    array ``counts[b, p]`` for the device at ``batch_axis`` position ``b`` (0 without one) and
    ``axis`` position ``p``. ``ring_attention`` drops the counts, and the compiler with them."""
    n = _check(q, k, v, mesh, axis, batch_axis)
    order = _check_order(order, n)
    spec = PartitionSpec(batch_axis, None, axis, None)

    def body(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        out, count = _ring_body(q, k, v, axis=axis, n=n, causal=causal, scale=scale, order=order)
        return out, count.reshape(1, 1)

    ring = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                         out_specs=(spec, PartitionSpec(batch_axis, axis)))
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if AxisType.Explicit in (types[axis], types.get(batch_axis)):
        # On explicit axes an argument's sharding is part of its type and must be the one the
        # blocks need; on automatic axes the compiler moves the data by itself.
        q, k, v = (jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    return ring(q, k, v)


def _ring_body(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, n: int, causal: bool, scale: float,
               order: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """One device's share: its query block against every key/value block, these passed around
    the ring; returns its output block and how many block pairs it computed."""
    place = {device: i for i, device in enumerate(order)}
    # held[s, p]: the key/value block the device at position p holds at step s.
    held = jnp.asarray(np.array([[order[(place[p] - s) % n] for p in range(n)] for s in range(n)], np.int32))
    ring = [(order[i], order[(i + 1) % n]) for i in range(n)]
    me = lax.axis_index(axis)
    b, h, sq, _ = q.shape
    state: _State = (jnp.zeros((b, h, sq, v.shape[3]), jnp.float32), jnp.full((b, h, sq), -jnp.inf, jnp.float32),
                     jnp.zeros((b, h, sq), jnp.float32), jnp.zeros((), jnp.int32))
    unmasked = jax.checkpoint(lambda state, k, v: _fold(state, q, k, v, scale, masked=False))

    def fold(state: _State, k: jax.Array, v: jax.Array, step: jax.Array) -> _State:
        # At steps >= 1 a device never holds its own block; under the causal mask a block
        # after its own contributes nothing, so that step is skipped.
        if not causal:
            return unmasked(state, k, v)
        return lax.cond(held[step, me] < me, unmasked, lambda state, k, v: state, state, k, v)

    def send(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.ppermute(k, axis, ring), lax.ppermute(v, axis, ring)

    # Step 0: every device holds its own block, the diagonal one under the causal mask.
    k_next, v_next = send(k, v) if n > 1 else (k, v)
    state = jax.checkpoint(lambda state, k, v: _fold(state, q, k, v, scale, masked=causal))(state, k, v)
    if n > 2:
        def step(carry: tuple[_State, jax.Array, jax.Array], s: jax.Array) -> tuple[tuple, None]:
            state, k, v = carry
            k_next, v_next = send(k, v)  # the next step's block travels while this one is folded in
            return (fold(state, k, v, s), k_next, v_next), None

        (state, k_next, v_next), _ = lax.scan(step, (state, k_next, v_next), jnp.arange(1, n - 1))
    if n > 1:
        state = fold(state, k_next, v_next, jnp.int32(n - 1))
    o, _, l, count = state
    return (o / l[..., None]).astype(q.dtype), count


def _fold(state: _State, q: jax.Array, k: jax.Array, v: jax.Array, scale: float, *, masked: bool) -> _State:
    """``state`` with the block pair (``q``, ``k``/``v``) folded into its streaming softmax;
    ``masked``: the pair is on the diagonal under the causal mask."""
    o, m, l, count = state
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if masked:
        s = jnp.where(_lower_triangle(q.shape[2], k.shape[2]), s, -jnp.inf)
    # Every row has a finite score from step 0 on (the diagonal's own key), so m_new is finite
    # and exp(m - m_new) is 0, not NaN, while m is still -inf.
    m_new = jnp.maximum(m, s.max(axis=-1))
    rescale = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o * rescale[..., None] + pv, m_new, l * rescale + p.sum(axis=-1), count + 1


def _lower_triangle(sq: int, sk: int) -> jax.Array:
    return jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :]


def _check(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh | AbstractMesh, axis: str,
           batch_axis: str | None) -> int:
    """The number of sequence blocks, after checking the shapes against each other and the mesh."""
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}")
    for name, what in ((axis, "axis"), (batch_axis, "batch_axis")):
        if name is not None and name not in mesh.axis_names:
            raise ValueError(f"{what} {name!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
    if batch_axis == axis:
        raise ValueError(f"batch_axis and axis are both {axis!r}: the batch and the sequence need their own axes")
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v must be (batch, heads, sequence, head size), q and k alike and v differing "
                         f"at most in head size; got q {q.shape}, k {k.shape}, v {v.shape}")
    n = mesh.shape[axis]
    if q.shape[2] % n:
        raise ValueError(f"the sequence length {q.shape[2]} of q, k, v {q.shape} is not divisible by the "
                         f"{n} devices of mesh axis {axis!r}")
    if batch_axis is not None and q.shape[0] % mesh.shape[batch_axis]:
        raise ValueError(f"the batch size {q.shape[0]} of q, k, v {q.shape} is not divisible by the "
                         f"{mesh.shape[batch_axis]} devices of mesh axis {batch_axis!r}")
    return n


def _check_order(order: Sequence[int] | None, n: int) -> tuple[int, ...]:
    if order is None:
        return tuple(range(n))
    order = tuple(int(i) for i in order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of the {n} axis positions 0..{n - 1}, got {order}")
    return order
