"""Backward split for zero-bubble schedules: a stage's backward -> B (input cotangents) and W
(parameter gradients), sharing work instead of repeating it.

The stage's backward (``grads(*args) -> [parameter grads..., input cotangents...]``) is traced
to one jaxpr. B is the part the input cotangents depend on. W is the part the parameter
gradients depend on, less what B already computed: the values W needs from B's part (the
cotangents flowing through the stage, e.g. the output gradient of every layer) are extra
outputs of B, kept until W runs. So B + W do the backward's work once, as one backward does,
and B is only the critical-path part (for a dense layer, W is the ``x^T g`` product B skips).
Reshapes, slices and casts of B's inputs that W needs (residuals unpacked from a buffer) are
redone in W instead of kept, so they hold no second copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as xc


def _live(eqns: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
  """The equations the values ``outs`` depend on, in order (dead-code elimination)."""
  live = {v for v in outs if isinstance(v, xc.Var)}
  keep = []
  for e in reversed(eqns):
    if any(o in live for o in e.outvars if not isinstance(o, xc.DropVar)):
      keep.append(e)
      live.update(a for a in e.invars if isinstance(a, xc.Var))
  keep.reverse()
  return keep


_REDO = {
  "slice",
  "dynamic_slice",
  "reshape",
  "squeeze",
  "expand_dims",
  "broadcast_in_dim",
  "convert_element_type",
  "transpose",
  "copy",
}


def _needed(w_eqns: Sequence[Any], outs: Sequence[Any], producer: dict) -> list[Any]:
  """Values defined by B's equations that W's equations (or outputs) read, in order."""
  own = {o for e in w_eqns for o in e.outvars}
  kept: list[Any] = []
  for v in [a for e in w_eqns for a in e.invars] + list(outs):
    if isinstance(v, xc.Var) and v in producer and v not in own and v not in kept:
      kept.append(v)
  return kept


def _jaxpr(closed, invars, outvars, eqns, name):
  dbg = xc.DebugInfo(
    "graph_pipeline",
    name,
    tuple(f"in{i}" for i in range(len(invars))),
    tuple(f"out{i}" for i in range(len(outvars))),
  )
  effects = frozenset().union(*[e.effects for e in eqns]) if eqns else frozenset()
  j = xc.Jaxpr(closed.jaxpr.constvars, invars, outvars, eqns, effects, debug_info=dbg)
  return xc.ClosedJaxpr(j, closed.consts)


class SplitBackward:
  """``grads`` split into ``bwd_input(*args) -> (input cotangents, kept)`` and
  ``bwd_weight(*args, kept, acc) -> acc + parameter gradients`` (``add`` adds them into the
  accumulator). Traced on the first call, one executable each."""

  def __init__(self, grads: Callable[..., Any], nparam: int, add: Callable[..., Any]):
    self.grads, self.nparam, self.add = grads, nparam, add
    self._b: Any = None
    self._w: Any = None
    # After the first call: B's and W's jaxprs and how many values B keeps for W.
    self.input_jaxpr: Any = None
    self.weight_jaxpr: Any = None
    self.kept = 0

  def _build(self, args) -> None:
    flat, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *f: list(self.grads(*jax.tree.unflatten(tree, f))))(*flat)
    J = closed.jaxpr
    p_out, a_out = J.outvars[: self.nparam], J.outvars[self.nparam :]
    b_eqns = _live(J.eqns, a_out)
    in_b = {id(e) for e in b_eqns}
    w_eqns = [e for e in _live(J.eqns, p_out) if id(e) not in in_b]
    producer = {o: e for e in b_eqns for o in e.outvars if not isinstance(o, xc.DropVar)}
    kept = _needed(w_eqns, p_out, producer)
    # A value B only reshapes or slices out of its inputs (a residual unpacked from a buffer)
    # is cheaper to redo in W than to keep: keeping it would hold a second copy.
    while redo := [producer[v] for v in kept if producer[v].primitive.name in _REDO]:
      have = {id(e) for e in w_eqns}
      w_eqns += [e for e in {id(e): e for e in redo}.values() if id(e) not in have]
      order = {id(e): i for i, e in enumerate(J.eqns)}
      w_eqns.sort(key=lambda e: order[id(e)])
      kept = _needed(w_eqns, p_out, producer)
    b = _jaxpr(closed, J.invars, list(a_out) + kept, b_eqns, "stage_backward_input")
    w = _jaxpr(closed, list(J.invars) + kept, list(p_out), w_eqns, "stage_backward_weight")
    self.input_jaxpr, self.weight_jaxpr, self.kept = b, w, len(kept)
    nact, b_fn, w_fn = len(a_out), xc.jaxpr_as_fun(b), xc.jaxpr_as_fun(w)

    def run_b(*f):
      outs = b_fn(*f)
      return list(outs[:nact]), list(outs[nact:])

    def run_w(f, k, acc):
      return self.add(list(w_fn(*f, *k)), acc)

    self._b = jax.jit(run_b)
    self._w = jax.jit(run_w, donate_argnums=(2,))

  def bwd_input(self, *args):
    if self._b is None:
      self._build(args)
    return self._b(*jax.tree.leaves(args))

  def bwd_weight(self, *args_kept_acc):
    *args, kept, acc = args_kept_acc
    if self._w is None:
      self._build(tuple(args))
    return self._w(jax.tree.leaves(tuple(args)), kept, acc)
