"""The ablation: the stage graph alone vs full GraphPipe (the paper's Fig. 9).

``ablation`` (table (d)) compares, per model at one device count, the best sequential plan,
GraphPipe held to that plan's micro-batch size ("parallel") and full GraphPipe;
``plot_ablation`` draws both over the sequential plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments import plotting
from gpp_jax.experiments.planner_runs import MODEL_LABELS, best_row, build_graph, default_batch_size
from gpp_jax.experiments.sweeps import (
  Configuration,
  Log,
  Row,
  Sweep,
  fmt_num,
  progress_label,
  progress_log,
  ratio,
  run_config,
  run_one,
)

# CSV header order of table (d).
ABLATION_COLUMNS = (
  "model",
  "devices",
  "batch",
  "sequential",
  "sequential_planner",
  "sequential_microbatch",
  "parallel",
  "parallel_depth",
  "full",
  "full_microbatch",
  "full_depth",
  "parallel_speedup",
  "full_speedup",
)


def ablation(
  sweep: Sweep, device_rows: Sequence[Mapping[str, Any]] = (), log: Log = progress_log
) -> list[Row]:
  """(d): per model at ``ablation_devices``: the best sequential plan, GraphPipe at that plan's
  micro-batch size ("parallel": the stage-graph effect alone) and full GraphPipe (its own
  micro-batch choice). Reuses ``device_rows`` of that device count when given."""
  k = sweep.ablation_devices
  out = []
  for i, model in enumerate(sweep.models, 1):
    label = progress_label(
      "ablation", f"{MODEL_LABELS.get(model, model)} {k} devices", i, len(sweep.models)
    )
    have: Sequence[Mapping[str, Any]] = [
      r for r in device_rows if r["model"] == model and r["devices"] == k
    ]
    batch = default_batch_size(model, k)
    graph = build_graph(model, sweep.preset, batch)
    cluster = make_cluster(sweep.cluster, k)
    if not have:
      fields = {"model": model, "devices": k, "batch": batch}
      config = Configuration(graph, cluster, batch, fields, label + " every planner")
      have = run_config(sweep.planners, config, log)
    full = next(r for r in have if r["planner"] == "graphpipe")
    seq = best_row(have, [p for p in sweep.planners if p != "graphpipe"])
    row = {
      "model": model,
      "devices": k,
      "batch": batch,
      "full": full.get("throughput"),
      "full_microbatch": full.get("microbatch"),
      "full_depth": full.get("depth"),
    }
    if seq is not None:
      log(f"{label} GraphPipe at micro-batch {seq['microbatch']} ...")
      par = run_one("graphpipe", graph, cluster, batch, num_microbatches=batch // seq["microbatch"])
      row.update(
        sequential=seq["throughput"],
        sequential_planner=seq["planner"],
        sequential_microbatch=seq["microbatch"],
        parallel=par.get("throughput"),
        parallel_depth=par.get("depth"),
      )
    out.append(row)
    log(
      f"{label}: sequential {fmt_num(row.get('sequential'))} "
      f"({row.get('sequential_planner')}, mb {row.get('sequential_microbatch')}), parallel "
      f"{fmt_num(row.get('parallel'))}, full {fmt_num(row['full'])} "
      f"(mb {row['full_microbatch']})"
    )
  return [_with_ratios(r) for r in out]


def _with_ratios(row: dict[str, Any]) -> Row:
  seq = row.get("sequential")
  row["parallel_speedup"] = ratio(row.get("parallel"), seq)
  row["full_speedup"] = ratio(row.get("full"), seq)
  return {c: row.get(c) for c in ABLATION_COLUMNS}


def plot_ablation(plt, ab: Sequence[Mapping[str, Any]], out_dir: str) -> str:
  """``ablation.png``: table (d), "parallel" and full GraphPipe over the best sequential plan
  per model."""
  fig, ax = plt.subplots(figsize=(5, 3.6))
  plotting.ratio_bars(
    ax,
    [MODEL_LABELS.get(r["model"], r["model"]) for r in ab],
    [
      ("best sequential", [1.0 for _ in ab]),
      ("Parallel", [r["parallel_speedup"] or 0 for r in ab]),
      ("GraphPipe", [r["full_speedup"] or 0 for r in ab]),
    ],
    0.27,
    f"throughput / best sequential ({ab[0]['devices']} devices)",
  )
  return plotting.save(plt, fig, out_dir, "ablation.png")
