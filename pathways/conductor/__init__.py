"""Automatic distribution: ``pw.conduct`` shards an unannotated JAX function by a cost model.

- ``graph``: the function's jaxpr as block operations in one vocabulary (loop dimensions),
  attention recognised as one operation;
- ``pricing``: each operation's candidate shardings on each mesh shape, and their cost in
  time and memory from the cluster's measured figures;
- ``ring_attention``: blockwise attention with the sequence split over a mesh axis;
- ``api``: planning (the planner's exact solver picks the candidates), running the plan, and
  re-planning from the previous plan.
"""

from pathways.conductor.api import ConductedFunction, Plan, PlannedOperation, conduct

__all__ = ["ConductedFunction", "Plan", "PlannedOperation", "conduct"]
