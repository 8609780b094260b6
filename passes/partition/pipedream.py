"""PipeDream planner: LayerGraph + Cluster -> a sequential Plan (a chain of replicated stages).

PipeDream (Harlap, Narayanan et al.; SOSP'19) linearises the graph in topological order and
cuts it into contiguous stages with a dynamic program that minimises the slowest stage's time,
letting each stage be replicated (data parallel) over several devices. This is the planner
GraphPipe compares against (run synchronously, as PipeDream-Flush / 1F1B).

DP, from the back of the chain so that each stage's in-flight count is known when it is
priced (synchronous 1F1B: the stage holds one micro-batch per stage from it to the end):
  A[n, m, 0] = 0
  A[i, m, s] = min over j > i, d | b, d <= m with memory(i..j-1, d, min(s, M)) <= capacity of
               max(TPS(i..j-1, d), A[j, m - d, s - 1])
A[0, K, s] is the best bottleneck with s stages. Devices may stay idle (A is made
non-increasing in m); idle devices are then handed out by ``refine.polish`` (not with the
published selection). TPS uses the
shared cost model, so PipeDream and GraphPipe are priced the same way. The micro-batch size is
swept over powers of two dividing the batch; over all (micro-batch, s) optima the ones with
the best estimate (M + s - 1) * TPS * b are simulated and the fastest wins (the same selection
rule GraphPipe uses over its depth frontier). The stages form a chain: consecutive stages get
an ordering edge even when no tensor flows between them, as in PipeDream's runtime, where a
stage talks only to its neighbours.

``min_stages`` (the planning problem's): the DP's optima are per stage count s, so the search
keeps to s >= min_stages (and the polish to moves that keep that many stages): PipeDream's
best plan of at least that many stages, whatever its best plan overall.

Selection (``selection=``):
  * ``"published"``: PipeDream's objective alone, no simulation and no polish: at each
    micro-batch size the DP's smallest bottleneck (ties: fewer stages); across sizes, which
    PipeDream takes as an input, the one whose synchronous 1F1B time (M + s - 1) * TPS * b is
    smallest (analytic). This is the PipeDream GraphPipe compares against.
  * ``"simulated"`` (default): the simulated and polished selection described above.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.plan_assembly import (
  StageLayout,
  assemble_plan,
  data_parallel_degrees,
  no_plan_error,
)
from gpp_jax.passes.partition.problem import (
  PlanningProblem,
  ProblemPlanner,
  device_unit,
  no_plan_with_stages_error,
)
from gpp_jax.passes.partition.range_costs import RangeCosts
from gpp_jax.passes.partition.refine import (
  REFINE_WITHIN,
  BoundTimes,
  pipeline_lower_bound,
  polish,
  stage_bound_times,
)


def chain_dp(rc: RangeCosts, replicate: bool = True, unit: int = 1) -> tuple[np.ndarray, list]:
  """The PipeDream DP table A[i, m, s] over ranges of ``rc`` (see the module docstring), on
  ``rc``'s cluster and its memory per device at ``rc``'s micro-batch size, with devices
  counted in slots of ``unit`` (m slots = m * unit devices; stages take multiples of
  ``unit``); ``A[0, -1, s]`` is the optimum with s stages on the whole cluster. Returns the
  table and the device counts a stage may take."""
  n = rc.n
  K = rc.cluster.num_devices
  M = rc.B // rc.b
  mem_cap = rc.cluster.memory_per_device
  Ks = K // unit
  S = min(Ks, n)
  A = np.full((n + 1, Ks + 1, S + 1), math.inf)
  A[n, :, 0] = 0.0
  dps = [d for d in (rc.dps if replicate else [1]) if d % unit == 0 and d <= K]
  if not chain_fits(rc, dps):
    return A, dps  # nothing fits: every entry but the empty tail's stays inf
  s_in = np.minimum(np.arange(1, S + 1), M)  # in-flight of the stage s-th from the end
  for i in range(n - 1, -1, -1):
    # Layers i.. make at most n - i stages: A[j, :, s - 1] is inf for s > n - i at every
    # j > i, so only the stage counts up to that are computed (the rest stay inf).
    top = min(S, n - i)
    static = rc.cm.static_memory(rc.params[i, i + 1 :])[:, None]  # (L, 1) for j = i+1..n
    for d in dps:
      u = d // unit
      T = rc.tps(d)[i, i + 1 :]  # (L,)
      mem = _ranges_memory(rc, i, static, d, s_in[:top])  # (L, top)
      # The stage's TPS where it fits in memory, inf where it does not (L, top).
      T_ok = np.where(mem <= mem_cap, T[:, None], math.inf)
      sub = A[i + 1 :, : Ks + 1 - u, :top]  # (L, Ks+1-u, top): A[j, m-u, s-1]
      val = np.maximum(T_ok[:, None, :], sub).min(axis=0)  # (Ks+1-u, top)
      A[i, u:, 1 : top + 1] = np.minimum(A[i, u:, 1 : top + 1], val)
    A[i] = np.minimum.accumulate(A[i], axis=0)
  return A, dps


def _ranges_memory(
  rc: RangeCosts, i: int, static: np.ndarray, d: int, in_flight: np.ndarray
) -> np.ndarray:
  """(L, S) bytes per device of the ranges i..j-1 (j = i+1..n; ``static``: their held bytes,
  (L, 1)) on d devices, holding ``in_flight[s]`` micro-batches as the stage s+1-th from the
  end: the memory rule of ``chain_dp`` and ``chain_fits``."""
  return static + rc.saved[i, i + 1 :][:, None] * rc.b / d * in_flight[None, :]


def chain_fits(rc: RangeCosts, dps: Sequence[int], slack: float = 0.0) -> bool:
  """Whether some chain of ranges of ``rc`` with stages on ``dps`` devices each fits the
  cluster's devices and their memory (by ``chain_dp``'s rule, the stage s-th from the end
  holding min(s, M) micro-batches): a DP over (first layer, stages from there to the end) of
  the fewest devices, without the slots and times ``chain_dp`` tables, so it answers in a
  fraction of that where nothing fits. ``slack``: memory counted up to (1 + slack) times the
  device's, for a caller whose sums round otherwise."""
  if not dps:
    return False
  n, K = rc.n, rc.cluster.num_devices
  M = rc.B // rc.b
  cap = rc.cluster.memory_per_device * (1 + slack)
  S = min(K // min(dps), n)
  s_in = np.minimum(np.arange(1, S + 1), M)
  fewest = np.full((n + 1, S + 1), math.inf)  # fewest[j, s]: layers j.. in s stages
  fewest[n, 0] = 0.0
  for i in range(n - 1, -1, -1):
    top = min(S, n - i)
    static = rc.cm.static_memory(rc.params[i, i + 1 :])[:, None]  # (L, 1) for j = i+1..n
    need = np.full((n - i, top), math.inf)  # the fewest devices of a stage i..j-1, per s
    for d in sorted(dps, reverse=True):
      need = np.where(_ranges_memory(rc, i, static, d, s_in[:top]) <= cap, float(d), need)
    fewest[i, 1 : top + 1] = (need + fewest[i + 1 :, :top]).min(axis=0)
  return bool((fewest[0, 1:] <= K).any())


@dataclasses.dataclass(frozen=True, eq=False)
class ChainTable:
  """PipeDream's DP at one micro-batch size: the range costs it prices (``rc``, whose cluster,
  micro-batch and batch it is for), its table ``A`` and device counts ``dps`` (``chain_dp``),
  devices counted in slots of ``unit``."""

  rc: RangeCosts
  A: np.ndarray
  dps: list[int]
  unit: int = 1

  @classmethod
  def compute(cls, rc: RangeCosts, replicate: bool = True, unit: int = 1) -> ChainTable:
    """The DP over ``rc`` (``chain_dp``; ``replicate``: data-parallel stages allowed)."""
    A, dps = chain_dp(rc, replicate, unit)
    return cls(rc, A, dps, unit)

  def reconstruct(self, s: int) -> list[tuple[int, int, int]]:
    """Stages (i, j, d) of the DP optimum that uses ``s`` stages on at most the cluster's
    devices."""
    rc, A, unit = self.rc, self.A, self.unit
    M = rc.B // rc.b
    mem_cap = rc.cluster.memory_per_device
    out = []
    i, m = 0, rc.cluster.num_devices // unit
    target = A[0, m, s]
    while i < rc.n:
      while m > 0 and A[i, m - 1, s] <= target:
        m -= 1
      found = None
      static = rc.cm.static_memory(rc.params[i, i + 1 :])
      for d in self.dps:
        if d > m * unit:
          break
        # The first end j whose stage with the rest attains the target, over every j at once.
        v = np.maximum(rc.tps(d)[i, i + 1 :], A[i + 1 :, m - d // unit, s - 1])
        mem = static + rc.saved[i, i + 1 :] * rc.b / d * min(s, M)
        hits = np.flatnonzero((v <= target * (1 + 1e-9)) & (mem <= mem_cap))
        if hits.size:
          found = (i + 1 + int(hits[0]), d)
          break
      if found is None:
        raise AssertionError("PipeDream reconstruction lost the optimum")
      j, d = found
      out.append((i, j, d))
      i, m, s = j, m - d // unit, s - 1
      target = A[i, m, s] if i < rc.n else 0.0
    return out


@dataclasses.dataclass(frozen=True)
class PipeDreamOptions:
  """PipeDream's options (the problem itself is a ``PlanningProblem``).

  Attributes:
    replicate: allow data-parallel stages (PipeDream's replication); False gives the
      straight pipeline (``--straight_pipeline``).
    simulate_top: how many (micro-batch, stage count) optima, ranked by the estimate
      (M + S - 1) * TPS * b, are simulated; at the two best micro-batch sizes the best
      max(simulate_top, 8) stage counts are simulated too, with and without replication; the
      fastest plan wins after ``refine.polish``.
    selection: "published" (PipeDream's objective alone) or "simulated" (see the module
      docstring).
    device_grid: the DP counts devices in slots of u devices, u the smallest power of two
      with at most this many slots (None: single devices; up to ``device_grid`` devices the
      DP sees every count); the polish then moves single devices.
  """

  replicate: bool = True
  simulate_top: int = 6
  selection: str = "simulated"
  device_grid: int | None = 64


def pipedream_search(problem: PlanningProblem, opts: PipeDreamOptions) -> Plan:
  """PipeDream: PlanningProblem -> sequential Plan (see the module docstring)."""
  if opts.selection not in SELECTIONS:
    raise ValueError(f"pipedream: selection must be one of {SELECTIONS}, got {opts.selection!r}")
  t0 = time.perf_counter()
  sizes = problem.microbatch_sizes()
  unit = device_unit(problem.num_devices, opts.device_grid)
  k = problem.min_stages
  if k > problem.num_devices // unit:
    raise no_plan_with_stages_error(
      "pipedream",
      k,
      f"its DP counts devices in slots of {unit}, at most {problem.num_devices // unit} "
      "stages; pass a larger device_grid",
    )
  if opts.selection == "published":
    plan = published_chain(problem, sizes, replicate=opts.replicate, unit=unit)
  else:
    search = ChainSearch(
      replicate=opts.replicate,
      simulate_top=opts.simulate_top,
      unit=unit,
      keep_within=REFINE_WITHIN,
    )
    evaluated = chain_candidates(problem, sizes, search)
    if not evaluated:
      raise no_chain_error(problem)
    plan = polish(problem, evaluated, refine_within=REFINE_WITHIN)
  pred = dict(plan.predicted)
  pred["search"] = {
    "seconds": time.perf_counter() - t0,
    "microbatch_sizes": sizes,
    "device_unit": unit,
  }
  return plan.replace(predicted=pred)


PIPEDREAM = ProblemPlanner("pipedream", PipeDreamOptions, pipedream_search)


# The keyword form (``PIPEDREAM(layer_graph, cluster, batch_size, **options)``) under its own name.
pipedream_plan = PIPEDREAM


def chain_tables(problem: PlanningProblem) -> dict:
  """The chain DP tables of a problem, shared by the planners that use them (keyed by
  micro-batch size, replication and device unit; ``chain_table``)."""
  return problem.memo.setdefault("chain_tables", {})


def chain_table(problem: PlanningProblem, b: int, replicate: bool, unit: int) -> ChainTable:
  """PipeDream's DP at micro-batch b over every layer in the order of the problem's costs,
  computed once per (b, replicate, unit) and kept in the problem's ``chain_tables``:
  everything else it depends on (the costs, cost model, cluster, memory and batch) is the
  problem's."""
  tables = chain_tables(problem)
  key = (b, replicate, unit)
  if key not in tables:
    cluster, cm, B, costs = problem.inputs()
    rc = RangeCosts(costs, cm, cluster, b, B, data_parallel_degrees(b, cluster.num_devices))
    tables[key] = ChainTable.compute(rc, replicate, unit)
  return tables[key]


SELECTIONS = ("simulated", "published")


def no_chain_error(problem: PlanningProblem) -> Exception:
  """PipeDream found no chain within memory (of at least ``min_stages`` stages, where the
  problem asks for more than one)."""
  if problem.min_stages > 1:
    return no_plan_with_stages_error(
      "pipedream", problem.min_stages, "none of that many stages fits device memory"
    )
  return no_plan_error("pipedream", problem.layer_graph, problem.cluster, problem.batch_size)


def published_chain(
  problem: PlanningProblem, sizes: list[int], *, replicate: bool = True, unit: int = 1
) -> Plan:
  """PipeDream as published: per micro-batch size the DP's smallest bottleneck (ties: fewer
  stages), across sizes the smallest (M + s - 1) * TPS * b; no simulation ranking, no polish.
  Stage counts below the problem's ``min_stages`` are not among the optima."""
  B = problem.batch_size
  best = None
  for b in sizes:
    table = chain_table(problem, b, replicate, unit)
    A = table.A
    first = max(1, problem.min_stages)
    vals = [(float(A[0, -1, s]), s) for s in range(first, A.shape[2]) if math.isfinite(A[0, -1, s])]
    if not vals:
      continue
    v, s = min(vals)
    est = (B // b + s - 1) * v * b
    if best is None or est < best[0]:
      best = (est, b, s, v, table)
  if best is None:
    raise no_chain_error(problem)
  _, b, s, v, table = best
  ranges = table.reconstruct(s)
  plan = assemble_plan(
    problem,
    [(problem.costs.layers[i:j], d) for i, j, d in ranges],
    microbatch=b,
    planner="pipedream",
    layout=StageLayout(sequential=True),
    info={"bottleneck_tps": v, "selection": "published"},
  )
  if not plan.predicted["memory_ok"]:
    raise no_plan_error("pipedream", problem.layer_graph, problem.cluster, B)
  return plan


@dataclasses.dataclass(frozen=True)
class ChainSearch:
  """Which of the chain DP's optima ``chain_candidates`` simulates, and the plans it makes of
  them.

  Attributes:
    planner: the name the plans record.
    sequential: the plans are chains (an ordering edge between consecutive stages); False
      keeps only the edges tensors flow along (a chain of stages is also a stage DAG, whose
      stages without a data edge between them may overlap).
    replicate: allow data-parallel stages (PipeDream's replication).
    simulate_top: how many (micro-batch, stage count) optima, ranked by the estimate
      (M + S - 1) * TPS * b, are simulated.
    sweep: at the two best micro-batch sizes, also simulate the best max(simulate_top, 8)
      stage counts, with and without replication.
    unit: the DP counts devices in slots of this many.
    keep_within: the sweep's plans whose pipeline lower bound is above this factor times the
      best simulated time are left out unsimulated (None: every one is simulated).
  """

  planner: str = "pipedream"
  sequential: bool = True
  replicate: bool = True
  simulate_top: int = 6
  sweep: bool = True
  unit: int = 1
  keep_within: float | None = None


def chain_candidates(
  problem: PlanningProblem, sizes: list[int], search: ChainSearch = ChainSearch()
) -> list[Plan]:
  """The simulated PipeDream DP optima within memory (see ``pipedream_plan``) at the
  micro-batch sizes ``sizes``, unpolished, searched as ``search`` says (``ChainSearch``).

  The DP's tables are the problem's (``chain_table``), so planners of the same problem share
  them, and so are the plans' simulations (``plan_assembly.predict``: with the problem's
  ``host``, the prediction for that machine). With ``search.keep_within``, the plans of the
  sweep whose pipeline lower bound is above that factor times the best simulated time are left
  out unsimulated: a polish that refines plans within that factor would not look at them (a
  one-stage plan, with ``host``, is always simulated: it runs as one jitted step, which the
  bound does not see). Only the optima of at least the problem's ``min_stages`` stages are
  plans.
  """
  cluster, cm, B, costs = problem.inputs()
  host = problem.host
  layout = StageLayout(sequential=search.sequential)

  def candidates(b: int, rep: bool):
    A = chain_table(problem, b, rep, search.unit).A
    M = B // b
    return [
      ((M + s - 1) * float(A[0, -1, s]) * b, b, s, rep)
      for s in range(max(1, problem.min_stages), A.shape[2])
      if math.isfinite(A[0, -1, s])
    ]

  evaluated: list[Plan] = []
  done = set()
  layer_times: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

  def bound(b: int, ranges: list[tuple[int, int, int]]) -> float:
    """``pipeline_lower_bound`` of the stages (no drain term, which holds for every schedule;
    a chain's fill only when the plan is sequential), less 1e-9 of it for the summing order."""
    stages = []
    for i, j, d in ranges:
      if (b, d) not in layer_times:
        layer_times[b, d] = cm.planner_layer_times(costs, cluster, b / d)
      stages.append(stage_bound_times(problem, layer_times[b, d], slice(i, j), d))
    n = len(ranges)
    preds = [[s - 1] if s and search.sequential else [] for s in range(n)]
    lb = pipeline_lower_bound(BoundTimes.of(stages), range(n), preds, B // b, drains=False)
    return lb * (1 - 1e-9)

  def evaluate(b: int, s: int, rep: bool, within: float | None = None):
    if (b, s, rep) in done:
      return
    done.add((b, s, rep))
    table = chain_table(problem, b, rep, search.unit)
    ranges = table.reconstruct(s)
    if within is not None and evaluated and (host is None or len(ranges) > 1):
      best = min(p.predicted["iteration_time"] for p in evaluated)
      if bound(b, ranges) > within * best:
        return
    stages = [(costs.layers[i:j], d) for i, j, d in ranges]
    plan = assemble_plan(
      problem,
      stages,
      microbatch=b,
      planner=search.planner,
      layout=layout,
      info={"bottleneck_tps": float(table.A[0, -1, s])},
    )
    if plan.predicted["memory_ok"]:
      evaluated.append(plan)

  found = sorted(c for b in sizes for c in candidates(b, search.replicate))
  for _, b, s, rep in found[: search.simulate_top]:
    evaluate(b, s, rep)
  # At the two best micro-batch sizes, simulate every stage count, with and without
  # replication: the bottleneck estimate cannot see when the all-reduce or the fill matters.
  top_sizes: list[int] = []
  for plan in sorted(evaluated, key=lambda p: p.predicted["iteration_time"]):
    mb = plan.stages[0].microbatch_size
    assert mb is not None  # assemble_plan sets every stage's micro-batch size
    if mb not in top_sizes:
      top_sizes.append(mb)
  for b in top_sizes[: 2 if search.sweep else 0]:
    for rep in {search.replicate, False}:
      for _, _, s, r in sorted(candidates(b, rep))[: max(search.simulate_top, 8)]:
        evaluate(b, s, r, search.keep_within)
  return evaluated
