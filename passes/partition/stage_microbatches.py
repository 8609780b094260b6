"""Per-stage micro-batch sizes for a finished plan: Plan -> Plan whose stages may differ in size.

GraphPipe lets each stage choose its micro-batch size. The planners here sweep one size for
all stages; this pass starts from such a plan and searches the sizes per stage by coordinate
descent on the simulated iteration time: a move halves or doubles one stage's size, kept when
the plan stays valid (the size divides the batch and the stage's devices, and along every stage
edge the larger size is a multiple of the smaller), within device memory, and faster
(``plan_assembly.better``). The stages, devices and schedule stay as they are; the schedule must
take per-stage counts (gpipe, 1f1b, graph-1f1b, zero-bubble).

The ``graphpipe-stage-mb`` planner is GraphPipe followed by this pass. Its plans run only on
steps whose loss carries no state between micro-batches and reads no random key (see
``runtime.executor``).
"""

from __future__ import annotations

import dataclasses

from gpp_jax.errors import PlanError
from gpp_jax.ir.plan import Plan, stage_microbatch_counts, validate_plan
from gpp_jax.passes.inflight import inflight_chunks
from gpp_jax.passes.partition.graphpipe.search import GraphPipeOptions, graphpipe_search
from gpp_jax.passes.partition.plan_assembly import better
from gpp_jax.passes.partition.problem import PlanningProblem, ProblemPlanner
from gpp_jax.passes.schedules import PER_STAGE_COUNTS


def with_sizes(plan: Plan, sizes: tuple[int, ...]) -> Plan:
  """``plan`` with these per-stage sizes and the in-flight counts 1F1B gives them."""
  stages = tuple(dataclasses.replace(s, microbatch_size=b) for s, b in zip(plan.stages, sizes))
  out = plan.replace(stages=stages)
  assert plan.batch_size is not None  # checked by the caller
  fl = inflight_chunks(plan.num_stages, plan.edges, stage_microbatch_counts(out, plan.batch_size))
  return out.replace(stages=tuple(dataclasses.replace(s, in_flight=f) for s, f in zip(stages, fl)))


def assign_stage_microbatches(problem: PlanningProblem, plan: Plan, *, max_evals: int = 64) -> Plan:
  """Plan (one micro-batch size) for ``problem`` -> the plan with per-stage sizes found by
  coordinate descent (see the module docstring); the plan re-simulated when no move helps.
  At most ``max_evals`` simulations (the problem's prediction, ``PlanningProblem.predict``:
  with its ``host``, the prediction for that machine).
  Moves that make every size equal again are skipped: a uniform plan is the planner's own
  choice (its sweep over sizes), and its count is ``num_microbatches``."""
  if plan.batch_size is None:
    raise PlanError("per-stage micro-batch sizes need the plan's batch_size; set Plan.batch_size")
  if plan.schedule not in PER_STAGE_COUNTS:
    raise PlanError(
      f"schedule {plan.schedule!r} needs one micro-batch size for every stage; per-stage "
      f"sizes work with {list(PER_STAGE_COUNTS)}"
    )
  B = plan.batch_size
  base = B // plan.num_microbatches
  sizes = tuple(s.microbatch_size or base for s in plan.stages)
  # The starting point simulated like every candidate, so that all compare alike.
  best = problem.predict(plan)
  evals = 0
  improved = True
  while improved and evals < max_evals:
    improved = False
    for s in range(plan.num_stages):
      for b in (sizes[s] // 2, sizes[s] * 2):
        if b < 1 or evals >= max_evals:
          continue
        trial = sizes[:s] + (b,) + sizes[s + 1 :]
        if len(set(trial)) == 1:
          continue
        try:  # a size that does not divide the batch fails already in ``with_sizes``
          cand = with_sizes(plan, trial)
          validate_plan(cand, batch_size=B)
        except PlanError:
          continue
        evals += 1
        cand = problem.predict(cand)
        if better(best, cand) is cand:
          best, sizes, improved = cand, trial, True
  return best.replace(
    predicted={**plan.predicted, **best.predicted, "stage_microbatch_evals": evals},
    planner=f"{plan.planner}+stage-mb",
  )


@dataclasses.dataclass(frozen=True)
class StageMicrobatchOptions(GraphPipeOptions):
  """The graphpipe-stage-mb planner's options: GraphPipe's (``GraphPipeOptions``, for the plan
  it starts from) and the per-stage search's (the problem itself is a ``PlanningProblem``).

  Attributes:
    max_evals: at most this many simulations in the coordinate descent.
  """

  max_evals: int = 64


def graphpipe_stage_microbatch_search(
  problem: PlanningProblem, opts: StageMicrobatchOptions
) -> Plan:
  """GraphPipe's plan, then per-stage micro-batch sizes (``assign_stage_microbatches``)."""
  plan = graphpipe_search(problem, opts)
  return assign_stage_microbatches(problem, plan, max_evals=opts.max_evals)


GRAPHPIPE_STAGE_MB = ProblemPlanner(
  "graphpipe-stage-mb", StageMicrobatchOptions, graphpipe_stage_microbatch_search
)


# The keyword form (``GRAPHPIPE_STAGE_MB(layer_graph, cluster, batch_size, **options)``).
graphpipe_stage_microbatch_plan = GRAPHPIPE_STAGE_MB
