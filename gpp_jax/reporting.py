"""Small pieces the entry points share: cluster presets by name, predicted timelines, and
reading a metric that may live on another process."""
from __future__ import annotations

import jax
import numpy as np

from gpp_jax import layer_graph as lg


def make_cluster(name: str, num_devices: int, dtype: str = "float32"):
  """The planner's cluster description: ``cpu`` (forced CPU devices), ``cuda`` (H100 GPUs, at
  the peak of ``dtype``) or ``v100`` (the paper)."""
  from gpp_jax.cluster import cpu_cluster, cuda_cluster, v100_cluster
  presets = {"cpu": cpu_cluster, "v100": v100_cluster,
             "cuda": lambda n: cuda_cluster(n, dtype=dtype)}
  try:
    make = presets[name]
  except KeyError:
    raise ValueError(f"unknown cluster {name!r}; choose one of {sorted(presets)}") from None
  return make(num_devices)


def predicted_timeline(pipeline, cluster):
  """The simulator's SimResult for a built ``GraphPipeline``'s plan and schedule."""
  from gpp_jax.simulator import simulate
  c = pipeline._require()  # pylint: disable=protected-access
  graph = lg.scaled(pipeline.layer_graph, c.batch_size)
  return simulate(pipeline.plan, graph, cluster, schedule=pipeline.schedule)


def write_predicted_timeline(pipeline, cluster, path: str):
  from gpp_jax.simulator import write_chrome_trace
  result = predicted_timeline(pipeline, cluster)
  write_chrome_trace(result, path)
  return result


def fetch(x):
  """A scalar metric as a Python float, or None when it lives on another process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return None
  return float(np.asarray(jax.device_get(x)))
