"""Capture pass: a loss function's ClosedJaxpr -> an inlined ClosedJaxpr and its OpGraph.

Nested ``jit`` (including ``nnx.jit``), ``closed_call`` and ``core_call`` equations are inlined
so that every equation of the model is visible at the top level, with its full name stack
(outer scope + inner scope) kept. ``custom_jvp_call``, ``custom_vjp_call``, ``remat`` and control
flow (``cond``, ``while``, ``scan``) stay whole: they are single equations of the OpGraph.
"""

from __future__ import annotations

import re

import jax
import networkx as nx
import numpy as np
from jax.extend import core as xc
from jax.extend import source_info_util as siu
from jax.extend.core import primitives as P

from gpp_jax.passes.costs import aval_bytes, eqn_bytes, eqn_flops

INLINED = {P.jit_p, P.closed_call_p, P.call_p}


def _inline_eval(jaxpr, consts, args, prefix):
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(a):
    return a.val if isinstance(a, xc.Literal) else env[a]

  for e in jaxpr.eqns:
    ins = [read(a) for a in e.invars]
    ns = prefix + e.source_info.name_stack
    if e.primitive in INLINED:
      sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
      if isinstance(sub, xc.ClosedJaxpr):
        outs = _inline_eval(sub.jaxpr, sub.consts, ins, ns)
      else:
        outs = _inline_eval(sub, (), ins, ns)
    else:
      bind_params = e.primitive.get_bind_params(e.params)
      with siu.user_context(e.source_info.traceback, name_stack=ns), e.ctx.manager:
        outs = e.primitive.bind(*ins, **bind_params)
      if not e.primitive.multiple_results:
        outs = [outs]
    for o, v in zip(e.outvars, outs):
      if not isinstance(o, xc.DropVar):
        env[o] = v
  return [read(a) for a in jaxpr.outvars]


def inline_calls(closed: xc.ClosedJaxpr) -> xc.ClosedJaxpr:
  """Returns an equivalent ClosedJaxpr with nested jit/closed_call equations inlined."""
  if not any(e.primitive in INLINED for e in closed.jaxpr.eqns):
    return closed
  avals = [v.aval for v in closed.jaxpr.invars]

  def run(*args):
    return _inline_eval(closed.jaxpr, closed.consts, args, siu.NameStack())

  out = jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
  return out


def host_constant(c):
  """A jaxpr constant as a host array, so each stage embeds it on its own device."""
  try:
    return np.asarray(jax.device_get(c))
  except (TypeError, ValueError):  # extended dtypes (PRNG keys) stay as they are
    return c


# ``jnp.einsum`` names its call after the spec ('bi,io->bo', 'BTD,NDH->BTNH', '...d,d->...').
_EINSUM_SPEC = re.compile(r"[A-Za-z. ]*(,[A-Za-z. ]*)*(->[A-Za-z. ]*)?")


def is_einsum_scope(name: str) -> bool:
  """Whether a name-stack scope is the one ``jnp.einsum`` opens, named after its spec."""
  return ("," in name or "->" in name) and _EINSUM_SPEC.fullmatch(name) is not None


def scope_path(eqn) -> str:
  """The equation's module path from its name stack ('Net/block0/fc'), transforms and
  ``jnp.einsum``'s spec scopes dropped."""
  parts = [
    s.name
    for s in eqn.source_info.name_stack.stack
    if type(s).__name__ == "Scope" and not is_einsum_scope(s.name)
  ]
  return "/".join(parts)


def op_graph(closed: xc.ClosedJaxpr) -> nx.DiGraph:
  """OpGraph: one node per equation (its index), edges along data flow.

  Node attributes: ``primitive``, ``scope`` (module path from the name stack), ``flops``,
  ``bytes``. Edge attributes: ``bytes`` of the variables flowing along the edge.
  """
  g = nx.DiGraph()
  producer: dict[xc.Var, int] = {}
  for i, e in enumerate(closed.jaxpr.eqns):
    g.add_node(
      i, primitive=e.primitive.name, scope=scope_path(e), flops=eqn_flops(e), bytes=eqn_bytes(e)
    )
    for v in e.invars:
      if isinstance(v, xc.Var) and v in producer:
        p = producer[v]
        if g.has_edge(p, i):
          g.edges[p, i]["bytes"] += aval_bytes(v.aval)
        else:
          g.add_edge(p, i, bytes=aval_bytes(v.aval))
    for o in e.outvars:
      if not isinstance(o, xc.DropVar):
        producer[o] = i
  return g
