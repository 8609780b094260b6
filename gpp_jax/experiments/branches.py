"""The branch sweep: CANDLE-Uno with more and more branches (the paper's Fig. 7 left).

``branch_sweep`` runs every planner on CANDLE-Uno with each branch count at one device count;
``branch_table`` (table (b)) sets GraphPipe beside PipeDream and the best sequential plan, and
``plot_branches`` draws the two ratios per branch count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments import plotting
from gpp_jax.experiments.planner_runs import build_graph, default_batch_size
from gpp_jax.experiments.sweeps import (
  Configuration,
  Log,
  Row,
  Sweep,
  by_planner,
  group_rows,
  progress_label,
  progress_log,
  ratio,
  run_config,
  vs_best_sequential,
)

# CSV header order of table (b).
BRANCH_COLUMNS = (
  "branches",
  "devices",
  "batch",
  "graphpipe",
  "graphpipe_stages",
  "graphpipe_depth",
  "graphpipe_microbatch",
  "pipedream",
  "pipedream_stages",
  "best_sequential",
  "best_sequential_planner",
  "speedup",
  "speedup_vs_pipedream",
)


def branch_sweep(sweep: Sweep, log: Log = progress_log) -> list[Row]:
  """(b): CANDLE-Uno with each branch count at ``branch_devices`` devices."""
  rows = []
  k = sweep.branch_devices
  batch = default_batch_size("candle_uno", k)
  cluster = make_cluster(sweep.cluster, k)
  for i, b in enumerate(sweep.branches, 1):
    graph = build_graph("candle_uno", sweep.preset, batch, branches=b)
    fields = {"model": f"candle_uno:branches={b}", "branches": b, "devices": k, "batch": batch}
    label = progress_label(
      "branches", f"CANDLE-Uno {b} branches, {k} devices", i, len(sweep.branches)
    )
    rows += run_config(sweep.planners, Configuration(graph, cluster, batch, fields, label), log)
  return rows


def branch_table(branch_rows: Sequence[Mapping[str, Any]]) -> list[Row]:
  """(b): one row per branch count: GraphPipe, PipeDream and the best sequential plan."""
  out = []
  for (b,), rows in group_rows(branch_rows, ("branches",)).items():
    by, gp, seq = by_planner(rows)
    pd = by.get("pipedream", {})
    out.append(
      {
        "branches": b,
        "devices": rows[0]["devices"],
        "batch": rows[0]["batch"],
        "graphpipe": gp.get("throughput"),
        "graphpipe_stages": gp.get("stages"),
        "graphpipe_depth": gp.get("depth"),
        "graphpipe_microbatch": gp.get("microbatch"),
        "pipedream": pd.get("throughput"),
        "pipedream_stages": pd.get("stages"),
        **vs_best_sequential(gp, seq),
        "speedup_vs_pipedream": ratio(gp.get("throughput"), pd.get("throughput")),
      }
    )
  return out


def plot_branches(plt, br: Sequence[Mapping[str, Any]], out_dir: str) -> str:
  """``branches.png``: table (b), GraphPipe / PipeDream and / best sequential per branch
  count."""
  fig, ax = plt.subplots(figsize=(5, 3.6))
  plotting.ratio_bars(
    ax,
    [str(r["branches"]) for r in br],
    [
      ("GraphPipe / PipeDream", [r["speedup_vs_pipedream"] or 0 for r in br]),
      ("GraphPipe / best sequential", [r["speedup"] or 0 for r in br]),
    ],
    0.4,
    "throughput ratio",
  )
  ax.axhline(1.0, color="k", linewidth=0.8)
  ax.set_xlabel(f"CANDLE-Uno branches ({br[0]['devices']} devices)")
  return plotting.save(plt, fig, out_dir, "branches.png")
