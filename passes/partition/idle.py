"""Why a plan leaves devices idle: ``idle_reason``, recorded as ``predicted["idle_reason"]``.

A planner's plan may leave devices idle (``predicted["idle_devices"]``). Every built-in planner
(``problem.ProblemPlanner.plan``) records why, in one of these forms, whichever is true of the
plan (found by pricing its stages, and by simulating it with the idle devices given to a
stage):

* no stage can take them: a stage's width must divide its micro-batch (each device gets whole
  samples), and, for a DP plan taken as it is (``selection="published"``), be a multiple of the
  DP's slot of devices (``device_grid``); the smallest such step needs more devices than are
  idle. A cluster that is no whole number of slots leaves the rest outside every slot;
* more devices would not be faster as predicted: each plan with one stage widened into the
  idle devices, and the plan with them handed out to the slowest stages in turn (where two
  stages are equally slow, widening one alone gains nothing), simulates no faster, or over
  memory (at most ``MAX_WIDENINGS`` plans are simulated, and the reason says how many);
* the search did not get there: some such plan is predicted faster, and the reason says why
  the planner did not reach it (its polish ran out of simulations or moves, it keeps its DP's
  plan as it is, or it keeps to its own candidates and has no polish), naming the faster
  plan.

BaPipe and Luo et al. give every stage the same width, so for them the widening is of every
stage at once. The simulations are the problem's (``PlanningProblem.simulations``): the
polish has often run them already.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpp_jax.errors import PlanError
from gpp_jax.ir.plan import Plan, Stage, has_mixed_microbatches, stage_microbatch_sizes
from gpp_jax.passes.partition.plan_assembly import (
  StageLayout,
  assemble_plan,
  data_parallel_degrees,
)
from gpp_jax.passes.partition.refine import stage_bound_times

if TYPE_CHECKING:
  from gpp_jax.passes.partition.problem import PlanningProblem

# At most this many widened plans are simulated to tell the reasons apart.
MAX_WIDENINGS = 64
# Planners whose stages all have the same width (their plan space), widened all at once: their
# names in the reason, and the candidates they choose among (none of them polishes).
UNIFORM_WIDTH = {
  "bapipe": (
    "BaPipe",
    "a stage count and one width for every stage, cut by its DP, the best few by an estimate "
    "simulated",
  ),
  "luo": (
    "Luo et al.'s planner",
    "one width r for every stage and devices / r stages or half as many, the best few by an "
    "estimate simulated",
  ),
}


@dataclasses.dataclass(frozen=True)
class Widths:
  """The widths a stage of the plan may take: divisors of its micro-batch (each device gets
  whole samples) up to ``num_devices``, multiples of the DP's slot of ``unit`` devices (a DP's
  plan taken as it is), and powers of two where ``powers`` (``powers_of_two`` of such a plan's
  search)."""

  num_devices: int
  unit: int = 1
  powers: bool = False

  def of(self, b: int) -> list[int]:
    """The widths a stage of micro-batch ``b`` may take, smallest first."""
    return [
      d
      for d in data_parallel_degrees(b, self.num_devices)
      if d % self.unit == 0 and (not self.powers or d & (d - 1) == 0)
    ]


def with_idle_reason(plan: Plan, problem: PlanningProblem, options: Any = None) -> Plan:
  """``plan`` with ``predicted["idle_reason"]`` set where it leaves devices idle (and dropped
  where it does not); ``options``: the planner's options dataclass, which says what its search
  could reach (``selection``, ``polish_plans``, ``device_grid``, ``powers_of_two``)."""
  if "idle_devices" not in plan.predicted:  # a planner that prices nothing (balanced)
    return plan
  reason = idle_reason(plan, problem, options)
  pred = {k: v for k, v in plan.predicted.items() if k != "idle_reason"}
  if reason is not None:
    pred["idle_reason"] = reason
  return plan.replace(predicted=pred)


def idle_reason(plan: Plan, problem: PlanningProblem, options: Any = None) -> str | None:
  """Why ``plan`` leaves ``predicted["idle_devices"]`` idle (see the module docstring); None
  where it leaves none. Names stages by their index in the plan."""
  idle = list(plan.predicted.get("idle_devices", ()))
  if not idle:
    return None
  K = problem.num_devices
  sizes = stage_microbatch_sizes(plan, plan.batch_size or problem.batch_size)
  unpolished = _unpolished(plan, options)
  unit = 1
  if unpolished and plan.planner == "pipedream":  # its DP's plan: widths in whole slots
    unit = int(plan.predicted.get("search", {}).get("device_unit", 1))
  powers = unpolished and bool(getattr(options, "powers_of_two", False))
  notes = []
  outside = K - (K // unit) * unit
  if outside:
    notes.append(
      f"{outside} of them lie outside the DP's {K // unit} slots of {unit} devices "
      f"(device_grid={getattr(options, 'device_grid', None)})"
    )
  spare = len(idle) - outside
  widths = Widths(K, unit, powers)
  uniform = plan.planner in UNIFORM_WIDTH and not has_mixed_microbatches(plan)
  counts = [len(s.devices) for s in plan.stages]
  if uniform:
    n, d = len(counts), max(counts)
    steps = [[(i, w) for i in range(n)] for w in widths.of(sizes[0]) if w > d]
    fits = [move for move in steps if (move[0][1] - d) * n <= spare]
  else:
    steps = [[(i, w)] for i, d in enumerate(counts) for w in widths.of(sizes[i]) if w > d]
    fits = [move for move in steps if move[0][1] - counts[move[0][0]] <= spare]
    handed = _hand_out(plan, problem, sizes, widths, spare)
    if len(handed) > 1:  # several stages widened: not one of the single widenings
      fits.insert(0, handed)
  if spare and not fits:
    notes.append(_no_step(plan, sizes, steps, uniform, widths))
  elif spare:
    notes.append(_widened(plan, problem, options, fits, uniform))
  return "; ".join(notes)


def _hand_out(
  plan: Plan, problem: PlanningProblem, sizes: Sequence[int], widths: Widths, spare: int
) -> list[tuple[int, int]]:
  """The idle devices handed out to the slowest stages in turn (as GraphPipe's ``hand_out``
  does with its DP's strategies): repeatedly, of the stages a wider allowed width within the
  devices left makes faster, the one with the largest compute and update time per iteration
  (``refine.stage_bound_times``) takes the next width. Returns the widened stages as (stage,
  width), those widened only; two or more equally slow stages need it, where widening one of
  them alone gains nothing."""
  cm, cluster, costs = problem.cost_model, problem.cluster, problem.costs
  B = plan.batch_size or problem.batch_size

  def seconds(i: int, d: int) -> float:
    s = plan.stages[i]
    f, b, u = stage_bound_times(
      problem,
      cm.layer_times(costs, cluster.device, sizes[i] / d),
      [costs.index[l] for l in s.layers],
      d,
    )
    return B // sizes[i] * (f + b) + u

  width = [len(s.devices) for s in plan.stages]
  left = spare
  while True:
    best = None
    for i, d in enumerate(width):
      up = next((w for w in widths.of(sizes[i]) if w > d), None)
      if up is None or up - d > left:
        continue
      now = seconds(i, d)
      if seconds(i, up) < now and (best is None or now > best[0]):
        best = (now, i, up)
    if best is None:
      break
    _, i, up = best
    left -= up - width[i]
    width[i] = up
  return [(i, w) for i, w in enumerate(width) if w != len(plan.stages[i].devices)]


def _unpolished(plan: Plan, options: Any) -> bool:
  """Whether the plan is a DP's plan taken as it is (no polish moved single devices)."""
  if getattr(options, "selection", None) == "published":
    return True
  return getattr(options, "polish_plans", True) is False and "seed" not in plan.predicted


def _no_step(
  plan: Plan,
  sizes: Sequence[int],
  steps: list[list[tuple[int, int]]],
  uniform: bool,
  widths: Widths,
) -> str:
  """The reason where no stage (no width, for a uniform planner) can take the idle devices:
  none of ``steps`` (the widenings to the next allowed width, ``widths``) fits in them."""
  counts = [len(s.devices) for s in plan.stages]
  rule = "divide its micro-batch"
  if widths.powers:
    rule += " and be a power of two (powers_of_two=True)"
  if widths.unit > 1:
    rule += (
      f" and be a multiple of the DP's slot of {widths.unit} devices (its plan is not polished)"
    )
  if not steps:
    return (
      f"no stage can take them: a stage's width must {rule}, and no stage can be wider than "
      f"it is (micro-batch of {sizes[0]} samples)"
    )

  def extra(move: list[tuple[int, int]]) -> int:
    return sum(w - counts[i] for i, w in move)

  move = min(steps, key=extra)
  if uniform:
    n, (_, w) = len(move), move[0]
    return (
      f"no stage can take them: {UNIFORM_WIDTH[plan.planner][0]} gives every stage the same "
      f"width, which must {rule} ({sizes[0]} samples), and its {n} stages on {w} devices "
      f"each need {extra(move)} more"
    )
  i, w = move[0]
  return (
    f"no stage can take them: a stage's width must {rule}, and the smallest step, stage {i} "
    f"from {counts[i]} to {w} devices (micro-batch of {sizes[i]} samples), needs "
    f"{w - counts[i]} more"
  )


def _widened(
  plan: Plan,
  problem: PlanningProblem,
  options: Any,
  moves: list[list[tuple[int, int]]],
  uniform: bool,
) -> str:
  """The reason where some stage (every stage, for a uniform planner) could take more of the
  idle devices: each such plan simulated (at most ``MAX_WIDENINGS``); either none is faster,
  or the fastest is named with why the planner's search did not reach it."""
  now = float(plan.predicted["iteration_time"])
  tried = moves[:MAX_WIDENINGS]
  best: tuple[float, list[tuple[int, int]]] | None = None
  over_memory = 0
  for move in tried:
    try:
      p = _widen(plan, problem, move)
    except PlanError:  # no contiguous devices for the wider stage (``place_stages``)
      over_memory += 1
      continue
    if not p.predicted["memory_ok"]:
      over_memory += 1
      continue
    t = float(p.predicted["iteration_time"])
    if t < now * (1 - 1e-4) and (best is None or t < best[0]):  # the polish's threshold
      best = (t, move)
  singles = sum(len(m) == 1 for m in tried)
  if uniform:
    what = "every stage widened into them"
  else:
    what = "one stage widened into them"
    if singles < len(tried):
      what += ", and with them handed out to the slowest stages in turn,"
  if len(tried) < len(moves):
    of = f"{len(tried)} of the {len(moves)} plans with {what} simulate"
  elif len(moves) == 1:
    of = f"the one plan with {what} simulates"
  else:
    of = f"all {len(moves)} plans with {what} simulate"
  if best is None:
    memory = f" ({over_memory} over device memory or not placeable)" if over_memory else ""
    return f"more devices would not be faster as predicted: {of} no faster{memory}"
  t, move = best
  if uniform:
    faster = f"every stage on {move[0][1]} devices instead of {len(plan.stages[0].devices)}"
  else:
    faster = " and ".join(
      f"stage {i} on {w} devices instead of {len(plan.stages[i].devices)}" for i, w in move
    )
  return (
    f"{_missed(plan, options)}; the plan with {faster} is predicted faster ({t * 1e3:.3f} ms "
    f"against {now * 1e3:.3f} ms)"
  )


def _missed(plan: Plan, options: Any) -> str:
  """Why the planner's search did not reach a faster plan with more devices in use."""
  p = plan.predicted
  seed = f" (the plan is {p['seed']}'s, taken as a seed)" if p.get("seed") else ""
  if getattr(options, "selection", None) == "published":
    why = (
      # The DP's optimum over every allocation of at most K devices (the fewest slots that
      # reach it): a wider stage on the idle devices has no smaller bottleneck.
      ", which they do not make faster by its objective (the slowest stage's time per sample)"
      if plan.planner == "pipedream"
      else ""
    )
    return (
      'the search stopped short of using them: selection="published" keeps the DP\'s plan'
      f"{why}, and neither simulates nor polishes it"
    )
  whose = f"{p['seed']}'s" if p.get("seed") else "the"
  if p.get("polish_stopped") == "budget":
    return f"{whose} polish ran out of simulations (its budget) before it gave them out{seed}"
  if p.get("polish_stopped") == "rounds":
    return f"{whose} polish made its most moves (max_rounds) before it gave them out{seed}"
  if _unpolished(plan, options):
    return "the search stopped short of using them: polish_plans=False keeps the plan unpolished"
  if plan.planner in UNIFORM_WIDTH:
    name, space = UNIFORM_WIDTH[plan.planner]
    return (
      f"the search stopped short of using them: {name} keeps to its own candidates ({space}) "
      "and has no polish"
    )
  return f"the search stopped short of using them{seed}"


def _widen(plan: Plan, problem: PlanningProblem, move: list[tuple[int, int]]) -> Plan:
  """``plan`` with stage i on w devices for each (i, w) of ``move``, simulated: placed afresh
  as the polish places a plan whose device counts it changed (``refine.refine_plan``), or,
  for stages of different micro-batch sizes, each widened stage given idle devices in order."""
  widths = dict(move)
  if not has_mixed_microbatches(plan):
    assert plan.batch_size is not None  # planners' plans carry their batch size
    return assemble_plan(
      problem,
      [(s.layers, widths.get(s.index, len(s.devices))) for s in plan.stages],
      microbatch=plan.stages[0].microbatch_size or plan.batch_size // plan.num_microbatches,
      planner=plan.planner,
      schedule=plan.schedule,
      layout=StageLayout(extra_edges=plan.edges, keep_order=True),
    )
  free = list(plan.predicted["idle_devices"])
  stages: list[Stage] = []
  for s in plan.stages:
    more = widths.get(s.index, len(s.devices)) - len(s.devices)
    stages.append(dataclasses.replace(s, devices=tuple(s.devices) + tuple(free[:more])))
    free = free[more:]
  return problem.predict(plan.replace(stages=tuple(stages)), idle=free)
