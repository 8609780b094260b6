"""What each layer of a captured step holds in memory besides its parameters, for the cost
model: the LayerGraph's ``step_memory`` attribute (``cost.cost_model``, ``LayerCosts``).

A layer's ``saved_bytes`` counts every value its forward computes, far more than a stage
keeps for its backward, and the cost model's fixed factors (a gradient and two optimizer
moments per parameter byte) are Adam's, whatever the step's optimizer is. The captured step
knows better, per layer, at the traced micro-batch size (``batch_size``):

* ``residuals``: bytes of its vjp residuals (what ``jax.vjp`` of the layer alone keeps for
  the backward, its parameters left out: the stage holds those anyway), the layer's inputs
  among them; of which ``packed_residuals``: the arrays that are not inputs and of at most
  ``pack_limit`` bytes, which a stage on one device packs into one buffer per dtype in its
  forward (``passes.staging.stage_functions``: built in the executable's temporaries, then
  copied out), and ``kept_inputs``: per layer whose outputs it keeps, the bytes of those of at
  most ``pack_limit`` bytes (packed too where that layer runs in the same stage);
* ``state``: bytes of the step's other non-batch arguments that live with the layer (the
  optimizer's state, by the rule ``passes.step_split`` places the step's equations with:
  where the parameter or gradient an equation reads lives);
* ``batch``: bytes of the batch arrays the layer is the first to read;

and ``one_call``: whether a plan of one stage runs as one call of the whole step
(``runtime.build.fuses``: the micro-batches' residuals then live in that executable's
temporaries, one micro-batch at a time), except under the ``stale_schedules``.

Each layer is traced once as a stage of its own (``passes.staging.stage_program``), not
compiled; layers whose stage programs print alike are traced once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as xc

from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.passes.costs import aval_bytes
from gpp_jax.passes.lowering import BATCH
from gpp_jax.passes.staging import StageProgram, stage_program
from gpp_jax.passes.weight_versions import ASYNC_SCHEDULES


def step_memory(captured: Any, pack_limit: int, fuse: bool = True) -> dict[str, Any]:
  """The ``step_memory`` graph attribute of a ``runtime.captured.Captured`` (see the module
  docstring); ``pack_limit``: the largest array a stage on one device packs
  (``runtime.placement.pack_limit``); ``fuse``: whether one-stage plans may run as one call
  (``Options.fuse``)."""
  lay = captured.layering
  g = lay.graph
  layers = topo_layers(g)
  index = {l: i for i, l in enumerate(layers)}
  plan = Plan(
    tuple(Stage(i, (l,), (0,)) for i, l in enumerate(layers)),
    tuple(sorted({(index[u], index[v]) for u, v in g.edges})),
    1,
  )
  staged = stage_program(captured.loss, lay.eqn_layer, lay.param_layer, plan)
  split = captured.scan_split
  roles = [r for r, ks in zip(captured.roles, split.parts) for _ in ks]
  invars = captured.loss.jaxpr.invars
  residuals: dict[str, int] = {}
  packed: dict[str, int] = {}
  batch: dict[str, int] = {}
  seen_batch: set[int] = set()
  kept_inputs: dict[str, dict[str, int]] = {}
  traced: dict[str, tuple[int, int, dict[int, int]]] = {}
  for st in staged.stages:
    layer = layers[st.index]
    key = str(st.jaxpr) + repr([(r.diff, r.kind) for r in st.inputs])
    if key not in traced:
      traced[key] = _residual_bytes(st, pack_limit)
    residuals[layer], packed[layer], kept = traced[key]
    for k, n in kept.items():
      r = st.inputs[k]
      if r.kind == "act" and r.src >= 0:
        src = kept_inputs.setdefault(layer, {})
        src[layers[r.src]] = src.get(layers[r.src], 0) + n
    for r in st.inputs:
      if r.kind == "data" and roles[r.index] == BATCH and r.index not in seen_batch:
        seen_batch.add(r.index)
        batch[layer] = batch.get(layer, 0) + aval_bytes(invars[r.index].aval)
  return {
    "batch_size": captured.microbatch_size,
    "residuals": residuals,
    "packed_residuals": packed,
    "kept_inputs": kept_inputs,
    "state": state_homes(captured),
    "batch": batch,
    "one_call": bool(fuse and not captured.state),
    "stale_schedules": list(ASYNC_SCHEDULES),
  }


def _residual_bytes(st: StageProgram, pack_limit: int) -> tuple[int, int, dict[int, int]]:
  """A one-layer stage's vjp residuals, its parameters left out: (their bytes, the bytes a
  packed stage packs of those that are not its inputs (each at most ``pack_limit`` bytes),
  per input position the bytes of it kept that a packed stage would pack were the input
  computed inside it)."""
  f = xc.jaxpr_as_fun(st.jaxpr)
  avals = [v.aval for v in st.jaxpr.jaxpr.invars]
  nparam = len(st.param_inputs)
  where: list[int] = []  # per residual: the input it is, or -1

  def fwd(diff, nondiff):
    _, vjp = jax.vjp(lambda *d: f(*d, *nondiff), *diff)
    leaves = jax.tree.leaves(vjp)
    mine = {id(x) for x in diff[:nparam]}
    inputs = {id(x): k for k, x in enumerate((*diff, *nondiff))}
    kept = [x for x in leaves if id(x) not in mine]
    where[:] = [inputs.get(id(x), -1) for x in kept]
    return kept

  kept = jax.eval_shape(fwd, avals[: st.num_diff], avals[st.num_diff :])
  sizes = [_nbytes(x) for x in kept]
  small = [
    n <= pack_limit and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    for n, x in zip(sizes, kept)
  ]
  packed = sum(n for n, k, ok in zip(sizes, where, small) if ok and k < 0)
  inputs: dict[int, int] = {}
  for n, k, ok in zip(sizes, where, small):
    if ok and k >= 0:
      inputs[k] = inputs.get(k, 0) + n
  return sum(sizes), packed, inputs


def _nbytes(x: Any) -> int:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    return aval_bytes(x)
  return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def state_homes(captured: Any) -> dict[str, int]:
  """Bytes of the step's non-parameter, non-batch arguments (the optimizer's state, other
  state) per layer they live with: the rule ``passes.step_split.split_step`` places the step
  with, over layers instead of stages. A parameter and its gradient live with the layer
  owning it, the loss with the layer computing it; an equation lives with the largest of its
  inputs that has a home (else with its first consumer), a step argument with its first
  reader; what has none of these lives with the first layer (``split_step``'s first stage)."""
  J = captured.step.jaxpr
  marker = captured.marker
  lay = captured.layering
  split = captured.scan_split
  nparam = captured.nparam
  param_layer = [lay.param_layer[ks[0]] for ks in split.parts[:nparam]]
  loss_layer = _loss_layers(captured)
  first = topo_layers(lay.graph)[0]
  home: dict[Any, str] = {}
  nloss = len(split.out_parts)
  for k, v in enumerate(marker.outvars):
    owner = loss_layer[k] if k < nloss else param_layer[k - nloss]
    if isinstance(v, xc.Var) and owner is not None:
      home[v] = owner
  for v, owner in zip(marker.invars[:nparam], param_layer):
    if isinstance(v, xc.Var) and owner is not None:
      home.setdefault(v, owner)
  eqns = J.eqns
  eqn_home: list[str | None] = [None] * len(eqns)
  for k, e in enumerate(eqns):
    if k == captured.marker_index:
      continue
    known = [
      (aval_bytes(v.aval), len(getattr(v.aval, "shape", ())), home[v])
      for v in e.invars
      if isinstance(v, xc.Var) and v in home
    ]
    outs = [home[o] for o in e.outvars if not isinstance(o, xc.DropVar) and o in home]
    h = outs[0] if outs else max(known, key=lambda t: t[:2])[2] if known else None
    eqn_home[k] = h
    if h is not None:
      for o in e.outvars:
        if not isinstance(o, xc.DropVar):
          home.setdefault(o, h)
  readers: dict[Any, list[int]] = {}
  for k, e in enumerate(eqns):
    for v in e.invars:
      if isinstance(v, xc.Var):
        readers.setdefault(v, []).append(k)
  for k in reversed(range(len(eqns))):
    if eqn_home[k] is None and k != captured.marker_index:
      later = [
        eqn_home[c] for o in eqns[k].outvars if isinstance(o, xc.Var) for c in readers.get(o, ())
      ]
      eqn_home[k] = next((h for h in later if h is not None), first)
  params = {v for v in marker.invars[:nparam] if isinstance(v, xc.Var)}
  skip = set(captured.batch_leaves)
  out: dict[str, int] = {}
  for i, v in enumerate(J.invars):
    if i in skip or v in params:
      continue
    h = home.get(v)
    if h is None:
      h = next(
        (eqn_home[k] for k in readers.get(v, ()) if eqn_home[k] is not None),
        None,
      )
    if h is not None:
      out[h] = out.get(h, 0) + aval_bytes(v.aval)
  return out


def _loss_layers(captured: Any) -> Sequence[str | None]:
  """Per output of the captured loss (before the scan split), the layer computing it."""
  J = captured.loss.jaxpr
  eqn_layer = captured.layering.eqn_layer
  producer = {o: eqn_layer[k] for k, e in enumerate(J.eqns) for o in e.outvars}
  out: list[str | None] = []
  for parts in captured.scan_split.out_parts:
    v = J.outvars[parts[0]]
    out.append(producer.get(v) if isinstance(v, xc.Var) else None)
  return out
