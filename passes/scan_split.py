"""Scan-split pass: inlined loss ClosedJaxpr -> the same loss with scans over stacked parameters
unrolled into one block of equations per iteration, and the stacked parameters sliced.

Large models stack their identical layers (Linen ``nn.scan``, ``nnx.scan``, ``jax.lax.scan``
over a stacked pytree): the parameters of all layers are one array with a leading layer axis,
scanned over. A scan is a single equation, so the planner could not cut between its layers.
This pass replaces every top-level ``scan`` that reads a parameter of the loss as a scanned-over
input (``xs``) by its iterations, each with its own name-stack scope (``<scan>/<i>``), so that
layering makes one layer per iteration; each such stacked parameter becomes one input per
iteration (its slice), which lets each stage own only the slices of its own layers. Other
scanned-over inputs are indexed per iteration, stacked outputs are stacked again.

The result computes the same values (the same equations, in the same order); only the
parameter inputs change, as ``ScanSplit`` records, so the runtime slices the stacked
parameters before the pipeline and stacks their gradients after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as xc
from jax.extend import source_info_util as siu
from jax.extend.core import primitives as P

from gpp_jax.ir.scan import ScanSplit
from gpp_jax.passes.capture import INLINED


def _scopes(ns) -> list[str]:
  return [s.name for s in ns.stack if type(s).__name__ == "Scope"]


def _name_stack(parts: Sequence[str]):
  ns = siu.NameStack()
  for p in parts:
    if p:
      ns = ns.extend(p)
  return ns


def _common_prefix(paths: Sequence[str]) -> str:
  split = [p.split("/") for p in paths if p]
  if not split:
    return ""
  out = []
  for comps in zip(*split):
    if len(set(comps)) != 1:
      break
    out.append(comps[0])
  return "/".join(out)


def scan_counts(e) -> tuple[int, int]:
  """(constants, carries) among a scan equation's operands, the rest being scanned over.

  JAX up to 0.11 records them as ``num_consts`` / ``num_carry``; 0.12 records the operand
  groups as the flat tree ``ft_in`` (constants, carries, scanned inputs).
  """
  if "num_consts" in e.params:
    return e.params["num_consts"], e.params["num_carry"]
  consts, carry, _ = e.params["ft_in"].unpack()  # a flat tree: len() counts operands
  return len(consts), len(carry)


def _scan_params(e, is_param: dict[xc.Var, int]) -> list[int]:
  """Positions (among the scan's operands) of splittable inputs (parameters, carried state)
  scanned over, stacked along axis 0."""
  start = sum(scan_counts(e))
  length = e.params["length"]
  return [
    k
    for k in range(start, len(e.invars))
    if isinstance(e.invars[k], xc.Var)
    and e.invars[k] in is_param
    and e.invars[k].aval.ndim >= 1
    and e.invars[k].aval.shape[0] == length
  ]


def split_scans(
  closed: xc.ClosedJaxpr,
  num_params: int,
  param_paths: Sequence[str],
  state: Sequence[tuple[int, int]] = (),
) -> tuple[xc.ClosedJaxpr, list[str], ScanSplit]:
  """Unrolls the scans over stacked parameters.

  Args:
    closed: the inlined loss; its first ``num_params`` inputs are the parameters.
    num_params: how many inputs are parameters.
    param_paths: the parameters' layer paths from their pytree paths.
    state: (input, output) pairs of state the loss carries between micro-batches. A state
      input scanned over by an unrolled scan is split like a parameter, and its output, when
      it is the scan's stacked per-iteration values, into one output per slice.

  Returns:
    the split loss (parameters first, one input per slice of a split input, then the other
    inputs in order), the split parameters' paths, and the ``ScanSplit``.
  """
  J = closed.jaxpr
  nin = len(J.invars)
  is_param = {v: i for i, v in enumerate(J.invars[:num_params])}
  splittable = dict(is_param)
  splittable.update({J.invars[j]: j for j, _ in state})
  lengths: dict[int, int] = {}
  for e in J.eqns:
    if e.primitive is P.scan_p and _scan_params(e, is_param):
      for k in _scan_params(e, splittable):
        i = splittable[e.invars[k]]
        if lengths.setdefault(i, e.params["length"]) != e.params["length"]:
          lengths[i] = 0  # scanned by scans of different lengths: not split
  lengths = {i: n for i, n in lengths.items() if n > 1}
  if not any(i < num_params for i in lengths):
    nout = len(J.outvars)
    return (
      closed,
      list(param_paths),
      ScanSplit(num_params, tuple((i,) for i in range(nin)), tuple((k,) for k in range(nout))),
    )

  parts: list[tuple[int, ...]] = []
  new_avals: list = []
  new_paths: list[str] = []
  for i, v in enumerate(J.invars):
    n = lengths.get(i, 1)
    base = len(new_avals)
    parts.append(tuple(range(base, base + n)))
    if n == 1:
      new_avals.append(v.aval)
    else:
      new_avals.extend([v.aval.update(shape=v.aval.shape[1:])] * n)
    if i < num_params:
      new_paths.extend([param_paths[i]] if n == 1 else [f"{param_paths[i]}/{k}" for k in range(n)])

  def run(*args):
    env: dict[xc.Var, object] = dict(zip(J.constvars, closed.consts))
    slices: dict[xc.Var, list] = {}
    for i, v in enumerate(J.invars):
      if len(parts[i]) == 1:
        env[v] = args[parts[i][0]]
      else:
        slices[v] = [args[k] for k in parts[i]]

    def read(a):
      if isinstance(a, xc.Literal):
        return a.val
      if a not in env:  # a split input read whole: stack its slices again
        env[a] = jnp.stack(slices[a])
      return env[a]

    for e in J.eqns:
      scanned = _scan_params(e, is_param) if e.primitive is P.scan_p else []
      scanned = [k for k in scanned if e.invars[k] in slices]
      if not scanned:
        outs = _eval_eqn(e, [read(a) for a in e.invars], lambda ns: ns)
      else:
        outs = _unroll(e, read, slices, param_paths, is_param)
      for o, val in zip(e.outvars, outs):
        if not isinstance(o, xc.DropVar):
          env[o] = val
    return [read(a) for a in J.outvars]

  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in new_avals]
  out = jax.make_jaxpr(run)(*specs)
  out, out_parts = _split_state_outputs(out, [(j, k) for j, k in state if j in lengths], lengths)
  return out, new_paths, ScanSplit(num_params, tuple(parts), out_parts)


def _split_state_outputs(closed, state, lengths):
  """Outputs that stack one value per scan iteration (the new value of split state) -> one
  output per iteration."""
  J = closed.jaxpr
  producer = {o: e for e in J.eqns for o in e.outvars if not isinstance(o, xc.DropVar)}
  split_out = {}
  for j, k in state:
    e = producer.get(J.outvars[k]) if isinstance(J.outvars[k], xc.Var) else None
    if (
      e is not None
      and e.primitive.name == "stack"
      and len(e.invars) == lengths[j]
      and e.params.get("axis", 0) == 0
      and all(isinstance(a, xc.Var) for a in e.invars)
    ):
      split_out[k] = list(e.invars)
  outvars, out_parts = [], []
  for k, v in enumerate(J.outvars):
    vs = split_out.get(k, [v])
    out_parts.append(tuple(range(len(outvars), len(outvars) + len(vs))))
    outvars.extend(vs)
  if not split_out:
    return closed, tuple(out_parts)
  dbg = xc.DebugInfo(
    "graph_pipeline",
    "loss",
    tuple(f"in{i}" for i in range(len(J.invars))),
    tuple(f"out{i}" for i in range(len(outvars))),
  )
  new = xc.Jaxpr(J.constvars, J.invars, outvars, J.eqns, J.effects, debug_info=dbg)
  return xc.ClosedJaxpr(new, closed.consts), tuple(out_parts)


def _eval_eqn(e, ins, rename: Callable):
  """Binds one equation under the name stack ``rename`` gives it, inlining nested calls."""
  ns = rename(e.source_info.name_stack)
  if e.primitive in INLINED:
    sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
    jaxpr, consts = (sub.jaxpr, sub.consts) if isinstance(sub, xc.ClosedJaxpr) else (sub, ())
    return _eval_jaxpr(jaxpr, consts, ins, lambda inner: rename(e.source_info.name_stack + inner))
  bind_params = e.primitive.get_bind_params(e.params)
  with siu.user_context(e.source_info.traceback, name_stack=ns), e.ctx.manager:
    outs = e.primitive.bind(*ins, **bind_params)
  return outs if e.primitive.multiple_results else [outs]


def _eval_jaxpr(jaxpr, consts, args, rename: Callable):
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(a):
    return a.val if isinstance(a, xc.Literal) else env[a]

  for e in jaxpr.eqns:
    for o, val in zip(e.outvars, _eval_eqn(e, [read(a) for a in e.invars], rename)):
      if not isinstance(o, xc.DropVar):
        env[o] = val
  return [read(a) for a in jaxpr.outvars]


def _unroll(e, read, slices, param_paths, is_param):
  """The scan ``e`` as its iterations, iteration i named ``<scan>/<i>``."""
  body = e.params["jaxpr"]
  (nc, ncarry), length = scan_counts(e), e.params["length"]
  consts = [read(a) for a in e.invars[:nc]]
  carry = [read(a) for a in e.invars[nc : nc + ncarry]]
  xs = e.invars[nc + ncarry :]
  outer = _scopes(e.source_info.name_stack)
  # The scan's own name: Linen names the body's equations after the scanned module; NNX and
  # plain functions name nothing, so the stacked parameters' common path names the scan.
  stacked_paths = [param_paths[is_param[a]] for a in xs if a in slices and a in is_param]
  fallback = _common_prefix(stacked_paths) or "scan"

  def renamer(i):
    def rename(ns):
      inner = _scopes(ns)
      if inner:
        return _name_stack(outer + inner[:1] + [str(i)] + inner[1:])
      return _name_stack(outer + ([] if outer else fallback.split("/")) + [str(i)])

    return rename

  ys_by_iter: dict[int, list] = {}
  order = range(length - 1, -1, -1) if e.params["reverse"] else range(length)
  for i in order:
    x_i = [
      slices[a][i] if a in slices else jax.lax.index_in_dim(read(a), i, keepdims=False) for a in xs
    ]
    outs = _eval_jaxpr(body.jaxpr, body.consts, consts + carry + x_i, renamer(i))
    carry = list(outs[:ncarry])
    ys_by_iter[i] = list(outs[ncarry:])
  nys = len(e.outvars) - ncarry
  ys = [jnp.stack([ys_by_iter[i][k] for i in range(length)]) for k in range(nys)]
  return carry + ys
