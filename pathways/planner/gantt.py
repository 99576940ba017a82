"""Gantt charts of plans, as PNG files.

matplotlib is imported inside the functions (plotting.pyplot: the Agg backend, an extra), so
that importing the planner stays cheap and works on machines without a display or matplotlib.
"""

from __future__ import annotations

from pathways import plotting
from pathways.planner.partition import PipelinePlan
from pathways.planner.schedule import Schedule
from pathways.planner.topology import PlanError, Topology


def _unit(seconds: float) -> tuple[float, str]:
    """A time unit that keeps the axis numbers readable."""
    for factor, name in ((1.0, "s"), (1e3, "ms"), (1e6, "us")):
        if seconds * factor >= 1.0:
            return factor, name
    return 1e9, "ns"




def transfers(schedule: Schedule) -> list[tuple[str, str, float, float]]:
    """The data moves of ``schedule`` between devices: ``(from task, to task, start, end)``,
    each starting when its producer ends and taking the link's time for the bytes it
    carries (empty when the schedule does not carry its tasks and topology)."""
    if schedule.topology is None:
        return []
    moves = []
    for task in schedule.tasks:
        dst = schedule.placements[task.id]
        for pred, nbytes in task.deps.items():
            src = schedule.placements[pred]
            if src.device != dst.device:
                moves.append((pred, task.id, src.end,
                              src.end + schedule.topology.transfer_time(src.device, dst.device, nbytes)))
    return moves


def plot_schedule(schedule: Schedule, path: str, title: str = "") -> None:
    """Write a Gantt chart of ``schedule`` to ``path``: one row per device, one bar per task
    (named inside it, or above it when it is too narrow), and for every dependency between
    devices a hatched bar on the receiving device's row for the transfer, labelled with its
    time, and an arrow from the producer to the consumer."""
    if not schedule.placements:
        raise PlanError("the schedule has no placements to plot")
    plt = plotting.pyplot()
    devices = sorted({p.device for p in schedule.placements.values()})
    row = {d: k for k, d in enumerate(devices)}
    factor, unit = _unit(max(schedule.makespan, 1e-12))
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(devices)))
    for k, p in enumerate(sorted(schedule.placements.values(), key=lambda p: (p.start, p.task))):
        width = (p.end - p.start) * factor
        ax.broken_barh([(p.start * factor, width)], (row[p.device] - 0.3, 0.6),
                       facecolors=colors[k % len(colors)], edgecolor="black", linewidth=0.5)
        if width >= 0.04 * schedule.makespan * factor:
            ax.text(p.start * factor + width / 2, row[p.device], p.task, ha="center", va="center", fontsize=7,
                    clip_on=True)
        else:  # too narrow for its name: above the bar
            ax.text(p.start * factor + width / 2, row[p.device] - 0.32, p.task, ha="center", va="bottom",
                    fontsize=6)
    for src, dst, start, end in transfers(schedule):
        a, b = schedule.placements[src], schedule.placements[dst]
        ax.broken_barh([(start * factor, (end - start) * factor)], (row[b.device] + 0.3, 0.15),
                       facecolors="white", edgecolor="grey", hatch="////", linewidth=0.5)
        ax.annotate("", xy=(b.start * factor, row[b.device] + 0.3), xytext=(a.end * factor, row[a.device] + 0.3),
                    arrowprops={"arrowstyle": "->", "color": "grey", "linewidth": 0.7})
        t_factor, t_unit = _unit(max(end - start, 1e-12))
        ax.text((start + end) / 2 * factor, row[b.device] + 0.47, f"{(end - start) * t_factor:.3g} {t_unit}",
                ha="center", va="top", fontsize=6, color="dimgrey")
    ax.set_yticks(range(len(devices)), devices)
    ax.set_ylim(len(devices) - 0.4, -0.7)  # inverted, with room for names above the first row's bars
    ax.set_xlabel(f"time ({unit}); hatched: a transfer between devices, with its time")
    ax.set_ylabel("device")
    proof = "optimal" if schedule.optimal else f"lower bound {schedule.lower_bound * factor:.4g} {unit}"
    ax.set_title(title or f"{schedule.method}: makespan {schedule.makespan * factor:.4g} {unit} ({proof})")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pipeline(plan: PipelinePlan, topology: Topology, path: str, title: str = "",
                  microbatches: int = 4) -> None:
    """Write a Gantt chart of ``microbatches`` microbatches going through ``plan``'s stages
    to ``path``: a row per stage's compute and a row per link (the return link included);
    a stage computes a microbatch once it has arrived and the previous one is done, and a
    link sends one microbatch at a time."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
    for st in plan.stages:
        topology.device(st.device)
    plt = plotting.pyplot()
    stages = plan.stages
    k = len(stages)
    rows = []  # (label, [(start, end, microbatch)])
    compute_rows = [[] for _ in stages]
    link_rows = [[] for _ in stages] if k > 1 else []
    compute_free = [0.0] * k
    link_free = [0.0] * k
    for b in range(microbatches):
        arrive = 0.0
        for i, st in enumerate(stages):
            start = max(arrive, compute_free[i])
            compute_free[i] = start + st.compute_s
            compute_rows[i].append((start, compute_free[i], b))
            if k > 1:
                send = max(compute_free[i], link_free[i])
                link_free[i] = send + st.send_s
                link_rows[i].append((send, link_free[i], b))
                arrive = link_free[i]
    for i, st in enumerate(stages):
        rows.append((f"{st.device} layers {st.start}-{st.end - 1}", compute_rows[i]))
        if k > 1:
            rows.append((f"{st.device} -> {stages[(i + 1) % k].device}", link_rows[i]))
    end = max((e for _, bars in rows for _, e, _ in bars), default=0.0)
    factor, unit = _unit(max(end, 1e-12))
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(rows)))
    for r, (_, bars) in enumerate(rows):
        for s, e, b in bars:
            ax.broken_barh([(s * factor, (e - s) * factor)], (r - 0.4, 0.8), facecolors=colors[b % len(colors)],
                           edgecolor="black", linewidth=0.5)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}); colour: microbatch")
    latency_factor, latency_unit = _unit(plan.latency)
    ax.set_title(title or f"{plan.strategy} ({plan.objective}): latency {plan.latency * latency_factor:.4g} "
                          f"{latency_unit}, {plan.throughput:.4g} microbatches/s")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
