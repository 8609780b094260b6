"""The stage phase of the compile chain (``runtime.compile``): ``Captured``, ``Planned`` ->
``Staged``: the loss cut into the plan's stages (each at its own micro-batch size, the step
traced again per size: ``restage``), the step around it split by where values live, each
stage's placement, and the programs of the stages whose gradients are reduced once per step
(``row_local_programs``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from gpp_jax.errors import CaptureError, GppError, PlanError
from gpp_jax.ir.plan import Plan, stage_microbatch_sizes
from gpp_jax.ir.staged import StagedProgram
from gpp_jax.ir.step import StepProgram
from gpp_jax.passes.lowering import BATCH, KEY, StepSpec
from gpp_jax.passes.staging import BatchFlags, stage_program
from gpp_jax.passes.step_split import split_step
from gpp_jax.runtime.captured import Captured
from gpp_jax.runtime.choice import Planned
from gpp_jax.runtime.loss_state import StatePair, split_state, state_carries
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.placement import StagePlacement, stage_placements
from gpp_jax.runtime.sharding import check_rows, plan_leaf_specs


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
  check_rows(layout, plan.num_places)
  for s in plan.stages:
    layout.check_inner(s.index, s.inner)
  shaped = [layout.stage_devices(s.devices, s.inner) for s in plan.stages]
  placements = stage_placements(
    [devs for devs, _ in shaped],
    sizes,
    axis_names=layout.axis_names,
    inner_shapes=[inner for _, inner in shaped],
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
  row_local: dict[int, Any] = {}  # with remat, every stage all-reduces in each backward
  if not opts.remat:
    row_local = row_local_programs(captured, plan, staged, placements, recapture)
  return Staged(staged, prog, tuple(placements), spec, leaf_specs, row_local)


def row_local_programs(
  captured: Captured,
  plan: Plan,
  staged: StagedProgram,
  placements: Sequence[StagePlacement],
  recapture: Callable[[int], Captured],
) -> dict[int, Any]:
  """Stage -> its program traced at micro-batch / rows, for each stage over several rows whose
  gradients can be summed per row and reduced once per step (``staging.row_local_functions``):
  one that carries no state between micro-batches, reads no random key, and whose outputs are
  batch-carrying values or the loss itself; its program at the rows' share must have the same
  inputs and outputs, each batch-carrying one split by the rows. In one process (a stage
  across processes keeps its per-micro-batch all-reduce). A step that recomputes its forward
  in the backward (``remat``) has none: ``stage_step`` does not ask."""
  if jax.process_count() > 1:
    return {}
  state = tuple(split_state(captured.state, captured.scan_split))
  carrying = set(state_carries(staged, state))
  out: dict[int, Any] = {}
  loss_stage, loss_pos = staged.loss_outputs[0]
  for st, place in zip(staged.stages, placements):
    r, mb = place.rows, place.microbatch_size
    if r < 2 or mb % r or st.index in carrying:
      continue
    if any(x.kind == "data" and captured.roles[x.index] == KEY for x in st.inputs):
      continue
    batch = row_batch_flags(st, captured.roles, mb)
    outs_ok = all(
      b or ((st.index, k) == (loss_stage, loss_pos) and st.jaxpr.jaxpr.outvars[k].aval.ndim == 0)
      for k, b in enumerate(batch.outputs)
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
      for a, c, b in zip(big, little, [*batch.inputs, *batch.outputs])
    ):
      out[st.index] = program
  return out


def _row_share(aval: Any, rows: int, batch: bool) -> tuple[Any, Any]:
  """(shape, dtype) of a row's share of ``aval``: the leading axis split where it is batch."""
  shape = getattr(aval, "shape", None)
  if batch and shape:
    shape = (shape[0] // rows, *shape[1:])
  return shape, getattr(aval, "dtype", None)


def row_batch_flags(st: Any, roles: Sequence[Any], mb: int) -> BatchFlags:
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
  return BatchFlags(tuple(ins), tuple(outs))


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
