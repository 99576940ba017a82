"""A table of figures, printed as text or written as markdown: the planner's command line
prints its plans with it, and the benchmarks their measurements (BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]

    def text(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]
        line = lambda cells: "  ".join(  # noqa: E731
            (c.ljust(w) if i == 0 else c.rjust(w)) for i, (c, w) in enumerate(zip(cells, widths)))
        return "\n".join([self.title, line(self.columns), line(["-" * w for w in widths]),
                          *(line(r) for r in self.rows)])

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        sep = "| " + " | ".join(["---"] + ["---:"] * (len(self.columns) - 1)) + " |"
        return "\n".join([f"{self.title}:", "", head, sep, *("| " + " | ".join(r) + " |" for r in self.rows)])
