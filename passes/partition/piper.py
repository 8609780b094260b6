"""Piper planner: LayerGraph + Cluster -> a sequential Plan of contiguous stages.

Piper (Tarnawski, Narayanan, Phanishayee; NeurIPS'21; reference code msr-fiddle/piper,
``algo.cpp``) runs a dynamic program over *downsets* of the layer DAG (successor-closed layer
sets, what its code calls ideals). A stage is the difference ``I \\ I'`` of two downsets
``I' ⊂ I``, which is always convex; the DP peels one stage at a time off the front, so the
stages it returns are totally ordered: a sequential pipeline whose stages may mix layers of
different branches.

  dp[∅][k][0] = 0
  dp[I][k][s] = min over downsets I' ⊊ I and d | b, d <= k, with
                memory(I \\ I', d, min(s, M)) <= capacity, of
                max(TPS(I \\ I', d), dp[I'][k - d][s - 1])

``s`` counts the stages of I; a stage that is s-th from the end holds min(s, M) micro-batches
in synchronous 1F1B (Piper's own code uses the PipeDream-2BW count ceil(s/d); this repository
runs PipeDream-Flush, so it uses the flush count). There is no tensor parallelism here, so
Piper's TMPC choice is the single "data parallel" configuration. TPS is the shared cost model.

Selection (``selection=``):
  * ``"published"``: Piper's own objective, no simulation and no polish. At each micro-batch
    size (powers of two; Piper takes the micro-batch size as an input) the DP's smallest
    bottleneck TPS (ties: fewer stages); across sizes, which neither paper searches, the one
    whose synchronous 1F1B time (M + s - 1) * TPS * b is smallest (analytic, not simulated).
    This is the Piper GraphPipe compares against.
  * ``"simulated"`` (default): at every size and stage count the DP optimum; those with the
    best estimates (M + s - 1) * TPS * b are simulated, the fastest wins and gets
    ``refine.polish``, as the other planners here.

The pair loop. The number of downsets grows as l^b for b branches of l layers, and the DP
visits every pair (I', I). Downsets are bitmasks (uint64 for up to 64 layers), so a downset's
sub-downsets are found with one vectorised subset test; the bytes crossing each pair's stage
boundary are computed once and shared by all micro-batch sizes. A pair whose stage TPS is
above an upper bound U of the answer cannot be part of any optimum at or below U, so it is
dropped before the DP (exact: every DP value <= U is unchanged). U is PipeDream's smallest
bottleneck at the same micro-batch size (its stages, ranges of a topological order, are
downset differences priced the same way, so Piper's optimum is at most U); the simulated
selection keeps pairs up to ``SIMULATED_BOUND`` * U (a heuristic cut: its candidates with a
bottleneck 1.5x the best are not simulated).

``min_stages`` (the planning problem's): the DP's optima are per stage count s, so the search
keeps to s >= min_stages (the bound U to PipeDream's optima of that many stages, and the
polish to moves that keep them): Piper's best plan of at least that many stages.

``max_downsets`` defaults to the authors' ``IDEALS_LIMIT = 40000``: beyond it the planner
raises PlanError, which is how Piper fails on DLRM and CANDLE-Uno in the GraphPipe paper.
"""

from __future__ import annotations

import dataclasses
import math
import time

import networkx as nx
import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import LayerCosts
from gpp_jax.errors import PlanError
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.pipedream import chain_table
from gpp_jax.passes.partition.plan_assembly import (
  StageLayout,
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
from gpp_jax.passes.partition.refine import polish

# The Piper authors' limit on the number of downsets (``IDEALS_LIMIT`` in ``algo.cpp``).
IDEALS_LIMIT = 40_000
SELECTIONS = ("simulated", "published")
# The simulated selection keeps pairs whose stage TPS is within this factor of the size's
# smallest bottleneck (PipeDream's, an upper bound of Piper's): its candidates are simulated,
# and a plan whose bottleneck is 1.5x the best is not among the fastest.
SIMULATED_BOUND = 1.5


def downsets(layer_graph: nx.DiGraph, order: list[str], limit: int) -> list[int]:
  """All successor-closed layer sets as bitmasks over ``order``, smallest first.

  Raises PlanError when there are more than ``limit``.
  """
  pos = {l: i for i, l in enumerate(order)}
  succ = [0] * len(order)
  for u, v in layer_graph.edges:
    succ[pos[u]] |= 1 << pos[v]
  seen = {0}
  frontier = [0]
  while frontier:
    nxt = []
    for I in frontier:
      for v in range(len(order)):
        bit = 1 << v
        if not I & bit and succ[v] & ~I == 0:
          J = I | bit
          if J not in seen:
            seen.add(J)
            nxt.append(J)
            if len(seen) > limit:
              raise PlanError(
                f"piper: {layer_graph.graph.get('name', 'the graph')} has more than {limit} "
                f"downsets (successor-closed layer sets) over {len(order)} layers; Piper's "
                "DP is quadratic in their number, which explodes with the number of parallel "
                "branches (the Piper authors' limit is 40000, and the GraphPipe paper reports "
                "Piper finding no strategy for DLRM and CANDLE-Uno for this reason). Use the "
                "graphpipe or pipedream planner, coarsen the layers, or raise max_downsets."
              )
    frontier = nxt
  return sorted(seen, key=lambda m: (bin(m).count("1"), m))


class DownsetPairs:
  """Every pair (I', I) of downsets with I' ⊊ I, grouped by I, with what pricing the stage
  ``I \\ I'`` needs that does not depend on the micro-batch size.

  Attributes:
    sets: downset bitmasks, smallest first; member: (D, n) bool.
    start: (D+1,) pairs of downset a are ``sub[start[a]:start[a+1]]``.
    sub: (P,) the sub-downset of each pair; owner: (P,) its downset.
    cut: (P,) bytes per sample crossing the stage's boundary.
  """

  def __init__(self, layer_graph: nx.DiGraph, costs: LayerCosts, limit: int, max_pairs: int):
    order = list(costs.layers)
    n = len(order)
    self.sets = downsets(layer_graph, order, limit)
    D = len(self.sets)
    self.member = np.array([[(m >> i) & 1 for i in range(n)] for m in self.sets], dtype=bool)
    size = self.member.sum(axis=1)
    first_of_size = np.searchsorted(size, size, side="left")  # sets are sorted by size
    subs = []
    total = 0
    if n <= 64:
      masks = np.array(self.sets, dtype=np.uint64)
      for a in range(D):
        cand = masks[: first_of_size[a]]
        idx = np.nonzero((cand & ~masks[a]) == 0)[0]
        subs.append(idx.astype(np.int32))
        total += len(idx)
        self._check(total, max_pairs, D, n, layer_graph)
    else:
      for a in range(D):
        cand = self.member[: first_of_size[a]]
        idx = np.nonzero(~(cand & ~self.member[a]).any(axis=1))[0]
        subs.append(idx.astype(np.int32))
        total += len(idx)
        self._check(total, max_pairs, D, n, layer_graph)
    counts = np.array([len(s) for s in subs], dtype=np.int64)
    self.start = np.concatenate([[0], np.cumsum(counts)])
    self.sub = np.concatenate(subs) if total else np.zeros(0, np.int32)
    self.owner = np.repeat(np.arange(D, dtype=np.int32), counts)
    self.num_pairs = total
    # Bytes entering each downset (edges only enter a successor-closed set), and per pair the
    # bytes of edges from outside I into I' (counted in both, not crossing the stage).
    eu = np.array([u for u, _, _ in costs.edges], dtype=int)
    ev = np.array([v for _, v, _ in costs.edges], dtype=int)
    eb = np.array([b for _, _, b in costs.edges], dtype=float)
    self.cut = np.zeros(total)
    if len(eb):
      cin = (self.member[:, ev] & ~self.member[:, eu]).astype(float) @ eb
      into_v = self.member[:, ev].astype(np.float64)  # (D, E)
      out_u = (~self.member[:, eu]) * eb[None, :]  # (D, E)
      for a in range(D):
        lo, hi = self.start[a], self.start[a + 1]
        if hi > lo:
          sub = self.sub[lo:hi]
          into = into_v[sub] @ out_u[a]
          self.cut[lo:hi] = np.maximum(cin[a] + cin[sub] - 2 * into, 0.0)
    self.params = self.member.astype(float) @ costs.held_param_bytes
    self.saved = self.member.astype(float) @ costs.saved_ps

  @staticmethod
  def _check(total: int, max_pairs: int, D: int, n: int, layer_graph: nx.DiGraph) -> None:
    if total > max_pairs:
      raise PlanError(
        f"piper: {layer_graph.graph.get('name', 'the graph')} has more than {max_pairs} "
        f"downset pairs ({D} downsets over {n} layers); the DP visits every pair, which "
        "explodes with the number of parallel branches. Use the graphpipe or pipedream "
        "planner, coarsen the layers, or raise max_pairs."
      )

  def subsets_of(self, a: int) -> np.ndarray:
    return self.sub[self.start[a] : self.start[a + 1]]


def _allreduce(cluster: Cluster, nbytes, d: int):
  if d <= 1:
    return np.zeros_like(nbytes)
  c = cluster
  link = c.intra_link if (c.devices_per_node is None or d <= c.devices_per_node) else c.inter_link
  assert link is not None  # a cluster with devices_per_node has an inter_link
  return 2 * (d - 1) * link.alpha + 2 * (d - 1) / d * nbytes / link.beta


class _Pricing:
  """Stage TPS and memory of downset pairs for one micro-batch size b of the problem, a stage
  on any of ``dps`` devices (the divisors of b, ``data_parallel_degrees``); vectorised, and
  shared by the DP and the reconstruction, so they agree to the last bit."""

  def __init__(self, problem: PlanningProblem, pairs: DownsetPairs, b: int):
    cluster, cm, B, costs = problem.inputs()
    self.pairs, self.costs, self.cm, self.cluster, self.b, self.B = pairs, costs, cm, cluster, b, B
    self.K, self.M = cluster.num_devices, B // b
    self.dps = data_parallel_degrees(b, self.K)
    link = cluster.slowest_link()
    self.alpha, self.beta = link.alpha, link.beta
    self.T = {}
    for d in self.dps:
      tf, tb = cm.planner_layer_times(costs, cluster, b / d)
      self.T[d] = pairs.member.astype(float) @ (tf + tb)

  def tps(self, a: np.ndarray, i: np.ndarray, cut: np.ndarray, d: int) -> np.ndarray:
    p = self.pairs
    comm = np.where(cut > 1e-12, 2 * self.alpha + cut * self.b / self.beta, 0.0)
    compute = self.T[d][a] - self.T[d][i]
    both = compute + comm if self.cm.tps_formula == "sum" else np.maximum(compute, comm)
    p_s = p.params[a] - p.params[i]
    upd = _allreduce(self.cluster, p_s, d) + (
      self.cm.update_traffic * p_s / self.cluster.device.memory_bandwidth
    )
    return both / self.b + upd / self.B

  def memory(self, a: np.ndarray, i: np.ndarray, d: int, in_flight: np.ndarray) -> np.ndarray:
    """(len(a), len(in_flight)) bytes per device."""
    p = self.pairs
    p_s = p.params[a] - p.params[i]
    sv_s = p.saved[a] - p.saved[i]
    return self.cm.static_memory(p_s)[:, None] + sv_s[:, None] * self.b / d * in_flight[None, :]


def _piper_dp(pr: _Pricing, S: int, U: float) -> np.ndarray:
  """The DP table dp[a, k, s] of the pairs ``pr`` prices, on up to all devices and with at
  most ``S`` stages, over pairs whose stage TPS is <= U (inf where no value <= U)."""
  pairs, dps, K, M = pr.pairs, pr.dps, pr.K, pr.M
  D = len(pairs.sets)
  cap = pr.cluster.memory_per_device
  s_in = np.minimum(np.arange(1, S + 1), M)
  # Pairs whose stage fits under U, per d, grouped by their downset; whether any of them can
  # exceed memory (else the memory test is skipped).
  kept = {}
  for d in dps:
    if d > K:
      break
    t = pr.tps(pairs.owner, pairs.sub, pairs.cut, d)
    sel = np.nonzero(t <= U)[0]
    worst = pr.memory(pairs.owner[sel], pairs.sub[sel], d, np.array([float(M)]))
    check = bool(len(sel)) and bool((worst > cap).any())
    kept[d] = (sel, t[sel], np.searchsorted(pairs.owner[sel], np.arange(D + 1)), check)
  dp = np.full((D, K + 1, S + 1), math.inf)
  dp[0, :, 0] = 0.0
  for a in range(1, D):
    row = dp[a]
    touched = False
    for d, (sel, t, st, check) in kept.items():
      lo, hi = st[a], st[a + 1]
      if hi == lo:
        continue
      idx = pairs.sub[sel[lo:hi]]
      alive = np.nonzero(np.isfinite(dp[idx, K - d, :S]).any(axis=1))[0]
      if not len(alive):
        continue
      idx, tt = idx[alive], t[lo:hi][alive]
      sub = dp[idx, : K + 1 - d, :S]  # (nv, K+1-d, S): dp[I'][k-d][s-1]
      val = np.maximum(tt[:, None, None], sub)
      if check:
        ok = pr.memory(np.full(len(idx), a), idx, d, s_in) <= cap  # (nv, S)
        val = np.where(ok[:, None, :], val, math.inf)
      np.minimum(row[d:, 1:], val.min(axis=0), out=row[d:, 1:])
      touched = True
    if touched:
      np.minimum.accumulate(row, axis=0, out=row)
  return dp


def _reconstruct(
  pr: _Pricing, dp: np.ndarray, s: int, target: float
) -> list[tuple[list[str], int]]:
  """Stages (front to back) of the optimum dp[full, K, s] = target of ``_piper_dp(pr, ...)``."""
  pairs, dps, K, M = pr.pairs, pr.dps, pr.K, pr.M
  order = list(pr.costs.layers)
  cap = pr.cluster.memory_per_device
  a = len(pairs.sets) - 1
  k = K
  out = []
  while s > 0:
    while k > 0 and dp[a, k - 1, s] <= target:
      k -= 1
    step = None
    lo = pairs.start[a]
    for d in dps:
      if d > k:
        break
      idx = pairs.subsets_of(a)
      cut = pairs.cut[lo : lo + len(idx)]
      t = pr.tps(np.full(len(idx), a), idx, cut, d)
      mem = pr.memory(np.full(len(idx), a), idx, d, np.array([min(s, M)]))[:, 0]
      ok = (dp[idx, k - d, s - 1] <= target) & (t <= target * (1 + 1e-9)) & (mem <= cap)
      hit = np.nonzero(ok)[0]
      if len(hit):
        step = (int(idx[hit[0]]), d)
        break
    if step is None:
      raise AssertionError("Piper reconstruction lost the optimum")
    i, d = step
    layers = [order[x] for x in range(len(order)) if pairs.member[a, x] and not pairs.member[i, x]]
    out.append((layers, d))
    a, k, s = i, k - d, s - 1
    target = dp[a, k, s] if s > 0 else 0.0
  return out


@dataclasses.dataclass(frozen=True)
class PiperOptions:
  """Piper's options (the problem itself is a ``PlanningProblem``).

  Attributes:
    selection: "published" (Piper's objective alone: smallest bottleneck TPS per micro-batch
      size, no simulation ranking, no polish) or "simulated" (the best estimates simulated,
      then polished); see the module docstring.
    max_downsets, max_pairs: state limits; PlanError beyond them (``max_downsets`` is the
      authors' ``IDEALS_LIMIT``).
    simulate_top: how many (micro-batch, stage count) optima are simulated.
  """

  selection: str = "simulated"
  max_downsets: int = IDEALS_LIMIT
  max_pairs: int = 50_000_000
  simulate_top: int = 6


def chain_bounds(problem: PlanningProblem, sizes: list[int]) -> dict[int, np.ndarray]:
  """Per micro-batch size, PipeDream's DP optimum for each stage count of at least the
  problem's ``min_stages`` over a topological order: its stages are downset differences
  priced the same way, so Piper's optimum of that many stages at that size is at most the
  smallest (PipeDream's tables, ``pipedream.chain_table``, shared through the problem)."""
  K = problem.num_devices
  return {b: chain_table(problem, b, True, 1).A[0, K, max(1, problem.min_stages) :] for b in sizes}


def dp_optima(
  problem: PlanningProblem,
  opts: PiperOptions,
  pairs: DownsetPairs,
  sizes: list[int],
  bounds: dict[int, np.ndarray] | None,
) -> list:
  """The DP optima (estimate, b, s, bottleneck, dp, pricing) worth simulating, best
  estimate first: at each micro-batch size one per stage count (published: the smallest
  bottleneck only), over the pairs whose stage TPS is within the size's bound (``bounds``
  None: no bound)."""
  cluster, _cm, B, costs = problem.inputs()
  K = cluster.num_devices
  S = min(K, len(costs.layers))
  full = len(pairs.sets) - 1
  published = opts.selection == "published"
  keep = 1 if published else opts.simulate_top
  out: list = []
  for b in sizes:
    M = B // b
    U = float(np.min(bounds[b], initial=math.inf)) if bounds is not None else math.inf
    if not published:
      U *= SIMULATED_BOUND
    pr = _Pricing(problem, pairs, b)
    dp = _piper_dp(pr, S, U * (1 + 1e-9))
    vals = [(float(dp[full, K, s]), s) for s in range(max(1, problem.min_stages), S + 1)]
    vals = [(v, s) for v, s in vals if math.isfinite(v)]
    if published and vals:
      vals = [min(vals)]  # the objective: smallest bottleneck (ties: fewer stages)
    out += [((M + s - 1) * v * b, b, s, v, dp, pr) for v, s in vals]
    # Keep only the candidates that can still be chosen (each holds its size's DP table).
    out.sort(key=lambda c: c[:3])
    del out[keep:]
  return out


def piper_search(problem: PlanningProblem, opts: PiperOptions) -> Plan:
  """Piper: PlanningProblem -> sequential Plan over downset differences (see the module
  docstring)."""
  if opts.selection not in SELECTIONS:
    raise ValueError(f"piper: selection must be one of {SELECTIONS}, got {opts.selection!r}")
  t0 = time.perf_counter()
  layer_graph, costs = problem.layer_graph, problem.costs
  pairs = DownsetPairs(layer_graph, costs, opts.max_downsets, opts.max_pairs)
  sizes = problem.microbatch_sizes()
  bounds = chain_bounds(problem, sizes)
  t_prep = time.perf_counter() - t0
  found = dp_optima(problem, opts, pairs, sizes, bounds)
  if not found:  # a bound below every Piper plan (it cannot be, but stay exact)
    found = dp_optima(problem, opts, pairs, sizes, None)
  plans = []
  best = None
  for _est, b, s, v, dp, pr in found:
    plan = assemble_plan(
      problem,
      _reconstruct(pr, dp, s, v),
      microbatch=b,
      planner="piper",
      layout=StageLayout(sequential=True),
      info={"bottleneck_tps": v, "downsets": len(pairs.sets), "selection": opts.selection},
    )
    best = better(best, plan)
    plans.append(plan)
  if best is None or not best.predicted.get("memory_ok", True):
    if problem.min_stages > 1:
      raise no_plan_with_stages_error(
        "piper", problem.min_stages, "none of that many stages fits device memory"
      )
    raise no_plan_error("piper", layer_graph, problem.cluster, problem.batch_size)
  if opts.selection != "published":
    best = polish(problem, plans)
  pred = dict(best.predicted)
  pred["search"] = {
    "seconds": time.perf_counter() - t0,
    "pairs_seconds": t_prep,
    "downsets": len(pairs.sets),
    "pairs": pairs.num_pairs,
  }
  return best.replace(predicted=pred)


PIPER = ProblemPlanner("piper", PiperOptions, piper_search)


# The keyword form (``PIPER(layer_graph, cluster, batch_size, **options)``) under its own name.
piper_plan = PIPER
