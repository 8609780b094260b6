"""Hand-written plans: module-path prefixes -> stage, stage -> device."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.errors import PlanError
from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan, Stage, stage_edges, validate_plan


@dataclasses.dataclass(frozen=True)
class ManualPlan:
  """Stage assignment by module-path prefix, resolved once the model's layers are known.

  Attributes:
    rules: ``{prefix: stage}``. A layer goes to the stage of the longest rule that is a
      path-component prefix of it or of its parameter-tree path (``"enc"`` matches ``enc``,
      ``enc/fc`` and the sibling layer ``enc#2``, not ``encoder``; ``"enc#2"`` names the
      sibling alone; a Linen layer ``Net/Net.encode/enc/Dense_0`` also matches ``"enc"`` and
      ``"params/enc"``). Layers that read no parameter and match no rule go with the stage
      that consumes them or that holds the last of their inputs.
    devices: ``{stage: device index or indices}``; default stage i -> device i.
    default_stage: stage of layers no rule matches (None: such layers are an error).
    microbatch_sizes: ``{stage: samples per micro-batch}`` for stages with their own size
      (GraphPipe's per-stage micro-batches); stages not named use batch / num_microbatches.
  """

  rules: Mapping[str, int]
  devices: Mapping[int, int | Sequence[int]] | None = None
  default_stage: int | None = None
  microbatch_sizes: Mapping[int, int] | None = None

  def resolve(
    self,
    layer_graph: nx.DiGraph,
    num_microbatches: int,
    schedule: str = "1f1b",
    num_devices: int | None = None,
    batch_size: int | None = None,
  ) -> Plan:
    """Builds and validates the Plan for ``layer_graph``."""
    assign: dict[str, int] = {}
    unmatched = []
    order = topo_layers(layer_graph)
    for layer in order:
      best = None
      for prefix, s in self.rules.items():
        if _matches_layer(prefix, layer, layer_graph) and (
          best is None or len(prefix) > len(best[0])
        ):
          best = (prefix, s)
      if best is not None:
        assign[layer] = best[1]
      elif not layer_graph.nodes[layer].get("free"):
        if self.default_stage is None:
          unmatched.append(layer)
          continue
        assign[layer] = self.default_stage
    if unmatched:
      raise PlanError(
        f"layers {unmatched} match no rule of the manual plan; add rules for them "
        f"or set default_stage. Rules: {dict(self.rules)}. All layers: "
        f"{_with_param_paths(order, layer_graph)}"
      )
    unknown = [
      p for p in self.rules if not any(_matches_layer(p, l, layer_graph) for l in layer_graph)
    ]
    if unknown:
      raise PlanError(
        f"manual plan rules {unknown} match no layer of the model; known layers: "
        f"{_with_param_paths(order, layer_graph)}"
      )
    _place_free_layers(layer_graph, order, assign, self.default_stage)
    n = max(assign.values()) + 1
    used = sorted(set(assign.values()))
    if used != list(range(n)):
      raise PlanError(f"manual plan stages must be numbered 0..{n - 1} without gaps; got {used}")
    sizes = dict(self.microbatch_sizes or {})
    if set(sizes) - set(range(n)):
      raise PlanError(
        f"manual plan micro-batch sizes name stages {sorted(set(sizes) - set(range(n)))}, but "
        f"the plan has stages 0..{n - 1}"
      )
    stages = []
    for s in range(n):
      d = (self.devices or {}).get(s, s)
      devs = (d,) if isinstance(d, int) else tuple(d)
      layers = tuple(l for l in topo_layers(layer_graph) if assign[l] == s)
      stages.append(Stage(s, layers, devs, microbatch_size=sizes.get(s)))
    plan = Plan(
      tuple(stages),
      stage_edges(layer_graph, assign),
      num_microbatches,
      schedule=schedule,
      planner="manual",
      batch_size=batch_size,
    )
    validate_plan(plan, layer_graph, num_devices, batch_size)
    return plan


def _matches(prefix: str, layer: str) -> bool:
  p = [x for x in prefix.split("/") if x]
  l = layer.split("/")
  return l[: len(p)] == p


def _matches_layer(prefix: str, layer: str, g: nx.DiGraph) -> bool:
  """Whether a rule names ``layer``: a path-component prefix of its name or of its
  parameter-tree path (``param_path``; a leading ``params/`` optional), a ``#k`` sibling
  matching the rules of its module unless a rule names it."""
  names = [layer]
  tree = g.nodes[layer].get("param_path")
  if tree:
    names.append(tree)
  names += [n.partition("#")[0] for n in names if "#" in n]
  rule = prefix[len("params/") :] if prefix.startswith("params/") else prefix
  return any(_matches(prefix, n) or _matches(rule, n) for n in names)


def _with_param_paths(order: Sequence[str], g: nx.DiGraph) -> list[str]:
  """Layer names for messages, each with its parameter-tree path where that differs."""
  return [
    f"{l} (params/{g.nodes[l]['param_path']})" if g.nodes[l].get("param_path") else l for l in order
  ]


def _acyclic(g: nx.DiGraph, assign: Mapping[str, int]) -> bool:
  placed = [(u, v) for u, v in g.edges if u in assign and v in assign]
  q = nx.DiGraph((assign[u], assign[v]) for u, v in placed if assign[u] != assign[v])
  return nx.is_directed_acyclic_graph(q)


def _place_free_layers(
  g: nx.DiGraph, order: Sequence[str], assign: dict[str, int], default: int | None
) -> None:
  """Places the layers that read no parameter (loss terms over other layers' outputs): at the
  stage their rule names, else with the stage that consumes them, else the stage holding the
  last of their inputs, whichever first keeps the stage graph acyclic."""
  free = [l for l in order if g.nodes[l].get("free")]
  if not free or (len(assign) == len(order) and _acyclic(g, assign)):
    return
  ruled = {l: assign.pop(l) for l in free if l in assign}
  rank = {l: i for i, l in enumerate(order)}
  for l in free:
    consumers = {assign[c] for c in g.successors(l) if c in assign}
    inputs = sorted((p for p in g.predecessors(l) if p in assign), key=rank.__getitem__)
    options = [ruled.get(l)]
    options += [consumers.pop()] if len(consumers) == 1 else []
    options += [assign[inputs[-1]]] if inputs else []
    options += [default, 0 if not assign else max(assign.values())]
    for s in options:
      if s is not None and _acyclic(g, {**assign, l: s}):
        assign[l] = s
        break
    else:
      assign[l] = next(s for s in options if s is not None)


def manual_plan(
  rules: Mapping[str, int],
  devices: Mapping[int, int | Sequence[int]] | None = None,
  default_stage: int | None = None,
  microbatch_sizes: Mapping[int, int] | None = None,
) -> ManualPlan:
  """A plan written by hand: ``{module-path prefix: stage}``, optionally stage -> device and
  stage -> micro-batch size (stages of different sizes re-chunk the batch between them)."""
  check_microbatch_sizes(microbatch_sizes)
  return ManualPlan(
    dict(rules),
    None if devices is None else dict(devices),
    default_stage,
    None if microbatch_sizes is None else dict(microbatch_sizes),
  )


def check_microbatch_sizes(sizes: Mapping[Any, Any] | None) -> None:
  """A manual plan's ``{stage: samples per micro-batch}``: stage indices and sizes are ints,
  sizes >= 1."""
  for s, b in (sizes or {}).items():
    if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
      raise PlanError(f"microbatch_sizes maps stage indices (ints >= 0) to sizes; got key {s!r}")
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
      raise PlanError(
        f"microbatch_sizes gives stage {s} {b!r} samples per micro-batch; a size is an int "
        f">= 1 that divides the batch (leave the stage out to use batch / num_microbatches)"
      )
