"""Staging pass: (inlined loss ClosedJaxpr, Layering, Plan) -> StagedProgram.

The loss jaxpr is split into one sub-jaxpr per stage with explicit cut-edge inputs and outputs.
Each stage's inputs are, in order: its differentiable inputs (floating parameters, then floating
activations from other stages) and its non-differentiable inputs (batch data, keys, constants,
integer activations). Its outputs are the values other stages read plus the loss outputs it
produces. A parameter lives on one owner stage (the stage of the layer that owns it); other
stages that read it receive a copy once per step and send their gradient back to the owner.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as xc
from jax.sharding import PartitionSpec

from gpp_jax.errors import CaptureError, PlanError
from gpp_jax.ir.plan import Plan
from gpp_jax.ir.staged import InputRef, OutputRef, StagedProgram, StageProgram
from gpp_jax.passes.backward_split import SplitBackward
from gpp_jax.passes.capture import host_constant

_BOUNDARY_UNSUPPORTED = {"token", "ref"}


def _is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating) or jnp.issubdtype(aval.dtype, jnp.complexfloating)


def stage_program(
  closed: xc.ClosedJaxpr, eqn_layer: Sequence[str], param_layer: Sequence[str | None], plan: Plan
) -> StagedProgram:
  """Splits the loss jaxpr by ``plan`` into per-stage sub-jaxprs with cut edges."""
  J = closed.jaxpr
  where = plan.stage_of_layer()
  try:
    eqn_stage = [where[l] for l in eqn_layer]
  except KeyError as err:
    raise PlanError(f"layer {err.args[0]!r} is in no stage of the plan") from None
  S = plan.num_stages
  param_owner = tuple(where[p] if p is not None else -1 for p in param_layer)
  for i, v in enumerate(J.invars):
    if param_owner[i] >= 0 and not _is_float(v.aval):
      raise CaptureError(
        f"parameter input {i} has dtype {v.aval.dtype}; only floating-point "
        "parameters can be differentiated (pass integer state outside the "
        "differentiated argument)"
      )
  defined: dict[xc.Var, int] = {}
  for e, s in zip(J.eqns, eqn_stage):
    for o in e.outvars:
      if not isinstance(o, xc.DropVar):
        defined[o] = s
  invar_index = {v: i for i, v in enumerate(J.invars)}
  const_index = {v: i for i, v in enumerate(J.constvars)}
  consumers: dict[xc.Var, set[int]] = {}
  for e, s in zip(J.eqns, eqn_stage):
    for a in e.invars:
      if isinstance(a, xc.Var) and a in defined and defined[a] != s:
        consumers.setdefault(a, set()).add(s)
        if any(x in str(a.aval) for x in _BOUNDARY_UNSUPPORTED):
          raise CaptureError(
            f"value of type {a.aval} crosses from stage {defined[a]} to stage "
            f"{s}; it cannot be transferred between devices. Put the layers "
            "that produce and consume it in the same stage."
          )
  loss_pos: dict[xc.Var, list[int]] = {}
  for k, v in enumerate(J.outvars):
    if not isinstance(v, xc.Var) or v not in defined:
      raise CaptureError(
        f"loss output {k} ({v}) is a constant or an input passed through unchanged; the loss "
        "function must compute its outputs from the model (return e.g. a mean of per-example "
        "losses)"
      )
    loss_pos.setdefault(v, []).append(k)
  vid: dict[xc.Var, int] = {}
  for e in J.eqns:
    for o in e.outvars:
      if not isinstance(o, xc.DropVar):
        vid[o] = len(vid)

  stages, edges = [], set()
  out_pos: dict[xc.Var, tuple[int, int]] = {}
  loss_outputs: list[tuple[int, int] | None] = [None] * len(J.outvars)
  for s in range(S):
    eqns = [e for e, t in zip(J.eqns, eqn_stage) if t == s]
    if not eqns:
      raise PlanError(
        f"stage {s} computes nothing: no equation of the loss falls into its "
        f"layers {plan.stages[s].layers}; remove the stage or give it layers"
      )
    seen, ins, refs, consts = set(), [], [], []
    for e in eqns:
      for a in e.invars:
        if not isinstance(a, xc.Var) or a in seen or defined.get(a) == s:
          continue
        seen.add(a)
        if a in const_index:
          consts.append(a)
          continue
        if a in invar_index:
          i = invar_index[a]
          kind = "param" if param_owner[i] >= 0 else "data"
          refs.append(InputRef(kind, i, diff=kind == "param"))
        else:
          p = defined[a]
          edges.add((p, s))
          refs.append(InputRef("act", vid[a], src=p, diff=_is_float(a.aval)))
        ins.append(a)
    # Differentiable inputs first: parameters, then activations.
    order = sorted(range(len(ins)), key=lambda k: (not refs[k].diff, refs[k].kind != "param", k))
    ins = [ins[k] for k in order]
    refs = [refs[k] for k in order]
    outs: list[xc.Var] = []
    orefs: list[OutputRef] = []
    for e in eqns:
      for o in e.outvars:
        if isinstance(o, xc.DropVar):
          continue
        cons = tuple(sorted(consumers.get(o, ())))
        if cons or o in loss_pos:
          out_pos[o] = (s, len(outs))
          for k in loss_pos.get(o, ()):
            loss_outputs[k] = (s, len(outs))
          outs.append(o)
          orefs.append(OutputRef(vid[o], cons, loss_pos.get(o, [-1])[0], _is_float(o.aval)))
    cvals = [host_constant(closed.consts[const_index[c]]) for c in consts]
    dbg = xc.DebugInfo(
      "graph_pipeline",
      f"stage{s}",
      tuple(f"in{i}" for i in range(len(ins))),
      tuple(f"out{i}" for i in range(len(outs))),
    )
    effects = frozenset().union(*[e.effects for e in eqns])
    if effects:
      prims = sorted({e.primitive.name for e in eqns if e.effects})
      raise CaptureError(
        f"unsupported primitive {', '.join(prims)} in stage {s}: it has side "
        "effects, and a pipelined loss function must be pure. Remove debug "
        "prints and callbacks from the loss (return values as aux instead)."
      )
    sub = xc.Jaxpr(consts, ins, outs, eqns, effects, debug_info=dbg)
    stages.append(
      StageProgram(
        s,
        xc.ClosedJaxpr(sub, cvals),
        tuple(refs),
        tuple(orefs),
        sum(r.diff for r in refs),
        len(eqns),
      )
    )
  if edges - set(plan.edges):
    raise PlanError(
      f"the program needs stage edges {sorted(edges - set(plan.edges))} that the "
      "plan lacks; rebuild the plan from this model's layer graph"
    )
  placed_loss_outputs: list[tuple[int, int]] = []
  for lo in loss_outputs:
    assert lo is not None  # every loss output is defined (checked above), so some stage has it
    placed_loss_outputs.append(lo)
  return StagedProgram(tuple(stages), param_owner, tuple(placed_loss_outputs), tuple(sorted(edges)))


# ----------------------------------------------------------------------------- executables


def _zeros_ct(aval):
  if _is_float(aval):
    return jnp.zeros(aval.shape, aval.dtype)
  return np.zeros(aval.shape, dtype=jax.dtypes.float0)


@dataclasses.dataclass
class StageFunctions:
  """Jitted forward/backward of one stage.

  fwd(diff, nondiff) -> (outputs, residuals)
  bwd(residuals, cts, acc) -> (acc + parameter grads, activation cotangents)
  where ``cts[k]`` is a tuple of cotangent contributions for output k (summed inside; empty for
  an output nobody differentiates) and ``acc`` the running parameter-gradient sums.

  The backward split in two, for schedules with W actions (zero-bubble; see
  ``passes/backward_split.py``): ``bwd_input(residuals, cts) -> (activation cotangents, kept)``
  (B) and ``bwd_weight(residuals, cts, kept, acc) -> acc + parameter grads`` (W), where
  ``kept`` are the values of B's part of the backward that W reads (so nothing is computed
  twice). Packed stages take ``pparams`` after the residuals, as ``bwd`` does.
  """

  fwd: Callable[..., Any]
  bwd: Callable[..., Any]
  zeros_acc: Callable[..., Any]
  # The accumulator -> the parameter gradients, one array each.
  acc_leaves: Callable[..., Any] | None = None
  # Set when the stage is packed: parameters -> the packed form that ``fwd(pparams, acts,
  # nondiff)`` and ``bwd(res, pparams, cts, acc)`` take.
  pack_params: Callable[..., Any] | None = None
  bwd_input: Callable[..., Any] | None = None
  bwd_weight: Callable[..., Any] | None = None


def _pack(leaves, keep=(), params=(), limit=None):
  """Arrays -> (one flat buffer per dtype, the arrays kept apart), and the static layout
  ``_unpack`` needs. Kept apart: arrays of extended dtypes (keys), arrays larger than ``limit``
  bytes, and those whose ``id`` is in ``keep`` (a forward's own inputs among its residuals:
  returned as they are, jit forwards them without a copy, where packing would copy every
  weight once per micro-batch in flight)."""
  param_index = {id(x): i for i, x in enumerate(params)}
  refs = [param_index.get(id(x)) for x in leaves]
  apart_mask = [id(x) in keep or i is not None for x, i in zip(leaves, refs)]
  leaves = [jnp.asarray(x) for x in leaves]
  layout, napart = [], 0
  for i, entry in zip(refs, _layout(leaves, apart_mask, limit)):
    if i is not None:
      entry = ("param", i, None)
    elif entry[0] is None:
      entry, napart = (None, napart, None), napart + 1
    layout.append(entry)
  layout = tuple(layout)
  flat, apart = {}, []
  for x, (key, _, _) in zip(leaves, layout):
    if key is None:
      apart.append(x)
    elif key != "param":
      flat.setdefault(key, []).append(x.reshape(-1))
  bufs = {k: v[0] if len(v) == 1 else jnp.concatenate(v) for k, v in flat.items()}
  return (bufs, apart), layout


def _layout(avals, apart=None, limit=None):
  """(dtype name, offset, shape) per array, or (None, index, None) for one kept apart (marked
  in ``apart``, of an extended dtype, or larger than ``limit`` bytes)."""
  layout, sizes, napart = [], {}, 0
  for i, a in enumerate(avals):
    if (
      (apart is not None and apart[i])
      or jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
      or (limit is not None and np.prod(a.shape, dtype=np.int64) * a.dtype.itemsize > limit)
    ):
      layout.append((None, napart, None))
      napart += 1
      continue
    key = str(a.dtype)
    layout.append((key, sizes.get(key, 0), tuple(a.shape)))
    sizes[key] = sizes.get(key, 0) + int(np.prod(a.shape, dtype=np.int64))
  return tuple(layout)


def _unpack(packed, layout, params=()):
  bufs, apart = packed
  out = []
  for key, off, shape in layout:
    if key is None:
      out.append(apart[off])
    elif key == "param":
      out.append(params[off])
    else:
      size = int(np.prod(shape, dtype=np.int64))
      out.append(jax.lax.slice(bufs[key], (off,), (off + size,)).reshape(shape))
  return out


def stage_functions(
  stage: StageProgram,
  remat: bool = False,
  pack_residuals: bool = False,
  pack_limit: int | None = None,
  param_shardings: Sequence[Any] | None = None,
) -> StageFunctions:
  """Builds the jitted forward, backward and accumulator-init functions of a stage.

  With ``pack_residuals`` the forward returns its vjp residuals as one flat buffer per dtype
  instead of hundreds of arrays, and takes the parameters packed the same way: every array a
  call takes or returns costs host time in the runtime (tens of microseconds each on a GPU),
  which made dispatch, not the device, the limit for large stages. Only for stages on one
  device (a concatenation would gather sharded ones). Packing copies what it packs, so arrays
  larger than ``pack_limit`` bytes (None: no limit) stay apart: copying them would cost more
  device time than their dispatch costs host time (see ``placement.pack_limit``).
  ``param_shardings``: per parameter, where it lives (a stage over several devices); the
  gradient sums are held there too, so the optimizer's update reads them as they lie.
  """
  f = xc.jaxpr_as_fun(stage.jaxpr)
  out_avals = [v.aval for v in stage.jaxpr.jaxpr.outvars]
  in_avals = [v.aval for v in stage.jaxpr.jaxpr.invars]
  nparam = sum(1 for r in stage.inputs if r.kind == "param")

  def call(diff, nondiff):
    return f(*diff, *nondiff)

  def cotangents(cts):
    return [sum(c[1:], c[0]) if c else _zeros_ct(a) for c, a in zip(cts, out_avals)]

  def finish(grads, acc):
    sums = [a + g for a, g in zip(acc, grads[:nparam])]
    if param_shardings is not None:
      sums = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(sums, param_shardings)]
    return (sums, list(grads[nparam:]))

  if remat:

    def fwd(diff, nondiff):
      return call(diff, nondiff), (diff, nondiff)

    def grads_of(res, cts):
      diff, nondiff = res
      _, vjp = jax.vjp(lambda *d: call(d, nondiff), *diff)
      return vjp(cotangents(cts))

    def bwd(res, cts, acc):
      return finish(grads_of(res, cts), acc)
  elif pack_residuals:
    residuals = {}  # the vjp's tree and layout, recorded when the forward is traced
    acc_layout = _layout(in_avals[:nparam], limit=pack_limit)

    def finish(grads, acc):  # the accumulator is packed like the residuals
      bufs, apart = acc
      (gbufs, gapart), _ = _pack(grads[:nparam], limit=pack_limit)
      summed = ({k: bufs[k] + gbufs[k] for k in bufs}, [a + g for a, g in zip(apart, gapart)])
      return summed, list(grads[nparam:])

    # The parameters come packed too (``pack_params``, once per step): the forward unpacks
    # them, and the backward takes them again instead of residual copies of the weights.
    def fwd_packed(pparams, acts, nondiff):
      params = _unpack(pparams, acc_layout)
      outs, vjp = jax.vjp(lambda *d: call(d, nondiff), *params, *acts)
      leaves, residuals["tree"] = jax.tree.flatten(vjp)
      packed, residuals["layout"] = _pack(
        leaves, keep={id(x) for x in (*acts, *nondiff)}, params=params, limit=pack_limit
      )
      return outs, packed

    def grads_packed(packed, pparams, cts):
      params = _unpack(pparams, acc_layout)
      vjp = jax.tree.unflatten(residuals["tree"], _unpack(packed, residuals["layout"], params))
      return vjp(cotangents(cts))

    def bwd_packed(packed, pparams, cts, acc):
      return finish(grads_packed(packed, pparams, cts), acc)
  else:

    def fwd(diff, nondiff):
      return jax.vjp(lambda *d: call(d, nondiff), *diff)

    def grads_of(vjp, cts):
      return vjp(cotangents(cts))

    def bwd(vjp, cts, acc):
      return finish(grads_of(vjp, cts), acc)

  def zeros_acc():
    zeros = [jnp.zeros(a.shape, a.dtype) for a in in_avals[:nparam]]
    return _pack(zeros, limit=pack_limit)[0] if pack_residuals and not remat else zeros

  if pack_residuals and not remat:
    split = SplitBackward(grads_packed, nparam, lambda grads, acc: finish(grads, acc)[0])
    acc_leaves = jax.jit(lambda acc: _unpack(acc, acc_layout))
    pack_params = jax.jit(lambda params: _pack(params, limit=pack_limit)[0])
    return StageFunctions(
      jax.jit(fwd_packed),
      jax.jit(bwd_packed, donate_argnums=(3,)),
      zeros_acc,
      acc_leaves,
      pack_params,
      split.bwd_input,
      split.bwd_weight,
    )
  split = SplitBackward(grads_of, nparam, lambda grads, acc: finish(grads, acc)[0])
  return StageFunctions(
    jax.jit(fwd),
    jax.jit(bwd, donate_argnums=(2,)),
    zeros_acc,
    lambda acc: acc,
    bwd_input=split.bwd_input,
    bwd_weight=split.bwd_weight,
  )


@dataclasses.dataclass(frozen=True)
class BatchFlags:
  """Per input and per output of a stage, whether it carries the micro-batch as its leading
  axis (``runtime.stage.row_batch_flags``).

  Attributes:
    inputs: per input of the stage.
    outputs: per output of the stage.
  """

  inputs: tuple[bool, ...]
  outputs: tuple[bool, ...]


def row_local_functions(
  stage: StageProgram,
  mesh: Any,
  batch: BatchFlags,
  param_shardings: Sequence[Any],
  acc_shardings: Sequence[Any],
) -> StageFunctions:
  """A data-parallel stage's functions with its gradients reduced once per step.

  ``stage`` is the stage's program traced at a row's share of the micro-batch (micro-batch /
  rows, the size of ``mesh``'s first axis). The forward and backward run it on every row of
  that axis at once, as a ``shard_map`` manual over that axis only (the other axes stay
  GSPMD's: the model's tensor parallelism inside a row is unchanged): each row computes its
  own examples, and its parameter gradients are added to its own slice of the gradient sums,
  shaped ``(rows, *parameter)`` and sharded over the rows, so no collective over the rows runs
  in the backward. ``acc_leaves`` (the UPDATE) sums the slices: one all-reduce per step, or a
  reduce-scatter where the parameter is sharded over the rows. ``param_shardings`` and
  ``acc_shardings``: where the stage's parameters and its gradient sums sit.

  ``batch``: per input / output of the stage, whether it carries the micro-batch as its
  leading axis (split over the rows); every other output must be the loss, a mean over the
  examples (the mean of the rows' means). The signatures are those of ``stage_functions``'
  unpacked stage; the residuals keep the parameters themselves (the forward's inputs, passed
  through without a copy) and each row's vjp residuals stacked.
  """
  axis = mesh.axis_names[0]
  rows = mesh.shape[axis]
  batch_in, batch_out = batch.inputs, batch.outputs
  f = xc.jaxpr_as_fun(stage.jaxpr)
  out_avals = [v.aval for v in stage.jaxpr.jaxpr.outvars]
  in_avals = [v.aval for v in stage.jaxpr.jaxpr.invars]
  nparam = sum(1 for r in stage.inputs if r.kind == "param")
  ndiff = stage.num_diff
  row = PartitionSpec(axis)
  manual = functools.partial(
    jax.shard_map, mesh=mesh, axis_names=frozenset({axis}), check_vma=False
  )
  layout: dict[str, Any] = {}  # the vjp's tree and where the parameters sit in it (traced)

  def split(values, batch):
    return tuple(row if b else PartitionSpec() for b in batch[: len(values)]) if values else ()

  def fwd(diff, nondiff):
    params, acts = list(diff[:nparam]), list(diff[nparam:])

    def body(params, acts, nondiff):
      outs, vjp = jax.vjp(lambda *d: f(*d, *nondiff), *params, *acts)
      leaves, layout["tree"] = jax.tree.flatten(vjp)
      ids = {id(p): i for i, p in enumerate(params)}
      layout["refs"] = [ids.get(id(x)) for x in leaves]
      kept = [x[None] for x in leaves if id(x) not in ids]
      return [o if b else o[None] for o, b in zip(outs, batch_out)], kept

    in_specs = (
      (PartitionSpec(),) * len(params),
      split(acts, batch_in[nparam:ndiff]),
      split(nondiff, batch_in[ndiff:]),
    )
    outs, kept = manual(body, in_specs=in_specs, out_specs=([row] * len(out_avals), row))(
      tuple(params), tuple(acts), tuple(nondiff)
    )
    outs = [o if b else jnp.mean(o, axis=0) for o, b in zip(outs, batch_out)]
    return outs, (tuple(params), kept)

  def bwd(res, cts, acc):
    params, kept = res
    summed = [sum(c[1:], c[0]) if c else _zeros_ct(a) for c, a in zip(cts, out_avals)]
    # A loss output is each row's mean: its cotangent reaches every row divided by the rows.
    local = [
      c if b else jnp.broadcast_to(c / rows, (rows, *np.shape(c)))
      for c, b in zip(summed, batch_out)
    ]

    def body(params, kept, cts, acc):
      it = iter(kept)
      leaves = [params[i] if i is not None else next(it)[0] for i in layout["refs"]]
      vjp = jax.tree.unflatten(layout["tree"], leaves)
      grads = vjp([c if b else c[0] for c, b in zip(cts, batch_out)])
      new = [a + g[None] for a, g in zip(acc, grads[:nparam])]
      ins = [g if b else g[None] for g, b in zip(grads[nparam:], batch_in[nparam:ndiff])]
      return new, ins

    in_specs = ((PartitionSpec(),) * len(params), row, [row] * len(local), [row] * len(acc))
    new, ins = manual(body, in_specs=in_specs, out_specs=([row] * len(acc), row))(
      tuple(params), kept, local, list(acc)
    )
    new = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(new, acc_shardings)]
    ins = [g if b else jnp.sum(g, axis=0) for g, b in zip(ins, batch_in[nparam:ndiff])]
    return new, ins

  def zeros_acc():
    return [jnp.zeros((rows, *a.shape), a.dtype) for a in in_avals[:nparam]]

  def acc_leaves(acc):
    return [jnp.sum(a, axis=0) for a in acc]

  return StageFunctions(
    jax.jit(fwd),
    jax.jit(bwd, donate_argnums=(2,)),
    zeros_acc,
    jax.jit(acc_leaves, out_shardings=list(param_shardings)),
  )
