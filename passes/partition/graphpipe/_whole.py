"""GraphPipe planner: LayerGraph + Cluster -> Plan whose stages form a DAG.

The search follows GraphPipe (Jeon et al., ASPLOS'25), Alg. 1 and 2:

1. Series-parallel decomposition of the layer graph (``passes/series_parallel.py``).
2. For a target time per sample ``t`` (TPS), a dynamic program over
   (SP sub-problem, devices, downstream depth) decides whether every stage can have
   TPS <= t within device memory, and among the feasible strategies returns the one whose
   entry stages hold the fewest in-flight micro-batches (the paper's "minimal source in-flight"
   value, which is what upstream memory depends on). Sub-problems are:
     * a single stage: the whole sub-problem, or a contiguous run of children of one series or
       parallel node, data parallel over d devices (d divides the micro-batch);
     * a series split: the downstream part is solved first (in-flight counts go sink to
       source), then the upstream part with the downstream entry depth as its context;
     * a parallel split: branches solved independently with the same context, devices split
       between them; the entry depth is the max over branches.
   Results are memoised on (sub-problem signature, devices, context), so identical branches
   (the seven CANDLE-Uno towers) are solved once.
3. A binary search on ``t`` finds the smallest feasible TPS.
4. The micro-batch size is uniform across stages and swept over powers of two dividing the
   batch (the paper's default configuration: same micro-batch everywhere, synchronous 1F1B).

Extensions beyond the paper's recurrence (each keeps stages convex and the stage graph a DAG):
  * head and tail merges: in a series node, a stage may hold some branches of a parallel child
    together with the series children right before it (the fork; the other branches are fed
    by the stage) or right after it (the join; the other branches feed the stage); without
    them the fork and the join always cost a stage of their own;
  * serialised runs: the children [i, n) of a series or parallel node may be solved as one
    sequential pipeline over their layers in SP order (a topological order), i.e. the DP may
    apply the SP-ization rule by choice and add ordering edges between branches. Stages can
    then cut across branch boundaries to balance work; at the root this is a PipeDream-style
    chain over the SP order (which may order branches differently from PipeDream's
    topological order);
  * depth frontier: besides t*, for each depth below the depth reached at t*, the smallest TPS
    reaching that depth (searched only where the estimate (M + depth - 1) * TPS * b can still
    win); the best candidates per micro-batch size are simulated with the plan's schedule and
    the fastest plan within memory wins; a micro-batch size whose bound B * TPS is 25% above
    the best simulated time is skipped;
  * balanced tie-break: DP values order (entry depth, largest stage TPS) lexicographically,
    so among strategies of the paper's minimal depth the more balanced one wins;
  * two branch orders: a parallel node's children are tried lightest first (equal branches
    adjacent; merges take the light ones) and in topological order;
  * a no-replication variant: the TPS objective spreads a stage's gradient all-reduce over
    the iteration although it runs after the stage's last backward, which favours data
    parallelism; at the two best micro-batch sizes the search is repeated with one device
    per stage (then polished), so deeper all-pipeline plans compete in the simulator too.

  * chain seeds: the chain DP's optima over the topological order (PipeDream's DP, as stage
    DAGs without ordering edges) join the simulated candidates, since a chain of stages is a
    stage DAG too;
  * polish: the best plan of each of the best micro-batch sizes is improved by local search
    on the simulated time (``refine.polish``: device counts, layer moves, splits, merges);
    the sequential planners get the same polish, restricted to chains.

Choices the paper leaves open, made here (see BUILD_NOTES.md):
  * TPS of a stage = combine(compute, transfers) / b + (all-reduce + optimizer) / B, with
    ``CostModel.tps_formula`` "sum" by default; transfers priced on the slowest link of the
    cluster (placement is decided after the search);
  * in-flight count of a stage = min(L(s), M), L = longest path to a sink in stages;
  * device counts per stage: any divisor of the micro-batch (``powers_of_two=True``
    restricts them to powers of two); the DP may leave devices idle once the bottleneck cannot
    improve, so afterwards the polish (a local search against the simulator, which
    PipeDream and Piper get too) hands them to the stages that gain most; devices no stage
    can use stay idle and are listed in ``predicted["idle_devices"]``;
  * stages get contiguous device ranges, kept inside a node where they fit
    (``plan_assembly.place_stages``).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

import networkx as nx
import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel, LayerCosts
from gpp_jax.passes.partition.range_costs import RangeCosts
from gpp_jax.passes.partition.plan_assembly import (MAX_MICROBATCHES, assemble_plan, better,
                                                    data_parallel_degrees, microbatch_sizes,
                                                    no_plan_error, planner_inputs)
from gpp_jax.passes.partition.pipedream import chain_candidates
from gpp_jax.passes.partition.refine import polish
from gpp_jax.passes.series_parallel import SPNode, sp_decompose
from gpp_jax.ir.plan import Plan

INF = 1 << 30


# DP values encode (depth, bottleneck) lexicographically as one float: the integer part is the
# entry depth (stages from the entry to the sink), the fraction is 0.5 * (largest TPS of the
# sub-problem's stages) / target, so among strategies of equal depth the more balanced wins.
def _ser(rest: float, frac: float) -> float:
  """Value of a stage with TPS fraction ``frac`` in front of a sub-problem worth ``rest``."""
  if rest >= INF:
    return INF
  d = int(rest)
  return d + 1 + max(rest - d, frac)


def _par(a: float, b: float) -> float:
  """Value of two sub-problems side by side (same context)."""
  if a >= INF or b >= INF:
    return INF
  da, db = int(a), int(b)
  return max(da, db) + max(a - da, b - db)


def _attach(e: float, rest: float) -> float:
  """Value of a sub-problem solved in the context int(rest), followed by ``rest``."""
  if e >= INF or rest >= INF:
    return INF
  d = int(e)
  return d + max(e - d, rest - int(rest))


class _Node:
  """An SP tree node with the aggregates the DP needs (layer positions, not names)."""
  __slots__ = ("kind", "children", "layers", "sig", "n", "params", "saved", "incident",
               "internal", "cross", "child_layers", "to_siblings", "twin")

  def __init__(self, sp: SPNode, costs: LayerCosts, incident: np.ndarray,
               interner: dict, edge_map: dict, children: list | None = None):
    self.kind = sp.kind
    self.twin = None
    if children is not None:
      self.children = children
    else:
      self.children = [_Node(c, costs, incident, interner, edge_map) for c in sp.children]
      if self.kind == "parallel":
        # Branch order matters: runs of adjacent branches can share a stage and merges take a
        # prefix. The DP tries two orders: lightest first (equal branches stay adjacent,
        # light branches merge with a fork or join) and the topological order (the twin).
        topo = list(self.children)
        work = lambda c: float(costs.flops_ps[c.layers].sum() + costs.act_bytes_ps[c.layers].sum())
        self.children.sort(key=lambda c: (work(c), c.layers[0]))
        if [id(c) for c in topo] != [id(c) for c in self.children]:
          self.twin = _Node(sp, costs, incident, interner, edge_map, children=topo)
    self.layers = [l for c in self.children for l in c.layers] if self.children else \
        [costs.index[l] for l in sp.layers]
    if self.kind == "leaf":
      i = self.layers[0]
      self.n = 1
      self.child_layers = [self.layers]
      sig = ("L", float(costs.flops_ps[i]), float(costs.act_bytes_ps[i]),
             float(costs.param_bytes[i]), float(costs.saved_ps[i]),
             _nan0(costs.time_f_ps[i]), _nan0(costs.time_b_ps[i]), float(incident[i]))
      self.params = np.array([0.0, costs.param_bytes[i]])
      self.saved = np.array([0.0, costs.saved_ps[i]])
      self.incident = np.array([0.0, incident[i]])
      self.internal = np.array([0.0, 0.0])
      self.cross = None
      self.to_siblings = {}
    else:
      kids = self.children
      self.n = len(kids)
      self.child_layers = [k.layers for k in kids]
      self.params = np.concatenate([[0.0], np.cumsum([k.total("params") for k in kids])])
      self.saved = np.concatenate([[0.0], np.cumsum([k.total("saved") for k in kids])])
      self.incident = np.concatenate([[0.0], np.cumsum([k.total("incident") for k in kids])])
      self.internal = np.concatenate([[0.0], np.cumsum([k.total("internal") for k in kids])])
      n = self.n
      cross = np.zeros((n + 1, n + 1))
      cross_sig = ()
      if self.kind == "series":
        owner = {}
        for j, k in enumerate(kids):
          for l in k.layers:
            owner[l] = j
        E = np.zeros((n, n))
        for l in self.layers:
          for v, b in edge_map.get(l, ()):
            if v in owner and owner[v] != owner[l]:
              E[owner[l], owner[v]] += b
        for i in range(n):
          for p in range(i + 2, n + 1):
            cross[i, p] = cross[i, p - 1] + E[i:p - 1, p - 1].sum()
        cross_sig = tuple(np.round(E[np.nonzero(E)], 6)) + tuple(map(tuple, np.argwhere(E)))
        # For a parallel child i: bytes between each of its branches and each series child
        # (either direction).
        self.to_siblings = {}
        for i, k in enumerate(kids):
          if k.kind != "parallel":
            continue
          G = np.zeros((k.n, n))
          for br, ls in enumerate(k.child_layers):
            for l in ls:
              for v, b in edge_map.get(l, []) + edge_map.get(("in", l), []):
                if v in owner and owner[v] != i:
                  G[br, owner[v]] += b
          self.to_siblings[i] = np.cumsum(np.vstack([np.zeros((1, n)), G]), axis=0)
          cross_sig += (i, tuple(np.round(G[np.nonzero(G)], 6)), tuple(map(tuple, np.argwhere(G))))
      else:
        self.to_siblings = {}
      self.cross = cross
      sig = (self.kind[0].upper(), tuple(k.sig for k in kids), cross_sig)
    self.sig = interner.setdefault(sig, len(interner))

  def total(self, what: str) -> float:
    arr = getattr(self, what)
    if what == "internal" and self.cross is not None:
      return float(arr[-1] + self.cross[0, self.n])
    return float(arr[-1])

  def block_layers(self, i: int, p: int) -> list[int]:
    return [l for j in range(i, p) for l in self.child_layers[j]]


def _nan0(x: float) -> float:
  return 0.0 if math.isnan(x) else float(x)


@dataclasses.dataclass
class _Context:
  """Everything fixed for one micro-batch size: device choices and per-layer times."""
  b: int
  B: int
  M: int
  K: int
  dps: list[int]
  tsum: dict[int, np.ndarray]       # d -> per-layer (t_f + t_b) at b/d samples per device
  mem_cap: float
  p2p_alpha: float
  p2p_beta: float
  cm: CostModel
  cluster: Cluster
  costs: LayerCosts
  block_cache: dict = dataclasses.field(default_factory=dict)
  n_dps: list = dataclasses.field(default_factory=list)    # k -> how many dps are <= k
  node_time: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.n_dps = [sum(1 for d in self.dps if d <= k) for k in range(self.K + 1)]

  def upd(self, params: float, d: int) -> float:
    c = self.cluster
    link = c.intra_link if (c.devices_per_node is None or d <= c.devices_per_node) else c.inter_link
    return self.cm.update_time(params, c.device, d, link)

  def child_times(self, node: _Node, d: int) -> np.ndarray:
    key = (node.sig, d)
    pt = self.node_time.get(key)
    if pt is None:
      t = self.tsum[d]
      pt = np.concatenate([[0.0], np.cumsum([t[ls].sum() for ls in node.child_layers])])
      self.node_time[key] = pt
    return pt

  def block(self, node: _Node, i: int, p: int):
    """(TPS per d in dps, TPS without transfers per d, params, saved bytes per sample) of
    children [i, p) as one stage. The transfer-free TPS grows with p (a lower bound)."""
    key = (node.sig, i, p)
    hit = self.block_cache.get(key)
    if hit is not None:
      return hit
    params = float(node.params[p] - node.params[i])
    saved = float(node.saved[p] - node.saved[i])
    internal = float(node.internal[p] - node.internal[i])
    if node.cross is not None:
      internal += float(node.cross[i, p])
    cut = max(float(node.incident[p] - node.incident[i]) - 2 * internal, 0.0)
    comm = 0.0 if cut <= 1e-12 else 2 * self.p2p_alpha + cut * self.b / self.p2p_beta
    tps, bound = [], []
    for d in self.dps:
      pt = self.child_times(node, d)
      compute = float(pt[p] - pt[i])
      upd = self.upd(params, d) / self.B
      tps.append(self.cm.combine(compute, comm) / self.b + upd)
      bound.append(compute / self.b + upd)
    hit = (tps, list(np.minimum.accumulate(bound)), params, saved)
    self.block_cache[key] = hit
    return hit

  def merged(self, node: _Node, ip: int, a: int, lo: int, hi: int):
    """Like ``block`` for the stage made of branches [0, a) of the parallel child ``ip`` of
    series ``node`` together with the series children [lo, hi) right after it
    (lo = ip + 1, a tail merge) or right before it (hi = ip, a head merge)."""
    key = ("merged", node.sig, ip, a, lo, hi)
    hit = self.block_cache.get(key)
    if hit is not None:
      return hit
    c = node.children[ip]
    params = float(c.params[a] + node.params[hi] - node.params[lo])
    saved = float(c.saved[a] + node.saved[hi] - node.saved[lo])
    G = node.to_siblings[ip]
    internal = float(c.internal[a] + node.internal[hi] - node.internal[lo]
                     + node.cross[lo, hi] + G[a, lo:hi].sum())
    incident = float(c.incident[a] + node.incident[hi] - node.incident[lo])
    cut = max(incident - 2 * internal, 0.0)
    comm = 0.0 if cut <= 1e-12 else 2 * self.p2p_alpha + cut * self.b / self.p2p_beta
    tps, bound = [], []
    for d in self.dps:
      compute = float(self.child_times(c, d)[a] + self.child_times(node, d)[hi]
                      - self.child_times(node, d)[lo])
      upd = self.upd(params, d) / self.B
      tps.append(self.cm.combine(compute, comm) / self.b + upd)
      bound.append(compute / self.b + upd)
    hit = (tps, list(np.minimum.accumulate(bound)), params, saved)
    self.block_cache[key] = hit
    return hit

  def linear(self, node: _Node) -> RangeCosts:
    """Range costs over ``node``'s layers in their SP order (a topological order)."""
    key = ("linear", node.sig)
    rc = self.block_cache.get(key)
    if rc is None:
      rc = RangeCosts(self.costs, self.cm, self.cluster, self.b, self.B, self.dps,
                      order=node.layers)
      self.block_cache[key] = rc
    return rc

  def linear_stacks(self, node: _Node):
    """(TPS per d stacked, static memory, saved bytes per sample, samples per device per d)
    over ``node``'s linear order, for the serialised option."""
    key = ("stacks", node.sig)
    hit = self.block_cache.get(key)
    if hit is None:
      rc = self.linear(node)
      hit = (np.stack([rc.tps(d) for d in self.dps]), self.cm.static_memory(rc.params),
             rc.saved, np.array([self.b / d for d in self.dps]))
      self.block_cache[key] = hit
    return hit

  def mem(self, params: float, saved: float, d: int, depth: int) -> float:
    return self.cm.stage_memory(params, saved, self.b, d, min(depth, self.M))


class _Search:
  """One DP run for a fixed micro-batch context and TPS target."""

  def __init__(self, ctx: _Context, t_max: float, serialise: bool = True):
    self.ctx = ctx
    self.t = t_max * (1 + 1e-12)
    self.memo_r: dict = {}
    self.memo_s: dict = {}
    self.memo_p: dict = {}
    self.memo_chain: dict = {}
    self.serialise = serialise

  def best_block(self, node: _Node, i: int, p: int, k: int, rest_fn, parallel: bool,
                 D: int):
    """Smallest feasible d for block [i, p): returns (entry, d) or (INF, None)."""
    ctx = self.ctx
    tps, _, params, saved = ctx.block(node, i, p)
    for j, d in enumerate(ctx.dps):
      if d > k:
        break
      if tps[j] > self.t:
        continue
      rest = rest_fn(k - d)
      if rest >= INF:
        return INF, None
      depth = D + 1 if parallel else int(rest) + 1
      if ctx.mem(params, saved, d, depth) > ctx.cluster.memory_per_device:
        continue
      frac = 0.5 * tps[j] / self.t
      return (_par(D + 1 + frac, rest) if parallel else _ser(rest, frac)), d
    return INF, None

  def block_too_slow(self, node: _Node, i: int, p: int, k: int) -> bool:
    """True when no d <= k brings the block's transfer-free TPS under the target."""
    j = self.ctx.n_dps[k]
    return j == 0 or self.ctx.block(node, i, p)[1][j - 1] > self.t

  def R(self, node: _Node, k: int, D: int) -> int:
    key = (node.sig, k, D)
    hit = self.memo_r.get(key)
    if hit is not None:
      return hit[0]
    if k <= 0:
      val = (INF, None)
    elif node.kind == "leaf":
      e, d = self.best_block(node, 0, 1, k, lambda _: D, False, D)
      val = (e, ("block", 1, d))
    elif node.kind == "series":
      val = (self.S(node, 0, k, D), None)
    else:
      val = (self.P(node, 0, k, D), None)
      if node.twin is not None:
        e = self.P(node.twin, 0, k, D)
        if e < val[0]:
          val = (e, ("twin",))
    self.memo_r[key] = val
    return val[0]

  def S(self, node: _Node, i: int, k: int, D: int) -> int:
    if i == node.n:
      return D
    if k <= 0:
      return INF
    key = (node.sig, i, k, D)
    hit = self.memo_s.get(key)
    if hit is not None:
      return hit[0]
    best, choice = INF, None
    for p in range(i + 1, node.n + 1):
      if self.block_too_slow(node, i, p, k):
        break
      e, d = self.best_block(node, i, p, k, lambda kk, p=p: self.S(node, p, kk, D), False, D)
      if e < best:
        best, choice = e, ("block", p, d)
    child = node.children[i]
    if child.kind != "leaf":
      for k1 in range(1, k + 1):
        rest = self.S(node, i + 1, k - k1, D)
        if rest >= INF:
          break
        e = _attach(self.R(child, k1, int(rest)), rest)
        if e < best:
          best, choice = e, ("child", k1)
    if child.kind == "parallel" and i + 1 < node.n:
      e, ch = self.tail_merge(node, i, k, D)
      if e < best:
        best, choice = e, ch
    e, ch = self.head_merge(node, i, k, D)
    if e < best:
      best, choice = e, ch
    if self.serialise and i + 1 < node.n and any(c.kind != "leaf" for c in node.children[i:]):
      e = self.serial(node, i, k, D)
      if e < best:
        best, choice = e, ("serial",)
    self.memo_s[key] = (best, choice)
    return best

  def head_merge(self, node: _Node, i: int, k: int, D: int):
    """Stages where the series children [i, p) share a stage T with branches [0, a) of the
    parallel child p right after them; the other branches [a, m) are fed by T and solved as a
    parallel sub-problem in the context of the series children after p."""
    ctx = self.ctx
    best, choice = INF, None
    for p in range(i + 1, node.n):
      if self.block_too_slow(node, i, p, k):
        break
      c = node.children[p]
      if c.kind != "parallel":
        continue
      for a in range(1, c.n):
        tps, bound, params, saved = ctx.merged(node, p, a, i, p)
        if ctx.n_dps[k] == 0 or bound[ctx.n_dps[k] - 1] > self.t:
          break
        for k3 in (range(0, k) if p + 1 < node.n else (0,)):
          rest = self.S(node, p + 1, k3, D)
          if rest >= INF:
            continue
          for j, d in enumerate(ctx.dps):
            if d > k - k3 - 1:
              break
            if tps[j] > self.t:
              continue
            e = self.P(c, a, k - k3 - d, int(rest))
            if e >= INF:
              break
            after = _par(e, rest)
            if ctx.mem(params, saved, d, int(after) + 1) > ctx.cluster.memory_per_device:
              continue
            v = _ser(after, 0.5 * tps[j] / self.t)
            if v < best:
              best, choice = v, ("head", p, a, k3, d)
            break
    return best, choice

  def tail_merge(self, node: _Node, i: int, k: int, D: int):
    """Stages where branches [0, a) of the parallel child i share a stage T with the series
    children [i+1, p) after it; the other branches [a, m) feed T and are solved as a parallel
    sub-problem whose context is T's depth."""
    ctx = self.ctx
    c = node.children[i]
    best, choice = INF, None
    for p in range(i + 2, node.n + 1):
      if self.block_too_slow(node, i + 1, p, k):
        break
      for a in range(1, c.n):
        tps, bound, params, saved = ctx.merged(node, i, a, i + 1, p)
        if ctx.n_dps[k] == 0 or bound[ctx.n_dps[k] - 1] > self.t:
          break
        for k3 in (range(0, k) if p < node.n else (0,)):
          rest = self.S(node, p, k3, D)
          if rest >= INF:
            continue
          DT = int(rest) + 1
          for j, d in enumerate(ctx.dps):
            if d > k - k3 - 1:
              break
            if tps[j] > self.t or ctx.mem(params, saved, d, DT) > ctx.cluster.memory_per_device:
              continue
            e = self.P(c, a, k - k3 - d, DT)
            v = _par(_ser(rest, 0.5 * tps[j] / self.t), e)
            if v < best:
              best, choice = v, ("tail", p, a, k3, d)
            break
    return best, choice

  def P(self, node: _Node, i: int, k: int, D: int) -> int:
    if i == node.n:
      return D
    if k <= 0:
      return INF
    key = (node.sig, i, k, D)
    hit = self.memo_p.get(key)
    if hit is not None:
      return hit[0]
    best, choice = INF, None
    for p in range(i + 1, node.n + 1):
      if self.block_too_slow(node, i, p, k):
        break
      e, d = self.best_block(node, i, p, k, lambda kk, p=p: self.P(node, p, kk, D), True, D)
      if e < best:
        best, choice = e, ("block", p, d)
    child = node.children[i]
    if child.kind != "leaf":
      for k1 in range(1, k + 1):
        rest = self.P(node, i + 1, k - k1, D)
        if rest >= INF:
          break
        e = _par(self.R(child, k1, D), rest)
        if e < best:
          best, choice = e, ("child", k1)
    if self.serialise and i + 1 < node.n:
      e = self.serial(node, i, k, D)
      if e < best:
        best, choice = e, ("serial",)
    self.memo_p[key] = (best, choice)
    return best

  def chain(self, node: _Node, D: int) -> np.ndarray:
    """Serialised option: ``f[j, k]`` = smallest entry depth of a sequential pipeline over
    ``node``'s layers j.. (SP order) on at most k devices, every stage within the TPS target
    and memory, in context depth D (INF if none)."""
    key = (node.sig, D)
    f = self.memo_chain.get(key)
    if f is not None:
      return f
    ctx = self.ctx
    rc = ctx.linear(node)
    L, K, M = rc.n, ctx.K, ctx.M
    cap = ctx.cluster.memory_per_device
    tps_all, static, saved, per_dev = ctx.linear_stacks(node)
    nd = len(ctx.dps)
    f = np.full((L + 1, K + 1), math.inf)
    f[L, :] = D
    for j in range(L - 1, -1, -1):
      tps = tps_all[:, j, j + 1:]                                   # (nd, L - j)
      fast = tps <= self.t
      if not fast.any():
        continue
      F3 = np.full((nd, L - j, K + 1), math.inf)
      for di, d in enumerate(ctx.dps):
        if d <= K:
          F3[di, :, d:] = f[j + 1:, :K + 1 - d]
      fin = np.isfinite(F3) & fast[:, :, None]
      G = np.where(fin, F3, 0.0)
      base = np.floor(G)
      depth = base + 1
      val = depth + np.maximum(G - base, 0.5 * tps[:, :, None] / self.t)
      mem = (static[j, j + 1:][None, :, None]
             + saved[j, j + 1:][None, :, None] * per_dev[:, None, None] * np.minimum(depth, M))
      ok = fin & (mem <= cap)
      f[j] = np.minimum.accumulate(np.where(ok, val, math.inf).min(axis=(0, 1)))
    self.memo_chain[key] = f
    return f

  def serial(self, node: _Node, i: int, k: int, D: int) -> int:
    """Entry depth of serialising children [i, n) of ``node`` into one sequential pipeline."""
    start = sum(len(ls) for ls in node.child_layers[:i])
    v = self.chain(node, D)[start, k]
    return INF if not math.isfinite(v) else float(v)

  def _chain_stages(self, node: _Node, i: int, k: int, D: int):
    ctx = self.ctx
    rc = ctx.linear(node)
    f = self.chain(node, D)
    j = sum(len(ls) for ls in node.child_layers[:i])
    out = []
    while j < rc.n:
      target = f[j, k]
      while k > 0 and f[j, k - 1] <= target:
        k -= 1
      step = None
      for d in ctx.dps:
        if d > k:
          break
        for j2 in range(j + 1, rc.n + 1):
          sub = f[j2, k - d]
          if not math.isfinite(sub):
            continue
          t2 = rc.tps(d)[j, j2]
          val = _ser(float(sub), 0.5 * t2 / self.t)
          if (val <= target * (1 + 1e-12) and t2 <= self.t and
              ctx.mem(float(rc.params[j, j2]), float(rc.saved[j, j2]), d, int(sub) + 1)
              <= ctx.cluster.memory_per_device):
            step = (j2, d)
            break
        if step:
          break
      if step is None:
        raise AssertionError("lost the serialised optimum")
      j2, d = step
      out.append(([node.layers[x] for x in range(j, j2)], d))
      j, k = j2, k - d
    return out

  # -- reconstruction -------------------------------------------------------------------
  def stages(self, node: _Node, k: int, D: int) -> list[tuple[list[int], int]]:
    if self.R(node, k, D) >= INF:
      raise AssertionError("reconstructing an infeasible sub-problem")
    if node.kind == "leaf":
      return [(node.layers, self.memo_r[(node.sig, k, D)][1][2])]
    if node.kind == "series":
      return self._series(node, 0, k, D)
    if self.memo_r[(node.sig, k, D)][1] == ("twin",):
      return self._parallel(node.twin, 0, k, D)
    return self._parallel(node, 0, k, D)

  def _series(self, node: _Node, i: int, k: int, D: int):
    if i == node.n:
      return []
    _, choice = self.memo_s[(node.sig, i, k, D)]
    if choice[0] == "block":
      _, p, d = choice
      return [(node.block_layers(i, p), d)] + self._series(node, p, k - d, D)
    if choice[0] == "serial":
      return self._chain_stages(node, i, k, D)
    if choice[0] == "head":
      _, p, a, k3, d = choice
      c = node.children[p]
      rest = int(self.S(node, p + 1, k3, D))
      stage = node.block_layers(i, p) + [l for ls in c.child_layers[:a] for l in ls]
      return ([(stage, d)] + self._parallel(c, a, k - k3 - d, rest)
              + self._series(node, p + 1, k3, D))
    if choice[0] == "tail":
      _, p, a, k3, d = choice
      c = node.children[i]
      DT = int(self.S(node, p, k3, D)) + 1
      stage = [l for ls in c.child_layers[:a] for l in ls] + node.block_layers(i + 1, p)
      return ([(stage, d)] + self._parallel(c, a, k - k3 - d, DT)
              + self._series(node, p, k3, D))
    k1 = choice[1]
    rest = int(self.S(node, i + 1, k - k1, D))
    return self.stages(node.children[i], k1, rest) + self._series(node, i + 1, k - k1, D)

  def _parallel(self, node: _Node, i: int, k: int, D: int):
    if i == node.n:
      return []
    _, choice = self.memo_p[(node.sig, i, k, D)]
    if choice[0] == "serial":
      return self._chain_stages(node, i, k, D)
    if choice[0] == "block":
      _, p, d = choice
      return [(node.block_layers(i, p), d)] + self._parallel(node, p, k - d, D)
    k1 = choice[1]
    return self.stages(node.children[i], k1, D) + self._parallel(node, i + 1, k - k1, D)


@dataclasses.dataclass(frozen=True)
class SearchStats:
  """What the search did (recorded in ``plan.predicted['search']``)."""
  seconds: float
  dp_runs: int
  microbatch_sizes: tuple[int, ...]
  candidates: int
  simulated: int
  best_tps: float

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class _Runner:
  """Runs the DP for one micro-batch context and counts the runs."""

  def __init__(self, ctx: _Context, root: _Node, eps: float):
    self.ctx, self.root, self.eps, self.runs = ctx, root, eps, 0

  def run(self, t: float) -> tuple[_Search, int]:
    """DP at target t: the search and the entry depth it reaches (INF if infeasible)."""
    self.runs += 1
    s = _Search(self.ctx, t)
    v = s.R(self.root, self.ctx.K, 0)
    return s, INF if v >= INF else int(v)

  def bisect(self, lo_t: float, hi_t: float, s_hi: _Search, target: int):
    """Smallest TPS in (lo_t, hi_t] (to ``eps``) whose DP reaches entry depth <= target."""
    while hi_t - lo_t > self.eps * hi_t:
      mid = (lo_t + hi_t) / 2
      s, v = self.run(mid)
      if v <= target:
        hi_t, s_hi = mid, s
      else:
        lo_t = mid
    return hi_t, s_hi

  def min_tps(self, lo: float):
    """The smallest feasible TPS t* and its search, or None when nothing fits."""
    hi = lo
    for _ in range(64):
      s_hi, v = self.run(hi)
      if v < INF:
        return self.bisect(hi / 2 if hi > lo else 0.0, hi, s_hi, INF - 1)
      hi *= 2
    return None

  def shallower(self, t_star: float, s_star: _Search) -> list[tuple[float, int, _Search]]:
    """Depth / TPS frontier above t*: for each depth d below the depth D* reached at t*, the
    smallest TPS whose DP reaches depth <= d, searched only up to the TPS at which depth d can
    still beat the best estimate (M + D - 1) * TPS so far."""
    M = self.ctx.M
    D = int(s_star.R(self.root, self.ctx.K, 0))
    out = []
    best_est = (M + D - 1) * t_star
    d = D - 1
    while d >= 1:
      bound = best_est / (M + d - 1)
      s, v = self.run(bound)
      if v > d:
        d -= 1
        continue
      t_d, s_d = self.bisect(t_star, bound, s, d)
      depth = int(s_d.R(self.root, self.ctx.K, 0))
      out.append((t_d, depth, s_d))
      best_est = min(best_est, (M + depth - 1) * t_d)
      d = min(d, depth) - 1
    return out


def graphpipe_plan(layer_graph: nx.DiGraph, cluster: Cluster | int | None = None,
                   batch_size: int | None = None, *, num_microbatches: int | None = None,
                   cost_model: CostModel | None = None, schedule: str = "1f1b",
                   powers_of_two: bool = False, max_microbatches: int | None = MAX_MICROBATCHES,
                   eps: float = 5e-3, simulate_top: int = 4, prune: float = 1.25,
                   replication_variant: bool = True,
                   refine_sizes: int = 4, refine_within: float = 1.1,
                   refine_evals: int = 200, chain_seeds: bool = True) -> Plan:
  """GraphPipe: LayerGraph + Cluster -> Plan with a stage DAG (see the module docstring).

  Args:
    layer_graph: the LayerGraph with costs.
    cluster: a Cluster, or a device count (a ``cpu_cluster``).
    batch_size: mini-batch size (default: the graph's batch size).
    num_microbatches: fix M (micro-batch = batch / M) instead of sweeping powers of two.
    cost_model: the CostModel (default: Adam fp32, "sum" TPS).
    schedule: the schedule generator the plan names ("1f1b", "graph-1f1b" or "gpipe").
    powers_of_two: restrict per-stage device counts to powers of two.
    max_microbatches: skip micro-batch sizes that would need more micro-batches than this.
    eps: relative precision of the binary searches on TPS.
    simulate_top: how many frontier plans per micro-batch size (best estimates first) are
      simulated.
    prune: skip a micro-batch size when B * t* exceeds ``prune`` times the best simulated
      iteration time so far (t* its smallest feasible TPS).
    replication_variant: at the two best micro-batch sizes, also search without data
      parallelism inside stages.
    refine_sizes: how many micro-batch sizes (best first) get their best plan polished by
      ``refine.refine_plan`` (layer moves, splits and merges against the simulator), among
      those whose best plan is within ``refine_within`` times the best simulated time.
    refine_evals: at most this many simulations for the polish, in all.
    chain_seeds: add the chain DP's plans (PipeDream's DP over the topological order, without
      ordering edges) to the candidates before polishing.
  """
  t0 = time.perf_counter()
  cluster, cm, B, costs = planner_inputs(layer_graph, cluster, batch_size, cost_model)
  sp = sp_decompose(layer_graph)
  incident = np.zeros(len(costs))
  edge_map: dict = {}          # u -> [(v, bytes)]; ("in", v) -> [(u, bytes)]
  for u, v, b in costs.edges:
    incident[u] += b
    incident[v] += b
    edge_map.setdefault(u, []).append((v, b))
    edge_map.setdefault(("in", v), []).append((u, b))
  interner: dict = {}
  old_limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(old_limit, 20000))
  try:
    root = _Node(sp.root, costs, incident, interner, edge_map)
    link = cluster.slowest_link()
    sizes = microbatch_sizes(B, num_microbatches, max_microbatches)
    # Phase 1: the smallest feasible TPS t* for every micro-batch size, largest size first;
    # the plan at t* is simulated at once, and a size whose perfect-balance bound alone is
    # clearly slower than the best simulated plan is skipped.
    per_size = []
    best: Plan | None = None
    evaluated: list[Plan] = []
    seen: set = set()
    n_cands = n_sims = 0

    def consider(b, t, depth, stages):
      nonlocal best, n_sims
      key = (b, tuple(sorted((tuple(sorted(ls)), d) for ls, d in stages)))
      if key in seen:
        return
      seen.add(key)
      n_sims += 1
      plan = assemble_plan(
          layer_graph, cluster, [([costs.layers[l] for l in ls], d) for ls, d in stages],
          microbatch=b, batch_size=B, planner="graphpipe", schedule=schedule,
          cost_model=cm, costs=costs, info={"tps_target": float(t), "dp_entry_depth": depth})
      best = better(best, plan)
      if plan.predicted["memory_ok"]:
        evaluated.append(plan)

    def context(b: int, dps: list[int]) -> _Context:
      tsum = {}
      for d in dps:
        tf, tb = cm.layer_times(costs, cluster.device, b / d)
        tsum[d] = tf + tb
      return _Context(b=b, B=B, M=B // b, K=cluster.num_devices, dps=dps, tsum=tsum,
                      mem_cap=cluster.memory_per_device, p2p_alpha=link.alpha,
                      p2p_beta=link.beta, cm=cm, cluster=cluster, costs=costs)

    extra_runs = 0
    for b in sorted(sizes, reverse=True):
      dps = data_parallel_degrees(b, cluster.num_devices, powers_of_two)
      ctx = context(b, dps)
      tsum = ctx.tsum
      lo = sum(min(d * tsum[d][l] for d in dps) for l in range(len(costs))) / (ctx.K * b)
      if best is not None and B * lo > prune * best.predicted["iteration_time"]:
        continue
      runner = _Runner(ctx, root, eps)
      got = runner.min_tps(max(lo, 1e-15))
      if got is not None:
        t_star, s_star = got
        D = int(s_star.R(root, ctx.K, 0))
        per_size.append(((ctx.M + D - 1) * t_star * b, b, runner, t_star, s_star))
        consider(b, t_star, D, s_star.stages(root, ctx.K, 0))
    # Phase 2: most promising sizes first; skip a size whose bottleneck alone (B * t*) is
    # clearly slower than the best simulated plan; simulate the best frontier plans of the rest.
    per_size.sort(key=lambda x: x[:2])
    best_tps = min((x[3] for x in per_size), default=math.inf)
    for _, b, runner, t_star, s_star in per_size:
      if best is not None and B * t_star > prune * best.predicted["iteration_time"]:
        continue
      frontier = runner.shallower(t_star, s_star)
      frontier.sort(key=lambda f: (runner.ctx.M + f[1] - 1) * f[0])
      n_cands += len(frontier) + 1
      for t, depth, search in frontier[:simulate_top]:
        consider(b, t, depth, search.stages(root, runner.ctx.K, 0))
    # Phase 3: the TPS objective spreads a stage's gradient all-reduce over the iteration,
    # but it runs after the stage's last backward; at the best micro-batch sizes, also search
    # without data parallelism (deeper, all-pipeline plans) and let the simulator decide.
    if replication_variant and cluster.num_devices > 1:
      top = sorted(evaluated, key=lambda p: p.predicted["iteration_time"])
      sizes_done = []
      for plan in top:
        b = plan.stages[0].microbatch_size
        if b in sizes_done:
          continue
        sizes_done.append(b)
        if len(sizes_done) > 2:
          break
        ctx = context(b, [1])
        runner = _Runner(ctx, root, eps)
        lo = float(ctx.tsum[1].sum()) / (ctx.K * b)
        got = runner.min_tps(max(lo, 1e-15))
        if got is not None:
          t_star, s_star = got
          frontier = [(t_star, int(s_star.R(root, ctx.K, 0)), s_star)]
          frontier += runner.shallower(t_star, s_star)
          frontier.sort(key=lambda f: (ctx.M + f[1] - 1) * f[0])
          for t, depth, search in frontier[:simulate_top]:
            consider(b, t, depth, search.stages(root, ctx.K, 0))
        extra_runs += runner.runs
    runs = sum(x[2].runs for x in per_size) + extra_runs
  finally:
    sys.setrecursionlimit(old_limit)
  if best is None or not best.predicted.get("memory_ok", True):
    raise no_plan_error("graphpipe", layer_graph, cluster, B,
                        "every micro-batch size exceeds device memory")
  # A chain of stages is a stage DAG too: the chain DP's optima over the topological order
  # join the candidates, so GraphPipe's plan space visibly contains the sequential one.
  if chain_seeds:
    chains = chain_candidates(layer_graph, cluster, B, sizes, cost_model=cm, costs=costs,
                              schedule=schedule, simulate_top=3, sweep=False,
                              planner="graphpipe", sequential=False)
    evaluated += chains
    n_sims += len(chains)
  # Phase 4: the DP's objective is a proxy; polish the best plans by local search on the
  # simulated time (device counts, layer moves, splits and merges, per micro-batch size).
  best = polish(evaluated, layer_graph, cluster, cost_model=cm, costs=costs,
                refine_sizes=refine_sizes, refine_within=refine_within, max_evals=refine_evals,
                microbatch_sizes=sizes)
  stats = SearchStats(seconds=time.perf_counter() - t0, dp_runs=runs,
                      microbatch_sizes=tuple(sizes), candidates=n_cands, simulated=n_sims,
                      best_tps=float(best_tps))
  pred = dict(best.predicted)
  pred["search"] = stats.to_dict()
  pred["sp_ordering_edges"] = len(sp.added_edges)
  return best.replace(predicted=pred)
