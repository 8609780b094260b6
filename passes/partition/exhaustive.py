"""Exhaustive planner: LayerGraph + Cluster -> the best plan of the plan space, for small graphs.

Enumerates every partition of the layers into stages whose stage graph is acyclic (which
makes every stage convex), every device count per stage (a divisor of the micro-batch; devices
may stay idle), and every micro-batch size (powers of two dividing the batch), simulates each
plan with the synchronous 1F1B schedule and returns the fastest one within memory. It is the
ground truth the tests hold the other planners against; a cheap lower bound per candidate
(the busiest stage's compute for all micro-batches) skips candidates that cannot win. Under
the planning problem's ``min_stages``, partitions of fewer blocks are not plans.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import networkx as nx

from gpp_jax.errors import PlanError
from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.plan_assembly import (
  assemble_plan,
  better,
  data_parallel_degrees,
  no_plan_error,
)
from gpp_jax.passes.partition.problem import (
  PlanningProblem,
  ProblemPlanner,
  no_plan_with_stages_error,
)


def acyclic_partitions(layer_graph: nx.DiGraph) -> list[list[list[str]]]:
  """Every partition of the layers whose quotient (stage) graph is acyclic."""
  layers = topo_layers(layer_graph)
  out = []

  def rec(i: int, blocks: list[list[str]]):
    if i == len(layers):
      where = {l: k for k, bl in enumerate(blocks) for l in bl}
      q = nx.DiGraph()
      q.add_nodes_from(range(len(blocks)))
      q.add_edges_from((where[u], where[v]) for u, v in layer_graph.edges if where[u] != where[v])
      if nx.is_directed_acyclic_graph(q):
        out.append([list(bl) for bl in blocks])
      return
    l = layers[i]
    for bl in blocks:
      bl.append(l)
      rec(i + 1, blocks)
      bl.pop()
    blocks.append([l])
    rec(i + 1, blocks)
    blocks.pop()

  rec(0, [])
  return out


@dataclasses.dataclass(frozen=True)
class ExhaustiveOptions:
  """The exhaustive search's options (the problem itself is a ``PlanningProblem``).

  Attributes:
    max_layers, max_devices: PlanError for a graph of more layers or a cluster of more devices
      (the number of partitions grows like the Bell number of the layer count).
  """

  max_layers: int = 8
  max_devices: int = 8


def exhaustive_search(problem: PlanningProblem, opts: ExhaustiveOptions) -> Plan:
  """Exhaustive search: PlanningProblem -> the fastest plan (see the module docstring)."""
  t0 = time.perf_counter()
  layer_graph, cluster = problem.layer_graph, problem.cluster
  n = layer_graph.number_of_nodes()
  K = cluster.num_devices
  if n > opts.max_layers or opts.max_devices < K:
    raise PlanError(
      f"exhaustive search is for small problems (at most {opts.max_layers} layers and "
      f"{opts.max_devices} devices), got {n} layers on {K} devices; use graphpipe, "
      "or raise max_layers / max_devices knowing the cost grows like Bell(n)"
    )
  parts = acyclic_partitions(layer_graph)
  best: Plan | None = None
  simulated = 0
  # Every plan is met once: its simulation is not kept (up to tens of thousands of them).
  once = problem.without_memo()
  for b in problem.microbatch_sizes():
    best, count = best_at_size(once, parts, b, best)
    simulated += count
  if best is None or not best.predicted.get("memory_ok", True):
    if problem.min_stages > 1:
      raise no_plan_with_stages_error(
        "exhaustive", problem.min_stages, "none of that many stages fits device memory"
      )
    raise no_plan_error("exhaustive", layer_graph, cluster, problem.batch_size)
  pred = dict(best.predicted)
  pred["search"] = {
    "seconds": time.perf_counter() - t0,
    "partitions": len(parts),
    "simulated": simulated,
  }
  return best.replace(predicted=pred)


def best_at_size(
  problem: PlanningProblem, parts: list[list[list[str]]], b: int, best: Plan | None
) -> tuple[Plan | None, int]:
  """The faster of ``best`` and every plan at micro-batch size ``b`` (partitions ``parts``,
  every device count per stage), and how many plans were simulated: a plan whose busiest
  stage's compute alone is no faster than ``best`` (within memory) is not, nor one of fewer
  stages than the problem's ``min_stages``."""
  cluster, cm, B, costs = problem.inputs()
  K = cluster.num_devices
  M = B // b
  dps = data_parallel_degrees(b, K)
  times = {}
  for d in dps:
    tf, tb = cm.planner_layer_times(costs, cluster, b / d)
    times[d] = tf + tb
  simulated = 0
  for blocks in parts:
    if len(blocks) > K or len(blocks) < problem.min_stages:
      continue
    idx = [[costs.index[l] for l in bl] for bl in blocks]
    for counts in itertools.product(dps, repeat=len(blocks)):
      if sum(counts) > K:
        continue
      bound = max(M * float(times[d][ix].sum()) for d, ix in zip(counts, idx))
      if (
        best is not None
        and best.predicted["memory_ok"]
        and bound >= best.predicted["iteration_time"]
        and (problem.host is None or len(blocks) > 1)  # one stage: one jitted step
      ):
        continue
      plan = assemble_plan(problem, list(zip(blocks, counts)), microbatch=b, planner="exhaustive")
      simulated += 1
      best = better(best, plan)
  return best, simulated


EXHAUSTIVE = ProblemPlanner("exhaustive", ExhaustiveOptions, exhaustive_search)


# The keyword form (``EXHAUSTIVE(layer_graph, cluster, batch_size, **options)``) under its own name.
exhaustive_plan = EXHAUSTIVE
