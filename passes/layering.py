"""Layering pass: inlined loss ClosedJaxpr + parameter paths -> layers and a LayerGraph.

Every equation is attributed to one layer by these rules, applied in program order:
  1. An equation that reads parameters belongs to the layer of the largest parameter it reads.
     The layer of a parameter is the module path of the first equation that reads it, taken
     from the name stack when the model names its modules there (Flax Linen, explicit
     ``jax.named_scope``), otherwise from the parameter's pytree path minus its leaf name
     (Flax NNX, plain pytrees): ``['blocks'][0]['fc']['kernel']`` -> ``blocks/0/fc``.
  2. An equation whose name-stack path lies inside a parameter layer's path joins that layer.
  3. Any other equation whose producers all lie in one layer (activations, the loss) joins
     that layer. A join of several layers (a concat of branches, a residual add) joins the
     layer of its first consumer, or, when nothing downstream decides, its latest producer's.
  4. Equations with no producer (they read only inputs and literals) join the layer of their
     first consumer; what is left joins the last layer.
  5. Layers must stay convex (the layer graph acyclic). An equation whose layer choice would
     close a cycle goes, when it is free of parameters (a loss term over an early module's
     output, a weight penalty's sum), to the layer of its last input, the one every other
     input layer reaches; otherwise, e.g. an output head reusing the embedding matrix, to a
     sibling layer ``<layer>#2`` (``#3``, ...); its parameters stay owned by the first layer,
     and the stage that reads them there receives them (a manual plan puts such a use whose
     module's rule would close a stage cycle on the stage of its inputs).
  6. An equation that reads only parameters (and literals) and feeds a single other layer
     moves into that layer; the parameter is then shared between the two layers.
``layer_depth`` truncates layer paths to their first components to make coarser layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
from jax.extend import core as xc

from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.layering import Layering
from gpp_jax.passes.capture import scope_path
from gpp_jax.passes.costs import aval_bytes, eqn_bytes, eqn_flops


def _truncate(path: str, depth: int | None) -> str:
  if depth is None or not path:
    return path
  return "/".join(path.split("/")[:depth])


def layer_program(
  closed: xc.ClosedJaxpr,
  param_paths: Sequence[str | None],
  *,
  batch_size: int,
  layer_depth: int | None = None,
  name: str = "model",
) -> Layering:
  """Groups equations into layers and builds the LayerGraph with costs.

  Args:
    closed: the inlined loss ClosedJaxpr.
    param_paths: one entry per invar: the parameter's layer path from its pytree path, or None
      for a non-parameter input (batch data, keys, constants).
    batch_size: samples the jaxpr was traced for (recorded in the LayerGraph).
    layer_depth: truncate layer paths to this many components (None keeps full paths).
  """
  J = closed.jaxpr
  if len(param_paths) != len(J.invars):
    raise ValueError(f"{len(param_paths)} parameter paths for {len(J.invars)} inputs")
  is_param = {v: i for i, v in enumerate(J.invars) if param_paths[i] is not None}
  # Rule 1: the layer of each parameter, from the first reading equation's scope or its path.
  param_layer: dict[int, str] = {}
  for e in J.eqns:
    sp = scope_path(e)
    for v in e.invars:
      if isinstance(v, xc.Var) and v in is_param and is_param[v] not in param_layer:
        i = is_param[v]
        param_layer[i] = _truncate(sp or param_paths[i] or f"param{i}", layer_depth)
  param_layers = set(param_layer.values())

  producer: dict[xc.Var, int] = {}
  desired: list[str | None] = []
  fallback: list[str | None] = []
  for k, e in enumerate(J.eqns):
    reads = [
      (aval_bytes(v.aval), is_param[v]) for v in e.invars if isinstance(v, xc.Var) and v in is_param
    ]
    want, back = None, None
    if reads:
      want = param_layer[max(reads)[1]]
    else:
      sp = scope_path(e)
      while sp and want is None:
        cand = _truncate(sp, layer_depth)
        if cand in param_layers:
          want = cand
        sp = sp.rpartition("/")[0]
      if want is None:
        prods = sorted({producer[v] for v in e.invars if isinstance(v, xc.Var) and v in producer})
        eff = [desired[p] or fallback[p] for p in prods]
        if eff and len({x for x in eff if x is not None}) == 1 and None not in eff:
          want = eff[0]
        elif eff:
          back = eff[-1]  # a join of several layers: decided by its consumer below
    desired.append(want)
    fallback.append(back)
    for o in e.outvars:
      if not isinstance(o, xc.DropVar):
        producer[o] = k

  # Rules 3-4: joins and equations without producers take their first consumer's layer.
  consumers: dict[int, list[int]] = {k: [] for k in range(len(J.eqns))}
  for k, e in enumerate(J.eqns):
    for v in e.invars:
      if isinstance(v, xc.Var) and v in producer:
        consumers[producer[v]].append(k)
  for k in reversed(range(len(J.eqns))):
    if desired[k] is None:
      desired[k] = next((desired[c] for c in consumers[k] if desired[c] is not None), fallback[k])

  # Rule 5: assign in program order, keeping the layer graph acyclic.
  free = _free_equations(J, is_param)
  q = nx.DiGraph()
  final: list[str] = []
  for k, e in enumerate(J.eqns):
    want = desired[k]
    if want is None:
      want = final[-1] if final else (next(iter(param_layers)) if param_layers else name)
    srcs = {final[producer[v]] for v in e.invars if isinstance(v, xc.Var) and v in producer}
    base = want.split("#")[0]
    cands = [want] + [n for n in q.nodes if n.split("#")[0] == base and n != want]
    if free[k]:
      cands[1:1] = [s for s in srcs if all(t == s or nx.has_path(q, t, s) for t in srcs)]
    chosen = None
    for c in cands:
      if c not in q or not any(s != c and s in q and nx.has_path(q, c, s) for s in srcs):
        chosen = c
        break
    if chosen is None:
      j = 2
      while f"{base}#{j}" in q:
        j += 1
      chosen = f"{base}#{j}"
    q.add_node(chosen)
    for s in srcs:
      if s != chosen:
        q.add_edge(s, chosen)
    final.append(chosen)

  # Rule 6: weight preprocessing (equations reading only parameters and literals, such as the
  # transpose of a tied embedding) moves to the one layer that consumes it, so the parameter
  # is shared with that layer instead of a transformed copy being sent per micro-batch.
  for k in reversed(range(len(J.eqns))):
    ins = [v for v in J.eqns[k].invars if isinstance(v, xc.Var)]
    if not ins or not all(v in is_param for v in ins):
      continue
    targets = {final[c] for c in consumers[k]}
    if len(targets) == 1 and final[k] not in targets:
      final[k] = targets.pop()
  # A parameter is owned by the layer its first reader ended up in.
  first_reader: dict[int, int] = {}
  for k, e in enumerate(J.eqns):
    for v in e.invars:
      if isinstance(v, xc.Var) and v in is_param:
        first_reader.setdefault(is_param[v], k)
  param_layer = {i: final[k] for i, k in first_reader.items()}

  graph = _annotate(closed, final, param_layer, batch_size, name)
  _name_by_parameters(graph, param_layer, param_paths)
  for l in graph:
    graph.nodes[l]["free"] = all(f for f, m in zip(free, final) if m == l)
  plist = tuple(
    param_layer.get(i) if param_paths[i] is not None else None for i in range(len(J.invars))
  )
  # Parameters no equation reads still need an owner: the first layer.
  first = lg.topo_layers(graph)[0] if graph.number_of_nodes() else name
  plist = tuple(
    p if p is not None or param_paths[i] is None else first for i, p in enumerate(plist)
  )
  return Layering(eqn_layer=tuple(final), param_layer=plist, graph=graph)


def _name_by_parameters(g: nx.DiGraph, param_layer, param_paths) -> None:
  """Sets each layer's ``param_path``: where its parameters sit in the parameter tree (the
  common prefix of their paths), e.g. ``encoder/Dense_0`` for the Linen layer
  ``Model/Model.encode/encoder/Dense_0``; a ``#k`` sibling takes its first layer's path."""
  owned: dict[str, list[list[str]]] = {}
  for i, l in param_layer.items():
    if param_paths[i]:
      owned.setdefault(l, []).append(param_paths[i].split("/"))
  for l, paths in owned.items():
    common = paths[0]
    for p in paths[1:]:
      n = 0
      while n < min(len(common), len(p)) and common[n] == p[n]:
        n += 1
      common = common[:n]
    if common and "/".join(common) != l:
      g.nodes[l]["param_path"] = "/".join(common)
  for l in g:
    base, _, k = l.partition("#")
    if k and "param_path" not in g.nodes[l] and "param_path" in g.nodes.get(base, {}):
      g.nodes[l]["param_path"] = f"{g.nodes[base]['param_path']}#{k}"


def _free_equations(J: xc.Jaxpr, is_param) -> list[bool]:
  """Whether each equation is free of parameters: it reads no parameter, and no weight derived
  from parameters alone (a transposed tied embedding) next to an activation.

  Parameter-free equations (a KL term over an encoder's output, the sum of a weight penalty,
  the loss's final add) may join the layer holding the last of their inputs instead of
  opening a ``#k`` sibling of an early layer."""
  derived: set[xc.Var] = set()  # parameters and values computed from parameters alone
  free: list[bool] = []
  for e in J.eqns:
    ins = [v for v in e.invars if isinstance(v, xc.Var)]
    from_params = [v in is_param or v in derived for v in ins]
    weight = any(v in derived and getattr(v.aval, "shape", ()) for v in ins)
    free.append(not any(v in is_param for v in ins) and not (weight and not all(from_params)))
    if ins and all(from_params):
      derived.update(o for o in e.outvars if not isinstance(o, xc.DropVar))
  return free


def _annotate(closed, eqn_layer, param_layer, batch_size, name) -> nx.DiGraph:
  J = closed.jaxpr
  g = lg.new_layer_graph(name, batch_size)
  order: dict[str, int] = {}
  for l in eqn_layer:
    order.setdefault(l, len(order))
  for l, o in order.items():
    lg.add_layer(g, l, lg.LayerCost(saved_bytes=0.0), order=o)
  producer: dict[xc.Var, str] = {}
  exported: dict[str, set] = {l: set() for l in order}
  for e, l in zip(J.eqns, eqn_layer):
    d = g.nodes[l]
    d["flops"] += eqn_flops(e)
    d["bytes"] += eqn_bytes(e)
    d["saved_bytes"] += sum(aval_bytes(o.aval) for o in e.outvars)
    d["num_eqns"] = d.get("num_eqns", 0) + 1
    seen_here = set()
    for v in e.invars:
      if isinstance(v, xc.Var) and v in producer and producer[v] != l and v not in seen_here:
        seen_here.add(v)
        src = producer[v]
        key = (v, l)
        if key not in exported[src]:
          exported[src].add(key)
          lg.add_edge(g, src, l, aval_bytes(v.aval))
    for o in e.outvars:
      if not isinstance(o, xc.DropVar):
        producer[o] = l
  for v in J.outvars:
    if isinstance(v, xc.Var) and v in producer:
      exported[producer[v]].add((v, "<out>"))
  for l, vs in exported.items():
    g.nodes[l]["act_bytes"] = float(sum(aval_bytes(v.aval) for v in {v for v, _ in vs}))
  for i, l in param_layer.items():
    g.nodes[l]["param_bytes"] += aval_bytes(J.invars[i].aval)
  lg.validate_layer_graph(g)
  return g
