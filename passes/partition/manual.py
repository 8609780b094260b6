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
from gpp_jax.passes.capture import is_einsum_scope


@dataclasses.dataclass(frozen=True)
class ManualPlan:
  """Stage assignment by module-path prefix, resolved once the model's layers are known.

  Attributes:
    rules: ``{prefix: stage}``. A layer goes to the stage of the longest rule that is a
      path-component prefix of it or of its parameter-tree path (``"enc"`` matches ``enc``,
      ``enc/fc`` and the sibling layer ``enc#2``, not ``encoder``; ``"enc#2"`` names the
      sibling alone and wins over its module's rules; a Linen layer
      ``Net/Net.encode/enc/Dense_0`` also matches ``"enc"`` and ``"params/enc"``). A Linen
      layer no rule names that way matches the rules of the module that calls it: a shared
      embedding created by the root module and first called inside ``encoder``
      (``Net/Net.encode/encoder/embed``, parameters ``params/embed``) goes with
      ``"encoder"``. A ``#k`` use of a module (a tied output head, ``embed.attend``) that its
      module's rule (or ``default_stage``) would put on a stage its inputs come back to
      joins the stage of its inputs instead (the latest of them in stage order); its
      parameters stay with the module's stage, which sends them to the use's stage and takes
      their gradient back. Layers that read no parameter and match no rule go with the stage
      that consumes them or that holds the last of their inputs.
    devices: ``{stage: device index or indices}``; default stage i -> device i.
    default_stage: stage of layers no rule matches (None: such layers are an error).
    microbatch_sizes: ``{stage: samples per micro-batch}`` for stages with their own size
      (GraphPipe's per-stage micro-batches); stages not named use batch / num_microbatches.
    inner: over a mesh, ``{stage: sizes of the mesh's axes after the first}`` for stages that
      narrow them (``Stage.inner``: on a ("data", "model") mesh of model size 4, ``{1: (2,)}``
      runs stage 1 with tensor parallelism 2 and twice the rows); stages not named keep the
      mesh's.
  """

  rules: Mapping[str, int]
  devices: Mapping[int, int | Sequence[int]] | None = None
  default_stage: int | None = None
  microbatch_sizes: Mapping[int, int] | None = None
  inner: Mapping[int, Sequence[int]] | None = None

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
    by_module: list[str] = []  # #k uses placed by their module's rule or the default stage
    unmatched = []
    order = topo_layers(layer_graph)
    for layer in order:
      best = _best_rule(self.rules, layer, layer_graph)
      if best is not None:
        assign[layer] = self.rules[best[0]]
        if "#" in layer and best[1] != _NAMED:
          by_module.append(layer)
      elif not layer_graph.nodes[layer].get("free"):
        if self.default_stage is None:
          unmatched.append(layer)
          continue
        assign[layer] = self.default_stage
        if "#" in layer:
          by_module.append(layer)
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
      hints = [h for h in (_stale_rule_hint(p, layer_graph) for p in unknown) if h]
      raise PlanError(
        f"manual plan rules {unknown} match no layer of the model; "
        + "".join(f"{h}; " for h in hints)
        + f"known layers: {_with_param_paths(order, layer_graph)}"
      )
    _place_tied_uses(layer_graph, order, assign, by_module)
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
      shape = (self.inner or {}).get(s)
      stages.append(
        Stage(
          s,
          layers,
          devs,
          microbatch_size=sizes.get(s),
          inner=None if shape is None else tuple(int(n) for n in shape),
        )
      )
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


# How a rule names a layer, most specific first (``_tier``): a rule naming a ``#k`` use itself
# (``"embed#2"``), one naming the layer's module by its own name or parameter-tree path, one
# naming the module that calls it (Linen).
_NAMED, _OWN, _CALLER = 0, 1, 2


def _tier(prefix: str, layer: str, g: nx.DiGraph) -> int | None:
  """How ``prefix`` names ``layer`` (``_NAMED``, ``_OWN``, ``_CALLER``), or None where it does
  not: a path-component prefix of the layer's name or of its parameter-tree path
  (``param_path``; a leading ``params/`` optional), else of its caller's module path
  (``_caller_path``); a ``#k`` use also matches the rules of its module (its names without
  ``#k``), and a rule that names the use itself, ``#k`` included, is ``_NAMED``."""
  rule = prefix[len("params/") :] if prefix.startswith("params/") else prefix
  own = [layer]
  tree = g.nodes[layer].get("param_path")
  if tree:
    own.append(tree)
  caller = _caller_path(layer, g)
  callers = [caller] if caller else []

  def named(names: Sequence[str]) -> bool:
    return any(_matches(prefix, n) or _matches(rule, n) for n in names)

  if "#" in prefix and named(own + callers):
    return _NAMED
  for tier, names in ((_OWN, own), (_CALLER, callers)):
    if named(names + [n.partition("#")[0] for n in names if "#" in n]):
      return tier
  return None


def _matches_layer(prefix: str, layer: str, g: nx.DiGraph) -> bool:
  """Whether a rule names ``layer`` in any of the ways of ``_tier``."""
  return _tier(prefix, layer, g) is not None


def _best_rule(rules: Mapping[str, int], layer: str, g: nx.DiGraph) -> tuple[str, int] | None:
  """The rule that places ``layer`` and how it names it: the longest of the rules that name
  it most specifically (a rule naming a ``#k`` use wins over its module's rules)."""
  best = None
  for prefix in rules:
    t = _tier(prefix, layer, g)
    if t is not None and (best is None or (t, -len(prefix)) < (best[1], -len(best[0]))):
      best = (prefix, t)
  return best


def _caller_path(layer: str, g: nx.DiGraph) -> str | None:
  """A Linen layer's module path from its name stack without the root module and the method
  scopes: ``encoder/embed`` for ``Net/Net.encode/encoder/embed``, the module that calls a
  shared embedding whose parameters sit at ``params/embed``. None for a layer named by its
  parameter tree (NNX, plain pytrees: it has no ``param_path``) or where the two agree."""
  if not g.nodes[layer].get("param_path"):
    return None
  parts = [x for x in layer.split("/")[1:] if "." not in x.partition("#")[0]]
  path = "/".join(parts)
  return path if path and path != g.nodes[layer]["param_path"] else None


def _stale_rule_hint(prefix: str, g: nx.DiGraph) -> str | None:
  """For a rule that names no layer: why, where it names a layer of an earlier layering. A
  ``#k`` use of a module was a layer of its own for equations that read no parameter (a
  loss term, a pooling after a convolution; they now join the layer of their last input),
  and ``jnp.einsum``'s spec scope named layers (``.../BTD,NDH->BTNH``; now the module path
  does). None where the rule is not of that kind or its module is unknown too."""
  parts = [x for x in prefix.split("/") if x]
  if not parts:
    return None
  kept = [x for x in parts if not is_einsum_scope(x.partition("#")[0])]
  if len(kept) < len(parts):
    spec = next(x for x in parts if x not in kept).partition("#")[0]
    module = "/".join(kept).partition("#")[0]
    if not module:
      return (
        f"rule {prefix!r} names jnp.einsum's spec {spec!r}, which no longer names layers: "
        "layers are named by module path, so write the rule for the module that calls the "
        "einsum"
      )
    if any(_matches_layer(module, l, g) for l in g):
      return (
        f"rule {prefix!r} names jnp.einsum's spec {spec!r}, which no longer names layers: "
        f"the einsum is part of the layer of its module {module!r}, so the rule can go"
      )
    return None
  module, sep, k = prefix.rpartition("#")
  if sep and k.isdigit() and "/" not in k and any(_matches_layer(module, l, g) for l in g):
    return (
      f"rule {prefix!r} names the #{k} use of module {module!r} as a layer of its own, which it "
      f"no longer is: it is part of a layer of {module!r} or of the layer of its inputs, so "
      "the rule can go"
    )
  return None


def _with_param_paths(order: Sequence[str], g: nx.DiGraph) -> list[str]:
  """Layer names for messages, each with its parameter-tree path where that differs."""
  return [
    f"{l} (params/{g.nodes[l]['param_path']})" if g.nodes[l].get("param_path") else l for l in order
  ]


def _acyclic(g: nx.DiGraph, assign: Mapping[str, int]) -> bool:
  placed = [(u, v) for u, v in g.edges if u in assign and v in assign]
  q = nx.DiGraph((assign[u], assign[v]) for u, v in placed if assign[u] != assign[v])
  return nx.is_directed_acyclic_graph(q)


def _place_tied_uses(
  g: nx.DiGraph, order: Sequence[str], assign: dict[str, int], by_module: Sequence[str]
) -> None:
  """Moves each ``#k`` use of a module placed by its module's rule (or the default stage)
  whose stage its inputs come back to, so that it would close a stage cycle (a tied output
  head, ``embed.attend``, after a decoder on a later stage than the embedding), to the stage
  of its inputs: the latest of them in stage order that keeps the stages acyclic. The use
  keeps reading its module's parameters: the module's stage owns them, sends them to the
  use's stage and takes their gradient back, as for any parameter read by two stages.

  Layers that read no parameter are bypassed (placed afterwards, next to what they join);
  where the other layers' stages already form a cycle, the plan is left for
  ``validate_plan`` to name the cycle."""
  if not by_module:
    return
  free = [l for l in order if g.nodes[l].get("free")]
  h = nx.DiGraph(g.edges)
  h.add_nodes_from(order)
  for f in free:  # keep the paths that run through a layer that reads no parameter
    h.add_edges_from([(u, v) for u in h.predecessors(f) for v in h.successors(f)])
    h.remove_node(f)
  placed = {l: s for l, s in assign.items() if l in h and l not in by_module}
  if not _acyclic(h, placed):
    return
  for l in by_module:
    if _acyclic(h, {**placed, l: assign[l]}):
      placed[l] = assign[l]
      continue
    q = nx.DiGraph()
    q.add_nodes_from(sorted(set(placed.values())))
    q.add_edges_from(
      (placed[u], placed[v])
      for u, v in h.edges
      if u in placed and v in placed and placed[u] != placed[v]
    )
    rank = {s: i for i, s in enumerate(nx.lexicographical_topological_sort(q))}
    inputs = sorted({placed[p] for p in h.predecessors(l) if p in placed}, key=rank.__getitem__)
    for s in reversed(inputs):
      if _acyclic(h, {**placed, l: s}):
        assign[l] = s
        break
    placed[l] = assign[l]


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
  inner: Mapping[int, Sequence[int]] | None = None,
) -> ManualPlan:
  """A plan written by hand: ``{module-path prefix: stage}``, optionally stage -> device,
  stage -> micro-batch size (stages of different sizes re-chunk the batch between them) and,
  over a mesh, stage -> the sizes of the axes after the first (``ManualPlan.inner``)."""
  check_microbatch_sizes(microbatch_sizes)
  return ManualPlan(
    dict(rules),
    None if devices is None else dict(devices),
    default_stage,
    None if microbatch_sizes is None else dict(microbatch_sizes),
    None if inner is None else {int(k): tuple(v) for k, v in inner.items()},
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
