"""A plan of one stage on one device, run as one jitted step.

Such a plan is gradient accumulation, not a pipeline: nothing overlaps, and every action the
driver would issue (a forward and a backward per micro-batch, the gradient sums, the pieces of
the optimizer update) only adds host dispatch and buffers that a single XLA program avoids.
``fused_step`` compiles the whole captured step instead: the part before the loss, the loss's
value and gradient accumulated over the micro-batches by ``lax.scan``, and the update, with the
same per-micro-batch semantics as the driver (batch arrays split into contiguous chunks, keys
with the micro-batch index folded in, the loss seed ``1/M``, aux outputs averaged or
concatenated), so a one-stage plan costs what the plain jitted step costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as xc

from gpp_jax.ir.step import StepProgram
from gpp_jax.passes.lowering import BATCH, KEY, reduction
from gpp_jax.runtime.captured import Captured


def _accumulated_value_and_grad(
  captured: Captured, num_microbatches: int, stacked: bool = False
) -> Callable[..., list[Any]]:
  """``(*marker inputs) -> [*loss outputs, *parameter gradients]`` over the micro-batches of
  ``captured``'s loss as traced (its roles, its outputs' reductions, at its micro-batch size).
  ``stacked``: batch arrays come as their micro-batches along a leading axis."""
  loss = captured.loss_as_traced
  assert loss is not None
  roles: Sequence[str | None] = list(captured.roles)
  reduce: Sequence[str | None] = captured.reduce
  f = xc.jaxpr_as_fun(loss)
  M, mb = num_microbatches, captured.microbatch_size
  nparam = sum(r is None for r in roles)
  out_avals = [v.aval for v in loss.jaxpr.outvars]

  def one(params, data, m):
    def g(*p):
      outs = f(*p, *data)
      return outs[0], outs[1:]

    value, vjp, aux = jax.vjp(g, *params, has_aux=True)
    grads = vjp(jnp.asarray(1.0 / M, out_avals[0].dtype))
    return [value, *aux], list(grads)

  def run(*inputs):
    params, rest = list(inputs[:nparam]), list(inputs[nparam:])
    roles_rest = roles[nparam:]
    if M == 1:  # the step as written: its own keys, no fold
      data = [x[0] if stacked and r == BATCH else x for x, r in zip(rest, roles_rest)]
      outs, grads = one(params, data, 0)
      return [*outs, *grads]
    chunks = [
      x if stacked else x.reshape((M, mb, *x.shape[1:]))
      for x, r in zip(rest, roles_rest)
      if r == BATCH
    ]

    def body(acc, xs):
      m, batch = xs
      it = iter(batch)
      data = [
        next(it) if r == BATCH else jax.random.fold_in(x, m) if r == KEY else x
        for x, r in zip(rest, roles_rest)
      ]
      outs, grads = one(params, data, m)
      return [a + g for a, g in zip(acc, grads)], outs

    zeros = [jnp.zeros_like(p) for p in params]
    grads, per_mb = jax.lax.scan(body, zeros, (jnp.arange(M, dtype=jnp.uint32), chunks))
    outs = []
    for i, (y, a) in enumerate(zip(per_mb, out_avals)):
      mode = reduction(i, a, mb, False, reduce[i] if i < len(reduce) else None)
      if mode == "concat":
        outs.append(y.reshape((M * a.shape[0], *a.shape[1:])))
      elif mode == "last":
        outs.append(y[-1])
      else:
        total = y[0]
        for k in range(1, M):  # the executor's order of summation
          total = total + y[k]
        outs.append(total / M if mode == "mean" else total)
    return [*outs, *grads]

  return run


def fused_step(
  prog: StepProgram, captured: Captured, num_microbatches: int, stacked: bool = False
) -> Callable[..., list[Any]]:
  """The jitted step ``(*step input leaves) -> [*step outputs]`` of a one-stage plan: the step
  around the pipeline ``prog`` with ``captured``'s loss as traced accumulated over
  ``num_microbatches`` micro-batches (``stacked``: its batch arrays come as micro-batches
  along a leading axis, split over the devices of a data-parallel stage). It consumes the
  buffers of the captured step's donated leaves (``Captured.donated``)."""
  J = prog.jaxpr.jaxpr
  marker = prog.marker
  vag = _accumulated_value_and_grad(captured, num_microbatches, stacked)
  pieces = [(p, xc.jaxpr_as_fun(p.jaxpr)) for p in prog.before]
  after = [(p, xc.jaxpr_as_fun(p.jaxpr)) for p in prog.after]

  def step(*leaves):
    env: dict[Any, Any] = dict(zip(J.invars, leaves))
    for v, c in zip(J.constvars, prog.jaxpr.consts):
      env[v] = c

    def read(a):
      return a.val if isinstance(a, xc.Literal) else env[a]

    def run(ps):
      for p, f in ps:
        for o, val in zip(p.outputs, f(*[read(v) for v in p.inputs])):
          env[o] = val

    run(pieces)
    for o, val in zip(marker.outvars, vag(*[read(a) for a in marker.invars])):
      if not isinstance(o, xc.DropVar):
        env[o] = val
    run(after)
    return [read(a) for a in J.outvars]

  return jax.jit(step, donate_argnums=tuple(captured.donated))
