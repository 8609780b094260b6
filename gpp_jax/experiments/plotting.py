"""Matplotlib helpers of the reproduction's plots.

Importing pyplot (matplotlib is optional: the ``plots`` extra), the planners' labels and line
styles, the two kinds of axes the figures draw (one line per planner; grouped bars of ratios)
and saving a figure. The figure modules (``throughput``, ``branches``, ``microbatch``,
``ablation``) each draw their own plot with these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from gpp_jax.experiments.sweeps import ALL_PLANNERS

PLANNER_LABELS = {
  "graphpipe": "GraphPipe",
  "pipedream": "PipeDream",
  "piper": "Piper",
  "bapipe": "BaPipe",
  "luo": "Luo et al.",
}
PLANNER_STYLES = {"graphpipe": {"marker": "o", "linewidth": 2.2}}
DEFAULT_STYLE = {"marker": "."}


def pyplot() -> Any | None:
  """``matplotlib.pyplot`` on the Agg backend, or None (with a notice) without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: skipping plots (pip install 'gpp-jax[plots]')")
    return None
  return plt


def planner_lines(ax, rows: Sequence[Mapping[str, Any]], x_key: str) -> None:
  """One line per planner of samples/s (the planner's column of ``rows``) over ``x_key``, on a
  log2 x axis ticked at the rows' values; planners without a value in any row are left out."""
  for p in ALL_PLANNERS:
    pts = [(r[x_key], r[p]) for r in rows if r.get(p)]
    if pts:
      ax.plot(*zip(*pts), label=PLANNER_LABELS[p], **PLANNER_STYLES.get(p, DEFAULT_STYLE))
  ax.set_xscale("log", base=2)
  ax.set_xticks([r[x_key] for r in rows], [str(r[x_key]) for r in rows])
  ax.set_ylabel("samples/s")
  ax.grid(alpha=0.3)


def ratio_bars(
  ax, ticks: Sequence[str], series: Sequence[tuple[str, Sequence[float]]], width: float, ylabel: str
) -> None:
  """Grouped bars: one group per tick, one bar per (label, values) of ``series``, centred on
  the tick; a legend of the series' labels."""
  x = list(range(len(ticks)))
  for j, (label, values) in enumerate(series):
    off = (j - (len(series) - 1) / 2) * width
    ax.bar([i + off for i in x], values, width, label=label)
  ax.set_xticks(x, ticks)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)


def save(plt, fig, out_dir: str, name: str) -> str:
  """Lays out ``fig``, writes it to ``out_dir/name`` (110 dpi), closes it; returns ``name``."""
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=110)
  plt.close(fig)
  return name
