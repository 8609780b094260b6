"""Each stage's inner shape over the user's mesh (``Stage.inner``), chosen by prediction.

Over a mesh such as ("data", "model") of shape (rows, k), the planners' searches give each
stage whole rows, priced with the model's own tensor parallelism over the k devices of a row.
That is not always what a stage wants. A layer split k ways computes 1/k of its work but
all-reduces an activation over the row's link on every micro-batch; for small layers, a slow
link or a short stage, those all-reduces cost more than the split saves, and the same devices
do better as more data parallelism: the stage narrows "model" to a divisor of k, and each mesh
row becomes k / that many rows of its own (``runtime.sharding.MeshLayout.stage_devices``). A
model without specs gains the most: its rows otherwise repeat the same work on every device of
a row.

``choose_stage_shapes`` searches those shapes for every planner's plan (``ProblemPlanner``,
unless the problem says ``stage_shapes=False``): stage by stage, each shape the mesh allows
(every axis after the first at a divisor of its size) that the stage's micro-batch and the
model's specs divide, kept where the plan's prediction improves within the memory budget, over
the stages until none changes (two rounds at most). The prediction is the planner's own
(``PlanningProblem.predict``: the devices-only simulation, or the machine's with its host
costs), which prices a narrowed stage through ``cost.cost_model.plan_costs``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpp_jax.ir.plan import Plan, stage_microbatch_sizes
from gpp_jax.passes.partition.plan_assembly import better

if TYPE_CHECKING:
  from gpp_jax.passes.partition.problem import PlanningProblem

ROUNDS = 2  # passes over the stages; a second one rarely changes anything


def inner_shapes(mesh: Mapping[str, Any]) -> list[tuple[int, ...]]:
  """Every inner shape narrower than the mesh's (``mesh``: the layer graph's ``mesh``
  attribute): each axis after the first at a divisor of its size, the mesh's own left out."""
  own = tuple(mesh["inner"])
  divisors = [[d for d in range(1, n + 1) if n % d == 0] for n in own]
  return [t for t in itertools.product(*divisors) if t != own]


def shape_fits(mesh: Mapping[str, Any], rows: int, inner: tuple[int, ...], microbatch: int) -> bool:
  """Whether a stage of ``rows`` mesh rows can run with ``inner``: its first axis (rows x the
  narrowing) divides the micro-batch, and every dimension a spec shards divides over the
  stage's axis sizes (the ``divides`` facts of ``runtime.sharding.mesh_facts``)."""
  axes = tuple(mesh["axes"])
  first = rows * (math.prod(mesh["inner"]) // math.prod(inner))
  if first > 1 and microbatch % first:
    return False
  size = {axes[0]: first, **dict(zip(axes[1:], inner))}
  return all(n % math.prod(size.get(a, 1) for a in names) == 0 for n, names in mesh["divides"])


def choose_stage_shapes(plan: Plan, problem: PlanningProblem) -> Plan:
  """``plan`` with each stage's ``inner`` chosen by prediction (module docstring); the plan
  itself where the layer graph has no mesh, the mesh has nothing to narrow, or parameters are
  held otherwise than by the model's specs (``param_sharding``)."""
  mesh = problem.layer_graph.graph.get("mesh")
  if not mesh or math.prod(mesh["inner"]) <= 1 or plan.param_sharding != "model":
    return plan
  shapes: Sequence[tuple[int, ...] | None] = [None, *inner_shapes(mesh)]
  sizes = stage_microbatch_sizes(plan, plan.batch_size or problem.batch_size)
  idle = plan.predicted.get("idle_devices") or ()

  def priced(p: Plan) -> Plan:
    return problem.predict(p, idle=idle)

  best = priced(plan)
  tried = 0
  for _ in range(ROUNDS):
    changed = False
    for s in range(best.num_stages):
      stage = best.stages[s]
      for inner in shapes:
        if inner == stage.inner or (
          inner is not None and not shape_fits(mesh, len(stage.devices), inner, sizes[s])
        ):
          continue
        stages = list(best.stages)
        stages[s] = dataclasses.replace(stage, inner=inner)
        cand = priced(best.replace(stages=tuple(stages)))
        tried += 1
        if better(best, cand) is cand:
          best, stage, changed = cand, cand.stages[s], True
    if not changed:
      break
  if best is plan or all(s.inner is None for s in best.stages):
    return plan if "iteration_time" in plan.predicted else best
  return best.replace(predicted={**plan.predicted, **best.predicted, "stage_shapes_tried": tried})
