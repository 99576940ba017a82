"""Planning for heterogeneous clusters, independent of the runtime.

Two problems, each with a fast baseline and an exact optimizer (OR-Tools CP-SAT):

- ``pipeline_partition``: split a model's layers over devices as a ring pipeline, for the
  lowest latency or the highest throughput, under memory limits (baseline: exo's
  memory-weighted ring partitioning);
- ``schedule``: place and order a task graph on devices for the shortest makespan, with
  transfer times, memory and eligibility (baseline: HEFT), and re-plan from a previous
  schedule when a task or device comes or goes.

A ``Topology`` describes the devices and links, by hand, from JSON or from a running
cluster's status. ``gantt`` draws plans; ``cli`` is ``python -m pathways plan``.
"""

from pathways.planner.partition import (OBJECTIVES, STRATEGIES, Layer, Partition, PipelinePlan, Stage,
                                        partitions_to_layer_ranges, pipeline_partition,
                                        ring_memory_weighted_partitions)
from pathways.planner.schedule import METHODS, Placement, Schedule, Task, schedule, validate
from pathways.planner.topology import Device, Link, PlanError, Topology, UnknownLinkError

__all__ = [
    "Device", "Layer", "Link", "METHODS", "OBJECTIVES", "Partition", "PipelinePlan", "PlanError", "Placement",
    "STRATEGIES", "Schedule", "Stage", "Task", "Topology", "UnknownLinkError", "partitions_to_layer_ranges",
    "pipeline_partition", "ring_memory_weighted_partitions", "schedule", "validate",
]
