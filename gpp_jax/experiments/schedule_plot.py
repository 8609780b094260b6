"""The schedule visualiser: a timeline (simulated or measured) -> a PNG, one row per stage.

Like ``torch.distributed.pipelining``'s schedule visualiser: every action is a box on its
stage's row, coloured by kind (F forward, B backward or input-gradient backward, W
weight-gradient backward, UPDATE) and labelled with its micro-batch; the title gives the
iteration time and the mean bubble. ``schedule_pngs`` draws one plan's timelines simulated
under several schedules, ``schedule_<name>.png`` per schedule (the training entry point
simulates them and writes them into its run folder, ``cli.reporting.write_schedule_pngs``).
This module only draws what it is given. matplotlib is optional (the ``plots`` extra):
without it nothing is drawn and a notice says how to install it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpp_jax.experiments.plotting import pyplot, save

if TYPE_CHECKING:
  from gpp_jax.cost.sim_result import SimResult

COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "UPDATE": "#8c8c8c", "STEP": "#4c72b0"}


def _spans(timeline: Any) -> list[tuple[str, int, int, float, float]]:
  """(kind, stage, micro-batch, start, end) of a SimResult's actions or a Timeline's events:
  the schedule's actions (a timeline also holds the program's transfers and other work)."""
  items: Iterable[Any] = getattr(timeline, "actions", None) or getattr(timeline, "events", [])
  out = []
  for a in items:
    kind = getattr(a, "kind", None) or a.action
    if kind in COLORS:
      out.append((kind, a.stage, a.microbatch, a.start, a.end))
  return out


def draw_schedule(timeline: Any, path: str, title: str = "") -> str | None:
  """Draws a SimResult (``cost.simulator``) or an executor's Timeline to ``path`` (PNG);
  returns the file name, or None without matplotlib."""
  plt = pyplot()
  if plt is None:
    return None
  spans = _spans(timeline)
  if not spans:
    raise ValueError("the timeline has no actions to draw")
  stages = max(s for _, s, _, _, _ in spans) + 1
  t_end = max(e for *_, e in spans)
  scale, unit = (1e3, "ms") if t_end < 10 else (1.0, "s")
  fig, ax = plt.subplots(figsize=(min(4 + 0.12 * len(spans) / stages * 4, 22), 0.5 * stages + 1.6))
  busy = [0.0] * stages
  for kind, s, m, start, end in spans:
    w = (end - start) * scale
    ax.barh(
      s,
      w,
      left=start * scale,
      height=0.8,
      color=COLORS.get(kind, "#cccccc"),
      edgecolor="white",
      linewidth=0.5,
    )
    if kind != "UPDATE":
      busy[s] += end - start
      if w > 0.025 * t_end * scale:
        ax.text(
          start * scale + w / 2, s, str(m), ha="center", va="center", fontsize=7, color="white"
        )
  bubble = sum(1 - b / t_end for b in busy) / stages if t_end > 0 else 0.0
  ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
  ax.invert_yaxis()
  ax.set_xlabel(f"time ({unit})")
  kinds = sorted({k for k, *_ in spans}, key=list(COLORS).index)
  handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
  ax.legend(handles, kinds, loc="upper right", fontsize=7, ncol=len(kinds))
  ax.set_title(
    f"{title + ': ' if title else ''}iteration {t_end * scale:.3g} {unit}, "
    f"mean bubble {bubble:.1%}",
    fontsize=9,
  )
  out_dir, name = os.path.split(path)
  return save(plt, fig, out_dir or ".", name)


def schedule_pngs(results: Mapping[str, SimResult], out_dir: str) -> list[str]:
  """Draws each simulated timeline of ``results`` (by schedule name: a plan simulated under
  each of several schedules) to ``out_dir/schedule_<name>.png``; returns the file names
  written (none without matplotlib)."""
  if pyplot() is None:
    return []
  written = []
  for name, res in results.items():
    got = draw_schedule(res, os.path.join(out_dir, f"schedule_{name}.png"), f"{name} (simulated)")
    if got:
      written.append(got)
  return written
