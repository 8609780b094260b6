"""Idle devices and the DPs' device grid: a plan that leaves devices idle says why
(``predicted["idle_reason"]``, ``passes.partition.idle``, printed by ``Plan.__str__``), the
reason is true of the plan, and the coarse device grid's plans stay near the exact DP's at
small scale (``benchmarks/device_grid.py`` compares them at 64-256 devices)."""

import pytest

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.experiments.planner_runs import PER_DEVICE_BATCH, build_graph
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.partition.idle import idle_reason, with_idle_reason
from gpp_jax.passes.partition.plan_assembly import StageLayout, assemble_plan
from gpp_jax.passes.partition.problem import PlanningProblem
from gpp_jax.passes.partition.refine import RefineOptions, refine_plan

# The coarse grid's plan is at most this many times slower (simulated) than the exact DP's at
# 64 devices on the tiny zoo graphs (GraphPipe, unit 2) and at 128 (PipeDream, unit 2).
# Measured: at most 1.0 on these; at the paper's shapes at 64 devices at most 1.064
# (CANDLE-Uno). Larger clusters are not held here: the paper's CANDLE-Uno at 256 devices
# reaches 1.29 (GraphPipe) and 1.32 (PipeDream), tiny CANDLE-Uno with a mini-batch of 2,048
# 1.28 at 128 and 1.54 at 256 (GraphPipe); docs/results/planning.md, "The coarse device grid
# against the exact DP", and ``python benchmarks/device_grid.py``.
COARSE_FACTOR = 1.10


def chain_plan(widths, num_devices, batch=8, microbatch=4):
  """A chain of two equal layers (1,024 wide) on the given stage widths, on V100s: the
  problem and the plan with its idle reason."""
  g = mg.chain(layers=2, batch_size=batch)
  cluster = v100_cluster(num_devices)
  problem = PlanningProblem.build(g, cluster, batch)
  layers = sorted(g.nodes, key=list(g.nodes).index)
  plan = assemble_plan(
    problem,
    [([l], w) for l, w in zip(layers, widths)],
    microbatch=microbatch,
    planner="manual",
    layout=StageLayout(sequential=True),
  )
  return problem, with_idle_reason(plan, problem)


def test_a_plan_with_idle_devices_prints_how_many_and_why():
  # Widths must divide the micro-batch of 4: stage 1 could only go from 2 to 4 devices (2
  # more), stage 0 is at 4 already, and 1 device is idle.
  _, plan = chain_plan((4, 2), 7)
  assert plan.predicted["idle_devices"] == [6]
  reason = plan.predicted["idle_reason"]
  assert reason.startswith("no stage can take them") and "stage 1 from 2 to 4" in reason
  head = str(plan).splitlines()[:2]
  assert head[0].startswith("Plan by manual")
  assert head[1] == f"1 device idle: {reason}"
  # Two equally slow stages: widening one alone gains nothing, handing the idle devices out
  # to both does; the reason names that plan, and it is faster.
  _, plan = chain_plan((1, 1), 8, batch=4096, microbatch=512)
  reason = plan.predicted["idle_reason"]
  assert reason.startswith("the search stopped short of using them")
  named = "stage 0 on 4 devices instead of 1 and stage 1 on 4 devices instead of 1"
  assert f"the plan with {named} is predicted faster" in reason
  assert str(plan).splitlines()[1].startswith("6 devices idle: the search stopped short")
  wider = chain_plan((4, 4), 8, batch=4096, microbatch=512)[1]
  assert wider.predicted["iteration_time"] < plan.predicted["iteration_time"]
  # A plan that uses every device says nothing.
  assert "idle_reason" not in wider.predicted and "idle" not in str(wider).splitlines()[1]


def test_dlrm_on_1024_devices_leaves_112_idle_because_the_polish_ran_out():
  """The CLI's ``--model=dlrm --num_devices=1024 --planner=graphpipe`` plan: PipeDream's
  polished plan (GraphPipe's seed) on 912 devices. Stage widths divide the micro-batch of
  16,384 and more devices would be faster; the polish spent its 200 simulations first."""
  k = 1024
  batch = PER_DEVICE_BATCH["dlrm"] * k
  g = build_graph("dlrm", "paper", batch)
  cluster = v100_cluster(k)
  plan = PLANNERS["graphpipe"](g, cluster, batch)
  p = plan.predicted
  assert len(p["idle_devices"]) == 112 and p["seed"] == "pipedream"
  assert p["idle_reason"].startswith("pipedream's polish ran out of simulations")
  assert str(plan).splitlines()[1].startswith("112 devices idle: pipedream's polish ran out")
  # True: with a larger budget the same polish gives the idle devices out, and is faster.
  options = RefineOptions(partition=False, max_evals=1000)
  more = refine_plan(PlanningProblem.build(g, cluster, batch), plan, options)
  assert more.predicted["iteration_time"] < p["iteration_time"]
  assert len(more.predicted["idle_devices"]) < 112


def test_more_devices_not_faster_is_checked_by_simulation():
  g = build_graph("mmt", "tiny", 512)
  problem = PlanningProblem.build(g, v100_cluster(64), 512)
  plan = PLANNERS["pipedream"].plan(problem)
  reason = plan.predicted["idle_reason"]
  assert reason.startswith("more devices would not be faster as predicted")
  assert idle_reason(plan, problem) == reason  # the same check, the same answer


@pytest.mark.parametrize(
  "model, batch, planner, devices",
  [
    ("mmt", 512, "graphpipe", 64),
    ("dlrm", 2048, "graphpipe", 64),
    ("candle_uno", 2048, "graphpipe", 64),
    ("candle_uno", 2048, "pipedream", 128),
  ],
)
def test_the_coarse_grid_plans_near_the_exact_dp(model, batch, planner, devices):
  g = build_graph(model, "tiny", batch)
  cluster = v100_cluster(devices)
  exact = {"device_grid": None}
  if planner == "graphpipe":
    exact["chain_device_grid"] = None
  coarse = PLANNERS[planner](g, cluster, batch)
  fine = PLANNERS[planner](g, cluster, batch, **exact)
  assert coarse.predicted["search"]["device_unit"] == 2
  assert fine.predicted["search"]["device_unit"] == 1
  ratio = coarse.predicted["iteration_time"] / fine.predicted["iteration_time"]
  assert ratio <= COARSE_FACTOR, (model, planner, devices, ratio)


def test_sizes_the_grid_leaves_out_are_searched_in_slots_they_allow(monkeypatch):
  """96 devices in slots of 4: micro-batches of 2, 3 and 6 samples have no data-parallel
  degree a multiple of 4, so the coarse grid gives them no stage. Each is searched again in
  slots of one of its own degrees (2, 3 and 2: at most two grids' worth of slots; 1 would
  need 96 and is left out), and what that adds can only make the plan faster."""
  from gpp_jax.passes.partition.graphpipe import search

  g, B = mg.chain(batch_size=288, layers=12, hidden=2048), 288
  cluster = v100_cluster(96)
  seen: list[tuple[int, tuple[int, ...]]] = []
  sweep = search.sweep_sizes

  def recording(runs, sizes, cands):
    seen.append((runs.unit, tuple(sorted(sizes))))
    return sweep(runs, sizes, cands)

  monkeypatch.setattr(search, "sweep_sizes", recording)
  plan = PLANNERS["graphpipe"](g, cluster, B)
  assert seen[0][0] == 4 and {2, 3, 6} <= set(seen[0][1])
  assert (3, (3,)) in seen and (2, (2, 6)) in seen
  assert not any(1 in sizes for unit, sizes in seen[1:])
  monkeypatch.setattr(search, "finer_for_missed_sizes", lambda *a: [])
  coarse = PLANNERS["graphpipe"](g, cluster, B)
  assert plan.predicted["iteration_time"] <= coarse.predicted["iteration_time"]


def test_a_fixed_micro_batch_the_grid_leaves_out_is_halved_only_so_far(monkeypatch):
  """The micro-batch fixed at 3 samples: no degree of 3 (1 or 3 devices a stage) is a multiple
  of the grid's slots (4 on 96 devices, 8 on 192), nor of their halves. The grid is halved
  while the DP stays within four grids' worth of slots: on 96 devices down to single devices
  (one DP of 96 slots); on 192 not (it would be 192 slots; at 630 virtual devices such a DP
  took 68 s for the one size), and the size is searched in slots of 3 (64)."""
  from gpp_jax.passes.partition.graphpipe import search

  slots: list[int] = []
  run = search.DPRuns.run

  def recording(self, ctx, cap):
    slots.append(ctx.K)
    return run(self, ctx, cap)

  monkeypatch.setattr(search.DPRuns, "run", recording)
  for devices, most in ((96, 96), (192, 64)):
    slots.clear()
    g, B = mg.chain(batch_size=3 * devices, layers=12, hidden=2048), 3 * devices
    plan = PLANNERS["graphpipe"](g, v100_cluster(devices), B, num_microbatches=devices)
    assert plan.num_microbatches == devices and set(slots) == {most}, (devices, slots)
