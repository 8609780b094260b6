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
  from gpp_jax.cost.simulator import simulate

  graph = lg.scaled(pipeline.layer_graph, pipeline.batch_size)
  return simulate(
    pipeline.plan, graph, cluster, schedule=pipeline.schedule, program=pipeline.program
  )


def write_predicted_timeline(pipeline, cluster, path: str):
  from gpp_jax.cost.simulator import write_chrome_trace

  result = predicted_timeline(pipeline, cluster)
  write_chrome_trace(result, path)
  return result


def write_schedule_pngs(pipeline, cluster, run_dir: str) -> list[str]:
  """``schedule_<name>.png`` for the plan under every schedule (simulated) and
  ``schedule_measured.png`` for the last step's timeline, into ``run_dir``; nothing without
  matplotlib."""
  from gpp_jax.experiments.schedule_plot import draw_schedule, schedule_pngs

  graph = lg.scaled(pipeline.layer_graph, pipeline.batch_size)
  written = schedule_pngs(pipeline.plan, graph, cluster, run_dir)
  tl = pipeline.timeline
  if written and tl is not None and tl.events:
    what = "measured" if tl.measured else "host dispatch"
    got = draw_schedule(
      tl, os.path.join(run_dir, "schedule_measured.png"), f"{pipeline.schedule.name} ({what})"
    )
    written += [got] if got else []
  return written


def host_aware_time(pipeline, cluster, host_cost, outside: float, cores: int) -> float:
  """Seconds of one step as the simulator's host mode predicts it: one thread issues the
  instructions of the step's program in order, ``host_cost[op]`` seconds each, sharing
  ``cores`` cores with the computing (forced CPU) devices; plus ``outside`` seconds of host
  time the step spends outside the program."""
  from gpp_jax.cost.simulator import simulate

  graph = lg.scaled(pipeline.layer_graph, pipeline.batch_size)
  hosted = simulate(
    pipeline.plan,
    graph,
    cluster,
    schedule=pipeline.schedule,
    program=pipeline.program,
    host_cost=host_cost,
    cores=cores,
  ).iteration_time
  return hosted + outside


def host_costs(timeline) -> dict:
  """Median host seconds per op of a run's dispatch timeline (``measure`` off)."""
  from gpp_jax.ir.program import Op

  per: dict[str, list[float]] = {}
  for e in timeline.events:
    per.setdefault(e.action, []).append(e.end - e.start)
  return {Op(k): statistics.median(v) for k, v in per.items()}


def step_time_summary(
  pipeline, cluster, measured_ms: list[float], dispatch, predicted=None
) -> dict[str, Any]:
  """The measured step time beside the simulator's two predictions of it.

  ``devices``: every device computes independently and the host costs nothing (what planners
  optimise). ``host``: the driver's one thread issues the actions in dispatch order at the
  measured host cost per action, sharing the machine's cores with forced CPU devices, plus the
  host time the step spends outside the pipeline; ``dispatch`` is ``(host seconds of one step
  call, that step's Timeline)`` from a step run without ``measure``, or None. ``predicted``:
  the devices-only SimResult when the caller has it already (``write_predicted_timeline``).
  """
  out: dict[str, Any] = {
    # The first logged interval holds the warm-up of the first steps after compilation.
    "measured_ms": statistics.median(measured_ms[1:] or measured_ms) if measured_ms else None,
    "predicted_devices_ms": (predicted or predicted_timeline(pipeline, cluster)).iteration_time
    * 1e3,
    "predicted_host_ms": None,
    "host_us_per_action": None,
    "cores": len(os.sched_getaffinity(0)),
  }
  fused = (
    dispatch is not None
    and dispatch[1] is not None
    and any(e.action == "STEP" for e in dispatch[1].events)
  )
  # A fused step (one stage on one device) is one jitted call: no per-action dispatch to model.
  if dispatch is not None and dispatch[1] is not None and not dispatch[1].measured and not fused:
    t_host, tl = dispatch
    per_action = statistics.median(e.end - e.start for e in tl.events) if tl.events else 0.0
    outside = max(t_host - tl.total, 0.0)
    hosted = host_aware_time(pipeline, cluster, host_costs(tl), outside, out["cores"])
    out["predicted_host_ms"] = hosted * 1e3
    out["host_us_per_action"] = per_action * 1e6
  return out


def format_summary(s: dict[str, Any]) -> str:
  """The summary as the lines the training program prints."""

  def ms(x):
    return "n/a" if x is None else f"{x:.1f} ms"

  lines = [
    f"step time, measured:           {ms(s['measured_ms'])} (median over the logged "
    "intervals after the first)",
    f"predicted, devices only:       {ms(s['predicted_devices_ms'])} (the planner's view: "
    "devices compute independently, the host costs nothing)",
  ]
  if s["predicted_host_ms"] is not None:
    lines.append(
      f"predicted, with host dispatch: {ms(s['predicted_host_ms'])} (one driver thread at "
      f"{s['host_us_per_action']:.0f} us per action on {s['cores']} cores, plus the host "
      "time outside the pipeline)"
    )
  return "\n".join(lines)


def fetch(x):
  """A scalar metric as a Python float, or None when it lives on another process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return None
  return float(np.asarray(jax.device_get(x)))
