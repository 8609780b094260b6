"""Partitioners (planners): LayerGraph (+ Cluster) -> Plan.

``PLANNERS`` maps a planner name to a function with the common signature
``planner(layer_graph, cluster, batch_size, *, num_microbatches=None, **options) -> Plan``.
"""
from gpp_jax.passes.partition.balanced import balanced_plan

PLANNERS = {"balanced": balanced_plan}


def get_planner(name: str):
  try:
    return PLANNERS[name]
  except KeyError:
    raise ValueError(f"unknown planner {name!r}; choose one of {sorted(PLANNERS)} "
                     "or pass a Plan") from None
