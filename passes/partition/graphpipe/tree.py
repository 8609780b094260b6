"""The series-parallel tree the GraphPipe DP walks.

``SPTreeNode`` wraps a ``passes.series_parallel.SPNode`` with the prefix sums the DP needs
(layer positions, parameter and saved bytes, incident and internal transfer bytes), from what
every node of one tree shares (``TreeCosts``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from gpp_jax.cost.cost_model import LayerCosts
from gpp_jax.passes.series_parallel import SPNode


def nan_to_zero(x: float) -> float:
  return 0.0 if math.isnan(x) else float(x)


@dataclasses.dataclass(frozen=True, eq=False)
class TreeCosts:
  """What every node of one tree is built from.

  Attributes:
    costs: the layer costs (the nodes hold layer positions in their order).
    incident: bytes per sample each layer sends and receives.
    edge_map: u -> [(v, bytes)] per layer's out-edges; ("in", v) -> [(u, bytes)] per in-edges.
    interner: node signature -> id, filled as nodes are built (nodes with the same id are
      interchangeable to the DP).
  """

  costs: LayerCosts
  incident: np.ndarray
  edge_map: dict
  interner: dict = dataclasses.field(default_factory=dict)


class SPTreeNode:
  """An SP tree node with the aggregates the DP needs (layer positions, not names)."""

  __slots__ = (
    "child_layers",
    "children",
    "cross",
    "incident",
    "internal",
    "kind",
    "layers",
    "n",
    "params",
    "saved",
    "sig",
    "to_siblings",
    "twin",
  )

  def __init__(self, sp: SPNode, tc: TreeCosts, children: list | None = None):
    costs, incident, edge_map = tc.costs, tc.incident, tc.edge_map
    self.kind = sp.kind
    self.twin = None
    if children is not None:
      self.children = children
    else:
      self.children = [SPTreeNode(c, tc) for c in sp.children]
      if self.kind == "parallel":
        # Branch order matters: runs of adjacent branches can share a stage and merges take a
        # prefix. The DP tries two orders: lightest first (equal branches stay adjacent,
        # light branches merge with a fork or join) and the topological order (the twin).
        topo = list(self.children)
        work = lambda c: float(costs.flops_ps[c.layers].sum() + costs.act_bytes_ps[c.layers].sum())
        self.children.sort(key=lambda c: (work(c), c.layers[0]))
        if [id(c) for c in topo] != [id(c) for c in self.children]:
          self.twin = SPTreeNode(sp, tc, children=topo)
    self.layers = (
      [l for c in self.children for l in c.layers]
      if self.children
      else [costs.index[l] for l in sp.layers]
    )
    if self.kind == "leaf":
      i = self.layers[0]
      self.n = 1
      self.child_layers = [self.layers]
      sig: tuple[Any, ...] = (
        "L",
        float(costs.flops_ps[i]),
        float(costs.act_bytes_ps[i]),
        float(costs.held_param_bytes[i]),
        float(costs.saved_ps[i]),
        nan_to_zero(costs.time_f_ps[i]),
        nan_to_zero(costs.time_b_ps[i]),
        float(incident[i]),
      )
      self.params = np.array([0.0, costs.held_param_bytes[i]])
      self.saved = np.array([0.0, costs.saved_ps[i]])
      self.incident = np.array([0.0, incident[i]])
      self.internal = np.array([0.0, 0.0])
      self.cross = None
      self.to_siblings: dict[int, np.ndarray] = {}
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
      cross_sig: tuple[Any, ...] = ()
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
            cross[i, p] = cross[i, p - 1] + E[i : p - 1, p - 1].sum()
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
    self.sig = tc.interner.setdefault(sig, len(tc.interner))

  def total(self, what: str) -> float:
    arr = getattr(self, what)
    if what == "internal" and self.cross is not None:
      return float(arr[-1] + self.cross[0, self.n])
    return float(arr[-1])

  def block_layers(self, i: int, p: int) -> list[int]:
    return [l for j in range(i, p) for l in self.child_layers[j]]
