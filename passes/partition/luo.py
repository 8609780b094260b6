"""Luo et al. planner: LayerGraph + Cluster -> a sequential Plan mapped onto the topology.

Luo et al., "Efficient Pipeline Planning for Expedited Distributed DNN Training"
(INFOCOM'22) plan *synchronous* pipelines in two parts: (1) partition the model and map the
partitions onto devices of an arbitrary topology, jointly minimising the iteration time, and
(2) decide the order in which micro-batches are processed on each partition. Only the
abstract is available, so this is this repository's reconstruction (recorded in
BUILD_NOTES.md, "Planners"):

* Mapping. Every stage is replicated over r devices and stage s gets devices
  [s * r, (s + 1) * r) (nodes are filled in order), so on a two-level cluster the planner knows
  which stage boundaries cross nodes and which all-reduces stay inside one.
* Partition. The iteration time of a synchronous pipeline is estimated as
  ``sum_s t_s + (M - 1) * max_s t_s`` where t_s is stage s's forward + backward time per
  micro-batch plus its boundary transfers priced on the link its mapping gives it (the bytes
  crossing a boundary of the linearised graph) plus 1/M of its gradient all-reduce and
  optimizer update (the reconstruction prices synchronisation, which replication makes
  dominant for embedding-heavy models). For a grid of caps T on max_s t_s a DP over
  (stage, cut) minimises the sum subject to t_s <= T and per-device memory; the best cap wins.
* Order. Each partition is simulated with three micro-batch orders, synchronous 1F1B,
  list-scheduled graph 1F1B (backward as early as possible) and GPipe, and the fastest order
  within memory is kept.
Candidates range over micro-batch sizes (powers of two), replication r (a divisor of the
micro-batch) and two stage counts per r: S = min(devices / r, layers) and half of it (under
the planning problem's ``min_stages``, those of at least that many stages).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.plan_assembly import (
  StageLayout,
  assemble_plan,
  better,
  no_plan_error,
  shortlist,
)
from gpp_jax.passes.partition.problem import (
  PlanningProblem,
  ProblemPlanner,
  no_plan_with_stages_error,
)
from gpp_jax.passes.partition.range_costs import RangeCosts

ORDERS = ("1f1b", "graph-1f1b", "gpipe")
# Every order Luo et al.'s planner can choose among (``orders=``); the default keeps the synchronous
# orders of the reconstruction.
ALL_ORDERS = ("1f1b", "graph-1f1b", "gpipe", "zero-bubble")


def _crossing(costs, n: int) -> np.ndarray:
  """Bytes per sample crossing each boundary x (between layers x-1 and x) of the linear order."""
  diff = np.zeros(n + 2)
  for u, v, b in costs.edges:
    diff[u + 1] += b
    diff[v + 1] -= b
  return np.cumsum(diff)[: n + 1]


def _mapped_partition(rc: RangeCosts, cross: np.ndarray, r: int, S: int, grid: int = 24):
  """Best (estimate, ranges) for S stages of r devices mapped in order onto ``rc``'s cluster
  at ``rc``'s micro-batch size (``cross``: ``_crossing``), or None."""
  n, b, cluster = rc.n, rc.b, rc.cluster
  M = rc.B // b
  # Forward + backward per micro-batch, plus the stage's share of its end-of-iteration
  # gradient all-reduce and optimizer update (a replicated stage synchronises its gradients).
  comp = rc.compute[r] + rc.upd(rc.params, r) / M
  upd_static = rc.cm.static_memory(rc.params)
  inf = math.inf

  def link(s_from: int, s_to: int):
    return cluster.link_between(range(s_from * r, s_from * r + r), range(s_to * r, s_to * r + r))

  costs_s = []
  for s in range(S):
    c = comp.copy()
    if s > 0:
      l = link(s - 1, s)
      c = c + np.where(cross[:, None] > 0, l.alpha + cross[:, None] * b / l.beta, 0.0)
    if s < S - 1:
      l = link(s, s + 1)
      c = c + np.where(cross[None, :] > 0, l.alpha + cross[None, :] * b / l.beta, 0.0)
    mem = upd_static + rc.saved * b / r * min(S - s, M)
    c = np.where(mem <= cluster.memory_per_device, c, inf)
    c[np.tril_indices(n + 1)] = inf
    costs_s.append(c)
  finite = np.concatenate([c[np.isfinite(c)] for c in costs_s])
  if not len(finite):
    return None
  lo = max(float(comp[0, n]) / S, float(finite.min()))
  hi = float(finite.max())
  best = None
  for T in np.geomspace(lo, max(hi, lo), grid):
    F = np.full((S + 1, n + 1), inf)
    F[0, 0] = 0.0
    arg = np.zeros((S + 1, n + 1), dtype=int)
    for s in range(S):
      c = np.where(costs_s[s] <= T, costs_s[s], inf)
      cand = F[s][:, None] + c  # [i, j]
      arg[s + 1] = np.argmin(cand, axis=0)
      F[s + 1] = cand[arg[s + 1], np.arange(n + 1)]
    if not math.isfinite(F[S, n]):
      continue
    ranges, j = [], n
    for s in range(S, 0, -1):
      i = int(arg[s, j])
      ranges.append((i, j))
      j = i
    ranges.reverse()
    ts = [costs_s[s][i, j] for s, (i, j) in enumerate(ranges)]
    est = sum(ts) + (M - 1) * max(ts)
    if best is None or est < best[0]:
      best = (est, ranges)
  return best


@dataclasses.dataclass(frozen=True)
class LuoOptions:
  """Luo et al.'s options (the problem itself is a ``PlanningProblem``; its ``schedule`` is
  not used: the plan names the order that won).

  Attributes:
    orders: micro-batch processing orders (schedule generators) to choose from (ALL_ORDERS adds
      "zero-bubble" to the default three).
    simulate_top: how many partitions (best estimates first) are simulated in every order
      (searching with the host, also the best of every other replication and stage count,
      ``plan_assembly.shortlist``).
  """

  orders: tuple[str, ...] = ORDERS
  simulate_top: int = 4


def mapped_candidates(problem: PlanningProblem) -> list[tuple]:
  """The best mapped partition, (estimate, b, r, S, ranges), of every micro-batch size,
  replication r and stage count tried (see the module docstring; at least the problem's
  ``min_stages``), best estimate first."""
  cluster, cm, B, costs = problem.inputs()
  K = cluster.num_devices
  n = len(costs)
  cross = _crossing(costs, n)
  found = []
  for b in problem.microbatch_sizes():
    reps = [r for r in range(1, K + 1) if b % r == 0]
    rc = RangeCosts(costs, cm, cluster, b, B, reps)
    for r in reps:
      most = min(K // r, n)
      for S in sorted({S for S in (most, max(1, most // 2)) if problem.min_stages <= S}):
        got = _mapped_partition(rc, cross, r, S)
        if got is not None:
          found.append((got[0], b, r, S, got[1]))
  found.sort(key=lambda c: c[:4])
  return found


def luo_search(problem: PlanningProblem, opts: LuoOptions) -> Plan:
  """Luo et al.: PlanningProblem -> sequential Plan (see the module docstring)."""
  t0 = time.perf_counter()
  costs = problem.costs
  found = mapped_candidates(problem)
  # Stage s on devices [s * r, (s + 1) * r): the mapping the estimates price.
  layout = StageLayout(sequential=True, device_order=tuple(range(problem.num_devices)))
  best = None
  for est, b, r, _S, ranges in shortlist(found, opts.simulate_top, problem.host):
    stages = [(costs.layers[i:j], r) for i, j in ranges]
    for mode in opts.orders:
      plan = assemble_plan(
        problem,
        stages,
        microbatch=b,
        planner="luo",
        schedule=mode,
        layout=layout,
        info={"estimate": est, "replicas": r},
      )
      best = better(best, plan)
  if best is None or not best.predicted.get("memory_ok", True):
    if problem.min_stages > 1:
      raise no_plan_with_stages_error(
        "luo", problem.min_stages, "none of that many stages fits device memory"
      )
    raise no_plan_error("luo", problem.layer_graph, problem.cluster, problem.batch_size)
  pred = dict(best.predicted)
  pred["search"] = {"seconds": time.perf_counter() - t0, "candidates": len(found)}
  return best.replace(predicted=pred)


LUO = ProblemPlanner("luo", LuoOptions, luo_search)


# The keyword form (``LUO(layer_graph, cluster, batch_size, **options)``) under its own name.
luo_plan = LUO
