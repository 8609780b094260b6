"""Costs of contiguous ranges of a linearised LayerGraph, for the sequential planners.

PipeDream, BaPipe and Luo et al. cut the topologically ordered layers into contiguous ranges
(a contiguous range of a topological order is always convex). ``RangeCosts`` holds, for one
micro-batch size and a topological order of some or all layers (``order``, default all),
matrices indexed ``[i, j]`` for the range of layers ``i..j-1``: compute time per micro-batch
for each data-parallel degree, parameters, saved bytes per sample, bytes per sample crossing
the range boundary, and the resulting time per sample (TPS).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel, LayerCosts


@dataclasses.dataclass
class RangeCosts:
  """Range matrices for micro-batch ``b`` of a batch ``B`` (entries with j <= i are unused).

  Attributes:
    n: number of layers.
    dps: data-parallel degrees considered.
    compute: d -> (n+1, n+1) seconds of F + B of one micro-batch on each of d devices.
    comm: (n+1, n+1) seconds of the range's boundary transfers per micro-batch.
    params, saved: (n+1, n+1) parameter bytes, saved bytes per sample.
    cut: (n+1, n+1) bytes per sample crossing the range boundary (in + out).
  """

  costs: LayerCosts
  cm: CostModel
  cluster: Cluster
  b: int
  B: int
  dps: list[int]
  order: list[int] | None = None
  n: int = 0
  compute: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
  # Computed by __post_init__.
  comm: np.ndarray = dataclasses.field(init=False)
  params: np.ndarray = dataclasses.field(init=False)
  saved: np.ndarray = dataclasses.field(init=False)
  cut: np.ndarray = dataclasses.field(init=False)
  _tps: dict[int | tuple[str, int], np.ndarray] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    c = self.costs
    order = list(range(len(c))) if self.order is None else list(self.order)
    pos = {l: i for i, l in enumerate(order)}
    n = self.n = len(order)
    idx = np.asarray(order, dtype=int)
    pre = lambda x: np.concatenate([[0.0], np.cumsum(x)])
    diff = lambda p: p[None, :] - p[:, None]
    for d in self.dps:
      tf, tb = self.cm.planner_layer_times(c, self.cluster, self.b / d)
      self.compute[d] = diff(pre((tf + tb)[idx]))
    self.params = diff(pre(c.held_param_bytes[idx]))
    self.saved = diff(pre(c.saved_ps[idx]))
    E = np.zeros((n, n))
    inc = np.zeros(n)
    for u, v, by in c.edges:
      pu, pv = pos.get(u), pos.get(v)
      if pu is not None:
        inc[pu] += by
      if pv is not None:
        inc[pv] += by
      if pu is not None and pv is not None:
        if pu > pv:
          raise ValueError("RangeCosts order is not topological")
        E[pu, pv] += by
    # internal[i, j] = bytes of edges with i <= u and v < j (both ends inside the range).
    R = np.cumsum(E[::-1], axis=0)[::-1]  # R[i, v] = sum over u >= i of E[u, v]
    internal = np.zeros((n + 1, n + 1))
    internal[:n, 1:] = np.cumsum(R, axis=1)
    self.cut = np.maximum(diff(pre(inc)) - 2 * internal, 0.0)
    link = self.cluster.slowest_link()
    self.comm = np.where(self.cut > 1e-12, 2 * link.alpha + self.cut * self.b / link.beta, 0.0)

  def upd(self, params: np.ndarray, d: int) -> np.ndarray:
    c = self.cluster
    link = c.intra_link if (c.devices_per_node is None or d <= c.devices_per_node) else c.inter_link
    assert link is not None  # a cluster with devices_per_node has an inter_link
    ar = 0.0 if d <= 1 else 2 * (d - 1) * link.alpha + 2 * (d - 1) / d * params / link.beta
    return ar + self.cm.update_traffic * params / c.device.memory_bandwidth

  def tps(self, d: int) -> np.ndarray:
    """(n+1, n+1) time per sample of each range as one stage on d devices."""
    t = self._tps.get(d)
    if t is None:
      comp = self.compute[d]
      both = comp + self.comm if self.cm.tps_formula == "sum" else np.maximum(comp, self.comm)
      t = both / self.b + self.upd(self.params, d) / self.B
      self._tps[d] = t
    return t

  def bound(self, d: int) -> np.ndarray:
    """(n+1, n+1) TPS without transfers: grows with j for a fixed i (a lower bound of tps)."""
    key = ("bound", d)
    t = self._tps.get(key)
    if t is None:
      t = self.compute[d] / self.b + self.upd(self.params, d) / self.B
      self._tps[key] = t
    return t

  def memory(self, d: int, in_flight: np.ndarray | float) -> np.ndarray:
    """(n+1, n+1) bytes per device of each range on d devices holding ``in_flight``
    micro-batches."""
    return self.cm.static_memory(self.params) + self.saved * self.b / d * in_flight
