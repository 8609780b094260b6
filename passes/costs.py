"""Cost annotation of single Jaxpr equations: FLOPs and bytes.

FLOPs are exact for ``dot_general`` and ``conv_general_dilated`` (2 per multiply-add) and
estimated elsewhere: one FLOP per output element for elementwise ops, one per input element for
reductions, the body cost times the trip count for ``scan``, and the sum over sub-jaxprs for
other higher-order primitives (``while`` counts one trip: its trip count is unknown statically).
Bytes are the bytes of the input and output arrays of the equation.
"""

from __future__ import annotations

import math

import numpy as np
from jax.extend import core as xc


def aval_bytes(aval) -> int:
  """Bytes of an abstract value (0 for tokens and other non-arrays)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  try:
    itemsize = np.dtype(dtype).itemsize
  except TypeError:  # extended dtypes such as PRNG keys
    itemsize = 8
  return int(math.prod(shape)) * itemsize


def _size(aval) -> int:
  shape = getattr(aval, "shape", ())
  return int(math.prod(shape))


def jaxpr_flops(jaxpr) -> float:
  """Total estimated FLOPs of a Jaxpr (open or closed)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return float(sum(eqn_flops(e) for e in jaxpr.eqns))


def eqn_flops(eqn) -> float:
  """Estimated FLOPs of one equation."""
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    contract = math.prod(lhs.shape[d] for d in lc)
    return 2.0 * _size(eqn.outvars[0].aval) * contract
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    dn = eqn.params["dimension_numbers"]
    rhs_spec = dn.rhs_spec  # (out feature dim, in feature dim, spatial...)
    k = math.prod(rhs.shape[d] for d in rhs_spec[1:])
    return 2.0 * _size(eqn.outvars[0].aval) * k
  if name == "scan":
    return eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
  if name == "cond":
    return max(jaxpr_flops(b) for b in eqn.params["branches"])
  subs = list(xc.jaxprs_in_params(eqn.params))
  if subs:
    return float(sum(jaxpr_flops(j) for j in subs))
  if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum", "cumprod"):
    return float(sum(_size(v.aval) for v in eqn.invars))
  return float(sum(_size(v.aval) for v in eqn.outvars))


def eqn_bytes(eqn) -> float:
  """Bytes read and written by one equation."""
  ins = sum(aval_bytes(v.aval) for v in eqn.invars if not isinstance(v, xc.Literal))
  outs = sum(aval_bytes(v.aval) for v in eqn.outvars)
  return float(ins + outs)
