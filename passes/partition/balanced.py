"""FLOP-balanced chain planner: the simple default when no cost-model planner is wanted.

Linearises the LayerGraph in topological order and cuts it into contiguous pieces of nearly
equal forward FLOPs (at most one stage per device), one device per stage. Independent branches
are not run concurrently; use the graphpipe planner for that. It prices nothing: the problem's
cost model and micro-batch limit are not used. Its stage count is ``num_stages`` (default: as
many as devices and layers allow), which the problem's ``min_stages`` bounds from below: a
``num_stages`` under it is a ``PlanError``.
"""

from __future__ import annotations

import dataclasses

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.errors import PlanError, counted
from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan, Stage, stage_edges
from gpp_jax.passes.partition.problem import PlanningProblem, ProblemPlanner


@dataclasses.dataclass(frozen=True)
class BalancedOptions:
  """The balanced planner's options (the problem itself is a ``PlanningProblem``).

  Attributes:
    num_stages: stages to cut into (default: min(devices, layers)).
  """

  num_stages: int | None = None


def min_max_cuts(weights: list[float], num_stages: int) -> list[tuple[int, int]]:
  """``num_stages`` contiguous ranges [a, b) of ``weights`` whose largest sum is smallest (a
  linear-partition DP, exact for contiguous cuts)."""
  n, S = len(weights), num_stages
  pre = [0.0]
  for x in weights:
    pre.append(pre[-1] + x)
  INF = float("inf")
  best = [[INF] * (S + 1) for _ in range(n + 1)]
  cut = [[0] * (S + 1) for _ in range(n + 1)]
  best[0][0] = 0.0
  for i in range(1, n + 1):
    for k in range(1, min(i, S) + 1):
      for j in range(k - 1, i):
        v = max(best[j][k - 1], pre[i] - pre[j])
        if v < best[i][k]:
          best[i][k], cut[i][k] = v, j
  bounds, i = [], n
  for k in range(S, 0, -1):
    j = cut[i][k]
    bounds.append((j, i))
    i = j
  bounds.reverse()
  return bounds


def balanced_search(problem: PlanningProblem, opts: BalancedOptions) -> Plan:
  """Cuts the topologically ordered layers into FLOP-balanced contiguous stages, one device
  each; ``num_microbatches`` defaults to the number of stages."""
  layer_graph = problem.layer_graph
  layers = topo_layers(layer_graph)
  S = min(opts.num_stages or problem.num_devices, len(layers))
  if problem.min_stages > S:
    raise PlanError(
      f"balanced: num_stages={opts.num_stages} cuts {counted(S, 'stage')}, fewer than min_stages="
      f"{problem.min_stages}; pass num_stages of at least {problem.min_stages}, or drop "
      "num_stages (as many stages as devices and layers allow)"
    )
  weights = [max(layer_graph.nodes[l]["flops"], 1.0) for l in layers]
  stages = tuple(
    Stage(index=k, layers=tuple(layers[a:b]), devices=(k,))
    for k, (a, b) in enumerate(min_max_cuts(weights, S))
  )
  where = {l: s.index for s in stages for l in s.layers}
  return Plan(
    stages=stages,
    edges=stage_edges(layer_graph, where),
    num_microbatches=problem.num_microbatches or S,
    schedule=problem.schedule,
    planner="balanced",
    batch_size=problem.batch_size,
  )


BALANCED = ProblemPlanner("balanced", BalancedOptions, balanced_search, shapes_stages=False)


def balanced_plan(
  layer_graph: nx.DiGraph,
  cluster: Cluster | int | None = None,
  batch_size: int | None = None,
  *,
  num_microbatches: int | None = None,
  num_stages: int | None = None,
  schedule: str = "1f1b",
) -> Plan:
  """Cuts the topologically ordered layers into ``num_stages`` FLOP-balanced contiguous stages.

  Args:
    layer_graph: the LayerGraph.
    cluster: a Cluster or an int device count; the number of stages defaults to it.
    batch_size: mini-batch size (recorded in the plan; None records none).
    num_microbatches: micro-batches per step (default: number of stages).
    num_stages: stages to cut into (default: min(devices, layers)).
    schedule: the schedule generator the plan names.
  """
  plan = BALANCED(
    layer_graph,
    cluster,
    batch_size,
    num_microbatches=num_microbatches,
    schedule=schedule,
    num_stages=num_stages,
  )
  # The problem's batch defaults to the graph's; this form records only a batch it is given.
  return plan if batch_size is not None else plan.replace(batch_size=None)
