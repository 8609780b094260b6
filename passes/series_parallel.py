"""Series-parallel decomposition pass: LayerGraph -> SPDecomposition (a tree of layer sets).

GraphPipe's partitioner solves sub-problems on series-parallel (SP) subgraphs. This pass finds
that structure.

Form. The tree is in *node* form: a ``leaf`` is one layer; ``series(c1, ..., cn)`` means every
layer of ``ci`` precedes (reaches) every layer of ``cj`` for i < j; ``parallel(c1, ..., cn)``
means no path joins layers of different children. The paper states the same structure with
two-terminal subgraphs whose series splits share a node (``G = G1 ; G2`` with
sink(G1) = source(G2)). The node form resolves the shared-node question once: the shared node
belongs to the upstream part ``G1`` (it is the last element of ``G1``'s series), and
``G2`` starts right after it. A graph with several sources or sinks is the two-terminal graph
with a virtual source and sink added, then removed again: in node form that is simply a
top-level ``parallel`` (or a series whose first/last element is a parallel), so no virtual
layer ever reaches a stage.

Every tree node's layer set is convex in the layer graph, so any stage built from whole tree
nodes, or from contiguous children of one series or parallel node, is convex.

SP-ization rule for graphs that are not SP. When a connected set of layers has no series cut
(no split of its topological order where every earlier layer reaches every later one), the
pass picks the cut of the topological order that needs the fewest new orderings (pairs
(a, b), a before the cut, b after it, with no path a -> b; ties: the earliest cut) and adds
ordering edges from the sinks before the cut to the sources after it. Ordering edges carry no
data: they only promise that the stage holding ``b`` runs after the one holding ``a`` for the
same micro-batch, so the computation is unchanged (arithmetically identical). They are
recorded in ``SPDecomposition.added_edges``. Recursion then continues on both sides.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import networkx as nx

from gpp_jax.ir.layer_graph import topo_layers


@dataclasses.dataclass(frozen=True)
class SPNode:
  """A node of the SP tree.

  Attributes:
    kind: "leaf", "series" or "parallel".
    children: sub-trees (series: in execution order; parallel: by first layer's position).
    layer: the layer of a leaf.
    layers: every layer under this node, in topological order.
  """

  kind: str
  children: tuple[SPNode, ...] = ()
  layer: str | None = None
  layers: tuple[str, ...] = dataclasses.field(default=(), compare=False)

  def __post_init__(self):
    if self.kind not in ("leaf", "series", "parallel"):
      raise ValueError(f"unknown SP node kind {self.kind!r}")
    if self.kind == "leaf":
      if self.layer is None or self.children:
        raise ValueError("a leaf has a layer and no children")
      object.__setattr__(self, "layers", (self.layer,))
    else:
      if len(self.children) < 2:
        raise ValueError(f"a {self.kind} node needs at least two children")
      object.__setattr__(self, "layers", tuple(l for c in self.children for l in c.layers))

  def to_dict(self) -> dict[str, Any]:
    if self.kind == "leaf":
      return {"leaf": self.layer}
    return {self.kind: [c.to_dict() for c in self.children]}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> SPNode:
    if "leaf" in d:
      return cls("leaf", layer=d["leaf"])
    ((kind, kids),) = d.items()
    return cls(kind, tuple(cls.from_dict(k) for k in kids))

  def lines(self, indent: int = 0) -> list[str]:
    pad = "  " * indent
    if self.kind == "leaf":
      return [f"{pad}{self.layer}"]
    out = [f"{pad}{self.kind} ({len(self.layers)} layers)"]
    for c in self.children:
      out.extend(c.lines(indent + 1))
    return out

  def __str__(self) -> str:
    return "\n".join(self.lines())


@dataclasses.dataclass(frozen=True)
class SPDecomposition:
  """The SP tree of a LayerGraph and the ordering edges added to make it SP."""

  root: SPNode
  added_edges: tuple[tuple[str, str], ...] = ()

  @property
  def is_series_parallel(self) -> bool:
    """True when the graph was SP as given (no ordering edge was added)."""
    return not self.added_edges

  def to_json(self) -> str:
    return json.dumps(
      {"root": self.root.to_dict(), "added_edges": [list(e) for e in self.added_edges]}
    )

  @classmethod
  def from_json(cls, s: str) -> SPDecomposition:
    d = json.loads(s)
    return cls(SPNode.from_dict(d["root"]), tuple(tuple(e) for e in d["added_edges"]))

  def __str__(self) -> str:
    head = "SP decomposition" + (
      f", {len(self.added_edges)} ordering edges added: {list(self.added_edges)[:8]}"
      if self.added_edges
      else ""
    )
    return head + "\n" + str(self.root)


def sp_decompose(g: nx.DiGraph) -> SPDecomposition:
  """LayerGraph -> SPDecomposition (see the module docstring for the form and the rule)."""
  if g.number_of_nodes() == 0:
    raise ValueError("cannot decompose an empty LayerGraph; capture a model with layers first")
  order = topo_layers(g)
  pos = {l: i for i, l in enumerate(order)}
  n = len(order)
  desc = [0] * n
  succ = [0] * n
  pred = [0] * n
  for u, v in g.edges:
    succ[pos[u]] |= 1 << pos[v]
    pred[pos[v]] |= 1 << pos[u]
  for i in reversed(range(n)):
    m = succ[i]
    d = m
    while m:
      low = m & -m
      d |= desc[low.bit_length() - 1]
      m ^= low
    desc[i] = d
  added: list[tuple[str, str]] = []

  def bits(mask: int) -> list[int]:
    out = []
    while mask:
      low = mask & -mask
      out.append(low.bit_length() - 1)
      mask ^= low
    return out

  def components(mask: int) -> list[int]:
    comps = []
    rest = mask
    while rest:
      start = rest & -rest
      comp = start
      frontier = start
      while frontier:
        nxt = 0
        for i in bits(frontier):
          nxt |= (succ[i] | pred[i]) & mask
        frontier = nxt & ~comp
        comp |= frontier
      comps.append(comp)
      rest &= ~comp
    return comps

  def build(mask: int) -> SPNode:
    idx = bits(mask)  # ascending positions = topological order
    if len(idx) == 1:
      return SPNode("leaf", layer=order[idx[0]])
    comps = components(mask)
    if len(comps) > 1:
      comps.sort(key=lambda c: (c & -c).bit_length())
      return SPNode("parallel", tuple(build(c) for c in comps))
    cuts = []
    inter = mask
    prefix = 0
    for k, i in enumerate(idx[:-1]):
      inter &= desc[i]
      prefix |= 1 << i
      suffix = mask & ~prefix
      if suffix & ~inter == 0:
        cuts.append(k + 1)
    if not cuts:
      cuts = [_sp_ize(idx, mask)]
    parts, start = [], 0
    for c in cuts + [len(idx)]:
      part = 0
      for i in idx[start:c]:
        part |= 1 << i
      parts.append(part)
      start = c
    kids: list[SPNode] = []
    for p in parts:
      child = build(p)
      kids.extend(child.children if child.kind == "series" else (child,))
    return SPNode("series", tuple(kids))

  def _sp_ize(idx: list[int], mask: int) -> int:
    best_k, best_cost = 1, None
    prefix = 0
    for k, i in enumerate(idx[:-1]):
      prefix |= 1 << i
      suffix = mask & ~prefix
      cost = sum(bin(suffix & ~desc[a]).count("1") for a in bits(prefix))
      if best_cost is None or cost < best_cost:
        best_k, best_cost = k + 1, cost
    prefix = 0
    for i in idx[:best_k]:
      prefix |= 1 << i
    suffix = mask & ~prefix
    sinks = [a for a in bits(prefix) if succ[a] & prefix == 0]
    sources = [b for b in bits(suffix) if pred[b] & suffix == 0]
    for a in sinks:
      for b in sources:
        if not desc[a] >> b & 1:
          added.append((order[a], order[b]))
    return best_k

  root = build((1 << n) - 1)
  return SPDecomposition(root, tuple(added))


def with_ordering_edges(g: nx.DiGraph, decomposition: SPDecomposition) -> nx.DiGraph:
  """A copy of ``g`` with the decomposition's ordering edges added (0 bytes, ``ordering=True``)."""
  h = g.copy()
  for u, v in decomposition.added_edges:
    if not h.has_edge(u, v):
      h.add_edge(u, v, bytes=0.0, ordering=True)
  return h
