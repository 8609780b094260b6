"""Several training steps in one call (``GraphPipeline.run_steps``): which state carries from
step to step, and whether the steps run as one program.

One step at a time, a stage cannot start step t + 1 before its last backward of step t, so the
pipeline fills and drains once per step (the flush). Under the stale-weight schedules
(``pipedream-async``, ``-vsync``, ``2bw``) a stage computes step t + 1 with weights ``d(s) >= 1``
updates old, which exist long before step t ends, so the next step's forwards can go ahead of
this step's last backwards: ``passes.schedules.stream_schedule`` gives the lanes of K steps as
one 1F1B without flushes, and ``passes.lowering.lower_step`` lowers them into one program of K
steps (the state a step returns feeding the next, ``carry_map``), which the executor runs like
any other. JAX's CPU client, though, makes the issuing thread wait once a device has a few dozen
computations queued, and a stream queues many more than one step does; with one thread feeding
every device, the others then starve. ``run_steps`` therefore streams by default only on
accelerators (docs/results/schedules.md, "PipeDream without flushes").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from gpp_jax.errors import CaptureError


def stream_reason(c, measure: bool, multiprocess: bool, stream: bool | None) -> str | None:
  """Why ``run_steps`` runs the steps one call at a time for the compiled step ``c``, None if
  it runs them as one program.

  ``stream``: the caller's choice; None streams on accelerators only, True wherever the stream
  can run, False never."""
  if stream is False:
    return "stream=False"
  if c.fused:
    return "the plan is one stage on one device (the step runs as one jitted function)"
  if multiprocess:
    return "the run has several processes"
  if measure:
    return "measure=True times each action on its own"
  if stream is None and all(d.platform == "cpu" for p in c.staged.placements for d in p.devices):
    return "the devices are CPUs (pass stream=True to stream there)"
  return None


def carry_map(
  c, args: Sequence[Any], graph: set[int], carried_args: Sequence[int]
) -> dict[int, int]:
  """Flat input position -> flat output position of the state one step hands the next.

  NNX objects' state comes back after the step's own outputs; a functional step must return
  its new non-batch arguments first, in order."""
  out_def, state_def = c.out_tree.children()
  nout = out_def.num_leaves
  J = c.prog.jaxpr.jaxpr
  carry: dict[int, int] = {}
  nstate = state_def.num_leaves if graph else 0
  for k in range(nstate):
    carry[k] = nout + k
  if not carried_args:
    return carry
  out = jax.tree.unflatten(out_def, list(range(nout)))
  others = [i for i in range(len(args)) if i not in graph]
  offsets, k = {}, nstate
  for i in others:
    offsets[i] = k
    k += len(jax.tree.leaves(args[i]))
  n = len(carried_args)
  how = (
    "run_steps carries a functional step's state: the step must return its new non-batch "
    "arguments first, in order, e.g. (params, opt_state, batch) -> (params, opt_state, "
    "metrics)"
  )
  if not isinstance(out, (tuple, list)) or len(out) < n:
    raise CaptureError(f"{how}; this step returns {type(out).__name__}")
  for j, i in enumerate(carried_args):
    got, want = jax.tree.structure(out[j]), jax.tree.structure(args[i])
    if str(got) != str(want):
      raise CaptureError(f"{how}; output {j} has structure {got} but argument {i} {want}")
    for q, o in enumerate(jax.tree.leaves(out[j])):
      inv, outv = J.invars[offsets[i] + q].aval, J.outvars[o].aval
      if (inv.shape, inv.dtype) != (outv.shape, outv.dtype):
        raise CaptureError(
          f"{how}; leaf {q} of output {j} is {outv.str_short()} but of argument {i} "
          f"{inv.str_short()}"
        )
      carry[offsets[i] + q] = o
  return carry
