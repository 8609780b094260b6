"""Running planners side by side: model graphs, clusters and one result row per planner.

What the planning CLI (``python -m gpp_jax.plan``), the planner benchmark
(``benchmarks/planners.py``) and the paper reproduction (``gpp_jax.experiments.reproduce``)
share: which synthetic LayerGraph a model name and preset stand for, the default mini-batch,
the cluster presets by name, and ``run_planner``, which runs one planner and turns its Plan
(or its PlanError) into a flat, JSON-friendly row.

Presets:
  paper  the GraphPipe paper's shapes (``gpp_jax.experiments.model_graphs`` defaults, and for
         DLRM the paper's concatenated bags and 4096-wide dense outputs: ``PAPER_SHAPES``).
  tiny   the same topologies at small widths, so every planner answers in well under a second.

Mini-batch: the paper sizes mini-batches "close to the memory limit" (its table is lost), so the
default grows with the device count: ``PER_DEVICE_BATCH[model] * num_devices``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.errors import PlanError
from gpp_jax.experiments import model_graphs
from gpp_jax.passes.partition import PLANNERS, SEQUENTIAL_PLANNERS

# Samples per device of the default mini-batch (the planner benchmark's choice).
PER_DEVICE_BATCH = {"mmt": 8, "dlrm": 128, "candle_uno": 128, "gpt": 8, "chain": 8}

# Small shapes with the paper models' topologies (branch counts kept, widths cut).
TINY_SHAPES: dict[str, dict[str, Any]] = {
  "mmt": dict(branches=4, layers=2, seq=16, hidden=64, heads=4, ffn=256),
  "dlrm": dict(
    dense_branches=3,
    dense_layers=2,
    hidden=256,
    sparse_branches=3,
    embedding_dim=16,
    bag_size=8,
    rows=10_000,
    top_layers=2,
  ),
  # 4 layers per tower, as the paper's: 5^7 downsets, past Piper's limit as at the paper's shape.
  "candle_uno": dict(branches=7, layers=4, hidden=256, top_layers=2),
  "gpt": dict(layers=4, seq=64, hidden=128, heads=4, vocab=1000),
  "chain": dict(layers=6, hidden=256),
}
# Where the paper's shapes differ from the model_graphs defaults: DLRM as the paper describes
# it (each bag's embeddings concatenated, dense branches ending at 4096; interaction input
# 7 x 6400 + 7 x 4096 = 73,472 wide). ``model_graphs.dlrm()`` keeps the pooled form.
PAPER_SHAPES: dict[str, dict[str, Any]] = {"dlrm": dict(concat_bags=True, dense_out=4096)}
PRESETS = ("paper", "tiny")
MODEL_LABELS = {
  "mmt": "MMT",
  "dlrm": "DLRM",
  "candle_uno": "CANDLE-Uno",
  "gpt": "GPT",
  "chain": "chain",
}


# Planner names that stand for a planner with options: the sequential baselines as published
# (their own objective, no simulation ranking, no polish) beside their polished default.
PLANNER_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
  "pipedream-published": ("pipedream", {"selection": "published"}),
  "piper-published": ("piper", {"selection": "published"}),
}


def resolve_planner(name: str) -> tuple[str, dict[str, Any]]:
  """A planner name or variant -> (registered planner, options); ValueError for an unknown
  name, listing the choices."""
  if name in PLANNER_VARIANTS:
    base, options = PLANNER_VARIANTS[name]
    return base, dict(options)
  if name in PLANNERS:
    return name, {}
  raise ValueError(
    f"unknown planner {name!r}; choose one of {sorted(PLANNERS) + sorted(PLANNER_VARIANTS)}"
  )


def default_batch_size(model: str, num_devices: int) -> int:
  """The default mini-batch: ``PER_DEVICE_BATCH[model]`` samples per device."""
  return PER_DEVICE_BATCH.get(model, 8) * num_devices


def build_graph(model: str, preset: str = "paper", batch_size: int = 128, **shape) -> nx.DiGraph:
  """A synthetic LayerGraph of ``model`` at ``preset`` shapes (``shape`` overrides any)."""
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
  base = dict(TINY_SHAPES.get(model, {}) if preset == "tiny" else PAPER_SHAPES.get(model, {}))
  base.update(shape)
  return model_graphs.model_graph(model, batch_size=batch_size, **base)


def run_planner(
  name: str,
  graph: nx.DiGraph,
  cluster: Cluster,
  batch_size: int,
  *,
  keep_plan: bool = False,
  **options,
) -> dict[str, Any]:
  """Runs planner ``name`` (a registered planner or a ``PLANNER_VARIANTS`` name, which is the
  row's ``planner``) with ``options``, the planner's keyword arguments (``num_microbatches``,
  ``stages_per_device``, ``cost_model``, ...: ``passes.partition.Planner``), and returns one
  row.

  A plan gives ``throughput`` (samples/s), ``iteration_time`` (s), ``stages``, ``depth``,
  ``microbatch``, ``num_microbatches``, ``max_memory`` (bytes per device), ``memory_ok``,
  ``idle_devices``, ``schedule``, ``stages_per_device`` and ``seconds`` (search wall-clock);
  with ``keep_plan`` also
  ``plan`` (the Plan). A planner that cannot plan (PlanError, or a ValueError for options it
  rejects) gives ``error`` (its message) and ``seconds`` instead, so one failing planner does
  not stop a comparison.
  """
  base, fixed = resolve_planner(name)
  t0 = time.perf_counter()
  try:
    plan = PLANNERS[base](graph, cluster, batch_size, **{**fixed, **options})
  except (PlanError, ValueError) as e:
    return {"planner": name, "error": str(e), "seconds": time.perf_counter() - t0}
  seconds = time.perf_counter() - t0
  p = plan.predicted
  row = {
    "planner": name,
    "seconds": seconds,
    "throughput": p["throughput"],
    "iteration_time": p["iteration_time"],
    "stages": plan.num_stages,
    "depth": plan.depth(),
    "microbatch": plan.stages[0].microbatch_size,
    "num_microbatches": plan.num_microbatches,
    "max_memory": p["max_memory"],
    "memory_ok": p["memory_ok"],
    "idle_devices": len(p["idle_devices"]),
    "schedule": plan.schedule,
    "stages_per_device": plan.stages_per_device,
  }
  if keep_plan:
    row["plan"] = plan
  return row


def run_planners(
  names: Iterable[str], graph: nx.DiGraph, cluster: Cluster, batch_size: int, **kw
) -> list[dict[str, Any]]:
  """``run_planner`` for each name, in order."""
  return [run_planner(n, graph, cluster, batch_size, **kw) for n in names]


def short_error(row: Mapping[str, Any]) -> str:
  """The first clause of a failed row's message (the part that names the cause)."""
  return str(row.get("error", "")).split(";")[0]


def best_row(
  rows: Sequence[Mapping[str, Any]], planners: Iterable[str] = SEQUENTIAL_PLANNERS
) -> Mapping[str, Any] | None:
  """The row with the highest throughput among ``planners`` (None if none of them planned)."""
  names = set(planners)
  ok = [r for r in rows if r["planner"] in names and r.get("throughput")]
  return max(ok, key=lambda r: r["throughput"]) if ok else None
