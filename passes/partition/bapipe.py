"""BaPipe planner: LayerGraph + Cluster -> a sequential Plan, schedule mode chosen by simulation.

BaPipe (Zhao et al., arXiv 2012.12544) "automatically explores pipeline schedule modes and
balanced partitions". Only its abstract is available, so the details here are this
repository's reading of it (recorded in BUILD_NOTES.md, "Planners"):

* schedule modes: GPipe (all forwards, then all backwards) and synchronous 1F1B;
* balanced partitions: the topologically ordered layers are cut into S contiguous stages that
  minimise the slowest stage's time per sample, every stage replicated over the same number
  r of devices (r * S <= devices); memory is checked for the mode's in-flight count (GPipe
  stashes all M micro-batches; 1F1B a stage s-th from the end stashes min(s, M));
* exploration: every micro-batch size (powers of two dividing the batch), replication r,
  stage count S and mode; candidates are ranked by the estimate (M + S - 1) * TPS * b and the
  best ones are simulated with their mode's schedule; the fastest plan wins;
* ``min_stages`` (the planning problem's): the stage counts S explored start there.
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

MODES = ("1f1b", "gpipe")
# Every schedule mode BaPipe can explore (``modes=``); the default keeps the paper's two.
ALL_MODES = ("1f1b", "gpipe", "zero-bubble")


def balanced_ranges(
  rc: RangeCosts, r: int, S: int, mode: str
) -> tuple[float, list[tuple[int, int]]] | None:
  """Min-max partition of all layers into S contiguous ranges, each on r devices, within the
  memory per device of ``rc``'s cluster for ``mode`` at ``rc``'s micro-batch size; returns
  (bottleneck TPS, ranges) or None."""
  n = rc.n
  M = rc.B // rc.b
  mem_cap = rc.cluster.memory_per_device
  tps = rc.tps(r)
  # P[s][i]: best bottleneck for layers i..n-1 cut into s stages (the first is s-th from the end).
  P = np.full((S + 1, n + 1), math.inf)
  P[0, n] = 0.0
  arg = np.zeros((S + 1, n + 1), dtype=int)
  for s in range(1, S + 1):
    flight = M if mode == "gpipe" else min(s, M)
    mem = rc.memory(r, flight)
    cost = np.where(mem <= mem_cap, tps, math.inf)
    cost[np.tril_indices(n + 1)] = math.inf
    cand = np.maximum(cost, P[s - 1][None, :])  # [i, j]
    arg[s] = np.argmin(cand, axis=1)
    P[s] = cand[np.arange(n + 1), arg[s]]
  if not math.isfinite(P[S, 0]):
    return None
  out, i = [], 0
  for s in range(S, 0, -1):
    j = int(arg[s, i])
    out.append((i, j))
    i = j
  return float(P[S, 0]), out


@dataclasses.dataclass(frozen=True)
class BaPipeOptions:
  """BaPipe's options (the problem itself is a ``PlanningProblem``; its ``schedule`` is not
  used: the plan names the mode that won).

  Attributes:
    modes: schedule modes to explore (default "1f1b" and "gpipe"; ALL_MODES adds "zero-bubble").
    simulate_top: how many ranked candidates are simulated (searching with the host, also
      the best of every other replication and stage count, ``plan_assembly.shortlist``).
  """

  modes: tuple[str, ...] = MODES
  simulate_top: int = 8


def ranked_candidates(problem: PlanningProblem, modes: tuple[str, ...]) -> list[tuple]:
  """Every balanced partition within memory, (estimate, b, r, S, mode, ranges, TPS) over
  micro-batch sizes, replications, stage counts (at least the problem's ``min_stages``) and
  modes, best estimate first."""
  cluster, cm, B, costs = problem.inputs()
  K = cluster.num_devices
  n = len(costs)
  found = []
  for b in problem.microbatch_sizes():
    M = B // b
    reps = [r for r in range(1, K + 1) if b % r == 0 and K % r == 0]
    rc = RangeCosts(costs, cm, cluster, b, B, reps)
    for r in reps:
      for S in range(max(1, problem.min_stages), min(K // r, n) + 1):
        for mode in modes:
          got = balanced_ranges(rc, r, S, mode)
          if got is None:
            continue
          tps, ranges = got
          found.append(((M + S - 1) * tps * b, b, r, S, mode, ranges, tps))
  found.sort(key=lambda c: c[:5])
  return found


def bapipe_search(problem: PlanningProblem, opts: BaPipeOptions) -> Plan:
  """BaPipe: PlanningProblem -> sequential Plan (see the module docstring)."""
  t0 = time.perf_counter()
  costs = problem.costs
  found = ranked_candidates(problem, opts.modes)
  best = None
  for _est, b, r, _S, mode, ranges, tps in shortlist(found, opts.simulate_top, problem.host):
    stages = [(costs.layers[i:j], r) for i, j in ranges]
    plan = assemble_plan(
      problem,
      stages,
      microbatch=b,
      planner="bapipe",
      schedule=mode,
      layout=StageLayout(sequential=True),
      info={"bottleneck_tps": tps, "replicas": r},
    )
    best = better(best, plan)
  if best is None or not best.predicted.get("memory_ok", True):
    if problem.min_stages > 1:
      raise no_plan_with_stages_error(
        "bapipe", problem.min_stages, "none of that many stages fits device memory"
      )
    raise no_plan_error("bapipe", problem.layer_graph, problem.cluster, problem.batch_size)
  pred = dict(best.predicted)
  pred["search"] = {"seconds": time.perf_counter() - t0, "candidates": len(found)}
  return best.replace(predicted=pred)


BAPIPE = ProblemPlanner("bapipe", BaPipeOptions, bapipe_search)


# The keyword form (``BAPIPE(layer_graph, cluster, batch_size, **options)``) under its own name.
bapipe_plan = BAPIPE
