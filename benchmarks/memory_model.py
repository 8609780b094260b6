"""The planners' memory model against measured memory, per device and per term.

  python benchmarks/memory_model.py                              # the default configurations
  python benchmarks/memory_model.py --models=mmt --presets=tiny --devices=4 --schedules=1f1b

The planners choose and refuse plans by the cost model's memory per stage (``cost.cost_model``:
``plan_costs``' static and per-micro-batch terms, summed per device by the simulator); the
training program reports it per device as ``planned_peak_bytes`` (``cli.reporting
.planned_peaks``). This benchmark checks it against the measured peak: for each configuration
(a zoo model at a preset, a planner's pipelined plan with ``min_stages=2`` on forced CPU
devices, a schedule), in a process of its own so that nothing another configuration left
alive is counted, it runs one step and one memory-measuring step (``GraphPipeline
.measure_memory``: every array alive on each device at every instruction boundary plus the
running executable's temporaries) and prints per device:

* the measured peak, the planned peak and planned / measured;
* the measured breakdown at the peak (parameters, optimizer state, gradients, stashed
  activations, activations and cotangents, batch, temporaries, optimizer work, constants,
  outside the step: arrays alive before the step);
* the cost model's terms for the same device (``cost_model.memory_terms``): parameters,
  gradients, optimizer state, stashed activations (per micro-batch times the micro-batches the
  simulated schedule holds at once), temporaries, batch, and what else the model counts;
* where the measured peak falls (the program's instruction at its predicted peak, which
  matches the measured one to the byte on these runs).

The last line gives, over every device holding at least ``--min_mib`` MiB, the worst
planned / measured ratio and how many are within ``--tolerance``.
"""

from __future__ import annotations

import json
import os

from absl import app, flags
from child_runs import run_child

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno", "gpt"], "zoo models")
flags.DEFINE_list("presets", ["tiny", "medium"], "tiny (the zoo's) or medium (sizes below)")
flags.DEFINE_list("devices", ["4", "8"], "forced CPU device counts")
flags.DEFINE_list(
  "planners",
  ["graphpipe", "pipedream"],
  "planners (with min_stages=2); also 'plain jit' (one device) and 'jit data parallel' (every "
  "device), the step as one call of the whole batch",
)
flags.DEFINE_list("schedules", ["1f1b", "gpipe"], "schedules")
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
flags.DEFINE_integer("min_stages", 2, "the planners' min_stages")
flags.DEFINE_float("min_mib", 1.0, "devices below this measured peak are shown, not judged")
flags.DEFINE_float("tolerance", 0.15, "planned within this fraction of measured counts as right")
flags.DEFINE_boolean("terms", True, "print the measured breakdown and the modelled terms")
flags.DEFINE_string("json", None, "also write every configuration's result to this file")
flags.DEFINE_string("child", None, "internal: run one configuration (JSON) and print its result")

# Medium sizes: the zoo's (``zoo.MEDIUM``), and a GPT of the MMT medium's scale.
GPT_MEDIUM = dict(vocab_size=2048, seq_len=32, hidden=128, num_layers=4, num_heads=4, ffn=512)

# Measured categories in print order (``runtime.memory``), short names for the table.
MEASURED = {
  "parameters": "param",
  "optimizer state": "opt",
  "gradients": "grad",
  "stashed activations": "stash",
  "activations and cotangents": "act/ct",
  "batch": "batch",
  "temporaries": "temp",
  "optimizer work": "opt work",
  "constants": "const",
  "other": "other",
  "outside the step": "outside",
}


def _run_child(cfg: dict) -> dict:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cfg['n']}"
  )
  import jax

  import gpp_jax
  from gpp_jax.cli import reporting
  from gpp_jax.cost.cluster import process_cluster
  from gpp_jax.cost.cost_model import memory_terms
  from gpp_jax.experiments import zoo
  from gpp_jax.ir import layer_graph as lg
  from gpp_jax.passes.simulation import simulate

  name, preset = cfg["model"], cfg["preset"]
  if preset == "medium":
    sizes = GPT_MEDIUM if name == "gpt" else zoo.MEDIUM[name]
    run = zoo.setup(name, "paper", **sizes)
  else:
    run = zoo.setup(name, "tiny")
  batch = run.batches(cfg["batch"], 1)[0]
  devices = jax.devices()[: cfg["n"]]
  cluster = process_cluster(devices)
  kw: dict = dict(cluster=cluster, layer_depth=run.spec.layer_depth, calibrate=False)
  planner = cfg["planner"]
  if planner in ("plain jit", "jit data parallel"):  # one stage: the step as one call
    probe = gpp_jax.graph_pipeline(run.train_step, num_microbatches=1, **kw)
    layers = tuple(probe.layer_graph_for(run.model, run.optimizer, batch).nodes)
    width = 1 if planner == "plain jit" else len(devices)
    devices = devices[:width]
    stage = gpp_jax.Stage(0, layers, tuple(range(width)))
    plan = gpp_jax.Plan((stage,), (), 1, batch_size=cfg["batch"])
    pp = gpp_jax.graph_pipeline(
      run.train_step, num_microbatches=1, devices=devices, planner=plan, **kw
    )
  else:
    pp = gpp_jax.graph_pipeline(
      run.train_step,
      num_microbatches=cfg["m"],
      devices=devices,
      planner=planner,
      schedule=cfg["schedule"],
      min_stages=cfg["min_stages"],
      **kw,
    )
  pp(run.model, run.optimizer, batch)
  pp.measure_memory(run.model, run.optimizer, batch)
  c = pp.compiled
  planned = reporting.planned_peaks(pp, cluster)
  graph = lg.scaled(pp.layer_graph, pp.batch_size)
  sim = simulate(pp.plan, graph, cluster, timeline=False)
  terms = memory_terms(pp.plan, graph, cluster)
  ex = c.executor_for(1)
  program = c.predicted_memory(ex.temps)
  where = {
    str(d): (ex.program.instrs[k].label() if k >= 0 else "start") for d, k in program.at.items()
  }
  modelled: dict[str, dict[str, float]] = {}
  for s, place in enumerate(c.staged.placements):
    fixed, per_mb = terms[s]
    flight = sim.peak_in_flight[s]
    for d in place.devices:
      row = modelled.setdefault(str(d), {})
      for k, v in fixed.items():
        row[k] = row.get(k, 0.0) + v
      for k, v in per_mb.items():
        row[k] = row.get(k, 0.0) + v * flight
  out = []
  for d in pp.memory.devices:
    out.append(
      {
        "device": d.device,
        "measured": d.measured_peak_bytes,
        "planned": planned.get(d.device, 0.0),
        "breakdown": dict(d.breakdown),
        "modelled": modelled.get(d.device, {}),
        "at": where.get(d.device, "?"),
      }
    )
  return {
    "stages": pp.plan.num_stages,
    "widths": [len(s.devices) for s in pp.plan.stages],
    "schedule": pp.schedule.name,
    "in_flight": list(sim.peak_in_flight),
    "devices": out,
  }


def child(cfg: dict) -> dict:
  return run_child(__file__, cfg)


def mib(x: float) -> str:
  return f"{x / 2**20:.3f}"


def _terms(row: dict[str, float]) -> str:
  return " ".join(f"{k} {mib(v)}" for k, v in row.items() if v)


def main(argv):
  del argv
  if FLAGS.child:
    print("RESULT " + json.dumps(_run_child(json.loads(FLAGS.child))), flush=True)
    return
  print(
    f"planned (the cost model's peak per device, what the planners choose and refuse by) vs "
    f"measured (peak per device over a memory-measuring step); batch {FLAGS.batch_size}, "
    f"{FLAGS.microbatches} micro-batches, min_stages={FLAGS.min_stages}; MiB"
  )
  print(
    f"{'model':10s} {'preset':6s} {'n':>2s} {'planner':9s} {'schedule':8s} {'device':>7s} "
    f"{'measured':>9s} {'planned':>9s} {'ratio':>6s}  peak at"
  )
  results = []
  judged = []
  for model in FLAGS.models:
    for preset in FLAGS.presets:
      for n in map(int, FLAGS.devices):
        for planner in FLAGS.planners:
          one_call = planner in ("plain jit", "jit data parallel")
          for schedule in FLAGS.schedules[:1] if one_call else FLAGS.schedules:
            cfg = dict(
              model=model, preset=preset, n=n, planner=planner, schedule=schedule,
              batch=FLAGS.batch_size, m=FLAGS.microbatches, min_stages=FLAGS.min_stages,
            )  # fmt: skip
            r = child(cfg)
            results.append({**cfg, **r})
            head = f"{model:10s} {preset:6s} {n:2d} {planner:9s} {schedule:8s}"
            if "error" in r:
              print(f"{head} failed: {r['error'][:100]}", flush=True)
              continue
            print(
              f"{head} {r['stages']} stages (devices {'/'.join(map(str, r['widths']))}), "
              f"schedule {r['schedule']}, micro-batches in flight {r['in_flight']}"
            )
            for d in r["devices"]:
              ratio = d["planned"] / max(d["measured"], 1)
              big = d["measured"] >= FLAGS.min_mib * 2**20
              if big:
                judged.append((ratio, f"{model}/{preset}/{n}/{planner}/{schedule}/{d['device']}"))
              mark = "" if not big else (" ok" if abs(ratio - 1) <= FLAGS.tolerance else " off")
              print(
                f"{'':38s} {d['device']:>7s} {mib(d['measured']):>9s} {mib(d['planned']):>9s} "
                f"{ratio:6.2f}{mark:4s} {d['at']}",
                flush=True,
              )
              if FLAGS.terms:
                measured = {MEASURED.get(k, k): v for k, v in d["breakdown"].items()}
                measured = {k: measured[k] for k in MEASURED.values() if k in measured}
                print(f"{'':46s} measured: {_terms(measured)}")
                print(f"{'':46s} modelled: {_terms(d['modelled'])}")
  if judged:
    worst = max(judged, key=lambda x: abs(x[0] - 1))
    ok = sum(abs(r - 1) <= FLAGS.tolerance for r, _ in judged)
    print(
      f"devices of >= {FLAGS.min_mib:g} MiB: {ok} of {len(judged)} planned within "
      f"{FLAGS.tolerance:.0%} of measured; worst {worst[0]:.2f} ({worst[1]})"
    )
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
