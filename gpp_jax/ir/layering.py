"""Layering IR: each equation of the inlined loss assigned to a layer, each parameter to the
layer owning it, and the LayerGraph with costs (``passes.layering`` builds it)."""

from __future__ import annotations

import dataclasses

import networkx as nx


@dataclasses.dataclass(frozen=True)
class Layering:
  """Result of the layering pass.

  Attributes:
    eqn_layer: the layer of each equation of the (inlined) jaxpr.
    param_layer: for each jaxpr invar, the layer owning it if it is a parameter, else None.
    graph: the LayerGraph with costs (for the traced micro-batch size).
  """

  eqn_layer: tuple[str, ...]
  param_layer: tuple[str | None, ...]
  graph: nx.DiGraph
