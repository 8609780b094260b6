"""A candidate's predicted step time against the training loop's, measured in one run.

  python benchmarks/trial_vs_loop.py                 # tiny MMT, CANDLE-Uno, DLRM; 4 devices
  python benchmarks/trial_vs_loop.py --models=mmt --devices=8

For each model (zoo, tiny preset, batch ``--batch_size``), ``graph_pipeline(calibrate=True)``
chooses among its candidates as it always does; then the chosen step runs as
``gpp_jax.train`` runs it (``cached_partial``, the loss fetched every ``--log_every`` steps)
for ``--steps`` steps, and the step time is the median over the logged intervals after the
first. Printed per model: the chosen candidate, whether its time is measured (a timing
trial) or modelled (the cost model, calibrated), the time it was chosen by, the trial's own
seconds (``Planned.measured``), the host's time outside the step that the prediction adds
(``HostCosts.outside``: measured on the step's own path, ``cached_partial``'s), the loop's
measured step time (and the range of its logged intervals' own step times: how far the loop
moves by itself), the prediction's error against it, and for comparison the decorated
call's time outside the step on the same objects (``GraphPipeline.seconds_outside``);
once per ``--round_calls`` (the trials' runs issued back to back per round, 1 being each
run waited for). Every row runs in a process of its own; ``--repeats`` runs each
(model, round) that many times, and a last line per pair gives the median of its errors
(sub-millisecond steps on shared cores move between processes: one run does not settle 10%).

Then, in the same process, the chosen step's timing trial (``build.time_step``, as the plan
choice ran it, plus the same outside time) and a window of ``--log_every`` loop steps
alternate ``--alternations`` times: each trial is compared with the loop window right after
it, so that what the trial times is set against the loop on the same machine state, apart
from the drift between planning and training. Printed per row: the median of those errors,
their range and how many are within 10%.
"""

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "candle_uno", "dlrm"], "zoo models (tiny preset)")
flags.DEFINE_integer("devices", 4, "forced CPU devices")
flags.DEFINE_integer("batch_size", 64, "samples per step")
flags.DEFINE_integer(
  "num_microbatches", 8, "the pipelines' micro-batches (gpp_jax.train's default)"
)
flags.DEFINE_integer("steps", 2000, "steps the loop runs after the first")
flags.DEFINE_integer("log_every", 200, "steps between the loop's clock readings")
flags.DEFINE_list(
  "round_calls",
  ["16"],
  "trials timed with up to each of these many runs issued back to back per round "
  "(runtime.build.ROUND_CALLS; 1: each run waited for), one row each",
)
flags.DEFINE_integer(
  "alternations", 5, "trial / loop-window pairs timed after the loop in the same process"
)
flags.DEFINE_integer("repeats", 1, "processes per (model, round); the median error is printed")
flags.DEFINE_string("child", None, "internal: run one model and print its record as JSON")


def child(cfg: dict) -> dict:
  import statistics
  import time

  import jax

  import gpp_jax
  from gpp_jax.experiments import zoo
  from gpp_jax.runtime import build

  build.ROUND_CALLS = cfg["round_calls"]
  build.MIN_ROUND_CALLS = min(build.MIN_ROUND_CALLS, cfg["round_calls"])
  run = zoo.setup(cfg["model"], "tiny")
  data = run.batches(cfg["batch_size"], 4)
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=cfg["num_microbatches"],
    devices=jax.devices()[: cfg["devices"]],
    calibrate=True,
    layer_depth=run.spec.layer_depth,
  )
  train = pp.cached_partial(run.model, run.optimizer)
  jax.block_until_ready(train(data[0]))
  planned = pp.compiled.planned
  intervals = []
  t, n = time.perf_counter(), 0
  for step in range(1, cfg["steps"] + 1):
    loss = train(data[step % len(data)])
    n += 1
    if step % cfg["log_every"] == 0:
      jax.block_until_ready(loss)
      now = time.perf_counter()
      intervals.append((now - t) / n)
      t, n = now, 0
  steady = intervals[1:] or intervals
  loop = statistics.median(steady)
  # The chosen step's trial and a loop window, alternated: each trial against the loop
  # window right after it.
  from gpp_jax.runtime.capture_step import functionalize

  outside = planned.host.outside if planned.host is not None else 0.0
  pairs = []
  for _ in range(cfg["alternations"]):
    _, now_leaves = functionalize(run.train_step, (run.model, run.optimizer, data[0]))
    trial = build.time_step(pp.compiled, now_leaves, outside=outside) + outside
    jax.block_until_ready(train(data[0]))
    t = time.perf_counter()
    for step in range(cfg["log_every"]):
      loss = train(data[step % len(data)])
    jax.block_until_ready(loss)
    pairs.append((trial * 1e3, (time.perf_counter() - t) / cfg["log_every"] * 1e3))
  # The decorated call's time outside the program on the same objects, for comparison (the
  # loop calls ``cached_partial``, whose path the prediction was made with).
  full = (run.model, run.optimizer, data[0])
  pure, leaves = functionalize(run.train_step, full)
  return {
    "model": cfg["model"],
    "round_calls": cfg["round_calls"],
    "chosen": planned.chosen,
    "how": planned.predicted_how,
    "predicted_ms": planned.predicted_s * 1e3,
    "trial_ms": planned.measured.get(planned.chosen, float("nan")) * 1e3,
    "outside_ms": (planned.host.outside if planned.host is not None else 0.0) * 1e3,
    "decorated_outside_ms": pp.seconds_outside(full, pure, leaves) * 1e3,
    "loop_ms": loop * 1e3,
    "loop_range_ms": [min(steady) * 1e3, max(steady) * 1e3],
    "alternated_ms": pairs,
  }


def main(argv):
  del argv
  if FLAGS.child:
    print("RESULT " + json.dumps(child(json.loads(FLAGS.child))))
    return
  print(
    f"predicted step time against the training loop's, {FLAGS.devices} forced CPU devices, "
    f"batch {FLAGS.batch_size}, {len(os.sched_getaffinity(0))} cores (measured in one run)"
  )
  print(
    f"{'model':11s} {'round':>5s} {'chosen':26s} {'how':9s} {'predicted':>9s} {'trial':>7s}"
    f" {'outside':>8s} {'loop':>7s} {'error':>7s} {'decorated outside':>17s}"
    f" {'loop intervals':>15s}"
  )
  for model in FLAGS.models:
    for calls in FLAGS.round_calls:
      errors = [e for e in (_row(model, calls) for _ in range(FLAGS.repeats)) if e is not None]
      if FLAGS.repeats > 1 and errors:
        print(
          f"{model:11s} {calls:>5s} median error over {len(errors)} runs: "
          f"{statistics.median(errors):+.0%} (range {min(errors):+.0%} to {max(errors):+.0%})",
          flush=True,
        )


def _row(model: str, calls: str) -> float | None:
  """One process: ``model`` with ``calls`` runs per trial round; prints its row and returns
  the prediction's error against the loop (None where the process failed)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={FLAGS.devices}"
  cfg = {
    "model": model,
    "round_calls": int(calls),
    "devices": FLAGS.devices,
    "batch_size": FLAGS.batch_size,
    "num_microbatches": FLAGS.num_microbatches,
    "steps": FLAGS.steps,
    "log_every": FLAGS.log_every,
    "alternations": FLAGS.alternations,
  }
  out = subprocess.run(
    [sys.executable, __file__, f"--child={json.dumps(cfg)}"],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
  if line is None:
    print(f"{model:11s} {calls:>5s} failed: {out.stderr.strip().splitlines()[-1:]}")
    return None
  r = json.loads(line[len("RESULT ") :])
  err = r["predicted_ms"] / r["loop_ms"] - 1
  print(
    f"{model:11s} {calls:>5s} {r['chosen']:26s} {r['how']:9s} {r['predicted_ms']:8.2f}ms"
    f" {r['trial_ms']:6.2f}ms {r['outside_ms']:7.2f}ms {r['loop_ms']:6.2f}ms {err:+7.0%}"
    f" {r['decorated_outside_ms']:15.2f}ms"
    f" {r['loop_range_ms'][0]:6.2f}-{r['loop_range_ms'][1]:.2f}ms",
    flush=True,
  )
  alt = [trial / loop - 1 for trial, loop in r["alternated_ms"]]
  if alt:
    near = sum(abs(e) <= 0.10 for e in alt)
    print(
      f"{'':11s} {'':>5s} alternated in this process: trial against the next loop window "
      f"{statistics.median(alt):+.0%} median ({min(alt):+.0%} to {max(alt):+.0%}), "
      f"{near} of {len(alt)} within 10%",
      flush=True,
    )
  return err


if __name__ == "__main__":
  app.run(main)
