"""FLOP-balanced chain planner: the simple default when no cost-model planner is wanted.

Linearises the LayerGraph in topological order and cuts it into contiguous pieces of nearly
equal forward FLOPs (at most one stage per device), one device per stage. Independent branches
are not run concurrently; use the graphpipe planner for that.
"""

from __future__ import annotations

import networkx as nx

from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan, Stage, stage_edges


def balanced_plan(
  layer_graph: nx.DiGraph,
  cluster=None,
  batch_size: int | None = None,
  *,
  num_microbatches: int | None = None,
  num_stages: int | None = None,
  schedule: str = "1f1b",
) -> Plan:
  """Cuts the topologically ordered layers into ``num_stages`` FLOP-balanced contiguous stages.

  Args:
    layer_graph: the LayerGraph.
    cluster: a Cluster or an int device count; the number of stages defaults to it.
    batch_size: mini-batch size (recorded in the plan).
    num_microbatches: micro-batches per step (default: number of stages).
    num_stages: stages to cut into (default: min(devices, layers)).
  """
  layers = topo_layers(layer_graph)
  ndev = (
    cluster if isinstance(cluster, int) else (len(cluster.devices) if cluster is not None else 1)
  )
  S = min(num_stages or ndev, len(layers))
  w = [max(layer_graph.nodes[l]["flops"], 1.0) for l in layers]
  # Minimise the largest stage with a linear-partition DP (exact for contiguous cuts).
  n = len(w)
  pre = [0.0]
  for x in w:
    pre.append(pre[-1] + x)
  INF = float("inf")
  best = [[INF] * (S + 1) for _ in range(n + 1)]
  cut = [[0] * (S + 1) for _ in range(n + 1)]
  best[0][0] = 0.0
  for i in range(1, n + 1):
    for k in range(1, min(i, S) + 1):
      for j in range(k - 1, i):
        v = max(best[j][k - 1], pre[i] - pre[j])
        if v < best[i][k]:
          best[i][k], cut[i][k] = v, j
  bounds, i = [], n
  for k in range(S, 0, -1):
    j = cut[i][k]
    bounds.append((j, i))
    i = j
  bounds.reverse()
  stages = tuple(
    Stage(index=k, layers=tuple(layers[a:b]), devices=(k,)) for k, (a, b) in enumerate(bounds)
  )
  where = {l: s.index for s in stages for l in s.layers}
  return Plan(
    stages=stages,
    edges=stage_edges(layer_graph, where),
    num_microbatches=num_microbatches or S,
    schedule=schedule,
    planner="balanced",
    batch_size=batch_size,
  )
