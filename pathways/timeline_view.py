"""``python -m pathways trace FILE.json [--png OUT.png]``: read a timeline file (Chrome
trace-event JSON, as ``pw.trace`` writes it), print a summary per step name and per
function computed or compiled, and draw a Gantt chart with one row per process and thread.

matplotlib is imported only to draw, with the Agg backend, so that the summary works
anywhere.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from pathways import plotting


class TimelineFileError(ValueError):
    """A file that is not a timeline (what it lacks is in the message)."""


@dataclass(frozen=True)
class Span:
    process: str
    thread: str
    name: str
    start_us: float
    dur_us: float
    run: str
    detail: str = ""

    @property
    def label(self) -> str:
        """The step's name, and for a computation the function's: "execute train_step"."""
        return f"{self.name} {self.detail}" if self.name == "execute" and self.detail else self.name


def load(path: str) -> list[Span]:
    """The complete events of a timeline file, with their process and thread names."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TimelineFileError(f"cannot read {path} as a timeline: {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TimelineFileError(f"{path} is not Chrome trace-event JSON: it has no traceEvents list")
    processes: dict[Any, str] = {}
    threads: dict[tuple, str] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M":
            name = (e.get("args") or {}).get("name")
            if e.get("name") == "process_name":
                processes[e.get("pid")] = str(name)
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = str(name)
    spans = []
    begun: dict[tuple, dict] = {}  # (pid, id) -> an async slice's begin event
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "b":
            begun[(e.get("pid"), e.get("id"))] = e
            continue
        if e.get("ph") == "e" and (b := begun.pop((e.get("pid"), e.get("id")), None)) is not None:
            e = {**b, "dur": _number(e.get("ts"), path) - _number(b.get("ts"), path)}
        elif e.get("ph") != "X":
            continue
        start, dur = _number(e.get("ts"), path), _number(e.get("dur", 0.0), path)
        pid, tid = e.get("pid"), e.get("tid")
        args = e.get("args") or {}
        spans.append(Span(processes.get(pid, f"process {pid}"), threads.get((pid, tid), f"thread {tid}"),
                          str(e.get("name", "?")), start, dur, str(args.get("run", "")), str(args.get("detail", ""))))
    return spans


def _number(value: Any, path: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TimelineFileError(f"{path}: an event's ts or dur is not a number: {str(value)[:100]}") from None


def steps(spans: list[Span]) -> list[tuple[str, str, int, float, float]]:
    """Per step name and the kind of process it ran in (client, controller, worker): the
    count, total us and median us of its spans, the costliest first."""
    return _grouped(spans, lambda s: (s.process.split()[0], s.name))


def functions(spans: list[Span]) -> list[tuple[str, str, int, float, float]]:
    """Like ``steps``, per function computed (the detail of "execute"), and per function
    compiled (the IFRT proxy's "compile" spans)."""
    return _grouped([s for s in spans if s.name in _FUNCTION_STEPS and s.detail],
                    lambda s: (s.name, s.detail))


def _grouped(spans: list[Span], key: Any) -> list[tuple[str, str, int, float, float]]:
    groups: dict[tuple[str, str], list[float]] = {}
    for s in spans:
        groups.setdefault(key(s), []).append(s.dur_us)
    return [(a, b, len(durs), sum(durs), statistics.median(durs))
            for (a, b), durs in sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))]


def extent_us(spans: list[Span]) -> float:
    """Microseconds from the first span's start to the last one's end."""
    first = min((s.start_us for s in spans), default=0.0)
    return max((s.start_us + s.dur_us for s in spans), default=0.0) - first


def summary(spans: list[Span]) -> str:
    """Per step name (and the kind of process it ran in): count, total and median time."""
    runs = {s.run for s in spans if s.run}
    lines = [f"{len(spans)} spans of {len(runs)} run(s) on {len({s.process for s in spans})} process(es), "
             f"{extent_us(spans) / 1000:.3f} ms from first to last",
             f"{'where':<11} {'step':<18} {'count':>7} {'total ms':>10} {'median us':>10}"]
    for where, name, count, total, median in steps(spans):
        lines.append(f"{where:<11} {name:<18} {count:>7} {total / 1000:>10.3f} {median:>10.1f}")
    named = functions(spans)
    if named:
        lines.append(f"{'step':<11} {'function':<24} {'count':>7} {'total ms':>10} {'median us':>10}")
        for step, function, count, total, median in named:
            lines.append(f"{step:<11} {function:<24} {count:>7} {total / 1000:>10.3f} {median:>10.1f}")
    return "\n".join(lines)


def gantt(spans: list[Span], path: str, title: Optional[str] = None) -> None:
    """A PNG Gantt chart: a row per process and thread, a colour per step name, and per
    function for computations (named in the legend, and on bars wide enough)."""
    plt = plotting.pyplot()
    from matplotlib.patches import Patch

    order = _process_order(spans)
    rows = sorted({(s.process, s.thread) for s in spans}, key=lambda r: (order[r[0]], r[1]))
    index = {r: i for i, r in enumerate(rows)}
    names = sorted({s.label for s in spans}, key=lambda n: (n not in COLOURS, list(COLOURS).index(n) if n in COLOURS
                                                            else 0, n))
    cmap = plt.get_cmap("tab20b")  # functions' colours: none of them a step's
    colour = {n: COLOURS.get(n) or cmap(i % 20) for i, n in enumerate(names)}
    origin = min((s.start_us for s in spans), default=0.0)
    end = max((s.start_us + s.dur_us for s in spans), default=1.0) - origin
    scale, unit = (1e3, "ms") if end >= 2000 else (1.0, "us")
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.3 * len(rows) + 1.8, 0.17 * len(names) + 1.0)))
    for s in spans:
        ax.barh(index[(s.process, s.thread)], max(s.dur_us, end / 2000) / scale, left=(s.start_us - origin) / scale,
                height=0.7, color=colour[s.label], edgecolor="none")
        if s.name in _FUNCTION_STEPS and s.detail and s.dur_us >= end / _NAMED_BAR:
            ax.text((s.start_us - origin + s.dur_us / 2) / scale, index[(s.process, s.thread)], s.detail,
                    ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{_short(p)} / {t}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}), on the client's clock")
    ax.set_title(title or "pathways timeline")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=colour[n], label=n) for n in names]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Steps whose detail is the function they compute or compile.
_FUNCTION_STEPS = ("execute", "compile")
# Such a step's bar carries its function's name when at least 1/this of the chart wide.
_NAMED_BAR = 25

# Steps that do work in strong colours, waits in pale ones.
COLOURS = {
    "trace": "#bcbd22", "put": "#7f7f7f", "submit": "#17becf", "fetch": "#e5e5e5",
    "lower": "#8c564b", "schedule": "#e377c2", "queue": "#f2d4e8", "dispatch": "#ff7f0e",
    "receive": "#9467bd", "wait for inputs": "#d9d9d9", "wait for release": "#c7c7c7", "execute": "#d62728",
    "send": "#2ca02c", "receive data": "#1f77b4", "done": "#aec7e8", "compile": "#dbdb8d",
}


def _process_order(spans: list[Span]) -> dict[str, tuple]:
    """Client, controller, then workers in the order they first executed (a pipeline's
    stage order), each process's rows together."""
    first: dict[str, float] = {}
    for s in spans:
        if s.name == "execute":
            first[s.process] = min(first.get(s.process, s.start_us), s.start_us)
    kinds = {"client": 0, "controller": 1}
    return {p: (kinds.get(p.split()[0], 2), first.get(p, float("inf")), p) for p in {s.process for s in spans}}


def _short(process: str) -> str:
    """A process label without its pid, so that row labels stay short."""
    return process.split(" (pid")[0].replace("grpc://", "")
