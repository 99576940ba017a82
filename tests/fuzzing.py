"""A seeded generator of hostile control-plane messages, for the fuzz tests.

It starts from a valid message of each kind (built from the kind's own field checkers, so
every kind the protocol has is covered) and breaks it the ways a buggy or hostile peer
would: a field replaced by a value of the wrong type, out of range, NaN, huge, deeply
nested; fields dropped or added; the tag changed; the message replaced by junk. Payloads
are then sometimes truncated or replaced by random bytes.
"""

from __future__ import annotations

import random
from typing import Any

from pathways.errors import WireError
from pathways.protocol import check as c
from pathways.protocol import messages as m
from pathways.protocol import ops
from pathways.protocol.handles import first_handle
from pathways.protocol.ops import Op

LAYOUT = [[0], [0, 0], [1], ["x"], [None]]
GRAPH = {"nvalues": 2, "inputs": [0], "nodes": [[1, [0], [1]]], "outputs": [1], "types": [["float32", [2]]] * 2}
OPS = [[int(Op.IN), 0, []], [int(Op.EXEC), 1, [0], [1]], [int(Op.OUT), 1], [int(Op.DROP), [0, 1]],
       [int(Op.SEND), 1, 2, LAYOUT, [[1, 1, [[0, 2]]]]], [int(Op.RESHARD), 1, 2, LAYOUT], [int(Op.AWAIT), 0],
       [int(Op.STEP), 0, [1]]]


def _deep(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


JUNK = [None, True, False, -1, 0, 2 ** 64 - 1, -2 ** 63, 2 ** 62, float("nan"), float("inf"), -float("inf"), 1e308,
        "", "x" * 70_000, "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), b"", b"\x00" * 64,
        [], {}, [[[]]], {"a": [1, {"b": None}]}, {1: 2, "t": "hello"}, list(range(1000)), _deep(40), _deep(200),
        ["x"] * 100, [None, None, None], [[0, "a"]], [[0, float("nan"), 1e9]], {"nvalues": 2 ** 40}]


def sample(checker: c.Checker, rng: random.Random, field: str) -> Any:
    """A valid wire value for ``checker``."""
    if checker is ops.LAYOUT:
        return LAYOUT
    if checker is ops.ROUTE:
        return [1, 1, [[0, 2]]]
    if field == "path":  # absolute, or none
        return rng.choice(["", "/tmp/pathways-suspend"])
    if field == "nvalues":
        return 4  # enough registers for the sample ops
    if field == "links" and isinstance(checker, c.Seq) and not isinstance(checker.item, m.Nested):
        # a worker's measured link has both figures or neither
        return rng.choice([[], [[1, 1e-4, 1e9]], [[1, None, None]]])
    if field == "format":  # a jax.export function: no options, no devices
        return "jax.export"
    if field == "options":
        return b""
    if field == "devices" and isinstance(checker, c.Seq):  # flat (host rank, device index) pairs
        return rng.choice([[], [0, 0], [0, 0, 1, 0]]) if checker is not m.DEVICE_PAIRS else []
    if isinstance(checker, c.Int):
        return rng.choice([checker.lo, min(checker.hi, checker.lo + rng.randrange(1, 1000))])
    if isinstance(checker, c.Float):
        return checker.lo + (checker.hi - checker.lo) * rng.choice([0.5, 1e-6, 1.0])
    if isinstance(checker, c.Bool):
        return rng.random() < 0.5
    if isinstance(checker, c.Str):
        if checker.choices:
            return rng.choice(sorted(checker.choices))
        return rng.choice(["", "name", "grpc://127.0.0.1:1", "tcp://127.0.0.1:1"])
    if isinstance(checker, c.Bytes):
        return b"blob".ljust(checker.min_len, b"\x00")
    if isinstance(checker, c.Optional):
        return None if rng.random() < 0.3 else sample(checker.inner, rng, field)
    if isinstance(checker, c.Seq):
        n = max(checker.min_len, rng.randrange(0, 3))
        return [sample(checker.item, rng, field) for _ in range(n)]
    if isinstance(checker, c.Fixed):
        return [sample(x, rng, field) for x in checker.items]
    if isinstance(checker, m.Nested):  # a record: each of its fields by name
        return [sample(x, rng, name) for name, x in checker.cls.FIELDS]
    if field in ("ins", "outs", "layout"):
        return LAYOUT
    if field == "graph":
        return GRAPH
    if field == "ops":
        return rng.sample(OPS, 3)
    if field in ("inputs", "args", "sessions", "session_bytes"):  # maps of integers, as pairs
        return [[0, 5]]
    if field == "init_data":  # a map of text, as pairs
        return [["PATHWAYS_TOKEN", "t"]]
    return {}


def valid(cls: type[m.Message], rng: random.Random) -> list:
    if cls is m.Compiled and rng.random() < 0.5:  # a success: its lists agree in length
        n = rng.randrange(0, 3)
        return ["compiled", rng.randrange(1, 1 << 40), "", [LAYOUT] * n, [LAYOUT], [["float32", [2]]],
                [b"\x08\x01"] * n, [b""], [[0]] * n, [[0]], list(range(n)), "ab12", "jit_f", "",
                [[["flops", 8.0]], [["temp_size_in_bytes", 64]], "HloModule jit_f"], rng.choice([[], [0]])]
    if cls in (m.Restore, m.Adopt):  # session handles of its own session, controller copies
        session = rng.randrange(1, 100)
        handle, copy = first_handle(session) + rng.randrange(1, 1000), first_handle(0) + rng.randrange(1, 1000)
        if cls is m.Adopt:
            return ["adopt", session, [[copy, handle, [1]]]]
        return ["restore", session, [[handle, copy, LAYOUT, [[1, 1, [[0, 2]]]]]]]
    if cls is m.Compiled:  # a failure: only the error, and its kind where the controller cut the compile
        return m.Compiled(rng.randrange(1, 1 << 40), "compile failed", kind=rng.choice(["", "WorkerLostError"])).encode()
    return [cls.TAG, *(sample(checker, rng, name) for name, checker in cls.FIELDS)]


def mutate(raw: list, rng: random.Random) -> Any:
    choice = rng.randrange(8)
    out = list(raw)
    if choice <= 2 and len(out) > 1:  # a field of the wrong type, out of range, NaN, huge or nested
        out[rng.randrange(1, len(out))] = rng.choice(JUNK)
    elif choice == 3 and len(out) > 1:
        del out[rng.randrange(1, len(out))]
    elif choice == 4:
        out.append(rng.choice(JUNK))
    elif choice == 5:
        out[0] = rng.choice(["", "t", "hello ", None, 3, b"run", "x" * 5000, "register"])
    elif choice == 6:
        return rng.choice(JUNK)
    else:  # a nested field broken one level down
        for i in rng.sample(range(1, len(out)), len(out) - 1) if len(out) > 1 else []:
            if isinstance(out[i], list) and out[i]:
                inner = list(out[i])
                inner[rng.randrange(len(inner))] = rng.choice(JUNK)
                out[i] = inner
                break
        else:
            out.append(None)
    return out


def _pin(raw: Any, table: m.Table, pins: dict[str, Any]) -> None:
    if type(raw) is list and raw and type(raw[0]) is str and raw[0] in table.kinds:
        names = [n for n, _ in table.kinds[raw[0]].FIELDS]
        for name, value in pins.items():
            if name in names and len(raw) > names.index(name) + 1:
                raw[names.index(name) + 1] = value


def message(table: m.Table, rng: random.Random, start: dict[str, Any] | None = None,
            pin: dict[str, Any] | None = None) -> tuple[Any, bool]:
    """One message of ``table``'s kinds, most often broken, and whether the table refuses
    it. ``start`` sets fields of the valid message before it is broken; ``pin`` sets them
    after (e.g. an island number that must never collide with a real one)."""
    raw = valid(rng.choice(list(table.kinds.values())), rng)
    _pin(raw, table, start or {})
    if rng.random() < 0.9:
        raw = mutate(raw, rng)
    _pin(raw, table, pin or {})
    try:
        table.decode(raw)
    except WireError:
        return raw, True
    return raw, False


def batch(table: m.Table, rng: random.Random, size: int, pin: dict[str, Any] | None = None) -> tuple[bytes, int]:
    """A payload of ``size`` messages (see ``message``) and how many the table refuses."""
    messages = [message(table, rng, pin=pin) for _ in range(size)]
    return m.pack([raw for raw, _ in messages]), sum(refused for _, refused in messages)


def corrupt(payload: bytes, rng: random.Random) -> bytes:
    """The payload truncated, with random bytes, or replaced."""
    choice = rng.randrange(4) if len(payload) > 1 else 2
    if choice == 0:
        return payload[:rng.randrange(len(payload))]
    if choice == 1:
        data = bytearray(payload)
        for _ in range(8):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if choice == 2:
        return rng.randbytes(rng.randrange(1, 256))
    return rng.choice([b"", b"\xc1", b"\xdd\xff\xff\xff\xff", b"\x91" * 5000 + b"\x90", m.pack({"t": "hello"})])
