"""OR-Tools' CP-SAT solver, which the planner's and the conductor's optimal searches use. It
comes with an extra (``pip install "pathways[planner]"``: OR-Tools brings pandas and more),
and is imported only when a search needs it, so that the runtime installs without it."""

from __future__ import annotations

from types import ModuleType

from pathways.planner.topology import PlanError

INSTALL = 'pip install "pathways[planner]" (or ortools)'


def cp_model() -> ModuleType:
    """``ortools.sat.python.cp_model``; PlanError saying how to install it where it is not."""
    try:
        from ortools.sat.python import cp_model as module
    except ImportError:
        raise PlanError(f"this search needs OR-Tools' CP-SAT solver, which is not installed: {INSTALL}") from None
    return module
