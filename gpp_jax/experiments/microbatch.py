"""The micro-batch sweep: every planner held to one micro-batch size (the paper's Fig. 7 right).

``microbatch_sweep`` runs one model at a fixed device count and mini-batch, one fixed
micro-batch size at a time; ``microbatch_table`` (table (c)) pivots its rows and
``plot_microbatch`` draws samples/s over the micro-batch size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments import plotting
from gpp_jax.experiments.planner_runs import MODEL_LABELS, build_graph
from gpp_jax.experiments.sweeps import (
  ALL_PLANNERS,
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
from gpp_jax.passes.partition.plan_assembly import microbatch_sizes

# CSV header order of table (c).
MICROBATCH_COLUMNS = (
  "microbatch",
  "num_microbatches",
  *ALL_PLANNERS,
  "graphpipe_depth",
  "best_sequential",
  "best_sequential_planner",
  "best_sequential_depth",
  "speedup",
)


def microbatch_sweep(sweep: Sweep, log: Log = progress_log) -> list[Row]:
  """(c): one model at a fixed device count and mini-batch, one fixed micro-batch size at a
  time (every planner gets ``num_microbatches = batch / microbatch``)."""
  rows = []
  B, k = sweep.microbatch_batch, sweep.microbatch_devices
  graph = build_graph(sweep.microbatch_model, sweep.preset, B)
  cluster = make_cluster(sweep.cluster, k)
  sizes = list(sweep.microbatch_list) or microbatch_sizes(B)
  label = MODEL_LABELS.get(sweep.microbatch_model, sweep.microbatch_model)
  for i, b in enumerate(sizes, 1):
    fields = {"model": sweep.microbatch_model, "devices": k, "batch": B, "microbatch_size": b}
    what = progress_label("micro-batch", f"{label} micro-batch {b}, {k} devices", i, len(sizes))
    config = Configuration(graph, cluster, B, fields, what)
    rows += run_config(sweep.planners, config, log, num_microbatches=B // b)
  return rows


def microbatch_table(mb_rows: Sequence[Mapping[str, Any]]) -> list[Row]:
  """(c): one row per micro-batch size: each planner's throughput at that fixed size."""
  out = []
  for (b,), rows in group_rows(mb_rows, ("microbatch_size",)).items():
    by, gp, seq = by_planner(rows)
    row = {"microbatch": b, "num_microbatches": rows[0]["batch"] // b, **planner_throughputs(by)}
    row.update(
      graphpipe_depth=gp.get("depth"),
      **vs_best_sequential(gp, seq),
      best_sequential_depth=seq and seq["depth"],
    )
    out.append(row)
  return out


def plot_microbatch(plt, mb: Sequence[Mapping[str, Any]], out_dir: str) -> str:
  """``microbatch.png``: table (c), each planner's samples/s over the micro-batch size."""
  fig, ax = plt.subplots(figsize=(5, 3.6))
  plotting.planner_lines(ax, mb, "microbatch")
  ax.set_xlabel("micro-batch size (fixed)")
  ax.legend(fontsize=8)
  return plotting.save(plt, fig, out_dir, "microbatch.png")
