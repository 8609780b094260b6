"""The user-facing decorator: ``@gpp_jax.graph_pipeline``."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import jax
import networkx as nx
import numpy as np
from absl import logging
from flax import nnx
from jax.extend import core as xc

from gpp_jax.cost.cluster import process_cluster
from gpp_jax.errors import BatchError, CaptureError, PlanError
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import (
  Plan,
  has_mixed_microbatches,
  stage_microbatch_sizes,
  validate_plan,
)
from gpp_jax.ir.schedule import Schedule
from gpp_jax.passes.calibrate import Calibration, measure_layers
from gpp_jax.passes.capture import inline_calls
from gpp_jax.passes.layering import Layering, layer_program
from gpp_jax.passes.partition import get_planner
from gpp_jax.passes.partition.manual import ManualPlan
from gpp_jax.passes.scan_split import ScanSplit, split_scans
from gpp_jax.passes.schedules import plan_schedule
from gpp_jax.passes.staging import StagedProgram, stage_program
from gpp_jax.passes.step_split import Piece, StepProgram, split_step
from gpp_jax.passes.weight_versions import stale_versions, weight_delays
from gpp_jax.runtime.cached import CachedStep
from gpp_jax.runtime.capture_step import functionalize, recording, value_and_grad_p
from gpp_jax.runtime.driver import (
  BATCH,
  BROADCAST,
  KEY,
  STATE,
  PipelineRunner,
  Timeline,
  TimelineEvent,
  _is_key,
  placeholder,
  wait_for,
)
from gpp_jax.runtime.fused import fused_step
from gpp_jax.runtime.loss_state import StatePair, check_state_returned, split_state
from gpp_jax.runtime.placement import (
  LocalCopy,
  StagePlacement,
  new_send_epoch,
  place_input,
  stage_placements,
  transfer,
)
from gpp_jax.runtime.processes import check_same_plan, exchange
from gpp_jax.runtime.stacked_params import (
  param_homes,
  slice_data,
  slice_params,
  stack_grads,
  stack_outputs,
)
from gpp_jax.runtime.stream import stream_reason, stream_steps


class Compiled:
  """Everything built for one input signature: plan, staged program, schedule, runner.

  ``GraphPipeline._capture`` fills the capture fields (``step`` .. ``microbatch_size``);
  ``GraphPipeline._build`` fills the build fields (``plan`` .. ``nbefore``). A field not given
  to the constructor is not set.
  """

  out_tree: Any
  # Capture.
  step: xc.ClosedJaxpr
  marker_index: int
  loss: xc.ClosedJaxpr
  layering: Layering
  roles: list[str | None]
  state: list[StatePair]
  scan_split: ScanSplit
  nparam: int
  batch_size: int
  microbatch_size: int
  # Build.
  plan: Plan
  layer_graph: nx.DiGraph
  schedule: Schedule
  staged: StagedProgram
  runner: PipelineRunner
  prog: StepProgram
  placements: list[StagePlacement]
  pieces: list[tuple[Piece, Callable[..., Any]]]
  nbefore: int
  calibration: Calibration | None
  # Set when the plan is one stage on one device: the whole step as one jitted function.
  fused: Callable[..., Any] | None
  last_fused: Timeline | None

  def __init__(self, **kw: Any):
    self.__dict__.update(kw)


class GraphPipeline:
  """A train step run as a graph pipeline. Call it like the original step.

  Attributes (after the first call): ``plan``, ``layer_graph``, ``schedule``, ``timeline``
  (the last step's), and ``explain()``.
  """

  def __init__(
    self,
    fn: Callable,
    *,
    num_microbatches: int,
    devices: Sequence[Any] | None = None,
    planner: str | Plan | ManualPlan | Callable = "balanced",
    schedule: str | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    remat: bool = False,
    layer_depth: int | None = None,
    cluster: Any = None,
    measure: bool = False,
    planner_options: dict | None = None,
    timeout_s: float = 300.0,
    calibrate: bool = False,
    fuse: bool = True,
  ):
    if num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    self.fn = fn
    self.num_microbatches = int(num_microbatches)
    self.devices = list(devices) if devices is not None else list(jax.devices())
    self.planner = planner
    self.schedule_name = schedule
    self.batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    self.remat = remat
    self.layer_depth = layer_depth
    self.cluster = cluster
    self.measure = measure
    self.planner_options = dict(planner_options or {})
    self.timeout_s = float(timeout_s)
    self.calibrate = calibrate
    self.fuse = fuse
    self._compiled: dict[Any, Compiled] = {}
    self._last: Compiled | None = None
    functools.update_wrapper(self, fn)
    if len(self.devices) == 1 and self.num_microbatches > 1:
      warnings.warn(_one_device_message(self.devices[0]), UserWarning, stacklevel=_caller_level())

  # ------------------------------------------------------------------ public views
  @property
  def plan(self) -> Plan:
    return self._require().plan

  @property
  def layer_graph(self):
    return self._require().layer_graph

  @property
  def schedule(self):
    return self._require().schedule

  @property
  def calibration(self) -> Calibration | None:
    """The measured layer times the plan was made with (``calibrate=True``), else None."""
    return self._require().calibration

  @property
  def timeline(self):
    """The last step's per-action ``Timeline`` (device times when ``measure`` was on)."""
    c = self._require()
    tl = c.last_fused if c.fused is not None else c.runner.last_timeline
    if tl is None:
      return None
    return dataclasses.replace(tl, stage_devices=tuple(s.devices for s in c.plan.stages))

  def explain(self) -> str:
    """Stages, devices, layers and the bytes cut between stages, as text."""
    c = self._require()
    g = c.layer_graph
    where = c.plan.stage_of_layer()
    lines = [str(c.plan), ""]
    if c.fused is not None:
      lines += [
        "runs as one jitted step: one stage on one device is gradient accumulation, so the "
        "micro-batch loop runs inside one XLA program (fuse=False runs it action by action)",
        "",
      ]
    lines.append("cut edges (bytes per micro-batch):")
    cut: dict[tuple[int, int], float] = {}
    for u, v, d in g.edges(data=True):
      if where[u] != where[v]:
        cut[(where[u], where[v])] = cut.get((where[u], where[v]), 0.0) + d["bytes"]
    for (a, b), by in sorted(cut.items()):
      lines.append(f"  stage {a} -> stage {b}: {by:,.0f} B")
    lines.append("")
    for s in c.plan.stages:
      flops = sum(g.nodes[l]["flops"] for l in s.layers)
      pbytes = sum(g.nodes[l]["param_bytes"] for l in s.layers)
      devs = ", ".join(str(self.devices[d]) for d in s.devices)
      lines.append(
        f"stage {s.index} on {devs}: {len(s.layers)} layers, {flops / 1e6:.3f} MFLOP "
        f"forward per micro-batch, {pbytes / 2**20:.3f} MiB parameters"
      )
    lines.append("")
    lines.append(str(c.schedule))
    return "\n".join(lines)

  def _require(self) -> Compiled:
    if self._last is None:
      raise RuntimeError("the pipeline is built on the first call; call the step once first")
    return self._last

  # ------------------------------------------------------------------ building
  def _batch_positions(self, args) -> tuple[int, ...]:
    if self.batch_argnums is None:
      return (len(args) - 1,)
    for a in self.batch_argnums:
      if not -len(args) <= a < len(args):
        raise ValueError(
          f"batch_argnums {self.batch_argnums} out of range for {len(args)} arguments"
        )
    return tuple(a % len(args) for a in self.batch_argnums)

  def _capture(self, args, pure, leaves, microbatch_size: int | None = None) -> Compiled:
    """Traces the step and layers its loss (no planning, no compilation), at micro-batches of
    ``microbatch_size`` samples (default: batch / num_microbatches)."""
    M = self.num_microbatches
    bpos = self._batch_positions(args)
    # Flat indices of batch leaves: graph state first, then the other arguments in order.
    nstate = (
      len(jax.tree.leaves(nnx.state(tuple(args[i] for i in pure.graph_positions))))
      if pure.graph_positions
      else 0
    )
    batch_idx: list[int] = []
    offset = nstate
    for i, a in enumerate(args):
      if i in pure.graph_positions:
        if i in bpos:
          raise CaptureError(f"argument {i} is an NNX object, not a batch; set batch_argnums")
        continue
      n = len(jax.tree.leaves(a))
      if i in bpos:
        batch_idx.extend(range(offset, offset + n))
      offset += n
    if not batch_idx:
      raise BatchError(
        f"the batch arguments {bpos} hold no arrays; pass the batch there or set batch_argnums"
      )
    sizes = {np.shape(leaves[i])[0] if np.ndim(leaves[i]) else None for i in batch_idx}
    if None in sizes or len(sizes) != 1:
      raise BatchError(
        f"batch leaves must share one leading (batch) dimension; got sizes "
        f"{sorted(map(str, sizes))}"
      )
    B = sizes.pop()
    assert B is not None  # None in sizes raised above
    if B % M:
      raise BatchError(
        f"the batch of {B} examples does not split into {M} micro-batches; use a "
        f"batch size divisible by {M} or a num_microbatches that divides {B}"
      )
    mb = B // M if microbatch_size is None else microbatch_size
    abstract = []
    for i, x in enumerate(leaves):
      shape = tuple(np.shape(x))
      if i in batch_idx:
        shape = (mb,) + shape[1:]
      abstract.append(jax.ShapeDtypeStruct(shape, _canonical(_dtype(x))))
    with recording() as recs:
      step = jax.make_jaxpr(pure.fn)(*abstract)
    if not recs:
      raise CaptureError(
        "the step never calls gpp_jax.value_and_grad; replace "
        "jax.value_and_grad / nnx.value_and_grad by gpp_jax.value_and_grad"
      )
    rec = recs[0]
    step = inline_calls(step)
    J = step.jaxpr
    markers = [k for k, e in enumerate(J.eqns) if e.primitive is value_and_grad_p]
    if len(markers) != 1:
      raise CaptureError(
        f"expected one gpp_jax.value_and_grad in the step, found {len(markers)} "
        "(it may not sit inside jax.lax control flow)"
      )
    mk = markers[0]
    marker = J.eqns[mk]
    batch_vars = {J.invars[i] for i in batch_idx}
    for k, e in enumerate(J.eqns):
      if k != mk and any(isinstance(a, xc.Var) and a in batch_vars for a in e.invars):
        raise CaptureError(
          f"the batch is used outside the loss function (by `{e.primitive.name}` at "
          f"{e.source_info.name_stack or 'top level'}); move every computation on the batch "
          "into the function given to gpp_jax.value_and_grad"
        )
    if any(isinstance(a, xc.Var) and a in batch_vars for a in J.outvars):
      raise CaptureError("the step returns its batch input; return only results")
    nparam = rec.num_params
    if any(isinstance(a, xc.Var) and a in batch_vars for a in marker.invars[:nparam]):
      raise CaptureError("a batch array is passed as the differentiated argument")
    roles: list[str | None] = [None] * nparam
    # Batch arrays are split, never carried (an aux leaf named like a batch entry is no state).
    rec.state = [
      p for p in rec.state if p.input is None or marker.invars[p.input] not in batch_vars
    ]
    carried = {p.input for p in rec.state if p.input is not None}
    for i, a in enumerate(marker.invars[nparam:], nparam):
      if isinstance(a, xc.Var) and a in batch_vars:
        roles.append(BATCH)
      elif i in carried:
        roles.append(STATE)
      elif _is_key(a.aval) and i not in rec.module_state:
        roles.append(KEY)
      else:
        roles.append(BROADCAST)
    if BATCH not in roles:
      raise CaptureError(
        "the loss function does not read the batch; the pipeline splits the "
        "batch read inside the loss into micro-batches"
      )
    check_state_returned(J, marker, rec.state)
    loss = inline_calls(marker.params["loss_jaxpr"])
    loss, split_paths, scan_split = split_scans(
      loss, nparam, rec.param_paths, [(p.input, p.output) for p in rec.state if p.input is not None]
    )
    layering = layer_program(
      loss,
      split_paths + [None] * (len(loss.jaxpr.invars) - len(split_paths)),
      batch_size=mb,
      layer_depth=self.layer_depth,
      name=getattr(self.fn, "__name__", "step"),
    )
    return Compiled(
      out_tree=pure.out_tree[-1],
      step=step,
      marker_index=mk,
      loss=loss,
      layering=layering,
      roles=roles,
      state=rec.state,
      scan_split=scan_split,
      nparam=nparam,
      batch_size=B,
      microbatch_size=mb,
    )

  def layer_graph_for(self, *args):
    """Traces the step for these arguments and returns its LayerGraph, without planning."""
    pure, leaves = functionalize(self.fn, args)
    return self._capture(args, pure, leaves).layering.graph

  def _build(self, args, pure, leaves) -> Compiled:
    c = self._capture(args, pure, leaves)
    M, B, mb, loss, layering = (
      self.num_microbatches,
      c.batch_size,
      c.microbatch_size,
      c.loss,
      c.layering,
    )
    step, mk, roles, nparam = c.step, c.marker_index, c.roles, c.nparam
    marker = step.jaxpr.eqns[mk]
    graph = layering.graph
    calibration = None
    if self.calibrate:
      calibration = self._calibrate(loss, layering)
      graph = calibration.apply(graph)
    plan = self._make_plan(graph, B)
    if jax.process_count() > 1:
      check_same_plan(plan, self.timeout_s)
    sizes = stage_microbatch_sizes(plan, B)
    placements = stage_placements(
      [[self.devices[d] for d in s.devices] for s in plan.stages], sizes
    )
    staged = stage_program(loss, layering.eqn_layer, layering.param_layer, plan)
    if len(set(sizes)) > 1:
      staged = self._restage(args, pure, leaves, c, plan, staged, sizes)
    sched = plan_schedule(plan, B)
    split = c.scan_split
    homes = param_homes(split.param_split, staged.param_owner)
    in_home = [homes[j] if j < nparam else -1 for j in range(len(marker.invars))]
    nloss = len(split.out_parts)
    out_home = [staged.loss_outputs[split.out_parts[k][0]][0] for k in range(nloss)] + homes
    prog = split_step(step, mk, in_home, out_home)
    # The loss's inputs and outputs after the scan split: one per slice of a split input.
    loss_roles = [r for r, ks in zip(roles, split.parts) for _ in ks]
    state = split_state(c.state, split)
    runner = PipelineRunner(staged, sched, placements, loss_roles, remat=self.remat, state=state)
    pieces = [(p, jax.jit(xc.jaxpr_as_fun(p.jaxpr))) for p in prog.before + prog.after]
    fused = None
    if (
      self.fuse
      and plan.num_stages == 1
      and len(plan.stages[0].devices) == 1
      and jax.process_count() == 1
      and weight_delays(sched) is None  # stale-weight schedules keep older versions
      and not c.state  # state carried between micro-batches runs in the driver
    ):
      # The loss as captured (one stage needs no scan split): inputs are the marker's.
      fused = fused_step(prog, inline_calls(marker.params["loss_jaxpr"]), roles, M, mb)
    logging.info(
      "graph_pipeline: %d stages (depth %d), micro-batches per stage %s of %s, %d step pieces",
      plan.num_stages,
      plan.depth(),
      list(sched.stage_counts),
      list(sizes),
      len(pieces),
    )
    return Compiled(
      out_tree=c.out_tree,
      plan=plan,
      layer_graph=graph,
      layering=layering,
      schedule=sched,
      staged=staged,
      runner=runner,
      prog=prog,
      pieces=pieces,
      nbefore=len(prog.before),
      placements=placements,
      batch_size=B,
      calibration=calibration,
      fused=fused,
      last_fused=None,
      roles=roles,
      nparam=nparam,
      scan_split=c.scan_split,
    )

  def _restage(
    self,
    args,
    pure,
    leaves,
    c: Compiled,
    plan: Plan,
    staged: StagedProgram,
    sizes: Sequence[int],
  ) -> StagedProgram:
    """The staged loss with each stage traced at its own micro-batch size.

    The step is captured once more per distinct size; stage s takes its program from the
    capture at ``sizes[s]``. Every capture must split into the same stages with the same
    inputs and outputs (a model whose program changes with the batch size cannot), and a value
    crossing between stages of different sizes must carry the batch as its leading axis, so
    that the driver can cut or join it along that axis.
    """
    by_size = {c.microbatch_size: staged}
    for b in sorted(set(sizes) - {c.microbatch_size}):
      cb = self._capture(args, pure, leaves, microbatch_size=b)
      if cb.scan_split != c.scan_split:
        raise CaptureError(
          f"the loss traced at micro-batch size {b} splits its scanned layers differently "
          f"than at {c.microbatch_size}; give every stage the same micro-batch size"
        )
      try:
        by_size[b] = stage_program(cb.loss, cb.layering.eqn_layer, cb.layering.param_layer, plan)
      except PlanError as e:
        raise CaptureError(
          f"the loss traced at micro-batch size {b} has other layers than at "
          f"{c.microbatch_size} ({e}); the model's program must not depend on the batch size "
          "to use per-stage micro-batch sizes"
        ) from e
    for b, other in by_size.items():
      same = (other.param_owner, other.loss_outputs, other.edges) == (
        staged.param_owner,
        staged.loss_outputs,
        staged.edges,
      ) and all(
        (x.inputs, x.outputs) == (y.inputs, y.outputs) for x, y in zip(other.stages, staged.stages)
      )
      if not same:
        raise CaptureError(
          f"the loss traced at micro-batch size {b} cuts into stages differently than at "
          f"{c.microbatch_size} (the program depends on the batch size); give every stage "
          "the same micro-batch size"
        )
    stages = tuple(by_size[b].stages[s] for s, b in enumerate(sizes))
    _check_rechunkable(stages, sizes)
    return dataclasses.replace(staged, stages=stages)

  def _planner_cluster(self):
    if self.cluster is not None:
      return self.cluster
    if jax.process_count() > 1:
      return process_cluster(self.devices)
    return len(self.devices)

  def _calibrate(self, loss, layering) -> Calibration:
    """Times the layers on this process's first device of the pipeline; with several
    processes, every process takes process 0's numbers so that all plan alike."""
    here = jax.process_index()
    device = next((d for d in self.devices if d.process_index == here), jax.local_devices()[0])
    cal = measure_layers(loss, layering.eqn_layer, layering.param_layer, layering.graph, device)
    if jax.process_count() == 1:
      return cal
    first = Calibration.from_json(exchange("calibration", cal.to_json(), self.timeout_s)[0])
    return dataclasses.replace(
      first,
      device=f"{first.device} on process 0",
    )

  def _make_plan(self, graph, batch_size) -> Plan:
    M = self.num_microbatches
    p = self.planner
    nd = len(self.devices)
    if isinstance(p, Plan):
      plan = p if p.num_microbatches == M else p.replace(num_microbatches=M)
      if has_mixed_microbatches(plan) and plan.batch_size != batch_size:
        plan = plan.replace(batch_size=batch_size)  # per-stage sizes are checked against it
      if self.schedule_name is not None:
        plan = plan.replace(schedule=self.schedule_name)
      validate_plan(plan, graph, nd, batch_size)
      return plan
    if isinstance(p, ManualPlan):
      return p.resolve(graph, M, self.schedule_name or "1f1b", nd, batch_size)
    if isinstance(p, str):
      fn = get_planner(p)
      cluster = self._planner_cluster()
      plan = fn(
        lg.scaled(graph, batch_size),
        cluster,
        batch_size,
        num_microbatches=M,
        **self.planner_options,
      )
    elif callable(p):
      plan = p(graph, self._planner_cluster(), batch_size, num_microbatches=M)
    else:
      raise TypeError(
        f"planner must be a name, a Plan, a gpp_jax.manual_plan or a callable; "
        f"got {type(p).__name__}"
      )
    if plan.num_microbatches != M:
      plan = plan.replace(num_microbatches=M)
    if self.schedule_name is not None:
      plan = plan.replace(schedule=self.schedule_name)
    validate_plan(plan, graph, nd, batch_size)
    return plan

  # ------------------------------------------------------------------ running
  def __call__(self, *args):
    pure, leaves = functionalize(self.fn, args)
    c = self.compiled_for(args, pure, leaves)
    outs = self.run_compiled(c, leaves)
    out, new_state = jax.tree.unflatten(c.out_tree, outs)
    if pure.graph_positions:
      nnx.update(tuple(args[i] for i in pure.graph_positions), new_state)
    return out

  def run_steps(self, *args, stream: bool | None = None):
    """K training steps in one call: ``step(*args_t)`` for t = 0..K-1, where each batch
    argument (the last one, or ``batch_argnums``) is given as a list of K batches.

    The state carries from step to step as it would over K calls: NNX objects among ``args``
    are updated in place; a functional step returns its new non-batch arguments first, in
    order (``(params, opt_state, batch) -> (params, opt_state, metrics)``), and step t + 1
    gets them. Returns the list of the K outputs for an NNX step; for a functional step what
    ``jax.lax.scan`` would: ``(*final non-batch arguments, [rest of the output per step])``.

    Under the stale-weight schedules (``pipedream-async``, ``pipedream-async-vsync``, ``2bw``)
    the steps can be issued as one stream without a flush between them (``runtime.stream``), as
    PipeDream runs. ``stream=None`` (default) streams on accelerators and runs K calls on CPU
    devices, where the client blocks the issuing thread once a device has a few dozen
    computations queued and the stream measured slower than K calls (see BUILD_NOTES);
    ``True`` streams wherever it can, ``False`` never. Other schedules, and runs the stream
    does not cover (one fused stage, scanned layers split across stages, several processes,
    ``measure=True``), run the K steps one after another. The values are those of K calls
    either way.
    """
    bpos = self._batch_positions(args)
    K = None
    for i in bpos:
      b = args[i]
      if not isinstance(b, (list, tuple)) or not b:
        raise BatchError(
          f"run_steps takes each batch argument as a non-empty list of per-step batches; "
          f"argument {i} is a {type(b).__name__}"
        )
      if K is not None and len(b) != K:
        raise BatchError(
          f"run_steps got {K} batches for one batch argument and {len(b)} for argument {i}; "
          "give every batch argument one batch per step"
        )
      K = len(b)
    assert K is not None

    def step_args(t: int) -> tuple:
      return tuple(a[t] if i in bpos else a for i, a in enumerate(args))

    first = step_args(0)
    pure, leaves = functionalize(self.fn, first)
    c = self.compiled_for(first, pure, leaves)
    graph = set(pure.graph_positions)
    carried_args = [i for i in range(len(args)) if i not in bpos and i not in graph]
    carry = self._carry_map(c, first, graph, carried_args)
    others_at = [i for i in range(len(args)) if i not in graph]
    nstate = len(leaves) - len(jax.tree.leaves(tuple(first[i] for i in others_at)))

    def flat(t: int) -> list:
      a = step_args(t)
      return leaves[:nstate] + jax.tree.leaves(tuple(a[i] for i in others_at))

    def signature(t: int) -> tuple:
      bs = [args[i][t] for i in bpos]
      shapes = [(np.shape(x), _canonical(_dtype(x))) for x in jax.tree.leaves(bs)]
      return str(jax.tree.structure(bs)), shapes

    want = signature(0)
    for t in range(1, K):
      if signature(t) != want:
        raise BatchError(
          f"run_steps needs batches of one structure, shape and dtype; batch {t} differs "
          "from batch 0"
        )
    steps_leaves = [leaves] + [flat(t) for t in range(1, K)]
    stale = weight_delays(c.schedule) is not None
    reason = stream_reason(c, self.measure, jax.process_count() > 1, stream)
    if reason is None and stale:
      outs = stream_steps(c, steps_leaves, carry)
    else:
      if reason is not None and stale:
        logging.info("run_steps: the %d steps run one after another: %s", K, reason)
      outs = []
      for t in range(K):
        step_leaves = steps_leaves[t]
        if t > 0:
          step_leaves = [outs[-1][carry[i]] if i in carry else x for i, x in enumerate(step_leaves)]
        outs.append(self.run_compiled(c, step_leaves))
    per_step = [jax.tree.unflatten(c.out_tree, o) for o in outs]
    if graph:
      nnx.update(tuple(args[i] for i in pure.graph_positions), per_step[-1][1])
    if not carried_args:
      return [out for out, _ in per_step]
    n = len(carried_args)
    rest = [out[n] if len(out) == n + 1 else tuple(out[n:]) for out, _ in per_step]
    return (*per_step[-1][0][:n], rest)

  def _carry_map(self, c: Compiled, args, graph, carried_args) -> dict[int, int]:
    """Flat input position -> flat output position of the state one step hands the next."""
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

  def cached_partial(self, *cached_args) -> Callable:
    """The step with its leading arguments bound, the NNX graph traversal done once.

    ``fast = step.cached_partial(model, optimizer)``, then ``fast(batch)`` is
    ``step(model, optimizer, batch)`` without splitting and updating the NNX objects on every
    call (milliseconds of host time per step for a few hundred variables), as
    ``nnx.cached_partial`` does for ``nnx.jit``: each call reads and writes the objects'
    Variables directly. Like there, the objects' structure must stay as it is between calls
    (assigning new values to their Variables is fine); see ``runtime.cached.CachedStep``.
    """
    return CachedStep(self, cached_args)

  def compiled_for(self, args, pure, leaves) -> Compiled:
    """The compiled pipeline for these step arguments (built on first use of their shapes)."""
    key = (
      pure.in_tree,
      tuple((tuple(np.shape(x)), str(_canonical(_dtype(x)))) for x in leaves),
      pure.graph_positions,
    )
    c = self._compiled.get(key)
    if c is None:
      c = self._compiled[key] = self._build(args, pure, leaves)
    self._last = c
    return c

  def run_compiled(self, c: Compiled, leaves) -> list:
    """Runs one step of ``c`` on the flat step arguments; returns the flat outputs."""
    self._last = c
    return self._execute_fused(c, leaves) if c.fused is not None else self._execute(c, leaves)

  def _execute_fused(self, c: Compiled, leaves):
    fused = c.fused
    assert fused is not None
    t0 = time.perf_counter()
    here = c.placements[0].replicated
    # State from the previous step is already there; only what is not (the batch) is put.
    outs = fused(
      *[
        x if isinstance(x, jax.Array) and x.sharding == here else jax.device_put(x, here)
        for x in leaves
      ]
    )
    if self.measure:
      jax.block_until_ready(outs)
    t = time.perf_counter() - t0
    c.last_fused = Timeline([TimelineEvent("STEP", 0, 0, 0.0, t)], t, self.measure)
    return outs

  def _execute(self, c: Compiled, leaves):
    J = c.prog.jaxpr.jaxpr
    homes = [p.replicated for p in c.placements]
    local = c.runner.local
    if c.runner.multiprocess:
      new_send_epoch()
    env: dict = {}
    for v, x, h in zip(J.invars, leaves, c.prog.invar_home):
      if h >= 0:
        env[v] = place_input(x, homes[h])
      elif c.runner.multiprocess and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
        env[v] = LocalCopy(x)  # unplaced (batch, keys): each process uses its own copy
      else:
        env[v] = x

    def read(a):
      return a.val if isinstance(a, xc.Literal) else env[a]

    def value(a):
      x = read(a)
      return x.value if isinstance(x, LocalCopy) else x

    def run_pieces(pieces):
      for p, f in pieces:
        # Every process issues the same puts (local copy, send, receive or no-op) ...
        args = [transfer(read(v), homes[p.home]) for v in p.inputs]
        if local[p.home]:
          outs = f(*args)
        else:  # ... and stands in placeholders for what another process computes.
          outs = [placeholder(o.aval, homes[p.home]) for o in p.outputs]
        for o, val in zip(p.outputs, outs):
          env[o] = val

    run_pieces(c.pieces[: c.nbefore])
    marker = c.prog.marker
    nparam = c.nparam
    vals = [
      read(a) if r in (None, KEY, BROADCAST, STATE) else value(a)
      for a, r in zip(marker.invars, c.roles)
    ]
    split, owner = c.scan_split, c.staged.param_owner
    params, data = vals[:nparam], vals[nparam:]
    if split.stacked:
      params = slice_params(split.param_split, params, owner, c.placements, local)
      data = slice_data(split, data)
    outs, grads = c.runner.run(
      params, params + data, measure=self.measure, versions=stale_versions(c, params)
    )
    if split.stacked:
      grads = stack_grads(split.param_split, grads, owner, c.placements, local)
      out_stage = [s for s, _ in c.staged.loss_outputs]
      outs = stack_outputs(split, outs, out_stage, c.placements, local)
    for o, val in zip(marker.outvars, list(outs) + list(grads)):
      if not isinstance(o, xc.DropVar):
        env[o] = val
    run_pieces(c.pieces[c.nbefore :])
    outs = [value(a) for a in J.outvars]
    if c.runner.multiprocess:
      wait_for(outs, self.timeout_s)
    return outs


def _check_rechunkable(stages: Sequence[Any], sizes: Sequence[int]) -> None:
  """Raises CaptureError for a value crossing between stages of different micro-batch sizes
  that does not have the batch as its leading axis (a per-chunk scalar, say): it cannot be
  cut or joined into the other stage's chunks."""
  out_aval = {
    o.vid: (st.index, v.aval) for st in stages for o, v in zip(st.outputs, st.jaxpr.jaxpr.outvars)
  }
  for st in stages:
    for r, v in zip(st.inputs, st.jaxpr.jaxpr.invars):
      if r.kind != "act" or sizes[r.src] == sizes[st.index]:
        continue
      p, src = out_aval[r.index]
      dst = v.aval
      if not (
        src.ndim >= 1
        and dst.ndim >= 1
        and src.shape[0] == sizes[p]
        and dst.shape[0] == sizes[st.index]
        and src.shape[1:] == dst.shape[1:]
      ):
        raise CaptureError(
          f"a value of shape {src.shape} at stage {p} (micro-batch {sizes[p]}) and "
          f"{dst.shape} at stage {st.index} (micro-batch {sizes[st.index]}) crosses between "
          "stages of different micro-batch sizes without the batch as its leading axis, so it "
          f"cannot be re-chunked; give stages {p} and {st.index} the same micro-batch size or "
          "put the layers that reduce over the batch into one stage"
        )


def _one_device_message(device) -> str:
  """The warning for a pipeline given a single device: every stage shares it."""
  msg = (
    f"graph_pipeline runs on one device ({device}): every stage shares it, so the step is "
    "gradient accumulation over micro-batches, not a pipeline. "
  )
  available = jax.device_count()
  if available > 1:
    return msg + f"JAX has {available} devices; pass several in devices=."
  if device.platform == "cpu":
    return msg + (
      "JAX has one CPU device unless asked for more before it is first used: call "
      'jax.config.update("jax_num_cpu_devices", 8) right after `import jax` (or set '
      "XLA_FLAGS=--xla_force_host_platform_device_count=8), then pass devices=jax.devices()."
    )
  return msg + (
    f"JAX has one device per accelerator and sees a single {device.platform.upper()} here; run "
    "on a machine with several."
  )


def _caller_level() -> int:
  """The ``stacklevel`` of the first frame outside this module (the decorator's caller)."""
  frame: FrameType | None = sys._getframe(1)
  level = 1
  while frame is not None and frame.f_code.co_filename == __file__:
    frame, level = frame.f_back, level + 1
  return level


def _dtype(x):
  return getattr(x, "dtype", None) or np.result_type(x)


def graph_pipeline(fn: Callable | None = None, **kwargs) -> Any:
  """Decorates a train step to run as a graph pipeline.

  Usage::

    @gpp_jax.graph_pipeline(num_microbatches=8, devices=jax.devices()[:4])
    def train_step(state, batch):
      def loss_fn(params):
        return loss(state.apply_fn(params, batch["x"]), batch["y"])
      loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

  Args:
    num_microbatches: micro-batches per step; the batch size must divide by it.
    devices: devices to run on (default: ``jax.devices()``); plan device indices refer to it.
      A single device with several micro-batches warns (every stage would share it); on CPU,
      ``jax.config.update("jax_num_cpu_devices", n)`` before JAX is first used gives n devices.
    planner: a planner name (``"balanced"``, and the cost-model planners), a ``Plan``, a
      ``gpp_jax.manual_plan(...)``, or a callable ``(layer_graph, cluster, batch_size,
      num_microbatches=) -> Plan``. Stages with different ``microbatch_size``s each run at
      their own size (``manual_plan(..., microbatch_sizes=)``, ``"graphpipe-stage-mb"``).
    schedule: ``"1f1b"``, ``"gpipe"``, ``"graph-1f1b"`` or ``"zero-bubble"`` (backward split
      into input and weight gradients, the latter deferred into bubbles); None (default) keeps
      the plan's (planners choose; a manual plan uses 1F1B).
    batch_argnums: positions of the batch arguments (default: the last argument).
    remat: recompute each stage's forward in its backward instead of keeping residuals.
    layer_depth: truncate layer paths to this many components (coarser layers).
    cluster: the Cluster description planners use (default: the device count).
    measure: run each stage in its own thread, blocking per action, to record a measured
      timeline (slower; single process only).
    calibrate: time every layer's forward and backward on this process's first device of the
      pipeline before planning (``passes.calibrate``: robust, identical layers timed once), so
      cost-model planners see measured layer times instead of the roofline estimate; with
      several processes all take process 0's times. The result is ``.calibration``.
    fuse: a plan of one stage on one device (in one process) runs as one jitted step, the
      micro-batch loop inside it (``runtime.fused``), so it costs what the plain jitted step
      costs; False runs it action by action like any other plan (to inspect its timeline).
    timeout_s: in a multi-process run, the set-up (sharing layer times and checking that all
      processes have one plan) or a step that has not finished after this many seconds
      (a peer process died or stalls) raises ``GppError`` instead of hanging.
  """
  if fn is None:
    return lambda f: GraphPipeline(f, **kwargs)
  return GraphPipeline(fn, **kwargs)


def _canonical(dtype):
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return jax.dtypes.canonicalize_dtype(dtype)
