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
  <planner>           each planner's pipeline (``--planners``), planned on the same calibrated
                      layer graph

and prints per candidate: its devices per stage and micro-batches, measured ms, predicted ms,
the error, the prediction and error with the host's probe only (without the model's own SPMD
factor), without any SPMD factor (the model before them) and without the host's fixed
seconds per call over several devices (``HostCosts.spmd_call``; the factors as calibrated
with them) and with every stage's instructions issued at one device's costs (without
``HostCosts.wide_ops``), and the prediction from the lowered program the executor ran (its
step pieces and batched puts included, ``simulate(program=)``); then the planner's choice,
the best measured candidate and the regret (measured time of the choice / best measured).
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
from gpp_jax.cost.simulator import simulate
from gpp_jax.errors import PlanError
from gpp_jax.experiments import zoo
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import stage_microbatch_counts
from gpp_jax.runtime.compile import baseline_plans, make_plan, planner_cluster, predict_seconds

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


def measure(run, data, trains: list[Any]) -> list[float]:
  """Median wall seconds of a step (the call and its results ready) of each of ``trains``,
  as a training loop sees: ``--steps`` timed steps each, taken in ``--rounds`` rounds that
  visit the steps in turn (one untimed step first in each: the state moves to that plan's
  devices), so that a slow or fast spell of the machine falls on all of them alike."""
  times: list[list[float]] = [[] for _ in trains]
  per_round = -(-FLAGS.steps // FLAGS.rounds)
  for r in range(FLAGS.rounds):
    for train, found in zip(trains, times):
      jax.block_until_ready((train(data[r % len(data)]), jax.tree.leaves(run.model)))
      for i in range(per_round):
        t = time.perf_counter()
        jax.block_until_ready((train(data[i % len(data)]), jax.tree.leaves(run.model)))
        found.append(time.perf_counter() - t)
  return [statistics.median(found) for found in times]


def one(model, size, n):
  run = setup(model, size)
  data = run.batches(FLAGS.batch_size, 2)
  devices = jax.devices()[:n]
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.microbatches,
    devices=devices,
    planner="graphpipe",
    calibrate=True,
    layer_depth=run.spec.layer_depth,
  )
  t = time.perf_counter()
  jax.block_until_ready(pp(run.model, run.optimizer, data[0]))
  setup_s = time.perf_counter() - t
  c = pp.compiled
  # The options as given: a chosen baseline's compiled step keeps its one micro-batch.
  planned, B = c.planned, c.batch_size
  opts = dataclasses.replace(c.opts, num_microbatches=FLAGS.microbatches)
  graph = planned.layer_graph
  scaled = lg.scaled(graph, B)
  cluster = planner_cluster(opts)
  candidates = dict(baseline_plans(graph, B, opts))
  for name in FLAGS.planners:
    try:
      candidates[name] = make_plan(graph, B, dataclasses.replace(opts, planner=name))
    except PlanError as e:
      print(f"  {name}: no plan ({e})")

  def shape(plan):
    return [(s.layers, s.devices) for s in plan.stages], plan.num_microbatches

  # The same host without its measured SPMD factors, and the graph without the model's own
  # (jit data parallel timed in the trial): what the prediction was before them.
  unfactored = dataclasses.replace(planned.host, spmd=None) if planned.host is not None else None
  # The host without its fixed seconds per call over several devices (the factors as they are).
  no_call = dataclasses.replace(planned.host, spmd_call=None) if planned.host is not None else None
  # The host issuing every stage's instructions at one device's costs (no ``wide_ops``).
  narrow = (
    dataclasses.replace(planned.host, wide_ops=None, wide_per_stage=None)
    if planned.host is not None
    else None
  )
  bare = scaled.copy()
  bare.graph.pop("spmd", None)
  rows = []
  # Every candidate compiled first, then measured side by side; the choice too where it is
  # none of them (e.g. the planner's plan on fewer devices).
  chosen_index = next(
    (i for i, p in enumerate(candidates.values()) if shape(p) == shape(pp.plan)), None
  )
  plans = list(candidates.values()) + ([pp.plan] if chosen_index is None else [])
  prepared = [prepare(run, data, plan, devices) for plan in plans]
  times = measure(run, data, [train for train, _ in prepared])
  chosen = times[-1 if chosen_index is None else chosen_index]
  for (name, plan), measured, (_, compiled) in zip(candidates.items(), times, prepared):
    predicted, _ = predict_seconds(plan, scaled, cluster, planned.host)
    without, _ = predict_seconds(plan, bare, cluster, unfactored)
    probe, _ = predict_seconds(plan, bare, cluster, planned.host)
    callless, _ = predict_seconds(plan, scaled, cluster, no_call)
    one_width, _ = predict_seconds(plan, scaled, cluster, narrow)
    # The lowered program the executor ran (step pieces and batched puts included), timed
    # with the same host costs; a one-stage plan is one jitted step either way.
    program = predicted
    if plan.num_stages > 1:
      res = simulate(plan, scaled, cluster, program=compiled.program, host=planned.host)
      program = res.iteration_time
    rows.append(
      dict(
        candidate=name,
        stages=plan.num_stages,
        widths="+".join(str(len(s.devices)) for s in plan.stages),
        microbatches="+".join(map(str, sorted(set(stage_microbatch_counts(plan, B))))),
        depth=plan.depth(),
        measured_ms=measured * 1e3,
        predicted_ms=predicted * 1e3,
        error=(predicted - measured) / measured,
        predicted_probe_ms=probe * 1e3,
        error_probe=(probe - measured) / measured,
        predicted_without_spmd_ms=without * 1e3,
        error_without_spmd=(without - measured) / measured,
        predicted_without_call_ms=callless * 1e3,
        error_without_call=(callless - measured) / measured,
        predicted_narrow_issue_ms=one_width * 1e3,
        error_narrow_issue=(one_width - measured) / measured,
        predicted_program_ms=program * 1e3,
        error_program=(program - measured) / measured,
      )
    )
  best = min(rows, key=lambda r: r["measured_ms"])
  return dict(
    model=model,
    size=size,
    devices=n,
    choice=pp.plan.planner,
    choice_stages=pp.plan.num_stages,
    choice_predicted_ms=planned.predicted_s * 1e3,
    choice_measured_ms=chosen * 1e3,
    best=best["candidate"],
    best_ms=best["measured_ms"],
    regret=chosen * 1e3 / best["measured_ms"],
    fusion=graph.graph.get("fusion"),
    spmd=dict(planned.host.spmd or {}) if planned.host is not None else None,
    spmd_call_ms={k: v * 1e3 for k, v in (planned.host.spmd_call or {}).items()}
    if planned.host is not None
    else {},
    model_spmd={int(k): f for k, f in graph.graph.get("spmd", {}).items()},
    setup_s=setup_s,
    rows=rows,
  )


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
          f"{spmd_text(r['spmd_call_ms'], 2)}, set-up {r['setup_s']:.0f} s)"
        )
        head = ("candidate", "devices", "M", "measured", "predicted", "err", "probe", "err")
        head += ("no SPMD", "err", "no call", "err", "1-dev issue", "err", "program", "err")
        print(
          "  {:20s} {:>8s} {:>3s}".format(*head[:3])
          + " {:>10s} {:>10s} {:>6s}".format(*head[3:6])
          + (" {:>10s} {:>6s}" * 5).format(*head[6:])
        )
        for row in r["rows"]:
          print(
            f"  {row['candidate']:20s} {row['widths']:>8s} {row['microbatches']:>3s} "
            f"{row['measured_ms']:8.2f}ms {row['predicted_ms']:8.2f}ms "
            f"{row['error'] * 100:+5.0f}% {row['predicted_probe_ms']:8.2f}ms "
            f"{row['error_probe'] * 100:+5.0f}% {row['predicted_without_spmd_ms']:8.2f}ms "
            f"{row['error_without_spmd'] * 100:+5.0f}% {row['predicted_without_call_ms']:8.2f}ms "
            f"{row['error_without_call'] * 100:+5.0f}% {row['predicted_narrow_issue_ms']:8.2f}ms "
            f"{row['error_narrow_issue'] * 100:+5.0f}% {row['predicted_program_ms']:8.2f}ms "
            f"{row['error_program'] * 100:+5.0f}%"
          )
        print(
          f"  choice: {r['choice']} ({r['choice_stages']} stages) measured "
          f"{r['choice_measured_ms']:.2f} ms, predicted {r['choice_predicted_ms']:.2f} ms; "
          f"best: {r['best']} {r['best_ms']:.2f} ms; regret {r['regret']:.2f}"
        )
  errs = [abs(row["error"]) for r in out for row in r["rows"]]
  prog = [abs(row["error_program"]) for r in out for row in r["rows"]]
  print(
    f"\n{len(errs)} candidates: |error| median {statistics.median(errs) * 100:.0f}%, "
    f"max {max(errs) * 100:.0f}%, within 15%: {sum(e <= 0.15 for e in errs)}; regret max "
    f"{max(r['regret'] for r in out):.2f}, <= 1.05: {sum(r['regret'] <= 1.05 for r in out)}"
    f"/{len(out)}; the programs' predictions: |error| median "
    f"{statistics.median(prog) * 100:.0f}%, within 15%: {sum(e <= 0.15 for e in prog)}"
  )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
