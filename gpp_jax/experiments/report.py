"""The reproduction's outputs: CSVs, markdown tables, plots and ``results.md``.

``write_csv`` and ``md_table`` (number formatting), ``write_plots`` (each figure module's plot),
``paper_comparison`` (the paper's reported figures beside ours, ours/paper),
``shared_devices_section`` (several stages per device: ``benchmarks/shared_devices.py``'s table)
and ``results_markdown`` (the whole report: the comparison, tables (a)-(e), several stages per
device, the real-training check, what limits the comparison).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpp_jax.experiments import plotting
from gpp_jax.experiments.ablation import plot_ablation
from gpp_jax.experiments.branches import plot_branches
from gpp_jax.experiments.microbatch import plot_microbatch
from gpp_jax.experiments.planner_runs import MODEL_LABELS, default_batch_size
from gpp_jax.experiments.sweeps import ALL_PLANNERS, PAPER_BASELINES, Sweep, progress_log
from gpp_jax.experiments.throughput import plot_throughput

Tables = Mapping[str, Sequence[Mapping[str, Any]]]

# ------------------------------------------------------------------------------ writing


def _cell(v) -> str:
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.6g}"
  return str(v)


def write_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], path: str) -> None:
  """Writes ``rows`` as CSV, one column per key of ``columns`` (missing values empty, floats
  to 6 significant digits)."""
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(columns)
    for r in rows:
      w.writerow([_cell(r.get(c)) for c in columns])


def md_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
  """A markdown table; ``columns`` are (key, header, format) with format "" for str(),
  a format spec for numbers; a missing value prints as "fail" for numeric columns."""
  lines = [
    "| " + " | ".join(h for _, h, _ in columns) + " |",
    "|" + "|".join("---" for _ in columns) + "|",
  ]
  for r in rows:
    cells = []
    for key, _, fmt in columns:
      v = r.get(key)
      if v is None or v == "":
        cells.append("fail" if fmt and fmt != "s" else "-")
      elif fmt and fmt != "s":
        cells.append(format(v, fmt))
      else:
        cells.append(str(v))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


# Each plotted table, in plotting order, and the function that draws it.
PLOTS = (
  ("throughput", plot_throughput),
  ("branches", plot_branches),
  ("microbatch", plot_microbatch),
  ("ablation", plot_ablation),
)


def write_plots(tables: Tables, out_dir: str) -> list[str]:
  """PNG plots of tables (a)-(d); returns the file names ([] without matplotlib)."""
  plt = plotting.pyplot()
  if plt is None:
    return []
  return [plot(plt, tables[name], out_dir) for name, plot in PLOTS if tables.get(name)]


# ------------------------------------------------------------------- paper comparison


def _span(values: Sequence[float | None]) -> tuple[float, float] | None:
  """(min, max) of the values that are set (None when none is)."""
  present = [v for v in values if v]
  return (min(present), max(present)) if present else None


def paper_comparison(tables: Tables, sweep: Sweep) -> list[dict[str, Any]]:
  """One row per figure the paper reports (GraphPipe, Jeon et al., ASPLOS 2025,
  arXiv:2406.17145: abstract, conclusion, §7 and App. A.2): the claim, the paper's figure,
  ours and ours/paper; ``paper`` is None where the figure is lost (an image whose values are
  not stated in the text)."""
  tp, st = tables.get("throughput") or [], tables.get("search_time") or []
  br, mb = tables.get("branches") or [], tables.get("microbatch") or []
  ab = tables.get("ablation") or []
  rows: list[dict[str, Any]] = []

  def add(claim: str, paper: str | None, ours: str, ratio: str | None, note: str = "") -> None:
    rows.append({"claim": claim, "paper": paper, "ours": ours, "ratio": ratio, "note": note})

  _headline_claims(add, tp)
  _ablation_claims(add, ab, sweep)
  _branch_claims(add, br)
  _microbatch_claims(add, mb, sweep)
  _search_claims(add, st, sweep)
  return rows


def _headline_claims(add: Callable[..., None], tp: Sequence[Mapping[str, Any]]) -> None:
  """``paper_comparison``'s rows for the end-to-end headline (the abstract, Fig. 6)."""
  # End-to-end headline (abstract, Fig. 6).
  vs_base = []
  for r in tp:
    base = [r[p] for p in PAPER_BASELINES if r.get(p)]
    if r.get("graphpipe") and base:
      vs_base.append((r["graphpipe"] / max(base), r))
  if vs_base:
    best, where = max(vs_base, key=lambda x: x[0])
    add(
      "Max throughput gain over PipeDream/Piper, any model and device count (abstract: up "
      "to 1.6x; conclusion 1.61x)",
      "1.61x",
      f"{best:.2f}x ({MODEL_LABELS[where['model']]}, {where['devices']} devices)",
      f"{best / 1.61:.2f}",
    )
  sp = [r["speedup"] for r in tp if r.get("speedup")]
  if sp:
    best_r = max((r for r in tp if r.get("speedup")), key=lambda r: r["speedup"])
    add(
      "Max throughput gain over the best of all four sequential planners",
      "1.61x (vs PipeDream/Piper only)",
      f"{best_r['speedup']:.2f}x ({MODEL_LABELS[best_r['model']]}, {best_r['devices']} devices)",
      f"{best_r['speedup'] / 1.61:.2f}",
      "BaPipe and Luo et al. are not baselines in the paper",
    )
    wins = sum(1 for x in sp if x > 1.0 + 1e-9)
    ties = sum(1 for x in sp if abs(x - 1.0) <= 1e-9)
    add(
      "Configurations where GraphPipe beats the sequential planners (Fig. 6: all but one)",
      "all but one",
      f"wins {wins}, ties {ties}, losses {len(sp) - wins - ties} of {len(sp)}",
      None,
      "per-configuration throughputs of Fig. 6 are lost (image)",
    )
  add(
    "Per-configuration throughput of Fig. 6 (samples/s per model and GPU count)",
    None,
    "table (a)",
    None,
    "lost: Fig. 6 was an image; only the claims above survive",
  )


def _ablation_claims(
  add: Callable[..., None], ab: Sequence[Mapping[str, Any]], sweep: Sweep
) -> None:
  """``paper_comparison``'s rows for the ablation (Fig. 9)."""
  # Ablation (Fig. 9).
  k = sweep.ablation_devices
  full = _span([r.get("full_speedup") for r in ab])
  par = _span([r.get("parallel_speedup") for r in ab])
  if full:
    add(
      f"Full GraphPipe / sequential at {k} devices, range over models (Fig. 9: 1.25-1.61x "
      "at 32 GPUs)",
      "1.25-1.61x",
      _fmt_span(full),
      f"{full[0] / 1.25:.2f} / {full[1] / 1.61:.2f}",
      "ratio: low ends / high ends",
    )
  if par:
    add(
      f"'Parallel' (GraphPipe stages at the sequential micro-batch) / sequential at {k} "
      "devices (Fig. 9: 1.12-1.40x)",
      "1.12-1.40x",
      _fmt_span(par),
      f"{par[0] / 1.12:.2f} / {par[1] / 1.40:.2f}",
      "ratio: low ends / high ends",
    )


def _branch_claims(add: Callable[..., None], br: Sequence[Mapping[str, Any]]) -> None:
  """``paper_comparison``'s rows for the branch sweep (Fig. 7 left)."""
  # Branch sweep (Fig. 7 left).
  if br:
    top = max(br, key=lambda r: r["branches"])
    gain = top.get("speedup_vs_pipedream")
    add(
      f"CANDLE-Uno at {top['branches']} branches, GraphPipe / PipeDream (Fig. 7 left: up to "
      "2x at 16 branches, 4-16 GPUs)",
      "2x",
      "-" if gain is None else f"{gain:.2f}x ({top['devices']} devices)",
      None if gain is None else f"{gain / 2.0:.2f}",
      f"the paper's per-branch bars are lost; it swept 4/8/16 GPUs, we use {top['devices']}",
    )
    grows = all(
      a.get("speedup_vs_pipedream") is not None
      and b.get("speedup_vs_pipedream") is not None
      and b["speedup_vs_pipedream"] >= a["speedup_vs_pipedream"] - 1e-9
      for a, b in itertools.pairwise(br)
    )
    add(
      "Gain grows with the number of branches (Fig. 7 left)",
      "yes",
      "yes"
      if grows
      else "no: "
      + ", ".join(f"{r['branches']}: {_fmt_x(r.get('speedup_vs_pipedream'))}" for r in br),
      None,
    )


def _microbatch_claims(
  add: Callable[..., None], mb: Sequence[Mapping[str, Any]], sweep: Sweep
) -> None:
  """``paper_comparison``'s rows for the micro-batch sweep (Fig. 7 right)."""
  # Micro-batch sweep (Fig. 7 right).
  if mb:
    ok = [r for r in mb if r.get("speedup")]
    wins = sum(1 for r in ok if r["speedup"] > 1.0 + 1e-9)
    add(
      f"{MODEL_LABELS.get(sweep.microbatch_model)} at {sweep.microbatch_devices} devices, "
      "GraphPipe above the sequential planners at every fixed micro-batch size (Fig. 7 right)",
      "every size",
      f"{wins} of {len(ok)} sizes with a plan on both sides"
      + (f" (gain {_fmt_span(_span([r['speedup'] for r in ok]))})" if ok else ""),
      None,
      "bar heights lost (image)",
    )


def _search_claims(add: Callable[..., None], st: Sequence[Mapping[str, Any]], sweep: Sweep) -> None:
  """``paper_comparison``'s rows for the search time (Table 1)."""
  # Search time (Table 1).
  pd = _span([r.get("pipedream_over_graphpipe") for r in st])
  gp_max = max((r["graphpipe_s"] for r in st if r.get("graphpipe_s") is not None), default=None)
  if pd:
    add(
      "Search time of PipeDream / GraphPipe (Table 1: GraphPipe 9-21x faster than PipeDream "
      "and Piper)",
      "9-21x",
      _fmt_span(pd),
      f"{pd[0] / 9:.3f} / {pd[1] / 21:.3f}",
      (
        "below 1x = our GraphPipe searched slower (one min-max DP over the SP tree per "
        "micro-batch size plus the simulation and polish of its candidates, vs a few numpy "
        "operations per layer and no simulation for PipeDream); "
        if pd[0] < 1
        else ""
      )
      + "Table 1's seconds are lost",
    )
  piper_ok = [r for r in st if r.get("piper_over_graphpipe")]
  piper_failed = sorted(
    {
      _label(r["model"])
      for r in st
      if r["model"] in sweep.models and "piper" in (r.get("failed") or "").split()
    }
  )
  add(
    "Piper: no strategy for DLRM and CANDLE-Uno, strategies for MMT (Fig. 6, Table 1)",
    "fails on DLRM, CANDLE-Uno",
    ("fails on " + ", ".join(piper_failed)) if piper_failed else "plans every model",
    None,
    "our Piper stops at the authors' limit of 40,000 downsets (IDEALS_LIMIT), as theirs "
    "does; MMT has about 10^4"
    if piper_failed
    else "",
  )
  if piper_ok:
    sp_ = _span([r["piper_over_graphpipe"] for r in piper_ok])
    assert sp_ is not None  # every row of piper_ok has a ratio
    add(
      "Search time of Piper / GraphPipe where our Piper plans ("
      + ", ".join(_label(r["model"]) + f" x{r['devices']}" for r in piper_ok)
      + ")",
      "9-21x",
      _fmt_span(sp_),
      f"{sp_[0] / 9:.2f} / {sp_[1] / 21:.2f}",
      "Piper's cost grows with the downsets, l^b for b branches of l layers",
    )
  if gp_max is not None:
    add(
      "GraphPipe search time per configuration (Table 1: under 1 minute on an M1 Max)",
      "< 60 s",
      f"max {gp_max:.1f} s",
      f"{gp_max / 60:.2f}",
      "ratio: our max / 60 s; shared 2-core machine",
    )
  add(
    "Search seconds per model and GPU count (Table 1)",
    None,
    "table (e)",
    None,
    "lost: Table 1 was an image",
  )
  add(
    "Mini-batch sizes per GPU count (App. A.2 table)",
    None,
    ", ".join(f"{MODEL_LABELS[m]} {default_batch_size(m, 1)}/device" for m in sweep.models),
    None,
    "lost: we scale the mini-batch with the device count",
  )


def _fmt_span(s: tuple[float, float] | None) -> str:
  return (
    "-" if s is None else (f"{s[0]:.2f}x" if abs(s[0] - s[1]) < 5e-3 else f"{s[0]:.2f}-{s[1]:.2f}x")
  )


def _label(model: str) -> str:
  """Display name: "candle_uno:branches=4" -> "CANDLE-Uno, 4 branches"."""
  name, _, branches = model.partition(":branches=")
  label = MODEL_LABELS.get(name, name)
  return f"{label}, {branches} branches" if branches else label


def _fmt_x(v) -> str:
  return "fail" if v is None else f"{v:.2f}x"


# ------------------------------------------------------------------------------ results.md

# Columns of md_table that several tables of results.md share.
_GP_SHAPE_COLUMNS = (("gp_shape", "GP S/D", "s"), ("graphpipe_microbatch", "GP mb", "d"))
_SPEEDUP_COLUMN = ("speedup", "GP / best seq", ".3f")


def _vs_best_sequential_columns(key: str, header: str) -> list[tuple[str, str, str]]:
  """The best sequential planner, its ``key`` column and GraphPipe / best sequential."""
  return [("best_sequential_planner", "best seq", "s"), (key, header, "d"), _SPEEDUP_COLUMN]


def _display(
  rows: Sequence[Mapping[str, Any]], *, model: bool = True, gp_shape: bool = False
) -> list[dict[str, Any]]:
  """Rows for a markdown table: ``model`` as its display name (``_label``) and, with
  ``gp_shape``, GraphPipe's stages/depth as ``gp_shape`` ("-" without a plan)."""
  out = []
  for r in rows:
    d = dict(r)
    if model:
      d["model"] = _label(r["model"])
    if gp_shape:
      d["gp_shape"] = (
        f"{r['graphpipe_stages']}/{r['graphpipe_depth']}" if r.get("graphpipe_stages") else "-"
      )
    out.append(d)
  return out


def _model_table(
  rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]], gp_shape: bool = False
) -> str:
  """``md_table`` of a per-model table: the model's display name first, then ``columns``."""
  return md_table(_display(rows, gp_shape=gp_shape), [("model", "model", "s"), *columns])


def _planner_cols(fmt=".1f"):
  names = {
    "graphpipe": "GraphPipe",
    "pipedream": "PipeDream",
    "piper": "Piper",
    "bapipe": "BaPipe",
    "luo": "Luo",
  }
  return [(p, names[p], fmt) for p in ALL_PLANNERS]


def _section(title: str, intro: str, table: str, *, after: str = "", image: str = "") -> list[str]:
  """The lines of one section of ``results.md``: heading, intro paragraph, table, an optional
  closing paragraph and an optional image line (``_plot``)."""
  out = [title, "", intro, "", table, ""]
  if after:
    out += [after, ""]
  if image:
    out += [image, ""]
  return out


def _plot(alt: str, file: str, plots: Sequence[str]) -> str:
  """The markdown image of plot ``file`` with ``alt`` text, "" when that plot was not written
  (it is not among ``plots``)."""
  return f"![{alt}]({file})" if file in plots else ""


# The several-stages-per-device benchmark, beside the package in the repository.
SHARED_DEVICES_BENCHMARK = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "benchmarks",
  "shared_devices.py",
)


def shared_devices_section(
  sweep: Sweep, progress: Callable[[str], None] | None = progress_log
) -> str:
  """Section (g): GraphPipe with two (and the better of two and four) stages per device against
  one, and against PipeDream's chain with as many, on the multi-branch models at 16-64 devices
  and 2-8 micro-batches: the table of ``benchmarks/shared_devices.py`` (its ``rows`` and
  ``markdown``, imported from the repository). A sweep of fewer than 16 devices (``QUICK``)
  gets MMT at 16 devices and 2 and 4 micro-batches; "" where the benchmark is not beside the
  package (an installed copy) or the preset is not the paper's."""
  if sweep.preset != "paper" or not os.path.exists(SHARED_DEVICES_BENCHMARK):
    return ""
  spec = importlib.util.spec_from_file_location(
    "shared_devices_benchmark", SHARED_DEVICES_BENCHMARK
  )
  assert spec is not None and spec.loader is not None
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  full = max(sweep.devices) >= 16
  config = (
    dict(models=bench.MODELS, devices=bench.DEVICES, microbatches=bench.MICROBATCHES)
    if full
    else dict(models=("mmt",), devices=(16,), microbatches=(2, 4))
  )

  def log(r: dict[str, Any]) -> None:
    if progress is not None:
      progress(
        f"[shared devices] {r['model']} {r['devices']} devices, {r['microbatches']} "
        f"micro-batches: v=2 {r['gain_v2']:.3f}x v=1, {r['chain_v2']:.3f}x the chain"
      )

  table = bench.rows(**config, progress=log)
  command = "python benchmarks/shared_devices.py" + (
    "" if full else " --models=mmt --devices=16 --microbatches=2,4"
  )
  return "\n".join(
    [
      "## (g) Several stages per device (interleaving) on the multi-branch models",
      "",
      "Predicted iteration times (ms) on the V100 preset at the paper's shapes: GraphPipe with "
      "one stage per device, with two, and with the better of two and four (its plan cut and "
      "interleaved, its plan for v times as many micro-batches cut the same way, or its plan "
      "for a virtual cluster of v x N devices folded, whichever is faster; interleaved 1F1B), "
      "against PipeDream's chain with as many stages per device. Few micro-batches per "
      "device count: the pipeline bubble's regime.",
      "",
      bench.markdown(table, command).rstrip("\n"),
      "",
    ]
  )


# ``results.md``'s closing section.
_RESULTS_LIMITS = [
  "## What limits the comparison",
  "",
  "- Simulation, not measurement: a roofline cost model with a fitted efficiency curve "
  "and affine links stands in for FlexFlow on Summit; absolute samples/s are not "
  "comparable, ratios between planners priced by the same model are.",
  "- The baselines are our re-implementations (PipeDream and Piper from their "
  "papers' and code's DPs, BaPipe and Luo et al. from abstracts only); the paper ran "
  "the authors' PipeDream and Piper planners on FlexFlow. GraphPipe, PipeDream and "
  "Piper all end with the same local search against the simulator "
  "(`passes/partition/refine.py`), so the chain baselines of tables (a)-(e) are stronger "
  "than the published planners and the gains are those of the stage DAG alone; section "
  "(f), when present, puts PipeDream and Piper as published beside them.",
  "- Lost figures: every plotted value and Table 1's seconds; the mini-batch sizes per "
  "GPU count (we use a fixed number of samples per device).",
  "- Piper: the authors' limit of 40,000 downsets; it plans MMT (10,003 downsets) and stops "
  "on DLRM and CANDLE-Uno, as in the paper.",
  "- Model shapes follow App. A.2 (MMT 4 branches, DLRM 7+7, CANDLE-Uno 7); the paper "
  "itself gives other branch counts in §7.2.",
  "",
]


@dataclasses.dataclass(frozen=True)
class Provenance:
  """How a ``results.md`` was made: the command line (""; the reproduction's module) and the
  minutes it took (``elapsed`` seconds; None: not stated)."""

  command: str = ""
  elapsed: float | None = None


def results_markdown(
  tables: Tables,
  sweep: Sweep,
  plots: Sequence[str] = (),
  provenance: Provenance = Provenance(),
  extra: str = "",
) -> str:
  """``results.md``: the paper comparison, then tables (a)-(e) (with the ``plots`` written),
  ``extra`` (markdown written by another benchmark, e.g. ``benchmarks/planners.py``'s section
  (f)), section (g) (several stages per device, ``shared_devices_section``: planned here, for
  the paper's preset) and the real-training check; ``provenance`` heads it."""
  out = _results_header(tables, sweep, provenance)
  out += _planner_sections(tables, sweep, plots)
  out += _loss_check_section(tables)
  if extra:
    out += [extra.rstrip("\n"), ""]
  section = shared_devices_section(sweep)
  if section:
    out += [section.rstrip("\n"), ""]
  out += _RESULTS_LIMITS
  return "\n".join(out)


def _results_header(tables: Tables, sweep: Sweep, provenance: Provenance) -> list[str]:
  """``results.md``'s opening: what its numbers are, the paper, and the comparison with it."""
  command, elapsed = provenance.command, provenance.elapsed
  out = [
    "# GraphPipe reproduction: simulated results beside the paper's",
    "",
    f"Generated by `{command or 'python -m gpp_jax.experiments.reproduce'}`"
    + (f" in {elapsed / 60:.1f} min" if elapsed else "")
    + ". Every throughput below is a "
    "**prediction**: the planners plan on the V100 preset (4 V100 16 GB per node, NVLink "
    "inside a node, 100 Gb/s InfiniBand between nodes; `gpp_jax.cost.cluster.v100_cluster`) "
    "for the synthetic LayerGraphs at "
    + (
      "the paper's shapes (`gpp_jax.experiments.model_graphs`)"
      if sweep.preset == "paper"
      else f"the `{sweep.preset}` preset (the paper's topologies at small widths, "
      "`gpp_jax.experiments.planner_runs`)"
    )
    + ", and the simulator times the plan's schedule with "
    "the cost model. Nothing ran on a GPU. The "
    "paper's numbers were measured on Summit (FlexFlow runtime). Search times are wall-clock "
    "seconds on a shared 2-core machine.",
    "",
    'The paper: "GraphPipe: Improving Performance and Scalability of DNN Training with '
    'Graph Pipeline Parallelism", Jeon et al., ASPLOS 2025 (arXiv:2406.17145): the abstract '
    "and conclusion (headline gain), the evaluation in §7 (Fig. 6, 7 and 9, Table 1) and "
    "App. A.2 (model shapes). The values of Fig. 6, 7 and 9, Table 1's seconds and the "
    "mini-batch table of App. A.2 are images in the text compared against here and could not "
    "be read as numbers: such figures are marked *lost*, and only what the paper states in "
    "its text is compared, with no ratio where it states no number.",
    "",
    "## Ours vs the paper",
    "",
  ]
  comp = paper_comparison(tables, sweep)
  out.append(
    md_table(
      [{**r, "paper": r["paper"] or "lost", "ratio": r["ratio"] or "-"} for r in comp],
      [
        ("claim", "claim", "s"),
        ("paper", "paper", "s"),
        ("ours", "ours", "s"),
        ("ratio", "ours / paper", "s"),
        ("note", "note", "s"),
      ],
    )
  )
  out += [
    "",
    "Reading the ratios: 1.00 means we reproduce the paper's figure; for the search "
    "time, a ratio below 1 means our GraphPipe's search is relatively slower than the "
    "paper's.",
    "",
  ]

  return out


def _planner_sections(tables: Tables, sweep: Sweep, plots: Sequence[str]) -> list[str]:
  """``results.md``'s tables (a)-(e): throughput, the branch and micro-batch sweeps, the
  ablation and the search times, each where the tables have it."""
  k_ab = sweep.ablation_devices
  out: list[str] = []
  tp = tables.get("throughput") or []
  if tp:
    out += _section(
      "## (a) Throughput vs device count (Fig. 6)",
      "Simulated samples/s; `fail` = the planner gave no plan (Piper's state limit). "
      "Mini-batch = "
      + ", ".join(f"{MODEL_LABELS[m]} {default_batch_size(m, 1)}" for m in sweep.models)
      + " samples per device. "
      "S/D = stages / depth, mb = micro-batch size.",
      _model_table(
        tp,
        [
          ("devices", "devices", "d"),
          ("batch", "batch", "d"),
          *_planner_cols(),
          *_GP_SHAPE_COLUMNS,
          *_vs_best_sequential_columns("best_sequential_microbatch", "seq mb"),
        ],
        gp_shape=True,
      ),
      image=_plot("throughput vs devices", "throughput.png", plots),
    )

  br = tables.get("branches") or []
  if br:
    out += _section(
      f"## (b) Branch sweep: CANDLE-Uno at {br[0]['devices']} devices (Fig. 7 left)",
      f"Mini-batch {br[0]['batch']}. The paper normalises to PipeDream.",
      md_table(
        _display(br, model=False, gp_shape=True),
        [
          ("branches", "branches", "d"),
          ("graphpipe", "GraphPipe", ".1f"),
          *_GP_SHAPE_COLUMNS,
          ("pipedream", "PipeDream", ".1f"),
          ("pipedream_stages", "PD stages", "d"),
          ("best_sequential", "best seq", ".1f"),
          ("best_sequential_planner", "by", "s"),
          ("speedup_vs_pipedream", "GP / PipeDream", ".3f"),
          _SPEEDUP_COLUMN,
        ],
      ),
      image=_plot("branch sweep", "branches.png", plots),
    )

  mb = tables.get("microbatch") or []
  if mb:
    out += _section(
      f"## (c) Micro-batch sweep: {MODEL_LABELS.get(sweep.microbatch_model)} on "
      f"{sweep.microbatch_devices} devices, mini-batch {sweep.microbatch_batch} "
      "(Fig. 7 right)",
      "Every planner is held to one micro-batch size per row (`num_microbatches` fixed); "
      "`fail` = no plan fits memory (or Piper's state limit).",
      md_table(
        mb,
        [
          ("microbatch", "micro-batch", "d"),
          ("num_microbatches", "M", "d"),
          *_planner_cols(),
          ("graphpipe_depth", "GP depth", "d"),
          *_vs_best_sequential_columns("best_sequential_depth", "seq depth"),
        ],
      ),
      image=_plot("micro-batch sweep", "microbatch.png", plots),
    )

  ab = tables.get("ablation") or []
  if ab:
    out += _section(
      f"## (d) Ablation at {k_ab} devices (Fig. 9)",
      "`sequential` = the best sequential plan of table (a); `parallel` = GraphPipe "
      "forced to that plan's micro-batch size (the stage-graph effect alone); `full` = "
      "GraphPipe with its own micro-batch choice. Throughput in samples/s.",
      _model_table(
        ab,
        [
          ("sequential", "sequential", ".1f"),
          ("sequential_planner", "by", "s"),
          ("sequential_microbatch", "mb", "d"),
          ("parallel", "parallel", ".1f"),
          ("parallel_depth", "depth", "d"),
          ("full", "full", ".1f"),
          ("full_microbatch", "mb", "d"),
          ("full_depth", "depth", "d"),
          ("parallel_speedup", "parallel / seq", ".3f"),
          ("full_speedup", "full / seq", ".3f"),
        ],
      ),
      after="Paper (Fig. 9, 32 GPUs): parallel 1.12-1.40x, full 1.25-1.61x over the "
      "sequential baseline; per-model bars lost.",
      image=_plot("ablation", "ablation.png", plots),
    )

  st = tables.get("search_time") or []
  if st:
    out += _section(
      "## (e) Search time (Table 1)",
      "Wall-clock seconds per planner (a failed planner's entry is the time it took to "
      "give up; it is listed under `failed`). Paper: GraphPipe 9-21x faster than "
      "PipeDream and Piper, under a minute everywhere (seconds lost). The rows after "
      "the three models are the branch sweep's configurations (b).",
      _model_table(
        st,
        [
          ("devices", "devices", "d"),
          *[(f"{p}_s", f"{h} s", ".2f") for p, h, _ in _planner_cols()],
          ("failed", "failed", "s"),
          ("pipedream_over_graphpipe", "PD / GP", ".3f"),
          ("piper_over_graphpipe", "Piper / GP", ".3f"),
        ],
      ),
    )
  return out


def _loss_check_section(tables: Tables) -> list[str]:
  """``results.md``'s real-training check (pipelined against one device), where run."""
  out: list[str] = []
  lc = tables.get("loss_check") or []
  if lc:
    out += _section(
      "## Real training: pipelined vs one device",
      "`python -m gpp_jax.experiments.loss_curves` with 8 forced CPU devices "
      "(`XLA_FLAGS=--xla_force_host_platform_device_count=8`): each tiny zoo model "
      "trains with the GraphPipe plan on 8 devices and, from the same initial state, "
      "undecorated on one device (AdamW, global-norm clipping, batch 32, 8 "
      "micro-batches), in float32 and in float64 (`--dtype=float64`). `max diff` = the "
      "largest |pipelined - one device| loss over the run. In float32 the two runs "
      "differ by rounding (~1e-7); when that rounding puts a ReLU pre-activation on the "
      "other side of zero, the unit's gradient switches on or off in one run only and "
      "the curves separate from that step on. In float64 the same runs agree to "
      "rounding for the whole run.",
      _model_table(
        lc,
        [
          ("dtype", "dtype", "s"),
          ("steps", "steps", "d"),
          ("stages", "stages", "d"),
          ("depth", "depth", "d"),
          ("loss_first", "loss at step 1", ".4f"),
          ("loss_last", f"loss at step {lc[0]['steps']}", ".4f"),
          ("max_diff", "max diff", ".2e"),
          ("max_rel_diff", "max rel. diff", ".2e"),
          ("first_step_over_1e-5", "first step > 1e-5", "s"),
          ("error", "error", "s"),
        ],
      ),
      after="`first step > 1e-5`: `-` when the curves never differ by more than 1e-5.",
    )
  return out
