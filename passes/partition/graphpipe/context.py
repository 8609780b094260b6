"""What the GraphPipe DP holds fixed for one micro-batch size: device choices, per-layer times,
and the (memoised) TPS of every block of SP-tree children as one stage."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel, LayerCosts
from gpp_jax.passes.partition.graphpipe.tree import SPTreeNode
from gpp_jax.passes.partition.range_costs import RangeCosts


@dataclasses.dataclass
class MicrobatchContext:
  """Everything fixed for one micro-batch size: device choices and per-layer times.

  The DP counts devices in slots of ``unit`` devices (``K`` slots): a stage on ``dps[j]``
  devices takes ``slots[j] = dps[j] // unit`` of them. On large clusters the unit keeps the
  DP's tables (slots x depths) small; the polish then moves single devices."""

  b: int
  B: int
  M: int
  K: int
  dps: list[int]
  tsum: dict[int, np.ndarray]  # d -> per-layer (t_f + t_b) at b/d samples per device
  mem_cap: float
  p2p_alpha: float
  p2p_beta: float
  cm: CostModel
  cluster: Cluster
  costs: LayerCosts
  block_cache: dict = dataclasses.field(default_factory=dict)
  n_dps: list = dataclasses.field(default_factory=list)  # k slots -> how many stages fit
  node_time: dict = dataclasses.field(default_factory=dict)
  unit: int = 1
  slots: list[int] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if any(d % self.unit for d in self.dps):
      raise ValueError(f"device counts {self.dps} are not multiples of the unit {self.unit}")
    self.slots = [d // self.unit for d in self.dps]
    self.n_dps = [sum(1 for d in self.slots if d <= k) for k in range(self.K + 1)]

  def upd(self, params: float, d: int) -> float:
    c = self.cluster
    link = c.intra_link if (c.devices_per_node is None or d <= c.devices_per_node) else c.inter_link
    assert link is not None  # a cluster with devices_per_node has an inter_link
    return self.cm.update_time(params, c.device, d, link)

  def child_times(self, node: SPTreeNode, d: int) -> np.ndarray:
    key = (node.sig, d)
    pt = self.node_time.get(key)
    if pt is None:
      t = self.tsum[d]
      pt = np.concatenate([[0.0], np.cumsum([t[ls].sum() for ls in node.child_layers])])
      self.node_time[key] = pt
    return pt

  def block(self, node: SPTreeNode, i: int, p: int):
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

    def compute(d):
      pt = self.child_times(node, d)
      return float(pt[p] - pt[i])

    hit = self.stage_tps(compute, params, saved, cut)
    self.block_cache[key] = hit
    return hit

  def stage_tps(self, compute, params: float, saved: float, cut: float):
    """(TPS per d in dps, running minimum of the transfer-free TPS, params, saved) of a stage
    whose compute time on d devices is ``compute(d)`` and whose inputs and outputs move
    ``cut`` bytes per sample."""
    comm = 0.0 if cut <= 1e-12 else 2 * self.p2p_alpha + cut * self.b / self.p2p_beta
    tps, bound = [], []
    for d in self.dps:
      t = compute(d)
      upd = self.upd(params, d) / self.B
      tps.append(self.cm.combine(t, comm) / self.b + upd)
      bound.append(t / self.b + upd)
    return (tps, list(itertools.accumulate(bound, min)), params, saved)

  def merged(self, node: SPTreeNode, ip: int, a: int, lo: int, hi: int):
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
    assert node.cross is not None  # node is a series node
    internal = float(
      c.internal[a] + node.internal[hi] - node.internal[lo] + node.cross[lo, hi] + G[a, lo:hi].sum()
    )
    incident = float(c.incident[a] + node.incident[hi] - node.incident[lo])
    cut = max(incident - 2 * internal, 0.0)

    def compute(d):
      return float(
        self.child_times(c, d)[a] + self.child_times(node, d)[hi] - self.child_times(node, d)[lo]
      )

    hit = self.stage_tps(compute, params, saved, cut)
    self.block_cache[key] = hit
    return hit

  def linear(self, node: SPTreeNode) -> RangeCosts:
    """Range costs over ``node``'s layers in their SP order (a topological order)."""
    key = ("linear", node.sig)
    rc = self.block_cache.get(key)
    if rc is None:
      rc = RangeCosts(
        self.costs, self.cm, self.cluster, self.b, self.B, self.dps, order=node.layers
      )
      self.block_cache[key] = rc
    return rc

  def linear_stacks(self, node: SPTreeNode):
    """(TPS per d stacked, static memory, saved bytes per sample, samples per device per d)
    over ``node``'s linear order, for the serialised option."""
    key = ("stacks", node.sig)
    hit = self.block_cache.get(key)
    if hit is None:
      rc = self.linear(node)
      hit = (
        np.stack([rc.tps(d) for d in self.dps]),
        self.cm.static_memory(rc.params),
        rc.saved,
        np.array([self.b / d for d in self.dps]),
      )
      self.block_cache[key] = hit
    return hit

  def mem(self, params: float, saved: float, d: int, depth: int) -> float:
    return self.cm.stage_memory(params, saved, self.b, d, min(depth, self.M))
