"""Schedules for stage DAGs whose stages share devices: interleaved 1F1B, looped BFS, ZB-V.

Several stages on one device ("virtual stages") shrink the pipeline bubble without more
micro-batches: Megatron-LM's interleaved schedule takes the bubble of a chain of p devices from
(p - 1)/m to (p - 1)/(v m) with v stages per device; the V-shaped zero-bubble schedule (ZB-V)
puts two stages on each device in a V and fills the rest of the bubble with weight gradients.
Here the stages form a DAG (branches, fan-in, skip edges), not only a chain, and a device may
hold any number of them (``Schedule.places``).

Each generator orders every place's actions by list scheduling: the places run their actions
in unit time steps (F 1, B 2, or B 1 and W 1 where the backward is split), and a place that is
free takes, of the actions whose inputs are done, the first by its schedule's rule:

  interleaved-1f1b: Megatron's depth-first order. Forwards go in groups of P micro-batches
      (P places) through the place's stages in topological order, backwards through them in
      reverse; a place first runs ``warm-up`` forwards (Megatron's count, (P - d - 1) * 2 +
      (v - 1) * P for a place with v stages whose first stage has depth d, P the places on
      the longest path of stages; P - d - 1 with one stage), then a
      forward whenever fewer than ``warm-up + 1`` micro-batches are in flight, else a
      backward: one of each in turn, as Megatron's steady state runs them.
  looped-bfs: breadth first, every forward before any backward on a place, its stages in
      topological order (forwards) and reverse (backwards), all micro-batches of one stage
      before the next (torch's ScheduleLoopedBFS).
  zb-v: the backward split into B (input cotangents) and W (weight gradients); a place runs a B
      whenever one is ready, a forward while fewer than 2P micro-batches hold activations
      (a forward's activations are held until its W), and a W when neither is ready.
      ``v_places`` puts 2P stages of a chain in the V that ZB-V names (device d holds stages d
      and 2P - 1 - d).

A place whose next action is held back only by its in-flight bound, while no place can run
anything else, runs it anyway: the orders are complete and free of deadlock by construction,
and ``validate_schedule`` checks them as it checks every schedule.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import networkx as nx

from gpp_jax.errors import ScheduleError
from gpp_jax.ir.schedule import Action, Schedule, dependencies, validate_schedule

SHARED_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zb-v")


def v_places(num_stages: int) -> tuple[int, ...]:
  """ZB-V's placement of a chain of 2P stages on P places: place d holds stages d and
  2P - 1 - d (an odd stage count leaves the middle stage a place of its own)."""
  half = (num_stages + 1) // 2
  return tuple(s if s < half else num_stages - 1 - s for s in range(num_stages))


def round_robin_places(num_stages: int, num_places: int) -> tuple[int, ...]:
  """Megatron's interleaved placement of a chain: stage s on place s mod P."""
  return tuple(s % num_places for s in range(num_stages))


def stage_depths(g: nx.DiGraph) -> dict[int, int]:
  """Each stage's depth: the stages on the longest path from a source to it, less one."""
  depth: dict[int, int] = {}
  for s in nx.topological_sort(g):
    depth[s] = max((depth[p] + 1 for p in g.predecessors(s)), default=0)
  return depth


def _shared_schedule(
  name: str,
  num_stages: int,
  edges: Sequence[tuple[int, int]],
  num_microbatches: int,
  places: Sequence[int] | None,
  counts: Sequence[int] | None = None,
) -> Schedule:
  S, M = num_stages, num_microbatches
  if counts is not None and len(set(counts)) > 1:
    raise ScheduleError(
      f"schedule {name!r} needs one micro-batch size for every stage, but the stages run "
      f"{list(counts)} micro-batches; give every stage the same micro-batch size"
    )
  places = tuple(places) if places is not None else tuple(range(S))
  if len(places) != S:
    raise ScheduleError(f"places {list(places)} must give one place to each of {S} stages")
  Q = max(places) + 1  # places
  g = nx.DiGraph()
  g.add_nodes_from(range(S))
  g.add_edges_from(edges)
  if not nx.is_directed_acyclic_graph(g):
    raise ScheduleError(f"stage graph has a cycle {nx.find_cycle(g)}")
  depth = stage_depths(g)
  members: list[list[int]] = [[] for _ in range(Q)]
  for s in sorted(range(S), key=lambda s: (depth[s], s)):
    members[places[s]].append(s)
  if any(not m for m in members):
    raise ScheduleError(f"places {list(places)} leave a place without stages; number them 0..")
  chunk = {s: members[places[s]].index(s) for s in range(S)}
  # The pipeline's length in places: the places on the longest path of stages (P on a chain
  # of P places; fewer where branches run side by side on places of their own). Megatron's
  # groups of micro-batches and warm-up count are in these.
  path = nx.dag_longest_path(g)
  P = max(1, len({places[s] for s in path}))
  rank = {q: min(depth[m[0]], P - 1) for q, m in enumerate(members)}  # where q joins the pipe
  split = name == "zb-v"
  dur = {"F": 1, "B": 1 if split else 2, "W": 1}
  bound = _bound(name, P, members, rank, M)
  prefer = _RULES[name](P, chunk)

  kinds = ("F", "B", "W") if split else ("F", "B")
  nxt = {(s, k): 0 for s in range(S) for k in kinds}  # each stage runs each kind in order
  done_at: dict[Action, int] = {}
  held = [0] * Q  # micro-batches holding activations on each place (F run, B or W not yet)
  orders: list[list[Action]] = [[] for _ in range(Q)]
  free = [0] * Q
  events: list[int] = [0]
  left = S * M * len(kinds)
  while left:
    t = heapq.heappop(events)
    while events and events[0] == t:
      heapq.heappop(events)
    for force in (False, True):
      picked = False
      for q in range(Q):
        if free[q] > t:
          continue
        ready = []
        for st in members[q]:
          for k in kinds:
            m = nxt[st, k]
            if m < M:
              a = Action(k, st, m)
              if all(done_at.get(d, t + 1) <= t for d in dependencies(a, g, split)):
                ready.append(a)
        pick = _choose(ready, prefer, held[q], bound[q], force)
        if pick is None:
          continue
        picked = True
        nxt[pick.stage, pick.kind] += 1
        orders[q].append(pick)
        left -= 1
        end = t + dur[pick.kind]
        done_at[pick] = end
        free[q] = end
        held[q] += 1 if pick.kind == "F" else -1 if pick.kind == kinds[-1] else 0
        heapq.heappush(events, end)
      if picked or any(f > t for f in free):
        break
    else:  # pragma: no cover - a DAG always has a ready action when nothing runs
      raise ScheduleError(f"schedule {name!r}: no place can run anything at time {t}")
  for q in range(Q):
    orders[q].extend(Action("UPDATE", s) for s in members[q])
  lanes = tuple(tuple(a for a in orders[places[s]] if a.stage == s) for s in range(S))
  sched = Schedule(
    name,
    M,
    tuple(sorted(edges)),
    lanes,
    places=places,
    orders=tuple(map(tuple, orders)),
  )
  validate_schedule(sched)
  return sched


def _bound(
  name: str, P: int, members: Sequence[Sequence[int]], rank: dict[int, int], M: int
) -> list[float]:
  """Per place, how many micro-batches may hold activations at once before its forwards wait
  for a backward (the schedule's memory bound)."""
  out: list[float] = []
  for q, stages in enumerate(members):
    v, d = len(stages), rank[q]
    if name == "interleaved-1f1b":
      warmup = (P - d - 1) * 2 + (v - 1) * P if v > 1 else P - d - 1
      out.append(min(warmup, M * v) + 1)
    elif name == "zb-v":
      out.append(2 * P)
    else:
      out.append(float("inf"))
  return out


def _interleaved_rule(P: int, chunk: dict[int, int]) -> Callable[[Action, int, float], tuple]:
  def key(a: Action, held: int, bound: float) -> tuple:
    # A forward while the bound lets one run (``_choose``), else a backward: the warm-up,
    # then one forward and one backward in turn, then the backwards left.
    group, c = a.microbatch // P, chunk[a.stage]
    if a.kind == "F":
      return (0, group, c, a.microbatch)
    return (1, group, -c, a.microbatch)

  return key


def _bfs_rule(P: int, chunk: dict[int, int]) -> Callable[[Action, int, float], tuple]:
  def key(a: Action, held: int, bound: float) -> tuple:
    c = chunk[a.stage]
    return (0, c, a.microbatch) if a.kind == "F" else (1, -c, a.microbatch)

  return key


def _zbv_rule(P: int, chunk: dict[int, int]) -> Callable[[Action, int, float], tuple]:
  order = {"B": 0, "F": 1, "W": 2}

  def key(a: Action, held: int, bound: float) -> tuple:
    c = chunk[a.stage]
    return (order[a.kind], a.microbatch, -c if a.kind != "F" else c)

  return key


_RULES = {
  "interleaved-1f1b": _interleaved_rule,
  "looped-bfs": _bfs_rule,
  "zb-v": _zbv_rule,
}


def _choose(
  ready: Sequence[Action], prefer: Callable, held: int, bound: float, force: bool
) -> Action | None:
  """The ready action the rule puts first, a forward only under the bound (or ``force``)."""
  allowed = [a for a in ready if a.kind != "F" or held < bound or force]
  if not allowed:
    return None
  return min(allowed, key=lambda a: prefer(a, held, bound))


def interleaved_1f1b(num_stages, edges, num_microbatches, places=None, counts=None) -> Schedule:
  """Megatron's interleaved 1F1B on a stage DAG whose stages share places (module docstring)."""
  return _shared_schedule("interleaved-1f1b", num_stages, edges, num_microbatches, places, counts)


def looped_bfs(num_stages, edges, num_microbatches, places=None, counts=None) -> Schedule:
  """Breadth-first looping over a place's stages (module docstring)."""
  return _shared_schedule("looped-bfs", num_stages, edges, num_microbatches, places, counts)


def zb_v(num_stages, edges, num_microbatches, places=None, counts=None) -> Schedule:
  """The V-shaped zero-bubble schedule on a stage DAG (module docstring); without places, the
  stages go in a V (``v_places``) where the stage graph is a chain."""
  if places is None:
    places = v_places(num_stages)
  return _shared_schedule("zb-v", num_stages, edges, num_microbatches, places, counts)
