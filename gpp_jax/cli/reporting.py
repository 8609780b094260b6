"""What the entry points share: predicted timelines, the measured-vs-predicted step time
summary, and reading a metric that may live on another process."""

from __future__ import annotations

import os
import statistics
from typing import Any

import jax
import numpy as np

from gpp_jax.ir import layer_graph as lg


def predicted_timeline(pipeline, cluster):
  """The simulator's SimResult for a built ``GraphPipeline``: the program its executor runs,
  timed under the cost model."""
  from gpp_jax.passes.simulation import simulate

  graph = lg.scaled(pipeline.layer_graph, pipeline.batch_size)
  return simulate(
    pipeline.plan, graph, cluster, schedule=pipeline.schedule, program=pipeline.program
  )


def planned_peaks(pipeline, cluster) -> dict[str, float]:
  """Per device (by name), the peak bytes the planner's own memory model gives the plan (the
  simulator's stage memory under the cost model, summed over the stages a device runs; for a
  captured step what its program holds, ``cost_model.step_memory_terms``): the model plans
  are chosen and refused by, beside the program's prediction and the measurement
  (``benchmarks/memory_model.py`` compares them term by term)."""
  from gpp_jax.passes.simulation import simulate

  graph = lg.scaled(pipeline.layer_graph, pipeline.batch_size)
  res = simulate(pipeline.plan, graph, cluster, timeline=False)
  out: dict[str, float] = {}
  for s, place in enumerate(pipeline.compiled.staged.placements):
    for d in place.devices:
      out[str(d)] = out.get(str(d), 0.0) + float(res.stage_memory[s])
  return out


def write_predicted_timeline(pipeline, cluster, path: str):
  from gpp_jax.cost.simulator import write_chrome_trace

  result = predicted_timeline(pipeline, cluster)
  write_chrome_trace(result, path)
  return result


def write_schedule_pngs(pipeline, cluster, run_dir: str) -> list[str]:
  """``schedule_<name>.png`` for the plan under every schedule that applies to it (simulated)
  and ``schedule_measured.png`` for the last step's timeline, into ``run_dir``; nothing without
  matplotlib. One pass over the modules: the layer graph scaled to the plan's batch, the
  plan's schedules (``passes.schedules.plan_variants``), their times under the cost model
  (``cost.step_model.plan_times``), their simulation (``passes.simulation.simulate_times``),
  and the drawing (``experiments.schedule_plot``)."""
  from gpp_jax.cost.step_model import plan_times
  from gpp_jax.errors import ScheduleError
  from gpp_jax.experiments.schedule_plot import draw_schedule, schedule_pngs
  from gpp_jax.passes.schedules import plan_variants
  from gpp_jax.passes.simulation import simulate_times
  from gpp_jax.passes.weight_versions import weight_delays

  graph = lg.scaled(pipeline.layer_graph, pipeline.batch_size)
  variants = plan_variants(pipeline.plan)
  delays = {name: weight_delays(sched) for name, (_, sched) in variants.items()}
  times = {
    name: plan_times(plan, graph, cluster, sched, delays[name])
    for name, (plan, sched) in variants.items()
  }
  results = {}
  for name, t in times.items():
    try:
      results[name] = simulate_times(variants[name][1], t.stages, t.host)
    except ScheduleError:
      continue
  written = schedule_pngs(results, run_dir)
  tl = pipeline.timeline
  if written and tl is not None and any(e.action in ("F", "B", "W") for e in tl.events):
    what = "measured" if tl.measured else "host dispatch"
    got = draw_schedule(
      tl, os.path.join(run_dir, "schedule_measured.png"), f"{pipeline.schedule.name} ({what})"
    )
    written += [got] if got else []
  return written


def step_time_summary(
  pipeline, cluster, measured_ms: list[float], predicted=None
) -> dict[str, Any]:
  """The measured step time beside the one prediction the plan was chosen by.

  ``predicted_ms``: the time the plan was chosen by (``Planned.predicted_s``), and
  ``prediction`` where it comes from: ``"measured"`` (a timing trial of the chosen candidate)
  or ``"modelled"`` (the cost model's prediction; ``Planned.predicted_how``); ``model``: the
  cost model it was chosen with, ``"host-aware"`` (the host's measured costs, when the layers
  were calibrated) or ``"devices only"``; ``predicted_devices_ms``: the simulator's
  devices-only view (every device computes independently, the host costs nothing), kept for
  comparison; ``candidates_ms``: every candidate's time as compared (the pipeline, plain jit,
  jit data parallel, ...) and ``candidates_how`` the same names -> ``"measured"`` or
  ``"modelled"`` (``Planned.how``), ``chosen`` the name of the one that runs; ``timed_ms``:
  the candidates compiled and timed while choosing (seconds per call of the step).
  ``predicted``: the devices-only SimResult when the caller has it already
  (``write_predicted_timeline``).
  """
  planned = pipeline.compiled.planned
  devices_ms = (predicted or predicted_timeline(pipeline, cluster)).iteration_time * 1e3
  measured = statistics.median(measured_ms[1:] or measured_ms) if measured_ms else None
  one = planned.predicted_s * 1e3 if planned.predicted_s is not None else devices_ms
  return {
    # The first logged interval holds the warm-up of the first steps after compilation.
    "measured_ms": measured,
    "predicted_ms": one,
    "prediction": planned.predicted_how,
    "model": "host-aware" if planned.host is not None else "devices only",
    "prediction_error": (one - measured) / measured if measured else None,
    "predicted_devices_ms": devices_ms,
    "candidates_ms": {k: v * 1e3 for k, v in planned.alternatives.items()},
    "candidates_how": {k: planned.how.get(k, "modelled") for k in planned.alternatives},
    "chosen": planned.chosen,
    "timed_ms": {k: v * 1e3 for k, v in planned.measured.items()},
    "choice": planned.note or None,
    "cores": len(os.sched_getaffinity(0)),
  }


def format_summary(s: dict[str, Any]) -> str:
  """The summary as the lines the training program prints: the step time measured, the time
  the plan was chosen by and each candidate's, each labelled measured or modelled."""

  def ms(x):
    return "n/a" if x is None else f"{x:.1f} ms"

  err = s["prediction_error"]
  lines = [
    f"step time, measured:  {ms(s['measured_ms'])} (median over the logged intervals after "
    "the first)",
    f"predicted:            {ms(s['predicted_ms'])} ({s['prediction']}, {s['model']}: the "
    "time the plan was chosen by" + (f"; {err:+.0%} off" if err is not None else "") + ")",
  ]
  if s["model"] != "devices only":
    lines.append(
      f"devices only:         {ms(s['predicted_devices_ms'])} (every device computing "
      "independently, the host costing nothing)"
    )
  if s["candidates_ms"]:
    lines.append("candidates compared (time per step, where it comes from):")
    for name, t in s["candidates_ms"].items():
      runs = "  (runs)" if name == s["chosen"] else ""
      lines.append(f"  {name:28s} {ms(t):>10s}  {s['candidates_how'][name]}{runs}")
  return "\n".join(lines)


def fetch(x):
  """A scalar metric as a Python float, or None when it lives on another process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return None
  return float(np.asarray(jax.device_get(x)))
