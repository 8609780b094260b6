"""Each candidate's time in the plan choice says where it comes from: ``"measured"`` (a timing
trial of that candidate) or ``"modelled"`` (the cost model), in ``Choice.how`` and
``Planned.how``, and in the training program's ``summary.json`` (``candidates_how`` beside
``candidates_ms``; ``prediction`` for the chosen one) and printed lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import optax
import pytest
from harness import child_env, dag_model, dag_params, make_batch, max_diff, mse_step

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.cost.host import HostCosts
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.runtime import compile as cp

OPS = ("F", "B", "W", "UPDATE", "SEND", "RECV", "STEP")


def host(per_op: float, parallel: float | None, outside: float = 0.0, spmd=None) -> HostCosts:
  return HostCosts(
    per_op=dict.fromkeys(OPS, per_op),
    outside=outside,
    parallel=parallel,
    cores=2,
    device="cpu:0",
    spmd=spmd,
  )


def chain(seconds: float, batch: int = 8):
  """Two layers a -> b, each ``seconds`` forward (twice that backward) per batch."""
  g = lg.new_layer_graph("chain", batch)
  for name in ("a", "b"):
    lg.add_layer(
      g,
      name,
      lg.LayerCost(flops=1e6, param_bytes=1e5, act_bytes=1024),
      time_f=seconds,
      time_b=2 * seconds,
    )
  lg.add_edge(g, "a", "b", 1024)
  return g


def candidates(g, M: int = 4) -> dict[str, Plan]:
  layers = tuple(lg.topo_layers(g))
  B = g.graph["batch_size"]

  def one(k: int, m: int, name: str) -> Plan:
    return Plan((Stage(0, layers, tuple(range(k))),), (), m, planner=name, batch_size=B)

  two = Plan(
    (Stage(0, ("a",), (0,)), Stage(1, ("b",), (1,))), ((0, 1),), M, planner="chain", batch_size=B
  )
  return {
    "pipeline": two,
    "plain jit": one(1, 1, "plain jit"),
    "jit data parallel": one(2, 1, "jit data parallel"),
    cp.ACCUMULATED: one(1, M, "plain jit"),
  }


def test_choose_labels_the_timed_one_call_steps_measured_and_the_pipeline_modelled():
  """Plain jit, timed, fits the fusion: its time in the choice is its trial's plus the host's
  time outside the step ("measured"); its step in micro-batches, measured faster, is that time
  scaled by the two trials ("measured"); the pipeline, timed too, keeps the simulator's
  prediction ("modelled"), and jit data parallel, not timed, the cost model's. Without the
  host's costs (devices only) every time is modelled."""
  g, cluster = chain(2e-3), cpu_cluster(2, 8 * 2**30)
  h = host(1e-4, 2.0, outside=2e-4)
  cands = candidates(g)
  B = g.graph["batch_size"]
  at = cp.Predictor(lg.scaled(g, B), cluster)
  fitted = cp.calibrate_fusion(at, cp.MachineCalibration(h), cp.Timed(cands["plain jit"], 0.01))
  timed = {"plain jit": 0.01, cp.ACCUMULATED: 0.008, "pipeline": 0.5}
  c = cp.choose(cands, lg.scaled(g, B), cluster, fitted, timed)
  assert c.how == {
    "pipeline": "modelled",
    "plain jit": "measured",
    "jit data parallel": "modelled",
    cp.ACCUMULATED: "measured",
  }
  assert c.predicted["plain jit"] == pytest.approx(0.01 + 2e-4, rel=1e-6)
  assert c.predicted[cp.ACCUMULATED] == pytest.approx(0.8 * c.predicted["plain jit"])
  assert c.predicted["pipeline"] != pytest.approx(0.5 + 2e-4)
  assert cp.choose_plan(cands, lg.scaled(g, B), cluster, fitted, timed) == (c.name, c.predicted)
  devices_only = cp.choose(cands, lg.scaled(g, B), cluster, None, timed)
  assert set(devices_only.how.values()) == {"modelled"}


def test_a_timed_one_call_step_is_predicted_at_its_trial_where_the_fit_hit_its_floor():
  """Plain jit timed faster than the fusion's floor lets the model price it (the factor held
  at ``FUSION_FLOOR``): its time in the choice is still its trial's plus the host's time
  outside the step, labelled measured, and it is chosen over a slower pipeline by it."""
  g, cluster = chain(2e-3), cpu_cluster(2, 8 * 2**30)
  h = host(1e-4, 2.0, outside=2e-4)
  cands = candidates(g)
  B = g.graph["batch_size"]
  at = cp.Predictor(lg.scaled(g, B), cluster)
  fast = 1e-5
  fitted = cp.calibrate_fusion(at, cp.MachineCalibration(h), cp.Timed(cands["plain jit"], fast))
  modelled = at.seconds(cands["plain jit"], fitted)
  assert modelled > 2 * (fast + 2e-4)  # the floor held: the model cannot reach the trial
  c = cp.choose(cands, lg.scaled(g, B), cluster, fitted, {"plain jit": fast})
  assert c.how["plain jit"] == "measured"
  assert c.predicted["plain jit"] == pytest.approx(fast + 2e-4, rel=1e-9)
  assert c.how["pipeline"] == "modelled" and c.name == "plain jit"


def test_a_tie_goes_to_the_pipeline_then_to_a_measured_time():
  """Predictions within ``TIE`` of the fastest are a tie: a modelled time a few bits under a
  measured one does not take the step from it, and the planner's plan wins any tie."""
  from gpp_jax.runtime.choice import fastest

  t = 0.0102
  under = t * (1 - 1e-15)
  how = {"jit data parallel": "measured", "jit fsdp": "modelled", "pipeline": "modelled"}
  names = ["jit data parallel", "jit fsdp"]
  assert fastest(names, {"jit data parallel": t, "jit fsdp": under}, how) == "jit data parallel"
  assert fastest(names, {"jit data parallel": t, "jit fsdp": 0.99 * t}, how) == "jit fsdp"
  both = {"jit data parallel": t, "jit fsdp": under, "pipeline": t * (1 + 1e-12)}
  assert fastest([*names, "pipeline"], both, how) == "pipeline"


@pytest.fixture(scope="module")
def dag():
  tx = optax.adam(1e-2)
  params = dag_params()
  return mse_step(dag_model, tx), params, tx.init(params), make_batch(0, 16, 5, 2)


def test_planned_labels_plain_jit_measured_and_the_pipeline_modelled(dag, monkeypatch):
  """Through ``graph_pipeline(calibrate=True)``: plain jit and jit data parallel are timed by
  trial (here 10 ms and 50 ms a call) and their times in the choice are those trials'
  ("measured"); the user's two-stage pipeline is the simulator's ("modelled"), whether or not
  it was timed before being turned down. Plain jit runs, and ``predicted_how`` says its time
  is measured."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(
    host_mod, "measure_host", lambda devices, *_: host(0.0, 1.0, spmd={2: 3.0, 4: 6.0})
  )

  def fake(c, leaves, repeats=5, outside=0.0):
    plan = c.planned.plan
    if plan.num_stages == 1 and len(plan.stages[0].devices) == 1:
      return 0.013 if plan.num_microbatches > 1 else 0.01
    return 0.05

  monkeypatch.setattr(cp, "time_step", fake)

  def halves(layer_graph, cluster, batch_size, *, num_microbatches=None):
    layers = tuple(lg.topo_layers(layer_graph))
    return Plan(
      (Stage(0, layers[:2], (0,)), Stage(1, layers[2:], (1,))),
      ((0, 1),),
      num_microbatches,
      planner="halves",
      batch_size=batch_size,
    )

  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step, num_microbatches=2, devices=jax.devices()[:4], planner=halves, calibrate=True
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert set(planned.how) == set(planned.alternatives)
  assert planned.measured["plain jit"] == 0.01 and planned.how["plain jit"] == "measured"
  assert planned.how["jit data parallel"] == "measured"
  assert planned.how["pipeline"] == "modelled"
  assert planned.how["jit fsdp"] == "modelled"  # never timed
  assert planned.chosen == "plain jit" and pp.plan.planner == "plain jit"
  assert planned.predicted_how == "measured"
  assert planned.predicted_s == planned.alternatives["plain jit"]
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5


@pytest.mark.slow
def test_the_training_program_writes_and_prints_the_labels(tmp_path):
  """A tiny ``gpp_jax.train`` run with the balanced planner (a pipeline of 2 stages, whose
  time is the simulator's): ``summary.json`` has ``candidates_how`` beside ``candidates_ms``,
  plain jit (timed by trial) measured, the pipeline modelled, ``prediction`` the chosen
  candidate's label, and the printed candidate lines say the same."""
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.train",
      "--model=dlrm",
      "--planner=balanced",
      "--num_devices=2",
      "--num_microbatches=2",
      "--batch_size=8",
      "--steps=2",
      "--log_every=1",
      "--nomeasure_memory",
      f"--run_dir={tmp_path}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=child_env(),
  )
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  how = s["candidates_how"]
  assert set(how) == set(s["candidates_ms"]) and set(how.values()) <= {"measured", "modelled"}
  assert how["plain jit"] == "measured" and "plain jit" in s["timed_ms"]
  assert how["pipeline"] == "modelled"
  assert s["prediction"] == how[s["chosen"]] and s["model"] == "host-aware"
  assert re.search(r"^  plain jit +[\d.]+ ms  measured", r.stdout, re.M), r.stdout[-2000:]
  assert re.search(r"^  pipeline +[\d.]+ ms  modelled", r.stdout, re.M), r.stdout[-2000:]
  assert f"({s['prediction']}, host-aware: the time the plan was chosen by" in r.stdout
