"""Plans for the machine at hand: the host's costs in the prediction, plain jit and jit data
parallel among the candidates, and the one prediction a plan is chosen by."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import optax
import pytest
from harness import (
  accumulating_planner,
  dag_model,
  dag_params,
  make_batch,
  max_diff,
  mse_step,
  sequential_plan,
)

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.cost.host import HostCosts
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.runtime import compile as cp

OPS = ("F", "B", "W", "UPDATE", "SEND", "RECV", "STEP")
MiB = 2**20


@pytest.fixture(autouse=True)
def _host_outside_as_probed(monkeypatch):
  """These tests give the host's costs by a fake probe, its time outside the program
  included; the step's own call path is not measured in its place here
  (``test_call_overhead.py`` measures it)."""
  from gpp_jax.runtime.pipeline import GraphPipeline

  monkeypatch.setattr(GraphPipeline, "seconds_outside", lambda self, *a: None)


def host(per_op: float, parallel: float | None, outside: float = 0.0) -> HostCosts:
  return HostCosts(
    per_op=dict.fromkeys(OPS, per_op), outside=outside, parallel=parallel, cores=2, device="cpu:0"
  )


def chain(seconds: float, param_bytes: float, batch: int = 8):
  """Two layers a -> b, each ``seconds`` forward (twice that backward) per batch."""
  g = lg.new_layer_graph("chain", batch)
  for name in ("a", "b"):
    lg.add_layer(
      g,
      name,
      lg.LayerCost(flops=1e6, param_bytes=param_bytes, act_bytes=1024),
      time_f=seconds,
      time_b=2 * seconds,
    )
  lg.add_edge(g, "a", "b", 1024)
  return g


def candidates(g, M: int = 4):
  layers = tuple(lg.topo_layers(g))
  B = g.graph["batch_size"]
  one = lambda k, name: Plan(
    (Stage(0, layers, tuple(range(k))),), (), M, planner=name, batch_size=B
  )
  two = Plan(
    (Stage(0, ("a",), (0,)), Stage(1, ("b",), (1,))), ((0, 1),), M, planner="chain", batch_size=B
  )
  return {"pipeline": two, "plain jit": one(1, "plain jit"), "jit data parallel": one(2, "dp")}


def test_dispatch_bound_model_gets_the_fused_plan():
  """Layers of microseconds, instructions of a millisecond to issue: one jitted call wins."""
  g = chain(20e-6, 4096)
  name, predicted = cp.choose_plan(candidates(g), g, cpu_cluster(2), host(1e-3, 1.0))
  assert name == "plain jit", predicted
  assert predicted["pipeline"] > 2 * predicted["plain jit"]


def test_compute_bound_chain_on_two_devices_gets_two_stages():
  """Layers of 50 ms, devices that compute at once, parameters too large to all-reduce
  cheaply: the two-stage pipeline wins over both plain jit and data parallel."""
  g = chain(50e-3, 512 * MiB)
  name, predicted = cp.choose_plan(candidates(g), g, cpu_cluster(2, 8 * 2**30), host(50e-6, 2.0))
  assert name == "pipeline", predicted
  assert predicted["pipeline"] < predicted["plain jit"]


def test_devices_that_share_cores_do_not_pay_for_a_pipeline():
  """The same compute-bound chain where the two devices take turns on the cores (forced CPU
  devices on a busy host): the pipeline's concurrency is gone, plain jit wins."""
  g = chain(50e-3, 4096)
  name, predicted = cp.choose_plan(candidates(g), g, cpu_cluster(2), host(50e-6, 1.0))
  assert name == "plain jit", predicted
  # Devices-only (no host): the pipeline overlaps the two stages and is predicted faster.
  _, devices_only = cp.choose_plan(candidates(g), g, cpu_cluster(2), None)
  assert devices_only["pipeline"] < devices_only["plain jit"]


def test_processes_issue_on_their_own_and_share_the_cores_measured_across_them():
  """Two processes, a stage on each: each issues its own stage's instructions (a SEND both),
  so a dispatch-bound pipeline that one thread issues in turn overlaps; their computations
  share the cores that ``parallel`` (measured across the processes) says there are: with
  one, the stages compute in turn whatever issues them."""
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  two = candidates(g)["pipeline"]
  cluster = cpu_cluster(2)
  two_processes = dataclasses.replace(host(0, 1.0), processes=2)
  lanes = two_processes.lane_processes([(0,), (1,), (0, 1)], 2)
  assert lanes == [(0,), (1,), (0, 1), (0, 1)]  # the host lane last: both
  assert host(0, 1.0).lane_processes([(0,), (1,)], 2) is None

  def predicted(g, per_op: float, parallel: float, processes: int) -> float:
    h = dataclasses.replace(host(per_op, parallel), processes=processes)
    return simulate(candidates(g)["pipeline"], g, cluster, host=h).iteration_time

  # Layers of 0.1 ms, instructions of 2 ms to issue, cores to spare: two threads issue faster.
  quick = chain(1e-4, 4096)
  one_thread, threads = predicted(quick, 2e-3, 4.0, 1), predicted(quick, 2e-3, 4.0, 2)
  assert threads < 0.9 * one_thread, (threads, one_thread)
  # One core between them: both layers' 10 + 20 ms a batch, in turn; with a core for each
  # stage and one for issuing, they overlap as devices-only.
  assert predicted(g, 0.0, 1.0, 2) >= 0.06 > predicted(g, 0.0, 3.0, 2)
  assert predicted(g, 0.0, 3.0, 2) == pytest.approx(simulate(two, g, cluster).iteration_time)


def test_gradient_accumulation_is_not_chosen_where_plain_jit_fits():
  """The planner's one stage of 4 micro-batches on one device is predicted a hair faster
  than plain jit (the cost model is linear in the micro-batch, so they tie up to the
  update): plain jit, the same computation in one call, is chosen while it fits, unless
  trials measured the micro-batches faster; where it does not fit, accumulation is."""
  g = chain(10e-3, 4096)
  plans = candidates(g)
  layers = plans["plain jit"].stages[0].layers
  acc = Plan((Stage(0, layers, (0,)),), (), 4, planner="graphpipe", batch_size=8)
  h = host(1e-4, 1.0)
  for_acc = {"pipeline": acc, "plain jit": plans["plain jit"]}
  name, predicted = cp.choose_plan(for_acc, g, cpu_cluster(2), h)
  assert name == "plain jit", predicted
  assert predicted["pipeline"] <= predicted["plain jit"]  # a tie went to the planner
  # Plain jit's whole batch does not fit; the micro-batches' stashes do.
  tight = cpu_cluster(2, memory_per_device=2.5 * 1024 * 8)
  g_big = chain(10e-3, 4096)
  for n in g_big.nodes:
    g_big.nodes[n]["saved_bytes"] = 1024 * 8.0
  name, predicted = cp.choose_plan(for_acc, g_big, tight, h)
  assert "plain jit" not in predicted and name == "pipeline", predicted
  # Over several devices alike: jit data parallel, not its micro-batches one by one.
  wide = Plan((Stage(0, layers, (0, 1)),), (), 4, planner="graphpipe", batch_size=8)
  for_wide = {"pipeline": wide, "jit data parallel": plans["jit data parallel"]}
  name, predicted = cp.choose_plan(for_wide, g, cpu_cluster(2), h)
  assert name == "jit data parallel", predicted
  assert predicted["pipeline"] <= predicted["jit data parallel"]  # it would have won
  # Timed by trials: measured slower, not chosen; measured faster, chosen and predicted at
  # plain jit's prediction times the ratio of the two measurements.
  slower = {"plain jit": 0.010, "pipeline": 0.012}
  assert cp.choose_plan(for_acc, g, cpu_cluster(2), h, slower)[0] == "plain jit"
  name, predicted = cp.choose_plan(for_acc, g, cpu_cluster(2), h, {**slower, "pipeline": 0.008})
  assert name == "pipeline"
  assert predicted["pipeline"] == pytest.approx(0.8 * predicted["plain jit"])


@pytest.fixture(scope="module")
def dag():
  tx = optax.adam(1e-2)
  params = dag_params()
  return mse_step(dag_model, tx), params, tx.init(params), make_batch(0, 16, 5, 2)


def test_calibrated_host_cost_is_used(dag, monkeypatch):
  """With calibrate=True the host's measured costs (here: expensive instructions) decide:
  the planner's pipeline loses to plain jit, the note and explain() say so, the prediction
  kept is the host-aware one, and the step equals the plain step."""
  from gpp_jax.runtime import host as host_mod

  slow = host(5e-3, 1.0)
  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: slow)
  # The trial's timings, as a machine on which jit data parallel does not pay says them.
  timed_by_width(monkeypatch, lambda k: 0.01 if k == 1 else 0.03)
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner="graphpipe", calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert planned.host.host is slow
  assert pp.plan.num_stages == 1 and pp.plan.planner == "plain jit"
  assert planned.predicted_s == pytest.approx(0.01, rel=1e-6)
  assert "plain jit is predicted fastest" in planned.note and planned.note in pp.explain()
  graph = lg.scaled(planned.layer_graph, pp.batch_size)
  cluster = cp.planner_cluster(pp.compiled.opts)
  seconds, _ = cp.predict_seconds(pp.plan, graph, cluster, planned.host)
  assert planned.predicted_s == pytest.approx(seconds)
  # The measured plain step calibrated the layer times (XLA's fusion of the whole model).
  assert planned.host.fusion > 0
  # The planner searched with the same host: its own plan was predicted for this machine.
  own = planned.plans["pipeline"]
  assert own.predicted["host_aware"] and "searched with the host's measured costs" in pp.explain()
  ref = jax.jit(step)(params, opt_state, batch)
  assert max_diff(ref, out) < 1e-5


def four_layer_chain(seconds: float) -> object:
  """Four layers a -> b -> c -> d of ``seconds`` forward (twice that backward) per batch of
  16 and 32 MiB of parameters each (data parallel all-reduces them): a pipeline of four
  stages over four devices by the devices-only model."""
  g = lg.new_layer_graph("chain4", 16)
  names = ("a", "b", "c", "d")
  for name in names:
    lg.add_layer(
      g,
      name,
      lg.LayerCost(flops=1e9, param_bytes=32 * MiB, act_bytes=1024),
      time_f=seconds,
      time_b=2 * seconds,
    )
  for u, v in itertools.pairwise(names):
    lg.add_edge(g, u, v, 1024)
  return g


@pytest.mark.parametrize("planner", ["graphpipe", "pipedream", "piper", "bapipe", "luo"])
def test_every_planner_searches_with_the_host_it_is_given(planner):
  """A planner given the machine's host costs compares its plans by the prediction for that
  machine: devices that take turns on the cores (parallel 1) and instructions of 2 ms to
  issue make its devices-only pipeline slower than fewer stages. The plan it returns carries
  the one prediction (``predict_seconds``), is no slower on that machine than its
  devices-only plan, and has fewer stages."""
  from gpp_jax.passes.partition import get_planner

  g, cluster, h = four_layer_chain(10e-3), cpu_cluster(4, 8 * 2**30), host(2e-3, 1.0)
  plan = get_planner(planner)
  devices_only = plan(g, cluster, 16, num_microbatches=4)
  on_host = plan(g, cluster, 16, num_microbatches=4, host=h)
  assert devices_only.num_stages > 1 and "host_aware" not in devices_only.predicted
  assert on_host.predicted["host_aware"]
  seconds, fits = cp.predict_seconds(on_host, g, cluster, h)
  assert fits and on_host.predicted["iteration_time"] == pytest.approx(seconds)
  assert seconds <= cp.predict_seconds(devices_only, g, cluster, h)[0] * (1 + 1e-9)
  assert on_host.num_stages < devices_only.num_stages
  # Without the host the same planner's plan is the devices-only one, as the papers plan.
  again = plan(g, cluster, 16, num_microbatches=4)
  assert again.stages == devices_only.stages


@pytest.mark.parametrize("planner", ["bapipe", "luo"])
def test_a_search_with_the_host_simulates_every_replication_and_stage_count(planner, monkeypatch):
  """BaPipe and Luo simulate the best few candidates of their devices-only estimate; searched
  with the host, also the best of every other (replication, stage count), which the
  estimate ranks below the widest and deepest (``plan_assembly.shortlist``)."""
  import importlib

  from gpp_jax.passes.partition.plan_assembly import shortlist
  from gpp_jax.passes.partition.problem import PlanningProblem

  found = [(e, 4, r, S, "x") for e, r, S in [(1, 2, 4), (2, 2, 4), (3, 1, 8), (4, 2, 2), (5, 1, 8)]]
  assert shortlist(found, 2, None) == found[:2]
  assert shortlist(found, 2, object()) == found[:4]
  module = importlib.import_module(f"passes.partition.{planner}")
  ranked = module.ranked_candidates if planner == "bapipe" else module.mapped_candidates
  simulated = []
  real = module.assemble_plan

  def counted(problem, stages, **kw):
    simulated.append((stages[0][1], len(stages)))
    return real(problem, stages, **kw)

  monkeypatch.setattr(module, "assemble_plan", counted)
  g, cluster, h = four_layer_chain(10e-3), cpu_cluster(4, 8 * 2**30), host(2e-3, 1.0)
  shapes = set()
  for on_host in (None, h):
    problem = PlanningProblem.build(g, cluster, 16, num_microbatches=4, host=on_host)
    args = (problem, ("1f1b", "gpipe")) if planner == "bapipe" else (problem,)
    shapes = {(c[2], c[3]) for c in ranked(*args)}
    simulated.clear()
    getattr(module, f"{planner}_plan")(g, cluster, 16, num_microbatches=4, host=on_host)
    if on_host is None:
      assert set(simulated) < shapes  # the estimate's best few only
    else:
      assert set(simulated) == shapes


def test_a_user_planner_is_given_the_host_where_it_takes_one():
  """``run_planner``: a callable planner whose signature takes ``host`` gets the measured
  host costs; one that does not is called as before."""
  from gpp_jax.passes.partition import get_planner

  g, cluster, h = four_layer_chain(10e-3), cpu_cluster(4, 8 * 2**30), host(2e-3, 1.0)
  seen = []

  def with_host(graph, cl, batch_size, *, num_microbatches=None, host=None):
    seen.append(host)
    return get_planner("graphpipe")(
      graph, cl, batch_size, num_microbatches=num_microbatches, host=host
    )

  def without(graph, cl, batch_size, *, num_microbatches=None):
    seen.append("called")
    return get_planner("graphpipe")(graph, cl, batch_size, num_microbatches=num_microbatches)

  opts = cp.Options(num_microbatches=4, devices=tuple(jax.devices()[:4]))
  plan = cp.run_planner(g, cluster, 16, dataclasses.replace(opts, planner=with_host), h)
  assert seen == [h] and plan.predicted["host_aware"]
  plan = cp.run_planner(g, cluster, 16, dataclasses.replace(opts, planner=without), h)
  assert seen[-1] == "called" and "host_aware" not in plan.predicted


def test_min_stages_keeps_a_pipeline(dag, monkeypatch):
  """With instructions of 5 ms to issue, the one-stage candidates would win; min_stages=2
  leaves them out and keeps the planner's pipeline (the balanced planner's: one whose stage
  count does not hang on the layer times measured on a busy machine)."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: host(5e-3, 1.0))
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner="balanced",
    calibrate=True,
    min_stages=2,
  )
  out = pp(params, opt_state, batch)
  # The planner's pipeline, or its pipeline on fewer devices: never a one-stage candidate.
  assert pp.plan.num_stages >= 2
  assert not {"plain jit", "jit data parallel"} & set(pp.compiled.planned.alternatives)
  np.testing.assert_allclose(
    np.asarray(out[-1]["loss"]),
    np.asarray(jax.jit(step)(params, opt_state, batch)[-1]["loss"]),
    rtol=1e-5,
  )


def test_without_calibration_the_planner_plan_is_kept(dag):
  """Devices-only estimates are not this machine's: a faster baseline is only noted."""
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner="graphpipe"
  )
  pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert planned.host is None and pp.plan.planner == "graphpipe"
  assert {"pipeline", "plain jit"} <= set(planned.alternatives)
  assert planned.predicted_s == planned.alternatives["pipeline"]


def test_a_baseline_plan_runs_the_whole_batch_at_once(dag):
  """Plain jit is the step a user had: the whole batch in one call (value for value), also
  when the pipeline was built for micro-batches; a one-stage plan of micro-batches given by
  the user keeps them. The simulator times the fused step's one instruction as the
  prediction does."""
  step, params, opt_state, batch = dag
  one = jax.devices()[:1]
  with pytest.warns(UserWarning, match="one device"):
    given = gpp_jax.graph_pipeline(
      step, num_microbatches=2, devices=one, planner=gpp_jax.manual_plan({"": 0})
    )
  given(params, opt_state, batch)
  assert given.plan.num_microbatches == 2
  layers = tuple(lg.topo_layers(given.layer_graph))
  plain = Plan((Stage(0, layers, (0,)),), (), 1, planner="plain jit", batch_size=16)
  with pytest.warns(UserWarning, match="one device"):
    pp = gpp_jax.graph_pipeline(step, num_microbatches=2, devices=one, planner=plain)
  out = pp(params, opt_state, batch)
  assert pp.plan == plain and pp.compiled.fused
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-6
  from gpp_jax.cli import reporting
  from gpp_jax.cost.simulator import predict_fused

  cluster = cp.planner_cluster(pp.compiled.opts)
  timed = reporting.predicted_timeline(pp, cluster).iteration_time
  graph = lg.scaled(pp.layer_graph, pp.batch_size)
  assert timed > 0 and timed == pytest.approx(predict_fused(pp.plan, graph, cluster))


def test_gpus_are_planned_with_the_cuda_preset():
  """The cluster a planner gets follows the devices: on GPUs the H100 preset (a CPU's memory
  bandwidth would price a GPU's optimizer update a hundred times too slow)."""
  from types import SimpleNamespace

  from gpp_jax.cost.cluster import devices_cluster

  gpus = [SimpleNamespace(platform="gpu", process_index=0, id=i) for i in range(2)]
  assert devices_cluster(gpus).name == "h100x2"
  cpus = jax.devices()[:2]
  assert devices_cluster(cpus) == cpu_cluster(2)
  gpu_bw = devices_cluster(gpus).device.memory_bandwidth
  assert gpu_bw > 50 * devices_cluster(cpus).device.memory_bandwidth


def spmd_host(factors, parallel: float | None = 1.0, calls=None) -> HostCosts:
  """No issue costs, nothing outside the step: only the compute and the update are left."""
  return HostCosts(
    per_op=dict.fromkeys(OPS, 0.0), parallel=parallel, cores=2, spmd=factors, spmd_call=calls
  )


def test_spmd_factor_scales_the_fused_step_over_several_devices():
  """Jit data parallel over k devices computes 1/k of the one-device time times the measured
  factor for k (the factor is measured against that 1/k, and includes the devices' sharing of
  the cores: k over the compute servers is not applied as well); plain jit on one device is
  not scaled; without a measured factor, the devices' share times k over the servers."""
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.cost.simulator import predict_fused

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  plans = candidates(g)
  dp, plain = plans["jit data parallel"], plans["plain jit"]
  update = plan_costs(dp, g, cluster).update[0]
  one_device = predict_fused(plain, g, cluster, None) - plan_costs(plain, g, cluster).update[0]
  for f in (1.0, 3.0, 7.5):
    seconds = predict_fused(dp, g, cluster, spmd_host({2: f, 4: 2 * f}))
    assert seconds - update == pytest.approx(f * one_device / 2)
  # Not measured: the cost model's time of each device's share, times 2 devices / 1 server.
  share = predict_fused(dp, g, cluster, None) - update
  assert predict_fused(dp, g, cluster, spmd_host(None)) - update == pytest.approx(2 * share)
  assert predict_fused(plain, g, cluster, spmd_host({2: 5.0})) == pytest.approx(
    predict_fused(plain, g, cluster, spmd_host(None))
  )
  # Widths between the measured ones are interpolated, wider ones take the widest's.
  h = spmd_host({2: 2.0, 8: 14.0})
  assert [h.spmd_factor(k) for k in (1, 2, 4, 8, 16)] == pytest.approx([1, 2, 6, 14, 14])
  assert spmd_host(None).spmd_factor(2) is None and spmd_host(None).spmd_factor(1) == 1.0


def test_a_fused_step_over_fewer_devices_takes_the_model_own_factor_scaled():
  """The trial timed jit data parallel over 4 devices at 3x the probe's factor there: a whole
  step over 2 devices (a planner's one stage on fewer devices) is priced at 3x the probe's
  factor for 2, not the probe's alone; a pipeline stage over 2 devices keeps the probe's."""
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.cost.simulator import predict_fused, spmd_factor

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  h = spmd_host({2: 1.5, 4: 2.0})
  timed = cp.MachineCalibration(h, model_spmd={4: 6.0})
  assert spmd_factor(timed, 2, like_model=True) == pytest.approx(4.5)
  assert spmd_factor(timed, 2) == pytest.approx(1.5)
  assert spmd_factor(timed, 4, like_model=True) == 6.0
  assert spmd_factor(h, 2, like_model=True) == pytest.approx(1.5)  # nothing timed
  layers = candidates(g)["plain jit"].stages[0].layers
  two = Plan((Stage(0, layers, (0, 1)),), (), 4, planner="graphpipe", batch_size=8)
  plain = candidates(g)["plain jit"]
  one_device = predict_fused(plain, g, cluster, None) - plan_costs(plain, g, cluster).update[0]
  update = plan_costs(two, g, cluster).update[0]
  assert predict_fused(two, g, cluster, timed) - update == pytest.approx(4.5 * one_device / 2)


def test_spmd_factor_prices_a_stage_over_several_devices():
  """Under the host-aware model a pipeline stage over 2 devices computes 1/2 of its
  one-device forward and backward times the factor for 2 devices; a stage on one device is
  unchanged, and so is the devices-only model (no host: what planners search with)."""
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  stage_b = Stage(1, ("b",), (2,))
  plan = Plan((Stage(0, ("a",), (0, 1)), stage_b), ((0, 1),), 4, planner="x", batch_size=8)
  narrow = plan.replace(stages=(Stage(0, ("a",), (0,)), stage_b))

  def durations(res):  # every F (B) of a stage lasts as long
    return {(a.kind, a.stage): a.end - a.start for a in res.actions if a.kind in ("F", "B")}

  devices_only = simulate(plan, g, cluster)
  unmeasured = simulate(plan, g, cluster, host=spmd_host(None))
  slow = simulate(plan, g, cluster, host=spmd_host({2: 3.0}))
  one = durations(simulate(narrow, g, cluster, host=spmd_host({2: 3.0})))
  base, scaled = durations(unmeasured), durations(slow)
  assert durations(devices_only) == pytest.approx(base)
  for kind in ("F", "B"):
    assert scaled[(kind, 0)] == pytest.approx(3.0 * one[(kind, 0)] / 2)
    assert scaled[(kind, 0)] > base[(kind, 0)]
    assert scaled[(kind, 1)] == pytest.approx(base[(kind, 1)])
  assert slow.iteration_time > unmeasured.iteration_time
  # The devices-only model does not look at a host, measured factors or not.
  assert simulate(plan, g, cluster, host=None).iteration_time == devices_only.iteration_time


def test_spmd_call_seconds_are_paid_per_action_of_a_stage_and_per_microbatch_of_a_fused_step():
  """A computation over k devices costs fixed seconds per call beside its share of the work:
  a pipeline stage over 2 devices pays them in every forward and every backward, a fused step
  over k devices once per micro-batch of its loop (jit data parallel, one micro-batch: once);
  one device, or a host without them, pays nothing."""
  from gpp_jax.cost.simulator import predict_fused
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  call = 2e-3
  stage_b = Stage(1, ("b",), (2,))
  plan = Plan((Stage(0, ("a",), (0, 1)), stage_b), ((0, 1),), 4, planner="x", batch_size=8)

  def durations(res):
    return {(a.kind, a.stage): a.end - a.start for a in res.actions if a.kind in ("F", "B")}

  without = durations(simulate(plan, g, cluster, host=spmd_host({2: 3.0})))
  with_calls = durations(simulate(plan, g, cluster, host=spmd_host({2: 3.0}, calls={2: call})))
  for kind in ("F", "B"):
    assert with_calls[(kind, 0)] == pytest.approx(without[(kind, 0)] + call)
    assert with_calls[(kind, 1)] == pytest.approx(without[(kind, 1)])  # one device
  for M in (1, 4):
    plans = candidates(g, M)
    dp, plain = plans["jit data parallel"], plans["plain jit"]
    assert predict_fused(dp, g, cluster, spmd_host({2: 5.0}, calls={2: call})) == pytest.approx(
      predict_fused(dp, g, cluster, spmd_host({2: 5.0})) + M * call
    )
  assert predict_fused(plain, g, cluster, spmd_host({2: 5.0}, calls={2: call})) == pytest.approx(
    predict_fused(plain, g, cluster, spmd_host({2: 5.0}))
  )
  # Interpolated like the factor: 0 at one device, the widest one's beyond the measured.
  h = spmd_host({2: 2.0, 8: 14.0}, calls={2: 1e-3, 8: 4e-3})
  assert [h.spmd_call_seconds(k) for k in (1, 2, 4, 8, 16)] == pytest.approx(
    [0, 1e-3, 2e-3, 4e-3, 4e-3]
  )
  assert spmd_host({2: 2.0}).spmd_call_seconds(2) == 0.0


def test_a_stage_over_several_devices_all_reduces_its_gradients_in_every_backward():
  """With the all-reduce's cost measured (``HostCosts.allreduce``, seconds per byte), a stage
  over 2 devices pays it for its parameter bytes in every backward (in its W where the
  schedule splits the backward), its UPDATE no longer pays the cost model's all-reduce once
  per step, and a fused step over k devices pays it once per micro-batch; one device, and a
  host that did not measure it, price as before."""
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.cost.simulator import predict_fused
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  per_byte = 1e-9
  stage_b = Stage(1, ("b",), (2,))
  plan = Plan((Stage(0, ("a",), (0, 1)), stage_b), ((0, 1),), 4, planner="x", batch_size=8)
  pc = plan_costs(plan, g, cluster)
  assert pc.param_bytes[0] > 0
  reduce = per_byte * pc.param_bytes[0]
  optimizer = plan_costs(plan.replace(stages=(Stage(0, ("a",), (0,)), stage_b)), g, cluster)

  def durations(res, kinds=("F", "B", "W", "UPDATE")):
    return {(a.kind, a.stage): a.end - a.start for a in res.actions if a.kind in kinds}

  base = durations(simulate(plan, g, cluster, host=spmd_host({2: 3.0})))
  host = dataclasses.replace(spmd_host({2: 3.0}), allreduce={2: per_byte})
  paid = durations(simulate(plan, g, cluster, host=host))
  assert paid[("B", 0)] == pytest.approx(base[("B", 0)] + reduce)
  assert paid[("F", 0)] == pytest.approx(base[("F", 0)])
  assert paid[("B", 1)] == pytest.approx(base[("B", 1)])  # one device
  assert pc.update[0] > optimizer.update[0]  # the cost model's all-reduce, once per step
  assert paid[("UPDATE", 0)] == pytest.approx(optimizer.update[0])
  assert paid[("UPDATE", 1)] == pytest.approx(base[("UPDATE", 1)])
  # A zero-bubble schedule computes the parameter gradients, and reduces them, in W.
  zb = plan.replace(schedule="zero-bubble")
  base_zb = durations(simulate(zb, g, cluster, host=spmd_host({2: 3.0})))
  paid_zb = durations(simulate(zb, g, cluster, host=host))
  assert paid_zb[("W", 0)] == pytest.approx(base_zb[("W", 0)] + reduce)
  assert paid_zb[("B", 0)] == pytest.approx(base_zb[("B", 0)])
  # Jit data parallel: every micro-batch of its loop reduces the whole model's gradients.
  for M in (1, 4):
    dp, plain = candidates(g, M)["jit data parallel"], candidates(g, M)["plain jit"]
    dpc, one_step = plan_costs(dp, g, cluster), plan_costs(plain, g, cluster)
    assert predict_fused(dp, g, cluster, host) == pytest.approx(
      predict_fused(dp, g, cluster, spmd_host({2: 3.0}))
      + M * per_byte * dpc.param_bytes[0]
      - (dpc.update[0] - one_step.update[0])
    )
  # Widths between the measured ones are interpolated; one device and no bytes pay nothing.
  h = dataclasses.replace(host, allreduce={2: 1e-9, 8: 4e-9})
  assert [h.allreduce_seconds(k, 1e6) for k in (1, 2, 4, 8, 16)] == pytest.approx(
    [0, 1e-3, 2e-3, 4e-3, 4e-3]
  )
  assert h.allreduce_seconds(2, 0) == 0.0 and spmd_host({2: 3.0}).allreduce_seconds(2, 1e6) is None


def test_layers_timed_over_a_stage_devices_price_that_stage():
  """Where every layer of a stage over k devices was timed as such a stage runs it
  (``time_f_at`` / ``time_b_at``), the host-aware simulator gives the stage those times,
  scaled to its micro-batch as one-device times are, in place of the SPMD factor and its
  fixed seconds per call; the measured backward holds the gradients' all-reduce, so nothing
  is added to it and its UPDATE has no all-reduce either. Other stages, other widths and the
  devices-only model price as before."""
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.cost.simulator import measured_width_times
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  stage_b = Stage(1, ("b",), (2,))
  plan = Plan((Stage(0, ("a",), (0, 1)), stage_b), ((0, 1),), 4, planner="x", batch_size=8)
  h = dataclasses.replace(spmd_host({2: 3.0}, calls={2: 1e-3}), allreduce={2: 1e-9})

  def durations(graph, host=h):
    res = simulate(plan, graph, cluster, host=host)
    return {(a.kind, a.stage): a.end - a.start for a in res.actions}

  before = durations(g)
  assert measured_width_times(plan, g, cluster) == {}
  timed = g.copy()
  timed.nodes["a"].update(time_f_at={"2": 30e-3}, time_b_at={"2": 70e-3})
  timed.nodes["b"].update(time_f_at={"4": 1.0}, time_b_at={"4": 1.0})  # not b's width
  # Scaled to the micro-batch as the one-device time (10 ms, 20 ms backward) is.
  one_device = plan.replace(stages=(Stage(0, ("a",), (0,)), stage_b))
  one = plan_costs(one_device, g, cluster)
  f, b = 3.0 * one.forward[0], 3.5 * one.backward[0]
  assert measured_width_times(plan, timed, cluster) == {0: pytest.approx((f, b))}
  after = durations(timed)
  assert after[("F", 0)] == pytest.approx(f) and after[("B", 0)] == pytest.approx(b)
  for key in ("F", 1), ("B", 1), ("UPDATE", 1):
    assert after[key] == pytest.approx(before[key])
  assert after[("UPDATE", 0)] == pytest.approx(one.update[0])
  # Without the all-reduce measured, the stage's UPDATE still leaves it out (it is measured).
  assert durations(timed, dataclasses.replace(h, allreduce=None))[("UPDATE", 0)] == (
    pytest.approx(after[("UPDATE", 0)])
  )
  # The devices-only model does not read them.
  assert simulate(plan, timed, cluster).iteration_time == pytest.approx(
    simulate(plan, g, cluster).iteration_time
  )
  assert lg.widths_measured(timed, ["a"]) == {2} and lg.widths_measured(timed, ["b"]) == {4}
  assert lg.widths_measured(timed, ["a", "b"]) == set() == lg.widths_measured(g, ["a"])
  # Rescaled with the graph, as the one-device times are.
  big = lg.scaled(timed, 16)
  assert big.nodes["a"]["time_b_at"] == {"2": pytest.approx(140e-3)}
  assert timed.nodes["a"]["time_b_at"] == {"2": 70e-3}
  assert lg.at_width(big, 2).nodes["a"]["time_b"] == pytest.approx(140e-3)
  # A stage with one layer not timed at its width keeps the factor.
  timed.nodes["a"].update(time_f_at={"4": 1.0}, time_b_at={"2": 70e-3})
  assert durations(timed)[("F", 0)] == pytest.approx(before[("F", 0)])


def test_layers_are_timed_over_the_widths_of_the_candidates_stages(dag, monkeypatch):
  """With calibrate=True on CPU devices, a candidate pipeline with a stage over 2 devices has
  every layer timed the way such a stage runs it, beside its one-device time (the
  calibration's graph untouched), its prediction takes those times, and the step's values
  are the plain step's."""
  from gpp_jax.cost.simulator import measured_width_times
  from gpp_jax.passes.calibrate import LayerTiming, measure_layers
  from gpp_jax.runtime import host as host_mod
  from gpp_jax.runtime.placement import StagePlacement

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: spmd_host({2: 3.0, 4: 6.0}))
  timed_by_width(monkeypatch, lambda k: 0.01 if k == 1 else 0.03)

  def halves(layer_graph, cluster, batch_size, *, num_microbatches=None):
    layers = list(lg.topo_layers(layer_graph))
    cut = len(layers) // 2
    stages = [(layers[:cut], 2), (layers[cut:], 1)]
    return sequential_plan(layer_graph, cluster, batch_size, num_microbatches, stages, "halves")

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner=halves,
    calibrate=True,
    min_stages=2,
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert [len(s.devices) for s in pp.plan.stages] == [2, 1]
  graph = planned.layer_graph
  assert lg.widths_measured(graph, graph.nodes) == {2}
  for n in graph:
    assert graph.nodes[n]["time_f_at"]["2"] > 0 and graph.nodes[n]["time_b_at"]["2"] > 0
    assert "time_f_at" not in pp.compiled.captured.layering.graph.nodes[n]
  cluster = cp.planner_cluster(pp.compiled.opts)
  scaled = lg.scaled(graph, pp.batch_size)
  assert set(measured_width_times(pp.plan, scaled, cluster)) == {0}
  assert planned.alternatives["pipeline"] == pytest.approx(
    cp.predict_seconds(pp.plan, scaled, cluster, planned.host)[0]
  )
  assert "layers also timed as a stage over 2 devices runs them" in pp.explain()
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5
  # Timing layers over 2 devices puts the batch-sized arrays split over them.
  lay = pp.compiled.captured.layering
  seen = []
  measure_layers(
    pp.compiled.captured.loss,
    lay,
    jax.devices()[0],
    LayerTiming(
      max_rounds=1,
      repeats=1,
      timer=lambda layer, role, fn: seen.append(jax.block_until_ready(fn())) or 1e-3,
    ),
    placement=StagePlacement(tuple(jax.devices()[:2]), pp.compiled.captured.microbatch_size),
  )
  assert seen and all(len(x.sharding.device_set) == 2 for out in seen for x in jax.tree.leaves(out))
  # Layers timed at another micro-batch than the graph's would be kept as if at the graph's.
  captured = pp.compiled.captured
  other = lg.scaled(captured.layering.graph, 2 * captured.microbatch_size)
  with pytest.raises(ValueError, match="captured at micro-batch"):
    cp.calibrate_widths(
      captured, other, planned.host, cp.width_groups(jax.devices()[:4], [pp.plan])
    )


def test_the_planner_searches_with_every_stage_width_timed(dag, monkeypatch):
  """With calibrate=True on CPU devices, the planner is given the measured host and a layer
  graph whose layers are already timed at every width a pipeline's stage may take (2 of 4
  devices at micro-batch 8; 3 does not split it), before it searches."""
  from gpp_jax.passes.partition import get_planner
  from gpp_jax.runtime import host as host_mod

  h = spmd_host({2: 3.0, 4: 6.0})
  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: h)
  timed_by_width(monkeypatch, lambda k: 0.01 if k == 1 else 0.03)
  seen = []

  def planner(layer_graph, cluster, batch_size, *, num_microbatches=None, host=None):
    seen.append((host, lg.widths_measured(layer_graph, layer_graph.nodes)))
    return get_planner("graphpipe")(
      lg.scaled(layer_graph, batch_size), cluster, batch_size, num_microbatches=num_microbatches
    )

  assert cp.stage_widths(4, 8) == [2] and cp.stage_widths(8, 16) == [2, 4]
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner=planner, calibrate=True
  )
  pp(params, opt_state, batch)
  assert seen and all(host.host is h and widths == {2} for host, widths in seen)


def test_the_planner_searches_again_with_what_the_trials_measured(dag, monkeypatch):
  """The search runs before the trials fit the fusion and the model's own SPMD factor; with
  them, the planner searches once more and its new plan (here: a 2-stage pipeline where
  the first search found one stage over the devices) replaces the first as its candidate,
  the first one's timing dropped."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: spmd_host({2: 3.0, 4: 6.0}))
  timed_by_width(monkeypatch, lambda k: 0.01 if k == 1 else 0.03)
  seen = []

  def planner(layer_graph, cluster, batch_size, *, num_microbatches=None, host=None):
    calibrated = host.fusion is not None
    seen.append(calibrated)
    layers = list(lg.topo_layers(layer_graph))
    n = cluster.num_devices
    stages = [(layers[:2], 1), (layers[2:], 1)] if calibrated else [(layers, n)]
    return sequential_plan(layer_graph, cluster, batch_size, num_microbatches, stages, "mine")

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner=planner, calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert seen[0] is False and seen[-1] is True
  assert planned.plans["pipeline"].num_stages == 2
  # The first plan's trial (one stage over 4 devices: 0.03 s) is not the new plan's timing.
  assert planned.measured.get("pipeline", 0.01) == 0.01
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


@pytest.mark.parametrize("acc_seconds", [0.013, 0.008])
def test_the_planner_one_device_step_in_micro_batches_is_timed_and_searched_with(
  dag, monkeypatch, acc_seconds
):
  """The planner's first plan is plain jit's step in micro-batches on its one device
  (gradient accumulation), which the fusion alone prices near plain jit's time: timed beside
  plain jit (0.01 s). At 1.3x its time, the two fit the fixed seconds each micro-batch pays,
  the planner's second search, which sees them, returns its pipeline instead, and plain jit
  runs. At 0.8x, no fixed seconds are fitted, the step in micro-batches stays the planner's
  plan and runs, measured faster, and the note says so."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: spmd_host({2: 3.0, 4: 6.0}))
  asked = []

  def fake(c, leaves, repeats=5, outside=0.0):
    plan = c.planned.plan
    asked.append((len(plan.stages[0].devices), plan.num_microbatches))
    if plan.num_stages == 1 and len(plan.stages[0].devices) == 1:
      return acc_seconds if plan.num_microbatches > 1 else 0.01
    return 0.05

  monkeypatch.setattr(cp, "time_step", fake)
  seen = []

  def planner(layer_graph, cluster, batch_size, *, num_microbatches=None, host=None):
    timed = 1 in host.model_call
    seen.append(timed)
    layers = list(lg.topo_layers(layer_graph))
    stages = [(layers[:2], 1), (layers[2:], 1)] if timed else [(layers, 1)]
    return sequential_plan(layer_graph, cluster, batch_size, num_microbatches, stages, "mine")

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner=planner, calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert (1, 2) in asked  # the step in micro-batches on one device, timed
  if acc_seconds > 0.01:
    assert seen[0] is False and seen[-1] is True
    assert planned.host.model_call[1] > 0
    assert planned.plans["pipeline"].num_stages == 2
    assert planned.measured.get("pipeline", 0.05) == 0.05  # not the first plan's timing
    assert planned.plan.planner == "plain jit"
  else:
    assert not any(seen) and 1 not in planned.host.model_call
    assert planned.plan.planner == "mine" and planned.plan.num_microbatches == 2
    assert planned.predicted_s == pytest.approx(0.8 * planned.alternatives["plain jit"])
    assert "micro-batches measured" in planned.note and "faster than plain jit" in planned.note
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


@pytest.mark.parametrize("acc_seconds, min_stages", [(0.008, 1), (0.013, 1), (0.008, 2)])
def test_plain_jit_in_micro_batches_measured_faster_is_chosen_over_another_planner_plan(
  dag, monkeypatch, acc_seconds, min_stages
):
  """The planner's plan is a pipeline, never plain jit's step in micro-batches on one device
  (gradient accumulation). That step, timed beside plain jit (0.01 s) to fit the fusion, is a
  candidate too: measured faster (0.8x), it runs, predicted at plain jit's prediction times the
  ratio of the two measurements, and the note says so; slower (1.3x), plain jit runs; with
  ``min_stages=2`` it is no candidate."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: spmd_host({2: 3.0, 4: 6.0}))

  def fake(c, leaves, repeats=5, outside=0.0):
    plan = c.planned.plan
    if plan.num_stages == 1 and len(plan.stages[0].devices) == 1:
      return acc_seconds if plan.num_microbatches > 1 else 0.01
    return 0.05

  monkeypatch.setattr(cp, "time_step", fake)

  def planner(layer_graph, cluster, batch_size, *, num_microbatches=None, host=None):
    layers = list(lg.topo_layers(layer_graph))
    return sequential_plan(
      layer_graph, cluster, batch_size, num_microbatches, [(layers[:2], 1), (layers[2:], 1)], "mine"
    )

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner=planner,
    calibrate=True,
    min_stages=min_stages,
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  name = cp.ACCUMULATED
  if min_stages > 1:
    assert name not in planned.plans and planned.plan.num_stages == 2
  elif acc_seconds < 0.01:
    assert planned.measured[name] == acc_seconds
    assert planned.plan.num_stages == 1 and planned.plan.num_microbatches == 2
    assert planned.plan.stages[0].devices == (0,)
    assert planned.predicted_s == pytest.approx(0.8 * planned.alternatives["plain jit"])
    assert name in planned.note  # predicted fastest, or measured faster than the pipeline
    assert pp.compiled.planned.trial is not None  # its timed step runs, not compiled again
  else:
    assert name in planned.plans and planned.plan.planner == "plain jit"
    assert planned.plan.num_microbatches == 1
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


def test_the_step_own_update_timed_prices_the_update():
  """Where the step's update was timed (``update_per_byte``, seconds per parameter byte), the
  host-aware model's UPDATE is that times the stage's parameter bytes, plus the all-reduce
  where it stays in the UPDATE (a stage over 2 devices, the all-reduce not measured), in the
  pipeline and in the fused step alike; the devices-only model keeps the cost model's."""
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.cost.simulator import predict_fused
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4 * MiB)
  cluster = cpu_cluster(4)
  plan = Plan(
    (Stage(0, ("a",), (0, 1)), Stage(1, ("b",), (2,))), ((0, 1),), 4, planner="x", batch_size=8
  )
  h = spmd_host({2: 3.0})
  timed = g.copy()
  timed.graph["update_per_byte"] = per_byte = 2e-11
  pc = plan_costs(plan, g, cluster)
  cm = plan_costs(plan.replace(stages=(Stage(0, ("a",), (0,)), plan.stages[1])), g, cluster)
  allreduce = pc.update[0] - cm.update[0]
  assert allreduce > 0

  def updates(graph, host=h):
    res = simulate(plan, graph, cluster, host=host)
    done = {a.stage: a.end - a.start for a in res.actions if a.kind == "UPDATE"}
    return [done[0], done[1]]

  assert updates(g) == pytest.approx(pc.update)
  assert updates(timed) == pytest.approx([per_byte * 4 * MiB + allreduce, per_byte * 4 * MiB])
  assert per_byte * 4 * MiB < pc.update[1] / 10  # far from the cost model's guess
  measured = dataclasses.replace(h, allreduce={2: 1e-9})  # all-reduced in the backward
  assert updates(timed, measured) == pytest.approx([per_byte * 4 * MiB] * 2)
  assert simulate(plan, timed, cluster).iteration_time == pytest.approx(
    simulate(plan, g, cluster).iteration_time
  )
  plain = candidates(g)["plain jit"]
  whole = plan_costs(plain, g, cluster).update[0]
  assert predict_fused(plain, timed, cluster, h) == pytest.approx(
    predict_fused(plain, g, cluster, h) - whole + per_byte * 8 * MiB
  )


def test_calibration_times_the_step_own_update(dag, monkeypatch):
  """calibrate=True times the step's work after its gradients (Adam's update here) on one
  device: the calibration records it per parameter byte and the planned graph carries it."""
  from gpp_jax.passes.calibrate import measure_update
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: host(0.0, 1.0))
  timed_by_width(monkeypatch, lambda k: 0.01 if k == 1 else 0.03)
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:2], planner="graphpipe", calibrate=True
  )
  pp(params, opt_state, batch)
  planned = pp.compiled.planned
  per_byte = planned.calibration.settings["update_per_byte"]
  assert planned.layer_graph.graph["update_per_byte"] == per_byte > 0
  captured = pp.compiled.captured
  seconds = measure_update(captured.step, captured.marker_index, jax.devices()[0])
  param_bytes = sum(d["param_bytes"] for _, d in captured.layering.graph.nodes(data=True))
  assert 0 < seconds < 1.0 and param_bytes > 0


def test_a_fractional_parallel_interpolates_between_its_whole_neighbours():
  """Devices that compute 1.25 at a time: the iteration time is a quarter of the way from
  one server's to two servers', continuous in the measured value (rounding it put a pipeline
  on one server or two as probes measured 1.47 or 1.52); whole values are simulated as they
  are."""
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(2)
  plan = candidates(g)["pipeline"]
  t = {p: simulate(plan, g, cluster, host=host(1e-4, p)).iteration_time for p in (1.0, 2.0)}
  assert t[1.0] > t[2.0]  # the two stages overlap on two servers
  for p in (1.25, 1.5, 1.75):
    got = simulate(plan, g, cluster, host=host(1e-4, p)).iteration_time
    assert got == pytest.approx(t[1.0] + (p - 1) * (t[2.0] - t[1.0]))


def test_a_stage_over_several_devices_holds_as_many_cores():
  """On 2 cores, a stage over 2 devices runs on both device threads: no other stage's action
  runs beside one of its actions. With the stage on one device, the two stages overlap."""
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  stage_b = Stage(1, ("b",), (2,))
  wide = Plan((Stage(0, ("a",), (0, 1)), stage_b), ((0, 1),), 4, planner="x", batch_size=8)
  narrow = wide.replace(stages=(Stage(0, ("a",), (0,)), stage_b))
  two_cores = spmd_host({2: 1.0}, parallel=2.0)

  def overlap(res) -> float:
    acts = [a for a in res.actions if a.kind in ("F", "B")]
    return sum(
      max(0.0, min(x.end, y.end) - max(x.start, y.start))
      for x in acts
      if x.stage == 0
      for y in acts
      if y.stage == 1
    )

  assert overlap(simulate(narrow, g, cluster, host=two_cores)) > 0
  assert overlap(simulate(wide, g, cluster, host=two_cores)) == 0


def test_a_stage_over_several_devices_pays_its_measured_issue_costs():
  """Issuing an instruction of a stage over 2 devices costs what the probe measured for that
  width (``wide_ops``, ``wide_per_stage``): on a host-bound program the step takes exactly the
  extra issue time of the wide stage's forwards, backwards, transfers (each SEND at the wider
  of its two stages) and per-stage work; the one-device stage pays what it paid."""
  from gpp_jax.passes.simulation import simulate

  g = chain(1e-9, 4096)  # no compute: the host's issuing is the step
  cluster = cpu_cluster(4)
  M = 4
  plan = Plan(
    (Stage(0, ("a",), (0, 1)), Stage(1, ("b",), (2,))), ((0, 1),), M, planner="x", batch_size=8
  )
  ops = {"F": 1e-3, "B": 2e-3, "W": 0.0, "UPDATE": 1e-4, "SEND": 5e-4, "RECV": 0.0}
  narrow = HostCosts(per_op=ops, per_stage=3e-4, parallel=None)
  wide_ops = {2: {"F": 3e-3, "B": 5e-3, "SEND": 8e-4}}
  wide = dataclasses.replace(narrow, wide_ops=wide_ops, wide_per_stage={2: 7e-4})
  extra = M * (2e-3 + 3e-3) + 2 * M * 3e-4 + (7e-4 - 3e-4)
  t_narrow = simulate(plan, g, cluster, host=narrow).iteration_time
  t_wide = simulate(plan, g, cluster, host=wide).iteration_time
  assert t_wide - t_narrow == pytest.approx(extra, rel=1e-3)
  # The same costs on one-device stages: nothing changes.
  flat = plan.replace(stages=(Stage(0, ("a",), (0,)), Stage(1, ("b",), (2,))))
  assert simulate(flat, g, cluster, host=wide).iteration_time == pytest.approx(
    simulate(flat, g, cluster, host=narrow).iteration_time
  )
  # Interpolated between measured widths, the widest one's beyond; unmeasured ops as one
  # device.
  h = dataclasses.replace(narrow, wide_ops={2: {"F": 3e-3}, 4: {"F": 7e-3}})
  assert [h.issue_seconds("F", k) for k in (1, 2, 3, 4, 8)] == pytest.approx(
    [1e-3, 3e-3, 5e-3, 7e-3, 7e-3]
  )
  assert h.issue_seconds("B", 4) == 2e-3 and h.stage_seconds(4) == 3e-4


def test_a_stage_edge_of_several_arrays_costs_a_transfer_per_array():
  """The host issues a transfer per array: an edge carrying 3 arrays costs 3 SENDs each way
  per micro-batch on a host-bound step (2 more arrays' share of a lone put where measured,
  ``send_extra``); the devices-only model does not change."""
  from gpp_jax.passes.simulation import simulate

  def graph(arrays):
    g = lg.new_layer_graph("chain", 8)
    for name in ("a", "b"):
      lg.add_layer(
        g, name, lg.LayerCost(flops=1e3, param_bytes=64, act_bytes=64), time_f=1e-9, time_b=2e-9
      )
    lg.add_edge(g, "a", "b", 1024, arrays=arrays)
    return g

  M, send = 4, 5e-4
  plan = Plan(
    (Stage(0, ("a",), (0,)), Stage(1, ("b",), (1,))), ((0, 1),), M, planner="x", batch_size=8
  )
  h = HostCosts(per_op={"F": 1e-4, "B": 1e-4, "SEND": send}, parallel=None)
  cluster = cpu_cluster(2)
  one, three = (simulate(plan, graph(a), cluster, host=h).iteration_time for a in (1, 3))
  assert three - one == pytest.approx(2 * M * 2 * send, rel=1e-3)
  # Put together, each array beyond the first adds its measured share of a lone put.
  h = dataclasses.replace(h, send_extra=0.25)
  one, three = (simulate(plan, graph(a), cluster, host=h).iteration_time for a in (1, 3))
  assert three - one == pytest.approx(2 * M * 2 * send * 0.25, rel=1e-3)
  assert simulate(plan, graph(3), cluster).iteration_time == pytest.approx(
    simulate(plan, graph(1), cluster).iteration_time
  )


def test_measure_host_measures_wider_stages():
  """The probe's pipeline, run again with stages over 2 and 4 devices, gives per-op issue
  costs for those widths, the stages' own: positive, and a forward over 4 devices dearer
  than over one."""
  from gpp_jax.runtime import pipeline
  from gpp_jax.runtime.host import measure_host

  h = measure_host(jax.devices()[:4], pipeline.graph_pipeline, repeats=3)
  assert set(h.wide_ops) == set(h.wide_per_stage) == {2, 4}
  for w, ops in h.wide_ops.items():
    assert {"F", "B", "SEND"} <= set(ops), w
    assert all(v > 0 for v in ops.values()) and h.wide_per_stage[w] > 0
  assert h.issue_seconds("F", 4) > h.issue_seconds("F", 1)
  assert h.send_extra is not None and 0.0 <= h.send_extra <= 1.0


def test_host_costs_json_round_trips_with_and_without_spmd():
  import json

  with_spmd = HostCosts(
    per_op={"F": 1e-4},
    parallel=1.5,
    cores=2,
    spmd={2: 2.5, 4: 6.0},
    spmd_call={2: 1e-3},
    allreduce={2: 1e-9, 4: 3e-9},
  )
  back = HostCosts.from_json(with_spmd.to_json())
  assert back == with_spmd and back.spmd_factor(4) == 6.0 and back.spmd_call_seconds(2) == 1e-3
  assert back.allreduce_seconds(4, 1e6) == pytest.approx(3e-3)
  without = HostCosts(per_op={"F": 1e-4}, parallel=None)
  assert HostCosts.from_json(without.to_json()) == without
  wide = dataclasses.replace(
    with_spmd,
    wide_ops={2: {"F": 3e-4, "SEND": 2e-4}, 4: {"F": 6e-4}},
    wide_per_stage={2: 1e-3},
    send_extra=0.3,
    input_send=2e-5,
  )
  back = HostCosts.from_json(wide.to_json())
  assert back == wide and back.issue_seconds("F", 4) == 6e-4 and back.stage_seconds(2) == 1e-3
  # HostCosts saved before the fields existed still load.
  old = json.loads(wide.to_json())
  for k in (
    "spmd",
    "spmd_call",
    "allreduce",
    "wide_ops",
    "wide_per_stage",
    "send_extra",
    "input_send",
  ):
    del old[k]
  back = HostCosts.from_json(json.dumps(old))
  assert back.spmd is None and back.spmd_call is None and back.spmd_call_seconds(2) == 0.0
  assert back.allreduce is None and back.allreduce_seconds(2, 1e6) is None
  assert back.wide_ops is None and back.issue_seconds("F", 4) == 1e-4 and back.send_extra is None
  assert back.input_send is None


def test_the_host_lane_puts_cost_their_own_measured_seconds():
  """A SEND from the host lane (an argument put where it goes, mostly already there) costs
  ``input_send``, not a put between stages: the probe's timeline gives both medians apart,
  and a simulated program charges each its own."""
  from gpp_jax.cost.host import host_costs_from_timeline
  from gpp_jax.ir.program import Op
  from gpp_jax.runtime.executor import Timeline, TimelineEvent

  S = 2
  events = [TimelineEvent("SEND", S, -1, 0.0, 1e-5), TimelineEvent("SEND", S, -1, 0.0, 3e-5)]
  events += [TimelineEvent("SEND", 0, 0, 0.0, 4e-4), TimelineEvent("F", 1, 0, 0.0, 1e-4)]
  h = host_costs_from_timeline(Timeline(events, 5e-4, False), S, 1e-3)
  assert h.per_op["SEND"] == 4e-4 and h.input_send == pytest.approx(2e-5)
  lanes = h.lane_costs([1, 2], schedule=False)
  assert lanes[0][Op.SEND] == 4e-4 and lanes[-1][Op.SEND] == pytest.approx(2e-5)


def test_measure_spmd_on_forced_cpu_devices():
  """A factor and seconds per call per width: no better than perfect division, no negative
  time; none for one device."""
  import math

  from gpp_jax.runtime.host import measure_spmd

  factors, seconds = measure_spmd(jax.devices()[:2], reps=2)
  assert set(factors) == set(seconds) == {2}
  assert math.isfinite(factors[2]) and 1.0 <= factors[2] < 1e3
  assert 0.0 <= seconds[2] < 1.0
  assert measure_spmd(jax.devices()[:1]) == ({}, {})


def test_measure_allreduce_on_forced_cpu_devices():
  """Seconds per byte of gradients a backward over 2 devices pays beyond one device's: finite,
  never negative, under a second per MiB; none for one device."""
  import math

  from gpp_jax.runtime.host import measure_allreduce

  per_byte = measure_allreduce(jax.devices()[:2], sizes=(1 << 20, 2 << 20), reps=2)
  assert set(per_byte) == {2}
  assert math.isfinite(per_byte[2]) and 0.0 <= per_byte[2] * 2**20 < 1.0
  assert measure_allreduce(jax.devices()[:1]) == {}


@pytest.mark.parametrize("calls", [None, {2: 1e-3, 4: 3e-3}])
def test_the_model_own_spmd_factor_makes_the_prediction_its_measurement(calls):
  """``calibrate_spmd``: jit data parallel over k devices, timed, sets the model's factor and
  fixed seconds for k, the probe's times one ratio, so that its prediction is the measured
  time; plain jit keeps its prediction, a whole step over another width takes the probe's
  scaled as the model's over the probe's at k, and a step of more micro-batches pays the
  model's fixed seconds for each."""
  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  h = spmd_host({2: 3.0, 4: 6.0}, calls=calls)
  at, m = cp.Predictor(g, cluster), cp.MachineCalibration(h)
  for M in (1, 4):
    plans = candidates(g, M)
    dp, plain = plans["jit data parallel"], plans["plain jit"]
    before = cp.predict_seconds(dp, g, cluster, h)[0]
    for seconds in (0.5 * before, 2.0 * before):
      tuned = cp.calibrate_spmd(at, m, cp.Timed(dp, seconds))
      assert cp.predict_seconds(dp, g, cluster, tuned)[0] == pytest.approx(seconds)
      r = tuned.model_spmd[2] / 3.0
      assert r != pytest.approx(1.0)
      if calls:
        assert tuned.model_call[2] == pytest.approx(r * 1e-3)
      assert cp.predict_seconds(plain, g, cluster, tuned)[0] == pytest.approx(
        cp.predict_seconds(plain, g, cluster, h)[0]
      )
      wide = dp.replace(stages=(Stage(0, dp.stages[0].layers, (0, 1, 2, 3)),))
      scaled = m.with_width(4, max(1.0, 6.0 * r), 3e-3 * r if calls else None)
      assert cp.predict_seconds(wide, g, cluster, tuned)[0] == pytest.approx(
        cp.predict_seconds(wide, g, cluster, scaled)[0]
      )
      if calls:  # the step in 4 micro-batches: the model's fixed seconds for each
        more = candidates(g, 4)["jit data parallel"]
        free = dataclasses.replace(tuned, model_call={2: 0.0})
        extra = cp.predict_seconds(more, g, cluster, tuned)[0]
        assert extra - cp.predict_seconds(more, g, cluster, free)[0] == pytest.approx(4 * r * 1e-3)


def test_two_timings_of_one_width_fit_its_factor_and_fixed_seconds_apart():
  """``calibrate_spmd(pieces=)``: jit data parallel and the same step in 4 micro-batches over
  the same devices, both timed, fit the SPMD factor and the fixed seconds per sharded call
  each on its own: both predictions are their measurements, where one ratio on the probe's
  pair misses the one in micro-batches. Times that would take negative fixed seconds keep
  the ratio's fit; times that would take a factor under its floor take the floor, with jit
  data parallel's prediction still its measurement."""
  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  h = spmd_host({2: 3.0, 4: 6.0}, calls={2: 1e-3, 4: 3e-3})
  at, m = cp.Predictor(g, cluster), cp.MachineCalibration(h)
  dp, acc = candidates(g, 1)["jit data parallel"], candidates(g, 4)["jit data parallel"]
  truth = m.with_width(2, 3.5, 15e-3)
  t1, t4 = (cp.predict_seconds(p, g, cluster, truth)[0] for p in (dp, acc))
  tuned = cp.calibrate_spmd(at, m, cp.Timed(dp, t1), cp.Timed(acc, t4))
  assert tuned.model_spmd[2] == pytest.approx(3.5)
  assert tuned.model_call[2] == pytest.approx(15e-3)
  for p, t in ((dp, t1), (acc, t4)):
    assert cp.predict_seconds(p, g, cluster, tuned)[0] == pytest.approx(t)
  ratio = cp.calibrate_spmd(at, m, cp.Timed(dp, t1))
  assert cp.predict_seconds(dp, g, cluster, ratio)[0] == pytest.approx(t1)
  assert abs(cp.predict_seconds(acc, g, cluster, ratio)[0] / t4 - 1) > 0.15
  # Four micro-batches no slower than one: no fixed seconds per call can say that.
  kept = cp.calibrate_spmd(at, m, cp.Timed(dp, t1), cp.Timed(acc, 0.9 * t1))
  assert kept == ratio
  # So slow in micro-batches that the fit's factor falls under the floor: the floor, and the
  # fixed seconds at which jit data parallel is still its measurement.
  slow = t4 + 3 * t1
  floored = cp.calibrate_spmd(at, m, cp.Timed(dp, t1), cp.Timed(acc, slow))
  assert floored.model_spmd[2] == pytest.approx(cp.SPMD_FLOOR)
  assert cp.predict_seconds(dp, g, cluster, floored)[0] == pytest.approx(t1)
  near = cp.predict_seconds(acc, g, cluster, floored)[0]
  assert cp.predict_seconds(acc, g, cluster, ratio)[0] < near < slow


def test_plain_jit_and_its_step_in_micro_batches_fit_the_fusion_and_fixed_seconds_apart():
  """``calibrate_fusion(pieces=)``: plain jit and the same step in 4 micro-batches on its one
  device (gradient accumulation), both timed, fit the fusion and the fixed seconds each
  micro-batch pays (``model_call[1]``) each on its own: both predictions are their
  measurements, where the fusion alone misses the step in micro-batches.
  A pipeline's stages and jit data parallel are priced as before; times that would take
  negative fixed seconds keep the fusion alone, and times that would take a fusion under its
  floor take the floor, with plain jit's prediction still its measurement."""
  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  h = spmd_host({2: 3.0}, calls={2: 1e-3})
  at, m = cp.Predictor(g, cluster), cp.MachineCalibration(h)
  one, four = candidates(g, 1), candidates(g, 4)
  plain, acc = one["plain jit"], four["plain jit"]
  truth = m.with_fusion(0.6, 5e-3)
  t1, t4 = (cp.predict_seconds(p, g, cluster, truth)[0] for p in (plain, acc))
  bare = dataclasses.replace(truth, model_call={})
  for p, M in ((plain, 1), (acc, 4)):  # each micro-batch pays it
    extra = cp.predict_seconds(p, g, cluster, truth)[0] - cp.predict_seconds(p, g, cluster, bare)[0]
    assert extra == pytest.approx(M * 5e-3)
  tuned = cp.calibrate_fusion(at, m, cp.Timed(plain, t1), cp.Timed(acc, t4))
  assert tuned.fusion == pytest.approx(0.6)
  assert tuned.model_call[1] == pytest.approx(5e-3)
  for p, t in ((plain, t1), (acc, t4)):
    assert cp.predict_seconds(p, g, cluster, tuned)[0] == pytest.approx(t)
  alone = cp.calibrate_fusion(at, m, cp.Timed(plain, t1))
  assert alone.model_call == {}
  assert abs(cp.predict_seconds(acc, g, cluster, alone)[0] / t4 - 1) > 0.15
  # One device's fixed seconds are the fused step's only: not a pipeline's one-device stages,
  # not a step over several devices.
  free = dataclasses.replace(tuned, model_call={})
  for p in (four["pipeline"], one["jit data parallel"], four["jit data parallel"]):
    assert cp.predict_seconds(p, g, cluster, tuned)[0] == cp.predict_seconds(p, g, cluster, free)[0]
  assert cp.predict_seconds(acc, g, cluster, free)[0] < t4
  # Four micro-batches faster than one: no fixed seconds per micro-batch can say that.
  kept = cp.calibrate_fusion(at, m, cp.Timed(plain, t1), cp.Timed(acc, 0.9 * t1))
  assert kept == alone
  # Four micro-batches so slow that the fit's fusion falls under the floor (a noisy machine):
  # the floor, and the fixed seconds at which plain jit is still its measurement; the step
  # in micro-batches is then priced short of its time by the least that allows, where the
  # fusion alone priced it at about plain jit's.
  slow = t4 + 3 * t1
  floored = cp.calibrate_fusion(at, m, cp.Timed(plain, t1), cp.Timed(acc, slow))
  assert floored.fusion == pytest.approx(cp.FUSION_FLOOR)
  assert cp.predict_seconds(plain, g, cluster, floored)[0] == pytest.approx(t1)
  near = cp.predict_seconds(acc, g, cluster, floored)[0]
  assert cp.predict_seconds(acc, g, cluster, alone)[0] < near < slow
  for f in (1.2 * cp.FUSION_FLOOR, 2 * cp.FUSION_FLOOR):  # on plain jit's line, farther off
    other = floored.with_fusion(f, 0.0)
    c = t1 - cp.predict_seconds(plain, g, cluster, other)[0]
    other = other.with_fusion(f, c)
    assert c >= 0 and cp.predict_seconds(plain, g, cluster, other)[0] == pytest.approx(t1)
    assert cp.predict_seconds(acc, g, cluster, other)[0] < near


def timed_by_width(monkeypatch, seconds_for):
  """``time_step`` patched to say ``seconds_for(width of the step's stage)``; returns the
  widths it was asked for, in order."""
  asked = []

  def fake(c, leaves, repeats=5, outside=0.0):
    k = len(c.planned.plan.stages[0].devices)
    asked.append(k)
    return seconds_for(k)

  monkeypatch.setattr(cp, "time_step", fake)
  return asked


@pytest.mark.parametrize("rounds", [0, 2])
def test_a_slow_spell_in_one_trial_does_not_decide_the_choice(dag, monkeypatch, rounds):
  """The trials are timed again in turns and each keeps its median: plain jit's first
  timing fell in a slow spell of the machine (3x), jit data parallel's did not. Taken one
  after the other (no rounds), jit data parallel wins; timed in turns, plain jit does, at
  its usual time."""
  from gpp_jax.runtime import choice
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(choice, "TRIAL_ROUNDS", rounds)  # read by ``choice.Trials.interleave``

  probe = HostCosts(
    per_op=dict.fromkeys(OPS, 5e-3), parallel=1.0, cores=2, device="cpu:0", spmd={4: 2.0}
  )
  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: probe)
  calls = {1: 0}
  asked = []

  def fake(c, leaves, repeats=5, outside=0.0):
    plan = c.planned.plan
    k = len(plan.stages[0].devices)
    asked.append(k)
    if k > 1:
      return 0.015
    if plan.num_microbatches > 1:  # plain jit's step in micro-batches: slower
      return 0.05
    calls[1] += 1
    return 0.03 if calls[1] == 1 else 0.01

  monkeypatch.setattr(cp, "time_step", fake)
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner="graphpipe", calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  # Each trial once, plain jit first; then all again backwards, then forwards.
  n = len(asked) // (1 + rounds)
  first = asked[:n]
  turns = [k for r in range(rounds) for k in (first[::-1] if r % 2 == 0 else first)]
  assert first[0] == 1 and asked == first + turns, asked
  assert planned.measured["jit data parallel"] == pytest.approx(0.015)
  if rounds:
    assert planned.measured["plain jit"] == pytest.approx(0.01)
    assert pp.plan.planner == "plain jit"
  else:
    assert planned.measured["plain jit"] == pytest.approx(0.03)
    assert pp.plan.planner == "jit data parallel"
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


def test_jit_data_parallel_is_timed_and_chosen_where_it_measures_fastest(dag, monkeypatch):
  """The trial compiles and times jit data parallel like plain jit (whatever the host's probe
  predicts for it); measured faster, it is the choice, its prediction is its measurement, its
  compiled step is the one run, and the step's numbers are plain jit's."""
  from gpp_jax.runtime import host as host_mod

  # The probe says 4 devices run 50x slower than a quarter of one: far from the best.
  probe = HostCosts(
    per_op=dict.fromkeys(OPS, 5e-3), parallel=1.0, cores=2, device="cpu:0", spmd={4: 50.0}
  )
  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: probe)
  asked = timed_by_width(monkeypatch, lambda k: 0.02 if k == 1 else 0.01)
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner="graphpipe", calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  # Plain jit first, then (after the planner's step in micro-batches on one device, where
  # that is its plan) jit data parallel.
  assert asked[0] == 1 and 4 in asked[1:3]
  assert pp.plan.planner == "jit data parallel" and len(pp.plan.stages[0].devices) == 4
  assert planned.predicted_s == pytest.approx(0.01, rel=1e-6)
  assert planned.alternatives["plain jit"] == pytest.approx(0.02, rel=1e-6)
  assert "jit data parallel is predicted fastest" in planned.note
  assert pp.compiled.fused and pp.compiled.planned is planned
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


def test_the_planner_own_step_in_micro_batches_is_timed_beside_jit_data_parallel(dag, monkeypatch):
  """A planner's plan that is jit data parallel's step in micro-batches over the same devices
  (gradient accumulation) is timed beside it: the two times fit the model's factor and fixed
  seconds per sharded call apart, so each prediction is its measurement (plus the host's time
  outside the step). It is not chosen: the one-call step runs."""
  from gpp_jax.runtime import host as host_mod

  probe = HostCosts(
    per_op=dict.fromkeys(OPS, 5e-5),
    parallel=1.0,
    cores=2,
    device="cpu:0",
    spmd={4: 2.0},
    spmd_call={4: 1e-4},
    outside=2e-4,
  )
  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: probe)
  # (width, micro-batches) -> seconds
  seconds = {(1, 1): 0.02, (1, 4): 0.026, (4, 1): 0.01, (4, 4): 0.016}

  def fake(c, leaves, repeats=5, outside=0.0):
    p = c.planned.plan
    return seconds[len(p.stages[0].devices), p.num_microbatches]

  monkeypatch.setattr(cp, "time_step", fake)

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=accumulating_planner(4),
    calibrate=True,
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert planned.measured == pytest.approx(
    {"plain jit": 0.02, "jit data parallel": 0.01, "pipeline": 0.016, cp.ACCUMULATED: 0.026}
  )
  assert planned.alternatives["jit data parallel"] == pytest.approx(0.01 + 2e-4)
  assert planned.alternatives["pipeline"] == pytest.approx(0.016 + 2e-4)
  assert set(planned.host.model_call) == {1, 4}  # plain jit's pair too
  assert pp.plan.planner == "jit data parallel"
  # The planner's own plan stays at hand beside the one chosen, as predicted.
  assert set(planned.plans) == set(planned.alternatives)
  assert planned.plans["pipeline"].planner == "accumulate"
  assert planned.plans["jit data parallel"] == pp.plan
  assert "16.20 ms for accumulate's one stage of 4 micro-batches" in planned.note
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


@pytest.mark.parametrize("pipeline_s", [0.05, 0.002])
def test_a_pipeline_predicted_fastest_is_timed_before_it_is_taken(dag, monkeypatch, pipeline_s):
  """Instructions that cost the host nothing and devices that compute at once: the planner's
  pipeline is predicted fastest. It is compiled and timed like the baselines before it is
  taken: measured slower than plain jit, plain jit runs and the note and explain() say why;
  measured faster, it runs, compiled once (the trial's step). Either way the step's values
  are the plain step's."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: host(0.0, 4.0))
  asked = []

  def fake(c, leaves, repeats=5, outside=0.0):
    p = c.planned.plan
    asked.append(p.num_stages)
    if p.num_stages > 1:
      return pipeline_s
    return 0.01 if len(p.stages[0].devices) == 1 else 0.03

  monkeypatch.setattr(cp, "time_step", fake)
  built = []
  build_step = cp.build_step
  monkeypatch.setattr(cp, "build_step", lambda *a, **k: built.append(1) or build_step(*a, **k))
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner="balanced", calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  # Plain jit, its step in micro-batches and jit data parallel timed, then twice more in
  # turns; then the pipeline predicted fastest, timed, and it and plain jit twice more in turns.
  assert [a > 1 for a in asked] == [False] * 9 + [True, True, False, False, True], asked
  assert planned.alternatives["pipeline"] < planned.alternatives["plain jit"]
  assert planned.measured["pipeline"] == pytest.approx(pipeline_s)
  assert "compiled and timed while choosing: plain jit 10.00 ms" in pp.explain()
  if pipeline_s > 0.01:
    assert pp.plan.planner == "plain jit"
    assert "measured 50.00 ms per step, slower than plain jit's 10.00 ms" in planned.note
    assert planned.note in pp.explain()
    assert planned.predicted_s == pytest.approx(0.01, rel=1e-6)
  else:
    assert pp.plan.num_stages > 1 and pp.plan.planner == "balanced" and not planned.note
    # Built for the four trials only: the pipeline's trial step is the one that runs.
    assert len(built) == 4
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


def test_a_pipeline_trial_puts_each_stage_state_on_its_stage(dag):
  """Timing a pipeline, its parameters and optimizer state go where its program keeps them
  (each stage's on its devices, as a training loop's later steps find them); the timed step
  leaves the caller's arrays as they were."""
  from gpp_jax.runtime.executor import leaf_homes

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner="balanced"
  )
  pp(params, opt_state, batch)
  c = pp.compiled
  assert pp.plan.num_stages > 1
  batch_leaves = set(c.staged.spec.batch_leaves)
  homes = {i: s for i, s in leaf_homes(c.executor_for(1)).items() if i not in batch_leaves}
  placed = {frozenset(s.device_set) for s in homes.values()}
  stages = {frozenset(pp.devices[d] for d in st.devices) for st in pp.plan.stages}
  assert placed <= stages and len(placed) > 1, (placed, stages)
  leaves = jax.tree.leaves((params, opt_state, batch))
  before = [np.asarray(x) for x in leaves]
  assert cp.time_step(c, leaves) > 0
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, leaves))
