"""GraphPipe's pipeline against PipeDream's, both held to ``min_stages=2``, beside plain jit:
step times measured side by side on this machine.

  python benchmarks/graphpipe_vs_pipedream.py
  python benchmarks/graphpipe_vs_pipedream.py --models=dlrm --sizes=tiny --devices=4 --steps=6

For each model (MMT, DLRM, CANDLE-Uno), size (the zoo's tiny preset, and medium: the paper
preset narrowed, ``experiments.zoo.MEDIUM``) and forced CPU device count, one
``graph_pipeline`` per planner is set up as a user would (``planner="graphpipe"`` and
``planner="pipedream"``, ``min_stages=2``, ``calibrate=True`` unless ``--nocalibrate``):
each planner's own search kept to plans of at least two stages (``PlanningProblem
.min_stages``), whatever it would find fastest without the constraint, and each run's choice
among its candidates (its plan, or its plan on fewer devices; the one-stage candidates are
left out by ``min_stages``). Plain jit is the same step as one jitted call on the first
device (the ``"plain jit"`` baseline plan, as a run's candidates have it).

The three steps are compiled first, then timed side by side as a training loop calls them
(``cached_partial``): ``--steps`` timed steps each, in ``--rounds`` rounds that visit the
steps in turn (one untimed step first in each: the state moves to that step's devices), the
median kept; this machine's speed changes in spells of milliseconds to seconds, which would
otherwise fall on one of them only. The table gives per step its plan (stages, devices per
stage, micro-batches, depth), the measured milliseconds per step and the ratio to plain jit's
measured time (both labelled measured), and the time the run chose it by with where that
time comes from (``Planned.predicted_how``: modelled for a pipeline), for reference. Where
the two planners' plans are the same step it says so. ``--json_out`` writes the rows too.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import json
import statistics
import time
from typing import Any

import jax
from absl import app, flags

import gpp_jax
from gpp_jax.errors import PlanError
from gpp_jax.experiments import zoo
from gpp_jax.runtime.compile import baseline_plans

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "zoo models")
flags.DEFINE_list("sizes", ["tiny", "medium"], "zoo sizes: tiny, medium")
flags.DEFINE_list("devices", ["4", "8"], "forced CPU device counts")
flags.DEFINE_list("planners", ["graphpipe", "pipedream"], "planners, each held to min_stages")
flags.DEFINE_integer("min_stages", 2, "the fewest stages each planner's plan may have")
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer("microbatches", 4, "micro-batches per step")
flags.DEFINE_integer("steps", 10, "timed steps per step function (median reported)")
flags.DEFINE_integer("rounds", 5, "rounds the timed steps are taken in, step functions in turn")
flags.DEFINE_bool(
  "calibrate",
  True,
  "time the layers and the host before planning (each planner searches with this machine's "
  "costs, as a user's run does); --nocalibrate plans with the devices-only model (quicker)",
)
flags.DEFINE_string("json_out", None, "also write the rows to this JSON file")


def setup(model: str, size: str) -> zoo.ZooRun:
  kw = zoo.MEDIUM[model] if size == "medium" else {}
  return zoo.setup(model, "paper" if size == "medium" else "tiny", **kw)


def pipeline(run: zoo.ZooRun, planner: Any, devices, min_stages: int) -> Any:
  """``run``'s step decorated as a user would (``graph_pipeline``)."""
  return gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.microbatches,
    devices=devices,
    planner=planner,
    min_stages=min_stages,
    calibrate=FLAGS.calibrate and isinstance(planner, str),
    layer_depth=run.spec.layer_depth,
  )


def warmed(run: zoo.ZooRun, data, pp) -> Any:
  """``pp``'s step as a training loop calls it (``cached_partial``), compiled and warmed up."""
  train = pp.cached_partial(run.model, run.optimizer)
  for i in range(3):
    jax.block_until_ready(train(data[i % len(data)]))
  return train


def measure(run: zoo.ZooRun, data, trains: list[Any]) -> tuple[list[float], list[float]]:
  """Median wall seconds of a step (the call and the model's arrays ready) of each of
  ``trains``, taken in ``--rounds`` rounds that visit them in turn, and how far each one's
  rounds' medians lie apart (largest over smallest, less one)."""
  times: list[list[float]] = [[] for _ in trains]
  medians: list[list[float]] = [[] for _ in trains]
  per_round = -(-FLAGS.steps // FLAGS.rounds)
  for r in range(FLAGS.rounds):
    for train, found, mids in zip(trains, times, medians):
      jax.block_until_ready((train(data[r % len(data)]), jax.tree.leaves(run.model)))
      these = []
      for i in range(per_round):
        t = time.perf_counter()
        jax.block_until_ready((train(data[i % len(data)]), jax.tree.leaves(run.model)))
        these.append(time.perf_counter() - t)
      found.extend(these)
      mids.append(statistics.median(these))
  return [statistics.median(t) for t in times], [max(m) / min(m) - 1 for m in medians]


def describe(plan) -> dict[str, Any]:
  return dict(
    planner=plan.planner,
    stages=plan.num_stages,
    widths="+".join(str(len(s.devices)) for s in plan.stages),
    microbatches=plan.num_microbatches,
    depth=plan.depth(),
    shape=[[list(s.layers), list(s.devices)] for s in plan.stages],
    edges=[list(e) for e in plan.edges],
    schedule=plan.schedule,
  )


def one(model: str, size: str, n: int) -> dict[str, Any]:
  """The rows of one model, size and device count: each planner's step and plain jit's."""
  run = setup(model, size)
  data = run.batches(FLAGS.batch_size, 2)
  devices = jax.devices()[:n]
  rows: list[dict[str, Any]] = []
  trains = []
  t0 = time.perf_counter()
  ref = None  # a run that compiled: its layer graph and options make plain jit's plan
  for name in FLAGS.planners:
    pp = pipeline(run, name, devices, FLAGS.min_stages)
    try:
      trains.append(warmed(run, data, pp))
    except PlanError as e:
      print(f"  {model} {size}, {n} devices, {name}: no plan ({e})")
      continue
    ref = pp
    planned = pp.compiled.planned
    rows.append(
      dict(
        step=name,
        **describe(pp.plan),
        chosen_by_ms=None if planned.predicted_s is None else planned.predicted_s * 1e3,
        chosen_by=planned.predicted_how,
        note=planned.note,
      )
    )
  # Plain jit: the same step in one call on the first device, as a run's baseline plan.
  if ref is None:
    raise PlanError(f"{model} {size}, {n} devices: no planner found a plan")
  plain = baseline_plans(ref.layer_graph, ref.batch_size, ref.compiled.opts, (1,))["plain jit"]
  trains.append(warmed(run, data, pipeline(run, plain, devices, 1)))
  rows.append(dict(step="plain jit", **describe(plain), chosen_by_ms=None, chosen_by=None))
  setup_s = time.perf_counter() - t0
  seconds, spreads = measure(run, data, trains)
  base = seconds[-1]
  for row, s, apart in zip(rows, seconds, spreads):
    row.update(measured_ms=s * 1e3, ratio_to_plain_jit=s / base, rounds_spread=apart)
  # The same step: the same stages on the same devices, stage edges, micro-batches, schedule.
  keys = ("shape", "edges", "microbatches", "schedule")
  shapes = [json.dumps([r[k] for k in keys]) for r in rows[:-1]]
  return dict(
    model=model,
    size=size,
    devices=n,
    batch_size=FLAGS.batch_size,
    microbatches=FLAGS.microbatches,
    min_stages=FLAGS.min_stages,
    calibrated=FLAGS.calibrate,
    setup_s=setup_s,
    same_plan=len(shapes) > 1 and len(set(shapes)) == 1,
    rows=rows,
  )


def print_table(r: dict[str, Any]) -> None:
  print(
    f"\n{r['model']} {r['size']}, {r['devices']} forced CPU devices, batch {r['batch_size']}, "
    f"M={r['microbatches']}, min_stages={r['min_stages']} "
    f"({'calibrated' if r['calibrated'] else 'devices-only model'}; set-up {r['setup_s']:.0f} s)"
  )
  print(
    f"  {'step':12s} {'planner':10s} {'stages':>6s} {'devices':>9s} {'M':>3s} {'depth':>5s}"
    f" {'ms/step':>9s} {'':8s} {'x plain jit':>11s} {'':8s} {'rounds':>6s}"
    f"  {'chosen by':>10s}"
  )
  for row in r["rows"]:
    chosen = (
      f"{row['chosen_by_ms']:8.2f}ms {row['chosen_by']}" if row["chosen_by_ms"] is not None else "-"
    )
    print(
      f"  {row['step']:12s} {row['planner']:10s} {row['stages']:6d} {row['widths']:>9s} "
      f"{row['microbatches']:3d} {row['depth']:5d} {row['measured_ms']:9.2f} measured "
      f"{row['ratio_to_plain_jit']:11.2f} measured {row['rounds_spread'] * 100:5.0f}%  {chosen}"
    )
  if r["same_plan"]:
    print("  the planners' plans are the same step")


def main(_):
  out = []
  for size in FLAGS.sizes:
    for model in FLAGS.models:
      for n in map(int, FLAGS.devices):
        r = one(model, size, n)
        out.append(r)
        print_table(r)
        if FLAGS.json_out:
          with open(FLAGS.json_out, "w") as f:
            json.dump(out, f, indent=1)
  ratios = {
    name: [row["ratio_to_plain_jit"] for r in out for row in r["rows"] if row["step"] == name]
    for name in FLAGS.planners
  }
  print("\nmeasured step time / plain jit's (median over the configurations):")
  for name, rs in ratios.items():
    if rs:
      print(f"  {name:12s} {statistics.median(rs):.2f}x (range {min(rs):.2f}-{max(rs):.2f}x)")


if __name__ == "__main__":
  app.run(main)
