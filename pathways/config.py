"""Every environment variable pathways reads: one table, each variable's type, default and
meaning.

Code reads a variable through its entry here (``config.ADDRESS.get()``), never through
``os.environ`` by name, so that this table is the whole list; the command line's help names
the variables it falls back on from it, and docs/configuration.md is this table
(``python -m pathways.config`` prints it; a test keeps the two equal).

Two audiences: variables a user sets (``USER``), and variables pathways sets for the
processes it starts (``INTERNAL``), listed so that nobody sets them by accident. The keeper
(``keeper.py``, run as a script of the standard library alone) spells the internal ones it
shares with the worker itself; a test checks that it spells them as here. Standard library
only: every process imports this, the keeper's worker included, before anything heavy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Optional, TypeVar

T = TypeVar("T")

USER = "user"
INTERNAL = "internal"


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable. ``parse`` turns its text (stripped; unset or blank counts
    as unset) into a value, raising ValueError with what it expects; ``default`` stands
    for it unset. ``audience`` is USER or INTERNAL; ``help`` says what it means, as a
    paragraph whose line breaks and indentation fold into single spaces. ``kind`` and
    ``default_text`` (where the default's value alone would not say it) are how the table
    shows them."""

    name: str
    kind: str
    parse: Callable[[str], T]
    default: Optional[T]
    audience: str
    help: str
    default_text: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "help", " ".join(self.help.split()))  # frozen: set once, here

    def text(self, environ: Mapping[str, str] = os.environ) -> Optional[str]:
        """The variable's text, stripped, or None where it is unset or blank."""
        value = environ.get(self.name, "").strip()
        return value or None

    def get(self, environ: Mapping[str, str] = os.environ) -> Optional[T]:
        """The variable's value, or its default where it is unset; ValueError naming the
        variable where its text is not of its kind."""
        value = self.text(environ)
        if value is None:
            return self.default
        try:
            return self.parse(value)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={value!r}: {e}") from None


def _text(value: str) -> str:
    return value


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError("expected a number") from None


def _whole(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError("expected a whole number") from None


def _seconds(value: str) -> int:
    """A positive whole number of seconds."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError("give a positive whole number of seconds, e.g. 30, or unset it")
    return int(value)


def _flag(value: str) -> bool:
    """Any text but 0, false, no or off turns a flag on."""
    return value.lower() not in ("0", "false", "no", "off")


def _level(value: str) -> str:
    level = value.lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return level


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# ---- set by users ---------------------------------------------------------------------------

ADDRESS = Variable("PATHWAYS_ADDRESS", "grpc://HOST:PORT", _text, None, USER, """
    The cluster's controller: `pw.connect()` without an address, and the `--address` of `status`,
    `retire` and `demo`, connect to it.
    """, default_text="none (`pw.connect()` starts an embedded cluster)")
TOKEN = Variable("PATHWAYS_TOKEN", "text", _text, None, USER, """
    The cluster's shared token, which clients present and servers require (`--token-file` overrides
    it); required beyond loopback.
    """)
WORKER_TOKEN = Variable("PATHWAYS_WORKER_TOKEN", "text", _text, None, USER, """
    The token workers attach to the controller with (`--worker-token-file` overrides it); it must
    differ from the clients' token.
    """)
TLS_CA = Variable("PATHWAYS_TLS_CA", "path", _text, None, USER, """
    PEM CA certificate that servers' certificates are verified with (`--tls-ca` overrides it).
    """)
LOG_LEVEL = Variable("PATHWAYS_LOG_LEVEL", "level", _level, "warning", USER, f"""
    How much the command line and the processes it starts log on stderr: {', '.join(LOG_LEVELS)}
    (`--log-level` overrides it, and sets it for its children).
    """)
TRACE = Variable("PATHWAYS_TRACE", "path", _text, None, USER, """
    Record a timeline of every session of the process into this file (as `pw.trace` does), written
    as each session closes; `pathways trace FILE` summarizes it.
    """)
COMPILE_CACHE = Variable("PATHWAYS_COMPILE_CACHE", "path", _text, None, USER, """
    The directory a worker keeps compiled executables in (`pathways worker --compile-cache`
    overrides it).
    """, default_text="JAX's own cache directory, where it has one")
PLAN_LOG = Variable("PATHWAYS_PLAN_LOG", "flag", _flag, False, USER, """
    Print the CP-SAT solver's search log while the planner and the conductor search.
    """)
SLICE = Variable("PATHWAYS_SLICE", "KIND:COUNT[@ISLAND]", _text, None, USER, """
    Under the IFRT proxy (`JAX_PLATFORMS=proxy`): the session's devices are one slice of this many
    devices of this kind (on this island), e.g. `cpu:2`.
    """, default_text="every device of the cluster")
WEIGHT = Variable("PATHWAYS_WEIGHT", "number", _number, None, USER, """
    Under the IFRT proxy: the session's fair-share weight, in (0, 1e6].
    """, default_text="1")
PROXY_CONNECTION_TIMEOUT = Variable("PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS", "whole seconds", _seconds, None, USER, """
    Under the IFRT proxy: how long the client waits for the server to answer.
    """, default_text="the proxy client's own")

# ---- set by pathways for the processes it starts ---------------------------------------

PARENT_PID = Variable("PATHWAYS_PARENT_PID", "pid", _whole, None, INTERNAL, """
    The process that started this one: it exits once that process is gone.
    """)
WORKER_KEPT = Variable("PATHWAYS_WORKER_KEPT", "flag", _flag, False, INTERNAL, """
    The worker runs under its keeper, which starts it again when it asks to be.
    """)
RECONNECT_UNTIL = Variable("PATHWAYS_RECONNECT_UNTIL", "seconds since the epoch", _number, None, INTERNAL, """
    Until when a restarted worker waits for its controller.
    """)
SPMD_PROCESSES = Variable("PATHWAYS_SPMD_PROCESSES", "count", _whole, None, INTERNAL, """
    An SPMD pool's number of processes.
    """)
SPMD_RANK = Variable("PATHWAYS_SPMD_RANK", "count", _whole, None, INTERNAL, """
    This SPMD process's rank in its pool.
    """)
SPMD_DEVICES = Variable("PATHWAYS_SPMD_DEVICES", "count", _whole, None, INTERNAL, """
    CPU devices of each SPMD process.
    """)
SPMD_COORDINATOR = Variable("PATHWAYS_SPMD_COORDINATOR", "HOST:PORT", _text, None, INTERNAL, """
    The SPMD pool's jax.distributed coordinator.
    """)
SPMD_INIT_TIMEOUT = Variable("PATHWAYS_SPMD_INIT_TIMEOUT", "seconds", _number, 120.0, INTERNAL, """
    How long an SPMD process waits for its pool's jax.distributed group.
    """)
SPMD_FD = Variable("PATHWAYS_SPMD_FD", "file descriptor", _whole, None, INTERNAL, """
    The pipe an SPMD process takes its pool's requests on.
    """)

VARIABLES: tuple[Variable, ...] = tuple(v for v in globals().values() if isinstance(v, Variable))


def table() -> str:
    """docs/configuration.md: every variable, users' first."""
    lines = ["# Configuration", "",
             "Every environment variable pathways reads. This page is generated from `pathways/config.py`",
             "(`python -m pathways.config > docs/configuration.md`); a test keeps the two equal. Command-line",
             "flags override the variables they name.", ""]
    for audience, title in ((USER, "Set by users"), (INTERNAL, "Set by pathways for the processes it starts "
                                                                "(do not set them)")):
        lines += [f"## {title}", "", "| variable | value | default | meaning |", "| --- | --- | --- | --- |"]
        for v in VARIABLES:
            if v.audience == audience:
                default = v.default_text or ("unset" if v.default is None else f"`{_shown(v.default)}`")
                lines.append(f"| `{v.name}` | {v.kind} | {default} | {v.help} |")
        lines.append("")
    lines += ["Variables of other programs that pathways sets or reads: `JAX_PLATFORMS=proxy` and",
              "`JAX_BACKEND_TARGET=grpc://HOST:PORT` choose the IFRT proxy backend (docs/ifrt.md);",
              "`TF_CPP_MIN_LOG_LEVEL` and `GRPC_VERBOSITY` are set for the processes a cluster starts from",
              "`PATHWAYS_LOG_LEVEL`.", ""]
    return "\n".join(lines)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


if __name__ == "__main__":
    print(table(), end="")
