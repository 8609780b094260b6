"""Throughput vs device count (the paper's Fig. 6) and planner search time (Table 1).

The device sweep runs every planner on every model and device count; ``throughput_table``
(table (a)) and ``search_time_table`` (table (e)) pivot its rows, and ``plot_throughput``
draws table (a), one panel per model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments import plotting
from gpp_jax.experiments.planner_runs import MODEL_LABELS, build_graph, default_batch_size
from gpp_jax.experiments.sweeps import (
  ALL_PLANNERS,
  PAPER_BASELINES,
  Configuration,
  Log,
  Row,
  Sweep,
  by_planner,
  group_rows,
  planner_throughputs,
  progress_label,
  progress_log,
  run_config,
  vs_best_sequential,
)

# CSV header order of each table.
THROUGHPUT_COLUMNS = (
  "model",
  "devices",
  "batch",
  *[f"{p}" for p in ALL_PLANNERS],
  "graphpipe_stages",
  "graphpipe_depth",
  "graphpipe_microbatch",
  "best_sequential",
  "best_sequential_planner",
  "best_sequential_stages",
  "best_sequential_microbatch",
  "speedup",
  "failed",
)
SEARCH_COLUMNS = (
  "model",
  "devices",
  *[f"{p}_s" for p in ALL_PLANNERS],
  "failed",
  "pipedream_over_graphpipe",
  "piper_over_graphpipe",
)


def device_sweep(sweep: Sweep, log: Log = progress_log) -> list[Row]:
  """(a)/(e): every planner on every model and device count."""
  rows = []
  configs = [(m, k) for m in sweep.models for k in sweep.devices]
  for i, (model, k) in enumerate(configs, 1):
    what = f"{MODEL_LABELS.get(model, model)} {k} devices"
    batch = default_batch_size(model, k)
    graph = build_graph(model, sweep.preset, batch)
    cluster = make_cluster(sweep.cluster, k)
    fields = {"model": model, "devices": k, "batch": batch}
    label = progress_label("throughput", what, i, len(configs))
    rows += run_config(sweep.planners, Configuration(graph, cluster, batch, fields, label), log)
  return rows


def throughput_table(device_rows: Sequence[Mapping[str, Any]]) -> list[Row]:
  """(a): one row per (model, devices): each planner's throughput (None: it failed), GraphPipe's
  shape, the best sequential plan and GraphPipe / best sequential."""
  out = []
  for (model, k), rows in group_rows(device_rows, ("model", "devices")).items():
    by, gp, seq = by_planner(rows)
    row = {"model": model, "devices": k, "batch": rows[0]["batch"], **planner_throughputs(by)}
    row.update(
      graphpipe_stages=gp.get("stages"),
      graphpipe_depth=gp.get("depth"),
      graphpipe_microbatch=gp.get("microbatch"),
      **vs_best_sequential(gp, seq),
      best_sequential_stages=seq and seq["stages"],
      best_sequential_microbatch=seq and seq["microbatch"],
      failed=" ".join(r["planner"] for r in rows if "error" in r),
    )
    out.append(row)
  return out


def search_time_table(device_rows: Sequence[Mapping[str, Any]]) -> list[Row]:
  """(e): one row per (model, devices): each planner's search seconds (a failed planner's
  seconds are the time it took to give up, and it is listed in ``failed``), and PipeDream's and
  Piper's time over GraphPipe's (None when that planner failed)."""
  out = []
  for (model, k), rows in group_rows(device_rows, ("model", "devices")).items():
    by = {r["planner"]: r for r in rows}
    row = {"model": model, "devices": k}
    row.update({f"{p}_s": by[p]["seconds"] if p in by else None for p in ALL_PLANNERS})
    row["failed"] = " ".join(r["planner"] for r in rows if "error" in r)
    gp = by.get("graphpipe", {})
    for p in PAPER_BASELINES:
      ok = p in by and "error" not in by[p] and "error" not in gp and gp
      row[f"{p}_over_graphpipe"] = by[p]["seconds"] / gp["seconds"] if ok else None
    out.append(row)
  return out


def plot_throughput(plt, tp: Sequence[Mapping[str, Any]], out_dir: str) -> str:
  """``throughput.png``: table (a), samples/s over devices, one panel per model."""
  models = list(dict.fromkeys(r["model"] for r in tp))
  fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
  for ax, m in zip(axes[0], models):
    plotting.planner_lines(ax, [r for r in tp if r["model"] == m], "devices")
    ax.set_title(MODEL_LABELS.get(m, m))
    ax.set_xlabel("V100 devices (simulated)")
  axes[0][0].legend(fontsize=8)
  return plotting.save(plt, fig, out_dir, "throughput.png")
