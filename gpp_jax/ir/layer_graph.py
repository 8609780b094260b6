"""LayerGraph: the layer-level DAG with costs that planners consume.

A LayerGraph is a plain ``networkx.DiGraph`` with documented attributes, so every graph
algorithm of networkx applies directly.

Graph attributes:
  name: str; batch_size: int, the number of samples the costs below were taken for.

Node (layer) attributes, all for ``batch_size`` samples, forward pass only:
  flops: float        forward FLOPs (exact for dot_general/conv, estimated for the rest)
  bytes: float        bytes read + written by the forward equations
  param_bytes: float  bytes of the parameters this layer owns
  act_bytes: float    bytes of this layer's outputs that other layers (or the loss) read
  saved_bytes: float  bytes of the intermediates kept for the backward pass (activation memory)
  order: int          position in a topological order of the source program (deterministic)
  time_f, time_b: float (optional)  measured forward/backward seconds at ``batch_size``;
                      a cost model uses them instead of the roofline when present.
  time_f_at, time_b_at: dict (optional)  the same, measured as a stage over k > 1 devices
                      runs the layer, keyed by ``str(k)`` (``at_width``).
  param_read_bytes: float (optional)  parameter bytes the forward reads once per call whatever
                      the batch size (default: param_bytes if bytes >= param_bytes, else 0,
                      as for a sparse embedding gather).
  param_path: str (optional)  where the layer's parameters sit in the parameter tree
                      (``encoder/Dense_0``), when that differs from the name-stack path
                      that names the layer (Linen: ``Model/Model.encode/encoder/Dense_0``).
  free: bool (optional)  the layer reads no parameter: its equations only combine other
                      layers' outputs (a loss term); a manual plan may move it next to them.

Edge attributes:
  bytes: float        bytes flowing along the edge per ``batch_size`` samples.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import networkx as nx

NODE_ATTRS = ("flops", "bytes", "param_bytes", "act_bytes", "saved_bytes")


def new_layer_graph(name: str, batch_size: int) -> nx.DiGraph:
  """Returns an empty LayerGraph for costs measured at ``batch_size`` samples."""
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  return nx.DiGraph(name=name, batch_size=int(batch_size))


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer's costs, the node attributes of the same names (module docstring), for the
  graph's ``batch_size`` samples. ``saved_bytes`` None: as many as ``act_bytes``."""

  flops: float = 0.0
  bytes: float = 0.0
  param_bytes: float = 0.0
  act_bytes: float = 0.0
  saved_bytes: float | None = None


def add_layer(g: nx.DiGraph, name: str, cost: LayerCost = LayerCost(), **extra: Any) -> None:
  """Adds a layer with its ``cost`` and any further node attributes in ``extra`` (``rows``,
  ``param_read_bytes``, ``time_f``, ...); ``order`` defaults to insertion order."""
  if name in g:
    raise ValueError(f"layer {name!r} already exists")
  g.add_node(
    name,
    flops=float(cost.flops),
    bytes=float(cost.bytes),
    param_bytes=float(cost.param_bytes),
    act_bytes=float(cost.act_bytes),
    saved_bytes=float(cost.act_bytes if cost.saved_bytes is None else cost.saved_bytes),
    order=extra.pop("order", g.number_of_nodes()),
    **extra,
  )


def add_edge(g: nx.DiGraph, src: str, dst: str, bytes: float, arrays: int = 1) -> None:  # pylint: disable=redefined-builtin
  """Adds (or accumulates onto) the edge src -> dst carrying ``bytes`` per batch in
  ``arrays`` arrays (the edge attribute ``arrays``; an edge without it carries one)."""
  for n in (src, dst):
    if n not in g:
      raise ValueError(f"edge {src!r} -> {dst!r}: unknown layer {n!r}")
  if g.has_edge(src, dst):
    d = g.edges[src, dst]
    d["bytes"] += float(bytes)
    d["arrays"] = d.get("arrays", 1) + int(arrays)
  else:
    g.add_edge(src, dst, bytes=float(bytes), arrays=int(arrays))


def validate_layer_graph(g: nx.DiGraph) -> None:
  """Raises ValueError unless ``g`` is a well-formed LayerGraph."""
  if "batch_size" not in g.graph:
    raise ValueError("LayerGraph lacks the graph attribute 'batch_size'")
  if not nx.is_directed_acyclic_graph(g):
    cycle = nx.find_cycle(g)
    raise ValueError(f"LayerGraph has a cycle: {cycle}")
  for n, d in g.nodes(data=True):
    missing = [a for a in NODE_ATTRS + ("order",) if a not in d]
    if missing:
      raise ValueError(f"layer {n!r} lacks attributes {missing}")
  for u, v, d in g.edges(data=True):
    if "bytes" not in d:
      raise ValueError(f"edge {u!r} -> {v!r} lacks 'bytes'")


def topo_layers(g: nx.DiGraph) -> list[str]:
  """Layers in a deterministic topological order (ties broken by ``order``)."""
  return list(nx.lexicographical_topological_sort(g, key=lambda n: (g.nodes[n]["order"], n)))


def scaled(g: nx.DiGraph, batch_size: int) -> nx.DiGraph:
  """A copy with activation-dependent costs rescaled linearly to ``batch_size`` samples."""
  f = batch_size / g.graph["batch_size"]
  h = g.copy()
  h.graph["batch_size"] = int(batch_size)
  for _, d in h.nodes(data=True):
    for a in ("flops", "bytes", "act_bytes", "saved_bytes", "time_f", "time_b"):
      if a in d:
        d[a] = d[a] * f
    for a in ("time_f_at", "time_b_at"):
      if a in d:
        d[a] = {k: t * f for k, t in d[a].items()}
  for _, _, d in h.edges(data=True):
    d["bytes"] *= f
  return h


def widths_measured(g: nx.DiGraph, layers: Iterable[str]) -> set[int]:
  """The widths (devices per stage, > 1) at which every one of ``layers`` has measured
  times (``time_f_at`` and ``time_b_at``, set by ``passes.calibrate``)."""
  found: set[int] | None = None
  for n in layers:
    d = g.nodes[n]
    have = {int(k) for k in d.get("time_f_at", {})} & {int(k) for k in d.get("time_b_at", {})}
    found = have if found is None else found & have
  return found or set()


def at_width(g: nx.DiGraph, k: int) -> nx.DiGraph:
  """A copy whose layers' ``time_f`` / ``time_b`` are their times measured as a stage over
  ``k`` devices runs them (``time_f_at`` / ``time_b_at``), where measured."""
  h = g.copy()
  key = str(k)
  for _, d in h.nodes(data=True):
    if key in d.get("time_f_at", {}) and key in d.get("time_b_at", {}):
      d["time_f"], d["time_b"] = d["time_f_at"][key], d["time_b_at"][key]
  return h


def to_json(g: nx.DiGraph) -> str:
  return json.dumps(nx.node_link_data(g, edges="edges"), sort_keys=True)


def from_json(s: str) -> nx.DiGraph:
  return nx.node_link_graph(json.loads(s), directed=True, edges="edges")


def describe(g: nx.DiGraph) -> str:
  """A readable table of the layers and their costs."""
  rows = [
    f"LayerGraph {g.graph.get('name', '')!s} (batch {g.graph['batch_size']}): "
    f"{g.number_of_nodes()} layers, {g.number_of_edges()} edges",
    f"{'layer':40s} {'GFLOP':>10s} {'param MiB':>10s} {'act MiB':>10s}  inputs",
  ]
  for n in topo_layers(g):
    d = g.nodes[n]
    preds = ", ".join(sorted(g.predecessors(n)))
    rows.append(
      f"{n:40.40s} {d['flops'] / 1e9:10.4f} {d['param_bytes'] / 2**20:10.3f} "
      f"{d['act_bytes'] / 2**20:10.3f}  {preds}"
    )
  return "\n".join(rows)
