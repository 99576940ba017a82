"""The op vocabulary of a lowered program: what the lowering emits (controller/lowering.py)
and the executor runs (worker/executor.py), and its one validation.

An op stream is a list of ops; each op is a tuple whose first entry is an ``Op``. On the
wire an op is a list ``[code, field, ...]``. Register numbers index the run's register
file: program values ``0 .. nvalues-1``, then the transfer copies the lowering created.

- ``(IN, v, senders)``: wait for handle(v) in the object store, load it into register v.
  With no ``senders`` it is a value the run's caller holds, kept in the store; else it is
  a transfer copy for this run only, removed from the store, and ``senders`` are the
  workers that push it here: the only ones it is taken from (worker/store.py ``screen``).
- ``(EXEC, fn, ins, outs)``: run compiled function ``fn`` on registers ``ins``.
- ``(OUT, v)``: publish register v to the object store as handle(v).
- ``(SEND, v, dst, layout, routes)``: push regions of register v to other hosts, where they
  arrive as handle(dst) in ``layout``. ``routes`` is ``((receiver, senders, regions), ...)``:
  each receiver gets ``regions`` (``((start, stop), ...)`` each) from this host and
  assembles its part once all ``senders`` hosts have delivered.
- ``(RESHARD, v, dst, layout)``: copy register v into ``layout`` on this worker.
- ``(DROP, regs)``: release registers after their last use.
- ``(AWAIT, node)``: sequential dispatch: wait until the controller releases ``node``.
- ``(STEP, node, outs)``: sequential dispatch: wait for ``outs``, then report ``node`` done.
"""

from __future__ import annotations

import enum
from typing import Any

from pathways.errors import WireError
from pathways.ir import Layout
from pathways.protocol.check import MAX_ITEMS, Custom, Fixed, Int, Seq
from pathways.protocol.handles import MAX_HANDLE

MAX_REGISTERS = 1 << 22
MAX_OPS = 1 << 20
MAX_NODES = 1 << 20
MAX_SENDERS = 4096
MAX_RANK = 64  # dimensions of an array


class Op(enum.IntEnum):
    IN = 0
    EXEC = 1
    OUT = 2
    SEND = 3
    RESHARD = 4
    DROP = 5
    AWAIT = 6
    STEP = 7


LAYOUT = Custom(Layout.from_wire, Layout.to_wire)
_REGION = Seq(Int(0), max_len=2 * MAX_RANK)
_ROUTE = Fixed(Int(0, MAX_ITEMS), Int(1, MAX_SENDERS), Seq(_REGION, max_len=MAX_ITEMS))


def _read_route(raw: Any) -> tuple:
    receiver, senders, regions = _ROUTE.check(raw, "route")
    return receiver, senders, tuple(_region(flat) for flat in regions)


def _write_route(route: tuple) -> list:
    receiver, senders, regions = route
    return [receiver, senders, [[x for pair in region for x in pair] for region in regions]]


# One route of a transfer, (receiver, senders, regions) with each region ((start, stop), ...):
# what a sender pushes to one receiver (a SEND op's routes, a Restore's moves).
ROUTE = Custom(_read_route, _write_route)
_FIELDS: dict[Op, tuple] = {
    Op.IN: (Int(0, MAX_REGISTERS), Seq(Int(0, MAX_ITEMS), max_len=MAX_SENDERS)),
    Op.EXEC: (Int(0, MAX_HANDLE), Seq(Int(0, MAX_REGISTERS)), Seq(Int(0, MAX_REGISTERS))),
    Op.OUT: (Int(0, MAX_REGISTERS),),
    Op.SEND: (Int(0, MAX_REGISTERS), Int(0, MAX_REGISTERS), LAYOUT, Seq(_ROUTE, min_len=1)),
    Op.RESHARD: (Int(0, MAX_REGISTERS), Int(0, MAX_REGISTERS), LAYOUT),
    Op.DROP: (Seq(Int(0, MAX_REGISTERS)),),
    Op.AWAIT: (Int(0, MAX_NODES),),
    Op.STEP: (Int(0, MAX_NODES), Seq(Int(0, MAX_REGISTERS))),
}
_CODES = {op.value: op for op in Op}


def decode_op(raw: Any, nregs: int) -> tuple:
    """One wire op as a checked tuple; every register it names is below ``nregs``."""
    if type(raw) is not list or not raw or type(raw[0]) is not int or raw[0] not in _CODES:
        raise WireError(f"op {str(raw)[:80]} is not a list starting with an op code in 0..{len(_CODES) - 1}")
    op = _CODES[raw[0]]
    fields = _FIELDS[op]
    if len(raw) != len(fields) + 1:
        raise WireError(f"op {op.name} has {len(raw) - 1} fields; it takes {len(fields)}")
    values = [c.check(v, f"field {i + 1} of op {op.name}") for i, (c, v) in enumerate(zip(fields, raw[1:]))]
    for reg in _registers(op, values):
        if reg >= nregs:
            raise WireError(f"op {op.name} names register {reg} outside 0..{nregs - 1}")
    if op is Op.SEND:
        values[3] = tuple((receiver, senders, tuple(_region(flat) for flat in regions))
                          for receiver, senders, regions in values[3])
    return (op, *values)


def encode_op(op: tuple) -> list:
    """The wire form of a checked op tuple (the lowering's ops are already lists)."""
    code, *values = op
    if code is Op.SEND:  # regions back to flat [start, stop, ...] lists
        values[3] = [(receiver, senders, [[x for pair in region for x in pair] for region in regions])
                     for receiver, senders, regions in values[3]]
    return [int(code), *(c.encode(v) for c, v in zip(_FIELDS[code], values))]


def _registers(op: Op, values: list) -> list[int]:
    if op in (Op.IN, Op.OUT):
        return [values[0]]
    if op in (Op.SEND, Op.RESHARD):
        return values[:2]
    if op is Op.EXEC:
        return [*values[1], *values[2]]
    if op is Op.DROP:
        return list(values[0])
    if op is Op.STEP:
        return list(values[1])
    return []


def _region(flat: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    if len(flat) % 2 or any(a > b for a, b in zip(flat[::2], flat[1::2])):
        raise WireError(f"send region {list(flat)} is not a flat list of [start, stop] pairs")
    return tuple(zip(flat[::2], flat[1::2]))
