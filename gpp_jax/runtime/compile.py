"""The compile chain: a train step and its arguments -> a ``CompiledStep``, phase by phase.

``compile_step`` runs the phases in order; each is a function of the previous phases' results
and returns one typed result:

  capture   (step, arguments)          -> Captured   the step's Jaxpr, its loss, layers, roles
  plan      Captured                   -> Planned    LayerGraph (calibrated), Plan
  stage     Captured, Planned          -> Staged     the loss per stage, the step around it,
                                                     each stage's placement
  schedule  Planned                    -> Schedule   per-stage action lists
  lower     Staged, Schedule           -> Lowered    the program the executor runs and the
                                                     simulator times (``passes.lowering``)
  kernels   Staged                     -> Kernels    the jitted stage, piece and fused functions
  executor  Lowered, Kernels           -> Executor   (``runtime.executor``)

``GraphPipeline`` (``runtime.pipeline``) keeps one ``CompiledStep`` per argument signature.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import jax
import networkx as nx
import numpy as np
from absl import logging
from flax import nnx
from jax.extend import core as xc
from jax.sharding import NamedSharding, PartitionSpec

from gpp_jax.cost.cluster import Link, as_cluster, devices_cluster, process_blocks
from gpp_jax.cost.cost_model import plan_costs
from gpp_jax.cost.host import HostCosts
from gpp_jax.cost.simulator import simulate, simulate_on_host
from gpp_jax.errors import BatchError, CaptureError, GppError, PlanError
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import (
  Plan,
  Stage,
  has_mixed_microbatches,
  stage_microbatch_sizes,
  validate_plan,
)
from gpp_jax.ir.program import Program
from gpp_jax.ir.schedule import Schedule
from gpp_jax.passes.calibrate import Calibration, measure_layers, measure_update
from gpp_jax.passes.capture import inline_calls
from gpp_jax.passes.layering import Layering, layer_program
from gpp_jax.passes.lowering import (
  BATCH,
  BROADCAST,
  KEY,
  STATE,
  Lowered,
  StepSpec,
  lower_fused,
  lower_step,
)
from gpp_jax.passes.partition import KeywordPlanner, get_planner
from gpp_jax.passes.partition.manual import ManualPlan
from gpp_jax.passes.partition.problem import (
  check_min_stages,
  planner_name,
  too_few_stages_error,
)
from gpp_jax.passes.scan_split import ScanSplit, split_scans
from gpp_jax.passes.schedules import plan_schedule, stream_schedule
from gpp_jax.passes.staging import (
  StagedProgram,
  row_local_functions,
  stage_functions,
  stage_program,
)
from gpp_jax.passes.step_split import StepProgram, split_step
from gpp_jax.passes.weight_versions import weight_delays
from gpp_jax.runtime.capture_step import PureStep, recording, value_and_grad_p
from gpp_jax.runtime.executor import Executor, Kernels, StageKernels, leaf_homes
from gpp_jax.runtime.fused import fused_step
from gpp_jax.runtime.input_checks import check_loss_is_pure
from gpp_jax.runtime.loss_state import StatePair, check_state_returned, split_state, state_carries
from gpp_jax.runtime.placement import (
  StagePlacement,
  pack_limit,
  place_input,
  stage_placements,
  transfer,
)
from gpp_jax.runtime.processes import check_same_plan, exchange
from gpp_jax.runtime.sharding import (
  MeshLayout,
  check_rows,
  check_specs,
  entry_axes,
  leaf_names,
  param_shards,
  plan_leaf_specs,
  stage_param_specs,
  step_leaf_specs,
  tensor_parallel,
)


@dataclasses.dataclass(frozen=True)
class Options:
  """The decorator's settings (``graph_pipeline``'s arguments)."""

  num_microbatches: int
  devices: tuple[Any, ...]
  planner: Any = "balanced"
  schedule: str | None = None
  batch_argnums: tuple[int, ...] | None = None
  remat: bool = False
  layer_depth: int | None = None
  cluster: Any = None
  measure: bool = False
  planner_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  timeout_s: float = 300.0
  calibrate: bool = False
  fuse: bool = True
  name: str = "step"
  memory_limit: int | None = None  # bytes per device; None: the device's, else the cluster's
  # The fewest stages the plan may have: the planner's own search keeps to plans of at least
  # this many (``PlanningProblem.min_stages``), and one-stage candidates do not compete.
  min_stages: int = 1
  donate_argnums: tuple[int, ...] = ()  # arguments whose arrays the fused step may consume
  # devices -> their host's HostCosts (``runtime.host.measure_host``), measured when calibrating
  host_probe: Callable[[Sequence[Any]], HostCosts] | None = None
  # The user's mesh (``runtime.sharding.MeshLayout``); None: ``devices`` as a one-axis mesh.
  # With a mesh, ``devices`` holds one device per row of its first axis: the planners count
  # rows, and a plan's device indices are row indices.
  layout: MeshLayout | None = None

  @property
  def mesh_layout(self) -> MeshLayout:
    return self.layout if self.layout is not None else MeshLayout.flat(self.devices)

  def batch_positions(self, nargs: int, positional: int | None = None) -> tuple[int, ...]:
    """Positions of the batch among ``nargs`` step arguments, of which the first
    ``positional`` are given by position (default: the last of those)."""
    npos = nargs if positional is None or positional < 0 else positional
    if self.batch_argnums is None:
      return (npos - 1,)
    for a in self.batch_argnums:
      if not -npos <= a < npos:
        raise ValueError(
          f"batch_argnums {self.batch_argnums} out of range for {npos} positional arguments"
        )
    return tuple(a % npos for a in self.batch_argnums)


# ---------------------------------------------------------------------------- capture


@dataclasses.dataclass(frozen=True)
class Captured:
  """The traced step (no planning, no compilation).

  Attributes:
    out_tree: the tree of the step's outputs (its own and the new NNX state).
    step: the whole step's ClosedJaxpr (calls inlined); ``marker_index`` its value-and-grad.
    loss: the loss's ClosedJaxpr after the scan split; ``layering`` its layers.
    roles: per marker input: None for a parameter, else BATCH, KEY, BROADCAST or STATE.
    state: state the loss updates (``runtime.loss_state``).
    scan_split: how stacked parameters were cut per layer (``passes.scan_split``).
    nparam: parameters of the captured loss.
    batch_size, microbatch_size: examples per step and per micro-batch (as traced).
    batch_leaves: the flat step arguments that are batch arrays (traced at micro-batch size).
    donated: the flat step arguments of ``donate_argnums`` (``donated_leaves``).
    reduce: per loss output, how it combines over micro-batches (``value_and_grad``'s
      ``aux_reduce``; None: the default rule).
    loss_as_traced: the loss at micro-batch size before the scan split (the fused step's).
  """

  out_tree: Any
  step: xc.ClosedJaxpr
  marker_index: int
  loss: xc.ClosedJaxpr
  layering: Layering
  roles: tuple[str | None, ...]
  state: tuple[StatePair, ...]
  scan_split: ScanSplit
  nparam: int
  batch_size: int
  microbatch_size: int
  batch_leaves: tuple[int, ...] = ()
  reduce: tuple[str | None, ...] = ()
  donated: tuple[int, ...] = ()
  loss_as_traced: xc.ClosedJaxpr | None = None
  # Per flat step argument: its partition spec (None: replicated) and a readable path.
  leaf_specs: tuple[Any, ...] = ()
  leaf_names: tuple[str, ...] = ()

  @property
  def marker(self) -> xc.JaxprEqn:
    return self.step.jaxpr.eqns[self.marker_index]


def capture(
  pure: PureStep,
  args: Sequence[Any],
  leaves: Sequence[Any],
  opts: Options,
  microbatch_size: int | None = None,
) -> Captured:
  """Traces the step and layers its loss, at micro-batches of ``microbatch_size`` samples
  (default: batch / num_microbatches).

  The loss is traced at the micro-batch size. The rest of the step is too, unless it reads
  the batch itself (metrics such as an accuracy computed from the batch and the logits the loss
  returned): then the step is traced once more at the whole batch, and that trace is the step
  the pipeline runs around its loss."""
  batch_idx, B = batch_leaves(pure, args, leaves, opts)
  mb = B // opts.num_microbatches if microbatch_size is None else microbatch_size
  step, rec, mk = _trace(pure, leaves, batch_idx, mb)
  traced_loss = inline_calls(step.jaxpr.eqns[mk].params["loss_jaxpr"])
  batch_vars = {step.jaxpr.invars[i] for i in batch_idx}
  if mb != B and _reads_batch_outside_loss(step.jaxpr, mk, batch_vars):
    step, _, mk = _trace(pure, leaves, batch_idx, B)
  J = step.jaxpr
  marker = J.eqns[mk]
  batch_vars = {J.invars[i] for i in batch_idx}
  if any(isinstance(a, xc.Var) and a in batch_vars for a in marker.invars[: rec.num_params]):
    raise CaptureError("a batch array is passed as the differentiated argument")
  # Batch arrays are split, never carried (an aux leaf named like a batch entry is no state).
  state = [p for p in rec.state if p.input is None or marker.invars[p.input] not in batch_vars]
  roles = input_roles(marker, rec.num_params, batch_vars, state, rec.module_state)
  check_state_returned(J, marker, state)
  pairs = [(p.input, p.output) for p in state if p.input is not None]
  loss, split_paths, scan_split = split_scans(traced_loss, rec.num_params, rec.param_paths, pairs)
  layering = layer_program(
    loss,
    split_paths + [None] * (len(loss.jaxpr.invars) - len(split_paths)),
    batch_size=mb,
    layer_depth=opts.layer_depth,
    name=opts.name,
  )
  check_loss_is_pure(loss, layering.eqn_layer)
  # The model's own partition specs hold over a mesh the user gave (``devices=`` alone runs as
  # before: stages replicate their parameters).
  specs = step_leaf_specs(pure, args, opts.layout) if opts.layout is not None else ()
  if len(specs) != len(leaves):  # a box holding several arrays: the specs cannot be told apart
    specs = (None,) * len(leaves)
  captured = Captured(
    out_tree=pure.out_tree[-1],
    step=step,
    marker_index=mk,
    loss=loss,
    layering=layering,
    roles=roles,
    state=tuple(state),
    scan_split=scan_split,
    nparam=rec.num_params,
    batch_size=B,
    microbatch_size=mb,
    batch_leaves=tuple(batch_idx),
    reduce=rec.reduce,
    donated=donated_leaves(pure, args, opts),
    loss_as_traced=traced_loss,
    leaf_specs=specs,
    leaf_names=tuple(leaf_names(pure, args)) if any(specs) else (),
  )
  # Stages over several rows sum their own gradients and reduce them once per step where
  # nothing the loss does depends on how the micro-batch is split (``row_local_programs``).
  layering.graph.graph["reduce_once"] = not (
    opts.remat or state or KEY in roles or jax.process_count() > 1
  )
  if any(specs) and opts.layout is not None:
    # Axes the mesh lacks are refused here; what divides what, per plan (``plan_leaf_specs``).
    shapes = [None if i in batch_idx else tuple(np.shape(x)) for i, x in enumerate(leaves)]
    check_specs(specs, shapes, captured.leaf_names, opts.layout, ())
    # What the cost model holds per device.
    layering.graph.graph["param_shards"] = param_shards(captured, opts.layout)
    layering.graph.graph["tensor_parallel"] = tensor_parallel(captured, opts.layout)
  return captured


def _trace(pure: PureStep, leaves: Sequence[Any], batch_idx: Sequence[int], size: int):
  """The step's ClosedJaxpr (calls inlined) with the batch leaves at ``size`` examples, the
  loss's record, and the marker's position."""
  abstract = [
    jax.ShapeDtypeStruct(
      ((size,) + tuple(np.shape(x))[1:]) if i in batch_idx else tuple(np.shape(x)),
      canonical_dtype(x),
    )
    for i, x in enumerate(leaves)
  ]
  with recording() as recs:
    # A fresh function each time: make_jaxpr caches traces by function, and a cached trace
    # runs none of the Python that records the loss.
    step = jax.make_jaxpr(lambda *a: pure.fn(*a))(*abstract)
  if not recs:
    raise CaptureError(
      "the step never calls gpp_jax.value_and_grad; replace "
      "jax.value_and_grad / nnx.value_and_grad by gpp_jax.value_and_grad"
    )
  step = inline_calls(step)
  markers = [k for k, e in enumerate(step.jaxpr.eqns) if e.primitive is value_and_grad_p]
  if len(markers) != 1:
    raise CaptureError(
      f"expected one gpp_jax.value_and_grad in the step, found {len(markers)} "
      "(it may not sit inside jax.lax control flow)"
    )
  return step, recs[0], markers[0]


def _reads_batch_outside_loss(J: xc.Jaxpr, mk: int, batch_vars: set) -> bool:
  """Whether the step reads (or returns) the batch outside its loss function."""
  return any(
    k != mk and any(isinstance(a, xc.Var) and a in batch_vars for a in e.invars)
    for k, e in enumerate(J.eqns)
  ) or any(isinstance(a, xc.Var) and a in batch_vars for a in J.outvars)


def batch_leaves(
  pure: PureStep, args: Sequence[Any], leaves: Sequence[Any], opts: Options
) -> tuple[list[int], int]:
  """The flat step arguments that are batch arrays, and the batch size (checked to split
  into the micro-batches)."""
  M = opts.num_microbatches
  bpos = opts.batch_positions(len(args), pure.num_positional)
  # Flat indices of batch leaves: graph state first, then the other arguments in order.
  nstate = (
    len(jax.tree.leaves(nnx.state(tuple(args[i] for i in pure.graph_positions))))
    if pure.graph_positions
    else 0
  )
  for i in pure.graph_positions:
    if i in bpos:
      raise CaptureError(f"argument {i} is an NNX object, not a batch; set batch_argnums")
  batch_idx = [k for i, r in _other_arg_leaves(pure, args, nstate).items() if i in bpos for k in r]
  if not batch_idx:
    raise BatchError(
      f"the batch arguments {bpos} hold no arrays; pass the batch there or set batch_argnums"
    )
  sizes = {np.shape(leaves[i])[0] if np.ndim(leaves[i]) else None for i in batch_idx}
  if None in sizes or len(sizes) != 1:
    raise BatchError(
      f"batch leaves must share one leading (batch) dimension; got sizes {sorted(map(str, sizes))}"
    )
  B = sizes.pop()
  assert B is not None  # None in sizes raised above
  if B % M:
    raise BatchError(
      f"the batch of {B} examples does not split into {M} micro-batches; use a "
      f"batch size divisible by {M} or a num_microbatches that divides {B}"
    )
  return batch_idx, B


def donated_leaves(pure: PureStep, args: Sequence[Any], opts: Options) -> tuple[int, ...]:
  """The flat step arguments of the arguments at ``opts.donate_argnums``: every array of a
  pytree there, and of an NNX object there its Variables' values (a Variable two objects
  share belongs to the first)."""
  if not opts.donate_argnums:
    return ()
  npos = pure.num_positional if pure.num_positional >= 0 else len(args)
  donate = set()
  for a in opts.donate_argnums:
    if not -npos <= a < npos:
      raise ValueError(
        f"donate_argnums {opts.donate_argnums} out of range for {npos} positional arguments"
      )
    donate.add(a % npos)
  out: list[int] = []
  gpos = pure.graph_positions
  nstate = 0
  if gpos:
    _, state = nnx.split(tuple(args[i] for i in gpos))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    out = [k for k, path in enumerate(paths) if gpos[path[0].key] in donate]
    nstate = len(paths)
  out += [k for i, r in _other_arg_leaves(pure, args, nstate).items() if i in donate for k in r]
  return tuple(out)


def _other_arg_leaves(pure: PureStep, args: Sequence[Any], nstate: int) -> dict[int, range]:
  """The flat step arguments of each argument that is not an NNX object, in argument order:
  the flat arguments are the ``nstate`` leaves of the NNX objects' state, then these."""
  out: dict[int, range] = {}
  offset = nstate
  for i, a in enumerate(args):
    if i not in pure.graph_positions:
      n = len(jax.tree.leaves(a))
      out[i] = range(offset, offset + n)
      offset += n
  return out


def input_roles(marker, nparam: int, batch_vars: set, state, module_state) -> tuple:
  """Per loss input: None for a parameter, BATCH (split into micro-batches), STATE (carried
  from micro-batch to micro-batch), KEY (micro-batch index folded in) or BROADCAST."""
  roles: list[str | None] = [None] * nparam
  carried = {p.input for p in state if p.input is not None}
  for i, a in enumerate(marker.invars[nparam:], nparam):
    if isinstance(a, xc.Var) and a in batch_vars:
      roles.append(BATCH)
    elif i in carried:
      roles.append(STATE)
    elif _is_key(a.aval) and i not in module_state:
      roles.append(KEY)
    else:
      roles.append(BROADCAST)
  if BATCH not in roles:
    raise CaptureError(
      "the loss function does not read the batch; the pipeline splits the "
      "batch read inside the loss into micro-batches"
    )
  return tuple(roles)


# ---------------------------------------------------------------------------- plan


# Where a candidate's time in the plan choice comes from (``Choice.how``, ``Planned.how``).
How = Literal["measured", "modelled"]
MEASURED: How = "measured"  # a timing trial of the candidate itself (``trial``)
MODELLED: How = "modelled"  # the cost model / simulator (``predict_seconds``)


@dataclasses.dataclass(frozen=True)
class Planned:
  """The plan and the graph it was made for.

  Attributes:
    plan: the validated plan (stages, devices, micro-batches, schedule name).
    layer_graph: the LayerGraph planned over (calibrated times where measured).
    calibration: the measured layer times (``calibrate=True``), else None.
    host: the host's measured costs (``calibrate=True``; with several processes, process
      0's of its own devices, ``probe_host``), else None.
    predicted_s: seconds per step predicted for the plan on this machine (with ``host``).
    alternatives: what else was predicted: candidate name -> seconds ("pipeline": the
      planner's plan, "plain jit", "jit data parallel").
    note: one line saying what was chosen and why ("" for a plan the user gave).
    measured: the candidates compiled and timed while choosing: name -> seconds per call of
      the compiled step (the host's time outside it not included).
    candidates: the plans ``alternatives`` predicted, by the same names (the planner's own
      plan is ``"pipeline"``, whichever was chosen), less any a trial found over the memory
      budget as compiled.
    how: per name of ``alternatives``, where its time comes from: ``"measured"`` (a timing
      trial of that candidate) or ``"modelled"`` (the cost model; ``Choice.how``).
    chosen: the name of the candidate that runs (``"pipeline"`` for the planner's own plan
      and a plan the user gave).
  """

  plan: Plan
  layer_graph: nx.DiGraph
  calibration: Calibration | None = None
  host: HostCosts | None = None
  predicted_s: float | None = None
  alternatives: Mapping[str, float] = dataclasses.field(default_factory=dict)
  note: str = ""
  trial: Any = None  # the chosen plan's compiled step, when a trial compiled it already
  measured: Mapping[str, float] = dataclasses.field(default_factory=dict)
  candidates: Mapping[str, Plan] = dataclasses.field(default_factory=dict)
  # Every candidate considered, those over the budget too: its modelled peak bytes per device.
  memory: Mapping[str, float] = dataclasses.field(default_factory=dict)
  memory_limit: float | None = None
  how: Mapping[str, How] = dataclasses.field(default_factory=dict)
  chosen: str = "pipeline"

  @property
  def predicted_how(self) -> How:
    """Where ``predicted_s`` comes from: the chosen candidate's ``how``."""
    return self.how.get(self.chosen, MODELLED)


def plan_step(
  captured: Captured,
  opts: Options,
  trial: Callable[[Plan], tuple[Any, float]] | None = None,
  again: Callable[[Any], float] | None = None,
) -> Planned:
  """Calibrates (if asked), plans, validates; with several processes, checks that every
  process has the same plan.

  What a user would run instead of a pipeline is in the plan space: a planner's plan competes
  with plain jit on one device, jit data parallel over the devices (one-stage plans, run as
  one jitted step) and its own plans on fewer devices, each predicted for this machine
  (``predict_seconds`` with the host's measured costs), and the fastest is taken.
  ``min_stages`` keeps the planner's own search to plans of at least that many stages (its
  best such plan is its plan: ``PlanningProblem.min_stages``; no other planner stands in) and
  leaves out the candidates of fewer stages. Without calibration (layer times estimated, the
  host not measured) the planner's plan is kept and a faster baseline only noted. A plan the
  user gives is run as it is, with the same prediction.

  When calibrating, the planner searches with the host's measured costs (``make_plan(host=)``:
  every plan it compares is predicted for this machine), after the layers are timed at each
  width a pipeline's stage may take (``stage_widths``, ``calibrate_widths``; on CPU devices of
  one process), and once more after the trials below have fitted the fusion and the model's
  own SPMD factor (one-stage plans are priced with them only then).

  When calibrating, ``trial(plan)`` compiles and times plain jit (``(compiled step, seconds)``):
  the measured step calibrates the layer times' sum against what XLA makes of the whole
  model (``fusion``: their ratio, applied to the one-stage candidates, which XLA compiles as
  one program; a pipeline's stages are compiled apart, as the layers were timed), and if
  plain jit is chosen its compiled step is kept (``Planned.trial``). Jit data parallel is
  timed the same way (``calibrate_spmd``). Plain jit's step in the planner's micro-batches
  on its device (gradient accumulation) is timed beside plain jit, and the planner's plan
  where it is jit data parallel's step in micro-batches beside that: the two times of one
  width fit the fusion (one device) or the model's SPMD factor (several) and the fixed
  seconds each micro-batch pays apart. The step in micro-batches on one device is then a
  candidate too (``"plain jit in micro-batches"``, unless ``min_stages`` asks for a
  pipeline), chosen where it measured faster than plain jit. The candidate then predicted
  fastest, if none of these, is timed before it is taken (``checked_by_trial``).

  ``again(compiled step)`` times a trial's step once more (seconds per call): the steps
  compared are then timed in turns (``_interleaved``), so that a slow or fast spell of the
  machine does not fall on one of them only."""
  graph = captured.layering.graph
  B = captured.batch_size
  given = isinstance(opts.planner, (Plan, ManualPlan))
  if not given:  # before anything is timed: the stages asked for must be possible
    check_min_stages(
      opts.min_stages, len(opts.devices), graph.number_of_nodes(), opts.layout is not None
    )
  calibration = host = None
  if opts.calibrate:
    calibration = calibrate(captured, opts)
    graph = calibration.apply(graph)
    if opts.host_probe is not None:
      host = probe_host(opts)
      opts = with_measured_link(opts, host)
  if calibration is not None and host is not None and not given:
    # The planner searches with the host's measured costs: every plan it compares is
    # predicted for this machine, as the candidates below are. A stage over several devices
    # is priced by its layers timed that wide, so each width a stage may take is timed first.
    widths = stage_widths(len(opts.devices), captured.microbatch_size)
    graph = calibrate_widths(captured, graph, (), host, opts.devices, widths)
  plan = make_plan(graph, B, opts, host)
  cluster = planner_cluster(opts)
  candidates = {"pipeline": plan}
  if not given:
    candidates.update(baseline_plans(graph, B, opts, sharded=any(captured.leaf_specs)))
    if host is not None:  # where the host is the bottleneck, fewer devices can be faster
      candidates.update(fewer_device_plans(graph, B, opts, host))
    candidates = {
      k: p for k, p in candidates.items() if k == "pipeline" or p.num_stages >= opts.min_stages
    }
  if calibration is not None:  # stages over several devices (of any width not timed yet)
    graph = calibrate_widths(captured, graph, candidates.values(), host, opts.devices)
  trials: dict[str, tuple[Any, float]] = {}
  # The plain step, timed, calibrates one-stage predictions (a given pipeline needs none).
  if host is not None and trial is not None and (not given or plan.num_stages == 1):
    # Layers timed one call each add up to more than XLA makes of the whole model (it fuses
    # across layers): plain jit, compiled and timed, says by how much.
    plain = candidates.get("plain jit") or baseline_plans(graph, B, opts, (1,))["plain jit"]
    _timed(trials, "plain jit", plain, trial, candidates, opts.timeout_s)
    # Jit data parallel timed too: how much slower than 1/k of plain jit's time its step is
    # over k devices depends on the model (its share of work per device against the
    # collectives), which the host's probe of a small MLP only guesses (measured 0.5x to 3.5x
    # off: BUILD_NOTES, fidelity). It is what a user would run: measured, not modelled.
    dp = candidates.get("jit data parallel")
    # Plain jit's step in the planner's micro-batches on its one device (gradient
    # accumulation) is timed beside it, and where the planner's plan is jit data parallel's
    # step in micro-batches, that too: the two times of one width tell the fixed seconds each
    # micro-batch pays from the share of work that divides (``calibrate_fusion``,
    # ``calibrate_spmd``). Timed whatever the planner's first plan, since the second search
    # below may return it. A throwaway dict: a plan over the memory budget leaves no
    # candidate here.
    acc = candidates["pipeline"]
    M = opts.num_microbatches or acc.num_microbatches
    one_acc = plain.replace(num_microbatches=M) if M > 1 and B % M == 0 else None
    if "plain jit" in trials and one_acc is not None and (not given or is_same(plan, one_acc)):
      name = "pipeline" if is_same(acc, one_acc) else ACCUMULATED
      _timed(trials, name, one_acc, trial, dict(candidates), opts.timeout_s)
    wide_acc = dp is not None and acc.num_stages == 1 and acc.num_microbatches > 1
    wide_acc = wide_acc and dp is not None and acc.stages[0].devices == dp.stages[0].devices
    if dp is not None:
      _timed(trials, "jit data parallel", dp, trial, candidates, opts.timeout_s)
      if "jit data parallel" in trials and wide_acc:
        _timed(trials, "pipeline", acc, trial, dict(candidates), opts.timeout_s)
    if again is not None:
      _interleaved(trials, list(trials), again, opts.timeout_s)
    if "plain jit" in trials:
      timed = trials.get(ACCUMULATED)
      if one_acc is not None and is_same(acc, one_acc):
        timed = trials.get("pipeline")
      pieces = (one_acc, timed[1]) if one_acc is not None and timed is not None else None
      graph = calibrate_fusion(graph, B, plain, cluster, host, trials["plain jit"][1], pieces)
    if dp is not None and "jit data parallel" in trials:
      pieces = (acc, trials["pipeline"][1]) if wide_acc and "pipeline" in trials else None
      graph = calibrate_spmd(graph, B, dp, cluster, host, trials["jit data parallel"][1], pieces)
    if not given and trials:
      # The search ran before the trials said what XLA makes of a step in one program (the
      # fusion, the model's own SPMD factor, the fixed seconds per micro-batch), so it priced
      # one-stage plans with the host's probe only: searched again with them, the planner's
      # plan replaces its first one.
      better_plan = make_plan(graph, B, opts, host)
      if plan_shape(better_plan) != plan_shape(plan):
        logging.info(
          "graph_pipeline: searched again with the trials' calibration, %s's plan has %d "
          "stage(s) (first: %d)",
          better_plan.planner,
          better_plan.num_stages,
          plan.num_stages,
        )
        plan = candidates["pipeline"] = better_plan
        trials.pop("pipeline", None)  # the first plan's timing
        if one_acc is not None and ACCUMULATED in trials and is_same(plan, one_acc):
          trials["pipeline"] = trials[ACCUMULATED]  # the step it timed
        graph = calibrate_widths(captured, graph, [plan], host, opts.devices)
    candidate = not given and opts.min_stages <= 1
    if one_acc is not None and ACCUMULATED in trials and candidate:
      if is_same(plan, one_acc):
        trials.pop(ACCUMULATED)  # the planner's plan, timed as "pipeline"
      else:  # timed: chosen where it measured faster than plain jit (``choose_plan``)
        candidates[ACCUMULATED] = one_acc
    else:
      trials.pop(ACCUMULATED, None)
  measured = {k: t for k, (_, t) in trials.items()}
  chose = choose(candidates, lg.scaled(graph, B), cluster, host, measured)
  choice, predicted = chose.name, chose.predicted
  note = ""
  if trial is not None and not given and choice not in trials:
    choice, note = checked_by_trial(
      choice, trials, candidates, predicted, trial, opts.timeout_s, again
    )
  if note:
    logging.info("graph_pipeline: %s", note)
    plan = candidates[choice]
  elif choice != "pipeline" and host is None:
    # Devices-only layer estimates are not this machine's: say so, keep the planner's plan.
    if predicted[choice] < predicted["pipeline"]:
      note = (
        f"{choice} is predicted faster than {plan.planner}'s pipeline of {plan.num_stages} "
        f"stages by the devices-only model ({predicted[choice] * 1e3:.2f} against "
        f"{predicted['pipeline'] * 1e3:.2f} ms); calibrate=True measures this machine and "
        "chooses by it"
      )
      logging.info("graph_pipeline: %s", note)
    choice = "pipeline"
  elif choice != "pipeline":
    theirs = (
      f"pipeline of {plan.num_stages} stages"
      if plan.num_stages > 1
      else f"one stage of {plan.num_microbatches} micro-batches"
    )
    note = (
      f"{choice} is predicted fastest on this machine: {predicted[choice] * 1e3:.2f} ms per "
      f"step against {predicted['pipeline'] * 1e3:.2f} ms for {plan.planner}'s {theirs}"
    )
    if predicted[choice] > predicted["pipeline"]:  # the planner's plan accumulates gradients
      note = (
        f"{choice} runs the step in one call ({predicted[choice] * 1e3:.2f} ms predicted): "
        f"{plan.planner}'s {theirs} ({predicted['pipeline'] * 1e3:.2f} ms predicted) is the "
        "same computation in pieces, which saves memory, not time"
      )
    if candidates[choice].num_stages == 1:
      note += " (min_stages=2 runs a pipeline regardless)"
    logging.info("graph_pipeline: %s", note)
    plan = candidates[choice]
  elif choice == "pipeline" and plan.num_stages == 1 and plan.num_microbatches > 1:
    base = "plain jit" if len(plan.stages[0].devices) == 1 else "jit data parallel"
    if "pipeline" in measured and base in measured:  # chosen for its measurement
      note = (
        f"{plan.planner}'s one stage of {plan.num_microbatches} micro-batches measured "
        f"{measured['pipeline'] * 1e3:.2f} ms per step, faster than {base}'s "
        f"{measured[base] * 1e3:.2f} ms in one call"
      )
      logging.info("graph_pipeline: %s", note)
  if not given and opts.min_stages > 1:
    kept_to = (
      f"min_stages={opts.min_stages}: {plan.planner}'s search kept to plans of at least "
      f"{opts.min_stages} stages"
    )
    note = f"{kept_to}; {note}" if note else kept_to
  if jax.process_count() > 1:
    check_same_plan(plan, opts.timeout_s)
  kept = trials[choice][0] if choice in trials else None
  measured = {k: t for k, (_, t) in trials.items()}
  plans = {k: candidates[k] for k in predicted if k in candidates}
  scaled = lg.scaled(graph, B)
  memory = {k: predicted_peak(p, scaled, cluster, host) for k, p in candidates.items()}
  return Planned(
    plan,
    graph,
    calibration,
    host,
    predicted[choice],
    predicted,
    note,
    kept,
    measured,
    plans,
    memory,
    cluster.memory_per_device,
    chose.how,
    choice,
  )


def predicted_peak(plan: Plan, graph: nx.DiGraph, cluster: Any, host: HostCosts | None) -> float:
  """The cost model's peak bytes per device of ``plan`` (its largest stage's)."""
  if not plan.batch_size:
    plan = plan.replace(batch_size=graph.graph["batch_size"])
  return max(simulate_on_host(plan, graph, cluster, host).stage_memory, default=0.0)


def plan_shape(plan: Plan) -> tuple:
  """What makes two plans the same step: each stage's layers and devices, the micro-batches."""
  return tuple((s.layers, s.devices) for s in plan.stages), plan.num_microbatches


def is_same(a: Plan, b: Plan) -> bool:
  """Whether ``a`` and ``b`` are the same step (``plan_shape``)."""
  return plan_shape(a) == plan_shape(b)


# The trial of plain jit's step in the planner's micro-batches (gradient accumulation on one
# device), where that is not the planner's plan: it fits the fusion, and it is a candidate,
# chosen where it measured faster than plain jit (medium MMT on 8 forced CPU devices: 0.81x).
ACCUMULATED = "plain jit in micro-batches"


def checked_by_trial(
  choice: str,
  trials: dict[str, tuple[Any, float]],
  candidates: dict[str, Plan],
  predicted: Mapping[str, float],
  trial: Callable[[Plan], tuple[Any, float]],
  timeout_s: float,
  again: Callable[[Any], float] | None = None,
) -> tuple[str, str]:
  """The candidate predicted fastest, compiled and timed like the baselines before it is
  taken: (the choice, "" where it stands; else the fastest candidate timed, and the note that
  says why). Where no baseline among ``candidates`` was timed, the prediction stands alone.
  The predictions of one-call steps are their measurements; a pipeline's is the simulator's,
  which misses what the host and the devices do to it on some machines (BUILD_NOTES,
  fidelity). Its compiled step is kept, so a pipeline that stands is compiled once. With
  ``again``, it and the fastest baseline are then timed in turns (``_interleaved``)."""
  # Only candidates the cost model found to fit the memory budget (``predicted``) compete: a
  # baseline timed to calibrate (plain jit, always) may not.
  timed = [k for k in trials if k in candidates and k in predicted]
  if not timed:
    return choice, ""
  _timed(trials, choice, candidates[choice], trial, candidates, timeout_s)
  best = min(timed, key=lambda k: trials[k][1])
  what = f"{choice} ({predicted[choice] * 1e3:.2f} ms predicted)"
  if choice not in trials:
    return best, f"{what} does not fit the memory budget as compiled: {best} runs instead"
  if again is not None:  # the two compared, timed in turns
    _interleaved(trials, [best, choice], again, timeout_s)
  mine, theirs = trials[choice][1], trials[best][1]
  if mine <= theirs:
    return choice, ""
  return best, (
    f"{what} measured {mine * 1e3:.2f} ms per step, slower than {best}'s {theirs * 1e3:.2f} ms: "
    f"{best} runs instead (min_stages=2 runs a pipeline regardless)"
  )


def probe_host(opts: Options) -> HostCosts | None:
  """The host's costs of driving ``opts.devices`` (``opts.host_probe``). With several
  processes, each holding an equal block of the devices in order, each probes its own block
  (its issuing thread's costs) and all take process 0's numbers, so that all plan alike
  (``HostCosts.processes``); how many device computations run at full speed at once is
  measured across the processes (``runtime.host.measure_parallel_across``: processes on one
  machine share its cores). Devices spread over the processes otherwise leave the host out
  (None: the planner's plan is kept)."""
  assert opts.host_probe is not None
  P, here = jax.process_count(), jax.process_index()
  if P == 1:
    return opts.host_probe(opts.devices)
  owners = [d.process_index for d in opts.devices]
  per = process_blocks(owners)
  if per is None or owners[::per] != list(range(P)):  # block k: process k's devices
    logging.info(
      "graph_pipeline: the devices are not in equal blocks per process (process of each: "
      "%s), so the host's costs are left out of the choice of plan",
      owners,
    )
    return None
  from gpp_jax.runtime.host import measure_link_across, measure_parallel_across

  mine = opts.host_probe([d for d in opts.devices if d.process_index == here])
  first = HostCosts.from_json(exchange("host", mine.to_json(), opts.timeout_s)[0])
  parallel = first.parallel
  if parallel is not None:  # CPU devices
    parallel = measure_parallel_across(opts.devices, opts.timeout_s)
  # Measured where every process can send to the others (JAX's cross-host transfers need a
  # socket address per process: ``initialize(transfer_address=)``); else the cluster's link.
  address = getattr(jax.config, "values", {}).get("jax_cross_host_transfer_socket_address")
  can = exchange("transfers", "1" if address else "0", opts.timeout_s)
  link = measure_link_across(opts.devices, opts.timeout_s) if "0" not in can else None
  return dataclasses.replace(first, processes=P, parallel=parallel, cross_link=link)


def with_measured_link(opts: Options, host: HostCosts | None) -> Options:
  """``opts`` whose cluster's link between nodes (processes) is the one measured
  (``HostCosts.cross_link``), where there is both."""
  if host is None or host.cross_link is None:
    return opts
  cluster = planner_cluster(opts)
  if cluster.inter_link is None:
    return opts
  alpha, beta = host.cross_link
  link = Link(alpha=alpha, beta=beta, name="cross-process, measured")
  return dataclasses.replace(opts, cluster=cluster.replace(inter_link=link))


def _timed(
  trials: dict[str, tuple[Any, float]],
  name: str,
  plan: Plan,
  trial: Callable[[Plan], tuple[Any, float]],
  candidates: dict[str, Plan],
  timeout_s: float,
) -> None:
  """Runs ``trial(plan)`` into ``trials[name]``; a candidate that does not fit the memory
  budget (its compiled program says so) leaves the candidates. With several processes all
  take process 0's clock (plain jit runs there alone), and a candidate that does not fit on
  one process leaves them on all, so that all choose alike."""
  try:
    result: tuple[Any, float] | None = trial(plan)
  except PlanError:
    result = None
  if jax.process_count() > 1:
    times = exchange("trial", "-" if result is None else repr(result[1]), timeout_s)
    if result is not None:
      result = None if "-" in times else (result[0], float(times[0]))
  if result is None:
    candidates.pop(name, None)
  else:
    trials[name] = result


TRIAL_ROUNDS = 2  # rounds of timing in turns after the trials (``_interleaved``)


def _interleaved(
  trials: dict[str, tuple[Any, float]],
  names: Sequence[str],
  again: Callable[[Any], float],
  timeout_s: float,
  rounds: int | None = None,
) -> None:
  """The trials ``names`` timed ``rounds`` (default ``TRIAL_ROUNDS``) more times in turns
  (``again(compiled step)``), backwards and forwards in alternate rounds; each keeps the
  median of its times, the trial's own included. Trials taken one after another fall in
  different spells of a shared machine's speed, which last from milliseconds to seconds: on
  2 cores, one step measured 1.4x apart in one run (BUILD_NOTES, fidelity), enough to flip a
  choice between steps within 20% of each other. With several processes every process times
  the same steps in the same order, and all take process 0's clock, as ``_timed`` does."""
  names = [k for k in names if k in trials]
  rounds = TRIAL_ROUNDS if rounds is None else rounds
  if len(names) < 2 or rounds < 1:
    return
  seen = {k: [trials[k][1]] for k in names}
  for r in range(rounds):
    order = names[::-1] if r % 2 == 0 else names
    times = [again(trials[k][0]) for k in order]
    if jax.process_count() > 1:
      times = json.loads(exchange("retime", json.dumps(times), timeout_s)[0])
    for k, t in zip(order, times):
      seen[k].append(t)
  for k in names:
    trials[k] = (trials[k][0], statistics.median(seen[k]))


# A candidate's prediction counts as its trial's where the two agree to this (relative): the
# fits (``calibrate_fusion``, ``calibrate_spmd``) solve for it exactly, and miss it only where
# a floor held the factor (the prediction is then the model's, calibrated).
SAME_AS_TRIAL = 1e-3


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` decided.

  Attributes:
    name: the candidate predicted fastest (of those it may choose: ``choose``).
    predicted: seconds per step of each candidate that fits the memory budget (the
      ``"pipeline"`` always), as compared.
    how: per name of ``predicted``, where its time comes from: ``"measured"`` where it is a
      timing trial's of that very candidate (the fits make a timed one-call step's
      prediction its measurement plus the host's time outside the step; gradient
      accumulation measured faster than its one-call step is that step's measured time
      scaled by the two measurements), ``"modelled"`` where it is the cost model's
      (simulator's) prediction, calibrated or not, whether or not the candidate was timed
      (a pipeline timed before it is taken keeps its modelled time here: the trial that
      checks it is ``Planned.measured``'s).
  """

  name: str
  predicted: dict[str, float]
  how: dict[str, How]


def choose_plan(
  candidates: Mapping[str, Plan],
  graph: nx.DiGraph,
  cluster: Any,
  host: HostCosts | None,
  measured: Mapping[str, float] | None = None,
) -> tuple[str, dict[str, float]]:
  """(the name of the candidate predicted fastest, seconds predicted per candidate):
  ``choose``'s name and predictions (its ``how`` left out)."""
  c = choose(candidates, graph, cluster, host, measured)
  return c.name, c.predicted


def choose(
  candidates: Mapping[str, Plan],
  graph: nx.DiGraph,
  cluster: Any,
  host: HostCosts | None,
  measured: Mapping[str, float] | None = None,
) -> Choice:
  """The candidate predicted fastest, the seconds predicted per candidate and where each
  time comes from (``Choice``), over ``graph`` (scaled to the batch) on ``cluster`` with the
  host's costs (``predict_seconds``).
  Candidates whose predicted memory does not fit are left out, except ``"pipeline"`` (the
  planner's own plan, which fits by construction or was asked for); on a tie it wins.

  Gradient accumulation (one stage, several micro-batches) is the one-call step's
  computation in pieces: it saves memory, mostly not time (the loop measured 1.3-2.6x plain
  jit's step, on an H200 and on forced CPU devices; over 4 forced CPU devices, 1.5-2.8x jit
  data parallel's), though the cost model, linear in the micro-batch, ties the two where the
  fixed seconds each micro-batch pays were not fitted (``calibrate_fusion``,
  ``calibrate_spmd``). Where a one-call candidate over the same number of devices fits (plain
  jit on one, jit data parallel on all), it is not chosen, unless trials timed both
  (``measured``: name -> seconds per call) and the step in micro-batches measured faster
  (medium MMT on one forced CPU device in 4 micro-batches: 0.92x plain jit's time, BUILD_NOTES):
  it is then predicted at the one-call step's prediction times the ratio of the two
  measurements.

  Each time is labelled (``Choice.how``): measured where it is the candidate's own trial's
  (``measured``, plus the host's time outside the step, which the fits add), else
  modelled."""
  predicted = {}
  for name, p in candidates.items():
    seconds, fits = predict_seconds(p, graph, cluster, host)
    if fits or name == "pipeline":
      predicted[name] = seconds

  def one_stage_width(p: Plan) -> int | None:
    return len(p.stages[0].devices) if p.num_stages == 1 else None

  in_one_call: dict[int | None, str] = {}
  for k in BASELINES:  # the first of each width: plain jit, jit data parallel
    if k in predicted:
      in_one_call.setdefault(one_stage_width(candidates[k]), k)
  timed = measured or {}
  outside = host.outside if host is not None else 0.0
  how: dict[str, How] = {
    k: MEASURED
    if host is not None
    and k in timed
    and math.isclose(t, timed[k] + outside, rel_tol=SAME_AS_TRIAL)
    else MODELLED
    for k, t in predicted.items()
  }
  choosable = []
  for k in predicted:
    p = candidates[k]
    base = in_one_call.get(one_stage_width(p))
    if k in BASELINES or p.num_microbatches <= 1 or base is None:
      choosable.append(k)  # not gradient accumulation beside a one-call step
    elif k in timed and base in timed and timed[k] < timed[base]:
      predicted[k] = predicted[base] * timed[k] / timed[base]
      how[k] = how[base]  # the one-call step's time, scaled by the two trials
      choosable.append(k)  # measured faster than the one-call step
  name = min(choosable, key=lambda k: (predicted[k], k != "pipeline"))
  return Choice(name, predicted, how)


FUSION_FLOOR = 0.05  # the smallest fusion fitted: the compute keeps 5% of the layers' sum


def calibrate_fusion(
  graph: nx.DiGraph,
  batch_size: int,
  plain: Plan,
  cluster: Any,
  host: HostCosts,
  seconds: float,
  pieces: tuple[Plan, float] | None = None,
) -> nx.DiGraph:
  """``graph`` with ``graph.graph["fusion"]``: the factor by which its layer times scale so
  that plain jit's prediction equals its measured ``seconds`` per call of its compiled step
  plus the host's time outside the step, which ``seconds`` leaves out (``predict_seconds``
  applies it to one-stage plans; the host's issue and the update are not scaled). The
  compute keeps at least 5% of the layers' sum.

  ``pieces``: the same step on the same device in M > 1 micro-batches (gradient
  accumulation), timed too ((its plan, seconds per call)). A micro-batch of the step's loop
  pays what does not shrink with it (each backward's gradients of the whole parameters,
  added to the sum; the loop's own work): plain jit's fusion alone priced medium CANDLE-Uno's
  step in 4 micro-batches at -43% of its measurement. The two timings fit the fusion and
  those fixed seconds per micro-batch (``graph.graph["spmd_call"]["1"]``, ``cost.simulator
  .spmd_call`` of one device) each on its own (``_fitted_apart``; where the seconds come out
  negative, the fusion alone, as without ``pieces``)."""

  def set_fusion(g: nx.DiGraph, f: float) -> None:
    g.graph["fusion"] = f

  if pieces is not None:

    def set_both(g: nx.DiGraph, factor: float, call: float) -> None:
      g.graph["fusion"] = factor
      g.graph["spmd_call"] = {**graph.graph.get("spmd_call", {}), "1": call}

    timed = [(plain, seconds), pieces]
    both = _fitted_apart(graph, batch_size, timed, cluster, host, set_both, FUSION_FLOOR)
    if both is not None:
      return both
  return _calibrated(graph, batch_size, plain, cluster, host, seconds, set_fusion, FUSION_FLOOR)


SPMD_FLOOR = 0.25  # the smallest SPMD factor fitted: a quarter of perfect division


def calibrate_spmd(
  graph: nx.DiGraph,
  batch_size: int,
  plan: Plan,
  cluster: Any,
  host: HostCosts,
  seconds: float,
  pieces: tuple[Plan, float] | None = None,
) -> nx.DiGraph:
  """``graph`` with the model's own step over k devices (the one-stage ``plan``, timed:
  ``seconds`` per call, to which the host's time outside the step adds): ``graph.graph
  ["spmd"][str(k)]`` and ``graph.graph["spmd_call"][str(k)]``, the SPMD factor and the fixed
  seconds of one computation over k devices (``cost.simulator.spmd_factor`` and
  ``spmd_call``), both the host's probe's times one ratio r, the r at which the plan's
  prediction is the measurement. One timing cannot tell a fixed cost from a proportional one;
  the probe's split holds for the model roughly: tiny DLRM and MMT on 4 forced CPU devices,
  whose steps there measured 3x and 5.5x what the probe's fit says, paid 3x and 5.7x the
  probe's fixed seconds for each further micro-batch of a step. Where the probe has no factor
  for k, the factor alone is fitted (the probe's seconds as they are). The factor is at least
  a quarter (a quarter of perfect division is beyond any machine's).

  ``pieces``: the same step over the same devices in M > 1 micro-batches, timed too ((its
  plan, seconds per call)). Two timings tell the two apart: the factor and the fixed seconds
  are fitted each on its own so that both predictions are their measurements (the ratio
  above put tiny DLRM's step in 4 micro-batches at +57% of its measurement, MMT's at -31%),
  ``_fitted_apart`` (where the seconds come out negative, the ratio, as without ``pieces``)."""
  k = str(len(plan.stages[0].devices))
  probe, call = host.spmd_factor(int(k)), host.spmd_call_seconds(int(k))
  if pieces is not None:

    def set_both(g: nx.DiGraph, factor: float, seconds: float) -> None:
      g.graph["spmd"] = {**graph.graph.get("spmd", {}), k: factor}
      g.graph["spmd_call"] = {**graph.graph.get("spmd_call", {}), k: seconds}

    timed = [(plan, seconds), pieces]
    both = _fitted_apart(graph, batch_size, timed, cluster, host, set_both, SPMD_FLOOR)
    if both is not None:
      return both

  def set_spmd(g: nx.DiGraph, r: float) -> None:
    g.graph["spmd"] = {**graph.graph.get("spmd", {}), k: r * probe if probe else r}
    if probe:
      g.graph["spmd_call"] = {**graph.graph.get("spmd_call", {}), k: r * call}

  floor = SPMD_FLOOR / probe if probe else SPMD_FLOOR
  return _calibrated(graph, batch_size, plan, cluster, host, seconds, set_spmd, floor)


def _fitted_apart(
  graph: nx.DiGraph,
  batch_size: int,
  timed: Sequence[tuple[Plan, float]],
  cluster: Any,
  host: HostCosts,
  set_both: Callable[[nx.DiGraph, float, float], None],
  floor: float,
) -> nx.DiGraph | None:
  """A copy of ``graph`` with a factor and the fixed seconds per computation (``set_both``:
  the SPMD factor over k devices, or the fusion on one) at which the predictions of the two
  one-stage plans ``timed`` (over the same devices, different micro-batch counts) are their
  seconds plus the host's time outside the step. A prediction is linear in both, so three
  predictions of each plan solve it. Where that takes a factor under ``floor`` or negative
  seconds, the first plan's prediction (the one-call step, which ``choose_plan`` prices a
  faster step in micro-batches by) stays its measurement, and the second misses its own by
  the least that allows: a factor under the floor takes the floor and the fixed seconds that
  fit the first (the first's fit alone prices the second at about the first's time). None
  where the seconds come out negative (the caller then fits the first alone) or the two
  plans have the same micro-batch count."""

  def with_both(factor: float, seconds: float) -> nx.DiGraph:
    g = graph.copy()
    set_both(g, factor, seconds)
    return g

  rows, rhs = [], []
  for plan, seconds in timed:
    at = [
      predict_seconds(plan, lg.scaled(with_both(f, c), batch_size), cluster, host)[0]
      for f, c in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0))
    ]
    rows.append([at[1] - at[0], at[2] - at[0]])
    rhs.append(seconds + host.outside - at[0])
  try:
    factor, call = np.linalg.solve(np.array(rows), np.array(rhs))
  except np.linalg.LinAlgError:  # the same micro-batch count twice
    return None
  if call < 0.0:
    return None
  if factor < floor:
    # Along the fits that keep the first prediction its measurement, the second's miss grows
    # with the distance from the exact fit: the nearest within the floor.
    (a, b), r = rows[0], rhs[0]
    factor, call = floor, (r - a * floor) / b if b > 0 else -1.0
    if call < 0.0:
      return None
  return with_both(float(factor), float(call))


def _calibrated(
  graph: nx.DiGraph,
  batch_size: int,
  plan: Plan,
  cluster: Any,
  host: HostCosts,
  seconds: float,
  set_factor: Callable[[nx.DiGraph, float], None],
  floor: float,
) -> nx.DiGraph:
  """A copy of ``graph`` with the factor ``f >= floor`` (``set_factor``) at which ``plan``'s
  prediction is ``seconds`` plus the host's time outside the step. The prediction is linear
  in the factor: two points solve it (``floor`` where it does not move with the factor)."""

  def predicted(f: float) -> float:
    g = graph.copy()
    set_factor(g, f)
    return predict_seconds(plan, lg.scaled(g, batch_size), cluster, host)[0]

  p0, p1 = predicted(0.0), predicted(1.0)
  target = seconds + host.outside
  out = graph.copy()
  set_factor(out, max((target - p0) / (p1 - p0), floor) if p1 > p0 else floor)
  return out


# What a user would run instead of a pipeline: the step in one call on one device, and over
# all devices as one SPMD program with the parameters replicated (data parallel), sharded
# FSDP-style, or by the model's own partition specs over the user's mesh.
BASELINES = ("plain jit", "jit data parallel", "jit fsdp", "jit sharded")


def baseline_plans(
  graph: nx.DiGraph,
  batch_size: int,
  opts: Options,
  widths: Sequence[int] | None = None,
  sharded: bool = False,
) -> dict[str, Plan]:
  """What a user would run instead, the whole batch in one call (one micro-batch): all
  layers as one stage on the first device (plain jit) and over all devices, the batch split
  over them: jit data parallel (parameters replicated), jit fsdp (parameters, gradients and
  optimizer state sharded over all devices, ``Plan.param_sharding``) and, where the model has
  partition specs (``sharded``), jit sharded (them over the user's whole mesh); ``widths``
  picks by number of devices (default: both)."""
  layers = tuple(lg.topo_layers(graph))
  out = {}
  n = len(opts.devices)
  for k in widths or (1, n):
    if k == 1:
      kinds = {"plain jit": "model"}
    elif k < 2 or batch_size % k:
      continue
    else:
      kinds = {"jit data parallel": "replicated" if sharded else "model", "jit fsdp": "fsdp"}
      if sharded:
        kinds["jit sharded"] = "model"
    for name, how in kinds.items():
      plan = Plan(
        (Stage(0, layers, tuple(range(k))),),
        (),
        1,
        planner=name,
        batch_size=batch_size,
        param_sharding=how,
      )
      validate_plan(plan, graph, n, batch_size)
      out[name] = plan
  return out


def fewer_device_plans(
  graph: nx.DiGraph, batch_size: int, opts: Options, host: HostCosts | None = None
) -> dict[str, Plan]:
  """The planner's plans on the first 2, 4, 8, ... of the devices (fewer than all), for a
  machine where more devices do not compute more at once (forced CPU devices sharing the
  host's cores) or each action's issue costs more than it saves (searched with ``host``, as
  ``make_plan``); none on fewer devices than ``min_stages`` stages need."""
  out: dict[str, Plan] = {}
  n = len(opts.devices)
  cluster = planner_cluster(opts)
  if cluster.inter_link is not None:
    return out
  k = 2
  while k < opts.min_stages:
    k *= 2
  while k < n:
    sub = dataclasses.replace(
      opts, devices=tuple(opts.devices[:k]), cluster=cluster.replace(num_devices=k)
    )
    try:
      out[f"{opts.planner if isinstance(opts.planner, str) else 'planner'} on {k} devices"] = (
        make_plan(graph, batch_size, sub, host)
      )
    except PlanError as e:
      logging.info("graph_pipeline: no plan on %d devices: %s", k, e)
    k *= 2
  return out


def predict_seconds(
  plan: Plan, graph: nx.DiGraph, cluster: Any, host: HostCosts | None
) -> tuple[float, bool]:
  """(seconds per step on this machine, whether its predicted memory fits the cluster's
  memory per device): ``simulate_on_host`` (a one-stage plan runs as one jitted step,
  ``predict_fused``, a pipeline as its schedule's program issued by the host; ``graph.graph
  ["fusion"]``, where measured, scales a one-stage plan's compute)."""
  if not plan.batch_size:  # a plan given without its batch: the graph's
    plan = plan.replace(batch_size=graph.graph["batch_size"])
  res = simulate_on_host(plan, graph, cluster, host)
  return res.iteration_time, max(res.stage_memory, default=0.0) <= cluster.memory_per_device


def calibrate(captured: Captured, opts: Options) -> Calibration:
  """Times the layers, and the step's work after them (the optimizer update, ``measure_update``),
  on this process's first device of the pipeline; with several processes, every process takes
  process 0's numbers so that all plan alike."""
  here = jax.process_index()
  device = next((d for d in opts.devices if d.process_index == here), jax.local_devices()[0])
  lay = captured.layering
  cal = measure_layers(captured.loss, lay.eqn_layer, lay.param_layer, lay.graph, device)
  param_bytes = sum(d["param_bytes"] for _, d in lay.graph.nodes(data=True))
  if param_bytes > 0:  # the step's own optimizer update, per parameter byte
    try:
      update = measure_update(captured.step, captured.marker_index, device) / param_bytes
    except Exception as e:  # the cost model's guess then; the step itself is not at stake
      logging.warning("graph_pipeline: the step's update could not be timed (%s)", e)
    else:
      cal = dataclasses.replace(cal, settings={**cal.settings, "update_per_byte": update})
  if jax.process_count() == 1:
    return cal
  first = Calibration.from_json(exchange("calibration", cal.to_json(), opts.timeout_s)[0])
  return dataclasses.replace(first, device=f"{first.device} on process 0")


def calibrate_widths(
  captured: Captured,
  graph: nx.DiGraph,
  plans: Iterable[Plan],
  host: HostCosts | None,
  devices: Sequence[Any],
  widths: Iterable[int] = (),
) -> nx.DiGraph:
  """``graph`` with its layers also timed as a stage over k devices runs them, for each width
  k > 1 of a stage of a pipeline among ``plans``, and each of ``widths`` (on the first k of
  ``devices``), not yet measured (``measure_layers
  (placement=)``, on that stage's devices; ``Calibration.apply(width=)``): the simulator
  then takes those times for such stages (``cost.simulator.measured_width_times``) instead
  of the host's SPMD factor. Only on CPU devices of one process, where the host measured the
  factor: devices that share a host's cores pay per op, per device and per collective what
  no small probe tells (medium MMT's stages over 4 of 8 forced CPU devices measured 2.3-2.7x
  the factor's time, the layers timed this way added up to within 10% of them: BUILD_NOTES,
  "Stages over several devices, timed layer by layer"). A width that does not divide the
  micro-batch is left out. ``devices``: what the plans' device numbers index. ``captured``
  must be the capture ``graph`` was made from (its micro-batch is the graph's batch: the
  times are kept as measured)."""
  if host is None or not host.spmd or jax.process_count() > 1:
    return graph
  mb = captured.microbatch_size
  groups: dict[int, tuple[Any, ...]] = {}
  stages = [tuple(s.devices) for p in plans if p.num_stages > 1 for s in p.stages]
  for ds in stages + [tuple(range(k)) for k in widths if k <= len(devices)]:
    devs = tuple(devices[d] for d in ds)
    if len(devs) > 1 and mb % len(devs) == 0 and devs[0].platform == "cpu":
      groups.setdefault(len(devs), devs)
  lay = captured.layering
  for k, devs in sorted(groups.items()):
    if k in lg.widths_measured(graph, graph.nodes):
      continue
    if mb != graph.graph["batch_size"]:
      raise ValueError(
        f"calibrate_widths: the step was captured at micro-batch {mb} but the layer graph "
        f"is at {graph.graph['batch_size']}; pass the capture the graph was made from"
      )
    cal = measure_layers(
      captured.loss,
      lay.eqn_layer,
      lay.param_layer,
      lay.graph,
      devs[0],
      placement=StagePlacement(devs, mb),
    )
    graph = cal.apply(graph, width=k)
  return graph


def stage_widths(num_devices: int, microbatch: int) -> list[int]:
  """The widths a stage of a pipeline over ``num_devices`` devices may take beyond one
  device: those that leave a device for another stage and split the micro-batch evenly."""
  return [k for k in range(2, num_devices) if microbatch % k == 0]


def planner_cluster(opts: Options) -> Any:
  """What planners are given as the machine: the user's Cluster (else the devices'), with the
  memory per device the budget (``memory_limit``)."""
  if opts.cluster is not None:
    cluster = as_cluster(opts.cluster)
  else:
    cluster = devices_cluster(list(opts.devices))
  return cluster.replace(memory_per_device=float(memory_limit(opts, cluster)))


def memory_limit(opts: Options, cluster: Any = None) -> int:
  """Bytes per device a plan may use: ``memory_limit=``, else the smallest ``bytes_limit`` the
  pipeline's devices report (GPU, TPU), else the cluster preset's memory per device."""
  if opts.memory_limit is not None:
    return int(opts.memory_limit)
  reported = []
  for d in opts.devices:
    stats = d.memory_stats() if d.process_index == jax.process_index() else None
    if stats and stats.get("bytes_limit"):
      reported.append(int(stats["bytes_limit"]))
  if reported:
    return min(reported)
  if cluster is None:
    cluster = (
      as_cluster(opts.cluster) if opts.cluster is not None else devices_cluster(opts.devices)
    )
  return int(cluster.memory_per_device)


def check_memory(c: CompiledStep, opts: Options, planned_by_user: bool) -> None:
  """Before anything runs: the step's program, its buffers sized, against the budget. A plan
  that does not fit is refused with each device's numbers (a planner's too: its cost model
  was optimistic where the program finds it over budget)."""
  limit = memory_limit(opts)
  trace = c.predicted_memory()
  over = {d: n for d, n in trace.peak.items() if n > limit}
  if not over:
    return
  from gpp_jax.cost.memory import format_bytes as fmt

  lines = []
  for d, n in sorted(over.items(), key=lambda kv: -kv[1]):
    cat, size = max(trace.breakdown[d].items(), key=lambda kv: kv[1])
    lines.append(f"{d}: {fmt(n)} (most: {cat}, {fmt(size)})")
  msg = (
    f"the plan needs more memory than memory_limit={fmt(limit)} per device (before "
    f"temporaries): {'; '.join(lines)}. Give the stages fewer layers (more stages), keep fewer "
    "micro-batches in flight (schedule='1f1b' instead of 'gpipe'), use smaller micro-batches "
    "(more num_microbatches), recompute activations (remat=True), or raise memory_limit to at "
    f"least {fmt(max(over.values()))}"
  )
  if not planned_by_user:
    msg = f"{c.plan.planner}'s plan: {msg}"
  raise PlanError(msg)


def run_planner(
  p: Any,
  graph: nx.DiGraph,
  cluster: Any,
  batch_size: int,
  opts: Options,
  host: HostCosts | None = None,
) -> Plan:
  """A named planner's or a callable's plan for ``graph`` on ``cluster``, which fits its memory
  per device as the simulator predicts it (a planner that does not look at memory is held to
  it here: ``PlanError`` when over). With ``host`` (the machine's measured costs) the planner
  searches with the prediction for this machine (``PlanningProblem.host``); a callable gets
  it where its signature takes ``host``. ``opts.min_stages`` above one is the planner's
  too: a named planner searches plans of at least that many stages
  (``PlanningProblem.min_stages``), a callable gets it where its signature takes
  ``min_stages``, and a plan of fewer stages is a ``PlanError`` naming the planner (no other
  planner runs in its place)."""
  M = opts.num_microbatches
  k = opts.min_stages
  if isinstance(p, str):
    fn = get_planner(p)
    with_host = {} if host is None else {"host": host}
    with_stages = {"min_stages": k} if k > 1 else {}
    plan = fn(
      lg.scaled(graph, batch_size),
      cluster,
      batch_size,
      num_microbatches=M,
      **{**with_host, **with_stages, **opts.planner_options},
    )
  else:
    named = KeywordPlanner(planner_name(p), p)
    takes = named.accepts()
    extra: dict[str, Any] = {}
    if host is not None and (takes is None or "host" in takes):
      extra["host"] = host
    if k > 1 and (takes is None or "min_stages" in takes):
      extra["min_stages"] = k
    plan = p(graph, cluster, batch_size, num_microbatches=M, **extra)
    if plan.num_stages < k:
      name = plan.planner or named.name
      raise too_few_stages_error(name, plan, k, keyword="min_stages" in extra)
  if plan.num_microbatches != M:
    plan = plan.replace(num_microbatches=M)
  if opts.schedule is not None:
    plan = plan.replace(schedule=opts.schedule)
  # Per device: a device running several stages holds all of their memory.
  peak = max(
    simulate(plan, lg.scaled(graph, batch_size), cluster).peak_memory.values(), default=0.0
  )
  if peak > cluster.memory_per_device:
    raise PlanError(
      f"the plan needs {peak / 2**20:.3f} MiB on a device, more than "
      f"{cluster.memory_per_device / 2**20:.3f} MiB"
    )
  return plan


def budget_error(
  error: PlanError, graph: nx.DiGraph, cluster: Any, batch_size: int, opts: Options, rounds: int = 8
) -> PlanError:
  """The planner found no plan under the memory budget: when one exists with unlimited memory,
  an error naming the smallest budget found to fit (bisected over ``rounds`` planner runs)
  and what takes the most memory in that plan; else ``error`` itself."""
  from gpp_jax.cost.memory import format_bytes as fmt

  limit = cluster.memory_per_device

  def attempt(budget: float) -> Plan | None:
    try:
      sized = cluster.replace(memory_per_device=budget)
      return run_planner(opts.planner, graph, sized, batch_size, opts)
    except PlanError:
      return None

  hi = 1e18
  fitting = attempt(hi)
  if fitting is None:
    return error
  res = simulate(fitting, lg.scaled(graph, batch_size), cluster)
  lo, hi = float(limit), max(float(max(res.stage_memory, default=limit)), float(limit))
  for _ in range(rounds):
    if hi <= lo * 1.05:
      break
    mid = (lo + hi) / 2
    got = attempt(mid)
    if got is None:
      lo = mid
    else:
      hi, fitting = mid, got
  pc = plan_costs(fitting, lg.scaled(graph, batch_size), cluster)
  worst = max(
    range(fitting.num_stages), key=lambda i: pc.static_memory[i] + pc.activation_memory[i]
  )
  stage = fitting.stages[worst]
  static, act = pc.static_memory[worst], pc.activation_memory[worst]
  flight = stage.in_flight or fitting.num_microbatches
  what = (
    f"its parameters, gradients and optimizer state ({fmt(static)} per device)"
    if static >= act * flight
    else f"activations stashed for the micro-batches in flight (up to {flight} x {fmt(act)})"
  )
  name = opts.planner if isinstance(opts.planner, str) else "the planner"
  return PlanError(
    f"{name}: no plan fits memory_limit={fmt(limit)} per device on {len(opts.devices)} devices "
    f"(batch {batch_size}, {opts.num_microbatches} micro-batches); the smallest budget found "
    f"that fits is about {fmt(hi)} ({fitting.num_stages} stages), where stage {worst} "
    f"({len(stage.layers)} layers from {stage.layers[0]!r}) holds the most: {what}. Raise "
    "memory_limit, use more devices, more micro-batches (smaller ones) or remat=True"
  )


def make_plan(
  graph: nx.DiGraph, batch_size: int, opts: Options, host: HostCosts | None = None
) -> Plan:
  """The plan for ``graph``: the given Plan, a resolved manual plan, or a planner's (searched
  with ``host``, the machine's measured costs, where given: ``run_planner``)."""
  M = opts.num_microbatches
  p = opts.planner
  nd = len(opts.devices)
  if isinstance(p, Plan):
    if p.planner in BASELINES:  # the whole batch at once, as it was chosen
      M = p.num_microbatches
    plan = p if p.num_microbatches == M else p.replace(num_microbatches=M)
    if has_mixed_microbatches(plan) and plan.batch_size != batch_size:
      plan = plan.replace(batch_size=batch_size)  # per-stage sizes are checked against it
  elif isinstance(p, ManualPlan):
    if opts.layout is not None:  # stages take rows of the mesh: say so before resolving
      named = [*p.rules.values(), *([] if p.default_stage is None else [p.default_stage])]
      where = [(p.devices or {}).get(s, s) for s in range(max(named, default=0) + 1)]
      check_rows(
        opts.layout, len({(d,) if isinstance(d, int) else tuple(sorted(d)) for d in where})
      )
    return p.resolve(graph, M, opts.schedule or "1f1b", nd, batch_size)
  elif isinstance(p, str) or callable(p):
    cluster = planner_cluster(opts)
    try:
      plan = run_planner(p, graph, cluster, batch_size, opts, host)
    except PlanError as e:
      raise budget_error(e, graph, cluster, batch_size, opts) from e
  else:
    raise TypeError(
      f"planner must be a name, a Plan, a gpp_jax.manual_plan or a callable; got {type(p).__name__}"
    )
  if plan.num_microbatches != M:
    plan = plan.replace(num_microbatches=M)
  if opts.schedule is not None:
    plan = plan.replace(schedule=opts.schedule)
  validate_plan(plan, graph, nd, batch_size)
  return plan


# ---------------------------------------------------------------------------- stage


@dataclasses.dataclass(frozen=True)
class Staged:
  """The step cut by the plan.

  Attributes:
    staged: the loss per stage (``passes.staging``).
    prog: the step around the pipeline (``passes.step_split``).
    placements: where each stage runs.
    spec: what the lowering reads (``passes.lowering.StepSpec``).
    leaf_specs: per flat step argument, its partition spec (None: replicated).
  """

  staged: StagedProgram
  prog: StepProgram
  placements: tuple[StagePlacement, ...]
  spec: StepSpec
  leaf_specs: tuple[Any, ...] = ()
  # Stage -> its program at a row's share of the micro-batch, for the data-parallel stages
  # whose gradients are reduced once per step (``row_local_programs``).
  row_local: Mapping[int, Any] = dataclasses.field(default_factory=dict)

  @property
  def microbatch_sizes(self) -> tuple[int, ...]:
    return tuple(p.microbatch_size for p in self.placements)


def stage_step(
  captured: Captured,
  planned: Planned,
  opts: Options,
  recapture: Callable[[int], Captured],
) -> Staged:
  """Cuts the loss into the plan's stages (each at its own micro-batch size, tracing the step
  again per size through ``recapture``) and the rest of the step by where values live."""
  plan, B = planned.plan, captured.batch_size
  sizes = stage_microbatch_sizes(plan, B)
  layout = opts.mesh_layout
  check_rows(layout, len({frozenset(s.devices) for s in plan.stages}))
  placements = stage_placements(
    [[x for r in s.devices for x in layout.rows[r]] for s in plan.stages],
    sizes,
    layout.inner_shape,
    layout.axis_names,
  )
  leaf_specs = plan_leaf_specs(captured, plan, layout)
  lay = captured.layering
  staged = stage_program(captured.loss, lay.eqn_layer, lay.param_layer, plan)
  if len(set(sizes)) > 1:
    staged = restage(captured, plan, staged, sizes, recapture)
  split = captured.scan_split
  marker = captured.marker
  # A parameter stacked over a split scan lives on the stage owning its first slice.
  homes = [staged.param_owner[ks[0]] for ks in split.parts[: split.num_params]]
  nparam = captured.nparam
  in_home = [homes[j] if j < nparam else -1 for j in range(len(marker.invars))]
  nloss = len(split.out_parts)
  out_home = [staged.loss_outputs[split.out_parts[k][0]][0] for k in range(nloss)] + homes
  prog = split_step(captured.step, captured.marker_index, in_home, out_home)
  # The loss's inputs and outputs after the scan split: one per slice of a split input.
  loss_roles = tuple(r for r, ks in zip(captured.roles, split.parts) for _ in ks)
  state = tuple(split_state(captured.state, split))
  carries = state_carries(staged, state)
  counts = [B // b for b in sizes]
  spec = StepSpec(
    staged=staged,
    prog=prog,
    roles=loss_roles,
    scan_split=split,
    state=state,
    batch_size=B,
    batch_leaves=captured.batch_leaves,
    donated=captured.donated,
    reduce=tuple(r for r, qs in zip(captured.reduce, split.out_parts) for _ in qs),
    packed=tuple(len(p.devices) == 1 and not opts.remat for p in placements),
    multi_device=tuple(len(p.devices) > 1 for p in placements),
    widths=tuple(p.rows for p in placements),
    carries=tuple((s, j, k) for s, pairs in carries.items() for j, k in pairs),
  )
  if len(set(counts)) > 1:
    _check_mixed(counts, state, loss_roles)
  row_local = row_local_programs(captured, plan, staged, placements, state, opts, recapture)
  return Staged(staged, prog, tuple(placements), spec, leaf_specs, row_local)


def row_local_programs(
  captured: Captured,
  plan: Plan,
  staged: StagedProgram,
  placements: Sequence[StagePlacement],
  state: Sequence[StatePair],
  opts: Options,
  recapture: Callable[[int], Captured],
) -> dict[int, Any]:
  """Stage -> its program traced at micro-batch / rows, for each stage over several rows whose
  gradients can be summed per row and reduced once per step (``staging.row_local_functions``):
  one that carries no state between micro-batches, reads no random key, recomputes nothing
  (``remat``), and whose outputs are batch-carrying values or the loss itself; its program at
  the rows' share must have the same inputs and outputs, each batch-carrying one split by the
  rows. In one process (a stage across processes keeps its per-micro-batch all-reduce)."""
  if opts.remat or jax.process_count() > 1:
    return {}
  carrying = set(state_carries(staged, state))
  out: dict[int, Any] = {}
  loss_stage, loss_pos = staged.loss_outputs[0]
  for st, place in zip(staged.stages, placements):
    r, mb = place.rows, place.microbatch_size
    if r < 2 or mb % r or st.index in carrying:
      continue
    if any(x.kind == "data" and captured.roles[x.index] == KEY for x in st.inputs):
      continue
    batch_in, batch_out = row_batch_flags(st, captured.roles, mb)
    outs_ok = all(
      b or ((st.index, k) == (loss_stage, loss_pos) and st.jaxpr.jaxpr.outvars[k].aval.ndim == 0)
      for k, b in enumerate(batch_out)
    )
    floating = all(
      jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating) for v in st.jaxpr.jaxpr.outvars
    )
    if not outs_ok or not floating:  # an integer output's cotangent (float0) stays outside
      continue
    try:
      small = staged_at(captured, plan, staged, mb // r, recapture)
    except GppError:
      continue
    if len(small.stages) != len(staged.stages):
      continue
    program = small.stages[st.index]
    if (program.inputs, program.outputs) != (st.inputs, st.outputs):
      continue
    big = [v.aval for v in (*st.jaxpr.jaxpr.invars, *st.jaxpr.jaxpr.outvars)]
    little = [v.aval for v in (*program.jaxpr.jaxpr.invars, *program.jaxpr.jaxpr.outvars)]
    if all(
      _row_share(a, r, b) == (getattr(c, "shape", None), getattr(c, "dtype", None))
      for a, c, b in zip(big, little, [*batch_in, *batch_out])
    ):
      out[st.index] = program
  return out


def _row_share(aval: Any, rows: int, batch: bool) -> tuple[Any, Any]:
  """(shape, dtype) of a row's share of ``aval``: the leading axis split where it is batch."""
  shape = getattr(aval, "shape", None)
  if batch and shape:
    shape = (shape[0] // rows, *shape[1:])
  return shape, getattr(aval, "dtype", None)


def row_batch_flags(st: Any, roles: Sequence[Any], mb: int) -> tuple[list[bool], list[bool]]:
  """Per input and per output of a stage, whether it carries the micro-batch as its leading
  axis: activations and outputs of that leading size, and the batch the loss reads."""
  ins = []
  for x, v in zip(st.inputs, st.jaxpr.jaxpr.invars):
    shape: tuple[int, ...] = tuple(getattr(v.aval, "shape", ()))
    if x.kind == "data":
      ins.append(roles[x.index] == BATCH)
    else:
      ins.append(x.kind == "act" and len(shape) >= 1 and shape[0] == mb)
  outs = [
    len(getattr(v.aval, "shape", ())) >= 1 and v.aval.shape[0] == mb for v in st.jaxpr.jaxpr.outvars
  ]
  return ins, outs


def restage(
  captured: Captured,
  plan: Plan,
  staged: StagedProgram,
  sizes: Sequence[int],
  recapture: Callable[[int], Captured],
) -> StagedProgram:
  """The staged loss with each stage traced at its own micro-batch size.

  The step is captured once more per distinct size; stage s takes its program from the
  capture at ``sizes[s]``. Every capture must split into the same stages with the same
  inputs and outputs (a model whose program changes with the batch size cannot), and a value
  crossing between stages of different sizes must carry the batch as its leading axis, so
  that the executor can cut or join it along that axis.
  """
  by_size = {captured.microbatch_size: staged}
  for b in sorted(set(sizes) - {captured.microbatch_size}):
    by_size[b] = staged_at(captured, plan, staged, b, recapture)
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
        f"{captured.microbatch_size} (the program depends on the batch size); give every stage "
        "the same micro-batch size"
      )
  stages = tuple(by_size[b].stages[s] for s, b in enumerate(sizes))
  _check_rechunkable(stages, sizes)
  return dataclasses.replace(staged, stages=stages)


def staged_at(
  captured: Captured,
  plan: Plan,
  staged: StagedProgram,
  b: int,
  recapture: Callable[[int], Captured],
) -> StagedProgram:
  """The loss traced at micro-batch size ``b`` and cut by ``plan``, its cut values numbered as
  ``staged`` numbers them. CaptureError where the trace splits its scanned layers or its
  layers differently (a program that depends on the batch size)."""
  cb = recapture(b)
  if cb.scan_split != captured.scan_split:
    raise CaptureError(
      f"the loss traced at micro-batch size {b} splits its scanned layers differently "
      f"than at {captured.microbatch_size}; give every stage the same micro-batch size"
    )
  try:
    other = stage_program(cb.loss, cb.layering.eqn_layer, cb.layering.param_layer, plan)
  except PlanError as e:
    raise CaptureError(
      f"the loss traced at micro-batch size {b} has other layers than at "
      f"{captured.microbatch_size} ({e}); the model's program must not depend on the batch "
      "size to use per-stage micro-batch sizes"
    ) from e
  return _numbered_like(other, staged)


def _numbered_like(other: StagedProgram, base: StagedProgram) -> StagedProgram:
  """``other`` with its cut values numbered as ``base`` numbers them.

  A cut value's number counts the loss's equations before it, and tracing at another batch
  size may add or drop a reshape or broadcast (a batch of 1, say), so the numbers shift while
  the cut stays the same. A value is the same one when the same stage produces it at the same
  output position; the comparison in ``restage`` then checks the rest."""
  if len(other.stages) != len(base.stages) or any(
    len(x.outputs) != len(y.outputs) for x, y in zip(other.stages, base.stages)
  ):
    return other
  pairs = zip(other.stages, base.stages)
  new = {x.vid: y.vid for so, sb in pairs for x, y in zip(so.outputs, sb.outputs)}
  stages = tuple(
    dataclasses.replace(
      st,
      inputs=tuple(
        dataclasses.replace(r, index=new.get(r.index, -1 - r.index)) if r.kind == "act" else r
        for r in st.inputs
      ),
      outputs=tuple(dataclasses.replace(o, vid=new[o.vid]) for o in st.outputs),
    )
    for st in other.stages
  )
  return dataclasses.replace(other, stages=stages)


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


def _check_mixed(counts: Sequence[int], state: Sequence[StatePair], roles) -> None:
  """Raises GppError for what cannot run with per-stage micro-batch sizes."""
  from gpp_jax.errors import GppError

  what = f"the stages run {list(counts)} micro-batches (per-stage micro-batch sizes)"
  fix = "give every stage the same micro-batch size (Stage.microbatch_size)"
  if state:
    raise GppError(
      f"{what}, but the loss carries state from one micro-batch to the next (e.g. "
      f"BatchNorm statistics), whose order depends on the micro-batch size; {fix}"
    )
  if KEY in roles:
    raise GppError(
      f"{what}, but the loss reads a random key, into which each stage folds its own "
      f"micro-batch index, so stages would draw from different chunks; {fix}, or pass "
      "no key to the loss"
    )
  if jax.process_count() > 1:
    raise GppError(f"{what}, which runs in a single process only; {fix}")


# ---------------------------------------------------------------------------- the rest


def fuses(opts: Options, plan: Plan, sched: Schedule, captured: Captured) -> bool:
  """Whether the step runs as one jitted function: one stage is gradient accumulation, not a
  pipeline (``runtime.fused``): plain jit on one device, jit data parallel on several (with
  several processes, a stage over devices of each is one SPMD program that each calls)."""
  return (
    opts.fuse
    and plan.num_stages == 1
    and weight_delays(sched) is None  # stale-weight schedules keep older versions
    and not captured.state  # state carried between micro-batches runs in the executor
  )


def _without(spec: Any, axis: str, ndim: int) -> tuple:
  """``spec``'s entries for an array of rank ``ndim``, without ``axis`` (taken by the rows)."""
  entries = list(tuple(spec or ())[:ndim]) + [None] * (ndim - len(tuple(spec or ())[:ndim]))
  out = []
  for e in entries:
    names = tuple(n for n in entry_axes(e) if n != axis)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return tuple(out)


def build_kernels(
  captured: Captured,
  planned: Planned,
  staged: Staged,
  opts: Options,
  fused: bool,
  split_w: bool = False,
):
  """The jitted functions a program calls: per stage forward/backward, the pieces of the
  step around the pipeline, and (one fused stage) the whole step."""
  spec = staged.spec
  layers = [tuple(s.layers) for s in planned.plan.stages]
  stages = []
  param_specs = stage_param_specs(captured, staged.staged, staged.leaf_specs)
  for st, place, packed in zip(staged.staged.stages, staged.placements, spec.packed):
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]
    shardings = [
      place.sharded(sp, avals[p].ndim) for sp, p in zip(param_specs[st.index], st.param_inputs)
    ]
    local = staged.row_local.get(st.index) if not split_w else None
    if local is not None:  # gradients summed per row, reduced once per step
      batch_in, batch_out = row_batch_flags(st, captured.roles, place.microbatch_size)
      axis = place.axis_names[0]
      acc_shardings: list[jax.sharding.Sharding] = [
        NamedSharding(place.mesh, PartitionSpec(axis, *_without(sp, axis, a.ndim)))
        for sp, a in zip(param_specs[st.index], [avals[p] for p in st.param_inputs])
      ]
      fns = row_local_functions(
        local, place.rows, place.mesh, batch_in, batch_out, shardings, acc_shardings
      )
      shardings = acc_shardings
    else:
      fns = stage_functions(
        st,
        remat=opts.remat,
        pack_residuals=len(place.devices) == 1,
        pack_limit=pack_limit(place.devices[0]),
        param_shardings=None if len(place.devices) == 1 else shardings,
      )
    assert (fns.pack_params is not None) == packed
    nondiff = [r for r in st.inputs if not r.diff]
    keys = tuple(
      k for k, r in enumerate(nondiff) if r.kind == "data" and spec.roles[r.index] == KEY
    )
    zeros = jax.jit(
      fns.zeros_acc, out_shardings=place.replicated if len(place.devices) == 1 else shardings
    )
    stages.append(StageKernels(st, fns, place, zeros, keys, layers[st.index], local is not None))
  prog = staged.prog
  pieces = [jax.jit(xc.jaxpr_as_fun(p.jaxpr)) for p in prog.before + prog.after]
  fused_fn = None
  if fused:
    # The loss as captured (one stage needs no scan split): inputs are the marker's.
    loss = captured.loss_as_traced
    assert loss is not None
    fused_fn = fused_step(
      prog,
      loss,
      list(captured.roles),
      opts.num_microbatches,
      captured.microbatch_size,
      captured.reduce,
      stacked=len(staged.placements[0].devices) > 1,
      donate=staged.spec.donated,
    )
  return Kernels(stages, pieces, fused_fn, staged.leaf_specs)


def buffer_bytes(
  kernels: Kernels, staged: StagedProgram, split_w: bool, remat: bool
) -> list[dict[str, int]]:
  """Per stage, bytes per device of the buffers only its traced functions size: residuals
  (``res``), packed parameters (``pp``), gradient sums (``acc``) and, with W actions, what B
  keeps for W (``kept``). Traced, not compiled (``jax.eval_shape``); a stage over k devices
  holds 1/k of its residuals (they carry the batch)."""
  out = []
  for k in kernels.stages:
    st, fns = k.stage, k.fns
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]
    nparam = sum(r.kind == "param" for r in st.inputs)
    nondiff = avals[st.num_diff :]
    sizes: dict[str, int] = {"acc": _tree_bytes(jax.eval_shape(fns.zeros_acc))}
    if k.row_local:  # a slice per row, each row's devices holding their own
      sizes["acc"] //= k.placement.rows
    if fns.pack_params is not None:
      pp = jax.eval_shape(fns.pack_params, avals[:nparam])
      sizes["pp"] = _tree_bytes(pp)
      outs, res = jax.eval_shape(fns.fwd, pp, avals[nparam : st.num_diff], nondiff)
      pre: tuple = (res, pp)
    else:
      outs, res = jax.eval_shape(fns.fwd, avals[: st.num_diff], nondiff)
      pre = (res,)
    width = len(k.placement.devices)
    if k.row_local:  # (the parameters, each row's residuals stacked over the rows)
      sizes["res"] = _tree_bytes(res[0]) + _tree_bytes(res[1]) // k.placement.rows
    else:
      sizes["res"] = _per_device_bytes(res, k.placement.rows, k.placement.microbatch_size)
    if split_w:
      # B's contributions per output, as the lowering groups them (a trace of the split
      # backward records its structure, so a fresh copy of the stage's functions is traced).
      cts = []
      for k_out, (o, x) in enumerate(zip(st.outputs, outs)):
        n = len(o.consumers) if o.diff else 0
        n += int(o.diff and (st.index, k_out) == staged.loss_outputs[0])
        cts.append(tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for _ in range(n)))
      fresh = stage_functions(
        st, remat=remat, pack_residuals=width == 1, pack_limit=pack_limit(k.placement.devices[0])
      )
      assert fresh.bwd_input is not None
      if fresh.pack_params is not None:  # its forward records the residuals' layout
        jax.eval_shape(fresh.fwd, pre[1], avals[nparam : st.num_diff], nondiff)
      else:
        jax.eval_shape(fresh.fwd, avals[: st.num_diff], nondiff)
      _, kept = jax.eval_shape(fresh.bwd_input, *pre, cts)
      sizes["kept"] = _per_device_bytes(kept, width, k.placement.microbatch_size)
    out.append(sizes)
  return out


def constant_bytes(staged: Staged, fused: bool, captured: Captured) -> dict[int, int]:
  """Per lane, bytes of the constants its executables close over (each jitted function keeps
  a copy on its devices): the stage programs' and the pieces of the step placed there."""
  out: dict[int, int] = {}

  def add(lane: int, consts) -> None:
    out[lane] = out.get(lane, 0) + sum(
      int(np.prod(np.shape(c), dtype=np.int64)) * np.asarray(c).dtype.itemsize
      for c in consts
      if hasattr(c, "shape")
    )

  if fused:
    add(0, captured.loss_as_traced.consts if captured.loss_as_traced is not None else [])
  else:
    for st in staged.staged.stages:
      add(st.index, st.jaxpr.consts)
  for p in staged.prog.before + staged.prog.after:
    add(0 if fused else p.home, p.jaxpr.consts)
  return out


def _per_device_bytes(tree: Any, width: int, microbatch: int) -> int:
  """Bytes per device of ``tree`` on a stage over ``width`` devices: arrays whose leading
  axis is the micro-batch are split over them, the rest replicated."""
  total = 0
  for x in jax.tree.leaves(tree):
    n = int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
    total += n // width if width > 1 and x.shape and x.shape[0] == microbatch else n
  return total


def _tree_bytes(tree: Any) -> int:
  leaves = jax.tree.leaves(tree)
  return sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize for x in leaves)


def loss_seeds(staged: Staged, counts: Sequence[int]) -> list[Any]:
  """Per stage, ``1 / M_s`` on the stage computing the loss (None elsewhere): the seed of its
  backward, d(mean loss) / d(chunk loss)."""
  st = staged.staged
  ls, lk = st.loss_outputs[0]
  dtype = st.stages[ls].jaxpr.jaxpr.outvars[lk].aval.dtype
  seeds: list[Any] = [None] * len(st.stages)
  seeds[ls] = transfer(np.asarray(1.0 / counts[ls], dtype=dtype), staged.placements[ls].replicated)
  return seeds


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """Everything built for one argument signature, phase by phase (see the module docstring).

  ``executor`` runs one step; ``executor_for`` gives the executor of K steps in one program
  (``run_steps``' stream) or of a stale-weight step with another history length.
  """

  opts: Options
  captured: Captured
  planned: Planned
  staged: Staged
  schedule: Schedule
  kernels: Kernels
  fused: bool
  seeds: tuple[Any, ...]
  delays: tuple[int, ...] | None
  history: list[list[Any]]  # parameter versions of earlier steps, newest first (stale weights)
  executors: dict[tuple[int, int], Executor]
  last: list[Executor]  # the executor of the last run

  @property
  def plan(self) -> Plan:
    return self.planned.plan

  @property
  def layer_graph(self) -> nx.DiGraph:
    return self.planned.layer_graph

  @property
  def batch_size(self) -> int:
    return self.captured.batch_size

  @property
  def out_tree(self) -> Any:
    return self.captured.out_tree

  @property
  def prog(self) -> StepProgram:
    return self.staged.prog

  @property
  def lowered(self) -> Lowered:
    return self.executor_for(1).lowered

  @property
  def program(self) -> Program:
    return self.lowered.program

  def executor_for(self, steps: int = 1, carry: dict[int, int] | None = None) -> Executor:
    """The executor of ``steps`` steps in one program (``carry``: flat input -> the flat
    output of the previous step feeding it)."""
    keep = max(self.delays) if self.delays else 0
    key = (steps, min(len(self.history), keep))
    ex = self.executors.get(key)
    if ex is None:
      if self.fused:
        assert steps == 1, "a fused step runs one step a call"
        lowered = lower_fused(self.staged.spec, self.opts.num_microbatches)
      else:
        sched = self.schedule if steps == 1 else stream_schedule(self.schedule, steps)
        split_w = sched.splits_backward
        lowered = lower_step(
          self.staged.spec,
          sched,
          carry=carry,
          delays=self.delays,
          history=key[1],
          sizes=buffer_bytes(self.kernels, self.staged.staged, split_w, self.opts.remat),
        )
      ex = Executor(
        lowered,
        self.kernels,
        seeds=self.seeds,
        timeout_s=self.opts.timeout_s,
        history=self.history,
      )
      self.executors[key] = ex
    return ex

  def input_kinds(self, lowered: Lowered) -> dict[int, str]:
    """Kinds of the program's step-argument buffers: parameters, the batch, other state."""
    J = self.captured.step.jaxpr
    index = {v: i for i, v in enumerate(J.invars)}
    params = {index[v] for v in self.captured.marker.invars[: self.captured.nparam] if v in index}
    batch = set(self.captured.batch_leaves)
    kinds = {}
    for b, binding in zip(lowered.program.inputs, lowered.bindings):
      if binding.kind == "leaf":
        i = binding.index
        kinds[b] = "param" if i in params else "batch" if i in batch else "input"
    return kinds

  def measure_memory(self, leaves: Sequence[Any]) -> tuple[list[Any], Any]:
    """One step, counting the live arrays per device at every instruction boundary; returns
    its flat outputs and the ``runtime.memory.MemoryReport`` (measured beside predicted)."""
    from gpp_jax.runtime import memory

    ex = self.executor_for(1)
    self.last[:] = [ex]
    kinds = self.input_kinds(ex.lowered)
    outs = ex.run([leaves], memory=kinds)[0]
    return outs, memory.report(ex.census, self.predicted_memory(ex.temps))

  def predicted_memory(self, temps: dict[int, int] | None = None) -> Any:
    """``cost.memory.program_memory`` of one step's program (``temps``: the executables'
    temporaries per instruction, when measured)."""
    from gpp_jax.cost.memory import program_memory

    ex = self.executor_for(1)
    lanes = [p.devices for p in self.staged.placements[: ex.program.num_stages]]
    return program_memory(
      ex.program,
      lanes + [()],
      temps,
      self.input_kinds(ex.lowered),
      constant_bytes(self.staged, self.fused, self.captured),
      self.memory_shares(ex),
    )

  def memory_shares(self, ex: Executor) -> dict[int, float]:
    """Buffer -> the fraction of it each device of its lane holds, for sharded buffers: the
    step's arguments with a partition spec and their copies, each stage's gradient sums, and
    the step's new values of such arguments (an NNX step's new state)."""
    if not any(self.staged.leaf_specs):
      return {}
    P, places = ex.program, self.staged.placements

    def share(lane: int, spec: Any, aval: Any) -> float:
      if lane >= len(places) or spec is None or not hasattr(aval, "ndim"):
        return 1.0
      s = places[lane].sharded(spec, aval.ndim)
      n = s.num_devices if hasattr(s, "num_devices") else len(s.device_set)
      shape = s.shard_shape(tuple(aval.shape)) if n > 1 else tuple(aval.shape)
      whole = max(1, int(np.prod(aval.shape, dtype=np.int64)))
      return int(np.prod(shape, dtype=np.int64)) / whole

    out = {b: share(P.buffers[b].lane, spec, ex.lowered.avals[b]) for b, spec in ex.specs.items()}
    # The new state of an NNX step comes back after the step's own outputs, leaf for leaf.
    out_def, state_def = self.out_tree.children()
    nout = out_def.num_leaves
    for ks in ex.lowered.step_outputs:
      for k in range(nout, min(len(ks), nout + state_def.num_leaves)):
        b = P.outputs[ks[k]]
        spec = self.staged.leaf_specs[k - nout] if k - nout < len(self.staged.leaf_specs) else None
        if spec is not None:
          out[b] = share(P.buffers[b].lane, spec, ex.lowered.avals[b])
    # Gradient sums: held like their parameters.
    param_specs = stage_param_specs(self.captured, self.staged.staged, self.staged.leaf_specs)
    for b, buf in enumerate(P.buffers):
      if buf.kind != "acc" or buf.lane >= len(places) or not places[buf.lane].devices[1:]:
        continue
      st = self.staged.staged.stages[buf.lane]
      avals = [st.jaxpr.jaxpr.invars[p].aval for p in st.param_inputs]
      sizes = [int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in avals]
      specs = param_specs[buf.lane]
      if self.kernels.stages[buf.lane].row_local:  # the rows' slices: the rows axis is theirs
        axis = places[buf.lane].axis_names[0]
        specs = [PartitionSpec(*_without(sp, axis, a.ndim)) for sp, a in zip(specs, avals)]
      held = sum(n * share(buf.lane, sp, a) for n, sp, a in zip(sizes, specs, avals))
      if sum(sizes):
        out[b] = held / sum(sizes)
    return out

  def run(
    self, steps_leaves: Sequence[Sequence[Any]], carry=None, measure: bool = False
  ) -> list[list[Any]]:
    """Runs ``len(steps_leaves)`` steps in one program; returns each step's flat outputs.
    ``measure``: one thread per lane waiting for each instruction (device times)."""
    ex = self.executor_for(len(steps_leaves), carry)
    self.last[:] = [ex]
    return ex.run(steps_leaves, measure=measure)


def compile_step(
  pure: PureStep, args: Sequence[Any], leaves: Sequence[Any], opts: Options
) -> CompiledStep:
  """The compile chain, top to bottom."""
  captured = capture(pure, args, leaves, opts)

  # One capture per micro-batch size: the trial's and the final build's trace the step once.
  captures = {captured.microbatch_size: captured}

  def build(planned: Planned, o: Options, by_user: bool) -> CompiledStep:
    # A baseline runs the whole batch at once (one micro-batch): traced again at its size.
    M = planned.plan.num_microbatches
    if o.num_microbatches != M:
      o = dataclasses.replace(o, num_microbatches=M)

    def recapture(b: int) -> Captured:
      if b not in captures:
        captures[b] = capture(pure, args, leaves, o, microbatch_size=b)
      return captures[b]

    return build_step(recapture(captured.batch_size // M), planned, o, recapture, by_user)

  def trial(plan: Plan) -> tuple[CompiledStep, float]:
    c = build(Planned(plan, captured.layering.graph), dataclasses.replace(opts, planner=plan), True)
    return c, time_step(c, leaves)

  planned = plan_step(captured, opts, trial, lambda c: time_step(c, leaves))
  if planned.trial is not None:  # its options: the user's, at the trial's micro-batches
    kept = planned.trial
    return dataclasses.replace(
      kept, opts=dataclasses.replace(kept.opts, planner=opts.planner), planned=planned
    )
  return build(planned, opts, isinstance(opts.planner, (Plan, ManualPlan)))


def build_step(
  captured: Captured,
  planned: Planned,
  opts: Options,
  recapture: Callable[[int], Captured],
  planned_by_user: bool,
) -> CompiledStep:
  """Stage, schedule, kernels and memory check of a captured, planned step."""
  staged = stage_step(captured, planned, opts, recapture)
  sched = plan_schedule(planned.plan, captured.batch_size)
  fused = fuses(opts, planned.plan, sched, captured)
  kernels = build_kernels(captured, planned, staged, opts, fused, sched.splits_backward)
  counts = sched.stage_counts
  seeds = loss_seeds(staged, counts)
  logging.info(
    "graph_pipeline: %d stages (depth %d), micro-batches per stage %s of %s, %d step pieces",
    planned.plan.num_stages,
    planned.plan.depth(),
    list(counts),
    list(staged.microbatch_sizes),
    len(kernels.pieces),
  )
  compiled = CompiledStep(
    opts=opts,
    captured=captured,
    planned=planned,
    staged=staged,
    schedule=sched,
    kernels=kernels,
    fused=fused,
    seeds=tuple(seeds),
    delays=weight_delays(sched),
    history=[],
    executors={},
    last=[],
  )
  check_memory(compiled, opts, planned_by_user)
  return compiled


def time_step(c: CompiledStep, leaves: Sequence[Any], repeats: int = 5) -> float:
  """Median seconds of at least ``repeats`` runs of one step of ``c`` (after two to warm up;
  quick steps run until ``TIME_STEP_SECONDS`` of runs or 100); the
  step's own host time outside its program is not in it. Arrays among ``leaves`` are placed
  where the step keeps them first: on the first call a model's arrays are not yet where a
  training loop's later steps find them (the step's own outputs), and moving them every run
  would be timed as the step: a stage over several devices keeps them replicated over its
  mesh (the batch arrives as a training loop's data does, on the stage's first device), and
  a pipeline's parameters and optimizer state go where its program puts them. A
  step that consumes arguments (``donate_argnums``) gets fresh copies of them for every run,
  made before the clock starts: the caller's arrays survive.

  With several processes every process runs the same number of runs (a stage over devices of
  several processes is one SPMD program that each calls), ``repeats``, the batch stays on the
  host, and each process's own clock is returned: the caller takes one process's."""
  multi = jax.process_count() > 1
  if c.staged.placements:
    place, batch = c.staged.placements[0], set(c.staged.spec.batch_leaves)
    # A pipeline's parameters and optimizer state go to their stages (where its program puts
    # them); its batch stays where it was given.
    homes = leaf_homes(c.executor_for(1)) if not c.fused or any(c.staged.leaf_specs) else None

    def home(i: int, x: Any) -> Any:
      if homes is not None:
        there = homes.get(i) if i not in batch else None
        if there is None:
          return x
        return place_input(x, there) if multi else jax.device_put(x, there)
      if multi:
        return x if i in batch else place_input(x, place.replicated)
      return jax.device_put(x, place.devices[0] if i in batch else place.replicated)

    given = list(leaves)
    leaves = [
      home(i, x) if isinstance(x, jax.Array) and x.is_fully_addressable else x
      for i, x in enumerate(leaves)
    ]
  donated = set(c.staged.spec.donated) if c.fused else set()

  def fresh(i: int, x: Any) -> Any:  # a copy the step may consume
    if multi and c.staged.placements:
      mine = given[i]
      if isinstance(mine, jax.Array) and mine.is_fully_addressable:  # not yet global
        return home(i, jax.device_put(mine, may_alias=False))
    return jax.device_put(x, may_alias=False)

  times: list[float] = []
  k = 0
  # At least ``repeats`` runs, more while they add up to under TIME_STEP_SECONDS: a step of a
  # few milliseconds on a shared machine needs dozens for a median that holds.
  while len(times) < repeats or (not multi and sum(times) < TIME_STEP_SECONDS and len(times) < 100):
    run = [
      fresh(i, x) if i in donated and isinstance(x, jax.Array) else x for i, x in enumerate(leaves)
    ]
    jax.block_until_ready(run)
    t = time.perf_counter()
    jax.block_until_ready(c.run([run]))
    if k >= 2:
      times.append(time.perf_counter() - t)
    k += 1
  return statistics.median(times)


TIME_STEP_SECONDS = 0.3  # the timed runs of a trial add up to at least this (or 100 runs)


def canonical_dtype(x) -> Any:
  dtype = getattr(x, "dtype", None) or np.result_type(x)
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return jax.dtypes.canonicalize_dtype(dtype)


def _is_key(x) -> bool:
  dt = getattr(x, "dtype", None)
  if dt is None:
    return False
  if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
    return True
  return dt == np.uint32 and tuple(getattr(x, "shape", ())) == (2,)
