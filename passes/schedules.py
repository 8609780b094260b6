"""Schedule generation pass: stage graph + micro-batch count -> Schedule.

Generators:
  gpipe:  all forwards, then all backwards, then the update (GPipe, with a flush).
  1f1b:   synchronous 1F1B (PipeDream-Flush) generalised to a stage DAG. Stage s issues
          warmup(s) = min(L(s), M) forwards before its first backward, where L(s) is the length
          (in stages) of the longest path from s to a sink; then alternates one backward and
          one forward; then drains its backwards. For a chain of S stages, stage i (0-based)
          warms up with S - i forwards, the classic schedule.
  graph-1f1b: synchronous 1F1B on a stage DAG by list scheduling, backward as early as
          possible (see passes/inflight.py); the same as 1f1b on a chain.
  zero-bubble: backward split into B (input cotangents) and W (parameter gradients), W placed
          into the bubbles under a per-stage memory bound (see passes/zero_bubble.py).
  pipedream-async, pipedream-async-vsync, 2bw: 1F1B lanes with stale-weight training semantics
          (weight stashing, vertical sync, two weight versions; see passes/weight_versions.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import networkx as nx

from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.inflight import graph_1f1b
from gpp_jax.passes.zero_bubble import zero_bubble


def _graph(num_stages: int, edges: Sequence[tuple[int, int]]) -> nx.DiGraph:
  g = nx.DiGraph()
  g.add_nodes_from(range(num_stages))
  g.add_edges_from(edges)
  return g


def longest_path_to_sink(num_stages: int, edges: Sequence[tuple[int, int]]) -> list[int]:
  """L(s): number of stages on the longest path from s to a sink (sinks have L = 1)."""
  g = _graph(num_stages, edges)
  L = [1] * num_stages
  for s in reversed(list(nx.topological_sort(g))):
    L[s] = 1 + max((L[t] for t in g.successors(s)), default=0)
  return L


def gpipe(
  num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int, update: bool = True
) -> Schedule:
  """GPipe: F for every micro-batch, then B for every micro-batch, per stage."""
  M = num_microbatches
  lanes = []
  for s in range(num_stages):
    lane = [Action("F", s, m) for m in range(M)] + [Action("B", s, m) for m in range(M)]
    if update:
      lane.append(Action("UPDATE", s))
    lanes.append(tuple(lane))
  sched = Schedule("gpipe", M, tuple(sorted(edges)), tuple(lanes))
  validate_schedule(sched)
  return sched


def one_f_one_b(
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  warmup: Sequence[int] | None = None,
  update: bool = True,
) -> Schedule:
  """Synchronous 1F1B on a stage DAG; ``warmup[s]`` overrides the forwards before the first B."""
  M = num_microbatches
  L = longest_path_to_sink(num_stages, edges) if warmup is None else list(warmup)
  lanes = []
  for s in range(num_stages):
    w = max(1, min(L[s], M))
    lane = [Action("F", s, m) for m in range(w)]
    f, b = w, 0
    while b < M:
      lane.append(Action("B", s, b))
      b += 1
      if f < M:
        lane.append(Action("F", s, f))
        f += 1
    if update:
      lane.append(Action("UPDATE", s))
    lanes.append(tuple(lane))
  sched = Schedule("1f1b", M, tuple(sorted(edges)), tuple(lanes))
  validate_schedule(sched)
  return sched


def pipedream_async(
  num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int
) -> Schedule:
  """PipeDream's asynchronous 1F1B with weight stashing (passes/weight_versions.py): 1F1B
  lanes per step, each stage computing with weights ``L(s) - 1`` updates old."""
  sched = one_f_one_b(num_stages, edges, num_microbatches)
  return dataclasses.replace(sched, name="pipedream-async")


def pipedream_async_vsync(
  num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int
) -> Schedule:
  """PipeDream's asynchronous 1F1B with weight stashing and vertical sync."""
  sched = one_f_one_b(num_stages, edges, num_microbatches)
  return dataclasses.replace(sched, name="pipedream-async-vsync")


def two_bw(num_stages: int, edges: Sequence[tuple[int, int]], num_microbatches: int) -> Schedule:
  """PipeDream-2BW: double-buffered weights, gradients coalesced over a step's micro-batches."""
  sched = one_f_one_b(num_stages, edges, num_microbatches)
  return dataclasses.replace(sched, name="2bw")


GENERATORS: dict[str, Callable[..., Schedule]] = {
  "gpipe": gpipe,
  "1f1b": one_f_one_b,
  "graph-1f1b": graph_1f1b,
  "zero-bubble": zero_bubble,
  "pipedream-async": pipedream_async,
  "pipedream-async-vsync": pipedream_async_vsync,
  "2bw": two_bw,
}


def make_schedule(
  name: str,
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  memory_bound: Sequence[int] | None = None,
) -> Schedule:
  """Builds the named schedule; raises ValueError naming the known generators.

  ``memory_bound`` (zero-bubble only): per stage, the most micro-batches held at once.
  """
  try:
    gen = GENERATORS[name]
  except KeyError:
    raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(GENERATORS)}") from None
  if memory_bound is not None:
    if name != "zero-bubble":
      raise ValueError(f"memory_bound applies to the zero-bubble schedule only, not {name!r}")
    return gen(num_stages, edges, num_microbatches, memory_bound=memory_bound)
  return gen(num_stages, edges, num_microbatches)


def plan_schedule(plan) -> Schedule:
  """Plan -> the Schedule the simulator and the runtime execute for it.

  A zero-bubble plan whose stages all carry ``in_flight`` uses those counts as its memory
  bound (planners set them from device memory); otherwise the generator's default.
  """
  bound = None
  if plan.schedule == "zero-bubble" and all(s.in_flight for s in plan.stages):
    bound = tuple(int(s.in_flight) for s in plan.stages)
  return make_schedule(
    plan.schedule, plan.num_stages, tuple(plan.edges), plan.num_microbatches, memory_bound=bound
  )
