"""Asynchronous schedules with stale weights: PipeDream's 1F1B with weight stashing and
PipeDream-2BW. Stage DAG -> Schedule, and Schedule -> how stale each stage's weights are.

These schedules change the training semantics, so they are defined here by the update rule the
runtime applies and the one-device reference loop the tests compare against. One call of the
decorated step is one optimizer update (PipeDream's minibatch; 2BW's coalesced update); its M
micro-batches are accumulated into that update as in every other schedule. At step t (0-based)
stage s computes its forward and backward with the parameters of version ``max(0, t - d(s))``
(weight stashing: forward and backward of a step see the same version), and the optimizer
applies those gradients to the current parameters:

  W(t + 1) = W(t) - lr * grad f(W_0(t - d(0)), ..., W_{S-1}(t - d(S-1)))

(with the user's optimizer in place of ``- lr *``; a parameter read by several stages is read
at each reader's version, and its gradient contributions are summed).

  pipedream-async: PipeDream (Narayanan et al., SOSP'19, section 3.3): 1F1B without flushes;
      stage s is ``d(s) = L(s) - 1`` updates behind, L(s) the stages on its longest path to a
      sink (its 1F1B warm-up), so the input stage of a chain of S stages uses weights S - 1
      updates old and the last stage current ones.
  pipedream-async-vsync: the same with vertical sync: every stage uses the version the input
      stages used, ``d(s) = max L - 1`` for all s, so a step's gradient is the gradient of one
      consistent (stale) model.
  2bw: PipeDream-2BW (Narayanan et al., ICML'21, section 3.1): two weight versions, gradients
      coalesced over the micro-batches of a step and computed on the previous version,
      ``d(s) = 1``: W(t + 1) = W(t) - lr * grad f(W(t - 1)).

The generators live in ``passes/schedules.py``. One step's lanes are 1F1B; a call of the step
runs one step, so consecutive calls flush the pipeline in between. ``GraphPipeline.run_steps``
takes several steps at once and issues them as one 1F1B stream without flushes
(``passes.schedules.stream_schedule``, ``runtime/steps.py``): the stale versions are what
lets step t + 1's forwards go ahead of step t's last backwards and its update. The runtime
keeps the last ``max d(s)`` parameter versions on the owners' devices (weight stashing's
memory: stage s holds ``d(s) + 1`` copies of its weights).
"""

from __future__ import annotations

from gpp_jax.ir.schedule import Schedule
from gpp_jax.passes.inflight import inflight_counts

ASYNC_SCHEDULES = ("pipedream-async", "pipedream-async-vsync", "2bw")


def weight_delays(sched: Schedule) -> tuple[int, ...] | None:
  """Schedule -> d(s) per stage (how many updates stage s's weights lag), None if synchronous."""
  if sched.name not in ASYNC_SCHEDULES:
    return None
  S = sched.num_stages
  if sched.name == "2bw":
    return (1,) * S
  L = inflight_counts(S, sched.edges).microbatches
  if sched.name == "pipedream-async-vsync":
    return (max(L) - 1,) * S
  return tuple(l - 1 for l in L)
