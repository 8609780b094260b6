"""Planning from the command line: several planners' plans for one model and cluster, side by side.

  python -m gpp_jax.plan --model=dlrm --preset=paper --cluster=v100 --num_devices=32 \\
      --planner=graphpipe,pipedream,piper,bapipe,luo

Prints each planner's Plan table, then one summary row per planner: stages, depth, micro-batch,
predicted iteration time, throughput, peak memory per device and search time. Nothing is run:
the numbers are the cost model's and simulator's predictions for the cluster preset. A planner
that cannot plan (Piper's state limit, no plan fitting memory) gets its error message in its
row. ``--json=PATH`` also writes the rows and plans as JSON.

Models are the synthetic LayerGraphs of ``gpp_jax.experiments.model_graphs``
(``--preset=paper``: the GraphPipe paper's shapes; ``--preset=tiny``: the same topologies at
small widths);
``--shape=branches=16`` overrides a shape argument. The mini-batch defaults to
``planner_runs.PER_DEVICE_BATCH[model]`` samples per device.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments.planner_runs import (
  MODEL_LABELS,
  build_graph,
  default_batch_size,
  run_planners,
  short_error,
)
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition import get_planner

FLAGS = flags.FLAGS
DEFAULT_PLANNERS = ("graphpipe", "pipedream", "piper", "bapipe", "luo")


def define_flags() -> None:
  """Defines the CLI's flags (called by ``run``; other entry points define flags of the same
  names, so importing this module defines none)."""
  flags.DEFINE_string("model", "dlrm", "model graph: mmt, dlrm, candle_uno, gpt or chain")
  flags.DEFINE_enum("preset", "paper", ["paper", "tiny"], "model shapes: the paper's or tiny")
  flags.DEFINE_list("shape", [], "shape overrides as key=value (e.g. branches=16,layers=2)")
  flags.DEFINE_enum("cluster", "v100", ["v100", "cuda", "cpu"], "cluster preset")
  flags.DEFINE_integer("num_devices", 8, "devices in the cluster")
  flags.DEFINE_list("planner", list(DEFAULT_PLANNERS), "planners to run, in this order")
  flags.DEFINE_integer(
    "batch_size", None, "mini-batch size (default: per-model samples per device x num_devices)"
  )
  flags.DEFINE_integer(
    "num_microbatches",
    None,
    "fix the number of micro-batches (default: each planner sweeps micro-batch sizes)",
  )
  flags.DEFINE_string("json", None, "also write the results to this JSON file")


def parse_shape(items: Sequence[str]) -> dict[str, int]:
  """``["branches=16", "layers=2"]`` -> ``{"branches": 16, "layers": 2}``."""
  shape = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"--shape entries are key=value, got {item!r}")
    try:
      shape[key.strip()] = int(value)
    except ValueError:
      raise ValueError(f"--shape {key}: expected an integer, got {value!r}") from None
  return shape


def compare(
  model: str,
  *,
  preset: str = "paper",
  cluster: str = "v100",
  num_devices: int = 8,
  planners: Sequence[str] = DEFAULT_PLANNERS,
  batch_size: int | None = None,
  num_microbatches: int | None = None,
  shape: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Runs ``planners`` on one model and cluster; returns the configuration and one row per
  planner (``planner_runs.run_planner`` rows, each with its ``plan`` when it planned)."""
  for name in planners:
    get_planner(name)  # an unknown name fails before anything runs
  batch = batch_size or default_batch_size(model, num_devices)
  graph = build_graph(model, preset, batch, **dict(shape or {}))
  cl = make_cluster(cluster, num_devices)
  rows = run_planners(planners, graph, cl, batch, num_microbatches=num_microbatches, keep_plan=True)
  return {
    "model": model,
    "graph": graph.graph.get("name", model),
    "layers": len(graph),
    "preset": preset,
    "cluster": cl.name,
    "num_devices": num_devices,
    "memory_per_device": cl.memory_per_device,
    "batch_size": batch,
    "num_microbatches": num_microbatches,
    "shape": dict(shape or {}),
    "results": rows,
  }


def format_report(report: Mapping[str, Any]) -> str:
  """The plans one after another, then the side-by-side summary table."""
  rows = report["results"]
  lines = [
    f"Planning {MODEL_LABELS.get(report['model'], report['model'])} "
    f"({report['graph']}, {report['layers']} layers, {report['preset']} preset) on "
    f"{report['cluster']}, mini-batch {report['batch_size']}"
    + (f", {report['num_microbatches']} micro-batches" if report["num_microbatches"] else "")
    + ". Nothing is run: times are simulated predictions.",
    "",
  ]
  for r in rows:
    lines.append(f"== {r['planner']} (search {r['seconds']:.2f} s) ==")
    lines.append(str(r["plan"]) if "plan" in r else f"no plan: {r['error']}")
    lines.append("")
  best = max((r["throughput"] for r in rows if r.get("throughput")), default=None)
  header = (
    f"{'planner':10s} {'stages':>6s} {'depth':>5s} {'mb':>5s} {'M':>4s} "
    f"{'iter ms':>10s} {'samples/s':>11s} {'peak GiB':>8s} {'fits':>4s} "
    f"{'search s':>8s} {'vs best':>7s}"
  )
  lines += [
    f"Summary ({report['cluster']}, {report['memory_per_device'] / 2**30:.0f} GiB per device)",
    header,
    "-" * len(header),
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['planner']:10s} FAILED after {r['seconds']:.2f} s: {short_error(r)}")
      continue
    lines.append(
      f"{r['planner']:10s} {r['stages']:6d} {r['depth']:5d} {r['microbatch']:5d} "
      f"{r['num_microbatches']:4d} {r['iteration_time'] * 1e3:10.3f} {r['throughput']:11.1f} "
      f"{r['max_memory'] / 2**30:8.2f} {'yes' if r['memory_ok'] else 'NO':>4s} "
      f"{r['seconds']:8.2f} {r['throughput'] / best:7.3f}"
    )
  return "\n".join(lines)


def report_to_json(report: Mapping[str, Any]) -> dict[str, Any]:
  """The report with each Plan as its dict (``Plan.from_dict`` reads it back)."""
  out = dict(report)
  out["results"] = [
    {k: (v.to_dict() if isinstance(v, Plan) else v) for k, v in r.items()}
    for r in report["results"]
  ]
  return out


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; everything is given as --flags")
  try:
    report = compare(
      FLAGS.model,
      preset=FLAGS.preset,
      cluster=FLAGS.cluster,
      num_devices=FLAGS.num_devices,
      planners=FLAGS.planner,
      batch_size=FLAGS.batch_size,
      num_microbatches=FLAGS.num_microbatches,
      shape=parse_shape(FLAGS.shape),
    )
  except ValueError as e:  # unknown model, planner or shape: a usage error, no traceback
    raise app.UsageError(str(e)) from None
  print(format_report(report))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report_to_json(report), f, indent=1)
    print(f"\nwrote {FLAGS.json}")


def run(argv: Sequence[str] | None = None) -> None:
  """Defines the flags and runs ``main`` under absl (``python -m gpp_jax.plan``)."""
  define_flags()
  app.run(main, argv=None if argv is None else list(argv))


if __name__ == "__main__":
  run()
