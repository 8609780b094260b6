"""Several training steps issued as one stream: PipeDream's 1F1B without flushes.

``GraphPipeline.run_steps`` hands K steps' inputs over at once. One step at a time, a stage
cannot start step t + 1 before its last backward of step t (and, in one process, its device
runs what it is given in order), so the pipeline fills and drains once per step (the flush).
Under the stale-weight schedules (``pipedream-async``, ``-vsync``, ``2bw``) a stage computes
step t + 1 with weights ``d(s) >= 1`` updates old, which exist long before step t ends, so the
next step's forwards can go ahead of this step's last backwards:
``passes.schedules.stream_schedule`` gives the lanes of all K steps, one 1F1B across the step
boundaries with ``UPDATE(s, t)`` after a stage's last backward of step t.

This module issues such lanes. Each step has its own values (the step's jaxpr variables) and its
own ``PipelineRunner`` state (a shallow copy of the compiled runner: stashed activations,
gradient sums). An action is issued when what it reads has been issued, in the round-robin
lane order of ``ir.schedule.dispatch_order``:

  * a stage's forward of step t is prepared (its per-step inputs, ``_prepare_stage``) once the
    loss inputs it reads exist: the batch and data of step t, the parameters of step
    ``t - d(s)`` (its stale version; parameters from earlier calls for the first steps);
  * ``UPDATE(s, t)`` completes the gradients of the parameters whose readers have all finished
    step t (and the loss outputs once their stages have), the values the step's optimizer
    pieces read;
  * the pieces of the step around the pipeline (``passes.step_split``) run as soon as their
    inputs exist; the state a step returns is the next step's input (``carry``).

Nothing here waits on a device: JAX dispatch is asynchronous and this only orders the
dispatches, so the values are the same as K calls of the step (the tests compare them to the
reference loops). Synchronous schedules get their lanes repeated (``stream_schedule``): K steps
with flushes, as K calls. JAX's CPU client, though, makes the issuing thread wait once a device
has a few dozen computations queued, and a stream queues many more than one step does; with
one thread feeding every device, the others then starve. ``run_steps`` therefore streams by
default only on accelerators (BUILD_NOTES, "Measured (schedules)").
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

from jax.extend import core as xc

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.schedule import Action
from gpp_jax.passes.schedules import stream_schedule
from gpp_jax.runtime.driver import Timeline, TimelineEvent
from gpp_jax.runtime.placement import place_input, transfer


class _Missing(Exception):
  """A value not issued yet."""


def stream_reason(c, measure: bool, multiprocess: bool, stream: bool | None) -> str | None:
  """Why ``run_steps`` runs the steps one call at a time for ``c``, None if it streams.

  ``stream``: the caller's choice (``GraphPipeline.run_steps``); None streams on accelerators
  only, True wherever the stream can run, False never."""
  if stream is False:
    return "stream=False"
  if c.fused is not None:
    return "the plan is one stage on one device (the step runs as one jitted function)"
  if c.scan_split.stacked:
    return "the loss has scanned layers split across stages"
  if multiprocess:
    return "the run has several processes"
  if measure:
    return "measure=True times each action on its own"
  if stream is None and all(d.platform == "cpu" for p in c.placements for d in p.devices):
    return "the devices are CPUs (pass stream=True to stream there)"
  return None


def stream_steps(c, steps_leaves: Sequence[Sequence[Any]], carry: dict[int, int]) -> list[list]:
  """Runs ``len(steps_leaves)`` steps of the compiled pipeline ``c``; returns their flat outputs.

  ``steps_leaves[t]``: the flat step arguments of step t (entries at carried positions are
  ignored for t > 0); ``carry``: flat input position -> flat output position of the state a
  step hands to the next.
  """
  J = c.prog.jaxpr.jaxpr
  K = len(steps_leaves)
  runner = c.runner
  sched = stream_schedule(runner.schedule, K)
  S = sched.num_stages
  counts = runner.counts
  homes = [p.replicated for p in c.placements]
  marker, nparam = c.prog.marker, c.nparam
  nloss = len(runner.staged.loss_outputs)
  invar_index = {v: i for i, v in enumerate(J.invars)}
  env: list[dict] = [{} for _ in range(K)]
  for t, leaves in enumerate(steps_leaves):
    for i, (v, x, h) in enumerate(zip(J.invars, leaves, c.prog.invar_home)):
      if t == 0 or i not in carry:
        env[t][v] = place_input(x, homes[h]) if h >= 0 else x

  def read(t: int, v) -> Any:
    if isinstance(v, xc.Literal):
      return v.val
    e = env[t]
    if v in e:
      return e[v]
    i = invar_index.get(v)
    if i is None or t == 0 or i not in carry:
      raise _Missing
    x = read(t - 1, J.outvars[carry[i]])
    h = c.prog.invar_home[i]
    e[v] = x = place_input(x, homes[h]) if h >= 0 else x
    return x

  # Stale weights: stage s at step t reads the parameters of step t - d(s); before the first
  # step, the versions earlier calls kept (``weight_versions.stale_versions``).
  delays = sched.delays or (0,) * S
  history = list(getattr(c, "weight_history", None) or [])

  def param(t: int, s: int, i: int) -> Any:
    u = t - delays[s]
    if u >= 0:
      return read(u, marker.invars[i])
    if not history:
      return read(0, marker.invars[i])
    return history[min(-u - 1, len(history) - 1)][i]

  runner.param_readers  # noqa: B018  (computed once, shared by the copies)
  runs = [copy.copy(runner) for _ in range(K)]
  for r in runs:
    r.begin()
  prepared = [[False] * S for _ in range(K)]
  staged = runner.staged

  def prepare(t: int, s: int) -> bool:
    if prepared[t][s]:
      return True
    ins = staged.stages[s].inputs
    try:
      ps = {r.index: param(t, s, r.index) for r in ins if r.kind == "param"}
      ds = {r.index: read(t, marker.invars[r.index]) for r in ins if r.kind == "data"}
    except _Missing:
      return False
    runs[t]._prepare_stage(s, ps, ds)
    prepared[t][s] = True
    return True

  # Gradients complete when every stage reading the parameter has run the step's UPDATE.
  readers = [{s for s, _, _ in rd} for rd in runner.param_readers[:nparam]]
  touched: list[list[int]] = [[] for _ in range(S)]
  for i, rd in enumerate(readers):
    owner = staged.param_owner[i]
    for s in rd or {max(owner, 0)}:
      touched[s].append(i)
  loss_stages = {s for s, _ in staged.loss_outputs}
  done: list[set[int]] = [set() for _ in range(K)]

  def update(s: int, t: int) -> None:
    done[t].add(s)
    r = runs[t]
    for i in touched[s]:
      if readers[i] <= done[t]:
        g = r.grad_of(i, marker.invars[i].aval)
        o = marker.outvars[nloss + i]
        if not isinstance(o, xc.DropVar):
          env[t][o] = g
    if s in loss_stages and loss_stages <= done[t]:
      for o, x in zip(marker.outvars, r.loss_outputs()):
        if not isinstance(o, xc.DropVar):
          env[t][o] = x

  pending = [list(c.pieces) for _ in range(K)]
  issued = [0]  # pieces issued so far

  def run_pieces(first: int = 0) -> None:
    """Issues the pieces whose inputs exist, from step ``first`` on. A later step gains
    inputs only from its own updates (which call this) and from the state the step before
    returns, so the scan stops at the first step after ``first`` where nothing ran."""
    for t in range(first, K):
      left = []
      for p, f in pending[t]:
        try:
          args = [read(t, v) for v in p.inputs]
        except _Missing:
          left.append((p, f))
          continue
        outs = f(*[transfer(x, homes[p.home]) for x in args])
        for o, x in zip(p.outputs, outs):
          env[t][o] = x
      ran = len(left) < len(pending[t])
      issued[0] += len(pending[t]) - len(left)
      pending[t] = left
      if t > first and not ran:
        break

  events: list[TimelineEvent] = []
  t0 = time.perf_counter()
  pos = [0] * S
  run_pieces()
  while any(pos[s] < len(sched.lanes[s]) for s in range(S)):
    progressed = False
    for s, lane in enumerate(sched.lanes):
      while pos[s] < len(lane):
        a = lane[pos[s]]
        t = sched.step_of(a)
        start = time.perf_counter()
        if a.kind == "UPDATE":
          update(s, t)
          run_pieces(t)
        else:
          local = Action(a.kind, s, a.microbatch - t * counts[s])
          if not prepare(t, s) or not runs[t]._ready(local):
            break
          runs[t]._run_action(local)
        events.append(TimelineEvent(a.kind, s, a.microbatch, start - t0, time.perf_counter() - t0))
        pos[s] += 1
        progressed = True
    if not progressed:
      before = issued[0]
      run_pieces()  # a full scan: a step may have gained inputs through one that did not
      if issued[0] > before:
        continue
      heads = [str(sched.lanes[s][pos[s]]) for s in range(S) if pos[s] < len(sched.lanes[s])]
      raise ScheduleError(
        f"the {K}-step stream cannot issue any of {heads}: what they read is computed later "
        "(a step whose loss inputs depend on the whole previous update?)\n" + sched.grid()
      )
  run_pieces()
  if any(pending):
    t = next(t for t in range(K) if pending[t])
    raise ScheduleError(f"step {t}'s pieces around the pipeline never got their inputs")
  outs = [[read(t, v) for v in J.outvars] for t in range(K)]
  if sched.delays is not None:
    keep = max(delays) + 1
    versions = [[read(t, marker.invars[i]) for i in range(nparam)] for t in reversed(range(K))]
    c.weight_history = (versions + history)[:keep]
  runner.last_timeline = Timeline(events, time.perf_counter() - t0, False)
  return outs
