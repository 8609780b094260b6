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

Where each phase lives (modules of ``runtime``; indented, those the phase above calls):

  options      ``Options``, the decorator's settings, which every phase reads
  captured     capture: ``capture`` -> ``Captured``
  choice       plan: ``plan_step`` -> ``Planned``; the candidates, their timing trials and
               the choice among them (``choose``)
  calibration    the machine measured (``calibrate=True``), and the fusion and SPMD factors
                 fitted to the trials (``calibrate_fusion``, ``calibrate_spmd``: a
                 ``cost.calibration.MachineCalibration``)
  planning       planner runs (``make_plan``, ``run_planner``), the memory budget and its
                 bisection (``budget_error``), ``predict_seconds``
  stage        stage: ``stage_step`` -> ``Staged``
  build        schedule, kernels and the memory check: ``build_step`` -> ``CompiledStep``,
               which lowers and makes its executors per number of steps; ``time_step``, a
               trial's timing
  buffers        the buffer sizes the lowering and the memory model take from the kernels

The trials of the plan phase build and time the candidates through ``compile_step``'s own
``build`` and ``time_step`` (``StepTrials``, the ``choice.TimingTrials`` ``plan_step`` takes),
so a chosen trial's step is kept.

``GraphPipeline`` (``runtime.pipeline``) keeps one ``CompiledStep`` per argument signature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from gpp_jax.cost.calibration import MachineCalibration
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.manual import ManualPlan
from gpp_jax.runtime.build import CompiledStep, build_step, time_step
from gpp_jax.runtime.calibration import (
  FUSION_FLOOR,
  SPMD_FLOOR,
  Predictor,
  Timed,
  calibrate_fusion,
  calibrate_spmd,
  calibrate_widths,
  stage_widths,
  width_groups,
)
from gpp_jax.runtime.capture_step import PureStep
from gpp_jax.runtime.captured import Captured, canonical_dtype, capture
from gpp_jax.runtime.choice import (
  ACCUMULATED,
  Choice,
  Planned,
  baseline_plans,
  choose,
  choose_plan,
  plan_step,
)
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.planning import (
  BASELINES,
  make_plan,
  planner_cluster,
  predict_seconds,
  run_planner,
)
from gpp_jax.runtime.stage import Staged

# Importable from here too: what other modules, the tests and the benchmarks take from the
# compile chain (each phase's own module holds it). ``compile_step`` looks ``build_step`` and
# ``time_step`` up in this module: patched here, they change what its trials build and time.
__all__ = [
  "ACCUMULATED",
  "BASELINES",
  "FUSION_FLOOR",
  "SPMD_FLOOR",
  "Captured",
  "Choice",
  "CompiledStep",
  "MachineCalibration",
  "Options",
  "Planned",
  "Predictor",
  "Staged",
  "StepTrials",
  "Timed",
  "baseline_plans",
  "build_step",
  "calibrate_fusion",
  "calibrate_spmd",
  "calibrate_widths",
  "canonical_dtype",
  "capture",
  "choose",
  "choose_plan",
  "compile_step",
  "make_plan",
  "planner_cluster",
  "predict_seconds",
  "run_planner",
  "stage_widths",
  "time_step",
  "width_groups",
]


@dataclasses.dataclass(frozen=True)
class StepTrials:
  """The plan choice's timing trials of one step (``choice.TimingTrials``): a candidate's
  plan built by the compile chain (``build``: as a plan the user gave) and timed on the step's
  arguments ``leaves`` (``time_step``, looked up in this module), so that a chosen trial's
  compiled step is kept."""

  build: Callable[[Plan], CompiledStep]
  leaves: Sequence[Any]

  def time(self, plan: Plan, outside: float = 0.0) -> tuple[CompiledStep, float]:
    """``plan``'s step, built and timed: (the compiled step, seconds per call in a loop that
    spends ``outside`` seconds a step outside the program, less those, ``time_step``)."""
    c = self.build(plan)
    return c, time_step(c, self.leaves, outside=outside)

  def again(self, step: CompiledStep, outside: float = 0.0) -> float:
    """Seconds per call of ``step`` (as ``time``), timed once more."""
    return time_step(step, self.leaves, outside=outside)


def compile_step(
  pure: PureStep,
  args: Sequence[Any],
  leaves: Sequence[Any],
  opts: Options,
  outside: Callable[[], float | None] | None = None,
) -> CompiledStep:
  """The compile chain, top to bottom. ``outside``: measures the host's seconds per call
  outside the program on the path the step is called by (``GraphPipeline.seconds_outside``),
  in place of the host probe's where calibrating (``choice.plan_step``)."""
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

  def build_trial(plan: Plan) -> CompiledStep:
    return build(
      Planned(plan, captured.layering.graph), dataclasses.replace(opts, planner=plan), True
    )

  planned = plan_step(captured, opts, StepTrials(build_trial, leaves), call_outside=outside)
  if planned.trial is not None:  # its options: the user's, at the trial's micro-batches
    kept = planned.trial
    return dataclasses.replace(
      kept, opts=dataclasses.replace(kept.opts, planner=opts.planner), planned=planned
    )
  return build(planned, opts, isinstance(opts.planner, (Plan, ManualPlan)))
