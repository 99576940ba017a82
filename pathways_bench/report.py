"""What every benchmark shares: repetition statistics, tables, progress, JSON, plots and the
markdown section that BENCHMARKS.md is made of.

A benchmark is a module of ``pathways_bench`` with

- ``TITLE`` (one line), ``PAPER`` (the paper's figure it reproduces, or ``""``),
  ``PAPER_RESULT`` (what the paper reports there, or ``""``), ``ROUNDS`` (the default
  repetitions) and ``ABOUT`` (markdown: what is measured, and how);
- ``measure(rounds, tiny, progress) -> dict``: runs it; the dict is JSON-serializable and
  holds every number the other functions show;
- ``tables(data) -> list[Table]``, ``summary(data) -> list[str]`` (markdown lines: the
  headline ratios and each target, met or missed and by how much, through :func:`verdict`
  and :func:`unjudged`) and ``notes(data) -> str`` (markdown: why the numbers are what they are);
- ``plot(data, path)``: a PNG.
"""

from __future__ import annotations

import math
import os
import selectors
import statistics
import subprocess
import sys
import time
from typing import Any, Iterable, Sequence

from pathways import plotting
from pathways.table import Table  # noqa: F401  (the benchmarks' tables are report.Table)


def stats(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max) of repetitions."""
    if not samples:
        raise ValueError("stats() needs at least one sample")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(a: dict[str, float], b: dict[str, float]) -> float:
    """Ratio of two medians."""
    return a["median"] / b["median"] if b["median"] else math.nan


def rate(s: dict[str, float], digits: int = 0) -> str:
    """``median (min-max)`` of a rate; just the value when it is one round's."""
    if s.get("n") == 1:
        return f"{s['median']:,.{digits}f}"
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


# The short names of the benchmarks' modes, explained under the tables that use them.
LEGEND = {
    "JAX-O": "multi-controller JAX (pw.spmd), one jitted call per computation, dispatched asynchronously",
    "JAX-F": "multi-controller JAX, the computations fused in one jitted loop",
    "PW-O": "pathways op by op: every call its own submission from the client",
    "PW-C": "pathways, a @pw.program chaining the calls: one submission per chain",
    "PW-C fused": "the PW-C program traced with fuse=True: its chained calls compiled into one executable",
    "PW-F": "pathways running the fused function",
}


def legend(text: str) -> list[str]:
    """``NAME: meaning`` for every short name of LEGEND that ``text`` uses."""
    return [f"{name}: {meaning}" for name, meaning in LEGEND.items() if name in text]


def judged(data: dict) -> bool:
    """Whether a run's figures are judged against the targets: a ``--tiny`` run takes one cold
    sample of sizes below the targets', so it shows that the benchmark runs, not whether the
    targets are met."""
    return not data.get("meta", {}).get("tiny")


def unjudged(data: dict) -> list[str]:
    """The summary line saying that a ``--tiny`` run's targets are not judged; none otherwise."""
    if judged(data):
        return []
    return ["targets not judged: a --tiny run is too short and too small for its figures to mean anything"]


def verdict(data: dict, met: bool, missed: str) -> str:
    """A target's verdict: ``"met"``, or ``missed`` (how far it fell short), or ``"not judged"``
    on a ``--tiny`` run."""
    if not judged(data):
        return "not judged"
    return "met" if met else missed


def times(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def alternate(rounds: int, cases: dict[str, Any], progress: "Progress") -> dict[str, list[float]]:
    """Run every case once per round, in the same order each round, so that machine noise
    hits them alike; ``cases`` maps a name to a callable returning one sample."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, run in cases.items():
            progress.step(f"{name} (round {r + 1}/{rounds})")
            samples[name].append(run())
    return samples


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU time consumed so far by the processes ``pids`` (all threads)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone, or not Linux
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per tenth otherwise."""

    def __init__(self, label: str, stream=None):
        self.label = label
        self.total = 0
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._shown_tenth = -1

    def expect(self, steps: int) -> None:
        """Announce ``steps`` more steps."""
        self.total += steps

    def step(self, what: str = "") -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        fraction = self.done / self.total
        elapsed = time.monotonic() - self._start
        bar = "#" * int(fraction * 24)
        text = f"{self.label} [{bar:<24}] {self.done}/{self.total} {elapsed:5.0f}s {what}"
        if self._tty:
            self.stream.write("\r" + text[:120].ljust(120))
        elif int(fraction * 10) != self._shown_tenth:
            self._shown_tenth = int(fraction * 10)
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


def section(module, data: dict, command: str) -> str:
    """The markdown section of one benchmark's results."""
    paper = f" (the paper's {module.PAPER})" if module.PAPER else ""
    parts = [f"## {module.TITLE}{paper}", "", "```sh", command, "```", "", module.ABOUT.strip(), ""]
    if module.PAPER_RESULT:
        parts += [f"The paper: {module.PAPER_RESULT}.", ""]
    meta = data.get("meta", {})
    if meta:
        parts += [f"Measured {meta.get('date', '?')} on {meta.get('machine', '?')}, "
                  f"{meta.get('rounds', '?')} alternating rounds, in {meta.get('seconds', 0):.0f} s.", ""]
    for t in module.tables(data):
        parts += [t.markdown(), ""]
    lines = module.summary(data)
    if lines:
        parts += [*(f"- {line}" for line in lines), ""]
    notes = module.notes(data).strip()
    if notes:
        parts += [notes, ""]
    return "\n".join(parts)


def plot_lines(path: str, title: str, xlabel: str, ylabel: str,
               series: Iterable[tuple[str, Sequence[float], Sequence[float]]],
               logx: bool = False, logy: bool = False, hline: float | None = None) -> None:
    """A PNG of a few named (x, y) series."""
    plt = plotting.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(path: str, title: str, ylabel: str, groups: Sequence[str],
              series: dict[str, Sequence[float]], logy: bool = False) -> None:
    """A PNG of grouped bars: one group per label, one bar per series."""
    plt = plotting.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set(title=title, ylabel=ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_line(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The next line a helper process (``what``) prints, stripped; TimeoutError if it says
    nothing within ``timeout`` seconds, RuntimeError if it exits first."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"{what} said nothing within {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited (code {proc.poll()})")
    return line.strip()
