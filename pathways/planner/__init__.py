"""Planning for heterogeneous clusters, independent of the runtime.

Three problems, the first two with a fast baseline, all with an exact optimizer (OR-Tools
CP-SAT):

- ``pipeline_partition``: split a model's layers over devices as a ring pipeline, for the
  lowest latency or the highest throughput, under memory limits (baseline: exo's
  memory-weighted ring partitioning);
- ``schedule``: place and order a task graph on devices for the shortest makespan, with
  transfer times, memory and eligibility (baseline: HEFT), and re-plan from a previous
  schedule when a task or device comes or goes;
- ``solve_sharding`` (``pathways.planner.sharding``): one sharding per operation of a
  graph, for the least time under a per-device memory limit (what ``pw.conduct`` solves);
  ``best_ring`` (``pathways.planner.ring``): the ring order whose slowest hop is fastest.

A ``Topology`` describes the devices and links, by hand, from JSON or from a running
cluster's status. ``gantt`` draws plans; the ``pathways plan`` command
(:mod:`pathways.cli.plan`) plans from a JSON file.
"""

from pathways.planner.partition import (OBJECTIVES, STRATEGIES, Layer, Partition, PipelinePlan, Stage,
                                        partitions_to_layer_ranges, pipeline_partition,
                                        ring_memory_weighted_partitions)
from pathways.planner.ring import best_ring
from pathways.planner.schedule import METHODS, Placement, Schedule, Task, schedule, validate
from pathways.planner.sharding import ShardingSolution, exhaustive_sharding, solve_sharding
from pathways.planner.topology import Device, Link, PlanError, Topology, UnknownLinkError

__all__ = [
    "Device", "Layer", "Link", "METHODS", "OBJECTIVES", "Partition", "PipelinePlan", "PlanError", "Placement",
    "STRATEGIES", "Schedule", "ShardingSolution", "Stage", "Task", "Topology", "UnknownLinkError", "best_ring",
    "exhaustive_sharding", "partitions_to_layer_ranges", "pipeline_partition", "ring_memory_weighted_partitions",
    "schedule", "solve_sharding", "validate",
]
