"""Fidelity and regret: every candidate plan predicted and measured side by side, on this machine.

  python benchmarks/fidelity.py --models=mmt,dlrm,candle_uno --sizes=tiny,medium --devices=4,8

For each model, size and device count, one ``graph_pipeline`` is set up as a user would
(``planner="graphpipe"``, ``calibrate=True``): it measures the layers, the host's costs
(``runtime.host.measure_host``, its SPMD factor per width printed beside the fusion) and what
XLA makes of the whole step (plain jit, timed, and jit data parallel where it could be the
choice: the model's own SPMD factor), then picks among its candidates by one
prediction for this machine. Every candidate is then compiled and run for real, side by side
(``--steps`` timed steps each, the median, taken in ``--rounds`` rounds that visit the
candidates in turn: this machine's speed changes in spells of milliseconds to seconds, which
would otherwise fall on one candidate only) beside that prediction:

  plain jit           the step jitted on one device (one-stage plan, one jitted call)
  jit data parallel   one stage over all devices (each micro-batch split over them)
  <planner>           each planner's own plan (``--planners``), predicted by a calibrated run
                      with that planner (``--own_runs``: what its user is shown; the
                      baselines are GraphPipe's run's), else planned on GraphPipe's
                      calibrated layer graph; every planner searches with its run's
                      measured host costs (``PlanningProblem.host``)
  <planner> dev-only  the same planner's search without the host (the devices-only model),
                      on the same calibrated graph, where its plan differs
                      (``--devices_only_search``): the speed-up planning with the host
                      brought, measured

and prints per candidate: its devices per stage and micro-batches, how many devices compute at
once as the run that predicted it measured ("par"), measured ms, predicted ms,
the error, the prediction and error with the host's probe only (without the model's own SPMD
factor), without any SPMD factor (the model before them) and without the host's fixed
seconds per call over several devices (``HostCosts.spmd_call``; the factors as calibrated
with them) and with every stage's instructions issued at one device's costs (without
``HostCosts.wide_ops``), without the layers' times measured over a stage's devices ("no
widths": the SPMD factor's instead), with the cost model's update in place of the step's own
timed ("cm update"), and the prediction from the lowered program the
executor ran (its step pieces and batched puts included, ``simulate(program=)``); then
GraphPipe's choice,
the best measured candidate and the regret (measured time of the choice / best measured;
a run's choice that is none of the candidates is timed apart and counts among them),
and with ``--own_runs`` each planner's run's choice and its regret. Last, how repeatable
the numbers are on this machine: per candidate, how far its rounds' medians lie apart
("rounds") and how far the predictions of each planner's calibrated run lie apart ("runs",
for plans without a pipeline stage over several devices), and per model how far the trials of
the runs timed the same plain-jit and jit data-parallel steps.
With ``--json_out`` the rows go to a JSON file too. The 2-process rows are
``benchmarks/scaling.py``.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import dataclasses
import json
import statistics
import time
from typing import Any

import jax
from absl import app, flags

import gpp_jax
from gpp_jax.errors import PlanError
from gpp_jax.experiments import zoo
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import stage_microbatch_counts
from gpp_jax.passes.simulation import simulate
from gpp_jax.runtime.compile import (
  baseline_plans,
  calibrate_widths,
  make_plan,
  planner_cluster,
  predict_seconds,
  width_groups,
)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "zoo models")
flags.DEFINE_list("sizes", ["tiny", "medium"], "zoo sizes: tiny, medium")
flags.DEFINE_list("devices", ["4", "8"], "forced CPU device counts")
flags.DEFINE_list(
  "planners", ["graphpipe", "pipedream", "piper", "bapipe", "luo", "balanced"], "planners"
)
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer("microbatches", 4, "micro-batches per step")
flags.DEFINE_integer("steps", 10, "timed steps per candidate (median reported)")
flags.DEFINE_integer("rounds", 5, "rounds the timed steps are taken in, candidates in turn")
flags.DEFINE_string("json_out", None, "also write the rows to this JSON file")
flags.DEFINE_bool(
  "devices_only_search",
  True,
  "also run each planner's plan as its search finds it without the host's costs (the "
  "devices-only model, as before planners searched with the host), where it differs",
)
flags.DEFINE_bool(
  "own_runs",
  True,
  "predict each planner's plan by a calibrated run with that planner, as its user would see "
  "it (else on GraphPipe's calibrated layer graph)",
)


def setup(model, size):
  kw = zoo.MEDIUM[model] if size == "medium" else {}
  return zoo.setup(model, "paper" if size == "medium" else "tiny", **kw)


def prepare(run, data, planner, devices) -> tuple[Any, Any]:
  """The step of ``planner``'s plan as a training loop calls it (``cached_partial``),
  compiled and warmed up, and its compiled step."""
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.microbatches,
    devices=devices,
    planner=planner,
    layer_depth=run.spec.layer_depth,
  )
  train = pp.cached_partial(run.model, run.optimizer)
  for i in range(3):
    jax.block_until_ready(train(data[i % len(data)]))
  return train, pp.compiled


def measure(run, data, trains: list[Any]) -> tuple[list[float], list[float]]:
  """Median wall seconds of a step (the call and its results ready) of each of ``trains``,
  as a training loop sees: ``--steps`` timed steps each, taken in ``--rounds`` rounds that
  visit the steps in turn (one untimed step first in each: the state moves to that plan's
  devices), so that a slow or fast spell of the machine falls on all of them alike; and, of
  each, how far its rounds' medians lie apart (the largest over the smallest, less one): the
  measurement's own repeatability on this machine."""
  times: list[list[float]] = [[] for _ in trains]
  rounds: list[list[float]] = [[] for _ in trains]
  per_round = -(-FLAGS.steps // FLAGS.rounds)
  for r in range(FLAGS.rounds):
    for train, found, medians in zip(trains, times, rounds):
      jax.block_until_ready((train(data[r % len(data)]), jax.tree.leaves(run.model)))
      these = []
      for i in range(per_round):
        t = time.perf_counter()
        jax.block_until_ready((train(data[i % len(data)]), jax.tree.leaves(run.model)))
        these.append(time.perf_counter() - t)
      found.extend(these)
      medians.append(statistics.median(these))
  return [statistics.median(found) for found in times], [max(m) / min(m) - 1 for m in rounds]


def calibrated(run, data, devices, planner) -> tuple[Any, Any, float]:
  """``planner``'s run as a user would start it (``calibrate=True``): (its ``Planned``, its
  compiled step, seconds of set-up: calibration, the trials, compiling the choice)."""
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.microbatches,
    devices=devices,
    planner=planner,
    calibrate=True,
    layer_depth=run.spec.layer_depth,
  )
  t = time.perf_counter()
  jax.block_until_ready(pp(run.model, run.optimizer, data[0]))
  return pp.compiled.planned, pp.compiled, time.perf_counter() - t


def shape(plan):
  return [(s.layers, s.devices) for s in plan.stages], plan.num_microbatches


def columns(plan, planned, B, cluster, compiled) -> dict[str, float]:
  """Seconds ``plan`` is predicted at by the run that ``planned`` it (its calibrated graph and
  host), and by that model less one thing at a time: without the model's own SPMD factor
  (the host's probe's), without any SPMD factor, without the host's fixed seconds per call
  over several devices (the factors as calibrated with them), without the gradients'
  all-reduce in every backward over several devices (``HostCosts.allreduce``: the cost model's
  once per step instead), with every stage issued at one device's costs (no
  ``HostCosts.wide_ops``), without the layers' times measured over a stage's devices (the
  SPMD factor's instead, ``runtime.compile.calibrate_widths``), with the cost model's update
  (not the step's own, ``passes.calibrate.measure_update``); and the lowered program
  ``compiled`` ran, timed with the same host costs (step pieces and batched puts included)."""
  graph, host = planned.layer_graph, planned.host
  scaled = lg.scaled(graph, B)
  one_device = scaled.copy()
  for _, d in one_device.nodes(data=True):
    d.pop("time_f_at", None)
    d.pop("time_b_at", None)
  guessed_update = scaled.copy()
  guessed_update.graph.pop("update_per_byte", None)
  probe = unfactored = narrow = no_call = no_reduce = None
  if host is not None:

    def less(machine, **measured):  # the machine without some of the host's measurements
      return dataclasses.replace(machine, host=dataclasses.replace(machine.host, **measured))

    probe = dataclasses.replace(host, model_spmd={})  # the host's probe's factor
    unfactored = less(probe, spmd=None)
    no_call = less(host, spmd_call=None)
    no_reduce = less(host, allreduce=None)
    narrow = less(host, wide_ops=None, wide_per_stage=None)
  predicted = predict_seconds(plan, scaled, cluster, host)[0]
  program = predicted  # a one-stage plan is one jitted step either way
  if plan.num_stages > 1:
    program = simulate(plan, scaled, cluster, program=compiled.program, host=host).iteration_time
  return dict(
    predicted=predicted,
    probe=predict_seconds(plan, scaled, cluster, probe)[0],
    without_spmd=predict_seconds(plan, scaled, cluster, unfactored)[0],
    without_call=predict_seconds(plan, scaled, cluster, no_call)[0],
    without_allreduce=predict_seconds(plan, scaled, cluster, no_reduce)[0],
    narrow_issue=predict_seconds(plan, scaled, cluster, narrow)[0],
    without_widths=predict_seconds(plan, one_device, cluster, host)[0],
    guessed_update=predict_seconds(plan, guessed_update, cluster, host)[0],
    program=program,
  )


def one(model, size, n):
  run = setup(model, size)
  data = run.batches(FLAGS.batch_size, 2)
  devices = jax.devices()[:n]
  # GraphPipe's run: its calibration predicts the baselines (and, without --own_runs, every
  # planner's plan, planned on its calibrated layer graph).
  planned, compiled, setup_s = calibrated(run, data, devices, "graphpipe")
  B = compiled.batch_size
  # The options as given: a chosen baseline's compiled step keeps its one micro-batch.
  opts = dataclasses.replace(compiled.opts, num_microbatches=FLAGS.microbatches)
  graph = planned.layer_graph
  cluster = planner_cluster(opts)
  candidates = {k: (p, planned) for k, p in baseline_plans(graph, B, opts).items()}
  runs = {"graphpipe": planned}
  for name in FLAGS.planners:
    try:
      if name == "graphpipe" and "pipeline" in planned.plans:
        candidates[name] = (planned.plans["pipeline"], planned)
      elif name == "graphpipe" or not FLAGS.own_runs:
        candidates[name] = (make_plan(graph, B, dataclasses.replace(opts, planner=name)), planned)
      else:  # as a user who runs this planner sees it: its own calibration and choice
        runs[name] = calibrated(run, data, devices, name)[0]
        own = runs[name].plans.get("pipeline")
        if own is None:
          print(f"  {name}: its plan does not fit the memory budget as compiled")
          continue
        candidates[name] = (own, runs[name])
    except PlanError as e:
      print(f"  {name}: no plan ({e})")

  # Each planner's search without the host (the devices-only model) on the same calibrated
  # graph, where its plan differs: what planning with the host changed, measured.
  if FLAGS.devices_only_search:
    for name in FLAGS.planners:
      if name not in candidates:
        continue
      owner = runs.get(name, planned)
      try:
        plain = make_plan(owner.layer_graph, B, dataclasses.replace(opts, planner=name))
      except PlanError as e:
        print(f"  {name}, devices-only search: no plan ({e})")
        continue
      if shape(plain) != shape(candidates[name][0]):
        candidates[f"{name} dev-only"] = (plain, owner)

  # Every candidate compiled first, then measured side by side; each run's choice too where
  # it is none of them (e.g. a planner's plan on fewer devices).
  plans = [p for p, _ in candidates.values()]
  for r in runs.values():
    if all(shape(p) != shape(r.plan) for p in plans):
      plans.append(r.plan)
  prepared = [prepare(run, data, plan, devices) for plan in plans]
  # A pipeline's stages over several devices have their layers timed at those widths on the
  # graph that predicts it, as a run times its own candidates' (each with the capture at its
  # micro-batch: a run whose choice is a baseline keeps the whole-batch one).
  for (name, (plan, owner)), (_, c) in zip(list(candidates.items()), prepared):
    groups = width_groups(devices, [plan])
    timed = calibrate_widths(c.captured, owner.layer_graph, owner.host, groups)
    if timed is not owner.layer_graph:
      candidates[name] = (plan, dataclasses.replace(owner, layer_graph=timed))
  times, spreads = measure(run, data, [train for train, _ in prepared])
  by_shape = {repr(shape(p)): t for p, t in zip(plans, times)}
  rows = []
  for (name, (plan, owner)), measured, apart, (_, c) in zip(
    candidates.items(), times, spreads, prepared
  ):
    cols = columns(plan, owner, B, cluster, c)
    row = dict(
      candidate=name,
      stages=plan.num_stages,
      widths="+".join(str(len(s.devices)) for s in plan.stages),
      microbatches="+".join(map(str, sorted(set(stage_microbatch_counts(plan, B))))),
      depth=plan.depth(),
      # How many devices compute at once, as the run that predicted it measured (each
      # planner's run with --own_runs measures its own).
      parallel=owner.host.parallel if owner.host is not None else None,
      measured_ms=measured * 1e3,
      rounds_spread=apart,
      across_runs_ms=across_runs(plan, runs, B, cluster),
    )
    for k, v in cols.items():
      key = "predicted_ms" if k == "predicted" else f"predicted_{k}_ms"
      row[key] = v * 1e3
      row["error" if k == "predicted" else f"error_{k}"] = (v - measured) / measured
    rows.append(row)
  best = min(rows, key=lambda r: r["measured_ms"])
  best_name, best_ms = best["candidate"], best["measured_ms"]
  chosen_ms = {name: by_shape[repr(shape(r.plan))] * 1e3 for name, r in runs.items()}
  for name, r in runs.items():  # a run's choice that is none of the rows, timed apart
    if chosen_ms[name] < best_ms:
      best_name, best_ms = f"{name}'s choice ({r.plan.planner})", chosen_ms[name]
  choices = {
    name: dict(
      choice=r.plan.planner,
      stages=r.plan.num_stages,
      predicted_ms=r.predicted_s * 1e3,
      measured_ms=chosen_ms[name],
      regret=chosen_ms[name] / best_ms,
    )
    for name, r in runs.items()
  }
  mine = choices["graphpipe"]
  # The same compiled steps timed by every run's trials, minutes apart in one process.
  trials = {
    k: [r.measured[k] * 1e3 for r in runs.values() if k in r.measured]
    for k in ("plain jit", "jit data parallel")
  }
  ms = {row["candidate"]: row["measured_ms"] for row in rows}
  searched = {
    name: dict(host_ms=ms[name], devices_only_ms=ms.get(f"{name} dev-only", ms[name]))
    for name in FLAGS.planners
    if name in ms
  }
  return dict(
    model=model,
    size=size,
    devices=n,
    choice=mine["choice"],
    choice_stages=mine["stages"],
    choice_predicted_ms=mine["predicted_ms"],
    choice_measured_ms=mine["measured_ms"],
    best=best_name,
    best_ms=best_ms,
    regret=mine["regret"],
    choices=choices,
    fusion=planned.host.fusion if planned.host is not None else None,
    spmd=dict(planned.host.spmd or {}) if planned.host is not None else None,
    spmd_call_ms={k: v * 1e3 for k, v in (planned.host.spmd_call or {}).items()}
    if planned.host is not None
    else {},
    allreduce_ms_per_mib={k: v * 2**20 * 1e3 for k, v in (planned.host.allreduce or {}).items()}
    if planned.host is not None
    else {},
    model_spmd=dict(planned.host.model_spmd) if planned.host is not None else {},
    update_ms_per_mib=graph.graph.get("update_per_byte", float("nan")) * 2**20 * 1e3,
    setup_s=setup_s,
    searched=searched,
    trials_ms=trials,
    rows=rows,
  )


def across_runs(plan, runs, B, cluster) -> list[float] | None:
  """ms ``plan`` is predicted at by each run's calibration (its layer graph and host), where
  no stage of a pipeline spans several devices (those need the widths timed on each graph):
  how far calibrations minutes apart on this machine disagree about one plan."""
  if plan.num_stages > 1 and any(len(s.devices) > 1 for s in plan.stages):
    return None
  if len(runs) < 2:
    return None
  return [
    predict_seconds(plan, lg.scaled(r.layer_graph, B), cluster, r.host)[0] * 1e3
    for r in runs.values()
  ]


# The columns after the prediction, in the order printed (``columns``' keys).
ABLATIONS = (
  "probe",
  "without_spmd",
  "without_call",
  "without_allreduce",
  "narrow_issue",
  "without_widths",
  "guessed_update",
  "program",
)


def spread(values) -> float:
  """How far ``values`` lie apart: the largest over the smallest, less one."""
  return max(values) / min(values) - 1


def spmd_text(factors, digits: int = 1) -> str:
  """SPMD factors (or seconds per call) per width: the host's probe (``runtime.host
  .measure_spmd``) or the model's own (jit data parallel timed in the trial,
  ``runtime.compile.calibrate_spmd``)."""
  if not factors:
    return "none"
  return ", ".join(f"{k}: {f:.{digits}f}" for k, f in sorted(factors.items()))


def main(_):
  out = []
  for size in FLAGS.sizes:
    for model in FLAGS.models:
      for n in map(int, FLAGS.devices):
        r = one(model, size, n)
        out.append(r)
        print(
          f"\n{model} {size}, {n} devices, batch {FLAGS.batch_size}, M={FLAGS.microbatches} "
          f"(fusion {r['fusion']:.2f}, SPMD factors {spmd_text(r['spmd'])}, the model's "
          f"{spmd_text(r['model_spmd'])}, ms per call over k devices "
          f"{spmd_text(r['spmd_call_ms'], 2)}, all-reduce ms per MiB over k devices "
          f"{spmd_text(r['allreduce_ms_per_mib'], 2)}, update ms per MiB "
          f"{r['update_ms_per_mib']:.2f}, set-up {r['setup_s']:.0f} s)"
        )
        head = ("candidate", "devices", "M", "par")
        head += ("measured", "predicted", "err", "probe", "err")
        head += ("no SPMD", "err", "no call", "err", "no all-red", "err")
        head += ("1-dev issue", "err", "no widths", "err", "cm update", "err", "program", "err")
        head += ("rounds", "runs")
        print(
          "  {:20s} {:>8s} {:>3s} {:>4s}".format(*head[:4])
          + " {:>10s} {:>10s} {:>6s}".format(*head[4:7])
          + (" {:>10s} {:>6s}" * len(ABLATIONS)).format(*head[7:-2])
          + " {:>6s} {:>6s}".format(*head[-2:])
        )
        for row in r["rows"]:
          print(
            f"  {row['candidate']:20s} {row['widths']:>8s} {row['microbatches']:>3s} "
            f"{'-' if row['parallel'] is None else format(row['parallel'], '.1f'):>4s} "
            f"{row['measured_ms']:8.2f}ms {row['predicted_ms']:8.2f}ms "
            f"{row['error'] * 100:+5.0f}%"
            + "".join(
              f" {row[f'predicted_{k}_ms']:8.2f}ms {row[f'error_{k}'] * 100:+5.0f}%"
              for k in ABLATIONS
            )
            + f" {row['rounds_spread'] * 100:5.0f}% "
            + (
              f"{spread(row['across_runs_ms']) * 100:5.0f}%" if row["across_runs_ms"] else "     -"
            )
          )
        print(
          f"  choice: {r['choice']} ({r['choice_stages']} stages) measured "
          f"{r['choice_measured_ms']:.2f} ms, predicted {r['choice_predicted_ms']:.2f} ms; "
          f"best: {r['best']} {r['best_ms']:.2f} ms; regret {r['regret']:.2f}"
        )
        others = [
          f"{k}: {c['choice']} {c['measured_ms']:.2f} ms ({c['regret']:.2f})"
          for k, c in r["choices"].items()
          if k != "graphpipe"
        ]
        if others:
          print("  each planner's run chose (measured, regret): " + "; ".join(others))
        timed = [
          f"{k} {min(v):.2f}-{max(v):.2f} ms ({spread(v) * 100:.0f}% apart)"
          for k, v in r["trials_ms"].items()
          if len(v) > 1
        ]
        if timed:
          print("  the same step timed by each run's trial: " + "; ".join(timed))
        gains = [
          f"{k} {v['devices_only_ms'] / v['host_ms']:.2f}x"
          for k, v in r["searched"].items()
          if v["devices_only_ms"] != v["host_ms"]
        ]
        if FLAGS.devices_only_search:
          print(
            "  each planner's plan searched with the host, measured against its devices-only "
            "search's (devices-only ms / host-aware ms): "
            + ("; ".join(gains) if gains else "the same plans")
          )
  errs = [abs(row["error"]) for r in out for row in r["rows"]]
  prog = [abs(row["error_program"]) for r in out for row in r["rows"]]
  bare = [abs(row["error_without_widths"]) for r in out for row in r["rows"]]
  regrets = [c["regret"] for r in out for c in r["choices"].values()]
  gains = [
    v["devices_only_ms"] / v["host_ms"]
    for r in out
    for k, v in r["searched"].items()
    if v["devices_only_ms"] != v["host_ms"]
  ]
  if gains:
    print(
      f"\nplanners' plans searched with the host against their devices-only search: "
      f"{len(gains)} differ; measured speed-up median {statistics.median(gains):.2f}x, "
      f"min {min(gains):.2f}x, max {max(gains):.2f}x"
    )
  print(
    f"\n{len(errs)} candidates: |error| median {statistics.median(errs) * 100:.0f}%, "
    f"max {max(errs) * 100:.0f}%, within 15%: {sum(e <= 0.15 for e in errs)}; regret max "
    f"{max(r['regret'] for r in out):.2f}, <= 1.05: {sum(r['regret'] <= 1.05 for r in out)}"
    f"/{len(out)} (every planner's run: max {max(regrets):.2f}, <= 1.05: "
    f"{sum(x <= 1.05 for x in regrets)}/{len(regrets)}); the programs' predictions: |error| median "
    f"{statistics.median(prog) * 100:.0f}%, within 15%: {sum(e <= 0.15 for e in prog)}; "
    f"without the layers timed over stages' devices: |error| median "
    f"{statistics.median(bare) * 100:.0f}%, within 15%: {sum(e <= 0.15 for e in bare)}"
  )
  rounds = [row["rounds_spread"] for r in out for row in r["rows"]]
  runs = [spread(row["across_runs_ms"]) for r in out for row in r["rows"] if row["across_runs_ms"]]
  trials = [spread(v) for r in out for v in r["trials_ms"].values() if len(v) > 1]
  print(
    "the measurement's own repeatability: one candidate's rounds' medians lie "
    f"{statistics.median(rounds) * 100:.0f}% apart (median; max {max(rounds) * 100:.0f}%)"
    + (
      f"; one plan predicted by each planner's calibrated run: {statistics.median(runs) * 100:.0f}%"
      f" apart (median of {len(runs)} plans; max {max(runs) * 100:.0f}%)"
      if runs
      else ""
    )
    + (
      f"; one compiled step timed by each run's trial: {statistics.median(trials) * 100:.0f}% "
      f"apart (median; max {max(trials) * 100:.0f}%)"
      if trials
      else ""
    )
  )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
