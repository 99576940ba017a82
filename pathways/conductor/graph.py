"""A traced function as a graph of block operations, each described by its loop dimensions.

``trace`` turns a function into a flat jaxpr (nested ``jit`` and custom-derivative calls
inlined, dead equations dropped) and then into ``Graph``: one ``Operation`` per equation that
depends on an argument. Equations that depend on no argument (masks, iotas, scale factors)
are *constants*: every device computes them itself, so they are not operations.

Each operation is stated in one vocabulary, its *loop dimensions*: a dot_general's batch,
free and contracting dimensions; an elementwise operation's output dimensions; a
reduction's input dimensions. For every operand and output, each tensor dimension names the
loop dimension it runs along (or none: a broadcast dimension of size 1, or a dimension that
must stay whole). Sharding an operation is then one rule for all of them: give a loop
dimension a mesh axis, and every tensor dimension along it is split over that axis; a split
*reduced* loop dimension leaves partial results that an all-reduce completes.

Reshapes map a group of input dimensions to a group of output dimensions with the same
number of elements; the group's leading dimensions share one loop dimension (splitting the
leading dimension of a row-major group splits the whole group into the same contiguous
blocks), the others stay whole. Operations outside this vocabulary (gathers, scans, sorts,
loops) are *opaque*: one operation whose operands and results stay replicated.

Attention written in jax.numpy (``softmax(q·kᵀ · scale [masked]) · v``) is recognised as one
operation of kind ``attention`` (see ``_attention``) so that the planner may run it as ring
attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Calls whose body is inlined: the graph sees through them.
_INLINED = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "checkpoint", "remat")

ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p cos
    cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log
    log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan
    tanh xor
""".split())
# Reductions whose partial results combine with an all-reduce of the same kind.
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod"}


@dataclass
class Operation:
    """One block operation: its loop dimensions and how its operands and results run along them."""

    kind: str  # the primitive's name, "input", "output", "attention" or "opaque"
    name: str  # readable: kind and a number
    eqns: list  # the jaxpr equations it stands for (none for inputs and outputs)
    operands: list  # jaxpr variables it reads that are values of the graph (not constants)
    results: list  # jaxpr variables it defines
    loop: tuple[int, ...]  # sizes of its loop dimensions
    operand_dims: list[tuple[Optional[int], ...]]  # per operand, per tensor dimension: its loop dimension
    result_dims: list[tuple[Optional[int], ...]]
    reduced: frozenset[int] = frozenset()  # loop dimensions summed (or maxed...) over
    flops: float = 0.0
    attention: Optional["Attention"] = None


@dataclass(frozen=True)
class Attention:
    """A recognised ``softmax(q·kᵀ · scale [causal mask]) · v`` and its layout.

    ``q``, ``k`` and ``v`` are the jaxpr variables the two dot_generals read; the
    permutations bring each to (batch..., sequence, features), the layout of the result."""

    q: Any
    q_perm: tuple[int, ...]
    k: Any
    k_perm: tuple[int, ...]
    v: Any
    v_perm: tuple[int, ...]
    batch: tuple[int, ...]  # sizes of the batch dimensions (heads included)
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    causal: bool
    scale: float


@dataclass
class Graph:
    jaxpr: Jaxpr  # flat
    consts: list  # values of jaxpr.constvars
    operations: list[Operation]
    producer: dict = field(default_factory=dict)  # jaxpr variable -> (operation index, result index)

    def value_bytes(self, var: Any) -> int:
        return _nbytes(var.aval)


def trace(fun: Callable, avals: Sequence[jax.ShapeDtypeStruct]) -> Graph:
    """The graph of ``fun`` applied to arguments of these shapes and dtypes."""
    closed = jax.make_jaxpr(fun)(*avals)
    flat = _flatten(closed, avals)
    return _build(flat.jaxpr, list(flat.consts))


# ---- flattening ---------------------------------------------------------------------------


def _inner(eqn: Any) -> Optional[tuple[Jaxpr, list]]:
    if eqn.primitive.name not in _INLINED:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, ClosedJaxpr):
            return inner.jaxpr, list(inner.consts)
        if isinstance(inner, Jaxpr):
            return inner, []
    return None


def evaluate(jaxpr: Jaxpr, consts: Sequence, args: Sequence, on_eqn: Optional[Callable] = None) -> list:
    """Evaluate ``jaxpr``, inlining nested calls. ``on_eqn(eqn, operand values, read)`` may
    return the equation's results instead (a list), or None to bind it as usual; ``read(var)``
    is the value of any variable computed so far."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        outs = on_eqn(eqn, values, read) if on_eqn is not None else None
        if outs is None:
            inner = _inner(eqn)
            if inner is not None:
                outs = evaluate(inner[0], inner[1], values, on_eqn)
            else:
                outs = eqn.primitive.bind(*values, **eqn.params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _flatten(closed: ClosedJaxpr, avals: Sequence) -> ClosedJaxpr:
    return jax.make_jaxpr(lambda *args: evaluate(closed.jaxpr, closed.consts, args))(*avals)


# ---- the graph ----------------------------------------------------------------------------


def _build(jaxpr: Jaxpr, consts: list) -> Graph:
    eqns = _live(jaxpr)
    graph = Graph(jaxpr, consts, [])
    depends = _depends_on_args(jaxpr, eqns)
    for i, v in enumerate(jaxpr.invars):
        graph.producer[v] = (len(graph.operations), 0)
        graph.operations.append(_value_operation("input", f"input {i}", v, operand=False))
    attention = _find_attention(eqns, depends, dict(zip(jaxpr.constvars, consts)))
    finals = {id(region[-1]): (a, region) for a, region in attention}
    covered = {id(e) for _, region in attention for e in region}
    for eqn in eqns:
        if not any(v in depends for v in eqn.outvars):
            continue  # depends on no argument (masks, iotas, scale factors): every device computes it
        if id(eqn) in finals:
            a, region = finals[id(eqn)]
            _add(graph, _attention_operation(a, eqn, region, len(graph.operations)))
        elif id(eqn) not in covered:
            _add(graph, _operation(eqn, len(graph.operations)))
    for i, v in enumerate(jaxpr.outvars):
        if isinstance(v, Literal) or v not in depends:
            continue  # a constant output: computed where it is returned
        _add(graph, _value_operation("output", f"output {i}", v, operand=True))
    return graph


def _depends_on_args(jaxpr: Jaxpr, eqns: list) -> set:
    """The variables whose values depend on the function's arguments."""
    depends = set(jaxpr.invars)
    for eqn in eqns:
        if any(_var(v) in depends for v in eqn.invars):
            depends.update(eqn.outvars)
    return depends


def _add(graph: Graph, op: Operation) -> None:
    index = len(graph.operations)
    # Operands that depend on no argument are constants, not edges of the graph.
    keep = [j for j, v in enumerate(op.operands) if _var(v) in graph.producer]
    op.operands = [op.operands[j] for j in keep]
    op.operand_dims = [op.operand_dims[j] for j in keep]
    for r, v in enumerate(op.results):
        graph.producer[v] = (index, r)
    graph.operations.append(op)


def _var(v: Any) -> Any:
    return None if isinstance(v, Literal) else v


def _live(jaxpr: Jaxpr) -> list:
    """The equations whose results are used (the function is pure: nothing else matters)."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return live[::-1]


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _value_operation(kind: str, name: str, var: Any, operand: bool) -> Operation:
    shape = tuple(var.aval.shape)
    dims = tuple(range(len(shape)))
    return Operation(kind, name, [], [var] if operand else [], [] if operand else [var], shape,
                     [dims] if operand else [], [] if operand else [dims])


def _operation(eqn: Any, index: int) -> Operation:
    name = eqn.primitive.name
    out = eqn.outvars[0].aval if eqn.outvars else None
    operands = [v for v in eqn.invars]
    label = f"{name} {index}"
    if name in ELEMENTWISE and len(eqn.outvars) == 1:
        loop = tuple(out.shape)
        # Operands have the output's shape, or size 1 where they broadcast, or no dimensions.
        dims = [tuple(d if n == loop[d] else None for d, n in enumerate(_shape(v))) for v in operands]
        return Operation(name, label, [eqn], operands, list(eqn.outvars), loop, dims,
                         [tuple(range(len(loop)))], flops=float(np.prod(loop)))
    if name == "broadcast_in_dim":
        loop = tuple(out.shape)
        src = _shape(operands[0])
        dims = tuple(d if src[j] == loop[d] else None for j, d in enumerate(eqn.params["broadcast_dimensions"]))
        return Operation(name, label, [eqn], operands[:1], list(eqn.outvars), loop,
                         [dims], [tuple(range(len(loop)))])
    if name in REDUCTIONS:
        src = _shape(operands[0])
        axes = set(eqn.params["axes"])
        kept = tuple(d for d in range(len(src)) if d not in axes)
        return Operation(name, label, [eqn], operands, list(eqn.outvars), src, [tuple(range(len(src)))], [kept],
                         reduced=frozenset(axes), flops=float(np.prod(src)))
    if name == "transpose":
        perm = eqn.params["permutation"]
        loop = tuple(out.shape)
        dims = [None] * len(perm)
        for i, p in enumerate(perm):
            dims[p] = i
        return Operation(name, label, [eqn], operands, list(eqn.outvars), loop, [tuple(dims)],
                         [tuple(range(len(loop)))])
    if name == "squeeze":
        src = _shape(operands[0])
        gone = set(d % len(src) for d in eqn.params["dimensions"])
        kept = [d for d in range(len(src)) if d not in gone]
        return Operation(name, label, [eqn], operands, list(eqn.outvars), src, [tuple(range(len(src)))],
                         [tuple(kept)])
    if name == "reshape" and eqn.params.get("dimensions") is None:
        mapped = _reshape_dims(_shape(operands[0]), tuple(out.shape))
        if mapped is not None:
            loop, in_dims, out_dims = mapped
            return Operation(name, label, [eqn], operands, list(eqn.outvars), loop, [in_dims], [out_dims])
    if name == "dot_general":
        return _dot_general(eqn, label)
    return _opaque(eqn, label)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.aval.shape)


def _opaque(eqn: Any, label: str) -> Operation:
    """Kept whole: its operands and results are replicated on every device."""
    outs = list(eqn.outvars)
    return Operation("opaque", f"{eqn.primitive.name} {label.split()[-1]}", [eqn], list(eqn.invars), outs, (),
                     [(None,) * len(_shape(v)) for v in eqn.invars], [(None,) * len(_shape(v)) for v in outs],
                     flops=float(sum(np.prod(_shape(v)) for v in outs)))


def _dot_general(eqn: Any, label: str) -> Operation:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (_shape(v) for v in eqn.invars)
    lf = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    # Loop dimensions: batch, lhs free, rhs free (the output's order), then contracting.
    loop = tuple([lhs[d] for d in lb] + [lhs[d] for d in lf] + [rhs[d] for d in rf] + [lhs[d] for d in lc])
    ldims: list[Optional[int]] = [None] * len(lhs)
    rdims: list[Optional[int]] = [None] * len(rhs)
    for i, (a, b) in enumerate(zip(lb, rb)):
        ldims[a], rdims[b] = i, i
    for i, d in enumerate(lf):
        ldims[d] = len(lb) + i
    for i, d in enumerate(rf):
        rdims[d] = len(lb) + len(lf) + i
    n_out = len(lb) + len(lf) + len(rf)
    for i, (a, b) in enumerate(zip(lc, rc)):
        ldims[a], rdims[b] = n_out + i, n_out + i
    flops = 2.0 * float(np.prod(loop))
    return Operation("dot_general", label, [eqn], list(eqn.invars), list(eqn.outvars), loop,
                     [tuple(ldims), tuple(rdims)], [tuple(range(n_out))],
                     reduced=frozenset(range(n_out, len(loop))), flops=flops)


def _reshape_dims(src: tuple[int, ...], dst: tuple[int, ...]):
    """Loop dimensions of a row-major reshape: one per group of dimensions with equal
    products, shared by the group's leading dimensions; None when the shapes do not group."""
    loop: list[int] = []
    in_dims: list[Optional[int]] = [None] * len(src)
    out_dims: list[Optional[int]] = [None] * len(dst)
    i = j = 0
    while i < len(src) or j < len(dst):
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i == len(src) or j == len(dst):
            return (tuple(loop), tuple(in_dims), tuple(out_dims)) if i == len(src) and j == len(dst) else None
        gi, gj, a, b = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                if i == len(src):
                    return None
                a, i = a * src[i], i + 1
            else:
                if j == len(dst):
                    return None
                b, j = b * dst[j], j + 1
        in_dims[gi], out_dims[gj] = len(loop), len(loop)
        loop.append(math.gcd(src[gi], dst[gj]))
    return tuple(loop), tuple(in_dims), tuple(out_dims)


# ---- attention ----------------------------------------------------------------------------


def _find_attention(eqns: list, depends: set, consts: dict) -> list[tuple[Attention, list]]:
    """Every ``softmax(q·kᵀ · scale [mask]) · v`` in ``eqns``: (its description, its equations
    in order, the final dot_general last). A candidate whose inner values are used outside
    it, or whose mask is neither absent nor causal, is left as ordinary operations."""
    producer = {v: e for e in eqns for v in e.outvars}
    order = {id(e): i for i, e in enumerate(eqns)}
    uses: dict = {}
    for e in eqns:
        for v in e.invars:
            if not isinstance(v, Literal):
                uses.setdefault(v, []).append(e)
    found = []
    for eqn in eqns:
        if eqn.primitive.name != "dot_general":
            continue
        match = _match_attention(eqn, producer, order, depends, consts)
        if match is None:
            continue
        attention, region = match
        inside = {id(e) for e in region}
        if all(id(u) in inside for e in region if e is not eqn for v in e.outvars for u in uses.get(v, ())):
            found.append((attention, sorted(region, key=eqns.index)))
    return found


def _constant(v: Any, depends: set, producer: dict, order: dict, consts: dict) -> Optional[np.ndarray]:
    """The value of ``v`` if it depends on no argument: the equations it comes from are
    evaluated in one compiled call (one call per equation would compile each)."""
    if isinstance(v, Literal):
        return np.asarray(v.val)
    if v in depends:
        return None
    if v not in consts:
        needed: dict = {}
        stack = [v]
        while stack:
            u = stack.pop()
            if isinstance(u, Literal) or u in consts or id(producer.get(u)) in needed:
                continue
            e = producer.get(u)
            if e is None:
                return None
            needed[id(e)] = e
            stack.extend(e.invars)
        steps = sorted(needed.values(), key=lambda e: order[id(e)])
        known = {u: consts[u] for e in steps for u in e.invars if not isinstance(u, Literal) and u in consts}

        def run() -> Any:
            env = dict(known)
            for e in steps:
                values = [u.val if isinstance(u, Literal) else env[u] for u in e.invars]
                inner = _inner(e)
                outs = evaluate(inner[0], inner[1], values) if inner is not None else e.primitive.bind(*values, **e.params)
                env.update(zip(e.outvars, outs if e.primitive.multiple_results or inner is not None else [outs]))
            return env[v]

        consts[v] = jax.jit(run)()
    return np.asarray(consts[v])


def _match_attention(final: Any, producer: dict, order: dict, depends: set, consts: dict):
    """Attention ending at ``final`` (probs @ v): (Attention, the equations it spans), or None."""
    region: list = [final]

    def prod(v: Any, *names: str) -> Optional[Any]:
        if isinstance(v, Literal) or v not in depends:
            return None
        e = producer.get(v)
        return e if e is not None and e.primitive.name in names else None

    def const(v: Any) -> Optional[np.ndarray]:
        return _constant(v, depends, producer, order, consts)

    (pc, vc), (pb, vb) = final.params["dimension_numbers"]
    probs, v = final.invars
    p_shape = _shape(probs)
    if len(pc) != 1 or pc[0] != len(p_shape) - 1 or list(pb) != list(range(len(pb))) or len(p_shape) != len(pb) + 2:
        return None
    x_var = _match_softmax(probs, prod, const, region)
    scaled = None if x_var is None else _match_scale_and_mask(x_var, prod, const, region)
    if scaled is None:
        return None
    cur, scale, causal = scaled
    scores = prod(cur, "dot_general")
    if scores is None:
        return None
    region.append(scores)
    (qc, kc), (qb, kb) = scores.params["dimension_numbers"]
    q, k = scores.invars
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    nb = len(pb)
    if len(qc) != 1 or len(qs) != nb + 2 or len(ks) != nb + 2 or len(vs) != nb + 2 or len(vb) != nb:
        return None
    q_free = next(d for d in range(len(qs)) if d not in qc and d not in qb)
    k_free = next(d for d in range(len(ks)) if d not in kc and d not in kb)
    v_free = next(d for d in range(len(vs)) if d not in vc and d not in vb)
    attention = Attention(q=q, q_perm=tuple(qb) + (q_free, qc[0]), k=k, k_perm=tuple(kb) + (k_free, kc[0]),
                          v=final.invars[1], v_perm=tuple(vb) + (vc[0], v_free), batch=tuple(qs[d] for d in qb),
                          q_len=qs[q_free], kv_len=ks[k_free], head_dim=qs[qc[0]], value_dim=vs[v_free],
                          causal=causal, scale=scale)
    return attention, region


def _match_softmax(probs: Any, prod: Callable, const: Callable, region: list) -> Optional[Any]:
    """The scores ``x`` of ``probs`` = softmax(x) over the last axis, written as
    e / broadcast(reduce_sum(e)) with e = exp(x - broadcast(reduce_max(x))) (the max maybe
    under stop_gradient, or clamped from below by -inf), its equations appended to
    ``region``; None where ``probs`` is not that."""
    div = prod(probs, "div")
    if div is None:
        return None
    e_var, denom = div.invars
    chain = _through(denom, prod, ("broadcast_in_dim",))
    if chain is None or chain[0].primitive.name != "reduce_sum" or chain[0].invars[0] is not e_var \
            or not _over_last_axis(chain[0]):
        return None
    region += [div, *chain[1]]
    region.append(chain[0])
    exp = prod(e_var, "exp")
    if exp is None:
        return None
    region.append(exp)
    sub = prod(exp.invars[0], "sub")
    if sub is None:
        return None
    region.append(sub)
    x_var, shift = sub.invars
    chain = _through(shift, prod, ("broadcast_in_dim", "stop_gradient", "max"))
    if chain is None or chain[0].primitive.name != "reduce_max" or chain[0].invars[0] is not x_var \
            or not _over_last_axis(chain[0]):
        return None
    for e in chain[1]:
        if e.primitive.name == "max" and not any(
                (c := const(u)) is not None and np.all(np.isneginf(c)) for u in e.invars):
            return None
    region += [*chain[1], chain[0]]
    return x_var


def _match_scale_and_mask(x_var: Any, prod: Callable, const: Callable,
                          region: list) -> Optional[tuple[Any, float, bool]]:
    """Scores ``x_var`` scaled by constants and masked (all-true, or causal once), in any
    order: (the unscaled scores, the scale, whether causal), the equations appended to
    ``region``; None where another operation or mask is in the way."""
    scale, causal, cur = 1.0, False, x_var
    while True:
        e = prod(cur, "mul", "div", "select_n", "convert_element_type")
        if e is None:
            return cur, scale, causal
        name = e.primitive.name
        if name == "convert_element_type":
            cur = e.invars[0]
        elif name in ("mul", "div"):
            a, b = e.invars
            factor = const(b)
            if factor is not None and factor.size == 1:
                scale, cur = (scale * float(factor) if name == "mul" else scale / float(factor)), a
            elif name == "mul" and (factor := const(a)) is not None and factor.size == 1:
                scale, cur = scale * float(factor), b
            else:
                return None
        else:  # select_n(mask, fill, scores)
            if len(e.invars) != 3:
                return None
            mask, fill = const(e.invars[0]), const(e.invars[1])
            if mask is None or fill is None or not np.all(fill <= -1e9):
                return None
            mask = np.broadcast_to(mask, _shape(e.invars[2]))
            q_len, kv_len = mask.shape[-2:]
            if not np.all(mask):
                if causal or q_len != kv_len or not np.all(mask == np.tril(np.ones((q_len, kv_len), bool))):
                    return None
                causal = True
            cur = e.invars[2]
        region.append(e)


def _over_last_axis(reduction: Any) -> bool:
    """Whether a reduction is over its operand's last axis alone (a softmax's row)."""
    return tuple(reduction.params["axes"]) == (len(_shape(reduction.invars[0])) - 1,)


def _through(v: Any, prod: Callable, passes: tuple[str, ...]):
    """Walk back from ``v`` through equations named in ``passes``: (the first other
    equation reached, the equations passed)."""
    passed = []
    while True:
        e = prod(v, *passes, "reduce_sum", "reduce_max")
        if e is None:
            return None
        if e.primitive.name not in passes:
            return e, passed
        passed.append(e)
        v = next((u for u in e.invars if not isinstance(u, Literal) and prod(u, *passes, "reduce_sum", "reduce_max")),
                 e.invars[0])


def _attention_operation(a: Attention, final: Any, region: list, index: int) -> Operation:
    """Loop dimensions: batch..., query sequence, key sequence, head features, value features."""
    nb = len(a.batch)
    loop = (*a.batch, a.q_len, a.kv_len, a.head_dim, a.value_dim)
    q_dims = [None] * (nb + 2)
    k_dims = [None] * (nb + 2)
    v_dims = [None] * (nb + 2)
    for i in range(nb):
        q_dims[a.q_perm[i]], k_dims[a.k_perm[i]], v_dims[a.v_perm[i]] = i, i, i
    q_dims[a.q_perm[nb]], q_dims[a.q_perm[nb + 1]] = nb, nb + 2
    k_dims[a.k_perm[nb]], k_dims[a.k_perm[nb + 1]] = nb + 1, nb + 2
    v_dims[a.v_perm[nb]], v_dims[a.v_perm[nb + 1]] = nb + 1, nb + 3
    out_dims = (*range(nb), nb, nb + 3)
    b = float(np.prod(a.batch))
    flops = b * a.q_len * a.kv_len * (2.0 * a.head_dim + 2.0 * a.value_dim + 5.0)
    return Operation("attention", f"attention {index}", region, [a.q, a.k, a.v], list(final.outvars), loop,
                     [tuple(q_dims), tuple(k_dims), tuple(v_dims)], [out_dims],
                     reduced=frozenset({nb + 1, nb + 2}), flops=flops, attention=a)
